"""Quantised folders made by `python -m eval.quantize` decode as quantised through `decoders.load`
(no quant= needed; a contradicting one refused) and through the lm-eval model (`quant=` in its model
args, or a quantised folder). Tiny presets, float32 on the CPU."""

import pytest
import torch

import decoders
from declab_arch import quant
from declab_arch.quant_linear import QuantLinear
from eval.lm_model import DecLabLM, check_model_args
from eval.quantize import main as quantize_main


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_folder(tmp_path, preset, name, *extra):
    out = tmp_path / f"{preset}-{name}"
    assert quantize_main([preset, "--quant", name, "--out", str(out), "--device", "cpu", *extra]) == 0
    return out


@pytest.mark.parametrize("preset, name", [("llama-tiny", "int8"), ("llama-tiny", "int4-rtn-g16"), ("mamba2-tiny", "int4-rtn-g16"),
                                          ("rwkv7-tiny", "int4-rtn-g16"), ("maskpredict-tiny", "int8")])
def test_a_quantised_folder_loads_as_quantised_and_equals_quantising_on_the_fly(tmp_path, capsys, preset, name):
    folder = make_folder(tmp_path, preset, name)
    loaded = decoders.load(folder, device="cpu", impl="ref")
    fly = decoders.load(preset, device="cpu", impl="ref", quant=name)
    assert loaded.quant == fly.quant == quant.parse_quant(name)
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    tokens = torch.randint(0, fly.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    assert rel(loaded.logits(tokens), fly.logits(tokens)) < 1e-6
    assert loaded.memory(1, 32).weight_bytes == fly.memory(1, 32).weight_bytes
    # The same name (or none) is accepted; another is a contradiction, refused before any tensor is read.
    assert decoders.load(folder, device="cpu", impl="ref", quant=name).quant == loaded.quant
    other = "int4-rtn-g16" if name == "int8" else "int8"
    with pytest.raises(quant.QuantError, match="contradicts"):
        decoders.load(folder, device="cpu", impl="ref", quant=other)
    with pytest.raises(decoders.UsageError, match="eval.quantize"):
        loaded.save(tmp_path / "again")


def test_a_calibrated_folder_loads_and_its_name_matches(tmp_path, write_corpus, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    folder = make_folder(tmp_path, "llama-tiny", "int4-g16", "--calib", str(corpus), "--sequences", "4", "--length", "32")
    dec = decoders.load(folder, device="cpu", impl="ref", quant="int4-g16")
    assert dec.quant.method == "gptq" and dec.describe()["quant"]["name"] == "int4-g16"
    with pytest.raises(quant.QuantError, match="contradicts"):
        decoders.load(folder, device="cpu", impl="ref", quant="int4-rtn-g16")
    out = dec.generate([[1, 2, 3, 4]], max_new_tokens=4).tokens[0]
    assert len(out) == 4


def test_lm_eval_model_takes_quant_and_loads_quantised_folders(tmp_path, capsys):
    args = {"dtype": "float32", "device": "cpu", "impl": "ref", "max_length": 48, "batch_size": 2}
    lm = DecLabLM(pretrained="llama-tiny", quant="int8", **args)
    assert lm.decoder.quant.name == "int8"
    dense = DecLabLM(pretrained="llama-tiny", **args)
    requests = [("a b", " c"), ("hello", " world")]
    ours = [lp for lp, _ in lm.loglikelihood([type("R", (), {"args": r})() for r in requests], disable_tqdm=True)]
    theirs = [lp for lp, _ in dense.loglikelihood([type("R", (), {"args": r})() for r in requests], disable_tqdm=True)]
    assert ours != theirs and all(torch.isfinite(torch.tensor(ours)))
    assert DecLabLM(pretrained="llama-tiny", quant="none", **args).decoder.quant is None
    folder = make_folder(tmp_path, "llama-tiny", "int4-rtn-g16")
    assert DecLabLM(pretrained=str(folder), **args).decoder.quant.name == "int4-rtn-g16"
    with pytest.raises(decoders.USER_ERRORS, match="does not divide"):
        check_model_args({"pretrained": "llama-tiny", "quant": "int4-rtn-g32"})
    with pytest.raises(decoders.USER_ERRORS, match="contradicts"):
        check_model_args({"pretrained": str(folder), "quant": "int8"})


def test_quantize_refuses_a_folder_already_quantised(tmp_path, capsys):
    folder = make_folder(tmp_path, "llama-tiny", "int8")
    assert quantize_main([str(folder), "--quant", "int8", "--out", str(tmp_path / "twice"), "--device", "cpu"]) == 2
    assert "already quantised" in capsys.readouterr().err
