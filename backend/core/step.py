"""The step contract as data (vLLM v1's shape): the scheduler's plan for one step, what the model
runner made of it, and what the scheduler then appended to each request.

    scheduler.schedule(drafts)                                   -> SchedulerOutput
    runner.execute_model(SchedulerOutput)                        -> ModelRunnerOutput
    scheduler.update_from_output(SchedulerOutput, ModelRunnerOutput) -> StepUpdate

Nothing here holds a tensor, and nothing is read from a request that the step wrote there before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend.core.request import Request
    from backend.sampling.prompt_logprobs import PromptScores


@dataclass
class SchedulerOutput:
    """Which requests compute how many tokens this step (a decode's count includes the speculative
    drafts it verifies, which `spec_token_ids` holds by request id), who was preempted or admitted,
    and which blocks the block mover copies before the step runs: to and from swap space, and to
    and from the second KV tier (its slots are host-store blocks too)."""
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    newly_admitted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, swap block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, device block)
    offload: list[tuple[int, int]] = field(default_factory=list)  # (evicted device block, tier slot)
    load: list[tuple[int, int]] = field(default_factory=list)  # (tier slot, device block): tier prefix hits

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def moves_to_host(self) -> list[tuple[int, int]]:
        return self.swap_out + self.offload

    @property
    def moves_to_device(self) -> list[tuple[int, int]]:
        return self.swap_in + self.load

    def drafts(self, request: Request) -> list[int]:
        return self.spec_token_ids.get(request.request_id, [])


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step, the tokens it adds (a verified decode: the drafts the
    target agreed with, then its own next token) and, when asked for, each one's logprobs
    (chosen logprob, rank, top-N); and the prompt positions scored for prompt logprobs."""
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    prompt_scores: list[PromptScores] = field(default_factory=list)


@dataclass
class SampledTokens:
    """What a step appended to one request: its new tokens (up to the first that stops it) and
    their logprobs, for the output processor."""
    request: Request
    token_ids: list[int]
    logprobs: list[Any]


@dataclass
class StepUpdate:
    """What `update_from_output` did: the tokens appended to each request, and the requests that
    finished (their blocks already freed)."""
    appended: list[SampledTokens] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
