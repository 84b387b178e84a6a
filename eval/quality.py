"""Quality CLI: run checkpoints on lm-eval tasks, print and write a comparison table, draw the plots.

    python -m eval.quality --checkpoints runs/llama-30m runs/mamba2-30m runs/rwkv7-30m runs/maskpredict-30m \
        --tasks declab_mqar,declab_copy,declab_ppl,declab_cloze --include-path eval/tasks/data \
        --mp-iterations 1,2,4,8,16 --out results/quality/
    python -m eval.quality --from-jsonl results/quality/quality.jsonl --out results/quality/   # redraw

Each checkpoint (a folder or a preset) is run once through lm-eval as the `declab` model;
Mask-Predict checkpoints once per number of iterations T in --mp-iterations. Writes into --out:

- quality.jsonl: one JSON object per (checkpoint, T, task) with every metric lm-eval reported,
  the decoder's description and environment();
- quality.md: a markdown table, one row per run, one column per task (bits_per_byte for perplexity
  tasks, acc otherwise), also printed;
- mqar.png: MQAR accuracy against the number of key-value pairs, one line per run;
- maskpredict_iterations.png: each task's main metric against T for the Mask-Predict runs.

With --genppl-scorer (an autoregressive checkpoint of the same tokenizer) and --genppl-text (a
corpus), each Mask-Predict run also writes continuations of held-out prompts with its own decoding
and gets their generative perplexity under the scorer (`eval.samples`), recorded as the task
`declab_genppl` (metrics gen_ppl, scorer_nll, distinct): the measure that T changes.
"""

import argparse
import functools
import json
import re
from pathlib import Path

import torch

import decoders
from decoders.records import append_jsonl, environment
from decoders.cli import Parser, check_output_dir

MQAR_TASK = re.compile(r"declab_mqar_(\d+)$")
# The metric a table shows per task, first found: bits per byte (perplexity tasks), accuracy, the
# generative perplexity of samples (declab_genppl).
PRIMARY = ("bits_per_byte", "acc", "gen_ppl")
GENPPL_TASK = "declab_genppl"


def primary_metric(metrics: dict) -> tuple[str, float] | None:
    """The metric a table shows for one task: bits_per_byte when reported, else acc, else gen_ppl."""
    for name in PRIMARY:
        if f"{name},none" in metrics:
            return name, metrics[f"{name},none"]
    return None


@functools.lru_cache(maxsize=4)
def task_manager(include_path):
    """lm-eval's TaskManager over its own tasks and `include_path`'s, made once per folder: indexing
    every task YAML takes seconds, more than evaluating a small model on the lab's tasks."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def run_one(pretrained: str, tasks: list[str], *, include_path, model_args: dict, limit, iterations=None, genppl=None) -> tuple[dict, dict]:
    """lm-eval results {task: metrics} and the decoder's description for one checkpoint (and T); with
    `genppl` (scorer decoder, prompts, new tokens) also the generative perplexity of its samples."""
    import lm_eval

    from eval.lm_model import DecLabLM

    args = {"pretrained": pretrained, **model_args}
    if iterations is not None:
        args["iterations"] = iterations
    lm = DecLabLM(**args)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager(include_path), limit=limit, log_samples=False)
    results = {task: {k: v for k, v in metrics.items() if k != "alias"} for task, metrics in out["results"].items()}
    if genppl is not None:
        from eval.samples import generative_perplexity

        scorer, prompts, new_tokens = genppl
        measured = generative_perplexity(lm.decoder, scorer, prompts, new_tokens=new_tokens, batch_size=lm.batch_size)
        results[GENPPL_TASK] = {f"{k},none": v for k, v in measured.items()}
    return results, lm.decoder.describe()


def label(run: dict) -> str:
    name = Path(run["checkpoint"]).name or run["checkpoint"]
    return name if run["iterations"] is None else f"{name} T={run['iterations']}"


def markdown_table(runs: list[dict]) -> str:
    tasks = []
    for run in runs:
        for task, metrics in run["results"].items():
            if task not in tasks and primary_metric(metrics):
                tasks.append(task)
    header = ["model", "family", *[f"{t} ({primary_metric(next(r['results'][t] for r in runs if t in r['results']))[0]})" for t in tasks]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [label(run), run["family"]]
        for task in tasks:
            metric = primary_metric(run["results"].get(task, {}))
            cells.append("" if metric is None else f"{metric[1]:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_mqar(runs: list[dict], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for run in runs:
        points = sorted((int(m.group(1)), v["acc,none"]) for t, v in run["results"].items() if (m := MQAR_TASK.match(t)) and "acc,none" in v)
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{label(run)} ({run['family']})")
            drawn = True
    if drawn:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("key-value pairs")
        ax.set_ylabel("MQAR accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_iterations(runs: list[dict], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = {}
    for run in runs:
        if run["iterations"] is None:
            continue
        for task, metrics in run["results"].items():
            metric = primary_metric(metrics)
            if metric:
                sweeps.setdefault((run["checkpoint"], task, metric[0]), []).append((run["iterations"], metric[1]))
    if not sweeps:
        return False
    # One panel per metric (accuracy, bits per byte, generative perplexity): their scales differ.
    metrics = sorted({metric for _, _, metric in sweeps}, key=PRIMARY.index)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, name in zip(axes[0], metrics):
        for (checkpoint, task, metric), points in sorted(sweeps.items()):
            if metric == name:
                ax.plot(*zip(*sorted(points)), marker="o", label=f"{Path(checkpoint).name} {task}")
        ax.set_xscale("log", base=2)
        if name == "gen_ppl":
            ax.set_yscale("log")
        ax.set_xlabel("Mask-Predict iterations T")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def is_maskpredict(checkpoint: str) -> bool:
    """Whether a checkpoint folder or preset is of the Mask-Predict family (without loading weights)."""
    from decoders import family_class

    record = family_class("maskpredict")
    config = Path(checkpoint) / "config.json"
    if config.exists():
        return record.detects(json.loads(config.read_text()))
    return str(checkpoint).startswith(record.presets)


def runs_from_jsonl(path) -> list[dict]:
    """The runs recorded in a quality.jsonl (one per checkpoint and T, in file order), e.g. of an
    interrupted evaluation, in the form `markdown_table` and the plots take."""
    runs = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            run = runs.setdefault((r["checkpoint"], r["iterations"]), {"checkpoint": r["checkpoint"], "family": r["family"],
                                                                        "iterations": r["iterations"], "results": {}})
            run["results"][r["task"]] = r["metrics"]
    return list(runs.values())


def write_reports(runs: list[dict], out: Path) -> None:
    """quality.md (also printed), mqar.png and maskpredict_iterations.png of `runs` into `out`."""
    table = markdown_table(runs)
    (out / "quality.md").write_text(table)
    print(table)
    plot_mqar(runs, out / "mqar.png")
    plot_iterations(runs, out / "maskpredict_iterations.png")


def genppl_setup(scorer: str, text: str, *, model_args: dict, prompts: int, tokens: int):
    """(scorer decoder, prompts, new tokens) for `run_one`: the scorer loaded with the evaluation's
    dtype and device, `prompts` windows of `tokens` tokens from `text`'s held-out split (test when
    the corpus folder has one, else valid)."""
    from eval.samples import held_out_split, prompts_from_text
    from eval.tokenizer import tokenizer_for

    if prompts < 1 or tokens < 1:
        raise decoders.UsageError(f"--genppl-prompts and --genppl-tokens must be at least 1, got {prompts} and {tokens}")
    split = held_out_split(text)
    dtype = model_args.get("dtype")
    scorer_decoder = decoders.load(str(scorer), device=model_args.get("device"), dtype=None if dtype in (None, "auto") else dtype)
    return scorer_decoder, prompts_from_text(tokenizer_for(scorer_decoder), text, split=split, n=prompts, length=tokens), tokens


def quality(checkpoints: list[str], tasks: list[str], out: Path, *, include_path=None, model_args=None, limit=None, mp_iterations=(),
            genppl=None) -> list[dict]:
    """`genppl`: None, or (scorer decoder, prompts, new tokens) from `genppl_setup`, for the Mask-Predict runs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = dict(model_args or {})
    env = environment(model_args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    runs = []
    for checkpoint in checkpoints:
        mp = is_maskpredict(checkpoint)
        for iterations in (list(mp_iterations) or [None]) if mp else [None]:
            results, described = run_one(checkpoint, tasks, include_path=include_path, model_args=model_args, limit=limit, iterations=iterations,
                                         genppl=genppl if mp else None)
            run = {"checkpoint": str(checkpoint), "family": described["family"], "iterations": iterations, "results": results}
            runs.append(run)
            for task, metrics in results.items():
                append_jsonl(out / "quality.jsonl", {"checkpoint": str(checkpoint), "family": described["family"], "iterations": iterations,
                                                     "task": task, "metrics": metrics, "limit": limit, "decoder": described, **env})
    write_reports(runs, out)
    return runs


def parse_model_args(text: str) -> dict:
    from lm_eval.utils import simple_parse_args_string

    if text and any("=" not in item for item in text.split(",") if item):
        raise decoders.UsageError(f"model args {text!r}: expected key=value,key=value")
    return simple_parse_args_string(text) if text else {}


def parse_iterations(text: str, option: str = "--mp-iterations") -> list[int]:
    """'1,2,4' -> [1, 2, 4]: whole numbers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise decoders.UsageError(f"{option} expects comma-separated whole numbers, got {text!r}") from None
    if values and min(values) < 1:
        raise decoders.UsageError(f"{option} values must be at least 1, got {text!r}")
    return values


def check_runs(checkpoints: list[str], model_args: dict, *, limit=None, genppl_prompts: int = 1, genppl_tokens: int = 1) -> None:
    """What `quality` would refuse only after loading a model, checked for every checkpoint first: the
    checkpoint itself and the model_args it is evaluated with."""
    from eval.lm_model import check_model_args

    if limit is not None and not limit > 0:
        raise decoders.UsageError(f"--limit must be > 0, got {limit}")
    if genppl_prompts < 0 or genppl_tokens < 1:
        raise decoders.UsageError(f"--genppl-prompts must be >= 0 and --genppl-tokens >= 1, got {genppl_prompts} and {genppl_tokens}")
    if "pretrained" in model_args:
        raise decoders.UsageError("model args may not set pretrained (the checkpoints do)")
    for checkpoint in checkpoints:
        check_model_args({**model_args, "pretrained": str(checkpoint)})


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m eval.quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoints", nargs="+", help="checkpoint folders or presets")
    source.add_argument("--from-jsonl", type=Path, help="redraw the table and plots of an existing (possibly interrupted) quality.jsonl")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks or groups (with --checkpoints)")
    p.add_argument("--include-path", default=str(Path(__file__).resolve().parent / "tasks"), help="folder of task YAMLs (default eval/tasks)")
    p.add_argument("--model-args", default="", help="extra declab model_args, e.g. dtype=bfloat16,max_length=2048,batch_size=16")
    p.add_argument("--limit", type=float, help="examples per task (testing only)")
    p.add_argument("--mp-iterations", default="", help="comma-separated Mask-Predict iterations T to sweep")
    p.add_argument("--genppl-scorer", help="autoregressive checkpoint (same tokenizer) scoring the Mask-Predict runs' samples")
    p.add_argument("--genppl-text", help="corpus (folder, file or datasets name) whose held-out split (test, else valid) gives the prompts")
    p.add_argument("--genppl-prompts", type=int, default=60, help="prompts (default 60)")
    p.add_argument("--genppl-tokens", type=int, default=64, help="tokens of each prompt and of each continuation (default 64)")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv=None):
    a = parser().parse_args(argv)
    check_output_dir(a.out, "--out")
    if a.from_jsonl is not None:
        if not a.from_jsonl.is_file():
            raise decoders.UsageError(f"{a.from_jsonl}: no such file")
        a.out.mkdir(parents=True, exist_ok=True)
        write_reports(runs_from_jsonl(a.from_jsonl), a.out)
        return
    if not a.tasks:
        raise decoders.UsageError("--tasks is required with --checkpoints")
    iterations = parse_iterations(a.mp_iterations)
    limit = int(a.limit) if a.limit and a.limit >= 1 else a.limit
    model_args = parse_model_args(a.model_args)
    if (a.genppl_scorer is None) != (a.genppl_text is None):
        raise decoders.UsageError("--genppl-scorer and --genppl-text go together")
    if not Path(a.include_path).is_dir():
        raise decoders.UsageError(f"--include-path {a.include_path}: no such folder")
    check_runs(a.checkpoints + ([a.genppl_scorer] if a.genppl_scorer else []), model_args, limit=limit,
               genppl_prompts=a.genppl_prompts, genppl_tokens=a.genppl_tokens)
    if a.genppl_text is not None and "/" in a.genppl_text and not Path(a.genppl_text).exists():
        raise decoders.UsageError(f"--genppl-text {a.genppl_text}: no such file or folder")
    genppl = None
    if a.genppl_scorer:
        genppl = genppl_setup(a.genppl_scorer, a.genppl_text, model_args=model_args, prompts=a.genppl_prompts, tokens=a.genppl_tokens)
    quality(a.checkpoints, a.tasks.split(","), a.out, include_path=a.include_path, model_args=model_args,
            limit=limit, mp_iterations=iterations, genppl=genppl)


if __name__ == "__main__":
    with decoders.user_errors():
        main()
