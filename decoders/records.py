"""Result records: what every JSON line the lab writes carries, and how it is written.

- `environment(device)`: git sha (and dirty flag), device name, torch/triton versions, whether the
  Triton kernels launch with programmatic dependent launch (`declab_kernels.pdl`; DECLAB_PDL=0 turns
  it off), and the command line, for every record.
- `append_jsonl(path, record)`: one JSON object appended as a line and flushed, so an interrupted
  run keeps every result it finished.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from declab_kernels import pdl, pdl_off


def git_state() -> tuple[str, bool]:
    """(sha, dirty) of the repository holding this file, or ("unknown", False) outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, check=True).stdout.strip())
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False


def command_line() -> str:
    """This process's command as it can be pasted back into a shell: `python -m module args` for a
    module run with -m (the script's path otherwise), each argument quoted where it needs it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name.removesuffix(".__main__")] if spec is not None and spec.name else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def environment(device) -> dict:
    """What every result record carries about where it was measured."""
    device = torch.device(device)
    if "DECLAB_GIT_SHA" in os.environ:
        # A copy of the tree shipped without (or with a stale) .git names its commit here.
        sha, dirty = os.environ["DECLAB_GIT_SHA"], os.environ.get("DECLAB_GIT_DIRTY", "0") == "1"
    else:
        sha, dirty = git_state()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    off = pdl_off()
    return {
        "git_sha": sha,
        "git_dirty": dirty,
        "device": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "pdl": pdl(device),
        **({"pdl_off": list(off)} if off else {}),
        "command": command_line(),
    }


def append_jsonl(path, record: dict) -> None:
    """Append one JSON object as a line and flush it, so an interrupted run keeps what it wrote."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
