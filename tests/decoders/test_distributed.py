"""Tensor parallel and spread sweeps on the CPU: two processes on the gloo backend.

The tensor-parallel decoder of every family (float32, the reference path) must give the logits and
greedy tokens of the same model on one process; each rank's share of the weights must be its slice of
the full tensors (checked without processes, against slices written out by hand); a sweep spread over
two ranks must give the records one process gives; and a launch that does not fit the options is one
line on stderr and exit code 2.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import decoders
from declab_arch import tensor_parallel
from declab_arch.tensor_parallel import Group
from decoders import harness

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("llama-tiny", "mamba2-tiny", "mamba2-groups", "rwkv7-tiny")
# mamba2-tiny has one B/C group (replicated over the ranks, its gated norm all-reduced); this variant
# has four, split two per rank, and biases (in_proj's split like its rows, out_proj's on rank 0 alone).
GROUPS = {"ngroups": 4, "headdim": 8, "bias": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(name, **kwargs):
    if name == "mamba2-groups":
        from declab_arch import mamba2
        from decoders.mamba2 import Mamba2Decoder

        values = {**json.loads((ROOT / "configs" / "mamba2-tiny.json").read_text()), **GROUPS}
        if "tp" in kwargs:
            from decoders.distributed import tp_class

            cls, extra = tp_class(Mamba2Decoder), {"tp_group": kwargs.pop("tp")}
        else:
            cls, extra = Mamba2Decoder, {}
        config = mamba2.preset_config(values, name)
        model = mamba2.build(config, None, name)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            # (the random init zeroes biases, which would not show one added twice)
            for key, p in model.named_parameters():
                if key.endswith("proj.bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        return cls(model, config, source=name, device=torch.device("cpu"), dtype=torch.float32, impl="ref", **extra)
    return decoders.load(name, device="cpu", dtype="float32", impl="ref", **kwargs)


def tp_worker(rank: int, size: int, port: int, out: str):
    """One rank: every family's logits, teacher-forced decode logits and greedy tokens, on one process
    (no collective) and tensor parallel."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    group = Group(rank, size)
    results = {}
    g = torch.Generator().manual_seed(1)
    for name in MODELS:
        single, split = load(name), load(name, tp=group)
        tokens = torch.randint(0, single.vocab_size, (2, 24), generator=g)
        forced = torch.randint(0, single.vocab_size, (1, 4), generator=g)
        with torch.inference_mode():
            results[name] = {
                "logits": (single.logits(tokens), split.logits(tokens)),
                "decode": (harness.gate_logits(single, tokens[:1, :17], forced, 6), harness.gate_logits(split, tokens[:1, :17], forced, 6)),
                "tokens": (single.generate(tokens[:, :9], 6).tokens, split.generate(tokens[:, :9], 6).tokens),
                # prompts of different lengths: packed (transformer), grouped (Mamba-2), padded (RWKV-7)
                "ragged": tuple(d.generate([tokens[0, :9].tolist(), tokens[1, :4].tolist()], 5).tokens for d in (single, split)),
                "vocab": split.vocab_size,
                "tp": split.describe()["tp"],
            }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.start_processes(tp_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_equals_one_process(tp_results, name):
    for rank in range(2):
        r = tp_results[rank][name]
        single, split = r["logits"]
        assert split.shape == single.shape
        assert harness.relative_rms(split, single) < 1e-5
        single, split = r["decode"]
        assert harness.relative_rms(split, single) < 1e-5
        for key in ("tokens", "ragged"):
            single, split = r[key]
            assert split == single, key
        assert r["tp"] == 2
    # Both ranks sampled the same tokens from the same gathered logits.
    assert torch.equal(tp_results[0][name]["logits"][1], tp_results[1][name]["logits"][1])


def cat(t, dim, *spans):
    """The spans (start, stop) of t along dim, concatenated."""
    return torch.cat([t.narrow(dim, a, b - a) for a, b in spans], dim)


def expected_llama(full, r):
    # llama-tiny: 4 query heads and 2 KV heads of 16, MLP 176, vocabulary 512 (tied)
    q, kv, i, v = (r * 32, r * 32 + 32), (r * 16, r * 16 + 16), (r * 88, r * 88 + 88), (r * 256, r * 256 + 256)
    out = {"model.embed_tokens.weight": cat(full["model.embed_tokens.weight"], 0, v), "model.norm.weight": full["model.norm.weight"]}
    for n in range(2):
        a, m = f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp."
        out.update({
            a + "q_proj.weight": cat(full[a + "q_proj.weight"], 0, q),
            a + "k_proj.weight": cat(full[a + "k_proj.weight"], 0, kv),
            a + "v_proj.weight": cat(full[a + "v_proj.weight"], 0, kv),
            a + "o_proj.weight": cat(full[a + "o_proj.weight"], 1, q),
            m + "gate_proj.weight": cat(full[m + "gate_proj.weight"], 0, i),
            m + "up_proj.weight": cat(full[m + "up_proj.weight"], 0, i),
            m + "down_proj.weight": cat(full[m + "down_proj.weight"], 1, i),
            f"model.layers.{n}.input_layernorm.weight": full[f"model.layers.{n}.input_layernorm.weight"],
        })
    return out


def expected_mamba2(full, r, groups):
    # d_inner 128 (64 a rank), 8 heads (4 a rank), d_state 16; in_proj rows z 0:128, x 128:256, B and C
    # 64 rows each at G = 4 (32 a rank) or 16 at G = 1 (every rank all of them), dt 8
    d, bc = (r * 64, r * 64 + 64), (r * 32, r * 32 + 32) if groups == 4 else (0, 16)
    width = 64 if groups == 4 else 16
    h = (r * 4, r * 4 + 4) if groups == 1 else (r * 8, r * 8 + 8)
    heads = 8 if groups == 1 else 16
    out = {"backbone.embeddings.weight": cat(full["backbone.embeddings.weight"], 0, (r * 256, r * 256 + 256))}
    for n in range(2):
        m = f"backbone.layers.{n}.mixer."
        shift = lambda span, at: (span[0] + at, span[1] + at)  # noqa: E731
        in_rows = (d, shift(d, 128), shift(bc, 256), shift(bc, 256 + width), shift(h, 256 + 2 * width))
        if groups == 4:
            out[m + "in_proj.bias"] = cat(full[m + "in_proj.bias"], 0, *in_rows)
            out[m + "out_proj.bias"] = full[m + "out_proj.bias"] if r == 0 else torch.zeros(64)
        out.update({
            m + "in_proj.weight": cat(full[m + "in_proj.weight"], 0, *in_rows),
            m + "conv1d.weight": cat(full[m + "conv1d.weight"], 0, d, shift(bc, 128), shift(bc, 128 + width)),
            m + "conv1d.bias": cat(full[m + "conv1d.bias"], 0, d, shift(bc, 128), shift(bc, 128 + width)),
            m + "A_log": cat(full[m + "A_log"], 0, h),
            m + "D": cat(full[m + "D"], 0, h),
            m + "dt_bias": cat(full[m + "dt_bias"], 0, h),
            m + "norm.weight": cat(full[m + "norm.weight"], 0, d),
            m + "out_proj.weight": cat(full[m + "out_proj.weight"], 1, d),
            f"backbone.layers.{n}.norm.weight": full[f"backbone.layers.{n}.norm.weight"],
        })
        assert full[m + "A_log"].shape == (heads,)
    return out


def expected_rwkv7(full, r):
    # C 64 (32 a rank), 4 heads of 16 (2 a rank), FFN 256 (128 a rank), vocabulary 512
    c, h, i, v = (r * 32, r * 32 + 32), (r * 2, r * 2 + 2), (r * 128, r * 128 + 128), (r * 256, r * 256 + 256)
    out = {"model.embeddings.weight": cat(full["model.embeddings.weight"], 0, v), "lm_head.weight": cat(full["lm_head.weight"], 0, v)}
    for n in range(2):
        a, f = f"model.layers.{n}.attn.", f"model.layers.{n}.ffn."
        out.update({
            a + "r_proj.weight": cat(full[a + "r_proj.weight"], 0, c),
            a + "v_proj.weight": cat(full[a + "v_proj.weight"], 0, c),
            a + "o_proj.weight": cat(full[a + "o_proj.weight"], 1, c),
            a + "w_lora.lora.0.weight": full[a + "w_lora.lora.0.weight"],
            a + "w_lora.lora.2.weight": cat(full[a + "w_lora.lora.2.weight"], 0, c),
            a + "w_lora.lora.2.bias": cat(full[a + "w_lora.lora.2.bias"], 0, c),
            a + "g_lora.lora.2.weight": cat(full[a + "g_lora.lora.2.weight"], 0, c),
            a + "k_k": cat(full[a + "k_k"], 0, c),
            a + "r_k": cat(full[a + "r_k"], 0, h),
            a + "g_norm.weight": cat(full[a + "g_norm.weight"], 0, c),
            a + "x_r": full[a + "x_r"],
            f + "key.weight": cat(full[f + "key.weight"], 0, i),
            f + "value.weight": cat(full[f + "value.weight"], 1, i),
            f + "x_k": full[f + "x_k"],
        })
    return out


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_holds_its_slice_of_every_tensor(name):
    family = {"llama": "transformer", "mamba2": "mamba2", "rwkv7": "rwkv7"}[name.split("-")[0]]
    for r in range(2):
        dec = load(name)
        full = {k: v.clone() for k, v in dec.model.state_dict().items()}
        model, local = tensor_parallel.shard(dec.model, family, dec.config, Group(r, 2))
        have = model.state_dict()
        assert set(have) == set(full)
        if family == "transformer":
            want = expected_llama(full, r)
            attn = model.model.layers[0].self_attn
            a = "model.layers.0.self_attn."
            assert torch.equal(attn.qkv_weight, torch.cat([want[a + p] for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")]))
            assert (local.num_attention_heads, local.num_key_value_heads, local.vocab_size) == (2, 1, 256)
        elif family == "mamba2":
            want = expected_mamba2(full, r, dec.config.ngroups)
            assert local.nheads == dec.config.nheads // 2 and local.conv_dim == model.backbone.layers[0].mixer.conv1d.weight.shape[0]
        else:
            want = expected_rwkv7(full, r)
            assert local.num_heads == 2
        for key, value in want.items():
            assert torch.equal(have[key], value), key
        # Every tensor the plan leaves whole is the full one.
        rules = tensor_parallel.plan(family, dec.config, 2)
        for key in have:
            if tensor_parallel.spec_of(rules, key) is None:
                assert torch.equal(have[key], full[key]), key


def compare_cli(*args, env=None, nproc=None, timeout=240):
    command = [sys.executable, "-m", "decoders.compare", *args]
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "decoders.compare", *args]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)


# What a record says that does not depend on timing, the process or which rank measured it.
STABLE = ("model", "family", "impl", "dtype", "config", "ctx", "batch", "status", "prompt_len", "new_tokens", "passes", "weight_bytes",
          "state_bytes", "step_bytes", "repeats", "correctness")


def test_spread_sweep_gives_the_records_of_one_process(tmp_path):
    # A checkpoint whose weights do not fit its config fails when loaded: on each rank, one of its points.
    broken = tmp_path / "models" / "broken"
    decoders.load("llama-tiny", device="cpu").save(broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    args = ["--ctx", "48,64", "--new-tokens", "4", "--no-progress"]
    spread = compare_cli("--models", f"llama-tiny,rwkv7-tiny,{broken}", *args, "--out", str(tmp_path / "spread.jsonl"), nproc=2)
    assert spread.returncode == 0, spread.stderr[-2000:]
    one = compare_cli("--models", "llama-tiny,rwkv7-tiny", *args, "--out", str(tmp_path / "one.jsonl"))
    assert one.returncode == 0, one.stderr[-2000:]
    spread_records = [json.loads(line) for line in (tmp_path / "spread.jsonl").read_text().splitlines()]
    one_records = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    failed = spread_records[4:]
    assert [(r["model"], r["rank"], r["status"]) for r in failed] == [(str(broken), 0, "error"), (str(broken), 1, "error")]
    assert all(r["reason"].startswith(f"rank {r['rank']}: CheckpointError") and "has shape" in r["reason"] for r in failed)
    spread_records = spread_records[:4]
    assert [{k: r.get(k) for k in STABLE} for r in spread_records] == [{k: r.get(k) for k in STABLE} for r in one_records]
    assert sorted({r["rank"] for r in spread_records}) == [0, 1]
    assert {r["world_size"] for r in spread_records} == {2} and {r["tp"] for r in spread_records} == {1}
    # The decay is against the smallest context, whichever rank measured it.
    assert [r["decay"] for r in spread_records][::2] == [1.0, 1.0]
    # The parts each rank wrote as it went are merged and gone; rank 0 alone printed the table.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "one.jsonl", "spread.jsonl"]
    assert spread.stdout.count('"out":') == 1


def test_launches_that_do_not_fit_the_options_are_refused(tmp_path, capsys, monkeypatch):
    from decoders import compare

    args = ["--models", "llama-tiny", "--ctx", "64", "--new-tokens", "4", "--no-progress", "--out", str(tmp_path / "r.jsonl")]
    folder = tmp_path / "three-heads"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 48,
                                                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3,
                                                     "num_key_value_heads": 1}))
    cases = [
        ({}, ["--tp", "2"], "--tp 2 needs 2 processes: launch with torchrun --nproc-per-node 2"),
        ({}, ["--spread"], "--spread needs several processes"),
        ({"WORLD_SIZE": "2"}, ["--tp", "3"], "--tp 3 with 2 processes"),
        ({"WORLD_SIZE": "2"}, ["--tp", "2", "--models", str(folder)], "num_attention_heads 3 is not divisible by tp 2"),
        ({"WORLD_SIZE": "2"}, ["--tp", "2", "--models", "maskpredict-tiny"], "tensor parallel runs the transformer, mamba2, rwkv7"),
        ({"WORLD_SIZE": "2"}, ["--tp", "2", "--peers", "hf"], "--peers does not combine with --tp"),
    ]
    for env, extra, message in cases:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert compare.main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (extra, err)
    # The other ranks of a launch find the same mistake and exit without repeating it.
    monkeypatch.setenv("RANK", "1")
    assert compare.main(args + ["--tp", "3"]) == 2
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "r.jsonl").exists()


def gpu_worker(rank: int, size: int, port: int, out: str):
    """One GPU rank on NCCL: every family's tensor-parallel decoder on the Triton path (bf16, decode
    steps replayed from a CUDA graph with their collectives inside) through the correctness gate, and
    its logits' error against the one-process float32 reference beside the one-process bf16 error."""
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, device_id=device)
    group = Group(rank, size)
    results = {}
    for name in ("llama-tiny", "mamba2-tiny", "rwkv7-tiny"):
        split = decoders.load(name, device=device, impl="triton", tp=group)
        single = decoders.load(name, device=device, impl="triton")
        truth = decoders.load(name, device=device, dtype="float32", impl="ref")
        tokens = torch.randint(0, truth.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
        gate = harness.check_against_reference(split, new_tokens=8)
        expected = truth.logits(tokens)
        results[name] = {"gate": gate["ok"], "graphs": split.cuda_graphs,
                         "split": harness.relative_rms(split.logits(tokens).float(), expected),
                         "single": harness.relative_rms(single.logits(tokens).float(), expected)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("size", [1, 2])
def test_tensor_parallel_on_gpus(tmp_path, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    mp.start_processes(gpu_worker, args=(size, free_port(), str(tmp_path)), nprocs=size, start_method="spawn")
    for rank in range(size):
        for name, r in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert r["gate"] and r["graphs"], name
            # bf16 rounding, as much as one process's (the gate's rule)
            assert r["split"] <= 1.5 * r["single"] + 1e-3, (name, r)
