"""`python -m decoders.serve_bench`: the request-level serving benchmark (arrival rate against latency).

    python -m decoders.serve_bench --models llama-1b,mamba2-1.3b,rwkv7-1.5b --rate 1,4,16,inf --duration 60
    python -m decoders.serve_bench --models llama-8b --rate 2,4,8 --arrivals poisson,bursty --slo ttft=500ms,itl=50ms
    python -m decoders.serve_bench --models llama-1b --users 1,16,64 --prompt-len 128..1024 --output-len 256
    python -m decoders.serve_bench --models llama-1b --rate 4 --target http://127.0.0.1:8000

A workload (`decoders.workload`: Poisson, bursty or closed-loop arrivals; fixed, uniform or corpus
lengths; seeded) is fed in real time either to the engine in-process (`drive_engine`: a request
becomes visible to the engine at its arrival time, the driver steps the engine and timestamps every
output with `time.perf_counter()`) or to an OpenAI-compatible server (`drive_http`: `/v1/completions`
with `stream: true` and token-id prompts, each server-sent event timestamped). `summarize` turns the
per-request timestamps into the figures: request and token throughput, TTFT, inter-token and
end-to-end latency percentiles, queueing delay, goodput under the SLO, cost per 1,000 output tokens
and energy per output token.

Each finished (model, load) point is appended to `--out` as one JSON object with the provenance of
`decoders.compare` (git sha, device, versions, the exact command) and the path of the saved workload
(`--workload FILE` replays it). The table is printed at the end and the last stdout line is one short
JSON document. Bad input is one line on stderr and exit code 2; Ctrl-C keeps the finished points.
"""

import argparse
import asyncio
import hashlib
import importlib.util
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoders import workload as wl
from decoders import cli
from decoders.base import UsageError
from decoders.compare import parse_ints
from decoders.harness import percentile
from declab_kernels import compile_log, gemv

# Assumed price of one H200 GPU-hour in US dollars: a round figure within the on-demand list prices
# of cloud providers for a single H200 in 2025-2026 (roughly 3 to 10 dollars); pass your own.
DEFAULT_GPU_HOUR_PRICE = 4.0
SLO_KEYS = ("ttft", "itl", "e2e")
WARMUP_OUTPUT_TOKENS = 8
# Seconds of the first point's own workload the warm-up replays (`warm_up`).
DEFAULT_WARMUP_S = 5.0
# The warm-up burst's prompts are short: a burst of full-length prompts may not fit in the cache.
WARMUP_PROMPT_TOKENS = 16


class ArgError(UsageError):
    """A command-line value the CLI refuses."""


@dataclass
class Trace:
    """What one request did, in seconds from the start of its point's run."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_new_tokens: int
    first_token_s: float | None = None
    # (time, tokens) of every output that carried tokens
    token_times: list[tuple[float, int]] = field(default_factory=list)
    finish_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def add_tokens(self, t: float, n: int) -> None:
        if n > 0:
            if self.first_token_s is None:
                self.first_token_s = t
            self.token_times.append((t, n))
            self.output_tokens += n

    @property
    def ok(self) -> bool:
        return self.finish_s is not None and self.error is None and self.first_token_s is not None

    def gaps(self) -> list[float]:
        """Inter-token latencies: each output's time since the previous output, shared evenly by the
        tokens it carried (a Mask-Predict pass can commit several)."""
        gaps = []
        for (t0, _), (t1, n) in zip(self.token_times, self.token_times[1:]):
            gaps.extend([(t1 - t0) / n] * n)
        return gaps


def parse_rates(text: str) -> list[float]:
    """'1,4,16,inf' -> [1.0, 4.0, 16.0, inf] (requests/s, each > 0)."""
    rates = []
    for part in (t.strip() for t in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ArgError(f"--rate {part!r} is not a number of requests/s (or inf)") from None
        if math.isnan(rate) or rate <= 0:
            raise ArgError(f"--rate must be > 0 requests/s, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ArgError(f"--rate {text!r} names no rate")
    return rates


def parse_seconds(text: str, key: str) -> float:
    """'500ms', '0.5s' or '500' (milliseconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s)?\s*", text)
    if not m:
        raise ArgError(f"--slo {key}={text!r}: expected a time such as 500ms or 0.5s")
    value = float(m.group(1))
    return value if m.group(2) == "s" else value / 1e3


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,itl=50ms' -> {'ttft': 0.5, 'itl': 0.05} (seconds); keys ttft, itl, e2e."""
    if text is None:
        return {}
    slo = {}
    for part in (t.strip() for t in text.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in SLO_KEYS:
            raise ArgError(f"--slo {part!r}: expected KEY=TIME with KEY one of {', '.join(SLO_KEYS)} (e.g. ttft=500ms,itl=50ms)")
        seconds = parse_seconds(value, key)
        if seconds <= 0:
            raise ArgError(f"--slo {key} must be > 0, got {value!r}")
        slo[key] = seconds
    if not slo:
        raise ArgError(f"--slo {text!r} sets no objective")
    return slo


def engine_request(item: wl.WorkItem):
    """The engine's request for a work item: greedy, no stop token, so it runs to max_new_tokens."""
    from decoders.engine import Request

    return Request(prompt=item.prompt, max_new_tokens=item.max_new_tokens, stop_token_ids=())


def drive_engine(engine, workload: wl.Workload, *, duration_s: float | None = None, on_finish=None,
                 make_request=engine_request, clock=time.perf_counter, sleep=time.sleep) -> list[Trace]:
    """Run `workload` through `engine` in real time; one Trace per request issued.

    Open loop: a request is added once the clock passes its arrival (checked between engine steps,
    so a busy engine sees it at its next step and the wait counts in its TTFT); an idle engine sleeps
    until the next arrival. Closed loop: `users` requests start at 0 and each finish issues the next,
    until the workload is spent or `duration_s` has passed. Outputs are stamped when `step()`
    returns them; `on_finish(trace)` is called as each request finishes.
    """
    t0 = clock()
    traces, active = [], {}

    def issue(item: wl.WorkItem, arrival: float) -> None:
        trace = Trace(item.index, arrival, len(item.prompt), item.max_new_tokens)
        traces.append(trace)
        active[engine.add_request(make_request(item))] = trace

    items = deque(workload.items if workload.closed else sorted(workload.items, key=lambda item: item.arrival_s))
    if workload.closed:
        for _ in range(min(workload.users, len(items))):
            issue(items.popleft(), 0.0)
    while True:
        if not workload.closed:
            now = clock() - t0
            while items and items[0].arrival_s <= now:
                item = items.popleft()
                issue(item, item.arrival_s)
        if not engine.has_unfinished():
            if workload.closed or not items:
                break
            sleep(max(0.0, items[0].arrival_s - (clock() - t0)))
            continue
        outs = engine.step()
        now = clock() - t0
        for out in outs:
            trace = active[out.request_id]
            trace.add_tokens(now, len(out.new_tokens))
            if out.finished:
                trace.finish_s, trace.finish_reason = now, out.finish_reason
                del active[out.request_id]
                if on_finish:
                    on_finish(trace)
                if workload.closed and items and (duration_s is None or now < duration_s):
                    issue(items.popleft(), now)
    return traces


def completion_body(item: wl.WorkItem, model: str | None) -> dict:
    body = {"prompt": item.prompt, "max_tokens": item.max_new_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    return body


def event_tokens(choice: dict) -> int:
    """Tokens one streamed choice carries: its `token_ids` when the server sends them; else one,
    unless it is a closing event with no text."""
    if "token_ids" in choice:
        return len(choice["token_ids"] or ())
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return 1 if text or choice.get("finish_reason") is None else 0


async def send_request(session, url: str, item: wl.WorkItem, trace: Trace, model: str | None, t0: float) -> None:
    """POST one streamed completion and stamp each server-sent event that carries tokens
    (`event_tokens`); a `usage` (completion_tokens) sets the request's token count, an `error` event
    fails the request."""
    import aiohttp

    try:
        async with session.post(url, json=completion_body(item, model)) as response:
            if response.status != 200:
                body = (await response.text()).strip().replace("\n", " ")
                trace.error = f"HTTP {response.status}: {body[:200]}"
                trace.finish_s = time.perf_counter() - t0
                return
            async for raw in response.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                now = time.perf_counter() - t0
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]
                    trace.error = f"server error: {error.get('message', error) if isinstance(error, dict) else error}"
                    break
                for choice in event.get("choices") or []:
                    trace.add_tokens(now, event_tokens(choice))
                    trace.finish_reason = choice.get("finish_reason") or trace.finish_reason
                if usage := event.get("usage"):
                    trace.output_tokens = usage.get("completion_tokens", trace.output_tokens)
            trace.finish_s = time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        trace.error = f"{type(e).__name__}: {e}"
        trace.finish_s = time.perf_counter() - t0


async def drive_http_async(base_url: str, workload: wl.Workload, *, model: str | None = None, duration_s: float | None = None,
                           on_finish=None, timeout_s: float = 600.0) -> list[Trace]:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    traces = []
    # A request may stream for as long as the load makes it; only a silent connection times out.
    timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s)
    # No cap on connections: an open loop must not queue requests in the client.
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(item: wl.WorkItem, arrival: float) -> None:
            trace = Trace(item.index, arrival, len(item.prompt), item.max_new_tokens)
            traces.append(trace)
            await send_request(session, url, item, trace, model, t0)
            if on_finish:
                on_finish(trace)

        if workload.closed:
            items = deque(workload.items)

            async def user() -> None:
                while items and (duration_s is None or time.perf_counter() - t0 < duration_s):
                    await one(items.popleft(), time.perf_counter() - t0)

            await asyncio.gather(*(user() for _ in range(min(workload.users, len(items)))))
        else:
            tasks = []
            for item in sorted(workload.items, key=lambda item: item.arrival_s):
                wait = item.arrival_s - (time.perf_counter() - t0)
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(item, item.arrival_s)))
            await asyncio.gather(*tasks)
    return traces


def drive_http(base_url: str, workload: wl.Workload, *, model: str | None = None, duration_s: float | None = None,
               on_finish=None, timeout_s: float = 600.0) -> list[Trace]:
    """Send `workload` to an OpenAI-compatible server at `base_url` (e.g. http://127.0.0.1:8000) in
    real time, as `drive_engine` does to the engine in-process; one Trace per request sent. A request
    whose connection stays silent for `timeout_s` seconds fails."""
    return asyncio.run(drive_http_async(base_url, workload, model=model, duration_s=duration_s, on_finish=on_finish, timeout_s=timeout_s))


def nvml_handle(device: torch.device, uuid: str | None):
    """(pynvml, the device's NVML handle), or None when pynvml is missing or NVML refuses the device."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid is not None else pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except pynvml.NVMLError:
        return None


class PowerMeter:
    """The GPU's energy over a run: NVML's energy counter (or its power readings every 50 ms) when
    pynvml imports, else `nvidia-smi` power readings every 100 ms; on a CPU, or without either, none.
    `energy_j` is None (and `reason` says why) when there are no readings."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self.reason, self.source = device, [], None, None
        self.nvml = self.handle = self.process = self.thread = None
        self.start_mj = self.end_mj = None
        self.t_start = self.t_end = None
        if device.type != "cuda":
            self.reason = "no GPU: no power readings"
            return
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        # By UUID, which NVML and nvidia-smi share whatever CUDA_VISIBLE_DEVICES renumbers.
        self.gpu_id = str(device.index or 0) if uuid is None else str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
        nvml = nvml_handle(device, self.gpu_id if uuid is not None else None)
        if nvml is not None:
            (self.nvml, self.handle), self.source = nvml, "nvml"
        elif shutil.which("nvidia-smi"):
            self.source = "nvidia-smi"
        else:
            self.reason = "neither pynvml nor nvidia-smi available: no power readings"

    def __enter__(self):
        self.t_start = time.perf_counter()
        if self.source == "nvml":
            try:
                self.start_mj = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
            except self.nvml.NVMLError:
                # No energy counter on this GPU (before Volta): the power readings are integrated.
                self.start_mj = None
            self.stop_event = threading.Event()
            self.thread = threading.Thread(target=self.poll_nvml, daemon=True)
            self.thread.start()
        elif self.source == "nvidia-smi":
            self.process = subprocess.Popen(["nvidia-smi", "-i", self.gpu_id, "--query-gpu=power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self.read_smi, daemon=True)
            self.thread.start()
        return self

    def poll_nvml(self) -> None:
        while not self.stop_event.wait(0.05):
            self.samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3))

    def read_smi(self) -> None:
        for line in self.process.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip())))
            except ValueError:
                continue

    def __exit__(self, *exc):
        self.t_end = time.perf_counter()
        if self.source == "nvml":
            self.stop_event.set()
            self.thread.join()
            if self.start_mj is not None:
                self.end_mj = self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        elif self.source == "nvidia-smi":
            self.process.terminate()
            self.process.wait()
            self.thread.join()
        return False

    @property
    def energy_j(self) -> float | None:
        if self.end_mj is not None:
            return (self.end_mj - self.start_mj) / 1e3
        if len(self.samples) < 2:
            if self.source and self.reason is None:
                self.reason = f"{self.source} gave fewer than two power readings"
            return None
        times, watts = zip(*self.samples)
        # Trapezoids between readings, the first and last reading held to the run's ends.
        energy = sum((t1 - t0) * (w0 + w1) / 2 for t0, t1, w0, w1 in zip(times, times[1:], watts, watts[1:]))
        return energy + (times[0] - self.t_start) * watts[0] + (self.t_end - times[-1]) * watts[-1]

    def describe(self) -> dict:
        energy = self.energy_j
        seconds = self.t_end - self.t_start
        return {"energy_j": energy, "power_w_mean": energy / seconds if energy is not None and seconds > 0 else None,
                "power_source": self.source if energy is not None else None, "power_note": self.reason}


def idle_ttft_line(samples: list[tuple[int, float]]):
    """TTFT of a prompt on an idle engine as a function of its length: the line through the
    (prompt tokens, TTFT) samples of requests run alone (a constant when their lengths are one)."""
    lengths = {n for n, _ in samples}
    if len(lengths) < 2:
        value = statistics.fmean(t for _, t in samples)
        return lambda n: value
    xs, ys = zip(*samples)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return lambda n: my + slope * (n - mx)


def ms(values: list[float], q: float) -> float | None:
    return percentile(values, q) * 1e3 if values else None


def summarize(traces: list[Trace], *, slo: dict[str, float] | None = None, gpu_hour_price: float = DEFAULT_GPU_HOUR_PRICE,
              energy_j: float | None = None, idle_ttft=None) -> dict:
    """The point's figures from its requests' timestamps (seconds).

    The span runs from the first arrival to the last finish; throughputs are over it. TTFT is first
    token minus arrival, ITL every gap between tokens (pooled over requests), E2E finish minus
    arrival. Queueing delay is TTFT minus `idle_ttft(prompt tokens)` (the TTFT that prompt gets on an
    idle engine), at least 0; None without `idle_ttft`. A request meets the SLO when its TTFT, its
    mean inter-token latency and its E2E are within the objectives set; goodput is such requests per
    second, and `slo_p99_met` says whether the pooled p99 of each objective's figure is within it.
    Cost: the span's share of `gpu_hour_price` per 1,000 output tokens.
    """
    slo = slo or {}
    done = [t for t in traces if t.ok]
    span = max((t.finish_s for t in done), default=0.0) - min((t.arrival_s for t in traces), default=0.0)
    ttft = [t.first_token_s - t.arrival_s for t in done]
    gaps = [g for t in done for g in t.gaps()]
    e2e = [t.finish_s - t.arrival_s for t in done]
    output_tokens = sum(t.output_tokens for t in done)
    prompt_tokens = sum(t.prompt_tokens for t in done)
    record = {
        "requests": len(traces),
        "finished": len(done),
        "failed": sum(1 for t in traces if t.error is not None),
        "errors": sorted({t.error for t in traces if t.error})[:3],
        "span_s": span,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_per_s": len(done) / span if span > 0 else None,
        "output_tok_s": output_tokens / span if span > 0 else None,
        "total_tok_s": (prompt_tokens + output_tokens) / span if span > 0 else None,
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90), "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(gaps, 50), "itl_ms_p99": ms(gaps, 99),
        "e2e_ms_p50": ms(e2e, 50), "e2e_ms_p99": ms(e2e, 99),
        "queue_ms_mean": None, "queue_ms_std": None,
    }
    if idle_ttft is not None and done:
        queue = [max(0.0, t.first_token_s - t.arrival_s - idle_ttft(t.prompt_tokens)) for t in done]
        record["queue_ms_mean"] = statistics.fmean(queue) * 1e3
        record["queue_ms_std"] = statistics.pstdev(queue) * 1e3
    if slo:
        def meets(t: Trace) -> bool:
            gaps_t = t.gaps()
            return (t.first_token_s - t.arrival_s <= slo.get("ttft", math.inf)
                    and (not gaps_t or statistics.fmean(gaps_t) <= slo.get("itl", math.inf))
                    and t.finish_s - t.arrival_s <= slo.get("e2e", math.inf))

        good = sum(1 for t in done if meets(t))
        pooled = {"ttft": ttft, "itl": gaps, "e2e": e2e}
        record.update(slo={k: v * 1e3 for k, v in slo.items()}, slo_met=good, slo_violations=len(traces) - good,
                      goodput_request_per_s=good / span if span > 0 else None,
                      slo_p99_met=bool(done) and len(done) == len(traces) and all(not pooled[k] or percentile(pooled[k], 99) <= v for k, v in slo.items()))
    cost_per_s = gpu_hour_price / 3600
    record["gpu_hour_price"] = gpu_hour_price
    record["cost_per_1k_output_tokens"] = cost_per_s * span / output_tokens * 1e3 if output_tokens else None
    record["energy_j"] = energy_j
    record["energy_j_per_output_token"] = energy_j / output_tokens if energy_j is not None and output_tokens else None
    return record


def idle_samples(run, workload: wl.Workload, vocab_size: int) -> list[tuple[int, float]]:
    """(prompt tokens, TTFT) of the workload's shortest and longest prompt, each run alone twice
    (the second run kept: the first may compile kernels for that length)."""
    by_length = sorted(workload.items, key=lambda item: len(item.prompt))
    samples = []
    for item in {len(item.prompt): item for item in (by_length[0], by_length[-1])}.values():
        alone = wl.Workload({"arrivals": "closed", "users": 1}, vocab_size, [wl.WorkItem(i, None, item.prompt, WARMUP_OUTPUT_TOKENS) for i in range(2)])
        trace = run(alone)[-1]
        if trace.ok:
            samples.append((trace.prompt_tokens, trace.first_token_s - trace.arrival_s))
    return samples


def prefill_ladder(workload: wl.Workload, vocab_size: int) -> wl.Workload:
    """One request at a time, prompts of 1..8 tokens and then every power of two up to the workload's
    longest prompt (and that length), 2 output tokens each: a prefill step of each of these token
    counts compiles what a step of about that many tokens compiles (the projections' row tiles at
    1..8 rows, where each row count has its own GEMV pick; the attention's query tiles), which a
    stream of arrivals otherwise first meets inside a timed point."""
    longest = max(workload.items, key=lambda item: len(item.prompt)).prompt
    lengths = list(range(1, min(8, len(longest)) + 1))
    while lengths[-1] < len(longest):
        lengths.append(min(2 * lengths[-1], len(longest)))
    return wl.Workload({"arrivals": "closed", "users": 1}, vocab_size,
                       [wl.WorkItem(i, None, longest[:n], 2) for i, n in enumerate(lengths)])


def warm_up(run, workload: wl.Workload, vocab_size: int, burst: int, replay_s: float = 0.0):
    """Compile and capture before timing, then take the idle TTFT samples. The warm-up burst is
    `burst` short requests at once, the i-th asking for WARMUP_OUTPUT_TOKENS + i tokens, so that the
    running batch shrinks through every size from `burst` to 1 (a size's first step may compile or
    capture a graph). Then the prompt lengths of `prefill_ladder`, one at a time. Then the first
    `replay_s` seconds of the workload itself run (`replay_head`):
    the prompt chunks a stream of arrivals cuts beside the decoding rows (a chunk's length, the
    prefix it continues) are shapes the burst never makes, and their first compilation otherwise
    lands in the first point's TTFT tail. Returns (the idle TTFT samples, seconds spent)."""
    t0 = time.perf_counter()
    prompt = min(workload.items, key=lambda item: len(item.prompt)).prompt[:WARMUP_PROMPT_TOKENS]
    run(wl.Workload({"arrivals": "closed", "users": burst}, vocab_size,
                    [wl.WorkItem(i, None, prompt, WARMUP_OUTPUT_TOKENS + i) for i in range(burst)]))
    run(prefill_ladder(workload, vocab_size))
    if replay_s > 0:
        head, duration = replay_head(workload, replay_s, burst)
        run(head, duration_s=duration)
    samples = idle_samples(run, workload, vocab_size)
    return samples, time.perf_counter() - t0


def replay_head(workload: wl.Workload, seconds: float, burst: int) -> tuple[wl.Workload, float | None]:
    """The workload's first `seconds`, as (workload, duration_s for the driver): an open loop's
    requests arriving before then (at most `burst`, and at least the first), a closed loop's
    users issuing for that long."""
    if workload.closed:
        return workload, seconds
    items = [item for item in workload.items if item.arrival_s < seconds][:burst] or workload.items[:1]
    return wl.Workload(workload.spec, workload.vocab_size, items), None


class EngineTarget:
    """The engine in-process, on a decoder loaded from a preset or checkpoint."""

    def __init__(self, model: str, args):
        import decoders
        from decoders.engine import Engine

        family = decoders.family_of(model)
        options = {"page_size": args.page_size} if "page_size" in decoders.family_options(family) else {}
        if args.kv_dtype is not None:
            options["kv_dtype"] = args.kv_dtype
        self.decoder = decoders.load(model, device=args.device, dtype=args.dtype, impl=args.impl, seed=args.seed, quant=args.quant,
                                     **options)
        self.engine = Engine(self.decoder, max_batch=args.max_batch, max_step_tokens=args.max_step_tokens)
        # The engine's limit, which its KV pool can make shorter than the model's context.
        self.vocab_size, self.max_context, self.device = self.decoder.vocab_size, self.engine.max_model_len, self.decoder.device

    def run(self, workload, duration_s=None, on_finish=None):
        return drive_engine(self.engine, workload, duration_s=duration_s, on_finish=on_finish)

    def describe(self) -> dict:
        return {"target": "engine", **self.decoder.describe(), "engine_stats": self.engine.stats()}


class HttpTarget:
    """A server speaking the OpenAI completions protocol; the model's vocabulary and context are read
    from its preset or checkpoint config (nothing is loaded here)."""

    def __init__(self, model: str, args):
        import decoders

        self.model, self.url, self.family = model, args.target, decoders.family_of(model)
        self.vocab_size, self.max_context = model_limits(model)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def run(self, workload, duration_s=None, on_finish=None):
        return drive_http(self.url, workload, model=self.model, duration_s=duration_s, on_finish=on_finish)

    def describe(self) -> dict:
        return {"target": self.url, "family": self.family, "model": self.model}


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m decoders.serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help="comma list of presets or checkpoint folders (default: llama-1b,mamba2-1.3b,rwkv7-1.5b on a GPU, the tiny presets on a CPU)")
    p.add_argument("--rate", default=None, help="open loop: comma list of arrival rates in requests/s, inf = all at once (default 1,4,16,inf)")
    p.add_argument("--arrivals", default="poisson", help="open loop: comma list of poisson, bursty (default poisson)")
    p.add_argument("--burst-amplitude", type=float, default=0.4, help="bursty: the rate swings +-this fraction around its mean (default 0.4)")
    p.add_argument("--burst-period", type=float, default=10.0, help="bursty: seconds per swing of the rate (default 10)")
    p.add_argument("--users", default=None, help="closed loop instead of --rate: comma list of concurrent users")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of arrivals: a rate's request count is rate x duration; a closed loop stops issuing after it (default 60)")
    p.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S,
                   help=f"seconds of the first point's workload run untimed after the warm-up burst, per model (0: none; default {DEFAULT_WARMUP_S:g})")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per point (default: rate x duration; at rate inf the largest finite rate's count, else 8 x --max-batch; closed loop 8 per user)")
    p.add_argument("--prompt-len", default="1024", help="prompt tokens: 1024 (fixed), 128..1024 (uniform) or corpus:FILE (its document lengths) (default 1024)")
    p.add_argument("--output-len", default="256", help="output tokens, as --prompt-len (default 256)")
    p.add_argument("--workload", default=None, help="replay a saved workload file (its arrivals and lengths) instead of drawing one")
    p.add_argument("--slo", default=None, help="objectives for goodput, e.g. ttft=500ms,itl=50ms[,e2e=20s] (itl: a request's mean time between tokens)")
    p.add_argument("--gpu-hour-price", type=float, default=DEFAULT_GPU_HOUR_PRICE,
                   help=f"dollars per GPU-hour for the cost per 1,000 output tokens (default {DEFAULT_GPU_HOUR_PRICE:g}: an assumed round on-demand H200 price)")
    p.add_argument("--target", default=None, help="base URL of an OpenAI-compatible server (e.g. http://127.0.0.1:8000) instead of the engine in-process")
    p.add_argument("--max-batch", type=int, default=64, help="engine: most requests running at once (default 64)")
    p.add_argument("--max-step-tokens", type=int, default=2048, help="engine: most tokens one step schedules (default 2048)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size for attention families")
    p.add_argument("--kv-dtype", default=None, help="engine: KV cache dtype of attention families, fp8 | bf16 | ... (default: the model's dtype)")
    p.add_argument("--quant", default=None, help="engine: weight quantisation: int8, int4-rtn, int4-rtn-gN (on the fly), or int4 of a quantised folder (default: the model's own weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the random weights")
    p.add_argument("--out", default="runs/serve_bench.jsonl", help="JSON lines file, appended point by point; workloads are saved beside it")
    p.add_argument("--plot", default=None, help="PNG: p99 TTFT and p99 ITL against output tokens/s, one line per model and arrival process")
    p.add_argument("--replot", default=None, help="comma list of result files: draw --plot from them and exit (nothing is run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def replot(files: str, path: str | None) -> int:
    if path is None:
        raise ArgError("--replot needs --plot FILE.png")
    records = []
    for name in (f.strip() for f in files.split(",") if f.strip()):
        if not Path(name).is_file():
            raise ArgError(f"--replot {name!r} is not a file")
        with open(name) as f:
            try:
                records.extend(json.loads(line) for line in f if line.strip())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ArgError(f"--replot {name!r} is not a JSON lines file") from None
    plot_throughput_latency(records, path)
    print(f"plot of {len(records)} record(s) written to {path}", file=sys.stderr)
    return 0


def default_models(on_gpu: bool) -> str:
    return "llama-1b,mamba2-1.3b,rwkv7-1.5b" if on_gpu else "llama-tiny,mamba2-tiny,rwkv7-tiny"


def plan_loads(args) -> list[dict]:
    """The sweep's loads: {arrivals, rate, users, requests}, validated before anything is loaded."""
    if not (args.warmup >= 0 and math.isfinite(args.warmup)):
        raise ArgError(f"--warmup must be >= 0 seconds, got {args.warmup:g}")
    if args.workload is not None:
        if args.rate is not None or args.users is not None:
            raise ArgError("--workload replays a saved workload: give neither --rate nor --users")
        # Read now, so that a file that is not a workload is refused before any model loads.
        wl.load(args.workload)
        return [{"replay": args.workload}]
    if not args.duration > 0:
        raise ArgError(f"--duration must be > 0 seconds, got {args.duration:g}")
    if args.requests is not None and args.requests < 1:
        raise ArgError(f"--requests must be >= 1, got {args.requests}")
    # Checked whatever the arrivals: a value out of range is a mistake even where it would go unused.
    if not 0 <= args.burst_amplitude < 1:
        raise ArgError(f"--burst-amplitude must be in [0, 1), got {args.burst_amplitude:g}")
    if not args.burst_period > 0:
        raise ArgError(f"--burst-period must be > 0 seconds, got {args.burst_period:g}")
    if args.users is not None:
        if args.rate is not None:
            raise ArgError("give --rate (open loop) or --users (closed loop), not both")
        return [{"arrivals": "closed", "rate": None, "users": u, "requests": args.requests or 8 * u} for u in parse_ints(args.users, "users")]
    rates = parse_rates(args.rate or "1,4,16,inf")
    kinds = list(dict.fromkeys(k.strip() for k in args.arrivals.split(",") if k.strip()))
    for kind in kinds or [""]:
        if kind not in ("poisson", "bursty"):
            raise ArgError(f"--arrivals {kind!r}: expected poisson or bursty (a closed loop is --users)")
    if "bursty" in kinds:
        if math.isinf(max(rates)):
            raise ArgError("--arrivals bursty needs finite rates (inf sends every request at once)")
    finite = [max(1, math.ceil(r * args.duration)) for r in rates if not math.isinf(r)]
    saturating = max(finite) if finite else 8 * args.max_batch
    return [{"arrivals": kind, "rate": r, "users": None,
             "requests": args.requests or (saturating if math.isinf(r) else max(1, math.ceil(r * args.duration)))}
            for kind in kinds for r in rates]


def load_label(record: dict) -> str:
    if record.get("users") is not None:
        return f"{record['users']} users"
    rate = record.get("rate")
    return f"{rate:g}/s" if isinstance(rate, (int, float)) else f"{rate}/s"


def format_table(records: list[dict]) -> str:
    cols = [("model", "model", "{}"), ("arrivals", "arrivals", "{}"), ("load", None, "{}"), ("status", "status", "{}"),
            ("reqs", "finished", "{}"), ("req/s", "request_per_s", "{:.2f}"), ("out tok/s", "output_tok_s", "{:.1f}"),
            ("tok/s", "total_tok_s", "{:.0f}"), ("TTFT p50", "ttft_ms_p50", "{:.1f}"), ("p90", "ttft_ms_p90", "{:.1f}"),
            ("p99", "ttft_ms_p99", "{:.1f}"), ("ITL p50", "itl_ms_p50", "{:.2f}"), ("p99", "itl_ms_p99", "{:.2f}"),
            ("E2E p50", "e2e_ms_p50", "{:.0f}"), ("p99", "e2e_ms_p99", "{:.0f}"), ("queue mean", "queue_ms_mean", "{:.1f}"),
            ("std", "queue_ms_std", "{:.1f}"), ("goodput", "goodput_request_per_s", "{:.2f}"),
            ("$/1k out", "cost_per_1k_output_tokens", "{:.4f}"), ("J/tok", "energy_j_per_output_token", "{:.3f}"),
            ("host", "host_fraction", "{:.0%}")]
    rows = [[name for name, _, _ in cols]]
    for r in records:
        rows.append([load_label(r) if key is None else "-" if r.get(key) is None else fmt.format(r[key]) for _, key, fmt in cols])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    table = "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)
    return table + "\n(latencies in ms; goodput in requests/s meeting --slo; host: the engine's share of step time spent on the host)"


def plot_throughput_latency(records: list[dict], path: str) -> None:
    """p99 TTFT and p99 ITL against output tokens/s, one line per (model, arrival process), in
    order of offered load, each point labelled with its load; a point found several times in
    `records` is drawn from the last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {}
    for r in records:
        if r.get("status") == "ok" and r.get("output_tok_s"):
            latest[r["model"], r["arrivals"], str(r.get("rate")), r.get("users")] = r
    series = {}
    for r in latest.values():
        series.setdefault((r["model"], r["arrivals"]), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for (model, arrivals), points in sorted(series.items()):
        points.sort(key=lambda r: (r.get("users") or 0, r["rate"] if isinstance(r.get("rate"), (int, float)) else math.inf))
        x = [r["output_tok_s"] for r in points]
        for ax, key in zip(axes, ("ttft_ms_p99", "itl_ms_p99")):
            (line,) = ax.plot(x, [r[key] for r in points], marker="o", linestyle="--" if arrivals == "bursty" else "-", label=f"{model} ({arrivals})")
            for xi, r in zip(x, points):
                if r.get(key) is not None:
                    ax.annotate(load_label(r), (xi, r[key]), fontsize=6, color=line.get_color(), textcoords="offset points", xytext=(3, 3))
    for ax, title in zip(axes, ("p99 time to first token (ms)", "p99 inter-token latency (ms)")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(title)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle("Throughput against latency as the offered load grows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def workload_path(out: str, model: str, workload: wl.Workload) -> Path:
    """Where a point's workload is saved: beside --out, named by model, arrivals, load, seed and a
    digest of its spec (so a later run with other lengths or counts does not overwrite the file an
    earlier record names)."""
    spec = workload.spec
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name)
    what = f"users{spec['users']}" if spec["users"] is not None else f"rate{spec['rate']}"
    digest = hashlib.sha1(json.dumps([spec, workload.vocab_size], sort_keys=True).encode()).hexdigest()[:8]
    out = Path(out)
    return out.parent / f"{out.stem}.workloads" / f"{name}-{spec['arrivals']}-{what}-seed{spec['seed']}-{digest}.jsonl"


def model_limits(model: str) -> tuple[int, int | None]:
    """(vocabulary size, longest context or None) of a preset or checkpoint, from its config alone."""
    import decoders
    from declab_arch.checkpoint import CONFIG_DIR, read_json

    _, lab_config = decoders.model_config(model)
    limit = getattr(lab_config, "max_position_embeddings", None)
    path = Path(model)
    config = read_json(path / "config.json" if path.is_dir() else CONFIG_DIR / f"{model}.json")
    return config["vocab_size"], limit


def point_workload(args, load: dict, target, model: str, lengths) -> tuple[wl.Workload, str]:
    if "replay" in load:
        workload = wl.load(load["replay"])
        if workload.vocab_size > target.vocab_size:
            raise UsageError(f"{load['replay']}: drawn for a vocabulary of {workload.vocab_size}, {model} has {target.vocab_size}")
        return workload, load["replay"]
    spec = wl.WorkloadSpec(arrivals=load["arrivals"], requests=load["requests"], prompt_len=lengths[0], output_len=lengths[1],
                           rate=load["rate"], users=load["users"], amplitude=args.burst_amplitude, period_s=args.burst_period, seed=args.seed)
    workload = wl.generate(spec, target.vocab_size, target.max_context)
    path = workload_path(args.out, model, workload)
    wl.save(workload, path)
    return workload, str(path)


ENGINE_COUNTERS = ("finished", "preemptions", "tokens_generated", "steps", "host_s_total", "step_s_total", "prefill_steps",
                   "prefill_host_s_total", "prefill_step_s_total", "graphs_captured")


def engine_point_stats(before: dict, after: dict) -> dict:
    """What the engine counted during one point (its counters after minus before), with the host's
    share of step time (what the step spent outside waiting for the device) and tokens per step."""
    point = {k: after[k] - before[k] for k in ENGINE_COUNTERS if k in after and k in before}
    steps, step_s, host_s = point.get("steps"), point.get("step_s_total"), point.get("host_s_total")
    if steps:
        point["tokens_per_step"] = point.get("tokens_generated", 0) / steps
        if host_s is not None:
            point["host_ms_per_step"] = host_s / steps * 1e3
    if step_s and host_s is not None:
        point["host_fraction"] = host_s / step_s
    # Steps that consumed prompt tokens against the rest (decode only): where the host's time goes.
    prefills = point.get("prefill_steps")
    if prefills is not None and host_s is not None and "prefill_host_s_total" in point:
        p_host, p_step = point["prefill_host_s_total"], point["prefill_step_s_total"]
        if prefills:
            point["host_ms_per_prefill_step"], point["ms_per_prefill_step"] = p_host / prefills * 1e3, p_step / prefills * 1e3
        if steps - prefills:
            point["host_ms_per_decode_step"] = (host_s - p_host) / (steps - prefills) * 1e3
            point["ms_per_decode_step"] = (step_s - p_step) / (steps - prefills) * 1e3
    return point


def gemv_measured() -> int:
    """GEMV keys `declab_kernels.gemv.linear` has timed in this process (not read from DECLAB_GEMV_CHOICES)."""
    return sum(1 for rec in gemv.choices() if not rec.get("from_file"))


def warn_first_use(label: str, first_use: dict) -> None:
    """One stderr line when kernels compiled, graphs were captured or GEMV shapes were measured inside a
    timed point (`first_use_during_point`): the point's latencies include those seconds."""
    compiles = first_use["triton_compiles"]
    parts = [f"{compiles['count']} Triton compilation(s) ({compiles['seconds']:.1f} s)"] if compiles["count"] else []
    if first_use["graphs_captured"]:
        parts.append(f"{first_use['graphs_captured']} CUDA graph capture(s)")
    if first_use["gemv_keys_measured"]:
        parts.append(f"{first_use['gemv_keys_measured']} GEMV shape measurement(s)")
    if parts:
        print(f"warning: {label}: {', '.join(parts)} ran inside the timed point, and its latencies include them "
              "(a longer --warmup replays more of the workload before timing)", file=sys.stderr)


def run_point(args, target, model, workload, source, slo, env, idle, warmup_s, progress) -> dict:
    spec = workload.spec
    record = {"model": model, "arrivals": spec["arrivals"], "rate": spec.get("rate"), "users": spec.get("users"),
              "workload": spec, "workload_file": source, "warmup_s": warmup_s, "warmup_replay_s": args.warmup,
              "idle_ttft_ms": [[n, t * 1e3] for n, t in idle],
              **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if progress is not None:
        progress.reset(total=len(workload.items))
        progress.set_description(f"{model} {spec['arrivals']} {load_label(record)}")
    before = target.engine.stats() if isinstance(target, EngineTarget) else None
    compiled_before, gemv_keys = compile_log.snapshot(), gemv_measured()
    meter = PowerMeter(target.device)
    with meter:
        traces = target.run(workload, duration_s=args.duration if workload.closed else None, on_finish=(lambda t: progress.update()) if progress else None)
    described = target.describe()
    if before is not None:
        point = engine_point_stats(before, described["engine_stats"])
        described["engine_stats"] = {"point": point, "after": described["engine_stats"]}
        record["host_fraction"] = point.get("host_fraction")
        record["first_use_during_point"] = first_use = {
            "triton_compiles": compile_log.since(compiled_before), "graphs_captured": point.get("graphs_captured", 0),
            "gemv_keys_measured": gemv_measured() - gemv_keys}
        warn_first_use(f"{model} {spec['arrivals']} {load_label(record)}", first_use)
    record.update(described)
    record.update(model=model, status="ok", **summarize(traces, slo=slo, gpu_hour_price=args.gpu_hour_price, energy_j=meter.energy_j,
                                                        idle_ttft=idle_ttft_line(idle) if idle else None))
    record.update(meter.describe())
    if record["finished"] < record["requests"]:
        record["status"] = "errors" if record["failed"] else "unfinished"
    return record


def short_summary(records: list[dict], env: dict, out: str) -> dict:
    """The last stdout line: the environment and a few figures per point (the full records are in --out)."""
    keys = ("model", "arrivals", "rate", "users", "status", "request_per_s", "output_tok_s", "ttft_ms_p99", "itl_ms_p99", "goodput_request_per_s")

    def short(value):
        return float(f"{value:.4g}") if isinstance(value, float) else value

    return {"out": out, "git_sha": env["git_sha"], "device": env["device"], "points": [{k: short(r.get(k)) for k in keys} for r in records]}


def run(args) -> int:
    from decoders.records import append_jsonl, environment

    if args.replot is not None:
        return replot(args.replot, args.plot)
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if args.models is None:
        print(f"defaults for this {'GPU' if on_gpu else 'CPU'}: --models {default_models(on_gpu)}", file=sys.stderr)
    models = [m for m in (args.models or default_models(on_gpu)).split(",") if m]
    if not models:
        raise ArgError("--models names no model")
    loads = plan_loads(args)
    slo = parse_slo(args.slo)
    cli.check_records_file(args.out, "--out")
    if not args.gpu_hour_price >= 0:
        raise ArgError(f"--gpu-hour-price must be >= 0 dollars, got {args.gpu_hour_price:g}")
    if args.max_batch < 1 or args.max_step_tokens < 1:
        raise ArgError("--max-batch and --max-step-tokens must be >= 1")
    lengths = (wl.parse_lengths(args.prompt_len, "prompt-len"), wl.parse_lengths(args.output_len, "output-len"))
    if args.kv_dtype is not None:
        import decoders
        from decoders.kv_cache import parse_kv_dtype

        try:
            parse_kv_dtype(args.kv_dtype)
        except UsageError as e:
            raise ArgError(f"--kv-dtype: {e}") from None
        for model in models:
            family = decoders.family_of(model)
            if "kv_dtype" not in decoders.family_options(family):
                raise ArgError(f"--kv-dtype: {model} ({family}) has no KV cache")
    if args.quant is not None:
        import decoders
        from decoders.quant import check_load_quant

        if args.target is not None:
            raise ArgError("--quant is for the engine in-process; a --target server is started with its own --quant")
        for model in models:
            try:
                check_load_quant(model, args.quant)
            except decoders.USER_ERRORS as e:
                raise ArgError(f"--quant: {e}") from None
    for model in models:
        _, max_context = model_limits(model)
        # The lengths against the context now, before any model is loaded.
        if args.workload is None:
            wl.check_lengths(*lengths, max_context)
    if args.target is not None:
        if not re.match(r"https?://", args.target):
            raise ArgError(f"--target {args.target!r}: expected a base URL such as http://127.0.0.1:8000")
        if importlib.util.find_spec("aiohttp") is None:
            raise ArgError("--target needs aiohttp (pip install -e '.[bench]')")

    env = environment(torch.device(args.device or ("cuda" if on_gpu else "cpu")))
    compile_log.watch()  # from here on, what compiles inside a timed point is counted (`first_use_during_point`)
    records, planned = [], len(models) * len(loads)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(file=sys.stderr, unit="req")
    try:
        for model in models:
            target = (HttpTarget if args.target else EngineTarget)(model, args)
            for i, load in enumerate(loads):
                workload, source = point_workload(args, load, target, model, lengths)
                if i == 0:
                    idle, warmup_s = warm_up(target.run, workload, target.vocab_size, min(args.max_batch, len(workload.items)),
                                             args.warmup)
                    print(f"{model}: warm-up {warmup_s:.1f} s; idle TTFT " + ", ".join(f"{t * 1e3:.1f} ms at {n} tokens" for n, t in idle), file=sys.stderr)
                record = run_point(args, target, model, workload, source, slo, env, idle, warmup_s, progress)
                append_jsonl(args.out, record)
                records.append(record)
    except KeyboardInterrupt:
        print(f"interrupted: {len(records)} finished point(s) kept in {args.out}", file=sys.stderr)
    finally:
        if progress is not None:
            progress.close()
    print(format_table(records))
    if args.plot:
        plot_throughput_latency(records, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    print(json.dumps(short_summary(records, env, args.out)))
    return 0 if len(records) == planned else 130


def main(argv=None) -> int:
    """Exit status: 0 when every point finished, 130 when interrupted, 2 for input the lab refuses."""
    from decoders.cli import run_command

    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
