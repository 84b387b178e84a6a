"""The continuous-batching engine: every request's tokens equal the same request decoded alone, under
random arrivals, chunked prefill and preemption; nothing leaks; the scheduler's decisions on their own."""

import random
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import decoders
from decoders import Sampling, UsageError
from decoders import engine as engine_module
from decoders.engine import Engine, EngineFull, Request, Scheduler, Sequence, buckets, sample_rows
from decoders.kv_cache import PagedKVCache

PRESETS = {"transformer": "llama-tiny", "mamba2": "mamba2-tiny", "rwkv7": "rwkv7-tiny", "maskpredict": "maskpredict-tiny"}
_DECODERS = {}


def decoder(family, **options):
    key = (family, tuple(sorted(options.items())))
    if key not in _DECODERS:
        _DECODERS[key] = decoders.load(PRESETS[family], device="cpu", dtype="float32", impl="ref", **options)
    return _DECODERS[key]


def random_requests(rng, n, *, max_prompt=30, new=(1, 12), sampling=None):
    return [Request(prompt=[rng.randrange(3, 500) for _ in range(rng.randint(1, max_prompt))],
                    max_new_tokens=rng.choice(new) if isinstance(new, list) else rng.randint(*new),
                    sampling=sampling(i) if sampling else Sampling()) for i in range(n)]


def run_with_arrivals(engine, requests, rng):
    """Add the requests at random steps; all tokens per request (in order) and the per-step outputs."""
    pending, ids, tokens = list(requests), [], {}
    while pending or engine.has_unfinished():
        while pending and rng.random() < 0.4:
            ids.append(engine.add_request(pending.pop(0)))
        for out in engine.step():
            got = tokens.setdefault(out.request_id, [])
            got += out.new_tokens
            assert out.output_tokens == len(got)
    return [tokens[i] for i in ids]


def random_events(engine, rng, count, new_request, *, add, cancel):
    """`count` random events on `engine`, yielding after each: with probability `add` a request from
    `new_request()` arrives, with `cancel` a live one is cancelled, else the engine steps."""
    live = []
    for _ in range(count):
        roll = rng.random()
        if roll < add:
            live.append(engine.add_request(new_request()))
        elif roll < add + cancel and live:
            engine.cancel(live.pop(rng.randrange(len(live))))
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        yield


def alone(dec, request):
    return dec.generate([request.prompt], request.max_new_tokens, request.sampling).tokens[0]


@pytest.mark.parametrize("family", ["transformer", "mamba2", "rwkv7"])
def test_greedy_tokens_equal_decoding_alone_under_random_arrivals(family):
    dec = decoder(family)
    rng = random.Random(7)
    requests = random_requests(rng, 10)
    # A small step budget, so that prompts are cut into chunks mixed into decode steps.
    engine = Engine(dec, max_batch=4, max_step_tokens=9, **({"num_blocks": 64} if family == "transformer" else {}))
    got = run_with_arrivals(engine, requests, rng)
    assert got == [alone(dec, r) for r in requests]
    stats = engine.stats()
    assert stats["finished"] == 10 and stats["running"] == stats["waiting"] == 0
    assert stats["tokens_generated"] == sum(r.max_new_tokens for r in requests)


@pytest.mark.parametrize("options", [{}, {"block_length": 4}, {"block_length": 4, "rule": "low-confidence"}])
def test_maskpredict_tokens_equal_decoding_alone_under_random_arrivals(options):
    dec = decoder("maskpredict", **options)
    rng = random.Random(3)
    requests = random_requests(rng, 9, max_prompt=20, new=[4, 8],
                               sampling=lambda i: Sampling(temperature=1.0, seed=i) if i % 4 == 3 else Sampling())
    engine = Engine(dec, max_batch=4, max_step_tokens=40)
    got = run_with_arrivals(engine, requests, rng)
    # A sampled request decodes as a cohort of its own, so even its tokens are generate's.
    assert got == [alone(dec, r) for r in requests]
    assert engine.stats()["kv_blocks_used"] == 0


def test_preemption_under_a_small_block_pool_loses_nothing():
    dec = decoder("transformer")
    rng = random.Random(1)
    requests = random_requests(rng, 8, max_prompt=40, new=(10, 40))
    # 6 usable blocks of 16 positions: two long requests fill the pool, so running ones are preempted.
    engine = Engine(dec, max_batch=4, max_step_tokens=24, num_blocks=7)
    got = run_with_arrivals(engine, requests, rng)
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert got == [alone(dec, r) for r in requests]
    assert stats["kv_blocks_used"] == 0 and stats["finished"] == 8


@pytest.mark.parametrize("family", ["transformer", "mamba2"])
def test_a_seed_gives_the_same_tokens_alone_or_batched(family):
    dec = decoder(family)
    rng = random.Random(5)
    requests = random_requests(rng, 6, new=(12, 12), sampling=lambda i: Sampling(
        temperature=1.0, top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i // 2 % 2], seed=100 + i))
    # Greedy requests in the same batch keep generate's tokens.
    requests += random_requests(rng, 2, new=(12, 12))
    batched = run_with_arrivals(Engine(dec, max_batch=4, max_step_tokens=16), requests, rng)
    for r, tokens in zip(requests, batched):
        assert tokens == next(iter(Engine(dec, max_batch=1, max_step_tokens=5).run([r]).values()))
    assert batched[-2:] == [alone(dec, r) for r in requests[-2:]]
    # Different seeds draw different tokens.
    assert len({tuple(t) for t in batched[:6]}) == 6


def test_sample_rows_draws_from_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    n = 6000
    rows = logits.expand(n, 6)
    full = lambda v: torch.full((n,), v)
    seeds, counters = torch.full((n,), 11, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    drawn = sample_rows(rows, full(0.7), full(0).long(), full(1.0), seeds, counters, impl="ref")
    expected = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(drawn, minlength=6).double() / n
    assert (freq - expected.double()).abs().max() < 0.03
    # top-k 2 leaves only the two most likely tokens; temperature 0 is the argmax.
    top2 = sample_rows(rows, full(1.0), full(2).long(), full(1.0), seeds, counters, impl="ref")
    assert set(top2.tolist()) == set(logits[0].topk(2).indices.tolist())
    greedy = sample_rows(rows, full(0.0), full(0).long(), full(1.0), seeds, counters, impl="ref")
    assert set(greedy.tolist()) == {int(logits[0].argmax())}


def test_stop_tokens_and_max_new_tokens_end_a_request():
    dec = decoder("transformer")
    prompt = [5, 6, 7, 8]
    reference = alone(dec, Request(prompt, 12))
    stop = reference[4]
    engine = Engine(dec, max_batch=2, max_step_tokens=8, num_blocks=16)
    a = engine.add_request(Request(prompt, 12, stop_token_ids=(stop,)))
    b = engine.add_request(Request(prompt, 3))
    outs = [o for _ in range(20) for o in engine.step()]
    final = {o.request_id: o for o in outs if o.finished}
    assert final[a].finish_reason == "stop" and final[a].output_tokens == reference.index(stop) + 1
    assert final[b].finish_reason == "length" and final[b].output_tokens == 3
    assert sum((o.new_tokens for o in outs if o.request_id == a), []) == reference[: reference.index(stop) + 1]


def test_cancel_frees_at_once_and_is_reported_at_the_next_step():
    dec = decoder("transformer")
    engine = Engine(dec, max_batch=2, max_step_tokens=64, num_blocks=16)
    rid = engine.add_request(Request(list(range(3, 40)), 20))
    engine.step()
    assert engine.stats()["kv_blocks_used"] == 3
    assert engine.cancel(rid) and not engine.cancel(rid)
    assert engine.stats()["kv_blocks_used"] == 0
    (out,) = engine.step()
    assert (out.request_id, out.finished, out.finish_reason, out.new_tokens) == (rid, True, "cancelled", [])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("family", ["transformer", "rwkv7", "maskpredict"])
def test_no_block_or_slot_leaks_after_thousands_of_random_events(family):
    dec = decoder(family)
    rng = random.Random(11)
    engine = Engine(dec, max_batch=6, max_step_tokens=12, **({"num_blocks": 6} if family == "transformer" else {}))

    def request():
        new = rng.choice([4, 8]) if family == "maskpredict" else rng.randint(1, 6)
        return Request([rng.randrange(3, 500) for _ in range(rng.randint(1, 30))], new)

    for _ in random_events(engine, rng, 2000, request, add=0.45, cancel=0.15):
        pass
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0
    if family == "transformer":
        assert stats["kv_blocks_used"] == 0 and stats["preemptions"] > 0
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - 1 and not engine.kv.blocks
        assert bool((engine.runner.tables == engine.runner.scratch).all())
    elif family == "rwkv7":
        assert stats["slots_used"] == 0 and sorted(engine.scheduler.free_slots) == list(range(6))
    else:
        assert not engine.runner.cohorts
    if family != "maskpredict":
        assert engine.runner.rows == []


@pytest.mark.parametrize("family", ["transformer", "mamba2"])
def test_the_runners_incremental_bookkeeping_matches_a_full_scan_after_every_event(family):
    """Row indices, the count of sampling rows and the block tables are kept up to date on admission,
    retirement, cancellation and preemption (the tables only where the scheduler gave a request
    blocks), not recomputed per step: after every event they equal what scanning the rows gives."""
    dec = decoder(family)
    rng = random.Random(13)
    engine = Engine(dec, max_batch=5, max_step_tokens=12, **({"num_blocks": 8} if family == "transformer" else {}))
    runner = engine.runner

    def request():
        sampling = Sampling(temperature=1.0, seed=rng.randrange(100)) if rng.random() < 0.3 else Sampling()
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        return Request(prompt, rng.randint(1, 40), sampling=sampling)

    for _ in random_events(engine, rng, 600, request, add=0.35, cancel=0.1):
        assert [s.row for s in runner.rows] == list(range(len(runner.rows)))
        assert all((s.row is not None) == (s.status == "decode") for s in engine.seqs.values())
        assert runner.sampled_rows == sum(not s.request.sampling.greedy for s in runner.rows)
        if family == "transformer":
            expected = torch.full_like(runner.tables, runner.scratch)
            for i, s in enumerate(runner.rows):
                blocks = engine.kv.blocks[s.kv_seq]
                expected[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            assert torch.equal(runner.tables, expected)
    if family == "transformer":
        assert engine.stats()["preemptions"] > 0


def test_scheduler_chunks_long_prompts_under_the_step_budget():
    kv = PagedKVCache(1, 1, 16, block_size=16, num_blocks=64)
    sched = Scheduler(max_batch=4, max_step_tokens=10, kv=kv)
    seqs = [Sequence(Request([1] * n, 4), str(i), [1] * n, n, frozenset()) for i, n in enumerate([3, 25, 4])]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [(s.id, n) for s, n in plan.prefill] == [("0", 3), ("1", 7)]
    for s, n in plan.prefill:
        s.computed += n
    # Request 0 finished its prompt and decodes: one token of the budget, nine left for prefills.
    seqs[0].tokens.append(9)
    seqs[0].status = "decode"
    plan = sched.schedule()
    assert [s.id for s in plan.decode] == ["0"]
    assert [(s.id, n) for s, n in plan.prefill] == [("1", 9)]
    assert sum(n for _, n in plan.prefill) + len(plan.decode) <= 10


def two_decoding(num_blocks, new_tokens=8):
    """A scheduler over a pool of `num_blocks` blocks of 16 whose two requests ("a" admitted first) have
    prefilled 16-token prompts and sampled their first token: each holds one full block."""
    kv = PagedKVCache(1, 1, 16, block_size=16, num_blocks=num_blocks)
    sched = Scheduler(max_batch=4, max_step_tokens=64, kv=kv)
    seqs = [Sequence(Request([1] * 16, new_tokens), i, [1] * 16, 16, frozenset()) for i in "ab"]
    for s in seqs:
        sched.add(s)
    for s, n in sched.schedule().prefill:
        s.computed += n
        s.tokens.append(2)
        s.status = "decode"
    return sched, kv, seqs


def test_scheduler_preempts_the_newest_request():
    sched, kv, (old, new) = two_decoding(3)
    # Each holds one full block and needs a second: only one is free, so the newer request goes.
    plan = sched.schedule()
    assert plan.preempted == [new] and plan.decode == [old]
    assert list(sched.waiting) == [new] and new.status == "waiting" and new.tokens == [1] * 16 + [2]
    assert sched.preemptions == 1 and kv.pool.num_free == 1


def test_a_decoding_request_reserves_blocks_ahead_only_while_the_pool_has_room():
    def crossing(num_blocks, new_tokens=200):
        """The step where both requests feed their 17th token and need a second block."""
        sched, kv, seqs = two_decoding(num_blocks, new_tokens)
        return sched.schedule(), kv, seqs

    # Room: each takes GROW_AHEAD_BLOCKS blocks at once, and the runner is told what each held before.
    plan, kv, seqs = crossing(64)
    assert plan.decode == seqs and not plan.preempted
    assert [len(kv.blocks[s.kv_seq]) for s in seqs] == [1 + engine_module.GROW_AHEAD_BLOCKS] * 2
    assert [(s, have) for s, have in plan.grown] == [(seqs[0], 1), (seqs[1], 1)]
    # Never past the request's last position: 16 + 20 tokens fit in 3 blocks.
    plan, kv, seqs = crossing(64, new_tokens=20)
    assert [len(kv.blocks[s.kv_seq]) for s in seqs] == [3, 3]
    # No room beyond one free block per running request: one block each, as without reserving ahead.
    plan, kv, seqs = crossing(5)
    assert plan.decode == seqs and [len(kv.blocks[s.kv_seq]) for s in seqs] == [2, 2]


def test_user_errors_are_refused_before_anything_runs():
    dec = decoder("transformer")
    engine = Engine(dec, max_batch=2, max_step_tokens=8, max_waiting=1, num_blocks=8)
    for bad, message in [
        (Request([], 4), "at least one token"),
        (Request([1, 2], 0), "max_new_tokens"),
        (Request([1, 600], 4), "outside the vocabulary"),
        (Request([1] * 100, 20), "maximum"),
        (Request([1, 2], 4, stop_token_ids=(None,)), "stop_token_ids"),
    ]:
        with pytest.raises(UsageError, match=message):
            engine.add_request(bad)
    engine.add_request(Request([1, 2], 4, request_id="x"))
    with pytest.raises(EngineFull):
        engine.add_request(Request([1, 2], 4))
    with pytest.raises(UsageError, match="request_id"):
        Engine(dec, max_batch=2, num_blocks=8).add_request(Request([1], 1, request_id=7))
    with pytest.raises(UsageError, match="max_batch"):
        Engine(dec, max_batch=0)
    with pytest.raises(UsageError, match="block_length"):
        Engine(decoder("maskpredict", block_length=4)).add_request(Request([1], 6))


@pytest.mark.parametrize("family", ["transformer", "rwkv7", "maskpredict"])
def test_the_steps_that_consume_prompt_tokens_are_counted_apart(family):
    engine = Engine(decoder(family), max_batch=2, max_step_tokens=4)
    # 10 prompt tokens at 4 a step: 3 steps prefill (a Mask-Predict cohort starts in one step).
    engine.run([Request(list(range(3, 13)), 4 if family == "maskpredict" else 3)])
    s = engine.stats()
    assert s["prefill_steps"] == (1 if family == "maskpredict" else 3) < s["steps"]
    assert 0 < s["prefill_host_s_total"] <= s["prefill_step_s_total"] <= s["step_s_total"]
    assert s["prefill_host_s_total"] <= s["host_s_total"]


class HostWaits(TorchFunctionMode):
    """Records the calls of the engine's and the families' own code (decoders/, declab_arch/) that on a
    GPU would wait for the device: a Python list used as an index, `torch.tensor(..., device=)`, `.to()`
    a device without non_blocking, `.item()` / `.tolist()` (but in `collect`, the one wait a step
    makes). The kernels' reference paths, which the GPU runs do not take, are not looked at."""

    ROOTS = tuple(str(Path(decoders.__file__).parents[1] / d) for d in ("decoders", "declab_arch"))

    def __init__(self):
        super().__init__()
        self.sites = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        waits = (isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index)
                 or name in ("tensor", "as_tensor") and kwargs.get("device") is not None
                 or name in ("item", "tolist")
                 or name == "to" and not kwargs.get("non_blocking")
                 and any(isinstance(a, (str, torch.device)) for a in (*args[1:], kwargs.get("device"))))
        if waits:
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if f.filename.startswith(self.ROOTS)
                          or "/declab_kernels/" in f.filename), None)
            if frame is not None and frame.filename.startswith(self.ROOTS) and frame.name != "collect":
                self.sites.add(f"{frame.filename}:{frame.lineno} {frame.line}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["transformer", "mamba2", "rwkv7"])
def test_a_step_waits_for_the_device_only_for_the_previous_steps_tokens(family):
    # Prompts cut into chunks beside decoding rows, sampled and greedy rows, retirements: every path of
    # a step. On a GPU each call found here would stall the host until the queued work drained.
    engine = Engine(decoder(family), max_batch=4, max_step_tokens=9, **({"num_blocks": 64} if family == "transformer" else {}))
    rng = random.Random(3)
    requests = random_requests(rng, 8, sampling=lambda i: Sampling(temperature=0.7, seed=i) if i % 3 == 0 else Sampling())
    engine.add_request(requests.pop())
    engine.step()
    with HostWaits() as waits:
        run_with_arrivals(engine, requests, rng)
    assert not waits.sites, sorted(waits.sites)


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"])
def test_graphed_engine_on_the_gpu_equals_decoding_alone(preset):
    dec = decoders.load(preset, device="cuda", dtype="float32", impl="triton")
    rng = random.Random(2)
    requests = random_requests(rng, 24, new=(1, 20))
    requests += random_requests(rng, 4, new=(20, 20), sampling=lambda i: Sampling(temperature=0.8, top_p=0.9, seed=i))
    engine = Engine(dec, max_batch=8, max_step_tokens=32)
    assert engine.runner.cuda_graphs
    got = run_with_arrivals(engine, requests, rng)
    assert engine.runner.graphs
    # Greedy: generate's tokens; tf32 and split-K sums may differ in the last bits, so allow rare flips.
    same = sum(g == alone(dec, r) for g, r in zip(got[:24], requests[:24]))
    assert same >= 22
    eager = Engine(dec, max_batch=8, max_step_tokens=32, cuda_graphs=False).run(requests)
    assert sum(list(eager.values())[i] == got[i] for i in range(len(requests))) >= len(requests) - 2
    assert engine.stats()["host_s_total"] > 0


def test_the_measuring_command_appends_a_record_and_ends_with_json(tmp_path, capsys):
    import json

    from decoders.engine import main

    out = tmp_path / "engine.jsonl"
    assert main(["--model", "llama-tiny", "--device", "cpu", "--impl", "ref", "--batch", "3", "--ctx", "24",
                 "--new-tokens", "8", "--out", str(out)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    record = json.loads(out.read_text())
    # The last line is short and names the file holding the whole record.
    assert last["out"] == str(out) and all(record[k] == v for k, v in last.items() if k != "out")
    assert record["batch"] == 3 and record["saturated_steps"] >= 4 and record["decode_tok_s"] > 0
    assert 0 < record["host_fraction"] <= 1
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama-tiny", "--device", "cpu", "--ctx", "8", "--new-tokens", "8", "--out", str(out)])
    assert e.value.code == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("preset", ["llama-tiny", "rwkv7-tiny"])
def test_the_triton_path_under_the_interpreter_equals_decoding_alone(preset):
    dec = decoders.load(preset, device="cpu", dtype="float32", impl="triton")
    rng = random.Random(4)
    requests = random_requests(rng, 3, max_prompt=20, new=(1, 5))
    requests.append(Request([5, 6, 7], 4, sampling=Sampling(temperature=1.0, top_k=5, seed=3)))
    engine = Engine(dec, max_batch=2, max_step_tokens=16, **({"num_blocks": 20} if preset == "llama-tiny" else {}))
    got = engine.run(requests)
    assert [got[f"req-{i}"] for i in range(3)] == [alone(dec, r) for r in requests[:3]]
    assert len(got["req-3"]) == 4
