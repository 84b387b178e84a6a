"""The persistent decode step of a batch-1 RWKV-7 model: the host side of `triton_rwkv7.py`.

    step = RWKV7PersistentStep(layers, embed=..., head=..., final_norm=(w, b), pre_norm=(w, b), eps=..., g_eps=...,
                               shape=RWKV7Shape(...), shift=shift, wkv=wkv)
    logits = step(tokens, positions)     # tokens [1] on the device (positions unused: the state is the past); logits [1, V]

It holds the work list (`schedule_rwkv7.work_list`), the counters, the epoch, the activation buffers
(the residual x [C], the mixed inputs [6, C], the down-projection [3C + R], v_first, the gated output,
the channel mix's input and key output, the final norm's output) and the per-layer pointer table; a
call is one launch that allocates nothing and updates `shift` and `wkv` (the decoder's own state
buffers, row 0) in place, as the graphed step does.
"""

from dataclasses import dataclass

import torch

from declab_kernels.persistent_step import schedule_rwkv7
from declab_kernels.persistent_step.launch import PersistentLaunch, _chunk, _pow2
from declab_kernels.persistent_step.schedule_rwkv7 import RWKV7Shape, RWKV7Tiles
from declab_kernels.persistent_step.triton_rwkv7 import rwkv7_step_kernel

# Columns of the LoRA up-projection a time-mix item multiplies at once ([D, BR] weights).
LORA_CHUNK = 64


@dataclass
class RWKV7LayerWeights:
    """One layer's tensors, used in place (their addresses go into the pointer table, in this order)."""

    mix: torch.Tensor  # [6, C] the token-shift mixes r, k, v, w, a, g
    down: torch.Tensor  # [3C + R, C] r, k, v, then the LoRA down-projections (v,) w, a, g
    up: torch.Tensor  # [C, R] the LoRA up-projections, column blocks (v,) w, a, g
    bias_w: torch.Tensor  # [C]
    bias_a: torch.Tensor  # [C]
    bias_v: torch.Tensor | None  # [C]; None in layer 0 (no value residual)
    k_k: torch.Tensor  # [C]
    k_a: torch.Tensor  # [C]
    r_k: torch.Tensor  # [H, D]
    g_norm_w: torch.Tensor  # [C]
    g_norm_b: torch.Tensor  # [C]
    o_proj: torch.Tensor  # [C, C]
    attn_norm_w: torch.Tensor  # [C]
    attn_norm_b: torch.Tensor | None  # [C]
    ffn_norm_w: torch.Tensor  # [C]
    ffn_norm_b: torch.Tensor | None  # [C]
    ffn_mix: torch.Tensor  # [C] the channel mix's x_k
    key: torch.Tensor  # [I, C]
    value: torch.Tensor  # [C, I]

    def tensors(self):
        # why: layer 0 has no value bias; the kernel masks its load off there, but keeps a real address
        bias_v = self.bias_w if self.bias_v is None else self.bias_v
        return (self.mix, self.down, self.up, self.bias_w, self.bias_a, bias_v, self.k_k, self.k_a, self.r_k, self.g_norm_w,
                self.g_norm_b, self.o_proj, self.attn_norm_w, self.attn_norm_b, self.ffn_norm_w, self.ffn_norm_b, self.ffn_mix,
                self.key, self.value)


class RWKV7PersistentStep(PersistentLaunch):
    """The persistent step of one RWKV-7 model over its states, batch 1.

    `shift` [L, 2, 1, C] (the model dtype) and `wkv` [L, 1, H, D, D] float32; `final_norm` and
    `pre_norm` (None: no pre-norm) are (weight, bias) with bias None when the norms have none.
    `programs`: P (default: the module docstring of `declab_kernels.persistent_step`); `tiles`: the
    tile sizes (default `schedule_rwkv7.choose_tiles` for P); `delay_ns`, `timeline`: the kernel's
    debug constexprs (GPU only).
    """

    kernel = rwkv7_step_kernel

    def __init__(self, layers: list[RWKV7LayerWeights], *, embed, head, final_norm, pre_norm, eps: float, g_eps: float,
                 shape: RWKV7Shape, shift, wkv, programs: int | None = None, tiles: RWKV7Tiles | None = None, delay_ns: int = 0,
                 timeline: bool = False):
        device = embed.device
        self.shape = shape
        dtype = embed.dtype
        L, C, D = shape.n_layers, shape.d_model, shape.head_dim
        has_bias = final_norm[1] is not None
        norms = [final_norm] + ([pre_norm] if pre_norm is not None else []) + [(x.attn_norm_w, x.attn_norm_b) for x in layers]
        norms += [(x.ffn_norm_w, x.ffn_norm_b) for x in layers]
        if any((b is not None) != has_bias for _, b in norms):
            raise ValueError("persistent step: every norm has a bias or none does")
        if C % 8:
            # The GEMV tile loads 16-byte vectors of each mixed input row xs[m] (2C bytes apart).
            raise ValueError(f"persistent step: the hidden size must be a multiple of 8, got {C}")
        if layers[0].bias_v is not None or any(x.bias_v is None for x in layers[1:]):
            raise ValueError("persistent step: layer 0 has no value LoRA and every later layer has one")
        typed = [(t, dtype) for x in layers for t in x.tensors() if t is not None]
        typed += [(t, dtype) for pair in norms for t in pair if t is not None]
        typed += [(head, dtype), (shift, dtype), (wkv, torch.float32)]
        for l, x in enumerate(layers):
            if tuple(x.down.shape) != (shape.n_sel(l), C) or tuple(x.up.shape) != (C, shape.ranks(l)):
                raise ValueError(f"persistent step: layer {l}'s packed weights must be down [{shape.n_sel(l)}, {C}] and up "
                                 f"[{C}, {shape.ranks(l)}], got {tuple(x.down.shape)} and {tuple(x.up.shape)}")
        if tuple(shift.shape) != (L, 2, 1, C) or tuple(wkv.shape) != (L, 1, shape.n_heads, D, D):
            raise ValueError(f"persistent step: states must be shift [{L}, 2, 1, {C}] and wkv [{L}, 1, {shape.n_heads}, {D}, {D}], "
                             f"got {tuple(shift.shape)} and {tuple(wkv.shape)}")
        self._check(layers, typed, device, "weight and state", delay_ns, timeline)
        self.consts = dict(C=C, VOCAB=shape.vocab, H=shape.n_heads, D=D, BD=_pow2(D), INTER=shape.inter, RV=shape.rank_v,
                           RW=shape.rank_w, RA=shape.rank_a, RG=shape.rank_g, BR=min(LORA_CHUNK, _pow2(shape.ranks(1))), BC=_pow2(C),
                           HAS_PRE=pre_norm is not None, HAS_BIAS=has_bias, EMBED_BLOCK=min(1024, _pow2(C)), DELAY=int(delay_ns),
                           TIMELINE=bool(timeline))
        pre = pre_norm or final_norm
        self.args = dict(embed=embed, head=head, final_w=final_norm[0], final_b=final_norm[1] if has_bias else final_norm[0],
                         pre_w=pre[0], pre_b=pre[1] if has_bias else pre[0], shift=shift, wkv=wkv, eps=float(eps), g_eps=float(g_eps))
        self.x = torch.zeros(C, dtype=dtype, device=device)
        self.xs = torch.zeros(6, C, dtype=dtype, device=device)
        self.y = torch.zeros(shape.n_sel(1), dtype=dtype, device=device)
        self.v_first = torch.zeros(C, dtype=dtype, device=device)
        self.mo = torch.zeros(C, dtype=dtype, device=device)
        self.xk = torch.zeros(C, dtype=dtype, device=device)
        self.kv = torch.zeros(shape.inter, dtype=dtype, device=device)
        self.hf = torch.zeros(C, dtype=dtype, device=device)
        self.fixed_tiles = tiles
        self._start(shape.vocab, dtype, schedule_rwkv7.Counters(L).size, programs, timeline)

    def _plan(self, programs: int) -> None:
        """Tiles, work list and timeline buffer for P = programs."""
        shape = self.shape
        self.tiles = t = self.fixed_tiles or schedule_rwkv7.choose_tiles(shape, programs)
        self._set_items(schedule_rwkv7.work_list(shape, t))
        C = shape.d_model
        self.consts.update(BN_SEL=t.sel_rows, BK_SEL=_chunk(t.sel_rows, C), BN_O=t.o_rows, BK_O=_chunk(t.o_rows, C),
                           BN_KEY=t.key_rows, BK_KEY=_chunk(t.key_rows, C), BN_VAL=t.val_rows, BK_VAL=_chunk(t.val_rows, shape.inter),
                           BN_HEAD=t.head_rows, BK_HEAD=_chunk(t.head_rows, C))

    def _launch_args(self, tokens, positions):
        a = self.args
        return (*self._list_args(),
                a["embed"], a["head"], a["final_w"], a["final_b"], a["pre_w"], a["pre_b"], tokens,
                self.x, self.xs, self.y, self.v_first, self.mo, self.xk, self.kv, self.hf, self.logits, a["shift"], a["wkv"],
                a["eps"], a["g_eps"], self.times, self.stall)
