"""Request: one sequence's state as it moves through the scheduler (vLLM v1's shape).

There is no prefill or decode phase: a request has `all_token_ids` (prompt, then outputs) and
`num_computed_tokens`, the prefix whose keys and values already sit in its KV blocks.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from backend.lora import LoRARequest
from backend.outputs import PromptLogprobs, RequestMetrics, SampleLogprobs
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.multimodal import ImageInput
    from backend.sampling.structured_output import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed: recomputes from scratch
    SWAPPED = "swapped"  # blocks in CPU swap space: resumes where it stopped
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, *, index: int = 0, parent_id: str | None = None,
                 cache_salt: str | None = None, priority: int = 0,
                 arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                 images: tuple[ImageInput, ...] = ()) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index  # which of the parent's n samples this is
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter this request runs with, or None for the base model
        self.images = images  # the prompt's images, in order (their placeholders are prompt tokens)
        self.priority = priority
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.num_tier_cached_tokens = 0  # of those, the ones loaded back from the second KV tier
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this request's full, cached blocks
        self.swap_blocks: list[int] = []
        self.status = RequestStatus.WAITING
        self.arrival_order: int | None = None  # set by the scheduler; orders the waiting queue
        self.num_skips = 0  # times a later request was admitted ahead of this one
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        # Prompt logprobs, one entry per prompt token (None for the first, which nothing predicts).
        # Only the first sample computes them: its siblings share the prompt (and its output).
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.grammar: RequestGrammar | None = None  # structured outputs: where the sample is in its grammar
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())

    @property
    def cache_key(self) -> str | tuple | None:
        """What the prefix cache keys this request's blocks by besides their tokens: its cache salt,
        and its adapter (two adapters compute different keys and values for the same tokens)."""
        if self.lora_request is None:
            return self.cache_salt
        return (self.cache_salt, self.lora_request.lora_int_id)

    def block_key(self, start: int, end: int) -> str | tuple | None:
        """What keys the prefix-cache block of positions [start, end) besides its tokens (and, through
        the hash chain, the blocks before it): `cache_key`, and the hash of each image whose
        placeholders it holds, since placeholder tokens are the same for every image."""
        images = tuple(image.hash for image in self.images if image.overlap(start, end) is not None)
        return (self.cache_key, images) if images else self.cache_key

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: such a request reads nothing from the prefix cache
        (a cached block's keys and values are there, its logits are not), as in vLLM."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")
