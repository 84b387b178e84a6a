"""decoders.serve_bench: the metrics on hand-made timestamps, the in-process driver against a stand-in
engine on a simulated clock, the HTTP driver against a stand-in streaming server, bad input, the plot."""

import asyncio
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from decoders import serve_bench as sb
from decoders import workload as wl


class Clock:
    """A simulated clock: `sleep` and engine steps move it, nothing else does."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, dt):
        self.t += dt


class StandInEngine:
    """The engine's contract on the simulated clock: a step takes `step_s`, admits waiting requests up
    to `max_batch` and gives every running request one token (its first in the step that admits it)."""

    def __init__(self, clock, step_s=0.1, max_batch=2, advance=None):
        self.clock, self.step_s, self.max_batch = clock, step_s, max_batch
        self.advance = advance or clock.sleep
        self.waiting, self.running, self.left, self.added = deque(), [], {}, {}
        self.most_running = self.steps = 0

    def add_request(self, request):
        rid = str(len(self.added))
        self.added[rid] = self.clock()
        self.left[rid] = request.max_new_tokens
        self.waiting.append(rid)
        return rid

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def stats(self):
        return {"steps": self.steps, "running": len(self.running), "waiting": len(self.waiting), "host_s_total": 0.001 * self.steps, "step_s_total": 0.002 * self.steps}

    def step(self):
        self.advance(self.step_s)
        self.steps += 1
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        self.most_running = max(self.most_running, len(self.running))
        outs = []
        for rid in list(self.running):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outs.append(SimpleNamespace(request_id=rid, new_tokens=[7], finished=done, finish_reason="length" if done else None))
            if done:
                self.running.remove(rid)
        return outs


def items(arrivals, new_tokens=3, prompt_len=4):
    return [wl.WorkItem(i, a, [1] * prompt_len, new_tokens) for i, a in enumerate(arrivals)]


def drive(workload, **kw):
    clock = Clock()
    engine = StandInEngine(clock, **kw)
    traces = sb.drive_engine(engine, workload, make_request=lambda item: item, clock=clock, sleep=clock.sleep)
    return engine, traces


def test_requests_reach_the_engine_at_their_arrival_and_outputs_are_stamped_when_steps_return():
    workload = wl.Workload({"arrivals": "poisson", "users": None}, 10, items([0.0, 0.0, 0.5]))
    engine, traces = drive(workload)
    assert list(engine.added.values()) == [0.0, 0.0, 0.5]
    assert [t.first_token_s for t in traces] == pytest.approx([0.1, 0.1, 0.6])
    assert [t.finish_s for t in traces] == pytest.approx([0.3, 0.3, 0.8])
    assert [t.output_tokens for t in traces] == [3, 3, 3] and all(t.finish_reason == "length" for t in traces)
    assert traces[2].gaps() == pytest.approx([0.1, 0.1])


def test_a_full_batch_makes_later_requests_wait():
    workload = wl.Workload({"arrivals": "poisson", "users": None}, 10, items([0.0, 0.0, 0.0], new_tokens=2))
    _, traces = drive(workload, max_batch=1)
    assert [t.first_token_s - t.arrival_s for t in traces] == pytest.approx([0.1, 0.3, 0.5])


def test_a_closed_loop_keeps_its_users_busy_and_no_more():
    workload = wl.Workload({"arrivals": "closed", "users": 2}, 10, items([None] * 5, new_tokens=2))
    engine, traces = drive(workload, max_batch=8)
    assert len(traces) == 5 and engine.most_running == 2
    # Each finish issues the next request at once.
    assert [t.arrival_s for t in traces] == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.4])
    limited = wl.Workload({"arrivals": "closed", "users": 1}, 10, items([None] * 10, new_tokens=2))
    clock = Clock()
    traces = sb.drive_engine(StandInEngine(clock), limited, duration_s=0.5, make_request=lambda item: item, clock=clock, sleep=clock.sleep)
    assert len(traces) == 3


def test_the_driver_replays_a_generated_workload_in_full():
    spec = wl.WorkloadSpec("poisson", 40, wl.parse_lengths("2..5"), wl.parse_lengths("1..4"), rate=20.0, seed=3)
    workload = wl.generate(spec, vocab_size=10)
    _, traces = drive(workload, step_s=0.01, max_batch=4)
    assert [t.index for t in sorted(traces, key=lambda t: t.index)] == list(range(40))
    assert [t.output_tokens for t in sorted(traces, key=lambda t: t.index)] == [i.max_new_tokens for i in workload.items]
    assert all(t.first_token_s >= t.arrival_s + 0.01 - 1e-9 for t in traces)


def hand_made_traces():
    a = sb.Trace(0, 0.0, 10, 3, first_token_s=0.1, token_times=[(0.1, 1), (0.2, 1), (0.4, 1)], finish_s=0.4, output_tokens=3)
    b = sb.Trace(1, 1.0, 20, 3, first_token_s=1.5, token_times=[(1.5, 1), (1.6, 2)], finish_s=1.6, output_tokens=3)
    return [a, b]


def test_summary_figures_from_timestamps():
    r = sb.summarize(hand_made_traces(), slo={"ttft": 0.2, "itl": 0.2}, gpu_hour_price=3.6, energy_j=12.0, idle_ttft=lambda n: 0.1)
    assert r["requests"] == r["finished"] == 2 and r["span_s"] == pytest.approx(1.6)
    assert r["request_per_s"] == pytest.approx(2 / 1.6)
    assert r["output_tok_s"] == pytest.approx(6 / 1.6) and r["total_tok_s"] == pytest.approx(36 / 1.6)
    assert (r["ttft_ms_p50"], r["ttft_ms_p99"]) == pytest.approx((100, 500))
    # Pooled gaps 0.1, 0.2 and the two tokens of the last output sharing 0.1 s.
    assert (r["itl_ms_p50"], r["itl_ms_p99"]) == pytest.approx((50, 200))
    assert (r["e2e_ms_p50"], r["e2e_ms_p99"]) == pytest.approx((400, 600))
    assert (r["queue_ms_mean"], r["queue_ms_std"]) == pytest.approx((200, 200))
    assert (r["slo_met"], r["slo_violations"], r["slo_p99_met"]) == (1, 1, False)
    assert r["goodput_request_per_s"] == pytest.approx(1 / 1.6)
    assert r["cost_per_1k_output_tokens"] == pytest.approx(0.001 * 1.6 / 6 * 1e3)
    assert r["energy_j_per_output_token"] == pytest.approx(2.0)
    loose = sb.summarize(hand_made_traces(), slo={"ttft": 1.0, "itl": 0.25, "e2e": 1.0})
    assert (loose["slo_met"], loose["slo_p99_met"]) == (2, True)


def test_unfinished_and_failed_requests_count_against_the_point():
    traces = hand_made_traces() + [sb.Trace(2, 1.2, 5, 3, finish_s=1.3, error="HTTP 500: boom")]
    r = sb.summarize(traces, slo={"ttft": 1.0})
    assert (r["requests"], r["finished"], r["failed"], r["errors"]) == (3, 2, 1, ["HTTP 500: boom"])
    assert r["slo_violations"] == 1 and r["slo_p99_met"] is False
    assert r["queue_ms_mean"] is None and r["energy_j_per_output_token"] is None


def test_engine_point_stats_split_the_host_time_between_prefill_and_decode_steps():
    before = dict(finished=0, preemptions=0, tokens_generated=0, steps=10, host_s_total=1.0, step_s_total=2.0, prefill_steps=2,
                  prefill_host_s_total=0.5, prefill_step_s_total=0.6)
    after = dict(finished=4, preemptions=0, tokens_generated=40, steps=20, host_s_total=1.5, step_s_total=4.0, prefill_steps=4,
                 prefill_host_s_total=0.9, prefill_step_s_total=1.4)
    p = sb.engine_point_stats(before, after)
    assert p["steps"] == 10 and p["prefill_steps"] == 2 and p["host_fraction"] == pytest.approx(0.25)
    assert p["host_ms_per_prefill_step"] == pytest.approx(200) and p["ms_per_prefill_step"] == pytest.approx(400)
    assert p["host_ms_per_decode_step"] == pytest.approx(12.5) and p["ms_per_decode_step"] == pytest.approx(150)
    # An engine without these counters (a stand-in) gets the totals only.
    assert "host_ms_per_prefill_step" not in sb.engine_point_stats({"steps": 0, "host_s_total": 0}, {"steps": 2, "host_s_total": 1})


def test_idle_ttft_is_the_line_through_the_samples():
    line = sb.idle_ttft_line([(10, 0.1), (30, 0.3), (10, 0.1)])
    assert line(20) == pytest.approx(0.2)
    assert sb.idle_ttft_line([(8, 0.2), (8, 0.4)])(100) == pytest.approx(0.3)


def test_the_warm_up_replays_the_head_of_the_first_workload():
    spec = wl.WorkloadSpec("poisson", requests=40, prompt_len=wl.parse_lengths("6"), output_len=wl.parse_lengths("3"), rate=10.0, seed=1)
    w = wl.generate(spec, vocab_size=50)
    head, duration = sb.replay_head(w, 1.0, burst=64)
    assert duration is None and head.spec == w.spec and head.items == [i for i in w.items if i.arrival_s < 1.0] and head.items
    assert len(sb.replay_head(w, 100.0, burst=8)[0].items) == 8
    assert sb.replay_head(w, 1e-9, burst=8)[0].items == w.items[:1]
    closed = wl.generate(wl.WorkloadSpec("closed", requests=6, prompt_len=wl.parse_lengths("6"), output_len=wl.parse_lengths("3"), users=2), 50)
    assert sb.replay_head(closed, 2.5, burst=8) == (closed, 2.5)
    runs = []

    def run(workload, duration_s=None):
        runs.append((workload, duration_s))
        return [sb.Trace(0, 0.0, len(workload.items[0].prompt), 1, first_token_s=0.01)]

    sb.warm_up(run, w, 50, burst=4, replay_s=1.0)
    # the burst, the prefill ladder, the head (at most the burst's size), then the prompt length alone
    # (one length here)
    assert len(runs) == 4 and len(runs[0][0].items) == 4 and runs[2] == (sb.wl.Workload(w.spec, 50, head.items[:4]), None)
    assert [len(item.prompt) for item in runs[1][0].items] == [1, 2, 3, 4, 5, 6] and runs[1][0].spec["users"] == 1
    runs.clear()
    sb.warm_up(run, w, 50, burst=4)
    assert len(runs) == 3


def test_the_prefill_ladder_takes_every_row_count_to_8_then_powers_of_two_to_the_longest_prompt():
    w = wl.generate(wl.WorkloadSpec("poisson", requests=20, prompt_len=wl.parse_lengths("300..1000"), output_len=wl.parse_lengths("3"),
                                    rate=10.0, seed=2), vocab_size=50)
    longest = max(w.items, key=lambda item: len(item.prompt)).prompt
    ladder = sb.prefill_ladder(w, 50)
    lengths = [len(item.prompt) for item in ladder.items]
    assert lengths == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256, 512, len(longest)] and 512 < len(longest) <= 1000
    assert all(item.prompt == longest[:n] and item.max_new_tokens == 2 for item, n in zip(ladder.items, lengths))


def test_rates_and_objectives_parse():
    assert sb.parse_rates("1,4,16,inf") == [1.0, 4.0, 16.0, math.inf]
    assert sb.parse_slo("ttft=500ms,itl=50ms") == pytest.approx({"ttft": 0.5, "itl": 0.05})
    assert sb.parse_slo("e2e=2s,ttft=250") == pytest.approx({"e2e": 2.0, "ttft": 0.25})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "0"], "--rate must be > 0"),
        (["--rate", "-2"], "--rate must be > 0"),
        (["--rate", "fast"], "is not a number"),
        (["--rate", "4", "--duration", "0"], "--duration must be > 0"),
        (["--rate", "4", "--slo", "ttft=soon"], "expected a time"),
        (["--rate", "4", "--slo", "latency=5ms"], "KEY one of ttft, itl, e2e"),
        (["--rate", "4", "--slo", "ttft=0ms"], "--slo ttft must be > 0"),
        (["--users", "0"], "--users values must be"),
        (["--users", "2", "--rate", "4"], "not both"),
        (["--rate", "inf", "--arrivals", "bursty"], "needs finite rates"),
        (["--rate", "4", "--arrivals", "uniform"], "expected poisson or bursty"),
        (["--rate", "4", "--arrivals", "bursty", "--burst-amplitude", "1"], "--burst-amplitude must be in [0, 1)"),
        (["--rate", "4", "--burst-amplitude", "2"], "--burst-amplitude must be in [0, 1)"),
        (["--users", "2", "--burst-period", "0"], "--burst-period must be > 0"),
        (["--rate", "4", "--prompt-len", "0"], "--prompt-len '0'"),
        (["--rate", "4", "--prompt-len", "8000"], "exceed the context of 8192"),
        (["--rate", "4", "--models", "no-such-model"], "unknown preset 'no-such-model'"),
        (["--rate", "4", "--gpu-hour-price", "-1"], "--gpu-hour-price must be >= 0"),
        (["--rate", "4", "--warmup", "-1"], "--warmup must be >= 0"),
        (["--rate", "4", "--warmup", "nan"], "--warmup must be >= 0"),
        (["--rate", "4", "--target", "localhost:8000"], "expected a base URL"),
        (["--workload", "no-such-file.jsonl"], "is not a file"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, args, message):
    argv = ["--no-progress", "--out", str(tmp_path / "out.jsonl"), *args]
    if "--models" not in args:
        argv += ["--models", "llama-tiny"]
    assert sb.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "out.jsonl").exists()


def test_load_plan_counts_requests_from_the_rate_and_duration():
    args = sb.build_parser().parse_args(["--rate", "0.5,2,inf", "--duration", "10", "--arrivals", "poisson"])
    assert [(p["rate"], p["requests"]) for p in sb.plan_loads(args)] == [(0.5, 5), (2.0, 20), (math.inf, 20)]
    args = sb.build_parser().parse_args(["--users", "1,4"])
    assert [(p["users"], p["requests"]) for p in sb.plan_loads(args)] == [(1, 8), (4, 32)]


async def stand_in_server(requests_seen):
    """A streaming /v1/completions on a free local port: one event per token 10 ms apart, then the
    usage and [DONE]; more than 8 tokens asked is refused with 400."""
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        requests_seen.append(body)
        if body["max_tokens"] > 8:
            return web.json_response({"error": "too many tokens"}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.01)
            last = i == body["max_tokens"] - 1
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length" if last else None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': body['max_tokens']}})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def test_the_http_driver_streams_the_workload_and_times_each_event():
    seen = []

    async def scenario():
        runner, port = await stand_in_server(seen)
        try:
            open_loop = wl.Workload({"arrivals": "poisson", "users": None}, 10, items([0.0, 0.05, 0.1], new_tokens=4) + [wl.WorkItem(3, 0.1, [2, 3], 20)])
            closed = wl.Workload({"arrivals": "closed", "users": 2}, 10, items([None] * 4, new_tokens=2))
            return (await sb.drive_http_async(f"http://127.0.0.1:{port}", open_loop, model="llama-tiny"),
                    await sb.drive_http_async(f"http://127.0.0.1:{port}/", closed))
        finally:
            await runner.cleanup()

    traces, closed = asyncio.run(scenario())
    traces.sort(key=lambda t: t.index)
    assert seen[0] == {"prompt": [1, 1, 1, 1], "max_tokens": 4, "stream": True, "temperature": 0.0, "ignore_eos": True,
                       "stream_options": {"include_usage": True}, "model": "llama-tiny"}
    assert [t.output_tokens for t in traces[:3]] == [4, 4, 4] and all(t.ok and t.finish_reason == "length" for t in traces[:3])
    assert all(t.first_token_s - t.arrival_s >= 0.01 and len(t.gaps()) == 3 for t in traces[:3])
    assert traces[3].error.startswith("HTTP 400") and not traces[3].ok
    assert len(closed) == 4 and all(t.ok for t in closed) and "model" not in seen[-1]


def test_a_streamed_event_counts_its_token_ids_or_one_token_of_text():
    assert sb.event_tokens({"text": "a b", "token_ids": [4, 5]}) == 2
    assert sb.event_tokens({"text": "", "token_ids": [], "finish_reason": "abort"}) == 0
    assert sb.event_tokens({"text": "", "finish_reason": None}) == 1
    assert sb.event_tokens({"text": "", "finish_reason": "length"}) == 0
    assert sb.event_tokens({"delta": {"content": "hi"}, "finish_reason": "length"}) == 1


def test_energy_integrates_power_readings_and_is_none_on_a_cpu():
    with sb.PowerMeter(torch.device("cpu")) as meter:
        pass
    assert meter.energy_j is None and "no GPU" in meter.describe()["power_note"]
    meter.source, meter.samples, meter.t_start, meter.t_end = "nvidia-smi", [(1.0, 100.0), (2.0, 200.0)], 0.0, 3.0
    assert meter.energy_j == pytest.approx(450.0)


def test_the_plot_draws_every_model(tmp_path):
    records = [{"model": m, "arrivals": "poisson", "rate": r, "users": None, "status": "ok", "output_tok_s": 10.0 * r,
                "ttft_ms_p99": 5.0 * r, "itl_ms_p99": 2.0 + r} for m in ("llama-tiny", "mamba2-tiny") for r in (1.0, 4.0)]
    records.append({**records[0], "rate": "inf", "output_tok_s": 80.0})
    sb.plot_throughput_latency(records, str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert sb.main(["--replot", f"{tmp_path / 'a.jsonl'},{tmp_path / 'a.jsonl'}", "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000
    assert sb.main(["--replot", str(tmp_path / "a.jsonl")]) == 2
    assert sb.main(["--replot", str(tmp_path / "curve.png"), "--plot", str(tmp_path / "x.png")]) == 2


class StandInTarget(sb.EngineTarget):
    """The CLI's in-process target on the stand-in engine in real time (1 ms a step), no model loaded."""

    def __init__(self, model, args):
        self.engine = StandInEngine(time.perf_counter, step_s=0.001, max_batch=args.max_batch, advance=time.sleep)
        self.vocab_size, self.max_context, self.device = 32, 64, torch.device("cpu")

    def run(self, workload, duration_s=None, on_finish=None):
        return sb.drive_engine(self.engine, workload, duration_s=duration_s, on_finish=on_finish, make_request=lambda item: item)

    def describe(self):
        return {"target": "engine", "family": "transformer", "engine_stats": self.engine.stats()}


def test_the_cli_appends_a_record_per_point_saves_each_workload_and_replays_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sb, "EngineTarget", StandInTarget)
    out = tmp_path / "runs" / "sb.jsonl"
    argv = ["--no-progress", "--models", "llama-tiny", "--out", str(out), "--prompt-len", "4..8", "--output-len", "3", "--duration", "0.2",
            "--max-batch", "4", "--slo", "ttft=1s,itl=1s", "--plot", str(tmp_path / "curve.png")]
    assert sb.main([*argv, "--rate", "50,inf"]) == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["arrivals"], r["rate"], r["requests"], r["finished"], r["status"]) for r in records] == [("poisson", 50.0, 10, 10, "ok"), ("poisson", "inf", 10, 10, "ok")]
    assert all(r["slo_met"] == 10 and r["slo_p99_met"] and r["git_sha"] and r["command"] for r in records)
    point = records[0]["engine_stats"]["point"]
    assert point["steps"] >= 3 and point["host_fraction"] == pytest.approx(0.5) and point["host_ms_per_step"] == pytest.approx(1.0)
    assert "running" not in point and records[0]["host_fraction"] == pytest.approx(0.5) and records[1]["ttft_ms_p99"] > 0
    last = json.loads(stdout[-1])
    assert [p["rate"] for p in last["points"]] == [50.0, "inf"] and len(stdout[-1]) < 2000
    assert any("TTFT p50" in line for line in stdout) and (tmp_path / "curve.png").exists()
    saved = wl.load(records[0]["workload_file"])
    assert saved.spec == records[0]["workload"] and len(saved.items) == 10
    assert sb.main(argv[:-2] + ["--workload", records[0]["workload_file"]]) == 0
    replayed = [json.loads(line) for line in out.read_text().splitlines()][-1]
    assert replayed["workload"] == records[0]["workload"] and replayed["workload_file"] == records[0]["workload_file"]
    assert replayed["prompt_tokens"] == records[0]["prompt_tokens"] and replayed["output_tokens"] == 30


def test_the_cli_sweeps_closed_loops_and_bursty_arrivals(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sb, "EngineTarget", StandInTarget)
    out = tmp_path / "sb.jsonl"
    base = ["--no-progress", "--models", "llama-tiny", "--out", str(out), "--prompt-len", "4", "--output-len", "2", "--max-batch", "8"]
    assert sb.main([*base, "--users", "1,3", "--requests", "6"]) == 0
    assert sb.main([*base, "--rate", "40", "--duration", "0.25", "--arrivals", "poisson,bursty", "--burst-period", "0.1"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["arrivals"], r["users"], r["finished"]) for r in records] == [("closed", 1, 6), ("closed", 3, 6), ("poisson", None, 10), ("bursty", None, 10)]
    assert records[3]["workload"]["amplitude"] == 0.4 and records[2]["workload"]["amplitude"] is None
    assert records[2]["queue_ms_mean"] is not None and records[0]["energy_j"] is None and "no GPU" in records[0]["power_note"]


def test_ctrl_c_keeps_the_finished_points(tmp_path, capsys, monkeypatch):
    class Interrupted(StandInTarget):
        points = 0

        def run(self, workload, duration_s=None, on_finish=None):
            # The warm-up's four runs (burst, prefill ladder, replay, idle prompt), then the first point; the
            # second is interrupted.
            Interrupted.points += 1
            if Interrupted.points == 6:
                raise KeyboardInterrupt
            return super().run(workload, duration_s, on_finish)

    monkeypatch.setattr(sb, "EngineTarget", Interrupted)
    out = tmp_path / "sb.jsonl"
    argv = ["--no-progress", "--models", "llama-tiny", "--out", str(out), "--prompt-len", "4", "--output-len", "2", "--rate", "100,inf", "--requests", "3"]
    assert sb.main(argv) == 130
    captured = capsys.readouterr()
    assert "interrupted: 1 finished point(s) kept" in captured.err
    assert [json.loads(line)["rate"] for line in out.read_text().splitlines()] == [100.0]
    assert [p["rate"] for p in json.loads(captured.out.strip().splitlines()[-1])["points"]] == [100.0]


def run_cli(*args, out):
    return subprocess.run([sys.executable, "-m", "decoders.serve_bench", "--no-progress", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600)


def test_the_cli_on_the_engine_with_tiny_models(tmp_path):
    out = tmp_path / "sb.jsonl"
    result = run_cli("--models", "llama-tiny,mamba2-tiny", "--rate", "20,inf", "--requests", "6", "--prompt-len", "8..24",
                     "--output-len", "6", "--impl", "ref", "--device", "cpu", "--slo", "ttft=10s,itl=10s", out=out)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model"], r["rate"], r["family"]) for r in records] == [
        ("llama-tiny", 20.0, "transformer"), ("llama-tiny", "inf", "transformer"), ("mamba2-tiny", 20.0, "mamba2"), ("mamba2-tiny", "inf", "mamba2")]
    for r in records:
        assert (r["status"], r["finished"], r["output_tokens"], r["slo_met"]) == ("ok", 6, 36, 6)
        assert r["ttft_ms_p50"] > 0 and r["itl_ms_p50"] > 0 and r["engine_stats"]["point"]["finished"] == 6
        assert r["impl"] == "ref" and r["energy_j"] is None
        # On the CPU reference nothing compiles, no graph is captured and no GEMV shape is measured.
        assert r["first_use_during_point"] == {"triton_compiles": {"count": 0, "seconds": 0.0, "kernels": {}},
                                               "graphs_captured": 0, "gemv_keys_measured": 0}
    assert "inside the timed point" not in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["points"][3]["model"] == "mamba2-tiny"


def test_first_use_inside_a_timed_point_is_one_warning_line(capsys):
    quiet = {"triton_compiles": {"count": 0, "seconds": 0.0, "kernels": {}}, "graphs_captured": 0, "gemv_keys_measured": 0}
    sb.warn_first_use("llama-8b poisson 8/s", quiet)
    assert capsys.readouterr().err == ""
    sb.warn_first_use("llama-8b poisson 8/s", {**quiet, "triton_compiles": {"count": 3, "seconds": 2.46, "kernels": {"_prefill_kernel": 3}},
                                               "graphs_captured": 1})
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: llama-8b poisson 8/s: 3 Triton compilation(s) (2.5 s), 1 CUDA graph capture(s) ran inside")


@pytest.mark.gpu
def test_the_cli_on_the_gpu_records_energy(tmp_path):
    out = tmp_path / "sb.jsonl"
    result = run_cli("--models", "llama-1b,mamba2-1.3b", "--rate", "8,inf", "--requests", "32", "--prompt-len", "128..512",
                     "--output-len", "64", "--max-batch", "32", out=out)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and all(r["status"] == "ok" and r["finished"] == 32 and r["impl"] == "triton" for r in records)
    if shutil.which("nvidia-smi") or importlib.util.find_spec("pynvml"):
        assert all(r["energy_j"] > 0 and r["energy_j_per_output_token"] > 0 for r in records), [r["power_note"] for r in records]
