"""Greedy decoding's argmax over rows of logits (the rule, NaN included, is in ref.py's docstring).

The public function takes `impl` "triton" | "ref" (already resolved by `kernels.resolve_impl`); there
is no fallback from one to the other.
"""

from kernels import check_impl
from kernels.argmax.ref import argmax_ref

__all__ = ["argmax", "argmax_ref"]


def argmax(x, *, impl):
    """x `[B, V]` (bf16, fp16 or fp32; unit last stride, any row stride) -> int64 `[B]`: the first index
    of each row's maximum, exactly `x.argmax(-1)`. The Triton kernels launch without PDL."""
    check_impl(impl)
    if impl == "ref":
        return argmax_ref(x)
    from kernels.argmax.triton import argmax_triton

    return argmax_triton(x)
