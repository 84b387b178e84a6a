"""Mask-Predict's block loss (training sees what decoding sees) against sequences cut where the block
ends, its draws, and the decoder's two scoring bounds."""

import pytest
import torch

import decoders
from declab_arch import maskpredict

TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, mask_token_id=47, max_predicted_length=0)


def tiny_model(seed=0, **overrides):
    config = maskpredict.MaskPredictConfig(**{**TINY, **overrides})
    return maskpredict.build(config, None, "test", seed=seed).eval()


def reference_block_loss(model, tokens, seed, bidirectional):
    """The block loss one sequence at a time, each cut right after its block (the same draws)."""
    B, T = tokens.shape
    gen = torch.Generator().manual_seed(seed)
    prompt, length = maskpredict.draw_blocks(B, T, None, gen)
    t = 1e-3 + (1 - 1e-3) * torch.rand(B, generator=gen)
    coins = torch.rand(B, T, generator=gen)
    open_prompt = torch.rand(B, generator=gen) < bidirectional
    total = 0.0
    for b in range(B):
        p, n = int(prompt[b]), int(length[b])
        x = tokens[b, : p + n].clone()
        masked = torch.zeros(p + n, dtype=torch.bool)
        masked[p:] = coins[b, p : p + n] < t[b]
        x[masked] = model.mask_token_id
        segments = None if open_prompt[b] else (torch.arange(p + n) >= p).long()[None]
        logp = maskpredict.token_log_probs(model(x[None], segments=segments)[0], model.mask_token_id)
        nll = -logp.gather(-1, tokens[b, : p + n, None])[:, 0]
        total += (nll * masked).sum() / t[b] / n
    return total / B


@pytest.mark.parametrize("bidirectional", [0.0, 1.0, 0.5])
def test_block_loss_equals_sequences_cut_after_the_block(bidirectional):
    model = tiny_model()
    tokens = torch.randint(0, 47, (6, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = maskpredict.block_loss(model, tokens, bidirectional=bidirectional, generator=torch.Generator().manual_seed(5))
        want = reference_block_loss(model, tokens, 5, bidirectional)
    assert torch.isfinite(got) and got.item() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tokens_after_the_block_change_nothing():
    model = tiny_model()
    tokens = torch.randint(0, 47, (6, 20), generator=torch.Generator().manual_seed(2))
    prompt, length = maskpredict.draw_blocks(6, 20, None, torch.Generator().manual_seed(7))
    other = tokens.clone()
    for b in range(6):
        other[b, int(prompt[b] + length[b]) :] = (other[b, int(prompt[b] + length[b]) :] + 1) % 47
    with torch.no_grad():
        a = maskpredict.block_loss(model, tokens, generator=torch.Generator().manual_seed(7))
        b = maskpredict.block_loss(model, other, generator=torch.Generator().manual_seed(7))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def test_draws_cover_every_prompt_and_block_length():
    T, max_block = 6, 3
    prompt, length = maskpredict.draw_blocks(4000, T, max_block, torch.Generator().manual_seed(0))
    pairs = set(zip(prompt.tolist(), length.tolist()))
    want = {(p, n) for p in range(1, T) for n in range(1, min(max_block, T - p) + 1)}
    assert pairs == want


def test_decoder_scores_both_bounds_and_says_which():
    prefix = decoders.load("maskpredict-tiny", device="cpu", dtype="float32", impl="ref")
    open_ = decoders.load("maskpredict-tiny", device="cpu", dtype="float32", impl="ref", prefix_cache=False)
    assert prefix.describe()["scoring"] == {"bound": "prefix"} and open_.describe()["scoring"] == {"bound": "bidirectional"}
    ctx, cont = [256, 5, 6, 7, 8], [9, 10, 11]
    a = prefix.loglikelihood(ctx, cont, samples=8)
    b = prefix.loglikelihood(ctx, cont, samples=8, bound="bidirectional")
    assert b == pytest.approx(open_.loglikelihood(ctx, cont, samples=8), rel=1e-6)
    assert abs(a - b) > 1e-4
    # One token: the prefix bound is the exact log-probability under prefix attention.
    tokens = torch.tensor([ctx + [prefix.mask_token_id]])
    logits = prefix.model(tokens, segments=(torch.arange(6) >= 5).long()[None])
    want = maskpredict.token_log_probs(logits, prefix.mask_token_id)[0, 5, 9].item()
    assert prefix.loglikelihood(ctx, [9]) == pytest.approx(want, rel=1e-5)
    with pytest.raises(decoders.UsageError, match="score_bound"):
        decoders.load("maskpredict-tiny", device="cpu", impl="ref", score_bound="both")
    with pytest.raises(decoders.UsageError, match="bound"):
        prefix.loglikelihood(ctx, cont, bound="causal")


def test_trained_on_blocks_it_decodes_the_continuation():
    """A toy (counting sequences) trained with the block loss greedily writes the next tokens after
    a prompt, unshifted, at the end of the sequence."""
    torch.manual_seed(0)
    model = tiny_model().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(600):
        starts = torch.randint(0, 40, (32, 1), generator=gen)
        tokens = (starts + torch.arange(16)) % 40
        loss = maskpredict.block_loss(model, tokens, bidirectional=0.25, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    dec = decoders.family_class("maskpredict")(model, model.config, device=torch.device("cpu"), dtype=torch.float32, impl="ref", source="toy")
    prompts = [[(s + i) % 40 for i in range(5)] for s in (0, 13, 30)]
    out = dec.generate(prompts, max_new_tokens=4).tokens
    assert out == [[(p[-1] + 1 + i) % 40 for i in range(4)] for p in prompts]
