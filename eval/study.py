"""The matched language-model study in one command: the four families at two matched sizes on one
tokenizer, data order and token budget, a learning rate tuned per family, seeds, held-out bits per
byte with its spread, training curves and training throughput.

    python -m eval.study --corpus corpus/ --out results/quality/study
    python -m eval.study --corpus corpus/ --out /tmp/study --sizes 30m --tokens-small 50_000_000 --sweep-tokens 10_000_000

1. The presets `<family>-<size>` (llama, mamba2, rwkv7, maskpredict; default sizes 30m and 120m)
   must agree in parameter count within --match-tolerance (5%) per size (`eval.train.check_matched`).
2. One tokenizer (--tokenizer, saved in <out>/tokenizer) and one tokenised stream (<out>/data) for
   every run, so every model reads the same tokens in the same order (`eval.train`'s data layout).
3. Learning-rate sweep: each family at the small size for --sweep-tokens at every rate of --lrs;
   the rate with the lowest final held-out bits per byte is that family's, for both sizes.
4. Main runs (`eval.train`, the lab's training loop, resumable): the small size at every seed of
   --seeds for --tokens-small tokens, the large size at --large-seeds for --tokens-large.
   The default budgets are about 20 tokens per parameter (600M and 2.4B tokens), where compute-
   optimal training puts them; whether a curve has flattened is measured, not assumed: `tail_drop`
   is the relative fall of held-out bits per byte over the last fifth of the tokens, and the table
   marks a run whose curve still fell more than 2% there.
5. Training throughput per family and size (`eval.train.throughput`: forward, backward, clipping
   and AdamW at --batch x --seq-len) and MFU = 6 x parameters x tokens/s / the bf16 matmul rate
   measured in the same process.
6. With --include-path (the folder `eval.tasks.make` wrote), the offline tasks of --tasks on every
   final checkpoint through `eval.quality` into <out>/quality.

Every finished step is one JSON line in <out>/study.jsonl (kind sweep, run or speed) as soon as it
finishes; a rerun skips what is recorded, and a run interrupted midway resumes from its
train_state.pt.

Several GPUs: `torchrun --nproc-per-node N -m eval.study ...`. Rank 0 makes the tokenizer and the
tokenised data while the other ranks wait; then the sweep's runs, the main runs and the speed
measurements (each phase after the one it needs) are dealt out to the ranks, each training on its own
GPU (cuda:LOCAL_RANK) and appending to study.jsonl.rankR as it goes, and rank 0 merges them into
study.jsonl in grid order. A run that raises on a rank is an error record naming the rank (kept out
of the table, retried by a rerun) while the others go on; rank 0 alone prints, runs the --tasks
evaluation and writes the table and the figure.

Writes <out>/study.md (family, size, parameters, learning rate, bits per byte mean and standard
deviation over seeds, tail_drop, tokens/s, MFU; also printed) and <out>/curves.png (held-out bits
per byte against tokens, mean over seeds, one panel per size). Mask-Predict's bits
per byte are its ELBO bound on prompt-conditioned blocks (`declab_arch.maskpredict.block_loss`),
an upper bound, not the same measure as the autoregressive families' exact likelihood. The last
stdout line is one JSON document.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import decoders
from decoders import cli, distributed
from declab_kernels.timing import matmul_flops
from decoders.records import environment
from eval import train

# family -> the prefix of its preset names (llama-1b, mamba2-1.3b, ...)
PREFIX = {f: decoders.family_class(f).presets for f in decoders.FAMILIES}
FLATTENED = 0.02


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def val_curve(folder: Path) -> list[tuple[int, float]]:
    """(tokens, held-out bits per byte) of every validation of a run."""
    return [(r["tokens"], r["val_bpb"]) for r in read_records(folder / "train.jsonl") if r["kind"] == "val"]


def tail_drop(curve: list[tuple[int, float]]) -> float:
    """Relative fall of bits per byte over the last fifth of the tokens (0 when the curve is flat)."""
    end_tokens, end = curve[-1]
    before = [bpb for tokens, bpb in curve if tokens <= 0.8 * end_tokens]
    return (before[-1] - end) / before[-1] if before else float("nan")


def train_args(a, preset: str, *, tokens: int, lr: float, seed: int, out: Path, device: torch.device):
    """`eval.train`'s parsed arguments for one run on the study's tokenizer and data."""
    argv = ["--preset", preset, "--corpus", a.corpus, "--out", str(out), "--tokens", str(tokens), "--tokenizer", a.tokenizer,
            "--tokenizer-dir", a.out, "--data", str(Path(a.out) / "data"), "--seq-len", str(a.seq_len), "--batch", str(a.batch),
            "--lr", str(lr), "--seed", str(seed), "--val-every", str(a.val_every), "--val-tokens", str(a.val_tokens), "--device", str(device)]
    return train.parser().parse_args(argv)


def run_train(a, preset: str, **kwargs) -> Path:
    """One `eval.train` run (`train_args`); resumes a run left unfinished."""
    return train.train(train_args(a, preset, **kwargs))


def finished(records: list[dict]) -> list[dict]:
    """The records of jobs that finished (not the error records of jobs that raised on a rank)."""
    return [r for r in records if r.get("status") != "error"]


def summary_rows(records: list[dict]) -> list[dict]:
    """One row per (family, size): bits per byte over seeds, tail drop, speed."""
    runs, speed = {}, {}
    for r in records:
        if r["kind"] == "run":
            runs.setdefault((r["family"], r["size"]), []).append(r)
        elif r["kind"] == "speed":
            speed[(r["family"], r["size"])] = r
    rows = []
    for (family, size), group in runs.items():
        bpb = [r["val_bpb"] for r in group]
        s = speed.get((family, size), {})
        rows.append({"family": family, "size": size, "preset": group[0]["preset"], "params": group[0]["params"], "lr": group[0]["lr"],
                     "seeds": [r["seed"] for r in group], "val_bpb_mean": statistics.fmean(bpb),
                     "val_bpb_std": statistics.stdev(bpb) if len(bpb) > 1 else None, "tail_drop": max(r["tail_drop"] for r in group),
                     "tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu")})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| family | size | params | lr | held-out bits/byte (mean ± std, seeds) | tail_drop | train tok/s | MFU |", "|" + "---|" * 8]
    for r in rows:
        spread = "" if r["val_bpb_std"] is None else f" ± {r['val_bpb_std']:.4f}"
        flat = f"{r['tail_drop']:.3f}" + (" (still falling)" if r["tail_drop"] > FLATTENED else "")
        speed = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        mfu = "" if r["mfu"] is None else f"{r['mfu']:.3f}"
        lines.append(f"| {r['family']} | {r['size']} | {r['params']:,} | {r['lr']:.0e} | {r['val_bpb_mean']:.4f}{spread} "
                     f"({','.join(map(str, r['seeds']))}) | {flat} | {speed} | {mfu} |")
    return "\n".join(lines) + "\n"


def plot_curves(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["kind"] == "run"]
    sizes = sorted({r["size"] for r in runs}, key=lambda s: min(r["params"] for r in runs if r["size"] == s))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for i, family in enumerate(PREFIX):
            curves = [r["curve"] for r in runs if (r["family"], r["size"]) == (family, size)]
            if not curves:
                continue
            n = min(map(len, curves))
            xs = [c[0] for c in curves[0][1:n]]
            ys = [statistics.fmean(c[k][1] for c in curves) for k in range(1, n)]
            ax.plot(xs, ys, color=f"C{i}", label=f"{family} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("held-out bits per byte")
        ax.set_title(size)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = cli.Parser(prog="python -m eval.study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="corpus (eval.train's formats)")
    p.add_argument("--out", default="results/quality/study")
    p.add_argument("--families", default=",".join(PREFIX))
    p.add_argument("--sizes", default="30m,120m", help="preset suffixes: the first is the small size (seeds, LR sweep), the second the large")
    p.add_argument("--tokens-small", type=int, default=600_000_000)
    p.add_argument("--tokens-large", type=int, default=2_400_000_000)
    p.add_argument("--sweep-tokens", type=int, default=60_000_000)
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--large-seeds", default="0")
    p.add_argument("--tokenizer", default="bpe:8192")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--val-every", type=int, default=500)
    p.add_argument("--val-tokens", type=int, default=1 << 18)
    p.add_argument("--match-tolerance", type=float, default=0.05)
    p.add_argument("--include-path", help="offline tasks folder (eval.tasks.make); runs --tasks on the final checkpoints")
    p.add_argument("--tasks", default="declab_mqar,declab_copy,declab_ppl,declab_cloze")
    p.add_argument("--device")
    a = p.parse_args(argv)
    try:
        a.families = [f for f in a.families.split(",") if f]
        a.sizes = [s for s in a.sizes.split(",") if s]
        a.lrs = [float(x) for x in a.lrs.split(",") if x]
        a.seeds = [int(x) for x in a.seeds.split(",") if x]
        a.large_seeds = [int(x) for x in a.large_seeds.split(",") if x]
    except ValueError as e:
        p.error(f"a number list could not be read ({e})")
    unknown = [f for f in a.families if f not in PREFIX]
    if unknown or not a.families:
        p.error(f"--families: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(PREFIX)})")
    if not 1 <= len(a.sizes) <= 2:
        p.error(f"--sizes names one or two sizes, got {len(a.sizes)}")
    if not a.lrs or any(lr <= 0 for lr in a.lrs) or not a.seeds or (len(a.sizes) == 2 and not a.large_seeds):
        p.error("--lrs needs positive rates and --seeds / --large-seeds at least one seed")
    for name in ("tokens_small", "tokens_large", "sweep_tokens", "seq_len", "batch", "val_every", "val_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.include_path and not Path(a.include_path).is_dir():
        p.error(f"--include-path {a.include_path}: not a folder")
    return a


def study(a, here: distributed.World) -> dict | None:
    """The whole study; its summary on rank 0 (None on the other ranks of a launch)."""
    out = Path(a.out)
    presets = {size: {f: f"{PREFIX[f]}-{size}" for f in a.families} for size in a.sizes}
    counts = {size: train.check_matched(list(names.values()), a.match_tolerance) for size, names in presets.items()}
    log = out / "study.jsonl"
    device = distributed.device_of(decoders.parse_device(a.device), here)
    small = a.sizes[0]
    plan = [(small, seed, a.tokens_small) for seed in a.seeds] + [(a.sizes[1], seed, a.tokens_large) for seed in a.large_seeds if len(a.sizes) == 2]

    def sweep_folder(family: str, lr: float) -> Path:
        return out / "sweep" / f"{family}-lr{lr:g}"

    def run_folder(preset: str, seed: int) -> Path:
        return out / "runs" / f"{preset}-s{seed}"

    # Every run's options as eval.train checks them (corpus, tokenizer, folders, a run to resume), on
    # every rank before any work; the main runs' rate is the sweep's to pick, any rate checks the rest.
    for family in a.families:
        for lr in a.lrs:
            train.check_args(train_args(a, presets[small][family], tokens=a.sweep_tokens, lr=lr, seed=a.seeds[0],
                                        out=sweep_folder(family, lr), device=device))
        for size, seed, tokens in plan:
            train.check_args(train_args(a, presets[size][family], tokens=tokens, lr=a.lrs[0], seed=seed,
                                        out=run_folder(presets[size][family], seed), device=device))
    if here.launched:
        distributed.setup(device, here, distributed.JOBS_WAIT)
    budget = max(a.tokens_small, a.sweep_tokens, a.tokens_large if len(a.sizes) == 2 else 0)

    def prepare():
        out.mkdir(parents=True, exist_ok=True)
        distributed.fold_parts(log)
        train.prepare_data(a.corpus, train.load_or_make_tokenizer(a.tokenizer, a.corpus, out), budget + a.batch, out / "data")

    # One tokenizer and one tokenised stream for every run: rank 0 makes them while the others wait, then all read them.
    distributed.lead_first(prepare, here)
    tokenizer = train.load_or_make_tokenizer(a.tokenizer, a.corpus, out)
    errors = []

    def sweep(job):
        family, lr = job
        folder = run_train(a, presets[small][family], tokens=a.sweep_tokens, lr=lr, seed=a.seeds[0], out=sweep_folder(family, lr), device=device)
        return {"kind": "sweep", "family": family, "preset": presets[small][family], "lr": lr, "tokens": a.sweep_tokens,
                "val_bpb": val_curve(folder)[-1][1], **environment(device)}

    def sweep_failed(job, reason):
        family, lr = job
        return {"kind": "sweep", "family": family, "preset": presets[small][family], "lr": lr, "tokens": a.sweep_tokens,
                "status": "error", "reason": reason, **environment(device)}

    done = finished(read_records(log))
    jobs = [(family, lr) for family in a.families for lr in a.lrs
            if not any(r["kind"] == "sweep" and r["family"] == family and r["lr"] == lr for r in done)]
    errors += distributed.run_jobs(jobs, sweep, log, here, sweep_failed)
    done = finished(read_records(log))
    best_lr = {}
    for family in a.families:
        rates = [r for r in done if r["kind"] == "sweep" and r["family"] == family and r["lr"] in a.lrs]
        if rates:
            best_lr[family] = min(rates, key=lambda r: r["val_bpb"])["lr"]

    def run(job):
        size, seed, tokens, family = job
        preset = presets[size][family]
        folder = run_folder(preset, seed)
        run_train(a, preset, tokens=tokens, lr=best_lr[family], seed=seed, out=folder, device=device)
        curve = val_curve(folder)
        return {"kind": "run", "family": family, "size": size, "preset": preset, "seed": seed, "lr": best_lr[family], "tokens": tokens,
                "params": counts[size][preset], "val_bpb": curve[-1][1], "tail_drop": tail_drop(curve), "curve": curve,
                "checkpoint": str(folder), **environment(device)}

    def run_failed(job, reason):
        size, seed, tokens, family = job
        return {"kind": "run", "family": family, "size": size, "preset": presets[size][family], "seed": seed, "lr": best_lr[family],
                "tokens": tokens, "status": "error", "reason": reason, **environment(device)}

    # A family whose every sweep run failed (on some rank) has no rate: its runs wait for a rerun.
    jobs = [(size, seed, tokens, family) for size, seed, tokens in plan for family in a.families if family in best_lr
            and not any(r["kind"] == "run" and r["preset"] == presets[size][family] and r["seed"] == seed for r in done)]
    errors += distributed.run_jobs(jobs, run, log, here, run_failed)

    done = finished(read_records(log))
    jobs = [(size, family) for size in a.sizes for family in a.families
            if not any(r["kind"] == "speed" and r["preset"] == presets[size][family] for r in done)]
    # MFU needs the accelerator's bf16 matmul rate (of this rank's GPU); on the CPU it is left out.
    peak = matmul_flops(device) if device.type == "cuda" and jobs else None

    def speed(job):
        size, family = job
        preset = presets[size][family]
        tok_s = train.throughput(preset, tokenizer, batch=a.batch, seq_len=a.seq_len, device=device)
        return {"kind": "speed", "family": family, "size": size, "preset": preset, "tokens_per_s": tok_s,
                "mfu": None if peak is None else 6 * counts[size][preset] * tok_s / peak, "matmul_flops": peak, "batch": a.batch,
                "seq_len": a.seq_len, **environment(device)}

    def speed_failed(job, reason):
        size, family = job
        return {"kind": "speed", "family": family, "size": size, "preset": presets[size][family], "status": "error", "reason": reason,
                **environment(device)}

    errors += distributed.run_jobs(jobs, speed, log, here, speed_failed)
    if here.rank != 0:
        return None

    records = finished(read_records(log))
    if a.include_path:
        from eval import quality

        checkpoints = [str(run_folder(presets[size][family], seed)) for size, seed, _ in plan for family in a.families
                       if any(r["kind"] == "run" and r["preset"] == presets[size][family] and r["seed"] == seed for r in records)]
        quality.main(["--checkpoints", *checkpoints, "--tasks", a.tasks, "--include-path", a.include_path, "--out", str(out / "quality")])

    rows = summary_rows(records)
    text = table(rows)
    (out / "study.md").write_text(text)
    print(text)
    plot_curves(records, out / "curves.png")
    for record in errors:
        print(f"error: {record['kind']} {record['preset']}: {record['reason']} (recorded in {log}; a rerun retries it)", file=sys.stderr)
    return {"jsonl": str(log), "table": str(out / "study.md"), "curves": str(out / "curves.png"), "lr": best_lr, "rows": rows,
            "errors": [f"{r['kind']} {r['preset']}: {r['reason']}" for r in errors]}


def main(argv=None):
    here = distributed.world()
    try:
        with decoders.user_errors(), distributed.quiet_unless_lead(here):
            a = parse_args(argv)
            cli.check_output_dir(a.out, "--out")
            result = study(a, here)
        if result is not None:
            print(json.dumps(result))
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main()
