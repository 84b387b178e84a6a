"""GEMV benchmark on one GPU: every Triton configuration against F.linear (cuBLAS) at decode shapes.

    python -m declab_bench.gemv --out results/gemv.jsonl [--budget 90]
    python -m declab_bench.gemv --compile-only     # sm_90 registers / spills / shared memory, no GPU

bf16, weight `[N, K]` for (N, K) in SHAPES at M in ROWS rows, then the grouped case (G=3 products of
[2048, 2048] at M=1, one launch, against three F.linear calls). Per case, every record appended to
`--out` as soon as it is measured (one JSON line with `decoders.records.environment`):
1. self-check of F.linear and of every Triton configuration that fits the shape (`config_fits`)
   against the float32 reference; a Triton configuration that fails is not timed and the run
   exits non-zero;
2. µs per call from a CUDA graph of `copies` calls, each on its own copy of the weight, so that the
   copies together (>= 256 MB, at least two) overflow L2 and every call reads its weight from HBM
   as in a decode step; bytes = weight + x + y; fraction of the copy bandwidth;
3. (ungrouped) `linear`'s own choice for the shape (it autotunes, then times the tuned kernel
   against F.linear once) and the configuration autotuning picked.
After `--budget` seconds the remaining cases time F.linear and `linear`'s choice only. Tables are
printed at the end (µs by configuration, then the summary), then one JSON line summarising the run.
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = ((2048, 2048), (3072, 2048), (2048, 4096), (2048, 8192), (8192, 2048), (8512, 2048), (16384, 2048),
          (65536, 2048), (128256, 2048))
ROWS = (1, 4, 8)
GROUPED = ((3, 1, 2048, 2048),)  # (G, M, N, K)
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32
TIME_BUDGET_S = 75
TOL = 1e-2


def rel(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


def cases():
    for N, K in SHAPES:
        for M in ROWS:
            yield 1, M, N, K
    yield from GROUPED


def compile_report(rows=(1, 4, 8)):
    """Compile every configuration for sm_90 offline (no GPU, TRITON_INTERPRET unset): registers,
    spills (ptxas -v), shared memory, whether the weight loads are cp.async-pipelined."""
    import triton

    from declab_kernels.gemv.triton import CONFIGS, _gemv_kernel, config_fits, config_name
    from declab_bench.pdl_check import compile_one

    print(f"{'config':<28}{'M':>3}{'regs':>6}{'spill st/ld':>13}{'smem KB':>9}  weight loads")
    for cfg in CONFIGS:
        for M in rows:
            if not config_fits(cfg, M, 8192):
                continue
            consts = dict(G=1, stride_xg=0, stride_wg=0, stride_bg=0, stride_og=0,
                          M_POW2=triton.next_power_of_2(M), HAS_BIAS=False, DOT_PREC="tf32", **cfg.kwargs)
            if M == 1:
                consts["M"] = 1
            # As the benchmark launches them (without PDL): 16-byte aligned pointers, N, K and row
            # strides multiples of 16.
            ptx, _, regs, spills, shared = compile_one(
                _gemv_kernel, ptrs={"part_ptr": "*fp32", "cnt_ptr": "*i32"}, floats=("eps",), consts=consts,
                options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), unaligned=("M", "stride_zm"))
            n_cp = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
            loads = f"cp.async ({n_cp} in the PTX)" if n_cp else "ld.global.v4 to registers"
            print(f"{config_name(cfg):<28}{M:>3}{regs if regs is not None else '?':>6}{spills:>13}{shared / 1024:>9.1f}  {loads}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON-lines file the records are appended to")
    ap.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                    help="seconds after which the remaining cases time F.linear and linear's choice only")
    ap.add_argument("--compile-only", action="store_true", help="print the offline sm_90 compile report and exit")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.compile_only:
        compile_report()
        return
    if not args.out:
        ap.error("--out is required")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("declab_bench.gemv needs a CUDA GPU (or --compile-only)")
    from declab_kernels import gemv as G_
    from declab_kernels.timing import copy_bandwidth, time_ms
    from decoders.records import append_jsonl, environment
    from declab_kernels.gemv.triton import CONFIGS, config_fits, config_name, gemv_triton, tuned_config

    start = time.monotonic()
    env = environment(device)
    failures = []
    per_config = []   # (case label, {config index: us})
    summary_rows = []

    def emit(rec):
        append_jsonl(args.out, {"bench": "gemv", **rec, "env": env})

    bw = copy_bandwidth(device)
    emit({"kind": "ceiling", "copy_bytes_per_s": bw})
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    for G, M, N, K in cases():
        grouped = G > 1 or (G, M, N, K) in GROUPED
        label = f"{'G=%d ' % G if grouped else ''}M={M} [{N},{K}]"
        wbytes = G * N * K * 2
        nbytes = wbytes + G * (M * K + M * N) * 2
        copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / wbytes)))
        wshape = (copies, G, N, K) if grouped else (copies, N, K)
        ws = torch.randn(wshape, device=device, dtype=dtype, generator=gen) * K ** -0.5
        x = torch.randn((G, M, K) if grouped else (M, K), device=device, dtype=dtype, generator=gen)
        want = torch.matmul(x.float(), ws[0].float().transpose(-1, -2))
        out = torch.empty_like(want, dtype=dtype)
        base = {"G": G, "M": M, "N": N, "K": K, "dtype": "bfloat16", "copies": copies, "bytes": nbytes}

        def record(impl, config, fn, err):
            def graph_body():
                for i in range(copies):
                    fn(ws[i])

            us = time_ms(graph_body, graph=True, warmup=3, iters=20) * 1e3 / copies
            gbs = nbytes / (us * 1e-6) / 1e9
            emit({"kind": "time", **base, "impl": impl, "config": config, "us": us, "gb_per_s": gbs,
                  "frac_copy_bw": gbs * 1e9 / bw, "rel_err": err})
            return us

        if grouped:
            def torch_fn(w):
                for g in range(G):
                    F.linear(x[g], w[g])

            err_t = max(rel(F.linear(x[g], ws[0, g]), want[g]) for g in range(G))
        else:
            def torch_fn(w):
                F.linear(x, w)

            err_t = rel(F.linear(x, ws[0]), want)
        t_torch = record("torch" if not grouped else f"torch x{G}", None, torch_fn, err_t)
        times = {}
        if time.monotonic() - start < args.budget:
            for i, cfg in enumerate(CONFIGS):
                if not config_fits(cfg, M, K):
                    continue
                name = config_name(cfg)
                err = rel(gemv_triton(x, ws[0], out=out, config=cfg), want)
                ok = err < TOL
                emit({"kind": "selfcheck", **base, "config": name, "rel_err": err, "ok": ok})
                if not ok:
                    failures.append(f"{label} {name}: rel err {err:.1e}")
                    continue
                times[i] = record("triton", name, lambda w, cfg=cfg: gemv_triton(x, w, out=out, config=cfg), err)
        else:
            emit({"kind": "skipped", **base, "what": "triton configs", "reason": f"time budget {args.budget:.0f}s spent"})
        per_config.append((label, times))
        # linear's own choice (its graph-timed sweep); the grouped form has no linear: the autotuner's pick.
        if grouped:
            gemv_triton(x, ws[0])
            pick, choice = tuned_config(M, N, K, G, False, dtype), None
            pick_name = config_name(pick) if pick is not None else None
        else:
            G_.linear(x, ws[0], impl="triton")
            choice = G_.choices().get((M, N, K, "bfloat16", False))
            pick_name = choice["triton_config"] if choice else None
            emit({"kind": "choice", **base, **(choice or {})})
        best = min(times, key=times.get) if times else None
        summary_rows.append((label, t_torch, best, times.get(best), pick_name, choice, nbytes))
        ws = x = want = out = None  # free this case's weights before the next one allocates
        torch.cuda.empty_cache()

    def frac(us, nbytes):
        return nbytes / (us * 1e-6) / bw

    print(f"\nGEMV on {env['device']}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s; µs per call, weights from HBM")
    print("configurations:")
    for i, cfg in enumerate(CONFIGS):
        print(f"  c{i:<3}{config_name(cfg)}")
    print(f"{'case':<24}" + "".join(f"{'c%d' % i:>8}" for i in range(len(CONFIGS))))
    for label, times in per_config:
        print(f"{label:<24}" + "".join(f"{times[i]:>8.2f}" if i in times else f"{'-':>8}" for i in range(len(CONFIGS))))
    print(f"\n{'case':<24}{'F.linear':>16}{'best Triton':>16}  {'best config':<26}{'linear / autotuned':<26}linear picks")
    for label, t_torch, best, t_best, pick_name, choice, nbytes in summary_rows:
        tb = f"{t_best:6.2f} ({frac(t_best, nbytes):4.0%})" if t_best else f"{'-':>13}"
        lin = f"{choice['impl']} ({choice['triton_us'] or float('nan'):.2f} vs {choice['torch_us']:.2f} µs)" if choice else "-"
        print(f"{label:<24}{t_torch:6.2f} ({frac(t_torch, nbytes):4.0%}){tb:>16}  "
              f"{config_name(CONFIGS[best]) if best is not None else '-':<26}{pick_name or '-':<26}{lin}")
    summary = {"bench": "gemv", "out": args.out, "failures": failures, "seconds": round(time.monotonic() - start, 1)}
    print(json.dumps(summary))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
