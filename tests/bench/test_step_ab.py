"""declab_bench.step_ab: its variant syntax, the environment it sets and restores, and its refusal to run
without a GPU (its timing itself runs on one)."""

import os

import pytest
import torch

from declab_bench import step_ab


def test_parse_variant():
    assert step_ab.parse_variant("on:") == ("on", {})
    assert step_ab.parse_variant("off:DECLAB_PDL=0") == ("off", {"DECLAB_PDL": "0"})
    assert step_ab.parse_variant("two:A=1,B=x=y") == ("two", {"A": "1", "B": "x=y"})
    for bad in ("noname", ":A=1", "v:A"):
        with pytest.raises(SystemExit):
            step_ab.parse_variant(bad)


def test_environ_sets_then_restores(monkeypatch):
    monkeypatch.setenv("DECLAB_STEP_AB_KEPT", "before")
    monkeypatch.delenv("DECLAB_STEP_AB_NEW", raising=False)
    with step_ab.environ({"DECLAB_STEP_AB_KEPT": "during", "DECLAB_STEP_AB_NEW": "1"}):
        assert os.environ["DECLAB_STEP_AB_KEPT"] == "during" and os.environ["DECLAB_STEP_AB_NEW"] == "1"
    assert os.environ["DECLAB_STEP_AB_KEPT"] == "before" and "DECLAB_STEP_AB_NEW" not in os.environ


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a GPU"):
        step_ab.main([str(tmp_path / "out.jsonl"), "--model", "llama-tiny", "--variant", "on:"])
