"""What the persistent-step decoder tests of every family share: a (persistent, graphed) pair of
decoders, steps of both compared, and the GPU checks (bf16 logits and tokens following the graphed step, graph
replays with random delays in the kernel, the timeline's order)."""

import torch

import decoders
from decoders import harness


def pair(model, device="cpu", dtype=None, cls=None, name="small"):
    """(persistent, graphed) decoders of the same random weights: of preset `model`, or of config dict
    `model` through `cls.from_preset` (preset name `name`, float32 unless `dtype`)."""
    if isinstance(model, str):
        make = lambda **kw: decoders.load(model, device=device, dtype=dtype, impl="triton", **kw)
    else:
        make = lambda **kw: cls.from_preset(model, name, device=device, dtype=dtype or torch.float32, impl="triton", **kw)
    return make(step="persistent"), make()


def compare_steps(decs, states, steps, cache_names=()):
    """`steps` steps of both decoders from their `states`: the same logits (relative RMS 1e-5) and tokens,
    then the cache tensors named `cache_names` alike."""
    for _ in range(steps):
        ours, theirs = (d.step(s) for d, s in zip(decs, states))
        assert harness.relative_rms(ours.logits, theirs.logits) < 1e-5
        assert torch.equal(ours.tokens, theirs.tokens)
    for name in cache_names:
        assert harness.relative_rms(getattr(states[0].cache, name), getattr(states[1].cache, name)) < 1e-5


def bf16_follows_graphed(model, prompt_len, steps, cache_name=None, device="cuda", dtype=torch.bfloat16, gate_tokens=2048):
    """`steps` greedy steps of both in bf16 on the GPU (or `dtype` on `device`), the persistent one fed the graphed one's tokens.
    Two bf16 computations of the same logits each carry their own rounding: the allowance is twice the
    graphed step's error against the float32 reference (the correctness gate's measure, at 48 and 2048
    tokens, or `gate_tokens`), since by the triangle inequality two results that are each within e of the truth are
    within 2e of each other. Logits (and the cache tensor `cache_name` at the end) within it at every
    step; the same token wherever the graphed step's top-two margin is beyond 4x that allowance of the
    logits' RMS (rounding cannot flip it), on at least one of the steps."""
    decs = pair(model, device, dtype)
    gate = harness.check_against_reference(decs[1], new_tokens=4, long_tokens=gate_tokens)
    assert gate["ok"], gate
    allowance = 2 * max(c["rel_rms"] for c in gate["lengths"].values()) + 1e-3
    prompt = torch.randint(0, decs[0].vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    states = [d.prefill(prompt, max_new_tokens=steps + 1) for d in decs]
    assert torch.equal(states[0].next_tokens, states[1].next_tokens)
    decided = 0
    with torch.inference_mode():
        for _ in range(steps):
            ours, theirs = (d.step(s).logits.float() for d, s in zip(decs, states))
            assert harness.relative_rms(ours, theirs) < allowance
            top = theirs.topk(2).values[0]
            if top[0] - top[1] > 4 * allowance * theirs.pow(2).mean().sqrt():
                decided += 1
                assert torch.equal(states[0].next_tokens, states[1].next_tokens)
            states[0].next_tokens.copy_(states[1].next_tokens)
    assert decided >= 1
    if cache_name is not None:
        assert harness.relative_rms(getattr(states[0].cache, cache_name), getattr(states[1].cache, cache_name)) < allowance
    assert not states[0].cache.persistent.stalled()


def replays_with_random_delays(model, prompt_len):
    """The graphed persistent step of `model` replayed 300 times after a `prompt_len`-token prompt with
    every item spinning a random 0..20 us before its wait, against the same replays without: the kernel
    is deterministic (fixed tiles, merges in a fixed order, no atomics on data), so a dependency it
    misses shows as logits that differ anywhere."""
    dec = decoders.load(model, device="cuda", step="persistent")
    prompt = torch.randint(0, dec.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
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


def timeline_orders(model, before, after, layer=None):
    """One timed launch of `model`'s persistent step: a row per item, each started, ready and ended in that
    order, and no item of stage `after` ready before every item of stage `before` was (of layer `layer`,
    or of every layer: each item signals after its ready stamp)."""
    dec = decoders.load(model, device="cuda", step="persistent")
    state = dec.prefill([[1, 2, 3]], max_new_tokens=4)
    step = dec.persistent_step(state.cache, timeline=True)
    step(state.next_tokens, state.positions)
    rows = step.timeline()
    assert not step.stalled()
    assert len(rows) == len(step.items)
    assert all(0 <= r["start_ns"] <= r["ready_ns"] <= r["end_ns"] for r in rows)
    rows = [r for r in rows if layer is None or r["layer"] == layer]
    last = max(r["ready_ns"] for r in rows if r["stage"] == before)
    assert min(r["ready_ns"] for r in rows if r["stage"] == after) >= last


def compare_from_prompt(decs, prompt, steps, cache_names=()):
    """Both decoders prefilled with the one sequence `prompt`, then `compare_steps`; their states."""
    states = [d.prefill([prompt], max_new_tokens=steps + 1) for d in decs]
    compare_steps(decs, states, steps, cache_names)
    return states
