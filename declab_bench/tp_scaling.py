"""Tensor-parallel decoding against one GPU, in the same run (launched by torchrun; GPUs or the CPU).

    torchrun --nproc-per-node 2 -m declab_bench.tp_scaling --model llama-8b --ctx 4k,128k --out results/tp_scaling.jsonl

Every rank builds the full model once (random weights from one seed). Then rank 0 alone decodes on the
whole model (TP=1) while the other ranks wait, and all ranks decode with the model split over them
(TP=N), each point measured by `decoders.harness.measure` (batch 1 by default; CUDA graphs on the Triton
path). Per point rank 0 appends one JSON line to --out (as it finishes) and prints a row: decode tok/s,
median step, MBU (the rank's share of the bytes a step moves over its GPU's measured copy bandwidth,
which is all the bytes over the ranks' combined bandwidth; `mbu_nominal` against the datasheet), the
time the step's collectives take alone (`decoders.distributed.collective_time`), the speed-up over
TP=1 at that context, and how far the TP=N logits of a short prompt are from TP=1's (relative RMS).
"""

import argparse
import copy
import json
import sys

import torch

import decoders
from declab_kernels import resolve_impl
from decoders.records import environment
from decoders import distributed, harness
from decoders.cli import JsonlSink, Parser, check_records_file
from decoders.compare import parse_ctx


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="torchrun --nproc-per-node N -m declab_bench.tp_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8b", help="a preset (default llama-8b)")
    p.add_argument("--ctx", default="4k,128k", help="contexts (as decoders.compare takes them; default 4k,128k)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="decode steps launched from Python, not replayed from a CUDA graph")
    p.add_argument("--out", default="runs/tp_scaling.jsonl")
    return p


def row(r: dict) -> str:
    collectives = f"{r['collective_ms_per_step']:6.3f}" if "collective_ms_per_step" in r else "     -"
    return (f"{r['model']:>10}  tp {r['tp']}  ctx {r['ctx']:>6}  {r['decode_tok_s_per_seq']:8.1f} tok/s  {r['step_ms_p50']:7.3f} ms  "
            f"MBU {r['mbu']:.2f}  collectives {collectives} ms/step  x{r['speedup']:.2f}")


def run(args) -> int:
    here = distributed.world()
    lead = here.rank == 0
    device = distributed.device_of(decoders.parse_device(args.device), here)
    ctxs = parse_ctx(args.ctx)
    family, config = decoders.model_config(args.model)
    if not here.launched:
        raise decoders.UsageError("launch with torchrun --nproc-per-node N (N >= 2) -m declab_bench.tp_scaling ...")
    distributed.check_splits(family, config, here.size, args.model)
    if args.new_tokens >= min(ctxs):
        raise decoders.UsageError(f"--new-tokens {args.new_tokens} leaves no prompt at context {min(ctxs)}")
    try:
        impl = resolve_impl(args.impl, device)
    except ValueError as e:
        raise decoders.UsageError(f"--impl: {e}") from None
    sink = JsonlSink(check_records_file(args.out, "--out")) if lead else None
    group = distributed.setup(device, here)

    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = decoders.family_class(family).arch
    full = arch.build(config, None, args.model, seed=args.seed)
    cls = decoders.family_class(family)
    common = dict(device=device, dtype=dtype, impl=impl, source=args.model, **({"cuda_graphs": False} if args.eager else {}))
    ceiling = harness.ceilings(device)
    env = {**environment(device), "world_size": here.size}
    probe = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(args.seed))
    base, one_logits, records = {}, None, []

    def finish(record):
        record["speedup"] = record["decode_tok_s_per_seq"] / base[record["ctx"]]
        sink.append(record)
        records.append(record)
        print(row(record), flush=True)

    if lead:
        one = cls(copy.deepcopy(full), config, **common)
        one_logits = one.logits(probe).float()
        for ctx in ctxs:
            record = {"model": args.model, "tp": 1, **one.describe(), "ceilings": ceiling, **env,
                      **harness.measure(one, ctx=ctx, batch=args.batch, new_tokens=args.new_tokens, ceiling=ceiling, seed=args.seed)}
            base[ctx] = record["decode_tok_s_per_seq"]
            finish(record)
        del one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    split = distributed.tp_class(cls)(full, config, tp_group=group, **common)
    split_logits = split.logits(probe).float()
    agreement = harness.relative_rms(split_logits, one_logits) if lead else None
    for ctx in ctxs:
        measured = harness.measure(split, ctx=ctx, batch=args.batch, new_tokens=args.new_tokens, ceiling=ceiling, seed=args.seed)
        collectives = distributed.collective_time(split, args.batch)
        if lead:
            finish({"model": args.model, **split.describe(), "ceilings": ceiling, **env, **measured, **collectives,
                    "logits_rel_rms_vs_tp1": agreement, "combined_copy_bytes_per_s": here.size * ceiling["copy_bytes_per_s"]})
    if lead:
        print(json.dumps({"out": args.out, "points": [{k: r.get(k) for k in ("tp", "ctx", "decode_tok_s_per_seq", "mbu", "speedup",
                                                                            "collective_ms_per_step")} for r in records]}))
    return 0


def main(argv=None) -> int:
    from decoders.cli import run_command

    try:
        return run_command(build_parser, run, argv)
    finally:
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
