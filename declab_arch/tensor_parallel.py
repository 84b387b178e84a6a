"""Tensor parallelism for the lab's model families: a rank's share of a model, and the collectives its
forward calls.

A model split over N ranks is the full model (built or loaded as on one process) cut down in place by
`shard(model, family, group)`: every tensor of the family's sharding plan (`plan`) is replaced by this
rank's slice of it, the size attributes that follow from those tensors (heads, the Mamba-2 mixer's
config) are set to the rank's share, and three kinds of module take the place of plain ones:

- `RowParallelLinear`: a projection whose input features are split (llama's o_proj and down_proj,
  Mamba-2's out_proj, RWKV-7's o_proj and ffn.value); its forward all-reduces the partial products;
- `VocabParallelEmbedding`: rows [rank * V / N, (rank + 1) * V / N) of the table; a token outside them
  looks up zeros, and the all-reduce sums the one rank that holds it;
- `GroupedRMSNormGated` (Mamba-2 with fewer B/C groups than ranks): the gated RMSNorm of a group whose
  channels sit on several ranks, its sum of squares all-reduced.

The column-parallel projections (q/k/v, gate/up, Mamba-2's in_proj, RWKV-7's r/k/v and LoRA up
projections, ffn.key) need no collective: each rank computes its own heads or channels. The head is
vocabulary-parallel too (it is the embedding table when tied): each rank computes logits for its rows of
the vocabulary and the decoder gathers them (`Group.gather`). The fused Triton paths, which read the
weights directly rather than calling the modules, call the same `Group.reduce` through the `tp`
attribute the arch modules carry (None on one process).

What is split, per family (`plan`; V vocabulary, H heads, D head size, I MLP width, G Mamba-2 groups):

| family | split by rank | replicated |
|---|---|---|
| transformer | q/k/v rows by head (Hq / N query and Hkv / N KV heads, so the paged cache holds the rank's KV heads), o_proj columns; gate/up rows and down columns (I / N); embedding and head rows (V / N) | the norms |
| mamba2 | in_proj rows per packed part (z, x and dt by head; B and C by group when G >= N, else each rank holds the one group its heads read), conv1d channels the same way, A_log / D / dt_bias / norm by head, out_proj columns; embedding and head rows | the norms outside the mixer |
| rwkv7 | r/k/v rows and o_proj columns by head, LoRA up-projections (rows) and their biases, k_k, k_a, r_k, the per-head group norm; ffn.key rows, ffn.value columns; embedding and head rows | token-shift mixes, LoRA down-projections, the layer norms |

Mamba-2's B and C are shared by the H / G heads of a group. With G >= N a rank holds G / N whole groups
and everything about a group (its heads, its norm group) is local. With G < N (mamba2-1.3b has G = 1)
each rank's heads fall in one group, whose B/C rows every rank of that group holds a copy of, and the
group's gated RMSNorm spans N / G ranks: `GroupedRMSNormGated` all-reduces its sum of squares.
"""

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from declab_arch.mamba2 import Mamba2Config, RMSNormGated
from declab_arch.rwkv7 import RWKV7Config

FAMILIES = ("transformer", "mamba2", "rwkv7")


class Group:
    """The ranks a model is split over: this process is `rank` of `size`; collectives run on
    `process_group` (a torch.distributed group; None for the default one)."""

    def __init__(self, rank: int, size: int, process_group=None):
        self.rank, self.size, self.process_group = rank, size, process_group

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.process_group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., V / N] on each rank -> [..., V], the ranks' slices side by side in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # the ranks' x concatenated along dim 0
        # (all_gather_single is the newer name of all_gather_into_tensor)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        gather(out, x, group=self.process_group)
        return out.unflatten(0, (self.size, x.shape[0])).movedim(0, -2).flatten(-2)

    def __deepcopy__(self, memo):
        # A model copy (the correctness gate's float32 reference) runs on the same ranks.
        return self


@dataclass(frozen=True)
class Split:
    """How a tensor is cut along `dim`: the consecutive parts (length, pieces) of a packed tensor,
    each cut into `pieces` equal pieces of which rank r of N takes piece r * pieces // N (pieces = N:
    one piece each; pieces < N: the N / pieces ranks of a piece share it)."""

    dim: int
    parts: tuple


# A row-parallel projection's bias: added once, by rank 0 (zeros elsewhere), so the all-reduce sums it once.
FIRST_RANK = "first rank"


def split(length: int, size: int, dim: int = 0) -> Split:
    """A tensor cut in N equal pieces along `dim`."""
    return Split(dim, ((length, size),))


def take(t: torch.Tensor, spec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s share of the full tensor t under `spec` (a Split or FIRST_RANK), a new tensor."""
    if spec == FIRST_RANK:
        return t.clone() if rank == 0 else torch.zeros_like(t)
    pieces, start = [], 0
    for length, count in spec.parts:
        piece = length // count
        pieces.append(t.narrow(spec.dim, start + (rank * count // size) * piece, piece))
        start += length
    if start != t.shape[spec.dim]:
        raise ValueError(f"sharding plan covers {start} of {t.shape[spec.dim]} along dim {spec.dim}")
    return torch.cat(pieces, spec.dim)


def check(family: str, config, size: int) -> None:
    """Raise ValueError (one line) unless `config` splits over `size` ranks."""
    if family not in FAMILIES:
        raise ValueError(f"tensor parallel runs the {', '.join(FAMILIES)} families, not {family}")
    if family == "transformer":
        counts = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                  "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    elif family == "mamba2":
        counts = {"nheads": config.nheads, "vocab_size": config.vocab_size}
        g = config.ngroups
        if g % size and size % g:
            raise ValueError(f"ngroups {g} and tp {size}: one must divide the other (B/C are split by group or replicated)")
    else:
        counts = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    for name, value in counts.items():
        if value % size:
            raise ValueError(f"{name} {value} is not divisible by tp {size}")


def plan(family: str, config, size: int) -> dict:
    """{parameter name pattern (fnmatch): Split or FIRST_RANK} for a model of `config` over `size`
    ranks; a parameter no pattern matches is replicated."""
    c, n = config, size
    if family == "transformer":
        q, kv, inner = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        attn = "model.layers.*.self_attn."
        return {
            "model.embed_tokens.weight": split(c.vocab_size, n),
            "lm_head.weight": split(c.vocab_size, n),
            attn + "q_proj.*": split(q, n),
            attn + "k_proj.*": split(kv, n),
            attn + "v_proj.*": split(kv, n),
            attn + "o_proj.weight": split(q, n, dim=1),
            "model.layers.*.mlp.gate_proj.weight": split(inner, n),
            "model.layers.*.mlp.up_proj.weight": split(inner, n),
            "model.layers.*.mlp.down_proj.weight": split(inner, n, dim=1),
        }
    if family == "mamba2":
        d, bc, heads = c.d_inner, c.ngroups * c.d_state, c.nheads
        groups = min(c.ngroups, n)
        mixer = "backbone.layers.*.mixer."
        packed_in = Split(0, ((d, n), (d, n), (bc, groups), (bc, groups), (heads, n)))
        packed_conv = Split(0, ((d, n), (bc, groups), (bc, groups)))
        return {
            "backbone.embeddings.weight": split(c.vocab_size, n),
            "lm_head.weight": split(c.vocab_size, n),
            mixer + "in_proj.*": packed_in,
            mixer + "conv1d.*": packed_conv,
            mixer + "dt_bias": split(heads, n),
            mixer + "A_log": split(heads, n),
            mixer + "D": split(heads, n),
            mixer + "norm.weight": split(d, n),
            mixer + "out_proj.weight": split(d, n, dim=1),
            mixer + "out_proj.bias": FIRST_RANK,
        }
    C, inner, attn = c.hidden_size, c.intermediate_size, "model.layers.*.attn."
    return {
        "model.embeddings.weight": split(c.vocab_size, n),
        "lm_head.weight": split(c.vocab_size, n),
        attn + "r_proj.weight": split(C, n),
        attn + "k_proj.weight": split(C, n),
        attn + "v_proj.weight": split(C, n),
        attn + "o_proj.weight": split(C, n, dim=1),
        attn + "*_lora.lora.2.*": split(C, n),
        attn + "k_k": split(C, n),
        attn + "k_a": split(C, n),
        attn + "r_k": split(c.num_heads, n),
        attn + "g_norm.*": split(C, n),
        "model.layers.*.ffn.key.weight": split(inner, n),
        "model.layers.*.ffn.value.weight": split(inner, n, dim=1),
    }


def spec_of(rules: dict, name: str):
    """The plan's rule for parameter `name` (None: replicated)."""
    return next((spec for pattern, spec in rules.items() if fnmatch.fnmatchcase(name, pattern)), None)


@dataclass
class Mamba2Shard(Mamba2Config):
    """A rank's Mamba-2 mixer sizes: d_inner / tp channels (so nheads / tp heads) and `ngroups` the
    rank's own B/C groups (max(1, G / tp))."""

    tp: int = 1

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model // self.tp


@dataclass
class RWKV7Shard(RWKV7Config):
    """A rank's RWKV-7 sizes: num_heads / tp heads (hidden_size, the residual width, stays whole);
    intermediate_size and vocab_size are the rank's share."""

    tp: int = 1

    @property
    def num_heads(self) -> int:
        return self.hidden_size // self.head_dim // self.tp


def local_config(family: str, config, size: int):
    """The config of a rank's share: the sizes its tensors and state buffers have."""
    c, n = config, size
    if family == "transformer":
        return dataclasses.replace(c, num_attention_heads=c.num_attention_heads // n, num_key_value_heads=c.num_key_value_heads // n,
                                   intermediate_size=c.intermediate_size // n, vocab_size=c.vocab_size // n, head_dim=c.head_dim)
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    if family == "mamba2":
        return Mamba2Shard(**{**values, "ngroups": max(1, c.ngroups // n), "vocab_size": c.vocab_size // n}, tp=n)
    return RWKV7Shard(**{**values, "intermediate_size": c.intermediate_size // n, "vocab_size": c.vocab_size // n}, tp=n)


class RowParallelLinear(nn.Linear):
    """A linear whose weight holds this rank's input features: the partial products, all-reduced."""

    def __init__(self, linear: nn.Linear, group: Group):
        nn.Module.__init__(self)
        self.out_features, self.in_features = linear.weight.shape
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.tp = group

    def forward(self, x):
        return self.tp.reduce(F.linear(x, self.weight, self.bias))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of an embedding table; the lookup of tokens [...] -> [..., d] is
    all-reduced (a token outside the rows looks up zeros here, its row on the rank that holds it)."""

    def __init__(self, weight: nn.Parameter, start: int, group: Group):
        super().__init__()
        self.weight = weight
        self.start = start
        self.tp = group

    def forward(self, tokens):
        rows = self.weight.shape[0]
        local = tokens - self.start
        inside = (local >= 0) & (local < rows)
        out = F.embedding(local.clamp(0, rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.reduce(out)


class GroupedRMSNormGated(nn.Module):
    """Mamba-2's rmsnorm(y * silu(z)) where this rank's channels are part of one norm group of
    `group_size` channels spread over several ranks: each rank writes its partial sum of squares in its
    group's slot of a [..., slots] vector, the all-reduce completes every group's sum."""

    def __init__(self, norm: RMSNormGated, group_size: int, slot: int, slots: int, group: Group):
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self.group_size, self.slot, self.slots = group_size, slot, slots
        self.tp = group

    def forward(self, y, z):
        h = F.silu(z.float()) * y
        sumsq = h.pow(2).sum(-1, keepdim=True)  # [..., 1] this rank's channels
        total = self.tp.reduce(F.pad(sumsq, (self.slot, self.slots - self.slot - 1)))  # [..., slots]
        h = h * torch.rsqrt(total[..., self.slot : self.slot + 1] / self.group_size + self.eps)
        return self.weight * h.to(y.dtype)


def shard(model: nn.Module, family: str, config, group: Group):
    """Cut the full `model` (of `config`, on the CPU) down to rank `group.rank`'s share, in place.
    Returns (model, the rank's config). Raises ValueError when the config does not split."""
    check(family, config, group.size)
    rules = plan(family, config, group.size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = spec_of(rules, name)
            if spec is not None:
                p.data = take(p.data, spec, group.rank, group.size)
        # (the fused q/k/v and gate/up weights are cut by these sizes)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.out_features, module.in_features = module.weight.shape
    local = local_config(family, config, group.size)
    n = group.size
    if family == "transformer":
        trunk = model.model
        for block in trunk.layers:
            attn, mlp = block.self_attn, block.mlp
            attn.n_heads, attn.n_kv = local.num_attention_heads, local.num_key_value_heads
            attn.o_proj = RowParallelLinear(attn.o_proj, group)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
            attn.tp = mlp.tp = group
            # The fused q/k/v and gate/up weights are rebuilt from the rank's slices of each part.
            attn.fuse()
            mlp.fuse()
        table = trunk.embed_tokens.weight
        trunk.embed_tokens = VocabParallelEmbedding(table, group.rank * table.shape[0], group)
    elif family == "mamba2":
        backbone = model.backbone
        for block in backbone.layers:
            mixer = block.mixer
            mixer.config = local
            mixer.out_proj = RowParallelLinear(mixer.out_proj, group)
            if config.ngroups < n:
                mixer.norm = GroupedRMSNormGated(mixer.norm, config.d_inner // config.ngroups, group.rank * config.ngroups // n,
                                                 config.ngroups, group)
            mixer.tp = group
        table = backbone.embeddings.weight
        backbone.embeddings = VocabParallelEmbedding(table, group.rank * table.shape[0], group)
    else:
        trunk = model.model
        for block in trunk.layers:
            attn = block.attn
            attn.n_heads = local.num_heads
            attn.g_norm.num_groups, attn.g_norm.num_channels = local.num_heads, local.num_heads * local.head_dim
            attn.o_proj = RowParallelLinear(attn.o_proj, group)
            block.ffn.value = RowParallelLinear(block.ffn.value, group)
        table = trunk.embeddings.weight
        trunk.embeddings = VocabParallelEmbedding(table, group.rank * table.shape[0], group)
    model.tp = group
    model.config = local
    return model, local
