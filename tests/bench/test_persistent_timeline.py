"""`declab_bench.persistent_timeline.summarise`: per-stage spans, waits and work from timeline rows."""

from declab_bench.persistent_timeline import summarise


def test_summarise_stages_and_idle_time():
    rows = [
        {"stage": "qkv", "program": 0, "start_ns": 0, "ready_ns": 1000, "end_ns": 3000},
        {"stage": "qkv", "program": 1, "start_ns": 500, "ready_ns": 1000, "end_ns": 2000},
        {"stage": "head", "program": 0, "start_ns": 3000, "ready_ns": 4000, "end_ns": 9000},
    ]
    s = summarise(rows, programs=2)
    assert s["step_span_us"] == 9.0
    assert s["stages"]["qkv"] == {"items": 2, "span_us": 3.0, "wait_us": 1.5, "work_us": 3.0}
    assert s["stages"]["head"]["work_us"] == 5.0
    # Program 0 ends at 9 us, program 1 at 2 us: idle 0 and 7, median 3.5.
    assert s["idle_at_end_us_median"] == 3.5
    assert "attn" not in s["stages"]
