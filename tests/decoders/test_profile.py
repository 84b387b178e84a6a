"""decoders.profile: the per-kernel breakdown of one decode step, on the CPU (operators) with tiny presets."""

import json

import pytest

import decoders
from decoders import profile


@pytest.mark.parametrize("model", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"])
def test_profile_step_accounts_for_the_step(model):
    dec = decoders.load(model, impl="ref", device="cpu")
    rec = profile.profile_step(dec, ctx=64, batch=2, steps=2)
    assert rec["step_ms"] > 0 and rec["kernel_ms"] > 0
    assert rec["kernels"] and all(r["us_per_step"] > 0 for r in rec["kernels"])
    times = [r["us_per_step"] for r in rec["kernels"]]
    assert times == sorted(times, reverse=True)
    assert any("mm" in r["name"] or "linear" in r["name"] for r in rec["kernels"])
    assert rec["step_bytes"] == dec.memory(2, 64).step_bytes
    assert rec["critical_path"] is None  # kernel spans come from a GPU trace


def test_record_lists_the_gemv_choices(monkeypatch):
    """The picks of declab_kernels.gemv (made on a GPU; none on the CPU) come out one row per shape."""
    from declab_kernels import gemv

    # an empty table, as in a fresh process (earlier tests on a GPU leave their picks in it)
    monkeypatch.setattr(gemv, "_TABLE", {})
    dec = decoders.load("llama-tiny", impl="ref", device="cpu")
    assert profile.profile_step(dec, ctx=32, batch=1, steps=1)["gemv_choices"] == []
    pick = {"impl": "triton", "torch_us": 6.0, "triton_us": 4.5, "triton_config": "fma n4 k1024", "times_us": {"torch": 6.0}}
    monkeypatch.setitem(gemv._TABLE, (1, 2048, 2048, "bfloat16", False, None, None, "dense", 0), dict(pick, config=object()))
    monkeypatch.setitem(gemv._TABLE, (1, 2048, 4096, "bfloat16", False, ("gated_rms_norm",), ("residual", "float32"), "dense", 0),
                        dict(pick, impl="torch", config=None))
    rows = profile.profile_step(dec, ctx=32, batch=1, steps=1)["gemv_choices"]
    assert rows == [dict(M=1, N=2048, K=2048, dtype="bfloat16", bias=False, pre="", post="", weight="dense", **pick),
                    dict(M=1, N=2048, K=4096, dtype="bfloat16", bias=False, pre="gated_rms_norm", post="residual:float32",
                         weight="dense", **dict(pick, impl="torch"))]
    json.dumps(rows)


def test_critical_path_charges_what_each_kernel_added():
    """Overlapping kernels (as with PDL): each is charged its end minus the previous end, the charges
    add up to the span, and a kernel hidden inside another's run is charged nothing beyond it."""
    spans = [("norm", 0.0, 2.0), ("gemv", 1.0, 10.0), ("attn", 3.0, 9.0), ("gemv", 9.5, 14.0),
             ("norm", 20.0, 22.0), ("gemv", 21.0, 30.0), ("attn", 23.0, 29.0), ("gemv", 29.5, 34.0)]
    rows = profile.critical_path(spans, steps=2)
    got = {r["name"]: (r["calls_per_step"], r["us_per_step"]) for r in rows}
    # ends in order: 2 norm, 9 attn (+7), 10 gemv (+1), 14 gemv (+4), 22 norm (+8), 29 attn (+7), 30 (+1), 34 (+4)
    assert got == {"norm": (1.0, 4.0), "attn": (1.0, 7.0), "gemv": (2.0, 5.0)}
    assert [r["name"] for r in rows] == ["attn", "gemv", "norm"]
    assert sum(r["us_per_step"] for r in rows) * 2 == 34.0 - 2.0
    assert profile.critical_path([], steps=1) == []


def test_main_writes_a_record(tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    assert profile.main(["--model", "llama-tiny", "--ctx", "96", "--steps", "2", "--impl", "ref", "--device", "cpu", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["kind"] == "profile" and rec["ctx"] == 96 and rec["model"] == "llama-tiny" and rec["git_sha"]
    assert "step" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--model", "no-such-preset"], ["--model", "llama-tiny", "--ctx", "4x"], ["--model", "llama-tiny", "--ctx", "3"], ["--model", "maskpredict-tiny", "--ctx", "64"]])
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    assert profile.main(args + ["--device", "cpu", "--impl", "ref", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
