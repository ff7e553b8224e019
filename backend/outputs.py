"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shape),
and the folding of a stream's outputs that a consumer has not taken yet into one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first, then token id -> Logprob (the prompt's token plus the top-N).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)  # set when the engine failed the request
    # With SamplingParams.prompt_logprobs (in a DELTA stream, only the first output carries them).
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold the next DELTA output of this request into this one, as if they had been one step's:
        each sample's text, tokens and logprobs appended, its latest cumulative logprob and finish
        (vLLM's `RequestOutput.add(..., aggregate=True)`). For a consumer that fell behind."""
        samples = {completion.index: completion for completion in self.outputs}
        for completion in later.outputs:
            mine = samples.get(completion.index)
            if mine is None:
                self.outputs.append(completion)
                continue
            mine.text += completion.text
            mine.token_ids = mine.token_ids + completion.token_ids
            if completion.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + completion.logprobs
            mine.cumulative_logprob = completion.cumulative_logprob
            mine.finish_reason, mine.stop_reason = completion.finish_reason, completion.stop_reason
        self.finished, self.metrics = later.finished, later.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs


def coalesce(items: list[tuple[object, object]]) -> tuple[list[tuple[object, object]], int]:
    """(owner, item) pairs in arrival order, with every DELTA output that queued up behind an
    unfinished output of the same owner folded into it (`RequestOutput.add`), and how many were
    folded away. Anything else (an error, an output carrying one) stays where it is, and nothing is
    folded across it."""
    merged: list[tuple[object, object]] = []
    latest: dict[int, int] = {}  # id(owner) -> index in merged of its latest item
    folded = 0
    for owner, item in items:
        index = latest.get(id(owner))
        before = merged[index][1] if index is not None else None
        if (isinstance(before, RequestOutput) and isinstance(item, RequestOutput) and not before.finished
                and before.error is None and item.error is None):
            before.add(item)
            folded += 1
        else:
            latest[id(owner)] = len(merged)
            merged.append((owner, item))
    return merged, folded
