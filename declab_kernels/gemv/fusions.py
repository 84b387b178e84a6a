"""What `declab_kernels.gemv.linear` can fuse into a projection: one small record per fusion.

A `pre` spec changes the projection's input (or, for `RMSScale`, scales its products by statistics
that came with the input); a `post` spec consumes its output. Each spec owns:

- `check(x, n, k)`: ValueError naming the spec for inputs it cannot take (x as `linear` got it,
  weight `[n, k]`), run before anything else;
- `fusable(x) -> bool`: whether the fused Triton GEMV may take these inputs (else the unfused form runs);
- `kernel_args() -> dict`: the keyword arguments of `declab_kernels.gemv.triton.gemv_triton` that fuse it;
- `key() -> tuple`: its part of the choice-table key (kind first, then what changes the kernel);
- its unfused PyTorch equivalent: `Pre.unfused(x, weight, bias, product, impl)` where `product(h, bias)`
  is the rest of the projection (itself a `linear`), `Post.unfused(y, impl)` on the product.

`Pre.before`: True when the unfused form transforms x before the product (a norm, an activation, a
row select), False when it works on the products (`RMSScale`); `linear` peels such a pre last, so the
unfused pair of a pre + post fusion is the pre's kernel, then the post's fusion (measured on its own).
`Pre.in_place`: the unfused form writes into x (its timing then runs on a copy).

Adding a fusion: a class here (the four methods and its unfused form) and the kernel's support for
its `kernel_args` in `triton.py`; nothing else changes (declab_kernels/gemv/README.md).
"""

import torch
import torch.nn.functional as F

from declab_kernels import tuning

__all__ = ["Pre", "Post", "RMSNorm", "GatedRMSNorm", "RMSScale", "SqReLU", "Select", "Columns", "SwiGLU", "Residual",
           "ResidualNorm", "AddRMSNorm"]


def no_grad(*tensors) -> bool:
    """Whether no autograd records through these tensors (the Triton GEMV has no backward)."""
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _need_2d(x, name):
    if x.dim() != 2:
        raise ValueError(f"{name}: needs x [M, K], got {tuple(x.shape)}")


class Fusion:
    """What every fusion record has: its kind, its input check, whether the fused kernel takes it, and
    its part of the choice table's key."""

    kind = ""

    def check(self, x, n, k):
        _need_2d(x, self.kind)

    def fusable(self, x) -> bool:
        return True

    def key(self) -> tuple:
        return (self.kind,)


class Pre(Fusion):
    """Base of the input-side fusions."""

    before = True
    in_place = False


class Post(Fusion):
    """Base of the output-side fusions."""


class RMSNorm(Pre):
    """x -> rmsnorm(x) * weight (`declab_kernels.rmsnorm.rms_norm`), weight `[K]` in x's dtype. Fused:
    the statistics gathered as the x tiles load, 1 / rms applied to the sums (the normalised row is
    not rounded to x's dtype first: bf16 differs by ~0.3% of an element)."""

    kind = "rms_norm"

    def __init__(self, weight, eps):
        self.weight, self.eps = weight, eps

    def check(self, x, n, k):
        super().check(x, n, k)
        if tuple(self.weight.shape) != (k,):
            raise ValueError(f"rms_norm: needs a norm weight [{k}], got {tuple(self.weight.shape)}")

    def fusable(self, x) -> bool:
        return self.weight.dtype == x.dtype and no_grad(self.weight)

    def kernel_args(self) -> dict:
        return {"rms_norm": (self.weight, self.eps)}

    def unfused(self, x, weight, bias, product, impl):
        from declab_kernels import rmsnorm

        return product(rmsnorm.rms_norm(x, self.weight, self.eps, impl=impl), bias)


class GatedRMSNorm(Pre):
    """y -> rmsnorm(y * silu(z)) * weight per group of `group_size` channels (Mamba-2's gated norm,
    `declab_kernels.mamba2_norm.gated_rmsnorm`); z `[M, K]` may be a strided view. Fused for one group."""

    kind = "gated_rms_norm"

    def __init__(self, z, weight, eps, group_size):
        self.z, self.weight, self.eps, self.group_size = z, weight, eps, group_size

    def fusable(self, x) -> bool:
        k = x.shape[-1]
        return (self.group_size == k and tuple(self.z.shape) == tuple(x.shape) and tuple(self.weight.shape) == (k,)
                and self.z.dtype == self.weight.dtype == x.dtype and no_grad(self.z, self.weight))

    def kernel_args(self) -> dict:
        return {"norm": (self.z, self.weight, self.eps)}

    def unfused(self, x, weight, bias, product, impl):
        from declab_kernels import mamba2_norm

        return product(mamba2_norm.gated_rmsnorm(x, self.z, self.weight, self.group_size, self.eps, impl=impl), bias)


class RMSScale(Pre):
    """The second half of an RMSNorm whose statistics the kernel before gathered: x is g * norm_weight,
    sumsq `[M, S]` float32 partial sums of g^2; the result is rsqrt(sumsq.sum(-1) / K + eps) * (x @ W^T)
    + bias = linear(rmsnorm(g) * norm_weight). Fused: the products scaled in the epilogue."""

    kind = "rms_scale"
    before = False

    def __init__(self, sumsq, eps):
        self.sumsq, self.eps = sumsq, eps

    def check(self, x, n, k):
        super().check(x, n, k)
        s = self.sumsq
        if s.dim() != 2 or s.shape[0] != x.shape[0] or s.shape[1] == 0 or s.dtype != torch.float32:
            raise ValueError(f"rms_scale: needs a float32 sumsq [M, S] for x {tuple(x.shape)}, got {tuple(s.shape)} "
                             f"{s.dtype}")

    def kernel_args(self) -> dict:
        return {"rms_scale": (self.sumsq, self.eps)}

    def unfused(self, x, weight, bias, product, impl):
        out = product(x, None).float() * torch.rsqrt(self.sumsq.sum(-1, keepdim=True) / x.shape[-1] + self.eps)
        return (out if bias is None else out + bias.float()).to(x.dtype)


class SqReLU(Pre):
    """x -> relu(x)^2 (RWKV-7's channel mix, `declab_kernels.rwkv7_fused.sqrelu`), rounded to x's dtype.
    Fused: computed as the x tiles load. x is not modified unless `scratch`, which lets the unfused
    form compute relu^2 in place instead of on a copy."""

    kind = "sqrelu"

    def __init__(self, scratch=False):
        self.scratch = scratch
        self.in_place = scratch

    def kernel_args(self) -> dict:
        return {"act": "sqrelu"}

    def unfused(self, x, weight, bias, product, impl):
        from declab_kernels.rwkv7_fused import sqrelu

        return product(sqrelu(x if self.scratch else x.clone(), impl=impl), bias)


def check_row_splits(x, n, row_splits, caller="select") -> tuple:
    """row_splits as a tuple of ints, checked against x `[S, M, K]` and a weight of n rows: S + 1 split
    points rising from 0 to n (ValueError naming `caller` otherwise)."""
    splits = tuple(int(v) for v in row_splits)
    if (x.dim() != 3 or len(splits) != x.shape[0] + 1 or splits[0] != 0 or splits[-1] != n
            or any(b < a for a, b in zip(splits, splits[1:]))):
        raise ValueError(f"{caller}: needs x [S, M, K] and S + 1 row splits rising from 0 to N = {n}, "
                         f"got {tuple(x.shape)} and {splits}")
    return splits


class Select(Pre):
    """S inputs x `[S, M, K]`, one packed weight: a `Columns` `[M, N]` whose columns
    row_splits[i]:row_splits[i + 1] are input i times those weight rows (RWKV-7's r/k/v and LoRA down-projections, each of its own token-shift
    mix). Fused: each program multiplies its rows by the one input they take. Unfused, up to
    `tuning.CROSS_ROWS` rows: one GEMM of all S * M rows by the whole weight, the column blocks
    gathered (S times the products for the same weight bytes); more rows: by `panels`, else block by
    block. `panels`: (first input, end input, first row, end row, "batched" | "cross") each, covering
    the weight: "batched" multiplies input i by the next (row end - row start) / inputs rows as one
    batched GEMM, "cross" every input of the panel by all its rows."""

    kind = "select"

    def __init__(self, row_splits, panels=None):
        self.row_splits = tuple(int(v) for v in row_splits)
        self.panels = tuple(panels) if panels is not None else None

    def check(self, x, n, k):
        check_row_splits(x, n, self.row_splits)

    def fusable(self, x) -> bool:
        return x.stride(-1) == 1

    def kernel_args(self) -> dict:
        return {"select": self.row_splits}

    def key(self) -> tuple:
        return (self.kind, self.row_splits)

    def _blocks(self):
        return list(zip(self.row_splits, self.row_splits[1:]))

    def unfused(self, x, weight, bias, product, impl):
        S, M, K = x.shape
        dense = isinstance(weight, torch.Tensor)
        if not dense or S * M <= tuning.CROSS_ROWS:
            flat = x.reshape(S * M, K)
            y = F.linear(flat, weight, bias) if dense else product(flat, bias)
            return Columns([(a, y[i * M : (i + 1) * M, a:b]) for i, (a, b) in enumerate(self._blocks())])
        if self.panels is None:
            return Columns([(a, F.linear(x[i], weight[a:b], None if bias is None else bias[a:b]))
                            for i, (a, b) in enumerate(self._blocks())])
        pieces = []
        for i0, i1, lo, hi, mode in self.panels:
            n = i1 - i0
            if mode == "batched":
                width = (hi - lo) // n
                # [n, M, width]: input i0 + j times rows lo + j * width ..
                y = torch.bmm(x[i0:i1], weight[lo:hi].view(n, width, K).transpose(1, 2))
                pieces += [(lo + j * width, y[j]) for j in range(n)]
            else:
                # [n * M, hi - lo]: every input of the panel times every row of it, diagonal blocks kept
                y = x[i0:i1].reshape(n * M, K) @ weight[lo:hi].T
                for j in range(n):
                    a, b = max(self.row_splits[i0 + j], lo), min(self.row_splits[i0 + j + 1], hi)
                    if b > a:
                        pieces.append((a, y[j * M : (j + 1) * M, a - lo : b - lo]))
        if bias is not None:
            pieces = [(a, t + bias[a : a + t.shape[1]]) for a, t in pieces]
        return Columns(sorted(pieces, key=lambda p: p[0]))


class Columns:
    """What a `Select` projection returns: the `[M, N]` result as column pieces, each a view of the
    product that computed it (the unfused forms keep them apart: gathering them into one tensor would
    cost a copy every step). `cols(a, b)` is the `[M, b - a]` block, a view when one piece holds it;
    `cat()` the whole `[M, N]`."""

    def __init__(self, pieces):
        # [(first column, [M, width])] in column order, covering 0..N
        self.pieces = list(pieces)
        last_start, last = self.pieces[-1]
        self.shape = (last.shape[0], last_start + last.shape[1])

    def cols(self, a, b):
        for start, t in self.pieces:
            if start <= a and b <= start + t.shape[1]:
                return t[:, a - start : b - start]
        return torch.cat([t[:, max(a, s) - s : min(b, s + t.shape[1]) - s] for s, t in self.pieces
                          if s < b and s + t.shape[1] > a], -1)

    def cat(self):
        return self.pieces[0][1] if len(self.pieces) == 1 else torch.cat([t for _, t in self.pieces], -1)


class SwiGLU(Post):
    """y `[M, 2I]` = [gate; up] products -> silu(gate) * up `[M, I]` (llama's fused gate/up projection,
    `declab_kernels.swiglu.silu_mul`). Fused: each program takes gate and up rows of the same outputs."""

    kind = "swiglu"

    def check(self, x, n, k):
        super().check(x, n, k)
        if n % 2:
            raise ValueError(f"swiglu: needs a weight [2I, K] (gate then up rows), got {n} rows")

    def kernel_args(self) -> dict:
        return {"swiglu": True}

    def unfused(self, y, impl):
        from declab_kernels import swiglu

        return swiglu.silu_mul(y, impl=impl)


def _check_residual(kind, residual, x, n):
    if tuple(residual.shape) != (x.shape[0], n):
        raise ValueError(f"{kind}: needs a residual [{x.shape[0]}, {n}], got {tuple(residual.shape)}")


class Residual(Post):
    """residual + y in the residual's dtype (any float dtype), the product rounded to x's dtype before
    the add: a decoder layer's residual add. `reduce` (a row-parallel projection's all-reduce under
    tensor parallel, in place on y, returning it) runs on the product before the add; the fused
    epilogue cannot, so with `reduce` the unfused form runs."""

    kind = "residual"

    def __init__(self, residual, reduce=None):
        self.residual, self.reduce = residual, reduce

    def check(self, x, n, k):
        super().check(x, n, k)
        _check_residual(self.kind, self.residual, x, n)

    def fusable(self, x) -> bool:
        r = self.residual
        return self.reduce is None and r.stride(-1) == 1 and r.is_floating_point() and no_grad(r)

    def kernel_args(self) -> dict:
        return {"residual": self.residual}

    def key(self) -> tuple:
        return (self.kind, dtype_name(self.residual))

    def reduced(self, y):
        return y if self.reduce is None else self.reduce(y)

    def unfused(self, y, impl):
        return self.residual + self.reduced(y)


class ResidualNorm(Residual):
    """`Residual` and the first half of the RMSNorm that reads the new residual r next: returns (r, h,
    sumsq), h = r * norm_weight `[M, N]` in x's dtype and sumsq `[M, S]` float32 partial sums of r^2, so
    that `linear(h, W, pre=RMSScale(sumsq, eps))` is linear(rmsnorm(r) * norm_weight, W) with no norm
    kernel between. Fused: the epilogue writes all three (S = the GEMV's column blocks; unfused S = 1)."""

    kind = "residual_norm"

    def __init__(self, residual, norm_weight, reduce=None):
        super().__init__(residual, reduce)
        self.norm_weight = norm_weight

    def check(self, x, n, k):
        super().check(x, n, k)
        if tuple(self.norm_weight.shape) != (n,):
            raise ValueError(f"residual_norm: needs a norm weight [{n}], got {tuple(self.norm_weight.shape)}")

    def fusable(self, x) -> bool:
        return super().fusable(x) and no_grad(self.norm_weight)

    def kernel_args(self) -> dict:
        return {"residual": self.residual, "norm_out": self.norm_weight}

    def unfused(self, y, impl):
        y = self.reduced(y)
        r = (self.residual.float() + y.float()).to(self.residual.dtype)
        h = (r.float() * self.norm_weight.float()).to(y.dtype)
        return r, h, r.float().square().sum(-1, keepdim=True)


class AddRMSNorm(Residual):
    """The residual add and the whole RMSNorm after it in one norm kernel (`declab_kernels.rmsnorm.
    add_rms_norm`): returns (rmsnorm(r) * norm_weight, r) for r = residual + y. The GEMV has no fused
    form of it: the faster choice for more rows than `tuning.FOLD_ROWS` (llama)."""

    kind = "add_rms_norm"

    def __init__(self, residual, norm_weight, eps, reduce=None):
        super().__init__(residual, reduce)
        self.norm_weight, self.eps = norm_weight, eps

    def fusable(self, x) -> bool:
        return False

    def unfused(self, y, impl):
        from declab_kernels import rmsnorm

        return rmsnorm.add_rms_norm(self.reduced(y), self.residual, self.norm_weight, self.eps, impl=impl)
