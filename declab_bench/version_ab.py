"""A/B of two source trees of the lab on the graphed decode step (GPU only): the no-regression check.

    git archive OLD_COMMIT | tar -x -C /tmp/before
    python -m declab_bench.version_ab results/version_ab.jsonl --tree before=/tmp/before --tree after=.

For each model (`--models`, default llama-1b, mamba2-1.3b, rwkv7-1.5b: random weights from `--seed`)
one worker process per tree loads the decoder from that tree (PYTHONPATH set to it), prefills every
batch of `--batch` (default 1, 16, 64) at context `--ctx` (default 4k), and runs one step eagerly,
which compiles, measures the per-shape GEMV choices and captures the CUDA graph. The workers are set
up one after the other (two at once would time their GEMV candidates against each other), then
replay their steps in `--rounds` interleaved rounds (the order alternating round by round), each round
`--steps` steps per batch timed with CUDA events (median per round). The greedy tokens of every step
are hashed (`tokens_sha`, all steps so far): a change that keeps the arithmetic gives the same tokens.
Each worker also reports its GEMV picks (shape, cuBLAS / unfused or Triton config), since a pick that
flips on a near tie changes the tokens without any code change.

One JSON line per (model, batch, tree, round) is appended as it is measured; then one summary line per
(model, batch): each tree's median step time and its spread (min..max over rounds), the change in
percent, whether the two spreads overlap, whether the tokens and the GEMV picks are identical. A table
is printed; the last stdout line is one JSON document of the summaries.

Time on an H200 for the defaults: ~60-90 s per model and tree cold (Triton compilation, the GEMV
measurements, three prefills of 4k), about half that for the second tree when the Triton cache is
shared; the rounds take seconds. About 5 minutes for both trees and three models.
"""

import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("llama-1b", "mamba2-1.3b", "rwkv7-1.5b")
# Prefix of the worker's protocol lines on its stdout.
MESSAGE = "version_ab: "


def build_parser():
    from decoders.cli import Parser

    p = Parser(prog="version_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON lines file the rounds and summaries are appended to")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (exactly two; the first is the baseline)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    p.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--ctx", default="4k", help="context of every sequence (prompt + decoded tokens)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per batch per round")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--setup-timeout", type=float, default=600.0, help="seconds a worker may take to get ready")
    return p


def parse_trees(items) -> list:
    """[(name, Path)] from NAME=PATH items: exactly two, distinct names, each folder a source tree of
    the lab (it has decoders/ and configs/)."""
    from decoders import UsageError

    if len(items) != 2:
        raise UsageError(f"--tree: give exactly two trees (NAME=PATH), got {len(items)}")
    trees = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--tree wants NAME=PATH, got {item!r}")
        folder = Path(path).expanduser().resolve()
        if not (folder / "decoders" / "__init__.py").is_file() or not (folder / "configs").is_dir():
            raise UsageError(f"--tree {name}: {folder} is not a source tree of the lab (no decoders/ or configs/)")
        trees.append((name, folder))
    if trees[0][0] == trees[1][0]:
        raise UsageError(f"--tree: the two trees need different names, both are {trees[0][0]!r}")
    return trees


def check_args(a) -> dict:
    """Everything the run needs, checked before any work (UsageError otherwise)."""
    from decoders import UsageError
    from decoders.cli import check_records_file
    from decoders.compare import parse_ctx, parse_ints

    trees = parse_trees(a.tree)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if not models:
        raise UsageError("--models: no model given")
    for name, folder in trees:
        for m in models:
            if not (folder / "configs" / f"{m}.json").is_file():
                raise UsageError(f"--models: tree {name} ({folder}) has no preset {m!r}")
    ctx = parse_ctx(a.ctx)
    if len(ctx) != 1:
        raise UsageError(f"--ctx: one context, got {a.ctx!r}")
    batches = parse_ints(a.batch, "batch")
    if a.rounds < 1 or a.steps < 1:
        raise UsageError(f"--rounds and --steps must be >= 1, got {a.rounds} and {a.steps}")
    if ctx[0] <= a.rounds * a.steps + 2:
        raise UsageError(f"--ctx {ctx[0]} leaves no prompt for {a.rounds * a.steps + 2} decoded tokens")
    return {"out": check_records_file(a.out, "out"), "trees": trees, "models": models, "ctx": ctx[0], "batches": batches,
            "rounds": a.rounds, "steps": a.steps, "seed": a.seed, "setup_timeout": a.setup_timeout}


def normalise_picks(gemv) -> list:
    """A tree's GEMV picks as sorted [M, N, K, impl, config] (config only for Triton picks), whatever
    the tree's API: one `choices()` list of records, or a dict per op from several `*_choices()`."""
    tables = []
    listed = gemv.choices()
    if isinstance(listed, list):
        tables = [(r["M"], r["N"], r["K"], r) for r in listed]
    else:
        for name in dir(gemv):
            fn = getattr(gemv, name)
            if name.endswith("choices") and callable(fn):
                tables += [(key[0], key[1], key[2], rec) for key, rec in fn().items()]
    return sorted([m, n, k, rec["impl"], rec.get("triton_config") if rec["impl"] == "triton" else None]
                  for m, n, k, rec in tables)


def worker(spec: dict) -> int:
    """Run inside one tree: set up every batch, print {"ready": ...}, then one JSON line per "round"
    line on stdin; stop at "quit" or the end of stdin."""
    import torch

    import decoders

    try:
        from declab_kernels import gemv
    except ImportError:
        gemv = None
    t0 = time.perf_counter()
    dec = decoders.load(spec["model"], device="cuda", impl="triton", seed=spec["seed"])
    new_tokens = spec["rounds"] * spec["steps"] + 2
    states, tokens = {}, {}
    for batch in spec["batches"]:
        g = torch.Generator().manual_seed(spec["seed"])
        prompts = torch.randint(0, dec.vocab_size, (batch, spec["ctx"] - new_tokens), generator=g)
        state = dec.prefill(prompts, max_new_tokens=new_tokens)
        # eager: compiles, measures the GEMV choices, captures the graph
        dec.step(state)
        states[batch], tokens[batch] = state, []
    torch.cuda.synchronize()
    print(MESSAGE + json.dumps({"ready": True, "setup_s": time.perf_counter() - t0, "gpu": torch.cuda.get_device_name(),
                      "gemv_picks": normalise_picks(gemv) if gemv is not None else None}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        out = []
        for batch, state in states.items():
            events = [torch.cuda.Event(enable_timing=True) for _ in range(spec["steps"] + 1)]
            events[0].record()
            for i in range(spec["steps"]):
                tokens[batch].append(dec.step(state).tokens.clone())
                events[i + 1].record()
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]
            sha = hashlib.sha1(torch.cat(tokens[batch], 1).cpu().numpy().tobytes()).hexdigest()[:16]
            out.append({"batch": batch, "step_us": statistics.median(times), "tokens_sha": sha})
        print(MESSAGE + json.dumps({"round": out}), flush=True)
    return 0


class Worker:
    """One tree's worker process for one model (its stdout read line by line)."""

    def __init__(self, name, folder, spec, timeout):
        env = dict(os.environ, PYTHONPATH=str(folder))
        self.name, self.folder = name, folder
        # why: run from the tree's root (sys.path[0] is it, not this file's folder), so that every lab
        # module the worker imports is that tree's
        code = f"import runpy, sys; sys.argv = [{str(Path(__file__).resolve())!r}, '--worker', {json.dumps(spec)!r}]; " \
               f"runpy.run_path(sys.argv[0], run_name='__main__')"
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=folder, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.ready = self.read(timeout)

    def read(self, timeout=None) -> dict:
        """The worker's next message; other lines it prints (a library's log) go to stderr."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                self.proc.kill()
                raise RuntimeError(f"the worker of tree {self.name} ({self.folder}) was not ready within {timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise RuntimeError(f"the worker of tree {self.name} ({self.folder}) ended with exit code {code}")
            if line.startswith(MESSAGE):
                return json.loads(line[len(MESSAGE):])
            print(f"[{self.name}] {line.rstrip()}", file=sys.stderr)

    def round(self) -> list:
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        return self.read()["round"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def summarize(records: list, trees: list) -> list:
    """One summary per (model, batch) from the round records: each tree's median step time (µs) and
    spread (min..max over rounds), the change of the second tree against the first in percent,
    whether the spreads overlap, whether the last token hashes (all steps) and the GEMV picks agree."""
    base, other = trees
    groups = {}
    for r in records:
        groups.setdefault((r["model"], r["batch"]), {}).setdefault(r["tree"], []).append(r)
    out = []
    for (model, batch), by_tree in groups.items():
        row = {"kind": "version_ab_summary", "model": model, "batch": batch, "trees": {}}
        for name in (base, other):
            rounds = sorted(by_tree.get(name, []), key=lambda r: r["round"])
            if not rounds:
                continue
            times = [r["step_us"] for r in rounds]
            row["trees"][name] = {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times),
                                  "rounds": len(times), "tokens_sha": rounds[-1]["tokens_sha"],
                                  "gemv_picks": rounds[-1].get("gemv_picks")}
            row["ctx"] = rounds[-1]["ctx"]
        a, b = row["trees"].get(base), row["trees"].get(other)
        if a and b:
            row["change_pct"] = 100.0 * (b["median_us"] - a["median_us"]) / a["median_us"]
            row["spreads_overlap"] = max(a["min_us"], b["min_us"]) <= min(a["max_us"], b["max_us"])
            row["tokens_identical"] = a["tokens_sha"] == b["tokens_sha"]
            row["picks_identical"] = a["gemv_picks"] == b["gemv_picks"]
        out.append(row)
    return out


def table(summaries: list, trees: list) -> str:
    """The summaries as a text table: per (model, batch) each tree's median and spread, the change,
    and the token / pick agreement."""
    base, other = trees
    lines = [f"{'model':<14}{'batch':>6}  {base + ' us (spread)':>24}  {other + ' us (spread)':>24}  {'change':>8}  "
             f"{'overlap':>7}  {'tokens':>9}  {'picks':>9}"]

    def cell(t):
        return "-" if t is None else f"{t['median_us']:.1f} ({t['min_us']:.1f}..{t['max_us']:.1f})"

    def same(v):
        return "-" if v is None else "identical" if v else "DIFFER"

    for s in summaries:
        a, b = s["trees"].get(base), s["trees"].get(other)
        change = f"{s['change_pct']:+.1f}%" if "change_pct" in s else "-"
        overlap = "-" if "spreads_overlap" not in s else "yes" if s["spreads_overlap"] else "no"
        lines.append(f"{s['model']:<14}{s['batch']:>6}  {cell(a):>24}  {cell(b):>24}  {change:>8}  {overlap:>7}  "
                     f"{same(s.get('tokens_identical')):>9}  {same(s.get('picks_identical')):>9}")
    return "\n".join(lines)


def run(a) -> int:
    from decoders import UsageError
    from decoders.cli import JsonlSink

    cfg = check_args(a)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("version_ab times CUDA graphs: it needs a GPU")
    sink = JsonlSink(cfg["out"])
    names = [n for n, _ in cfg["trees"]]
    records = []
    for model in cfg["models"]:
        spec = {"model": model, "batches": cfg["batches"], "ctx": cfg["ctx"], "rounds": cfg["rounds"],
                "steps": cfg["steps"], "seed": cfg["seed"]}
        workers = []
        try:
            for name, folder in cfg["trees"]:
                workers.append(Worker(name, folder, spec, cfg["setup_timeout"]))
                print(f"{model}: tree {name} ready in {workers[-1].ready['setup_s']:.0f} s", flush=True)
            for r in range(cfg["rounds"]):
                for w in (workers if r % 2 == 0 else workers[::-1]):
                    for point in w.round():
                        rec = {"kind": "version_ab", "model": model, "ctx": cfg["ctx"], "tree": w.name, "tree_path": os.path.relpath(w.folder),
                               "round": r, "steps": cfg["steps"], "gpu": w.ready["gpu"], "setup_s": w.ready["setup_s"],
                               "gemv_picks": w.ready["gemv_picks"], **point}
                        sink.append(rec)
                        records.append(rec)
                        print(f"{model} batch {point['batch']:>3} round {r} {w.name:>10}: {point['step_us']:8.1f} us  "
                              f"tokens {point['tokens_sha']}", flush=True)
        finally:
            for w in workers:
                w.close()
    summaries = summarize(records, names)
    for s in summaries:
        sink.append(s)
    print(table(summaries, names))
    print(json.dumps({"out": sink.where, "summaries": [{k: v for k, v in s.items() if k != "trees"} | {
        "trees": {n: {k: v for k, v in t.items() if k != "gemv_picks"} for n, t in s["trees"].items()}} for s in summaries]}))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]))
    from decoders.cli import run_command

    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
