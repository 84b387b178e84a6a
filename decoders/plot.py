"""The context-scaling figure: decode tokens/s per sequence against context (log-scaled axes), one
solid line per (model, batch, T) of the lab, one dotted line per peer row (`hf-eager:llama-1b`, ...)
in its model's colour with the peer's own marker, and, dashed in the same colour, each model's
bandwidth roofline, so a model and the peers run on its shape read side by side. A point measured in
several runs is drawn from the newest (the last record of it in the files)."""

from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEER_MARKERS = "s^vDP*X"


def label_of(r: dict) -> str:
    return r["model"] + (f" T={r['iterations']}" if r.get("iterations") else "") + (f" b={r['batch']}" if r["batch"] != 1 else "")


def roofline(points: list[dict]) -> list[float] | None:
    """Tokens/s per sequence at the roofline step time, or None when a point lacks it."""
    roof = [r["tokens_per_pass"] / (r["roofline_ms"] * 1e-3) for r in points if r.get("roofline_ms")]
    return roof if len(roof) == len(points) else None


def latest_points(records: list[dict]) -> dict[str, list[dict]]:
    """The measured points of each series (label), one per (context, batch): the last one in
    `records`, so a result file that holds a point from several runs draws the newest."""
    latest = {}
    for r in records:
        if r.get("status") == "ok" and r.get("decode_tok_s_per_seq"):
            latest[label_of(r), r["ctx"], r["batch"]] = r
    series = defaultdict(list)
    for (label, _, _), r in latest.items():
        series[label].append(r)
    return series


def plot_context_scaling(records: list[dict], path: str) -> None:
    series = latest_points(records)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    lab = {label: points for label, points in series.items() if not points[0].get("peer")}
    peer = {label: points for label, points in series.items() if points[0].get("peer")}
    colours = {}
    for label, points in sorted(lab.items()):
        points.sort(key=lambda r: r["ctx"])
        ctx = [r["ctx"] for r in points]
        (line,) = ax.plot(ctx, [r["decode_tok_s_per_seq"] for r in points], marker="o", label=label)
        colours[points[0]["model"], points[0]["batch"]] = line.get_color()
        if (roof := roofline(points)) is not None:
            ax.plot(ctx, roof, linestyle="--", color=line.get_color(), alpha=0.6)
    markers = {}
    for label, points in sorted(peer.items()):
        points.sort(key=lambda r: r["ctx"])
        ctx = [r["ctx"] for r in points]
        marker = markers.setdefault(points[0]["peer"], PEER_MARKERS[len(markers) % len(PEER_MARKERS)])
        # A peer is drawn dotted in its model's colour; a model measured only through peers gets a
        # colour (and its roofline) from the first of them.
        key = (points[0]["preset"], points[0]["batch"])
        first = key not in colours
        (line,) = ax.plot(ctx, [r["decode_tok_s_per_seq"] for r in points], marker=marker, linestyle=":", color=colours.get(key), label=label)
        colours.setdefault(key, line.get_color())
        if first and (roof := roofline(points)) is not None:
            ax.plot(ctx, roof, linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s per sequence")
    ax.set_title("Decode throughput against context (dashed: bandwidth roofline of each model)")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=7, ncol=2 if len(series) > 8 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """Redraw the figure from result files: `python -m decoders.plot results/a.jsonl ... --out scaling.png`."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m decoders.plot", description=main.__doc__)
    p.add_argument("files", nargs="+", help="JSON lines written by decoders.compare")
    p.add_argument("--out", required=True, help="PNG to write")
    a = p.parse_args(argv)
    records = [json.loads(line) for f in a.files for line in open(f) if line.strip()]
    plot_context_scaling(records, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
