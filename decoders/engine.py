"""The continuous-batching engine: requests admitted and retired at every step, for every family.

    from decoders.engine import Engine, Request
    engine = Engine(decoder, max_batch=64, max_step_tokens=2048)
    rid = engine.add_request(Request(prompt=[1, 2, 3], max_new_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_tokens, out.finish_reason)

Split as in vLLM v1:

- `Scheduler` (pure Python, host bookkeeping only): each step, which requests decode, how many prompt
  tokens each prefilling request gets under the per-step token budget (`max_step_tokens`, decode
  tokens included), which waiting requests are admitted (first come, first served), and, when the
  transformer's block pool cannot give a running request its next block, which request is preempted
  (the most recently admitted: its blocks are freed and it goes back to the head of the queue with
  its generated tokens appended to its prompt, so recomputing it continues the same sequence).
- runners execute one scheduled step on the device: `PagedRunner` (transformer: one `PagedKVCache`
  pool, block tables `[max_batch, max_blocks]`), `StateRunner` (Mamba-2, RWKV-7: the family's state
  tensors with `2 * max_batch` rows), `CanvasRunner` (Mask-Predict).
- `Engine.step` turns what a runner sampled into `RequestOutput`s: commits tokens, applies stop
  tokens and lengths, retires finished requests and frees what they held.

Autoregressive rows: the requests that decode sit in rows 0..n-1 of the runner's buffers (next token,
position, sampling parameters, block table row or state row); a retiring request's hole is filled by
moving the last row into it (one row copy per retirement, not per step). A decode step runs over rows
[0, bucket(n)) (buckets 1, 2, 4, ... up to max_batch), the padding rows harmless: their block table
rows point at a scratch block and their positions are reset to 0; recurrent padding rows hold a
retired request's state, which nothing reads. Recurrent prefills run in staging rows
[max_batch, 2 * max_batch) (reset to zero on admission), copied into row n when the prompt is done,
so a decode step never touches a prompt still being consumed. On the Triton GPU path each
(bucket, sampling mode) decode step is captured in a CUDA graph after its first eager run.

One step of lookahead: `step()` schedules and launches step k, then waits for step k-1's tokens
(copied to pinned host memory behind it) and turns them into outputs, so the GPU always has the next
step queued while the host processes the last one. The outputs a call returns are the previous
launch's: the first call that prefills a prompt returns nothing for it, the next returns its first
token. The scheduler counts a request's tokens still on their way (`Sequence.inflight`); a request
that hits a stop token decodes once more before the host knows, and that token is dropped. On the
GPU every host-to-device copy of a step goes through pinned memory, so nothing in a step waits for
the queued work (the families' prefill code may still synchronise once per prefill).

Sampling runs on the device, per row: greedy rows take the argmax of the logits (exactly
`decoder.generate`'s tokens); sampled rows race probabilities against exponential noise derived from
(seed, position, token id) by a counter-based hash, so a request's tokens depend on its seed and
never on what else is in the batch (they are not `generate`'s tokens, whose noise comes from a
torch.Generator shared by the batch).

Mask-Predict: requests are decoded in cohorts (see `CanvasRunner`): waiting greedy requests with the
same canvas size start together as one `decoder.prefill` batch and share every pass; a sampled request
is a cohort of its own. Several cohorts run at once (each step runs one pass of each), a new cohort
starts at any step while rows are free, and each request reports its tokens as its blocks finish.

Nothing here is thread-safe: one thread owns the engine.
"""

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from decoders.base import UsageError, record_graph
from decoders.kv_cache import PagedKVCache, kv_token_bytes
from decoders.sampling import GREEDY, Sampling
from declab_kernels.argmax import argmax
from declab_kernels.host_copy import on_device

# Blocks a decoding request reserves at a time while the pool has room (`Scheduler._ahead`).
GROW_AHEAD_BLOCKS = 4


class EngineFull(RuntimeError):
    """The waiting queue already holds `max_waiting` requests."""


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_token_ids: tuple[int, ...] = ()
    request_id: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_tokens: list[int]  # tokens committed since the previous output of this request
    finished: bool
    finish_reason: str | None  # "length" | "stop" | "cancelled"
    prompt_tokens: int
    output_tokens: int  # total so far


@dataclass(eq=False, slots=True)
class Sequence:
    """The engine's record of one request."""

    request: Request
    id: str
    # prompt + generated so far: what the model consumes (a preempted request recomputes all of it)
    tokens: list[int]
    prompt_len: int
    stop: frozenset
    status: str = "waiting"  # waiting | prefill | decode | finished
    computed: int = 0  # tokens of `tokens` already in the KV cache / state
    admitted: int = -1  # admission counter: the newest running request is preempted first
    inflight: int = 0  # tokens sampled on the device that the host has not seen yet (see `Engine.step`)
    finish_reason: str | None = None
    kv_seq: int | None = None  # its PagedKVCache sequence (transformer)
    slot: int | None = None  # its staging slot (recurrent)
    row: int | None = None  # its decode row in the runner (autoregressive families), kept by the runner

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(slots=True)
class Schedule:
    decode: list[Sequence] = field(default_factory=list)  # feed their last token
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, prompt tokens this step)
    admitted: list[Sequence] = field(default_factory=list)  # newly admitted (their state to reset)
    preempted: list[Sequence] = field(default_factory=list)  # back in the queue, blocks freed
    # (decoding sequence, blocks it held before): its new block table entries, which the runner writes
    grown: list[tuple[Sequence, int]] = field(default_factory=list)


class Scheduler:
    """Which requests run, with how many tokens, and what is preempted: host bookkeeping only.

    `kv` (transformer) is the block pool's facade: a request holds blocks for the tokens it has
    consumed plus the one it will feed. `slots` (recurrent) is the number of staging slots: a
    request holds one from admission to retirement. `max_chunk` caps one request's prompt tokens in
    a step (the family's prefill chunk). `running` is in admission order.
    """

    def __init__(self, max_batch: int, max_step_tokens: int, *, kv: PagedKVCache | None = None, slots: int | None = None,
                 max_chunk: int | None = None):
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.max_chunk = max_chunk or max_step_tokens
        self.kv = kv
        self.free_slots = list(range(slots - 1, -1, -1)) if slots is not None else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._admissions = itertools.count()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Schedule:
        out = Schedule()
        running = list(self.running)  # preemptions shorten self.running
        kv = self.kv
        # Every decoding request spends one token of the budget; prefills share the rest, oldest first.
        self._budget = self.max_step_tokens - [s.status for s in running].count("decode")
        for seq in running:
            if seq.status == "decode":
                length = len(seq.tokens) + seq.inflight
                # A request whose last token is still on its way may be done already: when it is, its row
                # decodes once more (into the scratch block) and that token is dropped.
                if length - seq.prompt_len >= seq.request.max_new_tokens:
                    continue
                # Most steps give a request no block: that test is made here, as a call per request
                # would be a measurable share of the step's host time.
                if kv is None or length <= len(kv.blocks[seq.kv_seq]) * kv.block_size or self._grow(seq, length, out):
                    out.decode.append(seq)
            elif seq.status == "prefill" and self._budget > 0:
                n = min(len(seq.tokens) - seq.computed, self._budget, self.max_chunk)
                if self._grow(seq, seq.computed + n, out):
                    out.prefill.append((seq, n))
                    self._budget -= n
        # No admissions in a step that had to preempt: the pool is short already.
        while self.waiting and self._budget > 0 and len(self.running) < self.max_batch and not out.preempted:
            seq = self.waiting[0]
            n = min(len(seq.tokens), self._budget, self.max_chunk)
            if not self._admit(seq, n):
                break
            self.waiting.popleft()
            seq.status, seq.admitted, seq.computed = "prefill", next(self._admissions), 0
            self.running.append(seq)
            out.admitted.append(seq)
            out.prefill.append((seq, n))
            self._budget -= n
        return out

    def _admit(self, seq: Sequence, n: int) -> bool:
        """Give `seq` a slot or the blocks of its first `n` tokens; False (holding nothing) if there are none."""
        if self.free_slots is not None and not self.free_slots:
            return False
        if self.kv is not None and self.kv.pool.num_free < self.kv.blocks_needed(n):
            return False
        if self.free_slots is not None:
            seq.slot = self.free_slots.pop()
        if self.kv is not None:
            seq.kv_seq = self.kv.add_sequence()
            self.kv.reserve(seq.kv_seq, n)
        return True

    def _grow(self, seq: Sequence, length: int, out: Schedule) -> bool:
        """Blocks for `length` positions of `seq`, preempting the newest running requests while the
        pool is short; False if `seq` itself had to go. A decoding request's new blocks go into
        `out.grown`, which no later preemption of the step empties: a victim is always newer than
        every request served before it."""
        kv = self.kv
        if kv is None:
            return True
        have = len(kv.blocks[seq.kv_seq])
        if length <= have * kv.block_size:
            return True
        missing = kv.blocks_needed(length) - have
        while missing > kv.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        if seq.status == "decode":
            length = self._ahead(seq, length, missing)
        kv.reserve(seq.kv_seq, length)
        if seq.status == "decode":
            out.grown.append((seq, have))
        return True

    def _ahead(self, seq: Sequence, length: int, missing: int) -> int:
        """The length a decoding request reserves when it needs a block: GROW_AHEAD_BLOCKS blocks' worth
        (never past its last position) while the pool keeps a free block for every running request
        after it, else just `length`. Each reservation costs the next decode step a block-table write
        (`PagedRunner.before_decode`); reserving ahead makes those writes rarer."""
        kv = self.kv
        extra = GROW_AHEAD_BLOCKS - missing
        if extra <= 0 or kv.pool.num_free - missing - extra < len(self.running):
            return length
        return min(length + extra * kv.block_size, seq.prompt_len + seq.request.max_new_tokens)

    def preempt(self, seq: Sequence) -> None:
        """Free what `seq` holds and put it back at the head of the queue (recomputed from scratch)."""
        if seq.status == "decode":
            # A decoding request's prefill budget share is given back to the others this step.
            self._budget += 1
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.computed = "waiting", 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Retire `seq` (finished or cancelled), wherever it is."""
        if seq.status == "waiting":
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._release(seq)
        seq.status = "finished"

    def _release(self, seq: Sequence) -> None:
        if self.kv is not None and seq.kv_seq is not None:
            self.kv.free(seq.kv_seq)
            seq.kv_seq = None
        if self.free_slots is not None and seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None


def buckets(max_batch: int) -> list[int]:
    """Decode batch sizes a step is padded to: powers of two below max_batch, then max_batch."""
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return out + ([max_batch] if max_batch > 1 else [])


def bucket(n: int, sizes: list[int]) -> int:
    return next(b for b in sizes if b >= n)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def race_noise(seeds: torch.Tensor, counters: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [B, K] for token ids [B, K] of rows with seeds [B] at counters [B] (the position
    being sampled): a pure function of (seed, position, token id), so a request draws the same numbers
    alone or in any batch."""
    key = _mix32(_mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (counters & _M32))
    h = _mix32(_mix32(key[:, None] ^ token_ids) + 0x9E3779B9 & _M32)
    # 24 bits into (0, 1): exact in float32, never 0.
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def sample_rows(logits, temperature, top_k, top_p, seeds, counters, *, impl: str, out=None, advance=None):
    """Next tokens [B] from logits [B, V], each row with its own temperature / top-k / top-p / seed
    ([B] tensors; temperature 0 is greedy, top_k 0 and top_p 1 cut nothing). `counters` [B] int64 are
    the positions being sampled. Written into `out`, with `advance` incremented, as `sampling.sample`."""
    greedy = temperature == 0
    x = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    V = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    probs = torch.softmax(sorted_x.masked_fill(sorted_x < kth, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    probs = probs.masked_fill((probs.cumsum(-1) - probs) >= top_p[:, None], 0.0)
    # argmax(p / E) is a draw from p (renormalising p would not change it).
    race = probs / race_noise(seeds, counters, order)
    scores = torch.empty_like(race).scatter_(1, order, race)
    scores = torch.where(greedy[:, None], logits.float(), scores)
    return argmax(scores, impl=impl, out=out, advance=advance)


@dataclass(slots=True)
class Pending:
    """A launched step's sampled tokens on their way to the host: seqs[i] gets host[i]."""

    seqs: list[Sequence]
    host: torch.Tensor  # one of the runner's `host` buffers: int64 on the CPU (pinned on a GPU run)
    begin: "torch.cuda.Event | None"  # recorded before the step's first launch
    done: "torch.cuda.Event | None"  # recorded after the copy


class RowParams:
    """Per-row buffers of an autoregressive runner: the token to feed, its position, sampling parameters."""

    def __init__(self, rows: int, device):
        self.next_tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.int64, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=device)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.next_tokens, self.positions, self.temperature, self.top_k, self.top_p, self.seeds]

    def values(self, seq: Sequence) -> list:
        """Row values after `seq`'s prompt is done, but for its next token: the sampled first token
        (not yet in `seq.tokens`) is fed at position len(seq.tokens)."""
        s = seq.request.sampling
        return [len(seq.tokens), s.temperature, s.top_k, s.top_p, s.seed]


class ARRunner:
    """Rows, decode steps (graphed per bucket on the Triton GPU path) and sampling for the
    autoregressive families; subclasses supply the forwards and their state's rows."""

    def __init__(self, decoder, max_batch: int, rows: int, cuda_graphs: bool):
        self.decoder = decoder
        self.device = decoder.device
        self.impl = decoder.impl
        self.max_batch = max_batch
        sizes = buckets(max_batch)
        self.bucket_of = [bucket(n, sizes) for n in range(max_batch + 1)]
        self.params = RowParams(rows, self.device)
        self.rows: list[Sequence] = []  # rows[i] decodes in row i, and rows[i].row == i
        self.sampled_rows = 0  # rows whose request samples: a decode step of greedy rows only takes the argmax
        self.cuda_graphs = cuda_graphs
        self.graphs = {}
        self.wait_s = 0.0
        # GPU time of the last collected step, from its first launch to its tokens' copy (CUDA only)
        self.gpu_s = None
        # Where a launch's tokens land on the host, and its timing events: two sets, used by turns. A
        # launched step's set is read by its `collect`, which comes before the launch after the next
        # (one step of lookahead), so a set is free again two launches later. A step's tokens never
        # outnumber the rows (they are its decode rows and the prompts joining them).
        cuda = self.device.type == "cuda"
        self.host = [torch.empty(rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
                       for _ in range(2)]
        self.launches = 0

    def launch(self, sched: Schedule) -> "Pending | None":
        """Launch one scheduled step without waiting for it: the decode forward of rows 0..n-1 (when
        any request decodes), the prefill chunks, the first tokens of prompts done (their sequences
        join the decode rows). Its sampled tokens come back through `collect`."""
        n = len(self.rows) if sched.decode else 0
        decoded = self.rows[:n]
        turn = self.launches % 2
        begin, done = self.events[turn]
        if begin is not None:
            begin.record()
        if n:
            self.before_decode(sched.grown)
            self.decode(n)
        finished, logits = self.prefill(sched.prefill)
        first = None
        if finished:
            first = self.sample_first(finished, torch.stack(logits))
        if not (n or finished):
            return None
        # The decode rows' tokens, then the first tokens. The whole buffer is copied, not rows 0..n-1:
        # slicing a tensor costs the host about as much as the copy, and the rows past n are not read.
        host = self.host[turn]
        if n:
            host.copy_(self.params.next_tokens, non_blocking=True)
        if finished:
            host[n : n + len(finished)].copy_(first, non_blocking=True)
        if done is not None:
            done.record()
        self.launches += 1
        row = len(self.rows)
        for seq in finished:
            seq.row = len(self.rows)
            self.enter(seq, seq.row)
            self.rows.append(seq)
            self.sampled_rows += not seq.request.sampling.greedy
            seq.status = "decode"
        if finished:
            self.write_rows(range(row, row + len(finished)), finished, first)
        seqs = decoded + finished
        for seq in seqs:
            seq.inflight += 1
        return Pending(seqs, host, begin, done)

    def collect(self, pending: "Pending") -> Iterator[tuple[Sequence, int]]:
        """Wait for a launched step's tokens (the one host synchronisation of a step)."""
        start = time.perf_counter()
        if pending.done is not None:
            pending.done.synchronize()
        tokens = pending.host.tolist()
        self.wait_s += time.perf_counter() - start
        if pending.done is not None:
            self.gpu_s = pending.begin.elapsed_time(pending.done) * 1e-3
        for seq in pending.seqs:
            seq.inflight -= 1
        return zip(pending.seqs, tokens)

    def sample_first(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """First tokens [k] of sequences whose prompt is done, from their last logits [k, V]."""
        s = [q.request.sampling for q in seqs]
        dev = self.device
        if all(x.greedy for x in s):
            return argmax(logits, impl=self.impl)
        return sample_rows(
            logits,
            on_device([x.temperature for x in s], dev, torch.float32),
            on_device([x.top_k for x in s], dev),
            on_device([x.top_p for x in s], dev, torch.float32),
            on_device([x.seed for x in s], dev),
            on_device([len(q.tokens) for q in seqs], dev),
            impl=self.impl,
        )

    def write_rows(self, rows, seqs: list[Sequence], first: torch.Tensor) -> None:
        """Set the parameter rows of newly decoding sequences (one host-to-device copy per buffer)."""
        index = on_device(list(rows), self.device)
        self.params.next_tokens.index_copy_(0, index, first)
        values = [self.params.values(q) for q in seqs]
        for buf, column in zip(self.params.tensors[1:], zip(*values)):
            buf.index_copy_(0, index, on_device(list(column), self.device, buf.dtype))

    def decode(self, n: int) -> None:
        b = self.bucket_of[n]
        mode = "sample" if self.sampled_rows else "greedy"
        if b > n:
            self.params.positions[n:b].zero_()
        key = (b, mode)
        if key in self.graphs:
            self.graphs[key].replay()
            return
        self.decode_rows(b, mode)
        if self.cuda_graphs:
            self.graphs[key] = record_graph(self.device, None, lambda: self.decode_rows(b, mode))[0]

    def decode_rows(self, b: int, mode: str) -> None:
        """One decode forward over rows [0, b) and sampling into their next tokens: what a graph captures."""
        p = self.params
        logits = self.forward_decode(b)
        if mode == "greedy":
            argmax(logits, impl=self.impl, out=p.next_tokens[:b], advance=p.positions[:b])
            return
        sample_rows(logits, p.temperature[:b], p.top_k[:b], p.top_p[:b], p.seeds[:b], p.positions[:b] + 1,
                    impl=self.impl, out=p.next_tokens[:b], advance=p.positions[:b])

    def retire(self, seq: Sequence) -> None:
        """Take `seq` out of the decode rows (the last row moves into its hole); a no-op if it has none."""
        row = seq.row
        if row is None:
            return
        last = len(self.rows) - 1
        if row != last:
            self.move_row(last, row)
            # After the state copy: PyTorch kernels (launched without PDL) follow every state write
            # before the next decode step, whose Mamba-2 kernels load their states before their PDL
            # wait (`state_ready`; `enter` is followed by `write_rows` the same way).
            for buf in self.params.tensors:
                buf[row] = buf[last]
            moved = self.rows[last]
            self.rows[row], moved.row = moved, row
        self.rows.pop()
        seq.row = None
        self.sampled_rows -= not seq.request.sampling.greedy
        self.clear_row(last)

    def admit(self, seqs: list[Sequence]) -> None:
        """Prepare the state of newly admitted sequences."""

    def before_decode(self, grown: list[tuple[Sequence, int]]) -> None:
        """Host work before a decode step (the transformer writes the new block table entries of `grown`,
        see `Schedule`)."""

    def clear_row(self, row: int) -> None:
        """Make a row that no longer decodes harmless as padding."""


class PagedRunner(ARRunner):
    """The transformer over one paged KV pool; block tables [max_batch, max_blocks] int32."""

    def __init__(self, decoder, kv: PagedKVCache, max_batch: int, max_model_len: int, cuda_graphs: bool):
        super().__init__(decoder, max_batch, max_batch, cuda_graphs)
        self.kv = kv
        self.page = kv.block_size
        # Padding rows write their K/V into this block, which no request owns.
        (self.scratch,) = kv.pool.allocate(1)
        self.max_blocks = kv.blocks_needed(max_model_len)
        self.max_model_len = max_model_len
        self.tables = torch.full((max_batch, self.max_blocks), self.scratch, dtype=torch.int32, device=self.device)
        self.workspaces = {}

    def workspace(self, b: int):
        if self.impl != "triton":
            return None
        if b not in self.workspaces:
            c = self.decoder.config
            from declab_kernels import paged_attention, tuning

            self.workspaces[b] = paged_attention.decode_workspace(
                b, c.num_attention_heads, c.num_key_value_heads, c.head_dim, self.max_model_len, self.device,
                variant=tuning.attention_variant(b),
            )
        return self.workspaces[b]

    def prefill(self, chunks):
        if not chunks:
            return [], []
        from declab_arch import llama

        kv, dev = self.kv, self.device
        tokens, positions, slots, q_lens, seq_lens, ends, finished = [], [], [], [], [], [], []
        for seq, n in chunks:
            start = seq.computed
            tokens += seq.tokens[start : start + n]
            positions += range(start, start + n)
            slots.append(kv.append(seq.kv_seq, n))
            q_lens.append(n)
            seq.computed = start + n
            seq_lens.append(seq.computed)
            if seq.computed == len(seq.tokens):
                ends.append(sum(q_lens) - 1)
                finished.append(seq)
        cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        width = max(len(kv.blocks[s.kv_seq]) for s, _ in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, (s, _) in enumerate(chunks):
            table[i, : len(kv.blocks[s.kv_seq])] = torch.tensor(kv.blocks[s.kv_seq], dtype=torch.int32)
        batch = llama.PagedBatch(
            k_cache=kv.k, v_cache=kv.v, k_scale=kv.k_scale, v_scale=kv.v_scale, block_tables=on_device(table, dev),
            seq_lens=on_device(seq_lens, dev, torch.int32),
            slot_mapping=on_device(torch.cat(slots), dev), decode=False, cu_seqlens_q=on_device(cu, dev), max_seqlen_q=max(q_lens),
            impl=self.impl,
        )
        if not finished:
            # Nothing completes: the logits of one position are computed and dropped.
            ends = [0]
        logits = self.decoder.model.forward_paged(
            on_device(tokens, dev), on_device(positions, dev), batch, on_device(ends, dev)
        )
        return finished, list(logits[: len(finished)])

    def enter(self, seq: Sequence, row: int) -> None:
        # Its whole table: from here on, the scheduler reports each block it gains (`Schedule.grown`).
        blocks = self.kv.blocks[seq.kv_seq]
        self.tables[row, : len(blocks)] = on_device(blocks, self.device, torch.int32)

    def before_decode(self, grown: list[tuple[Sequence, int]]) -> None:
        rows, cols, values = [], [], []
        for seq, have in grown:
            blocks = self.kv.blocks[seq.kv_seq]
            for j in range(have, len(blocks)):
                rows.append(seq.row)
                cols.append(j)
                values.append(blocks[j])
        if rows:
            # One copy to the device: the flat entries of `tables`, then their values.
            width = self.tables.shape[1]
            k = len(rows)
            both = on_device([r * width + c for r, c in zip(rows, cols)] + values, self.device)
            self.tables.view(-1).index_copy_(0, both[:k], both[k:].to(torch.int32))

    def forward_decode(self, b: int) -> torch.Tensor:
        from declab_arch import llama

        p = self.params
        tokens, positions, tables = p.next_tokens[:b], p.positions[:b], self.tables[:b]
        # The decode attention finds the new row's page itself (slot_mapping None).
        batch = llama.PagedBatch(
            k_cache=self.kv.k, v_cache=self.kv.v, k_scale=self.kv.k_scale, v_scale=self.kv.v_scale, block_tables=tables,
            seq_lens=torch.add(positions, 1, out=torch.empty_like(positions, dtype=torch.int32)),
            slot_mapping=None, decode=True, impl=self.impl, workspace=self.workspace(b),
        )
        return self.decoder.model.forward_paged(tokens, positions, batch)

    def move_row(self, src: int, dst: int) -> None:
        self.tables[dst] = self.tables[src]

    def clear_row(self, row: int) -> None:
        self.tables[row] = self.scratch


class StateRunner(ARRunner):
    """A recurrent family (`RecurrentDecoder`) over its state tensors with 2 * max_batch rows: decode
    rows [0, max_batch), staging rows [max_batch, 2 * max_batch) for prompts being consumed."""

    def __init__(self, decoder, max_batch: int, cuda_graphs: bool):
        super().__init__(decoder, max_batch, max_batch, cuda_graphs)
        self.cache = decoder.new_cache([0] * (2 * max_batch), 1)
        # (tensor, its batch dimension), e.g. Mamba-2's conv [L, R, conv_dim, W] and ssm [L, R, H, P, N]
        self.states = decoder.state_tensors(self.cache)

    def staging(self, seq: Sequence) -> int:
        return self.max_batch + seq.slot

    def admit(self, seqs: list[Sequence]) -> None:
        """A fresh request starts from the zero state."""
        for t, dim in self.states:
            for seq in seqs:
                t.select(dim, self.staging(seq)).zero_()

    def prefill(self, chunks):
        if not chunks:
            return [], []
        finished, logits = [], []
        for (seq, n), out in zip(chunks, self.forward_chunks(chunks)):
            seq.computed += n
            if seq.computed == len(seq.tokens):
                finished.append(seq)
                logits.append(out)
        return finished, logits

    def forward_chunks(self, pieces) -> list[torch.Tensor]:
        """Consume each (sequence, n) chunk into its staging row from the state there; each chunk's last logits [V]."""
        width = max(n for _, n in pieces)
        tokens = on_device([seq.tokens[seq.computed : seq.computed + n] + [0] * (width - n) for seq, n in pieces], self.device)
        logits = self.decoder.chunk_forward(self.cache, tokens, [seq.computed for seq, _ in pieces], [n for _, n in pieces],
                                            rows=[self.staging(seq) for seq, _ in pieces])
        return list(logits)

    def enter(self, seq: Sequence, row: int) -> None:
        for t, dim in self.states:
            t.select(dim, row).copy_(t.select(dim, self.staging(seq)))

    def forward_decode(self, b: int) -> torch.Tensor:
        p = self.params
        return self.decoder.decode_forward(self.decoder.rows_view(self.cache, b), p.next_tokens[:b], p.positions[:b])

    def move_row(self, src: int, dst: int) -> None:
        for t, dim in self.states:
            t.select(dim, dst).copy_(t.select(dim, src))


class CohortScheduler:
    """Mask-Predict: which waiting requests start together as one cohort (one `decoder.prefill` batch
    whose passes they share). Greedy requests with the same canvas size (max_new_tokens) join the
    head of the queue's cohort, up to the free rows and `max_step_tokens` prompt tokens; a sampled
    request is a cohort of its own (its random stream is then `decoder.generate`'s alone). Several
    cohorts may start in one step while rows and the token budget last."""

    def __init__(self, max_batch: int, max_step_tokens: int):
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.free_slots = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[list[Sequence]]:
        cohorts, budget = [], self.max_step_tokens
        while self.waiting and len(self.running) < self.max_batch and (budget > 0 or not cohorts):
            head = self.waiting[0]
            cohort, budget = [head], budget - len(head.tokens)
            if head.request.sampling.greedy:
                for seq in list(self.waiting)[1:]:
                    if len(self.running) + len(cohort) == self.max_batch:
                        break
                    if (seq.request.sampling.greedy and seq.request.max_new_tokens == head.request.max_new_tokens
                            and len(seq.tokens) <= budget):
                        cohort.append(seq)
                        budget -= len(seq.tokens)
            for seq in cohort:
                self.waiting.remove(seq)
                seq.status = "decode"
                self.running.append(seq)
            cohorts.append(cohort)
        return cohorts

    def finish(self, seq: Sequence) -> None:
        (self.waiting if seq.status == "waiting" else self.running).remove(seq)
        seq.status = "finished"


@dataclass(eq=False)
class Cohort:
    seqs: list[Sequence]
    state: object  # the decoder's CanvasState


class CanvasRunner:
    """Mask-Predict cohorts: each step runs one refinement pass of every cohort (one forward each);
    a request's tokens are reported as its blocks become final. A cohort's KV blocks (its own pool,
    sized for it) are freed when its last request finishes or is cancelled."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.cohorts: list[Cohort] = []
        self.wait_s = 0.0
        self.gpu_s = None

    def start(self, seqs: list[Sequence]) -> None:
        request = seqs[0].request
        state = self.decoder.prefill([s.tokens for s in seqs], max_new_tokens=request.max_new_tokens, sampling=request.sampling)
        self.cohorts.append(Cohort(seqs, state))

    def execute(self) -> list[tuple[Sequence, list[int], bool]]:
        """One pass of every cohort; (sequence, its final tokens so far, whether its canvas is done)."""
        for cohort in self.cohorts:
            self.decoder.step(cohort.state)
        start = time.perf_counter()
        if self.decoder.device.type == "cuda":
            torch.cuda.synchronize(self.decoder.device)
        self.wait_s = time.perf_counter() - start
        out = []
        for cohort in list(self.cohorts):
            done = self.decoder.finished(cohort.state)
            final = self.decoder.output(cohort.state, [])
            out += [(seq, tokens, done) for seq, tokens in zip(cohort.seqs, final) if seq.status != "finished"]
            if done:
                self.drop(cohort)
        return out

    def drop(self, cohort: Cohort) -> None:
        self.decoder.release(cohort.state)
        self.cohorts.remove(cohort)

    def retire(self, seq: Sequence) -> None:
        """A cohort whose every request has finished is dropped now, its blocks freed."""
        for cohort in self.cohorts:
            if seq in cohort.seqs and all(s.status == "finished" or s is seq for s in cohort.seqs):
                self.drop(cohort)
                return

    def kv_blocks(self) -> tuple[int, int]:
        pools = [c.state.kv.pool for c in self.cohorts]
        return sum(p.num_blocks - p.num_free for p in pools), sum(p.num_blocks for p in pools)


class Engine:
    """Continuous batching over one decoder (see the module docstring). Options beyond the API:
    `num_blocks` / `kv_memory_bytes` size the transformer's block pool (default: room for max_batch
    requests of max_model_len tokens within 60% of the free GPU memory; on the CPU, max_batch
    requests of up to 1024 tokens), `max_model_len` caps prompt + max_new_tokens (default: the
    model's context, or what the pool holds), `cuda_graphs` (default: the decoder's setting)."""

    def __init__(self, decoder, max_batch: int = 64, max_step_tokens: int = 2048, max_waiting: int | None = None, *,
                 num_blocks: int | None = None, kv_memory_bytes: int | None = None, max_model_len: int | None = None,
                 cuda_graphs: bool | None = None):
        for name, value in (("max_batch", max_batch), ("max_step_tokens", max_step_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value!r}")
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0):
            raise UsageError(f"max_waiting must be a non-negative integer or None, got {max_waiting!r}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2):
            raise UsageError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.decoder = decoder
        self.family = decoder.family
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        if cuda_graphs and not (decoder.device.type == "cuda" and decoder.impl == "triton"):
            raise UsageError("cuda_graphs needs a CUDA device and impl='triton'")
        graphs = decoder.cuda_graphs if cuda_graphs is None else bool(cuda_graphs)
        limits = [x for x in (max_model_len, decoder.max_context) if x is not None]
        self.max_model_len = min(limits) if limits else None
        self.kv = None
        kind = decoder.state_kind
        if kind == "kv":
            self.kv = self._new_pool(num_blocks, kv_memory_bytes)
            usable_tokens = (self.kv.pool.num_blocks - 1) * self.kv.block_size
            self.max_model_len = min(self.max_model_len or usable_tokens, usable_tokens)
            if self.max_model_len < 2:
                raise UsageError(f"the KV pool of {self.kv.pool.num_blocks} blocks has no room for a request")
            self.runner = PagedRunner(decoder, self.kv, max_batch, self.max_model_len, graphs)
            self.scheduler = Scheduler(max_batch, max_step_tokens, kv=self.kv, max_chunk=decoder.chunk_tokens(self.max_model_len))
        elif kind == "recurrent":
            self.runner = StateRunner(decoder, max_batch, graphs)
            self.scheduler = Scheduler(max_batch, max_step_tokens, slots=max_batch, max_chunk=decoder.prefill_chunk)
        elif kind == "canvas":
            self.runner = CanvasRunner(decoder)
            self.scheduler = CohortScheduler(max_batch, max_step_tokens)
        else:
            raise UsageError(f"the engine does not run the {self.family} family")
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._cancelled: list[Sequence] = []
        self._pending: Pending | None = None
        self.finished = 0
        self.tokens_generated = 0
        self.steps = 0
        self.host_s_last = self.host_s_total = 0.0
        # The same counters over the steps that consumed prompt tokens (or started a Mask-Predict cohort)
        self.prefill_steps = 0
        self.prefill_host_s_total = self.prefill_step_s_total = 0.0
        self._prefilled = False
        self.step_s_last = self.step_s_total = 0.0

    def _new_pool(self, num_blocks, kv_memory_bytes) -> PagedKVCache:
        d = self.decoder
        c = d.config
        if num_blocks is None and kv_memory_bytes is None:
            # Room for max_batch requests at the longest length (and the scratch block), within 60%
            # of the free GPU memory; on the CPU, max_batch requests of up to 1024 tokens.
            if d.device.type == "cuda":
                per_block = d.page_size * kv_token_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, d.kv_dtype)
                full = self.max_batch * -(-self.max_model_len // d.page_size) + 1
                num_blocks = min(full, int(0.6 * torch.cuda.mem_get_info(d.device)[0]) // per_block)
            else:
                num_blocks = self.max_batch * -(-min(self.max_model_len, 1024) // d.page_size) + 1
        try:
            return PagedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size=d.page_size,
                                num_blocks=num_blocks, memory_bytes=kv_memory_bytes, dtype=d.kv_dtype, device=d.device)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def add_request(self, request: Request) -> str:
        """Queue a request; returns its id. Refuses bad input (UsageError) before anything runs."""
        prompt = request.prompt
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.reshape(-1).tolist()
        if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
            raise UsageError("a request needs a prompt of at least one token")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise UsageError("prompt tokens must be integers")
        vocab = self.decoder.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise UsageError(f"prompt token {bad} is outside the vocabulary (0..{vocab - 1})")
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"max_new_tokens must be >= 1, got {n!r}")
        if not isinstance(request.sampling, Sampling):
            raise UsageError(f"sampling must be a decoders.Sampling, got {type(request.sampling).__name__}")
        if self.max_model_len is not None and len(prompt) + n > self.max_model_len:
            raise UsageError(f"prompt of {len(prompt)} tokens + max_new_tokens {n} is over the engine's maximum of "
                             f"{self.max_model_len} tokens")
        stop_ids = tuple(request.stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
            raise UsageError(f"stop_token_ids must be integers, got {stop_ids!r}")
        stop = frozenset(stop_ids)
        if isinstance(self.runner, CanvasRunner):
            self._check_canvas(n)
        rid = request.request_id
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while rid in self.seqs:
                rid = f"req-{next(self._ids)}"
        elif not isinstance(rid, str) or rid in self.seqs:
            raise UsageError(f"request_id {rid!r} must be a string not already in the engine")
        if self.max_waiting is not None and len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineFull(f"the engine's queue is full ({self.max_waiting} waiting requests)")
        seq = Sequence(request=request, id=rid, tokens=list(prompt), prompt_len=len(prompt), stop=stop)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def _check_canvas(self, n: int) -> None:
        d = self.decoder
        if d.block_length and n % d.block_length:
            raise UsageError(f"max_new_tokens {n} is not a multiple of {d.source}'s block_length {d.block_length}")
        if d.length_beam:
            cap = min(d.config.max_predicted_length, n)
            if d.length_beam > cap:
                raise UsageError(f"length_beam {d.length_beam} is more than the {cap} lengths the head can propose within {n} new tokens")

    def cancel(self, request_id: str) -> bool:
        """Free the request's blocks / slot now; the next step reports it finished ("cancelled").
        False if the engine holds no unfinished request of that id."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status == "finished":
            return False
        self.runner.retire(seq)
        self.scheduler.finish(seq)
        seq.finish_reason = "cancelled"
        self._cancelled.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._cancelled or self._pending)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduling iteration: admit, prefill chunks, one decode forward (Mask-Predict: one pass
        of every cohort); outputs of the requests that gained tokens or finished. For the
        autoregressive families the tokens are those of the previous call's launch (one step of
        lookahead, see the module docstring)."""
        start = time.perf_counter()
        self._prefilled = False
        if isinstance(self.runner, CanvasRunner):
            outputs = self._step_canvas()
        else:
            outputs = self._step_autoregressive()
        elapsed = time.perf_counter() - start
        self.steps += 1
        self.step_s_last = elapsed
        self.step_s_total += elapsed
        self.host_s_last = elapsed - self.runner.wait_s
        self.host_s_total += self.host_s_last
        if self._prefilled:
            self.prefill_steps += 1
            self.prefill_step_s_total += elapsed
            self.prefill_host_s_total += self.host_s_last
        return outputs

    def _step_autoregressive(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.runner.retire(seq)
        self.runner.admit(sched.admitted)
        self.runner.wait_s = 0.0
        self._prefilled = bool(sched.prefill)
        launched = self.runner.launch(sched) if (sched.decode or sched.prefill) else None
        cancelled = [self._output(seq, []) for seq in self._cancelled]
        self._cancelled = []
        previous, self._pending = self._pending, launched
        if previous is None:
            return cancelled
        # Each output carries the one token its request gained (tokens are output as they are committed).
        # The unfinished ones, the common case, are built here with positional arguments: one
        # RequestOutput per row is the largest share of a step's host time, keywords add half again.
        outputs = []
        for seq, token in self.runner.collect(previous):
            if seq.status == "finished":
                continue
            seq.tokens.append(token)
            generated = len(seq.tokens) - seq.prompt_len
            if token in seq.stop:
                seq.finish_reason = "stop"
            elif generated >= seq.request.max_new_tokens:
                seq.finish_reason = "length"
            else:
                outputs.append(RequestOutput(seq.id, [token], False, None, seq.prompt_len, generated))
                continue
            self.runner.retire(seq)
            self.scheduler.finish(seq)
            outputs.append(self._output(seq, [token]))
        self.tokens_generated += len(outputs)
        return cancelled + outputs

    def _step_canvas(self) -> list[RequestOutput]:
        for cohort in self.scheduler.schedule():
            self.runner.start(cohort)
            self._prefilled = True
        self.runner.wait_s = 0.0
        outputs = [self._output(seq, []) for seq in self._cancelled]
        self._cancelled = []
        for seq, final, done in (self.runner.execute() if self.runner.cohorts else []):
            new = final[seq.generated :]
            stop = next((i for i, t in enumerate(new) if t in seq.stop), None)
            if stop is not None:
                new = new[: stop + 1]
                seq.finish_reason = "stop"
            elif done:
                seq.finish_reason = "length"
            seq.tokens += new
            self.tokens_generated += len(new)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.runner.retire(seq)
            if new or seq.finish_reason is not None:
                outputs.append(self._output(seq, new))
        return outputs

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        """`seq`'s output, `new` its tokens since the last one (a request's tokens are output as soon as
        they are committed, so a cancelled request has none left)."""
        done = seq.finish_reason is not None
        if done:
            self.finished += 1
            del self.seqs[seq.id]
        return RequestOutput(request_id=seq.id, new_tokens=new, finished=done, finish_reason=seq.finish_reason,
                             prompt_tokens=seq.prompt_len, output_tokens=seq.generated)

    def stats(self) -> dict:
        s = self.scheduler
        out = {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "finished": self.finished,
            "preemptions": s.preemptions,
            "tokens_generated": self.tokens_generated,
            "steps": self.steps,
            "host_s_last": self.host_s_last,
            "host_s_total": self.host_s_total,
            "prefill_steps": self.prefill_steps,
            "prefill_host_s_total": self.prefill_host_s_total,
            "prefill_step_s_total": self.prefill_step_s_total,
            "step_s_last": self.step_s_last,
            "step_s_total": self.step_s_total,
            "gpu_s_last": self.runner.gpu_s,
            # Decode steps captured as CUDA graphs so far (one per bucket and sampling mode, at first use).
            "graphs_captured": len(getattr(self.runner, "graphs", ())),
        }
        if self.kv is not None:
            total = self.kv.pool.num_blocks - 1
            out["kv_blocks_used"], out["kv_blocks_total"] = total - self.kv.pool.num_free, total
        if isinstance(self.runner, CanvasRunner):
            out["kv_blocks_used"], out["kv_blocks_total"] = self.runner.kv_blocks()
        if s.free_slots is not None:
            out["slots_used"], out["slots_total"] = self.max_batch - len(s.free_slots), self.max_batch
        return out

    def run(self, requests) -> dict[str, list[int]]:
        """Add every request, step until all are done; new tokens per request id."""
        ids = [self.add_request(r) for r in requests]
        result = {rid: [] for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id] += out.new_tokens
        return result


def build_parser():
    from decoders import cli

    p = cli.Parser(prog="python -m decoders.engine", description="Saturated decode through the engine: "
                                "--batch requests of --ctx tokens (prompt + --new-tokens) admitted at once; decode tokens/s "
                                "and the host share of the step time.")
    p.add_argument("--model", default="llama-1b", help="preset or checkpoint folder (default llama-1b)")
    p.add_argument("--batch", type=int, default=64, help="requests, and the engine's max_batch (default 64)")
    p.add_argument("--ctx", type=int, default=1024, help="prompt + new tokens per request (default 1024)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per request (default 128)")
    p.add_argument("--max-step-tokens", type=int, default=2048, help="per-step token budget (default 2048)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--impl", default="auto", choices=["auto", "triton", "ref"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size (transformer)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (transformer): fp8 | bf16 | ... (default: the model's dtype)")
    p.add_argument("--quant", default=None, help="weight quantisation: int8, int4-rtn, int4-rtn-gN (on the fly), or int4 of a quantised folder (default: the model's own weights)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/engine.jsonl", help="JSON lines file the result is appended to (default runs/engine.jsonl)")
    return p


def measure(engine: "Engine", batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> dict:
    """Run `batch` requests admitted together; per-step wall, host and GPU times (GPU: CUDA only, of
    the step collected in that call) of the saturated steps (every request decoding, no prompt left)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    for p in prompts:
        engine.add_request(Request(prompt=p, max_new_tokens=new_tokens))
    start = time.perf_counter()
    first_token_s, walls, hosts, gpus = None, [], [], []
    while engine.has_unfinished():
        saturated = first_token_s is not None and engine.stats()["running"] == batch
        t = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t
        if saturated and len(outs) == batch and not any(o.finished for o in outs):
            walls.append(wall)
            hosts.append(engine.host_s_last)
            gpus.append(engine.runner.gpu_s)
        if first_token_s is None and engine.stats()["tokens_generated"] >= batch:
            first_token_s = time.perf_counter() - start
    return {"walls": walls, "hosts": hosts, "gpus": gpus, "first_token_s": first_token_s, "total_s": time.perf_counter() - start}


def main(argv=None) -> int:
    """Exit status 0, or 2 for input the lab refuses."""
    import json
    import statistics
    import sys

    import decoders
    from decoders.records import append_jsonl, environment
    from decoders.cli import check_records_file

    args = build_parser().parse_args(argv)
    with decoders.user_errors():
        if args.batch < 1 or args.new_tokens < 1 or args.new_tokens >= args.ctx:
            raise UsageError(f"need --batch >= 1 and 1 <= --new-tokens < --ctx, got {args.batch}, {args.new_tokens}, {args.ctx}")
        out = check_records_file(args.out, "--out")
        record = decoders.family_class(decoders.family_of(args.model))
        if record.state_kind == "canvas":
            raise UsageError("the measuring command runs the autoregressive families (a Mask-Predict cohort is a static "
                             "batch: python -m decoders.compare measures it)")
        options = {"page_size": args.page_size} if record.state_kind == "kv" else {}
        if args.kv_dtype is not None:
            options["kv_dtype"] = args.kv_dtype
        dec = decoders.load(args.model, device=args.device, dtype=args.dtype, impl=args.impl, seed=args.seed, quant=args.quant, **options)
        engine = Engine(dec, max_batch=args.batch, max_step_tokens=args.max_step_tokens, max_model_len=args.ctx)
        prompt_len = args.ctx - args.new_tokens
        # Warm-up: compiles and autotunes the kernels and captures the decode graph of this batch.
        measure(engine, args.batch, prompt_len, min(args.new_tokens, 4), dec.vocab_size, args.seed + 1)
        run = measure(engine, args.batch, prompt_len, args.new_tokens, dec.vocab_size, args.seed)
    walls, hosts, gpus = run["walls"], run["hosts"], run["gpus"]
    if not walls:
        print("error: no saturated decode step was measured (raise --new-tokens)", file=sys.stderr)
        return 2
    step = statistics.median(walls)
    record = {
        **dec.describe(), "batch": args.batch, "ctx": args.ctx, "new_tokens": args.new_tokens,
        "max_step_tokens": args.max_step_tokens, "page_size": args.page_size, "saturated_steps": len(walls),
        "step_s_p50": step, "host_s_p50": statistics.median(hosts), "host_fraction": sum(hosts) / sum(walls),
        # The share of the step time the GPU waits for the host (CUDA only): the overhead the host adds.
        "gpu_s_p50": statistics.median(gpus) if None not in gpus else None,
        "gpu_idle_fraction": max(0.0, 1 - sum(gpus) / sum(walls)) if None not in gpus else None,
        "decode_tok_s": args.batch / step, "first_token_s": run["first_token_s"], "total_s": run["total_s"],
        "env": environment(dec.device),
    }
    append_jsonl(out, record)
    idle = record["gpu_idle_fraction"]
    print(f"{'model':<14} {'batch':>5} {'ctx':>6} {'decode tok/s':>12} {'step ms':>8} {'host ms':>8} {'host %':>6} {'GPU idle %':>10}")
    print(f"{dec.source:<14} {args.batch:>5} {args.ctx:>6} {record['decode_tok_s']:>12.0f} {step * 1e3:>8.3f} "
          f"{record['host_s_p50'] * 1e3:>8.3f} {100 * record['host_fraction']:>6.1f} {'-' if idle is None else f'{100 * idle:.1f}':>10}")
    # The last stdout line stays short: the whole record is in --out.
    print(json.dumps({"out": str(out), **{k: record[k] for k in ("model", "batch", "ctx", "new_tokens", "decode_tok_s", "step_s_p50",
                                                                "host_fraction", "gpu_idle_fraction")}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
