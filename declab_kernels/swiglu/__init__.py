"""SwiGLU activation: silu(gate) * up, reading gate and up from one fused projection `[N, 2I]`
(gate in the first half, up in the second) and writing `[N, I]` in its dtype. `impl` is "triton"
or "ref" (already resolved by `declab_kernels.resolve_impl`).

- `silu_mul(gate_up, *, impl, out=None) -> [N, I]`
"""

from declab_kernels import check_impl
from declab_kernels.swiglu.ref import silu_mul_ref

__all__ = ["silu_mul", "silu_mul_ref"]


def silu_mul(gate_up, *, impl, out=None):
    """silu(gate) * up of gate_up `[N, 2I]`; written into `out` `[N, I]` when given."""
    check_impl(impl)
    if impl == "ref":
        result = silu_mul_ref(gate_up)
        if out is None:
            return result
        out.copy_(result)
        return out
    from declab_kernels.swiglu.triton import silu_mul_triton

    return silu_mul_triton(gate_up, out=out)
