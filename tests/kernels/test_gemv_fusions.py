"""The fusion records of `declab_kernels.gemv.linear`: each one's fused GEMV (the Triton kernel under the
interpreter on the CPU, float32, odd shapes) against its unfused form, the choice table that picks
between them, and the duck-typed weight objects (quantised formats) that run every fusion unfused.
"""

import pytest
import torch
import torch.nn.functional as F

from declab_kernels import gemv as G_
from declab_kernels import tuning
from declab_kernels.gemv import fusions as fu
from declab_kernels.gemv import linear

M, N, K = 3, 34, 201
# RWKV-7-like packed rows: three square blocks of C, then low-rank blocks for inputs 2..5 (v's LoRA
# joins v's block), C = 24
C = 24
SPLITS = (0, C, 2 * C, 3 * C + 8, 3 * C + 16, 3 * C + 24, 3 * C + 40)
PANELS = ((0, 3, 0, 3 * C, "batched"), (2, 6, 3 * C, 3 * C + 40, "cross"))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(seed, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g)
    return g, x, w, b


def case(name, seed=0, device="cpu", dtype=torch.float32):
    """(x, weight, bias, pre, post) of one fusion, odd shapes (float32 on the CPU unless told)."""
    g, x, w, b = inputs(seed)

    def put(t):
        return t.to(device=device, dtype=dtype)

    x, w, b = put(x), put(w), put(b)
    residual = put(torch.randn(M, N, generator=g))
    norm_n = put(torch.rand(N, generator=g) + 0.5)
    norm_k = put(torch.rand(K, generator=g) + 0.5)
    sumsq = (torch.rand(M, 5, generator=g) * K).to(device)
    pre = post = None
    if name == "rms_norm":
        pre = fu.RMSNorm(norm_k, 1e-5)
    elif name == "gated_rms_norm":
        pre = fu.GatedRMSNorm(put(torch.randn(M, K, generator=g)), norm_k, 1e-5, K)
    elif name == "rms_scale":
        pre = fu.RMSScale(sumsq, 1e-5)
    elif name == "sqrelu":
        pre = fu.SqReLU()
    elif name == "select":
        x = put(torch.randn(len(SPLITS) - 1, M, K, generator=g))
        w = put(torch.randn(SPLITS[-1], K, generator=g) * K ** -0.5)
        b = put(torch.randn(SPLITS[-1], generator=g))
        pre = fu.Select(SPLITS, PANELS)
    elif name == "swiglu":
        post = fu.SwiGLU()
    elif name == "residual":
        post = fu.Residual(residual)
    elif name == "residual_norm":
        post = fu.ResidualNorm(residual, norm_n)
    elif name == "rms_norm+swiglu":
        pre, post = fu.RMSNorm(norm_k, 1e-5), fu.SwiGLU()
    elif name == "rms_norm+residual":
        pre, post = fu.RMSNorm(norm_k, 1e-5), fu.Residual(residual)
    elif name == "rms_scale+residual_norm":
        pre, post = fu.RMSScale(sumsq, 1e-5), fu.ResidualNorm(residual, norm_n)
    elif name == "add_rms_norm":
        post = fu.AddRMSNorm(residual, norm_n, 1e-5)
    return x, w, b, pre, post


FUSED = ["rms_norm", "gated_rms_norm", "rms_scale", "sqrelu", "select", "swiglu", "residual", "residual_norm",
         "rms_norm+swiglu", "rms_norm+residual", "rms_scale+residual_norm"]


def outputs(result):
    """A projection's result as a tuple of tensors (a Select's column pieces gathered)."""
    if isinstance(result, fu.Columns):
        return (result.cat(),)
    return result if isinstance(result, tuple) else (result,)


def by_hand(name, x, w, b, pre, post):
    """The definition of each fusion in plain float32 PyTorch, independent of the specs."""
    def rms(t, weight, eps=1e-5):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + eps) * weight

    if name == "select":
        return (torch.cat([F.linear(x[i], w[a:c], b[a:c]) for i, (a, c) in enumerate(zip(SPLITS, SPLITS[1:]))], -1),)
    h = x
    if name.startswith("rms_norm"):
        h = rms(x, pre.weight)
    elif name == "gated_rms_norm":
        h = rms(x * F.silu(pre.z), pre.weight)
    elif name == "sqrelu":
        h = torch.relu(x).square()
    if name.startswith("rms_scale"):
        y = F.linear(h, w) * torch.rsqrt(pre.sumsq.sum(-1, keepdim=True) / K + 1e-5) + b
    else:
        y = F.linear(h, w, b)
    if name.endswith("swiglu"):
        gate, up = y.chunk(2, -1)
        return (F.silu(gate) * up,)
    if name.endswith("residual_norm"):
        r = post.residual + y
        return r, r * post.norm_weight, r.square().sum(-1, keepdim=True)
    if name.endswith("residual"):
        return (post.residual + y,)
    if name == "add_rms_norm":
        r = post.residual + y
        return rms(r, post.norm_weight), r
    return (y,)


@pytest.fixture
def forced(monkeypatch):
    """`linear` as on a GPU, every fused key picked as `forced.pick` ("triton": the fused GEMV with the
    first configuration, under the interpreter here; "torch": the unfused form); plain keys keep F.linear."""
    from declab_kernels.gemv.triton import CONFIGS

    class Pick:
        pick = "triton"
        fused = []

    def choose(x, weight, bias, key, baseline, fused):
        baseline(weight)
        if fused:
            Pick.fused.append(fused)
        G_._TABLE[key] = {"impl": Pick.pick if fused else "torch", "config": CONFIGS[0], "torch_us": 1.0,
                          "triton_us": 2.0, "triton_config": "stand-in", "times_us": {}}
        return G_._TABLE[key]

    monkeypatch.setattr(G_, "_dense_fusable", lambda x, w, b, impl: impl == "triton" and x.dim() == 2 and x.shape[0] <= 8)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(G_, "_TABLE", {})
    monkeypatch.setattr(G_, "_choose", choose)
    return Pick


@pytest.mark.interpreter
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("pick", ["triton", "torch"])
def test_fused_gemv_and_unfused_form_match_the_definition(name, pick, forced):
    forced.pick = pick
    x, w, b, pre, post = case(name)
    want = by_hand(name, x, w, b, pre, post)
    got = outputs(linear(x, w, b, pre=pre, post=post, impl="triton"))
    unfused = outputs(linear(x, w, b, pre=pre, post=post, impl="ref"))
    if pick == "triton":
        kernel_args = {**(pre.kernel_args() if pre else {}), **(post.kernel_args() if post else {})}
        assert forced.fused and forced.fused[-1].keys() == kernel_args.keys()
    assert len(got) == len(want) == len(unfused)
    # the fused ResidualNorm writes one partial sum of squares per column block: compare their sums
    for g, u, v in zip(got, unfused, want):
        assert rel(g.sum(-1) if g.shape != v.shape else g, v.sum(-1) if g.shape != v.shape else v) < 1e-5
        assert rel(u, v) < 1e-5


@pytest.mark.interpreter
def test_choice_table_keys_name_the_fusions(forced):
    for name in ("rms_norm+swiglu", "select", "residual"):
        x, w, b, pre, post = case(name)
        linear(x, w, b, pre=pre, post=post, impl="triton")
    recs = {(r["pre"], r["post"]): r for r in G_.choices()}
    assert recs[("rms_norm", "swiglu")]["impl"] == "triton"
    assert recs[("select:" + str(SPLITS), "")]["M"] == M
    assert recs[("", "residual:float32")]["weight"] == "dense"
    # the unfused pair of rms_norm + swiglu measured swiglu on its own
    assert ("", "swiglu") in recs
    assert all("config" not in r for r in G_.choices())


@pytest.mark.interpreter
def test_add_rms_norm_has_no_fused_form_and_is_never_measured(forced):
    x, w, b, pre, post = case("add_rms_norm")
    h, r = linear(x, w, b, post=post, impl="triton")
    want_h, want_r = by_hand("add_rms_norm", x, w, b, pre, post)
    assert rel(h, want_h) < 1e-5 and rel(r, want_r) < 1e-5
    assert not forced.fused and all(rec["post"] == "" for rec in G_.choices())


@pytest.mark.parametrize("cross_rows", [tuning.CROSS_ROWS, 0])
@pytest.mark.parametrize("panels", [PANELS, None])
def test_select_unfused_layouts(monkeypatch, cross_rows, panels):
    """One GEMM of every input by the whole weight, the panels (batched r/k/v + LoRA GEMM), or block by
    block: the same columns."""
    monkeypatch.setattr(tuning, "CROSS_ROWS", cross_rows)
    x, w, b, _, _ = case("select")
    got = linear(x, w, b, pre=fu.Select(SPLITS, panels), impl="ref")
    want = by_hand("select", x, w, b, None, None)[0]
    assert got.shape == (M, SPLITS[-1]) and rel(got.cat(), want) < 1e-6
    # the blocks the RWKV-7 step reads (r, k, v, v's LoRA, then w, a, g's) are views of the products, no copy
    stored = {t.untyped_storage().data_ptr() for _, t in got.pieces}
    for a, c in [(0, C), (C, 2 * C), (2 * C, 3 * C), *zip(SPLITS[3:], SPLITS[4:]), (3 * C, SPLITS[3])]:
        block = got.cols(a, c)
        assert block.shape == (M, c - a) and rel(block, want[:, a:c]) < 1e-6
        assert block.untyped_storage().data_ptr() in stored
    # columns across two pieces are gathered
    assert rel(got.cols(C - 2, C + 2), want[:, C - 2 : C + 2]) < 1e-6


def test_specs_refuse_bad_input():
    x, w, b = inputs(1)[1:]
    with pytest.raises(ValueError, match="rms_norm: needs a norm weight"):
        linear(x, w, pre=fu.RMSNorm(torch.ones(K + 1), 1e-5), impl="ref")
    with pytest.raises(ValueError, match="rms_scale: needs a float32 sumsq"):
        linear(x, w, pre=fu.RMSScale(torch.ones(M, 2, dtype=torch.float64), 1e-5), impl="ref")
    with pytest.raises(ValueError, match="swiglu: needs a weight"):
        linear(x, w[:7], post=fu.SwiGLU(), impl="ref")
    with pytest.raises(ValueError, match="residual_norm: needs a residual"):
        linear(x, w, post=fu.ResidualNorm(torch.zeros(M, N + 1), torch.ones(N)), impl="ref")
    with pytest.raises(ValueError, match="select: needs x"):
        linear(x, w, pre=fu.Select((0, N)), impl="ref")
    with pytest.raises(ValueError, match="takes no post"):
        linear(x[None], w, pre=fu.Select((0, N)), post=fu.SwiGLU(), impl="ref")
    with pytest.raises(ValueError, match="needs x \\[M, K\\]"):
        linear(x[None], w, post=fu.SwiGLU(), impl="ref")


class FakeWeight:
    """A weight object as a quantised format provides it: here a dense W whose product is x @ W^T."""

    format = "fake-dense"

    def __init__(self, w):
        self.w = w
        self.shape = tuple(w.shape)
        self.dtype = w.dtype
        self.calls = 0

    def dequantize(self):
        return self.w.clone()

    def matmul(self, x2d, *, impl):
        assert x2d.dim() == 2 and impl in ("ref", "triton")
        self.calls += 1
        return x2d @ self.w.T


@pytest.mark.parametrize("name", [*FUSED, "add_rms_norm", "plain"])
@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_weight_object_equals_the_tensor_path(name, impl):
    x, w, b, pre, post = case(name, seed=4)
    fake = FakeWeight(w)
    got = outputs(linear(x, fake, b, pre=pre, post=post, impl=impl))
    want = outputs(linear(x, w, b, pre=pre, post=post, impl=impl))
    assert fake.calls == 1 and len(got) == len(want)
    for g, v in zip(got, want):
        assert g.shape == v.shape and g.dtype == v.dtype and rel(g, v) < 1e-5


def test_weight_object_keeps_leading_dims_and_records_no_choice(forced):
    x = torch.randn(2, 3, K)
    w = torch.randn(N, K)
    fake = FakeWeight(w)
    got = linear(x, fake, impl="triton")
    assert got.shape == (2, 3, N) and rel(got, F.linear(x, w)) < 1e-6
    assert torch.equal(fake.dequantize(), w) and not G_.choices()



@pytest.mark.gpu
@pytest.mark.parametrize("name", [*FUSED, "add_rms_norm", "plain"])
def test_gpu_weight_object_equals_the_tensor_path_bf16(name):
    """On the GPU the tensor path may run the fused GEMV; the weight object runs every fusion unfused
    around its product: the same result to bf16 rounding."""
    x, w, b, pre, post = case(name, seed=5, device="cuda", dtype=torch.bfloat16)
    got = outputs(linear(x, FakeWeight(w), b, pre=pre, post=post, impl="triton"))
    want = outputs(linear(x, w, b, pre=pre, post=post, impl="triton"))
    for g, v in zip(got, want):
        # the fused ResidualNorm writes one partial sum of squares per column block
        assert rel(g.sum(-1), v.sum(-1)) < 2e-2 if g.shape != v.shape else rel(g, v) < 2e-2
