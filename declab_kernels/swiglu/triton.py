"""SwiGLU activation in Triton: silu(gate) * up from one fused gate/up projection, one elementwise pass.

PDL (constexpr, see `declab_kernels.pdl`): gdc_wait() first (everything it reads is an activation).
"""

import torch
import triton
import triton.language as tl

from declab_kernels import pdl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the model dtype before the product, as F.silu(gate) * up rounds it.
    s = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate_up, *, out=None):
    """See `declab_kernels.swiglu.silu_mul`."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [N, 2I] with a contiguous last dimension, got {tuple(gate_up.shape)}")
    N, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != (N, I) or out.stride(-1) != 1:
        raise ValueError("silu_mul: out must be [N, I] with a contiguous last dimension")
    if N:
        use_pdl = pdl(gate_up.device, __name__)
        _silu_mul_kernel[(N, triton.cdiv(I, BLOCK))](gate_up, out, I, gate_up.stride(0), out.stride(0), BLOCK=BLOCK,
                                                     PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    return out
