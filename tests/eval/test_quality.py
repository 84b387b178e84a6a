"""eval.quality's reports: the table and plots redrawn from a quality.jsonl, as an interrupted run leaves it."""

import json

import pytest

from eval import quality


def write_records(path):
    rows = [("runs/llama-30m", "transformer", None, "declab_mqar_4", {"acc,none": 0.5}),
            ("runs/llama-30m", "transformer", None, "declab_mqar_8", {"acc,none": 0.25}),
            ("runs/llama-30m", "transformer", None, "declab_ppl", {"bits_per_byte,none": 1.5, "word_perplexity,none": 300.0}),
            ("runs/mp-30m", "maskpredict", 4, "declab_ppl", {"bits_per_byte,none": 2.5}),
            ("runs/mp-30m", "maskpredict", 16, "declab_ppl", {"bits_per_byte,none": 2.25})]
    path.write_text("".join(json.dumps({"checkpoint": c, "family": f, "iterations": t, "task": k, "metrics": m}) + "\n" for c, f, t, k, m in rows))


def test_runs_from_jsonl_groups_by_checkpoint_and_iterations(tmp_path):
    write_records(tmp_path / "q.jsonl")
    runs = quality.runs_from_jsonl(tmp_path / "q.jsonl")
    assert [(r["checkpoint"], r["iterations"]) for r in runs] == [("runs/llama-30m", None), ("runs/mp-30m", 4), ("runs/mp-30m", 16)]
    assert runs[0]["results"]["declab_mqar_8"] == {"acc,none": 0.25}


def test_from_jsonl_writes_table_and_plots(tmp_path, capsys):
    write_records(tmp_path / "q.jsonl")
    quality.main(["--from-jsonl", str(tmp_path / "q.jsonl"), "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "quality.md").read_text()
    assert "| llama-30m | transformer | 0.5000 | 0.2500 | 1.5000 |" in table and "| mp-30m T=16 | maskpredict |" in table
    assert (tmp_path / "out" / "mqar.png").stat().st_size > 0 and (tmp_path / "out" / "maskpredict_iterations.png").stat().st_size > 0
    assert "llama-30m" in capsys.readouterr().out


def test_from_jsonl_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(quality.decoders.UsageError, match="no such file"):
        quality.main(["--from-jsonl", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
