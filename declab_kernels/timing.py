"""Timing and the device's ceilings, shared by the kernels' per-shape choices, the decode harness and
the lab's benchmarks.

- `time_ms(fn)`: median milliseconds of `fn()` with CUDA events after warm-up (monotonic clock on
  the CPU), optionally through a CUDA graph to remove launch gaps.
- `copy_bandwidth(device)`: bytes read + written per second by a large device-to-device copy, the
  ceiling that achieved bandwidth and MBU are reported against.
- `matmul_flops(device)`: a large bf16 matrix product, the arithmetic ceiling.
"""

import statistics
import time

import torch


def time_samples_ms(fn, *, warmup: int = 10, iters: int = 50, graph: bool = False) -> list[float]:
    """Per-call times of `fn()` in ms: CUDA events on a GPU, a monotonic clock on the CPU."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if graph and cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    for _ in range(warmup):
        fn()
    samples = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def time_ms(fn, **kwargs) -> float:
    """Median of `time_samples_ms`."""
    return statistics.median(time_samples_ms(fn, **kwargs))


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    device = torch.device(device)
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10 if device.type == "cuda" else 3)
    return 2 * nbytes / (ms * 1e-3)


def matmul_flops(device, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 (GPU) or float32 (CPU) matrix product on random data."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        n = min(n, 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, warmup=3, iters=10 if device.type == "cuda" else 3)
    return 2 * n**3 / (ms * 1e-3)
