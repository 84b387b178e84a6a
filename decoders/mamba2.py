"""The Mamba-2 family: `declab_arch.mamba2` decoding over a fixed-size recurrent state.

The cache is two preallocated buffers, the same size at any context:

    conv [L, B, conv_dim, d_conv]  model dtype   each layer's conv inputs, a ring: position p in slot p % d_conv
    ssm  [L, B, H, P, N]           float32       each layer's SSM state

and, on the host, how many tokens each row has consumed through prefill (the ring's position).

A decode step reads and rewrites both in place (one `mamba2_decode_step` per layer), allocating only
temporaries and never reading a value back to the host, so it can be captured in a CUDA graph. On the
Triton path it is 5 launches per layer plus 2 (see `declab_arch.mamba2.Mamba2LM.step`).

`step="persistent"` decodes with the persistent step (`declab_kernels.persistent_step`): the whole
forward of a step as one Triton kernel over the same state buffers, batch 1, beside the default
`"graphed"` step. A batch, kernel implementation or model it does not cover is refused at load or
prefill (`check_persistent`).

Prefill consumes each prompt in chunks of `prefill_chunk` tokens, each chunk starting from the state
the previous one left (conv window and SSM state), so a 128k prompt costs memory linear in the chunk,
not the prompt, and only the last position's logits are computed. A chunk of every row is one pass
(`chunk_forward`, `Mamba2LM.forward_chunk`), the rows right-padded to the longest, each at its own
position: padded positions leave the state as it was (their step size dt is 0), except where the
model has a lower limit on dt (dt_min_limit > 0), whose rows go one pass per chunk length.
`prefill_forward` continues from whatever state the cache holds, so a prompt consumed in two calls
equals one call. A decode step takes each token's position from its caller (the decoder's state
advances them on the device) and writes that token's conv input into slot position % d_conv, which
no program of the step reads (`ssd.mamba2_decode_step`).
"""

from dataclasses import dataclass

import torch

from declab_arch import mamba2
from declab_kernels import persistent_step
from declab_kernels.host_copy import on_device
from decoders.base import STEPS, Memory, RecurrentDecoder, UsageError

# Parameters kept in float32 whatever the model dtype: A = -exp(A_log) and softplus(dt + dt_bias)
# set the decay, whose rounding compounds over thousands of steps; they are 3 * H numbers per layer.
FP32_PARAMS = ("A_log", "D", "dt_bias")


@dataclass
class Mamba2Cache:
    conv: torch.Tensor  # [L, B, conv_dim, d_conv] model dtype, rings (`ssd.conv_window_slots`)
    ssm: torch.Tensor  # [L, B, H, P, N] float32
    # tokens each row has consumed through prefill_forward; decode steps, which take their positions
    # from the caller, leave it as it is (a prefill after decode steps needs it set to the lengths)
    lens: list[int]
    persistent: persistent_step.Mamba2PersistentStep | None = None  # the step over these states (`step="persistent"`)


class Mamba2Decoder(RecurrentDecoder):
    family = "mamba2"
    arch = mamba2
    presets = "mamba2"
    state_kind = "recurrent"
    state_fields = {"conv": 1, "ssm": 1}

    def __init__(self, model, config, *, prefill_chunk: int = 8192, step: str = "graphed", **kwargs):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if step not in STEPS:
            raise UsageError(f"unknown step {step!r} (known: {', '.join(STEPS)})")
        keep = {n: p.detach().float().clone() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in FP32_PARAMS}
        super().__init__(model, config, **kwargs)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in keep:
                    p.data = keep[name].to(self.device)
        self.prefill_chunk = prefill_chunk
        self.step_kind = step
        if step == "persistent":
            check_persistent(self)

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, device=self.device)
        self.check_context(tokens.shape[-1])
        return self.model(tokens, impl=self.impl)

    def new_cache(self, prompt_lens: list[int], max_len: int) -> Mamba2Cache:
        c, B = self.config, len(prompt_lens)
        # A copy of this decoder on the reference path (the correctness gate's) runs the graphed step.
        persistent = self.step_kind == "persistent" and self.impl == "triton"
        if persistent and B != 1:
            raise UsageError(f"step='persistent' decodes one sequence at a time, got a batch of {B}")
        cache = Mamba2Cache(
            conv=torch.zeros(c.n_layer, B, c.conv_dim, c.d_conv, device=self.device, dtype=self.dtype),
            ssm=torch.zeros(c.n_layer, B, c.nheads, c.headdim, c.d_state, device=self.device, dtype=torch.float32),
            lens=[0] * B,
        )
        if persistent:
            cache.persistent = self.persistent_step(cache)
        return cache

    def persistent_step(self, cache: Mamba2Cache, **debug) -> persistent_step.Mamba2PersistentStep:
        """A persistent step over `cache`'s states (`Mamba2LM.persistent_step`; `debug`: its programs,
        tiles, delay_ns, timeline)."""
        return self.model.persistent_step(cache.conv, cache.ssm, **debug)

    def prefill_forward(self, cache: Mamba2Cache, prompts: list[list[int]]) -> torch.Tensor:
        """Consume prompts (row i of the cache continues with prompts[i]); logits [B, V] of each last token."""
        last = [None] * len(prompts)
        for t0 in range(0, max(map(len, prompts)), self.prefill_chunk):
            rows = [i for i, p in enumerate(prompts) if len(p) > t0]
            pieces = [prompts[i][t0 : t0 + self.prefill_chunk] for i in rows]
            width = max(map(len, pieces))
            tokens = on_device([p + [0] * (width - len(p)) for p in pieces], self.device)
            logits = self.chunk_forward(cache, tokens, [cache.lens[i] + t0 for i in rows], [len(p) for p in pieces], rows=rows)
            for i, p, logit in zip(rows, pieces, logits):
                if t0 + len(p) == len(prompts[i]):
                    last[i] = logit
        for i, p in enumerate(prompts):
            cache.lens[i] += len(p)
        return torch.stack(last)

    def decode_forward(self, cache: Mamba2Cache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if cache.persistent is not None and self.impl == "triton":
            return cache.persistent(tokens, positions)
        # Every step ends with sampling kernels launched without PDL, so the states are ready at the next step.
        return self.model.step(tokens, cache.conv, cache.ssm, self.impl, positions=positions, state_ready=True)

    def chunk_forward(self, cache: Mamba2Cache, tokens: torch.Tensor, positions: list[int], lengths: list[int], *,
                      rows: list[int] | None = None, logits: str = "last") -> torch.Tensor | None:
        """One `Mamba2LM.forward_chunk` pass over all rows, whatever their positions and lengths
        (`RecurrentDecoder.chunk_forward`); one pass per length where the model has dt_min_limit > 0."""
        rows = list(range(tokens.shape[0])) if rows is None else list(rows)
        if self.config.dt_min_limit > 0 and len(set(lengths)) > 1:
            # A lower limit on the step size would move the state at a padded position: one pass per length.
            out = [None] * len(rows)
            for n in dict.fromkeys(lengths):
                members = [j for j, m in enumerate(lengths) if m == n]
                part = self.chunk_forward(cache, tokens[:, :n].index_select(0, on_device(members, self.device)),
                                          [positions[j] for j in members], [n] * len(members), rows=[rows[j] for j in members],
                                          logits=logits)
                for j, logit in zip(members, () if part is None else part):
                    out[j] = logit
            return None if logits == "none" else torch.stack(out)
        r = self.model.forward_chunk(tokens[:, :max(lengths)], cache.conv, cache.ssm, rows, self.impl, positions, lengths,
                                     all_positions=logits == "all")
        return None if logits == "none" else self.model.head(r)

    def memory(self, batch: int, ctx: int, *, new_tokens: int = 1) -> Memory:
        c = self.config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        ssm = c.nheads * c.headdim * c.d_state * 4
        state = batch * c.n_layer * (c.conv_dim * c.d_conv * elt + ssm)
        # A step writes its SSM states and one slot of each conv ring.
        written = batch * c.n_layer * (c.conv_dim * elt + ssm)
        weights = self.weight_bytes()
        # A step reads one embedding row, not the table; a tied table is still read whole as the head.
        embed = self.model.backbone.embeddings.weight
        weights_read = weights - (0 if c.tie_embeddings else embed.numel() * embed.element_size())
        return Memory(weight_bytes=weights, state_bytes=state, step_read_bytes=weights_read + state, step_write_bytes=written)


def check_persistent(dec: Mamba2Decoder) -> None:
    """Raise UsageError where `step="persistent"` does not run: it is one Triton kernel over dense weights,
    one norm group and no projection biases."""
    why = None
    if dec.impl != "triton":
        why = f"it is a Triton kernel, and impl is {dec.impl!r}"
    elif dec.quant is not None:
        why = f"its weights are dense, and these are {dec.quant.name}"
    elif dec.config.ngroups != 1:
        why = f"its gated norm is one group, and this model has {dec.config.ngroups}"
    elif dec.config.bias:
        why = "it has no projection biases, and this model has them"
    if why:
        raise UsageError(f"step='persistent' does not run here: {why}")
