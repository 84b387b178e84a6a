"""Llama family against transformers' own models, from checkpoints written by `save_pretrained`."""

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import decoders
from declab_arch.checkpoint import CheckpointError
from declab_arch.llama import LlamaConfig, rope_inv_freq

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)


def save_hf(tmp_path, cls, config_cls, seed=0, **overrides):
    torch.manual_seed(seed)
    config = config_cls(**{**SMALL, **overrides})
    model = cls(config).eval()
    model.save_pretrained(tmp_path)
    return model


CASES = {
    "llama-gqa-untied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        dict(num_key_value_heads=1, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ),
    "qwen2-bias": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(num_key_value_heads=2)),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    cls, config_cls, overrides = CASES[case]
    hf = save_hf(tmp_path, cls, config_cls, **overrides)
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    assert dec.family == "transformer"
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 37))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(dec.logits(tokens), expected, rtol=1e-4, atol=1e-4)
    # The paged path (prefill + decode) gives the same last-token logits.
    state = dec.prefill(tokens, max_new_tokens=1)
    torch.testing.assert_close(state.first_logits, expected[:, -1], rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_transformers_token_for_token(tmp_path):
    hf = save_hf(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=2, tie_word_embeddings=False)
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    prompt = torch.randint(0, SMALL["vocab_size"], (1, 11))
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, 11:].tolist()
    assert dec.generate(prompt, max_new_tokens=20).tokens[0] == expected


def test_llama3_rope_frequencies_match_transformers():
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072)
    fn = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    expected, _ = fn(hf_config, "cpu")
    ours = rope_inv_freq(LlamaConfig(128256, 2048, 8192, 16, 32, 8, 64, rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_hf(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=2)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[: len(names) // 2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[len(names) // 2 :]}, tmp_path / "model-00002-of-00002.safetensors")
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(dec.logits(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_missing_tensor_is_named(tmp_path):
    save_hf(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=2)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        decoders.load(tmp_path, device="cpu", impl="ref")


def test_misshaped_tensor_is_named(tmp_path):
    save_hf(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=2)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \[3, 64\], expected \[32, 64\]"):
        decoders.load(tmp_path, device="cpu", impl="ref")


def test_unknown_architecture_and_non_checkpoint_folders(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="unknown architecture"):
        decoders.load(tmp_path, device="cpu", impl="ref")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        decoders.load(empty, device="cpu", impl="ref")


def test_tokenizer_is_loaded_from_the_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_hf(tmp_path, transformers.LlamaForCausalLM, transformers.LlamaConfig, num_key_value_heads=2)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp_path)
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    assert dec.tokenizer is not None
    gen = dec.generate(["hello world"], max_new_tokens=3)
    assert len(gen.tokens[0]) == 3 and isinstance(gen.text[0], str)


def test_fused_projections_are_the_only_copy_of_the_weights():
    """q/k/v and gate/up are views into one fused weight each, also after a dtype change, and load by HF names."""
    from declab_arch import llama

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, attention_bias=True)
    model = llama.build(config, None, "test").to(torch.float64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight.dtype == attn.qkv_bias.dtype == mlp.gate_up_weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == attn.qkv_bias.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    # Loading HF names writes into the fused weights.
    tensors = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    llama.assign_weights(model, tensors, "test")
    torch.testing.assert_close(attn.qkv_weight, torch.cat([tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
    torch.testing.assert_close(mlp.gate_up_weight, torch.cat([tensors[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]))
    # No parameter counted twice.
    own = sum(p.numel() for p in model.parameters())
    assert own == sum(t.numel() for t in tensors.values())


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["qwen2-bias", "llama-gqa-untied"])
def test_triton_path_matches_transformers(tmp_path, case):
    """The fused path (q/k/v bias, untied head) gives HF's logits at prefill and at a decode step."""
    cls, config_cls, overrides = CASES[case]
    hf = save_hf(tmp_path, cls, config_cls, **overrides)
    dec = decoders.load(tmp_path, device="cpu", dtype="float32", impl="triton")
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 13))
    with torch.no_grad():
        expected = hf(tokens).logits
    state = dec.prefill(tokens[:, :12], max_new_tokens=2)
    torch.testing.assert_close(state.first_logits, expected[:, 11], rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        state.next_tokens.copy_(tokens[:, 12])
        torch.testing.assert_close(dec.step(state).logits, expected[:, 12], rtol=1e-4, atol=1e-4)


def test_save_round_trip_in_the_lab_format(tmp_path):
    dec = decoders.load("llama-tiny", device="cpu", dtype="float32", impl="ref", seed=4)
    dec.save(tmp_path)
    again = decoders.load(tmp_path, device="cpu", dtype="float32", impl="ref")
    assert again.family == "transformer"
    tokens = torch.randint(0, dec.vocab_size, (1, 12))
    torch.testing.assert_close(again.logits(tokens), dec.logits(tokens))
