"""Small-batch GEMV: y = x @ weight^T for a few rows of x (decode), the weight streamed once.

x `[M, K]` (M small, 1..16; any row stride, contiguous last dimension), weight `[N, K]` as
nn.Linear stores it (contiguous in K), optional bias `[N]` -> `[M, N]` in x's dtype, float32
accumulation. The grouped form runs G independent products in one launch: x `[G, M, K]`, weight
`[G, N, K]`, bias `[G, N]` -> `[G, M, N]`. `impl` is "triton" or "ref" (already resolved by
`kernels.resolve_impl`).

- `gemv(x, weight, bias=None, *, impl, out=None) -> [M, N] | [G, M, N]`
- `linear(x, weight, bias=None, *, impl) -> [..., N]`: the drop-in for `F.linear` in the models.
  On a CUDA device with impl="triton" and at most MAX_ROWS rows it runs, per (M, N, K, dtype,
  bias) shape, the fastest of `F.linear` and every Triton configuration that fits, measured once
  when the shape is first seen: each candidate replayed from a CUDA graph over enough copies of
  the weight to overflow L2, as the calls of a decode step run (outside capture; during capture an
  unseen shape runs `F.linear`, unrecorded). Everywhere else (CPU, impl="ref", more rows) it is
  `F.linear`.
- `choices() -> {(M, N, K, dtype, has_bias): {"impl", "torch_us", "triton_us", "triton_config",
  "times_us"}}`: what `linear` picked so far and every candidate's time, for benchmarks and logs.
- `gated_norm_linear(y, z, norm_weight, eps, weight, bias=None, *, group_size, impl) -> [M, N]`:
  `linear(kernels.mamba2_norm.gated_rmsnorm(y, z, norm_weight, group_size, eps), weight, bias)`, Mamba-2's
  gated norm + out_proj. On a CUDA device with impl="triton", 1..MAX_ROWS rows and one group
  (group_size == K) it runs, per shape, the fastest of the unfused pair (gated_rmsnorm + `linear`,
  "torch" in the record) and every configuration of the GEMV with the norm in its prologue (one launch
  instead of two), measured as `linear` measures; elsewhere the unfused pair with `impl`.
  `norm_choices()` is its `choices()`.

Inside a CUDA graph: call `linear` (or `gemv` with impl="triton") once per shape before capture,
so that compilation, the measurement and the split-K workspace all happen outside it.
"""

import torch
import torch.nn.functional as F

from kernels import check_impl
from kernels.gemv.ref import gemv_ref

__all__ = ["gemv", "linear", "choices", "gated_norm_linear", "norm_choices", "gemv_ref", "MAX_ROWS"]

MAX_ROWS = 8
# (M, N, K, dtype name, has_bias, device index) -> the measured choice.
_CHOICES: dict = {}
# The same for `gated_norm_linear`, "torch" standing for the unfused gated_rmsnorm + linear pair.
_NORM_CHOICES: dict = {}


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
    """`linear`'s choice per shape so far: {(M, N, K, dtype, has_bias): record} (device index dropped;
    the record's config as its name)."""
    return {key[:5]: {k: v for k, v in rec.items() if k != "config"} for key, rec in _CHOICES.items()}


def norm_choices() -> dict:
    """`gated_norm_linear`'s choice per shape so far, as `choices()` ("torch": the unfused pair)."""
    return {key[:5]: {k: v for k, v in rec.items() if k != "config"} for key, rec in _NORM_CHOICES.items()}


def _graph_us(call, weights) -> float:
    """µs per call of `call(w)`, one call per weight copy, replayed from a CUDA graph: as in a decode
    step, calls run back to back and every weight comes from HBM (the copies overflow L2)."""
    from kernels.benchtools import time_ms

    return time_ms(lambda: [call(w) for w in weights], graph=True, warmup=1, iters=5) * 1e3 / len(weights)


def _choose(x2, weight, bias, key, baseline=None, norm=None, table=_CHOICES):
    """Time every Triton configuration that fits this shape and F.linear (or `baseline(w)`) the same
    way; keep the fastest. With `norm` the Triton candidates run the gated-norm prologue."""
    from kernels.gemv.triton import CONFIGS, config_fits, config_name, gemv_triton

    M, N, K = key[:3]
    device = x2.device
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
    copies = min(64, max(2, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    if baseline is None:
        def baseline(w):
            return F.linear(x2, w, bias)
    times = {"torch": _graph_us(baseline, weights)}
    configs = {config_name(c): c for c in CONFIGS if config_fits(c, M, K)}
    for name, cfg in configs.items():
        times[name] = _graph_us(lambda w, cfg=cfg: gemv_triton(x2, w, bias, config=cfg, norm=norm), weights)
    del weights
    best = min(times, key=times.get)
    fastest = min((n for n in times if n != "torch"), key=times.get, default=None)
    rec = {"impl": "torch" if best == "torch" else "triton", "config": configs.get(best), "torch_us": times["torch"],
           "triton_us": times[fastest] if fastest else None, "triton_config": fastest, "times_us": times}
    table[key] = rec
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

    return gemv_triton(x2, weight, bias, config=rec["config"]).view(*x.shape[:-1], N)


def gated_norm_linear(y, z, norm_weight, eps, weight, bias=None, *, group_size, impl):
    """out_proj(gated_rmsnorm(y, z)): y, z `[M, K]` (z may be a strided view), norm_weight `[K]`, weight
    `[N, K]`, bias `[N]` -> `[M, N]`; see the module docstring."""
    check_impl(impl)
    from kernels import mamba2_norm

    def unfused():
        h = mamba2_norm.gated_rmsnorm(y, z, norm_weight, group_size, eps, impl=impl)
        return F.linear(h, weight, bias) if impl == "ref" else linear(h, weight, bias, impl=impl)

    if impl != "triton" or not y.is_cuda or y.dim() != 2:
        return unfused()
    M, K = y.shape
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (y, z, norm_weight, weight, bias)):
        return unfused()
    if (M == 0 or M > MAX_ROWS or K == 0 or group_size != K or weight.dim() != 2 or weight.stride(-1) != 1
            or tuple(z.shape) != (M, K) or tuple(norm_weight.shape) != (K,)
            or any(t is not None and t.dtype != y.dtype for t in (z, norm_weight, weight, bias))):
        return unfused()
    N = weight.shape[0]
    key = (M, N, K, str(y.dtype).removeprefix("torch."), bias is not None, y.device.index)
    norm = (z, norm_weight, eps)
    rec = _NORM_CHOICES.get(key)
    if rec is None:
        if torch.cuda.is_current_stream_capturing():
            return unfused()
        unfused()  # `linear` measures its own shape here, outside any graph

        def baseline(w):
            return linear(mamba2_norm.gated_rmsnorm(y, z, norm_weight, group_size, eps, impl=impl), w, bias, impl=impl)

        rec = _choose(y, weight, bias, key, baseline=baseline, norm=norm, table=_NORM_CHOICES)
    if rec["impl"] != "triton":
        return unfused()
    from kernels.gemv.triton import gemv_triton

    return gemv_triton(y, weight, bias, config=rec["config"], norm=norm)
