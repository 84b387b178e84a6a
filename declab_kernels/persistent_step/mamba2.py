"""The persistent decode step of a batch-1 Mamba-2 model: the host side of `triton_mamba2.py`.

    step = Mamba2PersistentStep(layers, embed=..., head=..., final_norm=..., eps=..., shape=Mamba2Shape(...),
                                conv=conv, ssm=ssm, dt_limit=(lo, hi))
    logits = step(tokens, positions)     # tokens [1], positions [1] on the device; logits [1, V]

It holds the work list (`schedule_mamba2.work_list`), the counters, the epoch, the activation buffers
(r float32 [d], the in-projection [n_in], y [d_inner], the SSM tiles' sums of squares) and the
per-layer pointer table; a call is one launch that allocates nothing and updates `conv` and `ssm`
(the decoder's own state buffers, row 0) in place, as the graphed step does.
"""

import math
from dataclasses import dataclass

import torch
from triton import next_power_of_2

from declab_kernels.persistent_step import schedule_mamba2
from declab_kernels.persistent_step.launch import PersistentLaunch, _chunk, _pow2
from declab_kernels.persistent_step.schedule_mamba2 import Mamba2Shape, Mamba2Tiles
from declab_kernels.persistent_step.triton_mamba2 import mamba2_step_kernel


@dataclass
class Mamba2LayerWeights:
    """One layer's tensors, used in place (their addresses go into the pointer table, in this order)."""

    in_proj: torch.Tensor  # [2 d_inner + 2 G N + H, d]: z, x, B, C, dt rows
    out_proj: torch.Tensor  # [d, d_inner]
    conv_weight: torch.Tensor  # [conv_dim, W]
    conv_bias: torch.Tensor | None  # [conv_dim]
    dt_bias: torch.Tensor  # [H] float32
    A: torch.Tensor  # [H] float32, -exp(A_log)
    D: torch.Tensor  # [H] float32
    norm: torch.Tensor  # [d], the pre-norm's weight
    gated_norm: torch.Tensor  # [d_inner]

    def tensors(self):
        return (self.in_proj, self.out_proj, self.conv_weight, self.conv_bias, self.dt_bias, self.A, self.D, self.norm, self.gated_norm)


class Mamba2PersistentStep(PersistentLaunch):
    """The persistent step of one Mamba-2 model over its states, batch 1.

    `conv` [L, 1, conv_dim, W] (the model dtype, rings: `declab_kernels.ssd.conv_window_slots`) and
    `ssm` [L, 1, H, P, N] float32; one norm group (the gated norm's statistics over the whole row).
    `programs`: P (default: the module docstring of `declab_kernels.persistent_step`); `tiles`: the
    tile sizes (default `schedule_mamba2.choose_tiles` for P); `delay_ns`, `timeline`: the kernel's
    debug constexprs (GPU only).
    """

    kernel = mamba2_step_kernel

    def __init__(self, layers: list[Mamba2LayerWeights], *, embed, head, final_norm, eps: float, shape: Mamba2Shape, conv, ssm,
                 dt_limit=(0.0, math.inf), programs: int | None = None, tiles: Mamba2Tiles | None = None, delay_ns: int = 0,
                 timeline: bool = False):
        device = embed.device
        self.shape = shape
        dtype = embed.dtype
        has_bias = layers[0].conv_bias is not None
        if any((layer.conv_bias is not None) != has_bias for layer in layers):
            raise ValueError("persistent step: every layer has a conv bias or none does")
        typed = [(t, dtype) for layer in layers for t in (layer.in_proj, layer.out_proj, layer.conv_weight, layer.conv_bias, layer.norm,
                                                           layer.gated_norm) if t is not None]
        typed += [(t, torch.float32) for layer in layers for t in (layer.dt_bias, layer.A, layer.D)]
        typed += [(head, dtype), (final_norm, dtype), (conv, dtype), (ssm, torch.float32)]
        L, H, P, N, W = shape.n_layers, shape.nheads, shape.headdim, shape.d_state, shape.d_conv
        if tuple(conv.shape) != (L, 1, shape.conv_dim, W) or tuple(ssm.shape) != (L, 1, H, P, N):
            raise ValueError(f"persistent step: states must be conv [{L}, 1, {shape.conv_dim}, {W}] and ssm [{L}, 1, {H}, {P}, {N}], "
                             f"got {tuple(conv.shape)} and {tuple(ssm.shape)}")
        self._check(layers, typed, device, "weight and state", delay_ns, timeline)
        lo, hi = dt_limit
        self.consts = dict(D_MODEL=shape.d_model, VOCAB=shape.vocab, H=H, P=P, N=N, G=shape.ngroups, W=W,
                           BLOCK_N=_pow2(N), BLOCK_W=_pow2(W), HAS_BIAS=has_bias, HAS_LIMIT=(lo, hi) != (0.0, math.inf),
                           EMBED_BLOCK=min(1024, _pow2(shape.d_model)), DELAY=int(delay_ns), TIMELINE=bool(timeline))
        # The kernel clamps with finite numbers: an infinite bound is the float32 maximum.
        self.limit = (float(lo), min(float(hi), torch.finfo(torch.float32).max))
        self.args = dict(embed=embed, head=head, final_norm=final_norm, conv=conv, ssm=ssm, eps=float(eps))
        self.r = torch.zeros(shape.d_model, dtype=torch.float32, device=device)
        self.zx = torch.zeros(shape.n_in, dtype=dtype, device=device)
        self.y = torch.zeros(shape.d_inner, dtype=dtype, device=device)
        self.fixed_tiles = tiles
        self._start(shape.vocab, dtype, schedule_mamba2.Counters(L).size, programs, timeline)

    def _plan(self, programs: int) -> None:
        """Tiles, work list, sums-of-squares and timeline buffers for P = programs."""
        shape = self.shape
        self.tiles = t = self.fixed_tiles or schedule_mamba2.choose_tiles(shape, programs)
        self._set_items(schedule_mamba2.work_list(shape, t))
        n_ssm = schedule_mamba2.stage_tiles(shape, t)[schedule_mamba2.SSM]
        self.ss = torch.zeros(n_ssm, dtype=torch.float32, device=self.device)
        self.consts.update(BLOCK_P=t.block_p, N_SSM=n_ssm, SS_PAD=next_power_of_2(n_ssm),
                           BN_IN=t.in_rows, BK_IN=_chunk(t.in_rows, shape.d_model), BN_OUT=t.out_rows, BK_OUT=_chunk(t.out_rows, shape.d_inner),
                           BN_HEAD=t.head_rows, BK_HEAD=_chunk(t.head_rows, shape.d_model))

    def _launch_args(self, tokens, positions):
        a = self.args
        conv, ssm = a["conv"], a["ssm"]
        return (*self._list_args(),
                a["embed"], a["head"], a["final_norm"], tokens, positions,
                self.r, self.zx, self.y, self.ss, self.logits, conv, ssm,
                conv.stride(0), conv.stride(2), conv.stride(3), ssm.stride(0), ssm.stride(2), ssm.stride(3),
                a["eps"], self.limit[0], self.limit[1], self.times, self.stall)
