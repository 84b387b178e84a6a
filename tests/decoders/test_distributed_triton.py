"""Tensor parallel on the Triton path, under the interpreter: two gloo processes on the CPU.

The fused paths call the row-parallel all-reduces themselves (`tp` hooks in `declab_arch`), apart from
the modules the reference path goes through; here each family's tensor-parallel decoder on
impl="triton" (float32) must give, through prefill and teacher-forced decode steps, the logits of the
model on one process on the reference path.
"""

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import decoders
from declab_arch.tensor_parallel import Group
from decoders import harness

MODELS = ("llama-tiny", "mamba2-tiny", "rwkv7-tiny")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, size: int, port: int, out: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    g = torch.Generator().manual_seed(3)
    errors = {}
    for name in MODELS:
        split = decoders.load(name, device="cpu", dtype="float32", impl="triton", tp=Group(rank, size))
        truth = decoders.load(name, device="cpu", dtype="float32", impl="ref")
        prompt = torch.randint(0, truth.vocab_size, (1, 13), generator=g)
        forced = torch.randint(0, truth.vocab_size, (1, 3), generator=g)
        with torch.inference_mode():
            errors[name] = harness.relative_rms(harness.gate_logits(split, prompt, forced, 4), harness.gate_logits(truth, prompt, forced, 4))
    torch.save(errors, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.interpreter
def test_tensor_parallel_triton_path_equals_one_process_reference(tmp_path):
    mp.start_processes(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        for name, err in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert err < 1e-4, (rank, name, err)
