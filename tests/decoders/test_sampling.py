"""Sampling filters: temperature, top-k, top-p."""

import pytest
import torch

from decoders.sampling import Sampling, filtered_probs, sample, argmax


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, Sampling()), logits.argmax(-1))


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
    counts = torch.bincount(sample(logits, Sampling(temperature=1.0), g), minlength=3) / 20000
    torch.testing.assert_close(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.02, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Sampling(**kwargs)


@pytest.mark.parametrize("V", [50, 512, 50288, 65536, 128256, 1000003])
def test_two_stage_argmax_is_the_first_maximum(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randint(-5, 5, (3, V), generator=g).to(torch.bfloat16)  # many ties
    x[1, V // 3] = 7
    x[1, V - 1] = 7
    x[2, -1] = 9
    assert torch.equal(argmax(x), x.float().argmax(-1))
    assert argmax(x)[1] == V // 3 and argmax(x)[2] == V - 1
