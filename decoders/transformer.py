"""The transformer family: a Llama-style model (`declab_arch.llama`) decoding over a paged KV cache.

Prefill packs the prompts' tokens (several sequences, variable lengths) and runs them in chunks of
`prefill_chunk` tokens per sequence, each chunk writing its K/V into the pages and attending over the
prefix already there, so a 128k prompt never needs more than one chunk's attention scores. Before
decoding, every sequence reserves the blocks for its prompt plus `max_new_tokens`, so a decode step
computes its slots on the device from the block table and never returns to the host.

`kv_dtype="fp8"` stores the pages in e4m3 with one exponent per row (`decoders.kv_cache`): about
half the bytes per position, counted as such by `memory`.

`step="persistent"` decodes with the persistent step (`declab_kernels.persistent_step`): the whole
forward of a step as one Triton kernel, batch 1, beside the default `"graphed"` step (a kernel per
operation, replayed as a CUDA graph). It takes the same paged cache and decode workspace; a batch,
kernel implementation, KV cache dtype or model it does not cover is refused at load or prefill.
"""

from dataclasses import dataclass

import torch

from declab_arch import llama
from decoders.base import STEPS, AutoregressiveDecoder, Memory, UsageError
from decoders.kv_cache import PagedKVCache, kv_token_bytes, resolve_kv_dtype
from declab_kernels import paged_attention, persistent_step, tuning


@dataclass
class TransformerCache:
    kv: PagedKVCache
    seqs: list[int]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    workspace: dict | None  # decode partials, allocated once per state
    persistent: persistent_step.PersistentStep | None = None  # the step over this cache (`step="persistent"`)


class TransformerDecoder(AutoregressiveDecoder):
    family = "transformer"
    arch = llama
    presets = "llama"
    state_kind = "kv"

    def __init__(self, model, config, *, page_size: int = 16, num_blocks: int | None = None, kv_memory_bytes: int | None = None, prefill_chunk: int | None = None,
                 kv_dtype=None, step: str = "graphed", **kwargs):
        super().__init__(model, config, max_context=config.max_position_embeddings, **kwargs)
        # None: the cache stores the model's dtype (see `kv_dtype`).
        self._kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype, self.device, self.impl)
        if step not in STEPS:
            raise UsageError(f"unknown step {step!r} (known: {', '.join(STEPS)})")
        self.step_kind = step
        if step == "persistent":
            check_persistent(self)
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.pool = None
        if num_blocks is not None or kv_memory_bytes is not None:
            self.pool = self._new_kv(num_blocks=num_blocks, memory_bytes=kv_memory_bytes)

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: float8_e4m3fn for kv_dtype="fp8", else the model's dtype (or the one asked for)."""
        return self._kv_dtype or self.dtype

    def describe(self) -> dict:
        return {**super().describe(), "kv_dtype": str(self.kv_dtype).removeprefix("torch.")}

    def _new_kv(self, **size) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size=self.page_size, dtype=self.kv_dtype, device=self.device, **size)

    def new_cache(self, prompt_lens: list[int], max_len: int) -> TransformerCache:
        if self.step_kind == "persistent" and self.impl == "triton" and len(prompt_lens) != 1:
            raise UsageError(f"step='persistent' decodes one sequence at a time, got a batch of {len(prompt_lens)}")
        kv = self.pool
        if kv is None:
            kv = self._new_kv(num_blocks=len(prompt_lens) * -(-max_len // self.page_size))
        seqs = [kv.add_sequence() for _ in prompt_lens]
        for s in seqs:
            kv.reserve(s, max_len)
        workspace = None
        if self.impl == "triton":
            workspace = paged_attention.decode_workspace(
                len(seqs), self.config.num_attention_heads, self.config.num_key_value_heads, self.config.head_dim, max_len, self.device,
                variant=tuning.attention_variant(len(seqs)),
            )
        cache = TransformerCache(kv, seqs, kv.block_table(seqs), workspace)
        # A copy of this decoder on the reference path (the correctness gate's) runs the graphed step.
        if self.step_kind == "persistent" and self.impl == "triton":
            cache.persistent = self.persistent_step(cache)
        return cache

    def persistent_step(self, cache: TransformerCache, **debug) -> persistent_step.PersistentStep:
        """A persistent step over `cache` (`Llama.persistent_step`; `debug`: its programs, delay_ns, timeline)."""
        return self.model.persistent_step(self.decode_batch(cache, None), **debug)

    def release(self, state) -> None:
        for s in state.cache.seqs:
            state.cache.kv.free(s)

    def chunk_tokens(self, max_len: int) -> int:
        """Prefill tokens per sequence per forward; the reference attention holds [Hq, chunk, ctx] floats."""
        if self.prefill_chunk:
            return self.prefill_chunk
        if self.impl == "ref":
            budget = (8 << 30) if self.device.type == "cuda" else (1 << 30)
            return max(64, min(8192, budget // (4 * self.config.num_attention_heads * max_len)))
        return 8192

    def prefill_forward(self, cache: TransformerCache, prompts: list[list[int]]) -> torch.Tensor:
        chunk = self.chunk_tokens(max(map(len, prompts)))
        done = [0] * len(prompts)
        last_logits = [None] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            rows = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            tokens, positions, slots, q_lens, finishing = [], [], [], [], []
            for i in rows:
                n = min(chunk, len(prompts[i]) - done[i])
                tokens += prompts[i][done[i] : done[i] + n]
                positions += range(done[i], done[i] + n)
                slots.append(cache.kv.append(cache.seqs[i], n))
                q_lens.append(n)
                done[i] += n
                finishing.append(done[i] == len(prompts[i]))
            dev = self.device
            cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch = llama.PagedBatch(
                k_cache=cache.kv.k,
                v_cache=cache.kv.v,
                k_scale=cache.kv.k_scale,
                v_scale=cache.kv.v_scale,
                block_tables=cache.block_tables[rows],
                seq_lens=torch.tensor([done[i] for i in rows], dtype=torch.int32, device=dev),
                slot_mapping=torch.cat(slots).to(dev),
                decode=False,
                cu_seqlens_q=cu.to(dev),
                max_seqlen_q=max(q_lens),
                impl=self.impl,
            )
            ends = [int(cu[j + 1]) - 1 for j, f in enumerate(finishing) if f]
            logits = self.model.forward_paged(
                torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), batch, torch.tensor(ends, dtype=torch.long, device=dev)
            )
            for row, logit in zip([i for i, f in zip(rows, finishing) if f], logits):
                last_logits[row] = logit
        return torch.stack(last_logits)

    def decode_batch(self, cache: TransformerCache, positions: torch.Tensor | None) -> llama.PagedBatch:
        """The PagedBatch of a decode step at `positions` (None: no seq_lens, for the persistent step, which
        reads the positions itself)."""
        seq_lens = None
        if positions is not None:
            # One kernel (the add writes int32) where `(positions + 1).to(torch.int32)` launched two.
            seq_lens = torch.add(positions, 1, out=torch.empty_like(positions, dtype=torch.int32))
        # The decode attention finds the new row's page itself (slot_mapping None).
        return llama.PagedBatch(
            k_cache=cache.kv.k,
            v_cache=cache.kv.v,
            k_scale=cache.kv.k_scale,
            v_scale=cache.kv.v_scale,
            block_tables=cache.block_tables,
            seq_lens=seq_lens,
            slot_mapping=None,
            decode=True,
            impl=self.impl,
            workspace=cache.workspace,
        )

    def decode_forward(self, cache: TransformerCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if cache.persistent is not None and self.impl == "triton":
            return cache.persistent(tokens, positions)
        return self.model.forward_paged(tokens, positions, self.decode_batch(cache, positions))

    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        c = self.config
        kv_per_token = kv_token_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype)
        weights = self.weight_bytes()
        # A step reads one embedding row, not the table; a tied table is still read whole as the head.
        embed = self.model.model.embed_tokens.weight
        weights_read = weights - (0 if c.tie_word_embeddings else embed.numel() * embed.element_size())
        blocks = -(-ctx // self.page_size)
        return Memory(
            weight_bytes=weights,
            state_bytes=batch * blocks * self.page_size * kv_per_token,
            step_read_bytes=weights_read + batch * ctx * kv_per_token,
            step_write_bytes=batch * kv_per_token,
        )


def check_persistent(dec: TransformerDecoder) -> None:
    """Raise UsageError where `step="persistent"` does not run: it is one Triton kernel over a cache in
    the model's dtype, dense weights, no q/k/v biases, one process."""
    why = None
    if dec.impl != "triton":
        why = f"it is a Triton kernel, and impl is {dec.impl!r}"
    elif dec._kv_dtype is not None and dec._kv_dtype != dec.dtype:
        why = f"its cache is the model's dtype, and kv_dtype is {str(dec._kv_dtype).removeprefix('torch.')}"
    elif dec.quant is not None:
        why = f"its weights are dense, and these are {dec.quant.name}"
    elif dec.config.attention_bias:
        why = "it has no q/k/v biases, and this model has them"
    if why:
        raise UsageError(f"step='persistent' does not run here: {why}")
