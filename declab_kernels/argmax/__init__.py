"""Greedy decoding's argmax over rows of logits (the rule, NaN included, is in ref.py's docstring).

The public function takes `impl` "triton" | "ref" (already resolved by `declab_kernels.resolve_impl`); there
is no fallback from one to the other.
"""

from declab_kernels import check_impl
from declab_kernels.argmax.ref import argmax_ref

__all__ = ["argmax", "argmax_ref"]


def argmax(x, *, impl, out=None, advance=None):
    """x `[B, V]` (bf16, fp16 or fp32; unit last stride, any row stride) -> int64 `[B]`: the first index
    of each row's maximum, exactly `x.argmax(-1)`, written into `out` (contiguous int64 `[B]`) when
    given. `advance` (contiguous int64 `[B]`, e.g. a decoder's positions) gets 1 added to every row after
    the argmax is taken: on the Triton path inside its last kernel, which saves a step's launch. The
    Triton kernels launch without PDL."""
    check_impl(impl)
    if impl == "ref":
        result = argmax_ref(x)
        if out is not None:
            result = out.copy_(result)
        if advance is not None:
            advance.add_(1)
        return result
    from declab_kernels.argmax.triton import argmax_triton

    return argmax_triton(x, out=out, advance=advance)
