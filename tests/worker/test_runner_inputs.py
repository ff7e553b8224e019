"""The model runner's prepare step alone: a micro-batch of decodes, drafts and prefill chunks as flat
tensors, against the per-token loop it replaced (no model is loaded)."""

from __future__ import annotations

import random
from functools import partial
from types import SimpleNamespace

import torch

from backend.core.request import Request
from backend.sampling_params import SamplingParams
from backend.worker.model_runner import ModelRunner

BLOCK_SIZE = 4


def per_token(scheduled, drafts):
    """Token ids, positions and cache slots, one token at a time."""
    input_ids, positions, slots = [], [], []
    for request, n in scheduled:
        tokens = request.all_token_ids + drafts.get(request.request_id, [])
        for position in range(request.num_computed_tokens, request.num_computed_tokens + n):
            input_ids.append(tokens[position])
            positions.append(position)
            slots.append(request.block_table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
    return input_ids, positions, slots


def test_flat_inputs_match_the_per_token_layout():
    rng = random.Random(0)
    free_blocks = list(range(1, 400))
    rng.shuffle(free_blocks)
    decodes, prefills, drafts = [], [], {}
    for i in range(12):
        length = rng.randint(1, 40)
        request = Request(str(i), None, [rng.randrange(1000) for _ in range(length)], SamplingParams())
        kind = i % 3
        if kind == 0:  # a decode: everything but the last token computed
            request.num_computed_tokens, n = length - 1, 1
        elif kind == 1:  # a decode verifying drafts
            drafts[request.request_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
            request.num_computed_tokens, n = length - 1, 1 + len(drafts[request.request_id])
        else:  # a prefill chunk after a cached or computed prefix
            request.num_computed_tokens = rng.randint(0, length - 1)
            n = rng.randint(1, length - request.num_computed_tokens)
        request.block_table = [free_blocks.pop() for _ in range(-(-(request.num_computed_tokens + n) // BLOCK_SIZE))]
        (decodes if kind == 0 else prefills).append((request, n))
    runner = SimpleNamespace(block_size=BLOCK_SIZE, device=torch.device("cpu"), bidirectional_images=False)
    runner._image_ranges = partial(ModelRunner._image_ranges, runner)  # text only: no image ranges
    input_ids, positions, meta = ModelRunner._flat_inputs(runner, decodes, prefills, drafts)
    expected_ids, expected_positions, expected_slots = per_token(decodes + prefills, drafts)
    assert input_ids.tolist() == expected_ids
    assert positions.tolist() == expected_positions and positions.dtype == torch.int64
    assert meta.slot_mapping.tolist() == expected_slots and meta.slot_mapping.dtype == torch.int64
    assert meta.token_context_lens.tolist() == [p + 1 for p in expected_positions]
    counts = [n for _, n in decodes + prefills]
    assert meta.token_rows.tolist() == [row for row, n in enumerate(counts) for _ in range(n)]
    assert meta.decode_seq_lens.tolist() == [r.num_computed_tokens + 1 for r, _ in decodes]
    assert meta.prefill_seq_lens.tolist() == [r.num_computed_tokens + n for r, n in prefills]
    for span, (request, n) in zip(meta.prefills, prefills):
        assert span.block_table.tolist() == request.block_table and span.num_query_tokens == n
