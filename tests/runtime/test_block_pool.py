"""Unit tests of the KV block pool: ref counts, prefix-cache hashing, hits and LRU eviction."""

import pytest

from llmc.runtime.block_pool import BlockPool, hash_block_tokens, hash_token_blocks


def cached_pool(num_blocks: int, token_ids: list[int], block_size: int = 2) -> BlockPool:
    """A pool whose first blocks hold `token_ids` (full blocks), registered and then freed."""
    pool = BlockPool(num_blocks, block_size)
    hashes = hash_token_blocks(token_ids, block_size)
    blocks = pool.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes):
        assert pool.cache_block(block, block_hash)
    pool.free(blocks)
    pool.check_invariants()
    return pool


def test_allocate_and_free_track_ref_counts():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    blocks = pool.allocate(3)
    assert sorted(block.block_id for block in blocks) == [0, 1, 2]
    assert all(block.ref_count == 1 for block in blocks)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.check_invariants()
    pool.free(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    assert all(block.ref_count == 0 for block in pool.blocks)
    pool.check_invariants()


def test_allocate_beyond_free_and_double_free_raise():
    pool = BlockPool(num_blocks=2, block_size=2)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])


def test_hash_chain_includes_parent():
    hashes = hash_token_blocks([1, 2, 3, 4, 5], block_size=2)
    assert len(hashes) == 2  # the trailing partial block [5] gets no hash
    assert hashes[0] == hash_block_tokens(None, [1, 2])
    assert hashes[1] == hash_block_tokens(hashes[0], [3, 4])
    # The same tokens under another parent (or none) hash differently: equal hash = equal prefix.
    assert hashes[1] != hash_block_tokens(None, [3, 4])
    assert hashes[1] != hash_token_blocks([9, 9, 3, 4], block_size=2)[1]
    # Stable: recomputing gives the same digest.
    assert hash_token_blocks([1, 2, 3, 4], block_size=2) == hashes
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_prefix_hit_returns_longest_chain_and_share_counts():
    pool = cached_pool(num_blocks=4, token_ids=[1, 2, 3, 4])
    assert pool.num_free_blocks == 4 and pool.num_free_cached_blocks == 2
    hit = pool.find_cached_prefix([1, 2, 3, 4, 5, 6])
    assert [block.block_id for block in hit] == [0, 1]
    assert [block.block_id for block in pool.find_cached_prefix([1, 2, 7, 7])] == [0]
    assert pool.find_cached_prefix([2, 1, 3, 4]) == []  # first block differs: nothing matches
    assert pool.can_allocate(2, hit) and not pool.can_allocate(3, hit)
    pool.share(hit)
    pool.share(hit[:1])
    assert [block.ref_count for block in hit] == [2, 1]
    assert pool.num_free_blocks == 2
    pool.check_invariants()
    pool.free(hit)
    pool.free(hit[:1])
    assert pool.num_free_blocks == 4 and pool.num_free_cached_blocks == 2
    pool.check_invariants()


def test_chain_breaks_at_a_missing_parent():
    pool = BlockPool(num_blocks=4, block_size=2)
    hashes = hash_token_blocks([1, 2, 3, 4], block_size=2)
    block = pool.allocate(1)[0]
    pool.cache_block(block, hashes[1])  # only the second block of the chain is cached
    assert pool.find_cached_prefix([1, 2, 3, 4]) == []


def test_fresh_allocation_prefers_uncached_then_evicts_least_recently_freed():
    pool = BlockPool(num_blocks=3, block_size=2)
    first, second, plain = pool.allocate(3)
    hash_a, hash_b = hash_block_tokens(None, [1, 1]), hash_block_tokens(None, [2, 2])
    pool.cache_block(first, hash_a)
    pool.cache_block(second, hash_b)
    pool.free([first])
    pool.free([second])
    pool.free([plain])
    assert pool.allocate(1) == [plain]  # never-cached block first: no cached prefix is lost
    assert pool.find_cached_blocks([hash_a]) == [first]
    assert pool.allocate(1) == [first]  # then the least recently freed cached block
    assert first.block_hash is None and pool.find_cached_blocks([hash_a]) == []
    assert pool.find_cached_blocks([hash_b]) == [second]
    pool.check_invariants()


def test_sharing_refreshes_lru_position():
    pool = BlockPool(num_blocks=2, block_size=2)
    older, newer = pool.allocate(2)
    pool.cache_block(older, hash_block_tokens(None, [1, 1]))
    pool.cache_block(newer, hash_block_tokens(None, [2, 2]))
    pool.free([older])
    pool.free([newer])
    pool.share([older])  # a hit: `older` becomes the most recently used
    pool.free([older])
    assert pool.allocate(1) == [newer]


def test_freeing_a_table_evicts_its_tail_first():
    pool = cached_pool(num_blocks=3, token_ids=[1, 2, 3, 4, 5, 6])
    evicted = pool.allocate(1)[0]
    assert evicted.block_id == 2  # the chain's last block; its leading blocks still hit
    assert [block.block_id for block in pool.find_cached_prefix([1, 2, 3, 4, 5, 6])] == [0, 1]


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(num_blocks=2, block_size=2)
    first, twin = pool.allocate(2)
    block_hash = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(first, block_hash)
    assert pool.cache_block(first, block_hash)  # idempotent
    assert not pool.cache_block(twin, block_hash)
    assert twin.block_hash is None
    pool.free([first, twin])
    assert pool.num_free_cached_blocks == 1
    pool.check_invariants()


def test_cache_and_share_misuse_raise():
    pool = BlockPool(num_blocks=2, block_size=2)
    block = pool.allocate(1)[0]
    with pytest.raises(RuntimeError, match="not cached"):
        pool.share([block])
    pool.free([block])
    with pytest.raises(RuntimeError, match="free block"):
        pool.cache_block(block, hash_block_tokens(None, [1, 2]))


def test_prefix_caching_disabled_caches_nothing():
    pool = BlockPool(num_blocks=2, block_size=2, enable_prefix_caching=False)
    block = pool.allocate(1)[0]
    assert not pool.cache_block(block, hash_block_tokens(None, [1, 2]))
    pool.free([block])
    assert pool.find_cached_prefix([1, 2, 3]) == []
    assert pool.num_free_cached_blocks == 0
    pool.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    pool = cached_pool(num_blocks=3, token_ids=[1, 2, 3, 4])
    held = pool.allocate(1)
    assert not pool.reset_prefix_cache()
    pool.free(held)
    assert pool.reset_prefix_cache()
    assert pool.find_cached_prefix([1, 2, 3, 4]) == []
    assert pool.num_free_blocks == 3 and pool.num_free_cached_blocks == 0
    pool.check_invariants()
