"""Weight-only quantised linear layers: y = x @ dequant(W)^T with int8 or int4 weights.

Formats (declab_kernels/quant_gemv/README.md has the byte counts):
- int8 per output channel, symmetric: qweight `[N, K]` int8, scale `[N]` float32.
- int4 group-wise, asymmetric: qweight `[N, K // 8]` int32 (code of input i K / 8 + j in nibble i of
  word j: eight slices of a row, `pack_int4`, layout version INT4_LAYOUT), scales `[N, K // g]`
  float16 or float32, zeros `[N, K // g]` uint8 (0..15); g divides K, K a multiple of 8.

x `[M, K]` (contiguous last dimension) -> `[M, N]` in x's dtype, float32 accumulation. `impl` is
"triton" or "ref" (already resolved by `declab_kernels.resolve_impl`).

- `int8_linear(x, qweight, scale, *, impl)`, `int4_linear(x, qweight, scales, zeros, group_size, *, impl)`:
  up to MAX_ROWS rows (int8) or INT4_GEMV_ROWS (int4) the Triton GEMV that dequantises in registers;
  more rows (prefill, large batches) dequantise the whole weight to x's dtype with one Triton kernel and run `F.linear`
  (cuBLAS), because there the product is compute-bound and the dense pass (2 bytes an element
  written and read again) costs less than a tensor-core GEMM loses by being written by hand.
  impl="ref" is the float32 reference at any M.
- `dequantize_int8(qweight, scale, dtype, *, impl)`, `dequantize_int4(qweight, scales, zeros, group_size, dtype, *, impl)`
  -> dense `[N, K]` in dtype.
- `pack_int4(codes [N, K]) -> [N, K // 8]` int32 and its inverse `unpack_int4`; `SHIFTS`, the eight nibbles' bit offsets.
"""

import torch.nn.functional as F

from declab_kernels import check_impl
from declab_kernels.quant_gemv.ref import (
    INT4_LAYOUT, SHIFTS, dequantize_int4_ref, dequantize_int8_ref, int4_linear_ref, int8_linear_ref, pack_int4, unpack_int4,
)

MAX_ROWS = 16
# The int4 GEMV's row limit: it keeps every x row's per-thread sums, and each row's update costs a
# select over all of them (M^2 work), past 4 rows more than the dense path's extra pass.
INT4_GEMV_ROWS = 4

__all__ = ["int8_linear", "int4_linear", "dequantize_int8", "dequantize_int4", "pack_int4", "unpack_int4",
           "int8_linear_ref", "int4_linear_ref", "MAX_ROWS", "INT4_GEMV_ROWS", "INT4_LAYOUT", "SHIFTS"]


def int8_linear(x, qweight, scale, *, impl):
    """x `[M, K]` @ (qweight * scale[:, None])^T -> `[M, N]` in x's dtype."""
    check_impl(impl)
    if impl == "ref":
        return int8_linear_ref(x, qweight, scale)
    from declab_kernels.quant_gemv import triton as T

    if x.shape[0] <= MAX_ROWS:
        return T.int8_gemv_triton(x, qweight, scale)
    return F.linear(x, T.dequantize_int8_triton(qweight, scale, x.dtype))


def int4_linear(x, qweight, scales, zeros, group_size, *, impl):
    """x `[M, K]` @ ((codes - zeros) * scales)^T -> `[M, N]` in x's dtype (groups of `group_size` inputs)."""
    check_impl(impl)
    if impl == "ref":
        return int4_linear_ref(x, qweight, scales, zeros, group_size)
    from declab_kernels.quant_gemv import triton as T

    if x.shape[0] <= INT4_GEMV_ROWS:
        return T.int4_gemv_triton(x, qweight, scales, zeros, group_size)
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
