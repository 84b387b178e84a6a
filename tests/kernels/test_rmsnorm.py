"""Fused residual add + RMSNorm: Triton vs the float32 reference, on odd sizes, outputs NaN-poisoned."""

import pytest
import torch

from declab_kernels.rmsnorm import add_rms_norm, add_rms_norm_ref, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


@pytest.mark.parametrize("N,d", [(1, 64), (3, 37), (5, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_triton_matches_ref(N, d, with_residual):
    g = torch.Generator(device=DEVICE).manual_seed(N * d)
    x = torch.randn(N, d, generator=g, device=DEVICE)
    res = torch.randn(N, d, generator=g, device=DEVICE) if with_residual else None
    w = torch.randn(d, generator=g, device=DEVICE)
    out = torch.full((N, d), float("nan"), device=DEVICE)
    want, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    got, got_res = add_rms_norm(x, res, w, 1e-5, impl="triton", out=out)
    assert got is out
    assert rel(got, want) < 1e-5
    assert rel(got_res, want_res) < 1e-6
    if not with_residual:
        assert got_res is x


def test_ref_is_hf_llama_rmsnorm_after_the_add():
    x, res, w = torch.randn(4, 48), torch.randn(4, 48), torch.randn(48)
    r = x + res
    want = w * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6))
    got, new_res = add_rms_norm(x, res, w, 1e-6, impl="ref")
    torch.testing.assert_close(new_res, r)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(rms_norm(r, w, 1e-6, impl="ref"), want)


def test_strided_rows_and_inputs_untouched():
    base = torch.randn(3, 80, device=DEVICE)
    x = base[:, :50]  # row stride 80
    res = torch.randn(3, 50, device=DEVICE)
    w = torch.randn(50, device=DEVICE)
    x0, res0 = x.clone(), res.clone()
    got, got_res = add_rms_norm(x, res, w, 1e-5, impl="triton")
    want, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    assert rel(got, want) < 1e-5 and rel(got_res, want_res) < 1e-6
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.gpu
def test_bf16_rounding_matches_ref_on_gpu():
    x, res = torch.randn(2, 7, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    got, got_res = add_rms_norm(x, res, w, 1e-5, impl="triton")
    want, want_res = add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(got_res, want_res)
    assert rel(got, want) < 1e-2
