"""KV cache events from a real engine, read by a real ZMQ subscriber in vLLM's format: a prompt's
blocks stored once (a prefix hit stores nothing), evictions removed, a reset cleared; replaying the
events gives a subscriber exactly the prefixes the engine would hit; vLLM's own decoder reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from backend import LLM, EngineConfig, SamplingParams
from backend.config import KVEventsConfig
from backend.core.request import Request
from backend.engine.kv_events import binds, block_hash, prompt_block_hashes
from backend.errors import EngineError
from tools.triton_server import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))  # tools/setup_vllm_cpu.sh
BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # (k, v) x 2 layers x 16 tokens x 2 KV heads x head size 16, float32


def test_config_as_vllm_spells_it_with_a_loopback_default():
    config = EngineConfig.from_dict({"kv_events_config": '{"enable_kv_cache_events": true, "topic": "kv"}'})
    assert config.kv_events_config == KVEventsConfig(True, "zmq", "tcp://127.0.0.1:5557", topic="kv")
    assert EngineConfig.from_dict(config.to_dict()).kv_events_config == config.kv_events_config
    assert not KVEventsConfig.parse({"enable_kv_cache_events": False}).publishes  # publisher "null"
    for bad in ('{"endpoint": "127.0.0.1:5557"}', '{"hwm": 0}', '{"publisher": "kafka"}', '{"port": 1}', "[1]"):
        with pytest.raises(EngineError, match="kv_events_config"):
            EngineConfig(kv_events_config=bad)
    assert binds("tcp://127.0.0.1:5557") and binds("tcp://*:5557") and binds("ipc:///tmp/kv")
    assert not binds("tcp://collector.example:5557")  # vLLM's rule: a named host is a collector to connect to


def test_block_hash_is_a_stable_chain():
    tokens = list(range(40))
    first, second = prompt_block_hashes(tokens, BLOCK)  # the partial third block has no hash
    assert first == block_hash(None, tokens[:16]) and second == block_hash(first, tokens[16:32])
    assert prompt_block_hashes(tokens, BLOCK, key="tenant")[0] != first
    script = f"from backend.engine.kv_events import prompt_block_hashes; print(prompt_block_hashes({tokens}, {BLOCK}))"
    for seed in ("1", "2"):  # Python's own hash() would differ between these processes
        other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               cwd=ROOT, env={"PYTHONHASHSEED": seed}, check=True)
        assert json.loads(other.stdout) == [first, second]


class Subscriber:
    """A SUB socket on the engine's endpoint; `batches()` decodes what has come."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.frames: list[tuple[bytes, int, bytes]] = []

    def receive(self, timeout_s: float = 0.2) -> int:
        got = 0
        while self.socket.poll(int(timeout_s * 1000)):
            topic, sequence, payload = self.socket.recv_multipart()
            self.frames.append((topic, int.from_bytes(sequence, "big"), payload))
            got += 1
        return got

    def events(self) -> list[dict]:
        return [event for _, _, payload in self.frames for event in msgpack.unpackb(payload)[1]]


def cached_blocks(events: list[dict]) -> set[int]:
    """What a router knows after these events: the block hashes stored and not removed since."""
    held: set[int] = set()
    for event in events:
        if event["type"] == "BlockStored":
            held.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            held.difference_update(event["block_hashes"])
        else:
            held.clear()
    return held


def leading(hashes: list[int], held: set[int]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in held:
        count += 1
    return count


def test_a_real_engine_publishes_what_its_cache_holds(tiny_llama, tmp_path):
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    llm = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=10 * BLOCK_BYTES, max_num_seqs=2,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay,
                                "topic": "kv@test"})
    engine = llm.llm_engine
    subscriber = Subscriber(endpoint)
    deadline = time.monotonic() + 10
    while not subscriber.receive():  # a new subscription takes a moment: resets until one arrives
        assert time.monotonic() < deadline, "no event reached the subscriber"
        engine.reset_prefix_cache()
    subscriber.frames.clear()
    greedy = SamplingParams(max_tokens=1, temperature=0)

    def run(tokens: list[int]) -> None:
        llm.generate([{"prompt_token_ids": tokens}], greedy, use_tqdm=False)
        subscriber.receive()

    prompt = list(range(1000, 1048))  # three whole blocks
    run(prompt)
    stored = subscriber.events()
    assert [e["type"] for e in stored] == ["BlockStored"]  # one chain: one event, as vLLM sends it
    assert stored[0]["block_hashes"] == prompt_block_hashes(prompt, BLOCK)
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == prompt
    assert stored[0]["block_size"] == BLOCK and stored[0]["medium"] == "GPU" and stored[0]["lora_id"] is None
    run(prompt)  # again: two blocks hit, the third recomputed (its last token's logits) and not stored again
    assert len(subscriber.events()) == 1
    run(prompt + [7] * 20)  # a prefix hit: only the new whole block is stored, its parent the prompt's last
    more = subscriber.events()[1:]
    assert [(e["type"], e["parent_block_hash"]) for e in more] == [("BlockStored", stored[0]["block_hashes"][-1])]

    prompts = [list(range(2000 + 100 * i, 2048 + 100 * i)) for i in range(4)]  # 12 blocks into 10: evictions
    for other in prompts:
        run(other)
    events = subscriber.events()
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    held = cached_blocks(events)
    for tokens in [prompt, prompt + [7] * 20, *prompts]:  # the subscriber's view is the engine's
        request = Request("probe", None, tokens + [1], greedy)
        assert leading(prompt_block_hashes(tokens, BLOCK), held) == len(engine.kv_cache.find_cached_prefix(request))

    engine.reset_prefix_cache()
    subscriber.receive()
    assert subscriber.events()[-1] == {"type": "AllBlocksCleared"}
    sequences = [sequence for _, sequence, _ in subscriber.frames]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
    assert {topic for topic, _, _ in subscriber.frames} == {b"kv@test"}

    # Replay: a subscriber that missed batches asks from a sequence number (8 bytes big-endian) and
    # gets every batch kept since, then the sequence number -1. A DEALER reads them all.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart((b"", (sequences[0] + 1).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(5000), "the replay did not answer"
        _, topic, sequence, payload = dealer.recv_multipart()
        if int.from_bytes(sequence, "big", signed=True) == -1:
            break
        replayed.append((topic, int.from_bytes(sequence, "big"), payload))
    assert replayed == subscriber.frames[1:]

    if VLLM_PYTHON.exists():  # vLLM's own msgspec classes decode every payload
        payloads = tmp_path / "payloads.json"
        payloads.write_text(json.dumps([payload.hex() for _, _, payload in subscriber.frames]))
        script = ("import msgspec, sys, json\n"
                  "from vllm.distributed.kv_events import KVEventBatch\n"
                  "decoder = msgspec.msgpack.Decoder(KVEventBatch)\n"
                  "batches = [decoder.decode(bytes.fromhex(p)) for p in json.load(open(sys.argv[1]))]\n"
                  "print(json.dumps([[type(e).__name__, getattr(e, 'block_hashes', None)] "
                  "for b in batches for e in b.events]))\n")
        decoded = subprocess.run([str(VLLM_PYTHON), "-c", script, str(payloads)], capture_output=True, text=True,
                                 timeout=300, cwd=tmp_path)
        assert decoded.returncode == 0, decoded.stderr[-2000:]
        assert json.loads(decoded.stdout.splitlines()[-1]) == [[e["type"], e.get("block_hashes")]
                                                             for e in subscriber.events()]
    engine.shutdown()
