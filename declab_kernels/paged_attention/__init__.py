"""Paged attention: write new K/V into a paged cache, decode one query per sequence, prefill varlen.

Cache layout: `k_cache`, `v_cache` `[num_blocks, block_size, Hkv, D]`, `block_tables` `[B, max_blocks]`
int32, `slot_mapping` `[N]` int64 (`block_id * block_size + offset`), `seq_lens` `[B]` int32 (valid
positions after this call's tokens were written). Every function takes `impl="triton"|"ref"`,
already resolved by `declab_kernels.resolve_impl`; anything else is an error.

The caches may be float8_e4m3fn: then every call takes `scales=(k_scale, v_scale)`, int8
`[num_blocks, block_size, Hkv]`, the power-of-two exponent of each stored row (`ref.quantize`);
writes quantize each row, reads dequantize it in registers. Other caches take `scales=None`.

- `write_kv(k, v, k_cache, v_cache, slot_mapping, *, impl, scales=None)`
- `decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, device, *, num_splits=None,
  variant="split")`
- `paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *, impl, out=None, workspace=None,
  rope=None, scales=None)`
- `paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, *, causal, impl,
  max_seqlen_q=None, scales=None)`
"""

from declab_kernels import check_impl

from . import ref
from .ref import FP8, dequantize, quantize

__all__ = ["write_kv", "decode_workspace", "paged_decode_attention", "paged_prefill_attention", "FP8", "quantize", "dequantize"]


def _triton():
    from . import triton as tri

    return tri


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, impl, scales=None):
    """Scatter k, v `[N, Hkv, D]` into the caches (in place) at `slot_mapping`; slots < 0 are skipped."""
    check_impl(impl)
    if impl == "ref":
        ref.write_kv(k, v, k_cache, v_cache, slot_mapping, scales)
    else:
        _triton().write_kv(k, v, k_cache, v_cache, slot_mapping, scales=scales)


def decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, device, *, num_splits=None,
                     variant="split"):
    """Preallocated split-K buffers for Triton decode of up to `batch` sequences of <= `max_seq_len`.

    Allocate once (per batch bucket) and pass as `workspace=` so decode allocates nothing and can be
    captured in a CUDA graph. The split count is fixed here from host integers (batch, Hkv,
    max_seq_len, SM count) unless `num_splits` is given. `variant` picks the decode kernel's
    tiling and merge (`"split"`, the default; `"long"` for batch-1 latency, see
    README.md) for every call made with this workspace.
    """
    return _triton().decode_workspace(batch, num_q_heads, num_kv_heads, head_dim, max_seq_len, device,
                                      num_splits=num_splits, variant=variant)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *, impl, out=None, workspace=None,
                           rope=None, scales=None):
    """Attention of q `[B, Hq, D]` (position seq_lens-1) over each sequence's seq_lens cached positions.

    Returns `[B, Hq, D]` in q's dtype, written into `out` when given. Hq must be a multiple of Hkv.
    A sequence with seq_len 0 gets a zero output. `workspace` (from `decode_workspace`) is used by
    the Triton implementation only. `rope=(k, v, cos, sin)` folds in the step before: q and the
    step's k `[B, Hkv, D]` arrive unrotated, and the call rotates both at position seq_len - 1 (RoPE
    tables `[P, D/2]` float32, as `declab_kernels.rotary`) and writes the rotated k and v into the cache at
    that position before attending (q itself is left as it was). The Triton kernel does it in the
    same launch. `scales`: the exponents of an fp8 cache (module docstring).
    """
    check_impl(impl)
    if impl == "ref":
        ref.check_scales(k_cache, v_cache, scales)
        if rope is not None:
            q = ref.rope_write(q, *rope, k_cache, v_cache, block_tables, seq_lens, scales)
        result = ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, scales)
        if out is None:
            return result
        out.copy_(result)
        return out
    return _triton().paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                            out=out, workspace=workspace, rope=rope, scales=scales)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, *, causal, impl,
                            max_seqlen_q=None, scales=None):
    """Varlen attention of packed queries q `[total_q, Hq, D]` over the paged cache.

    Sequence b's queries `q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]` are its last q_len_b positions
    (absolute position seq_lens[b] - q_len_b + i); their K/V must already be written. causal=True
    attends to kv positions <= the query's own, causal=False to all seq_lens[b] positions.
    `max_seqlen_q` (host int) sizes the Triton grid; None reads it from `cu_seqlens_q` (a host sync).
    """
    check_impl(impl)
    if impl == "ref":
        ref.check_scales(k_cache, v_cache, scales)
        return ref.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, causal, scales)
    return _triton().paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                             causal=causal, max_seqlen_q=max_seqlen_q, scales=scales)
