"""Weight-only quantised linear layers: y = x @ dequant(W)^T with int8 or int4 weights.

Formats (declab_kernels/quant_gemv/README.md has the byte counts):
- int8 per output channel, symmetric: qweight `[N, K]` int8, scale `[N]` float32.
- int4 group-wise, asymmetric: qweight `[N, K // 8]` int32 (code of input i K / 8 + j in nibble i of
  word j: eight slices of a row, `pack_int4`, layout version INT4_LAYOUT), scales `[N, K // g]`
  float16 or float32, zeros `[N, K // g]` uint8 (0..15); g divides K, K a multiple of 8.

x `[M, K]` (contiguous last dimension) -> `[M, N]` in x's dtype, float32 accumulation. `impl` is
"triton" or "ref" (already resolved by `declab_kernels.resolve_impl`).

- `int8_linear(x, qweight, scale, *, impl, kernel=None)`, `int4_linear(x, qweight, scales, zeros, group_size, *, impl, kernel=None)`:
  with impl="triton" one of three kernels (KERNELS), chosen by `int8_kernel(M)` / `int4_kernel(M, K,
  group_size)` from the thresholds in `declab_kernels.tuning`, or the one `kernel` names (ValueError
  where it cannot run the shape):
  "fma", the GEMV that dequantises in registers on the CUDA cores (up to MAX_ROWS rows for int8,
  INT4_GEMV_ROWS for int4); "dot", the dequantising tensor-core kernel (any M; int4 needs
  `int4_dot_words` >= 16); "dequant+cublas", the whole weight dequantised to x's dtype by one
  Triton kernel, then `F.linear`. impl="ref" is the float32 reference at any M.
- `dequantize_int8(qweight, scale, dtype, *, impl)`, `dequantize_int4(qweight, scales, zeros, group_size, dtype, *, impl)`
  -> dense `[N, K]` in dtype.
- `pack_int4(codes [N, K]) -> [N, K // 8]` int32 and its inverse `unpack_int4`; `SHIFTS`, the eight nibbles' bit offsets.
"""

import math

import torch.nn.functional as F

from declab_kernels import check_impl, tuning
from declab_kernels.quant_gemv.ref import (
    INT4_LAYOUT, SHIFTS, dequantize_int4_ref, dequantize_int8_ref, int4_linear_ref, int8_linear_ref, pack_int4, unpack_int4,
)

MAX_ROWS = 16
# The int4 GEMV's row limit: it keeps every x row's per-thread sums, and each row's update costs a
# select over all of them (M^2 work). The dot kernel takes 2 rows and more where it can tile the
# shape; the GEMV's 2..4 rows serve the shapes it cannot.
INT4_GEMV_ROWS = 4

# The kernels a Triton product may run on (module docstring).
KERNELS = ("fma", "dot", "dequant+cublas")
# The widest int4 tile of words the dot kernel takes (8 x 128 inputs), and tl.dot's least depth.
DOT_WORDS = 128
MIN_DOT_WORDS = 16

__all__ = ["int8_linear", "int4_linear", "dequantize_int8", "dequantize_int4", "pack_int4", "unpack_int4",
           "int8_linear_ref", "int4_linear_ref", "int8_kernel", "int4_kernel", "int4_dot_words", "KERNELS",
           "MAX_ROWS", "INT4_GEMV_ROWS", "INT4_LAYOUT", "SHIFTS"]


def int4_dot_words(S: int, group_size: int) -> int:
    """The widest tile of words (a power of two <= DOT_WORDS) the int4 dot kernel can take for rows of
    S words in groups of `group_size` inputs: it must divide both, so that nibble i of every tile is
    one contiguous run of inputs inside one group; 0 where that is below MIN_DOT_WORDS (the dot
    kernel does not run such shapes)."""
    g = math.gcd(S, group_size)
    widest = min(g & -g, DOT_WORDS)
    return widest if widest >= MIN_DOT_WORDS else 0


def int8_kernel(M: int) -> str:
    """The kernel `int8_linear` runs for M rows (KERNELS; thresholds in `declab_kernels.tuning`)."""
    if M <= tuning.QUANT_FMA_ROWS["int8"]:
        return "fma"
    return "dot" if M <= tuning.QUANT_DOT_ROWS["int8"] else "dequant+cublas"


def int4_kernel(M: int, K: int, group_size: int) -> str:
    """The kernel `int4_linear` runs for M rows of depth K in groups of `group_size`: as `int8_kernel`,
    except that a shape the dot kernel cannot tile (`int4_dot_words` 0) runs the GEMV up to
    INT4_GEMV_ROWS rows and the dense path above."""
    if not int4_dot_words(K // 8, group_size):
        return "fma" if M <= INT4_GEMV_ROWS else "dequant+cublas"
    if M <= tuning.QUANT_FMA_ROWS["int4"]:
        return "fma"
    return "dot" if M <= tuning.QUANT_DOT_ROWS["int4"] else "dequant+cublas"


def _kernel(kernel, chosen, fits, name):
    """`kernel` checked (it must be among KERNELS and `fits`), or the rule's `chosen` for None."""
    if kernel is None:
        return chosen
    if kernel not in KERNELS:
        raise ValueError(f"{name}: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if not fits[kernel]:
        raise ValueError(f"{name}: the {kernel!r} kernel cannot run this shape")
    return kernel


def int8_linear(x, qweight, scale, *, impl, kernel=None):
    """x `[M, K]` @ (qweight * scale[:, None])^T -> `[M, N]` in x's dtype; `kernel` as the module docstring says."""
    check_impl(impl)
    if impl == "ref":
        return int8_linear_ref(x, qweight, scale)
    from declab_kernels.quant_gemv import triton as T

    M = x.shape[0]
    kernel = _kernel(kernel, int8_kernel(M), {"fma": M <= MAX_ROWS, "dot": True, "dequant+cublas": True}, "int8_linear")
    if kernel == "fma":
        return T.int8_gemv_triton(x, qweight, scale)
    if kernel == "dot":
        return T.int8_dot_triton(x, qweight, scale)
    return F.linear(x, T.dequantize_int8_triton(qweight, scale, x.dtype))


def int4_linear(x, qweight, scales, zeros, group_size, *, impl, kernel=None):
    """x `[M, K]` @ ((codes - zeros) * scales)^T -> `[M, N]` in x's dtype (groups of `group_size` inputs);
    `kernel` as the module docstring says."""
    check_impl(impl)
    if impl == "ref":
        return int4_linear_ref(x, qweight, scales, zeros, group_size)
    from declab_kernels.quant_gemv import triton as T

    M, K = x.shape[0], qweight.shape[1] * 8
    fits = {"fma": M <= INT4_GEMV_ROWS, "dot": int4_dot_words(K // 8, group_size) > 0, "dequant+cublas": True}
    kernel = _kernel(kernel, int4_kernel(M, K, group_size), fits, "int4_linear")
    if kernel == "fma":
        return T.int4_gemv_triton(x, qweight, scales, zeros, group_size)
    if kernel == "dot":
        return T.int4_dot_triton(x, qweight, scales, zeros, group_size)
    return F.linear(x, T.dequantize_int4_triton(qweight, scales, zeros, group_size, x.dtype))


def dequantize_int8(qweight, scale, dtype, *, impl):
    """Dense `[N, K]` in dtype."""
    check_impl(impl)
    if impl == "ref":
        return dequantize_int8_ref(qweight, scale).to(dtype)
    from declab_kernels.quant_gemv.triton import dequantize_int8_triton

    return dequantize_int8_triton(qweight, scale, dtype)


def dequantize_int4(qweight, scales, zeros, group_size, dtype, *, impl):
    """Dense `[N, K]` in dtype."""
    check_impl(impl)
    if impl == "ref":
        return dequantize_int4_ref(qweight, scales, zeros, group_size).to(dtype)
    from declab_kernels.quant_gemv.triton import dequantize_int4_triton

    return dequantize_int4_triton(qweight, scales, zeros, group_size, dtype)
