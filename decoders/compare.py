"""`python -m decoders.compare`: decode throughput, latency and context-scaling decay of every family.

    python -m decoders.compare                                  # defaults for this machine (printed)
    python -m decoders.compare --models llama-1b,mamba2-1.3b --ctx 4k..128k --batch 1,16
    python -m decoders.compare --models maskpredict-tiny --iterations 1,4,16 --block 8
    python -m decoders.compare --models llama-1b,mamba2-1.3b,rwkv7-1.5b --peers hf,mamba_ssm,fla
    python -m decoders.compare --models llama-1b --peers hf,gpt-fast --gpt-fast GPT_FAST_CHECKOUT
    python -m decoders.compare --models llama-1b --ctx 128k --kv-dtype bf16,fp8
    python -m decoders.compare --models llama-1b,llama-8b --ctx 4k --quant none,int8,int4-rtn
    python -m decoders.compare --models llama-1b,mamba2-1.3b --ctx 4k,32k,128k --step graphed,persistent

With `--peers`, the libraries a user would run instead (`decoders.peers`) run after each model's own
points on the same shapes, contexts and batches, each in its own row (`hf-eager:llama-1b`, ...); a peer
that is not installed or does not run the model's family is recorded as such, with the reason.
`--gpt-fast PATH` (or the variable DECLAB_GPT_FAST) names the gpt-fast checkout the `gpt-fast` peer
imports its model and decode loop from; a folder without its model.py and generate.py is refused.
With `--kv-dtype`, every point of a model with a KV cache (transformer, Mask-Predict) is measured once
per cache dtype (`fp8`: e4m3 pages, see `decoders.kv_cache`); the records carry `kv_dtype`, and on a
GPU every record carries `max_batch_fits`, the largest batch whose state would fit at its context.
With `--quant`, every model is measured once per weight quantisation (`none`: its own weights; int8 and
int4-rtn quantised on the fly, see `decoders.load`); the records carry `quant` (name, method, bits,
group size; null for dense weights), the gate compares the quantised kernels with the quantised
reference path, and the roofline and MBU count the packed weight bytes.
With `--step`, every transformer, Mamba-2 and RWKV-7 point is measured once per decode step: `graphed` (a
kernel per operation, replayed as a CUDA graph; the default) and `persistent` (the whole forward in one
kernel, `declab_kernels.persistent_step`: Triton, batch 1, dense weights, the model's KV dtype, one
process; Mask-Predict models and anything else it does not run are refused before anything
runs); every record carries `step`.

Each finished point is appended to `--out` as one JSON object (an interrupted sweep keeps what it
wrote); a point that does not fit in memory is recorded as skipped and the sweep goes on, and with
`--point-timeout S` a point (a peer's first one includes building it and its compiling) that has no
result after S seconds is recorded as `timeout` and the sweep goes on. The table
is printed at the end and the last stdout line is one short JSON document (where the records are, and
each point's status and headline figures; the full records are in `--out`). Every option, model and
output path is checked before anything is measured: bad input is one line on stderr and exit code 2.
On the CPU the figures exercise the code path and are not performance measurements (the table says
so; each point is timed a few times and the spread recorded, see `decoders.harness`).

Under `torchrun` (`decoders.distributed`): `--tp N` splits every model over the N processes (tensor
parallel; rank 0 alone prints and writes, and each record adds the time the step's collectives take
alone); `--spread` (the default with several processes and --tp 1) deals the points out to the ranks,
each of which appends its records to `OUT.rankR` as they finish, and rank 0 writes them all to `--out`
at the end. Every record carries `world_size` and `tp`.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import time

import torch

from decoders import distributed
from decoders.base import UsageError
from decoders.speculative import parse_spec

K = 1024


class ArgError(UsageError):
    """A command-line value the CLI refuses."""


class PointTimeout(BaseException):
    """A point ran past --point-timeout. A BaseException, so that no `except Exception` on the way
    (a peer's failure handling) records it as an error."""


@contextlib.contextmanager
def deadline(seconds: float | None):
    """Raise PointTimeout in this (main) thread once `seconds` have passed; no limit when None.
    The signal lands between Python bytecodes, so a long call into a library ends first."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"no result within {seconds:g} s (--point-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def parse_size(text: str) -> int:
    """'4k' -> 4096, '300' -> 300; k = 1024."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not m:
        raise ArgError(f"not a context size: {text!r} (expected e.g. 4096, 4k)")
    value = int(m.group(1)) * (K if m.group(2) else 1)
    if value < 1:
        raise ArgError(f"context must be at least 1 token, got {text!r}")
    return value


def parse_ctx(text: str) -> list[int]:
    """'4k..128k' doubles from 4k to 128k; '4k,6k,32k' and plain integers list the values."""
    if ".." in text:
        lo_text, _, hi_text = text.partition("..")
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo > hi:
            raise ArgError(f"--ctx range {text!r} runs backwards (start {lo} > end {hi})")
        values = []
        while lo <= hi:
            values.append(lo)
            lo *= 2
        return values
    values = [parse_size(t) for t in text.split(",") if t.strip()]
    if not values:
        raise ArgError(f"--ctx {text!r} names no context")
    return sorted(set(values))


def parse_ints(text: str, name: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ArgError(f"--{name} expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise ArgError(f"--{name} values must be integers >= {minimum}, got {text!r}")
    return values


def comma_names(text: str, option: str, what: str) -> list[str]:
    """'a, b,a' -> ['a', 'b']: the names of a comma list in the order given, repeats dropped; none is an error."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise ArgError(f"{option} {text!r} names no {what}")
    return names


def parse_peers(text: str) -> list[str]:
    """'hf,fla' -> ['hf', 'fla'] (known names only, in the order given, repeats dropped)."""
    from decoders.peers import PACKAGES

    known = f"(known: {', '.join(PACKAGES)})"
    names = comma_names(text, "--peers", f"peer {known}")
    for name in names:
        if name not in PACKAGES:
            raise ArgError(f"unknown peer {name!r} {known}")
    return names


def check_gpt_fast(path: str | None, peer_names: list[str]) -> None:
    """Check the gpt-fast checkout (--gpt-fast, else DECLAB_GPT_FAST) before anything runs, and hand
    --gpt-fast to the peer through that variable. Neither given: the gpt-fast row says it is unavailable."""
    from pathlib import Path

    from decoders.peers import GPT_FAST_ENV, gpt_fast_problem

    if path is not None and "gpt-fast" not in peer_names:
        raise ArgError("--gpt-fast needs --peers gpt-fast")
    if "gpt-fast" not in peer_names:
        return
    given, source = (path, "--gpt-fast") if path is not None else (os.environ.get(GPT_FAST_ENV), GPT_FAST_ENV)
    if not given:
        return
    problem = gpt_fast_problem(Path(given))
    if problem:
        raise ArgError(f"{source}: {problem}")
    os.environ[GPT_FAST_ENV] = str(Path(given).resolve())


def parse_kv_dtypes(text: str) -> list[str]:
    """'bf16,fp8' -> ['bf16', 'fp8'] (known names only, in the order given, repeats dropped)."""
    from decoders.kv_cache import KV_DTYPES

    known = f"(known: {', '.join(KV_DTYPES)})"
    names = comma_names(text, "--kv-dtype", f"dtype {known}")
    for name in names:
        if name not in KV_DTYPES:
            raise ArgError(f"--kv-dtype: unknown dtype {name!r} {known}")
    return names


def parse_quants(text: str) -> list[str | None]:
    """'none,int8,int4-rtn' -> [None, 'int8', 'int4-rtn'] (names checked, repeats dropped; `none`: dense)."""
    from declab_arch import quant

    names = comma_names(text, "--quant", f"quantisation (known: none, {quant.KNOWN})")
    for name in names:
        if name != "none":
            try:
                quant.check_quant(name)
            except quant.QuantError as e:
                raise ArgError(f"--quant: {e}") from None
    return [None if n == "none" else n for n in names]


def parse_steps(args, models, batches, kv_dtypes, quants, spec, device) -> list[str]:
    """'graphed,persistent' -> ['graphed', 'persistent'], checked against everything the sweep would
    combine the persistent step with (`check_persistent` in `decoders.transformer`, `decoders.mamba2` and `decoders.rwkv7` says
    what it runs on)."""
    import decoders
    from declab_kernels import resolve_impl
    from decoders.base import STEPS

    known = f"(known: {', '.join(STEPS)})"
    names = comma_names(args.step, "--step", f"step {known}")
    for name in names:
        if name not in STEPS:
            raise ArgError(f"--step: unknown step {name!r} {known}")
    if "persistent" not in names:
        return names
    for model in models:
        family, config = decoders.model_config(model)
        if family not in ("transformer", "mamba2", "rwkv7"):
            raise ArgError(f"--step persistent: {model} ({family}) has no persistent step yet (transformer, mamba2 and rwkv7 models only)")
        if family == "transformer" and config.attention_bias:
            raise ArgError(f"--step persistent: {model} has q/k/v biases, which the persistent step does not")
        if family == "mamba2" and (config.ngroups != 1 or config.bias):
            raise ArgError(f"--step persistent: {model} has {config.ngroups} norm groups or projection biases; the persistent "
                           "step has one group and no biases")
        if family == "rwkv7":
            from declab_kernels.persistent_step.schedule import TILE_ROWS

            sizes = (config.hidden_size, config.v_low_rank_dim, config.decay_low_rank_dim, config.a_low_rank_dim, config.gate_low_rank_dim)
            if any(n % TILE_ROWS[0] for n in sizes):
                raise ArgError(f"--step persistent: {model}'s hidden size and LoRA ranks {sizes} are not all multiples of {TILE_ROWS[0]}")
    refusals = [
        (max(batches) > 1, f"batch 1 only, and --batch has {max(batches)}"),
        (resolve_impl(args.impl, device) != "triton", "a Triton kernel, and --impl resolves to ref here"),
        (kv_dtypes != [None], "the model's KV dtype only (drop --kv-dtype)"),
        (quants != [None], "dense weights only (drop --quant)"),
        (spec is not None, "plain decoding only (drop --spec)"),
        (args.tp > 1, "one process only (drop --tp)"),
    ]
    for refused, why in refusals:
        if refused:
            raise ArgError(f"--step persistent: {why}")
    return names


def quant_name(record: dict) -> str | None:
    """The quant name a record's `quant` entry gives (None: dense weights)."""
    return (record.get("quant") or {}).get("name")


def defaults(on_gpu: bool) -> dict:
    if on_gpu:
        return {"models": "llama-1b,mamba2-1.3b,rwkv7-1.5b,maskpredict-1b", "ctx": "4k..128k"}
    return {"models": "llama-tiny,mamba2-tiny,rwkv7-tiny,maskpredict-tiny", "ctx": "256..1k"}


def build_parser() -> argparse.ArgumentParser:
    from decoders.cli import Parser

    p = Parser(prog="python -m decoders.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", help="comma list of presets or checkpoint folders")
    p.add_argument("--ctx", help="contexts: 4k..128k (doubling), 4k,6k,32k, or integers (k = 1024)")
    p.add_argument("--batch", default="1", help="comma list of batch sizes (default 1)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per point (default 32)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size for attention families")
    p.add_argument("--kv-dtype", default=None,
                   help="comma list of KV cache dtypes swept for attention families: fp8, bf16, ... (default: the model's dtype)")
    p.add_argument("--quant", default=None,
                   help="comma list of weight quantisations swept for every model: none, int8, int4-rtn, int4-rtn-gN (default: none)")
    p.add_argument("--step", default=None,
                   help="comma list of decode steps swept for transformer, Mamba-2 and RWKV-7 models: graphed, persistent (default: graphed)")
    p.add_argument("--iterations", default="4", help="Mask-Predict: comma list of refinement passes T")
    p.add_argument("--block", type=int, default=None, help="Mask-Predict: semi-autoregressive block length")
    p.add_argument("--peers", default=None, help="comma list of peers run on the same points: hf, gpt-fast, mamba_ssm, fla")
    p.add_argument("--gpt-fast", default=None, metavar="PATH",
                   help="gpt-fast checkout (its model.py and generate.py) the gpt-fast peer runs from (default: $DECLAB_GPT_FAST)")
    p.add_argument("--peers-only", action="store_true", help="run only the peers' points (the lab's own rows come from another sweep)")
    p.add_argument("--spec", default=None, help="speculative decoding of every autoregressive model: draft=PRESET_OR_FOLDER|ngram|heads:FOLDER,k=4[,verify=chunk|steps][,graphs=1]")
    p.add_argument("--out", default="runs/compare.jsonl", help="JSON lines file, appended point by point (default runs/compare.jsonl)")
    p.add_argument("--plot", default=None, help="figure (.png, .pdf, .svg): decode tokens/s against context, one line per model and peer")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--point-timeout", type=float, default=None,
                   help="seconds after which a point (warm-up and measurement; a peer's first point also its build) is recorded as timeout")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel over this many processes (launch with torchrun --nproc-per-node N)")
    p.add_argument("--spread", action="store_true",
                   help="share the points out over the processes of a torchrun launch (the default there with --tp 1)")
    return p


def plan_points(models, ctxs, batches, iterations, peer_names=(), device=None, own=True, kv_dtypes=(None,), quants=(None,),
                steps=(None,)):
    """(model, family, T, kv_dtype, quant, step, batch, ctx, peer) in sweep order; T only for Mask-Predict models,
    kv_dtype (one point per entry of `kv_dtypes`) only for the families with a KV cache, quant one
    point per entry of `quants` (None: the model's own weights), step one per entry of `steps` for the
    families that take the option (None: the default step). After a
    model's own points (peer None; left out when not `own`) come its peers' points (a `peers.Peer`),
    each peer's contexts in a row; a peer that cannot run the model is one point (a `peers.Absent`,
    batch and ctx None)."""
    import decoders
    from decoders import peers

    for model in models:
        family = decoders.family_of(model)
        takes = decoders.family_options(family)
        for it in (iterations if "iterations" in takes else [None]) if own else []:
            for kv in kv_dtypes if "kv_dtype" in takes else [None]:
                for q in quants:
                    for step in steps if "step" in takes else [None]:
                        for batch in batches:
                            for ctx in ctxs:
                                yield model, family, it, kv, q, step, batch, ctx, None
        for name in peer_names:
            for peer in peers.plan(name, model, family, device):
                if isinstance(peer, peers.Absent):
                    yield model, family, None, None, None, None, None, None, peer
                    continue
                for batch in batches:
                    for ctx in ctxs:
                        yield model, family, None, None, None, None, batch, ctx, peer


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def format_table(records: list[dict]) -> str:
    cols = [
        ("model", "{}"), ("T", "{}"), ("kv", "{}"), ("quant", "{}"), ("step", "{}"), ("batch", "{}"), ("ctx", "{}"), ("status", "{}"), ("ttft ms", "{:.1f}"),
        ("p50 ms", "{:.2f}"), ("p99 ms", "{:.2f}"), ("tok/s/seq", "{:.1f}"), ("tok/s", "{:.1f}"),
        ("prefill tok/s", "{:.0f}"), ("MBU", "{:.2f}"), ("MBU nom", "{:.2f}"), ("decay", "{:.2f}"), ("spread", "{:.0%}"),
        ("max batch", "{}"),
    ]
    keys = ["model", "iterations", "kv_dtype", "quant", "step", "batch", "ctx", "status", "ttft_ms", "step_ms_p50", "step_ms_p99", "decode_tok_s_per_seq",
            "decode_tok_s", "prefill_tok_s", "mbu", "mbu_nominal", "decay", "spread", "max_batch_fits"]
    rows = [[name for name, _ in cols]]
    for r in records:
        r = {**r, "quant": quant_name(r)}
        rows.append(["-" if r.get(k) is None else fmt.format(r[k]) for (_, fmt), k in zip(cols, keys)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def cpu_note(records: list[dict], threads: int) -> str:
    """What the table's CPU figures are, in words: the code path exercised, not a measurement."""
    spreads = [r["spread"] for r in records if r.get("spread") is not None]
    worst = f"; the repeated runs of a point differ by up to {max(spreads):.0%}" if spreads else ""
    return (f"CPU: these figures exercise the code path ({threads} thread(s)){worst}; "
            "they are not performance measurements (run on a GPU for those)")


def summary(records: list[dict], where: str) -> dict:
    """The last stdout line: where the full records are, and each point's status and headline figures."""
    keep = ("model", "peer", "iterations", "kv_dtype", "quant", "step", "batch", "ctx", "status", "decode_tok_s_per_seq", "step_ms_p50", "ttft_ms", "mbu",
            "mbu_nominal", "decay", "spread", "max_batch_fits")
    # Four significant digits: a headline, not the record.
    records = [{**r, "quant": quant_name(r)} for r in records]
    points = [{k: float(f"{r[k]:.4g}") if isinstance(r[k], float) else r[k] for k in keep if r.get(k) is not None} for r in records]
    return {"out": where, "points": points, "ok": sum(r.get("status") == "ok" for r in records)}


def format_reasons(records: list[dict]) -> str:
    """One line per row the table shows without numbers (a reason repeated over contexts once)."""
    lines = {}
    for r in records:
        if r.get("status") != "ok" and r.get("reason"):
            lines.setdefault((r["model"], r["status"], r["reason"]), f"{r['model']}: {r['status']}: {r['reason']}")
    return "\n".join(lines.values())


def measure_lab_point(args, dec, gate, model, it, batch, ctx, ceiling, env) -> dict:
    """The record of one of the lab's own points: gated by the correctness check, skipped when the
    state does not fit."""
    from decoders import harness

    record = {"model": model, "iterations": it, **dec.describe(), "ceilings": ceiling, "correctness": gate, **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if "error" in gate:
        record.update(status="error", reason=f"correctness check failed to run: {gate['error']}", ctx=ctx, batch=batch)
    elif not gate["ok"]:
        record.update(status="refused", reason=f"{dec.impl} disagrees with the reference (rel. RMS {gate['rel_rms']:.2e} > {gate['tolerance']:.2e})", ctx=ctx, batch=batch)
    elif (why := fits(dec, batch, ctx, args.new_tokens)) is not None:
        record.update(status="skipped", reason=why, ctx=ctx, batch=batch)
    else:
        try:
            record.update(status="ok", **harness.measure(dec, ctx=ctx, batch=batch, new_tokens=args.new_tokens, ceiling=ceiling, seed=args.seed))
            if getattr(dec, "tp", None) is not None:
                record.update(distributed.collective_time(dec, batch))
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            record.update(status="skipped", reason=f"out of memory: {first_line(e)}", ctx=ctx, batch=batch)
        except RuntimeError as e:
            # Recorded, not raised: one failing point must not cost the sweep its other points.
            record.update(status="error", reason=first_line(e), ctx=ctx, batch=batch)
    return record


def fits(dec, batch, ctx, new_tokens):
    """`harness.fits`; for a tensor-parallel decoder the first rank's reason, the same on all ranks."""
    from decoders import harness

    why = harness.fits(dec, batch, ctx, new_tokens)
    return why if getattr(dec, "tp", None) is None else distributed.first_reason(why, dec.tp)


def add_decay(records: list[dict]) -> None:
    """Each record's decode tok/s over that of the first (smallest-context) record of its model,
    iterations, KV cache dtype, weight quantisation, decode step and batch, in sweep order."""
    base = {}
    for record in records:
        if record.get("decode_tok_s_per_seq"):
            key = (record["model"], record.get("iterations"), record.get("kv_dtype"), quant_name(record), record.get("step"), record["batch"])
            first = base.setdefault(key, record["decode_tok_s_per_seq"])
            record["decay"] = record["decode_tok_s_per_seq"] / first


def check_distributed(args, models, peer_names, spec, here) -> bool:
    """The launch checks (`distributed.check_launch`) and what tensor parallel does not combine with;
    whether the points are spread over the ranks."""
    distributed.check_launch(args.tp, args.spread, here, "decoders.compare")
    if args.tp > 1:
        for option, given in (("--peers", peer_names), ("--spec", spec), ("--point-timeout", args.point_timeout)):
            if given:
                raise ArgError(f"{option} does not combine with --tp (every rank must run the same work in step)")
        import decoders

        for model in models:
            family, config = decoders.model_config(model)
            distributed.check_splits(family, config, args.tp, model)
    return here.launched and args.tp == 1


def release_peers(peer_models: dict, device) -> None:
    """Drop the peer model kept between points, and what compiling it left behind."""
    if peer_models:
        peer_models.clear()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_peer_point(args, dec, peer, peer_models, model, family, batch, ctx, ceiling, env) -> dict:
    """The record of a peer's point, measured by `harness.measure` like the lab's own. The peer's
    model is built once for its points (random weights of `dec`'s shape)."""
    from decoders import harness, peers

    key = (model, peer.name)
    if key not in peer_models:
        release_peers(peer_models, dec.device)
        try:
            peer_models[key] = (peers.build(peer, dec, seed=args.seed), None)
        except Exception as e:
            # A third-party library can fail in any way; the sweep records it and goes on.
            peer_models[key] = (None, first_line(e))
    built, build_error = peer_models[key]
    record = {"iterations": None, **peers.describe(peer, dec, model, family), "ceilings": ceiling, **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    record.update(ctx=ctx, batch=batch)
    if build_error is not None:
        record.update(status="error", reason=f"building {peer.name} failed: {build_error}")
        return record
    subject = peers.PeerDecoder(peer, built, dec)
    if (why := harness.fits(subject, batch, ctx, args.new_tokens)) is not None:
        record.update(status="skipped", reason=why)
        return record
    try:
        record.update(status="ok", **harness.measure(subject, ctx=ctx, batch=batch, new_tokens=args.new_tokens, ceiling=ceiling, seed=args.seed))
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        record.update(status="skipped", reason=f"out of memory: {first_line(e)}")
    except Exception as e:
        record.update(status="error", reason=first_line(e))
    return record


def measure_point(args, point, loaded, peer_models, device, spec, tp, ctxs, ceiling, env, kept) -> dict:
    """The record of one point of the plan. The lab's decoder of its model is loaded and gated once and
    kept in `loaded` for the points after it (split over the ranks of `tp` when given); `kept` says
    where the finished points are, for an error that ends the sweep."""
    import decoders
    from decoders import harness, peers

    model, family, it, kv, q, step, batch, ctx, peer = point
    if isinstance(peer, peers.Absent):
        record = {"iterations": None, **peers.describe(peer, None, model, family), **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        record.update(status=peer.status, reason=peer.reason, ctx=None, batch=None)
        return record
    key = (model, it, kv, q, step)
    if key not in loaded:
        loaded.clear()
        release_peers(peer_models, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        takes = decoders.family_options(family)
        options = {"page_size": args.page_size} if "page_size" in takes else {}
        if kv is not None:
            options["kv_dtype"] = kv
        if step is not None:
            options["step"] = step
        if "iterations" in takes:
            options.update(iterations=it, block_length=args.block)
        try:
            dec = decoders.load(model, device=device, dtype=args.dtype, impl=args.impl, seed=args.seed, tp=tp, quant=q, **options)
            dec.check_context(max(ctxs))
        except decoders.USER_ERRORS as e:
            # Found only when its weights are read (a mis-shaped tensor): the points before it stay.
            raise type(e)(f"{e} ({kept})") from None
        try:
            gate = harness.check_against_reference(dec, new_tokens=args.new_tokens, seed=args.seed)
        except RuntimeError as e:
            gate = {"ok": False, "rel_rms": None, "tolerance": None, "error": first_line(e)}
        if spec is not None:
            # The gate checked the target's kernels; the points time it decoding speculatively.
            dec = spec.wrap(dec)
        loaded[key] = (dec, gate)
    dec, gate = loaded[key]
    try:
        with deadline(args.point_timeout):
            if peer is None:
                record = measure_lab_point(args, dec, gate, model, it, batch, ctx, ceiling, env)
            else:
                record = measure_peer_point(args, dec, peer, peer_models, model, family, batch, ctx, ceiling, env)
    except PointTimeout as e:
        described = {"model": model, "iterations": it, **dec.describe()} if peer is None else \
            {"iterations": None, **peers.describe(peer, dec, model, family)}
        record = {**described, **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ctx": ctx, "batch": batch,
                  "status": "timeout", "reason": str(e)}
    return record


def run(args) -> int:
    import decoders
    from decoders import harness
    from declab_kernels import resolve_impl
    from decoders.records import environment
    from decoders.cli import JsonlSink, check_figure_file, check_records_file
    from decoders.quant import check_load_quant

    here = distributed.world()
    lead = here.rank == 0
    device = decoders.parse_device(args.device)
    on_gpu = device.type == "cuda"
    chosen = defaults(on_gpu)
    said = [f"--{k} {v}" for k, v in chosen.items() if getattr(args, k) is None]
    if said and lead:
        print(f"defaults for this {'GPU' if on_gpu else 'CPU'}: {' '.join(said)}", file=sys.stderr)
    models = list(dict.fromkeys(m.strip() for m in (args.models or chosen["models"]).split(",") if m.strip()))
    if not models:
        raise ArgError(f"--models {args.models!r} names no model")
    ctxs = parse_ctx(args.ctx or chosen["ctx"])
    batches = parse_ints(args.batch, "batch")
    iterations = parse_ints(args.iterations, "iterations")
    if args.new_tokens < 1:
        raise ArgError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.new_tokens >= min(ctxs):
        raise ArgError(f"--new-tokens {args.new_tokens} leaves no prompt at context {min(ctxs)}")
    peer_names = parse_peers(args.peers) if args.peers is not None else []
    if args.peers_only and not peer_names:
        raise ArgError("--peers-only needs --peers")
    check_gpt_fast(args.gpt_fast, peer_names)
    if args.point_timeout is not None and not args.point_timeout > 0:
        raise ArgError(f"--point-timeout must be a positive number of seconds, got {args.point_timeout}")
    if args.block is not None and args.block < 1:
        raise ArgError(f"--block must be >= 1, got {args.block}")
    decoders.parse_dtype(args.dtype)
    try:
        decoders.check_page_size(args.page_size)
    except UsageError as e:
        raise ArgError(f"--page-size: {e}") from None
    kv_dtypes = parse_kv_dtypes(args.kv_dtype) if args.kv_dtype is not None else [None]
    quants = parse_quants(args.quant) if args.quant is not None else [None]
    if args.tp > 1 and quants != [None]:
        raise ArgError("--quant does not combine with --tp (quantised weights are not split over processes)")
    try:
        resolve_impl(args.impl, device)
    except ValueError as e:
        raise ArgError(f"--impl: {e}") from None
    spec = parse_spec(args.spec, targets=models, peers=peer_names) if args.spec else None
    steps = parse_steps(args, models, batches, kv_dtypes, quants, spec, device) if args.step is not None else [None]
    spread = check_distributed(args, models, peer_names, spec, here)
    out = check_records_file(args.out, "--out")
    # Spread: each rank appends its own records as they finish; rank 0 writes them all to --out at the end.
    part = out.with_name(f"{out.name}.rank{here.rank}") if spread else None
    sink = JsonlSink(part or out)
    if args.plot:
        check_figure_file(args.plot, "--plot")
    for model in models:
        family = decoders.check_model(model, context=max(ctxs))
        if args.kv_dtype is not None and "kv_dtype" not in decoders.family_options(family):
            raise ArgError(f"--kv-dtype: {model} ({family}) has no KV cache; leave it out of --models or drop --kv-dtype")
        for q in quants:
            try:
                check_load_quant(model, q)
            except decoders.USER_ERRORS as e:
                raise ArgError(f"--quant: {e}") from None
    device = distributed.device_of(device, here)

    group = distributed.setup(device, here) if here.launched else None
    plan = list(plan_points(models, ctxs, batches, iterations, peer_names, device, own=not args.peers_only, kv_dtypes=kv_dtypes,
                            quants=quants, steps=steps))
    mine = distributed.share(len(plan), here) if spread else range(len(plan))
    tp = group if args.tp > 1 else None
    threads = harness.pin_cpu_threads() if device.type == "cpu" else None
    env = {**environment(device), **({"cpu_threads": threads} if threads else {}), "world_size": here.size, "rank": here.rank, "tp": args.tp}
    ceiling = harness.ceilings(device)
    if lead:
        print(f"ceilings on {env['device']}: copy {ceiling['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {ceiling['matmul_flops'] / 1e12:.1f} TFLOP/s", file=sys.stderr)
    records, indexed = [], []
    progress = None
    if not args.no_progress and lead:
        from tqdm import tqdm

        progress = tqdm(total=len(mine), file=sys.stderr, unit="point")
    loaded, peer_models = {}, {}
    try:
        for index in mine:
            model, family, it, _, _, _, batch, ctx, peer = plan[index]
            try:
                record = measure_point(args, plan[index], loaded, peer_models, device, spec, tp, ctxs, ceiling, env,
                                       f"{len(records)} finished point(s) kept in {sink.where}")
            except Exception as e:
                if not spread:
                    raise
                # Spread: a rank's failure is this point's record; its other points and the other ranks' stay.
                record = {"model": model, "iterations": it, **env, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ctx": ctx, "batch": batch,
                          "status": "error", "reason": f"rank {here.rank}: {first_line(e)}"}
            if not spread:
                add_decay(records + [record])
            if lead or spread:
                sink.append(record)
            records.append(record)
            indexed.append((index, record))
            if progress:
                progress.update()
    except KeyboardInterrupt:
        print(f"interrupted: {len(records)} finished point(s) kept in {sink.where}", file=sys.stderr)
        spread = False
    finally:
        if progress:
            progress.close()
    if spread:
        gathered = distributed.collect(indexed, here)
        part.unlink(missing_ok=True)
        if not lead:
            return 0 if len(records) == len(mine) else 130
        records = [record for _, record in gathered]
        add_decay(records)
        sink = JsonlSink(out)
        for record in records:
            sink.append(record)
    if not lead:
        return 0 if len(records) == len(plan) else 130
    print(format_table(records))
    if reasons := format_reasons(records):
        print(reasons)
    if threads:
        print(cpu_note(records, threads))
    code = 0 if len(records) == len(plan) else 130
    if args.plot:
        from decoders.plot import plot_context_scaling

        try:
            plot_context_scaling(records, args.plot)
            print(f"plot written to {args.plot}", file=sys.stderr)
        except OSError as e:
            print(f"error: --plot {args.plot} could not be written ({e.strerror or e}); the points are in {sink.where}, "
                  f"redraw with python -m decoders.plot", file=sys.stderr)
            code = code or 1
    print(json.dumps(summary(records, sink.where)))
    return code


def main(argv=None) -> int:
    """Exit status: 0 when every point finished, 130 when interrupted, 2 for input the lab refuses."""
    from decoders.cli import run_command

    try:
        return run_command(build_parser, run, argv)
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
