"""The host side of the RWKV-7 persistent decode step: tile sizes, the work list, and its model.

The list has the llama step's format (`schedule.Item`, `schedule.FIELDS`: program p runs items p,
p + P, ... and every item waits on a counter that only grows) and runs in `schedule.Model`; only
the stages and what each reads and writes are the family's own. Per layer l, on the residual x
(model dtype, C channels, H heads of D):

    EMBED            x = embed[token], LayerNorm'd when the model has a pre-norm    signals embed
    TNORM l          h = LN(x); xs[m] = h + (shift - h) mix[m] for the six mixes (r, k, v, w, a, g);
                     shift = h (the time-mix token shift, in place)   waits val[l-1] (or embed)  signals tnorm[l]
    SEL   l, t       rows t of the packed [3C + R, C] down matrix times their own mixed input:
                     r, k, v, then the LoRA down-projections (v,) w, a, g     waits tnorm[l]     signals sel[l]
    MIX   l, h       head h: the LoRA activations and up-projections of its D channels, the time-mix
                     inputs (decay, in-context rate, value residual, key norm), the WKV-7 state update
                     (in place), the group norm, r_k bonus and gate      waits sel[l]         signals mix[l]
    O     l, t       rows t of x += mo @ Wo^T                              waits mix[l] (H)     signals o[l]
    CNORM l          h = LN(x); xk = h + (shift - h) x_k; shift = h       waits o[l]           signals cnorm[l]
    KEY   l, t       rows t of kv = xk @ Wkey^T                            waits cnorm[l]       signals key[l]
    VAL   l, t       rows t of x += relu(kv)^2 @ Wval^T                    waits key[l]         signals val[l]
    FNORM            hf = LN(x) (the final norm)                           waits val[L-1]       signals fnorm
    HEAD  t          rows t of hf @ Whead^T                                waits fnorm

A SEL tile never straddles two row blocks of the packed matrix (its rows divide C and every LoRA rank),
so one mixed input serves the whole tile. The states need no counter: a layer's two token-shift rows
are read and written by one item each (TNORM, CNORM), a head's WKV state by one MIX item; the next
launch reads them (launches are ordered), as in the Mamba-2 step. Layer 0's MIX items write v_first
(the value residual's target) for the later layers' MIX items of the same head, which wait on it
through the chain of counters between them.
"""

from dataclasses import dataclass

from declab_kernels.persistent_step import schedule
from declab_kernels.persistent_step.schedule import (CNORM, EMBED, FNORM, HEAD, KEY, MIX, O, SEL, TILE_ROWS, TNORM, VAL, Item,
                                                     cdiv, choose_rows)


@dataclass(frozen=True)
class RWKV7Shape:
    """The sizes a batch-1 RWKV-7 decode step is cut by (`rank_v`: the value LoRA's, absent in layer 0)."""

    d_model: int
    n_layers: int
    vocab: int
    head_dim: int
    inter: int
    rank_v: int
    rank_w: int
    rank_a: int
    rank_g: int

    @property
    def n_heads(self) -> int:
        return self.d_model // self.head_dim

    def ranks(self, layer: int) -> int:
        """Columns of layer `layer`'s packed LoRA up-projection."""
        return (self.rank_v if layer else 0) + self.rank_w + self.rank_a + self.rank_g

    def n_sel(self, layer: int) -> int:
        """Rows of layer `layer`'s packed down matrix: r, k, v, then the LoRA down-projections."""
        return 3 * self.d_model + self.ranks(layer)

    def blocks(self, layer: int) -> list[tuple[int, int, int]]:
        """(first row, rows, mixed input) of each row block of the packed down matrix; inputs r, k, v, w, a, g = 0..5."""
        C = self.d_model
        sizes = [(C, 0), (C, 1), (C, 2)] + ([(self.rank_v, 2)] if layer else []) + [(self.rank_w, 3), (self.rank_a, 4), (self.rank_g, 5)]
        out, row = [], 0
        for n, m in sizes:
            out.append((row, n, m))
            row += n
        return out


@dataclass(frozen=True)
class RWKV7Tiles:
    """Weight rows of a SEL, O, KEY, VAL and head tile."""

    sel_rows: int
    o_rows: int
    key_rows: int
    val_rows: int
    head_rows: int


def sel_rows(shape: RWKV7Shape, programs: int) -> int:
    """Rows of a SEL tile: of the TILE_ROWS dividing C and every rank, the one `choose_rows` would pick."""
    sizes = (shape.d_model, shape.rank_v, shape.rank_w, shape.rank_a, shape.rank_g)
    allowed = [bn for bn in TILE_ROWS if all(s % bn == 0 for s in sizes)]
    if not allowed:
        raise ValueError(f"persistent step: C and the LoRA ranks {sizes[1:]} must be multiples of {TILE_ROWS[0]}")
    bn = choose_rows(shape.n_sel(1), shape.d_model, programs)
    return max([b for b in allowed if b <= bn] or [min(allowed)])


def choose_tiles(shape: RWKV7Shape, programs: int) -> RWKV7Tiles:
    C = shape.d_model
    return RWKV7Tiles(sel_rows=sel_rows(shape, programs), o_rows=choose_rows(C, C, programs),
                      key_rows=choose_rows(shape.inter, C, programs), val_rows=choose_rows(C, shape.inter, programs),
                      head_rows=choose_rows(shape.vocab, C, programs))


@dataclass(frozen=True)
class Counters:
    """Where each counter sits in the int32 counter array: embed, seven a layer, fnorm."""

    n_layers: int

    @property
    def embed(self) -> int:
        return 0

    def _at(self, k: int, layer: int) -> int:
        return 1 + k * self.n_layers + layer

    def tnorm(self, layer: int) -> int:
        return self._at(0, layer)

    def sel(self, layer: int) -> int:
        return self._at(1, layer)

    def mix(self, layer: int) -> int:
        return self._at(2, layer)

    def o(self, layer: int) -> int:
        return self._at(3, layer)

    def cnorm(self, layer: int) -> int:
        return self._at(4, layer)

    def key(self, layer: int) -> int:
        return self._at(5, layer)

    def val(self, layer: int) -> int:
        return self._at(6, layer)

    @property
    def fnorm(self) -> int:
        return self._at(7, 0)

    @property
    def size(self) -> int:
        return self.fnorm + 1


def stage_tiles(shape: RWKV7Shape, tiles: RWKV7Tiles, layer: int = 1) -> dict[int, int]:
    """Items of each stage in layer `layer` (SEL has fewer rows in layer 0; EMBED, FNORM and HEAD: in all)."""
    return {EMBED: 1, TNORM: 1, SEL: cdiv(shape.n_sel(layer), tiles.sel_rows), MIX: shape.n_heads, O: cdiv(shape.d_model, tiles.o_rows),
            CNORM: 1, KEY: cdiv(shape.inter, tiles.key_rows), VAL: cdiv(shape.d_model, tiles.val_rows), FNORM: 1,
            HEAD: cdiv(shape.vocab, tiles.head_rows)}


def work_list(shape: RWKV7Shape, tiles: RWKV7Tiles) -> list[Item]:
    """The step's items in topological order (every wait is on items earlier in the list)."""
    c = Counters(shape.n_layers)
    items = [Item(EMBED, 0, 0, -1, 0, c.embed)]
    for l in range(shape.n_layers):
        n = stage_tiles(shape, tiles, l)
        before = (c.embed, 1) if l == 0 else (c.val(l - 1), n[VAL])
        items.append(Item(TNORM, l, 0, *before, c.tnorm(l)))
        items += [Item(SEL, l, t, c.tnorm(l), 1, c.sel(l)) for t in range(n[SEL])]
        items += [Item(MIX, l, h, c.sel(l), n[SEL], c.mix(l)) for h in range(n[MIX])]
        items += [Item(O, l, t, c.mix(l), n[MIX], c.o(l)) for t in range(n[O])]
        items.append(Item(CNORM, l, 0, c.o(l), n[O], c.cnorm(l)))
        items += [Item(KEY, l, t, c.cnorm(l), 1, c.key(l)) for t in range(n[KEY])]
        items += [Item(VAL, l, t, c.key(l), n[KEY], c.val(l)) for t in range(n[VAL])]
    n = stage_tiles(shape, tiles)
    items.append(Item(FNORM, 0, 0, c.val(shape.n_layers - 1), n[VAL], c.fnorm))
    items += [Item(HEAD, 0, t, c.fnorm, 1, -1) for t in range(n[HEAD])]
    return items


def item_data(shape: RWKV7Shape, tiles: RWKV7Tiles, item: Item) -> tuple[list, list]:
    """(reads, writes) of an item as ((buffer, index), version) pairs: x has ("in", l) before layer l's
    time mix and ("mid", l) after its o-projection; xs (by mix), y, mo, xk and kv the layer that wrote
    them; vf (v_first) and hf (the final norm's output) step 0."""
    l, C, D = item.layer, shape.d_model, shape.head_dim
    rows = lambda bn, total: range(item.tile * bn, min(total, (item.tile + 1) * bn))
    x_all = lambda v: [(("x", i), v) for i in range(C)]
    if item.stage == EMBED:
        return [], x_all(("in", 0))
    if item.stage == TNORM:
        return x_all(("in", l)), [(("xs", m), l) for m in range(6)]
    if item.stage == SEL:
        own = list(rows(tiles.sel_rows, shape.n_sel(l)))
        inputs = {m for first, n, m in shape.blocks(l) for r in own if first <= r < first + n}
        return [(("xs", m), l) for m in inputs], [(("y", r), l) for r in own]
    if item.stage == MIX:
        channels = range(item.tile * D, (item.tile + 1) * D)
        reads = [(("y", j * C + c), l) for j in range(3) for c in channels]
        reads += [(("y", r), l) for r in range(3 * C, shape.n_sel(l))]
        writes = [(("mo", c), l) for c in channels]
        if l:
            reads += [(("vf", c), 0) for c in channels]
        else:
            writes += [(("vf", c), 0) for c in channels]
        return reads, writes
    if item.stage == O:
        own = rows(tiles.o_rows, C)
        return [(("mo", c), l) for c in range(C)] + [(("x", r), ("in", l)) for r in own], [(("x", r), ("mid", l)) for r in own]
    if item.stage == CNORM:
        return x_all(("mid", l)), [(("xk",), l)]
    if item.stage == KEY:
        return [(("xk",), l)], [(("kv", r), l) for r in rows(tiles.key_rows, shape.inter)]
    if item.stage == VAL:
        own = rows(tiles.val_rows, C)
        return ([(("kv", r), l) for r in range(shape.inter)] + [(("x", r), ("mid", l)) for r in own],
                [(("x", r), ("in", l + 1)) for r in own])
    if item.stage == FNORM:
        return x_all(("in", shape.n_layers)), [(("hf",), 0)]
    return [(("hf",), 0)], [(("logits", i), 0) for i in rows(tiles.head_rows, shape.vocab)]


def simulate(shape: RWKV7Shape, tiles: RWKV7Tiles, items: list[Item], programs: int, *, seed: int, steps: int = 2) -> None:
    """Run `steps` consecutive steps of the work list on `programs` virtual programs in the
    interleaving `seed` draws; raise schedule.ScheduleError on any hazard or deadlock."""
    model = schedule.Model(items, programs, Counters(shape.n_layers).size, lambda it: item_data(shape, tiles, it))
    schedule.run(model, [(("logits", i), 0) for i in range(shape.vocab)], seed=seed, steps=steps)
