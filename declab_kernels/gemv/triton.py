"""Small-batch GEMV in Triton: y = x @ W^T for a few rows of x, W streamed once.

One kernel, `_gemv_kernel`, grid `(cdiv(N, BLOCK_N), SPLIT_K, G)`. Program (n, s, g) owns BLOCK_N
rows of W_g (contiguous in K) for all M rows of x_g and the s-th of SPLIT_K equal runs of whole
BLOCK_K tiles of K, accumulating in float32. Two ways to multiply a tile (constexpr `DOT`):
- FMA: elementwise products kept unreduced in a `[BLOCK_M, BLOCK_N, BLOCK_K]` float32 accumulator,
  one reduction over K after the loop (no cross-thread work inside the loop);
- DOT: `tl.dot` of the x tile (M padded to 16) with the W tile transposed, the loads pipelined
  through shared memory.
SPLIT_K > 1: each program stores its float32 partial to a workspace `[SPLIT_K, G, M, N]`, takes a
ticket from a per-(g, n-block) int32 counter; the last one sums the SPLIT_K partials in split order
(deterministic), writes the output and sets the counter back to 0. One launch, no host sync, the
workspace has a fixed size and is zero again after every call: CUDA-graph safe.

Base offsets are int64 (G * N * K can pass 2^31); in-tile offsets stay int32.

PDL (constexpr, `declab_kernels.pdl`, launched with launch_pdl): every program calls
gdc_launch_dependents() first, loads its first W tiles (FMA: PDL_TILES, 1 or 2; DOT: one),
then gdc_wait() (the previous kernel has finished and its writes are visible) before it reads x or
writes anything; the K loop runs over the remaining tiles. Without PDL the kernel is unchanged.

NORM (constexpr, G == 1, one group of K channels; 1: `gemv_triton(..., norm=(z, norm_weight, eps))`,
Mamba-2's gated norm, g = x * silu(z); 2: `gemv_triton(..., rms_norm=(norm_weight, eps))`, g = x): the
product is rmsnorm(g) * norm_weight @ W^T in one pass. rmsnorm's 1 / rms(g) is one number a row, so it
comes out of the sum: every program accumulates sum(g^2) over its K range beside the products of
g * norm_weight, then scales its products by rsqrt(mean(g^2) + eps) (split-K: the partial sums of squares
go to the workspace beside the partial products, and the last program of a column block sums both in
split order). Every program reads its rows' whole K range anyway; the statistics cost no extra pass.
The normalised row is not rounded to the model dtype before the weight (the unfused norm kernels do),
so the result differs from the unfused pair by that rounding (bf16: ~0.3% of an element); DOT rounds
g * norm_weight to W's dtype for the tensor cores.

NORM 3 (`gemv_triton(..., rms_scale=(sumsq, eps))`): the statistics come with x. x is already g *
norm_weight and sumsq [M, S] holds partial sums of g^2 written by the kernel before (Mamba-2's decode
step: one a head); every program loads the row's S partials with its first x tile and scales its
products by rsqrt(sum / K + eps) before the bias (split-K: before storing its partial).

RESIDUAL (constexpr; `gemv_triton(..., residual=r)`, G == 1): the output is r + x @ W^T in r's dtype,
the product (+ bias) rounded to W's dtype first, then added in float32, as `r + F.linear(x, W, b)`
rounds it (the decoder layer's residual add, in the epilogue). `out` may be r itself.
NORM_OUT (with RESIDUAL; `gemv_triton(..., residual=r, norm_out=norm_weight)`, which then returns
(out, h, sumsq)): the epilogue also writes the next RMSNorm's first half for the new residual: h =
new * norm_weight (x's dtype) and each program's sum of new^2 over its columns into sumsq[:, pid_n],
which the GEMV that reads h takes as `rms_scale` (NORM 3), so no norm kernel runs between the two.

ACT (constexpr; `gemv_triton(..., act="sqrelu")`, G == 1): x is relu(input)^2, computed as each x
tile is loaded (no statistics, so no extra pass).

SWIGLU (constexpr; `gemv_triton(..., swiglu=True)`, G == 1): W is [gate; up] (N = 2I rows) and the
output is silu(x @ gate^T) * (x @ up^T) [M, I]. Program n takes gate and up rows of the same BLOCK_N
/ 2 outputs (interleaved as its local rows), so the epilogue computes each output once from its two
products.

SELECT (constexpr; `gemv_triton(..., select=row_splits)`, G == 1): x is [S, M, K], S inputs of M rows,
and W's rows row_splits[i]:row_splits[i + 1] multiply input i only; the output is [M, N]. A program
reads the input index of its first row from a per-row int32 table (made once per row_splits) and
takes that input's rows as x. Every split point must be a multiple of BLOCK_N, so a program's rows
share one input; SELECT is the largest power of two (<= 64) dividing them all, and configurations
with a larger BLOCK_N are not run.
"""

import math
import os

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.split_workspace import split_workspace
from declab_kernels.gemv.fusions import check_row_splits

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Keyword names of a configuration, in the order `config_name` prints them.
META = ("DOT", "BLOCK_N", "BLOCK_K", "SPLIT_K", "LOOP_STAGES")


def _cfg(dot, bn, bk, sk, warps, stages, loop=None):
    meta = {"DOT": dot, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "LOOP_STAGES": loop}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# Candidate configurations. The first is the interpreter's (it cannot autotune over several) and the
# fallback when pruning leaves nothing. FMA tiles are loaded straight into registers (bytes in flight
# come from many resident programs) unless LOOP_STAGES is set: then Triton pipelines them through
# shared memory with cp.async, LOOP_STAGES - 1 tiles ahead (it only does that for loads that feed no
# tl.dot when the loop asks). DOT loops are pipelined by num_stages. FMA accumulators take
# M_pad * BLOCK_N * BLOCK_K / (32 warps) registers a thread: `config_fits` keeps an FMA config only
# while that is <= 64.
CONFIGS = [
    _cfg(False, 4, 1024, 1, 4, 3),       # M=1: 8 KB tiles, 512 programs at N=2048
    _cfg(False, 4, 1024, 1, 4, 3, 3),    # the same, two tiles ahead through shared memory
    _cfg(False, 8, 512, 1, 4, 3, 3),
    _cfg(False, 4, 2048, 1, 8, 3),       # M=1, long K: 16 KB tiles, half the serial tiles a program
    _cfg(False, 16, 512, 1, 8, 3),       # M=1, large N: 16 KB tiles
    _cfg(False, 16, 512, 1, 8, 3, 3),
    _cfg(False, 4, 1024, 2, 4, 3, 3),    # M=1, long K: two splits
    _cfg(False, 4, 1024, 4, 4, 3),       # M=1, long K: four splits
    _cfg(False, 4, 256, 1, 4, 3, 4),     # M <= 8: 2 KB tiles, 8 * M accumulator registers
    _cfg(True, 16, 256, 1, 4, 4),        # M > 1: 8 KB of W a tile
    _cfg(True, 16, 256, 4, 4, 4),        # M > 1, few programs: four splits
    _cfg(True, 32, 256, 2, 4, 4),        # M > 1: 16 KB of W a tile, two splits
    _cfg(True, 64, 128, 1, 4, 4),        # M > 1, large N
]
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in CONFIGS)
MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in CONFIGS)
FMA_REGS = 64


def config_name(config) -> str:
    """Short label of a configuration: "fma n4 k1024 s1 w4 st3 p3" (p: LOOP_STAGES)."""
    kw = config.kwargs
    loop = f" p{kw['LOOP_STAGES']}" if kw.get("LOOP_STAGES") else ""
    return (f"{'dot' if kw['DOT'] else 'fma'} n{kw['BLOCK_N']} k{kw['BLOCK_K']} s{kw['SPLIT_K']} "
            f"w{config.num_warps} st{config.num_stages}{loop}")


def _m_pow2(M):
    return max(1, triton.next_power_of_2(M))


def config_fits(config, M, K, select=0) -> bool:
    """Whether `config` is a sensible candidate at M rows and depth K (used to prune autotuning);
    `select`: the SELECT alignment of a row-select launch (0: none), which BLOCK_N must divide."""
    kw = config.kwargs
    if select and select % kw["BLOCK_N"]:
        return False
    if not kw["DOT"] and _m_pow2(M) * kw["BLOCK_N"] * kw["BLOCK_K"] > FMA_REGS * 32 * config.num_warps:
        return False
    # Every split gets at least one whole tile.
    return kw["SPLIT_K"] == 1 or kw["SPLIT_K"] * kw["BLOCK_K"] <= K


def _prune(configs, nargs, **kwargs):
    kept = [c for c in configs if config_fits(c, nargs["M"], nargs["K"], kwargs.get("SELECT", 0))]
    return kept or configs[:1]


@triton.jit
def _gemv_tile(acc, ss, w, x_rows, k, k_hi, m_mask, DOT: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
               NORM: tl.constexpr, z_rows, nw_ptr, ACT: tl.constexpr):
    """(acc, ss) after the W tile `w` (columns k): acc + its products with the x tile of the same
    columns. With NORM the x tile is g * norm_weight, g = x * silu(z) (1) or x (2), and ss [BLOCK_M,
    BLOCK_K] (FMA) or [BLOCK_M] (DOT) gathers g^2 (see the module docstring). With ACT (1: sqrelu) it is
    relu(x)^2 of those columns, rounded to x's dtype as its own kernel rounds it."""
    xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :], other=0.0,
                 eviction_policy="evict_last")
    if ACT == 1:
        relu = tl.maximum(xt.to(tl.float32), 0.0)
        xt = (relu * relu).to(xt.dtype)
    if NORM == 1 or NORM == 2:
        g = xt.to(tl.float32)
        if NORM == 1:
            zt = tl.load(z_rows + k[None, :], mask=m_mask[:, None] & (k < k_hi)[None, :], other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
            g = g * zt * tl.sigmoid(zt)
        nw = tl.load(nw_ptr + k, mask=k < k_hi, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if DOT:
            ss += tl.sum(g * g, axis=1)
            xt = (g * nw[None, :]).to(w.dtype)
        else:
            ss += g * g
            xt = g * nw[None, :]
    if DOT:
        acc += tl.dot(xt, tl.trans(w), input_precision=DOT_PREC)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * xt.to(tl.float32)
    else:
        acc += w.to(tl.float32)[None, :, :] * xt.to(tl.float32)[:, None, :]
    return acc, ss


@triton.jit
def _row_parts(ss_ptr, stride_sm, M, BLOCK_M: tl.constexpr, PARTS: tl.constexpr, PARTS_POW2: tl.constexpr):
    """NORM 3: the rows' PARTS partial sums of squares, flat [BLOCK_M * PARTS_POW2] (zero-padded), float32.
    Loaded with x and reduced in the epilogue (`_row_rstd`): a reduction's barrier here would hold back
    the x load. Flat, so that the load keeps its own layout: as a [BLOCK_M, PARTS_POW2] tile it took the
    output's, 16 scalar loads and registers a thread at BLOCK_N = 4."""
    i = tl.arange(0, BLOCK_M * PARTS_POW2)
    m = i // PARTS_POW2
    p = i % PARTS_POW2
    return tl.load(ss_ptr + m * stride_sm + p, mask=(m < M) & (p < PARTS), other=0.0)


@triton.jit
def _row_rstd(parts, offs_m, K, eps, BLOCK_M: tl.constexpr, PARTS_POW2: tl.constexpr):
    """rsqrt(mean square + eps) [BLOCK_M] of `_row_parts`' sums, one scalar reduction a row."""
    row = tl.arange(0, BLOCK_M * PARTS_POW2) // PARTS_POW2
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):
        rstd = tl.where(offs_m == m, tl.rsqrt(tl.sum(tl.where(row == m, parts, 0.0), axis=0) / K + eps), rstd)
    return rstd


@triton.jit
def _store_out(res, out_rows, offs_n, pid_n, o_mask, m_mask, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, r, prod_dt: tl.constexpr):
    """Write the float32 products `res` [BLOCK_M, BLOCK_N] of the weight rows offs_n. With SWIGLU (the
    rows are gate and up pairs) write silu(gate) * up [BLOCK_M, BLOCK_N / 2] instead, rounded as the
    unfused pair rounds it: both products to the output dtype, silu(gate) to it, the product to it.
    With RESIDUAL write r + res (r: the residual's tile, loaded, float32), res rounded to `prod_dt`
    (W's dtype) first, the sum to the output dtype, and return the sum as stored (float32, for NORM_OUT)."""
    dt = out_rows.dtype.element_ty
    stored = res
    if SWIGLU:
        gate, up = tl.split(tl.reshape(res, (BLOCK_M, BLOCK_N // 2, 2)))
        gate = gate.to(dt).to(tl.float32)
        up = up.to(dt).to(tl.float32)
        y = ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up).to(dt)
        oj = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_rows + oj[None, :], y, mask=m_mask[:, None] & (oj < N // 2)[None, :])
    elif RESIDUAL:
        new = (r + res.to(prod_dt).to(tl.float32)).to(dt)
        tl.store(out_rows + offs_n[None, :], new, mask=o_mask)
        stored = new.to(tl.float32)
    else:
        tl.store(out_rows + offs_n[None, :], res.to(dt), mask=o_mask)
    return stored


@triton.jit
def _store_norm_out(new, nwo, h_rows, so_rows, offs_n, pid_n, o_mask, m_mask):
    """NORM_OUT: the next RMSNorm's first half for the columns offs_n of the new residual `new`
    [BLOCK_M, BLOCK_N] (float32, as stored): h = new * norm_weight in h's dtype, and the columns' sum of
    new^2 into the rows' partial sums at index pid_n (`rms_scale` of the GEMV that reads h)."""
    tl.store(h_rows + offs_n[None, :], (new * nwo[None, :]).to(h_rows.dtype.element_ty), mask=o_mask)
    tl.store(so_rows + pid_n, tl.sum(tl.where(o_mask, new * new, 0.0), axis=1), mask=m_mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, G,
    stride_xg, stride_xm, stride_wg, stride_wn, stride_bg, stride_og, stride_om,
    z_ptr, nw_ptr, stride_zm, eps, r_ptr, stride_rm, sel_ptr,
    M_POW2: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr = None, PDL: tl.constexpr = False, PDL_TILES: tl.constexpr = 1,
    NORM: tl.constexpr = 0, ACT: tl.constexpr = 0, SWIGLU: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    SELECT: tl.constexpr = 0, PARTS: tl.constexpr = 1, PARTS_POW2: tl.constexpr = 1,
    h_ptr=None, nwo_ptr=None, so_ptr=None, stride_hm=0, stride_som=0, NORM_OUT: tl.constexpr = False,
):
    # tl.dot needs at least 16 rows: x is padded with masked (zero) rows.
    BLOCK_M: tl.constexpr = 16 if DOT and M_POW2 < 16 else M_POW2
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    if SWIGLU:
        # W is [gate; up] (N = 2I rows): local rows 2j and 2j + 1 are gate and up row j of this
        # program's BLOCK_N / 2 outputs, so the epilogue has both halves of each output at hand.
        r = tl.arange(0, BLOCK_N)
        j = pid_n * (BLOCK_N // 2) + r // 2
        offs_n = j + (r % 2) * (N // 2)
        n_mask = j < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        # Split s owns whole tiles [s * per, (s + 1) * per); a split past the end runs no iteration.
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * per
        k_hi = tl.minimum(K, k_lo + per)
    if SELECT:
        # The input all of this program's rows multiply (written at model load, so read before the wait).
        xg = tl.load(sel_ptr + pid_n * BLOCK_N).to(tl.int64)
    else:
        xg = g
    x_rows = x_ptr + xg * stride_xg + offs_m[:, None] * stride_xm
    w_rows = w_ptr + g * stride_wg + offs_n[:, None].to(tl.int64) * stride_wn
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # NORM (G == 1): the sum of squares of g over this program's K range, kept unreduced by FMA (one
    # reduction after the loop, as acc), reduced tile by tile by DOT.
    z_rows = z_ptr + offs_m[:, None] * stride_zm
    if DOT:
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        ss = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    k_start = k_lo
    if PDL:
        # Programmatic dependent launch: let the next kernel's programs launch now, fetch the first
        # weight tiles (no kernel of a decode step writes a weight) while the previous kernel is
        # still finishing, and only then wait for it: x, the output, the split-K partials and
        # counters are all touched after the wait. FMA: PDL_TILES tiles (a second costs +0..8
        # registers; where it pays, see `gemv_triton`'s early_tiles). DOT: one,
        # its tile is held in the mma operand layout, ~45 registers more a tile (kept at the
        # occupancy shared memory already allows), where two would halve the resident programs.
        PEEL: tl.constexpr = 1 if DOT else PDL_TILES
        tl.extra.cuda.gdc_launch_dependents()
        k_a = k_lo + offs_k
        k_b = k_a + BLOCK_K
        w_a = tl.load(w_rows + k_a[None, :], mask=n_mask[:, None] & (k_a < k_hi)[None, :], other=0.0,
                      eviction_policy="evict_first")
        if PEEL > 1:
            w_b = tl.load(w_rows + k_b[None, :], mask=n_mask[:, None] & (k_b < k_hi)[None, :], other=0.0,
                          eviction_policy="evict_first")
        tl.extra.cuda.gdc_wait()
        if NORM == 3:
            parts = _row_parts(z_ptr, stride_zm, M, BLOCK_M, PARTS, PARTS_POW2)
        acc, ss = _gemv_tile(acc, ss, w_a, x_rows, k_a, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC, NORM, z_rows, nw_ptr, ACT)
        if PEEL > 1:
            acc, ss = _gemv_tile(acc, ss, w_b, x_rows, k_b, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC, NORM, z_rows, nw_ptr,
                                 ACT)
        k_start = k_lo + PEEL * BLOCK_K
    elif NORM == 3:
        parts = _row_parts(z_ptr, stride_zm, M, BLOCK_M, PARTS, PARTS_POW2)
    o_mask = m_mask[:, None] & n_mask[None, :]
    r_rows = r_ptr + offs_m[:, None] * stride_rm
    r = 0.0
    nwo = 0.0
    if NORM_OUT:
        h_rows = h_ptr + offs_m[:, None] * stride_hm
        so_rows = so_ptr + offs_m * stride_som
    if RESIDUAL and SPLIT_K == 1:
        # why: loaded here, not in the epilogue, so the load overlaps the K loop instead of adding a
        # memory round trip after it
        r = tl.load(r_rows + offs_n[None, :], mask=o_mask, other=0.0).to(tl.float32)
        if NORM_OUT:
            nwo = tl.load(nwo_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=LOOP_STAGES):
        k = k0 + offs_k
        k_mask = k < k_hi
        # W is read once: evict it first so x and the outputs stay in L2.
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
        acc, ss = _gemv_tile(acc, ss, w, x_rows, k, k_hi, m_mask, DOT, BLOCK_M, DOT_PREC, NORM, z_rows, nw_ptr, ACT)
    if DOT:
        res = acc
    elif BLOCK_M == 1:
        res = tl.sum(acc, axis=1)[None, :]
    else:
        res = tl.sum(acc, axis=2)
    if (NORM == 1 or NORM == 2) and not DOT:
        ss = tl.sum(ss, axis=1)
    if NORM == 3:
        # Linear in the products, so split-K partials are scaled before they are stored.
        res *= _row_rstd(parts, offs_m, K, eps, BLOCK_M, PARTS_POW2)[:, None]
    out_rows = out_ptr + g * stride_og + offs_m[:, None] * stride_om
    prod_dt: tl.constexpr = w_ptr.dtype.element_ty
    if SPLIT_K == 1:
        if NORM == 1 or NORM == 2:
            res *= tl.rsqrt(ss / K + eps)[:, None]
        if HAS_BIAS:
            res += tl.load(b_ptr + g * stride_bg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        new = _store_out(res, out_rows, offs_n, pid_n, o_mask, m_mask, N, BLOCK_M, BLOCK_N, SWIGLU, RESIDUAL, r, prod_dt)
        if NORM_OUT:
            _store_norm_out(new, nwo, h_rows, so_rows, offs_n, pid_n, o_mask, m_mask)
    else:
        # Partials [SPLIT_K, G, M, N], float32; with NORM then the sums of squares [SPLIT_K, n blocks, M].
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + (pid_k * G + g) * M * N + mn, res, mask=o_mask)
        ss_part = part_ptr + SPLIT_K * G * M * N + pid_n * M + offs_m
        if NORM == 1 or NORM == 2:
            tl.store(ss_part + pid_k * tl.num_programs(0) * M, ss, mask=m_mask)
        # Every thread's partial stores are issued before one thread takes a ticket; acq_rel
        # publishes them to, and acquires the others' for, the program that takes the last one.
        tl.debug_barrier()
        cnt = cnt_ptr + g * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            tl.store(cnt, 0)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            ss_total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            # In split order whoever is last, so the result does not depend on timing.
            for s in tl.static_range(SPLIT_K):
                # .cg reads from L2, where the other programs' stores landed.
                total += tl.load(part_ptr + (s * G + g) * M * N + mn, mask=o_mask, other=0.0, cache_modifier=".cg")
                if NORM == 1 or NORM == 2:
                    ss_total += tl.load(ss_part + s * tl.num_programs(0) * M, mask=m_mask, other=0.0,
                                        cache_modifier=".cg")
            if NORM == 1 or NORM == 2:
                total *= tl.rsqrt(ss_total / K + eps)[:, None]
            if HAS_BIAS:
                total += tl.load(b_ptr + g * stride_bg + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            r_last = r
            nwo_last = nwo
            if RESIDUAL:
                r_last = tl.load(r_rows + offs_n[None, :], mask=o_mask, other=0.0).to(tl.float32)
                if NORM_OUT:
                    nwo_last = tl.load(nwo_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            new = _store_out(total, out_rows, offs_n, pid_n, o_mask, m_mask, N, BLOCK_M, BLOCK_N, SWIGLU, RESIDUAL,
                             r_last, prod_dt)
            if NORM_OUT:
                _store_norm_out(new, nwo_last, h_rows, so_rows, offs_n, pid_n, o_mask, m_mask)


def _autotune_bench(fn, quantiles):
    # About 30 ms a candidate (Triton's default is ~125 ms); do_bench clears L2 before every call.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


_gemv_tuned = triton.autotune(
    configs=CONFIGS[:1] if INTERPRET else CONFIGS,
    key=["M", "N", "K", "G", "HAS_BIAS", "NORM", "ACT", "SWIGLU", "RESIDUAL", "SELECT"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_autotune_bench,
)(_gemv_kernel)

def _workspace(device, n_part, n_cnt):
    """This kernel family's split-K partials and counters (`declab_kernels.split_workspace`)."""
    return split_workspace("gemv", device, n_part, n_cnt)


def _as_config(config):
    if config is None or isinstance(config, triton.Config):
        return config
    if isinstance(config, dict):
        meta = {k: config.get(k) for k in META}
        return triton.Config(meta, num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3))
    raise TypeError(f"gemv: config must be a triton.Config or a dict, got {type(config).__name__}")


def _check_norm(x, norm):
    """(z, norm weight, eps) for a gated NORM launch, checked: x [M, K], z [M, K], weight [K], one group."""
    if len(norm) not in (3, 4):
        raise ValueError("gemv: norm must be (z, norm_weight, eps) or (z, norm_weight, eps, group_size)")
    z, nw, eps = norm[:3]
    if x.dim() != 2:
        raise ValueError(f"gemv: the gated-norm prologue takes x [M, K], got {tuple(x.shape)}")
    K = x.shape[-1]
    group_size = norm[3] if len(norm) == 4 and norm[3] is not None else K
    if group_size != K:
        raise ValueError(f"gemv: the gated-norm prologue supports one group (group_size == K = {K}), "
                         f"got group_size {group_size}")
    if tuple(z.shape) != tuple(x.shape) or tuple(nw.shape) != (K,):
        raise ValueError(f"gemv: norm needs z {list(x.shape)} and weight [{K}], got {tuple(z.shape)} and {tuple(nw.shape)}")
    if z.dtype != x.dtype or nw.dtype != x.dtype:
        raise ValueError(f"gemv: y, z and the norm weight must share a dtype, got {x.dtype}, {z.dtype}, {nw.dtype}")
    if z.stride(-1) != 1:
        z = z.contiguous()
    if nw.stride(0) != 1:
        nw = nw.contiguous()
    return z, nw, float(eps)


def _check_rms_scale(x, rms_scale):
    """(sumsq, eps) for an RMS-scale launch, checked: x [M, K], sumsq [M, S] float32, contiguous rows."""
    if len(rms_scale) != 2:
        raise ValueError("gemv: rms_scale must be (sumsq, eps)")
    sumsq, eps = rms_scale
    if x.dim() != 2 or sumsq.dim() != 2 or sumsq.shape[0] != x.shape[0] or sumsq.shape[1] == 0 or sumsq.dtype != torch.float32:
        raise ValueError(f"gemv: rms_scale takes x [M, K] and float32 sumsq [M, S], got {tuple(x.shape)} and "
                         f"{tuple(sumsq.shape)} {sumsq.dtype}")
    return sumsq.contiguous(), float(eps)


def _check_rms_norm(x, rms_norm):
    """(norm weight, eps) for an RMS NORM launch, checked: x [M, K], weight [K] in x's dtype."""
    if len(rms_norm) != 2:
        raise ValueError("gemv: rms_norm must be (norm_weight, eps)")
    nw, eps = rms_norm
    if x.dim() != 2:
        raise ValueError(f"gemv: the RMSNorm prologue takes x [M, K], got {tuple(x.shape)}")
    if tuple(nw.shape) != (x.shape[-1],) or nw.dtype != x.dtype:
        raise ValueError(f"gemv: rms_norm needs a weight [{x.shape[-1]}] in x's dtype, got {tuple(nw.shape)} {nw.dtype}")
    return nw.contiguous(), float(eps)


# Activations the prologue computes, by name: the ACT constexpr.
ACTS = {"sqrelu": 1}
# (row_splits, device) -> the int32 input index of every weight row, for SELECT launches.
_select_tables: dict = {}


def select_align(row_splits) -> int:
    """The SELECT constexpr of `row_splits`: the largest power of two <= 64 dividing every split
    point (the first and last, 0 and N, excluded)."""
    inner = math.gcd(*row_splits[1:-1])
    return 64 if inner == 0 else min(64, inner & -inner)


def _check_select(x, weight, row_splits):
    """The row table of a SELECT launch, checked: x [S, M, K], weight [N, K], row_splits S + 1 ints
    rising from 0 to N."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"gemv: select takes x [S, M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    splits = check_row_splits(x, weight.shape[0], row_splits, caller="gemv")
    key = (splits, str(x.device))
    if key not in _select_tables:
        sizes = torch.tensor([b - a for a, b in zip(splits, splits[1:])])
        _select_tables[key] = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), sizes).to(x.device)
    return _select_tables[key], select_align(splits)


def gemv_triton(x, weight, bias=None, *, out=None, config=None, norm=None, rms_norm=None, rms_scale=None, act=None,
                swiglu=False, residual=None, norm_out=None, early_tiles=1, select=None):
    """See `declab_kernels.gemv.gemv`. `config` (a `triton.Config` of CONFIGS or a dict with META keys and
    optional num_warps / num_stages) launches that configuration instead of the autotuned one.

    `norm=(z, norm_weight, eps)` (optionally a 4th item, group_size, which must be K): the product
    is gated_rmsnorm(x, z) @ W^T, the norm (`declab_kernels.mamba2_norm.gated_rmsnorm`, one group) computed
    in the same pass as the product: x [M, K] only, z [M, K] and norm_weight [K] in x's dtype.
    `rms_norm=(norm_weight, eps)`: the product is rmsnorm(x) * norm_weight @ W^T, likewise; x [M, K],
    norm_weight [K] in x's dtype. Both leave out the unfused norm's rounding of the normalised row (module
    docstring). `rms_scale=(sumsq, eps)`: the norm's statistics come with x instead (x already times
    the norm weight, sumsq `[M, S]` float32 partial sums of squares of the unweighted row): the product
    is rsqrt(sumsq.sum(-1) / K + eps) * (x @ W^T), scaled before the bias; x [M, K] only.

    `act="sqrelu"`: the product is relu(x)^2 @ W^T, computed as the x tiles are loaded; x [M, K] only,
    not with a norm. `swiglu=True`: W is [gate; up] [2I, K] and the result is
    `declab_kernels.swiglu.silu_mul` of the product, [M, I], computed in the epilogue; x [M, K] only.
    `residual=r` ([M, N], any float dtype, not with swiglu): the result is r + the product in r's
    dtype (module docstring); `out` may be r itself when `config` is given (autotuning would run
    the launch more than once). `norm_out=norm_weight` ([N], with residual and a `config`): the result is
    (out, h, sumsq), h `[M, N]` in x's dtype the new residual times norm_weight and sumsq `[M, S]` float32
    the partial sums of its squares, one per program's columns (S = cdiv(N, BLOCK_N)): what
    `rms_scale` of the next GEMV takes.

    `select=row_splits` (S + 1 host ints rising from 0 to N): x is [S, M, K] and the output [M, N]
    takes columns row_splits[i]:row_splits[i + 1] from input i and those weight rows (module
    docstring); not with a norm, act, swiglu or residual. A `config` must have a BLOCK_N dividing
    every split point.

    `early_tiles` (1 or 2; PDL launches of FMA configurations only): the weight tiles each program
    loads before its PDL wait. One is the default: in graphed decode steps of all three families a
    second one was slower. Two measured faster for llama's decode projections on either side of the
    batch-1 decode attention, q/k/v and o, and for Mamba-2's batch-1 out_proj after its SSM step
    (declab_kernels/gemv/README.md, performance log)."""
    if early_tiles not in (1, 2):
        raise ValueError(f"gemv: early_tiles must be 1 or 2, got {early_tiles}")
    if sum(v is not None for v in (norm, rms_norm, rms_scale)) > 1:
        raise ValueError("gemv: norm, rms_norm and rms_scale are different ways to normalise x; pass one")
    if norm is not None:
        norm = _check_norm(x, norm)
    if rms_norm is not None:
        rms_norm = _check_rms_norm(x, rms_norm)
    if rms_scale is not None:
        rms_scale = _check_rms_scale(x, rms_scale)
    normalised = norm is not None or rms_norm is not None or rms_scale is not None
    if act is not None:
        if act not in ACTS:
            raise ValueError(f"gemv: act must be one of {sorted(ACTS)}, got {act!r}")
        if normalised or x.dim() != 2:
            raise ValueError("gemv: an activation prologue takes x [M, K] and no norm")
    if swiglu and (x.dim() != 2 or weight.dim() != 2 or weight.shape[0] % 2):
        raise ValueError(f"gemv: swiglu takes x [M, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    sel, align = x, 0
    if select is not None:
        if normalised or act is not None or swiglu or residual is not None:
            raise ValueError("gemv: select takes no norm, act, swiglu or residual")
        sel, align = _check_select(x, weight, select)
        if config is not None and align % _as_config(config).kwargs["BLOCK_N"]:
            raise ValueError(f"gemv: config BLOCK_N does not divide the row splits {tuple(select)}")
    grouped = x.dim() == 3 and select is None
    if x.dim() not in (2, 3) or (weight.dim() != x.dim() and select is None):
        raise ValueError(f"gemv: x [M, K] with weight [N, K], or x [G, M, K] with weight [G, N, K]; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[-1] or (grouped and x.shape[0] != weight.shape[0]):
        raise ValueError(f"gemv: shapes {tuple(x.shape)} and {tuple(weight.shape)} do not match")
    if weight.stride(-1) != 1:
        raise ValueError("gemv: weight must be contiguous in K (stride 1 in its last dimension)")
    if x.dtype != weight.dtype:
        raise ValueError(f"gemv: x is {x.dtype}, weight is {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    G = x.shape[0] if grouped else 1
    stride_xg = x.stride(0) if x.dim() == 3 else 0
    M, K = x.shape[-2], x.shape[-1]
    N = weight.shape[-2]
    out_shape = (G, M, N) if grouped else (M, N // 2 if swiglu else N)
    if residual is not None:
        if swiglu or grouped or tuple(residual.shape) != out_shape or residual.stride(-1) != 1:
            raise ValueError(f"gemv: residual must be {list(out_shape)} with a contiguous last dimension, for x [M, K] "
                             f"without swiglu; got {tuple(residual.shape)}")
        if out is not None and out.data_ptr() == residual.data_ptr() and config is None:
            raise ValueError("gemv: writing the residual in place needs a config (autotuning reruns the launch)")
    if norm_out is not None:
        if residual is None or config is None:
            raise ValueError("gemv: norm_out needs a residual and a config (its partial sums follow BLOCK_N)")
        if min(M, N, K) == 0:
            raise ValueError("gemv: norm_out needs M, N and K > 0")
        if tuple(norm_out.shape) != (N,) or not norm_out.is_floating_point():
            raise ValueError(f"gemv: norm_out must be a norm weight [{N}], got {tuple(norm_out.shape)} {norm_out.dtype}")
        n_parts = triton.cdiv(N, _as_config(config).kwargs["BLOCK_N"])
        h_out = torch.empty(M, N, dtype=x.dtype, device=x.device)
        sumsq_out = torch.empty(M, n_parts, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype if residual is None else residual.dtype, device=x.device)
    if tuple(out.shape) != out_shape or out.stride(-1) != 1:
        raise ValueError(f"gemv: out must be {list(out_shape)} with a contiguous last dimension, got {tuple(out.shape)}")
    has_bias = bias is not None
    if has_bias and tuple(bias.shape) != ((G, N) if grouped else (N,)):
        raise ValueError(f"gemv: bias must be {[G, N] if grouped else [N]}, got {tuple(bias.shape)}")
    if has_bias and bias.stride(-1) != 1:
        bias = bias.contiguous()
    if M == 0 or N == 0 or G == 0:
        return out
    if K == 0:
        if swiglu:
            from declab_kernels.swiglu.ref import silu_mul_ref

            return out.copy_(silu_mul_ref(torch.zeros(M, N, dtype=x.dtype, device=x.device) if bias is None
                                          else bias.unsqueeze(0).expand(M, N)))
        prod = torch.zeros(out_shape, dtype=x.dtype, device=x.device) if not has_bias else \
            bias.unsqueeze(-2).expand(out_shape)
        return out.copy_(prod if residual is None else residual.float() + prod.float())
    config = _as_config(config)
    split = config.kwargs["SPLIT_K"] if config is not None else MAX_SPLIT_K
    min_bn = config.kwargs["BLOCK_N"] if config is not None else MIN_BLOCK_N
    n_blocks = G * triton.cdiv(N, min_bn)
    normed = norm is not None or rms_norm is not None
    part, cnt = _workspace(x.device, split * (G * M * N + (n_blocks * M if normed else 0)) if split > 1 else 0, n_blocks)
    gs = (lambda t: t.stride(0)) if grouped else (lambda t: 0)
    if norm is not None:
        norm_args = (norm[0], norm[1], norm[0].stride(0), norm[2])
    elif rms_norm is not None:
        norm_args = (x, rms_norm[0], 0, rms_norm[1])
    elif rms_scale is not None:
        norm_args = (rms_scale[0], x, rms_scale[0].stride(0), rms_scale[1])
    else:
        norm_args = (x, x, 0, 0.0)
    args = (x, weight, bias if has_bias else x, out, part, cnt,
            M, N, K, G,
            stride_xg, x.stride(-2), gs(weight), weight.stride(-2), gs(bias) if has_bias else 0, gs(out), out.stride(-2),
            *norm_args, residual if residual is not None else x, residual.stride(0) if residual is not None else 0, sel)
    use_pdl = pdl(x.device, __name__)
    consts = dict(M_POW2=_m_pow2(M), HAS_BIAS=has_bias, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                  PDL=use_pdl, PDL_TILES=early_tiles,
                  NORM=1 if norm is not None else 2 if rms_norm is not None else 3 if rms_scale is not None else 0,
                  ACT=ACTS.get(act, 0), SWIGLU=swiglu, RESIDUAL=residual is not None, SELECT=align)
    if rms_scale is not None:
        parts = rms_scale[0].shape[1]
        consts.update(PARTS=parts, PARTS_POW2=triton.next_power_of_2(parts))
    if norm_out is not None:
        consts.update(h_ptr=h_out, nwo_ptr=norm_out.contiguous(), so_ptr=sumsq_out, stride_hm=h_out.stride(0),
                      stride_som=sumsq_out.stride(0), NORM_OUT=True)
    if config is None:
        def grid(meta):
            return triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], G

        # The autotuner passes keyword arguments that are no config's on to every launch (its
        # benchmark's and the real one), launch options such as launch_pdl included.
        _gemv_tuned[grid](*args, **consts, launch_pdl=use_pdl)
    else:
        kw = config.kwargs
        grid = (triton.cdiv(N, kw["BLOCK_N"]), kw["SPLIT_K"], G)
        _gemv_kernel[grid](*args, **consts, **kw, num_warps=config.num_warps, num_stages=config.num_stages,
                           launch_pdl=use_pdl)
    if norm_out is not None:
        return out, h_out, sumsq_out
    return out


def tuned_config(M, N, K, G=1, has_bias=False, dtype=torch.bfloat16, norm=0, act=None, swiglu=False, residual=False,
                 select=0):
    """The configuration autotuning chose for this shape (None before the first call); `norm` is the
    NORM constexpr (0 none, 1 gated, 2 RMS, 3 RMS scale), `select` the SELECT one."""
    for key, cfg in _gemv_tuned.cache.items():
        if key[:10] == (M, N, K, G, has_bias, norm, ACTS.get(act, 0), swiglu, residual, select) and str(dtype) in key[10:]:
            return cfg
    return None
