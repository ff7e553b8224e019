"""AsyncLLMEngine: the engine on its own thread, for servers (the Triton model, asyncio code).

Callers in any thread validate and tokenize their request on the spot (errors raise at once), then
hand it to the engine thread through a command queue; the engine thread steps and calls each
request's `on_output` with every new output, the last one marked finished. If a step fails, the
engine is marked errored and every request in flight receives a final output carrying the error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
    pass


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.errored = False
        self.error: BaseException | None = None
        self._callbacks: dict[str, OutputCallback] = {}
        self._commands: deque = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tritonllm-engine", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, *, cache_salt: str | None = None, priority: int = 0) -> None:
        if self.errored or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        parent = self.engine.process_request(request_id, prompt, params, cache_salt=cache_salt,
                                             priority=priority)
        with self._wakeup:
            if request_id in self._callbacks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._callbacks[request_id] = on_output
            self._commands.append(("add", parent))
            self._wakeup.notify()

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
                    raise EngineDeadError(output.error)
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def get_metrics(self):
        return self.engine.get_metrics()

    def num_unfinished_requests(self) -> int:
        return len(self._callbacks)

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------
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
                    else:
                        self._deliver(self.engine.abort_request(argument))
                if stopping:
                    for request_id in list(self.engine.parents):
                        self._deliver(self.engine.abort_request(request_id))
                    return
                for output in self.engine.step():
                    self._deliver(output)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine step failed")
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
