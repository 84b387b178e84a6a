"""Rotary position embedding on q and k in one call (HF's rotate-half convention).

q `[N, Hq, D]`, k `[N, Hkv, D]` (any strides with a contiguous last dimension, e.g. views into one
fused q/k/v projection), positions `[N]` integer, cos and sin `[P, D/2]` float32 (the angle
positions * inv_freq). The rotation runs in float32; outputs are in the inputs' dtype. `impl` is
"triton" or "ref" (already resolved by `declab_kernels.resolve_impl`).

- `apply_rotary(q, k, positions, cos, sin, *, impl, inplace=False) -> (q_rot, k_rot)`
- `apply_rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, impl, scales=None)
  -> (q, k)`: q and k rotated in place, and the rotated k and v `[N, Hkv, D]` written into the
  paged caches `[num_blocks, block_size, Hkv, D]` at flat slots `slot_mapping` `[N]` (slot s is
  page s // block_size, row s % block_size; negative slots are skipped), as
  `declab_kernels.paged_attention.write_kv` does (fp8 caches with their `scales` included): one
  launch for RoPE and the cache write.
"""

from declab_kernels import check_impl
from declab_kernels.paged_attention.ref import write_kv as write_kv_ref
from declab_kernels.rotary.ref import apply_rotary_ref, rotate_ref

__all__ = ["apply_rotary", "apply_rotary_ref", "apply_rotary_write_kv", "rotate_ref"]


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
    from declab_kernels.rotary.triton import apply_rotary_triton

    return apply_rotary_triton(q, k, positions, cos, sin, inplace=inplace)


def apply_rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *, impl, scales=None):
    """RoPE on q and k in place, then the rotated k and v into the paged caches; returns (q, k)."""
    check_impl(impl)
    if impl == "ref":
        apply_rotary(q, k, positions, cos, sin, impl="ref", inplace=True)
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, scales)
        return q, k
    from declab_kernels.rotary.triton import apply_rotary_write_kv_triton

    return apply_rotary_write_kv_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, scales=scales)
