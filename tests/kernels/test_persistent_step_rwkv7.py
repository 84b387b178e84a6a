"""The RWKV-7 persistent step's schedule (`declab_kernels.persistent_step.schedule_rwkv7`): the work list
run by virtual programs in random interleavings has no hazard and no deadlock, every output is covered
once, SEL tiles never straddle two row blocks of the packed matrix, and broken lists are caught."""

import dataclasses

import pytest

import persistent_schedule_cases as cases
from declab_kernels.persistent_step import schedule as S
from declab_kernels.persistent_step import schedule_rwkv7 as R

# rwkv7-tiny's shape.
TINY = R.RWKV7Shape(d_model=64, n_layers=2, vocab=512, head_dim=16, inter=256, rank_v=8, rank_w=16, rank_a=16, rank_g=32)
# Three layers, an odd vocabulary and FFN width, ranks that allow only 4-row SEL tiles.
ODD = R.RWKV7Shape(d_model=48, n_layers=3, vocab=301, head_dim=16, inter=100, rank_v=4, rank_w=12, rank_a=8, rank_g=20)
# rwkv7-1.5b's shape.
BIG = R.RWKV7Shape(d_model=2048, n_layers=24, vocab=65536, head_dim=64, inter=8192, rank_v=64, rank_w=96, rank_a=96, rank_g=256)


@pytest.mark.parametrize("shape", [TINY, ODD], ids=["tiny", "odd"])
@pytest.mark.parametrize("programs", [1, 3, 8, 40])
def test_work_list_runs_in_any_interleaving(shape, programs):
    cases.runs_in_any_interleaving(R, shape, programs, seeds=6)


def test_every_output_is_covered_once():
    tiles = R.choose_tiles(ODD, 8)
    items = R.work_list(ODD, tiles)
    n0, n1 = R.stage_tiles(ODD, tiles, 0), R.stage_tiles(ODD, tiles, 1)
    per_layer = lambda n: 1 + n[S.SEL] + n[S.MIX] + n[S.O] + 1 + n[S.KEY] + n[S.VAL]
    assert len(items) == 1 + per_layer(n0) + (ODD.n_layers - 1) * per_layer(n1) + 1 + n1[S.HEAD]
    written = lambda stage, layer, buf: sorted(key[1] for it in items if it.stage == stage and it.layer == layer
                                               for key, _ in R.item_data(ODD, tiles, it)[1] if key[0] == buf)
    # Layer 0 has no value LoRA: its packed matrix is rank_v rows shorter.
    assert written(S.SEL, 0, "y") == list(range(ODD.n_sel(0))) and written(S.SEL, 2, "y") == list(range(ODD.n_sel(2)))
    assert written(S.MIX, 1, "mo") == list(range(ODD.d_model))
    assert written(S.MIX, 0, "vf") == list(range(ODD.d_model)) and written(S.MIX, 1, "vf") == []
    assert written(S.KEY, 2, "kv") == list(range(ODD.inter))
    assert written(S.HEAD, 0, "logits") == list(range(ODD.vocab))


@pytest.mark.parametrize("shape, programs, rows", [(TINY, 1, 8), (ODD, 1, 4), (BIG, 264, 32), (BIG, 1, 32)])
def test_sel_tiles_stay_inside_one_row_block(shape, programs, rows):
    tiles = R.choose_tiles(shape, programs)
    assert tiles.sel_rows == rows
    for layer in (0, 1):
        for first, n, _ in shape.blocks(layer):
            assert first % rows == 0 and n % rows == 0


def test_ranks_no_tile_divides_are_refused():
    with pytest.raises(ValueError, match="multiples"):
        R.choose_tiles(dataclasses.replace(TINY, rank_v=6), 8)


C = R.Counters(TINY.n_layers)
N_SEL = R.stage_tiles(TINY, R.choose_tiles(TINY, 8), 1)[S.SEL]
BROKEN = {
    "mix waits for one sel tile too few": (lambda it: it.stage == S.MIX and it.layer == 1, dict(wait_count=N_SEL - 1), "reads"),
    "o waits for half the heads": (lambda it: it.stage == S.O and it.layer == 0, dict(wait_count=2), "reads"),
    "tnorm of layer 1 does not wait": (lambda it: it.stage == S.TNORM and it.layer == 1, dict(wait=-1, wait_count=0), "reads|writes"),
    "cnorm waits on the mix stage": (lambda it: it.stage == S.CNORM and it.layer == 1, dict(wait=C.mix(1), wait_count=4), "reads"),
    "val waits for one key tile": (lambda it: it.stage == S.VAL and it.layer == 0, dict(wait_count=1), "reads"),
    "head waits on the last val tiles": (lambda it: it.stage == S.HEAD, dict(wait=C.val(1), wait_count=1), "reads"),
    "sel waits on a later stage": (lambda it: it.stage == S.SEL and it.layer == 0, dict(wait=C.o(0), wait_count=1), "deadlock"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_work_list_is_caught(name):
    predicate, change, says = BROKEN[name]
    tiles = R.choose_tiles(TINY, 8)
    assert R.stage_tiles(TINY, tiles)[S.MIX] == 4
    items = cases.broken(R.work_list(TINY, tiles), predicate, **change)
    cases.assert_caught(R, TINY, tiles, items, 8, says)
