"""`python -m decoders.compare --peers`: parsing, peers run beside the lab on the same points with the
same record fields, and a peer that is unavailable, not applicable or failing is a row with its reason."""

import dataclasses
import json

import pytest
import torch

from decoders import peers
from decoders.compare import ArgError, main, parse_peers

# What harness.measure gives every measured point, lab or peer.
MEASURED = {"ctx", "batch", "prompt_len", "new_tokens", "warmup_s", "ttft_ms", "prefill_tok_s", "passes", "peak_memory_bytes",
            "step_ms_p50", "step_ms_p90", "step_ms_p99", "decode_tok_s_per_seq", "decode_tok_s", "roofline_ms", "mbu"}


def sweep(tmp_path, capsys, *args):
    """Run the CLI in this process; (exit code, records of the .jsonl, the final JSON line, stderr)."""
    out = tmp_path / "out.jsonl"
    code = main(["--no-progress", "--out", str(out), *args])
    captured = capsys.readouterr()
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    final = json.loads(captured.out.strip().splitlines()[-1]) if code == 0 else None
    return code, records, final, captured.err


def by_model(records):
    return {(r["model"], r["ctx"]): r for r in records}


def test_peers_are_parsed_in_order_without_repeats():
    assert parse_peers("hf,mamba_ssm,fla") == ["hf", "mamba_ssm", "fla"]
    assert parse_peers(" fla , hf,fla") == ["fla", "hf"]


@pytest.mark.parametrize("bad, message", [("hf,vllm", "unknown peer 'vllm'"), (",", "names no peer"), ("HF", "unknown peer 'HF'")])
def test_bad_peers_are_refused(bad, message):
    with pytest.raises(ArgError, match=message):
        parse_peers(bad)


def test_unknown_peer_is_one_line_and_exit_code_2(tmp_path, capsys):
    code, records, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--ctx", "256", "--peers", "hf,vllm")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "unknown peer 'vllm' (known: hf, gpt-fast, mamba_ssm, fla)" in lines[0], err
    assert records == []


def test_hf_eager_runs_beside_the_lab_on_the_same_points(tmp_path, capsys):
    plot = tmp_path / "scaling.png"
    code, records, final, err = sweep(
        tmp_path, capsys, "--models", "llama-tiny", "--peers", "hf", "--ctx", "256", "--new-tokens", "4", "--plot", str(plot)
    )
    assert code == 0, err
    rows = by_model(records)
    lab, hf = rows["llama-tiny", 256], rows["hf-eager:llama-tiny", 256]
    assert lab["status"] == "ok" and "peer" not in lab
    assert hf["status"] == "ok" and hf["peer"] == "hf-eager" and hf["preset"] == "llama-tiny" and hf["family"] == "transformer"
    assert hf["library"].startswith("transformers ") and "stopping criterion" in hf["timing"]
    assert MEASURED <= set(hf) and MEASURED <= set(lab)
    # The same point: prompt, new tokens, and the lab's bytes for the roofline.
    for key in ("prompt_len", "new_tokens", "passes", "step_bytes", "roofline_ms"):
        assert hf[key] == lab[key], key
    assert hf["passes"] == 3 and hf["ttft_ms"] > 0 and hf["decode_tok_s"] > 0 and hf["decay"] == 1.0
    assert hf["step_ms_p50"] <= hf["step_ms_p90"] <= hf["step_ms_p99"]
    compiled = [r for r in records if r.get("peer") == "hf-compile"]
    assert len(compiled) == 1
    if torch.cuda.is_available():
        assert compiled[0]["status"] == "ok"
    else:
        assert compiled[0]["status"] == "unavailable" and "needs a CUDA device" in compiled[0]["reason"] and compiled[0]["ctx"] is None
    assert len(final["points"]) == len(records)
    assert plot.stat().st_size > 0


def test_peers_only_runs_no_lab_point(tmp_path, capsys):
    code, records, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "hf", "--peers-only", "--ctx", "256", "--new-tokens", "4")
    assert code == 0, err
    assert records and all("peer" in r for r in records)
    assert any(r["peer"] == "hf-eager" and r["status"] == "ok" for r in records)


def test_peers_only_without_peers_is_refused(tmp_path, capsys):
    code, records, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers-only", "--ctx", "256")
    assert code == 2 and "--peers-only needs --peers" in err and records == []


def test_unavailable_and_not_applicable_peers_are_rows_with_reasons(tmp_path, capsys, monkeypatch):
    real = peers.import_reason
    monkeypatch.setattr(peers, "import_reason", lambda module: "ImportError: mamba-ssm is not installed" if module == "mamba_ssm" else real(module))
    code, records, final, err = sweep(tmp_path, capsys, "--models", "llama-tiny,mamba2-tiny", "--peers", "mamba_ssm", "--ctx", "256", "--new-tokens", "4")
    assert code == 0, err
    rows = {r["model"]: r for r in records}
    assert set(rows) == {"llama-tiny", "mamba_ssm:llama-tiny", "mamba2-tiny", "mamba_ssm-cg:mamba2-tiny"}
    na, missing = rows["mamba_ssm:llama-tiny"], rows["mamba_ssm-cg:mamba2-tiny"]
    assert na["status"] == "not applicable" and na["reason"] == "llama-tiny is transformer; mamba_ssm runs only mamba2 models"
    assert missing["status"] == "unavailable" and missing["reason"] == "ImportError: mamba-ssm is not installed"
    assert missing["peer"] == "mamba_ssm-cg" and missing["family"] == "mamba2"
    assert len(final["points"]) == 4


def test_peers_that_need_a_gpu_say_so_on_the_cpu(monkeypatch):
    # installed or not here, the device is the reason given
    monkeypatch.setattr(peers, "import_reason", lambda module: None)
    cpu = torch.device("cpu")
    fla = peers.plan("fla", "rwkv7-tiny", "rwkv7", cpu)
    assert [row.name for row in fla] == ["fla-rwkv7", "fla-rwkv7-cg"]
    for row in fla:
        assert isinstance(row, peers.Absent) and row.status == "unavailable" and row.reason.startswith("needs a CUDA device")
    (hf,) = peers.plan("hf", "rwkv7-tiny", "rwkv7", cpu)
    assert isinstance(hf, peers.Absent) and hf.status == "not applicable"
    assert [(p.name, p.status) for p in peers.plan("hf", "maskpredict-tiny", "maskpredict", cpu)] == [("hf", "not applicable")]


def test_a_failing_peer_is_an_error_row_and_the_sweep_goes_on(tmp_path, capsys, monkeypatch):
    def fails(*args):
        raise ValueError("peer broke\nsecond line")

    monkeypatch.setattr(peers, "PEERS", [dataclasses.replace(p, run=fails) if p.name == "hf-eager" else p for p in peers.PEERS])
    code, records, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "hf", "--ctx", "256,512", "--new-tokens", "4")
    assert code == 0, err
    rows = by_model(records)
    for ctx in (256, 512):
        assert rows["llama-tiny", ctx]["status"] == "ok"
        assert rows["hf-eager:llama-tiny", ctx]["status"] == "error"
        assert rows["hf-eager:llama-tiny", ctx]["reason"] == "ValueError: peer broke"


def test_hf_mamba2_runs_on_the_cpu(tmp_path, capsys):
    code, records, _, err = sweep(tmp_path, capsys, "--models", "mamba2-tiny", "--peers", "hf", "--ctx", "128", "--new-tokens", "4")
    assert code == 0, err
    row = by_model(records)["hf-mamba2:mamba2-tiny", 128]
    assert row["status"] == "ok" and row["passes"] == 3 and row["decode_tok_s"] > 0


@pytest.mark.gpu
def test_every_peer_on_the_gpu(tmp_path, capsys):
    """Every row on tiny shapes: every peer whose package imports here is measured at both contexts;
    an optional extra (mamba-ssm, flash-linear-attention) that does not import is one row saying so."""
    code, records, _, err = sweep(
        tmp_path, capsys, "--models", "llama-tiny,mamba2-tiny,rwkv7-tiny", "--peers", "hf,mamba_ssm,fla", "--ctx", "256,512", "--new-tokens", "8"
    )
    assert code == 0, err
    status = {(r["model"], r["ctx"]): r["status"] for r in records}
    for name in ("hf-eager:llama-tiny", "hf-compile:llama-tiny", "hf-mamba2:mamba2-tiny"):
        assert status[name, 256] == status[name, 512] == "ok", (name, [r.get("reason") for r in records if r["model"] == name])
    for name, module in (("mamba_ssm-cg:mamba2-tiny", "mamba_ssm"), ("fla-rwkv7:rwkv7-tiny", "fla"), ("fla-rwkv7-cg:rwkv7-tiny", "fla")):
        rows = [r for r in records if r["model"] == name]
        runs = peers.import_reason(module) is None and (module != "mamba_ssm" or peers.mamba_ssm_kernel_reason() is None)
        want = ["ok", "ok"] if runs else ["unavailable"]
        assert [r["status"] for r in rows] == want, (name, rows)


def test_plot_draws_peers_beside_their_model(tmp_path):
    from decoders.plot import plot_context_scaling

    def point(model, ctx, tok_s, **extra):
        return {"model": model, "status": "ok", "ctx": ctx, "batch": 1, "decode_tok_s_per_seq": tok_s, "tokens_per_pass": 1.0, "roofline_ms": 0.5, **extra}

    records = [point("llama-1b", c, 400.0) for c in (4096, 8192)]
    records += [point("hf-eager:llama-1b", c, 15.0, peer="hf-eager", preset="llama-1b") for c in (4096, 8192)]
    # A model measured only through a peer still gets its roofline.
    records += [point("mamba_ssm-cg:mamba2-1.3b", c, 215.0, peer="mamba_ssm-cg", preset="mamba2-1.3b") for c in (4096, 8192)]
    records.append({"model": "fla:llama-1b", "status": "not applicable", "ctx": None, "batch": None})
    path = tmp_path / "scaling.png"
    plot_context_scaling(records, str(path))
    assert path.stat().st_size > 0


def test_plot_draws_the_newest_record_of_a_point():
    from decoders.plot import select

    # Records without a time: of one run's records of a context, the later in the files is drawn.
    old = {"model": "llama-1b", "status": "ok", "ctx": 4096, "batch": 1, "decode_tok_s_per_seq": 1000.0, "tokens_per_pass": 1.0}
    series, left_out = select([old, dict(old, ctx=8192), dict(old, decode_tok_s_per_seq=1100.0), dict(old, status="timeout")])
    assert sorted((r["ctx"], r["decode_tok_s_per_seq"]) for r in series["llama-1b", 1, None]) == [(4096, 1100.0), (8192, 1000.0)]
    assert left_out == []
