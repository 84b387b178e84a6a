"""The context-scaling figure: decode tokens/s per sequence against context, log-scaled context axis,
one line per (model, batch, T) and, dashed in the same colour, that model's roofline."""

from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_context_scaling(records: list[dict], path: str) -> None:
    series = defaultdict(list)
    for r in records:
        if r.get("status") == "ok" and r.get("decode_tok_s_per_seq"):
            label = r["model"] + (f" T={r['iterations']}" if r.get("iterations") else "") + (f" b={r['batch']}" if r["batch"] != 1 else "")
            series[label].append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in sorted(series.items()):
        points.sort(key=lambda r: r["ctx"])
        ctx = [r["ctx"] for r in points]
        (line,) = ax.plot(ctx, [r["decode_tok_s_per_seq"] for r in points], marker="o", label=label)
        roof = [r["tokens_per_pass"] / (r["roofline_ms"] * 1e-3) for r in points if r.get("roofline_ms")]
        if len(roof) == len(points):
            ax.plot(ctx, roof, linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s per sequence")
    ax.set_title("Decode throughput against context (dashed: bandwidth roofline)")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
