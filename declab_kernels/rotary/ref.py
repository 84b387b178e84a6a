"""Rotary position embedding (RoPE, HF's rotate-half convention): the PyTorch reference in float32.

The rotation itself, `rotate_ref`, is written once in `declab_kernels.paged_attention.ref`, whose
RoPE-fused decode specifies it too: this folder writes into the paged caches, so it builds on
paged_attention and never the reverse.
"""

from declab_kernels.paged_attention.ref import rotate_ref


def apply_rotary_ref(q, k, positions, cos, sin):
    """RoPE on q `[N, Hq, D]` and k `[N, Hkv, D]`; returns new (q, k)."""
    return rotate_ref(q, positions, cos, sin), rotate_ref(k, positions, cos, sin)
