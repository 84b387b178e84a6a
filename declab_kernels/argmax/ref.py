"""Greedy decoding's argmax: the PyTorch reference.

The index of the maximum of each row, the first one when the maximum repeats. A NaN counts as
larger than every number (torch's rule), so a row holding NaN gives the index of its first NaN;
-0.0 and +0.0 are equal.
"""


def argmax_ref(x):
    """x `[B, V]` -> int64 `[B]`: the first index of each row's maximum."""
    return x.argmax(dim=-1)
