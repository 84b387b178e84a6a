"""The persistent step's schedule (`declab_kernels.persistent_step.schedule`): the work list run by
virtual programs in random interleavings has no hazard and no deadlock, and broken lists are caught."""

import pytest

import persistent_schedule_cases as cases
from declab_kernels.persistent_step import schedule as S
from declab_kernels.persistent_step.launch import _chunk

TINY = S.StepShape(d_model=64, inter=176, vocab=512, n_layers=2, hq=4, hkv=2, head_dim=16, num_splits=3)
# One kv head a program group, no GQA, one split: the other corner of the attention's items.
MHA = S.StepShape(d_model=96, inter=128, vocab=300, n_layers=3, hq=3, hkv=3, head_dim=32, num_splits=1)


@pytest.mark.parametrize("shape", [TINY, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("programs", [1, 3, 8, 40])
def test_work_list_runs_in_any_interleaving(shape, programs):
    cases.runs_in_any_interleaving(S, shape, programs, seeds=10)


def test_every_output_row_is_covered_once():
    tiles = S.choose_tiles(TINY, 8)
    n = S.stage_tiles(TINY, tiles)
    items = S.work_list(TINY, tiles)
    assert len(items) == 1 + TINY.n_layers * sum(n[s] for s in (S.QKV, S.ATTN, S.O, S.GU, S.DOWN)) + n[S.HEAD]
    head_rows = [key for it in items if it.stage == S.HEAD for key, _ in S.item_data(TINY, tiles, it)[1]]
    assert sorted(r for _, r in head_rows) == list(range(TINY.vocab))


def test_choose_rows_weighs_rows_against_items():
    # 3072 rows of 2048 over 264 programs: one 16-row item (32 K weights + one item's cost) beats three 4-row ones.
    assert S.choose_rows(3072, 2048, 264) == 16
    # 2048 rows: 8 rows each at 4 or 8 rows a tile, one item fewer at 8; 16-row tiles would load 128 programs twice as much.
    assert S.choose_rows(2048, 2048, 264) == 8
    assert S.choose_rows(2048, 8192, 264) == 8
    assert S.choose_rows(64, 64, 1) == 32
    # A cap: the cheapest of the tiles up to it.
    assert S.choose_rows(64, 64, 1, max_rows=8) == 8
    assert S.choose_rows(8512, 2048, 264, max_rows=8) == 8


C = S.Counters(TINY.n_layers, TINY.hkv)
BROKEN = {
    "o waits for one merge too few": (lambda it: it.stage == S.O and it.layer == 1, dict(wait_count=TINY.hkv - 1), "reads"),
    "qkv of layer 1 does not wait": (lambda it: it.stage == S.QKV and it.layer == 1, dict(wait=-1, wait_count=0), "reads"),
    "gate/up waits for the merges, not o": (lambda it: it.stage == S.GU and it.layer == 0, dict(wait=C.comb(0), wait_count=TINY.hkv), "reads"),
    "head waits for one down tile": (lambda it: it.stage == S.HEAD, dict(wait_count=1), "reads"),
    "a split short of the merge": (lambda it: it.stage == S.ATTN, dict(ticket_count=TINY.num_splits - 1), "merges"),
    "qkv waits on a later stage": (lambda it: it.stage == S.QKV and it.layer == 0, dict(wait=C.o(0), wait_count=1), "deadlock"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_work_list_is_caught(name):
    predicate, change, says = BROKEN[name]
    tiles = S.choose_tiles(TINY, 8)
    items = cases.broken(S.work_list(TINY, tiles), predicate, **change)
    cases.assert_caught(S, TINY, tiles, items, 8, says)



def test_an_odd_gemv_depth_is_refused():
    # The GEMV tile loads column pairs (one 32-bit word of two bf16 values).
    assert _chunk(8, 2048) == 512
    with pytest.raises(ValueError, match="even"):
        _chunk(8, 47)
