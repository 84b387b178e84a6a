"""Llama-style decoder (Llama 2/3, Qwen2, Mistral): RMSNorm, RoPE (with the Llama-3 scaling rule),
grouped-query attention, SwiGLU MLP, tied or untied embeddings; and the HF checkpoint loader.

Parameter names follow HF `LlamaForCausalLM` (`model.layers.N.self_attn.q_proj.weight`, ...), so a
checkpoint's state dict loads without renaming. Attention runs in one of two ways:

- `forward(tokens [B, T])`: contiguous K/V, causal or not, through PyTorch SDPA; used by
  `Decoder.logits` for scoring and as the independent check of the paged path;
- `forward_paged(tokens [N], positions [N], batch)`: packed tokens of several sequences whose K/V
  are written into and read from a paged cache through `declab_kernels.paged_attention` (prefill chunks
  and decode steps).

`forward_paged` is written once for both impls (`PagedBatch.impl`, from the decoder): every projection
and the head go through `declab_kernels.gemv.linear`, whose fusions are data (`declab_kernels.gemv.fusions`;
the Triton GEMV runs where it measured faster, decode rows only). q/k/v are one projection
(`Attention.qkv_weight`), gate/up another (`MLP.gate_up_weight`) with SwiGLU after it; in prefill RoPE on
q and k and the K/V write are one kernel, in decode both run inside the paged decode kernel (`rope=`).
Up to `declab_kernels.tuning.FOLD_ROWS` rows (either impl) each RMSNorm runs inside the GEMV after
it and each residual add inside the GEMV before it; otherwise each residual add runs inside the norm
kernel after it. The fused weights are the only copy: `q_proj.weight` etc. are views into them (see
`fuse_linears`), so HF names still load and save, and parameter counts stay right. `forward` keeps the
plain reference math.

The blocks are reused unchanged (with `causal=False`) by the Mask-Predict family.
"""

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from declab_arch import quant_linear, tensor_parallel
from declab_arch.checkpoint import CheckpointError, assign_weights, check_fields, config_from_dict, load_weights, parse_config, read_json
from declab_kernels import gemv, paged_attention, persistent_step, rmsnorm, tuning
from declab_kernels import rotary as rotary_kernels
from declab_kernels.gemv import fusions

@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        check_fields(self)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}"
            )


@dataclass
class PagedBatch:
    """Where a packed forward reads and writes K/V: tensors only, built by the decoder's cache."""

    k_cache: torch.Tensor  # [L, num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [L, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, valid K/V positions after this forward's tokens are written
    slot_mapping: torch.Tensor | None  # [N] int64, cache slot of each packed token (None in decode: the attention finds it)
    decode: bool  # one query per sequence (N == B)
    causal: bool = True
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32, prefill only
    max_seqlen_q: int = 1
    impl: str = "ref"
    workspace: dict | None = field(default=None, repr=False)
    # [L, num_blocks, block_size, Hkv] int8 row exponents of fp8 caches (declab_kernels.paged_attention)
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def scales(self, layer: int):
        """The `scales=` argument of the paged attention calls for `layer` (None unless the cache is fp8)."""
        return None if self.k_scale is None else (self.k_scale[layer], self.v_scale[layer])


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of out_features, in] (and bias) holding the linears' weights in order.

    Each linear's parameters become views into it (same Parameter objects, so names, optimisers
    and `copy_` into them keep working) and the separate copies are freed.
    """
    with torch.no_grad():
        weight = torch.cat([lin.weight.data for lin in linears])
        bias = torch.cat([lin.bias.data for lin in linears]) if linears[0].bias is not None else None
        start = 0
        for lin in linears:
            end = start + lin.out_features
            lin.weight.data = weight[start:end]
            if bias is not None:
                lin.bias.data = bias[start:end]
            start = end
    return weight, bias


class FusedLinears(nn.Module):
    """A module whose projections `FUSED = {name: (linear names)}` share one weight each.

    `fuse` runs at construction and again after every `.to()`/`.cuda()`/`.half()` (`_apply`), which
    converts each parameter into its own new tensor and so would otherwise undo the sharing.
    """

    FUSED: dict[str, tuple[str, ...]] = {}

    def fuse(self):
        for name, parts in self.FUSED.items():
            linears = [getattr(self, p) for p in parts]
            # Quantised parts (`declab_arch.quant_linear`) fuse into one weight object of their rows.
            fuse = fuse_linears if isinstance(linears[0].weight, torch.Tensor) else quant_linear.fuse_rows
            weight, bias = fuse(*linears)
            # Plain attributes, not parameters or buffers: the parameters are the views.
            setattr(self, f"{name}_weight", weight)
            setattr(self, f"{name}_bias", bias)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fuse()
        return self


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as HF does), scaled in the input's dtype, or in the weight's with
    `weight_dtype_out` (a float32 residual stream feeding bf16 layers, as in Mamba-2)."""

    def __init__(self, dim: int, eps: float, *, weight_dtype_out: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_dtype_out = weight_dtype_out

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(self.weight.dtype if self.weight_dtype_out else x.dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """[D/2] inverse frequencies, with the Llama-3 rule when `rope_scaling` says so."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind != "default":
        raise CheckpointError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq.float()


class Rotary(nn.Module):
    """cos/sin tables for positions [0, max_position_embeddings), built once on the model's device."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.cos = self.sin = None

    def tables(self):
        """cos, sin [P, D/2] float32, built on first use (on the device of `inv_freq`)."""
        if self.cos is None or self.cos.device != self.inv_freq.device:
            pos = torch.arange(self.max_positions, device=self.inv_freq.device, dtype=torch.float32)
            angles = torch.outer(pos, self.inv_freq)  # [P, D/2]
            self.cos, self.sin = angles.cos(), angles.sin()
        return self.cos, self.sin

    def forward(self, x, positions):
        """x [..., H, D] at `positions` [...] (HF's rotate-half convention)."""
        cos, sin = self.tables()
        cos = cos[positions].unsqueeze(-2)  # [..., 1, D/2]
        sin = sin[positions].unsqueeze(-2)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(FusedLinears):
    FUSED = {"qkv": ("q_proj", "k_proj", "v_proj")}
    # Tensor parallel (`declab_arch.tensor_parallel`): the ranks the o-projection's partial sums are
    # reduced over on the fused path; None on one process.
    tp = None

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.fuse()

    def qkv(self, x, positions, rotary):
        """x [..., d] -> q [..., Hq, D], k and v [..., Hkv, D], with RoPE applied to q and k."""
        q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        return rotary(q, positions), rotary(k, positions), v

    def forward(self, x, positions, rotary, causal: bool):
        """Contiguous attention over x [B, T, d] at positions [B, T]."""
        q, k, v = self.qkv(x, positions, rotary)
        group = self.n_heads // self.n_kv
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    def forward_paged(self, x, positions, rotary, batch: PagedBatch, layer: int, *, pre=None, post=None):
        """Packed tokens x [N, d]: write their K/V into the pages, attend through the block table.
        `pre` / `post`: the fusions of the q/k/v and o projections (`declab_kernels.gemv.linear`), e.g. the
        block's input norm and the residual add (then x is the residual stream)."""
        impl = batch.impl
        # The projections on either side of the decode attention load more weight tiles before their
        # PDL wait (`tuning.EARLY_TILES_BESIDE_LATENCY`).
        tiles = tuning.EARLY_TILES_BESIDE_LATENCY if batch.decode else tuning.EARLY_TILES
        qkv = gemv.linear(x, self.qkv_weight, self.qkv_bias, pre=pre, impl=impl, early_tiles=tiles)
        q, k, v = qkv.unflatten(-1, (self.n_heads + 2 * self.n_kv, self.head_dim)).split([self.n_heads, self.n_kv, self.n_kv], dim=-2)
        k_cache, v_cache = batch.k_cache[layer], batch.v_cache[layer]
        # an fp8 cache's row exponents (None otherwise)
        scales = batch.scales(layer)
        cos, sin = rotary.tables()
        if batch.decode:
            # The decode kernel rotates q and k and writes the new K/V row itself.
            out = paged_attention.paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, self.scale, impl=impl, workspace=batch.workspace,
                rope=(k, v, cos, sin), scales=scales,
            )
        else:
            rotary_kernels.apply_rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, batch.slot_mapping, impl=impl,
                                                 scales=scales)
            out = paged_attention.paged_prefill_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, self.scale,
                causal=batch.causal, impl=impl, max_seqlen_q=batch.max_seqlen_q, scales=scales,
            )
        return gemv.linear(out.flatten(-2), self.o_proj.weight, post=post, impl=impl, early_tiles=tiles)


class MLP(FusedLinears):
    FUSED = {"gate_up": ("gate_proj", "up_proj")}
    # Tensor parallel: the ranks down's partial sums are reduced over on the fused path (see Attention).
    tp = None

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.fuse()

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_paged(self, x, *, impl, pre=None, post=None):
        """Packed rows x [N, d]: gate and up as one projection with SwiGLU after it, then down; `pre` goes
        with gate/up, `post` with down (`declab_kernels.gemv.linear`)."""
        act = gemv.linear(x, self.gate_up_weight, pre=pre, post=fusions.SwiGLU(), impl=impl)
        return gemv.linear(act, self.down_proj.weight, post=post, impl=impl)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, attend):
        """`attend(normed_x) -> attention output`; the residual structure is shared by both paths."""
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x, h, attend, next_norm: RMSNorm, *, impl: str, fold: bool):
        """One block of the packed forward: x [N, d] the residual stream. With `fold` every norm runs
        inside the GEMV after it and every residual add inside the GEMV before it (four GEMV launches,
        no norm kernel; h unused); else h = input_layernorm(x) comes in and each residual add runs
        inside the norm kernel after it (`fusions.AddRMSNorm`). Returns (x_out, next_norm(x_out) or None).
        Under tensor parallel the o and down projections' partial sums are all-reduced before each add."""
        attn, mlp, post_ln = self.self_attn, self.mlp, self.post_attention_layernorm
        if fold:
            inln = self.input_layernorm
            x = attend(x, fusions.RMSNorm(inln.weight, inln.eps), fusions.Residual(x, reduce_of(attn)))
            return mlp.forward_paged(x, pre=fusions.RMSNorm(post_ln.weight, post_ln.eps),
                                     post=fusions.Residual(x, reduce_of(mlp)), impl=impl), None
        h, x = attend(h, None, fusions.AddRMSNorm(x, post_ln.weight, post_ln.eps, reduce_of(attn)))
        h, x = mlp.forward_paged(h, post=fusions.AddRMSNorm(x, next_norm.weight, next_norm.eps, reduce_of(mlp)), impl=impl)
        return x, h


def reduce_of(module):
    """The all-reduce of a module's row-parallel projection under tensor parallel (`module.tp`), else None."""
    return None if module.tp is None else module.tp.reduce


class Trunk(nn.Module):
    """Embedding, blocks and final norm (HF's `model.` prefix)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    # Tensor parallel (`declab_arch.tensor_parallel`): set on each rank's share; None on one process.
    tp = None

    def __init__(self, config: LlamaConfig, *, causal: bool = True):
        super().__init__()
        self.config = config
        self.causal = causal
        self.model = Trunk(config)
        self.rotary = Rotary(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def head_weight(self):
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def head(self, h):
        return F.linear(self.model.norm(h), self.head_weight)

    def hidden(self, tokens, positions=None):
        """Final hidden states [B, T, d] before the norm, contiguous attention."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        x = self.model.embed_tokens(tokens)
        for block in self.model.layers:
            x = block(x, lambda h, b=block: b.self_attn(h, positions, self.rotary, self.causal))
        return x

    def forward(self, tokens):
        """Logits [B, T, V] of one parallel forward."""
        return self.head(self.hidden(tokens))

    def forward_paged(self, tokens, positions, batch: PagedBatch, logit_index=None, *, return_hidden: bool = False):
        """Packed tokens [N] at positions [N]; logits [len(logit_index), V] (all N if None), and with
        `return_hidden` the final hidden states of those rows before the norm (draft heads read them).
        Up to `tuning.FOLD_ROWS` rows (either impl) the norms and residual adds fold into the
        GEMVs (`Block.forward_paged`); the head reads only the rows in `logit_index`."""
        impl = batch.impl
        layers = self.model.layers
        x = self.model.embed_tokens(tokens)  # [N, d], the residual stream
        fold = x.shape[0] <= tuning.FOLD_ROWS
        first = layers[0].input_layernorm
        h = None if fold else rmsnorm.rms_norm(x, first.weight, first.eps, impl=impl)
        for i, block in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = block.forward_paged(x, h, lambda inp, pre, post, b=block, i=i: b.self_attn.forward_paged(
                inp, positions, self.rotary, batch, i, pre=pre, post=post), next_norm, impl=impl, fold=fold)
        if logit_index is not None:
            x = x[logit_index]
            h = None if fold else h[logit_index]
        final = self.model.norm
        if fold:
            logits = gemv.linear(x, self.head_weight, pre=fusions.RMSNorm(final.weight, final.eps), impl=impl)
        else:
            logits = gemv.linear(h, self.head_weight, impl=impl)
        return (logits, x) if return_hidden else logits

    def persistent_step(self, batch: PagedBatch, *, programs: int | None = None, delay_ns: int = 0,
                        timeline: bool = False) -> persistent_step.PersistentStep:
        """The whole decode forward of one sequence as one kernel (`declab_kernels.persistent_step`) over
        the cache, block table (row 0) and decode workspace of `batch`, on this model's weights in place."""
        c = self.config
        if c.attention_bias:
            raise ValueError("the persistent step has no q/k/v biases")
        ws = batch.workspace
        layers = [persistent_step.LayerWeights(qkv=b.self_attn.qkv_weight, o=b.self_attn.o_proj.weight, gate_up=b.mlp.gate_up_weight,
                                               down=b.mlp.down_proj.weight, input_norm=b.input_layernorm.weight,
                                               post_norm=b.post_attention_layernorm.weight) for b in self.model.layers]
        shape = persistent_step.StepShape(d_model=c.hidden_size, inter=c.intermediate_size, vocab=c.vocab_size, n_layers=c.num_hidden_layers,
                                          hq=c.num_attention_heads, hkv=c.num_key_value_heads, head_dim=c.head_dim,
                                          num_splits=ws.num_splits)
        cos, sin = self.rotary.tables()
        return persistent_step.PersistentStep(
            layers, embed=self.model.embed_tokens.weight, head=self.head_weight, final_norm=self.model.norm.weight, eps=c.rms_norm_eps,
            shape=shape, k_cache=batch.k_cache, v_cache=batch.v_cache, block_table=batch.block_tables[0], cos=cos, sin=sin,
            workspace=ws, scale=self.model.layers[0].self_attn.scale, programs=programs, delay_ns=delay_ns, timeline=timeline)

    def init_random(self, seed: int = 0):
        """Random weights with the usual 0.02-std normal init (norms at 1), deterministic in `seed`."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return self


# The name a saved config.json gives the lab family (`declab_family`).
FAMILY = "transformer"
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def config_from_hf(hf: dict, source: str) -> LlamaConfig:
    """Our LlamaConfig from an HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    for key in required:
        if key not in hf:
            raise CheckpointError(f"{source}: config.json has no field {key}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_pos = hf.get("max_position_embeddings", 8192)
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True) and window < max_pos:
        # Sliding-window attention is not implemented: limit the context to the window, where it is exact.
        max_pos = window
    model_type = hf.get("model_type", "llama")
    return LlamaConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=rope if kind != "default" else None,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
        attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )


def detects(hf: dict) -> bool:
    """Whether an HF config.json describes a causal Llama/Qwen2/Mistral model."""
    # A Llama-shaped masked-diffusion model (LLaDA style) is bidirectional: not this family.
    if hf.get("mask_token_id") is not None or hf.get("is_causal") is False:
        return False
    archs = hf.get("architectures") or []
    return any(a in HF_ARCHITECTURES for a in archs) or hf.get("model_type") in ("llama", "qwen2", "mistral")


def read_config(folder: Path) -> LlamaConfig:
    """The config of a Llama/Qwen2/Mistral checkpoint folder, checked, without reading its weights."""
    folder = Path(folder)
    hf = read_json(folder / "config.json")
    if not detects(hf):
        raise CheckpointError(f"{folder}: unknown architecture {hf.get('architectures') or hf.get('model_type')}")
    return parse_config(config_from_hf, hf, str(folder))


def load(folder: Path, tensors: dict | None = None) -> tuple[LlamaConfig, Llama]:
    """Config and model of a Llama/Qwen2/Mistral checkpoint folder (HF names); `tensors`: the folder's
    tensors already read (a quantised folder's, `declab_arch.quant.read_checkpoint`)."""
    folder = Path(folder)
    config = read_config(folder)
    tensors = load_weights(folder) if tensors is None else tensors
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    # Buffers HF may save that the lab recomputes.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    return config, build(config, tensors, str(folder))


def save(model: Llama, folder: Path) -> None:
    """An HF-style Llama folder (config.json + model.safetensors) that also names the lab family, so
    `decoders.load(folder)` and transformers both read it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = {"declab_family": FAMILY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", **asdict(model.config)}
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


def build(config: LlamaConfig, tensors: dict | None, source: str, *, causal: bool = True, seed: int = 0) -> Llama:
    """A Llama on the CPU in float32, with `tensors` assigned (checked) or random weights."""
    model = Llama(config, causal=causal)
    if tensors is None:
        return model.init_random(seed)
    assign_weights(model, tensors, source)
    return model


def preset_config(values: dict, source: str) -> LlamaConfig:
    return config_from_dict(LlamaConfig, values, source)


# Tensor parallel (`declab_arch.tensor_parallel`): query and KV heads split over the ranks (q/k/v rows, o_proj
# columns; the paged cache holds the rank's KV heads), the MLP width (gate/up rows, down columns) and the
# vocabulary; the norms replicated.
def tp_config(config: LlamaConfig, n: int) -> LlamaConfig:
    names = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    return replace(config, **tensor_parallel.divided(config, n, *names))


def tp_plan(config: LlamaConfig, n: int) -> dict:
    c, split = config, tensor_parallel.split
    q, kv, inner = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    attn, mlp = "model.layers.*.self_attn.", "model.layers.*.mlp."
    return {
        "model.embed_tokens.weight": split(c.vocab_size, n),
        "lm_head.weight": split(c.vocab_size, n),
        attn + "q_proj.*": split(q, n),
        **{attn + name: split(kv, n) for name in ("k_proj.*", "v_proj.*")},
        attn + "o_proj.weight": split(q, n, dim=1),
        **{mlp + name: split(inner, n) for name in ("gate_proj.weight", "up_proj.weight")},
        mlp + "down_proj.weight": split(inner, n, dim=1),
    }


def tp_adopt(model: Llama, config: LlamaConfig, local: LlamaConfig, group) -> None:
    for block in model.model.layers:
        block.self_attn.n_heads, block.self_attn.n_kv = local.num_attention_heads, local.num_key_value_heads
        # The fused q/k/v and gate/up weights are rebuilt from the rank's slices of each part.
        block.self_attn.fuse()
        block.mlp.fuse()
