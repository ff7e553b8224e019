"""Structured outputs: a request's JSON schema, regex, choice or grammar becomes an xgrammar matcher
that says, token by token, which tokens may come next.

The engine checks each spec when its request is added and compiles it once (an LRU keyed by kind and
spec) on a small worker pool against tokenizer information built once per engine; the request waits
in the queue until its grammar is ready, and every request (every sample of n) gets its own matcher. The sampler masks
the logits of constrained rows with one bitmask for the batch; the engine advances a matcher with
each token it appends, and a grammar that has run its course ends the request ("stop"). Only output
tokens move a matcher, so recomputing a preempted request's prompt and outputs leaves it untouched.
xgrammar loads with the first constrained request, never for a batch without one.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from backend.errors import EngineError, check
from backend.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar

    from backend.core.request import Request

JSON_OBJECT_SCHEMA = {"type": "object"}
# JSON may put whitespace between any two tokens, and a small model, once it starts, may never stop
# (vLLM's known failure): a run is capped, which still leaves room to indent a few levels deep.
MAX_WHITESPACE_RUN = 16
# Bounds on what one request may ask for: the spec's size (its JSON text: choices, schema, regex or
# grammar), the time its compilation may take, and the bytes the cache of compiled grammars holds.
MAX_SPEC_BYTES = 256 << 10
COMPILE_TIMEOUT_S = 60.0  # generous: compiles run at the lowest CPU priority
MAX_CACHE_BYTES = 512 << 20
NUM_COMPILE_WORKERS = 2
# xgrammar prefixes its errors with a time stamp and a C++ source location.
XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def build_grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The spec as an xgrammar Grammar (no tokenizer needed); ValueError if it is not a valid one."""
    import xgrammar as xgr

    whitespace = {"any_whitespace": not spec.disable_any_whitespace, "max_whitespace_cnt": MAX_WHITESPACE_RUN}
    kind = spec.key[0].removesuffix("_compact")
    try:
        if spec.json is not None:
            # strict_mode: no properties or items beyond the schema's, so generation can end.
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), strict_mode=True, **whitespace)
        if spec.json_object:
            return xgr.Grammar.from_json_schema(json.dumps(JSON_OBJECT_SCHEMA), strict_mode=False, **whitespace)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            # JSON string literals are EBNF string literals (escapes included).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as error:  # xgrammar's errors are RuntimeErrors mostly; any failure means a bad spec
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar (EBNF)"}[kind]
        reason = XGRAMMAR_NOISE.sub("", str(error).strip())
        raise EngineError("structured_outputs", f"invalid {what}: {reason}") from None


def lower_thread_priority() -> None:
    """Run the calling thread at the lowest CPU priority (Linux: a thread id is a process id here).
    A compile that competes for a core with the engine's OpenMP threads stalls every parallel region
    of a step behind the thread it preempted; at nice 19 it takes only what the steps leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class GrammarCompiler:
    """Validates specs on the caller's thread (parsing is quick, so a bad spec is refused when added)
    and compiles them on a small worker pool (compiling a large one takes seconds, which must not
    stall the engine's steps or a server's request thread). An LRU, bounded in entries and bytes,
    holds the compilations by spec: requests with the same spec share one, finished or under way."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], cache_size: int = 128,
                 cache_bytes: int = MAX_CACHE_BYTES, num_workers: int = NUM_COMPILE_WORKERS) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self.compile_timeout_s = COMPILE_TIMEOUT_S
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.lock = threading.Lock()
        self.compiler_lock = threading.Lock()
        self.num_workers = num_workers
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None

    def compiler(self) -> "xgrammar.GrammarCompiler":
        """Built on first use, on a request's thread (it reads the tokenizer): tokenizer information
        costs a pass over the vocabulary."""
        import xgrammar as xgr

        with self.compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our LRU caches
            return self._compiler

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The spec's compilation (a Future of a CompiledGrammar), started if not cached. Raises
        EngineError at once for a spec that is too large or not valid."""
        check(self.tokenizer is not None, "structured_outputs", "needs a tokenizer (skip_tokenizer_init is set)")
        key = spec.key
        with self.lock:
            future = self.cache.get(key)
            if future is not None:
                self.cache.move_to_end(key)
                return future
        size = len(key[1].encode())
        check(size <= MAX_SPEC_BYTES, "structured_outputs",
              f"the spec is {size} bytes; at most {MAX_SPEC_BYTES} are accepted")
        grammar = build_grammar(spec)
        compiler = self.compiler()
        with self.lock:
            future = self.cache.get(key)
            if future is not None:  # another thread submitted it meanwhile
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="tritonllm-grammar",
                                                initializer=lower_thread_priority)
            future = self._pool.submit(self._compile, compiler, grammar)
            future.started = time.monotonic()  # type: ignore[attr-defined]
            self.cache[key] = future
        self._evict()
        future.add_done_callback(lambda _: self._evict())
        return future

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar, waiting for it (EngineError if it cannot be compiled)."""
        return self.submit(spec).result()

    @staticmethod
    def _compile(compiler: "xgrammar.GrammarCompiler", grammar: "xgrammar.Grammar") -> "xgrammar.CompiledGrammar":
        try:
            return compiler.compile_grammar(grammar)
        except RuntimeError as error:
            reason = XGRAMMAR_NOISE.sub("", str(error).strip())
            raise EngineError("structured_outputs", f"cannot compile: {reason}") from None

    def _evict(self) -> None:
        """Drop least recently used entries past the entry or byte bound (requests holding an
        evicted grammar keep it)."""
        with self.lock:
            sizes = {key: f.result().memory_size_bytes for key, f in self.cache.items()
                     if f.done() and f.exception() is None}
            while len(self.cache) > 1 and (len(self.cache) > self.cache_size
                                           or sum(sizes.values()) > self.cache_bytes):
                key, _ = self.cache.popitem(last=False)
                sizes.pop(key, None)

    def failure(self, future: Future) -> EngineError | None:
        """Why a compilation will not serve its requests: it failed, or it has run past the time
        bound (it goes on in the background and stays cached, but its requests are refused)."""
        if future.done():
            return future.exception()  # type: ignore[return-value]
        started: float = future.started  # type: ignore[attr-defined]
        if time.monotonic() - started > self.compile_timeout_s:
            return EngineError("structured_outputs", f"the grammar did not compile within "
                                                     f"{self.compile_timeout_s:g} s; simplify it")
        return None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sample's position in its grammar."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self._matcher: "xgrammar.GrammarMatcher | None" = None
        self.num_accepted = 0  # output tokens fed so far

    def is_ready(self) -> bool:
        """Compiled: the request may be scheduled (until then it waits in the queue)."""
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def matcher(self) -> "xgrammar.GrammarMatcher":
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def advance(self, request: "Request", token_id: int) -> None:
        """Feed the output token just appended; end the request once the grammar is done."""
        assert self.num_accepted == request.num_output_tokens - 1, "a grammar saw a token twice or missed one"
        self.num_accepted += 1
        # A refused token means the row had no legal token left (only possible if something after the
        # mask removed them all); the output cannot continue within the grammar either way.
        if not self.matcher.accept_token(token_id) or self.matcher.is_terminated():
            request.finish_reason = request.finish_reason or "stop"

    def is_completed(self) -> bool:
        """The output so far is a whole sentence of the grammar (it may still go on)."""
        return self.matcher.is_completed()


def apply_grammar_bitmask(logits: torch.Tensor, requests: list["Request"], rows: list[int]) -> None:
    """Set to -inf, in place, every logit the grammar of `rows` forbids; one bitmask for the batch."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row in rows:
        requests[row].grammar.matcher.fill_next_token_bitmask(bitmask, row)
    # Its torch kernel: on the CPU, faster than its C++ one (docs/benchmarks.md, "Measured reasons").
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows,
                                    backend="torch_native")
