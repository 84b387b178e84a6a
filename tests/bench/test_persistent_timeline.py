"""`declab_bench.persistent_timeline`: per-stage spans, waits and work from timeline rows (`summarise`),
and its command's refusals."""

import pytest

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


@pytest.mark.parametrize("args, message", [
    (["--ctx", "abc"], "abc"),
    (["--model", "no-such-preset"], "no-such-preset"),
    (["--model", "llama-tiny", "--ctx", "1m"], "context"),
])
def test_bad_options_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, args, message):
    """A mistake in the options is named in one line (exit 2) before the GPU is asked for."""
    from declab_bench import persistent_timeline

    assert persistent_timeline.main([*args, "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "CUDA" not in err[0]
