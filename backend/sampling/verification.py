"""Sampling a step whose decodes verify speculative drafts (backend/engine/spec_decode.py proposes them).

Drafts are one-hot (q(d) = 1), and for those speculative rejection sampling (accept d with probability
min(1, p(d) / q(d)) = p(d), else sample from normalize(max(0, p - q)), which is p without d) is the
same as sampling the target's token x ~ p at every position as usual and accepting the draft while
x == d: the first x that differs is the correction, and after k agreements the last row yields a
bonus token. So verification is the Sampler itself (penalties, top-k/p, seeds and logprobs
included) over one row per position, each row seeing the request as if the drafts before it were
accepted: outputs keep exactly the target's distribution (greedy and seeded requests: token for
token, since a seeded generator is rewound to the positions kept).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from backend.core.request import Request
from backend.sampling.sampler import Sampler, draw_uniform


def verification_rows(requests: list[Request], drafts: list[list[int]]) -> list[Request]:
    """One row per scored position: each request, then for its i-th draft a copy that sees the
    drafts before it as output (for penalties, min_tokens and seeds, which draw row by row)."""
    if not any(drafts):
        return requests
    rows = []
    for request, proposed in zip(requests, drafts):
        rows.append(request)
        for i in range(1, len(proposed) + 1):
            view = copy.copy(request)
            view.all_token_ids = request.all_token_ids + proposed[:i]
            rows.append(view)
    return rows


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step appends: the drafts the target sampled too, then its first other token
    (or, all drafts accepted, the bonus token of the last row)."""
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return sampled[:num_accepted + 1]


def sample_and_verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request],
                      drafts: list[list[int]]) -> list[tuple[list[int], list[Any]]]:
    """Each request's new tokens and their logprobs: one token, or with drafts (logits then hold
    1 + len(drafts) consecutive rows for it) the drafts the target agrees with and its own next
    token. A seeded request's generator draws once per row, then is replayed for the rows kept, so
    its n-th token always gets its n-th draw, as without speculation."""
    states = {id(r): r.generator.get_state() for r, proposed in zip(requests, drafts)
              if proposed and r.generator is not None and not r.params.greedy}
    result = sampler(logits, verification_rows(requests, drafts))
    sampled, row = [], 0
    for request, proposed in zip(requests, drafts):
        tokens = accepted_tokens(proposed, result.token_ids[row:row + 1 + len(proposed)])
        sampled.append((tokens, result.logprobs[row:row + len(tokens)]))
        state = states.get(id(request))
        if state is not None:  # one draw per row kept (rows are drawn one by one, from one stream)
            request.generator.set_state(state)
            for _ in tokens:
                draw_uniform(request.generator)
        row += 1 + len(proposed)
    return sampled
