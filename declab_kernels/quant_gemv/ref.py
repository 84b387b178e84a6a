"""Weight-only quantised products y = x @ dequant(W)^T: the PyTorch reference, in float32, with the
packing helpers that define the lab's int4 layout.

int8: qweight `[N, K]` int8, scale `[N]`; W[n, k] = qweight[n, k] * scale[n] (symmetric).
int4: qweight `[N, S]` int32 with S = K // 8, scales and zeros `[N, K // g]` (float, uint8). The row is
packed in eight slices of S inputs: nibble i (bits 4 i .. 4 i + 3) of word qweight[n, j] is the code of
input k = i S + j, so the words of a row hold slice 0 in their low nibbles, slice 7 in their high ones
(layout version `INT4_LAYOUT`). W[n, k] = (code - zeros[n, k // g]) * scales[n, k // g] (asymmetric,
codes and zeros in 0..15).
"""

import torch

# The version of the int4 packing above; 1 was nibble k % 8 of word k // 8 (consecutive inputs in a word).
INT4_LAYOUT = 2
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8] bit offset of nibble i


def pack_int4(codes):
    """codes `[N, K]` integers in 0..15 (K a multiple of 8) -> `[N, K // 8]` int32, nibble i of word j
    holding code i K / 8 + j."""
    N, K = codes.shape
    if K % 8:
        raise ValueError(f"pack_int4: K = {K} is not a multiple of 8")
    c = codes.to(torch.int64).view(N, 8, K // 8)  # [N, slice i, word j]
    words = (c << SHIFTS.to(torch.int64).to(codes.device)[None, :, None]).sum(1)
    # why: nibble 7 reaches bit 31; wrap the 32-bit pattern into int32's range explicitly
    words = words - ((words >> 31) & 1) * (1 << 32)
    return words.to(torch.int32)


def unpack_int4(qweight):
    """`[N, K // 8]` int32 -> codes `[N, K]` int32 in 0..15 (the inverse of `pack_int4`)."""
    N, S = qweight.shape
    codes = (qweight.unsqueeze(1) >> SHIFTS.to(qweight.device)[None, :, None]) & 0xF  # [N, 8, S]
    return codes.reshape(N, 8 * S)


def dequantize_int8_ref(qweight, scale):
    """`[N, K]` float32: qweight[n, k] * scale[n]."""
    return qweight.float() * scale.float().unsqueeze(1)


def dequantize_int4_ref(qweight, scales, zeros, group_size):
    """`[N, K]` float32: (code - zero) * scale, each group of `group_size` inputs of a row sharing one."""
    codes = unpack_int4(qweight).float()
    s = scales.float().repeat_interleave(group_size, dim=1)
    z = zeros.float().repeat_interleave(group_size, dim=1)
    return (codes - z) * s


def int8_linear_ref(x, qweight, scale):
    """x `[M, K]` -> `[M, N]` in x's dtype: x @ dequant(W)^T in float32, rounded once."""
    return (x.float() @ dequantize_int8_ref(qweight, scale).T).to(x.dtype)


def int4_linear_ref(x, qweight, scales, zeros, group_size):
    """x `[M, K]` -> `[M, N]` in x's dtype: x @ dequant(W)^T in float32, rounded once."""
    return (x.float() @ dequantize_int4_ref(qweight, scales, zeros, group_size).T).to(x.dtype)
