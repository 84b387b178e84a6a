"""SwiGLU activation silu(gate) * up: the PyTorch reference, in float32 with the model's rounding."""

import torch.nn.functional as F


def silu_mul_ref(gate_up):
    """gate_up `[N, 2I]` (gate then up, one fused projection) -> `[N, I]` in its dtype.

    1. s = silu(gate) in float32, rounded to the dtype (as `F.silu` on a bf16 tensor);
    2. out = s * up, the float32 product rounded to the dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    s = F.silu(gate.float()).to(gate_up.dtype)
    return (s.float() * up.float()).to(gate_up.dtype)
