"""Tensor parallelism: the family-independent machinery that cuts a model into a rank's share, and the
collectives its forward calls.

A family's `declab_arch` module (the one that defines its config class) declares its plan:
`tp_config(config, n)`, the config of a rank's share of n (ValueError in one line, `divided`, when the
config does not split); `tp_plan(config, n)`, {parameter name pattern (fnmatch): Split or FIRST_RANK},
a parameter no pattern matches replicated; `tp_adopt(model, config, local, group)`, the rank's module
sizes (heads) and any collective the plan does not imply. A family without them is refused.

`shard` cuts the full model (built or loaded as on one process) in place: every tensor of the plan
becomes the rank's slice (`take`), and the plan places the collectives. A linear cut along its input
features (dim 1) is row-parallel (`RowParallelLinear` all-reduces its partial products; its bias,
FIRST_RANK, is added by rank 0 alone); a cut embedding table is vocabulary-parallel
(`VocabParallelEmbedding`: a token outside the rank's rows looks up zeros, the all-reduce sums the one
rank that holds it); a column-parallel linear (cut along its output features) needs none: each rank
computes its heads or channels, the head its rows of the vocabulary, gathered by the decoder
(`Group.gather`). The fused Triton paths reach `Group.reduce` through `tp`: every module whose class
declares a `tp` attribute (None on one process) gets the group.
"""

import fnmatch
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


def divided(config, size: int, *names: str) -> dict:
    """{name: config.name / size} for sizes the ranks share; ValueError naming one `size` does not divide."""
    for name in names:
        if getattr(config, name) % size:
            raise ValueError(f"{name} {getattr(config, name)} is not divisible by tp {size}")
    return {name: getattr(config, name) // size for name in names}


def has_plan(arch) -> bool:
    """Whether a family's `declab_arch` module declares a sharding plan."""
    return hasattr(arch, "tp_plan")


def planner(family: str, config):
    """The `declab_arch` module that defines `config`'s class, checked to be `family`'s and to have a plan."""
    arch = sys.modules[type(config).__module__]
    if getattr(arch, "FAMILY", None) != family:
        raise ValueError(f"a {type(config).__name__} is not a config of the {family} family")
    if not has_plan(arch):
        raise ValueError(f"the {family} family has no tensor-parallel plan")
    return arch


def check(family: str, config, size: int):
    """The config of a rank's share of `size` ranks; ValueError (one line) unless `config` splits so."""
    return planner(family, config).tp_config(config, size)


def plan(family: str, config, size: int) -> dict:
    """The family's plan for a model of `config` over `size` ranks (`tp_plan`)."""
    return planner(family, config).tp_plan(config, size)


def spec_of(rules: dict, name: str):
    """The plan's rule for parameter `name` (None: replicated)."""
    return next((spec for pattern, spec in rules.items() if fnmatch.fnmatchcase(name, pattern)), None)


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


def shard(model: nn.Module, family: str, config, group: Group):
    """Cut the full `model` (of `config`, on the CPU) down to rank `group.rank`'s share, in place:
    (model, the rank's config). ValueError when the family has no plan or the config does not split."""
    arch = planner(family, config)
    local, rules = arch.tp_config(config, group.size), arch.tp_plan(config, group.size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = spec_of(rules, name)
            if spec is not None:
                p.data = take(p.data, spec, group.rank, group.size)
    for name, module in list(model.named_modules()):
        parent, _, child = name.rpartition(".")
        spec = spec_of(rules, f"{name}.weight")
        if isinstance(module, nn.Linear):
            # (the fused q/k/v and gate/up weights are cut by these sizes)
            module.out_features, module.in_features = module.weight.shape
            if isinstance(spec, Split) and spec.dim == 1:
                setattr(model.get_submodule(parent), child, RowParallelLinear(module, group))
        elif isinstance(module, nn.Embedding) and spec is not None:
            table = module.weight
            setattr(model.get_submodule(parent), child, VocabParallelEmbedding(table, group.rank * table.shape[0], group))
        if hasattr(type(module), "tp"):
            module.tp = group
    arch.tp_adopt(model, config, local, group)
    model.config = local
    return model, local
