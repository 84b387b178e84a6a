"""The peers at their best: the gpt-fast peer (its option, its ModelArgs from every llama preset, an
eager run from a checkout named by DECLAB_GPT_FAST), Hugging Face's compile settings, mamba-ssm refused
without causal-conv1d's kernels, and every row's `peer_config`."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

import decoders
from declab_arch.checkpoint import preset_names
from decoders import peers
from decoders.base import Timer
from decoders.compare import main

SETTINGS_KEYS = {"compiled", "cuda_graphs", "cache", "attention", "kernels"}
CHECKOUT = os.environ.get(peers.GPT_FAST_ENV)
needs_checkout = pytest.mark.skipif(not CHECKOUT, reason=f"{peers.GPT_FAST_ENV} names no gpt-fast checkout")


def sweep(tmp_path, capsys, *args):
    """Run the CLI in this process; (exit code, records of the .jsonl, stderr)."""
    out = tmp_path / "out.jsonl"
    code = main(["--no-progress", "--out", str(out), *args])
    err = capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return code, records, err


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


@pytest.fixture
def no_checkout(monkeypatch):
    monkeypatch.delenv(peers.GPT_FAST_ENV, raising=False)


def test_gpt_fast_is_a_peer_name():
    from decoders.compare import parse_peers

    assert parse_peers("hf,gpt-fast") == ["hf", "gpt-fast"]
    assert [p.name for p in peers.rows("gpt-fast", "transformer")] == ["gpt-fast"]
    assert peers.rows("gpt-fast", "mamba2") == []


@pytest.mark.parametrize("files, message", [((), "has no model.py or generate.py"), (("model.py",), "has no generate.py")])
def test_a_folder_that_is_no_checkout_is_refused_up_front(tmp_path, capsys, no_checkout, files, message):
    folder = tmp_path / "gpt-fast"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("")
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "gpt-fast", "--gpt-fast", str(folder), "--ctx", "256")
    (line,) = error_lines(err)
    assert code == 2 and line.startswith("error: --gpt-fast: ") and message in line, err
    assert records == [] and peers.GPT_FAST_ENV not in os.environ


def test_a_missing_folder_and_a_bad_variable_are_refused(tmp_path, capsys, monkeypatch, no_checkout):
    code, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "gpt-fast", "--gpt-fast", str(tmp_path / "nowhere"), "--ctx", "256")
    assert code == 2 and "is not a folder" in error_lines(err)[0], err
    monkeypatch.setenv(peers.GPT_FAST_ENV, str(tmp_path))
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "gpt-fast", "--ctx", "256")
    (line,) = error_lines(err)
    assert code == 2 and line.startswith(f"error: {peers.GPT_FAST_ENV}: ") and "has no model.py or generate.py" in line, err
    assert records == []


def test_gpt_fast_option_needs_the_peer(tmp_path, capsys, no_checkout):
    code, _, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "hf", "--gpt-fast", str(tmp_path), "--ctx", "256")
    assert code == 2 and error_lines(err) == ["error: --gpt-fast needs --peers gpt-fast"], err


def test_without_a_checkout_the_row_is_unavailable(tmp_path, capsys, no_checkout):
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny,mamba2-tiny", "--peers", "gpt-fast", "--peers-only", "--ctx", "256")
    assert code == 0, err
    rows = {r["model"]: r for r in records}
    assert rows["gpt-fast:llama-tiny"]["status"] == "unavailable"
    assert rows["gpt-fast:llama-tiny"]["reason"] == f"ImportError: no gpt-fast checkout: pass --gpt-fast PATH or set {peers.GPT_FAST_ENV}"
    assert rows["gpt-fast:mamba2-tiny"]["status"] == "not applicable"


@pytest.mark.parametrize("preset", [name for name in preset_names() if name.startswith("llama-")])
def test_model_args_of_every_llama_preset(preset):
    family, config = decoders.model_config(preset)
    assert family == "transformer"
    args = peers.gpt_fast_args(config)
    expected = {
        "block_size": config.max_position_embeddings, "vocab_size": config.vocab_size, "n_layer": config.num_hidden_layers,
        "n_head": config.num_attention_heads, "n_local_heads": config.num_key_value_heads, "dim": config.hidden_size,
        "intermediate_size": config.intermediate_size, "rope_base": config.rope_theta, "norm_eps": config.rms_norm_eps,
    }
    assert {k: v for k, v in args.items() if k != "rope_scaling"} == expected
    # gpt-fast derives the head size; it must be the lab's.
    assert args["dim"] // args["n_head"] == config.head_dim
    scaling = config.rope_scaling
    if scaling is None:
        assert args["rope_scaling"] is None
    else:
        assert scaling["rope_type"] == "llama3"
        assert args["rope_scaling"] == {k: v for k, v in scaling.items() if k != "rope_type"}


def test_the_big_presets_are_scaled_llama3():
    for preset, factor in (("llama-1b", 32.0), ("llama-8b", 8.0)):
        args = peers.gpt_fast_args(decoders.model_config(preset)[1])
        assert args["rope_scaling"]["factor"] == factor and args["block_size"] == 131072


@pytest.mark.parametrize("change, message", [
    (dict(attention_bias=True), "no bias"),
    (dict(head_dim=32), "head_dim = dim // n_head = 16"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "no 'linear' rope scaling"),
])
def test_shapes_gpt_fast_cannot_express_are_refused(change, message):
    config = dataclasses.replace(decoders.model_config("llama-tiny")[1], **change)
    with pytest.raises(ValueError, match=message):
        peers.gpt_fast_args(config)


def test_every_row_that_needs_no_extra_package_names_its_configuration():
    config = decoders.model_config("llama-tiny")[1]
    for name in ("hf-eager", "hf-compile", "hf-mamba2", "fla-rwkv7", "fla-rwkv7-cg"):
        (peer,) = [p for p in peers.PEERS if p.name == name]
        for device in ("cpu", "cuda"):
            settings = peer.settings(config, torch.device(device))
            assert SETTINGS_KEYS <= set(settings), (name, settings)
    compiled = peers.hf_llama_settings(config, torch.device("cuda"), static=True)
    assert compiled["cuda_graphs"] is True and "fullgraph=True" in compiled["compiled"] and "dynamic=False" in compiled["compiled"]
    assert compiled["attention"] == "sdpa" and "StaticCache" in compiled["cache"]
    assert peers.hf_llama_settings(config, torch.device("cpu"), static=True)["compiled"] is None


def test_hf_compile_asks_generate_for_its_best_compiled_decoding():
    model = peers.hf_llama(decoders.model_config("llama-tiny")[1], "cpu", torch.float32, static=True)
    gen = model.generation_config
    assert gen.cache_implementation == "static"
    assert (gen.compile_config.fullgraph, gen.compile_config.dynamic, gen.compile_config.mode) == (True, False, "reduce-overhead")
    assert model.config._attn_implementation == "sdpa"
    eager = peers.hf_llama(decoders.model_config("llama-tiny")[1], "cpu", torch.float32, static=False)
    assert eager.generation_config.cache_implementation is None and eager.config._attn_implementation == "sdpa"


def test_measured_rows_carry_peer_config(tmp_path, capsys):
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "hf", "--peers-only", "--ctx", "128", "--new-tokens", "2")
    assert code == 0, err
    (row,) = [r for r in records if r["peer"] == "hf-eager"]
    assert row["status"] == "ok" and row["peer_config"]["cache"] == "DynamicCache" and row["cuda_graphs"] is False


def kernels(conv=True, decode=True):
    return {"conv1d": "causal-conv1d CUDA" if conv else None, "ssm_prefill": "Triton SSD", "ssm_decode": "Triton" if decode else None}


@pytest.mark.parametrize("found, reason", [
    (kernels(), None),
    (kernels(conv=False), "causal-conv1d's CUDA kernels do not import"),
    (kernels(decode=False), "selective_state_update does not import"),
])
def test_mamba_ssm_runs_only_with_its_kernels(monkeypatch, found, reason):
    monkeypatch.setattr(peers, "import_reason", lambda module: None)
    monkeypatch.setattr(peers, "mamba_ssm_kernels", lambda: found)
    (row,) = peers.plan("mamba_ssm", "mamba2-tiny", "mamba2", torch.device("cuda"))
    if reason is None:
        assert isinstance(row, peers.Peer) and row.name == "mamba_ssm-cg"
    else:
        assert isinstance(row, peers.Absent) and row.status == "unavailable" and reason in row.reason


@needs_checkout
def test_gpt_fast_eager_from_the_checkout(tmp_path, capsys, monkeypatch):
    import torch._inductor.config as inductor

    # compare writes the resolved checkout back into the variable; restored after the test.
    monkeypatch.setenv(peers.GPT_FAST_ENV, CHECKOUT)

    default = inductor.coordinate_descent_tuning
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "gpt-fast", "--peers-only", "--ctx", "128,256",
                               "--new-tokens", "4")
    assert code == 0, err
    assert [r["status"] for r in records] == ["ok", "ok"], [r.get("reason") for r in records]
    row = records[0]
    assert row["library"].startswith("gpt-fast ") and row["cuda_graphs"] is False
    assert row["peer_config"]["compiled"] is None and "static" in row["peer_config"]["cache"]
    # generate.py's Inductor flags hold around the gpt-fast runs only.
    assert peers.GPT_FAST["flags"] and inductor.coordinate_descent_tuning == default
    assert Path(peers.GPT_FAST["model"].__file__).resolve().parent == Path(CHECKOUT).resolve()


@needs_checkout
def test_gpt_fast_decode_is_greedy_on_its_own_model():
    lab = decoders.load("llama-tiny", device="cpu")
    (peer,) = peers.rows("gpt-fast", "transformer")
    model = peers.build(peer, lab, seed=0)
    # Tied as the lab's config says.
    assert model.output.weight is model.tok_embeddings.weight
    prompts = torch.randint(0, lab.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        timer = Timer(torch.device("cpu"))
        runs.append(peer.run(model, prompts, 5, timer))
        assert len(timer.intervals()) == 5
    assert runs[0].shape == (2, 14) and torch.equal(runs[0], runs[1]) and torch.equal(runs[0][:, :9], prompts)
    # Each new token is the argmax of the model's logits over the sequence so far.
    with torch.no_grad():
        model.max_seq_length = -1
        model.setup_caches(max_batch_size=2, max_seq_length=14)
        logits = model(runs[0][:, :13], torch.arange(13))
    assert torch.equal(logits[:, 8:].argmax(-1), runs[0][:, 9:].to(logits.device).long())


class FakeFla(torch.nn.Module):
    """Two layers whose recurrent and token-shift states advance the way fla's do: each forward reads
    them from fla's Cache and hands new tensors back through `Cache.update`."""

    def __init__(self, vocab=13, width=6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, past_key_values, use_cache, logits_to_keep):
        from types import SimpleNamespace

        x = self.embed(input_ids)  # [B, T, W]
        for i in range(2):
            state = past_key_values[i] if len(past_key_values) > i else None
            h = state["recurrent_state"] if state else torch.zeros_like(x[:, 0])
            for t in range(x.shape[1]):
                h = 0.5 * h + torch.tanh(x[:, t])
            shift = x[:, -1] if state is None else 0.5 * (x[:, -1] + state["conv_state"])
            past_key_values.update(recurrent_state=h, conv_state=shift, ffn_state=2 * shift, layer_idx=i, offset=x.shape[1])
            x = x + h[:, None] + shift[:, None]
        return SimpleNamespace(logits=self.head(x[:, -logits_to_keep:]))


def test_fla_graph_step_decodes_as_the_plain_cache_loop():
    from fla.models.utils import Cache

    torch.manual_seed(0)
    model = FakeFla().eval()
    prompts = torch.randint(0, 13, (3, 5))
    with torch.no_grad():
        cache = Cache()
        token = model(prompts, cache, True, 1).logits[:, -1].argmax(-1, keepdim=True)
        want = [token]
        for _ in range(6):
            token = model(token, cache, True, 1).logits[:, -1].argmax(-1, keepdim=True)
            want.append(token)
    want = torch.cat([prompts, *want], dim=1)
    # The second call reuses the first call's step, loaded with its own prefill's states.
    for other in (prompts.flip(0), prompts):
        timer = Timer(torch.device("cpu"))
        peers.fla_graph_generate(model, other, 7, timer)
        assert len(timer.intervals()) == 7
    assert list(model.declab_graph_steps) == [3]
    assert torch.equal(peers.fla_graph_generate(model, prompts, 7, Timer(torch.device("cpu"))), want)


@pytest.mark.gpu
def test_fla_graph_decodes_as_hf_generate_on_the_gpu():
    lab = decoders.load("rwkv7-tiny", device="cuda", dtype=torch.float32)
    model = peers.fla_rwkv7(lab.config, lab.device, torch.float32)
    prompts = torch.randint(0, lab.vocab_size, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    graphed = peers.fla_graph_generate(model, prompts, 8, Timer(lab.device))
    again = peers.fla_graph_generate(model, prompts, 8, Timer(lab.device))
    eager = peers.hf_generate(model, prompts, 8, Timer(lab.device))
    assert model.declab_graph_steps[2].graph is not None
    assert torch.equal(graphed, again) and torch.equal(graphed, eager)


@pytest.mark.gpu
@needs_checkout
def test_gpt_fast_compiled_on_the_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(peers.GPT_FAST_ENV, CHECKOUT)
    code, records, err = sweep(tmp_path, capsys, "--models", "llama-tiny", "--peers", "gpt-fast,hf", "--peers-only", "--ctx", "256,512",
                               "--new-tokens", "8")
    assert code == 0, err
    rows = [r for r in records if r["peer"] == "gpt-fast"]
    assert [r["status"] for r in rows] == ["ok", "ok"], [r.get("reason") for r in rows]
    assert rows[0]["cuda_graphs"] is True and "reduce-overhead" in rows[0]["peer_config"]["compiled"]
    compiled = [r for r in records if r["peer"] == "hf-compile"]
    assert [r["status"] for r in compiled] == ["ok", "ok"], [r.get("reason") for r in compiled]


def test_the_rope_difference_is_recorded():
    scaled, plain = decoders.model_config("llama-1b")[1], decoders.model_config("llama-tiny")[1]
    assert peers.gpt_fast_rope(scaled, {"rope_scaling": None}) == "llama3, as the lab's config"
    assert peers.gpt_fast_rope(scaled, {}).startswith("none: this checkout's ModelArgs has no rope_scaling")
    assert peers.gpt_fast_rope(plain, {}) == "none, as the lab's config"
    assert peers.gpt_fast_rope(dataclasses.replace(plain, attention_bias=True), {}).startswith("not built: gpt-fast's attention has no bias")
