"""declab decoders: one interface over every family, and `load` to get one.

    import decoders
    dec = decoders.load("llama-tiny")            # a preset: random weights of that shape
    dec = decoders.load("/path/to/checkpoint")   # a folder: format detected from its files
    out = dec.generate([[1, 2, 3]], max_new_tokens=8)
"""

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from declab_arch.checkpoint import CheckpointError, CONFIG_DIR, preset_names, read_json
from decoders.base import Decoder, Generation, Memory, StepOut, UsageError
from decoders.sampling import GREEDY, Sampling
from decoders.speculative import speculative
from declab_kernels import resolve_impl

__all__ = ["load", "speculative", "family_of", "user_errors", "USER_ERRORS", "Decoder", "Generation", "Memory", "StepOut", "Sampling", "GREEDY", "UsageError", "CheckpointError", "FAMILIES"]

# family -> class, imported on first use so that a family's optional dependencies stay optional.
FAMILIES = {
    "transformer": "decoders.transformer:TransformerDecoder",
    "mamba2": "decoders.mamba2:Mamba2Decoder",
    "rwkv7": "decoders.rwkv7:RWKV7Decoder",
    "maskpredict": "decoders.maskpredict:MaskPredictDecoder",
}
# preset name prefix -> family
PRESET_FAMILY = {"llama": "transformer", "mamba2": "mamba2", "rwkv7": "rwkv7", "maskpredict": "maskpredict"}
# What a user can cause (a bad option, preset or checkpoint): reported in one line, not a traceback.
USER_ERRORS = (UsageError, CheckpointError)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def family_class(family: str):
    if family not in FAMILIES:
        raise UsageError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return DTYPES[dtype]


def family_of(name_or_path) -> str:
    """The family a preset name or checkpoint folder belongs to (without building the model)."""
    path = Path(str(name_or_path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: not a checkpoint folder (no config.json)")
        hf = read_json(path / "config.json")
        return hf.get("declab_family") or detect_family(hf, path)
    name = str(name_or_path)
    if not (CONFIG_DIR / f"{name}.json").exists():
        if "/" in name or path.exists():
            raise CheckpointError(f"{name}: not a checkpoint folder")
        raise UsageError(f"unknown preset {name!r} (presets: {', '.join(preset_names())})")
    family = PRESET_FAMILY.get(name.split("-")[0])
    if family is None:
        raise UsageError(f"preset {name!r} names no known family")
    return family


def load(name_or_path, *, family: str | None = None, device=None, dtype=None, impl: str = "auto", seed: int = 0, **options) -> Decoder:
    """A decoder from a preset name (random weights) or a checkpoint folder.

    device defaults to CUDA when available; dtype to bfloat16 on a GPU and float32 on the CPU;
    impl is "auto" (Triton on a GPU), "triton" or "ref". `options` go to the family (page_size, ...).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        impl = resolve_impl(impl, device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    family = family or family_of(name_or_path)
    common = dict(device=device, dtype=dtype, impl=impl, **options)
    path = Path(str(name_or_path))
    if path.is_dir():
        return family_class(family).from_checkpoint(path, **common)
    name = str(name_or_path)
    return family_class(family).from_preset(read_json(CONFIG_DIR / f"{name}.json"), name, seed=seed, **common)


def detect_family(hf: dict, path: Path) -> str:
    for family in FAMILIES:
        if family_class(family).detects(hf):
            return family
    what = hf.get("architectures") or hf.get("model_type") or "nothing"
    raise CheckpointError(f"{path}: unknown architecture {what} (config.json names no family the lab reads)")


@contextmanager
def user_errors():
    """For command lines: a preset, checkpoint or option the lab refuses becomes one line on stderr
    and exit code 2, never a traceback."""
    try:
        yield
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
