"""Many Tritons behind one frontend: where each request goes, which replicas are up, where they are.

- Routing: `least-outstanding` (the default), `round-robin`, or `prefix`: the prompt's first
  token blocks pick a replica by rendezvous hashing, so requests that share a system prompt land
  where its KV blocks are cached, unless that replica is far busier than the least loaded one.
  With the replicas' KV events (kv_index.py), `prefix` routes by what their caches really hold:
  to the replica with the longest cached prefix of the prompt when that is at least half of it,
  else to the least loaded; first-block hashing only until some replica has published events.
- Health: every HEALTH_INTERVAL_S a background check asks each replica whether its `llm` model is
  ready and then probes the model's own process (triton.py's `probe`: Triton keeps a model READY
  after its Python stub died); any UNAVAILABLE from a call marks its replica down at once. Its
  `embeddings` model is checked alike but apart: when only that one is down, /v1/embeddings fails
  fast with a 503 naming it and the LLM's requests carry on. A
  replica that is loaded but does not answer (a dead stub, a frozen Triton) is `broken`: its
  watchdog fails a request there that has waited STALL_S for its next response with a 503 (an SSE
  error event mid-stream) instead of letting it hang. A request that fails on a replica before its first response is tried on
  another one; after that, only that request fails. `request_timeout` bounds every request.
- Discovery: fixed `host:port` addresses, a file of them re-read at every check, and `dns:///name:port`
  entries (a Kubernetes headless Service) whose every address is a replica, re-resolved likewise.

`Replicas` offers TritonClient's calls (`generate`, `embed`, `model_ready`, `close`), so the routers
never know how many Tritons there are.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from openai_frontend.errors import OpenAIError
from openai_frontend.kv_index import KVEventIndex
from openai_frontend.media import ImagePrompt
from openai_frontend.triton import (EMBEDDINGS_MODEL, LLM_MODEL, Chunk, ReplicaUnavailable, RequestTimeout,
                                    TritonClient)

ROUTING = ("least-outstanding", "prefix", "round-robin")
HEALTH_INTERVAL_S = 2.0
# A request on a broken replica fails once it has waited this long for its next response. Not at
# once: a probe can miss its deadline while the model is merely busy (a long execute call).
STALL_S = 5.0
STALL_CHECK_S = 0.5
DNS_PREFIX = "dns:///"
# The prefix key: the prompt's first PREFIX_BLOCKS whole blocks of BLOCK_TOKENS (the engine's
# default block size), enough to tell system prompts apart and short enough to ignore the question.
BLOCK_TOKENS = 16
PREFIX_BLOCKS = 4
# Prefix routing gives way to load when its replica has more than twice the outstanding requests
# of the least loaded one, and at least this many more.
FALLOVER_EXCESS = 8
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    url: str
    client: TritonClient | None = None  # None only in tests of the policies
    ready: bool = False  # its llm model answered ready at the last check, and no call failed since
    broken: str | None = None  # why Triton or the model's process stopped answering; None if they answer
    outstanding: int = 0  # requests sent and not finished
    requests: int = 0  # requests ever sent here
    reading: set[Reader] = field(default_factory=set)  # its generations in progress
    watchdog: asyncio.Task | None = None  # while it is broken and has generations in progress
    embeddings_ready: bool = False  # its embeddings model, as `ready` for the llm model
    embeddings_broken: str | None = None  # why its loaded embeddings model does not answer; None if it does

    def serves(self, model: str) -> bool:
        return self.embeddings_ready if model == EMBEDDINGS_MODEL else self.ready


class Reader:
    """One generation reading a replica's stream, as its replica's watchdog sees it: `wait()` before
    each wait for the next response, `task = None` once it came. Leaving the `with` block with the
    watchdog's cancellation raises a 503 `model_unavailable` instead (a stalled request fails;
    another cancellation, such as the client leaving, stays one)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.task: asyncio.Task | None = None  # the task waiting for the next response; None when not waiting
        self.since = 0.0  # when it began to wait
        self.stalled: str | None = None  # why the watchdog cancelled it

    def wait(self) -> None:
        self.task, self.since = asyncio.current_task(), asyncio.get_running_loop().time()

    def __enter__(self) -> Reader:
        self.replica.reading.add(self)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.replica.reading.discard(self)
        if exc_type is asyncio.CancelledError and self.stalled is not None and self.only_cancellation():
            raise OpenAIError(503, self.stalled, None, "model_unavailable") from None

    def only_cancellation(self) -> bool:
        """Whether the watchdog's cancellation of the task is the only one (Python 3.10 cannot tell)."""
        uncancel = getattr(self.task, "uncancel", None)
        return uncancel is None or uncancel() == 0


# -- policies: pure functions of the candidates' state -----------------------------------------------
def least_outstanding(candidates: list[Replica], turn: int) -> Replica:
    """Fewest outstanding; ties take turns, so idle replicas share a trickle of requests."""
    least = min(replica.outstanding for replica in candidates)
    return round_robin([replica for replica in candidates if replica.outstanding == least], turn)


def round_robin(candidates: list[Replica], turn: int) -> Replica:
    return candidates[turn % len(candidates)]


def prefix_key(token_ids: list[int]) -> bytes | None:
    """A stable hash of the prompt's first whole blocks; None when it has no whole block."""
    blocks = min(len(token_ids) // BLOCK_TOKENS, PREFIX_BLOCKS)
    if blocks == 0:
        return None
    head = np.asarray(token_ids[:blocks * BLOCK_TOKENS], dtype="<i8").tobytes()
    return hashlib.blake2b(head, digest_size=16).digest()


def rendezvous_order(candidates: list[Replica], key: bytes) -> list[Replica]:
    """Highest random weight first: adding or losing a replica moves only the keys it wins or held."""
    def weight(replica: Replica) -> bytes:
        return hashlib.blake2b(key + replica.url.encode(), digest_size=8).digest()
    return sorted(candidates, key=weight, reverse=True)


def overloaded(outstanding: int, least: int) -> bool:
    return outstanding > 2 * least and outstanding - least >= FALLOVER_EXCESS


def cache_affine(candidates: list[Replica], cached: list[int], num_blocks: int, turn: int) -> Replica:
    """With KV events: the replica holding the most of the prompt's `num_blocks` leading blocks
    (`cached`, one count per candidate) when that is at least half of them and it is not overloaded
    against the least loaded (ties: the least loaded of those); otherwise the least loaded, which
    then computes the prefix and keeps it."""
    least = min(replica.outstanding for replica in candidates)
    usable = [(count, replica) for count, replica in zip(cached, candidates)
              if not overloaded(replica.outstanding, least)]
    best = max(count for count, _ in usable)
    if best == 0 or 2 * best < num_blocks:
        return least_outstanding(candidates, turn)
    return least_outstanding([replica for count, replica in usable if count == best], turn)


def prefix_affine(candidates: list[Replica], key: bytes) -> Replica:
    """The key's first replica in rendezvous order that is not overloaded against the least loaded
    (there is always one: the least loaded itself), so a hot prefix spills to a stable second."""
    least = min(replica.outstanding for replica in candidates)
    return next(replica for replica in rendezvous_order(candidates, key)
                if not overloaded(replica.outstanding, least))


# -- discovery --------------------------------------------------------------------------------------
def parse_urls(text: str) -> list[str]:
    """A urls file: one `host:port` or `dns:///name:port` a line; blank lines and `#` comments skipped."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ipaddress.ip_address(host).version == 6 else f"{host}:{port}"


async def resolve(entry: str) -> list[str]:
    """`dns:///name:port` -> one `ip:port` per address the name has (sorted); others as they are."""
    if not entry.startswith(DNS_PREFIX):
        return [entry]
    host, _, port = entry[len(DNS_PREFIX):].rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return sorted({address(str(info[4][0]), int(port)) for info in infos})


class Replicas:
    def __init__(self, urls: Iterable[str], routing: str = "least-outstanding",
                 urls_file: str | None = None, request_timeout: float | None = None,
                 decode: Callable[[list[int]], str] | None = None, kv_index: KVEventIndex | None = None) -> None:
        self.entries, self.urls_file, self.routing = list(urls), urls_file, routing
        self.kv_index = kv_index  # the replicas' cache contents, from their KV events (prefix routing)
        self.decode = decode  # TritonClient's: prompts sent as text, to Triton's vLLM backend
        self.request_timeout = request_timeout  # seconds for a whole request, retries included
        self.replicas: dict[str, Replica] = {}  # by url, in discovery order
        self.retired: list[Replica] = []  # no longer listed; closed once their requests end
        self.last_resolved: dict[str, list[str]] = {}  # an entry's last good listing
        self.turn = 0
        self.watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Discover and check every replica once, then keep doing it in the background."""
        await self.refresh()
        self.watcher = asyncio.create_task(self.watch())

    async def close(self) -> None:
        tasks = [self.watcher, *(replica.watchdog for replica in [*self.replicas.values(), *self.retired])]
        for task in tasks:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(task for task in tasks if task is not None), return_exceptions=True)
        for replica in [*self.replicas.values(), *self.retired]:
            await replica.client.close()
        if self.kv_index is not None:
            await self.kv_index.close()
        self.replicas.clear()
        self.retired.clear()

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self.refresh()
            except Exception:  # the check must outlive any one failure
                logger.exception("replica refresh failed")

    # -- discovery and health ------------------------------------------------------------------
    async def listed(self) -> list[str]:
        entries = list(self.entries)
        if self.urls_file is not None:
            try:
                entries += parse_urls(Path(self.urls_file).read_text(encoding="utf-8"))
            except OSError as error:
                logger.warning("cannot read %s (%s); keeping the replicas it listed", self.urls_file, error)
                return list(self.replicas)
        urls = []
        for entry in entries:
            try:
                self.last_resolved[entry] = await resolve(entry)
            except (OSError, ValueError) as error:  # DNS down, or a name with no address yet
                logger.warning("cannot resolve %s (%s); keeping its last addresses", entry, error)
            urls += [url for url in self.last_resolved.get(entry, []) if url not in urls]
        return urls

    async def refresh(self) -> None:
        urls = await self.listed()
        for url in urls:
            if url not in self.replicas:
                self.replicas[url] = Replica(url, TritonClient(url, self.decode))
                logger.info("replica %s added", url)
        for url in [url for url in self.replicas if url not in urls]:
            self.retired.append(self.replicas.pop(url))
            logger.info("replica %s removed", url)
        for replica in [r for r in self.retired if r.outstanding == 0]:
            self.retired.remove(replica)
            await replica.client.close()
        if self.kv_index is not None:
            self.kv_index.follow(list(self.replicas))
        await asyncio.gather(*(self.check(replica) for replica in list(self.replicas.values())))

    @staticmethod
    async def model_health(replica: Replica, model: str) -> tuple[bool, str | None]:
        """(loaded, why it is broken or None). Broken: Triton does not answer, or the model is loaded
        and its process does not answer a probe (a model merely not loaded, or unloading, is not)."""
        try:
            loaded = await replica.client.model_ready(model)
            return loaded, (await replica.client.probe(model) if loaded else None)
        except OpenAIError as error:
            return False, error.message

    async def check(self, replica: Replica) -> bool:
        """Ready: Triton answers, the llm model is loaded, and its process answers a probe; the
        embeddings model likewise, apart (asked only when Triton answered)."""
        loaded, broken = await self.model_health(replica, LLM_MODEL)
        ready = loaded and broken is None
        if ready != replica.ready or broken != replica.broken:
            logger.log(logging.INFO if ready else logging.WARNING, "replica %s is %s", replica.url,
                       "ready" if ready else f"not ready: {broken}" if broken else "not ready")
        replica.ready, replica.broken = ready, broken
        if broken is not None and replica.reading and replica.watchdog is None:
            replica.watchdog = asyncio.create_task(self.fail_stalled(replica))
        unreachable = broken is not None and not loaded
        had_embeddings = replica.embeddings_ready or replica.embeddings_broken is not None
        if unreachable:  # its embeddings model is down with it
            embeddings_loaded, embeddings_broken = False, broken
        else:
            embeddings_loaded, embeddings_broken = await self.model_health(replica, EMBEDDINGS_MODEL)
        if not embeddings_loaded and not had_embeddings:  # a model it never served is not down, though
            embeddings_broken = None  # Triton died before or during the check (else /health stayed 503)
        if embeddings_broken != replica.embeddings_broken and not unreachable:
            logger.log(logging.WARNING if embeddings_broken else logging.INFO, "replica %s: the `%s` model %s",
                       replica.url, EMBEDDINGS_MODEL, f"is down: {embeddings_broken}" if embeddings_broken else "answers")
        replica.embeddings_ready = embeddings_loaded and embeddings_broken is None
        replica.embeddings_broken = embeddings_broken
        return ready

    @staticmethod
    async def fail_stalled(replica: Replica) -> None:
        """While `replica` is broken, fail each generation there once it has waited STALL_S for its next
        response: a dead stub or a frozen Triton never answers nor closes the stream. Its task is
        cancelled inside the wait (so its gRPC call is too) and the generation raises a 503. One
        watchdog per broken replica, none when all answer: a streamed response costs no timer."""
        loop = asyncio.get_running_loop()
        try:
            while replica.broken is not None and replica.reading:
                now = loop.time()
                for reader in replica.reading:
                    if reader.task is not None and reader.stalled is None and now - reader.since >= STALL_S:
                        reader.stalled = f"Triton at {replica.url} stopped answering this request: {replica.broken}"
                        reader.task.cancel()
                await asyncio.sleep(STALL_CHECK_S)
        finally:
            replica.watchdog = None

    def mark_down(self, replica: Replica, error: OpenAIError) -> None:
        if replica.ready:
            logger.warning("replica %s marked down: %s", replica.url, error.message)
        replica.ready = replica.embeddings_ready = False

    def embeddings_down(self) -> str | None:
        """Why no replica can serve the embeddings model, when it is loaded somewhere and broken
        wherever it is not ready; None otherwise (not loaded anywhere counts as not served, not as
        down). From the last check, so asking costs Triton nothing."""
        replicas = list(self.replicas.values())
        broken = [replica.embeddings_broken for replica in replicas if replica.embeddings_broken]
        return broken[0] if broken and not any(replica.embeddings_ready for replica in replicas) else None

    # -- routing -------------------------------------------------------------------------------
    def pick(self, token_ids: list[int] | None, tried: list[Replica], model: str = LLM_MODEL) -> Replica:
        candidates = [r for r in self.replicas.values() if r.serves(model) and r not in tried]
        if not candidates and model == EMBEDDINGS_MODEL:
            why = self.embeddings_down() or "not ready on any Triton replica"
            raise OpenAIError(503, f"The `{EMBEDDINGS_MODEL}` model is unavailable: {why}", None, "model_unavailable")
        if not candidates:
            raise OpenAIError(503, f"no Triton replica is ready ({len(self.replicas)} known)", None,
                              "service_unavailable")
        self.turn += 1
        if self.routing == "round-robin":
            return round_robin(candidates, self.turn)
        if self.routing == "prefix" and token_ids and self.kv_index is not None and \
                self.kv_index.live([r.url for r in candidates]):
            return self.route_by_cache(candidates, token_ids)
        key = prefix_key(token_ids) if self.routing == "prefix" and token_ids else None
        return prefix_affine(candidates, key) if key is not None else least_outstanding(candidates, self.turn)

    def route_by_cache(self, candidates: list[Replica], token_ids: list[int]) -> Replica:
        assert self.kv_index is not None
        index = self.kv_index
        hashes = index.prompt_hashes(token_ids, index.block_size([r.url for r in candidates]))
        if not hashes:
            return least_outstanding(candidates, self.turn)
        cached = [index.cached_blocks(replica.url, hashes) for replica in candidates]
        replica = cache_affine(candidates, cached, len(hashes), self.turn)
        index.expect(replica.url, hashes)
        return replica

    @contextmanager
    def sent(self, replica: Replica):
        replica.outstanding += 1
        replica.requests += 1
        try:
            yield
        finally:
            replica.outstanding -= 1

    def retry_elsewhere(self, replica: Replica, error: OpenAIError) -> bool:
        """Whether a request that failed before its first response may go to another replica:
        503s only (unreachable, model unloaded, overloaded); the first two also mark it down."""
        if isinstance(error, ReplicaUnavailable) or error.code == "model_unavailable":
            self.mark_down(replica, error)
        return error.status == 503

    # -- deadlines -----------------------------------------------------------------------------
    def deadline(self) -> float | None:
        return None if not self.request_timeout else asyncio.get_running_loop().time() + self.request_timeout

    def time_left(self, deadline: float | None) -> float | None:
        if deadline is None:
            return None
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RequestTimeout(self.request_timeout)
        return left

    # -- TritonClient's calls ------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], sampling_parameters: dict, *, stream: bool,
                       prompt_param: str = "prompt", images: ImagePrompt | None = None) -> AsyncGenerator[Chunk, None]:
        tried: list[Replica] = []
        deadline = self.deadline()
        while True:
            replica = self.pick(prompt_token_ids, tried)
            tried.append(replica)
            started = False
            with self.sent(replica):
                try:
                    generation = replica.client.generate(prompt_token_ids, sampling_parameters, stream=stream,
                                                         prompt_param=prompt_param, timeout=self.time_left(deadline),
                                                         images=images)
                    async with aclosing(generation):
                        with Reader(replica) as reader:  # a 503 if the watchdog finds it stalled
                            reader.wait()
                            async for chunk in generation:
                                reader.task, started = None, True
                                yield chunk
                                reader.wait()
                    return
                except OpenAIError as error:
                    if not self.retry_elsewhere(replica, error) or started:
                        raise
                    last_error = error
            if not any(r.ready and r not in tried for r in self.replicas.values()):
                raise last_error

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """On replicas whose embeddings model answers; one that fails there is set aside for it
        until the next check, and its llm model keeps serving."""
        tried: list[Replica] = []
        deadline = self.deadline()
        while True:
            replica = self.pick(None, tried, EMBEDDINGS_MODEL)
            tried.append(replica)
            with self.sent(replica):
                try:
                    return await replica.client.embed(texts, timeout=self.time_left(deadline))
                except OpenAIError as error:
                    if isinstance(error, ReplicaUnavailable):
                        self.mark_down(replica, error)
                    elif error.code == "model_unavailable":
                        replica.embeddings_ready = False
                    if error.status != 503:
                        raise
                    last_error = error
            if not any(r.embeddings_ready and r not in tried for r in self.replicas.values()):
                raise last_error

    async def model_ready(self, model: str) -> bool:
        """Whether any replica has `model` ready; 503 when none can be reached at all. For the LLM,
        the background check's verdict (which probes the model's process; see `check`), so health
        probes cost Triton nothing."""
        replicas = list(self.replicas.values())
        if model == LLM_MODEL:
            if any(replica.ready for replica in replicas):
                return True
            if replicas and all(replica.broken for replica in replicas):
                raise OpenAIError(503, f"no Triton replica answers ({len(replicas)} known): "
                                       f"{replicas[0].broken}", None, "service_unavailable")
            return False
        answers = await asyncio.gather(*(r.client.model_ready(model) for r in replicas), return_exceptions=True)
        if any(answer is True for answer in answers):
            return True
        if all(isinstance(answer, Exception) for answer in answers):
            raise OpenAIError(503, f"no Triton replica is reachable ({len(replicas)} known)", None,
                              "service_unavailable")
        return False

    def all(self) -> list[Replica]:
        return list(self.replicas.values())
