"""Paged KV cache bookkeeping: allocation, growth, fork with copy-on-write, free, exhaustion, no leaks."""

import pytest
import torch

from decoders.kv_cache import BlockPool, KVCacheExhausted, PagedKVCache


def make_cache(num_blocks=8, block_size=16):
    return PagedKVCache(2, 2, 4, block_size=block_size, num_blocks=num_blocks)


def test_pool_allocates_and_releases_with_reference_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and sorted(a) == [0, 1, 2]
    pool.share(a[0])
    pool.release(a[0])
    assert pool.num_free == 1
    pool.release(a[0])
    assert pool.num_free == 2
    with pytest.raises(KVCacheExhausted, match="need 3 more blocks, 2 of 4 free"):
        pool.allocate(3)


def test_sequence_grows_block_by_block_and_slots_follow_the_table():
    cache = make_cache()
    s = cache.add_sequence()
    slots = cache.append(s, 20)
    assert len(cache.blocks[s]) == 2
    table = cache.blocks[s]
    expected = [table[p // 16] * 16 + p % 16 for p in range(20)]
    assert slots.tolist() == expected
    more = cache.append(s, 13)
    assert len(cache.blocks[s]) == 3 and cache.lengths[s] == 33
    assert more.tolist() == [cache.blocks[s][p // 16] * 16 + p % 16 for p in range(20, 33)]


def test_fork_shares_full_blocks_and_copies_the_partial_block_on_write():
    cache = make_cache()
    parent = cache.add_sequence()
    cache.append(parent, 20)
    cache.k[:, cache.blocks[parent][1], :4] = 7.0
    child = cache.fork(parent)
    assert cache.blocks[child] == cache.blocks[parent]
    assert all(cache.pool.ref_counts[b] == 2 for b in cache.blocks[parent])
    free_before = cache.pool.num_free
    cache.append(child, 1)
    # The shared, partly filled second block was copied for the child; the first stays shared.
    assert cache.blocks[child][0] == cache.blocks[parent][0]
    assert cache.blocks[child][1] != cache.blocks[parent][1]
    assert cache.pool.num_free == free_before - 1
    assert torch.equal(cache.k[:, cache.blocks[child][1]], cache.k[:, cache.blocks[parent][1]])
    assert cache.pool.ref_counts[cache.blocks[parent][1]] == 1


def test_fork_at_block_boundary_copies_nothing():
    cache = make_cache()
    parent = cache.add_sequence()
    cache.append(parent, 32)
    child = cache.fork(parent)
    free_before = cache.pool.num_free
    cache.append(child, 1)
    assert cache.pool.num_free == free_before - 1
    assert cache.blocks[child][:2] == cache.blocks[parent][:2]


def test_free_returns_every_block_no_leak():
    cache = make_cache()
    a = cache.add_sequence()
    cache.append(a, 40)
    b = cache.fork(a)
    cache.append(b, 30)
    c = cache.add_sequence()
    cache.reserve(c, 16)
    for s in (a, b, c):
        cache.free(s)
    assert cache.pool.num_free == cache.pool.num_blocks
    assert all(r == 0 for r in cache.pool.ref_counts)


def test_exhaustion_is_a_clear_error_and_leaves_the_cache_usable():
    cache = make_cache(num_blocks=3)
    s = cache.add_sequence()
    cache.append(s, 40)
    with pytest.raises(KVCacheExhausted, match="KV cache exhausted"):
        cache.append(s, 20)
    cache.free(s)
    assert cache.pool.num_free == 3


def test_sized_from_a_memory_budget():
    per_block = 2 * 2 * 16 * 2 * 4 * 4
    cache = PagedKVCache(2, 2, 4, block_size=16, memory_bytes=10 * per_block + 5)
    assert cache.pool.num_blocks == 10 and cache.bytes_per_block == per_block


@pytest.mark.parametrize("size", [8, 24, 512])
def test_page_size_must_be_a_power_of_two_from_16_to_256(size):
    with pytest.raises(ValueError, match="page size"):
        make_cache(block_size=size)


def test_block_table_is_a_device_tensor_padded_with_zeros():
    cache = make_cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, 40)
    cache.append(b, 5)
    table = cache.block_table([a, b])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == cache.blocks[a] and table[1].tolist() == cache.blocks[b] + [0, 0]
