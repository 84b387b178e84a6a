"""Rotary position embedding (RoPE, HF's rotate-half convention): the PyTorch reference in float32."""

import torch


def rotate_ref(x, positions, cos, sin):
    """x `[N, H, D]` at positions `[N]`, tables cos and sin `[P, D/2]` float32 -> `[N, H, D]` in x's dtype.

    With x = [x1, x2] (the two halves of the head dimension) and angle a = positions * inv_freq:
    [x1 cos a - x2 sin a, x2 cos a + x1 sin a].
    """
    c = cos[positions].unsqueeze(-2)  # [N, 1, D/2]
    s = sin[positions].unsqueeze(-2)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def apply_rotary_ref(q, k, positions, cos, sin):
    """RoPE on q `[N, Hq, D]` and k `[N, Hkv, D]`; returns new (q, k)."""
    return rotate_ref(q, positions, cos, sin), rotate_ref(k, positions, cos, sin)
