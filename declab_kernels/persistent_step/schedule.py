"""The host side of the persistent decode step: tile sizes, the work list, and a pure-Python model of it.

The work list is the step cut into items in topological order; program p of P runs items p, p + P,
p + 2P, ... in order. Each item is one row of int32 (`FIELDS`): what it computes (stage, layer, tile),
the counter it waits on and the count it waits for per step, the counter it adds one to when its
outputs are stored, and (attention only) the ticket counter whose last taker merges the splits.
Counters only grow: at step e (0, 1, ...) an item waits until its counter holds `wait_count * (e + 1)`,
so no launch resets them and a captured step replays as it is. The kernel (`triton.py`) reads the
waits from this list, so the model below, `simulate`, checks the very dependencies the GPU obeys.

Stages, per layer l (Hkv kv heads, S key splits):
    EMBED            x = embed[token]                                     signals embed
    QKV   l, t       rows t of rmsnorm(x) @ Wqkv^T        waits down[l-1] (or embed)  signals qkv[l]
    ATTN  l, h*S+s   split s of kv head h (RoPE, K/V row write)  waits qkv[l]; ticket[l, h]: the
                     last of the S splits merges them into attn[h]       signals comb[l] (merger only)
    O     l, t       rows t of x += attn @ Wo^T           waits comb[l] (Hkv)          signals o[l]
    GU    l, t       outputs t of silu(g) * u, [g; u] = rmsnorm(x) @ Wgu^T  waits o[l]  signals gu[l]
    DOWN  l, t       rows t of x += act @ Wdown^T         waits gu[l]                  signals down[l]
    HEAD  t          rows t of rmsnorm(x) @ Whead^T       waits down[L-1]
Every buffer (x, qkv, attn, act, the split partials) is reused by every layer; `simulate` checks that
no layer's write lands before the previous layer's reads of it are done. `Model` and `run` take any
family's list with its items' reads and writes (`schedule_mamba2` builds the Mamba-2 one).
"""

import random
from dataclasses import dataclass

# One numbering for every family's stages (EMBED, O and HEAD are shared; IN, SSM and OUT are the Mamba-2
# step's, `schedule_mamba2`; TNORM to FNORM the RWKV-7 step's, `schedule_rwkv7`), so a work list row
# and a timeline name mean the same in every kernel.
EMBED, QKV, ATTN, O, GU, DOWN, HEAD, IN, SSM, OUT, TNORM, SEL, MIX, CNORM, KEY, VAL, FNORM = range(17)
STAGE_NAMES = ("embed", "qkv", "attn", "o", "gu", "down", "head", "in", "ssm", "out", "tnorm", "sel", "mix", "cnorm", "key", "val",
               "fnorm")
# One row of the int32 work list.
FIELDS = ("stage", "layer", "tile", "wait", "wait_count", "signal", "ticket", "ticket_count")
# Rows of a GEMV tile the schedule may choose (powers of two; SwiGLU tiles hold half as many outputs).
TILE_ROWS = (4, 8, 16, 32)
# An item's fixed cost, counted as weight elements streamed: its row and weight pointer, its activation's first
# chunk, its stores, barrier and release are round trips of ~1 us in all, what a program streams of bf16
# weights in 1 us at its share of the bandwidth (4.3 TB/s over 264 programs: 16 KB).
ITEM_OVERHEAD_ELEMS = 8192


class ScheduleError(AssertionError):
    """A work list that reads data before it is written, overwrites data still being read, or deadlocks."""


@dataclass(frozen=True)
class StepShape:
    """The sizes a batch-1 llama decode step is cut by."""

    d_model: int
    inter: int
    vocab: int
    n_layers: int
    hq: int
    hkv: int
    head_dim: int
    num_splits: int

    @property
    def n_qkv(self) -> int:
        return (self.hq + 2 * self.hkv) * self.head_dim

    @property
    def group(self) -> int:
        return self.hq // self.hkv


@dataclass(frozen=True)
class Tiles:
    """Weight rows a tile of each GEMV stage holds (GU: gate and up rows together, half as many outputs)."""

    qkv: int
    o: int
    gu: int
    down: int
    head: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_rows(n_rows: int, k: int, programs: int, max_rows: int = TILE_ROWS[-1]) -> int:
    """Tile rows (at most `max_rows`) for a stage of n_rows weight rows of k columns over `programs` programs:
    the tile whose busiest program costs least, an item costing its weights plus ITEM_OVERHEAD_ELEMS (a tie:
    the larger tile)."""
    cost = {bn: cdiv(cdiv(n_rows, bn), programs) * (bn * k + ITEM_OVERHEAD_ELEMS) for bn in TILE_ROWS if bn <= max_rows}
    return max(bn for bn, c in cost.items() if c == min(cost.values()))


def choose_tiles(shape: StepShape, programs: int) -> Tiles:
    d, hd = shape.d_model, shape.hq * shape.head_dim
    return Tiles(qkv=choose_rows(shape.n_qkv, d, programs), o=choose_rows(d, hd, programs),
                 gu=choose_rows(2 * shape.inter, d, programs), down=choose_rows(d, shape.inter, programs),
                 head=choose_rows(shape.vocab, d, programs))


@dataclass(frozen=True)
class Counters:
    """Where each counter sits in the int32 counter array."""

    n_layers: int
    hkv: int

    @property
    def embed(self) -> int:
        return 0

    def qkv(self, layer: int) -> int:
        return 1 + layer

    def ticket(self, layer: int, head: int) -> int:
        return 1 + self.n_layers + layer * self.hkv + head

    def _after_tickets(self, k: int, layer: int) -> int:
        return 1 + self.n_layers * (1 + self.hkv) + k * self.n_layers + layer

    def comb(self, layer: int) -> int:
        return self._after_tickets(0, layer)

    def o(self, layer: int) -> int:
        return self._after_tickets(1, layer)

    def gu(self, layer: int) -> int:
        return self._after_tickets(2, layer)

    def down(self, layer: int) -> int:
        return self._after_tickets(3, layer)

    @property
    def size(self) -> int:
        return self._after_tickets(4, 0)


@dataclass(frozen=True)
class Item:
    stage: int
    layer: int
    tile: int
    wait: int  # counter index, -1: none
    wait_count: int  # per step
    signal: int  # counter index, -1: none
    ticket: int = -1
    ticket_count: int = 0

    def row(self) -> list[int]:
        return [getattr(self, f) for f in FIELDS]

    def __str__(self) -> str:
        return f"{STAGE_NAMES[self.stage]}(layer {self.layer}, tile {self.tile})"


def stage_tiles(shape: StepShape, tiles: Tiles) -> dict[int, int]:
    """Items of each stage per layer (HEAD and EMBED: in all)."""
    return {EMBED: 1, QKV: cdiv(shape.n_qkv, tiles.qkv), ATTN: shape.hkv * shape.num_splits, O: cdiv(shape.d_model, tiles.o),
            GU: cdiv(shape.inter, tiles.gu // 2), DOWN: cdiv(shape.d_model, tiles.down), HEAD: cdiv(shape.vocab, tiles.head)}


def work_list(shape: StepShape, tiles: Tiles) -> list[Item]:
    """The step's items in topological order (every wait is on items earlier in the list)."""
    c = Counters(shape.n_layers, shape.hkv)
    n = stage_tiles(shape, tiles)
    items = [Item(EMBED, 0, 0, -1, 0, c.embed)]
    for layer in range(shape.n_layers):
        before = (c.embed, 1) if layer == 0 else (c.down(layer - 1), n[DOWN])
        items += [Item(QKV, layer, t, *before, c.qkv(layer)) for t in range(n[QKV])]
        items += [Item(ATTN, layer, t, c.qkv(layer), n[QKV], c.comb(layer), c.ticket(layer, t // shape.num_splits), shape.num_splits)
                  for t in range(n[ATTN])]
        items += [Item(O, layer, t, c.comb(layer), shape.hkv, c.o(layer)) for t in range(n[O])]
        items += [Item(GU, layer, t, c.o(layer), n[O], c.gu(layer)) for t in range(n[GU])]
        items += [Item(DOWN, layer, t, c.gu(layer), n[GU], c.down(layer)) for t in range(n[DOWN])]
    items += [Item(HEAD, 0, t, c.down(shape.n_layers - 1), n[DOWN], -1) for t in range(n[HEAD])]
    return items


def item_data(shape: StepShape, tiles: Tiles, item: Item) -> tuple[list, list]:
    """(reads, writes) of an item as ((buffer, index), version) pairs, the version being what the
    value must hold when read (or holds once written): x has ("in", l) before layer l's attention
    block, ("mid", l) after its o-projection; qkv, attn, act and the partials the layer that wrote them."""
    l = item.layer
    rows = lambda bn, total: range(item.tile * bn, min(total, (item.tile + 1) * bn))
    x_all = lambda v: [(("x", i), v) for i in range(shape.d_model)]
    if item.stage == EMBED:
        return [], x_all(("in", 0))
    if item.stage == QKV:
        return x_all(("in", l)), [(("qkv", r), l) for r in rows(tiles.qkv, shape.n_qkv)]
    if item.stage == ATTN:
        h, s = divmod(item.tile, shape.num_splits)
        D, G = shape.head_dim, shape.group
        heads = [h * G + g for g in range(G)] + [shape.hq + h, shape.hq + shape.hkv + h]
        return [(("qkv", hd * D + d), l) for hd in heads for d in range(D)], [(("part", h, s), l)]
    if item.stage == O:
        own = rows(tiles.o, shape.d_model)
        return ([(("attn", h), l) for h in range(shape.hkv)] + [(("x", r), ("in", l)) for r in own],
                [(("x", r), ("mid", l)) for r in own])
    if item.stage == GU:
        return x_all(("mid", l)), [(("act", r), l) for r in rows(tiles.gu // 2, shape.inter)]
    if item.stage == DOWN:
        own = rows(tiles.down, shape.d_model)
        return ([(("act", r), l) for r in range(shape.inter)] + [(("x", r), ("mid", l)) for r in own],
                [(("x", r), ("in", l + 1)) for r in own])
    return x_all(("in", shape.n_layers)), [(("logits", r), 0) for r in rows(tiles.head, shape.vocab)]


def merge_data(shape: StepShape, item: Item) -> tuple[list, list]:
    """(reads, writes) of the merge the last split of a kv head runs after its ticket."""
    h = item.tile // shape.num_splits
    return [(("part", h, s), item.layer) for s in range(shape.num_splits)], [(("attn", h), item.layer)]


class Model:
    """P virtual programs executing a work list over versioned data, one event at a time.

    `data(item)` gives an item's (reads, writes) as ((buffer, index), version) pairs; `merge(item)` those
    of the merge the last taker of an item's ticket runs (None: no item takes tickets). An item is two
    events: `begin` (its wait is satisfied: its reads are checked and held) and `end` (its writes land,
    its counter and ticket advance; the last ticket taker's merge runs then, as one more read-and-write).
    A read of a value that does not yet hold the version it needs, and a write to a value another
    program is still reading, raise ScheduleError; so does a state where no program can move while
    items remain (a deadlock).
    """

    def __init__(self, items: list[Item], programs: int, n_counters: int, data, merge=None):
        self.items, self.programs = items, programs
        self.data_of, self.merge_of = data, merge
        self.data: dict = {}
        self.counters = [0] * n_counters
        self.reading: dict = {}
        self.epoch = 0

    def check_reads(self, item, reads, what="reads"):
        # Versions carry the step too, so a value left from the step before never passes for this one's.
        for key, version in reads:
            if self.data.get(key) != (version, self.epoch):
                raise ScheduleError(f"{item} {what} {key} expecting {version} of step {self.epoch}, holding {self.data.get(key)}")

    def write(self, item, writes, program):
        for key, version in writes:
            others = [p for p in self.reading.get(key, ()) if p != program]
            if others:
                raise ScheduleError(f"{item} writes {key} while program {others[0]} still reads it")
            self.data[key] = (version, self.epoch)

    def run_step(self, epoch: int, rng: random.Random) -> None:
        """One step (epoch = steps before it) with the programs' events interleaved by `rng`."""
        self.epoch = epoch
        queues = [list(range(p, len(self.items), self.programs)) for p in range(self.programs)]
        begun = [None] * self.programs
        while any(queues) or any(b is not None for b in begun):
            movable = []
            for p in range(self.programs):
                if begun[p] is not None:
                    movable.append(p)
                elif queues[p]:
                    item = self.items[queues[p][0]]
                    if item.wait < 0 or self.counters[item.wait] >= item.wait_count * (epoch + 1):
                        movable.append(p)
            if not movable:
                stuck = [str(self.items[q[0]]) for q in queues if q]
                raise ScheduleError(f"deadlock at step {epoch}: every program waits ({', '.join(stuck[:3])} ...)")
            p = rng.choice(movable)
            if begun[p] is None:
                item = self.items[queues[p].pop(0)]
                reads, _ = self.data_of(item)
                self.check_reads(item, reads)
                for key, _ in reads:
                    self.reading.setdefault(key, set()).add(p)
                begun[p] = item
                continue
            item = begun[p]
            reads, writes = self.data_of(item)
            for key, _ in reads:
                self.reading[key].discard(p)
            self.write(item, writes, p)
            begun[p] = None
            if item.ticket >= 0:
                self.counters[item.ticket] += 1
                if self.counters[item.ticket] < item.ticket_count * (epoch + 1):
                    continue
                m_reads, m_writes = self.merge_of(item)
                self.check_reads(item, m_reads, "merges")
                self.write(item, m_writes, p)
            if item.signal >= 0:
                self.counters[item.signal] += 1


def run(model: Model, outputs: list, *, seed: int, steps: int) -> None:
    """Run `steps` consecutive steps of a model's work list in the interleaving `seed` draws, checking
    after each that `outputs` ((buffer, index), version) hold that step's values; raise ScheduleError on
    any hazard or deadlock."""
    rng = random.Random(seed)
    for epoch in range(steps):
        model.run_step(epoch, rng)
        model.check_reads("the step's output", outputs)


def simulate(shape: StepShape, tiles: Tiles, items: list[Item], programs: int, *, seed: int, steps: int = 2) -> None:
    """Run `steps` consecutive steps of the llama work list on `programs` virtual programs in the
    interleaving `seed` draws; raise ScheduleError on any hazard or deadlock."""
    model = Model(items, programs, Counters(shape.n_layers, shape.hkv).size, lambda it: item_data(shape, tiles, it),
                  lambda it: merge_data(shape, it))
    run(model, [(("logits", r), 0) for r in range(shape.vocab)], seed=seed, steps=steps)
