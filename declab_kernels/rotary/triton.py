"""RoPE on q and k in one Triton kernel: one program per token rotates all its q and k heads, and with
WRITE_KV also writes the rotated k and the v heads into a paged K/V cache (the attention families'
per-layer RoPE + cache write in one launch).

PDL (constexpr, see `declab_kernels.pdl`): gdc_wait() first, since the positions select the cos/sin rows.
FP8 (constexpr): float8_e4m3fn caches, each written row quantized as `declab_kernels.paged_attention.ref.quantize`
(its exponent into the scales), bit for bit.
"""

import torch
import triton
import triton.language as tl

from declab_kernels import pdl
from declab_kernels.paged_attention.triton import check_cache, fp8_exponent, pow2, round_e4m3, scale_args, store_fp8_rows


@triton.jit
def _rotate_heads(src, dst, stride_src_h, stride_dst_h, H, HALF, cos, sin, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate heads [0, H) of one token: src/dst point at the token's head 0; cos, sin [BLOCK_D] float32."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < H) & (d[None, :] < HALF)
    src_1 = src + h[:, None] * stride_src_h + d[None, :]
    dst_1 = dst + h[:, None] * stride_dst_h + d[None, :]
    # Both halves are loaded before either is stored, so dst may be src (in place).
    x1 = tl.load(src_1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_1 + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(dst_1, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_1 + HALF, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads_fp8(src, dst, exp_dst, stride_src_h, stride_dst_h, stride_exp_h, H, HALF, cos, sin,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_rotate_heads` into an fp8 cache: each rotated head quantized, its exponent to exp_dst + h * stride_exp_h."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < H) & (d[None, :] < HALF)
    src_1 = src + h[:, None] * stride_src_h + d[None, :]
    x1 = tl.load(src_1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_1 + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # Rounded to k's dtype first: the reference rotates in that dtype, then quantizes.
    r1 = (x1 * c - x2 * s).to(src.dtype.element_ty).to(tl.float32)
    r2 = (x2 * c + x1 * s).to(src.dtype.element_ty).to(tl.float32)
    # One exponent for the whole head: the larger of its two halves' largest magnitudes.
    e = fp8_exponent(tl.maximum(tl.max(tl.abs(r1), 1), tl.max(tl.abs(r2), 1)))
    inv = pow2(-e)[:, None]
    dst_1 = dst + h[:, None] * stride_dst_h + d[None, :]
    tl.store(dst_1, round_e4m3(r1 * inv).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst_1 + HALF, round_e4m3(r2 * inv).to(dst.dtype.element_ty), mask=mask)
    tl.store(exp_dst + h * stride_exp_h, e.to(tl.int8), mask=h < H)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
    v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh,
    stride_qon, stride_qoh, stride_kon, stride_koh,
    stride_cos, stride_sin,
    stride_vn, stride_vh, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    HQ, HKV, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr = False, PAGE: tl.constexpr = 16, PDL: tl.constexpr = False,
    ks_ptr=None, vs_ptr=None, stride_sb=0, stride_st=0, stride_sh=0, FP8: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_sin + d, mask=d < HALF, other=0.0)
    if WRITE_KV:
        # Before k is rotated in place: the cache gets the rotation of the unrotated k, and v as is.
        slot = tl.load(slot_ptr + n).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE
            row = slot % PAGE
            h = tl.arange(0, BLOCK_HKV)[:, None]
            dv = tl.arange(0, 2 * BLOCK_D)[None, :]
            mask = (h < HKV) & (dv < 2 * HALF)
            vc = vc_ptr + page * stride_vcb + row * stride_vct + h * stride_vch + dv
            if FP8:
                exps = page * stride_sb + row * stride_st
                _rotate_heads_fp8(k_ptr + n * stride_kn, kc_ptr + page * stride_kcb + row * stride_kct, ks_ptr + exps,
                                  stride_kh, stride_kch, stride_sh, HKV, HALF, cos, sin, BLOCK_HKV, BLOCK_D)
                v = tl.load(v_ptr + n * stride_vn + h * stride_vh + dv, mask=mask, other=0.0).to(tl.float32)
                heads = tl.arange(0, BLOCK_HKV)
                store_fp8_rows(v, vc, vs_ptr + exps + heads * stride_sh, mask, heads < HKV)
            else:
                _rotate_heads(k_ptr + n * stride_kn, kc_ptr + page * stride_kcb + row * stride_kct, stride_kh, stride_kch,
                              HKV, HALF, cos, sin, BLOCK_HKV, BLOCK_D)
                v = tl.load(v_ptr + n * stride_vn + h * stride_vh + dv, mask=mask)
                tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)
    _rotate_heads(q_ptr + n * stride_qn, qo_ptr + n * stride_qon, stride_qh, stride_qoh, HQ, HALF, cos, sin, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + n * stride_kn, ko_ptr + n * stride_kon, stride_kh, stride_koh, HKV, HALF, cos, sin, BLOCK_HKV, BLOCK_D)


def _check(q, k, positions, cos, sin):
    N, HQ, D = q.shape
    if k.shape[0] != N or k.shape[2] != D or D % 2 or positions.shape != (N,):
        raise ValueError(f"apply_rotary: q [N, Hq, D], k [N, Hkv, D] (D even), positions [N]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("apply_rotary: q, k, cos and sin need a contiguous last dimension")
    if cos.shape != sin.shape or cos.shape[-1] != D // 2:
        raise ValueError(f"apply_rotary: cos and sin must be [P, D/2] = [P, {D // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")


def _launch(q, k, q_out, k_out, positions, cos, sin, v=None, k_cache=None, v_cache=None, slot_mapping=None, fp8=None):
    N, HQ, D = q.shape
    HKV = k.shape[1]
    if N == 0:
        return
    write = k_cache is not None
    # Without the cache write its pointers and strides are unused: q stands in for them.
    v, k_cache, v_cache, slot_mapping = (v, k_cache, v_cache, slot_mapping) if write else (q, q.unsqueeze(0), q.unsqueeze(0), positions)
    use_pdl = pdl(q.device, __name__)
    _rotary_kernel[(N,)](
        q, k, q_out, k_out, positions, cos, sin,
        v, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ, HKV, D // 2,
        BLOCK_HQ=triton.next_power_of_2(HQ), BLOCK_HKV=triton.next_power_of_2(HKV), BLOCK_D=triton.next_power_of_2(D // 2),
        WRITE_KV=write, PAGE=k_cache.shape[1] if write else 16,
        PDL=use_pdl, num_warps=4, launch_pdl=use_pdl, **(fp8 or {}),
    )


def apply_rotary_triton(q, k, positions, cos, sin, *, inplace=False):
    """See `declab_kernels.rotary.apply_rotary`; q, k may be strided views (e.g. of one fused q/k/v projection)."""
    _check(q, k, positions, cos, sin)
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format))
    _launch(q, k, q_out, k_out, positions, cos, sin)
    return q_out, k_out


def apply_rotary_write_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, scales=None):
    """See `declab_kernels.rotary.apply_rotary_write_kv`: q and k rotated in place, rotated k and v into the
    caches (quantized, for an fp8 cache with its `scales`)."""
    _check(q, k, positions, cos, sin)
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"apply_rotary_write_kv: v must be k's shape {tuple(k.shape)} with a contiguous last dimension, got {tuple(v.shape)}")
    check_cache(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"apply_rotary_write_kv: the caches hold [Hkv, D] = {tuple(k_cache.shape[2:])} per row, k has {tuple(k.shape[1:])}")
    if slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"apply_rotary_write_kv: slot_mapping must be [N] = [{q.shape[0]}], got {tuple(slot_mapping.shape)}")
    fp8 = scale_args(k_cache, v_cache, scales)
    _launch(q, k, q, k, positions, cos, sin, v, k_cache, v_cache, slot_mapping, fp8)
    return q, k
