"""The transformer's persistent step (`step="persistent"`) against its graphed step: the same logits
and tokens at contexts inside one page, over several pages and over several key splits (some empty),
with GQA and without; its refusals; and on the GPU, bf16 tokens and many graph replays with random
delays in the kernel."""

import pytest
import torch

import decoders
from decoders import harness
from decoders.transformer import TransformerDecoder
from declab_kernels.persistent_step import schedule

TINY = decoders.model_config("llama-tiny")[1]
# No GQA, untied head, another head size.
MHA_UNTIED = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3,
              "num_key_value_heads": 3, "head_dim": 32, "tie_word_embeddings": False, "max_position_embeddings": 4096}


def pair(model, device, dtype=None):
    """(persistent, graphed) decoders of the same random weights."""
    make = (lambda **kw: decoders.load(model, device=device, dtype=dtype, impl="triton", **kw)) if isinstance(model, str) else \
        (lambda **kw: TransformerDecoder.from_preset(model, "mha-untied", device=device, dtype=dtype or torch.float32, impl="triton", **kw))
    return make(step="persistent"), make()


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


def compare_steps(decs, states, steps):
    for _ in range(steps):
        ours, theirs = (d.step(s) for d, s in zip(decs, states))
        assert harness.relative_rms(ours.logits, theirs.logits) < 1e-5
        assert torch.equal(ours.tokens, theirs.tokens)


@pytest.mark.interpreter
@pytest.mark.parametrize("ctx, max_len", [(5, 16), (40, 64), (1000, 1108), (2100, 2200)],
                         ids=["inside-a-page", "pages", "splits-one-empty", "splits-of-two-tiles"])
def test_persistent_equals_graphed_llama_tiny(ctx, max_len):
    decs = pair("llama-tiny", "cpu")
    states = filled_states(decs, ctx, max_len)
    step = states[0].cache.persistent
    if ctx >= 1000:
        assert step.shape.num_splits == 3
    compare_steps(decs, states, 2)


@pytest.mark.interpreter
def test_persistent_equals_graphed_without_gqa_untied_head():
    decs = pair(MHA_UNTIED, "cpu")
    compare_steps(decs, filled_states(decs, 50, 80), 2)


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


@pytest.mark.parametrize("kwargs, says", [
    (dict(impl="ref", step="persistent"), "Triton kernel"),
    (dict(impl="triton", step="megakernel"), "unknown step"),
    (dict(impl="triton", step="persistent", quant="int8"), "dense"),
])
def test_refused_at_load(kwargs, says):
    with pytest.raises(decoders.UsageError, match=says):
        decoders.load("llama-tiny", device="cpu", **kwargs)


def test_other_families_refuse_the_option():
    with pytest.raises(decoders.UsageError, match="step"):
        decoders.load("maskpredict-tiny", device="cpu", impl="ref", step="persistent")


@pytest.mark.interpreter
def test_batch_of_two_refused():
    dec = decoders.load("llama-tiny", device="cpu", impl="triton", step="persistent")
    with pytest.raises(decoders.UsageError, match="one sequence"):
        dec.prefill([[1, 2], [3, 4]], max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [4096, 32768])
def test_gpu_bf16_tokens_equal_graphed_llama_1b(ctx):
    """16 greedy steps of both, the persistent one fed the graphed one's tokens: logits within bf16
    rounding, and the same token wherever the graphed step's top two logits are not a near-tie
    (random weights make flat logits, where either step's rounding may pick the other)."""
    decs = pair("llama-1b", "cuda", torch.bfloat16)
    prompt = torch.randint(0, decs[0].vocab_size, (1, ctx - 17), generator=torch.Generator().manual_seed(0))
    states = [d.prefill(prompt, max_new_tokens=17) for d in decs]
    assert torch.equal(states[0].next_tokens, states[1].next_tokens)
    decided = 0
    with torch.inference_mode():
        for _ in range(16):
            ours, theirs = (d.step(s).logits.float() for d, s in zip(decs, states))
            assert harness.relative_rms(ours, theirs) < 3e-2
            top = theirs.topk(2).values[0]
            if top[0] - top[1] > 1e-2 * theirs.std():
                decided += 1
                assert torch.equal(states[0].next_tokens, states[1].next_tokens)
            states[0].next_tokens.copy_(states[1].next_tokens)
    assert decided >= 8
    assert not states[0].cache.persistent.stalled()


@pytest.mark.gpu
def test_gpu_many_replays_with_random_delays():
    """The graphed persistent step of llama-1b at 4k replayed 300 times with every item spinning a random
    0..20 us before its wait, against the same replays without: the kernel is deterministic (tiles
    and merges in a fixed order), so a dependency it misses shows as logits that differ anywhere."""
    dec = decoders.load("llama-1b", device="cuda", step="persistent")
    prompt = torch.randint(0, dec.vocab_size, (1, 4096 - 300), generator=torch.Generator().manual_seed(0))
    runs = []
    for delay_ns in (0, 20_000):
        state = dec.prefill(prompt, max_new_tokens=300)
        step = state.cache.persistent
        step.consts["DELAY"] = delay_ns
        logits = []
        while not dec.finished(state):
            logits.append(dec.step(state).logits.clone())
        dec.release(state)
        assert not step.stalled()
        runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.gpu
def test_gpu_timeline_orders_every_item():
    dec = decoders.load("llama-1b", device="cuda", step="persistent")
    state = dec.prefill([[1, 2, 3]], max_new_tokens=4)
    step = dec.model.persistent_step(dec.decode_batch(state.cache, None), timeline=True)
    step(state.next_tokens, state.positions)
    rows = step.timeline()
    assert not step.stalled()
    assert len(rows) == len(step.items)
    assert all(0 <= r["start_ns"] <= r["ready_ns"] <= r["end_ns"] for r in rows)
    # No head tile is ready before every down tile was (each down tile signals after its ready stamp).
    last_down = max(r["ready_ns"] for r in rows if r["stage"] == "down")
    assert min(r["ready_ns"] for r in rows if r["stage"] == "head") >= last_down


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


@pytest.mark.interpreter
def test_a_wait_that_cannot_be_met_sets_the_stall_flag():
    dec = decoders.load("llama-tiny", device="cpu", impl="triton", step="persistent")
    state = dec.prefill([[5, 6, 7]], max_new_tokens=3)
    step = state.cache.persistent
    step.consts["MAX_POLLS"] = 3
    with torch.inference_mode():
        step(state.next_tokens, state.positions)
        assert not step.stalled()
        # The last head tile now waits for one down tile more than there are.
        step.work[-1, schedule.FIELDS.index("wait_count")] += 1
        step(state.next_tokens, state.positions)
    assert step.stalled()
