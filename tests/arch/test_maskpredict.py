"""Mask-Predict model: segment attention, the paged bidirectional forward, the length head, the
masked-diffusion training loss, and both checkpoint formats (the lab's own and LLaDA-style HF Llama)."""

import json

import pytest
import torch

import decoders
from declab_arch import llama, maskpredict
from declab_arch.checkpoint import CONFIG_DIR, CheckpointError
from decoders.kv_cache import PagedKVCache

TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, mask_token_id=47, max_predicted_length=12)


def rel_rms(a, b):
    """||a - b|| / ||b|| in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny_model(seed=0, **overrides):
    config = maskpredict.MaskPredictConfig(**{**TINY, **overrides})
    return maskpredict.build(config, None, "test", seed=seed).eval()


def random_tokens(shape, seed=1, high=47):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def test_config_rejects_missing_or_out_of_range_mask_token():
    with pytest.raises(CheckpointError, match="mask_token_id"):
        maskpredict.MaskPredictConfig(**{**TINY, "mask_token_id": None})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        maskpredict.MaskPredictConfig(**{**TINY, "mask_token_id": 48})


def test_presets_load_and_match_llama_block_shape():
    tiny = maskpredict.preset_config(json.loads((CONFIG_DIR / "maskpredict-tiny.json").read_text()), "maskpredict-tiny")
    assert tiny.max_predicted_length > 0
    one_b = json.loads((CONFIG_DIR / "maskpredict-1b.json").read_text())
    llama_1b = json.loads((CONFIG_DIR / "llama-1b.json").read_text())
    assert {k: one_b[k] for k in llama_1b} == llama_1b
    assert 0 <= one_b["mask_token_id"] < one_b["vocab_size"]


def test_forward_is_bidirectional():
    model = tiny_model()
    tokens = random_tokens((1, 9))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 47
    with torch.no_grad():
        # The first position sees the last one: changing it changes the first position's logits.
        assert rel_rms(model(tokens)[0, 0], model(changed)[0, 0]) > 1e-4


def test_segments_keep_the_prompt_from_seeing_the_continuation():
    model = tiny_model()
    tokens = random_tokens((2, 11))
    segments = torch.tensor([[0] * 4 + [1] * 4 + [2] * 3, [0] * 6 + [1] * 5])
    with torch.no_grad():
        full = model.hidden(tokens, segments=segments)
        # Each prefix (prompt, then prompt + block) encodes the same alone.
        torch.testing.assert_close(full[0, :4], model.hidden(tokens[:1, :4])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full[0, 4:8], model.hidden(tokens[:1, :8], segments=segments[:1, :8])[0, 4:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full[1, :6], model.hidden(tokens[1:, :6])[0], rtol=1e-5, atol=1e-5)
        # One segment everywhere is plain bidirectional attention.
        torch.testing.assert_close(model.hidden(tokens, segments=torch.zeros_like(tokens)), model.hidden(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_paged_hidden_ref_and_triton_match_contiguous_forward(impl):
    model = tiny_model()
    lens = [13, 5, 20]
    kv = PagedKVCache(2, 2, 8, block_size=16, num_blocks=8)
    seqs = [kv.add_sequence() for _ in lens]
    slots = torch.cat([kv.append(s, n) for s, n in zip(seqs, lens)])
    prompts = [random_tokens((n,), seed=i) for i, n in enumerate(lens)]
    batch = llama.PagedBatch(
        k_cache=kv.k, v_cache=kv.v, block_tables=kv.block_table(seqs), seq_lens=torch.tensor(lens, dtype=torch.int32), slot_mapping=slots,
        decode=False, causal=False, cu_seqlens_q=torch.tensor([0, 13, 18, 38], dtype=torch.int32), max_seqlen_q=20, impl=impl,
    )
    with torch.no_grad():
        got = model.hidden_paged(torch.cat(prompts), torch.cat([torch.arange(n) for n in lens]), batch)
        want = torch.cat([model.hidden(p[None])[0] for p in prompts])
    assert rel_rms(got, want) < 1e-4


def test_length_head_pools_each_prompt():
    model = tiny_model()
    hidden = torch.randn(7, 32)
    owner = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    with torch.no_grad():
        got = model.length_logits(hidden, owner, 2)
        normed = model.model.norm(hidden)
        want = model.length_head(torch.stack([normed[:3].mean(0), normed[3:].mean(0)]))
    assert got.shape == (2, 13)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_token_log_probs_exclude_the_mask_token():
    logits = torch.randn(3, 48)
    logits[:, 47] = 100.0
    logp = maskpredict.token_log_probs(logits, 47)
    assert torch.isinf(logp[:, 47]).all()
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3))


def test_loss_counts_only_the_continuation_and_the_length():
    tokens = random_tokens((4, 10))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # All prompt: nothing is masked, and without a length head there is nothing to learn.
        assert maskpredict.masked_diffusion_loss(tiny_model(max_predicted_length=0), tokens, prompt_lens=[10] * 4, generator=gen).item() == 0.0
        # With a length head the length of the (empty) continuation is still a target.
        assert maskpredict.masked_diffusion_loss(tiny_model(), tokens, prompt_lens=[10] * 4, generator=gen).item() > 0
        loss = maskpredict.masked_diffusion_loss(tiny_model(), tokens, prompt_lens=[3, 4, 5, 6], generator=gen)
    assert torch.isfinite(loss) and loss.item() > 0


def test_training_loss_decreases():
    torch.manual_seed(0)
    model = tiny_model(num_hidden_layers=1).train()
    # Sequences with a learnable pattern: each continuation repeats its prompt shifted by one.
    prompts = random_tokens((8, 5), seed=3, high=40)
    tokens = torch.cat([prompts, prompts + 1], dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = maskpredict.masked_diffusion_loss(model, tokens, prompt_lens=[5] * 8, generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0], losses


def test_own_format_round_trip(tmp_path):
    model = tiny_model(seed=5)
    maskpredict.save(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["declab_family"] == "maskpredict" and hf["mask_token_id"] == 47
    dec = decoders.load(tmp_path, device="cpu", impl="ref")
    assert dec.family == "maskpredict"
    tokens = random_tokens((2, 7))
    with torch.no_grad():
        torch.testing.assert_close(dec.logits(tokens), model(tokens))


def llada_folder(tmp_path, *, model_type="llada"):
    """A tiny LLaDA-style checkpoint: HF Llama weights and names, a config that says masked diffusion."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(cfg).eval()
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(mask_token_id=47)
    if model_type == "llada":
        config.update(model_type="llada", architectures=["LLaDAModelLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    return hf_model, config


def test_llada_style_checkpoint_loads_with_hf_llama_names(tmp_path):
    hf_model, hf = llada_folder(tmp_path)
    assert maskpredict.is_masked_diffusion(hf)
    assert not llama.detects(hf)
    dec = decoders.load(tmp_path, device="cpu", impl="ref")
    assert dec.family == "maskpredict" and dec.mask_token_id == 47
    tokens = random_tokens((1, 9))
    # With one segment per position the segment attention is causal: the same function as HF's causal Llama.
    with torch.no_grad():
        ours = dec.model(tokens, segments=torch.arange(9)[None])
        theirs = hf_model(tokens).logits
    assert rel_rms(ours, theirs) < 1e-4


def test_llama_config_with_mask_token_is_masked_diffusion(tmp_path):
    _, hf = llada_folder(tmp_path, model_type="llama")
    assert hf["model_type"] == "llama" and maskpredict.is_masked_diffusion(hf)
    dec = decoders.load(tmp_path, family="maskpredict", device="cpu", impl="ref")
    assert dec.config.mask_token_id == 47


def test_plain_causal_llama_is_not_masked_diffusion(tmp_path):
    plain = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 48}
    assert not maskpredict.is_masked_diffusion(plain)
    with pytest.raises(CheckpointError, match="masked-diffusion"):
        (tmp_path / "config.json").write_text(json.dumps(plain))
        maskpredict.load(tmp_path)


def test_llada_own_names_and_fields_load(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model(seed=2, max_predicted_length=0, tie_word_embeddings=False)
    theirs = {"model.embed_tokens.weight": "model.transformer.wte.weight", "model.norm.weight": "model.transformer.ln_f.weight",
              "lm_head.weight": "model.transformer.ff_out.weight"}
    ours_to_llada = {v: k for k, v in maskpredict.LLADA_BLOCK_NAMES.items()}
    tensors = {}
    for name, t in model.state_dict().items():
        if name in theirs:
            tensors[theirs[name]] = t
        else:
            _, _, i, *module, leaf = name.split(".")
            tensors[f"model.transformer.blocks.{i}.{ours_to_llada['.'.join(module)]}.{leaf}"] = t
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "mlp_hidden_size": 64, "vocab_size": 48, "embedding_size": 48, "max_sequence_length": 256, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-5, "weight_tying": False, "include_bias": False, "activation_type": "silu", "layer_norm_type": "rms",
              "block_type": "llama", "mask_token_id": 47, "eos_token_id": 46}
    (tmp_path / "config.json").write_text(json.dumps(config))
    dec = decoders.load(tmp_path, device="cpu", impl="ref")
    assert dec.family == "maskpredict" and dec.mask_token_id == 47 and dec.eos_token_id == 46
    tokens = random_tokens((2, 7))
    with torch.no_grad():
        torch.testing.assert_close(dec.logits(tokens), model(tokens))
    (tmp_path / "config.json").write_text(json.dumps({**config, "include_bias": True}))
    with pytest.raises(CheckpointError, match="include_bias"):
        decoders.load(tmp_path, device="cpu", impl="ref")
