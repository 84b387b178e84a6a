"""Norms of the Mamba-2 decode step, each one launch on the Triton path: embedding + pre-norm, residual
add + pre-norm (residual kept in float32), and the gated group RMSNorm.

Each public function takes `impl="triton"|"ref"` (already resolved by `declab_kernels.resolve_impl`);
semantics in ref.py, layouts and bytes in README.md.
"""

from declab_kernels import check_impl
from declab_kernels.mamba2_norm import ref

__all__ = ["embed_rmsnorm", "add_rmsnorm", "gated_rmsnorm"]


def _module(impl):
    check_impl(impl)
    if impl == "ref":
        return ref
    from declab_kernels.mamba2_norm import triton as tri

    return tri


def embed_rmsnorm(tokens, table, weight, eps, *, impl):
    """tokens `[B]`, table `[V, D]` -> (weight * rmsnorm(r) `[B, D]`, r = table[tokens] `[B, D]` fp32)."""
    return _module(impl).embed_rmsnorm(tokens, table, weight, eps)


def add_rmsnorm(x, residual, weight, eps, *, impl):
    """x `[B, D]`, residual `[B, D]` fp32 -> (weight * rmsnorm(r) `[B, D]`, r = residual + x `[B, D]` fp32)."""
    return _module(impl).add_rmsnorm(x, residual, weight, eps)


def gated_rmsnorm(y, z, weight, group_size, eps, *, impl):
    """y, z `[B, D]` -> weight * rmsnorm(y * silu(z)) over groups of `group_size` channels, `[B, D]`."""
    return _module(impl).gated_rmsnorm(y, z, weight, group_size, eps)
