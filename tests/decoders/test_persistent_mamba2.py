"""Mamba-2's persistent step (`step="persistent"`) against its graphed step: the same logits, tokens and
states over several steps (the states carried across them), on mamba2-tiny and on a config with
several tiles a head, a head size that is no power of two, no conv bias, a dt clamp and an untied
head; its refusals; and on the GPU, bf16 tokens and many graph replays with random delays in the kernel."""

import pytest
import torch

import decoders
from decoders import harness
from decoders.mamba2 import Mamba2Decoder
from declab_kernels.persistent_step import schedule, schedule_mamba2

SMALL = {"vocab_size": 301, "d_model": 48, "n_layer": 3, "d_state": 8, "d_conv": 3, "expand": 2, "headdim": 12, "ngroups": 1,
         "chunk_size": 16, "conv_bias": False, "dt_min_limit": 0.001, "dt_max_limit": 0.05, "tie_embeddings": False}


def pair(model, device="cpu", dtype=None):
    """(persistent, graphed) decoders of the same random weights."""
    if isinstance(model, str):
        make = lambda **kw: decoders.load(model, device=device, dtype=dtype, impl="triton", **kw)
    else:
        make = lambda **kw: Mamba2Decoder.from_preset(model, "small", device=device, dtype=dtype or torch.float32, impl="triton", **kw)
    return make(step="persistent"), make()


def compare_steps(decs, prompt, steps):
    states = [d.prefill([prompt], max_new_tokens=steps + 1) for d in decs]
    for _ in range(steps):
        ours, theirs = (d.step(s) for d, s in zip(decs, states))
        assert harness.relative_rms(ours.logits, theirs.logits) < 1e-5
        assert torch.equal(ours.tokens, theirs.tokens)
    for name in ("conv", "ssm"):
        assert harness.relative_rms(getattr(states[0].cache, name), getattr(states[1].cache, name)) < 1e-5
    return states


@pytest.mark.interpreter
def test_persistent_equals_graphed_mamba2_tiny():
    states = compare_steps(pair("mamba2-tiny"), [5, 6, 7, 9, 11], 4)
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
    compare_steps(pair(SMALL), [3, 1, 4, 1, 5, 9, 2], 3)


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


@pytest.mark.interpreter
def test_persistent_passes_the_gate():
    dec = decoders.load("mamba2-tiny", device="cpu", impl="triton", step="persistent")
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
        decoders.load("mamba2-tiny", device="cpu", **kwargs)


def test_several_norm_groups_refused():
    with pytest.raises(decoders.UsageError, match="one group"):
        Mamba2Decoder.from_preset({**SMALL, "ngroups": 2}, "groups", device="cpu", dtype=torch.float32, impl="triton", step="persistent")


@pytest.mark.interpreter
def test_batch_of_two_refused():
    dec = decoders.load("mamba2-tiny", device="cpu", impl="triton", step="persistent")
    with pytest.raises(decoders.UsageError, match="one sequence"):
        dec.prefill([[1, 2], [3, 4]], max_new_tokens=2)


@pytest.mark.interpreter
def test_a_wait_that_cannot_be_met_sets_the_stall_flag():
    dec = decoders.load("mamba2-tiny", device="cpu", impl="triton", step="persistent")
    state = dec.prefill([[5, 6, 7]], max_new_tokens=3)
    step = state.cache.persistent
    step.consts["MAX_POLLS"] = 3
    with torch.inference_mode():
        step(state.next_tokens, state.positions)
        assert not step.stalled()
        # The last head tile now waits for one out_proj tile more than there are.
        step.work[-1, schedule.FIELDS.index("wait_count")] += 1
        step(state.next_tokens, state.positions)
    assert step.stalled()


@pytest.mark.gpu
def test_gpu_bf16_tokens_equal_graphed_mamba2_1_3b():
    """32 greedy steps of both, the persistent one fed the graphed one's tokens: logits within bf16
    rounding, and the same token wherever the graphed step's top two logits are not a near-tie
    (random weights make flat logits, where either step's rounding may pick the other)."""
    decs = pair("mamba2-1.3b", "cuda", torch.bfloat16)
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
    assert harness.relative_rms(states[0].cache.ssm, states[1].cache.ssm) < 3e-2
    assert not states[0].cache.persistent.stalled()


@pytest.mark.gpu
def test_gpu_many_replays_with_random_delays():
    """The graphed persistent step of mamba2-1.3b replayed 300 times with every item spinning a random
    0..20 us before its wait, against the same replays without: the kernel is deterministic (fixed
    tiles, no atomics on data), so a dependency it misses shows as logits that differ anywhere."""
    dec = decoders.load("mamba2-1.3b", device="cuda", step="persistent")
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
    dec = decoders.load("mamba2-1.3b", device="cuda", step="persistent")
    state = dec.prefill([[1, 2, 3]], max_new_tokens=4)
    step = dec.persistent_step(state.cache, timeline=True)
    step(state.next_tokens, state.positions)
    rows = step.timeline()
    assert not step.stalled()
    assert len(rows) == len(step.items)
    assert all(0 <= r["start_ns"] <= r["ready_ns"] <= r["end_ns"] for r in rows)
    # No out_proj tile of a layer is ready before every SSM tile of it was.
    last_ssm = max(r["ready_ns"] for r in rows if r["stage"] == "ssm" and r["layer"] == 0)
    assert min(r["ready_ns"] for r in rows if r["stage"] == "out" and r["layer"] == 0) >= last_ssm


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
