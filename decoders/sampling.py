"""Token sampling on the device: greedy, temperature, top-k and top-p, without host synchronisation.

Sampling uses the exponential-race form of the categorical draw (argmax of p / E with E ~ Exp(1)),
which needs no `multinomial` and so can sit inside a CUDA graph.
"""

from dataclasses import dataclass

import torch

from declab_kernels.argmax import argmax


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def filtered_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[B, V] probabilities after temperature, top-k and top-p (renormalised)."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None, *,
           impl: str, out: torch.Tensor | None = None, advance: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens [B] (int64) from logits [B, V], written into `out` when given; `advance` (int64 [B],
    a decoder's positions) gets 1 added in the same launch. The final argmax runs on `declab_kernels.argmax`
    (impl "triton": two kernels, launched without PDL) or as `argmax(-1)` (impl "ref")."""
    if not sampling.greedy:
        probs = filtered_probs(logits, sampling)
        race = torch.empty_like(probs).exponential_(generator=generator)
        logits = probs / race
    return argmax(logits, impl=impl, out=out, advance=advance)
