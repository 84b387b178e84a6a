"""Mamba-2 language model (Dao & Gu 2024, "Transformers are SSMs"): the block of mamba-ssm's `Mamba2`
and HF's `Mamba2ForCausalLM`, and loaders for both checkpoint layouts plus the lab's own.

One block, on the residual stream r (float32, as mamba-ssm's `residual_in_fp32`):

    h = RMSNorm(r)
    z, xBC, dt = in_proj(h)                      split [d_inner, conv_dim, H]
    xBC = silu(causal depthwise conv(xBC))       width d_conv, window carried across calls
    x, B, C = xBC                                split [d_inner, G*N, G*N]
    y = SSD(x, dt, A = -exp(A_log), B, C) + D x  dt -> softplus(dt + dt_bias), clamped to dt_limit
    y = RMSNormGated(y, z)                       rmsnorm(y * silu(z)) per group of d_inner / G channels
    r = r + out_proj(y)

then logits = lm_head(RMSNorm_f(r)), the head tied to the embedding or not.

Parameter names follow HF (`backbone.embeddings.weight`, `backbone.layers.N.mixer.in_proj.weight`, ...)
so an HF state dict loads unchanged; the state-spaces layout differs only in `backbone.embedding.`.
The model runs three ways, all through `declab_kernels.ssd`:

- `forward(tokens [B, T])`: one parallel forward from zero state, logits [B, T, V] (also the training
  path: with impl="ref" it is autograd through the reference scan, in chunks of at most REF_CHUNK);
- `forward_chunk(tokens [b, T], conv, ssm, rows, starts, lengths)`: right-padded prefill chunks, row j
  at positions starts[j].. for lengths[j] tokens, in one pass that starts from, and writes back, the
  rows `rows` of the batched state buffers; returns each row's last real position's hidden state;
- `step(tokens [B], conv, ssm, positions=)`: one token per sequence, both states updated in place; its norms go
  through `declab_kernels.mamba2_norm` (one launch each on the Triton path: embedding + pre-norm, residual add +
  pre-norm). With one norm group and up to `declab_kernels.tuning.GATE_IN_STEP_ROWS`
  sequences the decode step also applies the gate and gathers the gated norm's statistics (each head's sum
  of squares; it returns the gated output times the norm weight), and out_proj applies the row's 1 / rms
  to its products (`fusions.RMSScale`); otherwise the gated norm goes with out_proj
  (`fusions.GatedRMSNorm`). There the residual add and pre-norm after each block go the same way:
  out_proj's epilogue adds the residual and writes the next norm's statistics (`fusions.ResidualNorm`),
  and the next in-projection (or the head) applies 1 / rms. Every projection goes through
  `declab_kernels.gemv.linear` (the Triton GEMV, fused or not, where it measured faster).
"""

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from declab_arch import tensor_parallel
from declab_arch.checkpoint import CheckpointError, assign_weights, check_fields, config_from_dict, load_weights, parse_config, read_json
from declab_arch.llama import RMSNorm
from declab_kernels import gemv, mamba2_norm, persistent_step, ssd, tuning
from declab_kernels.gemv import fusions
from declab_kernels.host_copy import on_device

# Largest chunk of the reference SSD scan (impl="ref", the training path; the Triton path uses the config's
# chunk_size). Its intermediates cost about H (L + P N / L) floats per token, the [L, L] decays against the
# per-chunk states: least near L = sqrt(P N), 64 for mamba2-30m; the config's 128 costs ~6% more time.
REF_CHUNK = 64


def scan_chunk(chunk_size: int, impl: str) -> int:
    """The chunk the lab's SSD scan runs with for a config's `chunk_size`. A checkpoint's chunk size is a
    choice of its training run, and the scan's result does not depend on it (up to rounding), so the
    Triton scan takes the smallest power of two >= 16 at or above it (a checkpoint's 8 runs as 16), the
    reference at most REF_CHUNK."""
    if impl == "ref":
        return min(chunk_size, REF_CHUNK)
    return max(16, 1 << (chunk_size - 1).bit_length())


@dataclass
class Mamba2Config:
    vocab_size: int  # rows of the embedding table (already padded to the checkpoint's multiple)
    d_model: int
    n_layer: int
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    conv_bias: bool = True
    bias: bool = False  # bias of in_proj and out_proj
    dt_min_limit: float = 0.0
    dt_max_limit: float | None = None  # None: no upper clamp on the step size
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        check_fields(self)
        if self.d_inner % self.headdim:
            raise CheckpointError(f"expand * d_model = {self.d_inner} is not a multiple of headdim {self.headdim}")
        if self.nheads % self.ngroups:
            raise CheckpointError(f"nheads {self.nheads} is not a multiple of ngroups {self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def dt_limit(self) -> tuple[float, float]:
        return (self.dt_min_limit, math.inf if self.dt_max_limit is None else self.dt_max_limit)


class RMSNormGated(nn.Module):
    """rmsnorm(y * silu(z)) over groups of `group_size` channels (mamba-ssm norm_before_gate=False)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y, z):
        # (y promotes to float32 inside the product: no float32 copy of it is made)
        h = F.silu(z.float()) * y
        # h * rsqrt(mean(h^2) + eps) per group, as one fused kernel forward and backward
        h = F.rms_norm(h.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps)
        return self.weight * h.flatten(-2).to(y.dtype)


class Mixer(nn.Module):
    """The Mamba-2 mixer (HF `Mamba2Mixer`, mamba-ssm `Mamba2`)."""

    # Tensor parallel (`declab_arch.tensor_parallel`): set on each rank's share; None on one process.
    tp = None

    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.config = config
        c = config
        self.in_proj = nn.Linear(c.d_model, 2 * c.d_inner + 2 * c.ngroups * c.d_state + c.nheads, bias=c.bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.d_conv, groups=c.conv_dim, bias=c.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(c.nheads))
        self.A_log = nn.Parameter(torch.zeros(c.nheads))
        self.D = nn.Parameter(torch.ones(c.nheads))
        self.norm = RMSNormGated(c.d_inner, c.d_inner // c.ngroups, c.norm_eps)
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.bias)
        self._decay, self._decay_key = None, None

    def split(self, zxbcdt):
        """in_proj output [..., d_in_proj] -> z [..., d_inner], xBC [..., conv_dim], dt [..., H]."""
        c = self.config
        return zxbcdt.split([c.d_inner, c.conv_dim, c.nheads], dim=-1)

    def forward(self, h, impl: str, conv_init=None, ssm_init=None, padded=None):
        """h [b, T, d] -> (out [b, T, d], the conv's inputs xBC [b, T, conv_dim], SSM state [b, H, P, N] fp32).

        conv_init [b, conv_dim, W-1]: the conv's inputs before h. `padded` [b, T, 1] bool: positions
        that leave the SSM state as it was: their raw dt is -inf, so softplus(dt + dt_bias) is exactly
        0 on both impls (decay exp(0 * A) = 1, input 0 * x B = 0), unless a lower limit on the step
        (dt_min_limit > 0) clamps that 0 away (`Mamba2LM.forward_chunk` refuses it there).
        """
        c = self.config
        b, T, _ = h.shape
        z, xBC, dt = self.split(self.in_proj(h))
        if padded is not None:
            dt = dt.masked_fill(padded, -math.inf)
        conv_out, _ = ssd.causal_conv1d(
            xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, initial_state=conv_init, activation="silu", impl=impl
        )
        x, B, C = conv_out.split([c.d_inner, c.ngroups * c.d_state, c.ngroups * c.d_state], dim=-1)
        y, ssm_final = ssd.ssd_chunk_scan(
            x.reshape(b, T, c.nheads, c.headdim),
            dt,
            -torch.exp(self.A_log.float()),
            B.reshape(b, T, c.ngroups, c.d_state),
            C.reshape(b, T, c.ngroups, c.d_state),
            chunk_size=scan_chunk(c.chunk_size, impl),
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=c.dt_limit,
            initial_state=ssm_init,
            impl=impl,
        )
        y = self.norm(y.reshape(b, T, c.d_inner), z)
        return self.out_proj(y), xBC, ssm_final

    def decay_rates(self):
        """A = -exp(A_log) [H] fp32 for decoding, recomputed only when A_log changes, so a decode step
        launches no kernel for it (no autograd: training goes through `forward`)."""
        # Inference tensors keep no version counter: for them only a new tensor (data_ptr) is noticed.
        version = None if self.A_log.is_inference() else self.A_log._version
        key = (self.A_log.data_ptr(), version, self.A_log.device)
        if self._decay_key != key:
            with torch.no_grad():
                self._decay = -torch.exp(self.A_log.float())
            self._decay_key = key
        return self._decay

    def gate_in_step(self, rows: int) -> bool:
        """Whether a decode step of `rows` sequences applies the gate in the SSM step (see `step`): one norm
        group, at most `tuning.GATE_IN_STEP_ROWS` sequences and one process, whatever the impl (the
        reference kernels take the same schedule; tensor parallel reduces the norm through the modules)."""
        return self.tp is None and self.norm.group_size == self.config.d_inner and rows <= tuning.GATE_IN_STEP_ROWS

    def step(self, h, conv_state, ssm_state, impl: str, *, positions, state_ready: bool = False, h_scale=None,
             residual=None, next_norm=None):
        """One token h [B, d] at positions [B] -> out_proj's output [B, d]; conv_state [B, conv_dim, W] (a ring:
        `ssd.conv_window_slots`) and ssm_state [B, H, P, N] updated in place.

        z, xBC and dt stay strided views of the in-projection, read in place by the kernels.
        `state_ready`: see `Mamba2LM.step`. Where `gate_in_step`, the norms around the block may come
        with the projections (`Mamba2LM.step`): `h_scale=(sumsq, eps)`: h is the residual times the
        pre-norm's weight, sumsq the residual's partial sums of squares (the in-projection applies
        1 / rms); `residual` and `next_norm`: the result is (residual + out, h, sumsq) for the next
        norm, from out_proj's epilogue (`fusions.ResidualNorm`).
        """
        c = self.config
        gate_in_step = self.gate_in_step(h.shape[0])
        if (residual is not None or h_scale is not None) and not gate_in_step:
            raise ValueError("Mixer.step: h_scale / residual need the gate in the step (gate_in_step)")
        pre = None if h_scale is None else fusions.RMSScale(*h_scale)
        zxbcdt = gemv.linear(h, self.in_proj.weight, self.in_proj.bias, pre=pre, impl=impl)
        z, xBC, dt = self.split(zxbcdt)
        # One norm group, up to tuning.GATE_IN_STEP_ROWS sequences: the decode step applies the
        # gate, g = y * silu(z) (rounded to the model dtype, the one rounding the module does not do),
        # writes each head's sum of g^2 and returns g * norm_weight; out_proj scales its products by
        # the row's 1 / rms (`fusions.RMSScale`), so the norm launches no kernel of its own.
        # Otherwise the gate goes inside the gated norm, rmsnorm(y * silu(z)), with out_proj
        # (`fusions.GatedRMSNorm`).
        sumsq = torch.empty(h.shape[0], c.nheads, device=h.device, dtype=torch.float32) if gate_in_step else None
        y = ssd.mamba2_decode_step(
            xBC,
            dt,
            conv_state,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            ssm_state,
            self.decay_rates(),
            self.D,
            self.dt_bias,
            positions=positions,
            ngroups=c.ngroups,
            headdim=c.headdim,
            dt_limit=c.dt_limit,
            z=z.unflatten(-1, (c.nheads, c.headdim)) if gate_in_step else None,
            impl=impl,
            state_ready=state_ready,
            norm=(self.norm.weight, sumsq) if gate_in_step else None,
        ).reshape(h.shape[0], c.d_inner)
        if self.tp is not None:
            # Tensor parallel: the modules all-reduce out_proj's partial sums (and a norm group's sum of
            # squares when the group spans ranks), which the fused norm + out_proj GEMV cannot.
            return self.out_proj(self.norm(y, z))
        if gate_in_step:
            pre = fusions.RMSScale(sumsq, self.norm.eps)
        else:
            pre = fusions.GatedRMSNorm(z, self.norm.weight, self.norm.eps, self.norm.group_size)
        post = None if residual is None else fusions.ResidualNorm(residual, next_norm.weight)
        # The SSM step before out_proj leaves HBM idle: more weight tiles before the PDL wait.
        tiles = tuning.EARLY_TILES_BESIDE_LATENCY if gate_in_step and h.shape[0] <= tuning.OUT_PROJ_EARLY_TILES_ROWS \
            else tuning.EARLY_TILES
        return gemv.linear(y, self.out_proj.weight, self.out_proj.bias, pre=pre, post=post, impl=impl, early_tiles=tiles)


class Block(nn.Module):
    """Pre-norm residual block, r + mixer(norm(r)); `Mamba2LM` applies it on each of its three paths."""

    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.norm = RMSNorm(config.d_model, config.norm_eps, weight_dtype_out=True)
        self.mixer = Mixer(config)


class Backbone(nn.Module):
    """Embedding, blocks and final norm (HF's `backbone.` prefix)."""

    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_eps, weight_dtype_out=True)


class Mamba2LM(nn.Module):
    # Tensor parallel (`declab_arch.tensor_parallel`): set on each rank's share; None on one process.
    tp = None

    def __init__(self, config: Mamba2Config):
        super().__init__()
        self.config = config
        self.backbone = Backbone(config)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def head_weight(self):
        """[V, d]: the embedding table when tied, else lm_head's."""
        return self.backbone.embeddings.weight if self.config.tie_embeddings else self.lm_head.weight

    def head(self, r):
        """Residual r [..., d] (fp32) -> logits [..., V] in the model dtype."""
        return F.linear(self.backbone.norm_f(r), self.head_weight())

    def embed(self, tokens):
        # The residual stream stays in float32 whatever the weights' dtype.
        return self.backbone.embeddings(tokens).float()

    def hidden(self, tokens, impl: str = "ref"):
        """Final residual stream [B, T, d] (fp32) before the norm, one parallel forward from zero state."""
        r = self.embed(tokens)
        for block in self.backbone.layers:
            out, _, _ = block.mixer(block.norm(r), impl)
            r = r + out
        return r

    def forward(self, tokens, impl: str = "ref"):
        """Logits [B, T, V] of one parallel forward from zero state."""
        return self.head(self.hidden(tokens, impl))

    def forward_chunk(self, tokens, conv, ssm, rows, impl: str, starts, lengths, *, all_positions: bool = False):
        """Prefill chunks tokens [b, T], right-padded: row j continues the sequence in row rows[j] of the
        state buffers with its first lengths[j] >= 1 tokens, at positions starts[j].. (rows, starts and
        lengths host ints, copied through pinned memory: `declab_kernels.host_copy`).

        conv [L, B, conv_dim, W] (the rings of the decode step: the input at position p in slot p % W,
        `ssd.conv_window_slots`) and ssm [L, B, H, P, N] hold each sequence's state before the chunk and
        receive the state after its last real token: padded positions leave the SSM state as it was
        (`Mixer.forward`'s `padded`, refused where dt_min_limit > 0) and never enter a ring. One pass
        for all rows: each layer makes the same calls whatever the rows' positions and lengths. Returns
        each row's last real position's residual [b, d] (fp32), or every position's [b, T, d] with
        `all_positions` (speculative verification).
        """
        b, T = tokens.shape
        W, C = conv.shape[-1], conv.shape[-2]
        rows, starts, lens = on_device([rows, starts, lengths], conv.device)
        before = ssd.conv_window_slots(starts, W)[:, None, :].expand(b, C, W - 1)
        # After the chunk, slot s of row j's ring holds tap (s - end - 1) % W, oldest first, of the window
        # before end = starts[j] + lengths[j] (tap W - 1: the slot of position end, zeroed). That tap is the
        # chunk's input `token`, or, where token < 0, an input from before the chunk, in slot s already.
        tap = (torch.arange(W, device=conv.device) - (starts + lens)[:, None] - 1) % W  # [b, W]
        token = lens[:, None] - (W - 1) + tap
        kept, nxt = (token < 0)[:, None, :], (tap == W - 1)[:, None, :]
        inputs = token.clamp(0, T - 1)[:, :, None].expand(b, W, C)
        padded = None
        if min(lengths) < T:
            if self.config.dt_min_limit > 0:
                raise ValueError(f"forward_chunk: padded rows need dt_min_limit = 0, not {self.config.dt_min_limit} "
                                 "(a padded position's step would be clamped up to it)")
            padded = (torch.arange(T, device=conv.device) >= lens[:, None])[..., None]
        r = self.embed(tokens)
        for i, block in enumerate(self.backbone.layers):
            ring = conv[i, rows]
            out, xBC, ssm_final = block.mixer(block.norm(r), impl, ring.gather(2, before), ssm[i, rows], padded)
            # The slot of the next position holds an input no window reads again: zero, so the state
            # after a prompt is the same however it was cut into chunks.
            ring = torch.where(kept, ring, xBC.gather(1, inputs).transpose(1, 2).to(conv.dtype)).masked_fill_(nxt, 0)
            conv[i, rows] = ring
            ssm[i, rows] = ssm_final
            r = r + out
        return r if all_positions else r.gather(1, (lens - 1)[:, None, None].expand(b, 1, r.shape[-1])).squeeze(1)

    def step(self, tokens, conv, ssm, impl: str, *, positions, state_ready: bool = False):
        """One token per sequence, tokens [B] at positions [B]; conv and ssm ([L, B, ...]; conv the rings of
        `forward_chunk`) updated in place. Logits [B, V].

        The same blocks as `forward`, with each residual add fused into the norm that follows it (the
        next block's pre-norm, or norm_f): r = embed(tokens); h = norm_0(r); then per layer
        r = r + mixer(h), h = norm_{i+1}(r). Where the mixer gates in its SSM step (up to
        `tuning.GATE_IN_STEP_ROWS` sequences) the norms after the first launch nothing of
        their own: out_proj's epilogue writes r, r * weight and r's partial sums of squares, and the next
        in-projection (or the head) applies 1 / rms (`fusions.ResidualNorm`, `fusions.RMSScale`): 3
        launches a layer.

        `state_ready=True` promises that `conv` and `ssm` were last written before a kernel launched
        without PDL (such as the sampling kernels that end a decoder's step), so each layer's step
        kernel may load its states before waiting on the in-projection (`ssd.mamba2_decode_step`).
        Calling `step` back to back with only PDL-launched kernels in between breaks that promise.
        """
        layers = self.backbone.layers
        norms = [block.norm for block in layers] + [self.backbone.norm_f]
        table = self.backbone.embeddings.weight
        if self.tp is None:
            h, r = mamba2_norm.embed_rmsnorm(tokens, table, norms[0].weight, norms[0].eps, impl=impl)
        else:
            # Tensor parallel: the vocabulary-parallel lookup is all-reduced before the norm.
            r = self.embed(tokens)
            h = norms[0](r)
        if layers[0].mixer.gate_in_step(tokens.shape[0]):
            # Every norm after the first comes with the projections around it: out_proj writes the
            # residual, h = residual * weight and its partial sums of squares; the in-projection
            # (or the head) applies 1 / rms (`Mixer.step`).
            h_scale = None
            for i, block in enumerate(layers):
                r, h, sumsq = block.mixer.step(h, conv[i], ssm[i], impl, positions=positions, state_ready=state_ready,
                                               h_scale=h_scale, residual=r, next_norm=norms[i + 1])
                h_scale = (sumsq, norms[i + 1].eps)
            return gemv.linear(h, self.head_weight(), pre=fusions.RMSScale(*h_scale), impl=impl)
        for i, block in enumerate(layers):
            out = block.mixer.step(h, conv[i], ssm[i], impl, positions=positions, state_ready=state_ready)
            h, r = mamba2_norm.add_rmsnorm(out, r, norms[i + 1].weight, norms[i + 1].eps, impl=impl)
        return gemv.linear(h, self.head_weight(), impl=impl)

    def persistent_step(self, conv, ssm, *, programs: int | None = None, tiles=None, delay_ns: int = 0,
                        timeline: bool = False) -> persistent_step.Mamba2PersistentStep:
        """The whole decode forward of one sequence as one kernel (`declab_kernels.persistent_step`) over the
        states conv [L, 1, conv_dim, W] and ssm [L, 1, H, P, N], on this model's weights in place."""
        c = self.config
        if c.ngroups != 1 or c.bias:
            raise ValueError("the persistent step has one norm group and no projection biases")
        layers = [persistent_step.Mamba2LayerWeights(
            in_proj=b.mixer.in_proj.weight, out_proj=b.mixer.out_proj.weight, conv_weight=b.mixer.conv1d.weight.squeeze(1),
            conv_bias=b.mixer.conv1d.bias, dt_bias=b.mixer.dt_bias, A=b.mixer.decay_rates(), D=b.mixer.D, norm=b.norm.weight,
            gated_norm=b.mixer.norm.weight) for b in self.backbone.layers]
        shape = persistent_step.Mamba2Shape(d_model=c.d_model, n_layers=c.n_layer, vocab=c.vocab_size, nheads=c.nheads, headdim=c.headdim,
                                            d_state=c.d_state, ngroups=c.ngroups, d_conv=c.d_conv)
        return persistent_step.Mamba2PersistentStep(
            layers, embed=self.backbone.embeddings.weight, head=self.head_weight(), final_norm=self.backbone.norm_f.weight,
            eps=c.norm_eps, shape=shape, conv=conv, ssm=ssm, dt_limit=c.dt_limit, programs=programs, tiles=tiles, delay_ns=delay_ns,
            timeline=timeline)

    def init_random(self, seed: int = 0):
        """Random weights as mamba-ssm initialises them (A in [1, 16], dt in [1e-3, 0.1]), deterministic in `seed`."""
        g = torch.Generator().manual_seed(seed)
        c = self.config
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                    p.fill_(1.0)
                elif name.endswith("A_log"):
                    p.copy_(torch.log(torch.empty(c.nheads).uniform_(1, 16, generator=g)))
                elif name.endswith("dt_bias"):
                    dt = torch.exp(torch.rand(c.nheads, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                    # softplus(dt_bias) = dt, so dt_bias is softplus's inverse at dt.
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))
                elif name.endswith("conv1d.weight"):
                    bound = 1 / math.sqrt(c.d_conv)
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return self


def build(config: Mamba2Config, tensors: dict | None, source: str, *, seed: int = 0) -> Mamba2LM:
    """A Mamba2LM on the CPU in float32, with `tensors` assigned (checked) or random weights."""
    model = Mamba2LM(config)
    if tensors is None:
        return model.init_random(seed)
    assign_weights(model, tensors, source)
    return model


def preset_config(values: dict, source: str) -> Mamba2Config:
    return config_from_dict(Mamba2Config, values, source)


def _json_float(value, source: str) -> float:
    """A float from config.json: a number, "Infinity", or transformers 5's {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"{source}: {value!r} in config.json is not a number") from None


def _dt_limit_fields(limit, source: str) -> dict:
    lo, hi = (0.0, math.inf) if limit is None else (_json_float(limit[0], source), _json_float(limit[1], source))
    if lo < 0 or hi < lo:
        raise CheckpointError(f"{source}: dt limit {[lo, hi]} is not a range in [0, inf)")
    return {"dt_min_limit": lo, "dt_max_limit": None if math.isinf(hi) else hi}


# The name a saved config.json gives the lab family (`declab_family`).
FAMILY = "mamba2"


def detects(hf: dict) -> bool:
    """Whether a config.json is HF `Mamba2ForCausalLM`'s or the state-spaces `mamba2-*` layout's."""
    return is_hf_mamba2(hf) or is_state_spaces_mamba2(hf)


def is_hf_mamba2(hf: dict) -> bool:
    return "Mamba2ForCausalLM" in (hf.get("architectures") or []) or hf.get("model_type") == "mamba2"


def is_state_spaces_mamba2(hf: dict) -> bool:
    """mamba-ssm's `MambaConfig` of a pure Mamba-2 stack (`ssm_cfg.layer == "Mamba2"`)."""
    ssm_cfg = hf.get("ssm_cfg")
    return "d_model" in hf and "n_layer" in hf and isinstance(ssm_cfg, dict) and ssm_cfg.get("layer") == "Mamba2"


def config_from_hf(hf: dict, source: str) -> Mamba2Config:
    """Our config from an HF `Mamba2Config` config.json."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise CheckpointError(f"{source}: config.json has no field {key}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("residual_in_fp32") is False:
        raise CheckpointError(f"{source}: residual_in_fp32=false is not supported")
    config = Mamba2Config(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layer=hf["num_hidden_layers"],
        d_state=hf.get("state_size", 128),
        d_conv=hf.get("conv_kernel", 4),
        expand=hf.get("expand", 2),
        headdim=hf.get("head_dim", 64),
        ngroups=hf.get("n_groups", 8),
        chunk_size=hf.get("chunk_size", 256),
        conv_bias=hf.get("use_conv_bias", True),
        bias=hf.get("use_bias", False),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        **_dt_limit_fields(hf.get("time_step_limit"), source),
    )
    if "num_heads" in hf and hf["num_heads"] != config.nheads:
        raise CheckpointError(f"{source}: num_heads {hf['num_heads']} != expand * hidden_size / head_dim = {config.nheads}")
    return config


# mamba-ssm `Mamba2` options the lab's block does not implement, with the value it requires.
UNSUPPORTED_SSM_CFG = {"d_ssm": None, "D_has_hdim": False, "rmsnorm": True, "norm_before_gate": False, "activation": "silu"}


def config_from_state_spaces(hf: dict, source: str) -> Mamba2Config:
    """Our config from a mamba-ssm `MambaConfig` config.json (with `Mamba2`'s defaults)."""
    ssm = dict(hf["ssm_cfg"])
    for key, required in UNSUPPORTED_SSM_CFG.items():
        if ssm.get(key, required) != required:
            raise CheckpointError(f"{source}: ssm_cfg.{key}={ssm[key]!r} is not supported (only {required!r})")
    if hf.get("d_intermediate", 0) or hf.get("attn_layer_idx"):
        raise CheckpointError(f"{source}: MLP or attention layers (d_intermediate, attn_layer_idx) are not supported")
    if hf.get("rms_norm", True) is False or hf.get("residual_in_fp32", True) is False:
        raise CheckpointError(f"{source}: rms_norm=false or residual_in_fp32=false is not supported")
    vocab, multiple = hf["vocab_size"], hf.get("pad_vocab_size_multiple", 8)
    return Mamba2Config(
        vocab_size=-(-vocab // multiple) * multiple,
        d_model=hf["d_model"],
        n_layer=hf["n_layer"],
        d_state=ssm.get("d_state", 128),
        d_conv=ssm.get("d_conv", 4),
        expand=ssm.get("expand", 2),
        headdim=ssm.get("headdim", 64),
        ngroups=ssm.get("ngroups", 1),
        chunk_size=ssm.get("chunk_size", 256),
        conv_bias=ssm.get("conv_bias", True),
        bias=ssm.get("bias", False),
        norm_eps=hf.get("norm_epsilon", 1e-5),
        tie_embeddings=bool(hf.get("tie_embeddings", True)),
        **_dt_limit_fields(ssm.get("dt_limit"), source),
    )


def read_config(folder: Path) -> Mamba2Config:
    """The config of a Mamba-2 folder (the lab's own format, HF `Mamba2ForCausalLM`, or the
    state-spaces `mamba2-*` layout), checked, without reading its weights."""
    folder = Path(folder)
    source = str(folder)
    hf = read_json(folder / "config.json")
    if hf.get("declab_family") == FAMILY:
        values = {k: v for k, v in hf.items() if k not in ("declab_family", "quantization")}
        config = config_from_dict(Mamba2Config, values, source)
    elif is_hf_mamba2(hf):
        config = parse_config(config_from_hf, hf, source)
    elif is_state_spaces_mamba2(hf):
        config = parse_config(config_from_state_spaces, hf, source)
    else:
        raise CheckpointError(f"{source}: unknown architecture {hf.get('architectures') or hf.get('model_type') or 'nothing'}")
    return config


def load(folder: Path, tensors: dict | None = None) -> tuple[Mamba2Config, Mamba2LM]:
    """Config and model of a Mamba-2 folder: the lab's own format, HF `Mamba2ForCausalLM`, or the
    state-spaces `mamba2-*` layout; `tensors`: the folder's tensors already read (a quantised folder's)."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = load_weights(folder) if tensors is None else tensors
    if "backbone.embedding.weight" in tensors:
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, build(config, tensors, str(folder))


def save(model: Mamba2LM, folder: Path) -> None:
    """The lab's own format: config.json (`declab_family` + the config fields) and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = {"declab_family": FAMILY, **asdict(model.config)}
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


# Tensor parallel (`declab_arch.tensor_parallel`): heads split over the ranks (z, x and dt rows of in_proj,
# conv channels, A_log / D / dt_bias, the gated norm, out_proj columns) and the vocabulary; the norms
# outside the mixer replicated. B and C, shared by the H / G heads of a group, go by group when G >= n;
# with G < n (mamba2-1.3b has G = 1) the ranks of a group each hold its B/C rows, and its gated norm spans
# them (`GroupedRMSNormGated`).
@dataclass
class Mamba2Shard(Mamba2Config):
    """A rank's mixer sizes: d_inner / tp channels (nheads / tp heads), its own B/C groups max(1, G / tp)."""

    tp: int = 1

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model // self.tp


class GroupedRMSNormGated(nn.Module):
    """rmsnorm(y * silu(z)) where this rank's channels are part of one norm group of `group_size`
    channels spread over several ranks: each rank writes its partial sum of squares in its group's slot
    of a [..., slots] vector, the all-reduce completes every group's sum."""

    def __init__(self, norm: RMSNormGated, group_size: int, slot: int, slots: int, group):
        super().__init__()
        self.weight, self.eps, self.tp = norm.weight, norm.eps, group
        self.group_size, self.slot, self.slots = group_size, slot, slots

    def forward(self, y, z):
        h = F.silu(z.float()) * y
        sumsq = h.pow(2).sum(-1, keepdim=True)  # [..., 1] this rank's channels
        total = self.tp.reduce(F.pad(sumsq, (self.slot, self.slots - self.slot - 1)))  # [..., slots]
        h = h * torch.rsqrt(total[..., self.slot : self.slot + 1] / self.group_size + self.eps)
        return self.weight * h.to(y.dtype)


def tp_config(config: Mamba2Config, n: int) -> Mamba2Shard:
    g = config.ngroups
    if g % n and n % g:
        raise ValueError(f"ngroups {g} and tp {n}: one must divide the other (B/C are split by group or replicated)")
    tensor_parallel.divided(config, n, "nheads")
    return Mamba2Shard(**{**asdict(config), "ngroups": max(1, g // n), **tensor_parallel.divided(config, n, "vocab_size")}, tp=n)


def tp_plan(config: Mamba2Config, n: int) -> dict:
    d, bc, heads, groups = config.d_inner, config.ngroups * config.d_state, config.nheads, min(config.ngroups, n)
    split, mixer = tensor_parallel.split, "backbone.layers.*.mixer."
    return {
        "backbone.embeddings.weight": split(config.vocab_size, n),
        "lm_head.weight": split(config.vocab_size, n),
        # in_proj's rows are z, x, B, C, dt; conv1d's channels x, B, C
        mixer + "in_proj.*": tensor_parallel.Split(0, ((d, n), (d, n), (bc, groups), (bc, groups), (heads, n))),
        mixer + "conv1d.*": tensor_parallel.Split(0, ((d, n), (bc, groups), (bc, groups))),
        **{mixer + name: split(heads, n) for name in ("dt_bias", "A_log", "D")},
        mixer + "norm.weight": split(d, n),
        mixer + "out_proj.weight": split(d, n, dim=1),
        mixer + "out_proj.bias": tensor_parallel.FIRST_RANK,
    }


def tp_adopt(model: Mamba2LM, config: Mamba2Config, local: Mamba2Shard, group) -> None:
    g, n = config.ngroups, group.size
    for block in model.backbone.layers:
        block.mixer.config = local
        if g < n:
            block.mixer.norm = GroupedRMSNormGated(block.mixer.norm, config.d_inner // g, group.rank * g // n, g, group)
