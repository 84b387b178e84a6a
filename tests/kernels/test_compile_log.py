"""declab_kernels.compile_log: every Triton JIT compilation counted, with its time, per kernel."""

import time

import pytest
import torch
import triton
import triton.language as tl

from declab_kernels import compile_log


class FakeJIT:
    """Stands in for triton.runtime.jit.JITFunction: `fn` is the kernel's Python function."""

    def __init__(self, fn):
        self.fn = fn

    def _do_compile(self, key, *rest, warmup=False):
        time.sleep(0.01)
        if key == "fails":
            raise RuntimeError("compilation failed")
        return f"kernel {self.fn.__qualname__} {key}"


def _prefill_kernel():
    pass


def _rms_kernel():
    pass


def test_each_compilation_is_counted_with_its_time_and_kernel_even_when_it_fails():
    do_compile = compile_log.timed(FakeJIT._do_compile)
    before = compile_log.snapshot()
    assert do_compile(FakeJIT(_prefill_kernel), "k1", None, warmup=True) == "kernel _prefill_kernel k1"
    do_compile(FakeJIT(_prefill_kernel), "k2")
    with pytest.raises(RuntimeError, match="compilation failed"):
        do_compile(FakeJIT(_rms_kernel), "fails")
    got = compile_log.since(before)
    assert got["count"] == 3 and got["kernels"] == {"_prefill_kernel": 2, "_rms_kernel": 1}
    assert 0.03 <= got["seconds"] < 1
    assert compile_log.since(compile_log.snapshot()) == {"count": 0, "seconds": 0.0, "kernels": {}}


def test_watch_wraps_tritons_compile_method_once(monkeypatch):
    from triton.runtime.jit import JITFunction

    monkeypatch.setattr(JITFunction, "_do_compile", FakeJIT._do_compile)
    monkeypatch.setattr(compile_log, "_INSTALLED", False)
    assert compile_log.watch() and compile_log.watch()
    before = compile_log.snapshot()
    assert JITFunction._do_compile(FakeJIT(_rms_kernel), "k") == "kernel _rms_kernel k"
    # Wrapped once: one count per compilation, not one per watch() call.
    assert compile_log.since(before)["kernels"] == {"_rms_kernel": 1}


@triton.jit
def _scale_kernel(x_ptr, n, FACTOR: tl.constexpr):
    i = tl.arange(0, 16)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * FACTOR, mask=i < n)


@pytest.mark.gpu
def test_a_new_specialization_compiles_once_and_is_counted():
    compile_log.watch()
    x = torch.ones(16, device="cuda")
    before = compile_log.snapshot()
    for _ in range(3):
        _scale_kernel[(1,)](x, 16, FACTOR=3.0)
    _scale_kernel[(1,)](x, 16, FACTOR=5.0)
    got = compile_log.since(before)
    assert got["kernels"] == {"_scale_kernel": 2} and got["seconds"] > 0
    assert torch.equal(x, torch.full_like(x, 3.0 ** 3 * 5.0))
