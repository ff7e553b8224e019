"""KV cache events for routers: vLLM's `kv_events_config`, its event names and fields, on its channel.

After each step the engine hands the block manager's record (backend/core/kv_cache.py: blocks that
became findable by their hash, blocks evicted, the cache cleared) to a `KVEventPublisher`, which
publishes it as one `KVEventBatch` on a ZMQ PUB socket: frames (topic, sequence number as 8 bytes
big-endian, msgpack payload), the payload `[ts, [event, ...], data_parallel_rank]` with each event a
map tagged by "type" (BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name; BlockRemoved: block_hashes, medium; AllBlocksCleared), as vLLM's msgspec structs
encode them. A ROUTER socket at `replay_endpoint` resends the batches from a given sequence number
(8 bytes big-endian) and ends with the sequence number -1, for a subscriber that missed some.

Block hashes are `block_hash` below, not the engine's own: those use Python's hash(), which differs
between processes. A subscriber that knows a prompt's token ids computes the same chain
(`prompt_block_hashes`) and so finds which replica holds how much of it.

pyzmq and msgpack are imported only when events are enabled; the engine's modules (and torch) only
when events are encoded, so a router imports the hashes alone.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from backend.config import KVEventsConfig
from backend.errors import EngineError

if TYPE_CHECKING:
    from backend.core.kv_cache import KVCacheEvent

logger = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the first tier (its CPU build says the same); a second tier is "CPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def binds(endpoint: str) -> bool:
    """vLLM's rule (a wildcard host, ipc:// and inproc:// listen; a named host is a collector to
    connect to), except that a loopback host listens too, so the default stays on this machine."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://") or host in LOOPBACK_HOSTS


# -- block hashes a subscriber can compute ------------------------------------------------------------
def block_hash(parent: int | None, token_ids: Sequence[int], key: Any = None) -> int:
    """The first 8 bytes (big-endian, unsigned) of sha256 over the parent block's hash (8 bytes; none
    for a prompt's first block), the token ids (4 bytes little-endian each) and, when the block has
    one, repr() of its key (cache salt, adapter id, images: Request.block_key)."""
    digest = hashlib.sha256()
    if parent is not None:
        digest.update(parent.to_bytes(8, "big"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if key is not None:
        digest.update(repr(key).encode())
    return int.from_bytes(digest.digest()[:8], "big")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, key: Any = None) -> list[int]:
    """The hash chain of the prompt's whole blocks, as a replica publishes it when it caches them."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], key)
        hashes.append(parent)
    return hashes


def adapter_id(key: Any) -> int | None:
    """The LoRA adapter id inside a block key ((cache_key, images) or (cache salt, adapter id))."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], tuple):
        key = key[0]  # (cache_key, images)
    return key[1] if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int) else None


class EventEncoder:
    """The block manager's events -> vLLM's event maps, with `block_hash`es. The engine's hash of each
    stored block maps to its stable hash; a stored block's parent is found there (an evicted parent
    too: entries outlive eviction, the oldest dropped past `capacity`). A block whose parent is not
    there any more is not published (nor its children): a router then misses it, nothing worse."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.stable_hashes: OrderedDict[int, int] = OrderedDict()

    def stable(self, engine_hash: int | None) -> int | None:
        if engine_hash is None or engine_hash not in self.stable_hashes:
            return None
        self.stable_hashes.move_to_end(engine_hash)
        return self.stable_hashes[engine_hash]

    def encode(self, events: list[KVCacheEvent]) -> list[dict]:
        # Here, not at the top: routers import this module's hashes without the engine (and torch).
        from backend.core.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored

        wire: list[dict] = []
        for event in events:
            if isinstance(event, BlockStored):
                parent = self.stable(event.parent_hash)
                if event.parent_hash is not None and parent is None:
                    continue
                stable = block_hash(parent, event.token_ids, event.key)
                self.stable_hashes[event.block_hash] = stable
                if len(self.stable_hashes) > self.capacity:
                    self.stable_hashes.popitem(last=False)
                last = wire[-1] if wire else None
                lora_id = adapter_id(event.key)
                if (last is not None and last["type"] == "BlockStored" and last["block_hashes"][-1] == parent
                        and last["lora_id"] == lora_id):  # the next block of the same chain: one event, as vLLM
                    last["block_hashes"].append(stable)
                    last["token_ids"].extend(event.token_ids)
                else:
                    wire.append({"type": "BlockStored", "block_hashes": [stable], "parent_block_hash": parent,
                                 "token_ids": list(event.token_ids), "block_size": self.block_size,
                                 "lora_id": lora_id, "medium": MEDIUM, "lora_name": None})
            elif isinstance(event, BlockRemoved):
                stable = self.stable(event.block_hash)
                if stable is None:
                    continue
                if wire and wire[-1]["type"] == "BlockRemoved":
                    wire[-1]["block_hashes"].append(stable)
                else:
                    wire.append({"type": "BlockRemoved", "block_hashes": [stable], "medium": MEDIUM})
            elif isinstance(event, AllBlocksCleared):
                wire.append({"type": "AllBlocksCleared"})
        return wire


class KVEventPublisher:
    """Publishes each step's events from a thread of its own (the engine only queues them), keeping
    the last `buffer_steps` batches for replay."""

    def __init__(self, config: KVEventsConfig, block_size: int, num_blocks: int) -> None:
        import msgpack
        import zmq

        self.config = config
        self.encoder = EventEncoder(block_size, capacity=4 * num_blocks + 1024)
        self.lock = threading.Lock()  # the engine loop and a reset from another thread both publish
        self.queue: queue.Queue[list | None] = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.pack = msgpack.Packer()
        self.zmq = zmq
        context: zmq.Context = zmq.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.replay: zmq.Socket | None = None
        try:
            if binds(config.endpoint):
                self.pub.bind(config.endpoint)
            else:
                self.pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self.replay = context.socket(zmq.ROUTER)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self.close_sockets()
            raise EngineError("kv_events_config", f"cannot open {config.endpoint}"
                              f"{' or ' + config.replay_endpoint if config.replay_endpoint else ''}: {error}") from None
        self.topic = config.topic.encode()
        self.dropped = 0
        self.thread = threading.Thread(target=self.run, name="kv-events", daemon=True)
        self.thread.start()
        logger.info("publishing KV cache events on %s%s", config.endpoint,
                    f" (replay on {config.replay_endpoint})" if config.replay_endpoint else "")

    @classmethod
    def create(cls, value: KVEventsConfig | dict | str | None, block_size: int, num_blocks: int) -> KVEventPublisher | None:
        config = None if value is None else KVEventsConfig.parse(value)
        return cls(config, block_size, num_blocks) if config is not None and config.publishes else None

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        with self.lock:
            wire = self.encoder.encode(events)
        if not wire:
            return
        try:
            self.queue.put_nowait([time.time(), wire, 0])
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the publishing thread is behind)", self.dropped)

    def run(self) -> None:
        sequence = 0
        while True:
            if self.replay is not None and self.replay.poll(0):
                self.serve_replay()
            try:
                batch = self.queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                break
            payload = self.pack.pack(batch)
            try:
                self.pub.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
            except self.zmq.ZMQError:  # the thread must outlive a failed send
                logger.exception("KV events: cannot send batch %d", sequence)
            self.buffer.append((sequence, payload))
            sequence += 1

    def serve_replay(self) -> None:
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames ignored (want identity, empty, sequence)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self.buffer):
            if sequence >= first:
                self.replay.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)

    def shutdown(self) -> None:
        """Send what is queued (at most a second's wait), then close the sockets (idempotent)."""
        if not self.thread.is_alive():
            return
        self.queue.put(None)
        self.thread.join(timeout=1.0)
        self.close_sockets()
