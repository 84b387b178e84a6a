"""The context-scaling figure: one run per series (newest by record time), runs left out reported,
lines only between neighbouring contexts, and a title naming device, dtype and batch."""

import math

from decoders import plot


def point(model="llama-1b", ctx=4096, rate=1000.0, impl="triton", time="2026-12-01T10:00:00", **extra):
    return {"model": model, "ctx": ctx, "batch": 1, "iterations": None, "status": "ok", "decode_tok_s_per_seq": rate,
            "impl": impl, "dtype": "bfloat16", "device": "NVIDIA H200", "new_tokens": 32, "git_sha": "abc", "time": time,
            "tokens_per_pass": 1.0, "roofline_ms": 0.5, **extra}


def test_the_newest_run_is_drawn_whatever_the_file_order_and_the_other_is_reported():
    newer = [point(ctx=c, rate=r, time="2026-12-01T12:00:00") for c, r in ((4096, 1208.0), (131072, 557.0))]
    older = [point(ctx=c, rate=r, impl="ref", time="2026-11-30T09:00:00") for c, r in ((4096, 51.0), (131072, 14.0))]
    # The reference run's records come last in the files, as in `plot triton.jsonl ref.jsonl`.
    series, left_out = plot.select(newer + older)
    (points,) = series.values()
    assert [r["decode_tok_s_per_seq"] for r in points] == [1208.0, 557.0]
    assert len(left_out) == 1 and "left out 2 point(s) of 1 older run(s) differing in impl" in left_out[0]


def test_a_context_measured_twice_in_one_run_draws_its_newer_record():
    series, left_out = plot.select([point(rate=900.0, time="2026-12-01T12:00:00"), point(rate=800.0, time="2026-12-01T11:00:00")])
    assert [r["decode_tok_s_per_seq"] for r in next(iter(series.values()))] == [900.0] and left_out == []


def test_a_series_is_broken_at_contexts_it_was_not_measured_at():
    contexts = [4096, 8192, 16384, 32768]
    points = [point(ctx=4096), point(ctx=8192), point(ctx=32768)]
    xs, ys = plot.with_gaps(points, [1.0, 2.0, 3.0], contexts)
    assert xs[:2] == [4096, 8192] and math.isnan(xs[2]) and xs[3] == 32768 and math.isnan(ys[2])


def test_the_title_names_device_dtype_and_batch_and_labels_name_what_differs(tmp_path):
    records = [point(), point(model="mamba2-1.3b", device="cpu")]
    series, _ = plot.select(records)
    title, varying = plot.title_of(series)
    assert "bfloat16" in title and "batch 1" in title and varying == ["device"]
    assert plot.plot_context_scaling(records, str(tmp_path / "f.png")) == [] and (tmp_path / "f.png").stat().st_size > 0
