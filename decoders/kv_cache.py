"""Paged KV cache: a block pool with reference counts, and the facade the decoders talk to.

Split as in vLLM v1:

- `BlockPool` is host-side bookkeeping: a free queue of block ids and a reference count per
  block. Blocks are shared between sequences that forked from a common prefix.
- `PagedKVCache` owns the device tensors `k`, `v` `[L, num_blocks, block_size, Hkv, D]` and a
  block list per sequence. Sequences grow (`append`), reserve room ahead (`reserve`, so that decode
  steps never touch the host), fork (the new sequence shares every block; a shared, partly filled
  last block is copied before either side writes into it: copy-on-write at block granularity) and
  free their blocks. Block tables and slot mappings come out as device tensors.

Running out of blocks raises `KVCacheExhausted` with the numbers, never a silent overwrite.

fp8 pages (`dtype=torch.float8_e4m3fn`, the decoders' `kv_dtype="fp8"`): K and V hold one byte a
value, and `k_scale`, `v_scale` `[L, num_blocks, block_size, Hkv]` int8 the power-of-two exponent of
each row of D values (`declab_kernels.paged_attention.ref.quantize`), so a block takes
(D + 1) / (2 D) of its bf16 bytes. Scale granularity, per (token, kv head) row: a static scale per
(layer, kv head) calibrated at one prefill would clip the rows of later requests sharing the pool
(the engine's), and a dynamic scale per (page, head) would have to requantize a page's earlier rows
whenever a decode step appends a larger one; a row's own exponent is fixed when it is written, needs
no calibration, and moves with its row (copy-on-write, truncation). A power of two keeps the kernels'
dequantization exact and costs one byte per row.
"""

from collections import deque

import torch

from decoders.base import UsageError

FP8 = torch.float8_e4m3fn
# What the decoders' kv_dtype option takes: "fp8" or a float dtype name.
KV_DTYPES = {"fp8": FP8, "float8_e4m3fn": FP8, "float32": torch.float32, "fp32": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_kv_dtype(kv_dtype) -> torch.dtype | None:
    """A KV cache dtype by name ("fp8", "bf16", ...) or torch dtype; None stays None (the model's dtype)."""
    if kv_dtype is None or kv_dtype in KV_DTYPES.values():
        return kv_dtype
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise UsageError(f"unknown kv_dtype {kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    return KV_DTYPES[kv_dtype]


def resolve_kv_dtype(kv_dtype, model_dtype: torch.dtype, device: torch.device, impl: str) -> torch.dtype | None:
    """The dtype a decoder's KV cache stores, None when it is the model's own; refuses (UsageError) fp8
    through the Triton kernels on a GPU without e4m3 conversions (compute capability below 8.9)."""
    dtype = parse_kv_dtype(kv_dtype)
    if dtype == model_dtype:
        return None
    if dtype == FP8 and impl == "triton" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UsageError(f"kv_dtype fp8 needs a GPU of compute capability 8.9 or later for the Triton kernels, "
                         f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}")
    return dtype


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one position takes in the cache over all layers: K and V rows, plus an fp8 row's exponent."""
    row = head_dim * torch.tensor([], dtype=dtype).element_size() + (1 if dtype == FP8 else 0)
    return 2 * num_layers * num_kv_heads * row


class KVCacheExhausted(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_queue = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise KVCacheExhausted(
                f"KV cache exhausted: need {n} more blocks, {len(self.free_queue)} of {self.num_blocks} free"
            )
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"sharing free block {block}"
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"releasing free block {block}"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue.append(block)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        dtype=torch.float32,
        device="cpu",
    ):
        if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
            raise ValueError(f"page size must be a power of two from 16 to 256, got {block_size}")
        self.block_size = block_size
        self.bytes_per_block = block_size * kv_token_bytes(num_layers, num_kv_heads, head_dim, dtype)
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("size the KV cache with exactly one of num_blocks or memory_bytes")
        if num_blocks is None:
            num_blocks = memory_bytes // self.bytes_per_block
        self.pool = BlockPool(num_blocks)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # [L, num_blocks, block_size, Hkv] int8 exponents of the fp8 rows (None for other dtypes)
        self.k_scale = self.v_scale = None
        if dtype == FP8:
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.int8, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.int8, device=device)
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0

    def blocks_needed(self, length: int) -> int:
        return -(-length // self.block_size)

    def add_sequence(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self.blocks[seq], self.lengths[seq] = [], 0
        return seq

    def reserve(self, seq: int, length: int) -> None:
        """Make sure `seq` owns blocks for `length` positions, allocating (not writing) the rest."""
        missing = self.blocks_needed(length) - len(self.blocks[seq])
        if missing > 0:
            self.blocks[seq] += self.pool.allocate(missing)

    def append(self, seq: int, n: int) -> torch.Tensor:
        """Claim the next `n` positions of `seq`; returns their slots [n] (int64, on the CPU).

        A shared block that would be written into is first copied to a private one.
        """
        start = self.lengths[seq]
        self.reserve(seq, start + n)
        if n > 0:
            self._own_block(seq, start // self.block_size)
        self.lengths[seq] = start + n
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.blocks[seq], dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _own_block(self, seq: int, index: int) -> None:
        block = self.blocks[seq][index]
        if self.pool.ref_counts[block] > 1:
            (copy,) = self.pool.allocate(1)
            self.k[:, copy] = self.k[:, block]
            self.v[:, copy] = self.v[:, block]
            if self.k_scale is not None:
                self.k_scale[:, copy] = self.k_scale[:, block]
                self.v_scale[:, copy] = self.v_scale[:, block]
            self.pool.release(block)
            self.blocks[seq][index] = copy

    def fork(self, seq: int) -> int:
        """A new sequence sharing all of `seq`'s blocks (its prefix) without copying them."""
        child = self.add_sequence()
        filled = self.blocks_needed(self.lengths[seq])
        shared = self.blocks[seq][:filled]
        for b in shared:
            self.pool.share(b)
        self.blocks[child], self.lengths[child] = list(shared), self.lengths[seq]
        return child

    def free(self, seq: int) -> None:
        for b in self.blocks.pop(seq):
            self.pool.release(b)
        del self.lengths[seq]

    def block_table(self, seqs: list[int], width: int | None = None) -> torch.Tensor:
        """[len(seqs), width] int32 on the cache's device; unused entries are 0."""
        width = width or max(len(self.blocks[s]) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(self.blocks[s])] = torch.tensor(self.blocks[s], dtype=torch.int32)
        return table.to(self.k.device)

    def state_bytes(self, lengths: list[int]) -> int:
        """Bytes of K/V that sequences of these lengths hold (whole blocks)."""
        return sum(self.blocks_needed(n) for n in lengths) * self.bytes_per_block

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` positions of `seq` and release every block past them (speculative
        decoding's rollback of rejected tokens)."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot truncate sequence {seq} of {self.lengths[seq]} positions to {length}")
        keep = self.blocks_needed(length)
        for b in self.blocks[seq][keep:]:
            self.pool.release(b)
        del self.blocks[seq][keep:]
        self.lengths[seq] = length
