"""Weight-only quantised products in Triton (int8 per output channel, int4 group-wise): the CUDA-core
GEMVs, the dequantising tensor-core kernels, and the dequantisation kernels that the dense path
feeds to cuBLAS.

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

Dot kernels (any M; the dispatch runs them between tuning.QUANT_FMA_ROWS and tuning.QUANT_DOT_ROWS): grid (N /
BLOCK_N, M / BLOCK_M, splits along K). A program computes the transposed product out^T `[BLOCK_N,
BLOCK_M]` in float32, so that its weight rows fill the MMA's 64-row side and x's rows (16, padded by
masking, for decode; 64 for prefill) its narrow one. int4 on layout 2: a `[BLOCK_N, BW]` tile of words
(BW dividing S and the group: `int4_dot_words`) gives, for nibble i, weights of the contiguous inputs
i S + j0 .. + BW, all in one group, and tl.dot takes them with x's matching `[BW, BLOCK_M]` columns.
Decode (BLOCK_M 16) keeps the weight operand exact, code - zero, and applies the group's scale to each
nibble's `[BLOCK_N, 16]` product, once per row, nibble and tile instead of once per weight; for 16-bit
x it makes two weights a 32-bit register at once: the nibbles of words 2u and 2u + 1 (a consecutive
pair of inputs, as the MMA operand's register holds them) side by side in the two halves, masked,
plus the bf16 pattern of 144 (fp16: 1040) minus the zero in both halves (integer operations, no carry
between the halves: 144 + code - zero, exact), minus 144 (one packed subtraction in x's dtype).
Prefill (BLOCK_M 64) masks each nibble in place under 2^23's exponent (2^23 + code 2^sh as a float),
subtracts 2^23 + zero 2^sh and multiplies by the scale 2^-sh in float32, so that the weight, rounded
to x's dtype as the dense path rounds it, lets the eight products chain into one accumulator. int8:
codes to x's dtype (exact), one dot a tile, the row scale once at the end. Splits (`split_k`: while the (m, n) blocks leave SMs idle, up to MAX_SPLIT)
each own whole K tiles; each stores its float32 partial to a workspace `[split, M, N]`, takes a ticket
from its block's int32 counter, and the last one sums the partials in split order (deterministic),
writes the output and sets the counter back to 0: one launch, no host sync, a workspace of fixed size
after the first call, CUDA-graph safe.

PDL (constexpr, `declab_kernels.pdl`, launched with launch_pdl): every program calls
gdc_launch_dependents() first, loads its first weight tile (int4: the words; int8: the row scales and
the first tile), then gdc_wait() before it reads x, the workspace or stores anything.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.split_workspace import split_workspace
from declab_kernels.quant_gemv import INT4_GEMV_ROWS, MAX_ROWS, int4_dot_words

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter, which runs programs one after another, wide row blocks: few programs.
INTERPRET_BLOCK_N = 32
INTERPRET_CONFIG = dict(BLOCK_N=INTERPRET_BLOCK_N, BLOCK_T=8)
# 1 + code / 16 as a float32: the code moved to mantissa bits 19..22 of 1.0's pattern.
CODE_BITS = tl.constexpr(0x00780000)
ONE_BITS = tl.constexpr(0x3F800000)
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)
# 144 in bf16 and 1040 in fp16 (128 + 16 and 1024 + 16, where both step by 1), in both halves of a word.
PAIR_BF16 = tl.constexpr(0x43104310)
PAIR_FP16 = tl.constexpr(0x64106410)


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


@triton.jit
def _dot_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A dot kernel program's place in the grid (N / BLOCK_N, M / BLOCK_M, split): its ids, the number
    of splits, its output rows rn `[BN]` (as int64 too) and x rows rm `[BM]` with their masks."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_n, pid_m, tl.program_id(2), tl.num_programs(2), rn, rn < N, rn.to(tl.int64), rm, rm < M


@triton.jit
def _dot_store(acc, out_ptr, part_ptr, cnt_ptr, rn, rm, n_mask, m_mask, M, N, stride_om, pid_n, pid_m, pid_k, split):
    """Write this program's float32 products acc `[BN, BM]` (output columns rn, rows rm). With split
    programs along K (split > 1): store them to the partials `[split, M, N]`, take a ticket from the
    (m, n) block's counter, and the last of the block sums the split partials in split order
    (deterministic whoever is last), writes the output and sets the counter back to 0."""
    o_mask = n_mask[:, None] & m_mask[None, :]
    o_ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
    if split == 1:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        mn = rm[None, :] * N + rn[:, None]  # [BN, BM]
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=o_mask)
        # Every thread's partial stores are issued before one thread takes the ticket; acq_rel
        # publishes them to, and acquires the others' for, the program that takes the last one.
        tl.debug_barrier()
        cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
        if ticket == split - 1:
            tl.store(cnt, 0)
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(split):
                # .cg reads from L2, where the other programs' stores landed.
                total += tl.load(part_ptr + s * M * N + mn, mask=o_mask, other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _int4_group(s_rows, z_rows, n_mask, k0, GROUP: tl.constexpr):
    """(scale float32, zero int32) `[BN]` of the group holding input k0, from the rows' first scale
    and zero pointers `[BN]`."""
    g = k0 // GROUP
    return (tl.load(s_rows + g, mask=n_mask, other=0.0).to(tl.float32),
            tl.load(z_rows + g, mask=n_mask, other=0).to(tl.int32))


@triton.jit
def _int4_groups(s_rows, z_rows, n_mask, j0, S, GROUP: tl.constexpr):
    """The (scale, zero) of each nibble of the tile at word j0: nibble i holds inputs i S + j0 .. + BW,
    one group (BW divides S and the group). Loaded apart from the tile's arithmetic, so that the first
    tile's come before the PDL wait with its words."""
    return (_int4_group(s_rows, z_rows, n_mask, j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 2 * S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 3 * S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 4 * S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 5 * S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 6 * S + j0, GROUP),
            _int4_group(s_rows, z_rows, n_mask, 7 * S + j0, GROUP))


@triton.jit
def _int4_dot_x(x_ptr, stride_xm, rm, x_mask, j0, S, BLOCK_W: tl.constexpr):
    """x's eight `[BW, BM]` column runs of the tile at word j0 (run i: inputs i S + j0 .. + BW), loaded
    before any is used: outside the pipelined loop (the tile before the PDL wait) each load would
    otherwise wait for the previous nibble's product."""
    x_cols = x_ptr + rm[None, :] * stride_xm + tl.arange(0, BLOCK_W)[:, None]
    return (tl.load(x_cols + j0, mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (2 * S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (3 * S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (4 * S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (5 * S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (6 * S + j0), mask=x_mask[None, :], other=0.0),
            tl.load(x_cols + (7 * S + j0), mask=x_mask[None, :], other=0.0))


@triton.jit
def _int4_dot_tile(acc, words, groups, x_ptr, stride_xm, rm, x_mask, j0, S, DOT_PREC: tl.constexpr):
    """Prefill (BLOCK_M 64): acc `[BN, BM]` plus the products of one tile of words `[BN, BW]` (words j0
    .. j0 + BW of the program's rows, their scales and zeros `groups` from `_int4_groups`) with x's
    matching columns; x_mask `[BM]` masks x's rows (a split past the end masks them all)."""
    xs = _int4_dot_x(x_ptr, stride_xm, rm, x_mask, j0, S, words.shape[1])
    # Nibbles 5..7 moved to bits 8..19, so that every nibble can sit below a float's exponent field.
    high = words >> 12
    for i in tl.static_range(8):
        s, z = groups[i]
        if i < 5:
            b = words
            sh = 4 * i
        else:
            b = high
            sh = 4 * (i - 3)
        # The nibble masked in place under 2^23's exponent is the float 2^23 + code 2^sh (no shift, no
        # conversion instruction); minus 2^23 + zero 2^sh it is (code - zero) 2^sh, exact; times the
        # scale 2^-sh it is the weight, rounded to x's dtype as the dense path rounds it, so that the
        # eight products chain into one accumulator.
        c = ((b & (0xF << sh)) | MAGIC_BITS).to(tl.float32, bitcast=True)
        zf = ((z << sh) | MAGIC_BITS).to(tl.float32, bitcast=True)
        d = (c - zf[:, None]) * (s * (1.0 / (1 << sh)))[:, None]  # [BN, BW]
        acc = tl.dot(d.to(x_ptr.dtype.element_ty), xs[i], acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _int4_run_weights(lo, hi, words, z, i: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble i of the tile's words minus the zero points z `[BN]`: the MMA's weight operand `[BN, BW]`
    in DTYPE, STEP (code - z) exactly (STEP 1/16 for float32, 1 for 16-bit x), without a conversion
    instruction: bit operations, and for 16-bit x, an integer add and the subtraction of a constant,
    each on two weights at once."""
    if DTYPE == tl.float32:
        # 1 + code / 16: the code moved to the top of 1.0's mantissa; minus 1 + z / 16.
        if i < 5:
            b = words << (19 - 4 * i)
        else:
            b = words >> (4 * i - 19)
        c = ((b & CODE_BITS) | ONE_BITS).to(tl.float32, bitcast=True)
        w = c - ((z << 19) | ONE_BITS).to(tl.float32, bitcast=True)[:, None]
    else:
        # lo (hi) holds nibbles 0..3 (4..7) of words 2u and 2u + 1 in its low and high halves, the pair
        # of consecutive inputs that one register of the MMA operand holds: masked, plus the pattern of
        # 144 (bf16 0x4310, fp16 1040: 0x6410) minus z in both halves, each half is the float 144 +
        # code - z (1040 + ...), exact (no carry between the halves: 1 <= 16 + code - z <= 31); minus
        # 144 (1040) in DTYPE it is code - z.
        if DTYPE == tl.bfloat16:
            PAIR: tl.constexpr = PAIR_BF16
            OFFSET: tl.constexpr = 144.0
        else:
            PAIR: tl.constexpr = PAIR_FP16
            OFFSET: tl.constexpr = 1040.0
        b = lo if i < 4 else hi
        p = ((b >> (4 * (i % 4))) & 0x000F000F) + (z * -0x00010001 + PAIR)[:, None]  # [BN, BW / 2]
        pair = tl.join(p.to(tl.int16).to(DTYPE, bitcast=True), (p >> 16).to(tl.int16).to(DTYPE, bitcast=True))
        w = pair.reshape(words.shape[0], words.shape[1]) - OFFSET
    return w


@triton.jit
def _int4_decode_tile(acc, words, groups, x_ptr, stride_xm, rm, x_mask, j0, S, DOT_PREC: tl.constexpr):
    """Decode (BLOCK_M 16), as `_int4_dot_tile`, except that the weight operand stays exact, STEP (code -
    zero) (`_int4_run_weights`), and the group's scale (over STEP) multiplies each nibble's `[BN, BM]`
    product: once per (row, nibble, tile), not once per weight (a nibble's BW inputs lie in one group)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    BN: tl.constexpr = words.shape[0]
    BW: tl.constexpr = words.shape[1]
    INV_STEP: tl.constexpr = 16.0 if DTYPE == tl.float32 else 1.0
    xs = _int4_dot_x(x_ptr, stride_xm, rm, x_mask, j0, S, BW)
    # The words of each row in pairs (2u, 2u + 1): their low halves (nibbles 0..3) side by side in lo,
    # their high halves (4..7) in hi.
    a, b = tl.split(words.reshape(BN, BW // 2, 2))
    lo = (a & 0xFFFF) | (b << 16)
    hi = ((a >> 16) & 0xFFFF) | (b & -65536)
    for i in tl.static_range(8):
        s, z = groups[i]
        w = _int4_run_weights(lo, hi, words, z, i, DTYPE)
        acc += tl.dot(w, xs[i], input_precision=DOT_PREC) * (s * INV_STEP)[:, None]
    return acc


@triton.jit
def _int4_dot_step(acc, words, groups, x_ptr, stride_xm, rm, x_mask, j0, S, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile: `_int4_decode_tile` at BLOCK_M 16, `_int4_dot_tile` above."""
    if BLOCK_M <= 16:
        acc = _int4_decode_tile(acc, words, groups, x_ptr, stride_xm, rm, x_mask, j0, S, DOT_PREC)
    else:
        acc = _int4_dot_tile(acc, words, groups, x_ptr, stride_xm, rm, x_mask, j0, S, DOT_PREC)
    return acc


@triton.jit
def _int4_dot_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, S, n_groups, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr = False,
):
    pid_n, pid_m, pid_k, split, rn, n_mask, rn64, rm, m_mask = _dot_program(M, N, BLOCK_M, BLOCK_N)
    # Split s owns whole tiles of words [s per, (s + 1) per); BW divides S, so every tile is whole.
    per = tl.cdiv(S // BLOCK_W, split) * BLOCK_W
    j_lo = pid_k * per
    j_hi = tl.minimum(S, j_lo + per)
    q_rows = q_ptr + rn64[:, None] * S + tl.arange(0, BLOCK_W)[None, :]  # [BN, BW]
    s_rows = s_ptr + rn64 * n_groups  # [BN]
    z_rows = z_ptr + rn64 * n_groups
    # Transposed product, out^T [BN, BM]: the weight rows fill the MMA's 64-row side, x's few rows its narrow one.
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    j_start = j_lo
    if PDL:
        # Let the next kernel launch now, fetch the first tile of words and its scales and zeros (no
        # kernel of a decode step writes a weight) while the previous kernel finishes, and wait for it
        # before reading x.
        tl.extra.cuda.gdc_launch_dependents()
        # A split past the end (j_lo = j_hi) loads nothing and adds nothing; the test as a [BN] and a
        # [BM] tensor (the interpreter refuses a mask combined with a scalar comparison).
        live_n = n_mask & (tl.zeros((BLOCK_N,), tl.int32) + j_lo < j_hi)
        live_m = m_mask & (tl.zeros((BLOCK_M,), tl.int32) + j_lo < j_hi)
        words = tl.load(q_rows + j_lo, mask=live_n[:, None], other=0)
        groups = _int4_groups(s_rows, z_rows, live_n, j_lo, S, GROUP)
        tl.extra.cuda.gdc_wait()
        acc = _int4_dot_step(acc, words, groups, x_ptr, stride_xm, rm, live_m, j_lo, S, BLOCK_M, DOT_PREC)
        j_start = j_lo + BLOCK_W
    for j0 in range(j_start, j_hi, BLOCK_W):
        words = tl.load(q_rows + j0, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        groups = _int4_groups(s_rows, z_rows, n_mask, j0, S, GROUP)
        acc = _int4_dot_step(acc, words, groups, x_ptr, stride_xm, rm, m_mask, j0, S, BLOCK_M, DOT_PREC)
    _dot_store(acc, out_ptr, part_ptr, cnt_ptr, rn, rm, n_mask, m_mask, M, N, stride_om, pid_n, pid_m, pid_k, split)


@triton.jit
def _int8_dot_tile(acc, q, x_ptr, stride_xm, rm, m_mask, k0, k_hi, DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc `[BN, BM]` plus the products of the codes q `[BN, BK]` (inputs k0 .. k0 + BK) with x's columns."""
    k = k0 + tl.arange(0, BLOCK_K)
    xt = tl.load(x_ptr + rm[None, :] * stride_xm + k[:, None], mask=(k < k_hi)[:, None] & m_mask[None, :], other=0.0)  # [BK, BM]
    # Codes -127..127 are exact in bf16; the row scale comes once, after the sum.
    return tl.dot(q.to(xt.dtype), xt, acc, input_precision=DOT_PREC)


@triton.jit
def _int8_dot_kernel(
    x_ptr, q_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    pid_n, pid_m, pid_k, split, rn, n_mask, rn64, rm, m_mask = _dot_program(M, N, BLOCK_M, BLOCK_N)
    # Split s owns whole tiles [s per, (s + 1) per); a split past the end runs no tile.
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), split) * BLOCK_K
    k_lo = pid_k * per
    k_hi = tl.minimum(K, k_lo + per)
    kk = tl.arange(0, BLOCK_K)
    q_rows = q_ptr + rn64[:, None] * K + kk[None, :]  # [BN, BK]
    s = tl.load(s_ptr + rn64, mask=n_mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = k_lo
    if PDL:
        # As the int4 kernel: the row scales and the first tile of codes before the wait, x after.
        tl.extra.cuda.gdc_launch_dependents()
        q = tl.load(q_rows + k_lo, mask=n_mask[:, None] & (k_lo + kk < k_hi)[None, :], other=0)
        tl.extra.cuda.gdc_wait()
        acc = _int8_dot_tile(acc, q, x_ptr, stride_xm, rm, m_mask, k_lo, k_hi, DOT_PREC, BLOCK_K)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        q = tl.load(q_rows + k0, mask=n_mask[:, None] & (k0 + kk < k_hi)[None, :], other=0, eviction_policy="evict_first")
        acc = _int8_dot_tile(acc, q, x_ptr, stride_xm, rm, m_mask, k0, k_hi, DOT_PREC, BLOCK_K)
    _dot_store(acc * s[:, None], out_ptr, part_ptr, cnt_ptr, rn, rm, n_mask, m_mask, M, N, stride_om, pid_n, pid_m, pid_k, split)


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


def _check_x(x, K, name, max_rows=None):
    """ValueError unless x is `[M, K]` with 1 <= M (<= max_rows when given) and a contiguous last dimension."""
    bound = f" <= {max_rows}" if max_rows is not None else ""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] != K or not 1 <= x.shape[0] <= (max_rows or x.shape[0]):
        raise ValueError(f"{name}: x must be [M, {K}] with 1 <= M{bound} and a contiguous last dimension, got {tuple(x.shape)}")


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


# Dequantising tensor-core kernels: candidates per BLOCK_M (16: decode rows, padded; 64: prefill),
# autotuned per (N, K or S, BLOCK_M, group). The weight rows fill the MMA's 64-row side (BLOCK_N 64
# or 128). int4: BLOCK_W words a row a tile (8 BLOCK_W inputs), clipped to `int4_dot_words` for the
# shape; int8: BLOCK_K codes. Compiled for sm_90 (offline, Triton 3.6 and 3.9, PDL on), all use wgmma
# without spills: int4 at BLOCK_M 16 130..254 registers, 56..112 KB of shared memory (x's eight runs
# and the words, num_stages deep; BLOCK_W 128 spills); at BLOCK_M 64 only BLOCK_W 32 fits (BLOCK_W 64:
# 155..270 KB or spills); int8 95..200 registers.
INT4_DOT_CONFIGS = {bm: [triton.Config({"BLOCK_N": bn, "BLOCK_W": bw}, num_warps=w, num_stages=st) for bn, bw, w, st in cfgs]
                    for bm, cfgs in ((16, ((64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (128, 32, 8, 4))),
                                     (64, ((128, 32, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3))))}
INT8_DOT_CONFIGS = {bm: [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in cfgs]
                    for bm, cfgs in ((16, ((64, 256, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 128, 8, 4))),
                                     (64, ((128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3))))}
INTERPRET_INT4_DOT = dict(BLOCK_N=16, BLOCK_W=16)
INTERPRET_INT8_DOT = dict(BLOCK_N=16, BLOCK_K=32)
# Splits along K at most, and the SM count the interpreter pretends to have (so that small test
# shapes split, as llama's 2048..4096-row projections do on 132 SMs).
MAX_SPLIT = 8
INTERPRET_SMS = 4


def _clip_words(configs, nargs, **kwargs):
    """The int4 dot candidates with BLOCK_W clipped to the shape's widest tile (`int4_dot_words`), deduplicated."""
    widest = int4_dot_words(nargs["S"], kwargs["GROUP"])
    kept = {}
    for c in configs:
        kw = dict(c.kwargs, BLOCK_W=min(c.kwargs["BLOCK_W"], widest))
        kept.setdefault((kw["BLOCK_N"], kw["BLOCK_W"], c.num_warps, c.num_stages),
                        triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return list(kept.values())


_int4_dot_tuned = {bm: triton.autotune(cfgs, key=["N", "S", "BLOCK_M", "GROUP"], do_bench=_bench,
                                        prune_configs_by={"early_config_prune": _clip_words})(_int4_dot_kernel)
                   for bm, cfgs in INT4_DOT_CONFIGS.items()}
_int8_dot_tuned = {bm: triton.autotune(cfgs, key=["N", "K", "BLOCK_M"], do_bench=_bench)(_int8_dot_kernel)
                   for bm, cfgs in INT8_DOT_CONFIGS.items()}

def dot_block_m(M: int) -> int:
    """Rows of x a dot program takes: 16 (tl.dot's least, padded by masking) up to MAX_ROWS, 64 above."""
    return 16 if M <= MAX_ROWS else 64


def split_k(blocks: int, tiles: int, sms: int) -> int:
    """Programs along K for `blocks` (m, n) output blocks of `tiles` K tiles each: doubled, up to
    MAX_SPLIT and `tiles`, while the blocks alone would leave some of the `sms` SMs without a program."""
    split = 1
    while blocks * split < sms and 2 * split <= min(MAX_SPLIT, tiles):
        split *= 2
    return split


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device) -> int:
    """The SM count `split_k` fills on `device` (INTERPRET_SMS off CUDA)."""
    if device.type != "cuda":
        return INTERPRET_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())


def _workspace(device, n_part, n_cnt):
    """This kernel family's split-K partials and counters (`declab_kernels.split_workspace`)."""
    return split_workspace("quant_gemv", device, n_part, n_cnt)


def _dot_launch(kernel, tuned, configs, x, out, args, consts, N, tiles_of, config, split):
    """Launch a dot kernel with `config` (a dict of its block sizes), or autotuned (`tuned`, over
    `configs`, per BLOCK_M). args: the tensors after x and before the output, then a tuple of the
    integers after the workspace. Grid (n blocks, m blocks, splits), the splits by `split_k` unless
    `split` is given; the workspace sized for every candidate's grid."""
    M = x.shape[0]
    block_m = consts["BLOCK_M"]
    sms = _sms(x.device)

    def splits(meta):
        blocks = triton.cdiv(N, meta["BLOCK_N"]) * triton.cdiv(M, block_m)
        return split if split is not None else split_k(blocks, tiles_of(meta), sms)

    candidates = [config] if config is not None else [c.kwargs for c in configs[block_m]]
    n_part = max(splits(c) * M * N if splits(c) > 1 else 0 for c in candidates)
    n_cnt = max(triton.cdiv(N, c["BLOCK_N"]) * triton.cdiv(M, block_m) for c in candidates)
    part, cnt = _workspace(x.device, n_part, n_cnt)
    use_pdl = pdl(x.device, __name__)
    consts = dict(consts, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", PDL=use_pdl, launch_pdl=use_pdl)

    def grid(meta):
        return triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, block_m), splits(meta)

    if config is not None:
        kernel[grid(config)](x, *args[:-1], out, part, cnt, *args[-1], **consts, **config)
    else:
        # The autotuner passes the keywords that are no configuration's (launch_pdl too) to every launch.
        tuned[block_m][grid](x, *args[:-1], out, part, cnt, *args[-1], **consts)
    return out


def int4_dot_triton(x, qweight, scales, zeros, group_size, *, out=None, config=None, split=None):
    """x `[M, K]` (any M) -> `[M, N]` in x's dtype with the dequantising tensor-core kernel; the shape
    must have `int4_dot_words(S, group_size)` >= 16. `config` (BLOCK_N, BLOCK_W, optionally num_warps /
    num_stages): that configuration instead of the autotuned one (the interpreter's default:
    INTERPRET_INT4_DOT); `split`: that many programs along K instead of `split_k`'s."""
    N, S = qweight.shape
    K = 8 * S
    _check_x(x, K, "int4_dot")
    widest = int4_dot_words(S, group_size)
    if widest < 16:
        raise ValueError(f"int4_dot: {S} words a row and group {group_size} leave no tile of >= 16 words in one group")
    if config is None and INTERPRET:
        config = dict(INTERPRET_INT4_DOT, BLOCK_W=min(INTERPRET_INT4_DOT["BLOCK_W"], widest))
    if config is not None and (widest % config["BLOCK_W"] or config["BLOCK_W"] < 16):
        raise ValueError(f"int4_dot: BLOCK_W {config['BLOCK_W']} must be >= 16 and divide {widest}")
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (qweight, scales, zeros, (M, N, S, K // group_size, x.stride(0), out.stride(0)))
    consts = dict(GROUP=group_size, BLOCK_M=dot_block_m(M))
    return _dot_launch(_int4_dot_kernel, _int4_dot_tuned, INT4_DOT_CONFIGS, x, out, args, consts, N,
                       lambda meta: S // min(meta["BLOCK_W"], widest), config, split)


def int8_dot_triton(x, qweight, scale, *, out=None, config=None, split=None):
    """x `[M, K]` (any M) -> `[M, N]` in x's dtype with the tensor-core kernel; `config` (BLOCK_N,
    BLOCK_K, ...) and `split` as `int4_dot_triton`'s."""
    N, K = qweight.shape
    _check_x(x, K, "int8_dot")
    if config is None and INTERPRET:
        config = INTERPRET_INT8_DOT
    M = x.shape[0]
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    args = (qweight, scale, (M, N, K, x.stride(0), out.stride(0)))
    consts = dict(BLOCK_M=dot_block_m(M))
    return _dot_launch(_int8_dot_kernel, _int8_dot_tuned, INT8_DOT_CONFIGS, x, out, args, consts, N,
                       lambda meta: triton.cdiv(K, meta["BLOCK_K"]), config, split)


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
