"""Sampler: logits -> next tokens (and logprobs) for a whole batch at once.

Processing order follows vLLM: structured outputs first set to -inf what their grammars forbid
(one bitmask for the batch, built only when some request is constrained), so greedy and sampled
tokens alike obey them; raw logprobs are taken from those logits before anything else changes them;
then min_tokens suppression, logit_bias and penalties; then greedy rows take the argmax while the
others go through temperature, top-k, top-p and min-p and draw by inverting each row's cumulative
distribution at one uniform number. One number per row, not one per vocabulary entry: the
exponential-race trick (argmax of probs / Exp(1) noise) draws a number per vocabulary entry and
row (3 M for 64 rows of a 49k vocabulary). On the CPU, when no row uses top-k, top-p or min-p, one
C++ pass per row does it all (docs/benchmarks.md, "Measured reasons behind code choices"). A seeded
request draws its number from its own generator, so its tokens do not depend on its batch mates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.ops import cpu_ops
from backend.core.request import Request
from backend.sampling.structured_output import apply_grammar_bitmask


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: None, or (sampled token's logprob, its rank, [(token_id, logprob) for the top-N]).
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        params = [r.params for r in requests]
        constrained = [row for row, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            apply_grammar_bitmask(logits, requests, constrained)
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None

        self._suppress_stop_tokens(logits, requests)
        self._apply_allowed_and_bad_words(logits, requests)
        self._apply_logit_bias(logits, requests)
        if any(p.uses_penalties for p in params):
            apply_penalties(logits, requests)

        greedy = [p.greedy for p in params]
        plain = all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0 for p in params)
        if plain and cpu_ops.supports(logits, multiple=1) and logits.dtype == torch.float32:
            temperatures = torch.tensor([0.0 if g else p.temperature for p, g in zip(params, greedy)])
            token_ids = cpu_ops.sample_rows(logits, temperatures, self._uniforms(requests, greedy))
        elif all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._random_sample(logits, requests, greedy)

        result = SampleResult(token_ids.tolist(), [None] * len(requests))
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, token_ids, params, want_logprobs, result)
        return result

    def _random_sample(self, logits: torch.Tensor, requests: list[Request],
                       greedy: list[bool]) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy_tokens = logits.argmax(dim=-1) if any(greedy) else None
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        logits.div_(temperature.unsqueeze(1))  # in place: the step's logits are the sampler's own
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
        probs = logits.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            threshold = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        sampled = inverse_cdf(probs, self._uniforms(requests, greedy).unsqueeze(1))
        return sampled if greedy_tokens is None else torch.where(torch.tensor(greedy), greedy_tokens, sampled)

    def _uniforms(self, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        """One uniform number per row; a seeded request's from its own generator."""
        uniforms = torch.rand(len(requests), generator=self.generator)
        for row, request in enumerate(requests):
            if request.generator is not None and not greedy[row]:
                uniforms[row] = draw_uniform(request.generator)
        return uniforms

    @staticmethod
    def _suppress_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        for row, request in enumerate(requests):
            params = request.params
            # A completed grammar may end before min_tokens: its stop token may be all it allows.
            if request.num_output_tokens < params.min_tokens \
                    and not (request.grammar is not None and request.grammar.is_completed()):
                stop_ids = set(params.stop_token_ids or ()) | params.all_stop_token_ids
                if stop_ids:
                    logits[row, list(stop_ids)] = float("-inf")

    @staticmethod
    def _apply_allowed_and_bad_words(logits: torch.Tensor, requests: list[Request]) -> None:
        """allowed_token_ids: every other token is masked. bad_words: a word's last token is masked
        where the output so far ends with the word's other tokens (vLLM's rule: a one-token word is
        always masked)."""
        for row, request in enumerate(requests):
            params = request.params
            if params.allowed_token_ids:
                allowed = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                allowed[params.allowed_token_ids] = True
                logits[row].masked_fill_(~allowed, float("-inf"))
            if params.bad_words_token_ids:
                output = request.output_token_ids
                banned = [ids[-1] for ids in params.bad_words_token_ids
                          if len(ids) == 1 or (len(ids) - 1 <= len(output) and output[len(output) - len(ids) + 1:] == ids[:-1])]
                if banned:
                    logits[row, banned] = float("-inf")

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
        for row, request in enumerate(requests):
            bias = request.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias.keys()))
                logits[row, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype)

    @staticmethod
    def _gather_logprobs(raw_logprobs, token_ids, params, want_logprobs, result) -> None:
        rows = [i for i, want in enumerate(want_logprobs) if want]
        lp = raw_logprobs[rows]
        chosen = token_ids[rows]
        chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
        ranks = (lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
        k = max(params[i].logprobs for i in rows)
        top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        chosen_lp, ranks = chosen_lp.tolist(), ranks.tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, row in enumerate(rows):
            n = params[row].logprobs
            result.logprobs[row] = (chosen_lp[j], ranks[j], list(zip(top_ids[j][:n], top_lp[j][:n])))


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """A seeded row's one draw (speculative decoding replays these to rewind a generator)."""
    return torch.rand(1, generator=generator)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] (unnormalised is fine), uniform [rows, 1] in [0, 1) -> [rows] token ids:
    the first token whose cumulative sum passes uniform * total. Never a token of probability
    zero (its sum equals the one before it). float32 sums: a tail token's share can be off by
    about 1e-7 absolute, far below what any sampling test or user can see."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # Below the total even where uniform * total rounds up to it, so that some token passes it.
    target = torch.minimum(uniform * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus (top_k 0 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1 - top_p).unsqueeze(1)
    outside[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition penalty over prompt and output tokens; presence and frequency over outputs."""
    batch, vocab = logits.shape
    device = logits.device
    output_counts = torch.zeros(batch, vocab + 1, device=device)
    longest = max((r.num_output_tokens for r in requests), default=0)
    if longest:
        padded = torch.tensor([r.output_token_ids + [vocab] * (longest - r.num_output_tokens)
                               for r in requests], device=device)
        output_counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=output_counts.dtype))
    output_counts = output_counts[:, :vocab]
    repetition = torch.tensor([r.params.repetition_penalty for r in requests], device=device)
    if (repetition != 1.0).any():
        seen = output_counts > 0
        longest_prompt = max(r.num_prompt_tokens for r in requests)
        prompt = torch.tensor([r.prompt_token_ids + [vocab] * (longest_prompt - r.num_prompt_tokens)
                               for r in requests], device=device)
        prompt_seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
        prompt_seen.scatter_(1, prompt, True)
        seen |= prompt_seen[:, :vocab]
        penalty = repetition.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    frequency = torch.tensor([r.params.frequency_penalty for r in requests], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in requests], device=device)
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
