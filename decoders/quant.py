"""What a command checks of a `--quant` option before it spends time: the name (and group size) is
one the lab knows, and, given the model, the group divides every layer it would quantise.

    spec = check_quant("int4-g64", model="llama-1b")   # QuantSpec(bits=4, method="gptq", group_size=64)

The model's layers are read from a skeleton built on the meta device from its config (no tensor is
allocated or read), so the check costs no more than `decoders.check_model`. Refusals are
`declab_arch.quant.QuantError`, a CheckpointError: one line and exit code 2 under `decoders.user_errors`.
"""

import importlib
from pathlib import Path

import torch

from declab_arch import quant
from declab_arch.checkpoint import CONFIG_DIR, read_json

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
