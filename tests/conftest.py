"""Test configuration: Triton kernels run under the interpreter when no GPU is present, and tests
marked `gpu` (bf16 on the real kernels, CUDA graphs, long sequences) are skipped there."""

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
