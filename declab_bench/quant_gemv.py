"""Quantised linears on one GPU: int4 (group 128) and int8 at the llama projection shapes, beside
bf16 F.linear (cuBLAS) on the same shapes, each quantised case on the kernel the dispatch picks and,
where the choice is open, on the other candidate.

    python -m declab_bench.quant_gemv --out results/quant_gemv.jsonl [--budget 120]

bf16 x of M rows times weight `[N, K]`: every (N, K) in SHAPES at M in ROWS (1, 4, 16) on the
dispatched kernel (`int4_kernel` / `int8_kernel`: "fma", "dot" or "dequant+cublas"), plus the dot
kernel at M = 1 (or the GEMV, whichever the dispatch does not pick: the candidate for
tuning.QUANT_FMA_ROWS), plus M = 128 and 512 (prefill chunks, the engine's larger decode batches)
on the PREFILL shapes with both the dot kernel and the dense path (the candidates for
tuning.QUANT_DOT_ROWS). Per case, in this order:
1. self-check against the float32 reference (`int4_linear_ref` / `int8_linear_ref`); a failure is
   recorded and the run exits non-zero;
2. the first call (compilation and autotuning, outside the timing);
3. µs per call from a CUDA graph of `copies` calls, each on its own copy of the weight, so that the
   copies together (>= 256 MB, at least two) overflow L2 and every call reads its weight from HBM;
   bytes = packed weight + scales + zeros (int4) or weight + scales (int8) or the bf16 weight, plus
   x and y; GB/s and the fraction of the copy bandwidth measured at the start of the run; the kernel
   (`kernel`, and `dispatched`: whether the rule picks it at this M), the configuration autotuning
   picked (tile sizes; for the dot kernel also its splits along K, `split_k`) and, for int4, the
   packing's version (`int4_layout`).
One JSON line per case (with `decoders.records.environment`) appended to `--out` as soon as
it is measured. After `--budget` seconds the remaining cases are skipped (and listed). A table at the
end, then one JSON line summarising the run. About 1-1.5 minutes on an H200 (a third of it the
first calls' compiles).
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

# (model, projection, N, K)
SHAPES = (
    ("llama-8b", "q/o", 4096, 4096),
    ("llama-8b", "gate/up", 14336, 4096),
    ("llama-8b", "down", 4096, 14336),
    ("llama-1b", "q/o", 2048, 2048),
    ("llama-1b", "gate_up", 16384, 2048),
    ("llama-1b", "down", 2048, 8192),
)
ROWS = (1, 4, 16)
# Rows of a prefill chunk or a large decode batch (the dot kernel against the dense path), and the shapes.
PREFILL_ROWS = (128, 512)
PREFILL = (("llama-8b", "q/o", 4096, 4096), ("llama-8b", "gate/up", 14336, 4096))
GROUP = 128
FORMATS = ("int4-g128", "int8", "bf16")
ROTATE_BYTES = 256 << 20
MAX_COPIES = 32
TOL = 1e-2


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def make_weight(fmt, N, K, seed, kernel=None):
    """(call(x) -> y, reference(x) -> y, weight bytes) for one random weight of format `fmt`, the
    quantised ones computed on `kernel` (None: the dispatched one)."""
    from declab_kernels import quant_gemv as Q

    g = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "bf16":
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        return (lambda x: F.linear(x, w)), (lambda x: (x.float() @ w.float().T)), w.numel() * 2
    if fmt == "int8":
        q = torch.randint(-127, 128, (N, K), device="cuda", generator=g, dtype=torch.int32).to(torch.int8)
        s = torch.rand(N, device="cuda", generator=g) * 1e-3
        return ((lambda x: Q.int8_linear(x, q, s, impl="triton", kernel=kernel)), (lambda x: Q.int8_linear_ref(x.float(), q, s)),
                q.numel() + s.numel() * 4)
    q = torch.randint(-2**31, 2**31 - 1, (N, K // 8), device="cuda", generator=g, dtype=torch.int64).to(torch.int32)
    s = (torch.rand(N, K // GROUP, device="cuda", generator=g) * 1e-3).half()
    z = torch.randint(0, 16, (N, K // GROUP), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
    nbytes = q.numel() * 4 + s.numel() * 2 + z.numel()
    return ((lambda x: Q.int4_linear(x, q, s, z, GROUP, impl="triton", kernel=kernel)),
            (lambda x: Q.int4_linear_ref(x.float(), q, s, z, GROUP)), nbytes)


def kernel_record(fmt, M, N, K, kernel):
    """The fields naming what a quantised case ran on: kernel, dispatched, triton_config (and split_k)."""
    from declab_kernels import quant_gemv as Q
    from declab_kernels.quant_gemv import triton as T

    chosen = Q.int4_kernel(M, K, GROUP) if fmt.startswith("int4") else Q.int8_kernel(M)
    kernel = kernel or chosen
    record = {"kernel": kernel, "dispatched": kernel == chosen}
    if kernel == "fma":
        # The configuration autotuning picked for this shape (the last one run).
        record["triton_config"] = str((T._int4_tuned if fmt.startswith("int4") else T._int8_tuned).best_config)
    elif kernel == "dot":
        bm = T.dot_block_m(M)
        best = (T._int4_dot_tuned if fmt.startswith("int4") else T._int8_dot_tuned)[bm].best_config
        tiles = K // 8 // best.kwargs["BLOCK_W"] if fmt.startswith("int4") else math.ceil(K / best.kwargs["BLOCK_K"])
        blocks = math.ceil(N / best.kwargs["BLOCK_N"]) * math.ceil(M / bm)
        record.update(triton_config=str(best), split_k=T.split_k(blocks, tiles, torch.cuda.get_device_properties(0).multi_processor_count))
    return record


def measure(fmt, M, N, K, copy_bw, kernel=None):
    """One case's record (module docstring)."""
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    call, ref, wbytes = make_weight(fmt, N, K, seed=0, kernel=kernel)
    t0 = time.perf_counter()
    y = call(x)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    err = rel(y, ref(x))
    record = {"format": fmt, "M": M, "N": N, "K": K, "weight_bytes": wbytes, "rel_err": err, "ok": err < TOL, "first_call_s": round(first_s, 3)}
    if fmt != "bf16":
        from declab_kernels.quant_gemv import INT4_LAYOUT

        if fmt.startswith("int4"):
            record["int4_layout"] = INT4_LAYOUT
        record.update(kernel_record(fmt, M, N, K, kernel))
    if not record["ok"]:
        return record
    copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / wbytes)))
    calls = [call] + [make_weight(fmt, N, K, seed=i, kernel=kernel)[0] for i in range(1, copies)]
    for c in calls:
        c(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (reps * copies)
    nbytes = wbytes + 2 * M * (K + N)
    record.update(copies=copies, us=round(us, 2), bytes=nbytes, gb_s=round(nbytes / us / 1e3, 1),
                  frac_copy_bw=round(nbytes / (us * 1e-6) / copy_bw, 3))
    return record


def cases():
    """(model, projection, N, K, M, format, kernel) of every case in the run's order (llama-8b's
    decode shapes, the prefill cases, llama-1b's); kernel None is the dispatched one (bf16: cuBLAS)."""
    from declab_kernels import quant_gemv as Q

    def decode(model, proj, N, K):
        out = []
        for M in ROWS:
            out += [(model, proj, N, K, M, fmt, None) for fmt in FORMATS]
            if M == 1:
                # The other of the two kernels that can run one row.
                other = {"int4-g128": "dot" if Q.int4_kernel(1, K, GROUP) == "fma" else "fma",
                         "int8": "dot" if Q.int8_kernel(1) == "fma" else "fma"}
                out += [(model, proj, N, K, M, fmt, other[fmt]) for fmt in FORMATS if fmt != "bf16"]
        return out

    out = [c for shape in SHAPES if shape[0] == "llama-8b" for c in decode(*shape)]
    for model, proj, N, K in PREFILL:
        for M in PREFILL_ROWS:
            out += [(model, proj, N, K, M, "bf16", None)]
            out += [(model, proj, N, K, M, fmt, kernel) for fmt in FORMATS if fmt != "bf16"
                    for kernel in ("dot", "dequant+cublas")]
    return out + [c for shape in SHAPES if shape[0] != "llama-8b" for c in decode(*shape)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/quant_gemv.jsonl", help="JSON lines file the records are appended to")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds after which the remaining cases are skipped")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the quantised GEMV benchmark needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)
    if args.budget <= 0:
        print(f"error: --budget must be positive, got {args.budget}", file=sys.stderr)
        raise SystemExit(2)
    from decoders.records import append_jsonl, environment
    from declab_kernels.timing import copy_bandwidth

    env = environment("cuda")
    copy_bw = copy_bandwidth("cuda")
    began = time.perf_counter()
    rows, skipped, failed = [], [], []
    for model, proj, N, K, M, fmt, kernel in cases():
        case = f"{model} {proj} {fmt} M={M}" + (f" {kernel}" if kernel else "")
        if time.perf_counter() - began > args.budget:
            skipped.append(case)
            continue
        record = {"bench": "quant_gemv", "model": model, "projection": proj, **measure(fmt, M, N, K, copy_bw, kernel),
                  "copy_bw_gb_s": round(copy_bw / 1e9, 1), **env}
        append_jsonl(args.out, record)
        rows.append(record)
        if not record["ok"]:
            failed.append(case)
    print(f"{'model':<9}{'proj':<9}{'N x K':>13}{'M':>5}{'format':>11}{'kernel':>16}{'us':>9}{'GB/s':>8}{'of copy':>9}")
    for r in rows:
        shape = f"{r['N']}x{r['K']}"
        kernel = r.get("kernel", "cublas") + ("" if r.get("dispatched", True) else "*")
        print(f"{r['model']:<9}{r['projection']:<9}{shape:>13}{r['M']:>5}{r['format']:>11}{kernel:>16}"
              f"{r.get('us', float('nan')):>9.1f}{r.get('gb_s', float('nan')):>8.0f}{r.get('frac_copy_bw', float('nan')):>9.2f}")
    print("* a candidate the dispatch does not pick at this M")
    summary = {"bench": "quant_gemv", "cases": len(rows), "failed": failed, "skipped": skipped,
               "copy_bw_gb_s": round(copy_bw / 1e9, 1), "out": args.out, "seconds": round(time.perf_counter() - began, 1)}
    print(json.dumps(summary))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
