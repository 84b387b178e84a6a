"""WKV-7 tests: chunked reference vs recurrent reference, Triton chunk and step vs reference, and the
factored (training) form's outputs and gradients vs the recurrence.

On the CPU the Triton kernels run under the interpreter (small odd sizes, float32); the
GPU-marked tests run the rwkv7-1.5b shape (H=32, K=V=64) with bf16 inputs.
"""

import pytest
import torch

from declab_kernels.wkv7 import wkv7_chunk, wkv7_step
from declab_kernels.wkv7 import ref as wkv7_ref
from declab_kernels.wkv7.ref import rwkv7_inputs, wkv7_chunk_factored, wkv7_chunk_ref, wkv7_recurrent_ref, wkv7_step_ref
from declab_kernels.wkv7.triton import wkv7_chunk_triton, wkv7_step_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
# The chunked kernel runs its dots in tf32 on the GPU (the interpreter computes in float32): the
# relative error a float32 comparison through it allows there.
CHUNK_TOL = 1e-4 if DEVICE == "cpu" else 2e-3


def rel(x, y):
    """Relative RMS error ||x - y|| / ||y||."""
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm()).item()


def make(B, T, H, K, V, *, seed=0, dtype=torch.float32, device=DEVICE):
    g = torch.Generator(device=device).manual_seed(seed)
    x = rwkv7_inputs(B, T, H, K, V, dtype=dtype, device=device, generator=g)
    h0 = 0.3 * torch.randn(B, H, K, V, generator=g, device=device)
    return x, h0


@pytest.mark.parametrize("T", [1, 5, 37, 100])
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_ref_matches_recurrent_ref(T, chunk_size):
    x, h0 = make(2, T, 3, 16, 24, seed=T)
    o_rec, s_rec = wkv7_recurrent_ref(*x, scale=0.7, initial_state=h0)
    o_chk, s_chk = wkv7_chunk_ref(*x, scale=0.7, initial_state=h0, chunk_size=chunk_size)
    assert rel(o_chk, o_rec) < 1e-5
    assert rel(s_chk, s_rec) < 1e-5


def test_recurrent_ref_matches_fla_naive():
    """Conventions cross-check: fla's DPLR recurrence (q=r, alpha=a, beta=b, gk=w, scale K^-0.5)."""
    naive = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    x, h0 = make(2, 19, 3, 16, 24, seed=11, device="cpu")
    r, w, k, v, a, b = (y.transpose(1, 2).contiguous() for y in x)
    o_fla, s_fla = naive.dplr_recurrence(r, k, v, a, b, w, initial_state=h0.clone())
    o_ref, s_ref = wkv7_recurrent_ref(*x, scale=16**-0.5, initial_state=h0)
    assert rel(o_ref, o_fla.transpose(1, 2)) < 1e-5
    assert rel(s_ref, s_fla) < 1e-5


@pytest.mark.parametrize("T,K,V", [(1, 16, 16), (5, 16, 16), (37, 32, 16), (100, 24, 20)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_triton_matches_ref(T, K, V, with_h0):
    x, h0 = make(2, T, 2, K, V, seed=T + K)
    h0 = h0 if with_h0 else None
    B, H = 2, 2
    out = torch.full((B, T, H, V), float("nan"), device=DEVICE)
    state = torch.full((B, H, K, V), float("nan"), device=DEVICE)
    o, s = wkv7_chunk_triton(*x, scale=0.7, initial_state=h0, out=out, final_state=state)
    o_ref, s_ref = wkv7_recurrent_ref(*x, scale=0.7, initial_state=h0)
    assert not o.isnan().any() and not s.isnan().any()
    assert rel(o, o_ref) < CHUNK_TOL
    assert rel(s, s_ref) < CHUNK_TOL


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_triton_other_chunks_and_segments(chunk_size):
    x, h0 = make(1, 77, 2, 16, 16, seed=chunk_size)
    o_ref, s_ref = wkv7_recurrent_ref(*x, initial_state=h0)
    o, s = wkv7_chunk_triton(*x, initial_state=h0, chunk_size=chunk_size)
    assert rel(o, o_ref) < CHUNK_TOL and rel(s, s_ref) < CHUNK_TOL
    # why: a tiny segment budget forces one chunk per segment, exercising the state carried across segments
    o, s = wkv7_chunk_triton(*x, initial_state=h0, chunk_size=chunk_size, segment_floats=1)
    assert rel(o, o_ref) < CHUNK_TOL and rel(s, s_ref) < CHUNK_TOL


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("split", [1, 16, 23])
def test_state_handoff(impl, split):
    """wkv7_chunk on [0:split] then [split:T] with the state handed over equals one call."""
    T = 41
    x, h0 = make(1, T, 2, 16, 16, seed=split)
    o_all, s_all = wkv7_chunk(*x, initial_state=h0, impl=impl)
    o1, s1 = wkv7_chunk(*(y[:, :split] for y in x), initial_state=h0, impl=impl)
    o2, s2 = wkv7_chunk(*(y[:, split:] for y in x), initial_state=s1, impl=impl)
    tol = 1e-5 if impl == "ref" or DEVICE == "cpu" else CHUNK_TOL
    assert rel(torch.cat([o1, o2], 1), o_all) < tol
    assert rel(s2, s_all) < tol


@pytest.mark.parametrize("B,H,K,V", [(1, 2, 16, 16), (3, 2, 32, 16), (2, 3, 24, 20)])
def test_step_triton_matches_ref(B, H, K, V):
    x, h0 = make(B, 1, H, K, V, seed=K + V)
    x = [y[:, 0] for y in x]
    s_tri, s_ref = h0.clone(), h0.clone()
    out = torch.full((B, H, V), float("nan"), device=DEVICE)
    o = wkv7_step_triton(*x, s_tri, scale=0.7, out=out)
    o_ref = wkv7_step_ref(*x, s_ref, scale=0.7)
    assert o.data_ptr() == out.data_ptr()
    assert not o.isnan().any()
    assert rel(o, o_ref) < 1e-5
    assert rel(s_tri, s_ref) < 1e-5


def test_step_triton_strided_inputs():
    """r, w, k, a, b as views into one fused projection output, v and state as slices of pools."""
    B, H, K, V = 2, 2, 16, 16
    x, h0 = make(B, 1, H, K, V, seed=5)
    x = [y[:, 0] for y in x]
    r, w, k, v, a, b = x
    fused = torch.stack([r, w, k, a, b], dim=2)
    pool = torch.zeros(3, B, H, K, V, device=DEVICE)
    pool[1] = h0
    views = [fused[:, :, i] for i in range(5)]
    o = wkv7_step_triton(views[0], views[1], views[2], v, views[3], views[4], pool[1])
    s_ref = h0.clone()
    o_ref = wkv7_step_ref(r, w, k, v, a, b, s_ref)
    assert rel(o, o_ref) < 1e-5 and rel(pool[1], s_ref) < 1e-5
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_step_token_by_token_equals_chunk(impl):
    T, B, H, K, V = 21, 2, 2, 16, 16
    x, h0 = make(B, T, H, K, V, seed=7)
    o_chunk, s_chunk = wkv7_chunk(*x, scale=0.5, initial_state=h0, impl=impl)
    state = h0.clone()
    out = torch.full((B, H, V), float("nan"), device=DEVICE)
    o_steps = []
    for t in range(T):
        o_steps.append(wkv7_step(*(y[:, t] for y in x), state, scale=0.5, impl=impl, out=out).clone())
    tol = 1e-4 if impl == "ref" else CHUNK_TOL
    assert rel(torch.stack(o_steps, 1), o_chunk) < tol
    assert rel(state, s_chunk) < tol


def test_impl_must_be_resolved():
    x, h0 = make(1, 3, 1, 16, 16)
    with pytest.raises(ValueError):
        wkv7_chunk(*x, impl="auto")


@gpu
@pytest.mark.parametrize("T", [1, 1000])
def test_chunk_triton_matches_ref_gpu_1p5b(T):
    x, h0 = make(2, T, 32, 64, 64, seed=T, dtype=torch.bfloat16)
    out = torch.full((2, T, 32, 64), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    state = torch.full((2, 32, 64, 64), float("nan"), device=DEVICE)
    o, s = wkv7_chunk_triton(*x, initial_state=h0, out=out, final_state=state)
    o_ref, s_ref = wkv7_chunk_ref(*(y.float() for y in x), initial_state=h0)
    assert o.dtype == torch.bfloat16
    assert rel(o, o_ref) < 1e-2
    assert rel(s, s_ref) < CHUNK_TOL


@gpu
def test_chunk_triton_matches_recurrent_ref_gpu_long():
    """4100 tokens over several segments, against the token-by-token recurrence."""
    x, h0 = make(1, 4100, 4, 64, 64, seed=1)
    o, s = wkv7_chunk_triton(*x, initial_state=h0, segment_floats=1 << 20)
    o_ref, s_ref = wkv7_recurrent_ref(*x, initial_state=h0)
    assert rel(o, o_ref) < CHUNK_TOL and rel(s, s_ref) < CHUNK_TOL


@gpu
@pytest.mark.parametrize("B", [1, 5, 128])
def test_step_triton_matches_ref_gpu_1p5b(B):
    x, h0 = make(B, 1, 32, 64, 64, seed=B, dtype=torch.bfloat16)
    x = [y[:, 0] for y in x]
    s_tri, s_ref = h0.clone(), h0.clone()
    out = torch.full((B, 32, 64), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    wkv7_step(*x, s_tri, impl="triton", out=out)
    o_ref = wkv7_step_ref(*(y.float() for y in x), s_ref)
    assert rel(out, o_ref) < 1e-2
    assert rel(s_tri, s_ref) < 1e-5


@gpu
def test_step_cuda_graph_gpu():
    B, H, K, V = 4, 32, 64, 64
    x, h0 = make(B, 1, H, K, V, seed=3, dtype=torch.bfloat16)
    x = [y[:, 0] for y in x]
    state = h0.clone()
    out = torch.empty(B, H, V, device=DEVICE, dtype=torch.bfloat16)
    wkv7_step(*x, state, impl="triton", out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wkv7_step(*x, state, impl="triton", out=out)
    state.copy_(h0)
    out.fill_(float("nan"))
    graph.replay()
    s_ref = h0.clone()
    o_ref = wkv7_step_ref(*(y.float() for y in x), s_ref)
    assert rel(out, o_ref) < 1e-2 and rel(state, s_ref) < 1e-5


def recurrence(r, w, k, v, a, b, h0, scale):
    """The WKV-7 recurrence written without in-place updates, so autograd differentiates it (the
    definition `wkv7_recurrent_ref` implements, in the inputs' dtype)."""
    S, outs = h0, []
    for t in range(r.shape[1]):
        sa = torch.einsum("bhk,bhkv->bhv", a[:, t], S)
        S = torch.exp(w[:, t])[..., None] * S + b[:, t, ..., None] * sa[:, :, None]
        S = S + k[:, t, ..., None] * v[:, t, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", r[:, t], S))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("T,chunk_size", [(1, 16), (37, 16), (100, 32), (130, 64)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_factored_matches_recurrent_ref(T, chunk_size, with_h0):
    x, h0 = make(2, T, 3, 16, 24, seed=T, device="cpu")
    h0 = h0 if with_h0 else None
    o_rec, s_rec = wkv7_recurrent_ref(*x, scale=0.7, initial_state=h0)
    o, s = wkv7_chunk_factored(*x, scale=0.7, initial_state=h0, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel(o, o_rec) < 1e-5
    assert rel(s, s_rec) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_factored_gradients_match_recurrence(dtype, tol, with_h0):
    """Gradients w.r.t. r, w, k, v, a, b and the initial state, over a length that is not a multiple of
    the chunk, against autograd through the token-by-token recurrence."""
    x, h0 = make(2, 45, 2, 16, 12, seed=5, device="cpu")
    assert rel(recurrence(*x, h0, 0.7)[0], wkv7_recurrent_ref(*x, scale=0.7, initial_state=h0)[0]) < 1e-5
    g = torch.Generator().manual_seed(1)
    go, gs = torch.randn(2, 45, 2, 12, generator=g, dtype=dtype), torch.randn(2, 2, 16, 12, generator=g, dtype=dtype)

    def grads(fn):
        leaves = [y.to(dtype).requires_grad_() for y in x] + ([h0.to(dtype).requires_grad_()] if with_h0 else [])
        o, s = fn(*leaves[:6], leaves[6] if with_h0 else torch.zeros(2, 2, 16, 12, dtype=dtype))
        return torch.autograd.grad((o * go).sum() + (s * gs).sum(), leaves)

    want = grads(lambda *y: recurrence(*y, 0.7))
    got = grads(lambda *y: wkv7_chunk_factored(*y[:6], scale=0.7, initial_state=y[6], chunk_size=16))
    for gg, gw in zip(got, want):
        assert gg.dtype == dtype and ((gg - gw).norm() / gw.norm()).item() < tol


def test_chunk_factored_ignores_autocast():
    """Under bf16 autocast the factored form still computes in float32: the same result bit for bit."""
    x, h0 = make(2, 40, 2, 16, 16, seed=2, device="cpu")
    o, s = wkv7_chunk_factored(*x, initial_state=h0, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o2, s2 = wkv7_chunk_factored(*x, initial_state=h0, chunk_size=16)
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_chunk_factored_segments_carry_the_state(monkeypatch):
    """A tiny segment budget (one chunk per segment) gives the one-segment result."""
    x, h0 = make(2, 77, 2, 16, 16, seed=4, device="cpu")
    o, s = wkv7_chunk_factored(*x, initial_state=h0, chunk_size=16)
    monkeypatch.setattr(wkv7_ref, "FACTORED_SEGMENT_FLOATS", 1)
    o2, s2 = wkv7_chunk_factored(*x, initial_state=h0, chunk_size=16)
    assert rel(o2, o) < 1e-6 and rel(s2, s) < 1e-6


def test_chunk_factored_refuses_decay_beyond_its_bound():
    """exp(-w) over half a chunk past exp(FACTORED_MAX_EXP) is refused, not silently overflowed."""
    r, w, k, v, a, b = make(1, 64, 1, 16, 16, device="cpu")[0]
    with pytest.raises(RuntimeError, match="FACTORED_MAX_EXP"):
        wkv7_chunk_factored(r, torch.full_like(w, -3.0), k, v, a, b, chunk_size=64)
    # the same decay in chunks of 16 stays within the bound (8 * 3 < 60) and matches the recurrence
    o, s = wkv7_chunk_factored(r, torch.full_like(w, -3.0), k, v, a, b, chunk_size=16)
    o_rec, s_rec = wkv7_recurrent_ref(r, torch.full_like(w, -3.0), k, v, a, b)
    assert rel(o, o_rec) < 1e-5 and rel(s, s_rec) < 1e-5
