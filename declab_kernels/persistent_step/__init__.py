"""The persistent decode step: a whole batch-1 forward in one launch, llama, Mamba-2 or RWKV-7 (README.md).

    step = PersistentStep(weights, cache, shape=StepShape(...), ...)
    logits = step(tokens, positions)     # tokens [1], positions [1] on the device; logits [1, V]

`Mamba2PersistentStep` (`mamba2.py`) and `RWKV7PersistentStep` (`rwkv7.py`) are the same for a Mamba-2
and an RWKV-7 model over their recurrent states.
`PersistentStep` holds what the launch needs, made once per model and KV cache: the work list
(`schedule.work_list`), the int32 counters, the epoch, the activation buffers and the per-layer
pointer table. A call launches one kernel (`triton.persistent_step_kernel`) and allocates nothing,
so it is capturable in a CUDA graph. Triton only: on the CPU it runs under the interpreter, where
programs run one after another, so there P is 1 (the whole list in one program, in topological
order); on a GPU P is the SM count times the programs that fit on an SM together (every program
must be resident at once: a program spins on counters that other programs advance).
"""

from dataclasses import dataclass

import torch

from declab_kernels.paged_attention.triton import decode_config
from declab_kernels.persistent_step import schedule, schedule_mamba2, schedule_rwkv7
from declab_kernels.persistent_step.launch import PersistentLaunch, _chunk, _pow2, resident_programs
from declab_kernels.persistent_step.mamba2 import Mamba2LayerWeights, Mamba2PersistentStep
from declab_kernels.persistent_step.rwkv7 import RWKV7LayerWeights, RWKV7PersistentStep
from declab_kernels.persistent_step.schedule import StepShape, Tiles
from declab_kernels.persistent_step.schedule_mamba2 import Mamba2Shape
from declab_kernels.persistent_step.schedule_rwkv7 import RWKV7Shape
from declab_kernels.persistent_step.triton import persistent_step_kernel

__all__ = ["PersistentStep", "LayerWeights", "StepShape", "Tiles", "Mamba2PersistentStep", "Mamba2LayerWeights", "Mamba2Shape",
           "RWKV7PersistentStep", "RWKV7LayerWeights", "RWKV7Shape", "resident_programs", "schedule", "schedule_mamba2",
           "schedule_rwkv7"]

# Elements of one attention key tile (keys x D_pad): 64 keys at D = 64, K and V, this one and the next.
ATTENTION_TILE_ELEMS = 4096
# float32 partials the attention merge loads at once ([G, splits, D_pad]; the paged decode kernel's
# one-load bound): 64 registers a thread at 4 warps, 32 at 8.
MERGE_ELEMS = 8192


@dataclass
class LayerWeights:
    """One layer's tensors, used in place (their addresses go into the pointer table)."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, d]
    o: torch.Tensor  # [d, Hq D]
    gate_up: torch.Tensor  # [2 I, d]: gate rows, then up rows
    down: torch.Tensor  # [d, I]
    input_norm: torch.Tensor  # [d]
    post_norm: torch.Tensor  # [d]

    def tensors(self):
        return (self.qkv, self.o, self.gate_up, self.down, self.input_norm, self.post_norm)


class PersistentStep(PersistentLaunch):
    """The persistent step of one llama model over one paged KV cache, batch 1.

    `k_cache`, `v_cache` [L, num_blocks, page, Hkv, D] (one dtype with the weights); `block_table`
    [max_blocks] int32, the sequence's pages; `cos`, `sin` [P, D/2] float32; `workspace` the paged
    decode attention's (`declab_kernels.paged_attention.decode_workspace`): its split count, its
    variant's key tile and its partials (batch row 0) serve the step's attention, which so cuts the keys
    as the graphed step's kernel does. `programs`: P (default: as the module
    docstring says); `delay_ns`, `timeline`: the kernel's debug constexprs (GPU only).
    """

    kernel = persistent_step_kernel

    def __init__(self, layers: list[LayerWeights], *, embed, head, final_norm, eps: float, shape: StepShape, k_cache, v_cache,
                 block_table, cos, sin, workspace, scale: float, programs: int | None = None,
                 delay_ns: int = 0, timeline: bool = False):
        device = embed.device
        self.shape = shape
        dtype = embed.dtype
        if k_cache.stride() != v_cache.stride():
            raise ValueError("persistent step: the K and V caches must share one layout")
        if workspace.num_splits != shape.num_splits:
            raise ValueError(f"persistent step: the workspace has {workspace.num_splits} splits, the shape {shape.num_splits}")
        tensors = [t for layer in layers for t in layer.tensors()] + [head, final_norm, k_cache, v_cache]
        self._check(layers, [(t, dtype) for t in tensors], device, "weight and the KV cache", delay_ns, timeline)
        D = shape.head_dim
        d_pad = max(16, _pow2(D))
        g_r = _pow2(shape.group)
        s_pad = _pow2(shape.num_splits)
        self.consts = dict(
            D_MODEL=shape.d_model, INTER=shape.inter, VOCAB=shape.vocab, HQ=shape.hq, HKV=shape.hkv, D=D, D_PAD=d_pad,
            G=shape.group, G_PAD=max(16, g_r), G_R=g_r, PAGE=k_cache.shape[2],
            BLOCK_N=decode_config(D, workspace.variant).block_n, TILE=min(decode_config(D, workspace.variant).block_n, ATTENTION_TILE_ELEMS // d_pad),
            S_PAD=s_pad,
            CHUNK=min(s_pad, max(1, MERGE_ELEMS // (g_r * d_pad))), EMBED_BLOCK=min(1024, _pow2(shape.d_model)),
            DELAY=int(delay_ns), TIMELINE=bool(timeline),
        )
        self.args = dict(embed=embed, head=head, final_norm=final_norm, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                         cos=cos, sin=sin, lse=workspace.lse[0], partial=workspace.partial[0], eps=float(eps), qk_scale=float(scale) * 1.4426950408889634)
        self.x = torch.zeros(shape.d_model, dtype=dtype, device=device)
        self.qkv = torch.zeros(shape.n_qkv, dtype=dtype, device=device)
        self.attn = torch.zeros(shape.hq * D, dtype=dtype, device=device)
        self.act = torch.zeros(shape.inter, dtype=dtype, device=device)
        self._start(shape.vocab, dtype, schedule.Counters(shape.n_layers, shape.hkv).size, programs, timeline)

    def _plan(self, programs: int) -> None:
        """Tiles, work list and timeline buffer for P = programs."""
        shape = self.shape
        self.tiles = t = schedule.choose_tiles(shape, programs)
        self._set_items(schedule.work_list(shape, t))
        self.consts.update(BN_QKV=t.qkv, BK_QKV=_chunk(t.qkv, shape.d_model), BN_O=t.o, BK_O=_chunk(t.o, shape.hq * shape.head_dim),
                           BN_GU=t.gu, BK_GU=_chunk(t.gu, shape.d_model), BN_DOWN=t.down, BK_DOWN=_chunk(t.down, shape.inter),
                           BN_HEAD=t.head, BK_HEAD=_chunk(t.head, shape.d_model))

    def _launch_args(self, tokens, positions):
        a = self.args
        k = a["k_cache"]
        return (*self._list_args(),
                a["embed"], a["head"], a["final_norm"], tokens, positions,
                self.x, self.qkv, self.attn, self.act, a["lse"], a["partial"], self.logits,
                k, a["v_cache"], a["block_table"], a["cos"], a["sin"],
                k.stride(0), k.stride(1), k.stride(2), k.stride(3), a["cos"].stride(0),
                a["eps"], a["qk_scale"], self.shape.num_splits, self.times, self.stall)
