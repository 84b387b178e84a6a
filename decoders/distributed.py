"""Several processes of one `torchrun`: tensor-parallel decoders, and independent work shared out.

    torchrun --nproc-per-node 2 -m decoders.compare --tp 2 --models llama-8b --ctx 4k,128k
    torchrun --nproc-per-node 8 -m decoders.compare --spread --models llama-1b,mamba2-1.3b --ctx 4k..128k

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address in
their environment; `setup` joins them in one torch.distributed process group (NCCL on GPUs, each rank
on `cuda:LOCAL_RANK`; gloo on the CPU).

Tensor parallel (`--tp N`, N = the number of processes): every rank builds the same full model (random
weights from the same seed, or the checkpoint), keeps its share (`declab_arch.tensor_parallel.shard`, by
the plan its family's `declab_arch` module declares) and runs every call in lockstep with the others;
`load` gives that decoder, whose logits are gathered over the vocabulary so that sampling, on every
rank, sees the whole distribution and picks the same token. Only rank 0 prints and writes results.

Spreading (`--spread`, or WORLD_SIZE > 1 with --tp 1): the sweep's points are dealt out to the ranks
(`share`), each rank measures its own on its own GPU, and rank 0 collects every rank's records
(`collect`) into one result file.

Jobs (`run_jobs`, for the eval studies' grids of training runs): rank 0 prepares what every job reads
(`lead_first`) while the others wait, each rank runs its share of the jobs appending each record to its
own part file `OUT.rankR` as it finishes (a job that raises becomes an error record naming the rank),
and rank 0 appends every rank's records to OUT in job order; a part file an interrupted launch left
behind is folded into OUT by the next run (`fold_parts`), so a rerun skips what any rank finished.
"""

import contextlib
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch

from declab_arch import tensor_parallel
from declab_arch.tensor_parallel import Group
from decoders import FAMILIES, family_class
from decoders.base import UsageError
from decoders.records import append_jsonl


@dataclass
class World:
    """This process's place in the launch: rank of size (1 when not started by torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def launched(self) -> bool:
        return self.size > 1


def world() -> World:
    """From the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK)."""
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def check_launch(tp: int, spread: bool, here: World, command: str) -> None:
    """UsageError unless the options fit how the processes were launched."""
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and not here.launched:
        raise UsageError(f"--tp {tp} needs {tp} processes: launch with torchrun --nproc-per-node {tp} -m {command} ...")
    if tp > 1 and tp != here.size:
        raise UsageError(f"--tp {tp} with {here.size} processes: tensor parallel runs over all of them (--nproc-per-node {tp})")
    if spread and tp > 1:
        raise UsageError("--spread and --tp: a run either splits each model over the processes or shares points out, not both")
    if spread and not here.launched:
        raise UsageError(f"--spread needs several processes: launch with torchrun --nproc-per-node N -m {command} ...")


def device_of(device: torch.device, here: World) -> torch.device:
    """Each rank of a launch on its own GPU, cuda:LOCAL_RANK (a device the user named stays as named)."""
    if device.type == "cuda" and device.index is None and here.launched:
        if here.local_rank >= torch.cuda.device_count():
            raise UsageError(f"rank {here.rank} has LOCAL_RANK {here.local_rank}, but only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", here.local_rank)
    return device


def setup(device: torch.device, here: World, timeout: timedelta | None = None) -> Group:
    """Join the launch's process group (once per process); the Group of all its ranks. `timeout`: how
    long a collective may wait for the other ranks (torch's default when None; `JOBS_WAIT` for jobs)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size())


def teardown() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def check_splits(family: str, config, tp: int, name: str) -> None:
    """UsageError naming the model unless its family has a sharding plan (`declab_arch.tensor_parallel`)
    and its config splits over `tp` ranks."""
    if not tensor_parallel.has_plan(family_class(family).arch):
        planned = [f for f in FAMILIES if tensor_parallel.has_plan(family_class(f).arch)]
        raise UsageError(f"{name}: tensor parallel runs the {', '.join(planned)} families, not {family}")
    try:
        tensor_parallel.check(family, config, tp)
    except ValueError as e:
        raise UsageError(f"{name}: {e}") from None


class TensorParallel:
    """Mixed in before a family's decoder class (`tp_class`): the decoder of this rank's share.

    `tp_group` (a `tensor_parallel.Group`) is the ranks; the model passed in is the full model, cut
    down here before the family's own __init__ moves it to the device. The family's prefill and decode
    forwards (and `logits`) return the rank's vocabulary slice, gathered here into the whole."""

    def __init__(self, model, config, *, tp_group: Group, **kwargs):
        check_splits(self.family, config, tp_group.size, kwargs.get("source", self.family))
        self.full_config = config
        self.tp = tp_group
        model, local = tensor_parallel.shard(model, self.family, config, tp_group)
        super().__init__(model, local, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.full_config.vocab_size

    def describe(self) -> dict:
        return {**super().describe(), "config": asdict(self.full_config), "tp": self.tp.size}

    @torch.inference_mode()
    def logits(self, tokens):
        return self.tp.gather(super().logits(tokens))

    def prefill_forward(self, cache, prompts):
        return self.tp.gather(super().prefill_forward(cache, prompts))

    def decode_forward(self, cache, tokens, positions):
        return self.tp.gather(super().decode_forward(cache, tokens, positions))


_CLASSES = {}


def tp_class(family_class):
    """The tensor-parallel subclass of a family's decoder class (one per class)."""
    if family_class not in _CLASSES:
        _CLASSES[family_class] = type(f"TensorParallel{family_class.__name__}", (TensorParallel, family_class), {})
    return _CLASSES[family_class]


def first_reason(why, group: Group):
    """The first rank's non-None `why` (a reason to skip a point), the same on every rank, so that a
    point one GPU has no room for is skipped by all and none waits on the others."""
    import torch.distributed as dist

    reasons = [None] * group.size
    dist.all_gather_object(reasons, why, group=group.process_group)
    return next((r for r in reasons if r is not None), None)


def share(count: int, here: World) -> list[int]:
    """Indices of the points (of `count`, in sweep order) rank `here.rank` measures: every size-th one,
    so each rank gets some of each model's contexts."""
    return list(range(here.rank, count, here.size))


def collect(records: list[tuple[int, dict]], here: World):
    """On rank 0, every rank's (index, record) in index order; None on the others."""
    import torch.distributed as dist

    parts = [None] * here.size if here.rank == 0 else None
    dist.gather_object(records, parts, dst=0)
    if here.rank != 0:
        return None
    return sorted((item for part in parts for item in part), key=lambda item: item[0])


def trace_step(decoder, batch: int) -> list[tuple[str, tuple, torch.dtype]]:
    """The collectives one decode step of `decoder` (tensor parallel) runs at `batch`: (kind, shape,
    dtype) in order, recorded from an eager step after a short prefill."""
    group = decoder.tp
    calls = []
    reduce, gather = group.reduce, group.gather

    def traced_reduce(x):
        calls.append(("reduce", tuple(x.shape), x.dtype))
        return reduce(x)

    def traced_gather(x):
        calls.append(("gather", tuple(x.shape), x.dtype))
        return gather(x)

    prompts = torch.zeros(batch, 4, dtype=torch.long)
    with torch.inference_mode():
        state = decoder.prefill(prompts, max_new_tokens=2)
        group.reduce, group.gather = traced_reduce, traced_gather
        try:
            decoder.decode_forward(state.cache, state.next_tokens, state.positions)
        finally:
            del group.reduce, group.gather
        decoder.release(state)
    return calls


def collective_time(decoder, batch: int, repeats: int = 50) -> dict:
    """Time in collectives per decode step: the step's all-reduces and logit gather (`trace_step`) run
    alone, on tensors of their sizes, `repeats` times (on a GPU timed with events, captured in a CUDA
    graph when the decoder replays its steps from one; on the CPU with a monotonic clock)."""
    calls = trace_step(decoder, batch)
    group, device = decoder.tp, decoder.device
    tensors = [torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype in calls]

    def run():
        for (kind, _, _), t in zip(calls, tensors):
            if kind == "reduce":
                group.reduce(t)
            else:
                group.gather(t)

    with torch.inference_mode():
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if decoder.cuda_graphs:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                graph.replay()
                run = graph.replay
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                run()
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) * 1e-3
        else:
            t0 = time.perf_counter()
            for _ in range(repeats):
                run()
            seconds = time.perf_counter() - t0
    sizes = [t.numel() * t.element_size() for t in tensors]
    return {
        "collectives_per_step": len(calls),
        "allreduces_per_step": sum(kind == "reduce" for kind, _, _ in calls),
        "collective_bytes_per_step": sum(sizes),
        "collective_ms_per_step": seconds / repeats * 1e3,
    }


# How long a rank that finished its share of the jobs waits at the merge for the slowest rank (a
# study's training runs take hours, torch's default wait is minutes).
JOBS_WAIT = timedelta(days=7)


def barrier() -> None:
    """Wait for every rank of the launch (nothing to wait for in one process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def failure(error: BaseException, here: World) -> str:
    """The reason an error record gives for a job that raised: the rank, the error's type and first line."""
    text = str(error).strip()
    return f"rank {here.rank}: {type(error).__name__}: {text.splitlines()[0] if text else ''}"


def part_path(path: Path, rank: int) -> Path:
    """The file rank `rank` appends its records of the result file `path` to as they finish: PATH.rankR."""
    return path.with_name(f"{path.name}.rank{rank}")


def fold_parts(path: Path) -> int:
    """Append the records of the part files of `path` that a launch left behind (stopped before its
    merge ended) to `path`, in rank order, and remove them; how many records were folded in. A line
    `path` already holds (merged before the launch stopped) is not added twice."""
    ranks = {p: p.name.removeprefix(f"{path.name}.rank") for p in path.parent.glob(f"{path.name}.rank*")}
    parts = sorted((p for p, r in ranks.items() if r.isdigit()), key=lambda p: int(ranks[p]))
    have = set(path.read_text().splitlines(keepends=True)) if path.exists() else set()
    folded = 0
    for part in parts:
        # A rank killed mid-write may have left its last line cut short: it is dropped, and its job reruns.
        lines = [line for line in part.read_text().splitlines(keepends=True) if line.endswith("\n") and line not in have]
        with open(path, "a") as f:
            f.writelines(lines)
        have.update(lines)
        folded += len(lines)
        part.unlink()
    return folded


def lead_first(work, here: World):
    """Rank 0 runs `work()` (the phase every rank's jobs read: a tokenizer, a data cache) while the
    others wait; its result (picklable) on every rank. In one process an error simply propagates.
    Launched, when it raises every rank exits: with 2 when the lab refused the input (rank 0 saying
    why in one line), else with 1 (rank 0 printing the traceback)."""
    import torch.distributed as dist

    from decoders import USER_ERRORS

    if not dist.is_initialized():
        return work()
    result, code = None, 0
    if here.rank == 0:
        try:
            result = work()
        except USER_ERRORS as e:
            code = 2
            print(f"error: {e}", file=sys.stderr, flush=True)
        except Exception:
            code = 1
            traceback.print_exc()
            sys.stderr.flush()
    # Said before any rank learns of it: torchrun stops the other ranks as soon as one exits.
    said = [code, result]
    dist.broadcast_object_list(said, src=0)
    if said[0]:
        raise SystemExit(said[0])
    return said[1]


def run_jobs(jobs: list, run, path: Path, here: World, failed) -> list[dict]:
    """Run independent `jobs` and append each one's record (`run(job)`, a dict) to the JSON-lines file
    `path`. In one process: in order, each appended as it finishes; an error propagates. Launched:
    this rank's share (`share`), each record appended to its part file (`part_path`) as it finishes,
    a job that raises recorded as `failed(job, reason)` (`failure`: the rank and the error) while the
    rank goes on to its next; then rank 0 appends every rank's records to `path` in job order, the
    parts are removed, and every rank returns once `path` holds them all. Every record says its rank
    and the world size. Returns the error records (rank 0: every rank's; the others: none)."""
    placed = {"rank": here.rank, "world_size": here.size}
    if not here.launched:
        for job in jobs:
            append_jsonl(path, {**run(job), **placed})
        return []
    part = part_path(path, here.rank)
    indexed = []
    for index in share(len(jobs), here):
        try:
            record = run(jobs[index])
        except Exception as e:
            record = failed(jobs[index], failure(e, here))
        record = {**record, **placed}
        append_jsonl(part, record)
        indexed.append((index, record))
    gathered = collect(indexed, here) or []
    for _, record in gathered:
        append_jsonl(path, record)
    barrier()
    part.unlink(missing_ok=True)
    return [record for _, record in gathered if record.get("status") == "error"]


@contextlib.contextmanager
def quiet_unless_lead(here: World):
    """Rank 0 alone prints: the others' stdout goes nowhere; stderr (a traceback) stays."""
    if here.rank == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield
