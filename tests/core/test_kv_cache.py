"""Block manager rules: on-demand allocation, tail-first LRU reuse, confirmed prefix hits."""

from __future__ import annotations

from backend.core.kv_cache import KVCacheManager
from backend.core.request import Request
from backend.sampling_params import SamplingParams


def make(tokens, salt=None):
    return Request(str(id(tokens)), None, list(tokens), SamplingParams(), cache_salt=salt)


def compute(kv, request, n):
    assert kv.allocate_slots(request, n)
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def test_blocks_taken_on_demand_and_returned():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make(range(10))
    compute(kv, request, 6)
    assert len(request.block_table) == 2 and kv.num_free_blocks == 6
    compute(kv, request, 4)
    assert len(request.block_table) == 3
    assert not kv.allocate_slots(make(range(100, 130)), 30)  # needs 8 blocks, 5 free: refused
    assert kv.num_free_blocks == 5
    kv.free(request)
    assert kv.num_free_blocks == 8 and request.block_table == []


def test_prefix_hit_is_confirmed_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make(range(12))
    compute(kv, first, 12)
    first_blocks = list(first.block_table)
    kv.free(first)
    same = make(range(12))
    hits = kv.find_cached_prefix(same)
    assert len(hits) == 2  # 3 full blocks, but the last token must be computed
    longer = make(list(range(12)) + [99])
    assert len(kv.find_cached_prefix(longer)) == 3
    different = make([0, 1, 2, 3, 4, 5, 6, 77, 8, 9, 10, 11, 12])
    assert len(kv.find_cached_prefix(different)) == 1
    assert kv.find_cached_prefix(make(range(13), salt="tenant-b")) == []
    assert kv.allocate_slots(longer, 1, kv.find_cached_prefix(longer))
    assert longer.num_computed_tokens == 12 and longer.block_table[:3] == first_blocks


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make(range(9))
    compute(kv, a, 9)
    b = make(list(range(8)) + [50])
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert kv.allocate_slots(b, 1, hits)
    assert kv.blocks[hits[0]].ref_count == 2
    kv.free(a)
    assert kv.blocks[hits[0]].ref_count == 1
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_freed_tail_is_evicted_before_shared_head():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    request = make(range(8))
    compute(kv, request, 8)
    head, tail = request.block_table[0], request.block_table[-1]
    kv.free(request)
    newcomer = make(range(100, 102))
    assert kv.allocate_slots(newcomer, 2)
    assert newcomer.block_table == [tail]
    assert kv.find_cached_prefix(make(range(5)))[:1] == [head]


def test_blocks_taken_in_one_step_ascend_though_the_evicted_come_back_tail_first():
    """Freed cached blocks are evicted tail first, which hands the least recently used out in
    descending runs; a request's new blocks of one step are put in ascending order instead, so that
    its keys and values run forward through memory (the attention kernels stream them faster)."""
    kv = KVCacheManager(num_blocks=8, block_size=2)
    first = make(range(16))
    compute(kv, first, 16)
    assert first.block_table == list(range(8))
    kv.free(first)  # all cached: back in the queue tail first, 7, 6, ..., 0
    second = make(range(100, 112))
    compute(kv, second, 8)
    assert second.block_table == [4, 5, 6, 7]  # the four least recently used, ascending
    compute(kv, second, 4)
    assert second.block_table == [4, 5, 6, 7, 2, 3]
