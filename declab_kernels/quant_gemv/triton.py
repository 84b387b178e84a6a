"""Weight-only quantised GEMV in Triton (int8 per output channel, int4 group-wise), and the
dequantisation kernels that the many-row path feeds to a dense matmul.

GEMV (M <= MAX_ROWS rows of x): one program per BLOCK_N output rows walks K in tiles, loads the
packed words of its rows (contiguous in K, so a row's words are one coalesced load), unpacks and
dequantises them in registers and accumulates every x row's products in float32; the weight tile is
unpacked once and reused by all M rows. For int4 with a power-of-two group the tile is loaded as
sub-blocks that each lie inside one group ([BLOCK_N, sub-blocks, words], 3-D from the pointers, no
reshape), multiplied either as [BLOCK_N, sub-blocks, words, 8] codes in input order against a
contiguous x tile of that shape, or nibble by nibble against stride-8 slices of x (autotuning picks
per shape), and the dequantisation is folded into each sub-block's sums: sum_k (q_k - z) s x_k = s (sum_k q_k x_k -
z sum_k x_k), one scale and zero point a row and sub-block. Other group sizes gather the scale and
zero of every element. On CUDA the tile sizes are autotuned per (N, K, rows, group); under the
interpreter one configuration runs.

PDL (constexpr, `declab_kernels.pdl`, launched with launch_pdl): every program calls
gdc_launch_dependents() first, loads its first weight tile (int4: words, scales and zeros; int8: the
row scales and the first tile), then gdc_wait() before it reads x or stores anything.
"""

import os

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.quant_gemv import MAX_ROWS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter, which runs programs one after another, wide row blocks: few programs.
INTERPRET_BLOCK_N = 32
INTERPRET_CONFIG = dict(BLOCK_N=INTERPRET_BLOCK_N, BLOCK_K=256, X_TILE=True)


@triton.jit
def _int4_load(q_ptr, s_ptr, z_ptr, rn64, n_mask, k0, K, n_groups,
               GROUP: tl.constexpr, POW2_GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile at inputs k0 .. k0 + BLOCK_K of the program's rows: (words, scales, zeros)."""
    KW = K // 8
    if POW2_GROUP:
        # NSUB sub-blocks of SUB inputs, each inside one group: words [BN, NSUB, SUBW], contiguous
        # along the last two dimensions (a row's words are one wide load); scales, zeros [BN, NSUB].
        SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
        NSUB: tl.constexpr = BLOCK_K // SUB
        SUBW: tl.constexpr = SUB // 8
        rs = tl.arange(0, NSUB)
        w_idx = k0 // 8 + rs[:, None] * SUBW + tl.arange(0, SUBW)[None, :]  # [NSUB, SUBW]
        words = tl.load(q_ptr + rn64[:, None, None] * KW + w_idx[None, :, :], mask=n_mask[:, None, None] & (w_idx < KW)[None, :, :], other=0)
        sub0 = k0 + rs * SUB  # [NSUB] first input of each sub-block
        g_off = rn64[:, None] * n_groups + (sub0 // GROUP)[None, :]
        g_mask = n_mask[:, None] & (sub0 < K)[None, :]
    else:
        # words [BN, BW]; scales, zeros gathered per element [BN, BW, 8].
        w_idx = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(q_ptr + rn64[:, None] * KW + w_idx[None, :], mask=n_mask[:, None] & (w_idx < KW)[None, :], other=0)
        kk = w_idx[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BW, 8]
        g_off = rn64[:, None, None] * n_groups + (kk // GROUP)[None, :, :]
        g_mask = n_mask[:, None, None] & (kk < K)[None, :, :]
    s = tl.load(s_ptr + g_off, mask=g_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=g_mask, other=0).to(tl.float32)
    return words, s, z


@triton.jit
def _int4_accumulate(acc, words, s, z, x_ptr, stride_xm, M, k0, K, rows,
                     GROUP: tl.constexpr, POW2_GROUP: tl.constexpr, X_TILE: tl.constexpr, M_POW2: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc `[M_POW2, BN]` plus every x row's products with one weight tile of `_int4_load`."""
    rj = tl.arange(0, 8)
    if POW2_GROUP:
        SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
        NSUB: tl.constexpr = BLOCK_K // SUB
        SUBW: tl.constexpr = SUB // 8
        w_idx = k0 // 8 + tl.arange(0, NSUB)[:, None] * SUBW + tl.arange(0, SUBW)[None, :]  # [NSUB, SUBW]
        w_mask = w_idx < K // 8
        if X_TILE:
            # Codes [BN, NSUB, SUBW, 8] in input order against a contiguous x tile of that shape.
            codes = ((words[:, :, :, None] >> (rj * 4)[None, None, None, :]) & 0xF).to(tl.float32)
            kk = w_idx[:, :, None] * 8 + rj[None, None, :]  # [NSUB, SUBW, 8] input of each code
            k_mask = kk < K
        for m in tl.static_range(M_POW2):
            x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm
            if X_TILE:
                xm = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
                qx = tl.sum(tl.sum(codes * xm[None, :, :, :], axis=3), axis=2)  # [BN, NSUB]
                xs = tl.sum(tl.sum(xm, axis=2), axis=1)  # [NSUB]
            else:
                # Nibble j of every word against the stride-8 slice of x it multiplies.
                q3 = tl.zeros([BLOCK_N, NSUB, SUBW], dtype=tl.float32)
                x3 = tl.zeros([NSUB, SUBW], dtype=tl.float32)
                for j in tl.static_range(8):
                    xj = tl.load(x_row + w_idx * 8 + j, mask=w_mask, other=0.0).to(tl.float32)  # [NSUB, SUBW]
                    q3 += ((words >> (4 * j)) & 0xF).to(tl.float32) * xj[None, :, :]
                    x3 += xj
                qx = tl.sum(q3, axis=2)
                xs = tl.sum(x3, axis=1)
            # sum_k (q_k - z) s x_k = s (sum_k q_k x_k - z sum_k x_k) within each sub-block.
            part = tl.sum(s * (qx - z * xs[None, :]), axis=1)  # [BN]
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    else:
        kk = k0 + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + rj[None, :]  # [BW, 8]
        k_mask = kk < K
        w = (((words[:, :, None] >> (rj * 4)[None, None, :]) & 0xF).to(tl.float32) - z) * s  # [BN, BW, 8]
        for m in tl.static_range(M_POW2):
            xm = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(w * xm[None, :, :], axis=2), axis=1)
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, n_groups, stride_xm, stride_om,
    GROUP: tl.constexpr, POW2_GROUP: tl.constexpr, M_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_TILE: tl.constexpr = True, PDL: tl.constexpr = False,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rows = tl.arange(0, M_POW2)
    acc = tl.zeros([M_POW2, BLOCK_N], dtype=tl.float32)
    k_start = 0
    if PDL:
        # Let the next kernel launch now, fetch the first weight tile (no kernel of a decode step
        # writes a weight) while the previous kernel finishes, and wait for it before reading x.
        tl.extra.cuda.gdc_launch_dependents()
        words, s, z = _int4_load(q_ptr, s_ptr, z_ptr, rn64, n_mask, 0, K, n_groups, GROUP, POW2_GROUP, BLOCK_K)
        tl.extra.cuda.gdc_wait()
        acc = _int4_accumulate(acc, words, s, z, x_ptr, stride_xm, M, 0, K, rows, GROUP, POW2_GROUP, X_TILE, M_POW2, BLOCK_N, BLOCK_K)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        words, s, z = _int4_load(q_ptr, s_ptr, z_ptr, rn64, n_mask, k0, K, n_groups, GROUP, POW2_GROUP, BLOCK_K)
        acc = _int4_accumulate(acc, words, s, z, x_ptr, stride_xm, M, k0, K, rows, GROUP, POW2_GROUP, X_TILE, M_POW2, BLOCK_N, BLOCK_K)
    out_mask = (rows[:, None] < M) & n_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _int8_load(q_ptr, rn64, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """The int8 weight tile `[BN, BLOCK_K]` at inputs k0 .. k0 + BLOCK_K, as float32."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(q_ptr + rn64[:, None] * K + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0).to(tl.float32)


@triton.jit
def _int8_accumulate(acc, q, x_ptr, k0, K, M, stride_xm, rows, M_POW2: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc `[M_POW2, BN]` plus every x row's products with the tile q of `_int8_load`."""
    kk = k0 + tl.arange(0, BLOCK_K)
    for m in tl.static_range(M_POW2):
        xm = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)  # [BK]
        part = tl.sum(q * xm[None, :], axis=1)
        acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _int8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr,
    M, N, K, stride_xm, stride_om,
    M_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rows = tl.arange(0, M_POW2)
    acc = tl.zeros([M_POW2, BLOCK_N], dtype=tl.float32)
    s = tl.load(s_ptr + rn64, mask=n_mask, other=0.0).to(tl.float32)
    k_start = 0
    if PDL:
        # As the int4 kernel: the first weight tile (and the scales above) before the wait, x after.
        tl.extra.cuda.gdc_launch_dependents()
        q = _int8_load(q_ptr, rn64, n_mask, 0, K, BLOCK_K)
        tl.extra.cuda.gdc_wait()
        acc = _int8_accumulate(acc, q, x_ptr, 0, K, M, stride_xm, rows, M_POW2, BLOCK_K)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        acc = _int8_accumulate(acc, _int8_load(q_ptr, rn64, n_mask, k0, K, BLOCK_K), x_ptr, k0, K, M, stride_xm, rows, M_POW2, BLOCK_K)
    # The per-row scale is applied once, after the sum over K.
    out_mask = (rows[:, None] < M) & n_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], (acc * s[None, :]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, K, n_groups, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rj = tl.arange(0, 8)
    rn64 = rn.to(tl.int64)
    KW = K // 8
    mask2 = (rn < N)[:, None] & (rw < KW)[None, :]
    words = tl.load(q_ptr + rn64[:, None] * KW + rw[None, :], mask=mask2, other=0)
    codes = ((words[:, :, None] >> (rj * 4)[None, None, :]) & 0xF).to(tl.float32)  # [BN, BW, 8]
    kk = rw[:, None] * 8 + rj[None, :]  # [BW, 8]
    mask3 = (rn < N)[:, None, None] & (kk < K)[None, :, :]
    g_off = rn64[:, None, None] * n_groups + (kk // GROUP)[None, :, :]
    s = tl.load(s_ptr + g_off, mask=mask3, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=mask3, other=0).to(tl.float32)
    tl.store(out_ptr + rn64[:, None, None] * K + kk[None, :, :], ((codes - z) * s).to(out_ptr.dtype.element_ty), mask=mask3)


@triton.jit
def _int8_dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    q = tl.load(q_ptr + rn64[:, None] * K + rk[None, :], mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn64[:, None] * K + rk[None, :], (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# Candidates autotuning measures per (N, K, rows, group) on a GPU: 4 to 32 rows of 256 to 1024 inputs
# a tile, x fed as a contiguous tile or as nibble slices (X_TILE; only the power-of-two-group path reads it).
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "X_TILE": xt}, num_warps=w)
                for bn, bk, w in ((4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8))
                for xt in (True, False)]
INT8_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
                for bn, bk, w in ((4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8), (2, 2048, 4))]


def _bench(kernel_call, quantiles):
    """Autotuning's timer: Triton's (L2 cleared before each run, so weights come from HBM as in a
    decode step), with a shorter warm-up and measuring window than its default 25 + 100 ms."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_int4_tuned = triton.autotune(GEMV_CONFIGS, key=["N", "K", "M_POW2", "GROUP"], do_bench=_bench)(_int4_gemv_kernel)
_int8_tuned = triton.autotune(INT8_CONFIGS, key=["N", "K", "M_POW2"], do_bench=_bench)(_int8_gemv_kernel)


def pow2_group(group_size: int) -> bool:
    """Whether the folded path runs: a power-of-two group of at least one word (8 inputs)."""
    return group_size >= 8 and group_size & (group_size - 1) == 0


def _check_x(x, K, name):
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != K or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: x must be [M, {K}] with 1 <= M <= {MAX_ROWS} and a contiguous last dimension, got {tuple(x.shape)}")


def int4_gemv_triton(x, qweight, scales, zeros, group_size, *, out=None, config=None):
    """x `[M, K]` (M <= MAX_ROWS) -> `[M, N]` in x's dtype; see `declab_kernels.quant_gemv`.
    `config` (BLOCK_N, BLOCK_K, X_TILE, num_warps): that configuration instead of the autotuned one
    (the interpreter's default: INTERPRET_CONFIG)."""
    N, K = qweight.shape[0], qweight.shape[1] * 8
    _check_x(x, K, "int4_gemv")
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (x, qweight, scales, zeros, out, M, N, K, K // group_size, x.stride(0), out.stride(0))
    consts = dict(GROUP=group_size, POW2_GROUP=pow2_group(group_size), M_POW2=triton.next_power_of_2(M))
    use_pdl = pdl(x.device, __name__)
    consts.update(PDL=use_pdl, launch_pdl=use_pdl)
    if config is None and INTERPRET:
        config = INTERPRET_CONFIG
    if config is not None:
        _int4_gemv_kernel[(triton.cdiv(N, config["BLOCK_N"]),)](*args, **consts, **config)
    else:
        # The autotuner passes the keywords that are no configuration's (launch_pdl too) to every launch.
        _int4_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **consts)
    return out


def int8_gemv_triton(x, qweight, scale, *, out=None):
    """x `[M, K]` (M <= MAX_ROWS) -> `[M, N]` in x's dtype; see `declab_kernels.quant_gemv`."""
    N, K = qweight.shape
    _check_x(x, K, "int8_gemv")
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (x, qweight, scale, out, M, N, K, x.stride(0), out.stride(0))
    use_pdl = pdl(x.device, __name__)
    consts = dict(M_POW2=triton.next_power_of_2(M), PDL=use_pdl, launch_pdl=use_pdl)
    if INTERPRET:
        _int8_gemv_kernel[(triton.cdiv(N, INTERPRET_BLOCK_N),)](*args, BLOCK_N=INTERPRET_BLOCK_N, BLOCK_K=128, **consts)
    else:
        _int8_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](*args, **consts)
    return out


def dequantize_int4_triton(qweight, scales, zeros, group_size, dtype):
    """Dense `[N, K]` in `dtype` (rounded once from the float32 dequantised value)."""
    N, K = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(N, K, device=qweight.device, dtype=dtype)
    bn, bk = 16, 256
    _int4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
        qweight, scales, zeros, out, N, K, K // group_size, GROUP=group_size, BLOCK_N=bn, BLOCK_K=bk)
    return out


def dequantize_int8_triton(qweight, scale, dtype):
    """Dense `[N, K]` in `dtype` (rounded once from qweight * scale in float32)."""
    N, K = qweight.shape
    out = torch.empty(N, K, device=qweight.device, dtype=dtype)
    bn, bk = 16, 256
    _int8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](qweight, scale, out, N, K, BLOCK_N=bn, BLOCK_K=bk)
    return out
