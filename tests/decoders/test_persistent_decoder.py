"""The transformer's persistent step (`step="persistent"`) against its graphed step: the same logits
and tokens at contexts inside one page, over several pages and over several key splits (some empty),
with GQA and without; the gate and the counters; its compare refusals. What every family checks alike
is in `test_persistent_families.py`."""

import pytest
import torch

import decoders
import persistent_cases
from decoders import harness
from decoders.transformer import TransformerDecoder
from declab_kernels.persistent_step import schedule

TINY = decoders.model_config("llama-tiny")[1]
# No GQA, untied head, another head size.
MHA_UNTIED = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3,
              "num_key_value_heads": 3, "head_dim": 32, "tie_word_embeddings": False, "max_position_embeddings": 4096}


def filled_states(decs, ctx, max_len, seed=0):
    """States of both decoders holding the same random K/V for `ctx` positions (written straight into
    the pages: the step reads them the same however they got there), next token fed at position ctx."""
    prompt = torch.randint(0, decs[0].vocab_size, (1, 8), generator=torch.Generator().manual_seed(seed))
    states = [d.prefill(prompt, max_new_tokens=max_len - 8) for d in decs]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.inference_mode():
        for name in ("k", "v"):
            values = torch.randn(getattr(states[0].cache.kv, name).shape, generator=g) * 0.5
            for s in states:
                getattr(s.cache.kv, name).copy_(values)
        for s in states:
            s.positions.fill_(ctx)
            s.next_tokens.fill_(3)
    return states


@pytest.mark.interpreter
@pytest.mark.parametrize("ctx, max_len", [(5, 16), (40, 64), (1000, 1108), (2100, 2200)],
                         ids=["inside-a-page", "pages", "splits-one-empty", "splits-of-two-tiles"])
def test_persistent_equals_graphed_llama_tiny(ctx, max_len):
    decs = persistent_cases.pair("llama-tiny")
    states = filled_states(decs, ctx, max_len)
    step = states[0].cache.persistent
    if ctx >= 1000:
        assert step.shape.num_splits == 3
    persistent_cases.compare_steps(decs, states, 2)


@pytest.mark.interpreter
def test_persistent_equals_graphed_without_gqa_untied_head():
    decs = persistent_cases.pair(MHA_UNTIED, cls=TransformerDecoder, name="mha-untied")
    persistent_cases.compare_steps(decs, filled_states(decs, 50, 80), 2)


@pytest.mark.interpreter
def test_persistent_passes_the_gate_and_counts_its_steps():
    dec = decoders.load("llama-tiny", device="cpu", impl="triton", step="persistent")
    gate = harness.check_against_reference(dec, new_tokens=4, long_tokens=64)
    assert gate["ok"], gate
    state = dec.prefill([[5, 6, 7]], max_new_tokens=4)
    for _ in range(3):
        dec.step(state)
    step = state.cache.persistent
    # Counters only grow: after three steps each holds three steps' worth, and the epoch is 3.
    assert step.epoch.item() == 3
    n = schedule.stage_tiles(step.shape, step.tiles)
    c = schedule.Counters(step.shape.n_layers, step.shape.hkv)
    counts = step.counters.tolist()
    assert counts[c.qkv(1)] == 3 * n[schedule.QKV] and counts[c.down(0)] == 3 * n[schedule.DOWN]
    assert counts[c.comb(1)] == 3 * step.shape.hkv and counts[c.ticket(0, 1)] == 3 * step.shape.num_splits
    assert step.done.item() == 3 * step.programs
    assert describe_step(dec) == "persistent"


def describe_step(dec):
    return dec.describe()["step"]


def test_graphed_is_the_default_and_recorded():
    assert describe_step(decoders.load("llama-tiny", device="cpu", impl="ref")) == "graphed"


def test_other_families_refuse_the_option():
    with pytest.raises(decoders.UsageError, match="step"):
        decoders.load("maskpredict-tiny", device="cpu", impl="ref", step="persistent")


@pytest.mark.parametrize("extra, says", [
    (["--models", "maskpredict-tiny"], "has no persistent step yet"),
    (["--batch", "1,2"], "batch 1 only"),
    (["--impl", "ref"], "Triton kernel"),
    (["--quant", "int8", "--impl", "triton"], "dense weights"),
])
def test_compare_refuses_what_the_persistent_step_does_not_run(extra, says, tmp_path, capsys):
    from decoders import compare

    argv = ["--no-progress", "--models", "llama-tiny", "--ctx", "64", "--new-tokens", "4", "--step", "graphed,persistent",
            "--device", "cpu", "--out", str(tmp_path / "out.jsonl")]
    # The later --models wins, so each case changes one option of a sweep that would otherwise run.
    code = compare.main(argv + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1] and not (tmp_path / "out.jsonl").exists()
