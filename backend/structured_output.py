"""Structured outputs: a request's JSON schema, regex, choice or grammar becomes an xgrammar matcher
that says, token by token, which tokens may come next.

The engine compiles each spec once (an LRU keyed by kind and spec) against tokenizer information
built once per engine; every request (every sample of n) gets its own matcher. The sampler masks
the logits of constrained rows with one bitmask for the batch; the engine advances a matcher with
each token it appends, and a grammar that has run its course ends the request ("stop"). Only output
tokens move a matcher, so recomputing a preempted request's prompt and outputs leaves it untouched.
xgrammar loads with the first constrained request, never for a batch without one.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from backend.errors import EngineError
from backend.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar

    from backend.request import Request

JSON_OBJECT_SCHEMA = {"type": "object"}
# JSON may put whitespace between any two tokens, and a small model, once it starts, may never stop
# (vLLM's known failure): a run is capped, which still leaves room to indent a few levels deep.
MAX_WHITESPACE_RUN = 16
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


class GrammarCompiler:
    """Compiles specs against one tokenizer, with an LRU of compiled grammars; safe from any thread
    (requests are validated on the server's threads while the engine steps on its own)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], cache_size: int = 128) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, str], "xgrammar.CompiledGrammar"] = OrderedDict()
        self.lock = threading.Lock()
        self._compiler = None

    def compiler(self) -> "xgrammar.GrammarCompiler":
        """Built on first use: tokenizer information costs a pass over the vocabulary."""
        import xgrammar as xgr

        if self._compiler is None:
            if self.tokenizer is None:
                raise EngineError("structured_outputs", "needs a tokenizer (skip_tokenizer_init is set)")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our LRU caches
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        key = spec.key
        with self.lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                self.cache.move_to_end(key)
                return compiled
            grammar = build_grammar(spec)
            try:
                compiled = self.compiler().compile_grammar(grammar)
            except RuntimeError as error:
                reason = XGRAMMAR_NOISE.sub("", str(error).strip())
                raise EngineError("structured_outputs", f"cannot compile: {reason}") from None
            self.cache[key] = compiled
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
            return compiled


class RequestGrammar:
    """One sample's position in its grammar."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar") -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # output tokens fed so far

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
    # Its torch kernel: on the CPU, 4x faster than its C++ one (0.8 against 3.1 ms for 16 x 49152).
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows,
                                    backend="torch_native")
