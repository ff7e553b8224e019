"""The block manager's event record: what enters and leaves its hash map, and nothing when off."""

from __future__ import annotations

from backend.core.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager
from backend.core.request import Request
from backend.sampling_params import SamplingParams


def make(tokens, salt=None):
    return Request(str(id(tokens)), None, list(tokens), SamplingParams(), cache_salt=salt)


def compute(kv, request, n):
    assert kv.allocate_slots(request, n, kv.find_cached_prefix(request) if not request.block_table else None)
    request.num_computed_tokens += n
    kv.cache_full_blocks(request)


def test_full_blocks_are_stored_once_in_chain_order():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_kv_cache_events=True)
    request = make(range(10), salt="tenant-a")
    compute(kv, request, 10)
    stored = kv.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]  # the third block is not full
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert stored[0].token_ids == (0, 1, 2, 3) and stored[1].token_ids == (4, 5, 6, 7)
    assert stored[0].key == "tenant-a"
    assert [e.block_hash for e in stored] == request.block_hashes
    assert kv.take_events() == []  # taken: gone
    kv.free(request)
    again = make(list(range(8)) + [50, 51, 52], salt="tenant-a")  # hits both blocks: nothing new is stored
    compute(kv, again, 3)
    assert kv.take_events() == []
    twin = make(range(9), salt="tenant-a")  # computed beside a cached copy (no prefix lookup): not stored twice
    assert kv.allocate_slots(twin, 9)
    twin.num_computed_tokens = 9
    kv.cache_full_blocks(twin)
    assert kv.take_events() == []


def test_eviction_removes_and_reset_clears():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_kv_cache_events=True)
    first = make(range(8))
    compute(kv, first, 8)
    hashes = [e.block_hash for e in kv.take_events()]
    assert len(hashes) == 4
    kv.free(first)  # freeing keeps the blocks cached: no event
    assert kv.take_events() == []
    compute(kv, make(range(100, 102)), 2)  # takes the least recently used block: the tail
    events = kv.take_events()
    assert events[0] == BlockRemoved(hashes[-1])
    assert [type(e) for e in events[1:]] == [BlockStored]
    kv.reset_prefix_cache()  # the newcomer still holds its block: only the free ones leave
    assert sorted(e.block_hash for e in kv.take_events()) == sorted(hashes[:3])
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_kv_cache_events=True)
    request = make(range(4))
    compute(kv, request, 4)
    kv.free(request)
    kv.take_events()
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_nothing_recorded_when_off():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    request = make(range(8))
    compute(kv, request, 8)
    kv.free(request)
    compute(kv, make(range(100, 102)), 2)
    kv.reset_prefix_cache()
    assert kv.events is None and kv.take_events() == []
