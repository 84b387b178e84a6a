"""Small-batch projections: y = x @ weight^T for a few rows of x (decode), the weight streamed once,
with the work around a projection fused into it as data.

- `linear(x, weight, bias=None, *, pre=None, post=None, impl, early_tiles=1)`: the projection of every
  decode step. x `[..., K]` (with `pre` or `post`: `[M, K]`; with `fusions.Select`: `[S, M, K]`), weight
  `[N, K]` as nn.Linear stores it (or a weight object, below), bias `[N]`. `pre` / `post` are records of
  `declab_kernels.gemv.fusions` (RMSNorm, GatedRMSNorm, RMSScale, SqReLU, Select / SwiGLU, Residual,
  ResidualNorm, AddRMSNorm); each says what it computes and returns (a `Select` projection: a
  `fusions.Columns`, the result as column pieces). Without them the result is
  `F.linear(x, weight, bias)`. On a CUDA device with impl="triton", a dense weight and 1..`tuning.MAX_ROWS`
  rows, it runs, per choice-table key, the fastest of the unfused form and every Triton GEMV
  configuration that fits with the fusion in its prologue / epilogue, measured once when the key is
  first seen: each candidate replayed from a CUDA graph over enough copies of the weight to overflow
  L2, as the calls of a decode step run (outside capture; during capture an unseen key runs the unfused
  form, unrecorded). Everywhere else (CPU, impl="ref", more rows, autograd) the unfused form with `impl`:
  the pre's kernel, then the rest of the projection, then the post's. `early_tiles` (1 or 2): weight tiles
  a Triton program loads before its PDL wait (`triton.gemv_triton`; the rules are in `declab_kernels.tuning`).
- `choices() -> [record]`: what `linear` picked so far, one record per key: M, N, K, dtype, bias, pre,
  post (the specs' keys as text, "" for none), weight (the weight-format axis: "dense" today), impl
  ("torch": the unfused form, or "triton"), torch_us, triton_us, triton_config and every candidate's
  times_us (and from_file, the file it came from, for a pick read from DECLAB_GEMV_CHOICES). The
  profiler and the benchmarks read it.
- `gemv(x, weight, bias=None, *, impl, out=None) -> [M, N] | [G, M, N]`: the plain GEMV kernel (or its
  float32 reference), also grouped: x `[G, M, K]`, weight `[G, N, K]`, bias `[G, N]`.

Weight objects (quantised formats): `weight` may be any object that is not a tensor and has
`.shape` (N, K), `.dtype` (the activations' dtype), `.format` (a short string such as "int4-g128"),
`.dequantize() -> [N, K]` dense, and `.matmul(x2d, *, impl) -> [M, N]` in x2d's dtype for x2d `[M, K]`.
`linear` then applies `pre` unfused, calls `weight.matmul`, adds the bias and applies `post` unfused
(`Select` multiplies all S * M rows and gathers the column blocks). The choice table's weight axis is
the place for a format's own fused kernels.

Inside a CUDA graph: call `linear` once per key before capture, so that compilation, the measurement
and the split-K workspace all happen outside it.

`DECLAB_GEMV_CHOICES=FILE` keeps the table beyond the process: a key recorded in FILE (JSON lines) for
the same GPU model and Triton version is taken from it instead of measured, and every key measured is
appended to it. Two processes (two trees of an A/B, a test run on a fresh machine) then run the same
picks, and neither times nor compiles the candidates it does not run.
"""

import json
import os

import torch
import torch.nn.functional as F

from declab_kernels import check_impl, tuning
from declab_kernels.gemv import fusions
from declab_kernels.gemv.ref import gemv_ref

__all__ = ["linear", "choices", "gemv", "fusions"]

# (M, N, K, dtype name, has_bias, pre key, post key, weight format, device index) -> the measured choice.
_TABLE: dict = {}


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


def _text(key) -> str:
    return "" if key is None else ":".join(str(v) for v in key)


def choices() -> list:
    """`linear`'s choice per key so far (see the module docstring); the records without the config
    object (its name stays in triton_config)."""
    return [{"M": key[0], "N": key[1], "K": key[2], "dtype": key[3], "bias": key[4], "pre": _text(key[5]),
             "post": _text(key[6]), "weight": key[7], **{k: v for k, v in rec.items() if k != "config"}}
            for key, rec in _TABLE.items()]


def _file_key(key, device) -> str:
    """A choice-table key as FILE records it: the key without the device index, with the GPU model and
    the Triton version the times were measured on."""
    import triton

    return json.dumps([*key[:5], _text(key[5]), _text(key[6]), key[7], torch.cuda.get_device_name(device), triton.__version__])


_FILE: dict = {}


def _record(line: str) -> dict | None:
    """One line of DECLAB_GEMV_CHOICES as a record; None for a line that is not one (a line cut short
    by a process stopped while appending: its key is measured again)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and {"key", "impl", "triton_config"} <= rec.keys() else None


def _stored(key, device) -> dict | None:
    """The record of `key` in DECLAB_GEMV_CHOICES (read once), its configuration resolved by name;
    None when there is no file, no record, or a configuration this tree no longer has."""
    path = os.environ.get("DECLAB_GEMV_CHOICES")
    if not path:
        return None
    if path not in _FILE:
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        _FILE[path] = {rec["key"]: rec for rec in map(_record, lines) if rec is not None}
    rec = _FILE[path].get(_file_key(key, device))
    if rec is None:
        return None
    from declab_kernels.gemv.triton import CONFIGS, config_name

    configs = {config_name(c): c for c in CONFIGS}
    if rec["impl"] == "triton" and rec["triton_config"] not in configs:
        return None
    config = configs.get(rec["triton_config"]) if rec["impl"] == "triton" else None
    return {**{k: v for k, v in rec.items() if k != "key"}, "config": config, "from_file": path}


def _store(key, device, rec) -> None:
    """Appends `rec` (a measured choice) to DECLAB_GEMV_CHOICES, when set."""
    path = os.environ.get("DECLAB_GEMV_CHOICES")
    if not path:
        return
    line = {"key": _file_key(key, device), **{k: v for k, v in rec.items() if k != "config"}}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    _FILE.setdefault(path, {})[line["key"]] = line


def _graph_us(call, weights) -> float:
    """µs per call of `call(w)`, one call per weight copy, replayed from a CUDA graph: as in a decode
    step, calls run back to back and every weight comes from HBM (the copies overflow L2)."""
    from declab_kernels.timing import time_ms

    return time_ms(lambda: [call(w) for w in weights], graph=True, warmup=1, iters=5) * 1e3 / len(weights)


def _choose(x, weight, bias, key, baseline, fused) -> dict:
    """Time every Triton configuration that fits this key with `fused` (`gemv_triton`'s keyword
    arguments) and `baseline(w)` the same way; record and return the fastest."""
    from declab_kernels.gemv.triton import CONFIGS, config_fits, config_name, gemv_triton, select_align

    M, N, K = key[:3]
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 64 << 20) or (64 << 20)
    copies = min(64, max(2, -(-2 * l2 // (weight.numel() * weight.element_size()))))
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    times = {"torch": _graph_us(baseline, weights)}
    align = select_align(fused["select"]) if "select" in fused else 0
    configs = {config_name(c): c for c in CONFIGS if config_fits(c, M, K, align)}
    for name, cfg in configs.items():
        times[name] = _graph_us(lambda w, cfg=cfg: gemv_triton(x, w, bias, config=cfg, **fused), weights)
    del weights
    best = min(times, key=times.get)
    fastest = min((n for n in times if n != "torch"), key=times.get, default=None)
    rec = {"impl": "torch" if best == "torch" else "triton", "config": configs.get(best), "torch_us": times["torch"],
           "triton_us": times[fastest] if fastest else None, "triton_config": fastest, "times_us": times}
    _TABLE[key] = rec
    _store(key, x.device, rec)
    return rec


def _dense_fusable(x, weight, bias, impl) -> bool:
    """Whether a Triton GEMV may run: CUDA, impl="triton", x [M, K] with 1..MAX_ROWS rows, a dense
    weight contiguous in K, one dtype, no autograd."""
    if impl != "triton" or not x.is_cuda or x.dim() != 2 or not 0 < x.shape[0] <= tuning.MAX_ROWS or x.shape[1] == 0:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        return False
    return fusions.no_grad(x, weight, bias)


def _unfused(x, weight, bias, pre, post, impl, early_tiles):
    """One fusion peeled off and run as its own kernel or PyTorch ops, the rest through `linear`:
    the pre first when it works on x (`Pre.before`), else the post."""
    if pre is not None and (post is None or pre.before):
        def product(h, b):
            return linear(h, weight, b, post=post, impl=impl, early_tiles=early_tiles)

        return pre.unfused(x, weight, bias, product, impl)
    return post.unfused(linear(x, weight, bias, pre=pre, impl=impl, early_tiles=early_tiles), impl)


def _object_product(x, weight, bias, impl):
    """A weight object's product (module docstring) for x `[..., K]`."""
    y = weight.matmul(x.reshape(-1, x.shape[-1]), impl=impl)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def linear(x, weight, bias=None, *, pre=None, post=None, impl, early_tiles=tuning.EARLY_TILES):
    """The projection x @ weight^T + bias with `pre` and `post` fused into it; see the module docstring."""
    check_impl(impl)
    N, K = tuple(weight.shape)[-2:]
    if x.shape[-1] != K:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if isinstance(pre, fusions.Select) and post is not None:
        raise ValueError("linear: a Select pre takes no post")
    if pre is not None:
        pre.check(x, N, K)
    if post is not None:
        post.check(x, N, K)
    dense = isinstance(weight, torch.Tensor)
    if pre is None and post is None:
        if not dense:
            return _object_product(x, weight, bias, impl)
        x2 = x.reshape(-1, K) if K else x
        if not _dense_fusable(x2, weight, bias, impl):
            return F.linear(x, weight, bias)
        out = _measured(x2, weight, bias, None, None, impl, early_tiles)
        return out.view(*x.shape[:-1], N)
    if not dense:
        return _unfused(x, weight, bias, pre, post, impl, early_tiles)
    rows = x[0] if isinstance(pre, fusions.Select) else x
    if not (_dense_fusable(rows, weight, bias, impl) and all(s is None or s.fusable(x) for s in (pre, post))):
        return _unfused(x, weight, bias, pre, post, impl, early_tiles)
    return _measured(x, weight, bias, pre, post, impl, early_tiles)


def _measured(x, weight, bias, pre, post, impl, early_tiles):
    """The Triton GEMV with the fusions or their unfused form, whichever the choice table records as
    faster for this key. The first call of a key outside capture measures both: the unfused form once
    (which lets `linear` measure the keys it calls outside any graph), then timed per weight copy, on
    a copy of x when the form writes into x (`Pre.in_place`). During capture an unseen key runs the
    unfused form."""
    rows = x.shape[-2]
    key = (rows, weight.shape[0], x.shape[-1], fusions.dtype_name(x), bias is not None, pre.key() if pre else None,
           post.key() if post else None, "dense", x.device.index)

    def pair(xin, w):
        if pre is None and post is None:
            return F.linear(xin, w, bias)
        return _unfused(xin, w, bias, pre, post, impl, early_tiles)

    fused = {**(pre.kernel_args() if pre else {}), **(post.kernel_args() if post else {})}
    rec = _TABLE.get(key)
    if rec is None and (rec := _stored(key, x.device)) is not None:
        _TABLE[key] = rec
    if rec is None:
        if torch.cuda.is_current_stream_capturing():
            return pair(x, weight)
        timed = x.clone() if pre is not None and pre.in_place else x
        pair(timed, weight)
        rec = _choose(x, weight, bias, key, lambda w: pair(timed, w), fused)
    if rec["impl"] != "triton":
        return pair(x, weight)
    from declab_kernels.gemv.triton import gemv_triton

    out = gemv_triton(x, weight, bias, config=rec["config"], early_tiles=early_tiles, **fused)
    return fusions.Columns([(0, out)]) if isinstance(pre, fusions.Select) else out
