"""The host side of the Mamba-2 persistent decode step: tile sizes, the work list, and its model.

The list has the llama step's format (`schedule.Item`, `schedule.FIELDS`: program p runs items p,
p + P, ... and every item waits on a counter that only grows) and runs in `schedule.Model`; only
the stages and what each reads and writes are the family's own. Per layer l, on the float32 residual r:

    EMBED            r = embed[token]                                     signals embed
    IN    l, t       rows t of rmsnorm(r) @ Win^T (z, x, B, C, dt rows)    waits out[l-1] (or embed)  signals in[l]
    SSM   l, t       rows t of the heads' channels: conv + SiLU of x / B / C over the ring, the
                     state update (in place), y = state C + D x, g = y silu(z); stores g * norm
                     weight and the tile's sum of g^2               waits in[l]                 signals ssm[l]
    OUT   l, t       rows t of r += rmsnorm_gated(y) @ Wout^T: 1 / rms of the whole row from every
                     SSM tile's sum of squares, applied after the K loop  waits ssm[l]          signals out[l]
    HEAD  t          rows t of rmsnorm(r) @ Whead^T                        waits out[L-1]

SSM tile t covers rows `block_p` of one head (head t // (P / block_p)): its state tile, its x, z and
dt inputs are its own; B and C (one group, every head's) come from the whole in-projection, so the
tile waits for all of it. The states need no counter: a state tile is read and written by one item,
and the conv ring's written slot (this position's) is one no item of the step reads
(`declab_kernels.ssd.mamba2_decode_step`); both are read next by the following launch.
"""

from dataclasses import dataclass

from triton import next_power_of_2

from declab_kernels.persistent_step import schedule
from declab_kernels.persistent_step.schedule import EMBED, HEAD, IN, OUT, SSM, Item, cdiv, choose_rows

# Rows of a head an SSM tile may hold (powers of two): the smallest whose tiles fit in one wave of
# programs, so every head's state is streamed by as many programs as there are.
BLOCK_P_CHOICES = (8, 16, 32, 64)
# Rows of an in-projection tile at most, from a measurement (README, "Mamba-2's regression": under
# Triton 3.6 the 16-row normed K loop waits for 10 of its 26 loads each iteration, the 8-row one for
# none). Its item reads the float32 residual and rounds the normed row (`_gemv_item`'s ROUND_NORMED):
# at 16 rows an item of 64 KB took 30.6 us on an H200 (2.1 GB/s a program),
# at 8 rows 32 KB took 3.3 us and at 4 rows 16 KB 2.5 us; mamba2-1.3b's step 4629 / 1675 / 1991 us
# (`results/persistent_timeline.jsonl`, experiment `mamba2_in_rows`).
IN_MAX_ROWS = 8


@dataclass(frozen=True)
class Mamba2Shape:
    """The sizes a batch-1 Mamba-2 decode step is cut by (one norm group: `ngroups` of B and C)."""

    d_model: int
    n_layers: int
    vocab: int
    nheads: int
    headdim: int
    d_state: int
    ngroups: int
    d_conv: int

    @property
    def d_inner(self) -> int:
        return self.nheads * self.headdim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def n_in(self) -> int:
        """Rows of the in-projection: z, then x / B / C (the conv's channels), then dt."""
        return self.d_inner + self.conv_dim + self.nheads


@dataclass(frozen=True)
class Mamba2Tiles:
    """Weight rows of an in_proj, out_proj and head tile; rows of a head an SSM tile holds."""

    in_rows: int
    block_p: int
    out_rows: int
    head_rows: int


def choose_block_p(shape: Mamba2Shape, programs: int) -> int:
    """The smallest choice of BLOCK_P_CHOICES (up to the head's padded size) whose tiles fit on
    `programs` programs at once; the largest when none does."""
    choices = [b for b in BLOCK_P_CHOICES if b <= next_power_of_2(shape.headdim)] or [next_power_of_2(shape.headdim)]
    for b in choices:
        if shape.nheads * cdiv(shape.headdim, b) <= programs:
            return b
    return choices[-1]


def choose_tiles(shape: Mamba2Shape, programs: int) -> Mamba2Tiles:
    d = shape.d_model
    return Mamba2Tiles(in_rows=choose_rows(shape.n_in, d, programs, IN_MAX_ROWS), block_p=choose_block_p(shape, programs),
                       out_rows=choose_rows(d, shape.d_inner, programs), head_rows=choose_rows(shape.vocab, d, programs))


@dataclass(frozen=True)
class Counters:
    """Where each counter sits in the int32 counter array."""

    n_layers: int

    @property
    def embed(self) -> int:
        return 0

    def in_proj(self, layer: int) -> int:
        return 1 + layer

    def ssm(self, layer: int) -> int:
        return 1 + self.n_layers + layer

    def out_proj(self, layer: int) -> int:
        return 1 + 2 * self.n_layers + layer

    @property
    def size(self) -> int:
        return 1 + 3 * self.n_layers


def stage_tiles(shape: Mamba2Shape, tiles: Mamba2Tiles) -> dict[int, int]:
    """Items of each stage per layer (HEAD and EMBED: in all)."""
    return {EMBED: 1, IN: cdiv(shape.n_in, tiles.in_rows), SSM: shape.nheads * cdiv(shape.headdim, tiles.block_p),
            OUT: cdiv(shape.d_model, tiles.out_rows), HEAD: cdiv(shape.vocab, tiles.head_rows)}


def work_list(shape: Mamba2Shape, tiles: Mamba2Tiles) -> list[Item]:
    """The step's items in topological order (every wait is on items earlier in the list)."""
    c = Counters(shape.n_layers)
    n = stage_tiles(shape, tiles)
    items = [Item(EMBED, 0, 0, -1, 0, c.embed)]
    for layer in range(shape.n_layers):
        before = (c.embed, 1) if layer == 0 else (c.out_proj(layer - 1), n[OUT])
        items += [Item(IN, layer, t, *before, c.in_proj(layer)) for t in range(n[IN])]
        items += [Item(SSM, layer, t, c.in_proj(layer), n[IN], c.ssm(layer)) for t in range(n[SSM])]
        items += [Item(OUT, layer, t, c.ssm(layer), n[SSM], c.out_proj(layer)) for t in range(n[OUT])]
    items += [Item(HEAD, 0, t, c.out_proj(shape.n_layers - 1), n[OUT], -1) for t in range(n[HEAD])]
    return items


def ssm_channels(shape: Mamba2Shape, tiles: Mamba2Tiles, tile: int) -> tuple[int, list[int]]:
    """(head, its channels) of SSM tile `tile`: rows block_p * (tile % tiles a head) .. of the head."""
    per_head = cdiv(shape.headdim, tiles.block_p)
    h, b = divmod(tile, per_head)
    rows = range(b * tiles.block_p, min(shape.headdim, (b + 1) * tiles.block_p))
    return h, [h * shape.headdim + p for p in rows]


def item_data(shape: Mamba2Shape, tiles: Mamba2Tiles, item: Item) -> tuple[list, list]:
    """(reads, writes) of an item as ((buffer, index), version) pairs: r has ("in", l) before layer l;
    zx (the in-projection), y and ss (the SSM tiles' sums of squares) the layer that wrote them."""
    l = item.layer
    rows = lambda bn, total: range(item.tile * bn, min(total, (item.tile + 1) * bn))
    r_all = lambda v: [(("r", i), v) for i in range(shape.d_model)]
    if item.stage == EMBED:
        return [], r_all(("in", 0))
    if item.stage == IN:
        return r_all(("in", l)), [(("zx", i), l) for i in rows(tiles.in_rows, shape.n_in)]
    if item.stage == SSM:
        h, channels = ssm_channels(shape, tiles, item.tile)
        g, N, d_inner = h // (shape.nheads // shape.ngroups), shape.d_state, shape.d_inner
        group_bc = [d_inner + g * N + n for n in range(N)] + [d_inner + shape.ngroups * N + g * N + n for n in range(N)]
        # z, x (conv channel ch at zx row d_inner + ch), the group's B and C, the head's dt.
        needed = channels + [d_inner + ch for ch in channels + group_bc] + [d_inner + shape.conv_dim + h]
        return [(("zx", i), l) for i in needed], [(("y", ch), l) for ch in channels] + [(("ss", item.tile), l)]
    n_ssm = stage_tiles(shape, tiles)[SSM]
    if item.stage == OUT:
        own = rows(tiles.out_rows, shape.d_model)
        reads = [(("y", i), l) for i in range(shape.d_inner)] + [(("ss", t), l) for t in range(n_ssm)]
        return reads + [(("r", i), ("in", l)) for i in own], [(("r", i), ("in", l + 1)) for i in own]
    return r_all(("in", shape.n_layers)), [(("logits", i), 0) for i in rows(tiles.head_rows, shape.vocab)]


def simulate(shape: Mamba2Shape, tiles: Mamba2Tiles, items: list[Item], programs: int, *, seed: int, steps: int = 2) -> None:
    """Run `steps` consecutive steps of the work list on `programs` virtual programs in the
    interleaving `seed` draws; raise schedule.ScheduleError on any hazard or deadlock."""
    model = schedule.Model(items, programs, Counters(shape.n_layers).size, lambda it: item_data(shape, tiles, it))
    schedule.run(model, [(("logits", i), 0) for i in range(shape.vocab)], seed=seed, steps=steps)
