"""Sampling filters: temperature, top-k, top-p."""

import pytest
import torch

from decoders.sampling import Sampling, filtered_probs, sample


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_greedy_is_the_first_argmax(impl):
    logits = torch.randint(-3, 3, (4, 5000)).float()  # many ties: the first maximum must win
    logits[1, 4999] = 9
    assert torch.equal(sample(logits, Sampling(), impl=impl), logits.argmax(-1))


@pytest.mark.interpreter
def test_triton_sampling_draws_what_the_reference_draws():
    logits = torch.randn(3, 3000)
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9)
    got = sample(logits, s, torch.Generator().manual_seed(1), impl="triton")
    want = sample(logits, s, torch.Generator().manual_seed(1), impl="ref")
    assert torch.equal(got, want)


def test_top_k_keeps_k_tokens():
    probs = filtered_probs(torch.randn(3, 40), Sampling(temperature=1.0, top_k=5))
    assert ((probs > 0).sum(-1) == 5).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, Sampling(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_samples_follow_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1])).expand(20000, 3)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample(logits, Sampling(temperature=1.0), g, impl="ref"), minlength=3) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.02, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)
