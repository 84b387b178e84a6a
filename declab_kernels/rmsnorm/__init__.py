"""RMSNorm, optionally fused with the residual add before it (the decoder layer's `x = x + f(h);
h = norm(x)` in one kernel).

x, residual `[N, d]` in the model dtype, weight `[d]`; the normalisation runs in float32 and the
outputs are in x's dtype. `impl` is "triton" or "ref" (already resolved by `declab_kernels.resolve_impl`).

- `add_rms_norm(x, residual, weight, eps, *, impl, out=None) -> (normed, new_residual)`
- `rms_norm(x, weight, eps, *, impl, out=None) -> normed`
"""

from declab_kernels import check_impl
from declab_kernels.rmsnorm.ref import add_rms_norm_ref

__all__ = ["add_rms_norm", "rms_norm", "add_rms_norm_ref"]


def add_rms_norm(x, residual, weight, eps, *, impl, out=None):
    """new_residual = x + residual (x itself when residual is None); normed = RMSNorm(new_residual).

    Returns (normed, new_residual), both `[N, d]` in x's dtype; normed is written into `out` when
    given. Neither input is modified.
    """
    check_impl(impl)
    if impl == "ref":
        normed, new_res = add_rms_norm_ref(x, residual, weight, eps)
        if out is None:
            return normed, new_res
        out.copy_(normed)
        return out, new_res
    from declab_kernels.rmsnorm.triton import add_rms_norm_triton

    return add_rms_norm_triton(x, residual, weight, eps, out=out)


def rms_norm(x, weight, eps, *, impl, out=None):
    """RMSNorm of x `[N, d]` (float32 math, output in x's dtype)."""
    return add_rms_norm(x, None, weight, eps, impl=impl, out=out)[0]
