"""RoPE on q and k in one kernel: Triton vs the float32 reference on odd sizes, strided views, in place."""

import pytest
import torch

from declab_arch.llama import LlamaConfig, Rotary
from declab_kernels.paged_attention.ref import write_kv
from declab_kernels.rotary import apply_rotary, apply_rotary_ref, apply_rotary_write_kv

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


@pytest.mark.parametrize("N,Hq,Hkv,D,page", [(1, 4, 2, 16, 4), (6, 3, 1, 10, 2), (5, 8, 8, 64, 16)])
@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_rotary_write_kv_equals_rotary_then_cache_write(N, Hq, Hkv, D, page, impl):
    """In place on views of one fused projection: q and k rotated as apply_rotary does, the caches
    holding what write_kv of the rotated k and of v writes, a negative slot skipped, nothing else
    touched (cache rows never written stay NaN, the v heads unchanged)."""
    g = torch.Generator(device=DEVICE).manual_seed(N * D + page)
    qkv = torch.randn(N, Hq + 2 * Hkv, D, generator=g, device=DEVICE)
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
    positions = torch.randint(0, 50, (N,), generator=g, device=DEVICE)
    cos, sin = tables(64, D)
    slots = torch.randperm(4 * page, generator=g, device=DEVICE)[:N]
    if N > 1:
        slots[N // 2] = -1
    want_q, want_k = apply_rotary_ref(q, k, positions, cos, sin)
    want_kc, want_vc = (torch.full((4, page, Hkv, D), float("nan"), device=DEVICE) for _ in range(2))
    write_kv(want_k, v, want_kc, want_vc, slots)
    v_before = v.clone()
    k_cache, v_cache = (torch.full((4, page, Hkv, D), float("nan"), device=DEVICE) for _ in range(2))
    got_q, got_k = apply_rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots, impl=impl)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert rel(q, want_q) < 1e-6 and rel(k, want_k) < 1e-6 and torch.equal(v, v_before)
    written = want_kc.isfinite()
    assert torch.equal(k_cache.isfinite(), written) and torch.equal(v_cache.isfinite(), written)
    assert rel(k_cache[written], want_kc[written]) < 1e-6 and torch.equal(v_cache[written], want_vc[written])


def test_rotary_write_kv_refuses_mismatched_caches():
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    cos, sin = tables(8, 8, device="cpu")
    with pytest.raises(ValueError, match="caches"):
        apply_rotary_write_kv(q, k, v, torch.tensor([0, 1]), cos, sin, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8),
                              torch.tensor([0, 1]), impl="triton")


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
