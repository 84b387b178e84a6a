"""Serving workloads: when requests arrive and how long their prompts and outputs are, seeded.

    spec = WorkloadSpec(arrivals="bursty", rate=8.0, amplitude=0.4, period_s=10.0, requests=480,
                        prompt_len=parse_lengths("128..1024"), output_len=parse_lengths("256"), seed=0)
    wl = generate(spec, vocab_size=32000)
    save(wl, "runs/w.jsonl"); assert load("runs/w.jsonl") == wl

Arrival processes (`WorkloadSpec.arrivals`):
- `poisson`: exponential gaps at `rate` requests/s; `rate=inf` puts every request at time 0.
- `bursty`: a Poisson process whose rate follows `rate * (1 + amplitude * sin(2 pi t / period_s))`
  (drawn by thinning), so its mean rate is `rate` and it swings +-amplitude around it.
- `closed`: `users` concurrent users, each sending its next request when its previous one finishes;
  the requests carry no arrival time (the driver stamps them).

Lengths (`Lengths`): `fixed` (one value), `uniform` (integers lo..hi inclusive) or `corpus` (drawn
with replacement from a text corpus's document lengths). The same seed gives the same workload, and a
saved workload holds every request (arrival, prompt token ids, output length), so replaying the file
does not depend on this generator.
"""

import gzip
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from decoders.base import UsageError

ARRIVALS = ("poisson", "bursty", "closed")


@dataclass(frozen=True)
class Lengths:
    """A length distribution: kind "fixed" (values = (n,)), "uniform" (values = (lo, hi)) or
    "corpus" (values = the document lengths, source = the corpus file)."""

    kind: str
    values: tuple[int, ...]
    source: str | None = None

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "uniform":
            return rng.randint(self.values[0], self.values[1])
        return rng.choice(self.values)

    @property
    def max(self) -> int:
        return max(self.values)

    def describe(self) -> dict:
        """What a record says about it (a corpus by its file and size, not its every length)."""
        if self.kind == "corpus":
            return {"kind": "corpus", "source": self.source, "documents": len(self.values), "mean": sum(self.values) / len(self.values), "max": self.max}
        return {"kind": self.kind, "values": list(self.values)}

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.values[0])
        if self.kind == "uniform":
            return f"{self.values[0]}..{self.values[1]}"
        return f"corpus:{self.source}"


def corpus_documents(path: Path):
    """Documents of a text file (separated by empty lines; `.gz` read as gzip) or of JSON lines
    (`.jsonl`, one document per line in a "text" field)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if ".jsonl" in path.suffixes:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise UsageError(f"{path}:{number}: not a JSON object with a \"text\" field") from None
            return
        paragraphs = []
        for line in f:
            if line.strip():
                paragraphs.append(line.rstrip("\n"))
            elif paragraphs:
                yield "\n".join(paragraphs)
                paragraphs = []
        if paragraphs:
            yield "\n".join(paragraphs)


def corpus_lengths(path, count_tokens=None) -> tuple[int, ...]:
    """Every document's length in tokens (`count_tokens(text)`; whitespace-separated words when None)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"corpus {str(path)!r} is not a file")
    count = count_tokens or (lambda text: len(text.split()))
    lengths = tuple(n for n in (count(doc) for doc in corpus_documents(path)) if n > 0)
    if not lengths:
        raise UsageError(f"corpus {str(path)!r} holds no document")
    return lengths


def parse_lengths(text: str, name: str = "length", count_tokens=None) -> Lengths:
    """'256' (fixed), '128..1024' (uniform, inclusive) or 'corpus:FILE' (its document lengths)."""
    text = text.strip()
    if text.startswith("corpus:"):
        source = text.removeprefix("corpus:")
        return Lengths("corpus", corpus_lengths(source, count_tokens), source)
    if m := re.fullmatch(r"(\d+)\s*\.\.\s*(\d+)", text):
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo < 1 or lo > hi:
            raise UsageError(f"--{name} {text!r}: a range needs 1 <= lo <= hi")
        return Lengths("uniform", (lo, hi))
    if re.fullmatch(r"\d+", text) and int(text) >= 1:
        return Lengths("fixed", (int(text),))
    raise UsageError(f"--{name} {text!r}: expected a length (256), a range (128..1024) or corpus:FILE")


@dataclass(frozen=True)
class WorkloadSpec:
    """How a workload is drawn. `rate` (requests/s, may be inf) for poisson / bursty, `users` for
    closed; `requests` is how many requests the workload holds."""

    arrivals: str
    requests: int
    prompt_len: Lengths
    output_len: Lengths
    rate: float | None = None
    users: int | None = None
    amplitude: float = 0.0
    period_s: float = 10.0
    seed: int = 0

    def __post_init__(self):
        if self.arrivals not in ARRIVALS:
            raise UsageError(f"unknown arrival process {self.arrivals!r} (known: {', '.join(ARRIVALS)})")
        if self.requests < 1:
            raise UsageError(f"a workload needs at least 1 request, got {self.requests}")
        if self.arrivals == "closed":
            if self.users is None or self.users < 1:
                raise UsageError(f"a closed loop needs users >= 1, got {self.users}")
        elif self.rate is None or not self.rate > 0:
            raise UsageError(f"the arrival rate must be > 0 requests/s, got {self.rate}")
        if self.arrivals == "bursty":
            if not 0 <= self.amplitude < 1:
                raise UsageError(f"the burst amplitude must be in [0, 1), got {self.amplitude}")
            if not self.period_s > 0:
                raise UsageError(f"the burst period must be > 0 s, got {self.period_s}")
            if math.isinf(self.rate):
                raise UsageError("a bursty workload needs a finite rate")

    def describe(self) -> dict:
        # An infinite rate is written "inf": JSON has no infinity.
        rate = "inf" if self.rate is not None and math.isinf(self.rate) else self.rate
        return {"arrivals": self.arrivals, "requests": self.requests, "rate": rate, "users": self.users,
                "amplitude": self.amplitude if self.arrivals == "bursty" else None,
                "period_s": self.period_s if self.arrivals == "bursty" else None, "seed": self.seed,
                "prompt_len": self.prompt_len.describe(), "output_len": self.output_len.describe()}


@dataclass
class WorkItem:
    """One request of a workload: its arrival (seconds from the start; None in a closed loop), its
    prompt's token ids and how many tokens it asks for."""

    index: int
    arrival_s: float | None
    prompt: list[int]
    max_new_tokens: int


@dataclass
class Workload:
    spec: dict  # WorkloadSpec.describe() of what drew it (kept in the saved file and in every record)
    vocab_size: int
    items: list[WorkItem] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        return self.spec["arrivals"] == "closed"

    @property
    def users(self) -> int | None:
        return self.spec["users"]


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """n arrival times of a Poisson process at `rate`/s; all at 0 when the rate is infinite."""
    if math.isinf(rate):
        return [0.0] * n
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def bursty_arrivals(rate: float, amplitude: float, period_s: float, n: int, rng: random.Random) -> list[float]:
    """n arrivals of the Poisson process with rate(t) = rate * (1 + amplitude * sin(2 pi t / period_s)):
    candidates at the peak rate, each kept with probability rate(t) / peak (thinning)."""
    peak = rate * (1 + amplitude)
    t, times = 0.0, []
    while len(times) < n:
        t += rng.expovariate(peak)
        if rng.random() * peak <= rate * (1 + amplitude * math.sin(2 * math.pi * t / period_s)):
            times.append(t)
    return times


def check_lengths(prompt_len: Lengths, output_len: Lengths, max_context: int | None) -> None:
    """A UsageError when the lengths cannot fit the context (corpus prompts are cut to fit instead)."""
    if max_context is None:
        return
    if output_len.max >= max_context:
        raise UsageError(f"outputs of up to {output_len.max} tokens leave no prompt in a context of {max_context}")
    if prompt_len.kind != "corpus" and prompt_len.max + output_len.max > max_context:
        raise UsageError(f"prompts of up to {prompt_len.max} and outputs of up to {output_len.max} tokens exceed the context of {max_context}")


def generate(spec: WorkloadSpec, vocab_size: int, max_context: int | None = None) -> Workload:
    """The workload `spec` describes, with prompt tokens drawn uniformly from [0, vocab_size).

    Arrivals, lengths and tokens come from three generators seeded from `spec.seed`, so changing the
    length distribution leaves the arrival times as they were. With `max_context`, a prompt drawn
    longer than the context leaves for its output is cut to fit (corpus lengths can be long).
    """
    if vocab_size < 1:
        raise UsageError(f"vocabulary size must be >= 1, got {vocab_size}")
    check_lengths(spec.prompt_len, spec.output_len, max_context)
    arrival_rng, length_rng, token_rng = (random.Random(f"{spec.seed}:{part}") for part in ("arrivals", "lengths", "tokens"))
    n = spec.requests
    if spec.arrivals == "poisson":
        arrivals = poisson_arrivals(spec.rate, n, arrival_rng)
    elif spec.arrivals == "bursty":
        arrivals = bursty_arrivals(spec.rate, spec.amplitude, spec.period_s, n, arrival_rng)
    else:
        arrivals = [None] * n
    items = []
    for i, arrival in enumerate(arrivals):
        prompt_len, output_len = spec.prompt_len.draw(length_rng), spec.output_len.draw(length_rng)
        if max_context is not None:
            prompt_len = min(prompt_len, max_context - output_len)
        prompt = token_rng.choices(range(vocab_size), k=prompt_len)
        items.append(WorkItem(i, arrival, prompt, output_len))
    return Workload(spec.describe(), vocab_size, items)


def save(workload: Workload, path) -> None:
    """One JSON line with the spec and vocabulary size, then one line per request."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"workload": workload.spec, "vocab_size": workload.vocab_size, "requests": len(workload.items)}) + "\n")
        for item in workload.items:
            f.write(json.dumps(vars(item)) + "\n")


def load(path) -> Workload:
    """A workload written by `save`; a file that is not one is a UsageError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"workload {str(path)!r} is not a file")
    try:
        with path.open() as f:
            head = json.loads(f.readline())
            workload = Workload(head["workload"], head["vocab_size"])
            for line in f:
                if line.strip():
                    workload.items.append(WorkItem(**json.loads(line)))
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise UsageError(f"{path}: not a workload file (written by decoders.workload.save)") from None
    if len(workload.items) != head["requests"]:
        raise UsageError(f"{path}: holds {len(workload.items)} requests, its header says {head['requests']}")
    return workload
