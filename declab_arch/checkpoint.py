"""Reading checkpoint folders and presets: shared by every family's loader.

A preset is `configs/<name>.json` whose keys are exactly the fields of the family's config
dataclass. A checkpoint folder holds `config.json` and weights as one or sharded safetensors files
or `pytorch_model.bin`. Every problem a user can cause (unknown field, missing or mis-shaped
tensor, unknown architecture) raises `CheckpointError` with a one-line message naming it.
"""

import dataclasses
import json
import math
import types
import typing
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class CheckpointError(ValueError):
    """A preset or checkpoint folder the lab cannot use; the message is one line for the user."""


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def read_json(path: Path) -> dict:
    """A JSON object from a file; a missing file, invalid JSON or another JSON value is a CheckpointError."""
    try:
        values = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise CheckpointError(f"{path}: not a JSON text file ({type(e).__name__})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(values).__name__}, not an object of config fields")
    return values


def config_from_dict(cls, values: dict, source: str):
    """Build dataclass `cls` from `values`, rejecting unknown keys and reporting missing ones."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise CheckpointError(f"{source}: unknown config field(s) {', '.join(unknown)} for {cls.__name__}")
    try:
        return cls(**values)
    except TypeError as e:
        raise CheckpointError(f"{source}: {e}") from None
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None


def _matches(value, kind) -> bool:
    """Whether a config.json value is of the annotated type (int, float, bool, dict, list[...], unions)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, k) for k in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    return isinstance(value, origin or kind)


def check_fields(config) -> None:
    """Raise CheckpointError unless every field of dataclass `config` has its annotated type, and every
    count is at least 1 (token ids at least 0; names in the class's `ZERO_OK` may be 0). Run first in
    each config's __post_init__, so a wrong-typed config.json value is one line, not a traceback later."""
    hints = typing.get_type_hints(type(config))
    zero_ok = getattr(config, "ZERO_OK", ())
    for field in dataclasses.fields(config):
        value, kind = getattr(config, field.name), hints[field.name]
        if not _matches(value, kind):
            shown = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
            raise CheckpointError(f"config field {field.name} = {value!r} is not of type {shown}")
        if isinstance(value, int) and not isinstance(value, bool):
            least = 0 if field.name.endswith("_id") or field.name in zero_ok else 1
            if value < least:
                raise CheckpointError(f"config field {field.name} = {value} must be at least {least}")


def parse_config(read, hf: dict, source: str):
    """`read(hf, source)`, a family's config.json reader, with a value it cannot compute with (a string
    where a number belongs, a missing nested field) reported as CheckpointError naming the folder."""
    try:
        return read(hf, source)
    except CheckpointError as e:
        raise CheckpointError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None
    except (TypeError, ValueError, KeyError, ZeroDivisionError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{source}: config.json has a value the lab cannot read ({type(e).__name__}: {e})") from None


def save_config(config, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors, sharded or not, or pytorch_model.bin), on the CPU."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        tensors = {}
        for shard in shards:
            tensors.update(_read_weights(shard, lambda: load_file(str(shard)), "safetensors"))
        return tensors
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        tensors = {}
        for path in bins:
            tensors.update(_read_weights(path, lambda: torch.load(path, map_location="cpu", weights_only=True), "PyTorch"))
        return tensors
    raise CheckpointError(f"{folder}: no weights found (expected *.safetensors or pytorch_model.bin)")


def check_weights_files(folder: Path) -> None:
    """Without reading any tensor: raise CheckpointError unless the folder has weights and each
    safetensors file holds a header and all the bytes it announces (a truncated download fails here,
    before a command spends time on other work)."""
    folder = Path(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards and not sorted(folder.glob("pytorch_model*.bin")):
        raise CheckpointError(f"{folder}: no weights found (expected *.safetensors or pytorch_model.bin)")
    for shard in shards:
        size = shard.stat().st_size
        with shard.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= size - 8:
                raise CheckpointError(f"{shard}: not a safetensors file (no header)")
            try:
                header = json.loads(f.read(length))
                end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                raise CheckpointError(f"{shard}: not a safetensors file (unreadable header)") from None
        if 8 + length + end > size:
            raise CheckpointError(f"{shard}: truncated ({size} bytes, the header announces {8 + length + end})")


def _read_weights(path: Path, read, kind: str) -> dict[str, torch.Tensor]:
    """The tensors `read()` returns from weights file `path`, checked to be a dict of tensors."""
    try:
        tensors = read()
    except Exception as e:
        # A truncated or foreign file fails inside the reader in many ways (SafetensorError,
        # UnpicklingError, EOFError, RuntimeError): all are the user's file, reported in one line.
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{path}: not a readable {kind} weights file ({type(e).__name__}: {text[0] if text else 'no detail'})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CheckpointError(f"{path}: holds no state dict of tensors")
    return tensors


def assign_weights(module: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str, *, optional=()) -> None:
    """Copy `tensors` into `module`'s parameters and buffers by name, checking names and shapes.

    Every parameter must be present (except names in `optional`) with the exact shape; a tensor in
    the checkpoint that the model does not have is also an error, since it means a different model.
    """
    own = dict(module.named_parameters())
    own.update({k: v for k, v in module.named_buffers() if k in tensors})
    for name, param in own.items():
        if name not in tensors:
            if name in optional:
                continue
            raise CheckpointError(f"{source}: missing tensor {name} (expected shape {list(param.shape)})")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {list(t.shape)}, expected {list(param.shape)}")
    extra = sorted(set(tensors) - set(own))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    with torch.no_grad():
        for name, param in own.items():
            if name in tensors:
                param.copy_(tensors[name].to(param.dtype))


def load_tokenizer(folder: Path):
    """The HF tokenizer saved in `folder`, or None when the folder has no tokenizer files."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        # transformers and tokenizers fail on a broken tokenizer file in many ways; it is the user's file.
        text = str(e).strip().splitlines()
        raise CheckpointError(f"{folder}: its tokenizer files cannot be read ({type(e).__name__}: {text[0] if text else 'no detail'})") from None
