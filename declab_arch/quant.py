"""Weight-only quantisation of every family's linear layers: the weight objects, round-to-nearest
and GPTQ quantisers, `quantize_model`, and saving / reading quantised checkpoints.

Names (`parse_quant`, `check_quant`): "int8" (per output channel, symmetric, round-to-nearest),
"int4" (group-wise, asymmetric, GPTQ-calibrated, group 128), "int4-rtn" (the same format,
round-to-nearest), and "int4-gN" / "int4-rtn-gN" for another group size N. A layer narrower than the
group (K < N) is one group per row; otherwise N must divide the layer's K, and K must be a multiple of
8 (eight 4-bit codes a word).

Weight objects (`Int8Weight`, `Int4Weight`) follow the contract of `declab_kernels.gemv.linear`'s
`w`: `w.matmul(x2d [M, K], impl=impl) -> [M, N]` in x's dtype, `w.shape == (N, K)`, `w.dtype` (the
activation dtype), `w.format` ("int8", "int4-g128", ...), `w.dequantize() -> [N, K]` dense; plus
`.to(device, dtype)`, `.nbytes`, `.tensors()` and `cat(parts)` (rows of several weights, for fused
projections). The packed layouts are those of `declab_kernels.quant_gemv`.

GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", ICLR 2023, arXiv:2210.17323): for a layer with weight W and
calibration inputs X, H = X^T X (here averaged over the calibration rows, plus 1% of its mean
diagonal as damping); the columns are quantised one at a time, left to right, and each column's
rounding error, divided by the diagonal of the upper Cholesky factor U of H^-1, is spread over the
columns not yet quantised along U's row (the optimal brain surgeon update), so that ||W X^T - Q X^T||
rather than ||W - Q|| is minimised. Blocks are the quantisation groups: a group's scale and zero point
are set from its columns as updated when the group is reached; the updates within the group are
applied column by column and the block's accumulated error is carried to the later columns at once.
The Hessians come from one pass of the unquantised model's reference forward over the calibration
tokens (every linear sees the float model's activations, not those of already-quantised layers),
one K x K float32 matrix per distinct layer input (q/k/v share one, as do gate/up; layers sharing
one are quantised as one weight of all their rows, which GPTQ treats row by row: the same result in
one pass over the columns).

`quantize_model(model, method, calib_tokens=..., group_size=..., head=False)` returns a mapping from
weight names to weight objects: every `nn.Linear`'s "<module>.weight" (not embeddings, norms,
convolutions or the Mask-Predict length head; the LM head under "lm_head.weight" only with
`head=True`, tied or not), and each fused projection of a `FusedLinears` module ("<module>.qkv_weight",
"<module>.gate_up_weight") as the concatenation of its parts. The model is not modified; `routed`
runs a model's module-called linears through the weight objects, `dequantized` gives dense weights,
`weight_bytes` the model's parameter bytes with the quantised layers packed.

Checkpoints: `save` writes a family's folder with the quantised layers as "<module>.qweight",
".scales", ".zeros" (int4) or ".qweight", ".scale" (int8) and a `quantization` entry in config.json
(int4: with `int4_layout`, the packing's version); `read_checkpoint` reads it back (an int4 folder
without `int4_layout`, saved in layout 1, is repacked on load), or a Hugging Face AWQ (version gemm) or GPTQ folder
(`quantization_config`), unpacking to the lab's layout. A config that does not match its tensors is a
`QuantError` (a CheckpointError: one line, exit 2 in the command lines).
"""

import inspect
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from declab_arch.checkpoint import CheckpointError, load_weights, read_json
from declab_kernels import quant_gemv

KNOWN = "int8, int4, int4-rtn, int4-gN, int4-rtn-gN"
DEFAULT_GROUP = 128
# Modules that are heads, not layers: the LM head only with head=True, the Mask-Predict length head never.
LM_HEAD = "lm_head"
SKIPPED = ("length_head",)
# The module whose output is the LM head's input (the final norm), per family layout.
HEAD_INPUT = ("model.norm", "backbone.norm_f")
SCALE_DTYPE = torch.float16
GPTQ_DAMP = 0.01


class QuantError(CheckpointError):
    """A quantisation the lab cannot do (unknown name, a group that does not divide a layer, a
    checkpoint whose quantisation config does not match its tensors); the message is one line."""


@dataclass(frozen=True)
class QuantSpec:
    """What a quant name asks for: bits 8 or 4, method "rtn" or "gptq" (or "awq" for a checkpoint
    read from that layout), group size (int4 only)."""

    bits: int
    method: str
    group_size: int | None = None

    @property
    def name(self) -> str:
        if self.bits == 8:
            return "int8"
        base = "int4-rtn" if self.method == "rtn" else "int4"
        return base if self.group_size == DEFAULT_GROUP else f"{base}-g{self.group_size}"


def parse_quant(name: str, group_size: int | None = None) -> QuantSpec:
    """The spec of a quant name; `group_size` overrides int4's group (and must agree with a "-gN" in the name)."""
    m = re.fullmatch(r"int4(-rtn)?(?:-g(\d+))?", name) if isinstance(name, str) else None
    if name == "int8":
        if group_size is not None:
            raise QuantError(f"int8 is quantised per output channel: it takes no group size (got {group_size})")
        return QuantSpec(8, "rtn")
    if m is None:
        raise QuantError(f"unknown quant {name!r} (known: {KNOWN})")
    named = int(m.group(2)) if m.group(2) else None
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise QuantError(f"group size must be an integer, got {group_size!r}")
    if named is not None and group_size is not None and named != group_size:
        raise QuantError(f"quant {name!r} names group {named} but group size {group_size} was given")
    group = named if named is not None else group_size if group_size is not None else DEFAULT_GROUP
    if group < 1:
        raise QuantError(f"group size must be at least 1, got {group}")
    return QuantSpec(4, "rtn" if m.group(1) else "gptq", group)


def check_quant(name: str, group_size: int | None = None) -> QuantSpec:
    """What a command checks before it spends time: the quant name (and group size) is one the lab
    knows. Raises QuantError (shown as one line, exit 2, by `decoders.user_errors`)."""
    return parse_quant(name, group_size)


def layer_group(group_size: int, K: int, name: str) -> int:
    """The group a layer of K inputs uses: `group_size`, or K when the layer is narrower; QuantError
    when it does not divide K or K is no multiple of 8."""
    if K % 8:
        raise QuantError(f"{name}: int4 packs eight inputs a word, and the layer has {K} inputs")
    group = min(group_size, K)
    if K % group:
        raise QuantError(f"{name}: group size {group} does not divide the layer's {K} inputs")
    return group


class PackedWeight:
    """What the quantised weights share: their device and the bytes of their tensors (`tensors()`)."""

    @property
    def device(self):
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class Int8Weight(PackedWeight):
    """int8 per output channel: qweight `[N, K]` int8, scale `[N]` float32; W = qweight * scale[:, None]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.qweight, self.scale, self.dtype = qweight, scale, dtype
        self.shape = tuple(qweight.shape)
        self.format = "int8"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scale": self.scale}

    def matmul(self, x, *, impl):
        """x `[M, K]` -> `[M, N]` in x's dtype."""
        return quant_gemv.int8_linear(x if x.stride(-1) == 1 else x.contiguous(), self.qweight, self.scale, impl=impl)

    def dequantize(self):
        """`[N, K]` in self.dtype."""
        return quant_gemv.dequantize_int8(self.qweight, self.scale, self.dtype, impl="ref")

    def to(self, device=None, dtype=None):
        return Int8Weight(self.qweight.to(device), self.scale.to(device), dtype or self.dtype)

    @staticmethod
    def cat(parts):
        """The rows of `parts` (same K) as one weight."""
        return Int8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].dtype)


class Int4Weight(PackedWeight):
    """int4 group-wise: qweight `[N, K // 8]` int32, scales `[N, K // g]` float16, zeros `[N, K // g]`
    uint8; W = (code - zero) * scale per group of g inputs (layout: `declab_kernels.quant_gemv`)."""

    def __init__(self, qweight, scales, zeros, group_size: int, dtype: torch.dtype):
        self.qweight, self.scales, self.zeros = qweight, scales, zeros
        self.group_size, self.dtype = group_size, dtype
        self.shape = (qweight.shape[0], qweight.shape[1] * 8)
        self.format = f"int4-g{group_size}"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}

    def matmul(self, x, *, impl):
        """x `[M, K]` -> `[M, N]` in x's dtype."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        return quant_gemv.int4_linear(x, self.qweight, self.scales, self.zeros, self.group_size, impl=impl)

    def dequantize(self):
        """`[N, K]` in self.dtype."""
        return quant_gemv.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.dtype, impl="ref")

    def to(self, device=None, dtype=None):
        return Int4Weight(self.qweight.to(device), self.scales.to(device), self.zeros.to(device), self.group_size, dtype or self.dtype)

    def rows(self, start: int, end: int):
        """Output rows start:end as a weight of their own (copies)."""
        return Int4Weight(*(t[start:end].clone() for t in (self.qweight, self.scales, self.zeros)), self.group_size, self.dtype)

    @staticmethod
    def cat(parts):
        """The rows of `parts` (same K and group) as one weight."""
        if len({(p.shape[1], p.group_size) for p in parts}) != 1:
            raise ValueError("Int4Weight.cat: the parts differ in K or group size")
        return Int4Weight(*(torch.cat([getattr(p, t) for p in parts]) for t in ("qweight", "scales", "zeros")),
                          parts[0].group_size, parts[0].dtype)


def quantize_int8(weight, dtype=None) -> Int8Weight:
    """Round-to-nearest int8, symmetric per output row: scale = max|w| / 127."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, dtype or weight.dtype)


def group_params(w):
    """Scale and zero point of each row of w `[..., g]` (float32): the row's range over 15 steps,
    rounded to the stored float16; a constant row c gets scale |c| (or 1 for zeros), so it is exact."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    span = hi - lo
    scale = torch.where(span > 0, span / 15, torch.where(lo != 0, lo.abs(), torch.ones_like(lo)))
    scale = scale.clamp(max=torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)
    # why: a scale below float16's smallest subnormal would round to 0 and divide by zero
    scale = torch.where(scale == 0, torch.full_like(scale, 2.0**-24), scale).float()
    zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_int4_rtn(weight, group_size: int, dtype=None, *, name: str = "weight") -> Int4Weight:
    """Round-to-nearest int4 per group of `group_size` inputs (asymmetric: codes 0..15, zero point)."""
    N, K = weight.shape
    group = layer_group(group_size, K, name)
    w = weight.detach().float().view(N, K // group, group)
    scale, zero = group_params(w)  # [N, K // g]
    codes = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, 15).view(N, K)
    return Int4Weight(quant_gemv.pack_int4(codes), scale.to(SCALE_DTYPE), zero.to(torch.uint8), group, dtype or weight.dtype)


def quantize_int4_gptq(weight, hessian, group_size: int, dtype=None, *, name: str = "weight", damp: float = GPTQ_DAMP) -> Int4Weight:
    """GPTQ int4 (module docstring) of weight `[N, K]` given H = X^T X `[K, K]` of its calibration inputs."""
    N, K = weight.shape
    group = layer_group(group_size, K, name)
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    # Inputs that were always zero carry no information: their weights are irrelevant, set to 0.
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * H.diagonal().mean())
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        raise QuantError(f"{name}: the calibration Hessian is not positive definite even with damping {damp}") from None
    codes = torch.empty(N, K, dtype=torch.int32, device=W.device)
    scales = torch.empty(N, K // group, device=W.device)
    zeros = torch.empty(N, K // group, device=W.device)
    for j, g0 in enumerate(range(0, K, group)):
        g1 = g0 + group
        block = W[:, g0:g1]  # a view: updated in place as its columns are quantised
        scale, zero = group_params(block)
        scales[:, j], zeros[:, j] = scale, zero
        err = torch.empty(N, group, device=W.device)
        for i in range(group):
            col = block[:, i]
            q = torch.clamp(torch.round(col / scale) + zero, 0, 15)
            codes[:, g0 + i] = q.to(torch.int32)
            e = (col - (q - zero) * scale) / U[g0 + i, g0 + i]
            block[:, i:] -= e[:, None] * U[g0 + i, g0 + i : g1][None, :]
            err[:, i] = e
        W[:, g1:] -= err @ U[g0:g1, g1:]
    return Int4Weight(quant_gemv.pack_int4(codes), scales.to(SCALE_DTYPE), zeros.to(torch.uint8), group, dtype or weight.dtype)


def head_weight(model) -> torch.Tensor:
    """The LM head's weight `[V, d]`: lm_head's, or the (tied) embedding table."""
    if isinstance(getattr(model, LM_HEAD, None), nn.Linear):
        return model.lm_head.weight
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(embeddings) != 1:
        raise QuantError(f"{type(model).__name__}: no lm_head and {len(embeddings)} embeddings: cannot find the tied head")
    return embeddings[0].weight


def linear_layers(model) -> dict[str, nn.Linear]:
    """"<module>.weight" -> nn.Linear for every linear layer of a model (not the heads)."""
    return {f"{n}.weight": m for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n != LM_HEAD and n.split(".")[-1] not in SKIPPED}


def reference_forward(model):
    """tokens `[B, T]` -> logits through the model's reference path (impl="ref" where it takes one)."""
    if "impl" in inspect.signature(model.forward).parameters:
        return lambda tokens: model(tokens, impl="ref")
    return model


def collect_hessians(model, layers: dict[str, nn.Linear], tokens, *, head: bool = False, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """name -> H `[K, K]` float32, the mean of x x^T over every calibration row x a layer saw in the
    model's reference forward over tokens `[S, T]`. Layers called on the same input tensor (q/k/v,
    gate/up) share one matrix. With `head`, "lm_head.weight" gets the final norm's output's."""
    sums, counts, owner = {}, {}, {}
    last = {"input": None, "key": None}
    seen = set()

    def accumulate(key, x):
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if key not in sums:
            sums[key] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            counts[key] = 0
        sums[key].addmm_(x.T, x)
        counts[key] += x.shape[0]

    def pre_hook(name):
        def hook(module, args):
            x = args[0]
            if name not in seen:
                seen.add(name)
                # The first call decides: a layer fed the very tensor the previous layer was fed shares its matrix.
                owner[name] = last["key"] if x is last["input"] else name
            if owner[name] == name:
                accumulate(name, x)
            last["input"], last["key"] = x, owner[name]
        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n)) for n, m in layers.items()]
    if head:
        modules = dict(model.named_modules())
        norm = next((modules[n] for n in HEAD_INPUT if n in modules), None)
        if norm is None:
            raise QuantError(f"{type(model).__name__}: no final norm ({', '.join(HEAD_INPUT)}) to calibrate the head on")
        owner[LM_HEAD + ".weight"] = LM_HEAD + ".weight"
        handles.append(norm.register_forward_hook(lambda m, a, out: accumulate(LM_HEAD + ".weight", out)))
    forward = reference_forward(model)
    try:
        with torch.no_grad():
            for i in range(0, tokens.shape[0], batch_size):
                forward(tokens[i : i + batch_size])
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in list(layers) + ([LM_HEAD + ".weight"] if head else []) if n not in owner]
    if missing:
        raise QuantError(f"{missing[0]}: the reference forward never called this layer, so it has no calibration inputs")
    means = {key: sums[key] / counts[key] for key in sums}
    return {n: means[owner[n]] for n in owner}


def quantize_model(model, method: str, *, calib_tokens=None, group_size: int | None = None, head: bool = False,
                   dtype=None, batch_size: int = 8) -> dict:
    """name -> weight object for every linear layer of `model` (module docstring), quantised as `method`
    names ("int8", "int4", "int4-rtn", "int4-gN", ...). "int4" (GPTQ) needs `calib_tokens` `[S, T]`
    (token ids, a few hundred sequences). dtype: the activation dtype of the weight objects (default
    the model's). The model is left as it was."""
    spec = parse_quant(method, group_size)
    layers = linear_layers(model)
    weights = {n: m.weight for n, m in layers.items()}
    if head:
        weights[LM_HEAD + ".weight"] = head_weight(model)
    if spec.bits == 4:
        for name, w in weights.items():
            layer_group(spec.group_size, w.shape[1], name)
    hessians = None
    if spec.method == "gptq":
        if calib_tokens is None or not isinstance(calib_tokens, torch.Tensor) or calib_tokens.dim() != 2 or calib_tokens.numel() == 0:
            raise QuantError(f"{spec.name} is calibrated (GPTQ): it needs calibration tokens [sequences, length]")
        device = next(model.parameters()).device
        hessians = collect_hessians(model, layers, calib_tokens.to(device), head=head, batch_size=batch_size)
    out = {}
    if spec.method == "gptq":
        # Layers with one input (q/k/v, gate/up) share H, and GPTQ treats every output row on its
        # own: their rows run as one weight, one pass over the columns instead of one each.
        shared = {}
        for name in weights:
            shared.setdefault(id(hessians[name]), []).append(name)
        for names in shared.values():
            joint = torch.cat([weights[n].detach() for n in names])
            q = quantize_int4_gptq(joint, hessians[names[0]], spec.group_size, dtype or weights[names[0]].dtype, name=names[0])
            start = 0
            for n in names:
                out[n] = q.rows(start, start + weights[n].shape[0])
                start += weights[n].shape[0]
        return add_fused(model, {n: out[n] for n in weights})
    for name, w in weights.items():
        act = dtype or w.dtype
        out[name] = quantize_int8(w, act) if spec.bits == 8 else quantize_int4_rtn(w, spec.group_size, act, name=name)
    return add_fused(model, out)


def add_fused(model, mapping: dict) -> dict:
    """`mapping` plus an entry "<module>.<fused>_weight" for each fused projection of a `FusedLinears`
    module (llama's qkv, gate_up) whose parts are all quantised: their rows concatenated."""
    from declab_arch.llama import FusedLinears

    out = dict(mapping)
    for prefix, module in model.named_modules():
        if isinstance(module, FusedLinears):
            for fused, parts in module.FUSED.items():
                names = [f"{prefix}.{p}.weight" for p in parts]
                if all(n in mapping for n in names):
                    out[f"{prefix}.{fused}_weight"] = type(mapping[names[0]]).cat([mapping[n] for n in names])
    return out


def weight_bytes(model, mapping: dict) -> int:
    """Bytes of the model's parameters with each quantised layer at its packed size (weights, scales,
    zeros); a quantised tied head adds its packed copy to the embedding table it leaves dense."""
    total = 0
    for name, p in model.named_parameters():
        total += mapping[name].nbytes if name in mapping else p.numel() * p.element_size()
    head = mapping.get(LM_HEAD + ".weight")
    if head is not None and LM_HEAD + ".weight" not in dict(model.named_parameters()):
        total += head.nbytes
    return total


def dequantized(mapping: dict) -> dict[str, torch.Tensor]:
    """name -> dense `[N, K]` weight in the object's dtype."""
    return {n: w.dequantize() for n, w in mapping.items()}


@contextmanager
def routed(model, mapping: dict, *, impl: str):
    """Inside: each nn.Linear of `model` whose weight `mapping` holds computes x @ W^T (+ bias) with
    `w.matmul(impl=impl)` (the module-called linears of the reference forwards; not the LM head,
    which the families apply with F.linear)."""
    patched = []
    for name, module in linear_layers(model).items():
        w = mapping.get(name)
        if w is None:
            continue

        def forward(x, w=w, bias=module.bias):
            y = w.matmul(x.reshape(-1, x.shape[-1]), impl=impl).view(*x.shape[:-1], w.shape[0])
            return y if bias is None else y + bias.to(y.dtype)

        module.forward = forward
        patched.append(module)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward


def quantization_entry(spec: QuantSpec, mapping: dict) -> dict:
    """The `quantization` entry of a lab config.json."""
    entry = {"quant": spec.name, "bits": spec.bits, "method": spec.method, "group_size": spec.group_size,
             "head": LM_HEAD + ".weight" in mapping}
    if spec.bits == 4:
        entry["int4_layout"] = quant_gemv.INT4_LAYOUT
    return entry


def save(folder, model, mapping: dict, spec: QuantSpec, family_save) -> None:
    """`family_save(model, folder)` (the family's own writer), then its safetensors rewritten with the
    quantised layers' packed tensors in place of their dense weights and `quantization` added to config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    family_save(model, folder)
    config = read_json(folder / "config.json")
    config["quantization"] = quantization_entry(spec, mapping)
    tensors = load_weights(folder)
    for path in folder.glob("*.safetensors"):
        path.unlink()
    for name, w in mapping.items():
        if not name.endswith(".weight"):
            continue
        tensors.pop(name, None)
        prefix = name[: -len(".weight")]
        tensors.update({f"{prefix}.{k}": t.detach().cpu().contiguous() for k, t in w.tensors().items()})
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def is_quantized(hf: dict) -> bool:
    """Whether a config.json describes a quantised checkpoint (the lab's, or HF AWQ / GPTQ)."""
    return "quantization" in hf or "quantization_config" in hf


def _check_shape(name, t, shape, what):
    if tuple(t.shape) != tuple(shape):
        raise QuantError(f"{name}: shape {list(t.shape)} does not match the quantisation config ({what}: expected {list(shape)})")


def _from_lab(entry: dict, tensors: dict, source: str, dtype) -> tuple[QuantSpec, dict]:
    if "quant" not in entry:
        raise QuantError(f"{source}: config.json's quantization entry names no quant")
    try:
        spec = parse_quant(entry["quant"])
    except QuantError as e:
        raise QuantError(f"{source}: config.json's quantization entry: {e}") from None
    if entry.get("group_size", spec.group_size) != spec.group_size or entry.get("bits", spec.bits) != spec.bits:
        raise QuantError(f"{source}: config.json's quantization entry ({entry}) contradicts its quant {spec.name!r}")
    # Folders saved before the entry recorded a layout hold layout 1 (consecutive inputs in a word).
    layout = entry.get("int4_layout", 1)
    if spec.bits == 4 and layout not in (1, quant_gemv.INT4_LAYOUT):
        raise QuantError(f"{source}: config.json's int4_layout {layout!r} is unknown (known: 1, {quant_gemv.INT4_LAYOUT})")
    mapping = {}
    for qname in [n for n in tensors if n.endswith(".qweight")]:
        prefix = qname[: -len(".qweight")]
        q = tensors.pop(qname)
        if spec.bits == 8:
            scale = tensors.pop(f"{prefix}.scale", None)
            if scale is None or q.dtype != torch.int8 or q.dim() != 2:
                raise QuantError(f"{source}: {qname} is not an int8 [N, K] weight with a scale, as config.json's int8 says")
            _check_shape(f"{prefix}.scale", scale, (q.shape[0],), "one per output row")
            mapping[f"{prefix}.weight"] = Int8Weight(q, scale.float(), dtype)
            continue
        scales, zeros = tensors.pop(f"{prefix}.scales", None), tensors.pop(f"{prefix}.zeros", None)
        if scales is None or zeros is None or q.dtype != torch.int32 or q.dim() != 2 or scales.dim() != 2:
            raise QuantError(f"{source}: {qname} is not an int4 [N, K/8] int32 weight with scales and zeros, as config.json's {spec.name} says")
        K = q.shape[1] * 8
        group = layer_group(spec.group_size, K, f"{source}: {prefix}")
        _check_shape(f"{prefix}.scales", scales, (q.shape[0], K // group), f"group {group}")
        _check_shape(f"{prefix}.zeros", zeros, (q.shape[0], K // group), f"group {group}")
        if layout != quant_gemv.INT4_LAYOUT:
            q = quant_gemv.pack_int4(unpack_cols(q))
        mapping[f"{prefix}.weight"] = Int4Weight(q, scales.to(SCALE_DTYPE), zeros.to(torch.uint8), group, dtype)
    return spec, mapping


def unpack_cols(packed, order=None):
    """`[R, C // 8]` int32 packed along the last dimension, eight consecutive columns a word (as the
    hub's tools and the lab's layout 1 pack) -> `[R, C]` codes; `order[j]` is the column (within each
    eight) that nibble j holds (None: nibble j holds column j)."""
    R, W = packed.shape
    nibbles = (packed.unsqueeze(-1) >> quant_gemv.SHIFTS.to(packed.device)) & 0xF  # [R, W, 8]
    if order is not None:
        cols = torch.empty_like(nibbles)
        cols[:, :, list(order)] = nibbles
        nibbles = cols
    return nibbles.reshape(R, W * 8)


# Packed-layer tensor names left over when their qweight is missing.
ORPHANS = ("scales", "zeros", "qzeros", "g_idx")
# AutoAWQ's GEMM layout: nibble j of a word holds output column AWQ_ORDER[j] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _from_hf(qc: dict, tensors: dict, source: str, dtype) -> tuple[QuantSpec, dict]:
    method = qc.get("quant_method")
    if method not in ("awq", "gptq"):
        raise QuantError(f"{source}: quantization_config's quant_method {method!r} is not supported (awq, gptq)")
    if qc.get("bits") != 4:
        raise QuantError(f"{source}: {method} with bits={qc.get('bits')!r} is not supported (4 only)")
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise QuantError(f"{source}: AWQ version {qc.get('version')!r} is not supported (gemm only)")
        if not qc.get("zero_point", True):
            raise QuantError(f"{source}: AWQ without zero points is not supported")
    group_cfg = qc.get("group_size", qc.get("q_group_size"))
    if isinstance(group_cfg, bool) or not isinstance(group_cfg, int) or group_cfg < 1:
        raise QuantError(f"{source}: quantization_config's group_size {group_cfg!r} is not supported (a positive group; -1, one group a row, is not)")
    # GPTQ's v1 checkpoints store zero - 1 (AutoGPTQ's convention); gptq_v2 stores the zero itself.
    zero_offset = 1 if method == "gptq" and qc.get("checkpoint_format", "gptq") != "gptq_v2" else 0
    mapping = {}
    for qname in [n for n in tensors if n.endswith(".qweight")]:
        prefix = qname[: -len(".qweight")]
        q, qzeros, scales = tensors.pop(qname), tensors.pop(f"{prefix}.qzeros", None), tensors.pop(f"{prefix}.scales", None)
        g_idx = tensors.pop(f"{prefix}.g_idx", None)
        if qzeros is None or scales is None or q.dtype != torch.int32 or qzeros.dtype != torch.int32 or q.dim() != 2 or scales.dim() != 2:
            raise QuantError(f"{source}: {prefix} lacks int32 qweight / qzeros or scales of a {method} layer")
        if method == "awq":
            K, N = q.shape[0], q.shape[1] * 8
        else:
            K, N = q.shape[0] * 8, q.shape[1]
        group = group_cfg
        if K % group:
            raise QuantError(f"{source}: {prefix}: group_size {group} does not divide the layer's {K} inputs")
        _check_shape(f"{prefix}.scales", scales, (K // group, N), f"{method}, group {group}")
        _check_shape(f"{prefix}.qzeros", qzeros, (K // group, N // 8), f"{method}, group {group}")
        if method == "awq":
            codes = unpack_cols(q, AWQ_ORDER).T  # [N, K]
            zeros = unpack_cols(qzeros, AWQ_ORDER).T
        else:
            if g_idx is not None:
                if tuple(g_idx.shape) != (K,):
                    raise QuantError(f"{source}: {prefix}.g_idx has shape {list(g_idx.shape)}, expected [{K}]")
                if not torch.equal(g_idx.long().cpu(), torch.arange(K) // group):
                    raise QuantError(f"{source}: {prefix}: act-order (desc_act) groups that permute the inputs are not supported")
            codes = unpack_cols(q.T.contiguous())  # q.T [N, K // 8]: nibble j of word i is input 8i + j
            # why: the stored zero - 1 wraps 0 to nibble 15; & 15 after adding the 1 back recovers it
            zeros = ((unpack_cols(qzeros) + zero_offset) & 0xF).T
        mapping[f"{prefix}.weight"] = Int4Weight(quant_gemv.pack_int4(codes.contiguous()), scales.T.contiguous().to(SCALE_DTYPE),
                                                 zeros.contiguous().to(torch.uint8), group, dtype)
    return QuantSpec(4, method, group_cfg), mapping


def read_checkpoint(folder, *, dtype=torch.float32) -> tuple[QuantSpec, dict, dict]:
    """(spec, name -> weight object, the other tensors) of a quantised checkpoint folder: the lab's
    (`quantization` in config.json) or HF AWQ / GPTQ (`quantization_config`). The other tensors also
    hold each quantised layer's dequantised weight under its dense name, so that a family's `build`
    accepts them. dtype: the weight objects' activation dtype."""
    folder = Path(folder)
    hf = read_json(folder / "config.json")
    tensors = load_weights(folder)
    source = str(folder)
    if "quantization" in hf:
        entry = hf["quantization"]
        if not isinstance(entry, dict):
            raise QuantError(f"{source}: config.json's quantization entry is not an object")
        spec, mapping = _from_lab(entry, tensors, source, dtype)
    elif isinstance(hf.get("quantization_config"), dict):
        spec, mapping = _from_hf(hf["quantization_config"], tensors, source, dtype)
    else:
        raise QuantError(f"{source}: config.json has no quantization entry")
    if not mapping:
        raise QuantError(f"{source}: config.json says {spec.name}, but the folder holds no quantised tensor (no *.qweight)")
    leftover = [n for n in tensors if n.rsplit(".", 1)[-1] in ORPHANS]
    if leftover:
        raise QuantError(f"{source}: {leftover[0]} belongs to no quantised weight (no matching qweight)")
    tied = hf.get("tie_word_embeddings", hf.get("tie_embeddings", False))
    for name, w in mapping.items():
        # A tied head is the embedding table, which stays dense: it has no weight of its own to fill.
        if not (tied and name == LM_HEAD + ".weight"):
            tensors[name] = w.dequantize().float()
    return spec, mapping, tensors
