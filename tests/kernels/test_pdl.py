"""Programmatic dependent launch (PDL): the switch, every decode-step kernel's PDL code path, and on a
GPU, decode-step chains captured in a CUDA graph with PDL on equal to PDL off bit for bit.

On the CPU (interpreter) griddepcontrol cannot run, so `Guard` stands in for it. Each program's
gdc_launch_dependents() saves and poisons every tensor an earlier kernel of a step could write
(activations, residuals, states, caches, tables, workspaces and the outputs: NaN, integers 0), and
its gdc_wait() checks that the program stored nothing into them yet and restores them. A kernel that
loads such data before its wait computes with poison, one that stores before it fails the check;
weights are never poisoned, so loading them before the wait is allowed. Results must equal the
PDL-off launch bit for bit.
"""

import importlib
import os
import re
from pathlib import Path

import pytest
import torch
import triton.language.extra.cuda as tl_cuda

import declab_kernels

GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if GPU else "cpu"
MODULES = declab_kernels.PDL_KERNELS

interpreter_only = pytest.mark.skipif(not INTERPRET, reason="stubs griddepcontrol, which only the interpreter allows")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def gpu_only(test):
    """Marks a test `gpu` and skips it without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not GPU, reason="needs a GPU")(test))


def kmod(name):
    return importlib.import_module(f"declab_kernels.{name}.triton")


# ---------------------------------------------------------------------------------------------
# The switch


def test_pdl_is_off_on_the_cpu_and_with_declab_pdl_0(monkeypatch):
    assert not declab_kernels.pdl("cpu")
    assert not declab_kernels.pdl(torch.device("cpu"))
    if not GPU:
        assert not declab_kernels.pdl()
    monkeypatch.setenv("DECLAB_PDL", "0")
    assert not declab_kernels.pdl()
    assert not declab_kernels.pdl("cuda")


def test_pdl_needs_hopper_no_interpreter_and_no_opt_out(monkeypatch):
    """The decision with a CUDA device faked: capability >= 9, TRITON_INTERPRET unset, DECLAB_PDL != 0."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(declab_kernels, "_capability", lambda index: capability["value"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DECLAB_PDL", raising=False)
    assert declab_kernels.pdl("cuda:0") and declab_kernels.pdl(torch.device("cuda")) and declab_kernels.pdl(0) and declab_kernels.pdl()
    monkeypatch.setenv("DECLAB_PDL", "1")
    assert declab_kernels.pdl("cuda")
    monkeypatch.setenv("DECLAB_PDL", "0")
    assert not declab_kernels.pdl("cuda")
    monkeypatch.delenv("DECLAB_PDL")
    capability["value"] = (8, 0)
    assert not declab_kernels.pdl("cuda")
    capability["value"] = (10, 0)
    assert declab_kernels.pdl("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not declab_kernels.pdl("cuda")
    assert not declab_kernels.pdl("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    # DECLAB_PDL_OFF: off for the named kernel folders only
    monkeypatch.setenv("DECLAB_PDL_OFF", "ssd, mamba2_norm")
    assert not declab_kernels.pdl("cuda", "declab_kernels.ssd.triton")
    assert not declab_kernels.pdl("cuda", "declab_kernels.mamba2_norm.triton")
    assert declab_kernels.pdl("cuda", "declab_kernels.gemv.triton") and declab_kernels.pdl("cuda")
    monkeypatch.setenv("DECLAB_PDL_OFF", "ssd,gemm")
    with pytest.raises(ValueError, match="gemm"):
        declab_kernels.pdl("cuda", "declab_kernels.gemv.triton")


def test_every_pdl_launch_site_names_its_kernel():
    # A launch site that passed no name would ignore DECLAB_PDL_OFF without a word.
    for name in MODULES:
        src = Path(declab_kernels.__file__).parent.joinpath(name, "triton.py").read_text()
        calls = re.findall(r"\bpdl\(([^)]*)\)", src)
        assert calls, name
        assert all(c.endswith("__name__") for c in calls), (name, calls)


# ---------------------------------------------------------------------------------------------
# PDL code paths under the interpreter


class Guard:
    """Stands in for gdc_launch_dependents / gdc_wait (see the module docstring)."""

    def __init__(self):
        self.watched = []
        self.saved = None
        self.launches = 0
        self.waits = 0
        self.errors = []

    def watch(self, *tensors):
        self.watched.extend(t for t in tensors if t is not None)

    @staticmethod
    def _poison(t):
        return float("nan") if t.is_floating_point() else 0

    def launch_dependents(self, *args, **kwargs):
        self.launches += 1
        if self.saved is not None:
            self.errors.append("gdc_launch_dependents called twice before a wait")
            return
        # why: cached workspaces (e.g. the GEMV split-K workspace) may have been made by an earlier test in
        # inference mode, and inference tensors only take in-place writes inside it
        with torch.inference_mode():
            self.saved = [t.clone() for t in self.watched]
            for t in self.watched:
                t.fill_(self._poison(t))

    def wait(self, *args, **kwargs):
        self.waits += 1
        if self.saved is None:
            self.errors.append("gdc_wait without gdc_launch_dependents first")
            return
        for i, t in enumerate(self.watched):
            untouched = t.isnan().all() if t.is_floating_point() else (t == 0).all()
            if not bool(untouched):
                self.errors.append(f"watched tensor {i} {tuple(t.shape)} was stored to before gdc_wait")
        with torch.inference_mode():
            for t, s in zip(self.watched, self.saved):
                t.copy_(s)
        self.saved = None


class _TorchProxy:
    """`torch` for one kernel module: what it allocates is watched by the guard."""

    def __init__(self, guard):
        self._guard = guard

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name in ("empty", "empty_like", "zeros", "zeros_like", "full", "full_like"):
            def alloc(*args, **kwargs):
                t = fn(*args, **kwargs)
                self._guard.watch(t)
                return t

            return alloc
        return fn


def run_pdl(monkeypatch, module, make):
    """make() -> (run, activations): fresh, identical inputs on every call; run() launches the op
    and returns what to compare (outputs and in-place targets). Runs it without PDL, then with the
    PDL code path under a Guard watching `activations` and everything `module` allocates."""
    run, _ = make()
    want = [t.clone() for t in run()]
    guard, got = run_guarded(monkeypatch, module, *make())
    assert guard.saved is None, "a program never reached gdc_wait"
    assert not guard.errors, guard.errors[:3]
    assert guard.launches > 0 and guard.waits == guard.launches
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert same(g, w)
    return guard


def run_guarded(monkeypatch, module, run, activations):
    """(guard, run()'s results) with `module`'s PDL code path on under a Guard watching `activations`."""
    guard = Guard()
    guard.watch(*activations)
    with monkeypatch.context() as m:
        m.setattr(tl_cuda, "gdc_launch_dependents", guard.launch_dependents)
        m.setattr(tl_cuda, "gdc_wait", guard.wait)
        m.setattr(kmod(module), "pdl", lambda *a, **k: True)
        m.setattr(kmod(module), "torch", _TorchProxy(guard))
        return guard, run()


def same(a, b):
    """Bit for bit, NaN where NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=gen(seed), device=DEVICE)


GEMV_KINDS = {
    "fma": dict(DOT=False, BLOCK_N=4, BLOCK_K=32, SPLIT_K=1),
    "fma-pipelined": dict(DOT=False, BLOCK_N=8, BLOCK_K=32, SPLIT_K=1, LOOP_STAGES=3),
    "fma-split3": dict(DOT=False, BLOCK_N=4, BLOCK_K=16, SPLIT_K=3),
    "dot": dict(DOT=True, BLOCK_N=16, BLOCK_K=32, SPLIT_K=1),
    "dot-split2": dict(DOT=True, BLOCK_N=16, BLOCK_K=16, SPLIT_K=2),
}


@interpreter_only
@pytest.mark.parametrize("kind", [None, *GEMV_KINDS])
# K: under one tile, between one and two (the peeled tiles cover it), several tiles, splits past the end
@pytest.mark.parametrize("M,N,K", [(1, 9, 20), (3, 17, 45), (2, 5, 150), (1, 6, 17)])
@pytest.mark.parametrize("tiles", [1, 2])
def test_gemv_pdl_path(monkeypatch, kind, M, N, K, tiles):
    gt = kmod("gemv")
    config = None if kind is None else GEMV_KINDS[kind]

    def make():
        x, w, b = randn(M, K, seed=1), randn(N, K, seed=2), randn(N, seed=3)
        part, cnt = gt._workspace(x.device, 4 * M * N, N)
        out = torch.full((M, N), float("nan"), device=DEVICE)
        return (lambda: [gt.gemv_triton(x, w, b, out=out, config=config, early_tiles=tiles)]), (x, out, part, cnt)

    run_pdl(monkeypatch, "gemv", make)


@interpreter_only
@pytest.mark.parametrize("kind", ["fma", "fma-split3", "dot", "dot-split2"])
@pytest.mark.parametrize("M,N,K", [(1, 9, 20), (3, 17, 45), (2, 5, 150)])
def test_gemv_norm_pdl_path(monkeypatch, kind, M, N, K):
    """The gated-norm prologue: y and z (activations) are read only after the wait."""
    gt = kmod("gemv")

    def make():
        y, w, b = randn(M, K, seed=1), randn(N, K, seed=2), randn(N, seed=3)
        z = randn(M, 2 * K, seed=4)[:, K:]
        nw = randn(K, seed=5)
        part, cnt = gt._workspace(y.device, 4 * M * N, N)
        out = torch.full((M, N), float("nan"), device=DEVICE)
        return ((lambda: [gt.gemv_triton(y, w, b, out=out, config=GEMV_KINDS[kind], norm=(z, nw, 1e-5))]),
                (y, z, out, part, cnt))

    run_pdl(monkeypatch, "gemv", make)


@interpreter_only
def test_gemv_grouped_pdl_path(monkeypatch):
    gt = kmod("gemv")

    def make():
        x = randn(3, 2, 90, seed=1)[:, :, 3:80]
        w, b = randn(3, 21, 77, seed=2), randn(3, 21, seed=3)
        part, cnt = gt._workspace(x.device, 4 * 3 * 2 * 21, 3 * 21)
        return (lambda: [gt.gemv_triton(x, w, b, config=GEMV_KINDS["fma-split3"])]), (x, part, cnt)

    run_pdl(monkeypatch, "gemv", make)


@interpreter_only
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_pdl_path(monkeypatch, residual):
    f = kmod("rmsnorm").add_rms_norm_triton

    def make():
        x, r, w = randn(3, 50, seed=1), randn(3, 50, seed=2) if residual else None, randn(50, seed=3)
        out = torch.empty(3, 50)
        return (lambda: list(f(x, r, w, 1e-5, out=out))), (x, r, out)

    run_pdl(monkeypatch, "rmsnorm", make)


@interpreter_only
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_pdl_path(monkeypatch, inplace):
    f = kmod("rotary").apply_rotary_triton

    def make():
        qkv = randn(3, 7 * 16, seed=1)
        q, k = qkv[:, : 4 * 16].view(3, 4, 16), qkv[:, 4 * 16 : 6 * 16].view(3, 2, 16)
        pos = torch.tensor([5, 0, 11], device=DEVICE)
        cos, sin = randn(12, 8, seed=2), randn(12, 8, seed=3)
        return (lambda: list(f(q, k, pos, cos, sin, inplace=inplace))), (qkv, pos)

    run_pdl(monkeypatch, "rotary", make)


@interpreter_only
def test_rotary_write_kv_pdl_path(monkeypatch):
    """RoPE + cache write: the caches (written by the previous step's kernels' consumers) are guarded too."""
    f = kmod("rotary").apply_rotary_write_kv_triton

    def make():
        qkv = randn(3, 8 * 16, seed=1)
        q, k, v = (qkv[:, a * 16 : b * 16].view(3, b - a, 16) for a, b in ((0, 4), (4, 6), (6, 8)))
        pos = torch.tensor([5, 0, 11], device=DEVICE)
        cos, sin = randn(12, 8, seed=2), randn(12, 8, seed=3)
        k_cache, v_cache = randn(3, 4, 2, 16, seed=4), randn(3, 4, 2, 16, seed=5)
        slots = torch.tensor([9, -1, 2], device=DEVICE)
        return (lambda: list(f(q, k, v, pos, cos, sin, k_cache, v_cache, slots)) + [k_cache, v_cache]), (qkv, pos, k_cache, v_cache, slots)

    run_pdl(monkeypatch, "rotary", make)


@interpreter_only
def test_swiglu_pdl_path(monkeypatch):
    f = kmod("swiglu").silu_mul_triton

    def make():
        gu = randn(2, 2 * 1500, seed=1)
        return (lambda: [f(gu)]), (gu,)

    run_pdl(monkeypatch, "swiglu", make)


@interpreter_only
@pytest.mark.parametrize("op", ["embed", "add", "gated"])
def test_mamba2_norm_pdl_path(monkeypatch, op):
    m = kmod("mamba2_norm")

    def make():
        x, res, w = randn(2, 40, seed=1), randn(2, 40, seed=2), randn(40, seed=3)
        tokens = torch.tensor([3, 1], device=DEVICE)
        table = randn(5, 40, seed=4)
        if op == "embed":
            return (lambda: list(m.embed_rmsnorm(tokens, table, w, 1e-5))), (tokens,)
        if op == "add":
            return (lambda: list(m.add_rmsnorm(x, res, w, 1e-5))), (x, res)
        z = randn(2, 60, seed=5)[:, 10:50]
        return (lambda: [m.gated_rmsnorm(x, z, w, 20, 1e-5)]), (x, z)

    run_pdl(monkeypatch, "mamba2_norm", make)


@interpreter_only
@pytest.mark.parametrize("op", ["add_norm_shift", "add_norm", "lora_hidden", "time_mix_inputs", "gate_output", "sqrelu"])
def test_rwkv7_fused_pdl_path(monkeypatch, op):
    m = kmod("rwkv7_fused")
    B, H, D = 2, 3, 16
    C = H * D

    def make():
        if op in ("add_norm_shift", "add_norm"):
            x, delta, prev = randn(B, C, seed=1), randn(B, C, seed=2), randn(B, C, seed=3)
            w, b, mixes = 1 + randn(C, seed=4, scale=0.1), randn(C, seed=5, scale=0.1), torch.rand(6, C, generator=gen(6))
            if op == "add_norm":
                return (lambda: [m.add_norm_shift_triton(x, delta, w, b, eps=1e-5), x]), (x, delta)
            return (lambda: [m.add_norm_shift_triton(x, delta, w, b, prev, mixes, eps=1e-5), x, prev]), (x, delta, prev)
        if op == "lora_hidden":
            y = randn(4 * B, 60, seed=1)
            blocks = [y[j * B : (j + 1) * B, 3 + 12 * j : 3 + 12 * j + 5 + j] for j in range(4)]
            return (lambda: [m.lora_hidden_triton(blocks, (None, "tanh", None, "sigmoid"))]), (y,)
        if op == "time_mix_inputs":
            y = randn(3 * B, 3 * C + 7, seed=1)
            r, k, v = (y[j * B : (j + 1) * B, j * C : (j + 1) * C] for j in range(3))
            u, v_first = randn(4 * B, C, seed=2), randn(B, C, seed=6)
            consts = (randn(C, seed=3), randn(C, seed=4), randn(C, seed=5),
                      0.7 + 0.1 * torch.rand(C, generator=gen(7)), torch.rand(C, generator=gen(8)))
            bias_w, bias_a, bias_v, k_k, k_a = consts
            return (lambda: list(m.time_mix_inputs_triton(r, k, v, u, bias_w, bias_a, bias_v, k_k, k_a, v_first,
                                                          head_dim=D))), (y, u, v_first)
        if op == "gate_output":
            o, x, g = randn(B, H, D, seed=1), randn(5, B, C, seed=2), randn(2 * B, C, seed=3)[B:]
            r, k, v = (x[j].view(B, H, D) for j in range(3))
            r_k, nw, nb = randn(H, D, seed=4, scale=0.1), 1 + randn(C, seed=5, scale=0.1), randn(C, seed=6, scale=0.1)
            return (lambda: [m.gate_output_triton(o, r, k, v, g, r_k, nw, nb, eps=D * 1e-5)]), (o, x, g)
        x = randn(2500, seed=1)
        return (lambda: [m.sqrelu_triton(x)]), (x,)

    run_pdl(monkeypatch, "rwkv7_fused", make)


def _paged_inputs(seq_lens, page, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    at = 0
    for b, count in enumerate(pages):
        tables[b, :count] = order[at : at + count]
        at += count
    shape = (num_blocks, page, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=g), torch.randn(shape, generator=g), tables,
            torch.tensor(seq_lens, dtype=torch.int32))


@interpreter_only
def test_write_kv_pdl_path(monkeypatch):
    pa = kmod("paged_attention")

    def make():
        k_cache, v_cache, _, _ = _paged_inputs([40], 16, 2, 16)
        kv = randn(3, 2, 2, 16, seed=1)
        slots = torch.tensor([5, -1, 33])
        return (lambda: pa.write_kv(kv[:, 0], kv[:, 1], k_cache, v_cache, slots) or [k_cache, v_cache]), \
            (kv, k_cache, v_cache, slots)

    run_pdl(monkeypatch, "paged_attention", make)


def _ssd_step(G, state_ready, watch_state=None):
    """make() for one Mamba-2 decode step. The SSM state, the conv ring and the positions are watched
    unless state_ready (the promise: no kernel just before wrote them); `watch_state` overrides that."""
    watch_state = not state_ready if watch_state is None else watch_state
    st = kmod("ssd")
    Bsz, H, P, N, W = 2, 4, 16, 16, 4
    Cdim = H * P + 2 * G * N

    def make():
        g = torch.Generator().manual_seed(G)
        xBC, dt = torch.randn(Bsz, Cdim, generator=g), torch.randn(Bsz, H, generator=g)
        conv_state, ssm_state = torch.randn(Bsz, Cdim, W, generator=g), torch.randn(Bsz, H, P, N, generator=g)
        conv_w, conv_b = torch.randn(Cdim, W, generator=g) * 0.5, torch.randn(Cdim, generator=g) * 0.1
        A, Dh, dt_bias = -torch.rand(H, generator=g), torch.randn(H, generator=g), torch.randn(H, generator=g) - 2
        z = torch.randn(Bsz, H, P, generator=g)
        positions = torch.arange(Bsz) * 3 + 5

        def run():
            y = st.mamba2_decode_step(xBC, dt, conv_state, conv_w, conv_b, ssm_state, A, Dh, dt_bias,
                                      positions=positions, ngroups=G, headdim=P, z=z, state_ready=state_ready)
            return [y, conv_state, ssm_state]

        return run, (xBC, dt, *((conv_state, ssm_state, positions) if watch_state else ()), z)

    return make


def _shift_norm(state_ready, watch_state=None):
    """make() for one RWKV-7 add + LayerNorm + token shift; the shift row watched as in `_ssd_step`."""
    m = kmod("rwkv7_fused")
    watch_state = not state_ready if watch_state is None else watch_state

    def make():
        B, C = 2, 48
        x, delta, prev = randn(B, C, seed=1), randn(B, C, seed=2), randn(B, C, seed=3)
        w, b, mixes = 1 + randn(C, seed=4, scale=0.1), randn(C, seed=5, scale=0.1), torch.rand(6, C, generator=gen(6))
        run = lambda: [m.add_norm_shift_triton(x, delta, w, b, prev, mixes, eps=1e-5, state_ready=state_ready), x, prev]  # noqa: E731
        return run, (x, delta, prev if watch_state else None)

    return make


def _wkv7_step(state_ready, watch_state=None):
    """make() for one WKV-7 step; the state watched as in `_ssd_step`."""
    wt = kmod("wkv7")
    watch_state = not state_ready if watch_state is None else watch_state

    def make():
        B, H, K, V = 2, 3, 16, 48
        x = randn(5, B, H, K, seed=1)
        r, w, k, a, b = x[0], -torch.rand(B, H, K, generator=gen(2)), x[1], x[2], x[3]
        w = w.expand_as(r).contiguous()
        v, state = randn(B, H, V, seed=3), randn(B, H, K, V, seed=4)
        run = lambda: [wt.wkv7_step_triton(r, w, k, v, a, b, state, block_v=16, state_ready=state_ready), state]  # noqa: E731
        return run, (x, w, v, state if watch_state else None)

    return make


@interpreter_only
@pytest.mark.parametrize("state_ready", [False, True])
@pytest.mark.parametrize("G", [1, 2])
def test_ssd_decode_step_pdl_path(monkeypatch, G, state_ready):
    run_pdl(monkeypatch, "ssd", _ssd_step(G, state_ready))


@interpreter_only
@pytest.mark.parametrize("state_ready", [False, True])
def test_wkv7_step_pdl_path(monkeypatch, state_ready):
    run_pdl(monkeypatch, "wkv7", _wkv7_step(state_ready))


@interpreter_only
@pytest.mark.parametrize("state_ready", [False, True])
def test_shift_norm_pdl_path(monkeypatch, state_ready):
    run_pdl(monkeypatch, "rwkv7_fused", _shift_norm(state_ready))


@interpreter_only
@pytest.mark.parametrize("module", ["ssd", "wkv7", "rwkv7_fused"])
def test_state_ready_loads_the_state_before_the_wait(monkeypatch, module):
    """state_ready=True with the state poisoned at gdc_launch_dependents (as if the kernel just before
    were still writing it): the step computes with the poison, so the promise is what makes it
    correct; without state_ready the same watch gives the exact result."""
    make = {"ssd": lambda **k: _ssd_step(1, **k), "wkv7": _wkv7_step, "rwkv7_fused": _shift_norm}[module]
    for state_ready in (False, True):
        guard, got = run_guarded(monkeypatch, module, *make(state_ready=state_ready, watch_state=True)())
        assert not guard.errors and guard.launches == guard.waits > 0
        assert bool(got[0].isnan().any()) == state_ready
        if module == "ssd":
            # The conv ring too: with the promise the step puts the token's inputs into the slot of
            # the (poisoned) position it loaded before the wait.
            run, _ = make(state_ready=state_ready, watch_state=True)()
            assert same(got[1], run()[1]) == (not state_ready)


# ---------------------------------------------------------------------------------------------
# Decode-step chains: eagerly under the interpreter (PDL code paths stubbed), in CUDA graphs on a GPU


def llama_step(d=2048, hq=32, hkv=8, hd=64, inter=8192, page=16, ctx=300, dtype=torch.bfloat16, seed=0):
    """One llama layer's decode step at batch 1 on the Triton kernels: add+RMSNorm, qkv GEMV, RoPE,
    KV write, paged decode, o GEMV, add+RMSNorm, gate/up GEMV, SwiGLU, down GEMV; the output is fed
    back as the next step's input and positions, slots and lengths advance. Returns (step, state)."""
    from declab_kernels.gemv.triton import gemv_triton
    from declab_kernels.paged_attention.triton import decode_workspace, paged_decode_attention, write_kv
    from declab_kernels.rmsnorm.triton import add_rms_norm_triton
    from declab_kernels.rotary.triton import apply_rotary_triton
    from declab_kernels.swiglu.triton import silu_mul_triton

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    w = dict(n1=1 + rnd(d, scale=0.1), n2=1 + rnd(d, scale=0.1), qkv=rnd((hq + 2 * hkv) * hd, d, scale=d**-0.5),
             o=rnd(d, hq * hd, scale=(hq * hd) ** -0.5), gu=rnd(2 * inter, d, scale=d**-0.5),
             down=rnd(d, inter, scale=inter**-0.5))
    pos = torch.arange(4 * ctx, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(hd // 2) / (hd // 2))
    cos, sin = pos.cos().to(DEVICE), pos.sin().to(DEVICE)
    blocks = -(-(2 * ctx) // page)
    state = dict(h=rnd(1, d), res=rnd(1, d), k_cache=rnd(blocks, page, hkv, hd), v_cache=rnd(blocks, page, hkv, hd),
                 tables=torch.randperm(blocks, generator=g).to(DEVICE, torch.int32)[None],
                 positions=torch.full((1,), ctx, dtype=torch.int64, device=DEVICE),
                 seq_lens=torch.full((1,), ctx + 1, dtype=torch.int32, device=DEVICE))
    ws = decode_workspace(1, hq, hkv, hd, 2 * ctx, DEVICE)
    q_end, k_end = hq * hd, (hq + hkv) * hd

    def step(s):
        n, res = add_rms_norm_triton(s["h"], s["res"], w["n1"], 1e-5)
        qkv = gemv_triton(n, w["qkv"])
        q, k = apply_rotary_triton(qkv[:, :q_end].view(1, hq, hd), qkv[:, q_end:k_end].view(1, hkv, hd),
                                   s["positions"], cos, sin)
        v = qkv[:, k_end:].view(1, hkv, hd)
        page_of = s["tables"][0, s["positions"] // page].to(torch.int64)
        write_kv(k, v, s["k_cache"], s["v_cache"], page_of * page + s["positions"] % page)
        o = paged_decode_attention(q, s["k_cache"], s["v_cache"], s["tables"], s["seq_lens"], hd**-0.5, workspace=ws)
        a = gemv_triton(o.view(1, hq * hd), w["o"])
        n2, res2 = add_rms_norm_triton(a, res, w["n2"], 1e-5)
        y = gemv_triton(silu_mul_triton(gemv_triton(n2, w["gu"])), w["down"])
        s["h"].copy_(y)
        s["res"].copy_(res2)
        s["positions"] += 1
        s["seq_lens"] += 1

    return step, state


def mamba2_step(d=2048, d_inner=4096, H=64, P=64, N=128, W=4, dtype=torch.bfloat16, seed=0):
    """One Mamba-2 layer's decode step at batch 1: add+RMSNorm (float32 residual), in_proj GEMV,
    the fused conv + SSM step, gated RMSNorm, out_proj GEMV, fed back as the next input."""
    from declab_kernels.gemv.triton import gemv_triton
    from declab_kernels.mamba2_norm.triton import add_rmsnorm, gated_rmsnorm
    from declab_kernels.ssd.triton import mamba2_decode_step

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dt)

    cdim = d_inner + 2 * N
    w = dict(n=1 + rnd(d, scale=0.1), gn=1 + rnd(d_inner, scale=0.1), inp=rnd(d_inner + cdim + H, d, scale=d**-0.5),
             out=rnd(d, d_inner, scale=d_inner**-0.5), conv_w=rnd(cdim, W, scale=0.5), conv_b=rnd(cdim, scale=0.1),
             A=-torch.rand(H, generator=g).to(DEVICE), D=rnd(H, dt=torch.float32),
             dt_bias=rnd(H, dt=torch.float32) - 2)
    state = dict(h=rnd(1, d), res=rnd(1, d, dt=torch.float32), conv=rnd(1, cdim, W),
                 ssm=rnd(1, H, P, N, scale=0.1, dt=torch.float32), pos=torch.full((1,), 7, device=DEVICE))

    def step(s):
        n, r = add_rmsnorm(s["h"], s["res"], w["n"], 1e-5)
        zxd = gemv_triton(n, w["inp"])
        z, xBC, dt = zxd[:, :d_inner], zxd[:, d_inner : d_inner + cdim], zxd[:, d_inner + cdim :]
        y = mamba2_decode_step(xBC, dt, s["conv"], w["conv_w"], w["conv_b"], s["ssm"], w["A"], w["D"], w["dt_bias"],
                               positions=s["pos"], ngroups=1, headdim=P)
        s["h"].copy_(gemv_triton(gated_rmsnorm(y.view(1, d_inner), z, w["gn"], d_inner, 1e-5), w["out"]))
        s["res"].copy_(r)
        s["pos"] += 1

    return step, state


def rwkv7_step(C=2048, H=32, ranks=(32, 64, 64, 128), dtype=torch.bfloat16, seed=0):
    """One RWKV-7 layer's decode step at batch 1, as declab_arch/rwkv7.py runs it on the fused kernels:
    add+LayerNorm+shift, the down GEMV of the six mixed inputs, LoRA hidden, LoRA up GEMV, time-mix
    inputs, the WKV-7 step, gate/output, o GEMV, add+LayerNorm+shift, key GEMV, sqrelu, value GEMV."""
    from declab_kernels.gemv.triton import gemv_triton
    from declab_kernels.rwkv7_fused.triton import (add_norm_shift_triton, gate_output_triton, lora_hidden_triton,
                                            sqrelu_triton, time_mix_inputs_triton)
    from declab_kernels.wkv7.triton import wkv7_step_triton

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dt)

    D = C // H
    R = sum(ranks)
    offs = [sum(ranks[:j]) for j in range(5)]
    w = dict(n1w=1 + rnd(C, scale=0.1), n1b=rnd(C, scale=0.1), n2w=1 + rnd(C, scale=0.1), n2b=rnd(C, scale=0.1),
             mix=torch.rand(6, C, generator=g).to(DEVICE, dtype), kmix=torch.rand(1, C, generator=g).to(DEVICE, dtype),
             down=rnd(3 * C + R, C, scale=C**-0.5), up=rnd(C, R, scale=R**-0.5), bw=rnd(C), ba=rnd(C), bv=rnd(C),
             k_k=(0.7 + 0.1 * torch.rand(C, generator=g)).to(DEVICE, dtype), k_a=torch.rand(C, generator=g).to(DEVICE, dtype),
             r_k=rnd(H, D, scale=0.1), gnw=1 + rnd(C, scale=0.1), gnb=rnd(C, scale=0.1), o=rnd(C, C, scale=C**-0.5),
             key=rnd(4 * C, C, scale=C**-0.5), value=rnd(C, 4 * C, scale=(4 * C) ** -0.5))
    state = dict(x=rnd(1, C), delta=rnd(1, C), shift_a=rnd(1, C), shift_f=rnd(1, C), v_first=rnd(1, C),
                 wkv=rnd(1, H, D, D, scale=0.1, dt=torch.float32))

    def step(s):
        xs = add_norm_shift_triton(s["x"], s["delta"], w["n1w"], w["n1b"], s["shift_a"], w["mix"], eps=1e-5)
        y = gemv_triton(xs.view(6, C), w["down"])
        r, k, v = (y[j : j + 1, j * C : (j + 1) * C] for j in range(3))
        lo = [y[2 + j : 3 + j, 3 * C + offs[j] : 3 * C + offs[j + 1]] for j in range(4)]
        u = gemv_triton(lora_hidden_triton(lo, (None, "tanh", None, "sigmoid")), w["up"])
        x5, wd = time_mix_inputs_triton(r, k, v, u, w["bw"], w["ba"], w["bv"], w["k_k"], w["k_a"], s["v_first"],
                                        head_dim=D)
        rr, kk, vv, aa, bb = (t.view(1, H, D) for t in x5.unbind(0))
        o = wkv7_step_triton(rr, wd.view(1, H, D), kk, vv, aa, bb, s["wkv"])
        out = gate_output_triton(o, rr, kk, vv, u[3:4], w["r_k"], w["gnw"], w["gnb"], eps=D * 1e-5)
        att = gemv_triton(out, w["o"])
        xk = add_norm_shift_triton(s["x"], att, w["n2w"], w["n2b"], s["shift_f"], w["kmix"], eps=1e-5)
        s["delta"].copy_(gemv_triton(sqrelu_triton(gemv_triton(xk[0], w["key"])), w["value"]))

    return step, state


SMALL = {
    "llama": dict(d=64, hq=4, hkv=2, hd=16, inter=96, page=16, ctx=20, dtype=torch.float32),
    "mamba2": dict(d=32, d_inner=64, H=4, P=16, N=16, W=4, dtype=torch.float32),
    "rwkv7": dict(C=32, H=2, ranks=(4, 8, 8, 12), dtype=torch.float32),
}
BUILDERS = {"llama": llama_step, "mamba2": mamba2_step, "rwkv7": rwkv7_step}


def _trace(builder, kwargs, steps):
    """The states after each of `steps` eager steps."""
    step, state = builder(**kwargs)
    out = []
    for _ in range(steps):
        step(state)
        out.append({k: v.clone() for k, v in state.items()})
    return out


@interpreter_only
@pytest.mark.parametrize("model", list(BUILDERS))
def test_decode_chain_pdl_path_equals_plain(monkeypatch, model):
    """The chains the GPU test captures, eagerly under the interpreter: PDL code paths (griddepcontrol
    stubbed) give the plain launches' results bit for bit."""
    want = _trace(BUILDERS[model], SMALL[model], 2)
    counts = {"wait": 0}

    def wait():
        counts["wait"] += 1

    monkeypatch.setattr(tl_cuda, "gdc_launch_dependents", lambda: None)
    monkeypatch.setattr(tl_cuda, "gdc_wait", wait)
    for name in MODULES:
        monkeypatch.setattr(kmod(name), "pdl", lambda *a, **k: True)
    got = _trace(BUILDERS[model], SMALL[model], 2)
    assert counts["wait"] > 0
    for a, b in zip(got, want):
        for key in a:
            assert same(a[key], b[key]), key


def _graph_trace(builder, steps):
    """Warm up (compile, autotune, workspaces) on a throwaway state, capture one step in a CUDA graph
    on a fresh state (capture runs nothing), replay it `steps` times; the states after each replay."""
    step, state = builder()
    step(state)
    torch.cuda.synchronize()
    step, state = builder()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(state)
    out = []
    for _ in range(steps):
        graph.replay()
        out.append({k: v.clone() for k, v in state.items()})
    torch.cuda.synchronize()
    return out


@gpu_only
@pytest.mark.parametrize("model", list(BUILDERS))
def test_gpu_decode_chain_graph_pdl_equals_no_pdl(monkeypatch, model):
    """A decode step captured in a CUDA graph and replayed 40 times (each step's output is the next
    one's input): with PDL the states after every replay equal those without, bit for bit."""
    if not declab_kernels.pdl("cuda"):
        pytest.skip("PDL needs compute capability >= 9 (and DECLAB_PDL != 0)")
    monkeypatch.setenv("DECLAB_PDL", "0")
    plain = _graph_trace(BUILDERS[model], 40)
    monkeypatch.delenv("DECLAB_PDL")
    assert declab_kernels.pdl("cuda")
    with_pdl = _graph_trace(BUILDERS[model], 40)
    for i, (a, b) in enumerate(zip(with_pdl, plain)):
        for key in a:
            assert same(a[key], b[key]), f"step {i}: {key}"
    assert all(v.isfinite().all() for v in with_pdl[-1].values() if v.is_floating_point())


@gpu_only
def test_gpu_norm_gemv_swiglu_gemv_graph_many_replays(monkeypatch):
    """rmsnorm -> gemv -> swiglu -> gemv at llama-1b sizes, replayed 200 times per capture with
    fresh inputs copied in before each replay: PDL on equals PDL off bit for bit."""
    from declab_kernels.gemv.triton import gemv_triton
    from declab_kernels.rmsnorm.triton import add_rms_norm_triton
    from declab_kernels.swiglu.triton import silu_mul_triton

    if not declab_kernels.pdl("cuda"):
        pytest.skip("PDL needs compute capability >= 9 (and DECLAB_PDL != 0)")
    g = torch.Generator().manual_seed(0)
    d, inter = 2048, 8192
    nw = (1 + 0.1 * torch.randn(d, generator=g)).cuda().bfloat16()
    gu = (torch.randn(2 * inter, d, generator=g) * d**-0.5).cuda().bfloat16()
    down = (torch.randn(d, inter, generator=g) * inter**-0.5).cuda().bfloat16()
    xs = torch.randn(200, 2, 1, d, generator=g).cuda().bfloat16()

    def run():
        x, res = xs[0, 0].clone(), xs[0, 1].clone()
        y = torch.empty(1, d, device="cuda", dtype=torch.bfloat16)

        def step():
            n, _ = add_rms_norm_triton(x, res, nw, 1e-5)
            gemv_triton(silu_mul_triton(gemv_triton(n, gu)), down, out=y)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        outs = []
        for i in range(xs.shape[0]):
            x.copy_(xs[i, 0])
            res.copy_(xs[i, 1])
            graph.replay()
            outs.append(y.clone())
        torch.cuda.synchronize()
        return torch.stack(outs)

    monkeypatch.setenv("DECLAB_PDL", "0")
    plain = run()
    monkeypatch.delenv("DECLAB_PDL")
    assert torch.equal(run(), plain)


@gpu_only
def test_gpu_write_kv_then_paged_decode_graph(monkeypatch):
    """write_kv then the split-K paged decode (ticket merge) in one graph, 100 replays each writing
    the next position and reading it back: PDL on equals PDL off bit for bit."""
    from declab_kernels.paged_attention.triton import decode_workspace, paged_decode_attention, write_kv

    if not declab_kernels.pdl("cuda"):
        pytest.skip("PDL needs compute capability >= 9 (and DECLAB_PDL != 0)")
    page, hkv, hq, hd, ctx, steps = 16, 8, 32, 64, 1000, 100
    blocks = -(-(ctx + steps) // page)
    qkv = torch.randn(steps, 3, 1, hq, hd, generator=torch.Generator().manual_seed(5)).cuda().bfloat16()

    def build():
        s = dict(k_cache=torch.randn(blocks, page, hkv, hd, generator=torch.Generator().manual_seed(2)).cuda().bfloat16(),
                 v_cache=torch.randn(blocks, page, hkv, hd, generator=torch.Generator().manual_seed(3)).cuda().bfloat16(),
                 tables=torch.randperm(blocks, generator=torch.Generator().manual_seed(4)).cuda().int()[None],
                 pos=torch.full((1,), ctx, dtype=torch.int64, device="cuda"),
                 lens=torch.full((1,), ctx + 1, dtype=torch.int32, device="cuda"),
                 q=qkv[0, 0].clone(), k=qkv[0, 1, :, :hkv].clone(), v=qkv[0, 2, :, :hkv].clone(),
                 out=torch.empty(1, hq, hd, device="cuda", dtype=torch.bfloat16))
        ws = decode_workspace(1, hq, hkv, hd, ctx + steps, "cuda")

        def step():
            slot = s["tables"][0, s["pos"] // page].long() * page + s["pos"] % page
            write_kv(s["k"], s["v"], s["k_cache"], s["v_cache"], slot)
            paged_decode_attention(s["q"], s["k_cache"], s["v_cache"], s["tables"], s["lens"], hd**-0.5, out=s["out"],
                                   workspace=ws)
            s["pos"].add_(1)
            s["lens"].add_(1)

        return step, s, ws

    def run():
        step, _, _ = build()
        step()
        torch.cuda.synchronize()
        step, s, ws = build()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        outs = []
        for i in range(steps):
            s["q"].copy_(qkv[i, 0])
            s["k"].copy_(qkv[i, 1, :, :hkv])
            s["v"].copy_(qkv[i, 2, :, :hkv])
            graph.replay()
            outs.append(s["out"].clone())
        torch.cuda.synchronize()
        assert ws.counters.eq(0).all()
        return torch.stack(outs), s["k_cache"], s["v_cache"]

    monkeypatch.setenv("DECLAB_PDL", "0")
    plain = run()
    monkeypatch.delenv("DECLAB_PDL")
    for a, b in zip(run(), plain):
        assert same(a, b)


def test_pdl_check_memory_order_collapses_runs():
    from declab_bench.pdl_check import memory_order

    sass = """
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64+0x10] ;
        /*0030*/                   ACQBULK ;
        /*0040*/                   LDG.E.U16 R12, desc[UR4][R6.64] ;
        /*0050*/                   STG.E.128 desc[UR4][R6.64], R4 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   LDG.E.U16 R13, desc[UR4][R10.64] ;
        /*0080*/                   ATOMG.E.ADD.STRONG.GPU PT, R3, desc[UR4][R14.64], R5 ;
        /*0090*/                   STG.E.U16 desc[UR4][R6.64], R13 ;
        /*00a0*/                   STG.E.U16 desc[UR4][R6.64+0x2], R13 ;
        /*00b0*/                   EXIT ;
    """
    assert memory_order(sass) == "LDG x2 WAIT LDG STG BAR LDG ATOM STG x2"


def test_pdl_check_loop_mix_takes_the_longest_loop():
    from declab_bench.pdl_check import loop_mix

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R2, R2, 0xf000f, RZ, 0xc0, !PT ;
        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   HADD2.BF16_V2 R4, R4, -144, -144 ;
        /*0050*/                   LOP3.LUT R5, R5, 0xf000f, RZ, 0xc0, !PT ;
        /*0060*/                   HGMMA.64x16x16.F32.BF16 R24, R52, gdesc[UR20], R24 ;
        /*0070*/               @P1 BRA 0x40 ;
        /*0080*/                   EXIT ;
    """
    n, ops = loop_mix(sass)
    assert n == 4 and ops == {"HADD2": 1, "LOP3": 1, "HGMMA": 1, "BRA": 1}
    assert loop_mix("/*0000*/ EXIT ;") == (0, {})


def test_pdl_check_refuses_a_malformed_ptx_version_in_one_line(capsys):
    from declab_bench import pdl_check

    with pytest.raises(SystemExit) as exit_:
        pdl_check.main(["--ptx-version", "8"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MAJOR.MINOR" in err[0]
