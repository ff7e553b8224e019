"""The second KV tier's rules: a bounded LRU of evicted prefix blocks, confirmed hits, slots never
reused while a step's copies still need them; and the block manager's side of it: an evicted
cached block is copied to the tier, a prefix that goes on in the tier is copied back into fresh
device blocks and counts as computed."""

from __future__ import annotations

from backend.core.kv_cache import KVCacheManager
from backend.core.kv_tier import KVTier
from backend.core.request import Request
from backend.sampling_params import SamplingParams


def make(tokens, salt=None):
    return Request(str(id(tokens)), None, list(tokens), SamplingParams(), cache_salt=salt)


def compute(kv, request, n, cached=None, offloaded=None):
    assert kv.allocate_slots(request, n, cached, offloaded)
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def test_tier_is_a_bounded_lru_of_confirmed_blocks():
    tier = KVTier(num_slots=2, first_slot=10)  # slots after 10 swap blocks
    a, b, c = (1, 2), (3, 4), (5, 6)
    slot_a = tier.store(101, a, None)
    slot_b = tier.store(102, b, None)
    assert {slot_a, slot_b} == {10, 11}
    assert tier.store(101, a, None) is None  # held already: no copy, but now the most recent
    tier.moves_taken()
    assert tier.store(103, c, None) == slot_b  # full: the least recently used (102) makes room
    assert tier.find(102, b, None) is None and len(tier) == 2
    assert tier.find(101, a, None) == slot_a
    assert tier.find(101, (1, 9), None) is None  # a hash is confirmed by the tokens...
    assert tier.find(101, a, "tenant-b") is None  # ...and the key
    tier.clear()
    assert len(tier) == 0 and tier.find(101, a, None) is None and sorted(tier.free_slots) == [10, 11]


def test_tier_slots_are_not_reused_before_the_steps_moves_run():
    tier = KVTier(num_slots=2)
    tier.store(1, (1,), None)
    tier.store(2, (2,), None)
    assert tier.store(3, (3,), None) is None  # both slots are written this step: nothing to give
    tier.moves_taken()
    tier.load(1)  # read this step: 1 stays, although it is older than 2
    tier.load(2)
    assert tier.store(3, (3,), None) is None
    tier.moves_taken()
    assert tier.store(3, (3,), None) is not None


def test_evicted_blocks_go_to_the_tier_and_come_back_on_a_prefix_hit():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_swap_blocks=3, num_tier_blocks=8)
    first = make(range(13))
    compute(kv, first, 13)
    first_blocks, first_hashes = list(first.block_table), list(first.block_hashes)
    kv.free(first)
    assert kv.take_tier_moves() == ([], [])
    other = make(range(100, 113))
    compute(kv, other, 13)  # takes every block: the three cached ones are evicted to the tier
    offloads, loads = kv.take_tier_moves()
    assert sorted(block for block, _ in offloads) == sorted(first_blocks[:3]) and loads == []
    assert all(slot >= 3 for _, slot in offloads)  # tier slots come after the swap space's
    slot_of = dict(offloads)
    assert kv.find_cached_prefix(make(range(13))) == []
    kv.free(other)

    again = make(list(range(12)) + [99, 98])
    offloaded = kv.find_offloaded_prefix(again, 0)
    assert offloaded == first_hashes
    compute(kv, again, 2, [], offloaded)
    assert again.num_computed_tokens == 14 and again.block_hashes == first_hashes
    offloads, loads = kv.take_tier_moves()
    # each block copied back from the slot it went to, into the block it now has
    assert loads == [(slot_of[old], new) for old, new in zip(first_blocks[:3], again.block_table)]
    # other's blocks went to the tier to make room (other's first three were cached too)
    assert len(offloads) == 3 and not {slot for _, slot in offloads} & {slot for slot, _ in loads}
    # copied back, the blocks are in the KV cache again: a later prompt shares them
    later = make(list(range(12)) + [7])
    assert kv.find_cached_prefix(later) == again.block_table[:3]
    kv.free(again)
    assert kv.num_free_blocks == 4


def test_the_tier_continues_the_kv_caches_hits():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_tier_blocks=8)
    first = make(range(17))
    compute(kv, first, 17)  # 5 blocks, 4 cached
    kv.free(first)  # freed tail first: the tail is evicted before the head
    other = make(range(200, 216))
    compute(kv, other, 16)  # 4 blocks: the unused two, then blocks 3 and 2 of `first`, which go to the tier
    assert len(kv.take_tier_moves()[0]) == 2
    kv.free(other)
    again = make(list(range(16)) + [5])
    cached = kv.find_cached_prefix(again)
    assert len(cached) == 2
    offloaded = kv.find_offloaded_prefix(again, len(cached))
    assert len(offloaded) == 2
    assert kv.allocate_slots(again, 1, cached, offloaded) and again.num_computed_tokens == 16
    assert len(kv.take_tier_moves()[1]) == 2


def test_without_a_tier_nothing_is_offloaded():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = make(range(13))
    compute(kv, first, 13)
    kv.free(first)
    compute(kv, make(range(100, 113)), 13)
    assert kv.tier is None and kv.take_tier_moves() == ([], [])
    assert kv.find_offloaded_prefix(make(range(13)), 0) == []
