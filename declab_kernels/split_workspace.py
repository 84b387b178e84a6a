"""The float32 partials and int32 tickets of the split-K kernels (the bf16 GEMV, the quantised
products): one pair per (kernel family, device), grown on demand and kept for the process.

`split_workspace(owner, device, n_part, n_cnt) -> (partials [>= n_part] float32, counters [>= n_cnt]
int32)`. Counters start at zero and every launch of a split-K kernel leaves them at zero, so they are
allocated zeroed once; partials are written before they are read and need no zeroing. A pair that
grows is replaced and the old one kept alive, because a captured CUDA graph may still point at it.
"""

import torch

_pairs: dict = {}
_retired: list = []


def split_workspace(owner: str, device, n_part: int, n_cnt: int):
    """(partials, counters) of at least n_part floats and n_cnt counters for `owner` on `device`."""
    key = (owner, str(device))
    ws = _pairs.get(key)
    if ws is None or ws[0].numel() < n_part or ws[1].numel() < n_cnt:
        if ws is not None:
            _retired.append(ws)
            n_part, n_cnt = max(n_part, ws[0].numel()), max(n_cnt, ws[1].numel())
        ws = (torch.empty(max(n_part, 1), dtype=torch.float32, device=device),
              torch.zeros(max(n_cnt, 1), dtype=torch.int32, device=device))
        _pairs[key] = ws
    return ws
