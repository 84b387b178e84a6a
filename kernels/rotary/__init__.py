"""Rotary position embedding on q and k in one call (HF's rotate-half convention).

q `[N, Hq, D]`, k `[N, Hkv, D]` (any strides with a contiguous last dimension, e.g. views into one
fused q/k/v projection), positions `[N]` integer, cos and sin `[P, D/2]` float32 (the angle
positions * inv_freq). The rotation runs in float32; outputs are in the inputs' dtype. `impl` is
"triton" or "ref" (already resolved by `kernels.resolve_impl`).

- `apply_rotary(q, k, positions, cos, sin, *, impl, inplace=False) -> (q_rot, k_rot)`
"""

from kernels import check_impl
from kernels.rotary.ref import apply_rotary_ref, rotate_ref

__all__ = ["apply_rotary", "apply_rotary_ref", "rotate_ref"]


def apply_rotary(q, k, positions, cos, sin, *, impl, inplace=False):
    """RoPE on q and k at `positions`; returns (q_rot, k_rot), written into q and k when `inplace`."""
    check_impl(impl)
    if impl == "ref":
        q_rot, k_rot = apply_rotary_ref(q, k, positions, cos, sin)
        if not inplace:
            return q_rot, k_rot
        q.copy_(q_rot)
        k.copy_(k_rot)
        return q, k
    from kernels.rotary.triton import apply_rotary_triton

    return apply_rotary_triton(q, k, positions, cos, sin, inplace=inplace)
