"""The second KV tier's index (`kv_offloading_size`): which prefix-cache blocks evicted from the
device cache it holds, each in one slot of the host store, least recently used first.

When the block manager reuses a free block that still holds a cached prefix, it stores the block
here (a slot to copy it into) instead of dropping it; a later prompt whose prefix continues past
the device cache's hits finds the rest here and gets device blocks copied back from their slots
instead of recomputing them. The copies are the step's block moves (device to host, then host to
device, before the forward pass), the same moves swap preemption makes. Nothing here touches a
tensor: the slots are host-store blocks after the swap space's (kv_memory.allocate_host_store).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierEntry:
    slot: int
    token_ids: tuple[int, ...]
    key: str | tuple | None  # Request.block_key, as the device block had it


class KVTier:
    def __init__(self, num_slots: int, first_slot: int = 0) -> None:
        self.num_slots = num_slots
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()  # by block hash, least recent first
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # pop() takes the lowest
        # Slots this step's moves read or write: never handed to another block before the moves run
        # (a move's source must still hold its block, and one slot is written once a step).
        self.busy: set[int] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def find(self, block_hash: int, token_ids: tuple[int, ...], key: str | tuple | None) -> int | None:
        """The slot holding this block (its tokens and key confirmed, not only its hash), or None."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids or entry.key != key:
            return None
        return entry.slot

    def load(self, block_hash: int) -> TierEntry:
        """A found block is being copied back to the device: most recently used now, and its slot
        kept until this step's moves have run. The tier keeps its copy."""
        self.entries.move_to_end(block_hash)
        entry = self.entries[block_hash]
        self.busy.add(entry.slot)
        return entry

    def store(self, block_hash: int, token_ids: tuple[int, ...], key: str | tuple | None) -> int | None:
        """A slot to copy an evicted device block into, taking the least recently used one when
        none is free; None when no copy is needed (the tier holds the block already: it only
        becomes the most recent) or possible (every slot is busy this step)."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if not self.free_slots and not self._evict_one():
            return None
        slot = self.free_slots.pop()
        self.entries[block_hash] = TierEntry(slot, token_ids, key)
        self.busy.add(slot)
        return slot

    def _evict_one(self) -> bool:
        for block_hash, entry in self.entries.items():
            if entry.slot not in self.busy:
                del self.entries[block_hash]
                self.free_slots.append(entry.slot)
                return True
        return False

    def moves_taken(self) -> None:
        """This step's moves are on their way: every slot may be reused again."""
        self.busy.clear()

    def clear(self) -> None:
        self.free_slots.extend(entry.slot for entry in self.entries.values())
        self.free_slots.sort(reverse=True)
        self.entries.clear()
