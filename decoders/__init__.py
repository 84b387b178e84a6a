"""declab decoders: one interface over every family, and `load` to get one.

    import decoders
    dec = decoders.load("llama-tiny")            # a preset: random weights of that shape
    dec = decoders.load("/path/to/checkpoint")   # a folder: format detected from its files
    out = dec.generate([[1, 2, 3]], max_new_tokens=8)
"""

import importlib
import inspect
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from declab_arch.checkpoint import CheckpointError, CONFIG_DIR, check_weights_files, preset_names, read_json
from decoders.base import Decoder, Generation, Memory, StepOut, UsageError
from decoders.kv_cache import parse_kv_dtype
from decoders.sampling import GREEDY, Sampling
from decoders.speculative import speculative
from declab_kernels import resolve_impl

__all__ = ["load", "speculative", "family_of", "model_config", "check_model", "parse_device", "check_page_size", "user_errors", "USER_ERRORS", "Decoder", "Generation", "Memory", "StepOut", "Sampling", "GREEDY", "UsageError", "CheckpointError", "FAMILIES"]

# The registry: family -> its Decoder class, the family's record (`decoders.base.Decoder` says what it
# declares), imported on first use so that a family's optional dependencies stay optional. A new
# family is its decoder file (with its declab_arch module) and one line here.
FAMILIES = {
    "transformer": "decoders.transformer:TransformerDecoder",
    "mamba2": "decoders.mamba2:Mamba2Decoder",
    "rwkv7": "decoders.rwkv7:RWKV7Decoder",
    "maskpredict": "decoders.maskpredict:MaskPredictDecoder",
}
# What a user can cause (a bad option, preset or checkpoint): reported in one line, not a traceback.
USER_ERRORS = (UsageError, CheckpointError)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def family_class(family: str):
    """The Decoder class (the record) of a registered family."""
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


def parse_device(device) -> torch.device:
    """The device a user named ("cpu", "cuda", "cuda:1"; None: CUDA when available), checked to exist here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"unknown device {device!r} (expected cpu, cuda or cuda:N)") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"device {device!r} is not supported (expected cpu, cuda or cuda:N)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UsageError(f"device {device!r}: no CUDA device is available (torch {torch.__version__}, {build})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return parsed


def check_page_size(page_size) -> int:
    """A KV cache page size: a power of two from 16 to 256 tokens (what the paged attention kernels take)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 16 <= page_size <= 256 or page_size & (page_size - 1):
        raise UsageError(f"page size must be a power of two from 16 to 256, got {page_size!r}")
    return page_size


def family_options(family: str) -> list[str]:
    """The keyword options a family's decoder takes beyond what `load` passes itself (page_size, ...)."""
    own = {"self", "model", "config", "device", "dtype", "impl", "source", "tokenizer", "max_context", "quant"}
    names = []
    for cls in family_class(family).__mro__:
        if "__init__" in vars(cls):
            for p in inspect.signature(cls.__init__).parameters.values():
                if p.kind is p.KEYWORD_ONLY and p.name not in own and p.name not in names:
                    names.append(p.name)
    return names


def check_options(family: str, options: dict) -> None:
    """Raise UsageError for an option the family does not take (kv_dtype where there is no KV cache), or a
    page size or KV cache dtype it cannot use."""
    known = family_options(family)
    unknown = [k for k in options if k not in known]
    if "kv_dtype" in unknown:
        raise UsageError(f"kv_dtype {options['kv_dtype']!r}: the {family} family has no KV cache")
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r} for the {family} family (known: {', '.join(known)})")
    if "page_size" in options:
        check_page_size(options["page_size"])
    if "kv_dtype" in options:
        parse_kv_dtype(options["kv_dtype"])


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
    prefix = name.split("-")[0]
    for family in FAMILIES:
        if family_class(family).presets == prefix:
            return family
    raise UsageError(f"preset {name!r} names no known family")


def model_config(name_or_path):
    """(family, config) of a preset or checkpoint folder, checked, without reading any tensor."""
    family = family_of(name_or_path)
    arch = family_class(family).arch
    path = Path(str(name_or_path))
    if path.is_dir():
        return family, arch.read_config(path)
    return family, arch.preset_config(read_json(CONFIG_DIR / f"{name_or_path}.json"), str(name_or_path))


def check_model(name_or_path, *, context: int | None = None) -> str:
    """What a command checks of a model before it spends time: the preset exists or the folder is a
    checkpoint of a known family with complete weights files, and `context` is within the config's
    maximum (where it states one). Cheap: no tensor is read. Returns the family."""
    family, config = model_config(name_or_path)
    path = Path(str(name_or_path))
    if path.is_dir():
        check_weights_files(path)
    limit = getattr(config, "max_position_embeddings", None)
    if context is not None and limit is not None and context > limit:
        raise UsageError(f"context of {context} tokens is over {name_or_path}'s maximum of {limit}")
    return family


def load(name_or_path, *, family: str | None = None, device=None, dtype=None, impl: str = "auto", seed: int = 0, tp=None,
         quant: str | None = None, **options) -> Decoder:
    """A decoder from a preset name (random weights) or a checkpoint folder.

    device defaults to CUDA when available; dtype to bfloat16 on a GPU and float32 on the CPU;
    impl is "auto" (Triton on a GPU), "triton" or "ref". `options` go to the family (page_size,
    kv_dtype="fp8" for an e4m3 KV cache in the transformer and Mask-Predict families, ...).
    With `tp` (a `declab_arch.tensor_parallel.Group`, see `decoders.distributed`) the decoder is this
    rank's share of the model, split over the group's ranks, every one of which must load it alike.
    `quant` runs the linear layers on quantised weights: "int8" or "int4-rtn" (any "-gN" group)
    quantised on the fly; a quantised folder (`python -m eval.quantize`, or an AWQ / GPTQ folder) loads
    as quantised without it, and a `quant` that contradicts the folder's is refused (`decoders.quant`).
    """
    device = parse_device(device)
    dtype = parse_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        impl = resolve_impl(impl, device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    family = family or family_of(name_or_path)
    check_options(family, options)
    from decoders.quant import check_load_quant, folder_spec

    if check_load_quant(name_or_path, quant) is not None and tp is not None:
        raise UsageError("quantised weights under tensor parallel are not supported")
    common = dict(device=device, dtype=dtype, impl=impl, **options)
    # A quantised folder brings its own weight objects (`Decoder.from_checkpoint`).
    if quant is not None and folder_spec(name_or_path) is None:
        common["quant"] = quant
    cls = family_class(family)
    if tp is not None:
        from decoders.distributed import tp_class

        cls = tp_class(cls)
        common["tp_group"] = tp
    path = Path(str(name_or_path))
    if path.is_dir():
        return cls.from_checkpoint(path, **common)
    name = str(name_or_path)
    return cls.from_preset(read_json(CONFIG_DIR / f"{name}.json"), name, seed=seed, **common)


def detect_family(hf: dict, path: Path) -> str:
    for family in FAMILIES:
        if family_class(family).detects(hf):
            return family
    what = hf.get("architectures") or hf.get("model_type") or "nothing"
    raise CheckpointError(f"{path}: unknown architecture {what} (config.json names no family the lab reads)")


@contextmanager
def user_errors():
    """For command lines: a preset, checkpoint or option the lab refuses becomes one line on stderr
    and exit code 2, never a traceback (under torchrun every rank exits with 2, rank 0 alone prints)."""
    from decoders.cli import reports_refusals

    try:
        yield
    except USER_ERRORS as e:
        if reports_refusals():
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
