"""RWKV-7 "Goose" language model as in flash-linear-attention's HF format (`model_type: rwkv7`), and
its checkpoint loader.

Parameter names follow fla's `RWKV7ForCausalLM` (`model.embeddings.weight`,
`model.layers.N.attn.r_proj.weight`, `model.layers.N.attn.w_lora.lora.0.weight`,
`model.layers.N.attn.x_r`, `model.layers.N.ffn.key.weight`, `model.norm.weight`,
`lm_head.weight`), so an fla checkpoint loads without renaming. One block (layer i):

    x = pre_norm(x)                                   (layer 0 only, when norm_first)
    x = x + attn(attn_norm(x))                        time mixing, WKV-7 through declab_kernels.wkv7
    x = x + ffn(ffn_norm(x))                          channel mixing, squared ReLU

Time mixing of a token h with the previous token's h' (zeros before the first token):
    d = h' - h; x_* = h + d * x_*                     token shift with learned mixes r, w, k, v, a, g
    r, k, v = r_proj(x_r), k_proj(x_k), v_proj(x_v)
    w = -exp(-0.5) * sigmoid(w_lora(x_w))             log-decay in (-0.61, 0)
    v = lerp(v, v_first, sigmoid(v_lora(x_v)))        value residual toward layer 0's v (layers > 0)
    a = sigmoid(a_lora(x_a)); g = g_lora(x_g)         in-context learning rate; output gate
    kk = normalize(k * k_k) per head; k = k * (1 + (a - 1) * k_a)
    o = WKV7(r, w, k, v, -kk, kk * a)                 state [H, K, V] float32 per sequence
    o = (groupnorm_per_head(o) + sum(r * k * r_k) v) * g; out = o_proj(o)

Three ways to run it, all on the same modules (impl="ref" runs WKV-7 as `wkv7_chunk_factored`, the
differentiable, memory-light chunked form that training uses; impl="triton" as the Triton kernels):
- `forward(tokens [B, T], impl=...)`: logits [B, T, V] from zero state (scoring, training: the parallel form);
- `forward_chunk(tokens [B, T], lengths [B], shift, wkv)`: right-padded prompt chunks continuing
  from a carried state, which they update; padded positions leave the state untouched;
- `forward_step(tokens [B], shift, wkv, impl=...)`: one token per sequence, state updated in place, on
  the kernels of `declab_kernels.rwkv7_fused` around five projections and the WKV-7 step (11 launches
  a layer on impl="triton", where the sequence of about 60 PyTorch ops would be); each kernel runs its
  `impl`. The projections go through `declab_kernels.gemv.linear`: the r/k/v and LoRA
  down-projections as one row select (`fusions.Select`: each weight row block times its own mixed
  input; unfused, by the row rules of `declab_kernels.tuning.CROSS_ROWS`), the FFN's value projection
  with relu^2 before it (`fusions.SqReLU`).

The step reads the projections through packed weights: on its first call a layer's six mixes
become rows of one `[6, C]` tensor, the r/k/v projections and the LoRA down-projections rows of one
`[3C + sum(ranks), C]` matrix, and the LoRA up-projections column blocks of one `[C, sum(ranks)]`
matrix; the parameters are re-pointed to views of them (no copy kept, names unchanged).

The carried state of a batch: `shift [L, 2, B, C]` (the last normalised input of time mixing and of
channel mixing, model dtype) and `wkv [L, B, H, K, V]` float32.
"""

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from declab_arch import quant_linear, tensor_parallel
from declab_arch.checkpoint import CheckpointError, assign_weights, check_fields, config_from_dict, load_weights, parse_config, read_json
from declab_kernels import gemv, persistent_step
from declab_kernels.gemv import fusions
from declab_kernels.host_copy import on_device
from declab_kernels.rwkv7_fused import add_norm_shift, gate_output, lora_hidden, time_mix_inputs
from declab_kernels.wkv7 import wkv7_chunk, wkv7_chunk_factored, wkv7_step

FAMILY = "rwkv7"
# Chunk length of the reference path's WKV-7 (`wkv7_chunk_factored`; the Triton kernel keeps its own
# default): its exponents reach (REF_CHUNK / 2 + 1) * W_SCALE = 20.0, far inside its bound of 60.
REF_CHUNK = 64
# exp(-0.5): the largest per-token decay rate, so exp(w) stays in (0.545, 1).
W_SCALE = 0.6065306597126334

@dataclass
class Packed:
    """A layer's weights as the fused decode step reads them (the parameters are views of these)."""

    mix: torch.Tensor  # [6, C] token-shift mixes in the order r, k, v, w, a, g
    # [3C + R, C] rows: r_proj, k_proj, v_proj, then the LoRA down-projections (a weight object when quantised)
    down: torch.Tensor
    up: torch.Tensor  # [C, R] column blocks: the LoRA up-projections
    ranks: tuple  # widths of the LoRA blocks, in the order (v,) w, a, g
    # rows of `down` per mixed input, as `fusions.Select` takes them: input i (r, k, v, w, a, g)
    # multiplies rows down_splits[i]:down_splits[i + 1] (v's LoRA goes with v_proj)
    down_splits: tuple
    # the unfused products of `down` for many rows (`fusions.Select`'s panels): r/k/v as one batched
    # GEMM, the LoRA down-projections of the inputs (v,) w, a, g as one GEMM
    panels: tuple
    key: tuple  # data pointers of the parameters when packed: a change means the model was moved


@dataclass
class RWKV7Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    head_dim: int = 64
    intermediate_size: int | None = None
    decay_low_rank_dim: int = 64
    a_low_rank_dim: int = 64
    v_low_rank_dim: int = 16
    gate_low_rank_dim: int = 128
    norm_first: bool = True
    norm_bias: bool = True
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        check_fields(self)
        if self.hidden_size % self.head_dim:
            raise CheckpointError(f"hidden_size {self.hidden_size} is not a multiple of head_dim {self.head_dim}")
        if self.intermediate_size is None:
            # fla's rule: 4 * hidden rounded up to a multiple of 32.
            self.intermediate_size = 32 * -(-4 * self.hidden_size // 32)

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim


class LoRA(nn.Module):
    """Low-rank projection `lora.2(act(lora.0(x)))`, fla's module layout (names `lora.0`, `lora.2`)."""

    def __init__(self, dim: int, out: int, rank: int, activation: str | None, bias: bool = True):
        super().__init__()
        act = {"tanh": nn.Tanh(), "sigmoid": nn.Sigmoid(), None: nn.Identity()}[activation]
        self.lora = nn.Sequential(nn.Linear(dim, rank, bias=False), act, nn.Linear(rank, out, bias=bias))

    def forward(self, x):
        return self.lora(x)


class TimeMix(nn.Module):
    """RWKV-7 time mixing (fla's `RWKV7Attention`)."""

    def __init__(self, config: RWKV7Config, layer: int):
        super().__init__()
        C, H, D = config.hidden_size, config.num_heads, config.head_dim
        self.layer, self.n_heads, self.head_dim = layer, H, D
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k = nn.Parameter(torch.zeros(C))
        self.k_a = nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(H, D))
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.w_lora = LoRA(C, C, config.decay_low_rank_dim, "tanh")
        if layer != 0:
            self.v_lora = LoRA(C, C, config.v_low_rank_dim, None)
        self.a_lora = LoRA(C, C, config.a_low_rank_dim, None)
        self.g_lora = LoRA(C, C, config.gate_low_rank_dim, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(H, C, eps=D * config.norm_eps)

    def inputs(self, h, prev, v_first):
        """h, prev (the previous token's h) `[..., C]` -> WKV inputs `[..., H, D]`, v_first, gate
        terms. w is float32: the log-decay is summed over thousands of tokens."""
        d = prev - h
        r = self.r_proj(h + d * self.x_r[0, 0])
        w = -W_SCALE * torch.sigmoid(self.w_lora(h + d * self.x_w[0, 0]).float())
        k = self.k_proj(h + d * self.x_k[0, 0])
        xv = h + d * self.x_v[0, 0]
        v = self.v_proj(xv)
        if self.layer == 0:
            v_first = v
        else:
            v = torch.lerp(v, v_first, torch.sigmoid(self.v_lora(xv)))
        a = torch.sigmoid(self.a_lora(h + d * self.x_a[0, 0]))
        g = self.g_lora(h + d * self.x_g[0, 0])
        kk = F.normalize(self.heads(k * self.k_k), dim=-1)
        k = k.addcmul(k * (a - 1), self.k_a)
        r, w, k, v, a = (self.heads(x) for x in (r, w, k, v, a))
        return r, w, k, v, -kk, kk * a, v_first, g

    def heads(self, x):
        """`[..., C]` -> `[..., H, D]`."""
        return x.unflatten(-1, (self.n_heads, self.head_dim))

    def output(self, o, r, k, v, g):
        """WKV output o `[..., H, D]` -> block output `[..., C]`: per-head norm, bonus r_k, gate."""
        shape = o.shape[:-2]
        o = self.g_norm(o.reshape(-1, self.n_heads * self.head_dim)).view(*shape, -1)
        bonus = ((r * k * self.r_k).sum(-1, keepdim=True) * v).flatten(-2)
        return self.o_proj((o + bonus) * g)

    def forward(self, h, prev, v_first, state, *, impl, mask=None):
        """h, prev `[B, T, C]`; state `[B, H, K, V]` float32 or None (zeros). mask `[B, T]` marks
        real tokens: at padded positions w, k and b are zeroed, so the state passes unchanged.
        Returns (out `[B, T, C]`, v_first, final state)."""
        r, w, k, v, a, b, v_first, g = self.inputs(h, prev, v_first)
        if mask is not None:
            m = mask[..., None, None]
            w, k, b = w * m, k * m.to(k.dtype), b * m.to(b.dtype)
        if impl == "ref":
            o, state = wkv7_chunk_factored(r, w, k, v, a, b, initial_state=state, chunk_size=REF_CHUNK)
        else:
            o, state = wkv7_chunk(r, w, k, v, a, b, initial_state=state, impl=impl)
        return self.output(o, r, k, v, g), v_first, state

    def loras(self):
        """(LoRA, activation) in the packed order: v (layers > 0), w, a, g."""
        loras = [(self.w_lora, "tanh"), (self.a_lora, None), (self.g_lora, "sigmoid")]
        return ([(self.v_lora, None)] if self.layer else []) + loras

    def packed(self) -> Packed:
        """The packed weights, (re)built when the parameters are not (or no longer) views of them."""
        mixes = [getattr(self, n) for n in ("x_r", "x_k", "x_v", "x_w", "x_a", "x_g")]
        linears = [self.r_proj, self.k_proj, self.v_proj] + [m.lora[0] for m, _ in self.loras()]
        downs = [m.weight for m in linears]
        ups = [m.lora[2].weight for m, _ in self.loras()]
        key = tuple(quant_linear.data_ptr(p) for p in mixes + downs + ups)
        pack = getattr(self, "_packed", None)
        if pack is not None and pack.key == key:
            return pack
        # why: packing runs once, before any graph capture, usually inside a decoder's inference
        # mode; the buffers must be inference tensors exactly when the parameters are (a model
        # built under the caller's inference mode), else the parameters would change kind
        with torch.inference_mode(mixes[0].is_inference()), torch.no_grad():
            mix = torch.cat([p.reshape(1, -1) for p in mixes])
            up = torch.cat(ups, dim=1)
            for j, p in enumerate(mixes):
                p.data = mix[j].view(p.shape)
            if isinstance(downs[0], torch.Tensor):
                down = torch.cat(downs)
                row = 0
                for p in downs:
                    p.data = down[row : row + p.shape[0]]
                    row += p.shape[0]
            else:
                # Quantised down-projections (`declab_arch.quant_linear`): one weight object of their
                # rows, the modules' weights become views of it.
                down, _ = quant_linear.fuse_rows(*linears)
                downs = [m.weight for m in linears]
            col = 0
            for p in ups:
                p.data = up[:, col : col + p.shape[1]]
                col += p.shape[1]
        # LoRA j takes input 6 - len(ups) + j: (v,) w, a, g
        rows = [p.shape[0] for p in downs[:3]] + [0, 0, 0]
        for j, p in enumerate(downs[3:]):
            rows[6 - len(ups) + j] += p.shape[0]
        splits = tuple(itertools.accumulate(rows, initial=0))
        C = downs[0].shape[0]
        panels = ((0, 3, 0, 3 * C, "batched"), (6 - len(ups), 6, 3 * C, down.shape[0], "cross"))
        self._packed = Packed(mix, down, up, tuple(p.shape[1] for p in ups), splits, panels,
                              tuple(quant_linear.data_ptr(p) for p in mixes + downs + ups))
        return self._packed

    def step(self, xs, v_first, state, *, impl, reduce=None):
        """One token: xs `[6, B, C]` the mixed inputs (r, k, v, w, a, g); state `[B, H, K, V]` float32
        updated in place. Returns (out `[B, C]`, v_first `[B, c]`), c the channels of this process's heads
        (C, or C / ranks under tensor parallel, whose all-reduce `reduce` sums o_proj's partial products)."""
        pack = self.packed()
        # r_proj's rows: the channels r, k and v have here
        c = pack.down_splits[1]
        nb = len(pack.ranks)
        offs = list(itertools.accumulate(pack.ranks, initial=0))
        # [B, 3c + R] as column pieces: each row block of the packed weight times its own mixed input, the
        # weights read once
        y = gemv.linear(xs, pack.down, pre=fusions.Select(pack.down_splits, pack.panels), impl=impl)
        r, k, v = (y.cols(j * c, (j + 1) * c) for j in range(3))
        lo = [y.cols(3 * c + offs[j], 3 * c + offs[j + 1]) for j in range(nb)]
        # [nb * B, R] block-diagonal activations, then [nb * B, C]: row block j is LoRA j's output
        u = gemv.linear(lora_hidden(lo, [act for _, act in self.loras()], impl=impl), pack.up, impl=impl)
        bias_v = self.v_lora.lora[2].bias if self.layer else None
        x, w = time_mix_inputs(
            r, k, v, u, self.w_lora.lora[2].bias, self.a_lora.lora[2].bias, bias_v, self.k_k, self.k_a,
            v_first if self.layer else None, head_dim=self.head_dim, impl=impl,
        )
        r, k, v, a, b = (self.heads(t) for t in x.unbind(0))
        # The state was last written before the step's embedding lookup (a PyTorch kernel, no PDL;
        # see `RWKV7.forward_step`), so it may be loaded before the wait.
        o = wkv7_step(r, self.heads(w), k, v, a, b, state, impl=impl, state_ready=True)
        g = u[(nb - 1) * xs.shape[1] :]
        out = gate_output(o, r, k, v, g, self.r_k, self.g_norm.weight, self.g_norm.bias, eps=self.g_norm.eps, impl=impl)
        out = gemv.linear(out, self.o_proj.weight, impl=impl)
        return (out if reduce is None else reduce(out)), (x[2] if self.layer == 0 else v_first)


class ChannelMix(nn.Module):
    """RWKV-7 channel mixing (fla's `RWKV7FeedForward`): token shift, then value(relu(key(x))^2)."""

    def __init__(self, config: RWKV7Config):
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(config.hidden_size))
        self.key = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.value = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, h, prev):
        return self.value(torch.relu(self.key(h + (prev - h) * self.x_k)).square())


class Block(nn.Module):
    def __init__(self, config: RWKV7Config, layer: int):
        super().__init__()
        C = config.hidden_size

        def norm():
            return nn.LayerNorm(C, eps=config.norm_eps, bias=config.norm_bias)

        if config.norm_first and layer == 0:
            self.pre_norm = norm()
        self.attn_norm = norm()
        self.attn = TimeMix(config, layer)
        self.ffn_norm = norm()
        self.ffn = ChannelMix(config)

    def enter(self, x):
        return self.pre_norm(x) if hasattr(self, "pre_norm") else x


class Trunk(nn.Module):
    """Embedding, blocks and final norm (fla's `model.` prefix)."""

    def __init__(self, config: RWKV7Config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


def shifted(h, first):
    """The previous token's h for every position of h `[B, T, C]`, `first` `[B, C]` before t=0."""
    return torch.cat([first.unsqueeze(1), h[:, :-1]], dim=1)


class RWKV7(nn.Module):
    # Tensor parallel (`declab_arch.tensor_parallel`): set on each rank's share; None on one process.
    tp = None

    def __init__(self, config: RWKV7Config):
        super().__init__()
        self.config = config
        self.model = Trunk(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head(self, x):
        w = self.model.embeddings.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(self.model.norm(x), w)

    def new_state(self, batch: int, *, device=None, dtype=None):
        """Zero state for `batch` sequences: shift `[L, 2, B, C]` (model dtype), wkv `[L, B, H, K, V]` float32."""
        c = self.config
        p = self.model.embeddings.weight
        device, dtype = device or p.device, dtype or p.dtype
        shift = torch.zeros(c.num_hidden_layers, 2, batch, c.hidden_size, device=device, dtype=dtype)
        wkv = torch.zeros(c.num_hidden_layers, batch, c.num_heads, c.head_dim, c.head_dim, device=device, dtype=torch.float32)
        return shift, wkv

    def hidden(self, tokens, *, impl):
        """Final hidden states [B, T, d] before the norm, one parallel forward from zero state."""
        x = self.model.embeddings(tokens)
        zeros = x.new_zeros(x.shape[0], x.shape[-1])
        v_first = None
        for block in self.model.layers:
            x = block.enter(x)
            h = block.attn_norm(x)
            out, v_first, _ = block.attn(h, shifted(h, zeros), v_first, None, impl=impl)
            x = x + out
            h = block.ffn_norm(x)
            x = x + block.ffn(h, shifted(h, zeros))
        return x

    def forward(self, tokens, *, impl):
        """Logits [B, T, V] of one parallel forward from zero state."""
        return self.head(self.hidden(tokens, impl=impl))

    def forward_chunk(self, tokens, lengths, shift, wkv, *, impl, all_positions: bool = False):
        """Continue B sequences by a chunk each. tokens `[B, T]` right-padded, lengths (host ints,
        each >= 1) real tokens per row; shift `[L, 2, B, C]` and wkv `[L, B, H, K, V]` are read and
        updated in place. Returns logits `[B, V]` of each row's last real token, or `[B, T, V]` of
        every position with `all_positions` (speculative verification)."""
        B, T = tokens.shape
        lens = on_device(lengths, tokens.device)  # not waiting for the GPU (`declab_kernels.host_copy`)
        mask = None
        if min(lengths) < T:
            mask = torch.arange(T, device=tokens.device) < lens[:, None]
        last = (lens - 1).view(B, 1, 1)
        x = self.model.embeddings(tokens)
        v_first = None
        for i, block in enumerate(self.model.layers):
            x = block.enter(x)
            h = block.attn_norm(x)
            out, v_first, state = block.attn(h, shifted(h, shift[i, 0]), v_first, wkv[i], impl=impl, mask=mask)
            wkv[i].copy_(state)
            shift[i, 0].copy_(h.gather(1, last.expand(B, 1, h.shape[-1])).squeeze(1))
            x = x + out
            h = block.ffn_norm(x)
            prev = shifted(h, shift[i, 1])
            shift[i, 1].copy_(h.gather(1, last.expand(B, 1, h.shape[-1])).squeeze(1))
            x = x + block.ffn(h, prev)
        if all_positions:
            return self.head(x)
        return self.head(x.gather(1, last.expand(B, 1, x.shape[-1])).squeeze(1))

    def forward_step(self, tokens, shift, wkv, *, impl):
        """One token per sequence: tokens `[B]`; shift and wkv updated in place. Logits `[B, V]`. Each norm
        runs with the residual add before it and the token shift after it; the residual x `[B, C]` is
        updated in place.

        The embedding lookup comes first and is a PyTorch kernel (launched without PDL): every write
        to `wkv` and `shift` before this call has finished when it starts, which lets each layer's WKV
        step and token-shift norms load their state before waiting on the kernels before them
        (`wkv7_step(state_ready=True)`, `add_norm_shift(state_ready=True)`)."""
        x = self.model.embeddings(tokens)
        layers = self.model.layers
        if hasattr(layers[0], "pre_norm"):
            n = layers[0].pre_norm
            x = add_norm_shift(x, None, n.weight, n.bias, eps=n.eps, impl=impl)
        # Tensor parallel: o_proj and the FFN's value projection are row-parallel, their products all-reduced.
        reduce = None if self.tp is None else self.tp.reduce
        delta, v_first = None, None
        for i, block in enumerate(layers):
            n = block.attn_norm
            # [6, B, C]
            xs = add_norm_shift(x, delta, n.weight, n.bias, shift[i, 0], block.attn.packed().mix, eps=n.eps, impl=impl,
                                state_ready=True)
            out, v_first = block.attn.step(xs, v_first, wkv[i], impl=impl, reduce=reduce)
            n, ffn = block.ffn_norm, block.ffn
            # [1, B, C]
            xk = add_norm_shift(x, out, n.weight, n.bias, shift[i, 1], ffn.x_k.view(1, -1), eps=n.eps, impl=impl,
                                state_ready=True)
            delta = gemv.linear(gemv.linear(xk[0], ffn.key.weight, impl=impl), ffn.value.weight,
                                pre=fusions.SqReLU(scratch=True), impl=impl)
            if reduce is not None:
                delta = reduce(delta)
        n = self.model.norm
        h = add_norm_shift(x, delta, n.weight, n.bias, eps=n.eps, impl=impl)
        w = self.model.embeddings.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return gemv.linear(h, w, impl=impl)

    def persistent_step(self, shift, wkv, *, programs: int | None = None, tiles=None, delay_ns: int = 0,
                        timeline: bool = False) -> persistent_step.RWKV7PersistentStep:
        """The whole decode forward of one sequence as one kernel (`declab_kernels.persistent_step`) over the
        states shift [L, 2, 1, C] and wkv [L, 1, H, D, D], on this model's packed weights in place (dense only)."""
        c = self.config
        layers = []
        for i, block in enumerate(self.model.layers):
            a, pack = block.attn, block.attn.packed()
            if not isinstance(pack.down, torch.Tensor):
                raise ValueError("the persistent step runs on dense weights")
            layers.append(persistent_step.RWKV7LayerWeights(
                mix=pack.mix, down=pack.down, up=pack.up, bias_w=a.w_lora.lora[2].bias, bias_a=a.a_lora.lora[2].bias,
                bias_v=a.v_lora.lora[2].bias if i else None, k_k=a.k_k, k_a=a.k_a, r_k=a.r_k, g_norm_w=a.g_norm.weight,
                g_norm_b=a.g_norm.bias, o_proj=a.o_proj.weight, attn_norm_w=block.attn_norm.weight, attn_norm_b=block.attn_norm.bias,
                ffn_norm_w=block.ffn_norm.weight, ffn_norm_b=block.ffn_norm.bias, ffn_mix=block.ffn.x_k, key=block.ffn.key.weight,
                value=block.ffn.value.weight))
        pre = getattr(self.model.layers[0], "pre_norm", None)
        shape = persistent_step.RWKV7Shape(d_model=c.hidden_size, n_layers=c.num_hidden_layers, vocab=c.vocab_size, head_dim=c.head_dim,
                                           inter=c.intermediate_size, rank_v=c.v_low_rank_dim, rank_w=c.decay_low_rank_dim,
                                           rank_a=c.a_low_rank_dim, rank_g=c.gate_low_rank_dim)
        head = self.model.embeddings.weight if c.tie_word_embeddings else self.lm_head.weight
        n = self.model.norm
        return persistent_step.RWKV7PersistentStep(
            layers, embed=self.model.embeddings.weight, head=head, final_norm=(n.weight, n.bias),
            pre_norm=None if pre is None else (pre.weight, pre.bias), eps=c.norm_eps, g_eps=self.model.layers[0].attn.g_norm.eps,
            shape=shape, shift=shift, wkv=wkv, programs=programs, tiles=tiles, delay_ns=delay_ns, timeline=timeline)

    def init_random(self, seed: int = 0):
        """Random weights in the ranges a trained RWKV-7 has, deterministic in `seed`.

        Plain 0.02-std noise would leave the token-shift mixes and decays meaningless; these keep
        the decay spread over heads, the mixes in [0, 1], and norms at 1.
        """
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if "norm" in name:
                    p.fill_(1.0 if leaf == "weight" else 0.0)
                elif leaf.startswith("x_"):
                    p.copy_(torch.rand(p.shape, generator=g))
                elif leaf == "k_k":
                    p.copy_(0.7 + 0.1 * torch.rand(p.shape, generator=g))
                elif leaf == "k_a":
                    p.fill_(1.0)
                elif leaf == "r_k":
                    p.copy_(-0.04 + 0.1 * torch.randn(p.shape, generator=g))
                elif name.endswith("w_lora.lora.2.bias"):
                    p.copy_(torch.linspace(-6, 0, p.numel()) + 0.5 * torch.randn(p.shape, generator=g))
                elif leaf == "bias":
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
                elif name.endswith("embeddings.weight"):
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        return self


def detects(hf: dict) -> bool:
    """Whether a config.json is an fla-hub RWKV-7's."""
    return hf.get("model_type") == "rwkv7" or "RWKV7ForCausalLM" in (hf.get("architectures") or [])


def config_from_hf(hf: dict, source: str) -> RWKV7Config:
    """Our RWKV7Config from an fla `config.json` (`model_type: rwkv7`)."""
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise CheckpointError(f"{source}: config.json has no field {key}")
    C, L = hf["hidden_size"], hf["num_hidden_layers"]
    if hf.get("hidden_act", "sqrelu") != "sqrelu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (sqrelu only)")
    if hf.get("attn"):
        raise CheckpointError(f"{source}: hybrid attention layers (config field attn) are not supported")
    value_dim = hf.get("value_dim")
    if value_dim is not None and set(value_dim if isinstance(value_dim, list) else [value_dim]) != {C}:
        raise CheckpointError(f"{source}: value_dim {value_dim} is not supported (only value_dim == hidden_size)")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        head_dim = C // hf["num_heads"] if hf.get("num_heads") else 64
    intermediate = hf.get("intermediate_size")
    if intermediate is None:
        intermediate = 32 * -(-int(C * (hf.get("hidden_ratio") or 4)) // 32)
    # fla's own defaults, for configs that leave a field out.
    return RWKV7Config(
        vocab_size=hf["vocab_size"],
        hidden_size=C,
        num_hidden_layers=L,
        head_dim=head_dim,
        intermediate_size=intermediate,
        decay_low_rank_dim=hf.get("decay_low_rank_dim", 64),
        a_low_rank_dim=hf.get("a_low_rank_dim", 64),
        v_low_rank_dim=hf.get("v_low_rank_dim", 16),
        gate_low_rank_dim=hf.get("gate_low_rank_dim", 128),
        norm_first=bool(hf.get("norm_first", True)),
        norm_bias=bool(hf.get("norm_bias", True)),
        norm_eps=float(hf.get("norm_eps", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )


def read_config(folder: Path) -> RWKV7Config:
    """The config of an fla RWKV-7 folder or one in the lab's own format, checked, without its weights."""
    folder = Path(folder)
    hf = read_json(folder / "config.json")
    if hf.get("declab_family") == FAMILY:
        values = {k: v for k, v in hf.items() if k not in ("declab_family", "quantization")}
        config = config_from_dict(RWKV7Config, values, str(folder))
    elif detects(hf):
        config = parse_config(config_from_hf, hf, str(folder))
    else:
        raise CheckpointError(f"{folder}: unknown architecture {hf.get('architectures') or hf.get('model_type')}")
    return config


def load(folder: Path, tensors: dict | None = None) -> tuple[RWKV7Config, RWKV7]:
    """Config and model of an fla RWKV-7 folder or one in the lab's own format; `tensors`: the folder's
    tensors already read (a quantised folder's)."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = load_weights(folder) if tensors is None else tensors
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    # Early fla checkpoints stack the six token-shift mixes as attn.x_x [6, C]; fla splits them on load.
    for name in [n for n in tensors if n.endswith(".attn.x_x")]:
        stacked = tensors.pop(name)
        for j, mix in enumerate(("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")):
            tensors[name[: -len("x_x")] + mix] = stacked[j].reshape(1, 1, -1)
    return config, build(config, tensors, str(folder))


def save(model: RWKV7, folder: Path) -> None:
    """Write `model` in the lab's format: config.json (declab_family + fields) and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = {"declab_family": FAMILY, **asdict(model.config)}
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    # why: a copy each, since after a fused step the weights are views of shared packed buffers
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))


def build(config: RWKV7Config, tensors: dict | None, source: str, *, seed: int = 0) -> RWKV7:
    """An RWKV7 on the CPU in float32, with `tensors` assigned (checked) or random weights."""
    model = RWKV7(config)
    if tensors is None:
        return model.init_random(seed)
    assign_weights(model, tensors, source)
    return model


def preset_config(values: dict, source: str) -> RWKV7Config:
    return config_from_dict(RWKV7Config, values, source)


# Tensor parallel (`declab_arch.tensor_parallel`): heads split over the ranks (r/k/v and LoRA up rows, o_proj
# columns, k_k, k_a, r_k, the group norm), the FFN width (key rows, value columns) and the vocabulary; the
# token-shift mixes, LoRA down-projections and layer norms replicated.
@dataclass
class RWKV7Shard(RWKV7Config):
    """A rank's sizes: num_heads / tp heads (hidden_size, the residual width, whole), FFN width and vocabulary."""

    tp: int = 1

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim // self.tp


def tp_config(config: RWKV7Config, n: int) -> RWKV7Shard:
    tensor_parallel.divided(config, n, "num_heads")
    return RWKV7Shard(**{**asdict(config), **tensor_parallel.divided(config, n, "intermediate_size", "vocab_size")}, tp=n)


def tp_plan(config: RWKV7Config, n: int) -> dict:
    C, inner, split, attn = config.hidden_size, config.intermediate_size, tensor_parallel.split, "model.layers.*.attn."
    by_head = ("r_proj.weight", "k_proj.weight", "v_proj.weight", "*_lora.lora.2.*", "k_k", "k_a", "g_norm.*")
    return {
        "model.embeddings.weight": split(config.vocab_size, n),
        "lm_head.weight": split(config.vocab_size, n),
        **{attn + name: split(C, n) for name in by_head},
        attn + "r_k": split(config.num_heads, n),
        attn + "o_proj.weight": split(C, n, dim=1),
        "model.layers.*.ffn.key.weight": split(inner, n),
        "model.layers.*.ffn.value.weight": split(inner, n, dim=1),
    }


def tp_adopt(model: RWKV7, config: RWKV7Config, local: RWKV7Shard, group) -> None:
    for block in model.model.layers:
        block.attn.n_heads = local.num_heads
        block.attn.g_norm.num_groups, block.attn.g_norm.num_channels = local.num_heads, local.num_heads * local.head_dim
