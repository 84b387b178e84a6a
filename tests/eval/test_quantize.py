"""`python -m eval.quantize`: calibration tokens from a corpus, a calibrated quantised checkpoint
written and read back, and the refusals (one line, exit 2) before any work."""

import json

import pytest
import torch

from declab_arch import quant
from decoders.quant import check_quant
from eval.quantize import calibration_tokens, main
from eval.tokenizer import byte_tokenizer


def test_calibration_tokens_from_the_train_split(tmp_path, write_corpus):
    corpus = write_corpus(tmp_path / "corpus")
    tokens = calibration_tokens(corpus, byte_tokenizer(), sequences=4, length=64)
    assert tokens.shape == (4, 64) and tokens.dtype == torch.int64
    # <bos> first: the first document starts the stream.
    assert tokens[0, 0].item() == byte_tokenizer().bos_token_id
    assert not torch.equal(tokens, calibration_tokens(corpus, byte_tokenizer(), sequences=4, length=64, split="valid"))


def test_quantize_command_writes_a_checkpoint_that_reads_back(tmp_path, write_corpus, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "q"
    assert main(["llama-tiny", "--quant", "int4-g16", "--calib", str(corpus), "--sequences", "8", "--length", "32", "--out", str(out), "--device", "cpu"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["quant"] == "int4-g16" and summary["method"] == "gptq" and summary["layers"] == 14
    assert summary["quantized_bytes"] < summary["dense_bytes"] / 4
    spec, mapping, _ = quant.read_checkpoint(out)
    assert spec == quant.parse_quant("int4-g16") and len(mapping) == 14


@pytest.mark.parametrize("args, message", [
    (["--quant", "int3"], "unknown quant 'int3'"),
    (["--quant", "int4"], "group size 128 does not divide the layer's 176 inputs"),
    (["--quant", "int4-g16"], "give the calibration text with --calib"),
    (["--quant", "int8", "--calib", "somewhere"], "takes no calibration text"),
    (["--quant", "int8", "--group-size", "64"], "takes no group size"),
    (["--quant", "int4-rtn-g16", "--device", "tpu"], "unknown device"),
])
def test_refusals(tmp_path, capsys, args, message):
    assert main(["llama-tiny", "--out", str(tmp_path / "q"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "q").exists()


def test_refuses_small_corpus_and_full_folder(tmp_path, write_corpus, capsys):
    corpus = write_corpus(tmp_path / "corpus", docs=2)
    assert main(["llama-tiny", "--quant", "int4-g16", "--calib", str(corpus), "--sequences", "400", "--out", str(tmp_path / "q"), "--device", "cpu"]) == 2
    assert "fewer than 400 x 512" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["llama-tiny", "--quant", "int8", "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_check_quant_reads_shapes_only():
    assert check_quant("int4", model="llama-8b").group_size == 128
    assert check_quant("int4-g64", model="rwkv7-tiny", head=True).group_size == 64
    with pytest.raises(quant.QuantError, match="mamba2-tiny: .*group size 48 does not divide"):
        check_quant("int4-rtn-g48", model="mamba2-tiny")
