"""Recall as Zoology measures it: every family trained directly on multi-query associative recall (MQAR)
over a grid of model widths and (key-value pairs, sequence length), accuracy against width and
against the recurrent state size.

    python -m eval.mqar_sweep --out results/quality/mqar            # the default grid, one run at a time
    python -m eval.mqar_sweep --quick --out /tmp/mqar               # a small grid, a few minutes
    python -m eval.mqar_sweep --processes 12 --out results/quality/mqar   # 12 at a time on one GPU (~18 min at the old 512 vocabulary)
    python -m eval.mqar_sweep --families transformer,mamba2 --widths 64,128 --points 16:128,64:512

A sequence (seeded, synthetic) is n key-value pairs `k1 v1 ... kn vn`, filler up to the end of the
sequence less 2n tokens, then every key again in a random order, each followed by its value:
`... q1 a1 q2 a2 ... qn an` (keys from ids 1..4095, values from 4096..8190, all keys of a sequence
distinct). No model sees an answer: as in Zoology, the autoregressive families read the sequence
with every answer slot blanked to filler and predict each answer at its query key (the loss and the
accuracy read only those positions); Mask-Predict reads it with every answer masked and predicts
them all in one bidirectional pass. (With the answers left in, teacher forcing lets a model narrow
the i-th answer to the n - i values not yet asked for, which scores H_n / n with no recall at all,
0.34 at 8 pairs; attention and Mamba-2 settled there.) Models: two blocks (--layers) of each
family at each width, head dimension 32, vocabulary 8192 (as Zoology's), built from the family's
tiny preset with the width overridden. The attention families (transformer, Mask-Predict) read their
embeddings through a depthwise causal convolution of width --short-conv (3, as the short convolution
Zoology puts in front of its attention; `ShortConv`): without it, a two-block transformer at width 64
stayed at 0.09 on 8 pairs after 6000 steps, with it it reached 0.98-0.99 in 1500 (results/LOG.md,
2026-12-04 late). Mamba-2's conv and RWKV-7's token shift are that local path built in.
Training: `eval.train`'s optimiser and schedule (AdamW, weight decay on matrices, warmup then
cosine), fresh data every step, each learning rate of --lrs; a point's accuracy is that of its best
learning rate, measured on --eval-sequences held-out sequences of another seed.

Every trained (family, width, pairs, seq_len, lr) is one JSON line in <out>/mqar.jsonl as soon as it
finishes; a rerun skips what is there, so an interrupted sweep resumes and a finished one only
redraws. Under `torchrun --nproc-per-node N -m eval.mqar_sweep ...` the runs still to do are dealt
round-robin to the N ranks, each training on its own GPU (cuda:LOCAL_RANK) and appending to
mqar.jsonl.rankR as it goes; rank 0 merges them into mqar.jsonl in grid order, a run that raised on a
rank is an error record naming it (retried by a rerun), and rank 0 alone prints. On one GPU,
`--processes N` trains N runs at a time, each in a worker process of its own on the same device (the
models are small: two blocks of width 64-256); the longest runs go first, each record is appended as it
arrives, and a run that raised is an error record. Writes
mqar_width.png (accuracy against width, one panel per point, one line per family, a dashed line at
1 / pairs: a model that knows the answer is one of the context's values but not which scores that) and
mqar_state.png (accuracy against the bytes of state decoding carries at seq_len, i.e.
`Decoder.memory(1, seq_len).state_bytes`: the KV cache for attention, the fixed state for the
recurrences), prints a table (best accuracy per family, width and point; its last row 1 / pairs),
and its last stdout line is one JSON document.
"""

import argparse
import functools
import inspect
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import decoders
from decoders import cli, distributed
from declab_arch.checkpoint import CONFIG_DIR, read_json
from decoders.records import append_jsonl, environment
from eval.train import lr_at

FAMILIES = list(decoders.FAMILIES)
TINY = {f: f"{decoders.family_class(f).presets}-tiny" for f in FAMILIES}
# Zoology's vocabulary: with 512 tokens, two-block attention settles on "one of the context's values"
# and did not find recall (results/LOG.md, 2026-12-04); with 8,192 it recalled 2 pairs in 3,000 steps (one CPU run).
VOCAB = 8192
FILLER = 0
KEYS = range(1, 4096)
VALUES = range(4096, 8191)
MASK = 8191
HEAD_DIM = 32
# Families without a local path of their own: they read the embeddings through the short convolution.
ATTENTION = ("transformer", "maskpredict")
DEFAULT = {"widths": "64,128,256", "points": "8:64,16:128,32:256,64:512", "lrs": "1e-3,3e-3", "steps": 1500}
QUICK = {"widths": "64,128", "points": "8:64,32:256", "lrs": "3e-3", "steps": 400}


def model_values(family: str, width: int, layers: int) -> dict:
    """Config values of `family` at model width `width` with `layers` blocks: the tiny preset, resized."""
    values = read_json(CONFIG_DIR / f"{TINY[family]}.json")
    heads = width // HEAD_DIM
    # Resized by the fields the family's config has: attention heads (Llama-shaped), d_model (Mamba-2), or neither (RWKV-7).
    if "num_attention_heads" in values:
        values.update(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=HEAD_DIM, intermediate_size=16 * math.ceil(8 * width / 3 / 16))
        if "mask_token_id" in values:
            values.update(mask_token_id=MASK, max_predicted_length=0)
    elif "d_model" in values:
        values.update(d_model=width, n_layer=layers, headdim=HEAD_DIM)
    else:
        values.update(hidden_size=width, num_hidden_layers=layers, head_dim=HEAD_DIM, intermediate_size=4 * width)
    values["vocab_size"] = VOCAB
    return values


class ShortConv(nn.Module):
    """An embedding followed by a depthwise causal convolution of width `k`, added to it: each
    position also reads the k - 1 tokens before it, as Mamba-2's conv and RWKV-7's token shift let
    their blocks do (Zoology puts a width-3 short convolution in front of its attention)."""

    def __init__(self, embed: nn.Embedding, k: int):
        super().__init__()
        self.embed = embed
        d = embed.embedding_dim
        self.conv = nn.Conv1d(d, d, k, groups=d, padding=k - 1, device=embed.weight.device, dtype=embed.weight.dtype)

    @property
    def weight(self):
        """The embedding table (a tied LM head reads it)."""
        return self.embed.weight

    def forward(self, tokens):
        e = self.embed(tokens)
        return e + self.conv(e.transpose(1, 2))[..., : tokens.shape[1]].transpose(1, 2)


def short_conv_of(family: str, short_conv: int) -> int:
    """The short convolution's width a run of `family` gets: `short_conv` for attention, 0 for the recurrences."""
    return short_conv if family in ATTENTION else 0


def build(family: str, width: int, layers: int, *, device, seed: int, short_conv: int = 0):
    """The family's MQAR model at `width`; an attention family with `short_conv` > 0 reads its
    embeddings through a `ShortConv` of that width."""
    name = f"{family}-mqar-w{width}"
    dec = decoders.family_class(family).from_preset(model_values(family, width, layers), name, seed=seed, device=device,
                                                    dtype=torch.float32, impl="ref")
    if short_conv_of(family, short_conv):
        dec.model.model.embed_tokens = ShortConv(dec.model.model.embed_tokens, short_conv)
    return dec


def mqar_batch(batch: int, pairs: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences [batch, seq_len] and the bool [batch, seq_len] positions of the answers (on the CPU)."""
    keys = torch.rand(batch, len(KEYS), generator=generator).argsort(-1)[:, :pairs] + KEYS.start
    values = torch.randint(VALUES.start, VALUES.stop, (batch, pairs), generator=generator)
    order = torch.rand(batch, pairs, generator=generator).argsort(-1)
    context = torch.stack([keys, values], -1).flatten(1)  # [B, 2n]
    queries = torch.stack([keys.gather(1, order), values.gather(1, order)], -1).flatten(1)  # [B, 2n]
    filler = torch.full((batch, seq_len - 4 * pairs), FILLER, dtype=torch.long)
    tokens = torch.cat([context, filler, queries], 1)
    answers = torch.zeros(batch, seq_len, dtype=torch.bool)
    answers[:, seq_len - 2 * pairs + 1 :: 2] = True
    return tokens, answers


def answer_logits(dec, tokens: torch.Tensor, answers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [A, V] the model gives each answer and the answers [A], from the sequence with every
    answer hidden (`model_input`): the autoregressive families predict it at the query key before
    it, Mask-Predict at the masked position itself."""
    model = dec.model
    seen = model_input(dec.family, tokens, answers)
    # The LM head only where an answer is read: at 8,192 tokens it is most of a small model's work.
    kwargs = {"impl": "ref"} if "impl" in inspect.signature(model.hidden).parameters else {}
    if decoders.family_class(dec.family).state_kind == "canvas":
        return model.head(model.hidden(seen)[answers]), tokens[answers]
    return model.head(model.hidden(seen[:, :-1], **kwargs)[answers[:, 1:]]), tokens[answers]


def model_input(family: str, tokens: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """What the model reads: the sequence with every answer masked (Mask-Predict) or blanked to filler."""
    return torch.where(answers, MASK if decoders.family_class(family).state_kind == "canvas" else FILLER, tokens)


def accuracy(dec, pairs: int, seq_len: int, *, sequences: int, batch: int, seed: int) -> float:
    """Fraction of the answers of `sequences` held-out sequences whose argmax is right."""
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    right = total = 0
    dec.model.eval()
    with torch.no_grad():
        for start in range(0, sequences, batch):
            tokens, answers = mqar_batch(min(batch, sequences - start), pairs, seq_len, gen)
            logits, target = answer_logits(dec, tokens.to(dec.device), answers.to(dec.device))
            right += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    return right / total


def train_point(family: str, width: int, pairs: int, seq_len: int, lr: float, a, device) -> dict:
    """Train one model on MQAR and measure it: the JSON record of the run."""
    torch.manual_seed(a.seed)
    conv = short_conv_of(family, a.short_conv)
    dec = build(family, width, a.layers, device=device, seed=a.seed, short_conv=conv)
    model = dec.model
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(a.seed)
    warmup = max(1, a.steps // 20)
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps, lr, warmup)
        tokens, answers = mqar_batch(a.batch, pairs, seq_len, gen)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, target = answer_logits(dec, tokens.to(device, non_blocking=True), answers.to(device, non_blocking=True))
            loss = F.cross_entropy(logits.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - t0
    acc = accuracy(dec, pairs, seq_len, sequences=a.eval_sequences, batch=a.batch, seed=a.seed)
    return {"kind": "mqar", "family": family, "width": width, "layers": a.layers, "pairs": pairs, "seq_len": seq_len, "lr": lr,
            "steps": a.steps, "batch": a.batch, "seed": a.seed, "short_conv": conv, "acc": acc, "final_loss": loss.item(),
            # The convolution's window (k - 1 inputs of width floats) is state too.
            "params": sum(p.numel() for p in model.parameters()), "state_bytes": dec.memory(1, seq_len).state_bytes + max(conv - 1, 0) * width * 4,
            "train_s": train_s, "config": model_values(family, width, a.layers), **environment(device)}


def key(r: dict) -> tuple:
    # Records from before the short convolution had none.
    return r["family"], r["width"], r["layers"], r["pairs"], r["seq_len"], r["lr"], r["steps"], r["batch"], r["seed"], r.get("short_conv", 0)


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grid(a) -> list[dict]:
    """Every run of the sweep, as the identifying fields of its record."""
    return [{"family": f, "width": w, "layers": a.layers, "pairs": n, "seq_len": t, "lr": lr, "steps": a.steps, "batch": a.batch, "seed": a.seed,
             "short_conv": short_conv_of(f, a.short_conv)}
            for (n, t) in a.points for w in a.widths for f in a.families for lr in a.lrs]


def failed_point(run: dict, reason: str) -> dict:
    """The record of a run that raised on a rank of a launch."""
    return {"kind": "mqar", **run, "status": "error", "reason": reason}


def sweep(a, here: distributed.World) -> list[dict]:
    """Train every run of the grid not yet in mqar.jsonl (this rank's share of them when launched),
    each recorded as it finishes; the error records of the runs that raised (on rank 0, every rank's)."""
    device = distributed.device_of(decoders.parse_device(a.device), here)
    if here.launched:
        distributed.setup(device, here, distributed.JOBS_WAIT)
    path = Path(a.out) / "mqar.jsonl"

    def prepare():
        path.parent.mkdir(parents=True, exist_ok=True)
        distributed.fold_parts(path)

    distributed.lead_first(prepare, here)
    done = {key(r) for r in read_records(path) if r.get("status") != "error"}

    def point(run: dict) -> dict:
        record = train_point(run["family"], run["width"], run["pairs"], run["seq_len"], run["lr"], a, device)
        print_point(record)
        return record

    todo = [run for run in grid(a) if key(run) not in done]
    if a.processes > 1 and not here.launched:
        return in_processes(todo, a, device, path)
    return distributed.run_jobs(todo, point, path, here, failed_point)


def print_point(record: dict) -> None:
    print(f"{record['family']:<12} width {record['width']:>4}  pairs {record['pairs']:>3}  seq {record['seq_len']:>4}  lr {record['lr']:.0e}: "
          f"acc {record['acc']:.3f} ({record['train_s']:.0f} s)", flush=True)


def worker_point(run: dict, a, device: str) -> dict:
    """One run in a worker process of `in_processes`: its record, or its error record."""
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        record = train_point(run["family"], run["width"], run["pairs"], run["seq_len"], run["lr"], a, device)
    except Exception as e:
        return failed_point(run, f"{type(e).__name__}: {e}")
    return {**record, "processes": a.processes}


def in_processes(runs: list[dict], a, device: torch.device, path: Path) -> list[dict]:
    """Train `runs` in `a.processes` worker processes sharing `device`, the longest (sequence length
    x width) first; each record appended to `path` as it arrives. The error records of the runs that raised."""
    runs = sorted(runs, key=lambda r: (r["seq_len"] * r["width"], r["seq_len"]), reverse=True)
    errors = []
    if not runs:
        return errors
    with multiprocessing.get_context("spawn").Pool(min(a.processes, len(runs))) as pool:
        for record in pool.imap_unordered(functools.partial(worker_point, a=a, device=str(device)), runs):
            append_jsonl(path, record)
            if record.get("status") == "error":
                errors.append(record)
            else:
                print_point(record)
    return errors


def best(records: list[dict]) -> dict[tuple, dict]:
    """The best-learning-rate record of each (family, width, pairs, seq_len)."""
    out = {}
    for r in records:
        k = (r["family"], r["width"], r["pairs"], r["seq_len"])
        if k not in out or r["acc"] > out[k]["acc"]:
            out[k] = r
    return out


def family_label(points: dict[tuple, dict], family: str) -> str:
    """The family's name, with its short convolution when it had one."""
    conv = max(r.get("short_conv", 0) for k, r in points.items() if k[0] == family)
    return f"{family} + conv {conv}" if conv else family


def plot(points: dict[tuple, dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    cells = sorted({(n, t) for _, _, n, t in points})
    families = [f for f in FAMILIES if any(k[0] == f for k in points)]
    fig, axes = plt.subplots(1, len(cells), figsize=(4 * len(cells), 3.6), squeeze=False, sharey=True)
    for ax, (n, t) in zip(axes[0], cells):
        for family in families:
            xs = sorted(w for f, w, n2, t2 in points if (f, n2, t2) == (family, n, t))
            ax.plot(xs, [points[(family, w, n, t)]["acc"] for w in xs], marker="o", label=family_label(points, family))
        ax.axhline(1 / n, color="grey", linestyle="--", linewidth=0.8, label="1 / pairs (no recall)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{n} pairs, seq {t}", fontsize=9)
        ax.set_xlabel("model width")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("MQAR accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "mqar_width.png", dpi=120)
    plt.close(fig)
    written.append(str(out / "mqar_width.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    markers = "osD^vP*X"
    for i, family in enumerate(families):
        for j, (n, t) in enumerate(cells):
            rows = sorted((r["state_bytes"], r["acc"]) for k, r in points.items() if k[0] == family and (k[2], k[3]) == (n, t))
            if rows:
                ax.plot(*zip(*rows), marker=markers[j % len(markers)], color=f"C{i}", label=f"{family_label(points, family)}, {n} pairs")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("state bytes at seq_len (fp32 state; KV cache for attention)")
    ax.set_ylabel("MQAR accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "mqar_state.png", dpi=120)
    plt.close(fig)
    written.append(str(out / "mqar_state.png"))
    return written


def table(points: dict[tuple, dict]) -> str:
    cells = sorted({(n, t) for _, _, n, t in points})
    lines = ["| family | width | state bytes (longest) | " + " | ".join(f"{n} pairs / {t}" for n, t in cells) + " |",
             "|" + "---|" * (3 + len(cells))]
    for family in FAMILIES:
        for width in sorted({w for f, w, _, _ in points if f == family}):
            row = [points.get((family, width, n, t)) for n, t in cells]
            state = max(r["state_bytes"] for r in row if r)
            lines.append(f"| {family_label(points, family)} | {width} | {state:,} | " + " | ".join("" if r is None else f"{r['acc']:.3f}" for r in row) + " |")
    lines.append("| 1 / pairs (one of the context's values, no recall) | | | " + " | ".join(f"{1 / n:.3f}" for n, _ in cells) + " |")
    return "\n".join(lines) + "\n"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = cli.Parser(prog="python -m eval.mqar_sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/quality/mqar", help="folder of mqar.jsonl and the plots (default results/quality/mqar)")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--widths", help=f"model widths, multiples of {HEAD_DIM} (default {DEFAULT['widths']})")
    p.add_argument("--points", help=f"pairs:seq_len list, 4 * pairs <= seq_len (default {DEFAULT['points']})")
    p.add_argument("--lrs", help=f"learning rates, the best one counts (default {DEFAULT['lrs']})")
    p.add_argument("--steps", type=int, help=f"training steps per run (default {DEFAULT['steps']})")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--eval-sequences", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--short-conv", type=int, default=3, help="width of the depthwise causal convolution the attention families "
                                                             "(transformer, maskpredict) read their embeddings through; 0: none (default 3)")
    p.add_argument("--quick", action="store_true", help=f"the small grid: widths {QUICK['widths']}, points {QUICK['points']}, "
                                                        f"lr {QUICK['lrs']}, {QUICK['steps']} steps (explicit options still win)")
    p.add_argument("--device", help="default cuda when present (each rank of a launch on cuda:LOCAL_RANK), else cpu")
    p.add_argument("--processes", type=int, default=1, help="runs trained at a time, each in its own worker process on the one device (default 1)")
    a = p.parse_args(argv)
    preset = QUICK if a.quick else DEFAULT
    try:
        a.families = [f for f in a.families.split(",") if f]
        unknown = [f for f in a.families if f not in FAMILIES]
        if unknown or not a.families:
            p.error(f"--families: unknown {', '.join(unknown) or '(none given)'} (known: {', '.join(FAMILIES)})")
        a.widths = int_list(a.widths or preset["widths"])
        a.points = [tuple(int(x) for x in item.split(":")) for item in (a.points or preset["points"]).split(",") if item]
        a.lrs = [float(x) for x in (a.lrs or preset["lrs"]).split(",") if x]
    except ValueError as e:
        p.error(f"a number list could not be read ({e})")
    a.steps = preset["steps"] if a.steps is None else a.steps
    if not a.widths or any(w < HEAD_DIM or w % HEAD_DIM for w in a.widths):
        p.error(f"--widths must be multiples of {HEAD_DIM}, got {a.widths}")
    for point in a.points:
        if len(point) != 2 or point[0] < 1 or point[0] > len(KEYS) or 4 * point[0] > point[1]:
            p.error(f"--points: {':'.join(map(str, point))} is not pairs:seq_len with 1 <= pairs <= {len(KEYS)} and 4 * pairs <= seq_len")
    if a.short_conv < 0:
        p.error(f"--short-conv must be >= 0 (0: no convolution), got {a.short_conv}")
    if not a.points or not a.lrs or any(lr <= 0 for lr in a.lrs):
        p.error("--points and --lrs need at least one entry, learning rates positive")
    for name in ("steps", "batch", "layers", "eval_sequences", "processes"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    decoders.parse_device(a.device)
    return a


def report(a, out: Path, errors: list[dict]) -> None:
    """The table, the plots and the summary line of the grid's finished runs."""
    wanted = {key(g) for g in grid(a)}
    points = best([r for r in read_records(out / "mqar.jsonl") if r.get("status") != "error" and key(r) in wanted])
    text = table(points)
    (out / "mqar.md").write_text(text)
    print(text)
    plots = plot(points, out)
    for r in errors:
        print(f"error: {r['family']} width {r['width']} pairs {r['pairs']} seq {r['seq_len']} lr {r['lr']:g}: {r['reason']} "
              f"(recorded in {out / 'mqar.jsonl'}; a rerun retries it)", file=sys.stderr)
    summary = {f"{f}/w{w}/n{n}/t{t}": r["acc"] for (f, w, n, t), r in sorted(points.items())}
    print(json.dumps({"jsonl": str(out / "mqar.jsonl"), "table": str(out / "mqar.md"), "plots": plots, "acc": summary,
                      "errors": [r["reason"] for r in errors]}))


def main(argv=None):
    here = distributed.world()
    try:
        with decoders.user_errors(), distributed.quiet_unless_lead(here):
            a = parse_args(argv)
            out = cli.check_output_dir(a.out, "--out")
            errors = sweep(a, here)
            if here.rank == 0:
                report(a, out, errors)
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main()
