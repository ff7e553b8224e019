"""AsyncLLMEngine: the engine on its own thread, for servers (the Triton model, asyncio code).

Callers in any thread validate and tokenize their request on the spot (errors raise at once), then
hand it to the engine thread through a command queue; the engine thread steps and calls each
request's `on_output` with every new output, the last one marked finished.

Overload: at most `max_waiting_requests` samples wait for a run slot beyond the `max_num_seqs` that
run (free run slots count: a burst into an idle engine fills them first). Past that, `add_request`
raises EngineOverloadedError (code `engine_overloaded`) at once, before tokenizing anything; a request
whose n alone can never fit is an `invalid_parameter` EngineError on `n`.

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
from backend.engine.engine import LLMEngine
from backend.errors import ENGINE_OVERLOADED, EngineError, check, parse_wire
from backend.outputs import RequestOutput
from backend.sampling_params import RequestOutputKind, SamplingParams
from backend.worker.cpu_policy import reclaim_for_compute

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], object]


class RequestFailedError(RuntimeError):
    """The engine failed this request (a step raised); it goes on serving others."""


class EngineDeadError(RequestFailedError):
    """The engine has stopped for good; the server should report itself unhealthy."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the request was refused untouched and may be retried."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message, ENGINE_OVERLOADED)


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_waiting_requests = config.max_waiting_requests
        self.errored = False
        self.error: BaseException | None = None
        self.num_failed_steps = 0
        self._callbacks: dict[str, OutputCallback] = {}
        self._commands: deque = deque()
        self._num_waiting = 0  # samples queued in the engine or on their way to it
        self._num_running = 0  # samples in the engine's running batch
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
        self.generation_defaults = self.engine.generation_defaults

    # -- any thread -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    on_output: OutputCallback, *, cache_salt: str | None = None, priority: int = 0,
                    lora_request=None) -> None:
        if self.errored or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        self._admit(params.n)  # before tokenizing: refusing must stay cheap under overload
        parent = self.engine.process_request(request_id, prompt, params, cache_salt=cache_salt,
                                             priority=priority, lora_request=lora_request)
        with self._wakeup:
            check(request_id not in self._callbacks, "request_id", "is already in use", request_id)
            self._admit(len(parent.children))
            self._callbacks[request_id] = on_output
            self._commands.append(("add", parent))
            self._num_waiting += len(parent.children)
            self._wakeup.notify()

    def _admit(self, num_samples: int) -> None:
        """Raise unless `num_samples` more samples leave at most `max_waiting_requests` of them
        waiting for one of the `max_num_seqs` run slots."""
        limit = self.max_waiting_requests
        if limit is None:
            return
        capacity = self.max_num_seqs + limit
        check(num_samples <= capacity, "n", f"at most {capacity} samples can run or wait at once "
              f"(max_num_seqs={self.max_num_seqs} + max_waiting_requests={limit})", num_samples)
        in_engine = self._num_running + self._num_waiting
        if in_engine + num_samples > capacity:
            raise EngineOverloadedError(
                f"the engine is overloaded: {max(in_engine - self.max_num_seqs, 0)} samples are waiting "
                f"for a run slot (max_num_seqs={self.max_num_seqs}, max_waiting_requests={limit}) and "
                f"this request has {num_samples}; retry later")

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
                    code, param, message = parse_wire(output.error)
                    if code is not None:  # refused after it was queued (a grammar that did not compile)
                        error = EngineError(None, message, code)
                        error.param = param
                        raise error
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
        process (see LLMEngine._warn_thread: a model loaded by the caller's thread makes slower
        decode steps). Under `tritonllm serve` this thread also takes back the normal CPU policy
        first (backend/worker/cpu_policy.py)."""
        reclaim_for_compute()
        try:
            self.engine = LLMEngine(config)
            self.engine.on_worker_failure(self._worker_died)
        except BaseException as exc:  # raised again in the constructor's thread
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
                    for request_id in self.engine.request_ids():
                        self._deliver(self.engine.abort_request(request_id))
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # fail what the step touched, then probe
                    outputs = self._recover(exc)
                for output in outputs:
                    self._deliver(output)
                self._count_waiting()
        except BaseException as exc:  # the engine cannot go on: fail everyone, loudly
            logger.exception("the engine failed")
            self.error, self.errored = exc, True
            with self._wakeup:
                callbacks, self._callbacks = self._callbacks, {}
                pending = [arg for cmd, arg in self._commands if cmd == "add"]
                self._commands.clear()
            for request_id, callback in callbacks.items():
                pending_parent = next((p for p in pending if p.request_id == request_id), None)
                prompt_ids = self.engine.prompt_token_ids(request_id) or (
                    pending_parent.prompt_token_ids if pending_parent else [])
                self._safe_call(callback, RequestOutput(request_id, None, prompt_ids, [], True,
                                                        error=f"engine failed: {exc!r}"))

    def _count_waiting(self) -> None:
        queued, running = self.engine.num_queued_samples(), self.engine.num_running_samples()
        with self._wakeup:
            self._num_running = running
            self._num_waiting = queued + sum(len(p.children) for c, p in self._commands if c == "add")

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """After a failed step: drop the requests it touched, check the model still runs (raising if
        not), then fail the dropped ones. Returns the probe step's outputs for the survivors."""
        self.num_failed_steps += 1
        logger.error("engine step failed; failing the requests it touched", exc_info=exc)
        touched = [(request_id, self.engine.prompt_token_ids(request_id))
                   for request_id in self.engine.started_request_ids()]
        for request_id, _ in touched:
            self.engine.abort_request(request_id)
        orphaned = self.engine.num_used_blocks()  # the survivors, only queued, hold none
        if orphaned:
            raise RuntimeError(f"after a failed step {orphaned} KV blocks belong to no request") from exc
        self.engine.reset_prefix_cache()  # what the failed step wrote is not to be trusted
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
        except Exception:  # a caller's bug must not stop the engine
            logger.exception("output callback failed for request %s", output.request_id)
