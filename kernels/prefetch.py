"""L2 prefetch of the next GEMV's weights from inside a latency-bound decode kernel.

A batch-1 decode step alternates GEMVs that stream weights at copy bandwidth with kernels whose time
is a chain of dependent memory round trips (the paged decode attention at short contexts, the SSM
step), during which HBM is mostly idle. Such a kernel can take `prefetch=` (weights the GEMV after it
will read) and issue `prefetch.global.L2` for their first bytes, so that GEMV finds them in L2.

A prefetch is a hint: it loads nothing into registers, cannot fault and changes no result, so it may
target any data no kernel of the step writes. The weights are split evenly over the kernel's programs
(each takes a contiguous run of 128-byte lines, one line a thread per round). The Triton interpreter
has no inline assembly: there the hosting kernels compile it out (`enabled` is False).
"""

import os

import torch
import triton
import triton.language as tl


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` may issue prefetches (a CUDA device, outside the interpreter)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def ranges(tensors, limit: int, count: int = 2):
    """[(tensor, bytes)] * count: the first `limit` bytes of `tensors`, in order (padding entries have
    0 bytes). Each tensor must be contiguous: its bytes are prefetched as one range."""
    if len(tensors) > count:
        raise ValueError(f"at most {count} prefetch tensors, got {len(tensors)}")
    out = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"prefetch tensors must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")
        n = min(t.numel() * t.element_size(), max(0, limit))
        out.append((t, n))
        limit -= n
    while len(out) < count:
        out.append((None, 0))
    return out


@triton.jit
def prefetch_l2(ptr, nbytes, part, parts, LINES: tl.constexpr):
    """Prefetch into L2 part `part` of `parts` of the bytes [0, nbytes) at `ptr`: a contiguous run of
    128-byte lines, LINES at a time (one per thread when LINES is the program's thread count)."""
    base = ptr.to(tl.pointer_type(tl.int8))
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, parts)
    lo = part * per
    hi = tl.minimum(lo + per, lines)
    for l0 in range(lo, hi, LINES):
        line = tl.minimum(l0 + tl.arange(0, LINES), hi - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)
