"""Small-batch GEMV: Triton against the float32 reference, and `linear`'s choice per shape.

On the CPU the kernel runs under the Triton interpreter in float32 (it computes tl.dot wrongly on
bf16), with odd N and K, every kind of configuration (FMA in registers or cp.async-pipelined, the
3-D FMA for several rows, tl.dot, split-K), the grouped form, strided x rows, a bias, and outputs
pre-filled with NaN. Tests marked `gpu` run bf16 on CUDA: every configuration, autotuning, and
`linear` (its choice per shape, equal to F.linear within bf16 rounding, inside a CUDA graph).
"""

import pytest
import torch
import torch.nn.functional as F

from declab_kernels import gemv as G_
from declab_kernels import tuning
from declab_kernels import split_workspace
from declab_kernels.gemv import fusions as fu
from declab_kernels.gemv import gemv, linear
from declab_kernels.gemv.ref import gemv_ref

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def gpu_only(test):
    """Marks a test `gpu` and skips it without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a GPU")(test))


def rel(a, b):
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def choice(M, N, K, pre="", post="", bias=False):
    """`linear`'s record for a key (None before its first measurement)."""
    for rec in G_.choices():
        if (rec["M"], rec["N"], rec["K"], rec["bias"], rec["pre"], rec["post"]) == (M, N, K, bias, pre, post):
            return rec
    return None


def configs():
    from declab_kernels.gemv.triton import CONFIGS

    return CONFIGS


# One of each kind: registers, pipelined, 3-D FMA, two split-K FMA, dot, dot split-K.
KINDS = {
    "fma": dict(DOT=False, BLOCK_N=4, BLOCK_K=128, SPLIT_K=1),
    "fma-pipelined": dict(DOT=False, BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, LOOP_STAGES=3),
    "fma-split3": dict(DOT=False, BLOCK_N=4, BLOCK_K=64, SPLIT_K=3),
    "fma-split4-pipelined": dict(DOT=False, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4, LOOP_STAGES=2),
    "dot": dict(DOT=True, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
    "dot-split2": dict(DOT=True, BLOCK_N=32, BLOCK_K=32, SPLIT_K=2),
}


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 17, 100), (3, 100, 17), (8, 33, 1000), (1, 1000, 100)])
def test_gemv_default_config_matches_ref(M, N, K, nan_empty):
    x, w = torch.randn(M, K, device=DEVICE), torch.randn(N, K, device=DEVICE)
    got = gemv(x, w, impl="triton")
    assert got.shape == (M, N) and got.dtype == x.dtype
    assert rel(got, gemv_ref(x, w)) < 1e-5


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("M,N,K", [(1, 17, 100), (3, 33, 201), (8, 20, 17)])
def test_gemv_every_kind_matches_ref(kind, M, N, K, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    x, w = torch.randn(M, K, device=DEVICE), torch.randn(N, K, device=DEVICE)
    got = gemv_triton(x, w, config=KINDS[kind])
    assert rel(got, gemv_ref(x, w)) < 1e-5


@pytest.mark.parametrize("kind", ["fma", "fma-split3", "dot-split2"])
def test_gemv_grouped_strided_bias_out(kind):
    """G=3 products in one launch, x rows with a stride != K, a bias, written into a given out."""
    from declab_kernels.gemv.triton import gemv_triton

    Gn, M, N, K = 3, 2, 37, 150
    x = torch.randn(Gn, M, 2 * K, device=DEVICE)[:, :, 5:5 + K]
    w, b = torch.randn(Gn, N, K, device=DEVICE), torch.randn(Gn, N, device=DEVICE)
    out = torch.full((Gn, M, N), float("nan"), device=DEVICE)
    got = gemv_triton(x, w, b, out=out, config=KINDS[kind])
    assert got is out
    assert rel(got, gemv_ref(x, w, b)) < 1e-5


def test_gemv_strided_rows_and_out(nan_empty):
    M, N, K = 3, 100, 1000
    x = torch.randn(M, 3 * K, device=DEVICE)[:, K:2 * K]
    assert x.stride(0) == 3 * K
    w = torch.randn(N, K, device=DEVICE)
    out = torch.full((M, N), float("nan"), device=DEVICE)
    assert gemv(x, w, impl="triton", out=out) is out
    assert rel(out, gemv_ref(x, w)) < 1e-5
    # The output may itself be rows of a wider buffer.
    wide = torch.full((M, N + 7), float("nan"), device=DEVICE)
    gemv(x, w, impl="triton", out=wide[:, :N])
    assert rel(wide[:, :N], gemv_ref(x, w)) < 1e-5
    assert wide[:, N:].isnan().all()


def test_gemv_bias_and_ref_impl():
    x, w, b = torch.randn(2, 50, device=DEVICE), torch.randn(30, 50, device=DEVICE), torch.randn(30, device=DEVICE)
    torch.testing.assert_close(gemv(x, w, b, impl="triton"), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x, w, b, impl="ref"), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    out = torch.empty(2, 30, device=DEVICE)
    assert gemv(x, w, impl="ref", out=out) is out


def test_split_k_leaves_counters_at_zero():
    """The last split resets its counter: the workspace is reusable (and CUDA-graph safe)."""
    from declab_kernels.gemv import triton as tri

    x, w = torch.randn(2, 300, device=DEVICE), torch.randn(50, 300, device=DEVICE)
    for _ in range(2):
        assert rel(tri.gemv_triton(x, w, config=KINDS["fma-split3"]), gemv_ref(x, w)) < 1e-5
    assert not split_workspace._pairs[("gemv", str(x.device))][1].any()


def test_gemv_rejects_bad_shapes():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        gemv(x, torch.randn(4, 9, device=DEVICE), impl="triton")
    with pytest.raises(ValueError):
        gemv(x, torch.randn(8, 4, device=DEVICE).t(), impl="triton")
    with pytest.raises(ValueError):
        gemv(x, torch.randn(4, 8, device=DEVICE), impl="triton", out=torch.empty(2, 5, device=DEVICE))
    with pytest.raises(ValueError):
        gemv(x, torch.randn(4, 8, device=DEVICE), impl="auto")
    from declab_kernels.gemv.triton import gemv_triton

    with pytest.raises(ValueError, match="early_tiles"):
        gemv_triton(x, torch.randn(4, 8, device=DEVICE), early_tiles=3)


def test_config_pruning_keeps_fma_accumulators_small():
    from declab_kernels.gemv.triton import config_fits

    for cfg in configs():
        for M in (1, 4, 8, 16):
            if config_fits(cfg, M, 2048) and not cfg.kwargs["DOT"]:
                pad = 1 << (M - 1).bit_length()
                assert pad * cfg.kwargs["BLOCK_N"] * cfg.kwargs["BLOCK_K"] <= 64 * 32 * cfg.num_warps
    # Several rows always keep some candidate.
    assert any(config_fits(c, 16, 2048) for c in configs())


def test_linear_on_cpu_is_f_linear(monkeypatch):
    """On the CPU `linear` never runs the interpreter: it is F.linear, whatever impl."""
    from declab_kernels.gemv import triton as tri

    def boom(*args, **kwargs):
        raise AssertionError("linear ran the Triton kernel on the CPU")

    monkeypatch.setattr(tri, "gemv_triton", boom)
    x, w, b = torch.randn(2, 3, 40), torch.randn(24, 40), torch.randn(24)
    for impl in ("triton", "ref"):
        torch.testing.assert_close(linear(x, w, impl=impl), F.linear(x, w), rtol=0, atol=0)
        torch.testing.assert_close(linear(x, w, b, impl=impl), F.linear(x, w, b), rtol=0, atol=0)


# ---- GPU: bf16 on the compiled kernels ----


@gpu_only
@pytest.mark.parametrize("M,N,K", [(1, 2048, 2048), (4, 3000, 2000), (8, 1000, 8192), (1, 8512, 2048), (16, 513, 96)])
def test_gpu_every_config_bf16(M, N, K):
    from declab_kernels.gemv.triton import config_fits, config_name, gemv_triton

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    want = gemv_ref(x.float(), w.float())
    for cfg in configs():
        if config_fits(cfg, M, K):
            assert rel(gemv_triton(x, w, config=cfg), want) < 1e-2, config_name(cfg)
    assert rel(gemv(x, w, impl="triton"), want) < 1e-2


@gpu_only
def test_gpu_grouped_bf16():
    x = torch.randn(3, 1, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(3, 2048, 2048, device="cuda") * 2048 ** -0.5).to(torch.bfloat16)
    assert rel(gemv(x, w, impl="triton"), gemv_ref(x.float(), w.float())) < 1e-2


@gpu_only
def test_gpu_linear_picks_per_shape_and_matches_f_linear():
    for M, N, K in [(1, 2048, 2048), (4, 2048, 8192), (2, 1000, 300)]:
        x = torch.randn(1, M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
        got = linear(x, w, impl="triton")
        assert got.shape == (1, M, N)
        assert rel(got, F.linear(x, w)) < 1e-2
        rec = choice(M, N, K)
        assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0
    # More rows than MAX_ROWS: plain F.linear, no choice recorded.
    x = torch.randn(tuning.MAX_ROWS + 1, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, w, impl="triton"), F.linear(x, w))
    assert choice(tuning.MAX_ROWS + 1, 64, 256) is None


@gpu_only
@pytest.mark.parametrize("force", ["triton", "torch"])
def test_gpu_linear_in_cuda_graph(force):
    M, N, K = 1, 2048, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
    linear(x, w, impl="triton")  # warm-up outside capture: autotune + the choice
    G_._TABLE[(M, N, K, "bfloat16", False, None, None, "dense", x.device.index)]["impl"] = force
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear(x, w, impl="triton")
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w, impl="triton")
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel(y, F.linear(x, w)) < 1e-2


@gpu_only
def test_gpu_linear_unseen_shape_during_capture_uses_f_linear():
    x = torch.randn(1, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(640, 1536, device="cuda", dtype=torch.bfloat16)
    F.linear(x, w)  # cuBLAS warm-up before capture; records no choice
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w, impl="triton")
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, F.linear(x, w))
    assert choice(1, 640, 1536) is None


# ---------------------------------------------------------------------------------------------
# gated_rmsnorm folded into the GEMV's prologue (Mamba-2's gated norm + out_proj)

NORM_KINDS = {
    "fma": dict(DOT=False, BLOCK_N=4, BLOCK_K=64, SPLIT_K=1),
    "fma-3d-pipelined": dict(DOT=False, BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, LOOP_STAGES=3),
    "fma-split3": dict(DOT=False, BLOCK_N=4, BLOCK_K=32, SPLIT_K=3),
    "dot": dict(DOT=True, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1),
    "dot-split2": dict(DOT=True, BLOCK_N=16, BLOCK_K=32, SPLIT_K=2),
}


def norm_inputs(M, N, K, dtype=torch.float32, bias=True):
    """y [M, K], z a strided view (as the in-projection's slice), norm weight, W, bias."""
    y = torch.randn(M, K, device=DEVICE, dtype=dtype)
    z = torch.randn(M, 2 * K + 5, device=DEVICE, dtype=dtype)[:, 5:5 + K]
    nw = (torch.rand(K, device=DEVICE) + 0.5).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) * K ** -0.5).to(dtype)
    b = torch.randn(N, device=DEVICE, dtype=dtype) if bias else None
    return y, z, nw, w, b


def norm_ref(y, z, nw, w, b, eps=1e-5):
    from declab_kernels.mamba2_norm import gated_rmsnorm

    return gemv_ref(gated_rmsnorm(y, z, nw, y.shape[-1], eps, impl="ref"), w, b)


@pytest.mark.parametrize("kind", [None, *NORM_KINDS])
@pytest.mark.parametrize("M,N,K", [(1, 17, 150), (3, 33, 201)])  # K not a multiple of BLOCK_K
def test_gemv_norm_prologue_matches_ref(kind, M, N, K, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    y, z, nw, w, b = norm_inputs(M, N, K)
    got = gemv_triton(y, w, b, config=NORM_KINDS.get(kind), norm=(z, nw, 1e-5))
    assert got.shape == (M, N) and not got.isnan().any()
    assert rel(got, norm_ref(y, z, nw, w, b)) < 1e-5


def test_gemv_norm_prologue_into_out_no_bias():
    from declab_kernels.gemv.triton import gemv_triton

    y, z, nw, w, _ = norm_inputs(2, 20, 70, bias=False)
    out = torch.full((2, 20), float("nan"), device=DEVICE)
    assert gemv_triton(y, w, out=out, config=NORM_KINDS["fma-split3"], norm=(z, nw, 1e-3, 70)) is out
    assert rel(out, norm_ref(y, z, nw, w, None, eps=1e-3)) < 1e-5


def test_gemv_norm_prologue_refuses_groups_and_bad_shapes():
    from declab_kernels.gemv.triton import gemv_triton

    y, z, nw, w, b = norm_inputs(1, 8, 64)
    with pytest.raises(ValueError, match="one group"):
        gemv_triton(y, w, b, norm=(z, nw, 1e-5, 32))
    with pytest.raises(ValueError):
        gemv_triton(y, w, b, norm=(z[:, :32], nw, 1e-5))
    with pytest.raises(ValueError):
        gemv_triton(y.unsqueeze(0), w.unsqueeze(0), norm=(z, nw, 1e-5))


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("group_size", [96, 48])
def test_gated_rms_norm_pre_matches_the_pair(impl, group_size):
    """On the CPU (and with several groups anywhere) it is the unfused pair; ref is its definition."""
    from declab_kernels.mamba2_norm import gated_rmsnorm

    y, z, nw, w, b = norm_inputs(2, 24, 96)
    got = linear(y, w, b, pre=fu.GatedRMSNorm(z, nw, 1e-5, group_size), impl=impl)
    want = F.linear(gated_rmsnorm(y, z, nw, group_size, 1e-5, impl="ref"), w, b)
    assert got.shape == (2, 24)
    assert rel(got, want) < 1e-5


def test_choices_file_pins_the_picks_across_processes(monkeypatch, tmp_path):
    """With DECLAB_GEMV_CHOICES, a key measured once is written to the file, and a later process (its
    tables empty, measuring made to fail) takes the same pick from it; a configuration the tree no
    longer has, or another GPU model, is measured again."""
    from declab_kernels.gemv.triton import CONFIGS, config_name

    path = tmp_path / "choices.jsonl"
    monkeypatch.setenv("DECLAB_GEMV_CHOICES", str(path))
    monkeypatch.setattr(G_, "_dense_fusable", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(G_, "_TABLE", {})
    monkeypatch.setattr(G_, "_FILE", {})
    cfg = CONFIGS[2]

    def choose(x2, weight, bias, key, baseline, fused):
        rec = {"impl": "triton", "config": cfg, "torch_us": 2.0, "triton_us": 1.0, "triton_config": config_name(cfg), "times_us": {}}
        G_._TABLE[key] = rec
        G_._store(key, x2.device, rec)
        return rec

    monkeypatch.setattr(G_, "_choose", choose)
    x, w = torch.randn(1, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE)
    linear(x, w, impl="triton")
    assert len(path.read_text().splitlines()) == 1

    def fail(*a, **k):
        raise AssertionError("measured although the file holds the key")

    G_._TABLE.clear()
    G_._FILE.clear()
    monkeypatch.setattr(G_, "_choose", fail)
    assert rel(linear(x, w, impl="triton"), gemv_ref(x, w)) < 1e-5
    (rec,) = G_.choices()
    assert rec["triton_config"] == config_name(cfg) and rec["from_file"] == str(path)
    # Another GPU model, or a file naming a configuration that is gone: measured again.
    G_._TABLE.clear()
    G_._FILE.clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Other GPU")
    with pytest.raises(AssertionError, match="measured"):
        linear(x, w, impl="triton")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    path.write_text(path.read_text().replace(config_name(cfg), "fma n999 k1 s1 w1 st1"))
    G_._TABLE.clear()
    G_._FILE.clear()
    with pytest.raises(AssertionError, match="measured"):
        linear(x, w, impl="triton")
    # A line cut short (a process stopped while appending) and a blank line are skipped, not an error.
    good = path.read_text().replace("fma n999 k1 s1 w1 st1", config_name(cfg))
    path.write_text("\n" + good[: len(good) // 2] + "\n")
    G_._TABLE.clear()
    G_._FILE.clear()
    with pytest.raises(AssertionError, match="measured"):
        linear(x, w, impl="triton")
    path.write_text(good + good[: len(good) // 2])
    G_._TABLE.clear()
    G_._FILE.clear()
    assert rel(linear(x, w, impl="triton"), gemv_ref(x, w)) < 1e-5


@gpu_only
@pytest.mark.parametrize("M", [1, 3])
def test_gpu_gemv_norm_prologue_bf16(M):
    from declab_kernels.gemv.triton import CONFIGS, config_fits, gemv_triton

    N, K = 2048, 4096
    y, z, nw, w, b = norm_inputs(M, N, K, dtype=torch.bfloat16, bias=False)
    want = norm_ref(y.float(), z.float(), nw.float(), w.float(), None)
    for cfg in [c for c in CONFIGS if config_fits(c, M, K)]:
        assert rel(gemv_triton(y, w, config=cfg, norm=(z, nw, 1e-5)), want) < 1e-2
    got = linear(y, w, pre=fu.GatedRMSNorm(z, nw, 1e-5, K), impl="triton")
    assert rel(got, want) < 1e-2
    rec = choice(M, N, K, pre="gated_rms_norm")
    assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0


# ---------------------------------------------------------------------------------------------
# RMSNorm in the GEMV's prologue (a decoder's pre-norm + the projection after it), the residual add
# in its epilogue (the projection before it + the add)


def rms_inputs(M, N, K, dtype=torch.float32, bias=True):
    """x [M, K] with a row stride of 2K and rows of different scales, norm weight, W, bias (seeded by the
    shape, so a tolerance is checked on the same numbers every run)."""
    torch.manual_seed(M * 100_003 + N * 1_009 + K)
    x = (torch.randn(M, 2 * K, device=DEVICE) * torch.arange(1, M + 1, device=DEVICE)[:, None]).to(dtype)[:, :K]
    nw = (torch.rand(K, device=DEVICE) + 0.5).to(dtype)
    w = (torch.randn(N, K, device=DEVICE) * K ** -0.5).to(dtype)
    b = torch.randn(N, device=DEVICE, dtype=dtype) if bias else None
    return x, nw, w, b


def rms_pair(x, nw, w, b, eps=1e-5):
    """The definition: `declab_kernels.rmsnorm`'s norm (rounded to x's dtype, times the weight), then the product."""
    from declab_kernels.rmsnorm import rms_norm

    return gemv_ref(rms_norm(x, nw, eps, impl="ref"), w, b)


@pytest.mark.parametrize("kind", [None, *NORM_KINDS])
@pytest.mark.parametrize("M,N,K", [(1, 17, 150), (3, 33, 201)])  # K not a multiple of BLOCK_K
def test_gemv_rms_norm_prologue_matches_the_pair(kind, M, N, K, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    x, nw, w, b = rms_inputs(M, N, K)
    got = gemv_triton(x, w, b, config=NORM_KINDS.get(kind), rms_norm=(nw, 1e-5))
    assert got.shape == (M, N) and got.dtype == w.dtype and not got.isnan().any()
    assert rel(got, rms_pair(x, nw, w, b)) < 1e-5
    # The norm matters: each row's own scale comes out, and eps is used.
    assert rel(gemv_triton(x, w, b, config=NORM_KINDS.get(kind)), got) > 0.1
    x[:, :] = 0.0
    assert rel(gemv_triton(x, w, b, config=NORM_KINDS.get(kind), rms_norm=(nw, 1e-5)), b.expand(M, N)) < 1e-6


def scale_inputs(x, nw, parts):
    """What a kernel before hands `rms_scale`: x * norm_weight rounded to x's dtype, and the row's sums
    of x^2 in `parts` uneven pieces (float32)."""
    cuts = torch.linspace(0, x.shape[1], parts + 1).long().tolist()
    sumsq = torch.stack([x[:, a:b].float().square().sum(-1) for a, b in zip(cuts, cuts[1:])], -1)
    return (x.float() * nw.float()).to(x.dtype), sumsq


@pytest.mark.parametrize("kind", [None, *NORM_KINDS])
@pytest.mark.parametrize("M,N,K,parts", [(1, 17, 150, 1), (3, 33, 201, 5), (2, 9, 64, 64)])
def test_gemv_rms_scale_epilogue_matches_the_pair(kind, M, N, K, parts, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    torch.manual_seed(M + parts)
    x, nw, w, b = rms_inputs(M, N, K)
    xw, sumsq = scale_inputs(x, nw, parts)
    got = gemv_triton(xw, w, b, config=NORM_KINDS.get(kind), rms_scale=(sumsq, 1e-5))
    assert got.shape == (M, N) and got.dtype == w.dtype and not got.isnan().any()
    assert rel(got, rms_pair(x, nw, w, b)) < 1e-5
    # Every part counts (the last one given as much again as all of them), eps is used, and the bias
    # is added after the scale.
    sumsq[:, -1] += sumsq.sum(-1)
    assert rel(gemv_triton(xw, w, b, config=NORM_KINDS.get(kind), rms_scale=(sumsq, 1e-5)), got) > 0.05
    sumsq[:] = 0.0
    want = gemv_ref(xw, w).float() * 1e-5 ** -0.5 + b
    assert rel(gemv_triton(xw, w, b, config=NORM_KINDS.get(kind), rms_scale=(sumsq, 1e-5)), want) < 1e-5


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_scale_pre_matches_the_norm_and_projection(impl, dtype):
    torch.manual_seed(1)
    x, nw, w, b = rms_inputs(2, 24, 96, dtype=dtype)
    xw, sumsq = scale_inputs(x, nw, 4)
    got = linear(xw, w, b, pre=fu.RMSScale(sumsq, 1e-5), impl=impl)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and rel(got, rms_pair(x.float(), nw.float(), w.float(), b.float())) < tol
    with pytest.raises(ValueError, match="float32 sumsq"):
        linear(xw, w, b, pre=fu.RMSScale(sumsq.double(), 1e-5), impl=impl)
    with pytest.raises(ValueError, match="float32 sumsq"):
        linear(xw, w, b, pre=fu.RMSScale(sumsq[:1], 1e-5), impl=impl)


@pytest.mark.parametrize("kind", [None, *NORM_KINDS])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 17, 150), (3, 33, 201)])
def test_gemv_norm_out_epilogue_feeds_rms_scale(kind, r_dtype, M, N, K, nan_empty):
    """residual + norm_out writes r, h = r * w and per-program sums of r^2 that `rms_scale` turns into
    rmsnorm(r) * w for the GEMV after; with rms_scale on its own x as well (Mamba-2's out_proj)."""
    from declab_kernels.gemv.triton import CONFIGS, _as_config, gemv_triton

    torch.manual_seed(M + N)
    cfg = NORM_KINDS.get(kind, CONFIGS[0])
    x, nw, w, b = rms_inputs(M, N, K)
    r = torch.randn(M, N, device=DEVICE).to(r_dtype)
    nw_next = torch.rand(N, device=DEVICE) + 0.5
    w_next = torch.randn(7, N, device=DEVICE) * N ** -0.5
    for scale in (False, True):
        xw, sumsq = scale_inputs(x, nw, 3)
        fused = dict(rms_scale=(sumsq, 1e-5)) if scale else {}
        prod = rms_pair(x, nw, w, b) if scale else gemv_ref(x, w, b)
        want_r = (r.float() + prod.float()).to(r_dtype)
        new, h, ss = gemv_triton(xw if scale else x, w, b, config=cfg, residual=r, norm_out=nw_next, **fused)
        assert ss.shape == (M, -(-N // _as_config(cfg).kwargs["BLOCK_N"])) and ss.dtype == torch.float32
        assert new.dtype == r_dtype and rel(new, want_r) < (1e-5 if r_dtype == torch.float32 else 1e-2)
        assert rel(ss.sum(-1), new.float().square().sum(-1)) < 1e-6
        assert h.dtype == x.dtype and rel(h, new.float() * nw_next) < 1e-6
        got = gemv_triton(h, w_next, config=cfg, rms_scale=(ss, 1e-5))
        assert rel(got, rms_pair(new.float(), nw_next, w_next, None)) < 1e-5


def test_gemv_norm_out_refuses_bad_input():
    from declab_kernels.gemv.triton import CONFIGS, gemv_triton

    x, nw, w, b = rms_inputs(2, 8, 64)
    r = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="needs a residual and a config"):
        gemv_triton(x, w, residual=r, norm_out=nw[:8])
    with pytest.raises(ValueError, match="needs a residual and a config"):
        gemv_triton(x, w, config=CONFIGS[0], norm_out=nw[:8])
    with pytest.raises(ValueError, match="norm weight \\[8\\]"):
        gemv_triton(x, w, config=CONFIGS[0], residual=r, norm_out=nw)


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_post_then_rms_scale_pre_is_the_sublayer(impl, r_dtype):
    """Two ops for r += W x; rmsnorm(r) @ W2; on the CPU the pairs."""
    torch.manual_seed(2)
    x, nw, w, b = rms_inputs(2, 24, 96)
    r = torch.randn(2, 24, device=DEVICE).to(r_dtype)
    nw_next = torch.rand(24, device=DEVICE) + 0.5
    w_next = torch.randn(10, 24, device=DEVICE) * 24 ** -0.5
    new, h, ss = linear(x, w, b, post=fu.ResidualNorm(r, nw_next), impl=impl)
    want_r = (r.float() + gemv_ref(x, w, b).float()).to(r_dtype)
    assert rel(new, want_r) < (1e-5 if r_dtype == torch.float32 else 1e-2)
    got = linear(h, w_next, pre=fu.RMSScale(ss, 1e-5), impl=impl)
    assert rel(got, rms_pair(new.float(), nw_next, w_next, None)) < 1e-5
    xw, sumsq = scale_inputs(x, nw, 4)
    new2, _, _ = linear(xw, w, b, pre=fu.RMSScale(sumsq, 1e-5), post=fu.ResidualNorm(r, nw_next), impl=impl)
    assert rel(new2, (r.float() + rms_pair(x, nw, w, b).float()).to(r_dtype)) < (1e-5 if r_dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="needs a norm weight \\[24\\]"):
        linear(x, w, post=fu.ResidualNorm(r, nw), impl=impl)


def test_statistics_ops_pass_early_tiles_to_the_gemv(monkeypatch):
    """`early_tiles` of `linear` with RMSScale and ResidualNorm reaches the GEMV that runs, the fused
    one or the pair's `linear` (on the CPU the pair)."""
    import declab_kernels.gemv.triton as T

    seen = []

    def spy(fn):
        def wrapped(*args, early_tiles=1, **kw):
            seen.append(early_tiles)
            return fn(*args, early_tiles=early_tiles, **kw)
        return wrapped

    torch.manual_seed(3)
    x, nw, w, b = rms_inputs(1, 24, 64)
    xw, sumsq = scale_inputs(x, nw, 2)
    r = torch.randn(1, 24, device=DEVICE)

    def run():
        linear(xw, w, b, pre=fu.RMSScale(sumsq, 1e-5), impl="triton", early_tiles=2)
        linear(xw, w, b, pre=fu.RMSScale(sumsq, 1e-5), post=fu.ResidualNorm(r, torch.ones(24, device=DEVICE)),
               impl="triton", early_tiles=2)

    # the first calls of a shape measure the candidates (on a GPU); the calls after them dispatch
    run()
    monkeypatch.setattr(G_, "linear", spy(G_.linear))
    monkeypatch.setattr(T, "gemv_triton", spy(T.gemv_triton))
    run()
    assert seen and set(seen) == {2}


def test_gemv_rms_scale_refuses_bad_input():
    from declab_kernels.gemv.triton import gemv_triton

    x, nw, w, b = rms_inputs(2, 8, 64)
    _, sumsq = scale_inputs(x, nw, 2)
    with pytest.raises(ValueError, match="float32 sumsq"):
        gemv_triton(x, w, rms_scale=(sumsq[:1], 1e-5))
    with pytest.raises(ValueError, match="pass one"):
        gemv_triton(x, w, rms_scale=(sumsq, 1e-5), rms_norm=(nw, 1e-5))
    with pytest.raises(ValueError, match="takes x \\[M, K\\]"):
        gemv_triton(x[None], w, rms_scale=(sumsq, 1e-5), select=(0, 8))


@pytest.mark.parametrize("kind", [None, *NORM_KINDS])
@pytest.mark.parametrize("r_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 17, 150), (3, 33, 201)])
def test_gemv_residual_epilogue_matches_the_add(kind, r_dtype, M, N, K, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    x, _, w, b = rms_inputs(M, N, K)
    r = torch.randn(M, 2 * N, device=DEVICE).to(r_dtype)[:, N:]  # strided rows
    before = r.clone()
    got = gemv_triton(x, w, b, config=NORM_KINDS.get(kind), residual=r)
    assert got.shape == (M, N) and got.dtype == r_dtype
    want = (r.float() + gemv_ref(x, w, b).float()).to(r_dtype)
    assert rel(got, want) < (1e-5 if r_dtype == torch.float32 else 1e-2)
    assert torch.equal(r, before)


def test_gemv_residual_epilogue_in_place_with_the_norm(nan_empty):
    """A decoder's whole sublayer in two launches: r += W_o(gated) and the next norm's projection."""
    from declab_kernels.gemv.triton import gemv_triton

    x, nw, w, b = rms_inputs(2, 24, 64)
    r = torch.randn(2, 24, device=DEVICE)
    want = r + gemv_ref(rms_pair(x, nw, torch.eye(64, device=DEVICE), None), w, b)
    out = gemv_triton(x, w, b, out=r, config=NORM_KINDS["fma-split3"], rms_norm=(nw, 1e-5), residual=r)
    assert out is r and rel(r, want) < 1e-5
    with pytest.raises(ValueError, match="in place needs a config"):
        gemv_triton(x, w, b, out=r, residual=r)


def test_gemv_rms_norm_and_residual_refuse_bad_input():
    from declab_kernels.gemv.triton import gemv_triton

    x, nw, w, b = rms_inputs(2, 8, 64)
    with pytest.raises(ValueError, match="weight \\[64\\]"):
        gemv_triton(x, w, b, rms_norm=(nw[:32], 1e-5))
    with pytest.raises(ValueError, match="one"):
        gemv_triton(x, w, b, rms_norm=(nw, 1e-5), norm=(x, nw, 1e-5))
    with pytest.raises(ValueError, match="in x's dtype"):
        gemv_triton(x, w, rms_norm=(nw.double(), 1e-5))
    with pytest.raises(ValueError, match="residual must be"):
        gemv_triton(x, w, b, residual=torch.zeros(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="residual must be"):
        gemv_triton(x, torch.cat([w, w]), swiglu=True, residual=torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="needs a norm weight"):
        linear(x, w, pre=fu.RMSNorm(nw[:8], 1e-5), impl="ref")
    with pytest.raises(ValueError, match="needs a residual"):
        linear(x, w, post=fu.Residual(torch.zeros(2, 9, device=DEVICE)), impl="ref")


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_pre_and_residual_post_match_their_definitions(impl, dtype):
    """On the CPU they are the pairs (the norm kernel + the projection, the projection + the add)
    (bf16 against float32 math: SwiGLU of bf16 products is off by ~2% in norm)."""
    torch.manual_seed(0)
    x, nw, w, b = rms_inputs(2, 24, 96, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = linear(x, w, b, pre=fu.RMSNorm(nw, 1e-5), impl=impl)
    assert got.dtype == dtype and rel(got, rms_pair(x.float(), nw.float(), w.float(), b.float())) < tol
    wg = torch.cat([w, w.flip(0)])
    g = linear(x, wg, pre=fu.RMSNorm(nw, 1e-5), post=fu.SwiGLU(), impl=impl)
    normed = rms_pair(x.float(), nw.float(), torch.eye(96, device=DEVICE), None)
    assert g.shape == (2, 24) and rel(g, swiglu_pair(normed, wg.float(), None)) < 5 * tol
    r = torch.randn(2, 24, device=DEVICE)
    got = linear(x, w, b, post=fu.Residual(r), impl=impl)
    assert got.dtype == torch.float32 and rel(got, r + gemv_ref(x, w, b).float()) < tol


def test_fused_rms_and_residual_choices_on_the_cpu_stand_in(monkeypatch):
    """The first call of a shape measures the pair against the fused GEMV (stood in for on the CPU by
    the interpreted kernel): whichever wins, the result is the definition's."""
    from declab_kernels.gemv.triton import CONFIGS

    monkeypatch.setattr(G_, "_dense_fusable", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(G_, "_TABLE", {})
    picks = iter(["triton", "torch", "triton", "torch"])

    def choose(x2, weight, bias, key, baseline, fused):
        baseline(weight)
        # the plain projection inside a pair keeps cuBLAS here
        G_._TABLE[key] = {"impl": next(picks) if fused else "torch", "config": CONFIGS[0]}
        return G_._TABLE[key]

    monkeypatch.setattr(G_, "_choose", choose)
    x, nw, w, b = rms_inputs(2, 24, 96)
    for _ in range(2):
        assert rel(linear(x, w, b, pre=fu.RMSNorm(nw, 1e-5), impl="triton"), rms_pair(x, nw, w, b)) < 1e-5
        G_._TABLE.clear()
    r = torch.randn(2, 24, device=DEVICE)
    for _ in range(2):
        assert rel(linear(x, w, b, post=fu.Residual(r), impl="triton"), r + gemv_ref(x, w, b)) < 1e-5
        G_._TABLE.clear()


@gpu_only
@pytest.mark.parametrize("M", [1, 3])
def test_gpu_gemv_rms_norm_and_residual_bf16(M):
    from declab_kernels.gemv.triton import CONFIGS, config_fits, gemv_triton

    N, K = 3072, 2048
    x, nw, w, _ = rms_inputs(M, N, K, dtype=torch.bfloat16, bias=False)
    want = rms_pair(x.float(), nw.float(), w.float(), None)
    for r_dtype in (torch.bfloat16, torch.float32):
        r = torch.randn(M, N, device=DEVICE, dtype=r_dtype)
        want_r = r.float() + gemv_ref(x, w).float()
        for cfg in [c for c in CONFIGS if config_fits(c, M, K)]:
            assert rel(gemv_triton(x, w, config=cfg, rms_norm=(nw, 1e-5)), want) < 1e-2
            got = gemv_triton(x, w, config=cfg, residual=r)
            assert got.dtype == r_dtype and rel(got, want_r) < 1e-2
        assert rel(linear(x, w, post=fu.Residual(r), impl="triton"), want_r) < 1e-2
        rec = choice(M, N, K, post="residual:" + str(r_dtype).removeprefix("torch."))
        assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0
    assert rel(linear(x, w, pre=fu.RMSNorm(nw, 1e-5), impl="triton"), want) < 1e-2
    xw, sumsq = scale_inputs(x, nw, 64)
    for cfg in [c for c in CONFIGS if config_fits(c, M, K)]:
        assert rel(gemv_triton(xw, w, config=cfg, rms_scale=(sumsq, 1e-5)), want) < 1e-2
    assert rel(linear(xw, w, pre=fu.RMSScale(sumsq, 1e-5), impl="triton"), want) < 1e-2
    assert choice(M, N, K, pre="rms_scale")["triton_us"] > 0
    # The residual's norm from the epilogue (bf16 and float32 residuals), for every configuration, into the
    # next GEMV.
    nw_next = (torch.rand(N, device=DEVICE) + 0.5).to(torch.bfloat16)
    w2 = (torch.randn(1024, N, device=DEVICE) * N ** -0.5).to(torch.bfloat16)
    for r_dtype in (torch.bfloat16, torch.float32):
        r = torch.randn(M, N, device=DEVICE, dtype=r_dtype)
        want_r = (r.float() + gemv_ref(x, w).float()).to(r_dtype)
        want_n = rms_pair(want_r.float(), nw_next.float(), w2.float(), None)
        for cfg in [c for c in CONFIGS if config_fits(c, M, K)]:
            new, h, ss = gemv_triton(x, w, config=cfg, residual=r, norm_out=nw_next)
            assert new.dtype == r_dtype and rel(new, want_r) < 1e-2
            assert rel(gemv_triton(h, w2, config=cfg, rms_scale=(ss, 1e-5)), want_n) < 1e-2
        new, h, ss = linear(x, w, post=fu.ResidualNorm(r, nw_next), impl="triton")
        assert rel(new, want_r) < 1e-2
        assert rel(linear(h, w2, pre=fu.RMSScale(ss, 1e-5), impl="triton"), want_n) < 1e-2
    assert choice(M, N, K, post="residual_norm:bfloat16")["triton_us"] > 0
    rec = choice(M, N, K, pre="rms_norm")
    assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0
    wg = (torch.randn(2 * 4096, K, device=DEVICE) * K ** -0.5).to(torch.bfloat16)
    want = swiglu_pair(rms_pair(x.float(), nw.float(), torch.eye(K, device=DEVICE), None), wg.float(), None)
    assert rel(linear(x, wg, pre=fu.RMSNorm(nw, 1e-5), post=fu.SwiGLU(), impl="triton"), want) < 1e-2


# ---------------------------------------------------------------------------------------------
# relu^2 folded into the GEMV's prologue (RWKV-7's value projection), SwiGLU into its epilogue
# (llama's gate/up projection)


def sqrelu_inputs(M, N, K, dtype=torch.float32, bias=True):
    """x [M, K] with a row stride of 2K, W [N, K], bias."""
    x = (torch.randn(M, 2 * K, device=DEVICE, dtype=dtype) * 2)[:, 3:3 + K]
    w = (torch.randn(N, K, device=DEVICE) * K ** -0.5).to(dtype)
    b = torch.randn(N, device=DEVICE, dtype=dtype) if bias else None
    return x, w, b


def sqrelu_pair(x, w, b):
    from declab_kernels.rwkv7_fused.ref import sqrelu_ref

    return gemv_ref(sqrelu_ref(x.clone()), w, b)


def swiglu_pair(x, w, b):
    """The unfused pair: the projection rounded to x's dtype, then SwiGLU as its kernel rounds it."""
    from declab_kernels.swiglu.ref import silu_mul_ref

    return silu_mul_ref(gemv_ref(x, w, b))


@pytest.mark.parametrize("kind", [None, "fma-3d-pipelined", "fma-split3", "dot", "dot-split2"])
@pytest.mark.parametrize("M,N,K", [(1, 17, 150), (3, 33, 201)])  # K not a multiple of BLOCK_K
def test_gemv_sqrelu_prologue_matches_ref(kind, M, N, K, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    x, w, b = sqrelu_inputs(M, N, K)
    before = x.clone()
    got = gemv_triton(x, w, b, config=NORM_KINDS.get(kind), act="sqrelu")
    assert got.shape == (M, N) and not got.isnan().any()
    assert rel(got, sqrelu_pair(x, w, b)) < 1e-5
    assert torch.equal(x, before)
    # The activation matters: without it the product is far off.
    assert rel(gemv_triton(x, w, b, config=NORM_KINDS.get(kind)), got) > 0.1


@pytest.mark.parametrize("kind", [None, "fma-3d-pipelined", "fma-split3", "dot", "dot-split2"])
@pytest.mark.parametrize("M,I,K", [(1, 9, 150), (3, 33, 201), (2, 1, 17)])  # I odd: a half-empty last program
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_swiglu_epilogue_matches_the_pair(kind, M, I, K, bias, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton

    x, w, b = sqrelu_inputs(M, 2 * I, K, bias=bias)
    got = gemv_triton(x, w, b, config=NORM_KINDS.get(kind), swiglu=True)
    assert got.shape == (M, I) and not got.isnan().any()
    assert rel(got, swiglu_pair(x, w, b)) < 1e-5
    # Pairing gate row j with up row j matters: swapping the halves changes the result.
    swapped = torch.cat([w[I:], w[:I]])
    assert rel(gemv_triton(x, swapped, None if b is None else torch.cat([b[I:], b[:I]]), config=NORM_KINDS.get(kind),
                           swiglu=True), got) > 0.02


def test_gemv_swiglu_into_out():
    from declab_kernels.gemv.triton import gemv_triton

    x, w, _ = sqrelu_inputs(2, 40, 64, bias=False)
    out = torch.full((2, 20), float("nan"), device=DEVICE)
    assert gemv_triton(x, w, out=out, swiglu=True) is out
    assert rel(out, swiglu_pair(x, w, None)) < 1e-5
    with pytest.raises(ValueError, match="out must be"):
        gemv_triton(x, w, out=torch.empty(2, 40, device=DEVICE), swiglu=True)


def test_gemv_prologue_epilogue_refuse_bad_input():
    from declab_kernels.gemv.triton import gemv_triton

    x, w, b = sqrelu_inputs(1, 8, 64)
    with pytest.raises(ValueError, match="act must be"):
        gemv_triton(x, w, b, act="gelu")
    with pytest.raises(ValueError, match="no norm"):
        gemv_triton(x, w, b, act="sqrelu", norm=(x, w[0], 1e-5))
    with pytest.raises(ValueError, match=r"\[2I, K\]"):
        gemv_triton(x, w[:7], swiglu=True)
    with pytest.raises(ValueError, match="do not match"):
        linear(x, w[:, :32], pre=fu.SqReLU(), impl="ref")
    with pytest.raises(ValueError, match=r"needs a weight \[2I, K\]"):
        linear(x, w[:7], post=fu.SwiGLU(), impl="ref")


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_sqrelu_pre_matches_the_pair_and_keeps_x(impl):
    """On the CPU it is the unfused pair; x stays as it was unless the caller lends it as scratch."""
    x, w, b = sqrelu_inputs(2, 24, 96)
    x = x.contiguous()
    before = x.clone()
    want = sqrelu_pair(x, w, b)
    assert rel(linear(x, w, b, pre=fu.SqReLU(), impl=impl), want) < 1e-5
    assert torch.equal(x, before)
    assert rel(linear(x, w, b, pre=fu.SqReLU(scratch=True), impl=impl), want) < 1e-5


@pytest.mark.parametrize("pick", ["torch", "triton"])
@pytest.mark.parametrize("scratch", [False, True])
def test_fused_choice_measures_on_a_copy(monkeypatch, pick, scratch):
    """The first call of a shape times the pair and the fused GEMV (stood in for here, on the CPU):
    whatever wins, the result is the pair's, and the timing runs (relu^2 in place, again and again)
    never touch x, even when x is lent as scratch."""
    from declab_kernels.gemv.triton import CONFIGS

    monkeypatch.setattr(G_, "_dense_fusable", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(G_, "_TABLE", {})

    def choose(x2, weight, bias, key, baseline, fused):
        if fused:
            for _ in range(3):
                baseline(weight)
        # the plain projection inside a pair keeps cuBLAS here
        G_._TABLE[key] = {"impl": pick if fused else "torch", "config": CONFIGS[0]}
        return G_._TABLE[key]

    monkeypatch.setattr(G_, "_choose", choose)
    x, w, b = sqrelu_inputs(2, 24, 96)
    x = x.contiguous()
    before = x.clone()
    want = sqrelu_pair(before, w, b)
    assert rel(linear(x, w, b, pre=fu.SqReLU(scratch=scratch), impl="triton"), want) < 1e-5
    if not scratch or pick == "triton":
        assert torch.equal(x, before)
    xs, wg, _ = sqrelu_inputs(2, 48, 96, bias=False)
    assert rel(linear(xs, wg, post=fu.SwiGLU(), impl="triton"), swiglu_pair(xs, wg, None)) < 1e-5
    y, z, nw, wn, bn = norm_inputs(2, 24, 96)
    assert rel(linear(y, wn, bn, pre=fu.GatedRMSNorm(z, nw, 1e-5, 96), impl="triton"), norm_ref(y, z, nw, wn, bn)) < 1e-5


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_swiglu_post_matches_the_pair(impl):
    x, w, b = sqrelu_inputs(2, 48, 96)
    assert rel(linear(x, w, b, post=fu.SwiGLU(), impl=impl), swiglu_pair(x, w, b)) < 1e-5


@gpu_only
@pytest.mark.parametrize("M", [1, 3])
def test_gpu_gemv_sqrelu_and_swiglu_bf16(M):
    from declab_kernels.gemv.triton import CONFIGS, config_fits, gemv_triton

    x, w, _ = sqrelu_inputs(M, 2048, 8192, dtype=torch.bfloat16, bias=False)
    want = sqrelu_pair(x.float(), w.float(), None)
    xs, wg, _ = sqrelu_inputs(M, 2 * 8192, 2048, dtype=torch.bfloat16, bias=False)
    want_g = swiglu_pair(xs.float(), wg.float(), None)
    for cfg in [c for c in CONFIGS if config_fits(c, M, 8192)]:
        assert rel(gemv_triton(x, w, config=cfg, act="sqrelu"), want) < 1e-2
    for cfg in [c for c in CONFIGS if config_fits(c, M, 2048)]:
        assert rel(gemv_triton(xs, wg, config=cfg, swiglu=True), want_g) < 1e-2
    assert rel(linear(x.contiguous(), w, pre=fu.SqReLU(), impl="triton"), want) < 1e-2
    assert rel(linear(xs.contiguous(), wg, post=fu.SwiGLU(), impl="triton"), want_g) < 1e-2
    for rec in (choice(M, 2048, 8192, pre="sqrelu"), choice(M, 16384, 2048, post="swiglu")):
        assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0


# ---------------------------------------------------------------------------------------------
# Row select: S inputs, each weight row block multiplied by its own input (RWKV-7's packed r/k/v +
# LoRA down-projections, each of its own token-shift mix)


def select_inputs(S, M, K, splits, dtype=torch.float32, bias=True):
    x = torch.randn(S, M, K, device=DEVICE).to(dtype)
    w = (torch.randn(splits[-1], K, device=DEVICE) * K ** -0.5).to(dtype)
    b = torch.randn(splits[-1], device=DEVICE).to(dtype) if bias else None
    return x, w, b


def select_ref(x, w, b, splits):
    """Input i times weight rows splits[i]:splits[i + 1], block by block, in float32."""
    return torch.cat([gemv_ref(x[i].float(), w[a:c].float(), None if b is None else b[a:c].float())
                      for i, (a, c) in enumerate(zip(splits, splits[1:]))], -1)


# Blocks of 16, 32, none and 48 rows (the split points share the factor 16), and an odd last block.
SPLITS = (0, 16, 48, 48, 96, 101)


@pytest.mark.parametrize("kind", ["fma", "fma-split3", "fma-split4-pipelined", "dot"])
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_select_matches_blockwise_products(kind, M, nan_empty):
    from declab_kernels.gemv.triton import gemv_triton, select_align

    assert select_align(SPLITS) == 16
    x, w, b = select_inputs(len(SPLITS) - 1, M, 150, SPLITS)
    got = gemv_triton(x, w, b, config=KINDS[kind], select=SPLITS)
    assert got.shape == (M, SPLITS[-1]) and not got.isnan().any()
    assert rel(got, select_ref(x, w, b, SPLITS)) < 1e-5
    # Each block really takes its own input: the same weights against input 0 everywhere differ.
    assert rel(got, gemv_ref(x[0], w, b)) > 0.1


def test_gemv_select_default_config_and_refusals():
    from declab_kernels.gemv.triton import config_fits, gemv_triton, select_align

    x, w, b = select_inputs(3, 1, 64, (0, 8, 8, 40))
    assert rel(gemv_triton(x, w, b, select=(0, 8, 8, 40)), select_ref(x, w, b, (0, 8, 8, 40))) < 1e-5
    # BLOCK_N must divide every split point: 8 rules out 16-row blocks, one input allows any.
    assert select_align((0, 8, 8, 40)) == 8 and select_align((0, 40)) == 64
    assert not config_fits(_as_triton_config(KINDS["dot"]), 1, 64, select=8)
    with pytest.raises(ValueError, match="does not divide"):
        gemv_triton(x, w, config=KINDS["dot"], select=(0, 8, 8, 40))
    with pytest.raises(ValueError, match="row splits rising"):
        gemv_triton(x, w, select=(0, 8, 40))
    with pytest.raises(ValueError, match="row splits rising"):
        gemv_triton(x, w, select=(0, 16, 8, 40))
    with pytest.raises(ValueError, match="no norm"):
        gemv_triton(x, w, select=(0, 8, 8, 40), act="sqrelu")
    with pytest.raises(ValueError, match="gemv: needs x"):
        gemv_triton(x[0], w, select=(0, 40))
    with pytest.raises(ValueError, match="select: needs"):
        linear(x, w, pre=fu.Select((0, 8, 40)), impl="ref")


def _as_triton_config(kw):
    from declab_kernels.gemv.triton import _as_config

    return _as_config(kw)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_select_pre_is_blockwise_f_linear(impl, monkeypatch):
    """On the CPU (and with impl="ref") it is each input's block by F.linear; with the fused path
    stood in for on the CPU, both picks give the same columns."""
    from declab_kernels.gemv.triton import CONFIGS

    x, w, b = select_inputs(5, 2, 96, SPLITS)
    want = select_ref(x, w, b, SPLITS)
    assert rel(linear(x, w, b, pre=fu.Select(SPLITS), impl=impl).cat(), want) < 1e-5
    if impl == "ref":
        return
    monkeypatch.setattr(G_, "_dense_fusable", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(G_, "_TABLE", {})
    picks = iter(["triton", "torch"])

    def choose(x2, weight, bias, key, baseline, fused):
        assert fused == {"select": SPLITS}
        baseline(weight)
        G_._TABLE[key] = {"impl": next(picks), "config": CONFIGS[0]}
        return G_._TABLE[key]

    monkeypatch.setattr(G_, "_choose", choose)
    for _ in range(2):
        assert rel(linear(x, w, b, pre=fu.Select(SPLITS), impl="triton").cat(), want) < 1e-5
        G_._TABLE.clear()


@gpu_only
@pytest.mark.parametrize("M", [1, 4])
def test_gpu_select_pre_bf16(M):
    from declab_kernels.gemv.triton import CONFIGS, config_fits, gemv_triton, select_align

    # rwkv7-1.5b's packed down-projection: r, k, v (+ v's LoRA), w, a and g LoRAs
    C = 2048
    splits = (0, C, 2 * C, 3 * C + 64, 3 * C + 160, 3 * C + 256, 3 * C + 512)
    x, w, _ = select_inputs(6, M, C, splits, dtype=torch.bfloat16, bias=False)
    want = select_ref(x, w, None, splits)
    fits = [c for c in CONFIGS if config_fits(c, M, C, select_align(splits))]
    assert fits
    for cfg in fits:
        assert rel(gemv_triton(x, w, config=cfg, select=splits), want) < 1e-2
    assert rel(linear(x, w, pre=fu.Select(splits), impl="triton").cat(), want) < 1e-2
    rec = choice(M, splits[-1], C, pre="select:" + str(splits))
    assert rec["impl"] in ("triton", "torch") and rec["triton_us"] > 0 and rec["torch_us"] > 0
