"""Weight-only quantised GEMV in Triton (int8 per output channel, int4 group-wise), and the
dequantisation kernels that the many-row path feeds to a dense matmul.

int8 GEMV (M <= MAX_ROWS rows of x): one program per BLOCK_N output rows walks K in tiles of its
rows' codes (contiguous in K, one coalesced load), converts them in registers and accumulates every x
row's products in float32; the row scale is applied once after the sum.

int4 GEMV (M <= INT4_GEMV_ROWS), on the sliced packing (nibble i of word j is input i S + j, S = K / 8):
one program per BLOCK_N rows walks the words in tiles `[BLOCK_N, BLOCK_T, V]`, BLOCK_T threads along
the words (32 a warp, warps too), each thread V consecutive words of each of its rows (one 16-byte
load at V = 4). Nibble i of every word multiplies x[i S + j], so slice i of x is a contiguous
`[1, BLOCK_T, V]` load in the words' layout, shared by the thread's rows: no reshape, no interleave,
nothing moves between threads inside the loop. A nibble is unpacked with a shift and a mask into the
mantissa of 1.0 (f = 1 + code / 16 exactly, no int-to-float conversion); a thread sums f x over its V
words, and since those V inputs lie in one group, the dequantisation is one scale and zero a row,
slice and thread: sum_v (code_v - z) s x_v = s (16 (sum_v f_v x_v - sum_v x_v) - z sum_v x_v). The
per-thread sums `[M, BLOCK_N, BLOCK_T]` are reduced across threads once, after the loop. V is 4, 2 or
1: the largest dividing both S and the group. On CUDA the tiles are autotuned per (N, S, rows, group,
V); under the interpreter one configuration runs.

PDL (constexpr, `declab_kernels.pdl`, launched with launch_pdl): every program calls
gdc_launch_dependents() first, loads its first weight tile (int4: the words; int8: the row scales and
the first tile), then gdc_wait() before it reads x or stores anything.
"""

import os

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.quant_gemv import INT4_GEMV_ROWS, MAX_ROWS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter, which runs programs one after another, wide row blocks: few programs.
INTERPRET_BLOCK_N = 32
INTERPRET_CONFIG = dict(BLOCK_N=INTERPRET_BLOCK_N, BLOCK_T=8)
# 1 + code / 16 as a float32: the code moved to mantissa bits 19..22 of 1.0's pattern.
CODE_BITS = tl.constexpr(0x00780000)
ONE_BITS = tl.constexpr(0x3F800000)
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _int4_words(q_ptr, rn64, n_mask, j0, S, BLOCK_T: tl.constexpr, V: tl.constexpr):
    """Words j0 .. j0 + BLOCK_T V of the program's rows: `[BN, BLOCK_T, V]` int32, each thread's V
    consecutive words of a row one vector load."""
    w_idx = j0 + tl.arange(0, BLOCK_T)[:, None] * V + tl.arange(0, V)[None, :]  # [BT, V]
    return tl.load(q_ptr + rn64[:, None, None] * S + w_idx[None, :, :], mask=n_mask[:, None, None] & (w_idx < S)[None, :, :], other=0)


@triton.jit
def _int4_tile(acc, words, x_ptr, s_ptr, z_ptr, stride_xm, M, rn64, n_mask, j0, S, n_groups, rows,
               GROUP: tl.constexpr, M_POW2: tl.constexpr, BLOCK_T: tl.constexpr, V: tl.constexpr):
    """acc `[M_POW2, BN, BT]` plus every x row's products with one tile of words (`_int4_words`)."""
    rt = tl.arange(0, BLOCK_T)
    w_idx = j0 + rt[:, None] * V + tl.arange(0, V)[None, :]  # [BT, V]
    w_mask = w_idx < S
    t_mask = n_mask[:, None] & (j0 + rt * V < S)[None, :]  # [BN, BT]
    for i in tl.static_range(8):
        # Nibble i of every word is input i S + j: moved to the top of a float mantissa, f = 1 + code / 16.
        if i < 5:
            b = words << (19 - 4 * i)
        else:
            b = words >> (4 * i - 19)
        f = ((b & CODE_BITS) | ONE_BITS).to(tl.float32, bitcast=True)  # [BN, BT, V]
        # A thread's V inputs of slice i lie in one group (V divides the group and S).
        g_off = rn64[:, None] * n_groups + ((i * S + j0 + rt * V) // GROUP)[None, :]  # [BN, BT]
        s = tl.load(s_ptr + g_off, mask=t_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=t_mask, other=0).to(tl.int32)
        # The zero point as a float without a conversion instruction: 2^23 + z as bits, minus 2^23.
        z = (z | MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC
        for m in tl.static_range(M_POW2):
            # A thread's V inputs of the slice, one vector load shared by its BN rows (with BLOCK_T = 32
            # num_warps threads along T, x [1, BT, V] takes the words' layout: nothing moves between threads).
            x_off = tl.minimum(m, M - 1) * stride_xm + i * S + w_idx[None, :, :]
            xm = tl.load(x_ptr + x_off, mask=w_mask[None, :, :], other=0.0).to(tl.float32)  # [1, BT, V]
            xs = tl.sum(xm, axis=2)  # [1, BT]
            # sum_v (code_v - z) s x_v = s (16 (sum_v f_v x_v - sum_v x_v) - z sum_v x_v), in the thread.
            part = s * (16.0 * (tl.sum(f * xm, axis=2) - xs) - z * xs)  # [BN, BT]
            if M_POW2 == 1:
                acc += part[None, :, :]
            else:
                acc = tl.where(rows[:, None, None] == m, acc + part[None, :, :], acc)
    return acc


@triton.jit
def _int4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr,
    M, N, S, n_groups, stride_xm, stride_om,
    GROUP: tl.constexpr, M_POW2: tl.constexpr, V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    rows = tl.arange(0, M_POW2)
    BW: tl.constexpr = BLOCK_T * V
    # Per-thread partial sums, reduced across threads once after the loop.
    acc = tl.zeros([M_POW2, BLOCK_N, BLOCK_T], dtype=tl.float32)
    j_start = 0
    if PDL:
        # Let the next kernel launch now, fetch the first tile of words (no kernel of a decode step
        # writes a weight) while the previous kernel finishes, and wait for it before reading x.
        tl.extra.cuda.gdc_launch_dependents()
        words = _int4_words(q_ptr, rn64, n_mask, 0, S, BLOCK_T, V)
        tl.extra.cuda.gdc_wait()
        acc = _int4_tile(acc, words, x_ptr, s_ptr, z_ptr, stride_xm, M, rn64, n_mask, 0, S, n_groups, rows, GROUP, M_POW2, BLOCK_T, V)
        j_start = BW
    for j0 in range(j_start, S, BW):
        words = _int4_words(q_ptr, rn64, n_mask, j0, S, BLOCK_T, V)
        acc = _int4_tile(acc, words, x_ptr, s_ptr, z_ptr, stride_xm, M, rn64, n_mask, j0, S, n_groups, rows, GROUP, M_POW2, BLOCK_T, V)
    out = tl.sum(acc, axis=2)  # [M_POW2, BN]
    out_mask = (rows[:, None] < M) & n_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


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
def _int4_dequant_kernel(q_ptr, s_ptr, z_ptr, out_ptr, N, S, n_groups, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rn64 = rn.to(tl.int64)
    mask = (rn < N)[:, None] & (rw < S)[None, :]
    words = tl.load(q_ptr + rn64[:, None] * S + rw[None, :], mask=mask, other=0)  # [BN, BW]
    for i in tl.static_range(8):
        k = i * S + rw  # [BW] input of nibble i of each word
        g_off = rn64[:, None] * n_groups + (k // GROUP)[None, :]
        s = tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=mask, other=0).to(tl.float32)
        codes = ((words >> (4 * i)) & 0xF).to(tl.float32)
        tl.store(out_ptr + rn64[:, None] * (8 * S) + k[None, :], ((codes - z) * s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_dequant_kernel(q_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn64 = rn.to(tl.int64)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    q = tl.load(q_ptr + rn64[:, None] * K + rk[None, :], mask=mask, other=0).to(tl.float32)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn64[:, None] * K + rk[None, :], (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


# Candidates autotuning measures per (N, S, rows, group, V) on a GPU. BLOCK_T is 32 num_warps: one
# thread per position along T, so that x `[1, BT, V]` is laid out as the words are (a tile with fewer
# threads than x elements / V would be laid out otherwise, and converted through shared memory).
# Tiles of BLOCK_T V = 128 .. 1024 words a row (the whole of a 4096-input row in one tile at 4 warps),
# 2 to 8 rows: 4 rows at 4 warps compile to about 127 registers (4 programs an SM), 8 rows to about 250.
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_T": 32 * w}, num_warps=w)
                for bn, w in ((4, 4), (8, 4), (4, 2), (2, 8))]
INT8_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
                for bn, bk, w in ((4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8), (2, 2048, 4))]


def _bench(kernel_call, quantiles):
    """Autotuning's timer: Triton's (L2 cleared before each run, so weights come from HBM as in a
    decode step), with a shorter warm-up and measuring window than its default 25 + 100 ms."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_int4_tuned = triton.autotune(GEMV_CONFIGS, key=["N", "S", "M_POW2", "GROUP", "V"], do_bench=_bench)(_int4_gemv_kernel)
_int8_tuned = triton.autotune(INT8_CONFIGS, key=["N", "K", "M_POW2"], do_bench=_bench)(_int8_gemv_kernel)


def words_per_thread(S: int, group_size: int) -> int:
    """V, the consecutive words of a row one thread loads and sums before it scales: the largest of
    4, 2, 1 dividing both the words a row has (S) and the group, so that the V inputs of every
    slice lie in one group (4: one 16-byte load)."""
    return next(v for v in (4, 2, 1) if S % v == 0 and group_size % v == 0)


def _check_x(x, K, name, max_rows):
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != K or not 1 <= x.shape[0] <= max_rows:
        raise ValueError(f"{name}: x must be [M, {K}] with 1 <= M <= {max_rows} and a contiguous last dimension, got {tuple(x.shape)}")


def int4_gemv_triton(x, qweight, scales, zeros, group_size, *, out=None, config=None):
    """x `[M, K]` (M <= INT4_GEMV_ROWS) -> `[M, N]` in x's dtype; see `declab_kernels.quant_gemv`.
    `config` (BLOCK_N, BLOCK_T, num_warps): that configuration instead of the autotuned one (the
    interpreter's default: INTERPRET_CONFIG)."""
    N, S = qweight.shape
    K = S * 8
    _check_x(x, K, "int4_gemv", INT4_GEMV_ROWS)
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (x, qweight, scales, zeros, out, M, N, S, K // group_size, x.stride(0), out.stride(0))
    consts = dict(GROUP=group_size, M_POW2=triton.next_power_of_2(M), V=words_per_thread(S, group_size))
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
    _check_x(x, K, "int8_gemv", MAX_ROWS)
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
    N, S = qweight.shape
    out = torch.empty(N, 8 * S, device=qweight.device, dtype=dtype)
    bn, bw = 16, 64
    _int4_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(S, bw))](
        qweight, scales, zeros, out, N, S, 8 * S // group_size, GROUP=group_size, BLOCK_N=bn, BLOCK_W=bw)
    return out


def dequantize_int8_triton(qweight, scale, dtype):
    """Dense `[N, K]` in `dtype` (rounded once from qweight * scale in float32)."""
    N, K = qweight.shape
    out = torch.empty(N, K, device=qweight.device, dtype=dtype)
    bn, bk = 16, 256
    _int8_dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](qweight, scale, out, N, K, BLOCK_N=bn, BLOCK_K=bk)
    return out
