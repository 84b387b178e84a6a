"""Timing and ceilings shared by the kernel benchmarks and the decode harness.

- `time_ms(fn)`: median milliseconds of `fn()` with CUDA events after warm-up (monotonic clock on
  the CPU), optionally through a CUDA graph to remove launch gaps.
- `copy_bandwidth(device)`: bytes read + written per second by a large device-to-device copy, the
  ceiling that achieved bandwidth and MBU are reported against.
- `matmul_tflops(device)`: a large bf16 matrix product, the arithmetic ceiling.
- `environment()`: git sha (and dirty flag), device name, torch/triton versions, whether the Triton
  kernels launch with programmatic dependent launch (`declab_kernels.pdl`; DECLAB_PDL=0 turns it off), for
  every record.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from declab_kernels import pdl, pdl_off


def time_samples_ms(fn, *, warmup: int = 10, iters: int = 50, graph: bool = False) -> list[float]:
    """Per-call times of `fn()` in ms: CUDA events on a GPU, a monotonic clock on the CPU."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if graph and cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    for _ in range(warmup):
        fn()
    samples = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def time_ms(fn, **kwargs) -> float:
    """Median of `time_samples_ms`."""
    return statistics.median(time_samples_ms(fn, **kwargs))


def copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    device = torch.device(device)
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10 if device.type == "cuda" else 3)
    return 2 * nbytes / (ms * 1e-3)


def matmul_flops(device, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 (GPU) or float32 (CPU) matrix product on random data."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        n = min(n, 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, warmup=3, iters=10 if device.type == "cuda" else 3)
    return 2 * n**3 / (ms * 1e-3)


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


def import_mamba_ssm():
    """Import mamba-ssm for peer runs and cross-checks (never on the lab's own path).

    mamba-ssm built without its CUDA extension (MAMBA_SKIP_CUDA_BUILD=TRUE) still has its Triton
    kernels, but its package imports the Mamba-1 `selective_scan_cuda` module at load; a stand-in
    module lets that import succeed, and calling anything that needs the extension still fails.
    Raises ImportError when mamba-ssm is not installed.
    """
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("mamba_ssm") is None:
        raise ImportError("mamba-ssm is not installed (pip install -e '.[peers]', see the README)")
    if "selective_scan_cuda" not in sys.modules and importlib.util.find_spec("selective_scan_cuda") is None:
        stand_in = types.ModuleType("selective_scan_cuda")
        # Importers that look the module up again (find_spec) need a spec on it.
        stand_in.__spec__ = importlib.machinery.ModuleSpec("selective_scan_cuda", None)
        sys.modules["selective_scan_cuda"] = stand_in
    import mamba_ssm

    return mamba_ssm
