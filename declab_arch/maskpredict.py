"""Mask-Predict model: a bidirectional Llama-style transformer trained as a conditional masked LM
(Ghazvininejad et al. 2019) or a masked-diffusion LM (LLaDA, Nie et al. 2025); its training
objective, its checkpoint formats.

The blocks are `declab_arch.llama`'s, run with `causal=False`. What is added:

- a mask token (`mask_token_id`): the model predicts the token under every masked position;
- an optional length head: a linear map from the mean of the prompt's final (normed) hidden states
  to logits over target lengths 0..max_predicted_length (Mask-Predict's length prediction);
- attention by segments: `hidden(tokens, segments=...)` lets position i see position j only when
  segments[j] <= segments[i]. With segment 0 for the prompt and k+1 for the k-th canvas block this is
  exactly what the cached decoder computes (the prompt and finished blocks never see later tokens,
  so their K/V is computed once); without segments attention is fully bidirectional (LLaDA);
- the model's distribution over tokens never includes the mask token (`token_log_probs`);
- two training objectives: `masked_diffusion_loss` (LLaDA's, over whole sequences) and `block_loss`
  (what decoding sees: a clean prompt, then a masked block that ends the sequence).

Checkpoints: the lab's own format (`config.json` with `"declab_family": "maskpredict"` plus the
`MaskPredictConfig` fields, and `model.safetensors`), and LLaDA-style bidirectional Llama weights
whose config says it is a masked-diffusion model (`model_type: llada`, or a Llama config with
`mask_token_id`): in HF Llama names and fields, or in LLaDA's own OLMo-style names and fields
(`d_model`, `model.transformer.blocks.N.q_proj.weight`, ...).
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from declab_arch import llama
from declab_arch.checkpoint import CheckpointError, assign_weights, config_from_dict, load_weights, parse_config, read_json

FAMILY = "maskpredict"


@dataclass
class MaskPredictConfig(llama.LlamaConfig):
    mask_token_id: int | None = None
    # Largest target length the length head predicts (classes 0..max); 0 means no length head.
    max_predicted_length: int = 0
    # Fields `check_fields` lets be 0 (no length head).
    ZERO_OK: ClassVar[tuple[str, ...]] = ("max_predicted_length",)

    def __post_init__(self):
        super().__post_init__()
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"mask_token_id must be a token id below vocab_size {self.vocab_size}, got {self.mask_token_id}")
        if self.max_predicted_length < 0:
            raise CheckpointError(f"max_predicted_length must be >= 0, got {self.max_predicted_length}")


class MaskPredictLM(llama.Llama):
    """`declab_arch.llama.Llama` without the causal mask, plus the length head."""

    def __init__(self, config: MaskPredictConfig):
        super().__init__(config, causal=False)
        if config.max_predicted_length:
            self.length_head = nn.Linear(config.hidden_size, config.max_predicted_length + 1)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def hidden(self, tokens, positions=None, segments=None):
        """Final hidden states [B, T, d] before the norm; `segments` [B, T] restricts attention (see module doc)."""
        if segments is None:
            return super().hidden(tokens, positions)
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        # [B, 1, Tq, Tk]: query i sees key j when j's segment is not after i's.
        visible = (segments[:, None, :] <= segments[:, :, None]).unsqueeze(1)
        x = self.model.embed_tokens(tokens)
        for block in self.model.layers:
            x = block(x, lambda h, a=block.self_attn: segment_attention(a, h, positions, self.rotary, visible))
        return x

    def forward(self, tokens, segments=None):
        """Logits [B, T, V] of one parallel forward (bidirectional, or by segments)."""
        return self.head(self.hidden(tokens, segments=segments))

    def hidden_paged(self, tokens, positions, batch: llama.PagedBatch):
        """Packed tokens [N] at positions [N]: write their K/V into the pages; hidden states [N, d] before the norm."""
        x = self.model.embed_tokens(tokens)
        for i, block in enumerate(self.model.layers):
            x = block(x, lambda h, b=block, i=i: b.self_attn.forward_paged(h, positions, self.rotary, batch, i))
        return x

    def length_logits(self, hidden, owner, count: int):
        """Logits [count, max_predicted_length + 1] over target lengths from the mean normed hidden state
        of each prompt; hidden [N, d] packed, owner [N] the prompt index of each row."""
        normed = self.model.norm(hidden).float()
        pooled = torch.zeros(count, normed.shape[-1], device=hidden.device).index_add_(0, owner, normed)
        size = torch.zeros(count, device=hidden.device).index_add_(0, owner, torch.ones_like(owner, dtype=torch.float32))
        return self.length_head((pooled / size.clamp(min=1)[:, None]).to(hidden.dtype)).float()


def segment_attention(attn: llama.Attention, x, positions, rotary, visible):
    """`declab_arch.llama.Attention` over x [B, T, d] with a boolean mask visible [B, 1, T, T]."""
    q, k, v = attn.qkv(x, positions, rotary)
    group = attn.n_heads // attn.n_kv
    # [B, H, T, D]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).flatten(-2))


def token_log_probs(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Float32 log-probabilities [..., V] of the model's token distribution: the mask token excluded."""
    logits = logits.float().clone()
    logits[..., mask_token_id] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def masked_diffusion_loss(model: MaskPredictLM, tokens: torch.Tensor, prompt_lens=None, generator=None, eps: float = 1e-3):
    """Masked-diffusion training loss of `tokens` [B, T] (LLaDA's objective; a CMLM with a random ratio).

    1. per sequence draw a mask ratio t ~ U(eps, 1) (eps keeps 1/t finite);
    2. mask each token with probability t (the prompt, the first prompt_lens[b] tokens, stays clean);
    3. one forward; when there is a prompt, it sees only itself (segments 0 and 1, as the cached
       decoder computes it) and the continuation sees everything;
    4. cross-entropy on the masked tokens, weighted by 1/t, averaged over each sequence's maskable
       tokens and over the batch: an estimate of the negative ELBO per token;
    5. with a length head and a prompt: plus the cross-entropy of the continuation's length
       (clipped to max_predicted_length) predicted from the prompt.
    """
    B, T = tokens.shape
    dev = tokens.device
    pos = torch.arange(T, device=dev).expand(B, T)
    prompt = torch.zeros(B, dtype=torch.long, device=dev) if prompt_lens is None else torch.as_tensor(prompt_lens, device=dev)
    maskable = pos >= prompt[:, None]
    t = eps + (1 - eps) * torch.rand(B, generator=generator, device=dev)
    masked = maskable & (torch.rand(B, T, generator=generator, device=dev) < t[:, None])
    noisy = torch.where(masked, model.mask_token_id, tokens)
    segments = maskable.long() if prompt_lens is not None else None
    hidden = model.hidden(noisy, segments=segments)
    logp = token_log_probs(model.head(hidden), model.mask_token_id)
    nll = -logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    per_seq = (nll * masked).sum(1) / t / maskable.sum(1).clamp(min=1)
    loss = per_seq.mean()
    if prompt_lens is not None and model.config.max_predicted_length:
        rows = (~maskable).nonzero()
        logits = model.length_logits(hidden[rows[:, 0], rows[:, 1]], rows[:, 0], B)
        target = (T - prompt).clamp(max=model.config.max_predicted_length)
        loss = loss + F.cross_entropy(logits, target)
    return loss


def draw_blocks(B: int, T: int, max_block: int | None, generator=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lengths p [B] ~ U{1..T-1} and block lengths L [B] ~ U{1..min(max_block, T-p)} of `block_loss`."""
    prompt = torch.randint(1, T, (B,), generator=generator, device=device)
    room = (T - prompt).clamp(max=max_block or T)
    length = 1 + (torch.rand(B, generator=generator, device=device) * room).long().clamp(max=room - 1)
    return prompt, length


def block_loss(model: MaskPredictLM, tokens: torch.Tensor, *, max_block: int | None = None, bidirectional: float = 0.0,
               generator=None, eps: float = 1e-3):
    """Masked-diffusion loss of `tokens` [B, T] as decoding sees them: a clean prompt, then one masked
    block that ends the visible sequence (the canvas).

    1. per sequence draw a prompt length p and a block length L (`draw_blocks`) and a mask ratio
       t ~ U(eps, 1); mask each block token with probability t;
    2. the tokens after the block are hidden: nothing before them sees them and they are not scored,
       so the block is the end of the sequence, as the canvas is at inference (a packed window
       almost never shows that otherwise);
    3. the prompt sees only itself, as the prefix cache computes it (segments 0 prompt, 1 block, 2
       hidden); in a `bidirectional` share of the sequences the prompt also sees the block
       (decoding and scoring with prefix_cache=False);
    4. cross-entropy on the masked tokens, weighted by 1/t, averaged over each block and the batch:
       an estimate of the negative ELBO per block token. No length head is trained here.
    """
    B, T = tokens.shape
    dev = tokens.device
    pos = torch.arange(T, device=dev).expand(B, T)
    prompt, length = draw_blocks(B, T, max_block, generator, dev)
    in_block = (pos >= prompt[:, None]) & (pos < (prompt + length)[:, None])
    t = eps + (1 - eps) * torch.rand(B, generator=generator, device=dev)
    masked = in_block & (torch.rand(B, T, generator=generator, device=dev) < t[:, None])
    open_prompt = torch.rand(B, generator=generator, device=dev) < bidirectional
    # [B, T] 0 prompt, 1 block, 2 hidden tail; an open prompt shares the block's segment.
    segments = (pos >= prompt[:, None]).long() + (pos >= (prompt + length)[:, None]).long()
    segments = torch.where(open_prompt[:, None] & (segments == 0), 1, segments)
    noisy = torch.where(masked, model.mask_token_id, tokens)
    logp = token_log_probs(model(noisy, segments=segments), model.mask_token_id)
    nll = -logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return ((nll * masked).sum(1) / t / length).mean()


def detects(hf: dict) -> bool:
    """Whether a config.json is the lab's own Mask-Predict format or a masked-diffusion model's."""
    return hf.get("declab_family") == FAMILY or is_masked_diffusion(hf)


def is_masked_diffusion(hf: dict) -> bool:
    """Whether an HF config.json describes a bidirectional masked-diffusion model (LLaDA-style)."""
    archs = [str(a) for a in hf.get("architectures") or []]
    if hf.get("model_type") == "llada" or any(a.startswith("LLaDA") for a in archs):
        return True
    # A Llama-family config marked as masked diffusion (not via `llama.detects`, which should refuse these).
    llama_like = any(a in llama.HF_ARCHITECTURES for a in archs) or hf.get("model_type") in set(llama.HF_ARCHITECTURES.values())
    return llama_like and (hf.get("mask_token_id") is not None or hf.get("is_causal") is False)


def config_from_hf(hf: dict, source: str) -> MaskPredictConfig:
    """Our config from a LLaDA-style config.json written with HF Llama field names."""
    if hf.get("mask_token_id") is None:
        raise CheckpointError(f"{source}: config.json has no mask_token_id (a masked-diffusion model needs one)")
    base = llama.config_from_hf(hf, source)
    return MaskPredictConfig(**dataclasses.asdict(base), mask_token_id=int(hf["mask_token_id"]))


# LLaDA's own checkpoints name the same Llama block in OLMo's terms.
LLADA_NAMES = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}
LLADA_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
}


def config_from_llada(hf: dict, source: str) -> MaskPredictConfig:
    """Our config from LLaDA's own config.json (OLMo-style fields: d_model, n_layers, ...)."""
    for key in ("d_model", "n_layers", "n_heads", "mlp_hidden_size", "vocab_size", "mask_token_id"):
        if hf.get(key) is None:
            raise CheckpointError(f"{source}: config.json has no field {key}")
    for key, want in (("activation_type", "silu"), ("layer_norm_type", "rms"), ("block_type", "llama")):
        if hf.get(key, want) != want:
            raise CheckpointError(f"{source}: {key} {hf[key]!r} is not supported ({want} only)")
    for key in ("include_bias", "input_emb_norm", "scale_logits", "clip_qkv", "attention_layer_norm", "alibi"):
        if hf.get(key):
            raise CheckpointError(f"{source}: {key}={hf[key]!r} is not supported")
    return MaskPredictConfig(
        vocab_size=hf.get("embedding_size") or hf["vocab_size"],
        hidden_size=hf["d_model"],
        intermediate_size=hf["mlp_hidden_size"],
        num_hidden_layers=hf["n_layers"],
        num_attention_heads=hf["n_heads"],
        num_key_value_heads=hf.get("n_kv_heads") or hf["n_heads"],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=hf.get("max_sequence_length", 4096),
        tie_word_embeddings=bool(hf.get("weight_tying", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        mask_token_id=int(hf["mask_token_id"]),
    )


def rename_llada(tensors: dict, source: str) -> dict:
    """LLaDA's tensor names (model.transformer.blocks.N.q_proj.weight, ...) as HF Llama's."""
    out = {}
    for name, t in tensors.items():
        if name in LLADA_NAMES:
            out[LLADA_NAMES[name]] = t
            continue
        parts = name.split(".")
        if parts[:3] != ["model", "transformer", "blocks"] or len(parts) != 6 or parts[4] not in LLADA_BLOCK_NAMES:
            raise CheckpointError(f"{source}: unexpected tensor {name} for a LLaDA checkpoint")
        out[f"model.layers.{parts[3]}.{LLADA_BLOCK_NAMES[parts[4]]}.{parts[5]}"] = t
    return out


def build(config: MaskPredictConfig, tensors: dict | None, source: str, *, seed: int = 0) -> MaskPredictLM:
    """A MaskPredictLM on the CPU in float32, with `tensors` assigned (checked) or random weights."""
    model = MaskPredictLM(config)
    if tensors is None:
        return model.init_random(seed)
    assign_weights(model, tensors, source)
    return model


def preset_config(values: dict, source: str) -> MaskPredictConfig:
    return config_from_dict(MaskPredictConfig, values, source)


def read_config(folder: Path) -> MaskPredictConfig:
    """The config of a Mask-Predict folder (the lab's own format or LLaDA-style), checked, without its weights."""
    folder = Path(folder)
    hf = read_json(folder / "config.json")
    source = str(folder)
    if hf.get("declab_family") is not None:
        if hf["declab_family"] != FAMILY:
            raise CheckpointError(f"{source}: a {hf['declab_family']} checkpoint, not {FAMILY}")
        return config_from_dict(MaskPredictConfig, {k: v for k, v in hf.items() if k not in ("declab_family", "quantization")}, source)
    if not is_masked_diffusion(hf):
        raise CheckpointError(f"{source}: config.json does not describe a masked-diffusion model (no mask_token_id, model_type {hf.get('model_type')!r})")
    return parse_config(config_from_llada if "d_model" in hf else config_from_hf, hf, source)


def load(folder: Path, tensors: dict | None = None) -> tuple[MaskPredictConfig, MaskPredictLM]:
    """Config and model of a checkpoint folder: the lab's own format or LLaDA-style HF Llama weights;
    `tensors`: the folder's tensors already read (a quantised folder's)."""
    folder = Path(folder)
    source = str(folder)
    config = read_config(folder)
    hf = read_json(folder / "config.json")
    tensors = load_weights(folder) if tensors is None else tensors
    if hf.get("declab_family") is not None:
        return config, build(config, tensors, source)
    if "d_model" in hf:
        tensors = rename_llada(tensors, source)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    return config, build(config, tensors, source)


def save(model: MaskPredictLM, folder: Path) -> None:
    """Write `model` in the lab's own format: config.json (+ declab_family) and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = {"declab_family": FAMILY, **dataclasses.asdict(model.config)}
    (folder / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
