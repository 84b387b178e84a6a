"""Fused residual add + RMSNorm in Triton: one program per row, the whole row in registers.

PDL (constexpr, see `declab_kernels.pdl`): the norm weight is loaded before gdc_wait(), the row after it.
"""

import torch
import triton
import triton.language as tl

from declab_kernels import pdl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    d, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # The weight is no kernel's output: fetched while the previous kernel finishes.
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the model dtype before the norm reads it, as the reference's add is.
        r = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, r, mask=mask)
        rf = r.to(tl.float32)
    else:
        rf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(rf * rf, axis=0) / d + eps)
    # HF rounds the normalised row to the model dtype before scaling by the weight.
    h = (rf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    if not PDL:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(x, residual, weight, eps, *, out=None):
    """See `declab_kernels.rmsnorm.add_rms_norm`; x and residual `[N, d]` with a contiguous last dimension."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x must be [N, d] with a contiguous last dimension and weight [d], got {tuple(x.shape)}, {tuple(weight.shape)}")
    N, d = x.shape
    if out is None:
        out = torch.empty_like(x)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError("add_rms_norm: out must be [N, d] with a contiguous last dimension")
    if residual is None:
        new_res = x
    else:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError("add_rms_norm: residual must be [N, d] like x, with a contiguous last dimension")
        new_res = torch.empty_like(x)
    block = triton.next_power_of_2(d)
    # About 8 elements a thread: 8 warps for a 2048-wide row.
    warps = min(16, max(1, block // 256))
    has_res = residual is not None
    use_pdl = pdl(x.device, __name__)
    _add_rms_norm_kernel[(N,)](
        x, residual if has_res else x, weight, out, new_res,
        d, eps,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0), new_res.stride(0),
        HAS_RES=has_res, BLOCK=block, PDL=use_pdl, num_warps=warps, launch_pdl=use_pdl,
    )
    return out, new_res
