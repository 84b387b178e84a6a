"""RWKV-7's persistent step (`step="persistent"`) against its graphed step: the same logits, tokens and
states over several steps (the states carried across them), on rwkv7-tiny and on a config with a head
size that is no power of two, no pre-norm, norms without bias, a tied head and ranks that allow only
4-row tiles; float16 rounding; its own refusals. What every family checks alike is in
`test_persistent_families.py`."""

import pytest
import torch

import decoders
import persistent_cases
from decoders import harness
from decoders.rwkv7 import RWKV7Decoder
from declab_kernels.persistent_step import schedule, schedule_rwkv7

SMALL = {"vocab_size": 301, "hidden_size": 72, "num_hidden_layers": 3, "head_dim": 24, "intermediate_size": 100,
         "decay_low_rank_dim": 12, "a_low_rank_dim": 8, "v_low_rank_dim": 4, "gate_low_rank_dim": 20, "norm_first": False,
         "norm_bias": False, "tie_word_embeddings": True}
# The cache tensors both steps must leave alike.
STATES = ("shift", "wkv")


@pytest.mark.interpreter
def test_persistent_equals_graphed_rwkv7_tiny():
    states = persistent_cases.compare_from_prompt(persistent_cases.pair("rwkv7-tiny"), [5, 6, 7, 9, 11], 3, STATES)
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
    persistent_cases.compare_from_prompt(persistent_cases.pair(SMALL, cls=RWKV7Decoder), [3, 1, 4, 1, 5, 9, 2], 3, STATES)


@pytest.mark.interpreter
def test_float16_rounds_where_the_graphed_step_rounds():
    """float32 cannot show where a step rounds to the model dtype; float16 can (the interpreter rounds
    float16 to nearest as a GPU does, but truncates bfloat16). The first step's logits and states are
    the graphed step's bit for bit; later ones within float16 rounding (summation order inside a tile
    differs, so an output may land one ulp apart and carry on)."""
    decs = persistent_cases.pair("rwkv7-tiny", dtype=torch.float16)
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


def test_ranks_no_tile_divides_refused():
    with pytest.raises(decoders.UsageError, match="multiples of 4"):
        RWKV7Decoder.from_preset({**SMALL, "v_low_rank_dim": 6}, "ranks", device="cpu", dtype=torch.float32, impl="triton",
                                 step="persistent")


def test_hidden_size_off_a_multiple_of_8_refused():
    with pytest.raises(decoders.UsageError, match="multiple of 8"):
        RWKV7Decoder.from_preset({**SMALL, "hidden_size": 60, "head_dim": 20}, "c60", device="cpu", dtype=torch.float32, impl="triton",
                                 step="persistent")


def test_compare_takes_the_step_for_rwkv7_models():
    from decoders import compare

    args = compare.build_parser().parse_args(["--models", "rwkv7-tiny", "--step", "graphed,persistent", "--impl", "triton"])
    steps = compare.parse_steps(args, ["rwkv7-tiny"], [1], [None], [None], None, torch.device("cpu"))
    assert steps == ["graphed", "persistent"]
    points = list(compare.plan_points(["rwkv7-tiny"], [64], [1], [None], steps=steps))
    assert [p[5] for p in points] == ["graphed", "persistent"]
