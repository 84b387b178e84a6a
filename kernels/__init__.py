"""declab kernels: each op in its own folder, a float32 PyTorch reference beside a Triton kernel.

`resolve_impl` turns the user's choice ("auto", "triton", "ref") into the implementation that
will actually run. It is called once per model load; the result is logged and recorded in every
benchmark record. There is no silent fallback: asking for Triton where it cannot run is an error.
"""

import logging
import os

import torch

log = logging.getLogger("declab.kernels")

IMPLS = ("auto", "triton", "ref")


def triton_available(device: torch.device | str | None = None) -> bool:
    """True when Triton kernels can run for tensors on `device` (a GPU, or the CPU interpreter)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return torch.cuda.is_available()
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_impl(impl: str) -> None:
    """Raise unless `impl` is an implementation a kernel can run: "triton" or "ref" (not "auto")."""
    if impl not in ("triton", "ref"):
        raise ValueError(f"impl must be 'triton' or 'ref' (resolve 'auto' with kernels.resolve_impl), got {impl!r}")


def resolve_impl(impl: str, device: torch.device | str) -> str:
    """Map "auto" | "triton" | "ref" to the implementation that runs on `device`.

    "auto" is Triton on a CUDA device and the reference elsewhere; "triton" where Triton cannot run
    raises ValueError with a one-line reason.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}: expected one of {', '.join(IMPLS)}")
    device = torch.device(device)
    if impl == "auto":
        chosen = "triton" if device.type == "cuda" and triton_available(device) else "ref"
    elif impl == "triton" and not triton_available(device):
        raise ValueError(
            f"impl='triton' needs a CUDA device with Triton (or TRITON_INTERPRET=1 on the CPU); "
            f"got device {device}"
        )
    else:
        chosen = impl
    log.info("kernel implementation: %s (asked %s, device %s)", chosen, impl, device)
    return chosen
