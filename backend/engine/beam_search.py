"""Beam search: vLLM's `BeamSearchParams` / `BeamSearchOutput` shapes, scored the way Hugging Face
transformers' `generate(num_beams=k, do_sample=False)` scores them, driven from outside the engine.

Design (vLLM's): every step each live beam is one engine request for one token, asking for the
top-`beams_to_keep` logprobs of its next position; `BeamSearch.advance` picks the next beams from
those candidates. The engine itself knows nothing of beams. Beams share their KV blocks through the
block tables of the prefix cache: a step's requests find the prompt's and every earlier step's full
blocks cached (reference-counted, shared by all beams that descend from them), and each recomputes
only its own last, partial block (at most `block_size` tokens), which is what copy-on-write of that
block would have to copy anyway. Why this and not forking block tables inside the engine: the
scores come from the engine's normal sampling path (exactly the logprobs every other request gets),
beams run batched with everyone else's requests under the same scheduler, preemption and abort rules,
and no engine, scheduler or KV-cache code changes; the price is recomputing up to `block_size - 1`
tokens per beam per step. Without prefix caching every step recomputes whole beams (still exact).

Scoring follows transformers' (>= 4.50) vectorised `_beam_search`, with float32 arithmetic like its
tensors: candidates are the best `beams_to_keep = max(2, 1 + #eos) * k` of (beam score + token
logprob) over all beams; a candidate that ends in EOS or reaches `max_tokens` finishes if it is among
the first k, scored `sum_logprobs / generated_len ** length_penalty` (EOS counted); the best k
finished hypotheses are kept; the first k unfinished candidates run on. The search stops when no
running beam can beat the worst of k finished ones (`early_stopping=False`: judged at the current
length; `"never"`: at max_tokens when length_penalty > 0), once k are finished
(`early_stopping=True`), or at max_tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backend.errors import CONTEXT_LENGTH_EXCEEDED, EngineError, check
from backend.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from backend.sampling_params import RequestOutputKind, SamplingParams

MAX_BEAM_WIDTH = 32
DEAD = np.float32(-1.0e9)  # transformers' score for "no beam here"


@dataclass
class BeamSearchParams:
    """vLLM's fields, plus transformers' `early_stopping` (True, False or "never"). `temperature`
    is accepted for vLLM compatibility and changes nothing: scores are the model's raw logprobs (as
    the logprobs vLLM V1 returns, computed before temperature)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool), name, "must be an integer", value)
        check(1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width", f"must be in [1, {MAX_BEAM_WIDTH}]",
              self.beam_width)
        check(self.max_tokens >= 1, "max_tokens", "must be at least 1", self.max_tokens)
        check(isinstance(self.length_penalty, (int, float)) and not isinstance(self.length_penalty, bool)
              and np.isfinite(self.length_penalty), "length_penalty", "must be a finite number",
              self.length_penalty)
        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature",
              "must be a non-negative number", self.temperature)
        check(self.early_stopping in (True, False, "never"), "early_stopping", 'must be true, false or "never"',
              self.early_stopping)


@dataclass
class BeamSearchSequence:
    """One hypothesis. `tokens` holds the prompt too (vLLM's shape); `cum_logprob` is the sum of
    its generated tokens' logprobs, `score` that sum divided by length ** length_penalty (what the
    beams are ranked by, transformers' `sequences_scores`)."""
    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    logprobs: SampleLogprobs
    score: np.float32  # sum of logprobs, float32 as transformers accumulates it


@dataclass
class Finished:
    beam: Beam
    score: np.float32  # length-normalised


class BeamSearch:
    """One prompt's search: `inputs()` are the token sequences whose next-token logprobs are needed,
    `advance(candidates)` takes them (per running beam, its top (token, logprob, entry) best first)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.beams_to_keep = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        self.running = [Beam([], [], np.float32(0.0))]
        self.finished: list[Finished] = []
        self.num_generated = 0
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def inputs(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.token_ids for beam in self.running]

    def _normalised(self, score: np.float32, length: int) -> np.float32:
        return np.float32(score / np.float32(float(length) ** self.params.length_penalty))

    def advance(self, candidates: list[list[tuple[int, float, dict]]]) -> None:
        k, params = self.params.beam_width, self.params
        scored = [(np.float32(beam.score + np.float32(logprob)), b, token, entry)
                  for b, (beam, top) in enumerate(zip(self.running, candidates))
                  for token, logprob, entry in top[:self.beams_to_keep]]
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        scored = scored[:self.beams_to_keep]
        length = self.num_generated + 1
        ends = [token in self.eos_token_ids or length >= params.max_tokens for _, _, token, _ in scored]

        def extend(score, b, token, entry) -> Beam:
            parent = self.running[b]
            return Beam(parent.token_ids + [token], parent.logprobs + [entry], score)

        new = [Finished(extend(*c), self._normalised(c[0], length))
               for c, end in zip(scored[:k], ends[:k]) if end]
        # Stable sort: a finished hypothesis already kept wins a tie against a new one.
        self.finished = sorted(self.finished + new, key=lambda f: -f.score)[:k]
        self.running = [extend(*c) for c, end in zip(scored, ends) if not end][:k]
        self.num_generated = length

        best = self.running[0].score if self.running else DEAD
        hypothetical = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0 else length
        full = len(self.finished) == k
        if full and not self._normalised(best, hypothetical) > min(f.score for f in self.finished):
            self.improvable = False
        self.done = (not self.improvable or (full and params.early_stopping is True) or all(ends)
                     or not self.running)

    def output(self, tokenizer, lora_request=None) -> BeamSearchOutput:
        sequences = []
        for hypothesis in self.finished:
            beam = hypothesis.beam
            ended_by_eos = bool(beam.token_ids) and beam.token_ids[-1] in self.eos_token_ids
            text_ids = beam.token_ids[:-1] if ended_by_eos and not self.params.include_stop_str_in_output \
                else beam.token_ids
            text = None if tokenizer is None else tokenizer.decode(text_ids, skip_special_tokens=True)
            sequences.append(BeamSearchSequence(
                self.prompt_token_ids + beam.token_ids, beam.logprobs, float(beam.score), text,
                "stop" if ended_by_eos else "length", None, lora_request, float(hypothesis.score)))
        return BeamSearchOutput(sequences)


def step_params(search: BeamSearch) -> SamplingParams:
    """What each beam asks of the engine every step: one token (never stopping on EOS: the search
    decides that) and the top `beams_to_keep` logprobs of its next position."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, skip_special_tokens=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    params.logprobs = search.beams_to_keep  # past the API's cap of 20: an internal request
    return params


def candidates_of(output: RequestOutput) -> list[tuple[int, float, dict]]:
    """A one-token request's output -> its top (token, logprob, logprob entry), best first."""
    entry = output.outputs[0].logprobs[0]
    ranked = sorted(entry.items(), key=lambda item: (-item[1].logprob, item[0]))
    return [(token, lp.logprob, entry) for token, lp in ranked]


def check_fits(num_prompt_tokens: int, params: BeamSearchParams, max_model_len: int) -> None:
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise EngineError(None, f"This model's maximum context length is {max_model_len} tokens; the request asks "
                          f"for {num_prompt_tokens + params.max_tokens} ({num_prompt_tokens} in the prompt, "
                          f"{params.max_tokens} max_tokens). Shorten the prompt or max_tokens.",
                          CONTEXT_LENGTH_EXCEEDED, max_model_len=max_model_len,
                          prompt_tokens=num_prompt_tokens, max_tokens=params.max_tokens)


def to_request_output(request_id: str, prompt: str | None, result: BeamSearchOutput, n: int) -> RequestOutput:
    """The n best hypotheses as one finished RequestOutput (sample i = the i-th best), for servers
    that answer with per-sample arrays."""
    outputs = []
    for index, sequence in enumerate(result.sequences[:n]):
        num_prompt = len(sequence.tokens) - len(sequence.logprobs)
        outputs.append(CompletionOutput(index, sequence.text or "", sequence.tokens[num_prompt:],
                                        sequence.cum_logprob, None, sequence.finish_reason))
    prompt_ids = result.sequences[0].tokens[:len(result.sequences[0].tokens) - len(result.sequences[0].logprobs)]
    return RequestOutput(request_id, prompt, prompt_ids, outputs, True)


def pop_beam_options(values: dict) -> dict | None:
    """Take the beam-search keys out of a `sampling_parameters` object: `use_beam_search` (vLLM's)
    or `beam_width` > 1 (TensorRT-LLM's) turn it on; `length_penalty`, `early_stopping` tune it.
    Returns None when beam search is off."""
    use = values.pop("use_beam_search", None)
    width = values.pop("beam_width", None)
    options = {key: values.pop(key) for key in ("length_penalty", "early_stopping") if key in values}
    if isinstance(use, str):
        use = use.strip().lower() in ("true", "1", "yes")
    check(use is None or isinstance(use, bool), "use_beam_search", "must be a boolean", use)
    if isinstance(width, str) and width.strip().isdigit():
        width = int(width)
    check(width is None or isinstance(width, int) and not isinstance(width, bool), "beam_width",
          "must be an integer", width)
    if isinstance(options.get("length_penalty"), str):
        try:
            options["length_penalty"] = float(options["length_penalty"])
        except ValueError:
            raise EngineError("length_penalty", "must be a number", value=options["length_penalty"]) from None
    if isinstance(options.get("early_stopping"), str) and options["early_stopping"] != "never":
        options["early_stopping"] = options["early_stopping"].strip().lower() in ("true", "1", "yes")
    if not use and not (width is not None and width > 1):
        check(not options, next(iter(options), None), "needs use_beam_search (or beam_width > 1)")
        return None
    options["beam_width"] = width
    return options


def beam_params(options: dict, params: SamplingParams) -> BeamSearchParams:
    """BeamSearchParams from a request's beam options and its other sampling parameters: the beam
    width is `beam_width`, else n (vLLM's: beam search returns n beams)."""
    width = options.get("beam_width") or params.n
    check(params.n <= width, "n", f"must be at most beam_width ({width})", params.n)
    return BeamSearchParams(beam_width=width, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            include_stop_str_in_output=params.include_stop_str_in_output,
                            **{k: v for k, v in options.items() if k != "beam_width"})


class AsyncBeamSearch:
    """One beam search through an AsyncLLMEngine: each step's requests go in with callbacks; the
    last of them to finish advances the search (on the engine thread) and sends the next step's.
    `on_done` gets a BeamSearchOutput, the RequestOutput of a step request the engine failed (its
    `error` set), or the exception that ended the search (an abort too)."""

    def __init__(self, engine, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 on_done: Callable[[object], None], *, cache_salt: str | None = None, lora_request=None,
                 priority: int = 0) -> None:
        check_fits(len(prompt_token_ids), params, engine.max_model_len)
        self.engine = engine
        self.request_id = request_id
        self.search = BeamSearch(prompt_token_ids, params, engine.engine.eos_token_ids)
        self.on_done = on_done
        self.options = {"cache_salt": cache_salt, "lora_request": lora_request, "priority": priority}
        self.lock = threading.Lock()
        self.pending: dict[str, RequestOutput | None] = {}
        self.num_steps = 0
        self.aborted = False
        self.ended = False

    def start(self) -> None:
        """Send the first step (raises, sending nothing, if the engine refuses it)."""
        self._submit()

    def abort(self) -> None:
        with self.lock:
            self.aborted = True
            outstanding = [request_id for request_id, output in self.pending.items() if output is None]
        for request_id in outstanding:
            self.engine.abort(request_id)

    def _submit(self) -> None:
        params = step_params(self.search)
        inputs = self.search.inputs()
        ids = [f"{self.request_id}-beam{self.num_steps}-{i}" for i in range(len(inputs))]
        self.num_steps += 1
        with self.lock:
            self.pending = dict.fromkeys(ids)
        for request_id, tokens in zip(ids, inputs):
            try:
                self.engine.add_request(request_id, tokens, params,
                                        lambda output, rid=request_id: self._on_output(rid, output),
                                        **self.options)
            except Exception:
                self.abort()  # what this step already sent
                with self.lock:
                    self.pending = {}
                raise

    def _on_output(self, request_id: str, output: RequestOutput) -> None:
        with self.lock:
            if request_id not in self.pending or self.ended:
                return
            self.pending[request_id] = output
            if any(o is None for o in self.pending.values()):
                return
            outputs = list(self.pending.values())
        failed = next((o for o in outputs if o.error is not None or not o.outputs
                       or o.outputs[0].finish_reason == "abort"), None)
        if failed is not None and failed.error is not None:
            return self._end(failed)  # the step's error, as the engine reported it
        if failed is not None or self.aborted:
            return self._end(RuntimeError("beam search aborted"))
        try:
            self.search.advance([candidates_of(o) for o in outputs])
            if self.search.done:
                return self._end(self.search.output(self.engine.tokenizer, self.options["lora_request"]))
            self._submit()
        except Exception as error:
            self._end(error)

    def _end(self, result) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.on_done(result)
