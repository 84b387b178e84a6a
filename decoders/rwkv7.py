"""The RWKV-7 family: an RWKV-7 "Goose" model (`declab_arch.rwkv7`) decoding with a constant-size state.

A sequence's whole past is its state: per layer, the last normalised input of time mixing and of
channel mixing (token shift, `[C]` each) and the WKV matrix `[H, K, V]` in float32. The cache holds
them for the batch, preallocated once: `shift [L, 2, B, C]`, `wkv [L, B, H, K, V]`.

Prefill runs the prompts in chunks of `prefill_chunk` tokens per sequence (right-padded where the
prompts differ in length; padded positions leave the state untouched), carrying the state from
chunk to chunk, so a 128k prompt never materialises more than one chunk's activations and never a
per-token copy of the state. It continues from whatever state the cache holds, so a saved state
can be resumed. A decode step updates the cache in place (the token shift written by the fused
norm kernels, the WKV-7 step kernel; on impl="triton" 12 launches per layer, see
`declab_kernels/rwkv7_fused`): no allocation beyond temporaries, no host synchronisation, capturable in a
CUDA graph. The first step packs each layer's projection weights (the parameters become views of
the packed matrices), so it runs before capture, as the first step always does.

`step="persistent"` decodes with the persistent step (`declab_kernels.persistent_step`): the whole
forward of a step as one Triton kernel over the same state buffers, batch 1, beside the default
`"graphed"` step. A batch, kernel implementation or model it does not cover is refused at load or
prefill (`check_persistent`).
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from declab_arch import rwkv7
from declab_arch.checkpoint import load_tokenizer
from declab_kernels import persistent_step
from declab_kernels.host_copy import on_device
from declab_kernels.persistent_step.schedule import TILE_ROWS
from decoders.base import STEPS, Memory, RecurrentDecoder, UsageError

log = logging.getLogger("declab.decoders.rwkv7")


@dataclass
class RWKV7Cache:
    shift: torch.Tensor  # [L, 2, B, C] model dtype: last input of time mixing (0) and channel mixing (1)
    wkv: torch.Tensor  # [L, B, H, K, V] float32
    persistent: persistent_step.RWKV7PersistentStep | None = None  # the step over these states (`step="persistent"`)

    def clone(self) -> "RWKV7Cache":
        """A copy of the states (a persistent step is bound to the buffers it was built on: the copy has none)."""
        return RWKV7Cache(self.shift.clone(), self.wkv.clone())


class RWKV7Decoder(RecurrentDecoder):
    family = "rwkv7"
    arch = rwkv7
    presets = "rwkv7"
    state_kind = "recurrent"
    state_fields = {"shift": 2, "wkv": 1}
    # The LoRA up-projections are packed by columns (`Packed.up`), which weight objects of different
    # groups cannot share: quantised, they keep dense weights of their dequantised values.
    quant_dense = ("lora.2.weight",)

    def __init__(self, model, config, *, prefill_chunk: int = 8192, step: str = "graphed", **kwargs):
        if step not in STEPS:
            raise UsageError(f"unknown step {step!r} (known: {', '.join(STEPS)})")
        # RWKV has no position limit: the state is the same size at any context.
        super().__init__(model, config, max_context=None, **kwargs)
        if prefill_chunk < 1:
            raise UsageError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.step_kind = step
        if step == "persistent":
            check_persistent(self)

    @classmethod
    def load_tokenizer(cls, folder: Path):
        try:
            return load_tokenizer(folder)
        except (ValueError, OSError) as e:
            # fla-hub folders ship the RWKV world tokenizer as remote code, which the lab never runs:
            # the model still decodes token ids.
            log.warning("%s: tokenizer not loaded (%s); pass token ids", folder, str(e).splitlines()[0])
            return None

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, device=self.device)
        self.check_context(tokens.shape[-1])
        return self.model(tokens, impl=self.impl)

    def new_cache(self, prompt_lens: list[int], max_len: int) -> RWKV7Cache:
        # A copy of this decoder on the reference path (the correctness gate's) runs the graphed step.
        persistent = self.step_kind == "persistent" and self.impl == "triton"
        if persistent and len(prompt_lens) != 1:
            raise UsageError(f"step='persistent' decodes one sequence at a time, got a batch of {len(prompt_lens)}")
        shift, wkv = self.model.new_state(len(prompt_lens), device=self.device, dtype=self.dtype)
        cache = RWKV7Cache(shift, wkv)
        if persistent:
            cache.persistent = self.persistent_step(cache)
        return cache

    def persistent_step(self, cache: RWKV7Cache, **debug) -> persistent_step.RWKV7PersistentStep:
        """A persistent step over `cache`'s states (`RWKV7.persistent_step`; `debug`: its programs, tiles,
        delay_ns, timeline)."""
        return self.model.persistent_step(cache.shift, cache.wkv, **debug)

    def prefill_forward(self, cache: RWKV7Cache, prompts: list[list[int]]) -> torch.Tensor:
        """Consume the prompts into the cache from the state it holds; logits [B, V] of each last token."""
        chunk = self.prefill_chunk
        last_logits = [None] * len(prompts)
        for t0 in range(0, max(map(len, prompts)), chunk):
            rows = [i for i, p in enumerate(prompts) if len(p) > t0]
            pieces = [prompts[i][t0 : t0 + chunk] for i in rows]
            lengths = [len(p) for p in pieces]
            width = max(lengths)
            tokens = torch.tensor([p + [0] * (width - len(p)) for p in pieces], device=self.device)
            if len(rows) == len(prompts):
                logits = self.model.forward_chunk(tokens, lengths, cache.shift, cache.wkv, impl=self.impl)
            else:
                # Sequences already consumed sit out; their state rows are gathered and put back.
                index = torch.tensor(rows, device=self.device)
                shift, wkv = cache.shift.index_select(2, index), cache.wkv.index_select(1, index)
                logits = self.model.forward_chunk(tokens, lengths, shift, wkv, impl=self.impl)
                cache.shift.index_copy_(2, index, shift)
                cache.wkv.index_copy_(1, index, wkv)
            for j, i in enumerate(rows):
                if t0 + lengths[j] == len(prompts[i]):
                    last_logits[i] = logits[j]
        return torch.stack(last_logits)

    def decode_forward(self, cache: RWKV7Cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if cache.persistent is not None and self.impl == "triton":
            return cache.persistent(tokens, positions)
        return self.model.forward_step(tokens, cache.shift, cache.wkv, impl=self.impl)

    def chunk_forward(self, cache: RWKV7Cache, tokens: torch.Tensor, positions: list[int], lengths: list[int], *,
                      rows: list[int] | None = None, logits: str = "last") -> torch.Tensor | None:
        # The state does not depend on positions: a chunk continues from whatever the rows hold.
        width = max(lengths)
        if rows is None:
            out = self.model.forward_chunk(tokens[:, :width], lengths, cache.shift, cache.wkv, impl=self.impl,
                                           all_positions=logits == "all")
        else:
            # Through pinned memory (`on_device`): the engine calls this between decode steps, and a
            # pageable copy would wait for the GPU.
            index = on_device(rows, self.device)
            shift, wkv = cache.shift.index_select(2, index), cache.wkv.index_select(1, index)
            out = self.model.forward_chunk(tokens[:, :width], lengths, shift, wkv, impl=self.impl, all_positions=logits == "all")
            cache.shift.index_copy_(2, index, shift)
            cache.wkv.index_copy_(1, index, wkv)
        return None if logits == "none" else out

    def state_bytes_per_sequence(self) -> int:
        c = self.config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        shift = 2 * c.hidden_size * elt
        wkv = c.num_heads * c.head_dim * c.head_dim * 4
        return c.num_hidden_layers * (shift + wkv)

    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        weights = self.weight_bytes()
        # A step reads one embedding row, not the table; a tied table is still read whole as the head.
        embed = self.model.model.embeddings.weight
        weights_read = weights - (0 if self.config.tie_word_embeddings else embed.numel() * embed.element_size())
        state = batch * self.state_bytes_per_sequence()
        return Memory(weight_bytes=weights, state_bytes=state, step_read_bytes=weights_read + state, step_write_bytes=state)


def check_persistent(dec: RWKV7Decoder) -> None:
    """Raise UsageError where `step="persistent"` does not run: it is one Triton kernel over dense weights on
    one process, its row-select tiles need C and every LoRA rank a multiple of the smallest tile, and C a multiple of 8."""
    c = dec.config
    why = None
    if dec.impl != "triton":
        why = f"it is a Triton kernel, and impl is {dec.impl!r}"
    elif dec.quant is not None:
        why = f"its weights are dense, and these are {dec.quant.name}"
    elif dec.model.tp is not None:
        why = "it runs on one process, and this model is split by tensor parallelism"
    elif any(n % TILE_ROWS[0] for n in (c.hidden_size, c.v_low_rank_dim, c.decay_low_rank_dim, c.a_low_rank_dim, c.gate_low_rank_dim)):
        why = f"hidden size and LoRA ranks must be multiples of {TILE_ROWS[0]}"
    elif c.hidden_size % 8:
        why = "its GEMV tile loads 16-byte rows of the mixed inputs: the hidden size must be a multiple of 8"
    if why:
        raise UsageError(f"step='persistent' does not run here: {why}")
