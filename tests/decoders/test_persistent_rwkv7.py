"""RWKV-7's persistent step (`step="persistent"`) against its graphed step: the same logits, tokens and
states over several steps (the states carried across them), on rwkv7-tiny and on a config with a head
size that is no power of two, no pre-norm, norms without bias, a tied head and ranks that allow only
4-row tiles; its refusals; and on the GPU, bf16 tokens and many graph replays with random delays in the kernel."""

import pytest
import torch

import decoders
from decoders import harness
from decoders.rwkv7 import RWKV7Decoder
from declab_kernels.persistent_step import schedule, schedule_rwkv7

SMALL = {"vocab_size": 301, "hidden_size": 72, "num_hidden_layers": 3, "head_dim": 24, "intermediate_size": 100,
         "decay_low_rank_dim": 12, "a_low_rank_dim": 8, "v_low_rank_dim": 4, "gate_low_rank_dim": 20, "norm_first": False,
         "norm_bias": False, "tie_word_embeddings": True}


def pair(model, device="cpu", dtype=None):
    """(persistent, graphed) decoders of the same random weights."""
    if isinstance(model, str):
        make = lambda **kw: decoders.load(model, device=device, dtype=dtype, impl="triton", **kw)
    else:
        make = lambda **kw: RWKV7Decoder.from_preset(model, "small", device=device, dtype=dtype or torch.float32, impl="triton", **kw)
    return make(step="persistent"), make()


def compare_steps(decs, prompt, steps):
    states = [d.prefill([prompt], max_new_tokens=steps + 1) for d in decs]
    for _ in range(steps):
        ours, theirs = (d.step(s) for d, s in zip(decs, states))
        assert harness.relative_rms(ours.logits, theirs.logits) < 1e-5
        assert torch.equal(ours.tokens, theirs.tokens)
    for name in ("shift", "wkv"):
        assert harness.relative_rms(getattr(states[0].cache, name), getattr(states[1].cache, name)) < 1e-5
    return states


@pytest.mark.interpreter
def test_persistent_equals_graphed_rwkv7_tiny():
    states = compare_steps(pair("rwkv7-tiny"), [5, 6, 7, 9, 11], 3)
    step = states[0].cache.persistent
    # Counters only grow: after three steps each holds three steps' worth, and the epoch is 3.
    n = schedule_rwkv7.stage_tiles(step.shape, step.tiles, 1)
    c = schedule_rwkv7.Counters(step.shape.n_layers)
    counts = step.counters.tolist()
    assert counts[c.sel(1)] == 3 * n[schedule.SEL] and counts[c.mix(0)] == 3 * n[schedule.MIX] and counts[c.fnorm] == 3
    assert step.epoch.item() == 3 and step.done.item() == 3
    assert states[0].cache.persistent is not None and states[1].cache.persistent is None


@pytest.mark.interpreter
def test_persistent_equals_graphed_small_config():
    compare_steps(pair(SMALL), [3, 1, 4, 1, 5, 9, 2], 3)


@pytest.mark.interpreter
def test_float16_rounds_where_the_graphed_step_rounds():
    """float32 cannot show where a step rounds to the model dtype; float16 can (the interpreter rounds
    float16 to nearest as a GPU does, but truncates bfloat16). The first step's logits and states are
    the graphed step's bit for bit; later ones within float16 rounding (summation order inside a tile
    differs, so an output may land one ulp apart and carry on)."""
    decs = pair("rwkv7-tiny", dtype=torch.float16)
    states = [d.prefill([[5, 6, 7, 9, 11, 13, 2]], max_new_tokens=5) for d in decs]
    ours, theirs = (d.step(s).logits for d, s in zip(decs, states))
    assert torch.equal(ours, theirs)
    assert torch.equal(states[0].cache.shift, states[1].cache.shift) and torch.equal(states[0].cache.wkv, states[1].cache.wkv)
    for _ in range(3):
        ours, theirs = (d.step(s).logits for d, s in zip(decs, states))
        assert harness.relative_rms(ours.float(), theirs.float()) < 5e-3


@pytest.mark.interpreter
def test_small_tiles_equal_the_graphed_step():
    """rwkv7-tiny cut into small GEMV tiles (4-row SEL tiles: several a LoRA block), driven on copies of
    the graphed decoder's states for three steps, every step buffer NaN-filled first."""
    dec = decoders.load("rwkv7-tiny", device="cpu", impl="triton")
    state = dec.prefill([[7, 8, 9]], max_new_tokens=4)
    shift, wkv = state.cache.shift.clone(), state.cache.wkv.clone()
    tiles = schedule_rwkv7.RWKV7Tiles(sel_rows=4, o_rows=8, key_rows=16, val_rows=4, head_rows=32)
    with torch.inference_mode():
        step = dec.model.persistent_step(shift, wkv, tiles=tiles)
        assert schedule_rwkv7.stage_tiles(step.shape, tiles, 1)[schedule.SEL] == step.shape.n_sel(1) // 4
        # Every element of the step's buffers is written before it is read: NaN left anywhere shows.
        for buffer in (step.x, step.xs, step.y, step.v_first, step.mo, step.xk, step.kv, step.hf, step.logits):
            buffer.fill_(float("nan"))
        tokens = state.next_tokens.clone()
        for _ in range(3):
            theirs = dec.model.forward_step(tokens, state.cache.shift, state.cache.wkv, impl="triton")
            ours = step(tokens, state.positions)
            assert harness.relative_rms(ours, theirs) < 1e-5
            tokens = theirs.argmax(-1)
    assert harness.relative_rms(wkv, state.cache.wkv) < 1e-5 and harness.relative_rms(shift, state.cache.shift) < 1e-5


@pytest.mark.interpreter
def test_persistent_passes_the_gate():
    dec = decoders.load("rwkv7-tiny", device="cpu", impl="triton", step="persistent")
    gate = harness.check_against_reference(dec, new_tokens=4, long_tokens=64)
    assert gate["ok"], gate
    assert dec.describe()["step"] == "persistent"


@pytest.mark.parametrize("kwargs, says", [
    (dict(impl="ref", step="persistent"), "Triton kernel"),
    (dict(impl="triton", step="megakernel"), "unknown step"),
    (dict(impl="triton", step="persistent", quant="int8"), "dense"),
])
def test_refused_at_load(kwargs, says):
    with pytest.raises(decoders.UsageError, match=says):
        decoders.load("rwkv7-tiny", device="cpu", **kwargs)


def test_ranks_no_tile_divides_refused():
    with pytest.raises(decoders.UsageError, match="multiples of 4"):
        RWKV7Decoder.from_preset({**SMALL, "v_low_rank_dim": 6}, "ranks", device="cpu", dtype=torch.float32, impl="triton",
                                 step="persistent")


@pytest.mark.interpreter
def test_batch_of_two_refused():
    dec = decoders.load("rwkv7-tiny", device="cpu", impl="triton", step="persistent")
    with pytest.raises(decoders.UsageError, match="one sequence"):
        dec.prefill([[1, 2], [3, 4]], max_new_tokens=2)


@pytest.mark.interpreter
def test_a_wait_that_cannot_be_met_sets_the_stall_flag():
    dec = decoders.load("rwkv7-tiny", device="cpu", impl="triton", step="persistent")
    state = dec.prefill([[5, 6, 7]], max_new_tokens=3)
    step = state.cache.persistent
    step.consts["MAX_POLLS"] = 3
    with torch.inference_mode():
        step(state.next_tokens, state.positions)
        assert not step.stalled()
        # The last head tile now waits for the final norm twice.
        step.work[-1, schedule.FIELDS.index("wait_count")] += 1
        step(state.next_tokens, state.positions)
    assert step.stalled()


@pytest.mark.gpu
def test_gpu_bf16_tokens_equal_graphed_rwkv7_1_5b():
    """32 greedy steps of both, the persistent one fed the graphed one's tokens: logits within bf16
    rounding, and the same token wherever the graphed step's top two logits are not a near-tie
    (random weights make flat logits, where either step's rounding may pick the other)."""
    decs = pair("rwkv7-1.5b", "cuda", torch.bfloat16)
    prompt = torch.randint(0, decs[0].vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    states = [d.prefill(prompt, max_new_tokens=33) for d in decs]
    assert torch.equal(states[0].next_tokens, states[1].next_tokens)
    decided = 0
    with torch.inference_mode():
        for _ in range(32):
            ours, theirs = (d.step(s).logits.float() for d, s in zip(decs, states))
            assert harness.relative_rms(ours, theirs) < 3e-2
            top = theirs.topk(2).values[0]
            if top[0] - top[1] > 1e-2 * theirs.std():
                decided += 1
                assert torch.equal(states[0].next_tokens, states[1].next_tokens)
            states[0].next_tokens.copy_(states[1].next_tokens)
    assert decided >= 16
    assert harness.relative_rms(states[0].cache.wkv, states[1].cache.wkv) < 3e-2
    assert not states[0].cache.persistent.stalled()


@pytest.mark.gpu
def test_gpu_many_replays_with_random_delays():
    """The graphed persistent step of rwkv7-1.5b replayed 300 times with every item spinning a random
    0..20 us before its wait, against the same replays without: the kernel is deterministic (fixed
    tiles, no atomics on data), so a dependency it misses shows as logits that differ anywhere."""
    dec = decoders.load("rwkv7-1.5b", device="cuda", step="persistent")
    prompt = torch.randint(0, dec.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
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
    dec = decoders.load("rwkv7-1.5b", device="cuda", step="persistent")
    state = dec.prefill([[1, 2, 3]], max_new_tokens=4)
    step = dec.persistent_step(state.cache, timeline=True)
    step(state.next_tokens, state.positions)
    rows = step.timeline()
    assert not step.stalled()
    assert len(rows) == len(step.items)
    assert all(0 <= r["start_ns"] <= r["ready_ns"] <= r["end_ns"] for r in rows)
    # No o_proj tile of a layer is ready before every head's time mix of it was.
    last_mix = max(r["ready_ns"] for r in rows if r["stage"] == "mix" and r["layer"] == 0)
    assert min(r["ready_ns"] for r in rows if r["stage"] == "o" and r["layer"] == 0) >= last_mix


def test_compare_takes_the_step_for_rwkv7_models():
    from decoders import compare

    args = compare.build_parser().parse_args(["--models", "rwkv7-tiny", "--step", "graphed,persistent", "--impl", "triton"])
    steps = compare.parse_steps(args, ["rwkv7-tiny"], [1], [None], [None], None, torch.device("cpu"))
    assert steps == ["graphed", "persistent"]
    points = list(compare.plan_points(["rwkv7-tiny"], [64], [1], [None], steps=steps))
    assert [p[5] for p in points] == ["graphed", "persistent"]
