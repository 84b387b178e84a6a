"""Medusa-style draft heads: k residual blocks on a transformer's final hidden state (before its
norm), head i predicting the token i + 2 positions ahead through the transformer's own norm and LM
head (frozen; only the blocks are trained):

    h [..., d] -> h_i = h + SiLU(W_i h + b_i) -> logits_i = head(h_i)   [k, ..., V]

W_i starts at zero, so every head starts as the base model's next-token head. A trained set is a
folder: heads.json (hidden_size, k) and heads.safetensors, kept apart from the model's checkpoint.
"""

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from declab_arch.checkpoint import CheckpointError, read_json


class DraftHeads(nn.Module):
    def __init__(self, hidden_size: int, k: int):
        super().__init__()
        if k < 1:
            raise ValueError(f"draft heads need k >= 1, got {k}")
        self.hidden_size, self.k = hidden_size, k
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(k))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor, head) -> torch.Tensor:
        """hidden [..., d] -> logits [k, ..., V]; `head` maps hidden states to logits (norm + LM head)."""
        return torch.stack([head(hidden + F.silu(block(hidden))) for block in self.blocks])

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "heads.json").write_text(json.dumps({"hidden_size": self.hidden_size, "k": self.k}, indent=2) + "\n")
        save_file({n: p.detach().contiguous().cpu() for n, p in self.state_dict().items()}, str(folder / "heads.safetensors"))


def load(folder: Path) -> DraftHeads:
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "heads.json").exists():
        raise CheckpointError(f"{folder}: not a draft-heads folder (no heads.json)")
    values = read_json(folder / "heads.json")
    heads = DraftHeads(values["hidden_size"], values["k"])
    heads.load_state_dict(load_file(str(folder / "heads.safetensors")))
    return heads
