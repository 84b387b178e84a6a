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
# has four, split two per rank.
GROUPS = {"ngroups": 4, "headdim": 8}


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
        return cls(mamba2.build(config, None, name), config, source=name, device=torch.device("cpu"), dtype=torch.float32,
                   impl="ref", **extra)
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
        single, split = r["tokens"]
        assert split == single
        assert r["tp"] == 2
    # Both ranks sampled the same tokens from the same gathered logits.
    assert torch.equal(tp_results[0][name]["logits"][1], tp_results[1][name]["logits"][1])
