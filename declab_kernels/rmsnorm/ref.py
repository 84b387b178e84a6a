"""RMSNorm after an optional residual add: the PyTorch reference, in float32 with HF Llama's rounding."""

import torch


def add_rms_norm_ref(x, residual, weight, eps):
    """x `[N, d]`, residual `[N, d]` or None, weight `[d]` -> (normed `[N, d]`, new residual `[N, d]`).

    1. r = x + residual, rounded to x's dtype (the residual stream lives in the model dtype);
       without a residual r is x itself;
    2. h = r / sqrt(mean(r^2) + eps) in float32, rounded to x's dtype (as HF's LlamaRMSNorm);
    3. normed = weight * h, the float32 product rounded to x's dtype.
    """
    r = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    rf = r.float()
    h = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * h.float()).to(x.dtype), r
