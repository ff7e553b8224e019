"""What each replica's prefix cache holds, from its KV events, for the prefix router.

Each replica's engine publishes its block manager's events on ZMQ (`kv_events_config`,
backend/engine/kv_events.py: vLLM's KVEventBatch, msgpack). `KVEventIndex` subscribes to every
replica given an endpoint and keeps the set of block hashes each one holds (stored, not removed
since, nothing after AllBlocksCleared). The router computes a prompt's hash chain the same way
(`prompt_block_hashes`) and asks how many of its leading blocks each replica holds.

Events arrive after the engine computed the blocks; until then the blocks of prompts just sent to a
replica count as held there for EXPECTED_S (`expect`), so a burst that shares a new prefix stays
together. A sequence number that goes back (the engine restarted) empties the replica's set; a gap
(messages lost past the high-water mark) is logged and the set kept: a block wrongly held costs one
recomputed prefix, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from backend.engine.kv_events import prompt_block_hashes

EXPECTED_S = 30.0
DEFAULT_BLOCK_SIZE = 16  # the engine's default, until a replica's events say otherwise
logger = logging.getLogger(__name__)


@dataclass
class ReplicaCache:
    blocks: set[int] = field(default_factory=set)  # block hashes its events say it holds
    expected: dict[int, float] = field(default_factory=dict)  # hash -> until when, for prompts just sent
    sequence: int | None = None  # the last batch's
    block_size: int = DEFAULT_BLOCK_SIZE
    batches: int = 0  # batches applied

    def holds(self, block_hash: int, now: float) -> bool:
        return block_hash in self.blocks or self.expected.get(block_hash, 0.0) > now

    def apply(self, sequence: int, events: list) -> None:
        if self.sequence is not None and sequence <= self.sequence:
            logger.info("KV events restarted at sequence %d (after %d): the replica's cache starts empty",
                        sequence, self.sequence)
            self.blocks.clear()
        elif self.sequence is not None and sequence > self.sequence + 1:
            logger.warning("KV events %d to %d lost; the replica's cache as known may be off until they "
                           "matter no more", self.sequence + 1, sequence - 1)
        self.sequence = sequence
        self.batches += 1
        for event in events:
            kind = event.get("type") if isinstance(event, dict) else None
            if kind == "BlockStored":
                self.blocks.update(event["block_hashes"])
                self.block_size = event["block_size"]
            elif kind == "BlockRemoved":
                self.blocks.difference_update(event["block_hashes"])
                for block_hash in event["block_hashes"]:
                    self.expected.pop(block_hash, None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                self.expected.clear()


def parse_endpoints(entries: list[str]) -> tuple[dict[str, str], str | None]:
    """`--kv-events-endpoint` values: `REPLICA=ENDPOINT` (a replica's host:port as routed to, its
    engine's ZMQ endpoint), or one ENDPOINT with `{host}` for every replica (discovered ones too)."""
    pairs: dict[str, str] = {}
    template = None
    for entry in entries:
        replica, separator, endpoint = entry.partition("=")
        if not separator:
            if "{host}" not in entry:
                raise ValueError(f"kv_events_endpoint: `{entry}` is neither REPLICA=ENDPOINT nor an endpoint "
                                 "with {host}")
            template = entry
        elif not endpoint.startswith(("tcp://", "ipc://")) or not replica.rpartition(":")[2].isdigit():
            raise ValueError(f"kv_events_endpoint: `{entry}`: want host:port=tcp://host:port")
        else:
            pairs[replica] = endpoint
    return pairs, template


class KVEventIndex:
    def __init__(self, endpoints: dict[str, str], template: str | None = None) -> None:
        self.endpoints, self.template = endpoints, template
        self.caches: dict[str, ReplicaCache] = {}
        self.followers: dict[str, asyncio.Task] = {}

    def endpoint(self, url: str) -> str | None:
        if url in self.endpoints:
            return self.endpoints[url]
        return None if self.template is None else self.template.replace("{host}", url.rpartition(":")[0])

    def follow(self, urls: list[str]) -> None:
        """Subscribe to the replicas listed now (inside the event loop); stop following the others."""
        for url in urls:
            endpoint = self.endpoint(url)
            if endpoint is not None and url not in self.followers:
                self.followers[url] = asyncio.create_task(self.subscribe(url, endpoint))
        for url in [url for url in self.followers if url not in urls]:
            self.followers.pop(url).cancel()
            self.caches.pop(url, None)

    async def subscribe(self, url: str, endpoint: str) -> None:
        import msgpack
        import zmq
        import zmq.asyncio

        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(endpoint)
        logger.info("following replica %s's KV events at %s", url, endpoint)
        cache = self.caches.setdefault(url, ReplicaCache())
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    _, sequence, payload = frames
                    batch = msgpack.unpackb(payload)
                    cache.apply(int.from_bytes(sequence, "big"), batch[1])
                except (ValueError, TypeError, KeyError, IndexError) as error:
                    logger.warning("replica %s: a KV event batch not understood (%s)", url, error)
        finally:
            socket.close(linger=0)

    async def close(self) -> None:
        for task in self.followers.values():
            task.cancel()
        await asyncio.gather(*self.followers.values(), return_exceptions=True)
        self.followers.clear()

    def live(self, urls: list[str]) -> bool:
        """Whether some of these replicas have published events (else the router hashes first blocks)."""
        return any(url in self.caches and self.caches[url].batches for url in urls)

    def block_size(self, urls: list[str]) -> int:
        return next((self.caches[url].block_size for url in urls if url in self.caches and self.caches[url].batches),
                    DEFAULT_BLOCK_SIZE)

    def cached_blocks(self, url: str, hashes: list[int]) -> int:
        """How many of the prompt's leading blocks the replica holds (or is computing)."""
        cache = self.caches.get(url)
        if cache is None:
            return 0
        now = time.monotonic()
        count = 0
        while count < len(hashes) and cache.holds(hashes[count], now):
            count += 1
        return count

    def expect(self, url: str, hashes: list[int]) -> None:
        cache = self.caches.get(url)
        if cache is None:
            return
        now = time.monotonic()
        if len(cache.expected) > 4 * len(cache.blocks) + 4096:  # drop the lapsed now and then
            cache.expected = {h: until for h, until in cache.expected.items() if until > now}
        for block_hash in hashes:
            cache.expected[block_hash] = now + EXPECTED_S

    @staticmethod
    def prompt_hashes(token_ids: list[int], block_size: int) -> list[int]:
        return prompt_block_hashes(token_ids, block_size)
