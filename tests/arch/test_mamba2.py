"""Mamba-2 model and checkpoints: logits parity with transformers' `Mamba2ForCausalLM` (its PyTorch
path), the state-spaces `mamba2-*` layout, the lab's own format, one-line errors for bad folders, and the
reference training path (its chunk and fused gated norm) against the config's chunk and the explicit norm."""

import json

import pytest
import torch

import decoders
from declab_arch import mamba2
from declab_arch.checkpoint import CONFIG_DIR, CheckpointError, read_json
from declab_kernels import tuning
from decoders.mamba2 import Mamba2Decoder


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_model(ngroups: int, tie: bool, seed: int = 0):
    """A small HF Mamba2ForCausalLM in float32 with every parameter (norms, D, dt_bias too) randomised."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    config = Mamba2Config(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, n_groups=ngroups,
        expand=2, chunk_size=16, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    model = Mamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("conv1d.bias") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def load_ref(folder):
    return decoders.load(folder, device="cpu", dtype="float32", impl="ref")


@pytest.mark.parametrize("ngroups,tie", [(1, True), (2, False)])
def test_hf_checkpoint_logits_match_transformers_ref(tmp_path, ngroups, tie, hf_mamba2_groups):
    hf_mamba2_groups(ngroups)
    model = hf_model(ngroups, tie)
    model.save_pretrained(tmp_path)
    dec = load_ref(tmp_path)
    assert isinstance(dec, Mamba2Decoder) and dec.config.ngroups == ngroups and dec.config.tie_embeddings == tie
    # 37 tokens: two whole chunks of 16 and a partial one.
    tokens = torch.randint(0, 100, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
    assert rel(dec.logits(tokens), expected) < 1e-5


def state_spaces_folder(model, folder, multiple=16):
    """The mamba-ssm layout of an HF model (tied): renamed tensors in pytorch_model.bin, the embedding
    padded to a multiple of `multiple` rows, and a `MambaConfig`-style config.json."""
    c = model.config
    tensors = {}
    for name, t in model.state_dict().items():
        tensors[name.replace("backbone.embeddings.", "backbone.embedding.")] = t.clone()
    emb = tensors["backbone.embedding.weight"]
    padded = -(-c.vocab_size // multiple) * multiple
    tensors["backbone.embedding.weight"] = torch.cat([emb, torch.randn(padded - emb.shape[0], emb.shape[1])])
    tensors["lm_head.weight"] = tensors["backbone.embedding.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, folder / "pytorch_model.bin")
    config = {
        "d_model": c.hidden_size, "d_intermediate": 0, "n_layer": c.num_hidden_layers, "vocab_size": c.vocab_size,
        "ssm_cfg": {"layer": "Mamba2", "d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand,
                    "headdim": c.head_dim, "ngroups": c.n_groups, "chunk_size": c.chunk_size},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "pad_vocab_size_multiple": multiple, "tie_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("ngroups", [1, 2])
def test_state_spaces_layout_matches_transformers_ref(tmp_path, ngroups, hf_mamba2_groups):
    hf_mamba2_groups(ngroups)
    model = hf_model(ngroups, tie=True, seed=2)
    folder = state_spaces_folder(model, tmp_path / "ss")
    dec = load_ref(folder)
    assert dec.config.vocab_size == 112 and dec.config.ngroups == ngroups
    tokens = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens).logits
    logits = dec.logits(tokens)
    assert logits.shape == (2, 21, 112)
    assert rel(logits[..., :100], expected) < 1e-5


def test_detects_both_layouts_and_nothing_else(tmp_path):
    model = hf_model(1, tie=True)
    model.save_pretrained(tmp_path / "hf")
    state_spaces_folder(model, tmp_path / "ss")
    assert Mamba2Decoder.detects(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert Mamba2Decoder.detects(json.loads((tmp_path / "ss" / "config.json").read_text()))
    assert not Mamba2Decoder.detects({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not Mamba2Decoder.detects({"d_model": 64, "n_layer": 2, "ssm_cfg": {}})


def corrupt(folder, edit):
    path = folder / "pytorch_model.bin"
    tensors = torch.load(path, weights_only=True)
    edit(tensors)
    torch.save(tensors, path)


def test_missing_tensor_is_one_line_error(tmp_path):
    folder = state_spaces_folder(hf_model(1, tie=True), tmp_path / "ss")
    corrupt(folder, lambda t: t.pop("backbone.layers.1.mixer.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor backbone\.layers\.1\.mixer\.A_log") as e:
        load_ref(folder)
    assert "\n" not in str(e.value)


def test_misshaped_tensor_is_one_line_error(tmp_path):
    model = hf_model(1, tie=True)
    model.save_pretrained(tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["backbone.layers.0.mixer.conv1d.weight"] = torch.randn(160, 1, 3)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"conv1d\.weight has shape \[160, 1, 3\], expected \[160, 1, 4\]") as e:
        load_ref(tmp_path / "hf")
    assert "\n" not in str(e.value)


def test_unsupported_ssm_option_is_refused(tmp_path):
    folder = state_spaces_folder(hf_model(1, tie=True), tmp_path / "ss")
    config = json.loads((folder / "config.json").read_text())
    config["ssm_cfg"]["norm_before_gate"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="norm_before_gate"):
        load_ref(folder)


def test_lab_format_round_trip(tmp_path):
    dec = decoders.load("mamba2-tiny", device="cpu", dtype="float32", impl="ref", seed=5)
    dec.save(tmp_path / "lab")
    assert json.loads((tmp_path / "lab" / "config.json").read_text())["declab_family"] == "mamba2"
    again = load_ref(tmp_path / "lab")
    assert again.config == dec.config
    tokens = torch.randint(0, 512, (1, 19), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.logits(tokens), dec.logits(tokens))


def test_presets_have_the_stated_shapes():
    for name, (d, L, vocab) in {"mamba2-130m": (768, 24, 50288), "mamba2-1.3b": (2048, 48, 50288)}.items():
        c = mamba2.preset_config(read_json(CONFIG_DIR / f"{name}.json"), name)
        assert (c.d_model, c.n_layer, c.vocab_size, c.d_state, c.headdim, c.expand, c.ngroups, c.d_conv) == (d, L, vocab, 128, 64, 2, 1, 4)
        assert c.nheads == 2 * d // 64 and c.conv_dim == 2 * d + 2 * 128
    # About 130M parameters: the embedding plus, per layer, in_proj, out_proj, conv and the small vectors.
    with torch.device("meta"):
        model = mamba2.Mamba2LM(mamba2.preset_config(read_json(CONFIG_DIR / "mamba2-130m.json"), "mamba2-130m"))
    params = sum(p.numel() for p in model.parameters())
    assert 125e6 < params < 135e6


def test_decay_rates_follow_A_log():
    """The decode step's cached A = -exp(A_log) is recomputed after an in-place change of A_log."""
    config = mamba2.preset_config(read_json(CONFIG_DIR / "mamba2-tiny.json"), "mamba2-tiny")
    mixer = mamba2.build(config, None, "mamba2-tiny").backbone.layers[0].mixer
    first = mixer.decay_rates()
    assert torch.equal(first, -torch.exp(mixer.A_log)) and mixer.decay_rates() is first
    with torch.no_grad():
        mixer.A_log.add_(0.5)
    assert torch.equal(mixer.decay_rates(), -torch.exp(mixer.A_log))


@torch.inference_mode()
def test_step_equals_unfused_blocks_ref():
    """`step`'s fused add + norm order is the blocks' r = r + mixer(norm(r)), then the head."""
    dec = decoders.load("mamba2-tiny", device="cpu", dtype="float32", impl="ref", seed=3)
    model, c = dec.model, dec.config
    tokens = torch.tensor([5, 77, 300])
    positions = torch.tensor([9, 4, 130])
    conv = torch.randn(c.n_layer, 3, c.conv_dim, c.d_conv)
    ssm = torch.randn(c.n_layer, 3, c.nheads, c.headdim, c.d_state)
    conv2, ssm2 = conv.clone(), ssm.clone()
    logits = model.step(tokens, conv, ssm, "ref", positions=positions)
    r = model.embed(tokens)
    for i, block in enumerate(model.backbone.layers):
        r = r + block.mixer.step(block.norm(r), conv2[i], ssm2[i], "ref", positions=positions)
    assert torch.equal(logits, model.head(r))
    assert torch.equal(conv, conv2) and torch.equal(ssm, ssm2)


@pytest.mark.interpreter
@torch.inference_mode()
def test_step_triton_one_sequence_equals_the_blocks(monkeypatch):
    """One sequence on the Triton path (the interpreter on the CPU): the norms' statistics come from
    the SSM step and out_proj's epilogue, 1 / rms is applied by the GEMV after; the logits and states
    equal the reference blocks' (the schedule without the gate in the step). Passing those statistics
    where the gate is not in the step (more rows) is refused before any state moves."""
    dec = decoders.load("mamba2-tiny", device="cpu", dtype="float32", impl="ref", seed=3)
    model, c = dec.model, dec.config
    tokens = torch.tensor([77])
    positions = torch.tensor([6])
    conv = torch.randn(c.n_layer, 1, c.conv_dim, c.d_conv)
    ssm = torch.randn(c.n_layer, 1, c.nheads, c.headdim, c.d_state)
    conv2, ssm2 = conv.clone(), ssm.clone()
    logits = model.step(tokens, conv, ssm, "triton", positions=positions)
    with monkeypatch.context() as m:
        m.setattr(tuning, "GATE_IN_STEP_ROWS", 0)
        want = model.step(tokens, conv2, ssm2, "ref", positions=positions)
    for got, ref in ((logits, want), (conv, conv2), (ssm, ssm2)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    mixer = model.backbone.layers[0].mixer
    rows = tuning.GATE_IN_STEP_ROWS + 1
    conv3, ssm3 = torch.randn(rows, c.conv_dim, c.d_conv), torch.randn(rows, c.nheads, c.headdim, c.d_state)
    before = ssm3.clone()
    with pytest.raises(ValueError, match="gate in the step"):
        mixer.step(torch.zeros(rows, c.d_model), conv3, ssm3, "ref", positions=positions.expand(rows),
                   residual=torch.zeros(rows, c.d_model))
    assert torch.equal(ssm3, before)


def test_ref_training_forward_equals_the_config_chunk_and_unfused_norm(monkeypatch):
    """The reference path trains with chunks of at most REF_CHUNK and a fused rms_norm in the gated norm:
    logits and every parameter's gradient equal those of the config's chunk (256 here) and the explicit
    rmsnorm(y * silu(z)) formula, with autograd recording (the training path)."""
    values = {**read_json(CONFIG_DIR / "mamba2-tiny.json"), "chunk_size": 256}
    model = mamba2.build(mamba2.preset_config(values, "mamba2-tiny"), None, "mamba2-tiny", seed=2).train()
    x = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(2))

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(x, "ref")
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    def unfused_norm(self, y, z):
        h = (y.float() * torch.nn.functional.silu(z.float())).unflatten(-1, (-1, self.group_size))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.flatten(-2).to(y.dtype)

    logits, grads = run()
    monkeypatch.setattr(mamba2, "REF_CHUNK", 256)
    monkeypatch.setattr(mamba2.RMSNormGated, "forward", unfused_norm)
    want, want_grads = run()
    assert rel(logits, want) < 1e-5
    for name, g in grads.items():
        assert rel(g, want_grads[name]) < 1e-4, name
