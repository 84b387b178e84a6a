"""RWKV-7 fused decode-step kernels: Triton vs the float32 reference on odd sizes, outputs and
in-place targets poisoned with NaN first so that unwritten elements fail. On the CPU the kernels run
under the interpreter."""

import pytest
import torch

from declab_kernels.rwkv7_fused import add_norm_shift, gate_output, lora_hidden, sqrelu, time_mix_inputs
from declab_kernels.rwkv7_fused.triton import add_norm_shift_triton, gate_output_triton, lora_hidden_triton, time_mix_inputs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(x, y):
    """Relative RMS error ||x - y|| / ||y||."""
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return scale * torch.randn(*shape, generator=g, device=DEVICE)


@pytest.mark.parametrize("B,C", [(1, 40), (3, 100)])
@pytest.mark.parametrize("mode", ["shift6", "shift1", "plain", "no_delta_no_bias"])
@pytest.mark.parametrize("state_ready", [False, True])
def test_add_norm_shift_triton_matches_ref(B, C, mode, state_ready):
    x0, delta = randn(B, C, seed=1), randn(B, C, seed=2)
    weight, bias = 1 + randn(C, seed=3, scale=0.1), randn(C, seed=4, scale=0.1)
    prev0, mixes = randn(B, C, seed=5), torch.rand(6 if mode == "shift6" else 1, C, device=DEVICE)
    if mode == "no_delta_no_bias":
        delta, bias = None, None
    shift = mode.startswith("shift")
    outs = {}
    for impl in ("ref", "triton"):
        # rows with a row stride over C: the residual and the shift are slices of larger buffers
        x = torch.full((B, C + 3), float("nan"), device=DEVICE)[:, :C].copy_(x0)
        prev = torch.full((B, C + 5), float("nan"), device=DEVICE)[:, :C].copy_(prev0)
        args = (x, delta, weight, bias, prev if shift else None, mixes if shift else None)
        if impl == "ref":
            out = add_norm_shift(*args, eps=1e-5, impl="ref")
        else:
            out = add_norm_shift_triton(*args, eps=1e-5, out=nan(*((mixes.shape[0], B, C) if shift else (B, C))),
                                        state_ready=state_ready)
        outs[impl] = (out, x, prev)
    for got, want in zip(outs["triton"], outs["ref"]):
        assert not got.isnan().any()
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("widths,acts", [((5, 12, 7, 20), (None, "tanh", None, "sigmoid")), ((12, 7, 20), ("tanh", None, "sigmoid"))])
def test_lora_hidden_triton_matches_ref(B, widths, acts):
    # the blocks are slices of one wider matrix, as the down-projection GEMM leaves them
    y = randn(B * len(widths), sum(widths) + 9, seed=B)
    blocks, col = [], 4
    for j, w in enumerate(widths):
        blocks.append(y[j * B : (j + 1) * B, col : col + w])
        col += w
    got = lora_hidden_triton(blocks, acts, out=nan(B * len(widths), sum(widths)))
    want = lora_hidden(blocks, acts, impl="ref")
    assert not got.isnan().any()
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("B,H,D", [(1, 3, 16), (2, 5, 12)])
@pytest.mark.parametrize("value_residual", [False, True])
def test_time_mix_inputs_triton_matches_ref(B, H, D, value_residual):
    C = H * D
    # r, k, v as strided views of one GEMM output, as the decode step produces them
    y = randn(3 * B, 3 * C + 7, seed=1)
    r, k, v = (y[j * B : (j + 1) * B, j * C : (j + 1) * C] for j in range(3))
    NB = 4 if value_residual else 3
    u = randn(NB * B, C, seed=2)
    bias_w, bias_a, bias_v = randn(C, seed=3), randn(C, seed=4), randn(C, seed=5)
    k_k, k_a = 0.7 + 0.1 * torch.rand(C, device=DEVICE), torch.rand(C, device=DEVICE)
    v_first = randn(B, C, seed=6) if value_residual else None
    args = (r, k, v, u, bias_w, bias_a, bias_v if value_residual else None, k_k, k_a, v_first)
    x_t, w_t = time_mix_inputs_triton(*args, head_dim=D, out=nan(5, B, C), w_out=nan(B, C))
    x_r, w_r = time_mix_inputs(*args, head_dim=D, impl="ref")
    for got, want in ((x_t, x_r), (w_t, w_r)):
        assert not got.isnan().any()
        assert rel(got, want) < 1e-5
    assert w_t.dtype == torch.float32


@pytest.mark.parametrize("B,H,D", [(1, 3, 16), (3, 5, 12)])
def test_gate_output_triton_matches_ref(B, H, D):
    C = H * D
    o = randn(B, H, D, seed=1)
    x = randn(5, B, C, seed=2)
    r, k, v = (x[j].view(B, H, D) for j in range(3))
    g = randn(2 * B, C, seed=3)[B:]
    r_k, nw, nb = randn(H, D, seed=4, scale=0.1), 1 + randn(C, seed=5, scale=0.1), randn(C, seed=6, scale=0.1)
    got = gate_output_triton(o, r, k, v, g, r_k, nw, nb, eps=D * 1e-5, out=nan(B, C))
    want = gate_output(o, r, k, v, g, r_k, nw, nb, eps=D * 1e-5, impl="ref")
    assert not got.isnan().any()
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("n", [1, 1000, 2500])
def test_sqrelu_triton_matches_ref(n):
    x = randn(n, seed=n)
    want = sqrelu(x.clone(), impl="ref")
    got = sqrelu(x.clone(), impl="triton")
    assert rel(got, want) < 1e-6 or want.norm() == 0
    assert torch.equal(got == 0, x <= 0)
