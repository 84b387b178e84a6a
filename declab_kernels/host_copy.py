"""Host values onto the device without waiting for it.

A copy to the GPU from pageable host memory (`torch.tensor(values, device="cuda")`, indexing a CUDA
tensor with a Python list, `.to("cuda")` of an ordinary CPU tensor) first waits for all the work
queued on the stream, so a decode step or a prefill layer that makes one stalls the host until the
GPU drains, and the GPU then idles while the host launches the rest. `on_device` stages the values
in pinned memory, whose copy is queued like a kernel.
"""

import torch


def on_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """Host values (a list or a CPU tensor) as a tensor on `device`, the copy queued behind the
    stream's work (CUDA) rather than waited for."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
