"""Triton kernels for the norms around a Mamba-2 decode step (see ref.py for the semantics).

Each op is one launch with one program per (row, group), the whole row or group in registers: at decode
sizes (D = 2048, d_inner = 4096 at 1.3b) a row is a few KB, so the cost is the launch, not the bytes.
Inputs are read through their strides, so in-projection slices (z) need no copy.

PDL (constexpr, see `declab_kernels.pdl`): each program loads its norm weight, then gdc_wait(), then the
rest (the token ids, the embedding row, the activations).
"""

import torch
import triton
import triton.language as tl

from declab_kernels import pdl


def _num_warps(block):
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, tok_ptr, res_ptr, w_ptr, out_ptr, r_ptr,
    s_xb, s_xd, s_rb, s_rd, s_ob, s_od, s_qb, s_qd, s_tok,
    D, eps,
    BLOCK_D: tl.constexpr, GATHER: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # The norm weight is no kernel's output: fetched while the previous kernel finishes.
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.extra.cuda.gdc_wait()
    # With GATHER, x is the embedding table and this row's input is the row of its token. The token ids
    # are read through their stride: a column of a [B, T] tensor (speculative verification's fed[:, j])
    # is a view with stride T, and reading it as contiguous would give row b the token of another row.
    if GATHER:
        row = tl.load(tok_ptr + b * s_tok).to(tl.int64)
    else:
        row = b
    r = tl.load(x_ptr + row * s_xb + offs * s_xd, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(res_ptr + b * s_rb + offs * s_rd, mask=mask, other=0.0).to(tl.float32)
    tl.store(r_ptr + b * s_qb + offs * s_qd, r, mask=mask)
    h = r * tl.rsqrt(tl.sum(r * r, axis=0) / D + eps)
    if not PDL:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # Rounded to the weight's dtype before the product, as the reference's `weight * h.to(weight.dtype)`.
    out = h.to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + b * s_ob + offs * s_od, out.to(out_ptr.dtype.element_ty), mask=mask)


def _add_rmsnorm(x, tokens, residual, weight, eps):
    """Launch for both public ops: rows of x (or x[tokens]) plus residual -> (normed, r float32)."""
    Bsz = tokens.shape[0] if tokens is not None else x.shape[0]
    D = x.shape[1]
    if weight.shape != (D,) or weight.stride(0) != 1 or (residual is not None and residual.shape != (Bsz, D)):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)} weight {tuple(weight.shape)} "
                         f"residual {None if residual is None else tuple(residual.shape)}")
    out = torch.empty(Bsz, D, device=x.device, dtype=weight.dtype)
    r = torch.empty(Bsz, D, device=x.device, dtype=torch.float32)
    res = residual if residual is not None else r
    block = triton.next_power_of_2(D)
    use_pdl = pdl(x.device, __name__)
    _add_rmsnorm_kernel[(Bsz,)](
        x, tokens if tokens is not None else r, res, weight, out, r,
        *x.stride(), *res.stride(), *out.stride(), *r.stride(), tokens.stride(0) if tokens is not None else 0,
        D, eps,
        BLOCK_D=block, GATHER=tokens is not None, HAS_RES=residual is not None, PDL=use_pdl,
        num_warps=_num_warps(block), launch_pdl=use_pdl,
    )
    return out, r


def embed_rmsnorm(tokens, table, weight, eps):
    """tokens [B] int, table [V, D] -> (normed [B, D] weight dtype, r [B, D] fp32); one launch."""
    return _add_rmsnorm(table, tokens, None, weight, eps)


def add_rmsnorm(x, residual, weight, eps):
    """x [B, D], residual [B, D] fp32 -> (normed [B, D] weight dtype, r = residual + x [B, D] fp32); one launch."""
    return _add_rmsnorm(x, None, residual, weight, eps)


@triton.jit
def _gated_rmsnorm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr,
    s_yb, s_yd, s_zb, s_zd, s_ob, s_od,
    GS, eps,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < GS
    ch = g * GS + offs
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_ptr + ch, mask=mask, other=0.0)
        tl.extra.cuda.gdc_wait()
    y = tl.load(y_ptr + b * s_yb + ch * s_yd, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + b * s_zb + ch * s_zd, mask=mask, other=0.0).to(tl.float32)
    h = y * z * tl.sigmoid(z)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / GS + eps)
    if not PDL:
        w = tl.load(w_ptr + ch, mask=mask, other=0.0)
    # Rounded to y's dtype before the product, as the reference's `weight * h.to(y.dtype)`.
    out = h.to(y_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + b * s_ob + ch * s_od, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm(y, z, weight, group_size, eps):
    """y, z [B, D] (any strides) -> weight * rmsnorm(y * silu(z)) per group, [B, D] contiguous; one launch."""
    Bsz, D = y.shape
    if z.shape != (Bsz, D) or weight.shape != (D,) or weight.stride(0) != 1 or D % group_size:
        raise ValueError(f"shape mismatch: y {tuple(y.shape)} z {tuple(z.shape)} weight {tuple(weight.shape)} "
                         f"group_size {group_size}")
    out = torch.empty(Bsz, D, device=y.device, dtype=torch.promote_types(weight.dtype, y.dtype))
    block = triton.next_power_of_2(group_size)
    use_pdl = pdl(y.device, __name__)
    _gated_rmsnorm_kernel[(Bsz, D // group_size)](
        y, z, weight, out, *y.stride(), *z.stride(), *out.stride(), group_size, eps,
        BLOCK=block, PDL=use_pdl, num_warps=_num_warps(block), launch_pdl=use_pdl,
    )
    return out
