"""Reference (plain PyTorch) of the norms around a Mamba-2 decode step; the Triton kernels must match it.

Three ops, each the exact arithmetic of `declab_arch.mamba2`'s modules (float32 inside; the result rounded to
the weight's / y's dtype before the weight multiplies it, as the modules do):

- `embed_rmsnorm`: the first block's pre-norm of the embedding rows, r = table[tokens] in float32;
- `add_rmsnorm`: the residual add r = residual + x in float32 and the next pre-norm (or the final norm)
  of r, as mamba-ssm's `layer_norm_fn(..., residual_in_fp32=True, prenorm=True)`;
- `gated_rmsnorm`: rmsnorm(y * silu(z)) over groups of channels, as mamba-ssm's `RMSNormGated` with
  `norm_before_gate=False`.
"""

import torch
import torch.nn.functional as F


def rmsnorm(r, weight, eps):
    """r [B, D] float32 -> weight * (r / rms(r)) in the weight's dtype."""
    h = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(weight.dtype)


def embed_rmsnorm(tokens, table, weight, eps):
    """tokens [B] -> (normed [B, D] in weight's dtype, residual r [B, D] float32) with r = table[tokens]."""
    r = F.embedding(tokens, table).float()
    return rmsnorm(r, weight, eps), r


def add_rmsnorm(x, residual, weight, eps):
    """x [B, D] any float, residual [B, D] float32 -> (normed [B, D], r [B, D] float32) with r = residual + x."""
    r = residual + x.float()
    return rmsnorm(r, weight, eps), r


def gated_rmsnorm(y, z, weight, group_size, eps):
    """y, z [B, D] -> weight * rmsnorm(y * silu(z)) per group of `group_size` channels, [B, D] in
    promote(weight, y) dtype; the normalised value is rounded to y's dtype first."""
    h = y.float() * F.silu(z.float())
    h = h.unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.flatten(-2).to(y.dtype)
