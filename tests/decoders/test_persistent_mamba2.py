"""Mamba-2's persistent step (`step="persistent"`) against its graphed step: the same logits, tokens and
states over several steps (the states carried across them), on mamba2-tiny and on a config with
several tiles a head, a head size that is no power of two, no conv bias, a dt clamp and an untied
head; its own refusals. What every family checks alike is in `test_persistent_families.py`."""

import pytest
import torch

import decoders
import persistent_cases
from decoders import harness
from decoders.mamba2 import Mamba2Decoder
from declab_kernels.persistent_step import schedule, schedule_mamba2

SMALL = {"vocab_size": 301, "d_model": 48, "n_layer": 3, "d_state": 8, "d_conv": 3, "expand": 2, "headdim": 12, "ngroups": 1,
         "chunk_size": 16, "conv_bias": False, "dt_min_limit": 0.001, "dt_max_limit": 0.05, "tie_embeddings": False}
# The cache tensors both steps must leave alike.
STATES = ("conv", "ssm")


@pytest.mark.interpreter
def test_persistent_equals_graphed_mamba2_tiny():
    states = persistent_cases.compare_from_prompt(persistent_cases.pair("mamba2-tiny"), [5, 6, 7, 9, 11], 4, STATES)
    step = states[0].cache.persistent
    # Counters only grow: after four steps each holds four steps' worth, and the epoch is 4.
    n = schedule_mamba2.stage_tiles(step.shape, step.tiles)
    c = schedule_mamba2.Counters(step.shape.n_layers)
    counts = step.counters.tolist()
    assert counts[c.in_proj(1)] == 4 * n[schedule.IN] and counts[c.ssm(0)] == 4 * n[schedule.SSM]
    assert step.epoch.item() == 4 and step.done.item() == 4
    assert states[0].cache.persistent is not None and states[1].cache.persistent is None


@pytest.mark.interpreter
def test_persistent_equals_graphed_small_config():
    persistent_cases.compare_from_prompt(persistent_cases.pair(SMALL, cls=Mamba2Decoder), [3, 1, 4, 1, 5, 9, 2], 3, STATES)


@pytest.mark.interpreter
def test_two_tiles_a_head_equal_the_graphed_step():
    """The small config cut into 8-row tiles (two a head of 12 rows, the second one half empty) and small
    GEMV tiles, driven on copies of the graphed decoder's states for three steps."""
    dec = Mamba2Decoder.from_preset(SMALL, "small", device="cpu", dtype=torch.float32, impl="triton")
    state = dec.prefill([[7, 8, 9]], max_new_tokens=4)
    conv, ssm = state.cache.conv.clone(), state.cache.ssm.clone()
    tiles = schedule_mamba2.Mamba2Tiles(in_rows=8, block_p=8, out_rows=16, head_rows=32)
    with torch.inference_mode():
        step = dec.model.persistent_step(conv, ssm, tiles=tiles)
        assert schedule_mamba2.stage_tiles(step.shape, tiles)[schedule.SSM] == 2 * dec.config.nheads
        # Every element of the step's buffers is written before it is read: NaN left anywhere shows.
        for buffer in (step.zx, step.y, step.ss, step.logits):
            buffer.fill_(float("nan"))
        tokens, positions = state.next_tokens.clone(), state.positions.clone()
        for _ in range(3):
            theirs = dec.model.step(tokens, state.cache.conv, state.cache.ssm, "triton", positions=positions)
            ours = step(tokens, positions)
            assert harness.relative_rms(ours, theirs) < 1e-5
            tokens, positions = theirs.argmax(-1), positions + 1
    assert harness.relative_rms(ssm, state.cache.ssm) < 1e-5 and harness.relative_rms(conv, state.cache.conv) < 1e-5


def test_several_norm_groups_refused():
    with pytest.raises(decoders.UsageError, match="one group"):
        Mamba2Decoder.from_preset({**SMALL, "ngroups": 2}, "groups", device="cpu", dtype=torch.float32, impl="triton", step="persistent")


def test_compare_takes_the_step_for_mamba2_models():
    from decoders import compare

    args = compare.build_parser().parse_args(["--models", "llama-tiny,mamba2-tiny", "--step", "graphed,persistent", "--impl", "triton"])
    steps = compare.parse_steps(args, ["llama-tiny", "mamba2-tiny"], [1], [None], [None], None, torch.device("cpu"))
    assert steps == ["graphed", "persistent"]
    points = list(compare.plan_points(["mamba2-tiny", "maskpredict-tiny"], [64], [1], [None], steps=steps))
    assert [p[5] for p in points] == ["graphed", "persistent", None]


@pytest.mark.parametrize("model", ["maskpredict-tiny"])
def test_compare_refuses_the_step_for_other_families(model, tmp_path, capsys):
    from decoders import compare

    code = compare.main(["--no-progress", "--models", f"mamba2-tiny,{model}", "--ctx", "64", "--step", "persistent",
                         "--device", "cpu", "--impl", "triton", "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no persistent step yet" in err[0] and not (tmp_path / "out.jsonl").exists()
