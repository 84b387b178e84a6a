"""SwiGLU activation from a fused gate/up projection: Triton vs the float32 reference, NaN-poisoned output."""

import pytest
import torch
import torch.nn.functional as F

from declab_kernels.swiglu import silu_mul, silu_mul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("N,I", [(1, 7), (3, 1030), (4, 176)])
def test_silu_mul_triton_matches_ref(N, I):
    gate_up = torch.randn(N, 2 * I, device=DEVICE)
    out = torch.full((N, I), float("nan"), device=DEVICE)
    got = silu_mul(gate_up, impl="triton", out=out)
    assert got is out
    want = silu_mul_ref(gate_up)
    assert ((got - want).norm() / want.norm()).item() < 1e-6


def test_ref_is_silu_of_gate_times_up():
    gate, up = torch.randn(3, 9), torch.randn(3, 9)
    torch.testing.assert_close(silu_mul(torch.cat([gate, up], dim=1), impl="ref"), F.silu(gate) * up)
