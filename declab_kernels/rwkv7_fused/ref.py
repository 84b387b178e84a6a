"""Fused elementwise steps of one RWKV-7 decode step: float32 PyTorch reference.

Each function is one Triton kernel in `triton.py`; together with the GEMMs and the WKV-7 step they
make a whole decode step. Rows are sequences of the batch (`[B, C]`, C = H * D channels).

1. `add_norm_shift`: residual add, LayerNorm, token shift and the learned mixes:
       x <- x + delta;  h = LN(x);  out_m = h + (prev - h) * mix_m;  prev <- h
   (without `prev`: returns h, the plain add + LayerNorm).
2. `lora_hidden`: the LoRA activations of several down-projections laid out block-diagonally, so
   that ONE GEMM against the up-projections concatenated along their inner dimension gives every
   LoRA's output: row block j of the result holds act_j(block j) in columns [off_j, off_j + D_j)
   and zeros elsewhere.
3. `time_mix_inputs`: decay, in-context learning rate, value residual, key normalisation and the
   key's k_a mix, from the projections and the LoRA up-projections:
       w = -exp(-0.5) sigmoid(u_w + b_w);  iclr = sigmoid(u_a + b_a)
       v = lerp(v, v_first, sigmoid(u_v + b_v))                (when there is a v LoRA)
       kk = normalize(k * k_k) per head;  k = k * (1 + (iclr - 1) * k_a)
   giving the WKV-7 inputs r, w, k, v, a = -kk, b = kk * iclr.
4. `gate_output`: per-head group norm of the WKV output, the r_k bonus and the output gate:
       out = (groupnorm(o) + sum_d(r * k * r_k) v) * g
5. `sqrelu`: relu(x)^2 in place (the channel-mix activation).
"""

import torch
import torch.nn.functional as F

# exp(-0.5): the largest per-token decay rate.
W_SCALE = 0.6065306597126334
# The LoRA activations lora_hidden knows.
ACTS = (None, "tanh", "sigmoid")


def add_norm_shift_ref(x, delta, weight, bias, prev=None, mixes=None, *, eps):
    """x `[B, C]` (set to x + delta when delta is given), LN weight/bias `[C]` (bias may be None).
    With prev `[B, C]` and mixes `[M, C]`: returns `[M, B, C]` and sets prev to h; else h `[B, C]`."""
    if delta is not None:
        x.copy_(x.float() + delta.float())
    h = F.layer_norm(x.float(), x.shape[-1:], weight.float(), None if bias is None else bias.float(), eps).to(x.dtype)
    if prev is None:
        return h
    hf = h.float()
    out = hf + (prev.float() - hf) * mixes.float()[:, None, :]
    prev.copy_(h)
    return out.to(x.dtype)


def lora_hidden_ref(blocks, acts):
    """blocks: NB views `[B, D_j]`; acts: NB of None | "tanh" | "sigmoid". Returns `[NB * B, sum D_j]`
    with act_j(block j) on the block diagonal and zeros elsewhere."""
    B = blocks[0].shape[0]
    widths = [blk.shape[1] for blk in blocks]
    out = torch.zeros(len(blocks) * B, sum(widths), dtype=blocks[0].dtype, device=blocks[0].device)
    col = 0
    for j, (blk, act) in enumerate(zip(blocks, acts)):
        y = blk.float()
        y = {None: y, "tanh": torch.tanh(y), "sigmoid": torch.sigmoid(y)}[act]
        out[j * B : (j + 1) * B, col : col + widths[j]] = y.to(out.dtype)
        col += widths[j]
    return out


def time_mix_inputs_ref(r, k, v, u, bias_w, bias_a, bias_v, k_k, k_a, v_first, *, head_dim):
    """r, k, v `[B, C]`; u `[NB * B, C]` the LoRA up-projections in row blocks (v, w, a, g), or
    (w, a, g) when v_first is None (no value residual). Returns (x `[5, B, C]` in r's dtype holding
    r, k, v, a, b; w `[B, C]` float32)."""
    B, C = r.shape
    blocks = u.float().view(-1, B, C)
    if v_first is not None:
        u_v, blocks = blocks[0], blocks[1:]
    u_w, u_a = blocks[0], blocks[1]
    rf, kf, vf = r.float(), k.float(), v.float()
    w = -W_SCALE * torch.sigmoid(u_w + bias_w.float())
    iclr = torch.sigmoid(u_a + bias_a.float())
    if v_first is not None:
        vf = torch.lerp(vf, v_first.float(), torch.sigmoid(u_v + bias_v.float()))
    kk = F.normalize((kf * k_k.float()).view(B, -1, head_dim), dim=-1).view(B, C)
    kf = kf * (1 + (iclr - 1) * k_a.float())
    return torch.stack([rf, kf, vf, -kk, kk * iclr]).to(r.dtype), w


def gate_output_ref(o, r, k, v, g, r_k, norm_weight, norm_bias, *, eps):
    """o, r, k, v `[B, H, D]`, g `[B, C]`, r_k `[H, D]`, group-norm weight/bias `[C]`. Returns `[B, C]`
    in o's dtype."""
    B, H, D = o.shape
    of = o.float()
    mean = of.mean(-1, keepdim=True)
    var = of.var(-1, unbiased=False, keepdim=True)
    y = ((of - mean) / torch.sqrt(var + eps)).view(B, H * D) * norm_weight.float() + norm_bias.float()
    bonus = ((r.float() * k.float() * r_k.float()).sum(-1, keepdim=True) * v.float()).view(B, H * D)
    return ((y + bonus) * g.float()).to(o.dtype)


def sqrelu_ref(x):
    """relu(x)^2, in place. Returns x."""
    return x.copy_(torch.relu(x.float()).square())
