"""`python -m eval.report`: the lab's speed and quality records on one page.

    python -m eval.report results/compare_*.jsonl results/quality/*.jsonl --out results/report/
    python -m eval.report FILES... --out report/ --ctx 4k --load-batch 64

Joins the speed records (`decoders.compare`, a serving benchmark) and the quality records
(`eval.quality`) of the same models by the rule in `eval.report_join`, and writes into --out:

- report.html: one self-contained page (figures embedded, no network needed): the frontier of
  quality against decode tokens/s at batch 1 and at a serving load with its Pareto front; context
  scaling (tokens/s and memory against context, recall at distance); Mask-Predict against its
  iterations T beside the autoregressive families; cost and energy per token where recorded; every
  figure with the device, dtype, commits and commands of its records and a table linking each point
  to the records it came from, which the page holds;
- frontier.png, context.png, maskpredict.png, cost.png: the figures (cost.png only when a record has
  cost or energy);
- summary.md: the joined points, what is missing, the refused joins.

Records without quality (or without speed) are listed as such. A point measured more than once is
drawn from its last record (files in the order given). Bad input is one line on stderr and exit
code 2; the last stdout line is one JSON document.
"""

import base64
import html
import json
import re
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

import decoders  # noqa: E402
from decoders import cli  # noqa: E402
from decoders.compare import parse_size  # noqa: E402
from eval.report_join import GENPPL_TASK, Join, QualityRun, Record, join, read_records, settings_label, throughput  # noqa: E402

# One colour (and marker) per family in every figure.
FAMILY_STYLE = {
    "transformer": ("#1f77b4", "o"),
    "mamba2": ("#ff7f0e", "s"),
    "rwkv7": ("#2ca02c", "^"),
    "maskpredict": ("#d62728", "D"),
}
OTHER_STYLE = ("#7f7f7f", "x")
# Line styles of the models and settings within one family (dotted is for peers).
LINESTYLES = ("-", "--", "-.")
COPY_TASK = re.compile(r"declab_copy_(\d+)$")
MQAR_TASK = re.compile(r"declab_mqar_(\d+)$")
GB = 1e9
# The serving benchmark's cost (USD, from its GPU-hour price) and energy (J, from the GPU's power readings).
COST, ENERGY = "cost_per_1k_output_tokens", "energy_j_per_output_token"


def style(family: str) -> tuple[str, str]:
    return FAMILY_STYLE.get(family, OTHER_STYLE)


def family_handles(families):
    """Legend entries of the families drawn, in the fixed order."""
    known = [f for f in FAMILY_STYLE if f in families] + sorted(set(families) - set(FAMILY_STYLE))
    return [Line2D([], [], color=style(f)[0], marker=style(f)[1], linestyle="", label=f) for f in known]


def number(v, _pos=None) -> str:
    """Tick label of a quantity: 0.5 -> '0.5', 500 -> '500', 20000 -> '20k', 2e6 -> '2M'."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:g}{suffix}"
    return f"{v:g}"


def count(v, _pos=None) -> str:
    """Tick label of a small count: 1024 -> '1024'."""
    return f"{v:g}"


def tokens(v, _pos=None) -> str:
    """Tick label of a context: 4096 -> '4k', 131072 -> '128k'."""
    return f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"


def scale(ax, which: str, values, formatter=number, base=10) -> None:
    """Log scale on axis `which` ('x' or 'y') when the values span more than a factor of 4, plain
    tick labels either way."""
    values = [v for v in values if v and v > 0]
    axis = ax.xaxis if which == "x" else ax.yaxis
    if values and max(values) / min(values) > 4:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=base)
        if base == 10 and max(values) / min(values) < 300:
            # 1-2-5 steps, so a span of one or two decades still has several labelled ticks.
            axis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        axis.set_minor_formatter(NullFormatter())
    axis.set_major_formatter(FuncFormatter(formatter))


def speed_label(r: dict) -> str:
    return str(r.get("model", "?")) + settings_label(r.get("iterations"), r)


def load_of(r: dict) -> str:
    """The load a speed record ran at: 'ctx 4096, batch 64' (compare), 'poisson rate 8/s' or '16 users'
    (a serving benchmark)."""
    if r.get("users") is not None:
        return f"{r['users']} users"
    if r.get("rate") is not None:
        return f"{r.get('arrivals') or ''} rate {r['rate']}/s".strip()
    return ", ".join(f"{k} {r[k]}" for k in ("ctx", "batch") if r.get(k) is not None)


class SeriesStyles:
    """Within one family, the n-th series gets its own line style, then the same styles with open
    markers, so series of one colour stay apart."""

    def __init__(self):
        self.seen: dict[tuple, int] = {}

    def __call__(self, family: str, label: str) -> dict:
        n = self.seen.setdefault((family, label), sum(1 for k in self.seen if k[0] == family))
        colour, marker = style(family)
        face = "white" if (n // len(LINESTYLES)) % 2 else colour
        return {"color": colour, "marker": marker, "linestyle": LINESTYLES[n % len(LINESTYLES)], "markerfacecolor": face}


def no_data(ax, text: str) -> None:
    """An empty panel that says what it lacks."""
    ax.text(0.5, 0.5, textwrap.fill(text, 38), ha="center", va="center", transform=ax.transAxes, fontsize=9, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def provenance_line(records: list[Record]) -> str:
    """Device, dtype and commits of the records one figure draws, for the figure's footer."""
    if not records:
        return "no records"
    devices = sorted({str(r.data.get("device")) for r in records})
    dtypes = sorted({str(r.data.get("dtype") or (r.data.get("decoder") or {}).get("dtype")) for r in records})
    shas = sorted({str(r.data.get("git_sha", "unknown"))[:7] for r in records})
    commits = ", ".join(shas[:6]) + (f" and {len(shas) - 6} more" if len(shas) > 6 else "")
    return f"{len(records)} records; device {', '.join(devices)}; dtype {', '.join(dtypes)}; commits {commits}"


class Figure:
    """One figure of the page: the PNG, what it shows, the records it draws, its point table."""

    def __init__(self, name: str, title: str, text: str):
        self.name, self.title, self.text = name, title, text
        self.records: list[Record] = []
        self.rows: list[dict] = []
        self.path: Path | None = None

    def use(self, *records: Record) -> None:
        for r in records:
            if all(r is not s for s in self.records):
                self.records.append(r)

    def save(self, fig, out: Path) -> None:
        # Room at the bottom for the provenance line, below the axes' labels.
        fig.get_layout_engine().set(rect=(0, 0.03, 1, 0.97))
        fig.text(0.005, 0.003, provenance_line(self.records), fontsize=7, color="#444444", ha="left", va="bottom")
        self.path = out / f"{self.name}.png"
        fig.savefig(self.path, dpi=110)
        plt.close(fig)


class Selection:
    """The speed point of each quality run that a frontier panel draws."""

    def __init__(self, j: Join, ctx: int, load_batch: int | None):
        self.j, self.ctx = j, ctx
        batches = sorted({s.data.get("batch") for s in j.speed if isinstance(s.data.get("batch"), int) and s.data["batch"] > 1})
        self.load_batch = load_batch if load_batch is not None else (batches[-1] if batches else None)

    def batch1(self, run: QualityRun) -> Record | None:
        found = [s for s, _ in self.j.speed_of(run) if s.data.get("batch") == 1 and s.data.get("ctx") == self.ctx and "decode_tok_s_per_seq" in s.data]
        return found[-1] if found else None

    def load(self, run: QualityRun) -> Record | None:
        """The serving benchmark's highest output tokens/s, else compare's point at the load batch."""
        serving = [s for s, _ in self.j.speed_of(run) if "output_tok_s" in s.data]
        if serving:
            return max(serving, key=lambda s: s.data["output_tok_s"])
        found = [s for s, _ in self.j.speed_of(run) if s.data.get("batch") == self.load_batch and s.data.get("ctx") == self.ctx]
        return found[-1] if found else None

    def key(self, run: QualityRun, rec: Record) -> str:
        return next(k for s, k in self.j.speed_of(run) if s is rec)


def pareto(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """The non-dominated points (more tokens/s, better quality), sorted by tokens/s."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], p[1] if not higher_is_better else -p[1])):
        if not front or (y > front[-1][1] if higher_is_better else y < front[-1][1]):
            front.append((x, y))
    return sorted(front)


QUALITY_AXES = (
    ("bpb", "held-out bits per byte (lower is better)", False),
    ("acc", "task accuracy (higher is better)", True),
)


def frontier_figure(j: Join, sel: Selection, out: Path, bpb_task: str, acc_task: str) -> Figure:
    f = Figure("frontier", "Frontier: quality against decode speed",
               f"Each point is one trained model and decoding setting (Mask-Predict once per T), its quality from "
               f"`{bpb_task}` (bits per byte on held-out text) and `{acc_task}` (accuracy), its speed from the joined "
               f"speed record at context {sel.ctx}: left, decode tokens/s of one sequence at batch 1; right, aggregate "
               f"tokens/s at a serving load (the serving benchmark's highest output tokens/s where one exists, else "
               f"`compare` at batch {sel.load_batch}). The dashed line is the Pareto front: no other point is both "
               f"faster and better. Up and to the right is better in the accuracy row, down and to the right in the "
               f"bits-per-byte row.")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    columns = (("batch 1", sel.batch1, "decode tokens/s per sequence, batch 1"),
               ("load", sel.load, f"aggregate tokens/s at the serving load (batch {sel.load_batch} or a serving benchmark)"))
    for row, (metric, ylabel, higher) in enumerate(QUALITY_AXES):
        task, name = (bpb_task, "bits_per_byte") if metric == "bpb" else (acc_task, "acc")
        for col, (column, pick, xlabel) in enumerate(columns):
            ax = axes[row][col]
            drawn = []
            for run in j.quality:
                q, s = run.metric(task, name), pick(run)
                if q is not None and s is not None:
                    drawn.append((s.data["decode_tok_s_per_seq"] if column == "batch 1" else throughput(s.data), q, run, s))
            drawn.sort(key=lambda p: p[0])
            pts = []
            for i, (x, q, run, s) in enumerate(drawn):
                colour, marker = style(run.family)
                ax.scatter([x], [q], color=colour, marker=marker, s=50, zorder=3)
                where = f" (serving, {load_of(s.data)})" if "output_tok_s" in s.data else ""
                # Neighbours along x label above and below in turn, so labels of close points do not overlap.
                ax.annotate(run.label + where, (x, q), textcoords="offset points", xytext=(5, 5 if i % 2 == 0 else -11), fontsize=7)
                pts.append((x, q))
                f.use(s, run.tasks[task])
                f.rows.append({"point": run.label, "family": run.family, "panel": f"{metric} / {column}", "tok/s": x, "quality": q,
                               "join key": sel.key(run, s), "records": [s, run.tasks[task]]})
            if not pts:
                no_data(ax, f"no model has both {task} and a joined speed record at context {sel.ctx} ({column})")
            else:
                front = pareto(pts, higher)
                if len(front) > 1:
                    ax.plot(*zip(*front), linestyle="--", color="#333333", alpha=0.6, zorder=2)
                scale(ax, "x", [p[0] for p in pts])
                ax.margins(0.15)
                ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
    fig.legend(handles=family_handles({run.family for run in j.quality}), loc="outside right upper", title="family", fontsize=8)
    fig.suptitle("Quality against decode tokens/s (dashed: Pareto front)")
    f.save(fig, out)
    return f


def latest_batch1(j: Join) -> dict[str, list[Record]]:
    """Batch-1 decode records with a context, one series per model and setting; a model measured
    with several kernels, dtypes or devices gets one series of each, named so."""
    series = {}
    for s in j.speed:
        r = s.data
        if r.get("batch") == 1 and r.get("ctx") and r.get("decode_tok_s_per_seq"):
            series.setdefault((speed_label(r), r.get("impl"), r.get("dtype"), r.get("device")), []).append(s)
    labels = [key[0] for key in series]
    named = {}
    for key, points in series.items():
        points.sort(key=lambda s: s.data["ctx"])
        named[key[0] if labels.count(key[0]) == 1 else f"{key[0]} ({', '.join(map(str, key[1:]))})"] = points
    return named


def distance_curves(run: QualityRun, pattern) -> list[tuple[int, float, Record]]:
    pts = [(int(m.group(1)), rec.data["metrics"].get("acc,none"), rec) for task, rec in run.tasks.items() if (m := pattern.match(task))]
    return sorted(p for p in pts if p[1] is not None)


def context_figure(j: Join, out: Path) -> Figure:
    f = Figure("context", "Context scaling",
               "Top: decode tokens/s of one sequence (batch 1) and peak GPU memory against the context, one line per "
               "model, the newest record of each point (dotted: a peer library on the model's shape). The transformer's "
               "KV cache grows with the context; the recurrent families carry a fixed-size state. Bottom: the quality "
               "the trained models keep with distance: copy accuracy against the length copied, and multi-query "
               "associative recall (MQAR) accuracy against the number of key-value pairs to recall.")
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    series = latest_batch1(j)
    lab_styles, peer_styles = SeriesStyles(), SeriesStyles()
    for label, points in sorted(series.items()):
        r0 = points[0].data
        family = r0.get("family", "?")
        if r0.get("peer"):
            look = {**peer_styles(family, label), "linestyle": ":", "alpha": 0.7}
        else:
            look = lab_styles(family, label)
        ctx = [s.data["ctx"] for s in points]
        axes[0][0].plot(ctx, [s.data["decode_tok_s_per_seq"] for s in points], label=label, **look)
        mem = [(s.data["ctx"], s.data["peak_memory_bytes"] / GB) for s in points if s.data.get("peak_memory_bytes")]
        if mem:
            axes[0][1].plot(*zip(*mem), label=label, **look)
        f.use(*points)
        for s in points:
            f.rows.append({"point": label, "family": r0.get("family"), "panel": "tokens/s, memory", "ctx": s.data["ctx"],
                           "tok/s": s.data["decode_tok_s_per_seq"], "memory GB": (s.data.get("peak_memory_bytes") or 0) / GB, "records": [s]})
    for ax, ylabel in ((axes[0][0], "decode tokens/s per sequence, batch 1"), (axes[0][1], "peak GPU memory (GB)")):
        if ax.lines:
            scale(ax, "x", [x for line in ax.lines for x in line.get_xdata()], tokens, base=2)
            scale(ax, "y", [y for line in ax.lines for y in line.get_ydata()])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            no_data(ax, "no batch-1 speed record with a context")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
    for ax, pattern, xlabel in ((axes[1][0], COPY_TASK, "tokens copied (distance from the copy)"), (axes[1][1], MQAR_TASK, "key-value pairs to recall (MQAR)")):
        styles = SeriesStyles()
        for run in j.quality:
            pts = distance_curves(run, pattern)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=run.label, **styles(run.family, run.label))
            f.use(*(p[2] for p in pts))
            f.rows.append({"point": run.label, "family": run.family, "panel": xlabel.split(" (")[0],
                           "accuracy": ", ".join(f"{n}: {a:.2f}" for n, a, _ in pts), "records": [p[2] for p in pts]})
        if ax.lines:
            scale(ax, "x", [x for line in ax.lines for x in line.get_xdata()], count, base=2)
            ax.set_ylim(-0.05, 1.05)
            if all(y == 0 for line in ax.lines for y in line.get_ydata()):
                ax.text(0.5, 0.5, "every run scores 0 at every point (the lines overlap)", ha="center", transform=ax.transAxes, fontsize=9, color="#555555")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            no_data(ax, "no quality record of this task")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("accuracy")
    fig.suptitle("Decode speed, memory and recall against context")
    f.save(fig, out)
    return f


def maskpredict_figure(j: Join, sel: Selection, out: Path, bpb_task: str) -> Figure:
    f = Figure("maskpredict", "Mask-Predict against its iterations T",
               "Mask-Predict fills a block of masked tokens in T refinement passes, so it commits block/T tokens per "
               "pass where an autoregressive model commits one: at the same compute (one pass each) it produces more "
               "tokens, and fewer passes cost quality. Left: held-out bits per byte against T (horizontal lines: the "
               "autoregressive families, which have no T); it scores one parallel pass, so it need not move with T. "
               "Middle: the generative perplexity of its samples under the autoregressive scorer, the quality T changes. "
               "Right: decode tokens/s at batch 1 against T from the joined speed records, "
               "labelled with tokens committed per pass, beside the autoregressive families (horizontal lines).")
    fig, axes = plt.subplots(1, 3, figsize=(14, 5.6), layout="constrained")
    mp = sorted((r for r in j.quality if r.family == "maskpredict" and r.iterations is not None), key=lambda r: r.iterations)
    ar = [r for r in j.quality if r.family != "maskpredict"]
    by_ckpt = {}
    for run in mp:
        by_ckpt.setdefault(run.checkpoint, []).append(run)
    colour, marker = style("maskpredict")
    for ax, task, name, ylabel in ((axes[0], bpb_task, "bits_per_byte", "held-out bits per byte (lower is better)"),
                                   (axes[1], GENPPL_TASK, "gen_ppl", "generative perplexity (lower is better)")):
        drawn = False
        for i, runs in enumerate(by_ckpt.values()):
            pts = [(run.iterations, run.metric(task, name), run) for run in runs if run.metric(task, name) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, marker=marker, linestyle=LINESTYLES[i % len(LINESTYLES)], label=runs[0].name)
                drawn = True
                for t, q, run in pts:
                    f.use(run.tasks[task])
                    f.rows.append({"point": run.label, "family": run.family, "panel": task, "T": t, "quality": q, "records": [run.tasks[task]]})
        if drawn:
            for run in ar:
                if (q := run.metric(task, name)) is not None:
                    ax.axhline(q, color=style(run.family)[0], linestyle="--", alpha=0.8, label=run.label)
                    f.use(run.tasks[task])
                    f.rows.append({"point": run.label, "family": run.family, "panel": task, "T": "-", "quality": q, "records": [run.tasks[task]]})
            scale(ax, "x", [run.iterations for run in mp], count, base=2)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        else:
            no_data(ax, f"no Mask-Predict record of {task}")
        ax.set_xlabel("iterations T (passes per block)")
        ax.set_ylabel(ylabel)
    ax = axes[2]
    speed_mp = [(run, s) for run in mp if (s := sel.batch1(run)) is not None]
    if speed_mp:
        for i, runs in enumerate(by_ckpt.values()):
            line = [(run.iterations, s.data["decode_tok_s_per_seq"]) for run, s in speed_mp if run.checkpoint == runs[0].checkpoint]
            if line:
                ax.plot(*zip(*line), color=colour, marker=marker, linestyle=LINESTYLES[i % len(LINESTYLES)], label=runs[0].name)
        for run, s in speed_mp:
            x, y = run.iterations, s.data["decode_tok_s_per_seq"]
            if s.data.get("tokens_per_pass") is not None:
                ax.annotate(f"{s.data['tokens_per_pass']:g} tok/pass", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)
            f.use(s)
            f.rows.append({"point": run.label, "family": run.family, "panel": "speed", "T": x, "tok/s": y,
                           "tokens/pass": s.data.get("tokens_per_pass"), "join key": sel.key(run, s), "records": [s]})
        for run in ar:
            if (s := sel.batch1(run)) is not None:
                ax.axhline(s.data["decode_tok_s_per_seq"], color=style(run.family)[0], linestyle="--", alpha=0.8, label=f"{run.label} (1 tok/pass)")
                f.use(s)
                f.rows.append({"point": run.label, "family": run.family, "panel": "speed", "T": "-", "tok/s": s.data["decode_tok_s_per_seq"],
                               "tokens/pass": 1, "join key": sel.key(run, s), "records": [s]})
        scale(ax, "x", [run.iterations for run, _ in speed_mp], count, base=2)
        scale(ax, "y", [s.data["decode_tok_s_per_seq"] for _, s in speed_mp] + [y for line in ax.lines for y in line.get_ydata()])
        ax.grid(True, which="both", alpha=0.3)
        ax.margins(x=0.15)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    else:
        no_data(ax, f"no joined batch-1 speed record at context {sel.ctx} for a Mask-Predict run")
    ax.set_xlabel("iterations T (passes per block)")
    ax.set_ylabel("decode tokens/s per sequence, batch 1")
    fig.suptitle("Mask-Predict: quality and speed against iterations T")
    f.save(fig, out)
    return f


def cost_figure(j: Join, out: Path) -> Figure | None:
    """Cost per 1,000 tokens and energy per token of every speed record that has them, or None."""
    recs = [s for s in j.speed if s.data.get(COST) is not None or s.data.get(ENERGY) is not None]
    if not recs:
        return None
    f = Figure("cost", "Cost and energy per token",
               "Cost per 1,000 output tokens (from the GPU-hour price the benchmark was given) and energy per token "
               "(from the GPU's power readings), one bar per speed record that has them, labelled with its load; "
               "lower is better.")
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.6 + 0.35 * len(recs) + 2), layout="constrained")
    labels = [f"{speed_label(s.data)}, {load_of(s.data)}" for s in recs]
    for ax, key, xlabel in ((axes[0], COST, "cost per 1,000 output tokens (USD)"), (axes[1], ENERGY, "energy per output token (J)")):
        rows = [(lab, s) for lab, s in zip(labels, recs) if s.data.get(key) is not None]
        if rows:
            ax.barh(range(len(rows)), [s.data[key] for _, s in rows], height=0.6, color=[style(s.data.get("family", "?"))[0] for _, s in rows])
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.set_yticks(range(len(rows)), [lab for lab, _ in rows], fontsize=7)
            ax.invert_yaxis()
            ax.grid(True, axis="x", alpha=0.3)
        else:
            no_data(ax, f"no record has {key}")
        ax.set_xlabel(xlabel)
    for lab, s in zip(labels, recs):
        f.use(s)
        f.rows.append({"point": lab, "family": s.data.get("family"), "panel": "cost", "USD / 1k tokens": s.data.get(COST),
                       "J / token": s.data.get(ENERGY), "records": [s]})
    fig.legend(handles=family_handles({s.data.get("family", "?") for s in recs}), loc="outside right upper", title="family", fontsize=8)
    fig.suptitle("Cost and energy per token")
    f.save(fig, out)
    return f


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return "" if v is None else str(v)


def kinds(j: Join, sel: Selection) -> list[tuple[str, int]]:
    """How many records of each kind the page could draw on (0: missing)."""
    s = [r.data for r in j.speed]
    return [
        ("quality runs (eval.quality)", len(j.quality)),
        ("decode speed at batch 1 (decoders.compare)", sum(1 for r in s if r.get("batch") == 1)),
        (f"decode speed at a serving load (compare at batch {sel.load_batch} or a serving benchmark)",
         sum(1 for r in s if "output_tok_s" in r or (r.get("batch") == sel.load_batch and sel.load_batch))),
        ("serving benchmark (output_tok_s)", sum(1 for r in s if "output_tok_s" in r)),
        ("Mask-Predict speed (distinct T)", len({r.get("iterations") for r in s if r.get("family") == "maskpredict"})),
        ("speculative decoding", sum(1 for r in s if r.get("speculative"))),
        ("quantised decoding", sum(1 for r in s if r.get("quantization"))),
        (f"cost per 1,000 tokens ({COST})", sum(1 for r in s if r.get(COST) is not None)),
        (f"energy per token ({ENERGY})", sum(1 for r in s if r.get(ENERGY) is not None)),
        ("recall at distance (declab_copy_N, declab_mqar_N)", sum(1 for q in j.quality for t in q.tasks if COPY_TASK.match(t) or MQAR_TASK.match(t))),
        ("joined quality-speed pairs", len(j.pairs)),
    ]


def unjoined(j: Join) -> tuple[list[QualityRun], dict[str, list[Record]]]:
    """Quality runs without any speed record, and speed records without quality (by series)."""
    paired = {id(s) for _, s, _ in j.pairs}
    quality_only = [q for q in j.quality if not j.speed_of(q)]
    speed_only = {}
    for s in j.speed:
        if id(s) not in paired:
            speed_only.setdefault(speed_label(s.data) + (f" ({s.data['peer']})" if s.data.get("peer") else ""), []).append(s)
    return quality_only, speed_only


def link(rec: Record) -> str:
    return f'<a href="#{rec.anchor}">{html.escape(rec.ref)}</a>'


def html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def prose(text: str) -> str:
    """Escaped text with `code` spans marked up."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def figure_html(f: Figure) -> str:
    png = base64.b64encode(f.path.read_bytes()).decode()
    cols = [c for c in dict.fromkeys(k for row in f.rows for k in row) if c != "records"]
    rows = [[html.escape(fmt(row.get(c))) for c in cols] + [" ".join(link(r) for r in row["records"])] for row in f.rows]
    commands = sorted({str(r.data.get("command")) for r in f.records})
    return (f'<section id="{f.name}"><h2>{html.escape(f.title)}</h2><p>{prose(f.text)}</p>'
            f'<img src="data:image/png;base64,{png}" alt="{html.escape(f.title)}">'
            f'<p class="prov">{html.escape(provenance_line(f.records))}</p>'
            f'<details><summary>commands of these records ({len(commands)})</summary><ul>'
            + "".join(f"<li><code>{html.escape(c)}</code></li>" for c in commands) + "</ul></details>"
            f'<details><summary>points and their records ({len(f.rows)})</summary>{html_table(cols + ["records"], rows)}</details></section>')


CSS = """body{font-family:sans-serif;max-width:1200px;margin:1em auto;padding:0 1em;color:#222;line-height:1.4}
img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;font-size:12px;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}th{background:#f2f2f2}
.prov{font-size:12px;color:#555}code{font-size:12px}pre{font-size:11px;white-space:pre-wrap;background:#f7f7f7;padding:4px}
.missing{color:#a00}details{margin:.3em 0}:target{background:#fff3c4}.records{font-size:13px}.records details{margin:0}"""
# Opens the record a link points to (the page works without it: the record is highlighted).
OPEN_TARGET = """function openTarget(){var e=document.getElementById(location.hash.slice(1));if(e&&e.tagName=="DETAILS"){e.open=true;}}
window.addEventListener("hashchange",openTarget);openTarget();"""


def describe(rec: Record) -> str:
    """One line naming what a record is."""
    r = rec.data
    if "task" in r:
        return f"quality, {Path(r['checkpoint']).name}" + (f" T={r['iterations']}" if r.get("iterations") is not None else "") + f", {r['task']}"
    load = load_of(r)
    return f"speed, {speed_label(r)}" + (f", {load}" if load else "") + (f", {r['status']}" if r.get("status", "ok") != "ok" else "")


def left_out(j: Join) -> str:
    """The records of other kinds (kernel benchmarks, training logs ...), counted per file."""
    if not j.ignored:
        return "Every record is a speed or a quality record."
    return "Left out, neither speed nor quality: " + ", ".join(f"{n} in {name}" for name, n in sorted(j.ignored.items())) + "."


def no_pairs(j: Join) -> str:
    """Why nothing joined: the presets the quality runs come from against those the speed records ran."""
    quality = sorted({str(q.preset) for q in j.quality})
    speed = sorted({str(s.data.get("model")) for s in j.speed if not s.data.get("peer")})
    return (f'<p class="missing">No quality run has a speed record of the same network and decoding. The quality runs are of '
            f'{html.escape(", ".join(quality) or "nothing")}; the speed records ran {html.escape(", ".join(speed) or "nothing")}.</p>')


JOINED_HEAD = ["quality run", "family", "key", "speed record", "ctx", "batch", "tok/s (all sequences)"]


def build_html(j: Join, sel: Selection, figures: list[Figure], files: list[str], bpb_task: str, acc_task: str) -> str:
    quality_only, speed_only = unjoined(j)
    kind_rows = [[html.escape(k), str(n) if n else '<span class="missing">missing</span>'] for k, n in kinds(j, sel)]
    joined = [[html.escape(q.label), html.escape(q.family), key, link(s), html.escape(fmt(s.data.get("ctx"))), html.escape(fmt(s.data.get("batch"))),
               html.escape(fmt(throughput(s.data))), html.escape(fmt(q.metric(bpb_task, "bits_per_byte"))), html.escape(fmt(q.metric(acc_task, "acc")))]
              for q, s, key in j.pairs]
    qonly = [[html.escape(q.label), html.escape(q.family), html.escape(str(q.preset)),
              " ".join(link(r) for r in q.records[:3]) + (" ..." if len(q.tasks) > 3 else "")] for q in quality_only]
    sonly = [[html.escape(label), str(len(recs)), html.escape(", ".join(sorted({fmt(r.data.get("ctx")) for r in recs}))),
              html.escape(", ".join(sorted({fmt(r.data.get("batch")) for r in recs}))), link(recs[-1])] for label, recs in sorted(speed_only.items())]
    refused = [[html.escape(q.label), link(s), html.escape("; ".join(why))] for q, s, why in j.refused]
    absent = [[link(r), html.escape(speed_label(r.data)), html.escape(str(r.data.get("status"))), html.escape(str(r.data.get("reason", ""))[:160])]
              for r in j.not_measured]
    shown = {id(r): r for f in figures for r in f.records}
    for q, s, *_ in j.pairs + j.refused:
        shown[id(s)] = s
    for r in j.not_measured + [recs[-1] for recs in speed_only.values()]:
        shown[id(r)] = r
    for q in j.quality:
        for r in q.records:
            shown[id(r)] = r
    appendix = "".join(f'<details id="{r.anchor}"><summary>{html.escape(r.ref)}: {html.escape(describe(r))}</summary>'
                       f'<pre>{html.escape(json.dumps(r.data, indent=1))}</pre></details>' for r in sorted(shown.values(), key=lambda r: (r.file, r.line)))
    nav = " · ".join(f'<a href="#{f.name}">{html.escape(f.title)}</a>' for f in figures)
    return f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>declab: quality against speed</title><style>{CSS}</style></head><body>
<h1>declab: what each architecture and setting buys in tokens/s and costs in quality</h1>
<p>From {len(files)} result files: {html.escape(", ".join(Path(p).name for p in files))}. {nav}</p>
<h2>What the records hold</h2>{html_table(["kind", "records"], kind_rows)}<p>{html.escape(left_out(j))}</p>
<h2>How speed and quality are joined</h2>
<p>Decode speed does not depend on the values of the weights, so a quality run (a trained checkpoint, one decoding) is joined with a
speed record of the same network and decoding: key <b>checkpoint</b> when the speed record measured the checkpoint itself, key
<b>preset</b> when it ran random weights of the preset the checkpoint was trained from. Either way the family, the whole model config,
dtype, kernel implementation, device, Mask-Predict decoding (T, block, threshold; without blocks, the canvas length), quantisation and
speculative settings must be equal; a pair that differs in any of them is refused and listed below. Each point's key is in its table.</p>
{html_table(JOINED_HEAD + [f"bits/byte ({bpb_task})", f"acc ({acc_task})"], joined) if joined else no_pairs(j)}
{"".join(figure_html(f) for f in figures)}
<h2>Quality without speed</h2>{html_table(["quality run", "family", "preset", "records"], qonly) if qonly else "<p>none</p>"}
<h2>Speed without quality</h2>{html_table(["model and setting", "records", "contexts", "batches", "newest"], sonly) if sonly else "<p>none</p>"}
<h2>Refused joins</h2>{html_table(["quality run", "speed record", "what differs"], refused) if refused else "<p>none</p>"}
<h2>Speed points not measured</h2>{html_table(["record", "model", "status", "reason"], absent) if absent else "<p>none</p>"}
<h2>Records</h2><div class="records">{appendix}</div>
<script>{OPEN_TARGET}</script>
</body></html>"""


def build_summary(j: Join, sel: Selection, figures: list[Figure], bpb_task: str, acc_task: str) -> str:
    quality_only, speed_only = unjoined(j)
    lines = ["# declab: quality against speed", "", f"Speed at context {sel.ctx}; serving load: batch {sel.load_batch} (or a serving benchmark).", "",
             "| quality run | family | key | batch-1 tok/s | load tok/s | bits/byte | acc | records |", "|---|---|---|---|---|---|---|---|"]
    for run in j.quality:
        b1, load = sel.batch1(run), sel.load(run)
        if b1 is None and load is None:
            continue
        keys = sorted({sel.key(run, s) for s in (b1, load) if s is not None})
        refs = ", ".join(s.ref for s in (b1, load) if s is not None)
        lines.append(f"| {run.label} | {run.family} | {', '.join(keys)} | {fmt(b1 and b1.data['decode_tok_s_per_seq'])} | {fmt(load and throughput(load.data))} | "
                     f"{fmt(run.metric(bpb_task, 'bits_per_byte'))} | {fmt(run.metric(acc_task, 'acc'))} | {refs} |")
    lines += ["", "## Missing", ""]
    lines += [f"- {k}" for k, n in kinds(j, sel) if not n] or ["- nothing"]
    lines += ["", left_out(j)]
    lines += ["", "## Quality without speed", ""] + ([f"- {q.label} ({q.family})" for q in quality_only] or ["- none"])
    lines += ["", "## Speed without quality", ""] + ([f"- {label}: {len(recs)} records" for label, recs in sorted(speed_only.items())] or ["- none"])
    lines += ["", "## Refused joins", ""] + ([f"- {q.label} with {s.ref}: {'; '.join(why)}" for q, s, why in j.refused] or ["- none"])
    lines += ["", "## Figures", ""] + [f"- `{f.path.name}`: {f.title}. {f.text}" for f in figures]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m eval.report", description="Join speed and quality records into one page.")
    p.add_argument("files", nargs="+", help="JSON lines from decoders.compare, a serving benchmark, eval.quality, eval.ablation")
    p.add_argument("--out", required=True, help="folder to write report.html, the PNGs and summary.md into")
    p.add_argument("--ctx", default="4k", help="context of the speed points the frontier and Mask-Predict figures use (e.g. 4096, 4k)")
    p.add_argument("--load-batch", type=int, default=None, help="batch of the serving-load frontier (default: the largest batch > 1 in the records)")
    p.add_argument("--bpb-task", default="declab_ppl", help="quality task whose bits_per_byte the figures show")
    p.add_argument("--acc-task", default="declab_cloze", help="quality task whose acc the frontier shows")
    a = p.parse_args(argv)
    with decoders.user_errors():
        ctx = parse_size(a.ctx)
        if a.load_batch is not None and a.load_batch < 2:
            raise decoders.UsageError(f"--load-batch must be at least 2, got {a.load_batch}")
        out = Path(a.out)
        if out.exists() and not out.is_dir():
            raise decoders.UsageError(f"--out {a.out} is a file, not a folder")
        j = join(read_records(a.files))
        if not j.speed and not j.quality:
            raise decoders.UsageError("the files hold no speed record and no quality record")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise decoders.UsageError(f"cannot create --out {a.out}: {e.strerror}") from None
    sel = Selection(j, ctx, a.load_batch)
    figures = [frontier_figure(j, sel, out, a.bpb_task, a.acc_task), context_figure(j, out), maskpredict_figure(j, sel, out, a.bpb_task)]
    if (cost := cost_figure(j, out)) is not None:
        figures.append(cost)
    else:
        # A figure an earlier report wrote here must not outlive the records it came from.
        (out / "cost.png").unlink(missing_ok=True)
    (out / "report.html").write_text(build_html(j, sel, figures, a.files, a.bpb_task, a.acc_task))
    summary = build_summary(j, sel, figures, a.bpb_task, a.acc_task)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(json.dumps({"out": str(out), "files": [str(out / n) for n in ["report.html", "summary.md"] + [f.path.name for f in figures]],
                      "pairs": len(j.pairs), "refused": len(j.refused), "quality_runs": len(j.quality), "speed_records": len(j.speed),
                      "missing": [k for k, n in kinds(j, sel) if not n]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
