"""WKV-7 (RWKV-7 time mixing): chunked prefill and one-token decode step.

    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,    o_t = scale * S_t^T r_t

Layouts follow flash-linear-attention's `chunk_rwkv7`: r, w (log-decay), k, a, b `[B, T, H, K]`,
v `[B, T, H, V]`, state `[B, H, K, V]` float32. `impl` is "triton" or "ref" (already resolved by
`declab_kernels.resolve_impl`); there is no fallback from one to the other. `wkv7_chunk(impl="ref")` is the
literal chunked reference; `wkv7_chunk_factored` (no impl) is the same math, differentiable and
memory-light, which the models' reference path (training included) runs.
"""

from declab_kernels import check_impl
from declab_kernels.wkv7.ref import wkv7_chunk_factored, wkv7_chunk_ref, wkv7_recurrent_ref, wkv7_step_ref

# Default chunk of the prefill. 32 rather than 16: pass 2's sequential chain costs about the same per
# chunk at either size (its dots are latency-bound), so halving the chunk count nearly halves it,
# while pass 1 (parallel over chunks) grows by less than that saves.
CHUNK = 32

__all__ = ["CHUNK", "wkv7_chunk", "wkv7_step", "wkv7_chunk_factored", "wkv7_chunk_ref", "wkv7_recurrent_ref",
           "wkv7_step_ref"]


def wkv7_chunk(r, w, k, v, a, b, *, scale=1.0, initial_state=None, chunk_size=CHUNK, impl):
    """Prefill over T tokens from `initial_state` (zeros when None).

    Returns (o `[B, T, H, V]` in r's dtype, final state `[B, H, K, V]` float32). Any T; calling
    on [0:t] then [t:T] with the state handed over equals one call on [0:T].
    """
    check_impl(impl)
    if impl == "ref":
        return wkv7_chunk_ref(r, w, k, v, a, b, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    from declab_kernels.wkv7.triton import wkv7_chunk_triton

    return wkv7_chunk_triton(r, w, k, v, a, b, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


def wkv7_step(r, w, k, v, a, b, state, *, scale=1.0, impl, out=None, state_ready=False):
    """One token: r, w, k, a, b `[B, H, K]`, v `[B, H, V]`; `state` `[B, H, K, V]` float32 is
    updated in place. Returns o `[B, H, V]` in r's dtype (written into `out` when given; the
    Triton path then allocates nothing and can be captured in a CUDA graph). `state_ready`
    (Triton, see triton.wkv7_step_triton): the state was last written before a kernel launched
    without PDL."""
    check_impl(impl)
    if impl == "ref":
        o = wkv7_step_ref(r, w, k, v, a, b, state, scale=scale)
        if out is None:
            return o
        out.copy_(o)
        return out
    from declab_kernels.wkv7.triton import wkv7_step_triton

    return wkv7_step_triton(r, w, k, v, a, b, state, scale=scale, out=out, state_ready=state_ready)
