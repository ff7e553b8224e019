"""KV-cache block manager: blocks, block tables, reference counts, prefix hashing and LRU reuse.

A block holds `block_size` tokens' keys and values for every layer. Full blocks are keyed by a hash
chained over (parent hash, the block's token ids, extra keys: a cache salt, a LoRA adapter); a hit is
confirmed by comparing token ids. Freed blocks keep their contents and stay findable until the
least-recently-used one is reused; a request's blocks are freed tail first so its tail is evicted
before the shared head.

On a model whose layers all slide (`sliding_window`), blocks that no window can reach any more are
freed while the request runs (`free_behind_window`): their block-table entries point at NULL_BLOCK,
a block never handed out, so every position keeps its place in the table, and the attention
kernels never read it (they start each token at its window). A freed block keeps its contents and
hash like any freed block: a later prompt with the same prefix still hits it until it is evicted.

With a second KV tier (`kv_offloading_size`, core/kv_tier.py) an evicted cached block is not lost:
its contents are copied to a tier slot before its new owner writes it, and a prompt whose prefix
goes on past the cache's hits into the tier gets fresh blocks copied back from there, counted as
computed. The copies wait in `offloads` and `loads` until the scheduler takes them for the step.

With `enable_kv_cache_events` the manager also records what enters and leaves the hash map
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`); the engine takes them after each step
(`take_events`) and publishes them, as vLLM's block pool does.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from backend.core.kv_tier import KVTier
from backend.core.request import Request

NULL_BLOCK = 0  # with a sliding window: where block-table entries behind every window point


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became findable by its hash: later prompts with its prefix can share it."""
    block_hash: int
    parent_hash: int | None  # the block before it in its request (None: the first block)
    token_ids: tuple[int, ...]
    key: str | tuple | None  # Request.block_key: cache salt, adapter, images


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The block with this hash was evicted (or its hash dropped): prefix hits on it end."""
    block_hash: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache holds nothing any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.key: str | tuple | None = None  # what else its hash covers (Request.block_key)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, sliding_window: int | None = None,
                 enable_kv_cache_events: bool = False, num_tier_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks = list(range(num_swap_blocks))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently used first. Cached ones stay in hash_to_block.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.sliding_window = sliding_window
        if sliding_window:
            del self.free_blocks[NULL_BLOCK]
        self.num_usable_blocks = len(self.free_blocks)
        self.num_window_freed_blocks = 0  # blocks freed behind a sliding window, in total
        # The second tier's slots are host-store blocks after the swap space's.
        self.tier = KVTier(num_tier_blocks, num_swap_blocks) if num_tier_blocks and enable_prefix_caching else None
        self.offloads: list[tuple[int, int]] = []  # this step's (evicted block, tier slot) copies
        self.loads: list[tuple[int, int]] = []  # and (tier slot, block) copies back
        # Changes to hash_to_block since the last take_events (None: not recorded).
        self.events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int, max_step_tokens: int | None) -> int:
        """The most blocks a request of `num_tokens` holds at once, computing at most
        `max_step_tokens` of them a step (None: its whole prompt may come in one step, or again
        after a preemption by recompute). Under a sliding window a step holds the blocks of the
        window before its first token and of its own tokens, one more where they straddle a block."""
        total = self.blocks_needed(num_tokens)
        if not self.sliding_window or max_step_tokens is None:
            return total
        return min(total, self.blocks_needed(self.sliding_window + max_step_tokens) + 1)

    def _block_hash(self, parent: int | None, token_ids: tuple[int, ...], key: str | tuple | None) -> int:
        return hash((parent, token_ids, key))

    def _prefix_blocks(self, request: Request):
        """(hash, token ids, key) of each full block of the request before its last token (that
        token's logits must be computed, so no hit covers it)."""
        parent = None
        tokens = request.all_token_ids
        for start in range(0, request.num_tokens - 1 - self.block_size + 1, self.block_size):
            block_tokens = tuple(tokens[start:start + self.block_size])
            key = request.block_key(start, start + self.block_size)
            parent = self._block_hash(parent, block_tokens, key)
            yield parent, block_tokens, key

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request, never covering its last token
        (that token's logits must be computed)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for block_hash, block_tokens, key in self._prefix_blocks(request):
            block_id = self.hash_to_block.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens or self.blocks[block_id].key != key:
                break
            hits.append(block_id)
        return hits

    def find_offloaded_prefix(self, request: Request, num_cached_blocks: int) -> list[int]:
        """Hashes of the blocks after the first `num_cached_blocks` that the second tier holds, up
        to the first it lacks: the prefix hit goes on there."""
        if self.tier is None:
            return []
        hits: list[int] = []
        for block_hash, block_tokens, key in itertools.islice(self._prefix_blocks(request), num_cached_blocks, None):
            if self.tier.find(block_hash, block_tokens, key) is None:
                break
            hits.append(block_hash)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
                       offloaded: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens after any cached prefix: its
        blocks in the KV cache (`cached_blocks`), then those in the second tier (`offloaded`, by
        hash), which take new blocks to be copied into. Returns False, changing nothing, when there
        are not enough free blocks."""
        cached_blocks = cached_blocks or []
        offloaded = offloaded or []
        num_cached_tokens = (len(cached_blocks) + len(offloaded)) * self.block_size
        total = request.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(request.block_table) - len(cached_blocks)
        # Cached blocks with no owner sit in the free queue; taking them uses up free blocks too.
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
            request.block_hashes.append(block.hash)
        # Their slots are kept first: the evictions below store blocks in the tier too.
        entries = [self.tier.load(block_hash) for block_hash in offloaded] if self.tier is not None else []
        for block_hash, entry in zip(offloaded, entries):
            block = self.blocks[self._take_free_block()]
            block.hash, block.token_ids, block.key = block_hash, entry.token_ids, entry.key
            self._register(block_hash, block, request.block_hashes[-1] if request.block_hashes else None)
            request.block_table.append(block.block_id)
            request.block_hashes.append(block_hash)
            self.loads.append((entry.slot, block.block_id))
        request.num_computed_tokens += num_cached_tokens
        # In ascending order, so that a prompt's keys and values run forward through memory where
        # the blocks are adjacent, as the hardware prefetcher streams them: freed blocks come back
        # tail first, so the least recently used are mostly runs in descending order.
        request.block_table.extend(sorted(self._take_free_block()
                                          for _ in range(max(num_new_blocks - len(offloaded), 0))))
        return True

    def _take_free_block(self) -> int:
        """The least recently used free block, for new contents. A cached one is evicted: into
        the second tier, when there is one (the copy runs before the step writes the block)."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.events is not None:
                    self.events.append(BlockRemoved(block.hash))
                slot = self.tier.store(block.hash, block.token_ids, block.key) if self.tier is not None else None
                if slot is not None:
                    self.offloads.append((block_id, slot))
            block.hash, block.token_ids, block.key = None, (), None
        block.ref_count = 1
        return block_id

    def _register(self, block_hash: int, block: Block, parent: int | None) -> None:
        """Make a full block findable by its hash (an identical block may be there already)."""
        if block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block.block_id
            if self.events is not None:
                self.events.append(BlockStored(block_hash, parent, block.token_ids, block.key))

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        tokens = request.all_token_ids
        for index in range(len(request.block_hashes), num_full):
            block_tokens = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
            parent = request.block_hashes[-1] if request.block_hashes else None
            key = request.block_key(index * self.block_size, (index + 1) * self.block_size)
            block_hash = self._block_hash(parent, block_tokens, key)
            request.block_hashes.append(block_hash)
            if self.sliding_window and request.block_table[index] == NULL_BLOCK:  # freed: only the hash chain
                continue
            block = self.blocks[request.block_table[index]]
            block.hash, block.token_ids, block.key = block_hash, block_tokens, key
            self._register(block_hash, block, parent)

    def free_behind_window(self, request: Request) -> int:
        """Free the request's whole blocks before the window of its next token (position
        num_computed_tokens sees positions > num_computed_tokens - window; later tokens see less).
        Returns how many it freed."""
        if not self.sliding_window:
            return 0
        first_visible = request.num_computed_tokens + 1 - self.sliding_window
        table = request.block_table
        index = min(max(first_visible, 0) // self.block_size, len(table)) - 1
        released = []
        while index >= 0 and table[index] != NULL_BLOCK:  # freed entries form a prefix of the table
            released.append(table[index])
            table[index] = NULL_BLOCK
            index -= 1
        self._release(released[::-1])
        self.num_window_freed_blocks += len(released)
        return len(released)

    def free(self, request: Request) -> None:
        """Drop the request's references, tail first. Uncached blocks are reused first; cached
        ones wait at the back of the queue so they can still be hit."""
        self._release(request.block_table)
        request.block_table = []
        request.block_hashes = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past those holding the request's first `num_tokens` tokens (slots taken
        for speculative tokens that were rejected; such blocks were never cached)."""
        keep = self.blocks_needed(num_tokens)
        self._release(request.block_table[keep:])
        del request.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            if self.sliding_window and block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed blocks to swap space: returns (device, swap) block pairs to
        copy, or None when the swap space cannot hold them. The device blocks are freed."""
        num_blocks = self.blocks_needed(request.num_computed_tokens)
        if num_blocks > len(self.free_swap_blocks):
            return None
        request.swap_blocks = [self.free_swap_blocks.pop() for _ in range(num_blocks)]
        pairs = list(zip(request.block_table[:num_blocks], request.swap_blocks))
        self.free(request)
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """After allocate_slots gave a swapped request device blocks: (swap, device) pairs to copy."""
        pairs = list(zip(request.swap_blocks, request.block_table))
        self.free_swap(request)
        return pairs

    def free_swap(self, request: Request) -> None:
        self.free_swap_blocks.extend(request.swap_blocks)
        request.swap_blocks = []

    def take_tier_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's second-tier copies, (evicted block, tier slot) and (tier slot, block), for
        the block mover; the tier's slots may be reused after them."""
        moves = self.offloads, self.loads
        self.offloads, self.loads = [], []
        if self.tier is not None:
            self.tier.moves_taken()
        return moves

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.key = None, (), None
        if self.tier is not None:
            self.tier.clear()
        old_hashes = self.hash_to_block.keys()
        self.hash_to_block = {b.hash: b.block_id for b in self.blocks if b.hash is not None}
        if self.events is not None:
            if not self.hash_to_block:
                self.events.append(AllBlocksCleared())
            else:  # running requests' blocks stay cached
                self.events.extend(BlockRemoved(h) for h in old_hashes - self.hash_to_block.keys())

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (none when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events
