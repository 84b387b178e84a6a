"""The persistent step (`step="persistent"`) of every family that has one, where the checks are the
same: its refusals at load and of a batch of two, the stall flag of a wait that cannot be met, the
gate of the recurrent families, half-precision logits and tokens against the graphed step's own error; and on the GPU, bf16 logits and tokens, many graph replays with random delays in
the kernel, and the timeline's order (`persistent_cases`)."""

import pytest
import torch

import decoders
import persistent_cases
from decoders import harness
from declab_kernels.persistent_step import schedule

TINY = ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"]


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("kwargs, says", [
    (dict(impl="ref", step="persistent"), "Triton kernel"),
    (dict(impl="triton", step="megakernel"), "unknown step"),
    (dict(impl="triton", step="persistent", quant="int8"), "dense"),
])
def test_refused_at_load(model, kwargs, says):
    with pytest.raises(decoders.UsageError, match=says):
        decoders.load(model, device="cpu", **kwargs)


@pytest.mark.interpreter
@pytest.mark.parametrize("model", TINY)
def test_batch_of_two_refused(model):
    dec = decoders.load(model, device="cpu", impl="triton", step="persistent")
    with pytest.raises(decoders.UsageError, match="one sequence"):
        dec.prefill([[1, 2], [3, 4]], max_new_tokens=2)


@pytest.mark.interpreter
@pytest.mark.parametrize("model", TINY)
def test_a_wait_that_cannot_be_met_sets_the_stall_flag(model):
    dec = decoders.load(model, device="cpu", impl="triton", step="persistent")
    state = dec.prefill([[5, 6, 7]], max_new_tokens=3)
    step = state.cache.persistent
    step.consts["MAX_POLLS"] = 3
    with torch.inference_mode():
        step(state.next_tokens, state.positions)
        assert not step.stalled()
        # The last head tile now waits for one signal more than the items before it give a step.
        step.work[-1, schedule.FIELDS.index("wait_count")] += 1
        step(state.next_tokens, state.positions)
    assert step.stalled()


@pytest.mark.interpreter
@pytest.mark.parametrize("model", ["mamba2-tiny", "rwkv7-tiny"])
def test_persistent_passes_the_gate(model):
    dec = decoders.load(model, device="cpu", impl="triton", step="persistent")
    gate = harness.check_against_reference(dec, new_tokens=4, long_tokens=64)
    assert gate["ok"], gate
    assert dec.describe()["step"] == "persistent"


@pytest.mark.interpreter
@pytest.mark.parametrize("model, cache_name", [("llama-tiny", None), ("mamba2-tiny", "ssm"), ("rwkv7-tiny", "wkv")])
def test_half_precision_follows_graphed(model, cache_name):
    """The GPU check below, in float16 under the interpreter: its allowance from the gate, its tokens."""
    persistent_cases.bf16_follows_graphed(model, 20, 6, cache_name, device="cpu", dtype=torch.float16, gate_tokens=64)


@pytest.mark.gpu
@pytest.mark.parametrize("model, prompt_len, steps, cache_name", [
    ("llama-1b", 4096 - 33, 32, None),
    ("llama-1b", 32768 - 33, 32, None),
    ("mamba2-1.3b", 512, 32, "ssm"),
    ("rwkv7-1.5b", 512, 32, "wkv"),
], ids=["llama-1b-4k", "llama-1b-32k", "mamba2-1.3b", "rwkv7-1.5b"])
def test_gpu_bf16_follows_graphed(model, prompt_len, steps, cache_name):
    persistent_cases.bf16_follows_graphed(model, prompt_len, steps, cache_name)


@pytest.mark.gpu
@pytest.mark.parametrize("model, prompt_len", [("llama-1b", 4096 - 300), ("mamba2-1.3b", 256), ("rwkv7-1.5b", 256)])
def test_gpu_many_replays_with_random_delays(model, prompt_len):
    persistent_cases.replays_with_random_delays(model, prompt_len)


@pytest.mark.gpu
@pytest.mark.parametrize("model, before, after, layer", [
    ("llama-1b", "down", "head", None),
    ("mamba2-1.3b", "ssm", "out", 0),
    ("rwkv7-1.5b", "mix", "o", 0),
])
def test_gpu_timeline_orders_every_item(model, before, after, layer):
    persistent_cases.timeline_orders(model, before, after, layer)
