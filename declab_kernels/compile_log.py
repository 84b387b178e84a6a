"""Triton compilations as they happen: how many, of which kernels, and how long they took.

A Triton kernel compiles the first time it is called with a new specialization (its constexprs, and
its integer arguments' divisibility by 16 and pointers' alignment), or loads the result from Triton's
disk cache, in the caller's thread: a compilation inside a timed region is seconds of host time that
the measurement then reports as latency. `watch()` wraps the one method every JIT compilation goes
through (`triton.runtime.jit.JITFunction._do_compile`, in Triton 3.6 as in 3.9; autotuned kernels
compile their candidates through it too), once per process; from then on `snapshot()` reads the
running totals and `since(before)` what happened after an earlier snapshot. (Triton's own
`jit_cache_hook` / `jit_post_compile_hook` would serve, but Triton serialises every constexpr to JSON
before calling them, which a kernel's constexprs need not allow.) Under the CPU interpreter nothing
compiles and the totals stay at zero.

    from declab_kernels import compile_log
    compile_log.watch()
    before = compile_log.snapshot()
    ...                                   # the timed work
    compile_log.since(before)             # {"count": 2, "seconds": 1.9, "kernels": {"_prefill_kernel": 2}}
"""

import functools
import threading
import time
from collections import Counter

_LOCK = threading.Lock()
_TOTAL = {"count": 0, "seconds": 0.0, "kernels": Counter()}
_INSTALLED = False


def record(kernel: str, seconds: float) -> None:
    """Count one compilation of `kernel` that took `seconds`."""
    with _LOCK:
        _TOTAL["count"] += 1
        _TOTAL["seconds"] += seconds
        _TOTAL["kernels"][kernel] += 1


def timed(do_compile):
    """`do_compile` (an unbound `_do_compile(self, ...)`) with every call counted under its kernel's name."""
    @functools.wraps(do_compile)
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return do_compile(self, *args, **kwargs)
        finally:
            fn = getattr(self, "fn", None)
            record(getattr(fn, "__qualname__", None) or getattr(self, "__name__", "?"), time.perf_counter() - start)

    return wrapper


def watch() -> bool:
    """Start counting (once; later calls do nothing). False when this Triton has no such method."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return True
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return False
        if not callable(getattr(JITFunction, "_do_compile", None)):
            return False
        JITFunction._do_compile = timed(JITFunction._do_compile)
        _INSTALLED = True
        return True


def snapshot() -> dict:
    """The totals so far: count, seconds, kernels {name: count}."""
    with _LOCK:
        return {"count": _TOTAL["count"], "seconds": _TOTAL["seconds"], "kernels": dict(_TOTAL["kernels"])}


def since(before: dict) -> dict:
    """What compiled after `before` (a `snapshot()`): count, seconds, kernels {name: count}."""
    now = snapshot()
    kernels = {k: n - before["kernels"].get(k, 0) for k, n in now["kernels"].items() if n > before["kernels"].get(k, 0)}
    return {"count": now["count"] - before["count"], "seconds": now["seconds"] - before["seconds"], "kernels": kernels}
