"""Paged attention benchmark on one GPU: decode GB/s and prefill TFLOP/s beside SDPA and FlexAttention.

    python -m declab_bench.paged_attention --out results/paged_attention.jsonl

Measures the copy-bandwidth ceiling, then write_kv (Triton vs index_copy_), decode (contexts 4k,
32k, 128k x batch 1, 16, 64 x head dim 64 and 128, Hq=32, Hkv=8, pages 16 and 128; SDPA and
compiled FlexAttention over contiguous K/V as peers) and causal prefill (4k, 16k, 32k tokens,
batch 1, D=128 and D=64 (llama-1b's), beside SDPA's flash backend), then small tile/split sweeps and the batch-1 decode
variant "long" while time remains. `--sections decode,variants --decode-batches 1` runs only the
batch-1 decode points and the variant (about 30 s).
write_kv and decode are timed per call inside a CUDA graph of 16 calls (one per simulated layer)
over distinct caches, so graph launch is amortised as in a decode step and small caches are not
served from L2; the method is recorded in each record. Finishes in about 2 minutes.
Every point is checked against a float32 computation (on a sub-sample of sequences or query rows)
before it is timed; a mismatch is recorded with ok=false and not timed. One JSON record per point
is appended to --out as soon as it finishes; a table is printed at the end, then one JSON line.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F

from declab_kernels import timing
from declab_kernels import paged_attention as pa
from declab_kernels.paged_attention import triton as tri
from decoders import records

HQ, HKV = 32, 8
TOL = 2e-2
DECODE_CTX = (4096, 32768, 131072)
DECODE_BATCH = (1, 16, 64)
DECODE_DIMS = (128, 64)
SECTIONS = ("write_kv", "decode", "prefill", "decode_tuning", "variants", "prefill_tuning")
PAGES = (16, 128)
PREFILL_T = (4096, 16384, 32768)
PREFILL_DIMS = (128, 64)
WRITE_N = (64, 16384)
TUNE_CTX = (4096, 32768)
# Decode is timed as one model step would run it: a CUDA graph of LAYERS calls, each over its own
# cache, so graph-launch cost is shared as in the decoder and caches smaller than L2 are not
# re-read from L2. Distinct caches rotate until the graph touches ROTATE_BYTES (> 4x the 60 MB L2).
LAYERS = 16
ROTATE_BYTES = 256 << 20
MAX_BUFFERS = 64


class Bench:
    """Holds the run's deadline, ceilings and environment; writes and remembers every record."""

    def __init__(self, out, budget_s, flex_budget_s, device="cuda"):
        self.out = out
        self.device = torch.device(device)
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.flex_budget_s = flex_budget_s
        self.env = records.environment(self.device)
        self.records = []
        self.copy_bps = None
        # causal prefill TFLOP/s of SDPA's flash backend per length, the prefill ceiling
        self.sdpa_tflops = {}

    def elapsed(self):
        return time.monotonic() - self.start

    def emit(self, **record):
        record = {**record, **self.env}
        self.records.append(record)
        records.append_jsonl(self.out, record)


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def num_buffers(nbytes):
    """Distinct caches to rotate through so one timed graph reads >= ROTATE_BYTES (at least 2)."""
    return min(MAX_BUFFERS, max(2, -(-ROTATE_BYTES // nbytes)))


def timed_layers(calls, est_ms):
    """(ms per call, record fields): one CUDA graph of max(LAYERS, len(calls)) calls cycling `calls`.

    `calls[i]` runs the op over distinct buffers i; `est_ms` (a guess of one call) sizes the
    iteration count so big points stay short. Falls back to eager launches if capture fails.
    """
    n = max(LAYERS, len(calls))

    def step():
        for i in range(n):
            calls[i % len(calls)]()

    iters = max(3, min(30, int(300 / (n * est_ms))))
    method = {"timing": f"graph of {n} calls over {len(calls)} distinct buffers, ms per call", "graph_calls": n,
              "buffers": len(calls)}
    try:
        ms = timing.time_ms(step, graph=True, warmup=3, iters=iters)
        graph = True
    except Exception:
        torch.cuda.synchronize()
        ms = timing.time_ms(step, warmup=3, iters=iters)
        graph = False
    return ms / n, {**method, "graph": graph}


def decode_bytes(batch, ctx, head_dim, elem=2):
    """Bytes one decode call must move: K and V of every position, plus q read and out written."""
    return batch * ctx * HKV * head_dim * 2 * elem + 2 * batch * HQ * head_dim * elem


def decode_ref(q, k, v, scale):
    """float32 single-query GQA attention: q `[Hq, D]`, k/v `[L, Hkv, D]` -> `[Hq, D]`."""
    group = HQ // HKV
    qg = q.float().view(HKV, group, -1)
    probs = (torch.einsum("hgd,lhd->hgl", qg, k.float()) * scale).softmax(-1)
    return torch.einsum("hgl,lhd->hgd", probs, v.float()).reshape(HQ, -1)


def gather(cache, block_table, length):
    """Positions 0..length-1 of one sequence `[length, Hkv, D]`, read through its block table."""
    page = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[block_table.long()[pos // page], pos % page]


def bench_write_kv(bench):
    head_dim, page, cache_tokens = 128, 16, 65536
    k_cache = torch.randn(cache_tokens // page, page, HKV, head_dim, device=bench.device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for n in WRITE_N:
        k = torch.randn(n, HKV, head_dim, device=bench.device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = torch.randperm(cache_tokens, device=bench.device)[:n]
        nbytes = 2 * 2 * n * HKV * head_dim * 2
        pa.write_kv(k, v, k_cache, v_cache, slots, impl="triton")
        ok = torch.equal(k_cache.flatten(0, 1)[slots], k) and torch.equal(v_cache.flatten(0, 1)[slots], v)
        k_flat, v_flat = k_cache.view(-1, HKV, head_dim), v_cache.view(-1, HKV, head_dim)
        impls = {
            "triton": lambda: pa.write_kv(k, v, k_cache, v_cache, slots, impl="triton"),
            "index_copy": lambda: (k_flat.index_copy_(0, slots, k), v_flat.index_copy_(0, slots, v)),
        }
        for name, fn in impls.items():
            ms, method = timed_layers([fn], nbytes / bench.copy_bps * 1e3) if ok else (None, {})
            gbps = nbytes / ms / 1e6 if ms else None
            bench.emit(op="write_kv", impl=name, N=n, Hkv=HKV, D=head_dim, page=page, ms=ms, GBps=gbps,
                       frac=gbps / (bench.copy_bps / 1e9) if gbps else None, ceiling="copy", ok=ok, **method)


def bench_decode_point(bench, head_dim, ctx, batch, flex):
    dev = bench.device
    scale = head_dim**-0.5
    nbytes = decode_bytes(batch, ctx, head_dim)
    est_ms = nbytes / bench.copy_bps * 1e3
    n_buf = num_buffers(nbytes)
    # One K and one V pool per simulated layer; buffer 0 is the one checked against float32.
    kv = [(torch.randn(batch * ctx, HKV, head_dim, device=dev, dtype=torch.bfloat16),
           torch.randn(batch * ctx, HKV, head_dim, device=dev, dtype=torch.bfloat16)) for _ in range(n_buf)]
    q = torch.randn(batch, HQ, head_dim, device=dev, dtype=torch.bfloat16)
    samples = sorted({0, batch - 1})
    common = dict(op="decode", B=batch, ctx=ctx, D=head_dim, Hq=HQ, Hkv=HKV, ceiling="copy")

    def emit(impl, ms, ok, **extra):
        gbps = nbytes / ms / 1e6 if ms else None
        bench.emit(impl=impl, ms=ms, GBps=gbps, frac=gbps / (bench.copy_bps / 1e9) if gbps else None, ok=ok,
                   **common, **extra)

    for page in PAGES:
        num_blocks = batch * ctx // page
        caches = [(k.view(num_blocks, page, HKV, head_dim), v.view(num_blocks, page, HKV, head_dim)) for k, v in kv]
        # Pages in a random order, as a long-running allocator leaves them.
        block_tables = torch.randperm(num_blocks, device=dev).view(batch, ctx // page).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        # One workspace for all layers, as the decoder shares one per batch bucket.
        workspace = pa.decode_workspace(batch, HQ, HKV, head_dim, ctx, dev)
        out = torch.full_like(q, float("nan"))
        calls = [lambda kc=kc, vc=vc: pa.paged_decode_attention(q, kc, vc, block_tables, lens, scale, impl="triton",
                                                                 out=out, workspace=workspace)
                 for kc, vc in caches]
        calls[0]()
        k0, v0 = caches[0]
        err = max(rel_rms(out[b], decode_ref(q[b], gather(k0, block_tables[b], ctx), gather(v0, block_tables[b], ctx),
                                             scale)) for b in samples)
        ok = err < TOL and not torch.isnan(out).any().item()
        ms, method = timed_layers(calls, est_ms) if ok else (None, {})
        emit("triton", ms, ok, page=page, rel_rms=err, num_splits=workspace.num_splits, **method)

    # Peers read contiguous [B, Hkv, ctx, D] K/V (no paging), the layout they are fastest on. Built
    # one buffer at a time, freeing the paged one (no view of it may stay alive), so the largest
    # point never holds more than three caches.
    del caches, calls, k0, v0
    contiguous = []
    while kv:
        k, v = kv.pop(0)
        contiguous.append(tuple(x.view(batch, ctx, HKV, head_dim).transpose(1, 2).contiguous() for x in (k, v)))
        del k, v
    q4 = q.view(batch, HQ, 1, head_dim)
    peers = {"sdpa": lambda kc, vc: F.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)}
    if flex is not None and bench.elapsed() < bench.flex_budget_s:
        peers["flex"] = lambda kc, vc: flex(q4, kc, vc, scale=scale, enable_gqa=True)
    kc0, vc0 = contiguous[0]
    for name, fn in peers.items():
        try:
            got = fn(kc0, vc0)
            err = max(rel_rms(got[b, :, 0], decode_ref(q[b], kc0[b].transpose(0, 1), vc0[b].transpose(0, 1), scale))
                      for b in samples)
            ok = err < TOL
            calls = [lambda kc=kc, vc=vc, fn=fn: fn(kc, vc) for kc, vc in contiguous]
            ms, method = timed_layers(calls, est_ms) if ok else (None, {})
            emit(name, ms, ok, rel_rms=err, **method)
        except Exception as exc:
            torch.cuda.synchronize()
            emit(name, None, None, skipped=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    if flex is not None and "flex" not in peers:
        emit("flex", None, None, skipped="benchmark time budget for FlexAttention compilation spent")
    del contiguous, kc0, vc0
    torch.cuda.empty_cache()


def tune_decode_case(bench, head_dim, ctx, batch, configs, split_counts, variant="split", op="decode_tuning"):
    """Time the Triton decode at one shape for each (tile config, split count); one record each.

    A config of None is the variant's own tiles; a split count of None is the variant's own choice.
    """
    dev = bench.device
    page = 16
    scale = head_dim**-0.5
    nbytes = decode_bytes(batch, ctx, head_dim)
    num_blocks = batch * ctx // page
    # [num_blocks, page, Hkv, D] bf16 page pools
    caches = [tuple(torch.randn(num_blocks, page, HKV, head_dim, device=dev, dtype=torch.bfloat16) for _ in "kv")
              for _ in range(num_buffers(nbytes))]
    block_tables = torch.randperm(num_blocks, device=dev).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, head_dim, device=dev, dtype=torch.bfloat16)
    k0, v0 = caches[0]
    want = decode_ref(q[0], gather(k0, block_tables[0], ctx), gather(v0, block_tables[0], ctx), scale)
    for cfg in configs:
        for splits in split_counts:
            if bench.elapsed() > bench.budget_s:
                return
            workspace = pa.decode_workspace(batch, HQ, HKV, head_dim, ctx, dev, num_splits=splits, variant=variant)
            cfg = cfg or tri.decode_config(head_dim, variant)
            out = torch.full_like(q, float("nan"))
            calls = [lambda kc=kc, vc=vc: tri.paged_decode_attention(q, kc, vc, block_tables, lens, scale, out=out,
                                                                      workspace=workspace, config=cfg)
                     for kc, vc in caches]
            record = dict(op=op, impl="triton", variant=variant, B=batch, ctx=ctx, D=head_dim, Hq=HQ,
                          Hkv=HKV, page=page, num_splits=workspace.num_splits, block_n=cfg.block_n, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, ceiling="copy")
            try:
                calls[0]()
            except Exception as exc:
                bench.emit(ms=None, ok=None, skipped=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                           **record)
                break
            ok = rel_rms(out[0], want) < TOL
            ms, method = timed_layers(calls, nbytes / bench.copy_bps * 1e3) if ok else (None, {})
            gbps = nbytes / ms / 1e6 if ms else None
            bench.emit(ms=ms, GBps=gbps, frac=gbps / (bench.copy_bps / 1e9) if gbps else None, ok=ok, **record,
                       **method)
    del caches
    torch.cuda.empty_cache()


def bench_decode_tuning(bench):
    """Splits and pipeline depth at batch 1 (where they matter most), and splits at batch 16.

    Beside the default tiles: twice the tile rows (same depth), and the default tile with 3 stages
    (one K/V buffer: the previous version's pipelining).
    """
    for head_dim in DECODE_DIMS:
        default = tri.decode_config(head_dim)
        configs = [default, tri.KernelConfig(0, 2 * default.block_n, 4, 5), tri.KernelConfig(0, default.block_n, 4, 3)]
        for ctx in TUNE_CTX:
            tune_decode_case(bench, head_dim, ctx, 1, configs, (8, 16, 32, 64, 128))
    tune_decode_case(bench, 128, 32768, 16, [tri.decode_config(128)], (2, 3, 4, 5, 8, 16))


def bench_decode_variants(bench):
    """The batch-1 latency variant "long" (`decode_workspace(variant="long")`, what the decoders run at
    batch 1) at 4k/32k/128k, D 64 and 128, with its own split choice and twice and half that many
    splits. The default ("split") is the `decode` record of the same shape and page 16. ~15 s.
    """
    for head_dim in DECODE_DIMS:
        for ctx in DECODE_CTX:
            auto = pa.decode_workspace(1, HQ, HKV, head_dim, ctx, bench.device, variant="long").num_splits
            counts = sorted({auto, 2 * auto, max(1, auto // 2)})
            tune_decode_case(bench, head_dim, ctx, 1, [None], counts, variant="long", op="decode_variant")


def prefill_ref_rows(q, k, v, rows, scale):
    """float32 causal attention of query rows `rows` of q `[T, Hq, D]` over k/v `[T, Hkv, D]` (in order)."""
    group = HQ // HKV
    qr = q[rows].float().view(len(rows), HKV, group, -1)
    scores = torch.einsum("nhgd,lhd->hgnl", qr, k.float()) * scale
    pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(pos[None, None, None, :] > rows[None, None, :, None], float("-inf"))
    return torch.einsum("hgnl,lhd->nhgd", scores.softmax(-1), v.float()).reshape(len(rows), HQ, -1)


def prefill_case(bench, t, page, d):
    """Random q and K/V (head dim d) of one causal prefill of t tokens; K/V written into a paged cache by write_kv."""
    dev = bench.device
    k = torch.randn(t, HKV, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(t, HQ, d, device=dev, dtype=torch.bfloat16)
    k_cache = torch.empty(t // page, page, HKV, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    block_tables = torch.randperm(t // page, device=dev).view(1, -1).to(torch.int32)
    pos = torch.arange(t, device=dev)
    pa.write_kv(k, v, k_cache, v_cache, block_tables[0].long()[pos // page] * page + pos % page, impl="triton")
    rows = torch.cat([torch.arange(0, 64), torch.arange(t // 2, t // 2 + 64), torch.arange(t - 64, t)]).to(dev)
    want = prefill_ref_rows(q, k, v, rows, d**-0.5)
    return q, k, v, k_cache, v_cache, block_tables, rows, want


def run_prefill_config(bench, op, t, page, cfg, case):
    """Check then time the Triton prefill with tiles `cfg`; one record."""
    q, _, _, k_cache, v_cache, block_tables, rows, want = case
    d = q.shape[-1]
    cu = torch.tensor([0, t], dtype=torch.int32, device=bench.device)
    lens = torch.tensor([t], dtype=torch.int32, device=bench.device)
    flops = 4 * t * t * HQ * d / 2
    record = dict(op=op, impl="triton", B=1, ctx=t, D=d, Hq=HQ, Hkv=HKV, page=page, causal=True,
                  block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  ceiling="sdpa_flash")

    def run():
        return tri.paged_prefill_attention(q, k_cache, v_cache, block_tables, lens, cu, d**-0.5,
                                           causal=True, max_seqlen_q=t, config=cfg)

    try:
        got = run()
    except Exception as exc:
        bench.emit(ms=None, ok=None, skipped=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", **record)
        return
    err = rel_rms(got[rows], want)
    ok = err < TOL and not torch.isnan(got).any().item()
    ms = timing.time_ms(run, warmup=3, iters=10) if ok else None
    tflops = flops / ms / 1e9 if ms else None
    sdpa = bench.sdpa_tflops.get((t, d))
    bench.emit(ms=ms, TFLOPs=tflops, frac=tflops / sdpa if tflops and sdpa else None, ok=ok, rel_rms=err, **record)


def bench_prefill(bench):
    """Causal prefill, batch 1, per head dim in PREFILL_DIMS: SDPA's flash backend, then the Triton kernel per page size."""
    for d, t in ((d, t) for d in PREFILL_DIMS for t in PREFILL_T):
        scale = d**-0.5
        flops = 4 * t * t * HQ * d / 2
        for page in PAGES:
            case = prefill_case(bench, t, page, d)
            if page == PAGES[0]:
                q, k, v, _, _, _, rows, want = case
                qs, ks, vs = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
                gqa, note = True, None
                try:
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        F.scaled_dot_product_attention(qs[:, :, :128], ks[:, :, :128], vs[:, :, :128],
                                                       is_causal=True, scale=scale, enable_gqa=True)
                except RuntimeError:
                    # This torch's flash backend has no GQA: it reads K/V expanded to Hq heads.
                    gqa, note = False, "flash backend without enable_gqa: K/V expanded to Hq heads"
                    ks, vs = ks.repeat_interleave(HQ // HKV, 1), vs.repeat_interleave(HQ // HKV, 1)

                def sdpa():
                    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)

                got = sdpa()[0].transpose(0, 1)
                ok = rel_rms(got[rows], want) < TOL
                ms = timing.time_ms(sdpa, warmup=3, iters=10) if ok else None
                if ms:
                    bench.sdpa_tflops[(t, d)] = flops / ms / 1e9
                bench.emit(op="prefill", impl="sdpa_flash", B=1, ctx=t, D=d, Hq=HQ, Hkv=HKV, causal=True,
                           ms=ms, TFLOPs=bench.sdpa_tflops.get((t, d)), frac=1.0 if ms else None, ok=ok, note=note,
                           ceiling="sdpa_flash")
                del qs, ks, vs, got
            run_prefill_config(bench, "prefill", t, page, tri.prefill_config(d), case)
            del case
            torch.cuda.empty_cache()


def bench_prefill_tuning(bench, t=16384, page=16):
    """A few other prefill tile shapes at one length, per head dim (configs that do not fit are recorded as skipped)."""
    for d in PREFILL_DIMS:
        case = prefill_case(bench, t, page, d)
        for c in ((128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 4),
                  (128, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4)):
            if bench.elapsed() > bench.budget_s:
                return
            run_prefill_config(bench, "prefill_tuning", t, page, tri.KernelConfig(*c), case)
        del case


def compiled_flex():
    """torch.compile'd FlexAttention, or (None, reason) when it cannot be built here."""
    try:
        from torch.nn.attention.flex_attention import flex_attention

        # Every decode shape compiles anew; keep dynamo from falling back to eager after 8 shapes.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        return torch.compile(flex_attention, dynamic=False), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def print_table(records):
    head = (f"{'op':<15}{'impl':<12}{'B':>4}{'ctx|N':>8}{'D':>5}{'page':>6}{'splits':>7}{'tile':>14}{'ms':>10}"
            f"{'GB/s|TF/s':>11}{'frac':>7}  ok")
    print(head)
    print("-" * len(head))
    for r in records:
        if r["op"] == "copy":
            continue
        rate = r.get("GBps") or r.get("TFLOPs")
        ms = f"{r['ms']:.4f}" if r.get("ms") else ("skipped" if r.get("skipped") else "-")
        rate = f"{rate:.1f}" if rate else "-"
        frac = f"{r['frac']:.2f}" if r.get("frac") else "-"
        size = r.get("ctx", r.get("N", ""))
        page, splits = str(r.get("page") or ""), str(r.get("num_splits") or "")
        tile = ""
        if "block_n" in r:
            tile = f"{r.get('block_m') or ''}x{r['block_n']}/{r['num_warps']}w{r['num_stages']}s".lstrip("x")
        print(f"{r['op']:<15}{r['impl']:<12}{r.get('B', ''):>4}{size:>8}{r.get('D', ''):>5}"
              f"{page:>6}{splits:>7}{tile:>14}{ms:>10}{rate:>11}{frac:>7}  {r.get('ok')}")


def targets(records):
    """The design targets, evaluated on this run's records (None where a point is missing)."""

    def frac(pred):
        vals = [r["frac"] for r in records if r["op"] in ("decode", "prefill") and r["impl"] == "triton"
                and r.get("frac") is not None and pred(r)]
        return min(vals) if vals else None

    checks = {
        "decode_ctx>=32k_B1>=0.85": (frac(lambda r: r["op"] == "decode" and r["ctx"] >= 32768 and r["B"] == 1), 0.85),
        "decode_ctx>=32k_B>=16>=0.90": (
            frac(lambda r: r["op"] == "decode" and r["ctx"] >= 32768 and r["B"] >= 16), 0.90),
        "decode_4k_B1>=0.60": (frac(lambda r: r["op"] == "decode" and r["ctx"] == 4096 and r["B"] == 1), 0.60),
        "prefill_T>=16k>=0.80_sdpa": (frac(lambda r: r["op"] == "prefill" and r["ctx"] >= 16384), 0.80),
    }
    return {name: {"min_frac": v, "met": None if v is None else v >= want} for name, (v, want) in checks.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON-lines file to append records to")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting optional sweeps after this")
    parser.add_argument("--flex-budget-s", type=float, default=60.0, help="stop compiling FlexAttention after this")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of what to run, in this order: {','.join(SECTIONS)}")
    parser.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCH)), help="batch sizes of the decode section")
    args = parser.parse_args()
    sections = [x for x in args.sections.split(",") if x]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown} (known: {', '.join(SECTIONS)})")
    try:
        decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    except ValueError:
        raise SystemExit(f"--decode-batches expects comma-separated integers, got {args.decode_batches!r}") from None
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU")
    torch.manual_seed(0)
    bench = Bench(args.out, args.budget_s, args.flex_budget_s)
    bench.copy_bps = timing.copy_bandwidth(bench.device)
    bench.emit(op="copy", impl="torch", GBps=bench.copy_bps / 1e9, ok=True)
    print(f"copy bandwidth {bench.copy_bps / 1e9:.0f} GB/s")

    if "write_kv" in sections:
        bench_write_kv(bench)
    if "decode" in sections:
        flex, reason = compiled_flex()
        if flex is None:
            bench.emit(op="decode", impl="flex", ok=None, skipped=reason)
        for head_dim in DECODE_DIMS:
            for ctx in DECODE_CTX:
                for batch in decode_batches:
                    bench_decode_point(bench, head_dim, ctx, batch, flex)
                    print(f"[{bench.elapsed():6.1f}s] decode D={head_dim} ctx={ctx} B={batch} done", flush=True)
    for name, run in (("prefill", bench_prefill), ("decode_tuning", bench_decode_tuning), ("variants", bench_decode_variants),
                      ("prefill_tuning", bench_prefill_tuning)):
        if name in sections:
            run(bench)
            print(f"[{bench.elapsed():6.1f}s] {name} done", flush=True)

    print_table(bench.records)
    summary = {"out": args.out, "records": len(bench.records), "seconds": round(bench.elapsed(), 1),
               "copy_GBps": bench.copy_bps / 1e9, "targets": targets(bench.records),
               "failed": sum(1 for r in bench.records if r.get("ok") is False)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
