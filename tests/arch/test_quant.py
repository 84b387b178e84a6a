"""Weight-only quantisation of the models: names, quantisation error (int8 close, int4 bounded, GPTQ
better than round-to-nearest where activations have outlier channels), every family's layers
mapped to weight objects whose matmul path matches the reference forward on their dequantised
weights, and checkpoints: the lab's format round trip, hand-built HF AWQ and GPTQ folders, and the
configs that do not match their tensors."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import decoders
from declab_arch import llama, mamba2, quant as Q


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def model_of(preset):
    return decoders.load(preset, device="cpu", impl="ref").model


def calib(n=8, T=24, seed=0):
    return torch.randint(0, 500, (n, T), generator=torch.Generator().manual_seed(seed))


def test_names():
    assert Q.parse_quant("int8") == Q.QuantSpec(8, "rtn")
    assert Q.parse_quant("int4") == Q.QuantSpec(4, "gptq", 128)
    assert Q.parse_quant("int4-rtn") == Q.QuantSpec(4, "rtn", 128)
    assert Q.parse_quant("int4-g64").name == "int4-g64"
    assert Q.parse_quant("int4-rtn", 32).name == "int4-rtn-g32"
    for bad, match in [("int3", "unknown quant"), ("int4-g0", "at least 1"), ("fp8", "unknown quant")]:
        with pytest.raises(Q.QuantError, match=match):
            Q.check_quant(bad)
    with pytest.raises(Q.QuantError, match="no group size"):
        Q.check_quant("int8", 64)
    with pytest.raises(Q.QuantError, match="names group 64"):
        Q.check_quant("int4-g64", 32)


def test_int8_rtn_is_close():
    w = torch.randn(64, 256)
    q = Q.quantize_int8(w)
    assert q.format == "int8" and q.shape == (64, 256) and q.qweight.dtype == torch.int8
    # Uniform rounding of a Gaussian row with step max|w| / 127 (~3.3 sigma / 127): about 0.8% RMS.
    assert rel(q.dequantize(), w) < 0.012


def test_int4_rtn_error_bound_and_exact_rows():
    w = torch.randn(48, 512)
    q = Q.quantize_int4_rtn(w, 128)
    assert q.format == "int4-g128" and q.scales.shape == (48, 4) and q.scales.dtype == torch.float16
    # Step = range / 15 of 128 Gaussians (~5.2 sigma / 15 = 0.35 sigma): RMS error ~0.1 sigma.
    err = rel(q.dequantize(), w)
    assert 0.05 < err < 0.13
    # Constant rows, and a row on the grid of its own range (step 1.875 / 15 = 0.125, zero point 8).
    grid = [-1.0, 0.875, -0.5, 0.0, -0.875, 0.75, -0.75, 0.5]
    exact = torch.tensor([[0.5] * 8, [-0.25] * 8, [0.0] * 8, grid])
    assert torch.equal(Q.quantize_int4_rtn(exact, 8).dequantize(), exact)


def outlier_problem(seed=0):
    """A layer whose inputs have a few large channels (as LLM activations do), x [n, K], w [N, K]."""
    g = torch.Generator().manual_seed(seed)
    K = 256
    # Inputs correlated through 16 shared factors (as a model's hidden states are), which the error
    # feedback across columns can use, and four channels 30 times larger than the rest.
    x = torch.randn(2048, 16, generator=g) @ torch.randn(16, K, generator=g) + 0.3 * torch.randn(2048, K, generator=g)
    x[:, torch.randperm(K, generator=g)[:4]] *= 30.0
    w = torch.randn(96, K, generator=g) * 0.02
    return x, w


def test_gptq_beats_rtn_on_planted_outliers():
    x, w = outlier_problem()
    H = x.T @ x / x.shape[0]
    ref = x @ w.T

    def out_err(q):
        return rel(x @ q.dequantize().T, ref)

    rtn, gptq = out_err(Q.quantize_int4_rtn(w, 64)), out_err(Q.quantize_int4_gptq(w, H, 64))
    # Measured 0.10 of round-to-nearest's output error here.
    assert gptq < 0.3 * rtn, (gptq, rtn)


def test_gptq_without_information_is_rtn():
    # With a diagonal H the inputs are uncorrelated: no column's error can be made up by another,
    # and GPTQ reduces to round-to-nearest (the same scales and codes).
    w = torch.randn(16, 64)
    g, r = Q.quantize_int4_gptq(w, torch.eye(64), 32), Q.quantize_int4_rtn(w, 32)
    assert torch.equal(g.qweight, r.qweight) and torch.equal(g.zeros, r.zeros)


PRESETS = [("llama-tiny", 16), ("mamba2-tiny", 64), ("rwkv7-tiny", 16), ("maskpredict-tiny", 16)]


@pytest.mark.parametrize("preset, group", PRESETS)
@pytest.mark.parametrize("method", ["int8", "int4-rtn", "int4"])
def test_every_family_matmul_path_matches_dequantised_reference(preset, group, method):
    model = model_of(preset)
    mapping = Q.quantize_model(model, method if method == "int8" else f"{method}-g{group}", calib_tokens=calib())
    layers = Q.linear_layers(model)
    assert set(layers) <= set(mapping) and "lm_head.weight" not in mapping
    assert all(mapping[n].shape == tuple(m.weight.shape) for n, m in layers.items())
    tokens = calib(2, 12, seed=1)
    forward = Q.reference_forward(model)
    with torch.no_grad():
        with Q.routed(model, mapping, impl="ref"):
            routed = forward(tokens)
        substituted = copy.deepcopy(model)
        params = dict(substituted.named_parameters())
        dense = Q.dequantized(mapping)
        for name in layers:
            params[name].copy_(dense[name])
        expected = Q.reference_forward(substituted)(tokens)
        plain = forward(tokens)
    assert rel(routed, expected) < 1e-5
    # The float model is untouched, and quantisation changed its logits by a bounded amount.
    assert 0 < rel(routed, plain) < (0.05 if method == "int8" else 0.5)


@pytest.mark.interpreter
def test_triton_matmul_path_llama():
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-rtn-g16")
    tokens = calib(1, 20, seed=2)
    with torch.no_grad(), Q.routed(model, mapping, impl="ref"):
        expected = model(tokens)
    # 20 rows: the dense path; 2 rows: the GEMV.
    with torch.no_grad(), Q.routed(model, mapping, impl="triton"):
        assert rel(model(tokens), expected) < 1e-5
        assert rel(model(tokens[:, :2]), expected[:, :2]) < 1e-5


def test_fused_projections_are_their_parts():
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-rtn-g16")
    attn = "model.layers.1.self_attn"
    qkv = mapping[f"{attn}.qkv_weight"]
    assert qkv.shape == tuple(model.model.layers[1].self_attn.qkv_weight.shape)
    parts = [mapping[f"{attn}.{p}_proj.weight"].dequantize() for p in "qkv"]
    assert torch.equal(qkv.dequantize(), torch.cat(parts))
    assert "model.layers.0.mlp.gate_up_weight" in mapping


def test_head_quantised_only_when_asked():
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-g16", calib_tokens=calib(), head=True)
    head = mapping["lm_head.weight"]
    assert head.shape == tuple(model.model.embed_tokens.weight.shape)
    assert rel(head.dequantize(), model.model.embed_tokens.weight) < 0.15


def test_refusals():
    model = model_of("llama-tiny")
    # down_proj has 176 inputs: not a multiple of 128.
    with pytest.raises(Q.QuantError, match="down_proj.weight: group size 128 does not divide the layer's 176 inputs"):
        Q.quantize_model(model, "int4-rtn")
    with pytest.raises(Q.QuantError, match="needs calibration tokens"):
        Q.quantize_model(model, "int4-g16")
    with pytest.raises(Q.QuantError, match="unknown quant"):
        Q.quantize_model(model, "int2")


def test_lab_checkpoint_round_trip(tmp_path):
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-g16", calib_tokens=calib())
    spec = Q.parse_quant("int4-g16")
    Q.save(tmp_path, model, mapping, spec, llama.save)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization"] == {"quant": "int4-g16", "bits": 4, "method": "gptq", "group_size": 16, "head": False,
                                      "int4_layout": 2}
    read_spec, read, tensors = Q.read_checkpoint(tmp_path)
    assert read_spec == spec
    assert set(read) == {n for n in mapping if n.endswith(".weight")}
    for name, w in read.items():
        assert all(torch.equal(a, b) for a, b in zip(w.tensors().values(), mapping[name].tensors().values()))
    assert Q.is_quantized(config) and llama.read_config(tmp_path).hidden_size == 64
    rebuilt = llama.build(llama.read_config(tmp_path), tensors, str(tmp_path))
    with torch.no_grad(), Q.routed(model, mapping, impl="ref"):
        assert rel(rebuilt(calib(1, 8)), model(calib(1, 8))) < 1e-5


def test_lab_checkpoint_of_layout_1_is_repacked_and_an_unknown_layout_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-rtn-g16")
    Q.save(tmp_path, model, mapping, Q.parse_quant("int4-rtn-g16"), llama.save)
    path, config_path = tmp_path / "model.safetensors", tmp_path / "config.json"
    tensors = load_file(path)
    # Layout 1, as folders were saved before int4_layout: nibble j of word i holds input 8 i + j.
    for name in [n for n in tensors if n.endswith(".qweight")]:
        tensors[name] = pack_cols(Q.quant_gemv.unpack_int4(tensors[name]))
    save_file(tensors, str(path))
    config = json.loads(config_path.read_text())
    del config["quantization"]["int4_layout"]
    config_path.write_text(json.dumps(config))
    _, read, _ = Q.read_checkpoint(tmp_path)
    assert all(torch.equal(read[n].qweight, mapping[n].qweight) for n in read)
    config["quantization"]["int4_layout"] = 3
    config_path.write_text(json.dumps(config))
    with pytest.raises(Q.QuantError, match="int4_layout 3 is unknown"):
        Q.read_checkpoint(tmp_path)


def test_lab_checkpoint_round_trip_native_family(tmp_path):
    model = model_of("mamba2-tiny")
    mapping = Q.quantize_model(model, "int8")
    Q.save(tmp_path, model, mapping, Q.parse_quant("int8"), mamba2.save)
    assert mamba2.read_config(tmp_path).d_model == 64
    _, read, tensors = Q.read_checkpoint(tmp_path)
    assert all(torch.equal(read[n].qweight, mapping[n].qweight) for n in read)
    mamba2.build(mamba2.read_config(tmp_path), tensors, str(tmp_path))


def write_folder(folder, quantization_config, tensors):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": quantization_config}))
    save_file(tensors, str(folder / "model.safetensors"))


def pack_cols(codes, order=range(8)):
    """[R, C] codes -> [R, C // 8] int32, nibble j holding column order[j] of each eight (as the tools pack)."""
    R, C = codes.shape
    c = codes.view(R, C // 8, 8).to(torch.int64)
    word = sum(c[:, :, order[j]] << (4 * j) for j in range(8))
    return (word - ((word >> 31) & 1) * (1 << 32)).to(torch.int32)


def expected_weight(codes, zeros, scales, group):
    """W [N, K] from codes [K, N], zeros and scales [K // g, N] (the tools' transposed orientation)."""
    z = zeros.repeat_interleave(group, 0).float()
    return ((codes.float() - z) * scales.float().repeat_interleave(group, 0)).T


def hf_case(K=64, N=24, group=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (K, N), generator=g)
    zeros = torch.randint(0, 16, (K // group, N), generator=g)
    zeros[0, :3] = 0  # the value GPTQ v1's zero - 1 wraps
    scales = (torch.rand(K // group, N, generator=g) * 0.01 + 0.001).half()
    return codes, zeros, scales


def test_hf_awq_checkpoint(tmp_path):
    codes, zeros, scales = hf_case()
    prefix = "model.layers.0.mlp.up_proj"
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
    write_folder(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"},
                 {f"{prefix}.qweight": pack_cols(codes, awq_order), f"{prefix}.qzeros": pack_cols(zeros, awq_order),
                  f"{prefix}.scales": scales, "model.norm.weight": torch.ones(4)})
    spec, mapping, tensors = Q.read_checkpoint(tmp_path)
    w = mapping[f"{prefix}.weight"]
    assert spec.method == "awq" and w.format == "int4-g16" and w.shape == (24, 64)
    assert torch.equal(w.dequantize(), expected_weight(codes, zeros, scales, 16))
    assert set(tensors) == {"model.norm.weight", f"{prefix}.weight"}
    # Read as if sequential, the interleaved columns come out permuted: the order matters.
    write_folder(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"},
                 {f"{prefix}.qweight": pack_cols(codes), f"{prefix}.qzeros": pack_cols(zeros), f"{prefix}.scales": scales})
    assert not torch.equal(Q.read_checkpoint(tmp_path)[1][f"{prefix}.weight"].dequantize(), w.dequantize())


def gptq_tensors(prefix, codes, zeros, scales, offset, g_idx=None):
    K = codes.shape[0]
    qweight = pack_cols(codes.T.contiguous()).T.contiguous()  # [K // 8, N]: input 8i + j in nibble j of row i
    out = {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": pack_cols((zeros - offset) & 0xF), f"{prefix}.scales": scales}
    out[f"{prefix}.g_idx"] = torch.arange(K, dtype=torch.int32) // 16 if g_idx is None else g_idx
    return out


@pytest.mark.parametrize("fmt, offset", [(None, 1), ("gptq", 1), ("gptq_v2", 0)])
def test_hf_gptq_checkpoint(tmp_path, fmt, offset):
    codes, zeros, scales = hf_case(seed=3)
    prefix = "model.layers.0.self_attn.o_proj"
    config = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False}
    if fmt:
        config["checkpoint_format"] = fmt
    write_folder(tmp_path, config, gptq_tensors(prefix, codes, zeros, scales, offset))
    spec, mapping, _ = Q.read_checkpoint(tmp_path)
    assert spec.method == "gptq"
    assert torch.equal(mapping[f"{prefix}.weight"].dequantize(), expected_weight(codes, zeros, scales, 16))


def test_bad_checkpoints(tmp_path):
    codes, zeros, scales = hf_case()
    prefix = "model.layers.0.mlp.up_proj"
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True}
    permuted = torch.randperm(64, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 16
    cases = [
        (gptq, gptq_tensors(prefix, codes, zeros, scales, 1, g_idx=permuted), "act-order"),
        ({**gptq, "group_size": 32}, gptq_tensors(prefix, codes, zeros, scales, 1), "does not match the quantisation config"),
        ({**gptq, "bits": 8}, gptq_tensors(prefix, codes, zeros, scales, 1), "bits=8 is not supported"),
        ({**gptq, "quant_method": "bitsandbytes"}, {}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemv"}, {}, "version 'gemv'"),
        (gptq, {f"{prefix}.scales": scales, "x.weight": torch.ones(2)}, "holds no quantised tensor"),
    ]
    for config, tensors, match in cases:
        write_folder(tmp_path, config, tensors or {"x.weight": torch.ones(2)})
        with pytest.raises(Q.QuantError, match=match):
            Q.read_checkpoint(tmp_path)


def test_lab_checkpoint_mismatch_is_one_line_exit_2(tmp_path, capsys):
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int4-rtn-g16")
    Q.save(tmp_path, model, mapping, Q.parse_quant("int4-rtn-g16"), llama.save)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization"].update(quant="int4-rtn-g8", group_size=8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info, decoders.user_errors():
        Q.read_checkpoint(tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match the quantisation config (group 8" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["int8", "int4-g16", "int4-rtn-g16"])
def test_gpu_bf16_matmul_path(method):
    decoder = decoders.load("llama-tiny", device="cuda", dtype="bf16", impl="ref")
    model = decoder.model
    mapping = Q.quantize_model(model, method, calib_tokens=calib().cuda())
    assert all(w.dtype == torch.bfloat16 and w.device.type == "cuda" for w in mapping.values())
    for T in (1, 20):
        tokens = calib(2, T, seed=4).cuda()
        with torch.no_grad():
            with Q.routed(model, mapping, impl="ref"):
                expected = model(tokens)
            with Q.routed(model, mapping, impl="triton"):
                assert rel(model(tokens), expected) < 2e-2


def test_lab_checkpoint_other_mismatches(tmp_path):
    from safetensors.torch import load_file

    model = model_of("llama-tiny")
    Q.save(tmp_path, model, Q.quantize_model(model, "int4-rtn-g16"), Q.parse_quant("int4-rtn-g16"), llama.save)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))

    def rewrite(entry, drop=()):
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization": entry}))
        save_file({k: v for k, v in tensors.items() if k not in drop}, str(tmp_path / "model.safetensors"))

    for entry, drop, match in [
        ({**config["quantization"], "quant": "int8", "bits": 8, "group_size": None}, (), "is not an int8"),
        (config["quantization"], ("model.layers.1.mlp.up_proj.scales",), "is not an int4"),
        ({**config["quantization"], "bits": 8}, (), "contradicts its quant"),
        ({"bits": 4}, (), "names no quant"),
        ({**config["quantization"], "quant": "int5"}, (), "unknown quant"),
    ]:
        rewrite(entry, drop)
        with pytest.raises(Q.QuantError, match=match):
            Q.read_checkpoint(tmp_path)


def test_gptq_of_layers_sharing_an_input_is_per_layer_gptq():
    model = model_of("llama-tiny")
    tokens = calib()
    mapping = Q.quantize_model(model, "int4-g16", calib_tokens=tokens)
    layers = Q.linear_layers(model)
    hessians = Q.collect_hessians(model, layers, tokens)
    attn = "model.layers.0.self_attn"
    assert hessians[f"{attn}.q_proj.weight"] is hessians[f"{attn}.v_proj.weight"]
    assert hessians[f"{attn}.q_proj.weight"] is not hessians[f"{attn}.o_proj.weight"]
    for name in (f"{attn}.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        alone = Q.quantize_int4_gptq(layers[name].weight, hessians[name], 16)
        assert rel(mapping[name].dequantize(), alone.dequantize()) < 1e-6


def test_tied_head_round_trip(tmp_path):
    model = model_of("llama-tiny")
    mapping = Q.quantize_model(model, "int8", head=True)
    Q.save(tmp_path, model, mapping, Q.parse_quant("int8"), llama.save)
    assert json.loads((tmp_path / "config.json").read_text())["quantization"]["head"] is True
    _, read, tensors = Q.read_checkpoint(tmp_path)
    assert torch.equal(read["lm_head.weight"].qweight, mapping["lm_head.weight"].qweight)
    # The tied head is the embedding table, which stays dense and is the only copy.
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors
    llama.build(llama.read_config(tmp_path), tensors, str(tmp_path))


def test_weight_bytes():
    model = model_of("llama-tiny")
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert Q.weight_bytes(model, {}) == dense
    mapping = Q.quantize_model(model, "int8")
    layers = Q.linear_layers(model)
    linear_bytes = sum(m.weight.numel() * 4 for m in layers.values())
    packed = sum(m.weight.numel() + m.weight.shape[0] * 4 for m in layers.values())
    assert Q.weight_bytes(model, mapping) == dense - linear_bytes + packed
    with_head = Q.quantize_model(model, "int8", head=True)
    V, d = model.model.embed_tokens.weight.shape
    assert Q.weight_bytes(model, with_head) == dense - linear_bytes + packed + V * d + V * 4
