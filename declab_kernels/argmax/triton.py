"""Greedy decoding's argmax in two launches: block maxima, then the row's first maximum.

- `_block_max_kernel`, grid (G, B), G = cdiv(V, BLOCK): each program reduces one BLOCK-wide slice
  of a row to its largest key and the first column reaching it, into partials `[B, G]`.
- `_row_argmax_kernel`, grid (B,): the largest key among a row's G partials and the smallest column
  among the partials holding it, stored as int64; with `advance=` (constexpr ADVANCE) the program also
  adds 1 to its row of that int64 counter (a decoder's positions), which saves a launch per step.

Values are compared as int32 keys that order like the floats (`_key`), so that every NaN gets the
largest key (above +inf's) and -0.0 equals +0.0: the result is torch's `argmax` for any input, NaN included.

Both kernels MUST be launched without programmatic dependent launch (no `launch_pdl`, no gdc
calls). A decoder relies on its sampling kernels starting only after every earlier kernel of the
step has finished, which is what a launch without PDL guarantees: the recurrent decode steps load
their state before `gdc_wait()` when the caller promises `state_ready` (see `declab_kernels.pdl`), and the
promise holds because the step ends with kernels like these.

Nothing is synchronised with the host; the partials come from torch.empty (the caching allocator
serves it inside CUDA graph capture).
"""

import torch
import triton
import triton.language as tl

# Columns per stage-1 program: 2 x 16-byte loads per thread in bf16 at 4 warps, and ~25-125 programs
# per row for vocabularies of 50k-256k, enough to spread one row's reads over the SMs at batch 1.
BLOCK = 2048

# The key of every NaN (above +inf's 0x7F800000) and a key below every real one (-inf's is -0x7F800000).
_NAN_KEY = tl.constexpr(0x7FFFFFFF)
_PAD_KEY = tl.constexpr(-0x7FFFFFFF)
# Larger than any column (V < 2^31).
_NO_COL = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _key(v):
    """int32 keys ordered like the float32 values v, with -0.0 == +0.0 and every NaN equal and on top."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # float32 is sign and magnitude: a negative value's key is minus its magnitude bits (so -0 -> 0)
    key = tl.where(bits < 0, -mag, bits)
    # integer test for NaN (exponent all ones, mantissa non-zero): no float compare for a compiler to fold
    return tl.where(mag > 0x7F800000, _NAN_KEY, key)


@triton.jit
def _block_max_kernel(x_ptr, key_ptr, idx_ptr, s_x, V, G, BLOCK: tl.constexpr):
    i_g = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    cols = i_g * BLOCK + tl.arange(0, BLOCK)
    # the masked tail is -inf: it can tie with a real -inf only at a larger column, which loses the tie
    v = tl.load(x_ptr + i_b * s_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, j = tl.max(_key(v), axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(key_ptr + i_b * G + i_g, best)
    tl.store(idx_ptr + i_b * G + i_g, i_g * BLOCK + j)


@triton.jit
def _row_argmax_kernel(key_ptr, idx_ptr, out_ptr, adv_ptr, G, GP: tl.constexpr, ADVANCE: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    m = g < G
    keys = tl.load(key_ptr + i_b * G + g, mask=m, other=_PAD_KEY)
    cols = tl.load(idx_ptr + i_b * G + g, mask=m, other=0)
    best = tl.max(keys, axis=0)
    # several blocks may reach the maximum: the smallest of their first columns is the row's first
    first = tl.min(tl.where(keys == best, cols, _NO_COL), axis=0)
    tl.store(out_ptr + i_b, first.to(tl.int64))
    if ADVANCE:
        tl.store(adv_ptr + i_b, tl.load(adv_ptr + i_b) + 1)


def argmax_triton(x, *, out=None, advance=None):
    """See `argmax_ref`: x `[B, V]` with unit last stride (any row stride), B <= 65535. Returns int64
    `[B]` (written into `out` when given); `advance`, a contiguous int64 `[B]`, gets 1 added to each row."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: x must be [B, V] with V > 0 and unit last stride, got {tuple(x.shape)} {x.stride()}")
    B, V = x.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=x.device)
    elif out.shape != (B,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"argmax: out must be contiguous int64 [{B}], got {out.dtype} {tuple(out.shape)}")
    if advance is not None and (advance.shape != (B,) or advance.dtype != torch.int64 or not advance.is_contiguous()):
        raise ValueError(f"argmax: advance must be contiguous int64 [{B}], got {advance.dtype} {tuple(advance.shape)}")
    G = triton.cdiv(V, BLOCK)
    keys = torch.empty(B, G, dtype=torch.int32, device=x.device)
    cols = torch.empty(B, G, dtype=torch.int32, device=x.device)
    # Launched without launch_pdl on purpose: see the module docstring.
    _block_max_kernel[(G, B)](x, keys, cols, x.stride(0), V, G, BLOCK=BLOCK, num_warps=4)
    _row_argmax_kernel[(B,)](keys, cols, out, advance if advance is not None else out, G, GP=triton.next_power_of_2(G),
                             ADVANCE=advance is not None, num_warps=1)
    return out
