"""The lab's quantised weight objects (`declab_arch.quant`) through `declab_kernels.gemv.linear` with
every fusion: the same result as the dense path on their dequantised weights (the reference kernels on
the CPU, float32), one product call each."""

import pytest
import torch

from declab_arch import quant
from declab_kernels.gemv import fusions as fu
from declab_kernels.gemv import linear

M, N, K = 3, 48, 64


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def specs(name, g):
    residual = torch.randn(M, N, generator=g)
    norm_n, norm_k = torch.rand(N, generator=g) + 0.5, torch.rand(K, generator=g) + 0.5
    return {
        "plain": (None, None),
        "rms_norm+swiglu": (fu.RMSNorm(norm_k, 1e-5), fu.SwiGLU()),
        "gated_rms_norm": (fu.GatedRMSNorm(torch.randn(M, K, generator=g), norm_k, 1e-5, K), None),
        "rms_scale+residual_norm": (fu.RMSScale(torch.rand(M, 4, generator=g) * K, 1e-5), fu.ResidualNorm(residual, norm_n)),
        "sqrelu+residual": (fu.SqReLU(), fu.Residual(residual)),
        "add_rms_norm": (None, fu.AddRMSNorm(residual, norm_n, 1e-5)),
    }[name]


@pytest.mark.parametrize("fmt", ["int8", "int4-rtn-g32"])
@pytest.mark.parametrize("name", ["plain", "rms_norm+swiglu", "gated_rms_norm", "rms_scale+residual_norm", "sqrelu+residual",
                                  "add_rms_norm"])
def test_quantised_weight_through_linear_equals_its_dequantised_weight(fmt, name):
    g = torch.Generator().manual_seed(7)
    dense = torch.randn(N, K, generator=g) * K ** -0.5
    w = quant.quantize_int8(dense) if fmt == "int8" else quant.quantize_int4_rtn(dense, 32)
    assert w.format.startswith(fmt.split("-")[0]) and tuple(w.shape) == (N, K)
    x, b = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    pre, post = specs(name, g)
    got = linear(x, w, b, pre=pre, post=post, impl="ref")
    want = linear(x, w.dequantize(), b, pre=pre, post=post, impl="ref")
    for a, c in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
        assert a.shape == c.shape and rel(a, c) < 1e-4
