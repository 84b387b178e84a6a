"""WKV-7 benchmark on one GPU: decode-step latency and chunked-prefill throughput, beside fla.

    python -m declab_bench.wkv7 --out results/wkv7.jsonl [--budget 90]

Shape: rwkv7-1.5b (H=32, K=V=64, one layer). Ordered so that the headline numbers come first and
every record is appended to `--out` (one JSON line with `decoders.records.environment`) as soon
as it is measured:
1. the copy-bandwidth ceiling;
2. the default step: self-check against the float32 reference, then latency at batch 1, 16, 128
   (a CUDA graph of 24 layer-steps over distinct state buffers; µs per layer-step, GB/s, fraction
   of copy bandwidth);
3. the default prefill: self-check on a short prefix, then tokens/s per layer at 4k, 32k, 128k
   tokens, batch 1, and at 32k the device time of each of its kernels (pass 1 against pass 2);
4. fla's `chunk_rwkv7` (w is the log-decay there too): its error against the reference, then the
   same lengths, timed only if it matches (its first call autotunes, which takes a minute or more);
5. fla's `fused_recurrent_rwkv7` step at batch 1, 16, 128, the same way as ours;
6. while the time budget lasts: other prefill chunk sizes (PREFILL_CHUNKS), each self-checked, then
   timed; other step launch shapes.
A kernel that fails its self-check is not timed and the run exits non-zero. A table is printed at
the end, then one JSON line summarising the run.
"""

import argparse
import json
import sys
import time

import torch

from declab_kernels.timing import copy_bandwidth, time_ms
from decoders.records import append_jsonl, environment
from declab_kernels.wkv7 import CHUNK
from declab_kernels.wkv7.ref import rwkv7_inputs, wkv7_chunk_ref, wkv7_step_ref
from declab_kernels.wkv7.triton import PRECISION, wkv7_chunk_triton, wkv7_step_triton

H, K, V = 32, 64, 64
LAYERS = 24
STEP_BATCHES = (1, 16, 128)
# (block_v, num_warps) tried after the default step, at every batch
STEP_VARIANTS = ((32, 2), (32, 8), (16, 2), (64, 4))
PREFILL_T = (4096, 32768, 131072)
# chunk sizes (`wkv7_chunk(chunk_size=)`) timed after the default
PREFILL_CHUNKS = (16, 64)
CHECK_T = 1000
TIME_BUDGET_S = 90


def rel(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


def inputs(B, T, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return rwkv7_inputs(B, T, H, K, V, dtype=torch.bfloat16, device=device, generator=g)


def load_fla():
    """(chunk_rwkv7, fused_recurrent_rwkv7, version) or (None, None, reason)."""
    try:
        import fla
        from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
    except Exception as e:  # any import failure is recorded as the reason the peer is missing
        return None, None, f"{type(e).__name__}: {e}"
    return chunk_rwkv7, fused_recurrent_rwkv7, getattr(fla, "__version__", "unknown")


def kernel_ms(fn):
    """Device time of each Triton kernel of one call of `fn` (ms by kernel name), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.key.startswith("_chunk")}
    except Exception as e:  # a profiler failure costs the breakdown, never the timing records
        return {"error": f"{type(e).__name__}: {e}"}


def time_step(emit, bw, B, case, block_v, num_warps, failures=None):
    """Self-check a non-default launch shape (when `failures` is given), then time LAYERS steps."""
    x, states, outs, nbytes = case["x"], case["states"], case["outs"], case["nbytes"]
    kw = dict(block_v=block_v, num_warps=num_warps)
    label = "default" if block_v is None else f"bv={block_v} w={num_warps}"
    if failures is not None:
        s = case["h0"].clone()
        err_o, err_s = rel(wkv7_step_triton(*x, s, **kw), case["o_ref"]), rel(s, case["s_ref"])
        if not (err_o < 1e-2 and err_s < 1e-5):
            failures.append(f"step B={B} {label}")
            emit({"kind": "selfcheck", "op": "step", "batch": B, **kw, "rel_err_o": err_o, "rel_err_state": err_s, "ok": False},
                 ("selfcheck FAIL", f"step {label}", f"B={B}", "", f"o {err_o:.1e} state {err_s:.1e}"))
            return

    def layers():
        for s, o in zip(states, outs):
            wkv7_step_triton(*x, s, out=o, **kw)

    us = time_ms(layers, graph=True, warmup=20, iters=200) * 1e3 / LAYERS
    gbs = nbytes / (us * 1e-6) / 1e9
    emit({"kind": "step", "impl": "triton", "batch": B, "block_v": block_v or "auto", "num_warps": num_warps or "auto",
          "layers": LAYERS, "us_per_layer": us, "bytes_per_layer": nbytes, "gb_per_s": gbs, "frac_copy_bw": gbs * 1e9 / bw},
         ("step", f"triton {label}", f"B={B}", f"{us:.2f} us", f"{gbs:.0f} GB/s ({gbs * 1e9 / bw:.0%})"))


def time_fla_step(emit, bw, B, case, fla_rec):
    """fla's fused_recurrent_rwkv7 on one token ([B, 1, H, *]), its error, then LAYERS steps."""
    xt = [y[:, None] for y in case["x"]]
    kw = dict(r=xt[0], w=xt[1], k=xt[2], v=xt[3], a=xt[4], b=xt[5], scale=1.0, output_final_state=True)
    try:
        o_f, s_f = fla_rec(**kw, initial_state=case["h0"].clone())
        err = rel(s_f, case["s_ref"])

        def layers():
            for s in case["states"]:
                fla_rec(**kw, initial_state=s)

        us = time_ms(layers, graph=True, warmup=20, iters=200) * 1e3 / LAYERS
        gbs = case["nbytes"] / (us * 1e-6) / 1e9
        emit({"kind": "step", "impl": "fla.fused_recurrent_rwkv7", "batch": B, "layers": LAYERS,
              "us_per_layer": us, "bytes_per_layer": case["nbytes"], "gb_per_s": gbs, "frac_copy_bw": gbs * 1e9 / bw,
              "rel_err_state_vs_ref": err, "rel_err_o_vs_ref": rel(o_f[:, 0], case["o_ref"])},
             ("step", "fla fused_recurrent", f"B={B}", f"{us:.2f} us", f"{gbs:.0f} GB/s (state err {err:.1e})"))
    except Exception as e:  # the peer's failure is recorded, never hidden
        emit({"kind": "peer_error", "peer": "fla.fused_recurrent_rwkv7", "op": "step", "batch": B, "reason": f"{type(e).__name__}: {e}"},
             ("step", "fla fused_recurrent", f"B={B}", "", f"error: {type(e).__name__}"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON-lines file the records are appended to")
    ap.add_argument("--no-peers", action="store_true", help="skip fla")
    ap.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                    help="seconds after which optional measurements (step 6 of the docstring) are skipped")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("declab_bench.wkv7 needs a CUDA GPU")
    device = torch.device("cuda")
    start = time.monotonic()
    env = environment(device)
    rows, failures = [], []

    def emit(rec, row=None):
        rec = {"bench": "wkv7", **rec, "env": env}
        append_jsonl(args.out, rec)
        if row:
            rows.append(row)

    def over_budget(what):
        if time.monotonic() - start < args.budget:
            return False
        emit({"kind": "skipped", "what": what, "reason": f"time budget {args.budget:.0f}s spent"},
             ("skipped", what, "", "", "time budget"))
        return True

    bw = copy_bandwidth(device)
    emit({"kind": "ceiling", "copy_bytes_per_s": bw}, ("ceiling", "copy", "", "", f"{bw / 1e12:.2f} TB/s"))

    if args.no_peers:
        fla_chunk, fla_rec, fla_info = None, None, "skipped by --no-peers"
    else:
        fla_chunk, fla_rec, fla_info = load_fla()
    if fla_chunk is None:
        emit({"kind": "peer_unavailable", "peer": "fla", "reason": fla_info}, ("peer", "fla", "", "", f"unavailable: {fla_info}"))
    else:
        emit({"kind": "peer", "peer": "fla", "version": fla_info})

    # 2. default step: self-check, then a graph of LAYERS steps over distinct states
    step_cases = {}
    for B in STEP_BATCHES:
        x = [y[:, 0] for y in inputs(B, 1, device, seed=B)]
        h0 = 0.3 * torch.randn(B, H, K, V, device=device)
        s_tri, s_ref = h0.clone(), h0.clone()
        o_ref = wkv7_step_ref(*(y.float() for y in x), s_ref)
        err_o, err_s = rel(wkv7_step_triton(*x, s_tri), o_ref), rel(s_tri, s_ref)
        ok = err_o < 1e-2 and err_s < 1e-5
        emit({"kind": "selfcheck", "op": "step", "batch": B, "rel_err_o": err_o, "rel_err_state": err_s, "ok": ok})
        if not ok:
            failures.append(f"step B={B}")
            rows.append(("selfcheck FAIL", "step", f"B={B}", "", f"o {err_o:.1e} state {err_s:.1e}"))
            continue
        case = dict(x=x, h0=h0, o_ref=o_ref, s_ref=s_ref,
                    states=[h0.clone() for _ in range(LAYERS)],
                    outs=[torch.empty(B, H, V, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)],
                    nbytes=2 * B * H * K * V * 4 + (5 * B * H * K + 2 * B * H * V) * 2)
        step_cases[B] = case
        time_step(emit, bw, B, case, None, None)

    # 3. default prefill: self-check on a prefix, then tokens/s
    xc = inputs(1, CHECK_T, device, seed=1)
    h0c = 0.3 * torch.randn(1, H, K, V, device=device)
    o_ref, s_ref = wkv7_chunk_ref(*(y.float() for y in xc), initial_state=h0c)

    def check_chunk(C):
        o, s = wkv7_chunk_triton(*xc, initial_state=h0c, chunk_size=C)
        err_o, err_s = rel(o, o_ref), rel(s, s_ref)
        # tf32 products: 3.5e-4 in the state at T=1000 on an H200 (fla chunk_rwkv7: 1.3e-3)
        ok = err_o < 1e-2 and err_s < 2e-3
        label = f"chunk C={C}"
        emit({"kind": "selfcheck", "op": "chunk", "chunk_size": C, "precision": PRECISION, "T": CHECK_T,
              "rel_err_o": err_o, "rel_err_state": err_s, "ok": ok},
             ("selfcheck", label, f"T={CHECK_T}", "ok" if ok else "FAIL", f"o {err_o:.1e} state {err_s:.1e}"))
        if not ok:
            failures.append(label)
        return ok

    def time_chunk(C):
        for T in PREFILL_T:
            x = inputs(1, T, device, seed=T)

            def run():
                return wkv7_chunk_triton(*x, chunk_size=C)

            ms = time_ms(run, warmup=3, iters=10)
            tps = T / (ms * 1e-3)
            # why: pass 1 and pass 2 both scale with T, so only per-kernel times say which dominates
            split = {"kernel_ms": kernel_ms(run)} if T == 32768 else {}
            emit({"kind": "prefill", "impl": "triton", "T": T, "batch": 1, "chunk_size": C, "precision": PRECISION,
                  "default": C == CHUNK, "ms": ms, "tokens_per_s": tps,
                  "io_bytes": T * H * (5 * K + 2 * V) * 2, **split},
                 ("prefill", f"triton C={C}", f"T={T}", f"{ms:.2f} ms",
                  f"{tps / 1e6:.2f} M tok/s"))
            del x

    if check_chunk(CHUNK):
        time_chunk(CHUNK)
    # 4. fla's chunk_rwkv7: error against the reference, then the same lengths if it matches
    if fla_chunk is not None:
        try:
            o, s = fla_chunk(r=xc[0], w=xc[1], k=xc[2], v=xc[3], a=xc[4], b=xc[5], scale=1.0,
                             initial_state=h0c.clone(), output_final_state=True)
            err_o, err_s = rel(o, o_ref), rel(s, s_ref)
            ok = err_o < 1e-2 and err_s < 1e-2
            emit({"kind": "selfcheck", "op": "chunk", "impl": "fla.chunk_rwkv7", "T": CHECK_T,
                  "rel_err_o": err_o, "rel_err_state": err_s, "ok": ok},
                 ("selfcheck", "fla.chunk_rwkv7", f"T={CHECK_T}", "ok" if ok else "mismatch", f"o {err_o:.1e} state {err_s:.1e}"))
            for T in PREFILL_T if ok else ():
                x = inputs(1, T, device, seed=T)
                ms = time_ms(lambda: fla_chunk(r=x[0], w=x[1], k=x[2], v=x[3], a=x[4], b=x[5], scale=1.0,
                                               output_final_state=True), warmup=2, iters=5)
                tps = T / (ms * 1e-3)
                emit({"kind": "prefill", "impl": "fla.chunk_rwkv7", "T": T, "batch": 1, "ms": ms, "tokens_per_s": tps,
                      "io_bytes": T * H * (5 * K + 2 * V) * 2},
                     ("prefill", "fla.chunk_rwkv7", f"T={T}", f"{ms:.2f} ms", f"{tps / 1e6:.2f} M tok/s"))
                del x
        except Exception as e:  # the peer's failure is recorded, never hidden
            emit({"kind": "peer_error", "peer": "fla.chunk_rwkv7", "op": "chunk", "reason": f"{type(e).__name__}: {e}"},
                 ("prefill", "fla.chunk_rwkv7", "", "", f"error: {type(e).__name__}"))
        torch.cuda.empty_cache()

    # 5. fla's fused_recurrent_rwkv7 step at each batch
    for B, case in step_cases.items():
        if fla_rec is not None:
            time_fla_step(emit, bw, B, case, fla_rec)

    # 6. while the budget lasts: other prefill chunk sizes, other step launch shapes
    for C in PREFILL_CHUNKS:
        if over_budget(f"prefill C={C}"):
            break
        if check_chunk(C):
            time_chunk(C)
        torch.cuda.empty_cache()
    for B, case in step_cases.items():
        for bv, nw in STEP_VARIANTS:
            if over_budget(f"step B={B} block_v={bv} num_warps={nw}"):
                break
            time_step(emit, bw, B, case, bv, nw, failures)

    print(f"\nWKV-7 on {env['device']}  (H={H}, K=V={K}, one layer)")
    print(f"{'what':<16}{'impl':<28}{'shape':<12}{'time':<14}result")
    for kind, impl, shape, t, result in rows:
        print(f"{kind:<16}{impl:<28}{shape:<12}{t:<14}{result}")
    summary = {"bench": "wkv7", "out": args.out, "failures": failures, "seconds": round(time.monotonic() - start, 1)}
    print(json.dumps(summary))
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
