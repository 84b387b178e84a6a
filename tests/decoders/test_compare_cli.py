"""`python -m decoders.compare`: argument parsing, bad input, and an end-to-end tiny sweep."""

import json
import subprocess
import sys
import time

import pytest

from decoders import compare, harness
from decoders.compare import ArgError, parse_ctx
from decoders.plot import main as plot_main


def test_ctx_ranges_double_and_lists_are_taken_as_given():
    assert parse_ctx("4k..128k") == [4096, 8192, 16384, 32768, 65536, 131072]
    assert parse_ctx("256..1k") == [256, 512, 1024]
    assert parse_ctx("4k,6k,32k") == [4096, 6144, 32768]
    assert parse_ctx("300") == [300]
    assert parse_ctx("1K") == [1024]


@pytest.mark.parametrize("bad", ["128k..4k", "banana", "0", "4k..", "-5", "1.5k", ","])
def test_bad_ctx_is_refused(bad):
    with pytest.raises(ArgError):
        parse_ctx(bad)


def run_cli(*args, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "decoders.compare", "--no-progress", "--out", str(tmp_path / "out.jsonl"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "llama-tiny", "--ctx", "128k..4k"], "runs backwards"),
        (["--models", "llama-tiny", "--ctx", "banana"], "not a context size"),
        (["--models", "llama-tiny", "--ctx", "0"], "at least 1 token"),
        (["--models", "no-such-model", "--ctx", "256"], "unknown preset 'no-such-model'"),
        (["--models", "llama-tiny", "--ctx", "16k"], "over llama-tiny's maximum of 8192"),
        (["--models", "llama-tiny", "--ctx", "256", "--batch", "0"], "--batch values must be"),
        (["--models", "llama-tiny", "--ctx", "256", "--point-timeout", "0"], "--point-timeout must be a positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, message):
    result = run_cli(*args, tmp_path=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_folder_that_is_not_a_checkpoint(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    result = run_cli("--models", str(folder), "--ctx", "256", tmp_path=tmp_path)
    assert result.returncode == 2 and "not a checkpoint folder" in result.stderr and "Traceback" not in result.stderr


def test_tiny_sweep_end_to_end(tmp_path):
    plot = tmp_path / "scaling.png"
    result = run_cli("--models", "llama-tiny", "--ctx", "256..1k", "--new-tokens", "8", "--plot", str(plot), "--device", "cpu",
                     tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["ctx"] for r in records] == [256, 512, 1024]
    for r in records:
        assert r["status"] == "ok" and r["impl"] == "ref" and r["family"] == "transformer"
        assert r["decode_tok_s"] > 0 and r["ttft_ms"] > 0 and r["mbu"] > 0 and r["git_sha"]
        assert r["step_ms_p50"] <= r["step_ms_p90"] <= r["step_ms_p99"]
        # On the CPU each point is timed CPU_REPEATS times; the record keeps every run's rate and their spread.
        assert r["repeats"] == harness.CPU_REPEATS and len(r["decode_tok_s_per_seq_runs"]) == r["repeats"] and r["spread"] >= 0
        assert r["cpu_threads"] >= 1
    assert records[0]["decay"] == 1.0
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(final["points"]) == 3 and final["out"] == str(tmp_path / "out.jsonl") and "config" not in final["points"][0]
    assert "not performance measurements" in result.stdout
    assert "llama-tiny" in result.stdout and "tok/s" in result.stdout
    assert plot.stat().st_size > 0
    redrawn = tmp_path / "redrawn.png"
    assert plot_main([str(tmp_path / "out.jsonl"), "--out", str(redrawn)]) == 0 and redrawn.stat().st_size > 0


def test_a_point_past_its_timeout_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    """The 512-token point hangs (as a peer's first generate can, compiling and autotuning): it is
    recorded as timeout with the reason, the points before and after it are measured."""
    measure = harness.measure

    def hangs_at_512(dec, *, ctx, **kwargs):
        if ctx == 512:
            time.sleep(120)
        return measure(dec, ctx=ctx, **kwargs)

    monkeypatch.setattr(harness, "measure", hangs_at_512)
    out = tmp_path / "out.jsonl"
    start = time.monotonic()
    code = compare.main(["--no-progress", "--models", "llama-tiny", "--ctx", "256..1k", "--new-tokens", "4",
                         "--point-timeout", "20", "--out", str(out)])
    # 20 s: the measured points take a few seconds each on a busy 2-core CPU; the hung one is cut.
    assert code == 0 and time.monotonic() - start < 100
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["ctx"], r["status"]) for r in records] == [(256, "ok"), (512, "timeout"), (1024, "ok")]
    assert "no result within 20 s" in records[1]["reason"] and records[1]["model"] == "llama-tiny" and records[1]["git_sha"]
    assert "llama-tiny: timeout: no result within 20 s" in capsys.readouterr().out


def test_a_model_refused_mid_sweep_keeps_the_points_before_it(tmp_path, capsys):
    """A checkpoint whose tensor has the wrong shape is found only when its weights are read, after the
    models before it were measured: one line naming it and where those points are, exit code 2."""
    import torch
    from safetensors.torch import load_file, save_file

    import decoders

    folder = tmp_path / "misshaped"
    decoders.load("llama-tiny", device="cpu", impl="ref").save(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(folder / "model.safetensors"))
    out = tmp_path / "out.jsonl"
    code = compare.main(["--no-progress", "--models", f"llama-tiny,{folder}", "--ctx", "64", "--new-tokens", "4", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1 and "model.embed_tokens.weight has shape [3, 3]" in err[0]
    assert f"1 finished point(s) kept in {out}" in err[0] and json.loads(out.read_text())["status"] == "ok"
