"""Make the lab's offline lm-eval tasks: deterministic data (JSON lines) and their task YAMLs.

    python -m eval.tasks.make --seed 0                          # MQAR + copy tasks
    python -m eval.tasks.make --seed 0 --text corpus/valid.txt.gz   # + perplexity and cloze of that text
    lm_eval ... --include_path eval/tasks --tasks declab_mqar,declab_copy,declab_ppl,declab_cloze

Everything goes into --out (default eval/tasks/data, which lm-eval's --include_path eval/tasks
searches). The YAMLs use `dataset_path: json` with absolute `data_files`, so they load from any
working directory and with HF_DATASETS_OFFLINE=1. The same seed and arguments give the same files.

Tasks (all zero-shot; `acc` is lm-eval's greedy check: every continuation token is the argmax):

- declab_mqar_<n> (group declab_mqar): multi-query associative recall as in Zoology. n key:value
  pairs ("qzt:41 bka:07 ... |"), filler words up to --mqar-context characters, "|", then the keys
  queried in random order, some answered ("bka:07 ..."), and one open ("qzt:") whose value must be
  recalled from the pairs; metrics acc and perplexity of the value.
- declab_copy_<L> (group declab_copy): induction/copying. L characters of random words, "|", the first
  half of them again; the next 4 words must be copied. acc and perplexity.
- declab_ppl: held-out perplexity of the --text documents through loglikelihood_rolling
  (word_perplexity, byte_perplexity, bits_per_byte).
- declab_cloze: next-word cloze from --text: a paragraph cut before an alphabetic word at least
  20 words in, with up to --cloze-context characters of the document before it; acc and perplexity
  of " word".
"""

import argparse
import json
import random
import string
from pathlib import Path

import yaml

from decoders import user_errors
from decoders.base import UsageError
from decoders.cli import Parser, check_output_dir
from eval.corpus import documents, shard_files

DEFAULT_OUT = Path(__file__).resolve().parent / "data"
LOGLIK_METRICS = [
    {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
    {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
]


def random_word(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def mqar_docs(n_pairs: int, n_docs: int, context_chars: int, seed: int) -> list[dict]:
    """Zoology's MQAR in text: distinct 3-letter keys with 2-digit values, filler words up to
    `context_chars`, then the keys queried once each in random order; a random number of them are
    answered and the next one is open, so every key is asked at most once and must come from the pairs."""
    rng = random.Random(f"{seed}-mqar-{n_pairs}")
    docs = []
    for _ in range(n_docs):
        keys = []
        while len(keys) < n_pairs:
            key = random_word(rng, 3, 3)
            if key not in keys:
                keys.append(key)
        values = {k: f"{rng.randrange(100):02d}" for k in keys}
        text = " ".join(f"{k}:{values[k]}" for k in keys) + " |"
        # Filler between pairs and queries (Zoology's noise tokens): sets the recall distance.
        while len(text) < context_chars:
            text += " " + random_word(rng, 2, 6)
        order = rng.sample(keys, len(keys))
        answered = rng.randrange(len(keys))
        queries = " ".join(f"{k}:{values[k]}" for k in order[:answered])
        key = order[answered]
        context = f"{text} | {queries} {key}:" if queries else f"{text} | {key}:"
        docs.append({"context": context, "target": values[key], "pairs": n_pairs})
    return docs


def copy_docs(length: int, n_docs: int, seed: int, copy_words: int = 4) -> list[dict]:
    """Random words of `length` characters, then the first half again; the next `copy_words` words are the target."""
    rng = random.Random(f"{seed}-copy-{length}")
    docs = []
    for _ in range(n_docs):
        words = []
        while sum(len(w) + 1 for w in words) < length or len(words) < 2 * copy_words:
            words.append(random_word(rng, 2, 6))
        half = len(words) // 2
        context = " ".join(words) + " | " + " ".join(words[:half])
        docs.append({"context": context, "target": " " + " ".join(words[half : half + copy_words]), "length": length})
    return docs


def ppl_docs(texts: list[str], n_docs: int) -> list[dict]:
    return [{"text": t} for t in texts[:n_docs]]


def cloze_docs(texts: list[str], n_docs: int, context_chars: int, seed: int) -> list[dict]:
    """One cloze item per chosen paragraph: the text before an alphabetic word >= 20 words in, and that word."""
    rng = random.Random(f"{seed}-cloze")
    items = []
    for text in texts:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            words = line.split(" ")
            spots = [j for j in range(20, len(words)) if words[j].isalpha()]
            if not spots:
                continue
            j = rng.choice(spots)
            before = "\n".join(lines[:i] + [" ".join(words[:j])])
            items.append({"context": before[-context_chars:], "target": " " + words[j]})
    rng.shuffle(items)
    return items[:n_docs]


def task_yaml(name: str, data: Path, output_type: str, seed: int, **fields) -> dict:
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "output_type": output_type,
        "test_split": "test",
        **fields,
        "metadata": {"version": 1.0, "seed": seed},
    }


def loglik_yaml(name: str, data: Path, seed: int) -> dict:
    return task_yaml(name, data, "loglikelihood", seed, doc_to_text="{{context}}", doc_to_target="{{target}}", metric_list=LOGLIK_METRICS)


def group_yaml(group: str, tasks: list[str]) -> dict:
    return {
        "group": group,
        "task": tasks,
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": False}],
        "metadata": {"version": 1.0},
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_yaml(path: Path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")


def make(out: Path, *, seed: int = 0, text: str | None = None, mqar_pairs=(4, 8, 16, 32, 64), mqar_context: int = 512,
         copy_lengths=(128, 512, 1024), n_docs: int = 200, ppl_docs_n: int = 200, cloze_context: int = 1024,
         text_split: str = "valid") -> list[str]:
    """Write the tasks' data and YAMLs into `out`; returns the task and group names written. A corpus
    folder as `text` gives its `text_split` shards (valid*, or test* for a final evaluation)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    mqar = []
    for n in mqar_pairs:
        name = f"declab_mqar_{n}"
        write_jsonl(out / f"{name}.jsonl", mqar_docs(n, n_docs, mqar_context, seed))
        write_yaml(out / f"{name}.yaml", loglik_yaml(name, out / f"{name}.jsonl", seed))
        mqar.append(name)
    write_yaml(out / "declab_mqar.yaml", group_yaml("declab_mqar", mqar))
    copy = []
    for length in copy_lengths:
        name = f"declab_copy_{length}"
        write_jsonl(out / f"{name}.jsonl", copy_docs(length, n_docs, seed))
        write_yaml(out / f"{name}.yaml", loglik_yaml(name, out / f"{name}.jsonl", seed))
        copy.append(name)
    write_yaml(out / "declab_copy.yaml", group_yaml("declab_copy", copy))
    names += mqar + ["declab_mqar"] + copy + ["declab_copy"]
    if text is not None:
        texts = list(documents(text, text_split))
        cloze = cloze_docs(texts, n_docs, cloze_context, seed)
        if not cloze:
            # An empty task would fail inside lm-eval's dataset loading, after the evaluation started.
            raise UsageError(f"--text {text}: no paragraph of more than 20 words in its {text_split} split, so no declab_cloze item")
        write_jsonl(out / "declab_ppl.jsonl", ppl_docs(texts, ppl_docs_n))
        write_yaml(
            out / "declab_ppl.yaml",
            task_yaml(
                "declab_ppl", out / "declab_ppl.jsonl", "loglikelihood_rolling", seed,
                doc_to_text="", doc_to_target="{{text}}",
                metric_list=[
                    {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                    {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                    {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
                ],
            ),
        )
        write_jsonl(out / "declab_cloze.jsonl", cloze)
        write_yaml(out / "declab_cloze.yaml", loglik_yaml("declab_cloze", out / "declab_cloze.jsonl", seed))
        names += ["declab_ppl", "declab_cloze"]
    return names


def int_list(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]: whole numbers >= 1 (argparse reports anything else as one line)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return values


def check_text(text: str, split: str) -> None:
    """--text must be a readable file, or a corpus folder with `split` shards."""
    path = Path(text)
    if not path.exists():
        raise UsageError(f"--text {text}: no such file or folder")
    try:
        shard_files(path, split)
    except FileNotFoundError as e:
        raise UsageError(f"--text {e} (--text-split {split})") from None


def main(argv=None):
    p = Parser(prog="python -m eval.tasks.make", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--text", help="held-out text for declab_ppl and declab_cloze: a file or a corpus folder (its --text-split shards)")
    p.add_argument("--text-split", default="valid", choices=["valid", "test"], help="which shards of a corpus folder --text reads (default valid)")
    p.add_argument("--mqar-pairs", type=int_list, default=[4, 8, 16, 32, 64], help="comma-separated numbers of key-value pairs")
    p.add_argument("--mqar-context", type=int, default=512, help="characters of pairs + filler before the queries (the recall distance)")
    p.add_argument("--copy-lengths", type=int_list, default=[128, 512, 1024], help="comma-separated characters of random words to copy from")
    p.add_argument("--docs", type=int, default=200, help="examples per MQAR, copy and cloze task")
    p.add_argument("--ppl-docs", type=int, default=200, help="documents in declab_ppl")
    p.add_argument("--cloze-context", type=int, default=1024, help="characters of context before each cloze word")
    a = p.parse_args(argv)
    with user_errors():
        for option in ("mqar_context", "docs", "ppl_docs", "cloze_context"):
            if getattr(a, option) < 1:
                raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(a, option)}")
        check_output_dir(a.out, "--out")
        if a.text is not None:
            check_text(a.text, a.text_split)
    names = make(a.out, seed=a.seed, text=a.text, mqar_pairs=a.mqar_pairs, mqar_context=a.mqar_context, copy_lengths=a.copy_lengths,
                 n_docs=a.docs, ppl_docs_n=a.ppl_docs, cloze_context=a.cloze_context, text_split=a.text_split)
    print(f"wrote {len(names)} tasks to {a.out}: {', '.join(names)}")


if __name__ == "__main__":
    main()
