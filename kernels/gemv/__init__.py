"""Small-batch GEMV: y = x @ weight^T for a few rows of x (decode), the weight streamed once.

x `[M, K]` (M small, 1..16; any row stride, contiguous last dimension), weight `[N, K]` as
nn.Linear stores it (contiguous in K), optional bias `[N]` -> `[M, N]` in x's dtype, float32
accumulation. The grouped form runs G independent products in one launch: x `[G, M, K]`, weight
`[G, N, K]`, bias `[G, N]` -> `[G, M, N]`. `impl` is "triton" or "ref" (already resolved by
`kernels.resolve_impl`).

- `gemv(x, weight, bias=None, *, impl, out=None) -> [M, N] | [G, M, N]`
- `linear(x, weight, bias=None, *, impl) -> [..., N]`: the drop-in for `F.linear` in the models.
  On a CUDA device with impl="triton" and at most MAX_ROWS rows it runs, per (M, N, K, dtype,
  bias) shape, the faster of the Triton GEMV and `F.linear`, measured once when the shape is first
  seen (outside CUDA-graph capture; during capture an unseen shape runs `F.linear`, unrecorded);
  everywhere else (CPU, impl="ref", more rows) it is `F.linear`.
- `choices() -> {(M, N, K, dtype, has_bias): {"impl", "triton_us", "torch_us", "config"}}`: what
  `linear` picked so far, for benchmarks and logs.

Inside a CUDA graph: call `linear` (or `gemv` with impl="triton") once per shape before capture,
so that autotuning, the measurement and the split-K workspace all happen outside it.
"""

import statistics

import torch
import torch.nn.functional as F

from kernels import check_impl
from kernels.gemv.ref import gemv_ref

__all__ = ["gemv", "linear", "choices", "gemv_ref", "MAX_ROWS"]

MAX_ROWS = 8
# (M, N, K, dtype name, has_bias, device index) -> the measured choice.
_CHOICES: dict = {}


def gemv(x, weight, bias=None, *, impl, out=None):
    """x @ weight^T (+ bias), float32 accumulation, in x's dtype; written into `out` when given."""
    check_impl(impl)
    if impl == "ref":
        result = gemv_ref(x, weight, bias)
        if out is None:
            return result
        out.copy_(result)
        return out
    from kernels.gemv.triton import gemv_triton

    return gemv_triton(x, weight, bias, out=out)


def choices() -> dict:
    """`linear`'s choice per shape so far: {(M, N, K, dtype, has_bias): record} (device index dropped)."""
    return {key[:5]: dict(rec) for key, rec in _CHOICES.items()}


def _time_us(fns, device, reps=25):
    """Median µs of each callable, interleaved, each call after the L2 cache was overwritten."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
    flush = torch.empty(2 * l2, dtype=torch.int8, device=device)
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
              for _ in fns]
    torch.cuda.synchronize(device)
    # Hold the GPU (~10 ms) while every rep is queued, so no call waits for its own launch from
    # Python (a Triton launch costs more CPU time than a cuBLAS one, and more than a flush takes).
    torch.cuda._sleep(20_000_000)
    for r in range(reps):
        for fn, ev in zip(fns, events):
            # The weight comes from HBM in a decode step; the flush keeps it from being L2-hot here.
            flush.zero_()
            ev[r][0].record()
            fn()
            ev[r][1].record()
    torch.cuda.synchronize(device)
    for ev, s in zip(events, samples):
        s.extend(a.elapsed_time(b) * 1e3 for a, b in ev)
    return [statistics.median(s) for s in samples]


def _choose(x2, weight, bias, key):
    from kernels.gemv.triton import config_name, gemv_triton, tuned_config

    M, N, K = key[:3]
    # The first Triton call autotunes this shape (its own benchmark, outside any capture).
    gemv_triton(x2, weight, bias)
    t_tri, t_torch = _time_us([lambda: gemv_triton(x2, weight, bias), lambda: F.linear(x2, weight, bias)], x2.device)
    cfg = tuned_config(M, N, K, 1, bias is not None, x2.dtype)
    rec = {"impl": "triton" if t_tri < t_torch else "torch", "triton_us": t_tri, "torch_us": t_torch,
           "config": config_name(cfg) if cfg is not None else None}
    _CHOICES[key] = rec
    return rec


def linear(x, weight, bias=None, *, impl):
    """F.linear(x, weight, bias) for x `[..., K]`, weight `[N, K]`; see the module docstring."""
    check_impl(impl)
    K = x.shape[-1]
    if impl != "triton" or not x.is_cuda or K == 0:
        return F.linear(x, weight, bias)
    M = x.numel() // K
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        # The Triton GEMV has no backward.
        return F.linear(x, weight, bias)
    if (M == 0 or M > MAX_ROWS or weight.dim() != 2 or weight.stride(-1) != 1 or x.dtype != weight.dtype
            or (bias is not None and bias.dtype != x.dtype)):
        return F.linear(x, weight, bias)
    N = weight.shape[0]
    key = (M, N, K, str(x.dtype).removeprefix("torch."), bias is not None, x.device.index)
    x2 = x.reshape(M, K)
    rec = _CHOICES.get(key)
    if rec is None:
        if torch.cuda.is_current_stream_capturing():
            # Measuring needs synchronisation, which capture forbids: this capture keeps F.linear.
            return F.linear(x, weight, bias)
        rec = _choose(x2, weight, bias, key)
    if rec["impl"] != "triton":
        return F.linear(x, weight, bias)
    from kernels.gemv.triton import gemv_triton

    return gemv_triton(x2, weight, bias).view(*x.shape[:-1], N)
