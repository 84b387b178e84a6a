"""Tests for declab_kernels/ssd: chunked ref vs recurrent ref, triton vs ref, state handoff, decode vs scan.

On the CPU the Triton kernels run under the interpreter (small odd sizes, float32); tests marked
for the GPU use the mamba2-1.3b shapes in bf16.
"""

import pytest
import torch

from declab_kernels import ssd

GPU = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    """Relative RMS error ||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def scan_inputs(Bsz, T, H, P, G, N, opts, *, dtype=torch.float32, seed=0, device=DEV):
    """Random inputs for ssd_chunk_scan; opts in {"none", "all", "limit"} picks the optional features."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    x = rnd(Bsz, T, H, P).to(dtype)
    B = rnd(Bsz, T, G, N, scale=N**-0.5).to(dtype)
    C = rnd(Bsz, T, G, N, scale=N**-0.5).to(dtype)
    A = -torch.exp(rnd(H, scale=0.5))
    kw = {}
    if opts == "none":
        # Without softplus dt is used as given: keep it positive.
        dt = (torch.rand(Bsz, T, H, generator=g) * 0.2 + 0.01).to(device)
    else:
        dt = rnd(Bsz, T, H)
        kw.update(dt_bias=rnd(H, scale=0.5) - 2.0, dt_softplus=True)
    if opts == "all":
        kw.update(D=rnd(H), z=rnd(Bsz, T, H, P).to(dtype))
    if opts == "limit":
        kw.update(dt_limit=(0.05, 0.3))
    return (x, dt.to(dtype), A, B, C), kw


def test_impl_must_be_resolved():
    (x, dt, A, B, C), kw = scan_inputs(1, 5, 2, 16, 1, 16, "none")
    with pytest.raises(ValueError):
        ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16, impl="auto", **kw)


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (64, 64), (200, 64)])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("opts", ["none", "all", "limit"])
def test_ref_chunked_matches_ref_recurrent(T, chunk, G, opts):
    (x, dt, A, B, C), kw = scan_inputs(2, T, 4, 16, G, 16, opts)
    s0 = torch.randn(2, 4, 16, 16, device=DEV)
    y, s = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk, initial_state=s0, impl="ref", **kw)
    y_rec, s_rec = ssd.ssd_recurrent_ref(x, dt, A, B, C, chunk_size=chunk, initial_state=s0, **kw)
    assert rel(y, y_rec) < 1e-5
    assert rel(s, s_rec) < 1e-5


@pytest.mark.parametrize("G,opts", [(1, "all"), (2, "limit")])
def test_ref_chunked_gradients_match_ref_recurrent(G, opts):
    """Autograd through the chunked reference (the training path) equals autograd through the
    token-by-token recurrence, for every input, over a length that is not a multiple of the chunk."""
    (x, dt, A, B, C), kw = scan_inputs(2, 45, 4, 16, G, 16, opts, seed=G, device="cpu")
    s0 = torch.randn(2, 4, 16, 16)
    g = torch.Generator().manual_seed(7)
    gy, gs = torch.randn(2, 45, 4, 16, generator=g), torch.randn(2, 4, 16, 16, generator=g)

    def grads(fn):
        named = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "initial_state": s0,
                 **{k: v for k, v in kw.items() if isinstance(v, torch.Tensor)}}
        leaves = {k: v.clone().requires_grad_() for k, v in named.items()}
        pos = [leaves.pop(k) for k in ("x", "dt", "A", "B", "C")]
        y, s = fn(*pos, chunk_size=16, **{**kw, **leaves})
        return torch.autograd.grad((y * gy).sum() + (s * gs).sum(), pos + list(leaves.values()))

    want = grads(ssd.ssd_recurrent_ref)
    got = grads(lambda *a, **k: ssd.ssd_chunk_scan(*a, impl="ref", **k))
    for gg, gw in zip(got, want):
        assert rel(gg, gw) < 1e-5


@pytest.mark.parametrize("T,G,opts", [(1, 1, "none"), (1, 2, "all"), (37, 1, "limit"), (37, 2, "all"),
                                      (37, 1, "none"), (200, 1, "all"), (200, 2, "none"), (200, 2, "limit")])
def test_triton_scan_matches_ref(T, G, opts, nan_empty):
    (x, dt, A, B, C), kw = scan_inputs(2, T, 4, 16, G, 16, opts, seed=T + G)
    s0 = torch.randn(2, 4, 16, 16, device=DEV) if opts != "none" else None
    y, s = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=64, initial_state=s0, impl="triton", **kw)
    y_ref, s_ref = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=64, initial_state=s0, impl="ref", **kw)
    assert y.dtype == x.dtype and s.dtype == torch.float32
    assert rel(y, y_ref) < 1e-5
    assert rel(s, s_ref) < 1e-5


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("split", [1, 50])
def test_scan_state_handoff(impl, split):
    """Scanning [0:t] then [t:T] from its final state equals one scan of [0:T]."""
    T = 130
    (x, dt, A, B, C), kw = scan_inputs(1, T, 4, 16, 2, 16, "all", seed=split)
    y, s = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=32, impl=impl, **kw)

    def part(sl, init):
        kws = dict(kw, z=kw["z"][:, sl])
        return ssd.ssd_chunk_scan(x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], chunk_size=32, initial_state=init,
                                  impl=impl, **kws)

    y1, s1 = part(slice(0, split), None)
    y2, s2 = part(slice(split, T), s1)
    assert rel(torch.cat([y1, y2], dim=1), y) < 1e-5
    assert rel(s2, s) < 1e-5


def conv_inputs(Bsz, T, Cdim, W, seed=0, dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bsz, T, Cdim, generator=g).to(device, dtype)
    w = (torch.randn(Cdim, W, generator=g) * W**-0.5).to(device, dtype)
    b = torch.randn(Cdim, generator=g).to(device, dtype)
    init = torch.randn(Bsz, Cdim, W - 1, generator=g).to(device, dtype)
    return x, w, b, init


@pytest.mark.parametrize("T", [1, 2, 37, 150])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_triton_causal_conv1d_matches_ref(T, with_init, bias, activation, nan_empty):
    x, w, b, init = conv_inputs(2, T, 131, 4, seed=T)
    kw = dict(initial_state=init if with_init else None, activation=activation)
    y, fin = ssd.causal_conv1d(x, w, b if bias else None, impl="triton", **kw)
    y_ref, fin_ref = ssd.causal_conv1d(x, w, b if bias else None, impl="ref", **kw)
    assert rel(y, y_ref) < 1e-6
    assert torch.equal(fin, fin_ref)


def test_ref_causal_conv1d_state_is_last_inputs():
    x, w, b, init = conv_inputs(2, 2, 8, 4)
    _, fin = ssd.causal_conv1d(x, w, b, initial_state=init, impl="ref")
    assert torch.equal(fin, torch.cat([init[..., 2:], x.transpose(1, 2)], dim=-1))


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("split", [1, 2, 40])
def test_causal_conv1d_handoff(impl, split):
    """Conv of [0:t] then [t:T] from its final window equals one pass."""
    x, w, b, init = conv_inputs(2, 75, 67, 4, seed=split)
    y, fin = ssd.causal_conv1d(x, w, b, initial_state=init, impl=impl)
    y1, f1 = ssd.causal_conv1d(x[:, :split], w, b, initial_state=init, impl=impl)
    y2, f2 = ssd.causal_conv1d(x[:, split:], w, b, initial_state=f1, impl=impl)
    assert rel(torch.cat([y1, y2], dim=1), y) < 1e-6
    assert torch.equal(f2, fin)


def decode_inputs(Bsz, H, P, G, N, W, *, dtype=torch.float32, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    Cdim = H * P + 2 * G * N
    return dict(
        xBC=rnd(Bsz, Cdim).to(dtype),
        dt=rnd(Bsz, H).to(dtype),
        conv_state=rnd(Bsz, Cdim, W).to(dtype),
        conv_weight=rnd(Cdim, W, scale=W**-0.5).to(dtype),
        conv_bias=rnd(Cdim, scale=0.1).to(dtype),
        ssm_state=rnd(Bsz, H, P, N),
        A=-torch.exp(rnd(H, scale=0.5)),
        D=rnd(H),
        dt_bias=rnd(H, scale=0.5) - 2.0,
        # Rows at different slots of their rings, row 1 past position 2^31 (int64 positions).
        positions=(torch.arange(Bsz) * 5 + seed + 3 + (torch.arange(Bsz) == 1) * W * 2**29).to(device),
    ), rnd(Bsz, H, P).to(dtype)


@pytest.mark.parametrize("Bsz,H,P,G,N", [(1, 4, 16, 1, 16), (3, 4, 16, 2, 16), (2, 6, 24, 3, 20)])
@pytest.mark.parametrize("gate,dt_limit", [(False, (0.0, float("inf"))), (True, (0.02, 0.2))])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_decode_step_matches_ref(Bsz, H, P, G, N, gate, dt_limit, bias):
    args, z = decode_inputs(Bsz, H, P, G, N, 4, seed=Bsz + G)
    if not bias:
        args["conv_bias"] = None
    results = {}
    for impl in ("triton", "ref"):
        a = {k: v.clone() if v is not None else None for k, v in args.items()}
        out = torch.full((Bsz, H, P), float("nan"), device=DEV)
        y = ssd.mamba2_decode_step(**a, ngroups=G, headdim=P, dt_limit=dt_limit, z=z if gate else None, impl=impl,
                                   out=out)
        assert y is out
        results[impl] = (y, a["conv_state"], a["ssm_state"])
    for got, want in zip(results["triton"], results["ref"]):
        assert rel(got, want) < 1e-5
    # Both states really moved (in place): the token's input went into its slot of the ring, the
    # other slots kept theirs.
    assert not torch.equal(results["ref"][2], args["ssm_state"])
    slot = args["positions"] % 4
    for b in range(Bsz):
        ring, old = results["triton"][1][b], args["conv_state"][b]
        assert torch.equal(ring[:, slot[b]], args["xBC"][b])
        keep = torch.arange(4, device=DEV) != slot[b]
        assert torch.equal(ring[:, keep], old[:, keep])


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_decode_step_reads_the_ring_before_its_position(impl):
    """The conv over slots (p+1..p+W-1) % W, oldest first, then the token: against a linear window
    built by hand, for every slot the token can take."""
    Bsz, H, P, G, N, W = 4, 2, 16, 1, 16, 4
    args, _ = decode_inputs(Bsz, H, P, G, N, W, seed=11)
    args["positions"] = torch.tensor([0, 5, 10, 15], device=DEV)
    args["D"] = torch.zeros_like(args["D"])
    args["ssm_state"] = torch.zeros_like(args["ssm_state"])
    ring = args["conv_state"].clone()
    y = ssd.mamba2_decode_step(**args, ngroups=G, headdim=P, impl=impl)
    # With a zero state and D, y = dt * x (B . C): x is the conv of the hand-built window.
    for b, p in enumerate(args["positions"].tolist()):
        window = torch.stack([ring[b, :, (p - W + 1 + j) % W] for j in range(W - 1)] + [args["xBC"][b]], dim=-1)
        xbc = torch.nn.functional.silu((window * args["conv_weight"]).sum(-1) + args["conv_bias"])
        x = xbc[: H * P].reshape(H, P)
        Bv, Cv = xbc[H * P: H * P + N], xbc[H * P + N:]
        dt = torch.nn.functional.softplus(args["dt"][b] + args["dt_bias"])
        assert rel(y[b], (dt[:, None] * x) * (Bv @ Cv)) < 1e-5


@pytest.mark.parametrize("Bsz,H,P,G,N", [(1, 4, 16, 1, 16), (2, 6, 24, 3, 20)])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_decode_step_norm_is_the_gated_rmsnorm(Bsz, H, P, G, N, impl):
    """With norm=(weight, sumsq): the result times rsqrt(mean of the row's g^2 + eps) is the gated RMSNorm
    of the plain step's output (one group), and sumsq holds each head's sum of the rounded g^2."""
    from declab_kernels import mamba2_norm

    args, z = decode_inputs(Bsz, H, P, G, N, 4, seed=3)
    nw = torch.randn(H * P, generator=torch.Generator().manual_seed(5)).to(DEV)
    plain = {k: v.clone() for k, v in args.items()}
    y = ssd.mamba2_decode_step(**plain, ngroups=G, headdim=P, impl="ref").reshape(Bsz, H * P)
    want = mamba2_norm.gated_rmsnorm(y, z.reshape(Bsz, H * P), nw, H * P, 1e-5, impl="ref")
    g_want = (y.float() * torch.nn.functional.silu(z.reshape(Bsz, H * P).float())).reshape(Bsz, H, P)

    normed = {k: v.clone() for k, v in args.items()}
    sumsq = torch.full((Bsz, H), float("nan"), device=DEV)
    out = ssd.mamba2_decode_step(**normed, ngroups=G, headdim=P, z=z, impl=impl, norm=(nw, sumsq)).reshape(Bsz, H * P)
    assert rel(sumsq, g_want.square().sum(-1)) < 1e-5
    got = out.float() * torch.rsqrt(sumsq.sum(-1, keepdim=True) / (H * P) + 1e-5)
    assert rel(got, want) < 1e-5
    # The states move exactly as without the norm.
    assert rel(normed["ssm_state"], plain["ssm_state"]) < 1e-6
    assert torch.equal(normed["conv_state"], plain["conv_state"])


def test_decode_step_norm_is_checked():
    args, z = decode_inputs(1, 4, 16, 1, 16, 4)
    nw = torch.ones(64, device=DEV)
    for impl in ("ref", "triton"):
        with pytest.raises(ValueError, match="needs z"):
            ssd.mamba2_decode_step(**args, ngroups=1, headdim=16, impl=impl, norm=(nw, torch.zeros(1, 4, device=DEV)))
        with pytest.raises(ValueError, match="float32 sumsq"):
            ssd.mamba2_decode_step(**args, ngroups=1, headdim=16, z=z, impl=impl,
                                   norm=(nw, torch.zeros(1, 8, device=DEV)))
    from declab_kernels.ssd import triton as tri

    with pytest.raises(ValueError, match="one program a head"):
        tri.mamba2_decode_step(**args, ngroups=1, headdim=16, z=z, block_p=8, norm=(nw, torch.zeros(1, 4, device=DEV)))


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("G", [1, 2])
def test_decode_steps_match_conv_and_scan(impl, G):
    """Token-by-token decode from zero state reproduces causal_conv1d + ssd_chunk_scan over the sequence."""
    Bsz, T, H, P, N, W = 2, 6, 4, 16, 16, 4
    args, _ = decode_inputs(Bsz, H, P, G, N, W, seed=G)
    g = torch.Generator().manual_seed(7)
    Cdim = H * P + 2 * G * N
    xBC = torch.randn(Bsz, T, Cdim, generator=g).to(DEV)
    dt = torch.randn(Bsz, T, H, generator=g).to(DEV)
    z = torch.randn(Bsz, T, H, P, generator=g).to(DEV)

    xbc, conv_fin = ssd.causal_conv1d(xBC, args["conv_weight"], args["conv_bias"], impl=impl)
    x = xbc[..., : H * P].reshape(Bsz, T, H, P)
    Bm = xbc[..., H * P: H * P + G * N].reshape(Bsz, T, G, N)
    Cm = xbc[..., H * P + G * N:].reshape(Bsz, T, G, N)
    y_scan, s_scan = ssd.ssd_chunk_scan(x, dt, args["A"], Bm, Cm, chunk_size=16, D=args["D"], z=z,
                                        dt_bias=args["dt_bias"], dt_softplus=True, impl=impl)

    conv_state = torch.zeros(Bsz, Cdim, W, device=DEV)
    ssm_state = torch.zeros(Bsz, H, P, N, device=DEV)
    ys = []
    for t in range(T):
        ys.append(ssd.mamba2_decode_step(xBC[:, t], dt[:, t], conv_state, args["conv_weight"], args["conv_bias"],
                                         ssm_state, args["A"], args["D"], args["dt_bias"],
                                         positions=torch.full((Bsz,), t, device=DEV), ngroups=G, headdim=P,
                                         z=z[:, t], impl=impl))
    assert rel(torch.stack(ys, dim=1), y_scan) < 1e-5
    assert rel(ssm_state, s_scan) < 1e-5
    # The ring's last W-1 positions are the conv's carried window.
    assert torch.equal(conv_state[..., ssd.conv_window_slots(T, W)], conv_fin)


MAMBA2_13B = dict(H=64, P=64, G=1, N=128, W=4)


@GPU
@pytest.mark.parametrize("T", [1, 4133])
def test_gpu_triton_scan_matches_ref_bf16(T, nan_empty):
    (x, dt, A, B, C), kw = scan_inputs(1, T, 64, 64, 1, 128, "all", dtype=torch.bfloat16)
    s0 = torch.randn(1, 64, 64, 128, device=DEV) * 0.1
    y, s = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=256, initial_state=s0, impl="triton", **kw)
    y_ref, s_ref = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=256, initial_state=s0, impl="ref", **kw)
    assert rel(y, y_ref) < 2e-2
    assert rel(s, s_ref) < 1e-2


@GPU
@pytest.mark.parametrize("chunk", [64, 128])
def test_gpu_triton_scan_chunk_sizes(chunk):
    (x, dt, A, B, C), kw = scan_inputs(2, 1000, 64, 64, 1, 128, "limit", dtype=torch.bfloat16)
    y, s = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk, impl="triton", **kw)
    y_ref, s_ref = ssd.ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk, impl="ref", **kw)
    assert rel(y, y_ref) < 2e-2
    assert rel(s, s_ref) < 1e-2


@GPU
def test_gpu_triton_causal_conv1d_bf16(nan_empty):
    Cdim = 64 * 64 + 2 * 128
    x, w, b, init = conv_inputs(2, 3001, Cdim, 4, dtype=torch.bfloat16)
    y, fin = ssd.causal_conv1d(x, w, b, initial_state=init, impl="triton")
    y_ref, fin_ref = ssd.causal_conv1d(x, w, b, initial_state=init, impl="ref")
    assert rel(y, y_ref) < 1e-2
    assert torch.equal(fin, fin_ref)


@GPU
@pytest.mark.parametrize("state_ready", [False, True])
@pytest.mark.parametrize("Bsz", [1, 64])
def test_gpu_triton_decode_step_bf16_in_cuda_graph(Bsz, state_ready):
    """The 1.3b shape in bf16, captured once in a CUDA graph and replayed for 5 tokens, equals 5 ref steps;
    also with the state loaded before the PDL wait (its inputs change between replays by PyTorch copies,
    which PDL does not overlap)."""
    s = MAMBA2_13B
    args, z = decode_inputs(Bsz, s["H"], s["P"], s["G"], s["N"], s["W"], dtype=torch.bfloat16)
    ref_args = {k: v.clone() for k, v in args.items()}
    out = torch.full((Bsz, s["H"], s["P"]), float("nan"), device=DEV, dtype=torch.bfloat16)
    xs = torch.randn(5, *args["xBC"].shape, device=DEV).to(torch.bfloat16)
    dts = torch.randn(5, *args["dt"].shape, device=DEV).to(torch.bfloat16)
    extra = dict(state_ready=True) if state_ready else {}

    def step():
        ssd.mamba2_decode_step(**args, ngroups=s["G"], headdim=s["P"], impl="triton", out=out, **extra)

    # Warm-up (compilation) on copies, then capture on the real buffers.
    saved = {k: v.clone() for k, v in args.items()}
    step()
    for k in args:
        args[k].copy_(saved[k])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(5):
        args["xBC"].copy_(xs[t])
        args["dt"].copy_(dts[t])
        graph.replay()
        args["positions"] += 1
        ref_args["xBC"].copy_(xs[t])
        ref_args["dt"].copy_(dts[t])
        y_ref = ssd.mamba2_decode_step(**ref_args, ngroups=s["G"], headdim=s["P"], impl="ref")
        ref_args["positions"] += 1
        assert rel(out, y_ref) < 1e-2
    assert rel(args["ssm_state"], ref_args["ssm_state"]) < 1e-3
    assert torch.equal(args["conv_state"], ref_args["conv_state"])
