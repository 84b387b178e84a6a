"""Paged attention in Triton: KV write, flash-decoding split-K decode, and varlen flash prefill.

Layouts (see README.md): `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]` (last dim
contiguous); `block_tables` `[B, max_blocks]`; `seq_lens` `[B]`; token at position p of sequence b
lives at page `block_tables[b, p // block_size]`, row `p % block_size`. Every kernel gathers K/V
rows through that formula, so any power-of-two page size works.

Decode is CUDA-graph safe: the grid depends only on host integers (batch, heads, and the split
count fixed in a `DecodeWorkspace`), the per-sequence split length is computed on the device from
`seq_lens`, and no call reads a device value on the host.

PDL (`declab_kernels.pdl`): the KV write takes a `PDL` constexpr and is launched with launch_pdl; every
program calls gdc_launch_dependents() and gdc_wait() before its first load. The decode kernel is
launched without PDL: with it, a graphed llama-1b step was 4% slower at 128k (README.md, performance
log #16). Prefill is launched as before.

Decode with ROPE (constexpr; `paged_decode_attention(..., rope=(k, v, cos, sin))`) also rotates q
and the step's k at position seq_len - 1 and writes the rotated k and v into the cache: the split
holding that position writes them before its loop, behind a barrier (README.md, "RoPE in decode").

FP8 (constexpr; float8_e4m3fn caches with `scales=(k_scale, v_scale)`, see `ref.quantize`): every
kernel that writes a row quantizes it as the reference does (bit for bit: the exponent comes from
the float32 bits of the row's largest magnitude), and every kernel that reads K/V converts the e4m3
tile to q's dtype in registers and applies the rows' powers of two to the scores (K) and to the
probabilities before p @ v (V), so the dots run on q's dtype as for a bf16 cache. A float cache of
another dtype than q (a bf16 cache under a float32 model) is converted the same way, unscaled.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.paged_attention.ref import check_scales

LOG2E = 1.4426950408889634
MAX_SPLITS = 256
MIN_SPLIT_TOKENS = 128
# Prefill with few query tiles (a Mask-Predict block over its prefix): programs per SM the key
# splits aim for (a prefill tile holds more registers than a decode one), and keys per split.
PREFILL_PROGRAMS_PER_SM = 2
MIN_PREFILL_SPLIT_TOKENS = 256
# Programs per SM the split choice plans for: the decode tiles fit 5 per SM at D <= 128 (registers
# and shared memory), so a grid of 4 per SM runs as one wave with room to spare.
PROGRAMS_PER_SM = 4
# fp32 elements of partials the merging program holds per chunk (32 registers a thread at 4 warps).
REDUCE_ELEMS = 4096
# Up to this many (64 registers a thread at 4 warps) the flat merge loads every partial at once, beside
# the log-sum-exps: one L2 round trip for the whole merge (a batch-1 llama-1b layer at 4k: 4 heads x
# 32 splits x 64).
ONE_LOAD_ELEMS = 8192


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeVariant:
    """How one decode call is cut into programs, their tiles, and how the split partials are merged.

    `tile_elems` is the tile's rows x D_pad (K and V each). `flat_merge`: the merging program loads
    every split's log-sum-exp at once and the partial chunks in an unrolled loop with no dependence
    between chunks (else one online chunk after another). `early_v`: V's load is issued beside K's
    instead of after the softmax, so an unpipelined tile costs one memory round trip, not two.
    """

    programs_per_sm: int
    min_split_tokens: int
    tile_elems: int
    num_warps: int
    num_stages: int
    flat_merge: bool
    early_v: bool


DECODE_VARIANTS = {
    # The measured default: ~4 programs per SM, 8 KB K + 8 KB V tiles double-buffered.
    "split": DecodeVariant(PROGRAMS_PER_SM, MIN_SPLIT_TOKENS, 4096, 4, 5, False, False),
    # Batch-1 latency: half the programs, each with twice the tile rows (16 KB K + 16 KB V, still
    # double-buffered), and a merge of half as many partials issued in one round. Splits of >= 128
    # keys: 32 at 4k (one tile a split), which a llama-1b step measured 22 µs faster than 16.
    "long": DecodeVariant(2, 128, 8192, 4, 5, True, True),
}


def decode_config(head_dim: int, variant: str = "split") -> KernelConfig:
    """Decode tiles of `variant`; the default: 8 KB of K and 8 KB of V per tile, 4 warps, 5 stages.

    The block-table load takes one pipeline stage before the K/V loads that index with it; with 3
    or 4 stages the pipeliner keeps one K/V buffer (the loop waits for each tile as it starts), with
    5 it double-buffers K and V in shared memory (cp.async, ~38 KB on sm_90 at D=128, 89
    registers), so two tiles are in flight per program and five programs fit on an SM.
    """
    spec = _variant(variant)
    d_pad = _pad_dim(head_dim)
    return KernelConfig(block_m=0, block_n=max(16, spec.tile_elems // d_pad), num_warps=spec.num_warps,
                        num_stages=spec.num_stages)


def _variant(name: str) -> DecodeVariant:
    if name not in DECODE_VARIANTS:
        raise ValueError(f"decode variant must be one of {sorted(DECODE_VARIANTS)}, got {name!r}")
    return DECODE_VARIANTS[name]


def prefill_config(head_dim: int) -> KernelConfig:
    """Prefill tiles: 128 queries x 64 keys, as the Triton flash-attention forward uses on Hopper."""
    d_pad = _pad_dim(head_dim)
    if d_pad <= 64:
        return KernelConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if d_pad <= 128:
        return KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return KernelConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def _pad_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16 and tiles must be powers of two.
    return max(16, triton.next_power_of_2(head_dim))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter has no SMs; a small number keeps several splits in the CPU tests.
    return 4


def choose_num_splits(programs: int, max_seq_len: int, num_sms: int, *, block_n: int,
                      programs_per_sm: int = PROGRAMS_PER_SM, min_split_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Key splits for a grid of `programs` programs without splits (decode: sequences x kv heads;
    prefill: query tiles x heads x sequences) over sequences of length <= max_seq_len, cut by the
    kernel into runs of whole `block_n`-key tiles."""
    # About programs_per_sm programs per SM, rounded down so the grid stays one wave: rounding up
    # (16 x 8 x 5 = 640 programs where 528 fit) left a second, nearly empty wave of slow programs.
    wanted = max(1, programs_per_sm * num_sms // max(programs, 1))
    # At least min_split_tokens per split: shorter runs spend more on the partials than they save.
    splits = max(1, min(wanted, triton.cdiv(max(max_seq_len, 1), min_split_tokens), MAX_SPLITS))
    # The kernels give each split cdiv(tiles, splits) tiles, so at max_seq_len only the splits
    # returned here hold data (33 asked of 64 tiles: 32 runs of 2). Asking for more would launch
    # programs with nothing to do and widen the merge (a flat merge pads its splits to a power of 2).
    tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    return triton.cdiv(tiles, triton.cdiv(tiles, splits))


@dataclass
class DecodeWorkspace:
    """Partial results of split-K decode, allocated once per (batch capacity, max_seq_len)."""

    num_splits: int
    # [B, Hq, S] log2-sum-exp of each split's scores
    lse: torch.Tensor
    # [B, Hq, S, D_pad] each split's softmax-normalised output
    partial: torch.Tensor
    # [B, Hkv] int32 splits of (b, kv head) finished in the running call; the last one to finish
    # merges the partials and sets its counter back to 0, so every call starts from zeros.
    counters: torch.Tensor
    # key of DECODE_VARIANTS: tiles, warps, stages and merge of the calls that use this workspace
    variant: str = "split"


def decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, device, *, num_splits=None,
                     variant="split"):
    """Buffers for `paged_decode_attention` on up to `batch` sequences of length <= `max_seq_len`."""
    device = torch.device(device)
    spec = _variant(variant)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_seq_len, _num_sms(device),
                                       block_n=decode_config(head_dim, variant).block_n,
                                       programs_per_sm=spec.programs_per_sm, min_split_tokens=spec.min_split_tokens)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    partial = torch.empty(batch, num_q_heads, num_splits, _pad_dim(head_dim), dtype=torch.float32, device=device)
    counters = torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=device)
    return DecodeWorkspace(num_splits, lse, partial, counters, variant)


@triton.jit
def fp8_exponent(amax):
    """`ref.row_exponents` from each row's largest magnitude (float32): int32 exponents, at least -126."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(e, -126)


@triton.jit
def pow2(e):
    """2^e as float32 for int32 e in [-126, 127], built from its bits (exact, as `ref.pow2`)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_e4m3(y):
    """float32 y, |y| <= 448, rounded to the nearest e4m3 value (ties to even) and still float32, so the
    conversion after it is exact. (The Triton interpreter's own conversion carries no rounding into the
    exponent: 124 became 64, not 128.)"""
    bits = y.to(tl.int32, bitcast=True)
    # |y| >= 2^-6 (e4m3's smallest normal): keep 3 mantissa bits, rounding on the 20 below them.
    normal = ((bits >> 23) & 0xFF) >= 121
    up = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Below it the grid is multiples of 2^-9: |y| * 2^9 rounded to an integer by adding 1.5 * 2^23.
    sub = ((tl.abs(y) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(normal, up, tl.where(bits < 0, -sub, sub))


@triton.jit
def store_fp8_rows(x, dst, exp_dst, mask, row_mask):
    """Rows x `[R, C]` float32 (masked-off elements 0) quantized as `ref.quantize`: the e4m3 values to the
    pointers dst `[R, C]`, each row's exponent to exp_dst `[R]`."""
    e = fp8_exponent(tl.max(tl.abs(x), 1))
    tl.store(dst, round_e4m3(x * pow2(-e)[:, None]).to(dst.dtype.element_ty), mask=mask)
    tl.store(exp_dst, e.to(tl.int8), mask=row_mask)


def scale_args(k_cache, v_cache, scales) -> dict:
    """The kernels' arguments for an fp8 cache's exponents (none for any other cache); checks them."""
    if check_scales(k_cache, v_cache, scales) is None:
        return {}
    k_scale, v_scale = scales
    return dict(ks_ptr=k_scale, vs_ptr=v_scale, stride_sb=k_scale.stride(0), stride_st=k_scale.stride(1),
                stride_sh=k_scale.stride(2), FP8=True)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    PDL: tl.constexpr = False,
    ks_ptr=None, vs_ptr=None, stride_sb=0, stride_st=0, stride_sh=0, FP8: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE
        row = slot % PAGE
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < H) & (d < D)
        k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d, mask=mask)
        kc = kc_ptr + page * stride_kcb + row * stride_kct + h * stride_kch + d
        vc = vc_ptr + page * stride_vcb + row * stride_vct + h * stride_vch + d
        if FP8:
            # [H_PAD] the heads' exponents
            exps = page * stride_sb + row * stride_st + tl.arange(0, H_PAD) * stride_sh
            heads = tl.arange(0, H_PAD) < H
            store_fp8_rows(k.to(tl.float32), kc, ks_ptr + exps, mask, heads)
            store_fp8_rows(v.to(tl.float32), vc, vs_ptr + exps, mask, heads)
        else:
            tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, scales=None):
    """k, v `[N, Hkv, D]` into the caches at flat slots `slot_mapping` `[N]`; negative slots skipped.
    An fp8 cache (`scales`, see the module docstring) gets each row quantized."""
    n, num_heads, head_dim = k.shape
    check_cache(k_cache, v_cache)
    fp8 = scale_args(k_cache, v_cache, scales)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv: k and v need a contiguous last dimension")
    if n == 0:
        return
    use_pdl = pdl(k.device, __name__)
    _write_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=num_heads, D=head_dim, H_PAD=triton.next_power_of_2(num_heads), D_PAD=_pad_dim(head_dim),
        PAGE=k_cache.shape[1], PDL=use_pdl, num_warps=4, launch_pdl=use_pdl, **fp8,
    )


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, lse_ptr, part_ptr, cnt_ptr, out_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_lb, stride_lh,
    stride_pb, stride_ph, stride_ps,
    stride_cb,
    stride_ob, stride_oh,
    num_splits,
    G: tl.constexpr, G_PAD: tl.constexpr, G_R: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    S_PAD: tl.constexpr, FLAT_MERGE: tl.constexpr, EARLY_V: tl.constexpr, ONE_LOAD: tl.constexpr,
    kn_ptr=None, vn_ptr=None, cos_ptr=None, sin_ptr=None, stride_knb=0, stride_knh=0, stride_vnb=0, stride_vnh=0,
    stride_cos=0, ROPE: tl.constexpr = False,
    ks_ptr=None, vs_ptr=None, stride_sb=0, stride_st=0, stride_sh=0, FP8: tl.constexpr = False,
):
    split = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Every sequence is cut into num_splits equal runs of whole tiles, computed here from its own
    # length, so short sequences still spread over all splits and the grid stays fixed.
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(n_tiles, num_splits), 1)
    # Splits that hold data; the ones after them exit at once.
    n_valid = tl.cdiv(n_tiles, tiles_per_split)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = hk * G + g
    if D == D_PAD:
        qmask = g[:, None] < G
    else:
        qmask = (g[:, None] < G) & (d[None, :] < D)
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if start < end:
        # [G_PAD, D_PAD]: the G query heads sharing kv head hk are the M rows of both dots.
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        if ROPE:
            # The step's own token, at position seq_len - 1: rotate q here instead of in a kernel
            # before. The split holding that position also rotates the new key of kv head hk and
            # writes it and the value into the cache before its loop; the barrier makes the row
            # visible to every thread of the program, which then reads it like the older rows.
            p_new = seq_len - 1
            HALF: tl.constexpr = D // 2
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            dmask = d < D
            cos = tl.load(cos_ptr + p_new * stride_cos + d % HALF, mask=dmask, other=0.0)
            # [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]: the partner half times -sin, then +sin
            sin = tl.load(sin_ptr + p_new * stride_cos + d % HALF, mask=dmask, other=0.0) * tl.where(d < HALF, -1.0, 1.0)
            q_p = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + partner[None, :], mask=qmask, other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + q_p.to(tl.float32) * sin[None, :]).to(q.dtype)
            if end == seq_len:
                k_row = kn_ptr + b * stride_knb + hk * stride_knh
                k_a = tl.load(k_row + d, mask=dmask, other=0.0).to(tl.float32)
                k_b = tl.load(k_row + partner, mask=dmask, other=0.0).to(tl.float32)
                v_new = tl.load(vn_ptr + b * stride_vnb + hk * stride_vnh + d, mask=dmask, other=0.0)
                page_new = tl.load(bt_row + p_new // PAGE).to(tl.int64)
                row_new = page_new * stride_kb + (p_new % PAGE) * stride_kt + hk * stride_kh
                v_dst = v_ptr + page_new * stride_vb + (p_new % PAGE) * stride_vt + hk * stride_vh + d
                if FP8:
                    # Rounded to k's dtype first: the reference rotates in that dtype, then quantizes.
                    k_rot = (k_a * cos + k_b * sin).to(kn_ptr.dtype.element_ty).to(tl.float32)
                    v_f = v_new.to(tl.float32)
                    e_k = fp8_exponent(tl.max(tl.abs(k_rot), 0))
                    e_v = fp8_exponent(tl.max(tl.abs(v_f), 0))
                    tl.store(k_ptr + row_new + d, round_e4m3(k_rot * pow2(-e_k)).to(k_ptr.dtype.element_ty), mask=dmask)
                    tl.store(v_dst, round_e4m3(v_f * pow2(-e_v)).to(v_ptr.dtype.element_ty), mask=dmask)
                    s_new = page_new * stride_sb + (p_new % PAGE) * stride_st + hk * stride_sh
                    tl.store(ks_ptr + s_new, e_k.to(tl.int8))
                    tl.store(vs_ptr + s_new, e_v.to(tl.int8))
                else:
                    tl.store(k_ptr + row_new + d, (k_a * cos + k_b * sin).to(k_ptr.dtype.element_ty), mask=dmask)
                    tl.store(v_dst, v_new.to(v_ptr.dtype.element_ty), mask=dmask)
                tl.debug_barrier()
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            page = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
            if D == D_PAD:
                kvmask = valid[:, None]
            else:
                kvmask = valid[:, None] & (d[None, :] < D)
            k_off = page * stride_kb + (pos % PAGE) * stride_kt + hk * stride_kh
            # [BLOCK_N, D_PAD]
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if FP8:
                # [BLOCK_N] the rows' exponents
                s_off = page * stride_sb + (pos % PAGE) * stride_st + hk * stride_sh
                k_exp = tl.load(ks_ptr + s_off, mask=valid, other=0)
            if EARLY_V:
                v_off = page * stride_vb + (pos % PAGE) * stride_vt + hk * stride_vh
                v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kvmask, other=0.0)
                if FP8:
                    v_exp = tl.load(vs_ptr + s_off, mask=valid, other=0)
            # [G_PAD, BLOCK_N] scores in log2 units
            if FP8:
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * (pow2(k_exp.to(tl.int32)) * qk_scale)[None, :]
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not EARLY_V:
                v_off = page * stride_vb + (pos % PAGE) * stride_vt + hk * stride_vh
                v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kvmask, other=0.0)
                if FP8:
                    v_exp = tl.load(vs_ptr + s_off, mask=valid, other=0)
            if FP8:
                # p_j 2^e_j v8_j: the rows' powers of two on the probabilities, l_i left unscaled.
                p_v = p * pow2(v_exp.to(tl.int32))[None, :]
                acc = acc * alpha[:, None] + tl.dot(p_v.to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        if n_valid == 1:
            # The only split with data: its result is final.
            tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            gmask = g < G
            lse_head = lse_ptr + b * stride_lb + hk * G * stride_lh
            part_head = part_ptr + b * stride_pb + hk * G * stride_ph
            tl.store(lse_head + g * stride_lh + split, m_i + tl.log2(l_i), mask=gmask)
            tl.store(part_head + g[:, None] * stride_ph + split * stride_ps + d[None, :], acc / l_i[:, None],
                     mask=gmask[:, None])
            # Every thread's partial stores are issued before one thread takes a ticket; acq_rel
            # publishes them to, and acquires the others' for, the program that takes the last one.
            tl.debug_barrier()
            cnt = cnt_ptr + b * stride_cb + hk
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
            if ticket == n_valid - 1:
                # The last split of (b, hk) to finish merges all n_valid partials:
                # out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M).
                tl.store(cnt, 0)
                gr = tl.arange(0, G_R)
                sc = tl.arange(0, CHUNK)
                gr_ok = gr < G
                if FLAT_MERGE:
                    # [G_R, S_PAD] every split's lse in one load, so M is known before any partial
                    # is read and the unrolled chunk loads below depend on nothing but M: they can
                    # all be in flight together instead of one L2 round trip per chunk. Up to
                    # ONE_LOAD_ELEMS the partials are loaded beside the lse, before any reduction:
                    # one round trip in all (the reductions' barriers keep loads after them there).
                    sp = tl.arange(0, S_PAD)
                    sp_mask = gr_ok[:, None] & (sp[None, :] < n_valid)
                    lse_all = tl.load(lse_head + gr[:, None] * stride_lh + sp[None, :], mask=sp_mask,
                                      other=float("-inf"), cache_modifier=".cg")
                    if ONE_LOAD:
                        # [G_R, S_PAD, D_PAD] every partial, loaded beside the log-sum-exps.
                        part_all = tl.load(part_head + gr[:, None, None] * stride_ph + sp[None, :, None] * stride_ps
                                           + d[None, None, :], mask=sp_mask[:, :, None], other=0.0,
                                           cache_modifier=".cg")
                    # Padding head rows get weight 1 on zero partials instead of NaN from -inf - -inf.
                    lse_all = tl.where(gr_ok[:, None], lse_all, 0.0)
                    m_run = tl.max(lse_all, 1)
                    w_all = tl.exp2(lse_all - m_run[:, None])
                    den = tl.sum(w_all, 1)
                    if ONE_LOAD:
                        red = tl.sum(w_all[:, :, None] * part_all, 1)
                    else:
                        red = tl.zeros([G_R, D_PAD], dtype=tl.float32)
                        for c in tl.static_range(0, S_PAD, CHUNK):
                            s = c + sc
                            smask = gr_ok[:, None] & (s[None, :] < n_valid)
                            lse = tl.load(lse_head + gr[:, None] * stride_lh + s[None, :], mask=smask,
                                          other=float("-inf"), cache_modifier=".cg")
                            w = tl.exp2(tl.where(gr_ok[:, None], lse, 0.0) - m_run[:, None])
                            # [G_R, CHUNK, D_PAD]
                            part = tl.load(part_head + gr[:, None, None] * stride_ph + s[None, :, None] * stride_ps
                                           + d[None, None, :], mask=smask[:, :, None], other=0.0,
                                           cache_modifier=".cg")
                            red += tl.sum(w[:, :, None] * part, 1)
                else:
                    # Online over chunks of splits.
                    m_run = tl.full([G_R], float("-inf"), dtype=tl.float32)
                    den = tl.zeros([G_R], dtype=tl.float32)
                    red = tl.zeros([G_R, D_PAD], dtype=tl.float32)
                    for c in range(0, n_valid, CHUNK):
                        s = c + sc
                        smask = gr_ok[:, None] & (s[None, :] < n_valid)
                        # [G_R, CHUNK]; .cg reads from L2, where the other programs' stores landed.
                        lse = tl.load(lse_head + gr[:, None] * stride_lh + s[None, :], mask=smask,
                                      other=float("-inf"), cache_modifier=".cg")
                        # Padding head rows get weight 1 on zero partials instead of NaN from -inf - -inf.
                        lse = tl.where(gr_ok[:, None], lse, 0.0)
                        m_new = tl.maximum(m_run, tl.max(lse, 1))
                        alpha = tl.exp2(m_run - m_new)
                        w = tl.exp2(lse - m_new[:, None])
                        # [G_R, CHUNK, D_PAD]
                        part = tl.load(part_head + gr[:, None, None] * stride_ph + s[None, :, None] * stride_ps
                                       + d[None, None, :], mask=smask[:, :, None], other=0.0,
                                       cache_modifier=".cg")
                        den = den * alpha + tl.sum(w, 1)
                        red = red * alpha[:, None] + tl.sum(w[:, :, None] * part, 1)
                        m_run = m_new
                red_ptrs = out_ptr + b * stride_ob + (hk * G + gr)[:, None] * stride_oh + d[None, :]
                red_mask = gr_ok[:, None] & (d[None, :] < D)
                tl.store(red_ptrs, (red / den[:, None]).to(out_ptr.dtype.element_ty), mask=red_mask)
    elif split == 0:
        # Only an empty sequence (padding slot) has no data in split 0: defined as a zero output.
        tl.store(o_ptrs, tl.zeros([G_PAD, D_PAD], dtype=out_ptr.dtype.element_ty), mask=qmask)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *, out=None, workspace=None,
                           config=None, rope=None, scales=None):
    """Flash-decoding over the paged cache: q `[B, Hq, D]` -> `[B, Hq, D]` in q's dtype.

    `rope=(k, v, cos, sin)`: q and k `[B, Hkv, D]` are not yet rotated and the step's K/V row (position
    seq_len - 1) is not yet in the cache: the kernel rotates q and k (tables `[P, D/2]` float32) and
    writes the rotated k and v into the cache itself, as `declab_kernels.rotary.apply_rotary_write_kv` would
    have before the call.

    Without a workspace one is allocated for max_seq_len = block_tables.shape[1] * block_size (a
    host bound, no sync); pass one made by `decode_workspace` to capture the call in a CUDA graph.
    The workspace's variant picks tiles and merge; `config` overrides the tiles (the benchmark's sweep).
    `scales`: an fp8 cache's exponents (module docstring).
    """
    batch, num_q_heads, head_dim = q.shape
    check_cache(k_cache, v_cache)
    fp8 = scale_args(k_cache, v_cache, scales)
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("paged_decode_attention: q needs a contiguous last dimension")
    group = num_q_heads // num_kv_heads
    page = k_cache.shape[1]
    if workspace is None:
        workspace = decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, block_tables.shape[1] * page, q.device)
    ws_batch, ws_heads, _, ws_dim = workspace.partial.shape
    if (ws_batch < batch or ws_heads != num_q_heads or ws_dim != _pad_dim(head_dim)
            or workspace.counters.shape[1] != num_kv_heads):
        raise ValueError("decode workspace does not match (batch capacity, Hq, D) of this call")
    if out is None:
        out = torch.empty_like(q)
    if out.stride(-1) != 1 or out.shape != q.shape:
        raise ValueError("paged_decode_attention: out must be [B, Hq, D] with a contiguous last dimension")
    spec = _variant(workspace.variant)
    cfg = config or decode_config(head_dim, workspace.variant)
    splits = workspace.num_splits
    lse, part, cnt = workspace.lse, workspace.partial, workspace.counters
    g_r = triton.next_power_of_2(group)
    d_pad = _pad_dim(head_dim)
    s_pad = triton.next_power_of_2(splits)
    chunk = max(1, REDUCE_ELEMS // (g_r * d_pad))
    rope_args = {}
    if rope is not None:
        k_new, v_new, cos, sin = rope
        if (tuple(k_new.shape) != (batch, num_kv_heads, head_dim) or tuple(v_new.shape) != tuple(k_new.shape)
                or k_new.stride(-1) != 1 or v_new.stride(-1) != 1):
            raise ValueError(f"paged_decode_attention: rope k and v must be [{batch}, {num_kv_heads}, {head_dim}] with "
                             f"a contiguous last dimension, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        if (head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2
                or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride() != sin.stride()
                or cos.stride(1) != 1):
            raise ValueError(f"paged_decode_attention: rope tables must be float32 [P, {head_dim // 2}], "
                             f"laid out alike, got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
        rope_args = dict(kn_ptr=k_new, vn_ptr=v_new, cos_ptr=cos, sin_ptr=sin, stride_knb=k_new.stride(0),
                         stride_knh=k_new.stride(1), stride_vnb=v_new.stride(0), stride_vnh=v_new.stride(1),
                         stride_cos=cos.stride(0), ROPE=True)
    # Launched without PDL (module docstring).
    _decode_split_kernel[(splits, num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, seq_lens, lse, part, cnt, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        lse.stride(0), lse.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        cnt.stride(0),
        out.stride(0), out.stride(1),
        splits,
        G=group, G_PAD=max(16, g_r), G_R=g_r, D=head_dim, D_PAD=d_pad, PAGE=page, BLOCK_N=cfg.block_n,
        CHUNK=min(chunk, s_pad) if spec.flat_merge else chunk,
        # S_PAD only shapes the flat merge; fixed otherwise so the default compiles once for all split counts.
        S_PAD=s_pad if spec.flat_merge else 1, FLAT_MERGE=spec.flat_merge,
        ONE_LOAD=spec.flat_merge and g_r * s_pad * d_pad <= ONE_LOAD_ELEMS,
        EARLY_V=spec.early_v, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **rope_args, **fp8,
    )
    return out


# The integers that change from call to call under serving (the step's query count, the block
# table's width, the split count) are not specialised: each distinct value of 1, a multiple of 16 or
# anything else would otherwise compile its own variant in the middle of a timed run.
@triton.jit(do_not_specialize=["total_q", "stride_btb", "splits"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, cu_ptr, out_ptr, lse_ptr, part_ptr,
    qk_scale, total_q,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    splits,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    ks_ptr=None, vs_ptr=None, stride_sb=0, stride_st=0, stride_sh=0, FP8: tl.constexpr = False,
):
    # Query tiles in reverse so the longest causal tiles start first and the tail is short.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2) // splits
    split = tl.program_id(2) % splits
    hk = h // G
    q_first = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_first
    m_start = m_block * BLOCK_M
    if m_start < q_len:
        seq_len = tl.load(seq_lens_ptr + b)
        # The queries are the last q_len positions; the first seq_len - q_len are cached prefix.
        prefix = seq_len - q_len
        offs_m = m_start + tl.arange(0, BLOCK_M)
        q_pos = prefix + offs_m
        d = tl.arange(0, D_PAD)
        if D == D_PAD:
            qmask = offs_m[:, None] < q_len
        else:
            qmask = (offs_m[:, None] < q_len) & (d[None, :] < D)
        q_rows = (q_first + offs_m).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qmask, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        if CAUSAL:
            # Tiles wholly at or before the tile's first query position need no mask.
            full_end = (prefix + m_start + 1) // BLOCK_N * BLOCK_N
            end = tl.minimum(seq_len, prefix + m_start + BLOCK_M)
        else:
            full_end = seq_len // BLOCK_N * BLOCK_N
            end = seq_len
        # splits > 1: this program takes the split-th of `splits` equal runs of whole key tiles.
        tiles_per_split = tl.cdiv(tl.cdiv(end, BLOCK_N), splits)
        lo = split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, end)
        full_end = tl.maximum(tl.minimum(full_end, hi), lo)
        for n0 in range(lo, full_end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            page = tl.load(bt_row + pos // PAGE).to(tl.int64)
            k_off = page * stride_kb + (pos % PAGE) * stride_kt + hk * stride_kh
            v_off = page * stride_vb + (pos % PAGE) * stride_vt + hk * stride_vh
            if D == D_PAD:
                k = tl.load(k_ptr + k_off[:, None] + d[None, :])
                v = tl.load(v_ptr + v_off[:, None] + d[None, :])
            else:
                k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=d[None, :] < D, other=0.0)
                v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=d[None, :] < D, other=0.0)
            if FP8:
                s_off = page * stride_sb + (pos % PAGE) * stride_st + hk * stride_sh
                k_pow = pow2(tl.load(ks_ptr + s_off).to(tl.int32))
                v_pow = pow2(tl.load(vs_ptr + s_off).to(tl.int32))
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_pow * qk_scale)[None, :]
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8:
                acc = acc * alpha[:, None] + tl.dot((p * v_pow[None, :]).to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        # Diagonal tiles (causal) and the partly filled last tile: masked.
        for n0 in range(full_end, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < seq_len
            page = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
            k_off = page * stride_kb + (pos % PAGE) * stride_kt + hk * stride_kh
            v_off = page * stride_vb + (pos % PAGE) * stride_vt + hk * stride_vh
            if D == D_PAD:
                kvmask = valid[:, None]
            else:
                kvmask = valid[:, None] & (d[None, :] < D)
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kvmask, other=0.0)
            if FP8:
                s_off = page * stride_sb + (pos % PAGE) * stride_st + hk * stride_sh
                k_pow = pow2(tl.load(ks_ptr + s_off, mask=valid, other=0).to(tl.int32))
                v_pow = pow2(tl.load(vs_ptr + s_off, mask=valid, other=0).to(tl.int32))
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_pow * qk_scale)[None, :]
            else:
                qk = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
            if CAUSAL:
                visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            else:
                visible = valid[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # With splits, a causal row can see none of a later split's keys: exponents from 0, not
            # -inf. (One split: position 0 is visible to every row and comes first; m_new is finite.)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FP8:
                acc = acc * alpha[:, None] + tl.dot((p * v_pow[None, :]).to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m_i = m_new
        if splits == 1:
            out = acc / l_i[:, None]
            o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qmask)
        else:
            # This split's normalised output and log2-sum-exp (-inf where it saw no key), merged by
            # _prefill_merge_kernel. Layout: part [splits, total_q, Hq, D_PAD], lse [splits, total_q, Hq].
            seen = l_i > 0
            n_heads = tl.num_programs(1)
            row = (split * total_q + q_rows) * n_heads + h
            l_safe = tl.where(seen, l_i, 1.0)
            tl.store(lse_ptr + row, tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=offs_m < q_len)
            part = tl.where(seen[:, None], acc / l_safe[:, None], 0.0)
            tl.store(part_ptr + row[:, None] * D_PAD + d[None, :], part, mask=(offs_m[:, None] < q_len))


@triton.jit(do_not_specialize=["total_q", "splits"])
def _prefill_merge_kernel(lse_ptr, part_ptr, out_ptr, total_q, stride_ot, stride_oh, splits,
                          D: tl.constexpr, D_PAD: tl.constexpr):
    """One (query row, head): out = sum_s 2^(lse_s - M) part_s / sum_s 2^(lse_s - M), the splits
    folded in one at a time (online), so that every split count runs the same compiled kernel."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    n_heads = tl.num_programs(1)
    d = tl.arange(0, D_PAD)
    m = tl.full([1], float("-inf"), tl.float32)
    den = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for s in range(0, splits):
        row = (s * total_q + t) * n_heads + h
        # Split 0 holds the sequence's first key tile, visible to every query: m is finite from it on,
        # and a later split that saw no key (lse -inf) weighs 0.
        lse = tl.load(lse_ptr + row + tl.zeros([1], dtype=tl.int64))
        m_new = tl.maximum(m, lse)
        alpha, w = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        acc = acc * alpha + w * tl.load(part_ptr + row * D_PAD + d)
        den = den * alpha + w
        m = m_new
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / den).to(out_ptr.dtype.element_ty), mask=d < D)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, *, causal,
                            max_seqlen_q=None, config=None, num_splits=None, scales=None):
    """Varlen flash attention over the paged cache: q `[total_q, Hq, D]` -> `[total_q, Hq, D]`.

    `max_seqlen_q` (host int) sizes the grid; when None it is read from `cu_seqlens_q` (a sync).
    `config` overrides `prefill_config(D)` (used by the benchmark's tile sweep), its query tile cut to
    the longest query run when that is shorter. `num_splits` overrides `choose_num_splits` (1 while the
    query tiles alone fill the GPU), whose key bound here is the block table's capacity (host
    integers only: the call can be graph-captured).
    With more than one split each program walks its run of the keys into float32 partials that
    `_prefill_merge_kernel` combines: the few-query case (a Mask-Predict block over a long prefix)
    otherwise has one program per head walking the whole prefix. `scales`: an fp8 cache's exponents.
    """
    total_q, num_q_heads, head_dim = q.shape
    check_cache(k_cache, v_cache)
    fp8 = scale_args(k_cache, v_cache, scales)
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("paged_prefill_attention: q needs a contiguous last dimension")
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q)
    if total_q == 0 or batch == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    cfg = config or prefill_config(head_dim)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max(max_seqlen_q, 1))))
    m_blocks = triton.cdiv(max(max_seqlen_q, 1), block_m)
    page = k_cache.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(m_blocks * num_q_heads * batch, block_tables.shape[1] * page, _num_sms(q.device),
                                       block_n=cfg.block_n, programs_per_sm=PREFILL_PROGRAMS_PER_SM,
                                       min_split_tokens=MIN_PREFILL_SPLIT_TOKENS)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    d_pad = _pad_dim(head_dim)
    if num_splits > 1:
        lse = torch.empty(num_splits, total_q, num_q_heads, dtype=torch.float32, device=q.device)
        part = torch.empty(num_splits, total_q, num_q_heads, d_pad, dtype=torch.float32, device=q.device)
    else:
        # Not read; float32 like the split buffers, so that both cases run the same compiled kernel.
        lse = part = torch.empty(1, dtype=torch.float32, device=q.device)
    _prefill_kernel[(m_blocks, num_q_heads, batch * num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, lse, part,
        scale * LOG2E, total_q,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        G=num_q_heads // num_kv_heads, D=head_dim, D_PAD=d_pad, PAGE=page,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fp8,
    )
    if num_splits > 1:
        _prefill_merge_kernel[(total_q, num_q_heads)](
            lse, part, out, total_q, out.stride(0), out.stride(1), num_splits, D=head_dim, D_PAD=d_pad,
        )
    return out


def check_cache(k_cache, v_cache):
    """The paged caches' layout every kernel here (and declab_kernels.rotary's cache write) relies on."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches need a contiguous last dimension")
