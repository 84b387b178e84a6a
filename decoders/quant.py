"""What a command checks of a `--quant` option before it spends time: the name (and group size) is
one the lab knows, and, given the model, the group divides every layer it would quantise.

    spec = check_quant("int4-g64", model="llama-1b")   # QuantSpec(bits=4, method="gptq", group_size=64)

The model's layers are read from a skeleton built on the meta device from its config (no tensor is
allocated or read), so the check costs no more than `decoders.check_model`. Refusals are
`declab_arch.quant.QuantError`, a CheckpointError: one line and exit code 2 under `decoders.user_errors`.

`check_load_quant(model, quant)` is what `decoders.load(model, quant=...)` checks: on the fly only
round-to-nearest (int8, int4-rtn; GPTQ needs calibration text, `python -m eval.quantize`), and a
quantised folder (`folder_spec`, read from its config.json) takes no quant that contradicts its own.
"""

import importlib
from pathlib import Path

import torch

from declab_arch import quant
from declab_arch.checkpoint import CONFIG_DIR, read_json
from decoders.base import UsageError

# family -> (declab_arch module, model class)
MODEL_CLASSES = {
    "transformer": ("declab_arch.llama", "Llama"),
    "mamba2": ("declab_arch.mamba2", "Mamba2LM"),
    "rwkv7": ("declab_arch.rwkv7", "RWKV7"),
    "maskpredict": ("declab_arch.maskpredict", "MaskPredictLM"),
}


def skeleton(name_or_path):
    """The model of a preset or checkpoint folder on the meta device (shapes only), after `check_model`."""
    from decoders import check_model

    family = check_model(name_or_path)
    module_name, cls = MODEL_CLASSES[family]
    module = importlib.import_module(module_name)
    path = Path(str(name_or_path))
    if path.is_dir():
        config = module.read_config(path)
    else:
        config = module.preset_config(read_json(CONFIG_DIR / f"{name_or_path}.json"), str(name_or_path))
    with torch.device("meta"):
        return getattr(module, cls)(config)


def check_quant(name: str, group_size: int | None = None, *, model=None, head: bool = False) -> quant.QuantSpec:
    """The spec of quant `name`; with `model` (a preset or folder), also QuantError unless an int4 group
    fits every linear layer (and the LM head with `head`)."""
    spec = quant.check_quant(name, group_size)
    if model is not None and spec.bits == 4:
        net = skeleton(model)
        shapes = {n: m.in_features for n, m in quant.linear_layers(net).items()}
        if head:
            shapes[quant.LM_HEAD + ".weight"] = quant.head_weight(net).shape[1]
        for layer, K in shapes.items():
            quant.layer_group(spec.group_size, K, f"{model}: {layer}")
    return spec


def folder_spec(name_or_path) -> quant.QuantSpec | None:
    """The quantisation a checkpoint folder's config.json states (the lab's `quantization` entry or an
    AWQ / GPTQ `quantization_config`), read without any tensor; None for a preset or a dense folder."""
    path = Path(str(name_or_path))
    if not (path / "config.json").is_file():
        return None
    hf = read_json(path / "config.json")
    entry, qc = hf.get("quantization"), hf.get("quantization_config")
    if entry is not None:
        if not isinstance(entry, dict) or not isinstance(entry.get("quant"), str):
            raise quant.QuantError(f"{path}: config.json's quantization entry names no quant")
        try:
            return quant.parse_quant(entry["quant"])
        except quant.QuantError as e:
            raise quant.QuantError(f"{path}: config.json's quantization entry: {e}") from None
    if qc is not None:
        if not isinstance(qc, dict):
            raise quant.QuantError(f"{path}: config.json's quantization_config is not an object")
        return quant.QuantSpec(qc.get("bits"), qc.get("quant_method"), qc.get("group_size", qc.get("q_group_size")))
    return None


def check_load_quant(name_or_path, name: str | None) -> quant.QuantSpec | None:
    """The quantisation a decoder of `name_or_path` loaded with quant=`name` runs on (None: dense),
    checked before any tensor is read: QuantError for a bad name or group, or a name that contradicts
    a quantised folder's; UsageError for GPTQ ("int4") asked of a dense model."""
    found = folder_spec(name_or_path)
    if name is None:
        return found
    if found is not None:
        asked = quant.check_quant(name)
        if (asked.bits, asked.group_size, asked.method == "rtn") != (found.bits, found.group_size, found.method == "rtn"):
            raise quant.QuantError(f"{name_or_path} holds {found.name} ({found.method}) weights: quant {asked.name!r} contradicts them "
                                   "(leave quant out to load the folder as it is)")
        return found
    spec = quant.check_quant(name)
    if spec.bits == 4 and spec.method != "rtn":
        raise UsageError(f"{spec.name} is calibrated (GPTQ) and is not made on the fly: make a folder with python -m eval.quantize "
                         f"{name_or_path} --quant {spec.name} --calib CORPUS --out FOLDER and load that (or use int4-rtn)")
    return check_quant(name, model=name_or_path)
