"""Decoding on quantised weights (`decoders.load(..., quant=)`): every family's forward runs on the
weight objects (logits equal the dense model with the dequantised weights substituted), the dense
copies are gone, the memory model counts the packed bytes, decoding equals the parallel forward, the
Triton path (interpreter, float32) passes the gate against the quantised reference path, and bad
quant names are refused before any work. Tiny presets, float32 on the CPU."""

import json

import pytest
import torch

import decoders
from declab_arch import quant
from declab_arch.quant_linear import QuantLinear
from decoders import compare, harness

PRESETS = ["llama-tiny", "mamba2-tiny", "rwkv7-tiny", "maskpredict-tiny"]
# The tiny presets' MLPs have 176 inputs: group 16 divides every layer.
QUANTS = ["int8", "int4-rtn-g16"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def load(preset, **kwargs):
    return decoders.load(preset, device="cpu", dtype="float32", **{"impl": "ref", **kwargs})


def substituted(preset, name):
    """The dense decoder of `preset` with every quantised layer's weight replaced by its dequantised
    values (what a quantised decoder must compute), and the mapping the values came from."""
    dense = load(preset)
    mapping = quant.quantize_model(dense.model, name)
    params = dict(dense.model.named_parameters())
    with torch.no_grad():
        for n, w in mapping.items():
            if n in params:
                params[n].copy_(w.dequantize())
    return dense, mapping


@pytest.mark.parametrize("name", QUANTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_ref_quantised_logits_equal_the_dense_model_on_dequantised_weights(preset, name):
    want, mapping = substituted(preset, name)
    dec = load(preset, quant=name)
    tokens = torch.randint(0, dec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    got = dec.logits(tokens)
    assert rel(got, want.logits(tokens)) < 1e-5
    # Quantisation changed the outputs (the comparison above is not of a dense model with itself).
    assert rel(got, load(preset).logits(tokens)) > 1e-4
    spec = quant.parse_quant(name)
    assert dec.quant == spec and dec.describe()["quant"]["name"] == spec.name
    assert dec.describe()["quant"]["format"] == ("int8" if spec.bits == 8 else "int4-g16")


@pytest.mark.parametrize("preset", PRESETS)
def test_ref_dense_weights_are_freed_and_memory_counts_the_packed_bytes(preset):
    dense = load(preset)
    dec = load(preset, quant="int4-rtn-g16")
    mapping = quant.quantize_model(dense.model, "int4-rtn-g16")
    kept = {n: w for n, w in mapping.items() if not n.endswith(type(dec).quant_dense)}
    names = {n for n, _ in dec.model.named_parameters()}
    assert not names & set(kept), "a quantised layer still holds a dense parameter"
    quantised = [m for m in dec.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantised) == len([n for n in kept if n in dict(dense.model.named_parameters())])
    assert all(isinstance(m.weight, quant.Int4Weight) for m in quantised)
    assert dec.weight_bytes() == quant.weight_bytes(dense.model, kept) < dense.weight_bytes()
    ours, theirs = dec.memory(1, 64), dense.memory(1, 64)
    assert ours.weight_bytes == dec.weight_bytes()
    assert theirs.step_read_bytes - ours.step_read_bytes == dense.weight_bytes() - dec.weight_bytes()


def test_ref_fused_projections_are_one_object_the_parts_view():
    dec = load("llama-tiny", quant="int8")
    attn, mlp = dec.model.model.layers[0].self_attn, dec.model.model.layers[0].mlp
    assert isinstance(attn.qkv_weight, quant.Int8Weight) and isinstance(mlp.gate_up_weight, quant.Int8Weight)
    assert attn.q_proj.weight.qweight.data_ptr() == attn.qkv_weight.qweight.data_ptr()
    assert mlp.up_proj.weight.qweight.data_ptr() == mlp.gate_up_weight.qweight[mlp.gate_proj.out_features:].data_ptr()
    assert attn.qkv_weight.shape[0] == sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))


@pytest.mark.parametrize("preset", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"])
def test_ref_greedy_generation_equals_the_parallel_forward(preset):
    dec = load(preset, quant="int4-rtn-g16")
    prompt = torch.randint(0, dec.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2)).tolist()[0]
    out = dec.generate([prompt], max_new_tokens=6).tokens[0]
    for i, token in enumerate(out):
        logits = dec.logits(torch.tensor([prompt + out[:i]]))[0, -1]
        assert int(logits.argmax()) == token


@pytest.mark.interpreter
@pytest.mark.parametrize("name", QUANTS)
@pytest.mark.parametrize("preset", ["llama-tiny", "mamba2-tiny", "rwkv7-tiny"])
def test_triton_quantised_decoding_passes_the_gate_against_the_quantised_reference(preset, name):
    dec = load(preset, quant=name, impl="triton")
    gate = harness.check_against_reference(dec, new_tokens=3, tokens=8, long_tokens=8)
    assert gate["ok"] and gate["rel_rms"] < 1e-4
    if preset == "rwkv7-tiny":
        # The decode step's packed down-projection is one weight object of the quantised rows.
        assert isinstance(dec.model.model.layers[0].attn.packed().down, (quant.Int8Weight, quant.Int4Weight))
    # The gate's reference copy runs its quantised layers on the reference kernels; the decoder keeps Triton.
    ref = harness.with_impl(dec, "ref", torch.float32)
    assert {m.impl for m in ref.model.modules() if isinstance(m, QuantLinear)} == {"ref"}
    assert {m.impl for m in dec.model.modules() if isinstance(m, QuantLinear)} == {"triton"}


@pytest.mark.parametrize("name, message", [
    ("int5", "unknown quant"),
    ("int4", "python -m eval.quantize"),
    ("int4-rtn-g32", "does not divide"),
])
def test_load_refuses_bad_quant(name, message):
    with pytest.raises(decoders.USER_ERRORS, match=message):
        load("llama-tiny", quant=name)


def test_quant_and_tensor_parallel_are_refused_together():
    with pytest.raises(decoders.UsageError, match="tensor parallel"):
        decoders.load("llama-tiny", device="cpu", quant="int8", tp=object())


@pytest.mark.parametrize("argv, message", [
    (["--quant", "bogus"], "unknown quant 'bogus'"),
    (["--quant", "none,int4"], "python -m eval.quantize"),
    (["--quant", "int4-rtn-g7"], "does not divide"),
    (["--quant", ","], "names no quantisation"),
])
def test_compare_refuses_bad_quant_in_one_line(tmp_path, capsys, argv, message):
    code = compare.main(["--models", "llama-tiny", "--ctx", "64", "--device", "cpu", "--out", str(tmp_path / "o.jsonl"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "o.jsonl").exists()


def test_compare_sweeps_quant_and_records_it(tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    code = compare.main(["--models", "llama-tiny", "--ctx", "64", "--new-tokens", "4", "--device", "cpu", "--impl", "ref",
                         "--quant", "none,int8,int4-rtn-g16", "--out", str(out), "--no-progress"])
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [compare.quant_name(r) for r in records] == [None, "int8", "int4-rtn-g16"]
    assert all(r["status"] == "ok" for r in records)
    assert records[0]["quant"] is None and records[1]["quant"]["bits"] == 8 and records[2]["quant"]["group_size"] == 16
    assert records[0]["weight_bytes"] > records[1]["weight_bytes"] > records[2]["weight_bytes"]
    # Each quantisation is its own decay baseline.
    assert [r["decay"] for r in records] == [1.0, 1.0, 1.0]
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p.get("quant") for p in final["points"]] == [None, "int8", "int4-rtn-g16"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int8", "int4-rtn"])
def test_gpu_bf16_graphs_on_quantised_weights_pass_the_gate_and_free_memory(name):
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    dense = decoders.load("llama-1b", device="cuda")
    dense_bytes = torch.cuda.memory_allocated() - base
    del dense
    torch.cuda.empty_cache()
    dec = decoders.load("llama-1b", device="cuda", quant=name)
    quant_bytes = torch.cuda.memory_allocated() - base
    assert dec.cuda_graphs and dec.impl == "triton"
    linear = sum(m.weight.shape[0] * m.weight.shape[1] * 2 for m in dec.model.modules() if isinstance(m, QuantLinear))
    # The dense linears are gone: at most their packed size (half or a quarter, plus scales) remains.
    assert dense_bytes - quant_bytes > (0.45 if name == "int8" else 0.7) * linear
    assert abs(quant_bytes - dec.weight_bytes()) < 0.05 * dec.weight_bytes()
    gate = harness.check_against_reference(dec, new_tokens=8)
    assert gate["ok"], gate
    prompt = torch.randint(0, dec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    graphed = dec.generate(prompt, max_new_tokens=12).tokens
    eager = harness.with_impl(dec, "triton")
    eager.cuda_graphs = False
    assert eager.generate(prompt, max_new_tokens=12).tokens == graphed


@pytest.mark.parametrize("module, argv", [
    ("decoders.engine", ["--model", "llama-tiny", "--batch", "1", "--ctx", "64", "--new-tokens", "4"]),
    ("decoders.serve", ["--model", "llama-tiny", "--port", "0"]),
    ("decoders.serve_bench", ["--models", "llama-tiny"]),
])
@pytest.mark.parametrize("name, message", [("int5", "unknown quant"), ("int4-rtn-g32", "does not divide"), ("int4", "eval.quantize")])
def test_serving_commands_refuse_bad_quant_in_one_line(tmp_path, capsys, module, argv, name, message):
    import importlib

    main = importlib.import_module(module).main
    out = [] if module == "decoders.serve" else ["--out", str(tmp_path / "o.jsonl")]
    try:
        code = main([*argv, *out, "--device", "cpu", "--quant", name])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)


def pack_consecutive(codes):
    """[R, C] codes -> [R, C // 8] int32, nibble j of word i holding column 8 i + j (as AutoGPTQ packs)."""
    c = codes.to(torch.int64).view(codes.shape[0], -1, 8) << torch.arange(0, 32, 4)
    words = c.sum(-1)
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def test_ref_a_gptq_hub_folder_decodes_as_quantised(tmp_path):
    from safetensors.torch import load_file, save_file

    from declab_kernels import quant_gemv

    dense = load("llama-tiny")
    mapping = quant.quantize_model(dense.model, "int4-rtn-g16")
    dense.save(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    # The lab's int4 layout rewritten as AutoGPTQ's: qweight [K/8, N] packed along the inputs,
    # qzeros [K/g, N/8] along the outputs holding zero - 1, scales [K/g, N].
    for name, w in mapping.items():
        if name in tensors:
            prefix = name.removesuffix(".weight")
            del tensors[name]
            tensors[f"{prefix}.qweight"] = pack_consecutive(quant_gemv.unpack_int4(w.qweight)).T.contiguous()
            tensors[f"{prefix}.qzeros"] = pack_consecutive(((w.zeros.int() - 1) & 15).T.contiguous())
            tensors[f"{prefix}.scales"] = w.scales.T.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hub = load(tmp_path)
    assert hub.quant == quant.QuantSpec(4, "gptq", 16) and hub.describe()["quant"]["name"] == "int4-g16"
    tokens = torch.randint(0, hub.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    assert rel(hub.logits(tokens), load("llama-tiny", quant="int4-rtn-g16").logits(tokens)) < 1e-6
    with pytest.raises(quant.QuantError, match="contradicts"):
        load(tmp_path, quant="int4-rtn-g16")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["mamba2-130m", "rwkv7-0.1b", "maskpredict-120m"])
def test_gpu_bf16_recurrent_and_maskpredict_families_on_int4_pass_the_gate(preset):
    dec = decoders.load(preset, device="cuda", quant="int4-rtn")
    gate = harness.check_against_reference(dec, new_tokens=8)
    assert gate["ok"], gate
    prompt = torch.randint(0, dec.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    out = dec.generate(prompt, max_new_tokens=12)
    assert len(out.tokens) == 2 and all(len(t) >= 1 for t in out.tokens)
    if dec.cuda_graphs and dec.state_kind == "recurrent":
        eager = harness.with_impl(dec, "triton")
        eager.cuda_graphs = False
        assert eager.generate(prompt, max_new_tokens=12).tokens == out.tokens
