"""Tests for declab_kernels/mamba2_norm: the reference equals declab_arch.mamba2's norm modules, and triton equals ref
on odd sizes, strided inputs and NaN-poisoned outputs (the interpreter on the CPU)."""

import pytest
import torch

from declab_arch.mamba2 import RMSNorm, RMSNormGated
from declab_kernels import mamba2_norm
from declab_kernels.mamba2_norm import ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def rel(a, b):
    """Relative RMS error ||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rnd(*shape, seed, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV, dtype)


def strided(B, D, seed, dtype):
    """A [B, D] view of columns 3..3+D of a wider [B, D + 8] tensor, like a slice of the in-projection."""
    return rnd(B, D + 8, seed=seed, dtype=dtype)[:, 3 : 3 + D]


def test_ref_equals_the_model_modules():
    r = rnd(3, 37, seed=0) * 4
    x = rnd(3, 37, seed=1, dtype=torch.bfloat16)
    norm = RMSNorm(37, 1e-5, weight_dtype_out=True).to(DEV)
    norm.weight.data = rnd(37, seed=2)
    h, r_new = ref.add_rmsnorm(x, r, norm.weight, norm.eps)
    assert torch.equal(r_new, r + x) and torch.equal(h, norm(r + x))
    gated = RMSNormGated(39, 13, 1e-5).to(DEV)
    gated.weight.data = rnd(39, seed=3)
    y, z = rnd(3, 39, seed=4), rnd(3, 39, seed=5)
    # The module's F.rms_norm is one fused kernel on a GPU, summing in another order: a few ulp apart.
    torch.testing.assert_close(ref.gated_rmsnorm(y, z, gated.weight, 13, gated.eps), gated(y, z), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D", [(1, 37), (3, 200), (2, 64)])
def test_triton_add_rmsnorm_matches_ref(B, D, dtype, nan_empty):
    x = strided(B, D, seed=D, dtype=dtype)
    residual = rnd(B, D, seed=D + 1, scale=3.0)
    weight = rnd(D, seed=D + 2, dtype=dtype)
    h, r = mamba2_norm.add_rmsnorm(x, residual, weight, 1e-5, impl="triton")
    h_ref, r_ref = mamba2_norm.add_rmsnorm(x, residual, weight, 1e-5, impl="ref")
    assert h.dtype == h_ref.dtype == dtype and r.dtype == torch.float32
    assert not torch.isnan(h).any() and not torch.isnan(r).any()
    assert rel(r, r_ref) < 1e-6
    assert rel(h, h_ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_embed_rmsnorm_matches_ref(dtype, nan_empty):
    table = rnd(50, 37, seed=7, dtype=dtype)
    weight = rnd(37, seed=8, dtype=dtype)
    tokens = torch.tensor([4, 49, 0, 4], device=DEV)
    h, r = mamba2_norm.embed_rmsnorm(tokens, table, weight, 1e-5, impl="triton")
    h_ref, r_ref = mamba2_norm.embed_rmsnorm(tokens, table, weight, 1e-5, impl="ref")
    assert not torch.isnan(h).any() and not torch.isnan(r).any()
    assert torch.equal(r, r_ref)
    assert rel(h, h_ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_triton_embed_rmsnorm_reads_tokens_through_their_stride(nan_empty):
    """The token ids as speculative verification's decode steps pass them (`speculative.verify_steps`):
    column j of the fed tokens [B, T], a view with stride T. Read as contiguous, row b got the token at
    flat index b, row 0's own draft, and Mamba-2's "steps" verification diverged on every row but the first."""
    table = rnd(50, 37, seed=9)
    weight = rnd(37, seed=10)
    fed = torch.tensor([[4, 11, 12, 13, 14], [49, 21, 22, 23, 24], [0, 31, 32, 33, 34]], device=DEV)
    for j in range(fed.shape[1]):
        tokens = fed[:, j]
        assert tokens.stride(0) == fed.shape[1]
        h, r = mamba2_norm.embed_rmsnorm(tokens, table, weight, 1e-5, impl="triton")
        h_ref, r_ref = mamba2_norm.embed_rmsnorm(tokens, table, weight, 1e-5, impl="ref")
        assert torch.equal(r, table[tokens]) and torch.equal(r, r_ref)
        assert rel(h, h_ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,D,group", [(1, 40, 40), (3, 39, 13), (2, 96, 24)])
def test_triton_gated_rmsnorm_matches_ref(B, D, group, dtype, nan_empty):
    y = rnd(B, D, seed=D, dtype=dtype)
    z = strided(B, D, seed=D + 1, dtype=dtype)
    weight = rnd(D, seed=D + 2, dtype=dtype)
    out = mamba2_norm.gated_rmsnorm(y, z, weight, group, 1e-5, impl="triton")
    expected = mamba2_norm.gated_rmsnorm(y, z, weight, group, 1e-5, impl="ref")
    assert out.dtype == expected.dtype == dtype and not torch.isnan(out).any()
    assert rel(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_triton_rejects_mismatched_shapes():
    y = rnd(2, 39, seed=0)
    with pytest.raises(ValueError, match="shape mismatch"):
        mamba2_norm.gated_rmsnorm(y, y, rnd(39, seed=1), 10, 1e-5, impl="triton")
    with pytest.raises(ValueError, match="shape mismatch"):
        mamba2_norm.add_rmsnorm(y, rnd(2, 38, seed=2), rnd(39, seed=1), 1e-5, impl="triton")


def test_impl_must_be_resolved():
    y = rnd(2, 8, seed=0)
    with pytest.raises(ValueError):
        mamba2_norm.gated_rmsnorm(y, y, rnd(8, seed=1), 8, 1e-5, impl="auto")
