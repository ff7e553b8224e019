"""Prompt logprobs (SamplingParams.prompt_logprobs): which positions of a prefill chunk score prompt
tokens, and those positions' logits -> each prompt token's logprob, rank and the top-N.

The logits at position p predict token p + 1, so a chunk covering positions [start, start + n)
scores prompt tokens start + 1 ... start + n (the last prompt position predicts the first output
token instead, and is sampled as usual). Positions already scored are skipped, so a request
preempted and recomputed mid-prompt never scores a token twice. Logprobs are the raw model's
(log_softmax of the logits before any sampling parameter changes them), as vLLM's are.

Prefix-cached blocks hold keys and values, not logits: a request that still needs prompt logprobs
reads nothing from the prefix cache (`Request.needs_prompt_logprobs`, as vLLM does), so every prompt
position is computed; chunked prefill scores the same positions, a chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.core.request import Request

SCORE_ROWS = 256  # rows log-softmaxed at a time: bounds the copy a long prompt chunk makes


@dataclass
class PromptScores:
    """One request's scored prompt tokens in one step: tokens first_token ... first_token + len - 1,
    each (its logprob, its rank, [(token id, logprob)] for the top-N)."""
    request: Request
    first_token: int
    entries: list[tuple[float, int, list[tuple[int, float]]]]


def positions_to_score(request: Request, start: int, num_tokens: int) -> range:
    """The positions of a chunk [start, start + num_tokens) whose logits score prompt tokens not
    yet scored (empty unless the request asks for prompt logprobs)."""
    if request.prompt_logprobs is None:
        return range(0)
    first = max(start, len(request.prompt_logprobs) - 1)
    return range(first, min(start + num_tokens, request.num_prompt_tokens - 1))


def score(logits: torch.Tensor, spans: list[tuple[Request, range]]) -> list[PromptScores]:
    """`logits` holds one row per position of `spans` (each a request and its scored positions, in
    order): each row's next prompt token's logprob and rank, and the request's top-N."""
    results, row = [], 0
    for request, positions in spans:
        targets = torch.tensor(request.prompt_token_ids[positions.start + 1:positions.stop + 1])
        k = request.params.prompt_logprobs
        entries = []
        for offset in range(0, len(positions), SCORE_ROWS):
            rows = logits[row + offset:row + min(offset + SCORE_ROWS, len(positions))].float()
            logprobs = rows.log_softmax(dim=-1)
            chosen = logprobs.gather(1, targets[offset:offset + len(rows)].to(logprobs.device).unsqueeze(1))
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
            for lp, rank, ids, lps in zip(chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(),
                                          top_lp.tolist()):
                entries.append((lp, rank, list(zip(ids, lps))))
        results.append(PromptScores(request, positions.start + 1, entries))
        row += len(positions)
    return results
