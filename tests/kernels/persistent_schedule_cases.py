"""What the persistent-step schedule tests of every family share (`schedule`, `schedule_mamba2`,
`schedule_rwkv7` have the same `choose_tiles`, `work_list` and `simulate`): a list run in random
interleavings, a list with some items changed, and the check that the simulation catches it."""

import dataclasses

import pytest

from declab_kernels.persistent_step import schedule as S


def runs_in_any_interleaving(family, shape, programs, seeds):
    """The family's list for `programs` programs run two steps in `seeds` random interleavings."""
    tiles = family.choose_tiles(shape, programs)
    items = family.work_list(shape, tiles)
    for seed in range(seeds):
        family.simulate(shape, tiles, items, programs, seed=seed, steps=2)


def broken(items, predicate, **change):
    """`items` with the fields `change` replaced in every item that `predicate` picks."""
    return [dataclasses.replace(it, **change) if predicate(it) else it for it in items]


def assert_caught(family, shape, tiles, items, programs, says):
    """Some of 20 random interleavings of `items` raises a ScheduleError matching `says`."""
    with pytest.raises(S.ScheduleError, match=says):
        for seed in range(20):
            family.simulate(shape, tiles, items, programs, seed=seed)
