"""Offline sm_90 compile of the persistent decode step's kernels at an H200's plan (no GPU needed).

    python -m declab_bench.persistent_compile                       # llama-1b, mamba2-1.3b, rwkv7-1.5b
    python -m declab_bench.persistent_compile --models llama-1b --programs 264 --splits 32
    python -m declab_bench.persistent_compile --models mamba2-1.3b --tiles in_rows=16 --ptx-version 8.7   # under Triton 3.6

TRITON_INTERPRET must be unset. Each model is built on the CPU in bf16 (random weights, its ref path: no
kernel runs), its step planned for P programs (a transformer over a 4k cache cut into `--splits` key
splits, the H200's count at 4k), and its kernel compiled for `GPUTarget("cuda", 90, 64)` with the launch's
warps and `maxnreg`; the PTX (its `.version` set to `--ptx-version`, default 8.8: Triton 3.9's CPU wheel
writes 9.x and bundles a ptxas that takes 8.8; Triton 3.6, the H200's, takes 8.7) is assembled by
Triton's ptxas for sm_90a. `--tiles NAME=ROWS,...` replaces fields of the planned tiles of a Mamba-2 or
RWKV-7 step (`Mamba2Tiles`, `RWKV7Tiles`), e.g. to read the SASS of a tile size the plan does not pick.
Per model: the tiles, registers, spill bytes, shared memory, the programs an SM holds by
`launch.resident_programs`' rule, and each inner loop of the SASS with its global loads: how many are
read before the loop's back edge (a load read there, even by a move, is waited on in the iteration that
issued it) and how many stay in flight across it. Last stdout line: one JSON document.
"""

import dataclasses
import json
import os
import re
import sys

import torch

import decoders
from declab_bench import pdl_check
from decoders import UsageError
from decoders.cli import Parser, run_command
from declab_kernels import paged_attention
from declab_kernels.persistent_step import launch, schedule_mamba2, schedule_rwkv7

DTYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
# Shared memory of an H200 SM that programs may use (228 KB).
SHARED_PER_SM = 233472
CTX = 4096
# The tile records `--tiles` may change, per family.
TILE_FIELDS = {"mamba2": schedule_mamba2.Mamba2Tiles, "rwkv7": schedule_rwkv7.RWKV7Tiles}


def parse_tiles(text: str | None, family: str) -> dict:
    """`--tiles NAME=ROWS,...` as {name: rows}, checked against the family's tile record."""
    if not text:
        return {}
    if family not in TILE_FIELDS:
        raise UsageError(f"--tiles applies to Mamba-2 and RWKV-7 models, not {family}")
    names = [f.name for f in dataclasses.fields(TILE_FIELDS[family])]
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.partition("=")
        if name not in names:
            raise UsageError(f"--tiles {part!r}: NAME is one of {', '.join(names)} for {family}")
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"--tiles {part!r}: ROWS must be an integer >= 1")
        out[name] = int(value)
    return out


def build(model: str, programs: int, splits: int, tiles: dict | None = None):
    dec = decoders.load(model, device="cpu", dtype=torch.bfloat16, impl="ref")
    cache = dec.new_cache([1], CTX)
    if hasattr(cache, "workspace"):
        c = dec.config
        cache.workspace = paged_attention.decode_workspace(1, c.num_attention_heads, c.num_key_value_heads, c.head_dim, CTX, "cpu",
                                                           num_splits=splits, variant="long")
    step = dec.persistent_step(cache, programs=programs)
    if not tiles:
        return step
    try:
        return dec.persistent_step(cache, programs=programs, tiles=dataclasses.replace(step.tiles, **tiles))
    except ValueError as e:
        raise UsageError(f"--tiles: {e}") from None


def compile_step(step, ptx_version: str = "8.8") -> tuple[dict, str]:
    """The kernel of `step` compiled and assembled: its figures and its SASS."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = step.kernel
    consts = dict(step.consts)
    consts.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in consts})
    probe = torch.zeros(1, dtype=torch.int64)
    args = iter(step._launch_args(probe, probe))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        a = next(args)
        sig[name] = DTYPES[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
        # Tensors are 16-byte aligned and integers multiples of 16 specialised, as at a launch.
        if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=launch.NUM_WARPS, maxnreg=launch.MAX_REGISTERS))
    _, sass, regs, (spill_stores, spill_loads), shared = pdl_check.assemble(k, ptx_version=ptx_version)
    per_warp = -(-regs * 32 // 256) * 256
    resident = min(launch.REGISTERS_PER_SM // per_warp // launch.NUM_WARPS, 2048 // (32 * launch.NUM_WARPS),
                   SHARED_PER_SM // (shared + 1024), launch.MAX_PROGRAMS_PER_SM)
    return dict(registers=regs, spill_stores=spill_stores, spill_loads=spill_loads, shared=shared,
                programs_per_sm=resident), sass


def loops(sass: str) -> list[dict]:
    """Inner loops of SASS text (`pdl_check.sass_loops` over at most 1000 instructions with 8 or more
    FFMAs) and their global loads: waited (its destination read later in the body) or in flight across
    the back edge."""
    found = []
    for start, body in pdl_check.sass_loops(sass):
        if len(body) > 1000 or sum("FFMA" in s for s in body) < 8:
            continue
        waited = carried = spills = 0
        for j, s in enumerate(body):
            spills += s.startswith(("LDL", "STL"))
            m = re.match(r"(?:@!?P\d+ )?LDG\.(\S+)\s+R(\d+),", s)
            if not m:
                continue
            width = 4 if "128" in m.group(1) else 2 if "64" in m.group(1) else 1
            dst = {f"R{r}" for r in range(int(m.group(2)), int(m.group(2)) + width)}
            # Read later in the body: an operand after the destination (a store's first operand is read too).
            reads = (set(re.findall(r"\bR\d+\b", s2.split(None, 1)[-1] if s2.startswith(("ST", "RED", "ATOM")) else
                                    s2.split(",", 1)[1] if "," in s2 else "")) for s2 in body[j + 1:])
            if any(dst & r for r in reads):
                waited += 1
            else:
                carried += 1
        found.append(dict(start=hex(start), instructions=len(body), loads_waited=waited, loads_in_flight=carried, spill_ops=spills))
    return found


def run(args) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("unset TRITON_INTERPRET: the check compiles for sm_90")
    if args.programs < 1 or args.splits < 1:
        raise UsageError(f"--programs and --splits must be at least 1, got {args.programs} and {args.splits}")
    models = [m for m in args.models.split(",") if m]
    tiles = {}
    for model in models:
        family = decoders.check_model(model, context=CTX)
        if family not in ("transformer", "mamba2", "rwkv7"):
            raise UsageError(f"{model} ({family}) has no persistent step (transformer, mamba2 and rwkv7 models only)")
        tiles[model] = parse_tiles(args.tiles, family)
    out = {}
    for model in models:
        step = build(model, args.programs, args.splits, tiles[model])
        figures, sass = compile_step(step, args.ptx_version)
        out[model] = dict(tiles=vars(step.tiles), **figures, loops=loops(sass))
        print(model, json.dumps(out[model]), flush=True)
    print(json.dumps(out))
    return 0


def build_parser():
    p = Parser(prog="python -m declab_bench.persistent_compile", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b,mamba2-1.3b,rwkv7-1.5b", help="llama, Mamba-2 or RWKV-7 presets (comma list)")
    p.add_argument("--programs", type=int, default=264, help="P (default 264: two programs on each of an H200's 132 SMs)")
    p.add_argument("--splits", type=int, default=32, help="key splits of a transformer's attention (default 32: an H200 at 4k)")
    p.add_argument("--tiles", help="NAME=ROWS,...: fields of a Mamba-2 or RWKV-7 step's planned tiles replaced (e.g. in_rows=16)")
    p.add_argument("--ptx-version", type=pdl_check._ptx_version, default="8.8",
                   help="the PTX .version given to ptxas (default 8.8, for Triton 3.9's CPU wheel; 8.7 for Triton 3.6)")
    return p


def main(argv=None) -> int:
    return run_command(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
