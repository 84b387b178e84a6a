"""Small-batch matrix-vector product x @ weight.T: the PyTorch reference, in float32."""

import torch


def gemv_ref(x, weight, bias=None):
    """x `[M, K]` or `[G, M, K]`, weight `[N, K]` or `[G, N, K]`, bias `[N]` / `[G, N]` or None
    -> `[M, N]` / `[G, M, N]` in x's dtype.

    out = x @ weight^T (+ bias), every product and sum in float32, rounded once to x's dtype.
    """
    y = torch.matmul(x.float(), weight.float().transpose(-1, -2))
    if bias is not None:
        y = y + bias.float().unsqueeze(-2)
    return y.to(x.dtype)
