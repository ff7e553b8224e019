"""AsyncLLMEngine: the engine on its own thread, for servers (the Triton model, asyncio code).

Callers in any thread validate and tokenize their request on the spot (errors raise at once), then
hand it to the engine thread through a command queue; the engine thread steps and calls each
request's `on_output` with every new output, the last one marked finished.

Overload: at most `max_waiting_requests` samples wait for a slot; past that, `add_request` raises
EngineOverloadedError at once, before tokenizing anything.

Faults: if a step raises, the requests it may have left half-updated (running, holding KV blocks)
get a final output carrying the error and are dropped; requests that were only queued carry on.
One probe step then checks that the model still runs. If it does not, or the block bookkeeping no
longer adds up, the engine is dead: `errored` is set and every request gets the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from typing import AsyncIterator, Callable

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.outputs import RequestOutput
from backend.request import RequestStatus
from backend.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]
QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # no blocks, nothing half-computed


class RequestFailedError(RuntimeError):
    """The engine failed this request (a step raised); it goes on serving others."""


class EngineDeadError(RequestFailedError):
    """The engine has stopped for good; the server should report itself unhealthy."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the request was refused untouched and may be retried."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.max_waiting_requests = config.max_waiting_requests
        self.errored = False
        self.error: BaseException | None = None
        self.num_failed_steps = 0
        self._callbacks: dict[str, OutputCallback] = {}
        self._commands: deque = deque()
        self._num_waiting = 0  # samples queued in the engine or on their way to it
        self._wakeup = threading.Condition()
        self._stopping = False
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._build_and_run, args=(config,), name="tritonllm-engine",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name

    # -- any thread -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, *, cache_salt: str | None = None, priority: int = 0,
                    lora_request=None) -> None:
        if self.errored or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        self._refuse_if_full()  # before tokenizing: refusing must stay cheap under overload
        parent = self.engine.process_request(request_id, prompt, params, cache_salt=cache_salt,
                                             priority=priority, lora_request=lora_request)
        with self._wakeup:
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._refuse_if_full()
            self._callbacks[request_id] = on_output
            self._commands.append(("add", parent))
            self._num_waiting += len(parent.children)
            self._wakeup.notify()

    def _refuse_if_full(self) -> None:
        limit = self.max_waiting_requests
        if limit is not None and self._num_waiting >= limit:
            raise EngineOverloadedError(f"the engine is overloaded: {self._num_waiting} requests are "
                                        f"waiting (max_waiting_requests={limit}); retry later")

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._commands.append(("abort", request_id))
            self._wakeup.notify()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; leaving the loop early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.add_request(request_id, prompt, params,
                         lambda output: loop.call_soon_threadsafe(queue.put_nowait, output))
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if output.error is not None:
                    finished = True
                    raise (EngineDeadError if self.errored else RequestFailedError)(output.error)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def get_metrics(self):
        return self.engine.get_metrics()

    def num_unfinished_requests(self) -> int:
        return len(self._callbacks)

    def num_waiting_requests(self) -> int:
        return self._num_waiting

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        self.engine.shutdown()

    def _worker_died(self, message: str) -> None:
        """A tensor/pipeline-parallel rank exited (its watchdog calls this): the engine is dead even
        when idle, so that servers report it within a second rather than at the next request."""
        with self._wakeup:
            self._commands.append(("fail", message))
            self._wakeup.notify()

    # -- the engine thread ---------------------------------------------------------------------
    def _build_and_run(self, config: EngineConfig) -> None:
        """Load the model on this thread, the one that steps it: one OpenMP thread team in the
        process (see LLMEngine._warn_thread; a model loaded by the caller's thread measured 20%
        slower decode steps)."""
        try:
            self.engine = LLMEngine(config)
            self.engine.runner.on_failure = self._worker_died
        except BaseException as exc:  # noqa: BLE001 - raised again in the constructor's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._run()

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                    commands, self._commands = self._commands, deque()
                    stopping = self._stopping
                for command, argument in commands:
                    if command == "add":
                        self.engine.enqueue(argument)
                    elif command == "fail":
                        raise RuntimeError(argument)
                    else:
                        self._deliver(self.engine.abort_request(argument))
                if stopping:
                    for request_id in list(self.engine.parents):
                        self._deliver(self.engine.abort_request(request_id))
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail what the step touched, then probe
                    outputs = self._recover(exc)
                for output in outputs:
                    self._deliver(output)
                self._count_waiting()
        except BaseException as exc:  # noqa: BLE001 - the engine cannot go on: fail everyone, loudly
            logger.exception("the engine failed")
            self.error, self.errored = exc, True
            with self._wakeup:
                callbacks, self._callbacks = self._callbacks, {}
                pending = [arg for cmd, arg in self._commands if cmd == "add"]
                self._commands.clear()
            for request_id, callback in callbacks.items():
                parent = self.engine.parents.get(request_id) or next(
                    (p for p in pending if p.request_id == request_id), None)
                prompt_ids = parent.prompt_token_ids if parent else []
                self._safe_call(callback, RequestOutput(request_id, None, prompt_ids, [], True,
                                                        error=f"engine failed: {exc!r}"))

    def _count_waiting(self) -> None:
        queued = len(self.engine.scheduler.waiting) + sum(map(len, self.engine.held_siblings.values()))
        with self._wakeup:
            self._num_waiting = queued + sum(len(p.children) for c, p in self._commands if c == "add")

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """After a failed step: drop the requests it touched, check the model still runs (raising if
        not), then fail the dropped ones. Returns the probe step's outputs for the survivors."""
        self.num_failed_steps += 1
        logger.error("engine step failed; failing the requests it touched", exc_info=exc)
        touched = [(request_id, parent.prompt_token_ids) for request_id, parent in self.engine.parents.items()
                   if any(c.request.status not in QUEUED or c.request.block_table or c.request.swap_blocks
                          for c in parent.children)]
        for request_id, _ in touched:
            self.engine.abort_request(request_id)
        kv_cache = self.engine.kv_cache
        if kv_cache.num_free_blocks != kv_cache.num_blocks:  # the survivors hold no blocks
            raise RuntimeError(f"after a failed step {kv_cache.num_blocks - kv_cache.num_free_blocks} "
                               f"KV blocks belong to no request") from exc
        kv_cache.reset_prefix_cache()  # what the failed step wrote is not to be trusted
        outputs = self._probe()  # raises if the fault persists: the engine is dead
        for request_id, prompt_ids in touched:
            self._deliver(RequestOutput(request_id, None, prompt_ids, [], True,
                                        error=f"engine step failed: {exc!r}"))
        return outputs

    def _probe(self) -> list[RequestOutput]:
        """One step with a one-token request in it: raises if the model no longer runs."""
        probe_id = f"tritonllm-probe-{uuid.uuid4().hex}"
        self.engine.add_request(probe_id, [0], SamplingParams(
            max_tokens=2, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
        outputs = self.engine.step()
        self.engine.abort_request(probe_id)
        return outputs

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        with self._wakeup:
            callback = self._callbacks.get(output.request_id)
            if output.finished:
                self._callbacks.pop(output.request_id, None)
        if callback is not None:
            self._safe_call(callback, output)

    @staticmethod
    def _safe_call(callback: OutputCallback, output: RequestOutput) -> None:
        try:
            callback(output)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the engine
            logger.exception("output callback failed for request %s", output.request_id)
