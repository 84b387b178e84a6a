"""The context-scaling figure: decode tokens/s per sequence against context (log-scaled axes), one
solid line per (model, batch, T) of the lab, one dotted line per peer row (`hf-eager:llama-1b`, ...)
in its model's colour with the peer's own marker, and, dashed in the same colour, each model's
bandwidth roofline, so a model and the peers run on its shape read side by side.

Records are never merged across runs that differ in anything that changes a figure: a series (model
or peer row, batch, T) is drawn from one run, the records sharing impl, dtype, device, new tokens and
git sha, and of several runs the newest (by the records' `time`) is drawn; the others are reported as
left out. A context a run measured twice is drawn from its newer record. A line joins only contexts
next to each other among those the figure shows, so a series measured at 4k and 128k is two points,
not a line through contexts never measured. The title says the device, dtype and batch of what is
drawn (a label adds whichever of them differs between series).

    python -m decoders.plot results/compare_triton.jsonl results/compare_peers.jsonl --out scaling.png
"""

import json
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEER_MARKERS = "s^vDP*X"
# What makes two records of one series belong to different runs (a figure never mixes them).
RUN_FIELDS = ("impl", "dtype", "device", "new_tokens", "git_sha")


def series_key(r: dict) -> tuple:
    """The series a record belongs to: its model (or peer row), batch and Mask-Predict T."""
    return r["model"], r.get("batch"), r.get("iterations")


def run_key(r: dict) -> tuple:
    return tuple(r.get(f) for f in RUN_FIELDS)


def label_of(r: dict) -> str:
    return r["model"] + (f" T={r['iterations']}" if r.get("iterations") else "") + (f" b={r['batch']}" if r["batch"] != 1 else "")


def describe_run(key: tuple) -> str:
    return ", ".join(f"{f} {str(v)[:12] if f == 'git_sha' else v}" for f, v in zip(RUN_FIELDS, key) if v is not None)


def select(records: list[dict]) -> tuple[dict[tuple, list[dict]], list[str]]:
    """The points each series draws (its newest run, one record per context, sorted by context) and a
    line per run left out. Only measured points (status ok, a decode rate) count."""
    runs = defaultdict(lambda: defaultdict(dict))
    for order, r in enumerate(records):
        if r.get("status") == "ok" and r.get("decode_tok_s_per_seq"):
            by_ctx = runs[series_key(r)][run_key(r)]
            stamp = (r.get("time") or "", order)
            if r["ctx"] not in by_ctx or by_ctx[r["ctx"]][0] <= stamp:
                by_ctx[r["ctx"]] = (stamp, r)
    chosen, left_out = {}, []
    for series, by_run in runs.items():
        newest = max(by_run, key=lambda k: max(stamp for stamp, _ in by_run[k].values()))
        chosen[series] = [r for _, r in sorted(by_run[newest].values(), key=lambda sr: sr[1]["ctx"])]
        older = [key for key in by_run if key != newest]
        if older:
            differ = [f for i, f in enumerate(RUN_FIELDS) if any(key[i] != newest[i] for key in older)]
            left_out.append(f"{label_of(chosen[series][0])}: left out {sum(len(by_run[k]) for k in older)} point(s) of "
                            f"{len(older)} older run(s) differing in {', '.join(differ)} (drawn: {describe_run(newest)})")
    return chosen, left_out


def with_gaps(points: list[dict], values: list[float], contexts: list[int]) -> tuple[list[float], list[float]]:
    """x and y with a NaN wherever a context of the figure lies between two of the series' points,
    so that matplotlib breaks the line there instead of drawing through a context never measured."""
    position = {c: i for i, c in enumerate(contexts)}
    xs, ys = [], []
    for i, (r, v) in enumerate(zip(points, values)):
        if i and position[r["ctx"]] != position[points[i - 1]["ctx"]] + 1:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(r["ctx"])
        ys.append(v)
    return xs, ys


def roofline(points: list[dict]) -> list[float] | None:
    """Tokens/s per sequence at the roofline step time, or None when a point lacks it."""
    roof = [r["tokens_per_pass"] / (r["roofline_ms"] * 1e-3) for r in points if r.get("roofline_ms")]
    return roof if len(roof) == len(points) else None


def shared(series: dict[tuple, list[dict]], field: str) -> list:
    return sorted({str(points[0].get(field)) for points in series.values()})


def title_of(series: dict[tuple, list[dict]]) -> tuple[str, list[str]]:
    """The title (device, dtype, batch of the drawn series) and the run fields that differ between
    series, which their labels then name."""
    parts, varying = [], []
    for field in ("device", "dtype"):
        values = shared(series, field)
        if len(values) == 1:
            parts.append(values[0])
        else:
            varying.append(field)
    impls = shared({k: p for k, p in series.items() if not p[0].get("peer")}, "impl")
    if len(impls) > 1:
        varying.append("impl")
    batches = sorted({points[0]["batch"] for points in series.values()})
    parts.append(f"batch {', '.join(map(str, batches))}")
    return "Decode throughput against context: " + ", ".join(parts) + "\n(dashed: bandwidth roofline of each model)", varying


def plot_context_scaling(records: list[dict], path: str) -> list[str]:
    """Draw the figure into `path`; returns the warnings (runs left out), one line each."""
    series, left_out = select(records)
    contexts = sorted({r["ctx"] for points in series.values() for r in points})
    title, varying = title_of(series) if series else ("Decode throughput against context (nothing measured)", [])

    def name(points):
        extra = [str(points[0].get(f)) for f in varying if points[0].get(f) is not None]
        return label_of(points[0]) + (f" ({', '.join(extra)})" if extra else "")

    fig, ax = plt.subplots(figsize=(9, 5.5))
    lab = {k: points for k, points in series.items() if not points[0].get("peer")}
    peer = {k: points for k, points in series.items() if points[0].get("peer")}
    colours = {}
    for _, points in sorted(lab.items(), key=lambda kv: label_of(kv[1][0])):
        xs, ys = with_gaps(points, [r["decode_tok_s_per_seq"] for r in points], contexts)
        (line,) = ax.plot(xs, ys, marker="o", label=name(points))
        colours[points[0]["model"], points[0]["batch"]] = line.get_color()
        if (roof := roofline(points)) is not None:
            ax.plot(*with_gaps(points, roof, contexts), linestyle="--", color=line.get_color(), alpha=0.6)
    markers = {}
    for _, points in sorted(peer.items(), key=lambda kv: label_of(kv[1][0])):
        marker = markers.setdefault(points[0]["peer"], PEER_MARKERS[len(markers) % len(PEER_MARKERS)])
        # A peer is drawn dotted in its model's colour; a model measured only through peers gets a
        # colour (and its roofline) from the first of them.
        key = (points[0]["preset"], points[0]["batch"])
        first = key not in colours
        xs, ys = with_gaps(points, [r["decode_tok_s_per_seq"] for r in points], contexts)
        (line,) = ax.plot(xs, ys, marker=marker, linestyle=":", color=colours.get(key), label=name(points))
        colours.setdefault(key, line.get_color())
        if first and (roof := roofline(points)) is not None:
            ax.plot(*with_gaps(points, roof, contexts), linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s per sequence")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=7, ncol=2 if len(series) > 8 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return left_out


def read_records(files: list[str]) -> list[dict]:
    """Every JSON line of the result files; a missing file or a line that is not JSON is a UsageError."""
    from decoders.base import UsageError

    records = []
    for name in files:
        try:
            with open(name) as f:
                lines = f.readlines()
        except OSError as e:
            raise UsageError(f"{name}: cannot read ({e.strerror})") from None
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(f"{name}:{number}: not a JSON line (expected decoders.compare records)") from None
                if not isinstance(record, dict) or "model" not in record or "status" not in record:
                    raise UsageError(f"{name}:{number}: not a decoders.compare record (no model or status)")
                records.append(record)
    return records


def main(argv=None) -> int:
    """Redraw the figure from result files: `python -m decoders.plot results/a.jsonl ... --out scaling.png`."""
    from decoders import user_errors
    from decoders.base import UsageError
    from decoders.cli import Parser, check_figure_file

    p = Parser(prog="python -m decoders.plot", description=main.__doc__)
    p.add_argument("files", nargs="+", help="JSON lines written by decoders.compare")
    p.add_argument("--out", required=True, help="figure to write (.png, .pdf, .svg)")
    a = p.parse_args(argv)
    with user_errors():
        check_figure_file(a.out, "--out")
        records = read_records(a.files)
        series, _ = select(records)
        if not series:
            raise UsageError(f"no measured point (status ok) in {', '.join(a.files)}")
    for line in plot_context_scaling(records, a.out):
        print(f"warning: {line}", file=sys.stderr)
    for points in sorted(series.values(), key=lambda p: label_of(p[0])):
        first = points[0]
        print(f"{label_of(first)}: {len(points)} point(s) at {', '.join(str(r['ctx']) for r in points)} ({describe_run(run_key(first))})")
    print(f"figure written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
