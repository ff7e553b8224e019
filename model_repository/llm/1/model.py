"""Triton's face of the engine: request tensors in, engine requests out, engine outputs back as
responses. It speaks the tensor contract of Triton's vLLM backend, so that backend's clients work.

Threads: Triton calls `execute`, which validates (request_parsing.py) and hands requests to the
engine, nothing more. The engine steps on its own thread and calls back with each output; one
sender thread turns outputs into responses, polls for cancellation and owns every FINAL flag, so
each request gets exactly one on every path (success, error, cancel, unload). It takes whatever
has queued up at once, a step's outputs together, and when it has fallen behind a stream it sends
that stream's waiting outputs as one response (`coalesce`): a send is a round trip to tritonserver,
so a slow path sends fewer, larger messages instead of falling further behind. The same thread
copies the engine's metrics to Triton's metrics port (triton_metrics.py) twice a second and before
it sends final responses, so a scrape right after a request's last response already counts it.

Errors: a bad request is INVALID_ARG; a full waiting queue is UNAVAILABLE ("overloaded", like
Triton's own queue-full error); a failed engine step is INTERNAL for the requests it touched. If
the engine dies, the model unloads itself so that it reads as not ready (or, where model control
is off, its stub exits: `tritonllm serve` then exits non-zero for a supervisor to restart).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

try:
    from backend import AsyncLLMEngine, EngineConfig, RequestOutput
    from backend.engine.async_engine import EngineDeadError, EngineOverloadedError
    from backend.errors import ENGINE_OVERLOADED, MODEL_UNAVAILABLE, EngineError, parse_wire
except ImportError as error:  # the stub runs an isolated Python: PYTHONPATH does not count
    raise ImportError("tritonllm's `backend` package is not importable by Triton's Python stub; "
                      "install it into the Python that runs tritonserver (pip install -e .)") from error

from backend.engine.beam_search import AsyncBeamSearch, BeamSearchOutput, beam_params, to_request_output
from backend.errors import EngineError
from backend.lora import RUNTIME_LORA_ENV, LoRARegistry, LoRARequest, parse_lora_modules, runtime_lora_updating
from backend.engine.metrics import Metric
from backend.outputs import coalesce
import sys

# Installed as the `tritonllm` backend (tools/triton_server.py), this file's neighbours are
# imported from its own folder, wherever Triton's backend directory is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from auto_complete import complete_config
from request_parsing import parse_request
from triton_metrics import MetricsExporter

CANCEL_POLL_S = 0.1
# is_cancelled() is an IPC round trip to Triton (~136 us alone, more under load): a poll checks at
# most this many requests, taking turns, so 64 streams cost 160 checks a second, not 640.
CANCEL_CHECKS_PER_POLL = 16
METRICS_POLL_S = 0.5
STUB_EXIT_DELAY_S = 2.0  # after an engine failure that the model cannot unload itself from
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
MULTI_LORA_FILE = "multi_lora.json"  # {"name": "path"} beside model.json, as Triton's vLLM backend reads it
COALESCED_METRIC = "tritonllm:stream_outputs_coalesced"  # exported with `_total`, as counters are


@dataclass
class Job:
    """One Triton request on its way through the engine."""
    request_id: str
    request: object  # pb_utils.InferenceRequest, kept to poll is_cancelled()
    sender: object   # its response sender
    flags: dict[str, bool] = field(default_factory=dict)
    n: int = 1
    logprobs_asked: bool = False  # the client set sampling logprobs (else logprobs output is null)
    finish_reasons: list = field(default_factory=list)  # last known per sample (n > 1 streams)
    cumulative_logprobs: list = field(default_factory=list)
    beam: AsyncBeamSearch | None = None  # a beam search (use_beam_search / beam_width) in place of a request
    cancelled: bool = False
    unloading: bool = False
    done: bool = False


def lora_registry(config: EngineConfig, model_dir: str) -> LoRARegistry | None:
    """The adapters served by name: model.json's lora_modules, then multi_lora.json's (paths relative
    to the model folder); None without enable_lora."""
    if not config.enable_lora:
        return None
    modules = dict(config.lora_modules or {})
    path = os.path.join(model_dir, MULTI_LORA_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            listed = json.load(file)
        if not isinstance(listed, dict):
            raise ValueError(f"{MULTI_LORA_FILE}: expected {{\"name\": \"path\"}}")
        modules.update(parse_lora_modules({name: os.path.join(model_dir, os.path.expanduser(p))
                                           for name, p in listed.items()}))
    return LoRARegistry(modules)


def ends_a_request(item) -> bool:
    return not isinstance(item, RequestOutput) or item.finished


def string_tensor(name: str, values: list[str]):
    return pb_utils.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """A repository with only `backend: "tritonllm"` gets the tensors and streaming (auto_complete.py)."""
        return complete_config(auto_complete_model_config)

    def initialize(self, args: dict) -> None:
        self.model_name = args["model_name"]
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ValueError("the llm model needs `model_transaction_policy { decoupled: true }`")
        with open(f"{pb_utils.get_model_dir()}/model.json", encoding="utf-8") as file:
            engine_config = EngineConfig.from_dict(json.load(file))
        self.loras = lora_registry(engine_config, pb_utils.get_model_dir())
        self.engine = AsyncLLMEngine(engine_config)
        self.jobs: dict[str, Job] = {}
        self.jobs_lock = threading.Lock()
        self.outbox: queue.Queue = queue.Queue()
        self.poll_cursor = 0  # where the next cancellation poll starts in the job list
        self.unload_requested = False
        self.num_coalesced = 0  # engine outputs sent inside an earlier one's response (`coalesce`)

        self.metrics = None
        report = model_config.get("parameters", {}).get("REPORT_CUSTOM_METRICS", {})
        if report.get("string_value", "true").lower() == "true":
            try:
                self.metrics = MetricsExporter(self._readings(),
                                               {"model": self.model_name, "version": args["model_version"]})
            except pb_utils.TritonModelException as error:  # e.g. tritonserver --allow-metrics=false
                pb_utils.Logger.log_warn(f"[llm] metrics not exported: {error}")
        # Started last: it reads self.metrics.
        self.sender_thread = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self.sender_thread.start()

    # -- requests in ---------------------------------------------------------------------------
    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        job = Job(uuid.uuid4().hex, request, request.get_response_sender())
        if self.engine.errored or self.unload_requested:
            error = pb_utils.TritonError("the engine has failed; the model is unavailable",
                                         pb_utils.TritonError.UNAVAILABLE)
            self.outbox.put((job, error))
            return
        try:
            prompt, params, job.flags, cache_salt, lora = parse_request(request, self.engine.generation_defaults)
            lora_request = self._lora_request(lora)
            job.n = params.n
            job.logprobs_asked = params.logprobs is not None
            if job.flags["return_cumulative_logprob"] and params.logprobs is None:
                params.logprobs = 0  # the engine sums logprobs only when it computes them
            if job.flags["return_prompt_logprobs"] and params.prompt_logprobs is None:
                params.prompt_logprobs = 0  # the prompt tokens' own logprobs, no top-N
            job.finish_reasons = [None] * job.n
            job.cumulative_logprobs = [0.0] * job.n
            if job.flags["beam"] is not None:
                return self._submit_beam(job, prompt, params, cache_salt, lora_request)
            # Registered and handed over under one lock, so the sender thread never aborts (on a
            # cancellation) a request the engine has not been given yet.
            with self.jobs_lock:
                self.jobs[job.request_id] = job
                self.engine.add_request(job.request_id, prompt, params,
                                        lambda output, job=job: self.outbox.put((job, output)),
                                        cache_salt=cache_salt, lora_request=lora_request,
                                        priority=job.flags["priority"])
        except Exception as error:
            with self.jobs_lock:
                self.jobs.pop(job.request_id, None)
            self.outbox.put((job, self._triton_error(error)))

    def _submit_beam(self, job: Job, prompt, params, cache_salt, lora_request) -> None:
        """Beam search: one final response whose n samples are the n best beams, best first."""
        prompt_text, prompt_ids = self.engine.engine.tokenize(prompt)
        if params.max_tokens is None:  # the rest of the context, as for other requests
            params.max_tokens = max(self.engine.max_model_len - len(prompt_ids), 1)
        beam = beam_params(job.flags["beam"], params)

        def done(result, job=job) -> None:
            if isinstance(result, BeamSearchOutput):
                result = to_request_output(job.request_id, prompt_text, result, job.n)
            self.outbox.put((job, result))

        with self.jobs_lock:
            self.jobs[job.request_id] = job
            job.beam = AsyncBeamSearch(self.engine, job.request_id, prompt_ids, beam, done, cache_salt=cache_salt,
                                       lora_request=lora_request, priority=job.flags["priority"])
            job.beam.start()

    def _abort(self, job: Job) -> None:
        if job.beam is not None:
            job.beam.abort()
        else:
            self.engine.abort(job.request_id)

    def _lora_request(self, lora: dict) -> LoRARequest | None:
        """The adapter a request names (`lora_name` in sampling_parameters, as Triton's vLLM backend
        reads it): one of lora_modules / multi_lora.json, or, with runtime updating allowed, any
        folder given as `lora_path` (the OpenAI frontend sends it for adapters loaded at runtime)."""
        if not lora:
            return None
        if self.loras is None:
            raise EngineError("lora_name", "this model serves no LoRA adapters (enable_lora is off)")
        name = lora.get("lora_name")
        if name is None:
            raise EngineError("lora_name", "required with lora_path")
        if "lora_path" in lora:
            if not runtime_lora_updating():
                raise EngineError("lora_path", f"loading adapters by path needs {RUNTIME_LORA_ENV}=true on the server")
            return self.loras.add(name, lora["lora_path"])
        return self.loras.get(name)

    def _triton_error(self, error: Exception):
        """A refused request's error: the client's mistake, too much load, or ours. Errors a client
        can act on carry their code and parameter (backend/errors.py's wire form) for the frontend."""
        if isinstance(error, EngineDeadError):
            self._on_engine_failure(str(error))
            return pb_utils.TritonError("the engine has failed; the model is unavailable",
                                        pb_utils.TritonError.UNAVAILABLE)
        if isinstance(error, EngineOverloadedError):
            error = EngineError(None, str(error), ENGINE_OVERLOADED)
        elif isinstance(error, ValueError) and not isinstance(error, EngineError):
            error = EngineError(None, str(error))
        if isinstance(error, EngineError):
            # UNAVAILABLE when the load is to blame, as for Triton's own queue-full error.
            status = (pb_utils.TritonError.UNAVAILABLE if error.code in (ENGINE_OVERLOADED, MODEL_UNAVAILABLE)
                      else pb_utils.TritonError.INVALID_ARG)
            return pb_utils.TritonError(error.wire(), status)
        pb_utils.Logger.log_error(f"[llm] request failed: {traceback.format_exc()}")
        return pb_utils.TritonError(f"internal error: {type(error).__name__}", pb_utils.TritonError.INTERNAL)

    # -- responses out (the sender thread) -----------------------------------------------------
    def _send_loop(self) -> None:
        last_poll = last_metrics = time.monotonic()
        while True:
            try:
                items = [self.outbox.get(timeout=CANCEL_POLL_S)]
            except queue.Empty:
                items = []
            while True:  # and everything else already waiting: a step's outputs come together
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            stopping = None in items
            items, folded = coalesce([item for item in items if item is not None])
            self.num_coalesced += folded
            if any(ends_a_request(item) for _, item in items):
                self._update_metrics()  # the engine counted these requests before their last outputs
            for job, item in items:
                try:
                    self._deliver(job, item)
                except Exception:  # one bad response must not stop every other request's
                    pb_utils.Logger.log_error(f"[llm] sending a response failed: "
                                              f"{traceback.format_exc()}")
            if stopping:
                return
            if time.monotonic() - last_poll >= CANCEL_POLL_S:
                last_poll = time.monotonic()
                self._poll_cancellations()
            if time.monotonic() - last_metrics >= METRICS_POLL_S:
                last_metrics = time.monotonic()
                if self.engine.errored:  # e.g. a tensor-parallel worker died while no request ran
                    self._on_engine_failure(repr(self.engine.error))
                self._update_metrics()

    def _poll_cancellations(self) -> None:
        with self.jobs_lock:
            jobs = [job for job in self.jobs.values() if not job.cancelled]
        start = self.poll_cursor % len(jobs) if jobs else 0
        jobs = (jobs[start:] + jobs[:start])[:CANCEL_CHECKS_PER_POLL]
        self.poll_cursor = start + len(jobs)
        for job in jobs:
            if job.request.is_cancelled():
                job.cancelled = True
                # The vLLM backend's log lines, which its cancellation test looks for in Triton's log.
                pb_utils.Logger.log_info("[vllm] Cancelling the request")
                self._abort(job)  # its final output (finish_reason abort) follows

    def _deliver(self, job: Job, item: RequestOutput | pb_utils.TritonError) -> None:
        if job.done:
            return
        if isinstance(item, Exception):  # a beam search ended without a result
            item = (RequestOutput(job.request_id, None, [], [], True) if job.cancelled or job.unloading
                    else self._triton_error(item))
        if isinstance(item, pb_utils.TritonError):
            return self._finish(job, pb_utils.InferenceResponse(error=item))
        output = item
        if output.error is not None and parse_wire(output.error)[0] is not None:  # refused once queued
            error = pb_utils.TritonError(output.error, pb_utils.TritonError.INVALID_ARG)  # (a grammar)
            return self._finish(job, pb_utils.InferenceResponse(error=error))
        if output.error is not None:  # a failed step: this request is lost, maybe the engine too
            if self.engine.errored:
                self._on_engine_failure(output.error)
            error = pb_utils.TritonError(f"engine error: {output.error}", pb_utils.TritonError.INTERNAL)
            return self._finish(job, pb_utils.InferenceResponse(error=error))
        if job.cancelled or job.unloading:
            if output.finished:
                message, code = (("request cancelled", pb_utils.TritonError.CANCELLED) if job.cancelled
                                 else ("the model is being unloaded", pb_utils.TritonError.UNAVAILABLE))
                if job.cancelled:
                    pb_utils.Logger.log_info("[vllm] Successfully cancelled the request")
                self._finish(job, pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)))
            return
        response = self._response(job, output)
        if output.finished:
            self._finish(job, response)
        else:
            job.sender.send(response)

    def _finish(self, job: Job, response) -> None:
        job.done = True
        with self.jobs_lock:
            self.jobs.pop(job.request_id, None)
        job.sender.send(response, flags=FINAL)
        # Triton unloads the model only once every request object is released; a callback the
        # engine still holds must not keep this one alive.
        job.request = job.sender = None

    def _response(self, job: Job, output: RequestOutput):
        """One response: arrays with one element per sample (n), like the vLLM backend's."""
        texts = [""] * job.n
        num_output_tokens = [0] * job.n
        logprobs = ["null"] * job.n
        for completion in output.outputs:
            i = completion.index
            texts[i] = completion.text
            num_output_tokens[i] = len(completion.token_ids)
            job.finish_reasons[i] = completion.finish_reason
            if completion.cumulative_logprob is not None:
                job.cumulative_logprobs[i] = completion.cumulative_logprob
            if job.logprobs_asked and completion.logprobs is not None:
                logprobs[i] = json.dumps([
                    {token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                     for token_id, lp in position.items()}
                    for position in completion.logprobs])
        if job.flags["prepend_input"]:
            texts = [(output.prompt or "") + text for text in texts]
        tensors = [string_tensor("text_output", texts)]
        if job.flags["return_finish_reason"]:
            # "None" for samples still running, as the vLLM backend sends.
            tensors.append(string_tensor("finish_reason", [str(r) for r in job.finish_reasons]))
        if job.flags["return_cumulative_logprob"]:
            cumulative = np.array(job.cumulative_logprobs, np.float32)
            tensors.append(pb_utils.Tensor("cumulative_logprob", cumulative))
        if job.flags["return_logprobs"]:
            tensors.append(string_tensor("logprobs", logprobs))
        if job.flags["return_num_input_tokens"]:
            num_input_tokens = np.array([len(output.prompt_token_ids)], np.uint32)
            tensors.append(pb_utils.Tensor("num_input_tokens", num_input_tokens))
        if job.flags["return_num_output_tokens"]:
            # DELTA outputs carry only new tokens, so this is the count since the previous response.
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array(num_output_tokens, np.uint32)))
        if job.flags["return_num_cached_tokens"]:  # prompt tokens served from the prefix cache
            tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([output.num_cached_tokens], np.uint32)))
        if job.flags["return_prompt_logprobs"]:  # JSON in the first response, "null" in later ones
            tensors.append(string_tensor("prompt_logprobs", [json.dumps(
                None if output.prompt_logprobs is None else
                [None if position is None else
                 {token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                  for token_id, lp in position.items()} for position in output.prompt_logprobs])]))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # -- health and metrics --------------------------------------------------------------------
    def _on_engine_failure(self, message: str) -> None:
        if self.unload_requested:
            return
        self.unload_requested = True
        pb_utils.Logger.log_error(f"[llm] engine failed, unloading the model: {message}")
        try:
            pb_utils.unload_model(self.model_name)  # non-blocking; needs --model-control-mode=explicit
        except Exception as error:
            # Model control is off (`tritonllm serve`'s default). Triton would keep reporting the
            # model ready, so this stub exits once the failed requests' errors are out: `serve`
            # sees its stub gone and exits non-zero for a supervisor to restart it.
            pb_utils.Logger.log_error(f"[llm] could not unload the model ({error}); the stub exits")
            threading.Timer(STUB_EXIT_DELAY_S, os._exit, args=(1,)).start()

    def _readings(self) -> list:
        """The engine's metrics and this model's own."""
        coalesced = Metric(COALESCED_METRIC, "counter", "Engine outputs sent inside an earlier output's "
                           "response, the sender having fallen behind", value=self.num_coalesced, key=COALESCED_METRIC)
        return [*self.engine.get_metrics(), coalesced]

    def _update_metrics(self) -> None:
        """Only ever on the sender thread, so the exporter needs no lock."""
        if self.metrics is not None:
            try:
                self.metrics.update(self._readings())
            except Exception:
                pb_utils.Logger.log_error(f"[llm] metrics update failed: {traceback.format_exc()}")

    # -- unload --------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Abort what is still running (each gets a final UNAVAILABLE error), then stop every thread."""
        self.unload_requested = True
        with self.jobs_lock:
            jobs = list(self.jobs.values())
        for job in jobs:
            job.unloading = True
            self._abort(job)
        deadline = time.monotonic() + 10
        while self.jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        self.engine.shutdown()
        self.outbox.put(None)
        self.sender_thread.join()
        for job in list(self.jobs.values()):  # the engine never answered these: answer for it
            self._finish(job, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "the model is being unloaded", pb_utils.TritonError.UNAVAILABLE)))
        if self.metrics is not None:
            self.metrics.close()  # stops updating; Triton's metric objects live on (triton_metrics.py)
            self.metrics = None
        self.engine = None
        gc.collect()
