"""The harness's correctness gate checks long contexts too: a kernel that is wrong only beyond the
first few hundred positions is refused, a right one passes at every length it checks."""

import pytest
import torch

import decoders
from decoders import harness
from decoders.transformer import TransformerDecoder


class LateBug(TransformerDecoder):
    """The reference path under another impl's name, whose logits go wrong once the prompt is longer
    than `wrong_after` tokens (a kernel that breaks only at longer contexts)."""

    wrong_after = 10**9

    def _as_ref(self, run):
        impl, self.impl = self.impl, "ref"
        try:
            return run()
        finally:
            self.impl = impl

    def prefill(self, prompts, **kwargs):
        state = self._as_ref(lambda: super(LateBug, self).prefill(prompts, **kwargs))
        self.late = self.impl != "ref" and len(prompts[0]) > self.wrong_after
        if self.late:
            state.first_logits.mul_(1.05)
        return state

    def step(self, state):
        out = self._as_ref(lambda: super(LateBug, self).step(state))
        if self.late:
            out.logits.mul_(1.05)
        return out


def late_bug(wrong_after: int) -> LateBug:
    ref = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", seed=1)
    dec = LateBug(ref.model, ref.config, device=ref.device, dtype=ref.dtype, impl="triton", source="late-bug")
    dec.wrong_after = wrong_after
    return dec


def test_a_kernel_wrong_only_after_300_positions_is_refused():
    gate = harness.check_against_reference(late_bug(300), new_tokens=8)
    assert not gate["ok"], gate
    assert gate["lengths"][48]["ok"] and not gate["lengths"][2048]["ok"]
    assert gate["rel_rms"] == gate["lengths"][2048]["rel_rms"] > gate["tolerance"]


def test_a_right_kernel_passes_at_every_length():
    gate = harness.check_against_reference(late_bug(10**9), new_tokens=8)
    assert gate["ok"] and sorted(gate["lengths"]) == [48, 2048], gate
    assert all(c["rel_rms"] < 1e-6 for c in gate["lengths"].values())


def test_the_long_check_fits_the_decoders_context():
    dec = late_bug(10**9)
    dec.max_context = 600
    gate = harness.check_against_reference(dec, new_tokens=8)
    assert sorted(gate["lengths"]) == [48, 592]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny", "maskpredict-tiny"])
def test_gpu_triton_passes_the_gate_at_both_lengths(preset):
    dec = decoders.load(preset, device="cuda", dtype="bfloat16", impl="triton", seed=1)
    gate = harness.check_against_reference(dec, new_tokens=8)
    assert gate["ok"] and len(gate["lengths"]) == 2, gate
    torch.cuda.synchronize()
