"""declab kernels: each op in its own folder, a float32 PyTorch reference beside a Triton kernel.

`resolve_impl` turns the user's choice ("auto", "triton", "ref") into the implementation that
will actually run. It is called once per model load; the result is logged and recorded in every
benchmark record. There is no silent fallback: asking for Triton where it cannot run is an error.

`pdl(device, kernel)` says whether the Triton kernels of a decode step launch with programmatic
dependent launch (PDL, `launch_pdl=True` plus the `PDL` constexpr of each kernel; every kernel of a
step but the paged decode attention, which measured faster without it): True only on a CUDA device
of compute capability >= 9.0 (Hopper), outside the interpreter (TRITON_INTERPRET != "1"), and
unless the environment variable DECLAB_PDL is "0" (the switch for users and benchmarks; default on).
DECLAB_PDL_OFF, a comma list of kernel folders (`PDL_KERNELS`, e.g. "ssd,mamba2_norm"), turns it off
for those kernels only, for per-kernel A/B runs; each launch site passes its module's `__name__`.
Under PDL a kernel may start while the one before it on the stream is still running: every program
calls `gdc_launch_dependents()` at its start (the next PDL kernel may then launch) and
`gdc_wait()` (griddepcontrol.wait: the previous grid has completed and its memory is visible)
before it loads anything an earlier kernel may have written and before its first store. Only data
that no kernel of the step writes (weights, norm weights, biases) is loaded before the wait, so a
weight must not be written by the kernel launched right before the one reading it without a wait
in between (weights loaded at model load, many launches and a sync earlier, are fine). The one
exception is opt-in: the recurrent decode steps (`ssd.mamba2_decode_step`, `wkv7.wkv7_step`) and
RWKV-7's token-shift norm (`rwkv7_fused.add_norm_shift`) take `state_ready=True` from a caller that
promises the state (SSM state and conv window, WKV state, shift row) was last written before a
kernel launched without PDL (such a kernel starts only after everything before it has finished; a
decoder's step ends with sampling kernels launched without PDL, `declab_kernels.argmax` included), and
then load the state before the wait. The flag is read at every launch; a CUDA graph keeps what it was when captured.
"""

import functools
import logging
import os

import torch

log = logging.getLogger("declab.kernels")

IMPLS = ("auto", "triton", "ref")
# Kernel folders whose Triton launches follow `pdl`.
PDL_KERNELS = ("gemv", "rmsnorm", "rotary", "swiglu", "mamba2_norm", "rwkv7_fused", "paged_attention", "ssd", "wkv7", "quant_gemv")


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


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl(device: torch.device | str | int | None = None, kernel: str | None = None) -> bool:
    """Whether kernels launched for tensors on `device` use programmatic dependent launch (see the
    module docstring): a CUDA device of compute capability >= 9, TRITON_INTERPRET != "1",
    DECLAB_PDL != "0", and `kernel` (a module name under declab_kernels/, e.g. "declab_kernels.ssd.triton") not in
    DECLAB_PDL_OFF. `device` None means the current CUDA device (False without one)."""
    if os.environ.get("DECLAB_PDL") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if kernel is not None and kernel.split(".")[1] in pdl_off():
        return False
    if device is None:
        if not torch.cuda.is_available():
            return False
        index = torch.cuda.current_device()
    else:
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def pdl_off() -> tuple[str, ...]:
    """The kernel folders DECLAB_PDL_OFF names; ValueError for a name that is not in PDL_KERNELS."""
    names = tuple(x.strip() for x in os.environ.get("DECLAB_PDL_OFF", "").split(",") if x.strip())
    unknown = [x for x in names if x not in PDL_KERNELS]
    if unknown:
        raise ValueError(f"DECLAB_PDL_OFF names {unknown}, not among the PDL kernels {', '.join(PDL_KERNELS)}")
    return names


def check_impl(impl: str) -> None:
    """Raise unless `impl` is an implementation a kernel can run: "triton" or "ref" (not "auto")."""
    if impl not in ("triton", "ref"):
        raise ValueError(f"impl must be 'triton' or 'ref' (resolve 'auto' with declab_kernels.resolve_impl), got {impl!r}")


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
