"""SamplingParams: how one request is decoded, with vLLM's field names and defaults."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

from backend.config import cast_value, json_object_option
from backend.errors import EngineError, check

MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's bound
MAX_JSON_DEPTH = 64  # nesting of a JSON option (a schema, sampling_parameters): deeper is refused


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1       # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrained decoding, vLLM's names: exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF / GBNF) or
    `json_object` (any JSON object). Checked for shape here; the engine compiles the grammar and
    refuses one it cannot compile."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise EngineError("structured_outputs", "give exactly one of json, regex, choice, grammar, "
                              f"json_object; got {kinds or 'none'}")
        if isinstance(self.json, str):
            self.json = parse_json(self.json, "structured_outputs")
        if self.json is not None and not isinstance(self.json, dict):
            raise EngineError("structured_outputs", f"json must be a JSON schema object, got {self.json!r:.80}")
        check_json_depth(self.json, "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and bool(value)), "structured_outputs",
                  f"{name} must be a non-empty string")
        check(self.choice is None or (isinstance(self.choice, list) and bool(self.choice)
                                      and all(isinstance(c, str) and c for c in self.choice)),
              "structured_outputs", "choice must be a list of non-empty strings")
        check(isinstance(self.disable_any_whitespace, bool), "structured_outputs",
              "disable_any_whitespace must be a boolean")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec as text): what identifies the compiled grammar."""
        if self.json is not None:
            kind = "json_compact" if self.disable_any_whitespace else "json"
            return kind, json.dumps(self.json)  # key order matters: it is the output order
        if self.json_object:
            return ("json_object_compact" if self.disable_any_whitespace else "json_object"), ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """From a dict (or its JSON text), as `sampling_parameters` carries it."""
        value = json_object_option("structured_outputs", value, [f.name for f in fields(cls)])
        return cls(**{k: v for k, v in value.items() if v is not None})


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob, and the top-N at its position
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stream_interval: int | None = None  # streamed outputs every this many tokens (None: the server's)
    bad_words: list[str] | None = None  # words never generated (vLLM's: the last token of each is banned
    #                                     where the output already ends with the ones before it)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Set by the engine, never by users: end-of-sequence ids from the model's generation config.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Set by the engine from bad_words: the token sequences to ban (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check(isinstance(self.stop, (list, tuple, type(None))), "stop", "must be a string or a list of strings",
              self.stop)
        self.stop = [s for s in (self.stop or []) if s] or None
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = token_biases(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        integers = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed", "stream_interval",
                    "truncate_prompt_tokens")
        for name in integers:
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool)), name,
                  "must be an integer", value)
        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
        for name in numbers:
            value = getattr(self, name)
            check(not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value),
                  name, "must be a finite number", value)

        def bound(ok: bool, name: str, message: str) -> None:
            check(ok, name, message, getattr(self, name))

        bound(self.n >= 1, "n", "must be at least 1")
        bound(self.n <= 128, "n", "must be at most 128")
        bound(self.temperature >= 0.0, "temperature", "must be non-negative")
        bound(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        bound(self.top_k >= 0, "top_k", "must be 0 or -1 (disable), or at least 1")
        bound(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        bound(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        bound(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        bound(self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero")
        bound(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1")
        bound(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        bound(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", f"must be at most max_tokens ({self.max_tokens})")
        bound(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]")
        bound(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
              "must be in [0, 20]")
        bound(self.stream_interval is None or self.stream_interval >= 1, "stream_interval", "must be at least 1")
        bound(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids or []),
              "stop_token_ids", "must be non-negative integers")
        bound(self.seed is None or -(1 << 63) <= self.seed < (1 << 64), "seed", "must fit in 64 bits")
        bound(all(isinstance(s, str) for s in self.stop or []), "stop", "must be strings")
        check(all(abs(bias) <= MAX_LOGIT_BIAS for bias in (self.logit_bias or {}).values()), "logit_bias",
              f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        bound(self.bad_words is None or (isinstance(self.bad_words, list)
                                         and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
              "bad_words", "must be a list of non-blank strings")
        bound(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and bool(self.allowed_token_ids)
                                                 and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in self.allowed_token_ids)),
              "allowed_token_ids", "must be a non-empty list of token ids")
        bound(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1
              or self.truncate_prompt_tokens == -1, "truncate_prompt_tokens", "must be at least 1, or -1 (max_model_len)")

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in its vocabulary. The one place they are
        written: the engine and the OpenAI frontend both call it."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []),
                          ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            check(not bad, name, f"token ids must be in [0, {vocab_size})", bad[:5])
        if self.top_k > vocab_size:
            self.top_k = 0  # keeping more tokens than exist keeps them all

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON object (Triton's `sampling_parameters`); numeric strings are cast."""
        known = {f.name: f for f in fields(cls)
                 if f.name not in ("output_kind", "all_stop_token_ids", "bad_words_token_ids")}
        unknown = sorted(set(values) - set(known))
        check(not unknown, unknown[0] if len(unknown) == 1 else None,
              f"unknown sampling parameter(s): {', '.join(unknown)}")
        cast = {}
        for name, value in values.items():
            type_name = str(known[name].type)
            try:
                if name == "bad_words" and isinstance(value, str) and value.strip().startswith("["):
                    cast[name] = json.loads(value)  # JSON text: the generate endpoints take no lists
                elif name in ("stop", "structured_outputs", "logit_bias", "bad_words"):
                    cast[name] = value
                elif isinstance(value, str) and name in ("stop_token_ids", "allowed_token_ids"):
                    cast[name] = [int(v) for v in value.strip("[]").split(",") if v.strip()]
                else:
                    value = cast_value(name, type_name, value)
                    if type_name.startswith("int") and isinstance(value, float) and value.is_integer() \
                            and abs(value) < 2 ** 63:
                        value = int(value)  # JSON writers may send 16.0 for 16
                    cast[name] = value
            except EngineError:
                raise
            except (TypeError, ValueError, OverflowError) as error:  # cast_value's, int()'s
                message = str(error).removeprefix(f"{name}: ")
                if message.startswith("cannot read"):
                    raise EngineError(name, message) from None
                raise EngineError(name, "invalid value", value=value) from None
        return cls(**cast)


def parse_json(text: str, name: str, **options: Any) -> Any:
    """JSON text -> a value no deeper than MAX_JSON_DEPTH; EngineErrors naming `name` otherwise
    (never a RecursionError, which would be a traceback per request)."""
    try:
        value = json.loads(text, **options)
    except json.JSONDecodeError as error:
        raise EngineError(name, f"not valid JSON ({error})") from None
    except RecursionError:
        raise EngineError(name, f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_json_depth(value, name)
    return value


def check_json_depth(value: Any, name: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON value nested deeper than `limit` (walked without recursion)."""
    level, depth = [value], 0
    while level:
        depth += 1
        check(depth <= limit, name, f"nested deeper than {limit} levels")
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]


def token_biases(values: Any) -> dict[int, float]:
    """logit_bias as {token id: bias}; JSON gives the ids as strings."""
    check(isinstance(values, dict), "logit_bias", "must be an object of token id -> bias", values)
    biases = {}
    for key, bias in values.items():
        check(isinstance(key, int) and not isinstance(key, bool)
              or isinstance(key, str) and key.strip().lstrip("-").isdigit() and key.isascii(),
              "logit_bias", "keys must be token ids", key)
        check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias),
              "logit_bias", "biases must be finite numbers", bias)
        biases[int(key)] = float(bias)
    return biases
