"""Small-batch GEMV: y = x @ weight^T for a few rows of x (decode), the weight streamed once.

x `[M, K]` (M small, 1..16; any row stride, contiguous last dimension), weight `[N, K]` as
nn.Linear stores it (contiguous in K), optional bias `[N]` -> `[M, N]` in x's dtype, float32
accumulation. The grouped form runs G independent products in one launch: x `[G, M, K]`, weight
`[G, N, K]`, bias `[G, N]` -> `[G, M, N]`. `impl` is "triton" or "ref" (already resolved by
`declab_kernels.resolve_impl`).

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
  `linear(declab_kernels.mamba2_norm.gated_rmsnorm(y, z, norm_weight, group_size, eps), weight, bias)`, Mamba-2's
  gated norm + out_proj. On a CUDA device with impl="triton", 1..MAX_ROWS rows and one group
  (group_size == K) it runs, per shape, the fastest of the unfused pair (gated_rmsnorm + `linear`,
  "torch" in the record) and every configuration of the GEMV with the norm in its prologue (one launch
  instead of two), measured as `linear` measures; elsewhere the unfused pair with `impl`.
  `norm_choices()` is its `choices()`.
- `act_linear(x, act, weight, bias=None, *, impl) -> [M, N]`: `linear(act(x), weight, bias)` for
  act "sqrelu" (relu(x)^2: RWKV-7's value projection). As `gated_norm_linear`: per shape the fastest
  of the unfused pair (the activation kernel + `linear`) and the GEMV with the activation computed as
  its x tiles load; elsewhere the pair. x is not modified (unless `x_is_scratch=True`: the pair's
  relu^2 may then run in place). `act_choices()` is its `choices()`.
- `swiglu_linear(x, weight, bias=None, *, impl) -> [M, I]`: `declab_kernels.swiglu.silu_mul(linear(x,
  weight, bias))` with weight `[2I, K]` = [gate; up] (llama's fused gate/up projection). Per shape
  the fastest of that pair and the GEMV whose programs take gate and up rows of the same outputs and
  apply SwiGLU in the epilogue, once per output (an activation in the next GEMV's prologue would be
  recomputed by every one of its programs); elsewhere the pair. `swiglu_choices()` is its `choices()`.

- `rms_norm_linear(x, norm_weight, eps, weight, bias=None, *, impl, swiglu=False, early_tiles=1) -> [M, N]`:
  `linear(declab_kernels.rmsnorm.rms_norm(x), weight, bias)` (or `swiglu_linear` of it): a decoder's pre-norm
  and the projection after it. As `gated_norm_linear`: per shape the fastest of that pair and the GEMV
  with the norm in the same pass as the product (the statistics gathered as the x tiles load, 1 / rms
  applied to the sums: declab_kernels/gemv/README.md); elsewhere the pair. `rms_choices()` is its `choices()`.
- `rms_scaled_linear(x, sumsq, eps, weight, bias=None, *, impl, early_tiles=1) -> [M, N]`: the second half of an
  RMSNorm whose statistics the kernel before gathered: x `[M, K]` is already g * norm_weight and
  sumsq `[M, S]` (float32) holds partial sums of g^2 (Mamba-2's decode step writes one a head,
  `linear_residual_norm` one per program), so the result is rsqrt(sumsq.sum(-1) / K + eps) * (x @
  weight^T) + bias = linear(rmsnorm(g) * norm_weight). As
  `gated_norm_linear`: per shape the fastest of the pair (`linear` then the scale) and the GEMV that
  scales its products in the epilogue; elsewhere the pair. `scaled_choices()` is its `choices()`.
- `linear_residual_norm(x, weight, residual, norm_weight, bias=None, *, impl, rms_scale=None, early_tiles=1)
  -> (r, h, sumsq)`: r = `linear_residual(x, weight, residual, bias)`, and the first half
  of the RMSNorm that reads r next: h = r * norm_weight in x's dtype, sumsq `[M, S]` float32 partial
  sums of r^2, so that `rms_scaled_linear(h, sumsq, eps, W)` is `linear(rmsnorm(r), W)` with no norm
  kernel between. `rms_scale=(sumsq, eps)`: x itself comes with its statistics (as
  `rms_scaled_linear`'s). Per shape the fastest of the pair (the PyTorch ops, S = 1) and the GEMV that
  writes r, h and its columns' sum of squares in its epilogue; elsewhere the pair.
  `residual_norm_choices()` is its `choices()`. Mamba-2's batch-1 step runs its norms this way; llama's
  keeps its norms inside the GEMV after them (`rms_norm_linear`), which measured faster there
  (declab_kernels/gemv/README.md).
- `linear_residual(x, weight, residual, bias=None, *, impl, early_tiles=1) -> [M, N]`: `residual +
  linear(x, weight, bias)` in the residual's dtype (a decoder layer's residual add). Per shape the
  fastest of that pair and the GEMV that adds the residual in its epilogue; elsewhere the pair.
  `residual_choices()` is its `choices()`.
- `select_linear(x, weight, row_splits, bias=None, *, impl) -> [M, N]`: S inputs x `[S, M, K]`, weight
  `[N, K]`, row_splits S + 1 host ints rising from 0 to N: columns row_splits[i]:row_splits[i + 1] are
  input i times those weight rows (RWKV-7's r/k/v and LoRA down-projections, each of its own token-shift
  mix, from one packed weight). Per shape the fastest of the pair (F.linear of all S * M rows by the
  whole weight, S times the products for the same weight bytes, then the column blocks gathered) and
  the GEMV whose programs each multiply their rows by the one input those rows take; elsewhere each
  input's block by F.linear. `select_choices()` is its `choices()`.

Inside a CUDA graph: call `linear` (or `gemv` with impl="triton") once per shape before capture,
so that compilation, the measurement and the split-K workspace all happen outside it.
"""

import functools

import torch
import torch.nn.functional as F

from declab_kernels import check_impl
from declab_kernels.gemv.ref import gemv_ref

__all__ = ["gemv", "linear", "choices", "gated_norm_linear", "norm_choices", "act_linear", "act_choices",
           "swiglu_linear", "swiglu_choices", "rms_norm_linear", "rms_choices", "rms_scaled_linear",
           "scaled_choices", "linear_residual_norm", "residual_norm_choices", "linear_residual",
           "residual_choices", "select_linear", "select_choices", "gemv_ref", "MAX_ROWS"]

MAX_ROWS = 8
# (M, N, K, dtype name, has_bias, device index) -> the measured choice.
_CHOICES: dict = {}
# The same for `gated_norm_linear`, "torch" standing for the unfused gated_rmsnorm + linear pair.
_NORM_CHOICES: dict = {}
# The same for `act_linear` (key + the activation), "torch" standing for the activation kernel + linear.
_ACT_CHOICES: dict = {}
# The same for `swiglu_linear`, "torch" standing for linear + the SwiGLU kernel.
_SWIGLU_CHOICES: dict = {}
# The same for `rms_norm_linear` (key + swiglu), "torch" standing for the norm kernel + linear.
_RMS_CHOICES: dict = {}
# The same for `rms_scaled_linear`, "torch" standing for linear + the scale.
_SCALED_CHOICES: dict = {}
# The same for `linear_residual_norm` (key + the residual's dtype + rms_scale), "torch" the PyTorch ops.
_RESIDUAL_NORM_CHOICES: dict = {}
# The same for `linear_residual` (key + the residual's dtype), "torch" standing for linear + the add.
_RESIDUAL_CHOICES: dict = {}
# The same for `select_linear` (key + the row splits), "torch" standing for F.linear + the gather.
_SELECT_CHOICES: dict = {}


def gemv(x, weight, bias=None, *, impl, out=None):
    """x @ weight^T (+ bias), float32 accumulation, in x's dtype; written into `out` when given."""
    check_impl(impl)
    if impl == "ref":
        result = gemv_ref(x, weight, bias)
        if out is None:
            return result
        out.copy_(result)
        return out
    from declab_kernels.gemv.triton import gemv_triton

    return gemv_triton(x, weight, bias, out=out)


def _records(table) -> dict:
    """A choice table as the `*_choices()` functions return it: keys without the device index (the
    sixth field), records without the config object (its name stays)."""
    return {key[:5] + key[6:]: {k: v for k, v in rec.items() if k != "config"} for key, rec in table.items()}


def choices() -> dict:
    """`linear`'s choice per shape so far: {(M, N, K, dtype, has_bias): record} (device index dropped;
    the record's config as its name)."""
    return _records(_CHOICES)


def norm_choices() -> dict:
    """`gated_norm_linear`'s choice per shape so far, as `choices()` ("torch": the unfused pair)."""
    return _records(_NORM_CHOICES)


def act_choices() -> dict:
    """`act_linear`'s choice per (M, N, K, dtype, has_bias, act) so far, as `choices()` ("torch": the
    activation kernel + `linear`)."""
    return _records(_ACT_CHOICES)


def swiglu_choices() -> dict:
    """`swiglu_linear`'s choice per shape so far, as `choices()` ("torch": `linear` + the SwiGLU kernel)."""
    return _records(_SWIGLU_CHOICES)


def rms_choices() -> dict:
    """`rms_norm_linear`'s choice per (M, N, K, dtype, has_bias, swiglu) so far, as `choices()`
    ("torch": the norm kernel + `linear` or `swiglu_linear`)."""
    return _records(_RMS_CHOICES)


def scaled_choices() -> dict:
    """`rms_scaled_linear`'s choice per shape so far, as `choices()` ("torch": `linear` + the scale)."""
    return _records(_SCALED_CHOICES)


def residual_norm_choices() -> dict:
    """`linear_residual_norm`'s choice per (M, N, K, dtype, has_bias, residual dtype, rms_scale) so far,
    as `choices()` ("torch": the PyTorch ops)."""
    return _records(_RESIDUAL_NORM_CHOICES)


def residual_choices() -> dict:
    """`linear_residual`'s choice per (M, N, K, dtype, has_bias, residual dtype) so far, as `choices()`
    ("torch": `linear` + the add)."""
    return _records(_RESIDUAL_CHOICES)


def select_choices() -> dict:
    """`select_linear`'s choice per (M, N, K, dtype, has_bias, row_splits) so far, as `choices()`
    ("torch": F.linear of every input + the gather of the column blocks)."""
    return _records(_SELECT_CHOICES)


def _graph_us(call, weights) -> float:
    """µs per call of `call(w)`, one call per weight copy, replayed from a CUDA graph: as in a decode
    step, calls run back to back and every weight comes from HBM (the copies overflow L2)."""
    from declab_kernels.timing import time_ms

    return time_ms(lambda: [call(w) for w in weights], graph=True, warmup=1, iters=5) * 1e3 / len(weights)


def _choose(x2, weight, bias, key, baseline=None, table=_CHOICES, **fused):
    """Time every Triton configuration that fits this shape and F.linear (or `baseline(w)`) the same
    way; keep the fastest. The Triton candidates run with `fused` (`gemv_triton`'s norm= / rms_norm= /
    rms_scale= / act= / swiglu= / residual= / norm_out= / select=)."""
    from declab_kernels.gemv.triton import CONFIGS, config_fits, config_name, gemv_triton, select_align

    M, N, K = key[:3]
    device = x2.device
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
    copies = min(64, max(2, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    if baseline is None:
        def baseline(w):
            return F.linear(x2, w, bias)
    times = {"torch": _graph_us(baseline, weights)}
    align = select_align(fused["select"]) if fused.get("select") is not None else 0
    configs = {config_name(c): c for c in CONFIGS if config_fits(c, M, K, align)}
    for name, cfg in configs.items():
        times[name] = _graph_us(lambda w, cfg=cfg: gemv_triton(x2, w, bias, config=cfg, **fused), weights)
    del weights
    best = min(times, key=times.get)
    fastest = min((n for n in times if n != "torch"), key=times.get, default=None)
    rec = {"impl": "torch" if best == "torch" else "triton", "config": configs.get(best), "torch_us": times["torch"],
           "triton_us": times[fastest] if fastest else None, "triton_config": fastest, "times_us": times}
    table[key] = rec
    return rec


def linear(x, weight, bias=None, *, impl, early_tiles=1):
    """F.linear(x, weight, bias) for x `[..., K]`, weight `[N, K]`; see the module docstring.
    `early_tiles`: weight tiles a Triton program loads before its PDL wait (see `gemv_triton`)."""
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
    from declab_kernels.gemv.triton import gemv_triton

    return gemv_triton(x2, weight, bias, config=rec["config"], early_tiles=early_tiles).view(*x.shape[:-1], N)


def gated_norm_linear(y, z, norm_weight, eps, weight, bias=None, *, group_size, impl):
    """out_proj(gated_rmsnorm(y, z)): y, z `[M, K]` (z may be a strided view), norm_weight `[K]`, weight
    `[N, K]`, bias `[N]` -> `[M, N]`; see the module docstring."""
    check_impl(impl)
    from declab_kernels import mamba2_norm

    def pair(w):
        h = mamba2_norm.gated_rmsnorm(y, z, norm_weight, group_size, eps, impl=impl)
        return F.linear(h, w, bias) if impl == "ref" else linear(h, w, bias, impl=impl)

    K = y.shape[-1]
    if not (_fusable(y, weight, bias, impl) and group_size == K and tuple(z.shape) == tuple(y.shape)
            and tuple(norm_weight.shape) == (K,) and z.dtype == norm_weight.dtype == y.dtype
            and not (torch.is_grad_enabled() and (z.requires_grad or norm_weight.requires_grad))):
        return pair(weight)
    return _fused_or_pair(y, weight, bias, _key(y, weight, bias), _NORM_CHOICES, pair, norm=(z, norm_weight, eps))


def rms_norm_linear(x, norm_weight, eps, weight, bias=None, *, impl, swiglu=False, early_tiles=1):
    """`linear(declab_kernels.rmsnorm.rms_norm(x), weight, bias)`, or `swiglu_linear` of it with `swiglu`: x
    `[M, K]`, norm_weight `[K]`, weight `[N, K]`, all one dtype -> `[M, N]` (`[M, N / 2]`). See the
    module docstring; `early_tiles` as `linear`'s."""
    check_impl(impl)
    from declab_kernels import rmsnorm

    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm_linear: needs x [M, K], norm_weight [K] and weight [N, K], got {tuple(x.shape)}, "
                         f"{tuple(norm_weight.shape)} and {tuple(weight.shape)}")

    def pair(w):
        h = rmsnorm.rms_norm(x, norm_weight, eps, impl=impl)
        if swiglu:
            return swiglu_linear(h, w, bias, impl=impl)
        return F.linear(h, w, bias) if impl == "ref" else linear(h, w, bias, impl=impl, early_tiles=early_tiles)

    if not (_fusable(x, weight, bias, impl) and norm_weight.dtype == x.dtype and not (swiglu and weight.shape[0] % 2)
            and not (torch.is_grad_enabled() and norm_weight.requires_grad)):
        return pair(weight)
    return _fused_or_pair(x, weight, bias, (*_key(x, weight, bias), swiglu), _RMS_CHOICES, pair,
                          early_tiles=early_tiles, rms_norm=(norm_weight, eps), swiglu=swiglu)


def _check_sumsq(x, sumsq, caller):
    if sumsq.dim() != 2 or sumsq.shape[0] != x.shape[0] or sumsq.shape[1] == 0 or sumsq.dtype != torch.float32:
        raise ValueError(f"{caller}: needs a float32 sumsq [M, S] for x {tuple(x.shape)}, got {tuple(sumsq.shape)} "
                         f"{sumsq.dtype}")


def rms_scaled_linear(x, sumsq, eps, weight, bias=None, *, impl, early_tiles=1):
    """rsqrt(sumsq.sum(-1) / K + eps) * (x @ weight^T) + bias: x `[M, K]` (g * norm_weight), sumsq `[M, S]`
    float32 (partial sums of g^2), weight `[N, K]` -> `[M, N]` in x's dtype. See the module docstring;
    `early_tiles` as `linear`'s."""
    check_impl(impl)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_scaled_linear: needs x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    _check_sumsq(x, sumsq, "rms_scaled_linear")

    def pair(w):
        prod = F.linear(x, w) if impl == "ref" else linear(x, w, impl=impl, early_tiles=early_tiles)
        out = prod.float() * torch.rsqrt(sumsq.sum(-1, keepdim=True) / x.shape[-1] + eps)
        return (out if bias is None else out + bias.float()).to(x.dtype)

    if not _fusable(x, weight, bias, impl):
        return pair(weight)
    return _fused_or_pair(x, weight, bias, _key(x, weight, bias), _SCALED_CHOICES, pair, early_tiles=early_tiles,
                          rms_scale=(sumsq, eps))


def linear_residual_norm(x, weight, residual, norm_weight, bias=None, *, impl, rms_scale=None, early_tiles=1):
    """(r, h, sumsq): r = residual + linear(x, weight, bias) `[M, N]` in the residual's dtype (the product
    rounded to x's dtype first, with `rms_scale=(sumsq_x, eps)` scaled as `rms_scaled_linear`'s), h = r *
    norm_weight `[M, N]` in x's dtype and sumsq `[M, S]` float32 partial sums of r^2. See the module
    docstring; `early_tiles` as `linear`'s."""
    check_impl(impl)
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]
            or tuple(residual.shape) != (x.shape[0], weight.shape[0]) or tuple(norm_weight.shape) != (weight.shape[0],)):
        raise ValueError(f"linear_residual_norm: needs x [M, K], weight [N, K], residual [M, N] and norm_weight [N], "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}, {tuple(residual.shape)} and "
                         f"{tuple(norm_weight.shape)}")
    if rms_scale is not None:
        _check_sumsq(x, rms_scale[0], "linear_residual_norm")

    def pair(w):
        if rms_scale is None:
            prod = F.linear(x, w, bias) if impl == "ref" else linear(x, w, bias, impl=impl, early_tiles=early_tiles)
        else:
            prod = rms_scaled_linear(x, *rms_scale, w, bias, impl=impl, early_tiles=early_tiles)
        r = (residual.float() + prod.float()).to(residual.dtype)
        h = (r.float() * norm_weight.float()).to(x.dtype)
        return r, h, r.float().square().sum(-1, keepdim=True)

    if not (_fusable(x, weight, bias, impl) and residual.stride(-1) == 1 and residual.is_floating_point()
            and not (torch.is_grad_enabled() and (residual.requires_grad or norm_weight.requires_grad))):
        return pair(weight)
    key = (*_key(x, weight, bias), str(residual.dtype).removeprefix("torch."), rms_scale is not None)
    return _fused_or_pair(x, weight, bias, key, _RESIDUAL_NORM_CHOICES, pair, early_tiles=early_tiles,
                          residual=residual, norm_out=norm_weight, rms_scale=rms_scale)


def linear_residual(x, weight, residual, bias=None, *, impl, early_tiles=1):
    """`residual + linear(x, weight, bias)`: x `[M, K]`, weight `[N, K]`, residual `[M, N]` (any float
    dtype) -> `[M, N]` in the residual's dtype, the product rounded to x's dtype before the add. See
    the module docstring; `early_tiles` as `linear`'s."""
    check_impl(impl)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or tuple(residual.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"linear_residual: needs x [M, K], weight [N, K] and residual [M, N], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(residual.shape)}")

    def pair(w):
        out = F.linear(x, w, bias) if impl == "ref" else linear(x, w, bias, impl=impl, early_tiles=early_tiles)
        return residual + out

    if not (_fusable(x, weight, bias, impl) and residual.stride(-1) == 1 and residual.is_floating_point()
            and not (torch.is_grad_enabled() and residual.requires_grad)):
        return pair(weight)
    key = (*_key(x, weight, bias), str(residual.dtype).removeprefix("torch."))
    return _fused_or_pair(x, weight, bias, key, _RESIDUAL_CHOICES, pair, early_tiles=early_tiles, residual=residual)


def check_row_splits(x, weight, row_splits, caller="select_linear") -> tuple:
    """row_splits as a tuple of ints, checked against x `[S, M, K]` and weight `[N, K]`: S + 1 split
    points rising from 0 to N (ValueError naming `caller` otherwise)."""
    splits = tuple(int(v) for v in row_splits)
    if (x.dim() != 3 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or len(splits) != x.shape[0] + 1
            or splits[0] != 0 or splits[-1] != weight.shape[0] or any(b < a for a, b in zip(splits, splits[1:]))):
        raise ValueError(f"{caller}: needs x [S, M, K], weight [N, K] and S + 1 row splits rising from 0 to N, "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)} and {splits}")
    return splits


def select_linear(x, weight, row_splits, bias=None, *, impl):
    """x `[S, M, K]`, weight `[N, K]` (bias `[N]`), row_splits S + 1 ints rising from 0 to N -> `[M, N]`
    whose columns row_splits[i]:row_splits[i + 1] are F.linear(x[i], those weight rows, bias). See the
    module docstring."""
    check_impl(impl)
    splits = check_row_splits(x, weight, row_splits)
    S, M, K = x.shape
    blocks = list(zip(splits, splits[1:]))
    if not (_fusable(x[0], weight, bias, impl) and x.stride(-1) == 1):
        return torch.cat([F.linear(x[i], weight[a:b], None if bias is None else bias[a:b])
                          for i, (a, b) in enumerate(blocks)], -1)

    def pair(w):
        y = F.linear(x.reshape(S * M, K), w, bias)
        return torch.cat([y[i * M : (i + 1) * M, a:b] for i, (a, b) in enumerate(blocks)], -1)

    return _fused_or_pair(x, weight, bias, (*_key(x[0], weight, bias), splits), _SELECT_CHOICES, pair, select=splits)


def act_linear(x, act, weight, bias=None, *, impl, x_is_scratch=False):
    """linear(act(x), weight, bias) for act "sqrelu" (relu(x)^2, `declab_kernels.rwkv7_fused.sqrelu`): x
    `[M, K]`, weight `[N, K]` -> `[M, N]`. x is not modified unless `x_is_scratch`, which lets the
    unfused path compute relu^2 in place instead of on a copy. See the module docstring."""
    check_impl(impl)
    from declab_kernels.gemv.triton import ACTS
    from declab_kernels.rwkv7_fused import sqrelu

    if act not in ACTS:
        raise ValueError(f"act_linear: act must be one of {sorted(ACTS)}, got {act!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"act_linear: needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    def pair_on(t, w):
        # relu^2 in place on t, as a step runs it
        h = sqrelu(t, impl=impl)
        return F.linear(h, w, bias) if impl == "ref" else linear(h, w, bias, impl=impl)

    def pair(w):
        return pair_on(x if x_is_scratch else x.clone(), w)

    if not _fusable(x, weight, bias, impl):
        return pair(weight)
    # Measured on a copy of x, which every timed call overwrites.
    return _fused_or_pair(x, weight, bias, (*_key(x, weight, bias), act), _ACT_CHOICES, pair,
                          timed_pair=lambda: functools.partial(pair_on, x.clone()), act=act)


def swiglu_linear(x, weight, bias=None, *, impl):
    """`declab_kernels.swiglu.silu_mul(linear(x, weight, bias))`: x `[M, K]`, weight `[2I, K]` (gate then up
    rows, one fused projection) -> `[M, I]`. See the module docstring."""
    check_impl(impl)
    from declab_kernels import swiglu

    if x.dim() != 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[-1] or weight.shape[0] % 2:
        raise ValueError(f"swiglu_linear: needs x [M, K] and weight [2I, K], got {tuple(x.shape)} and {tuple(weight.shape)}")

    def pair(w):
        return swiglu.silu_mul(F.linear(x, w, bias) if impl == "ref" else linear(x, w, bias, impl=impl), impl=impl)

    if not _fusable(x, weight, bias, impl):
        return pair(weight)
    return _fused_or_pair(x, weight, bias, _key(x, weight, bias), _SWIGLU_CHOICES, pair, swiglu=True)


def _fusable(x, weight, bias, impl) -> bool:
    """Whether a fused GEMV may run: CUDA, impl="triton", 1..MAX_ROWS rows, no autograd, one dtype."""
    if impl != "triton" or not x.is_cuda or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS or x.shape[1] == 0:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))


def _key(x, weight, bias):
    return (x.shape[0], weight.shape[0], x.shape[1], str(x.dtype).removeprefix("torch."), bias is not None, x.device.index)


def _fused_or_pair(x, weight, bias, key, table, pair, *, timed_pair=None, early_tiles=1, **fused):
    """The GEMV with `fused` (`gemv_triton`'s norm= / rms_norm= / rms_scale= / act= / swiglu= / residual= /
    norm_out= / select=) or `pair(weight)`, whichever `table` records as faster for `key`. The first call of a key
    outside capture measures both: the pair as `timed_pair()` (default: `pair`) per weight copy, after
    one call of it that lets `linear` measure its own shape outside any graph. During capture an
    unmeasured key runs the pair."""
    rec = table.get(key)
    if rec is None:
        if torch.cuda.is_current_stream_capturing():
            return pair(weight)
        baseline = timed_pair() if timed_pair is not None else pair
        baseline(weight)
        rec = _choose(x, weight, bias, key, baseline=baseline, table=table, **fused)
    if rec["impl"] != "triton":
        return pair(weight)
    from declab_kernels.gemv.triton import gemv_triton

    return gemv_triton(x, weight, bias, config=rec["config"], early_tiles=early_tiles, **fused)
