"""Each family declares its own tensor-parallel plan: a family without one is refused before anything
runs (one line, exit code 2 on the command line), and the list of families that tensor parallel runs
is read from the registry and the plans, so removing a plan refuses that family too. No processes are
started: every refusal comes before the first collective.
"""

import pytest
import torch

import decoders
from declab_arch import llama, tensor_parallel
from declab_arch.tensor_parallel import Group
from decoders import compare, distributed


def test_a_family_without_a_plan_is_refused_by_load():
    refusal = "maskpredict-tiny: tensor parallel runs the transformer, mamba2, rwkv7 families, not maskpredict"
    with pytest.raises(decoders.UsageError, match=refusal):
        decoders.load("maskpredict-tiny", device="cpu", impl="ref", tp=Group(0, 2))


def test_removing_a_plan_refuses_its_family(tmp_path, capsys, monkeypatch):
    family, config = decoders.model_config("llama-tiny")
    model = llama.build(config, None, "llama-tiny")
    full = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.delattr(llama, "tp_plan")
    with pytest.raises(decoders.UsageError, match="llama-tiny: tensor parallel runs the mamba2, rwkv7 families, not transformer"):
        distributed.check_splits(family, config, 2, "llama-tiny")
    with pytest.raises(ValueError, match="the transformer family has no tensor-parallel plan"):
        tensor_parallel.shard(model, family, config, Group(0, 2))
    assert all(torch.equal(v, full[k]) for k, v in model.state_dict().items())
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--models", "llama-tiny", "--ctx", "64", "--new-tokens", "4", "--no-progress", "--tp", "2", "--out", str(tmp_path / "r.jsonl")]
    assert compare.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: llama-tiny: tensor parallel runs the mamba2, rwkv7 families, not transformer"]
    assert not (tmp_path / "r.jsonl").exists()


def test_a_plan_is_that_of_the_configs_own_family():
    family, config = decoders.model_config("mamba2-tiny")
    assert tensor_parallel.check(family, config, 2).nheads == config.nheads // 2
    with pytest.raises(ValueError, match="is not a config of the transformer family"):
        tensor_parallel.plan("transformer", config, 2)
