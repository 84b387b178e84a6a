"""RoPE on q and k in one kernel: Triton vs the float32 reference on odd sizes, strided views, in place."""

import pytest
import torch

from arch.llama import LlamaConfig, Rotary
from kernels.rotary import apply_rotary, apply_rotary_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


def tables(P, D, device=DEVICE):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))
    angles = torch.outer(torch.arange(P, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("N,Hq,Hkv,D", [(1, 4, 2, 16), (5, 3, 1, 10), (7, 6, 3, 34)])
def test_rotary_triton_matches_ref(N, Hq, Hkv, D):
    g = torch.Generator(device=DEVICE).manual_seed(N + D)
    q = torch.randn(N, Hq, D, generator=g, device=DEVICE)
    k = torch.randn(N, Hkv, D, generator=g, device=DEVICE)
    positions = torch.randint(0, 100, (N,), generator=g, device=DEVICE)
    cos, sin = tables(100, D)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)
    got_q, got_k = apply_rotary(q, k, positions, cos, sin, impl="triton")
    assert rel(got_q, want_q) < 1e-6 and rel(got_k, want_k) < 1e-6


def test_in_place_on_views_of_one_fused_projection():
    N, Hq, Hkv, D = 3, 4, 2, 12
    qkv = torch.full((N, Hq + 2 * Hkv, D), float("nan"), device=DEVICE)
    qkv.copy_(torch.randn(N, Hq + 2 * Hkv, D, device=DEVICE))
    v_before = qkv[:, Hq + Hkv :].clone()
    q, k, _ = qkv.split([Hq, Hkv, Hkv], dim=1)
    positions = torch.tensor([0, 9, 40], device=DEVICE)
    cos, sin = tables(64, D)
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)
    got_q, got_k = apply_rotary(q, k, positions, cos, sin, impl="triton", inplace=True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert rel(q, want_q) < 1e-6 and rel(k, want_k) < 1e-6
    # The kernel writes only the q and k heads.
    assert torch.equal(qkv[:, Hq + Hkv :], v_before)


def test_ref_matches_the_models_rotary():
    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=64)
    rope = Rotary(config)
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    positions = torch.tensor([0, 3, 7, 20, 63])
    cos, sin = rope.tables()
    got_q, got_k = apply_rotary(q, k, positions, cos, sin, impl="ref")
    torch.testing.assert_close(got_q, rope(q, positions))
    torch.testing.assert_close(got_k, rope(k, positions))
