"""Quantised weight objects (`declab_arch.quant`) installed in a model in place of its dense linear
weights, so that every forward path runs on them and the dense copies are freed.

    mapping = quant.quantize_model(model, "int4-rtn")       # after model.to(device, dtype)
    quant_linear.install(model, mapping, impl="triton")

`install` replaces each quantised `nn.Linear` by a `QuantLinear` whose `weight` is the weight object
(a plain attribute, not a parameter): the paths that hand `module.weight` to
`declab_kernels.gemv.linear` (the decode steps) and those that call the module (the reference
forwards, prefill chunks) both compute with it. Fused projections (llama's qkv and gate_up through
`FusedLinears.fuse`, RWKV-7's packed down-projection) hold one object of all their rows, and their
parts become row views of it (`fuse_rows`), as `declab_arch.llama.fuse_linears` does for dense weights.
Layers named in `dense` keep a dense weight holding their dequantised values (RWKV-7's LoRA
up-projections, packed by columns of different groups).
"""

import torch
from torch import nn

from declab_arch import quant


class QuantLinear(nn.Module):
    """An `nn.Linear` whose weight is a quantised weight object: y = w.matmul(x, impl) + bias."""

    def __init__(self, weight, bias: nn.Parameter | None, impl: str):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.impl = impl
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        """x `[..., K]` -> `[..., N]` in x's dtype."""
        y = self.weight.matmul(x.reshape(-1, x.shape[-1]), impl=self.impl).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight.format}, impl={self.impl}"


def row_view(w, start: int, end: int):
    """Output rows start:end of a weight object, sharing its tensors (no copy)."""
    if isinstance(w, quant.Int8Weight):
        return quant.Int8Weight(w.qweight[start:end], w.scale[start:end], w.dtype)
    return quant.Int4Weight(w.qweight[start:end], w.scales[start:end], w.zeros[start:end], w.group_size, w.dtype)


def fuse_rows(*linears: QuantLinear):
    """(one weight object of the linears' rows in order, their bias concatenated or None); each
    linear's weight (and bias) becomes a view into it and the separate copies are freed."""
    if not all(isinstance(lin, QuantLinear) for lin in linears):
        raise quant.QuantError("a fused projection has quantised and dense parts: quantise all of its layers or none")
    weight = type(linears[0].weight).cat([lin.weight for lin in linears])
    bias = None
    with torch.no_grad():
        if linears[0].bias is not None:
            bias = torch.cat([lin.bias.data for lin in linears])
        start = 0
        for lin in linears:
            end = start + lin.out_features
            lin.weight = row_view(weight, start, end)
            if bias is not None:
                lin.bias.data = bias[start:end]
            start = end
    return weight, bias


def data_ptr(w) -> int:
    """Where a weight's data starts (a dense tensor's, or a weight object's packed codes')."""
    return w.data_ptr() if isinstance(w, torch.Tensor) else w.qweight.data_ptr()


def install(model, mapping: dict, *, impl: str, dense: tuple = ()) -> None:
    """Put the weight objects of `mapping` ("<module>.weight" -> object, as `quant.quantize_model` or
    `quant.read_checkpoint` give; other entries ignored) into `model` in place of its linears' dense
    weights, moved to each layer's device; then re-fuse the fused projections. Layers whose name
    ends with one of `dense` keep a dense weight, overwritten with the dequantised values.
    QuantError for a quantised LM head (the heads run dense) or a weight no layer of the model has."""
    from declab_arch.llama import FusedLinears

    if quant.LM_HEAD + ".weight" in mapping:
        raise quant.QuantError("a quantised LM head is not supported for decoding (quantise without --head)")
    modules = dict(model.named_modules())
    layers = quant.linear_layers(model)
    unknown = [n for n in mapping if n.endswith(".weight") and n not in layers]
    if unknown:
        raise quant.QuantError(f"{unknown[0]}: a quantised weight for no linear layer of the model")
    for name, module in layers.items():
        w = mapping.get(name)
        if w is None:
            continue
        if tuple(w.shape) != tuple(module.weight.shape):
            raise quant.QuantError(f"{name}: quantised weight of shape {list(w.shape)} for a layer of {list(module.weight.shape)}")
        if name.endswith(dense):
            with torch.no_grad():
                module.weight.copy_(w.dequantize())
            continue
        parent, _, attr = name[: -len(".weight")].rpartition(".")
        setattr(modules[parent] if parent else model, attr, QuantLinear(w.to(module.weight.device), module.bias, impl))
    for module in model.modules():
        if isinstance(module, FusedLinears):
            module.fuse()


def is_installed(model) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def set_impl(model, impl: str) -> None:
    """The kernel implementation every QuantLinear of `model` computes with."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.impl = impl


def weight_bytes(model) -> int:
    """Bytes of `model`'s parameters plus its installed weight objects' packed tensors (codes, scales, zeros)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.weight.nbytes for m in model.modules() if isinstance(m, QuantLinear))
