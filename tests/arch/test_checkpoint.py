"""Checkpoint reading: every malformed file or config value is a CheckpointError with one line, and
a checkpoint's Mamba-2 chunk size does not bind the lab's scan."""

import json

import pytest
import torch

import decoders
from declab_arch import checkpoint, llama, mamba2
from declab_arch.checkpoint import CheckpointError


def test_config_values_of_the_wrong_type_or_range_are_named():
    values = json.loads((checkpoint.CONFIG_DIR / "llama-tiny.json").read_text())
    for change, message in [({"hidden_size": "64"}, "hidden_size = '64' is not of type int"),
                            ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes' is not of type bool"),
                            ({"rms_norm_eps": None}, "rms_norm_eps = None is not of type float"),
                            ({"num_hidden_layers": 0}, "num_hidden_layers = 0 must be at least 1"),
                            ({"eos_token_id": [1, "2"]}, "eos_token_id")]:
        with pytest.raises(CheckpointError, match=message.replace("[", r"\[")) as e:
            llama.preset_config({**values, **change}, "llama-tiny")
        assert "\n" not in str(e.value) and str(e.value).startswith("llama-tiny: ")


def test_unreadable_and_truncated_weights_files_are_named(tmp_path):
    good = torch.arange(1000, dtype=torch.float32)
    from safetensors.torch import save_file

    save_file({"w": good}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    assert torch.equal(checkpoint.load_weights(tmp_path)["w"], good)
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.check_weights_files(tmp_path)
    with pytest.raises(CheckpointError, match="not a readable safetensors weights file"):
        checkpoint.load_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="not a readable PyTorch weights file"):
        checkpoint.load_weights(tmp_path)


def test_a_broken_tokenizer_file_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="tokenizer files cannot be read"):
        checkpoint.load_tokenizer(tmp_path)


def test_mamba2_scan_chunk_is_the_labs_choice():
    assert [mamba2.scan_chunk(c, "triton") for c in (8, 16, 48, 256)] == [16, 16, 64, 256]
    assert [mamba2.scan_chunk(c, "ref") for c in (8, 256)] == [8, mamba2.REF_CHUNK]


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_hf_mamba2_checkpoint_with_chunk_size_8_loads_and_matches_transformers_triton(tmp_path, device):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=16, head_dim=16, num_heads=4, n_groups=1,
                          expand=2, chunk_size=8, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = Mamba2ForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    dec = decoders.load(tmp_path, device=device, dtype="float32", impl="triton")
    assert dec.config.chunk_size == 8
    tokens = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
    got = dec.logits(tokens.to(device)).cpu()
    # On a GPU the scan's float32 products may run as TF32.
    assert ((got - expected).norm() / expected.norm()).item() < (1e-4 if device == "cpu" else 3e-3)
