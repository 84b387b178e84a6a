"""Test configuration: Triton kernels run under the interpreter when no GPU is present, tests
marked `gpu` (bf16 on the real kernels, CUDA graphs, long sequences) are skipped there, and the
`nan_empty` fixture poisons what kernels allocate."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nan_empty(monkeypatch):
    """Every floating tensor the op allocates with torch.empty starts as NaN, so unwritten elements show."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
