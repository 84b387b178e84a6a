"""Test configuration: Triton kernels run under the interpreter when no GPU is present, tests
marked `gpu` (bf16 on the real kernels, CUDA graphs, long sequences) are skipped there, tests
marked `interpreter` (the Triton path on CPU tensors, which only the interpreter can run) are
skipped where a GPU is present, every test starts from the same random state, and the `nan_empty`
fixture poisons what kernels allocate."""

import inspect
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        marker, skip = "interpreter", pytest.mark.skip(reason="Triton on CPU tensors: the interpreter's test (the gpu tests run here)")
    else:
        marker, skip = "gpu", pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def same_random_state():
    """torch's and Python's generators seeded before every test, whatever ran before it: a tolerance
    that a rare draw breaks then fails in every run (and can be fixed), not in one run of many."""
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def nan_empty(monkeypatch):
    """Every floating tensor the op allocates with torch.empty starts as NaN, so unwritten elements show."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture
def hf_mamba2_groups():
    """`check(ngroups)` skips a comparison with transformers' Mamba-2 at more than one group when the
    installed release normalises the gated output over all of d_inner at once: mamba-ssm, and this
    lab, normalise each group of d_inner / ngroups (transformers' gated norm took a `group_size`
    later). At one group the two agree."""

    def check(ngroups):
        from transformers.models.mamba2 import modeling_mamba2

        # The class is `Mamba2RMSNormGated` from transformers 5.25 on, `MambaRMSNormGated` before.
        gated = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
        if ngroups > 1 and "group_size" not in inspect.signature(gated).parameters:
            pytest.skip("this transformers normalises Mamba-2's gated output over all groups at once (mamba-ssm: per group)")

    return check
