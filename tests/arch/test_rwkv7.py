"""RWKV-7 model (declab_arch.rwkv7): the chunked, resumed and one-token forms agree with the parallel forward,
the reference path's training forward (logits and gradients) agrees with the literal chunked WKV-7
reference, the Triton and reference WKV-7 kernels agree inside the model, checkpoints load with fla's
names (and refuse missing or mis-shaped tensors), and logits match flash-linear-attention's own
RWKV7ForCausalLM."""

import json
import os

import pytest
import torch

import decoders
from declab_arch import rwkv7
from declab_kernels import tuning
from declab_arch.checkpoint import CONFIG_DIR, CheckpointError, read_json
from declab_kernels.wkv7 import wkv7_chunk_ref

TINY = read_json(CONFIG_DIR / "rwkv7-tiny.json")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def tiny_model(seed=0, **changes):
    config = rwkv7.RWKV7Config(**{**TINY, **changes})
    return rwkv7.build(config, None, "rwkv7-tiny", seed=seed).eval()


def tokens(B, T, seed=0):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_ref_step_equals_parallel_forward():
    model = tiny_model()
    x = tokens(2, 19)
    full = model(x, impl="ref")
    shift, wkv = model.new_state(2)
    got = [model.forward_chunk(x[:, :6], [6, 6], shift, wkv, impl="ref")]
    for t in range(6, 19):
        got.append(model.forward_step(x[:, t], shift, wkv, impl="ref"))
    assert rel(torch.stack(got, 1), full[:, 5:]) < 1e-5


@torch.inference_mode()
@pytest.mark.parametrize("cut", [1, 7, 16])
def test_ref_chunk_resumed_from_saved_state_equals_one_shot(cut):
    model = tiny_model(norm_first=False)
    x = tokens(2, 37, seed=1)
    shift, wkv = model.new_state(2)
    one_shot = model.forward_chunk(x, [37, 37], shift, wkv, impl="ref")
    s2, w2 = model.new_state(2)
    model.forward_chunk(x[:, :cut], [cut, cut], s2, w2, impl="ref")
    saved = (s2.clone(), w2.clone())
    resumed = model.forward_chunk(x[:, cut:], [37 - cut] * 2, *saved, impl="ref")
    assert rel(resumed, one_shot) < 1e-5
    assert rel(saved[1], wkv) < 1e-5 and rel(saved[0], shift) < 1e-5


@torch.inference_mode()
def test_ref_right_padded_rows_keep_their_own_state():
    model = tiny_model()
    x = tokens(3, 21, seed=2)
    lengths = [21, 5, 13]
    shift, wkv = model.new_state(3)
    batched = model.forward_chunk(x, lengths, shift, wkv, impl="ref")
    for i, n in enumerate(lengths):
        s1, w1 = model.new_state(1)
        alone = model.forward_chunk(x[i : i + 1, :n], [n], s1, w1, impl="ref")
        assert rel(batched[i], alone[0]) < 1e-5
        assert rel(wkv[:, i], w1[:, 0]) < 1e-5 and rel(shift[:, :, i], s1[:, :, 0]) < 1e-5


def test_ref_training_forward_equals_the_chunk_reference(monkeypatch):
    """The reference path's WKV-7 (`wkv7_chunk_factored`) against the literal chunked reference it
    replaced: logits and every parameter's gradient, with autograd recording (the training path)."""
    model = tiny_model(seed=4).train()
    x = tokens(2, 100, seed=4)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(x, impl="ref")
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    logits, grads = run()
    monkeypatch.setattr(rwkv7, "wkv7_chunk_factored", wkv7_chunk_ref)
    want, want_grads = run()
    assert rel(logits, want) < 1e-5
    for name, g in grads.items():
        assert rel(g, want_grads[name]) < 1e-4, name


@pytest.mark.interpreter
@torch.inference_mode()
def test_triton_matches_ref_in_model():
    ref = decoders.load("rwkv7-tiny", impl="ref", device="cpu", seed=3)
    tri = decoders.load("rwkv7-tiny", impl="triton", device="cpu", seed=3)
    x = tokens(2, 21, seed=3)
    assert rel(tri.logits(x), ref.logits(x)) < 1e-4
    prompts = [x[0, :9].tolist(), x[1, :4].tolist()]
    g_ref = ref.generate(prompts, max_new_tokens=5)
    g_tri = tri.generate(prompts, max_new_tokens=5)
    assert g_tri.tokens == g_ref.tokens


@pytest.mark.interpreter
@torch.inference_mode()
@pytest.mark.parametrize("cross_rows", [tuning.CROSS_ROWS, 0])
def test_triton_step_matches_ref_step(monkeypatch, cross_rows):
    """The step on the Triton kernels against the same step on their references, with both unfused
    layouts of the down-projections (`fusions.Select`): one cross GEMM of every input by the packed
    weight (the row-select GEMV's alternative), and batched r/k/v + LoRA GEMMs (many rows); the
    layers with a value LoRA split their rows differently from layer 0."""
    monkeypatch.setattr(tuning, "CROSS_ROWS", cross_rows)
    ref, tri = tiny_model(seed=9), tiny_model(seed=9)
    x = tokens(3, 12, seed=9)
    states = [m.new_state(3) for m in (ref, tri)]
    for m, (shift, wkv) in zip((ref, tri), states):
        m.forward_chunk(x[:, :5], [5, 5, 5], shift, wkv, impl="ref")
    for t in range(5, 12):
        want = ref.forward_step(x[:, t], *states[0], impl="ref")
        got = tri.forward_step(x[:, t], *states[1], impl="triton")
        assert rel(got, want) < 1e-5
    assert rel(states[1][0], states[0][0]) < 1e-5 and rel(states[1][1], states[0][1]) < 1e-5


@pytest.mark.interpreter
def test_step_packs_weights_as_views_and_repacks_after_a_move(tmp_path):
    model = tiny_model(seed=10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shift, wkv = model.new_state(1)
    with torch.inference_mode():
        model.forward_step(tokens(1, 1)[:, 0], shift, wkv, impl="triton")
    attn = model.model.layers[1].attn
    pack = attn.packed()
    C = TINY["hidden_size"]
    assert attn.k_proj.weight.data_ptr() == pack.down[C].data_ptr()
    assert attn.x_v.data_ptr() == pack.mix[2].data_ptr()
    assert attn.w_lora.lora[2].weight.data_ptr() == pack.up[:, TINY["v_low_rank_dim"]].data_ptr()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    model.to(torch.float64)
    assert attn.packed() is not pack and attn.packed().down.dtype == torch.float64
    rwkv7.save(model, tmp_path)
    back = decoders.load(tmp_path, impl="ref", device="cpu", dtype=torch.float64)
    assert all(torch.equal(back.model.state_dict()[k], v) for k, v in model.state_dict().items())


def test_checkpoint_roundtrip_in_lab_format(tmp_path):
    dec = decoders.load("rwkv7-tiny", impl="ref", device="cpu", seed=4)
    dec.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["declab_family"] == "rwkv7"
    back = decoders.load(tmp_path, impl="ref", device="cpu")
    x = tokens(1, 9)
    assert torch.equal(back.logits(x), dec.logits(x))


def fla_folder(tmp_path, tensors, **config_changes):
    """A folder in fla's format (config.json as fla writes it) holding `tensors`."""
    from safetensors.torch import save_file

    hf = {
        "architectures": ["RWKV7ForCausalLM"], "model_type": "rwkv7", "attn": None, "hidden_act": "sqrelu",
        "hidden_ratio": 4, "num_heads": TINY["hidden_size"] // TINY["head_dim"],
        "value_dim": [TINY["hidden_size"]] * TINY["num_hidden_layers"], **TINY, **config_changes,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_fla_format_detected_and_loaded(tmp_path):
    model = tiny_model(seed=5)
    folder = fla_folder(tmp_path, model.state_dict())
    dec = decoders.load(folder, impl="ref", device="cpu")
    assert dec.family == "rwkv7"
    x = tokens(1, 8)
    assert torch.equal(dec.logits(x), model(x, impl="ref"))


def test_early_fla_stacked_mixes_are_split(tmp_path):
    model = tiny_model(seed=8)
    sd = model.state_dict()
    mixes = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
    for i in range(TINY["num_hidden_layers"]):
        prefix = f"model.layers.{i}.attn."
        sd[prefix + "x_x"] = torch.cat([sd.pop(prefix + m).reshape(1, -1) for m in mixes])
    dec = decoders.load(fla_folder(tmp_path, sd), impl="ref", device="cpu")
    x = tokens(1, 8)
    assert torch.equal(dec.logits(x), model(x, impl="ref"))


def test_missing_tensor_is_one_line_error(tmp_path):
    sd = tiny_model().state_dict()
    del sd["model.layers.1.attn.v_lora.lora.0.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.attn\.v_lora\.lora\.0\.weight") as e:
        decoders.load(fla_folder(tmp_path, sd), impl="ref", device="cpu")
    assert "\n" not in str(e.value)


def test_misshaped_tensor_is_one_line_error(tmp_path):
    sd = tiny_model().state_dict()
    sd["model.layers.0.attn.r_k"] = torch.zeros(2, 32)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.attn\.r_k has shape \[2, 32\], expected \[4, 16\]") as e:
        decoders.load(fla_folder(tmp_path, sd), impl="ref", device="cpu")
    assert "\n" not in str(e.value)


def test_unsupported_fla_configs_are_refused(tmp_path):
    sd = tiny_model().state_dict()
    with pytest.raises(CheckpointError, match="value_dim"):
        decoders.load(fla_folder(tmp_path, sd, value_dim=[128, 128]), impl="ref", device="cpu")
    with pytest.raises(CheckpointError, match="hybrid attention"):
        decoders.load(fla_folder(tmp_path, sd, attn={"layers": [1]}), impl="ref", device="cpu")


def test_first_layer_has_pre_norm_and_no_v_lora():
    names = set(tiny_model().state_dict())
    assert "model.layers.0.pre_norm.weight" in names and "model.layers.1.pre_norm.weight" not in names
    assert "model.layers.1.attn.v_lora.lora.2.bias" in names and not any(n.startswith("model.layers.0.attn.v_lora") for n in names)
    assert "model.layers.0.attn.g_lora.lora.2.bias" not in names


def fla_parity(tmp_path, monkeypatch, device, prompt_len, new_tokens, impl, tol, margin):
    """Our decoder loaded from an fla `save_pretrained` folder vs fla's RWKV7ForCausalLM: float32
    logits over prompt + generated tokens, and our greedy tokens are fla's argmax."""
    pytest.importorskip("fla")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime import autotuner

        run = autotuner.Autotuner.run

        # The interpreter cannot benchmark several autotune configs: keep fla's first one.
        def first_config(self, *args, **kwargs):
            self.configs = self.configs[:1]
            return run(self, *args, **kwargs)

        monkeypatch.setattr(autotuner.Autotuner, "run", first_config)
        # fla wraps small ops in torch.compile; compiling them on the CPU costs more than the test.
        monkeypatch.setattr(torch._dynamo.config, "disable", True)
    from fla.models import RWKV7Config, RWKV7ForCausalLM

    ours = tiny_model(seed=6)
    fla = RWKV7ForCausalLM(RWKV7Config(**TINY))
    # Our random init (fla's own zeroes o_proj and the FFN output); strict: the names must match.
    fla.load_state_dict(ours.state_dict(), strict=True)
    fla.save_pretrained(str(tmp_path))
    dec = decoders.load(tmp_path, impl=impl, device=device, dtype=torch.float32)
    prompt = tokens(1, prompt_len, seed=7).tolist()
    gen = dec.generate(prompt, max_new_tokens=new_tokens)
    seq = torch.tensor([prompt[0] + gen.tokens[0]], device=device)
    with torch.inference_mode():
        expected = fla.to(device).eval()(seq).logits
        got = dec.logits(seq)
    assert rel(got, expected) < tol
    # Greedy agreement: each of our tokens is fla's argmax, or within `margin` of it (near-ties on a GPU).
    steps = expected[0, prompt_len - 1 : -1].float()
    chosen = steps.gather(1, torch.tensor(gen.tokens, device=device).T).squeeze(1)
    assert bool((steps.max(-1).values - chosen <= margin).all())


def test_fla_parity_cpu(tmp_path, monkeypatch):
    """fla's Triton kernels under the interpreter; under 64 tokens fla uses its recurrent kernel."""
    if torch.cuda.is_available():
        pytest.skip("the GPU variant runs instead")
    fla_parity(tmp_path, monkeypatch, "cpu", prompt_len=5, new_tokens=6, impl="ref", tol=1e-5, margin=0.0)


@pytest.mark.gpu
def test_fla_parity_gpu_chunked(tmp_path, monkeypatch):
    """Over 64 tokens fla runs its chunked kernel; ours the Triton WKV-7 kernels."""
    fla_parity(tmp_path, monkeypatch, "cuda", prompt_len=150, new_tokens=20, impl="triton", tol=5e-3, margin=1e-2)
