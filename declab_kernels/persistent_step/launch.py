"""What every family's persistent step shares on the host: the checks of its tensors, the pointer table,
the counters and sync words, the work list on the device, how many programs fit at once, the GEMV chunk,
the launch, the stall flag and the timeline (`PersistentLaunch`)."""

import torch
from triton import next_power_of_2

from declab_kernels.persistent_step import schedule

# Warps of every program: the attention tile (K and V of the current and the next 64-key tile at
# D = 64, 32 KB) and the GEMV chunks (two 8 KB chunks in flight) spread over 256 threads.
NUM_WARPS = 8
# Weight elements of one GEMV chunk (BN rows x BK columns): 8 KB of bf16, two in flight a program.
CHUNK_ELEMS = 4096
# Programs an SM holds at most, whatever its registers and shared memory would allow.
MAX_PROGRAMS_PER_SM = 2
# Registers a thread may use (ptxas .maxnreg). Left free, ptxas took 222-247 whatever the tile sizes
# (llama-1b, sm_90 offline compile), one 8-warp program an SM; at 128 it spills ~100 bytes a thread and
# two programs fit an SM, twice the weight bytes in flight.
MAX_REGISTERS = 128
# 32-bit registers of one SM (every NVIDIA SM from Volta to Hopper).
REGISTERS_PER_SM = 65536


def resident_programs(n_regs: int, shared: int, num_warps: int, device: torch.device) -> int:
    """Programs of a kernel with `n_regs` registers a thread and `shared` bytes of shared memory that one
    SM holds at once (registers allocated per warp in units of 256; 1 KB of shared memory reserved a
    program), capped at MAX_PROGRAMS_PER_SM."""
    props = torch.cuda.get_device_properties(device)
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = REGISTERS_PER_SM // per_warp // num_warps
    by_threads = props.max_threads_per_multi_processor // (32 * num_warps)
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024)
    return min(by_regs, by_threads, by_shared, MAX_PROGRAMS_PER_SM)


def _pow2(n: int) -> int:
    return next_power_of_2(max(1, n))


def _chunk(rows: int, k: int) -> int:
    """BK for tiles of `rows` weight rows over depth k (even: the tile loads column pairs)."""
    if k % 2:
        raise ValueError(f"persistent step: a GEMV depth must be even (its tile loads column pairs), got {k}")
    return max(16, min(CHUNK_ELEMS // rows, _pow2(k)))


class PersistentLaunch:
    """The launch of a persistent step. A subclass sets `kernel`, defines `_plan(programs)` (tiles, then
    `_set_items`) and `_launch_args(tokens, positions)`; its constructor calls `_check` on its tensors,
    sets `consts` (the constexprs) and its buffers, then `_start`."""

    def _check(self, layers, typed, device, what: str, delay_ns: int, timeline: bool) -> None:
        """Refuse a (tensor, dtype) of `typed` that is not contiguous, of that dtype on `device` and 16-byte
        aligned (`what` names them in the message), and the debug constexprs off a GPU; keep `layers` and
        their pointer table [L, len(tensors())] int64 (a None tensor is address 0)."""
        for t, want in typed:
            if t.dtype != want or t.device != device or not t.is_contiguous():
                raise ValueError(f"persistent step: every {what} must be contiguous {want} on {device}, got {t.dtype} {tuple(t.shape)}")
            if t.data_ptr() % 16:
                raise ValueError(f"persistent step: every {what} must be 16-byte aligned")
        if (delay_ns or timeline) and device.type != "cuda":
            raise ValueError("persistent step: delay_ns and timeline need a GPU (globaltimer)")
        self.device = device
        # The pointer table holds these tensors' addresses: kept alive with the step.
        self.layers = layers
        self.table = torch.tensor([[0 if t is None else t.data_ptr() for t in layer.tensors()] for layer in layers], dtype=torch.int64,
                                  device=device)

    def _start(self, vocab: int, dtype: torch.dtype, n_counters: int, programs: int | None, timeline: bool) -> None:
        """The logits [1, vocab], the epoch, done and stall words and `n_counters` counters; then P (`programs`,
        or as many as fit) and its plan."""
        device = self.device
        self.logits = torch.empty(1, vocab, dtype=dtype, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        # Set by a wait that gave up (`stalled`).
        self.stall = torch.zeros(1, dtype=torch.int32, device=device)
        self.counters = torch.zeros(n_counters, dtype=torch.int32, device=device)
        self.timeline_on = bool(timeline)
        self.programs = programs or self._programs()
        self._plan(self.programs)

    def _set_items(self, items) -> None:
        """The work list: its items, their rows on the device and the timeline buffer."""
        self.items = items
        self.work = torch.tensor([it.row() for it in items], dtype=torch.int32, device=self.device)
        self.times = torch.zeros(len(items) if self.timeline_on else 1, 4, dtype=torch.int64, device=self.device)

    def _list_args(self) -> tuple:
        """Every kernel's first arguments: the work list, its length, the counters, epoch, done and the pointer table."""
        return (self.work, self.work.shape[0], self.counters, self.epoch, self.done, self.table)

    def _programs(self) -> int:
        if self.device.type != "cuda":
            # The interpreter runs programs one after another: a second one would never see the
            # first's counters move.
            return 1
        # The tiles depend on P and the registers on the tiles: compile for a P, read what fits, and
        # settle on a P whose own compiled kernel fits it (a P too large would hang, not fail).
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        programs = sms * MAX_PROGRAMS_PER_SM
        for _ in range(MAX_PROGRAMS_PER_SM):
            self._plan(programs)
            probe = torch.zeros(1, dtype=torch.int64, device=self.device)
            compiled = self.kernel.warmup(*self._launch_args(probe, probe), grid=(1,), num_warps=NUM_WARPS,
                                          maxnreg=MAX_REGISTERS, **self.consts)
            compiled._init_handles()
            resident = resident_programs(compiled.n_regs, compiled.metadata.shared, NUM_WARPS, self.device)
            if sms * resident >= programs:
                return programs
            if resident < 1:
                break
            programs = sms * resident
        raise RuntimeError(f"persistent step: {programs // sms} program(s) of {compiled.n_regs} registers a thread and "
                           f"{compiled.metadata.shared} B of shared memory do not fit on an SM")

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [1, V] of the token tokens [1] at positions [1]; the model's cache or states updated in place."""
        self.kernel[(self.programs,)](*self._launch_args(tokens, positions), num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS,
                                      **self.consts)
        return self.logits

    def stalled(self) -> bool:
        """Whether a wait of any launch so far gave up; synchronises. The flag stays set and every later
        wait gives up at once, so that launch's logits and all later ones are wrong (and quick)."""
        return bool(self.stall.item())

    def timeline(self) -> list[dict]:
        """Per item of the last launch with `timeline=True`: stage, layer, tile, program, SM and its
        start, wait-over and end times in ns from the step's first start."""
        if self.times.shape[0] != len(self.items):
            raise ValueError("persistent step: built without timeline=True")
        t = self.times.cpu().tolist()
        t0 = min(r[0] for r in t)
        return [{"stage": schedule.STAGE_NAMES[it.stage], "layer": it.layer, "tile": it.tile, "program": i % self.programs,
                 "sm": r[3], "start_ns": r[0] - t0, "ready_ns": r[1] - t0, "end_ns": r[2] - t0}
                for i, (it, r) in enumerate(zip(self.items, t))]
