"""GPU only, imported by the model runner when its device is CUDA: the profiling pass that measures
the largest step's memory before the KV cache is sized, and the CUDA graphs that replay decode steps.

Decode steps are captured once per batch size at start-up, which also compiles every kernel they
use, so the first request is not slow. A step of n sequences copies its inputs into the static
buffers of the smallest graph that holds n and replays it; the padded entries have slot -1 (the
cache write skips them) and length 0 (attention returns zeros for them).
"""

from __future__ import annotations

import torch

from backend.ops.attention import AttentionMetadata, PrefillSpan


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, then every multiple of 8, up to
    max_num_seqs (itself included) and at most 256. A batch runs in the smallest that holds it."""
    limit = min(max_num_seqs, 256)
    sizes = [s for s in [1, 2, 4, *range(8, 257, 8)] if s <= limit]
    if sizes[-1] < limit:
        sizes.append(limit)
    return sizes


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs, or None when none does (run eagerly)."""
    return next((s for s in sizes if s >= num_seqs), None)


class CudaGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], batch_sizes: list[int],
                 max_blocks_per_seq: int) -> None:
        device = kv_caches[0].device
        self.batch_sizes = batch_sizes
        largest = batch_sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        no_prefills = torch.zeros(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(batch_sizes):  # the largest first: the others reuse its memory
                meta = AttentionMetadata(self.slot_mapping[:size], size, self.seq_lens[:size],
                                         self.block_tables[:size], [], no_prefills, no_prefills,
                                         no_prefills.view(0, 0), 0)
                args = (self.input_ids[:size], self.positions[:size], kv_caches, meta)
                model(*args)  # warm-up: compiles the kernels, sets up cuBLAS
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(*args)
                self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step's hidden states [n, hidden], from the smallest graph holding it."""
        n = meta.num_decodes
        size = padded_batch_size(n, self.batch_sizes)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:size].zero_()
        self.block_tables[:n, :meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n]


@torch.inference_mode()
def profile_step_memory(model, args, dtype: torch.dtype, device: torch.device, block_size: int,
                        seq_lens: list[int], max_num_seqs: int) -> int:
    """Peak bytes the largest step allocates beyond the weights: a prefill of `seq_lens` sequences
    on a scratch KV cache just big enough (not counted), then logits for as many rows as a step
    can sample. Also compiles the prefill kernels."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    parts, kv_heads, width = args.kv_cache_entry()
    shape = (parts, kv_heads, sum(blocks_per_seq), block_size, width)
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.num_layers)]
    scratch = sum(c.numel() * c.element_size() for c in kv_caches)

    # Each sequence's blocks follow the previous one's, so slot = first block * block_size + position.
    width = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    spans, slots, positions, query_starts, first_block, start = [], [], [], [0], 0, 0
    for i, (n, blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :blocks] = torch.arange(first_block, first_block + blocks)
        spans.append(PrefillSpan(start, n, n, tables[i, :blocks].to(device)))
        slots.append(torch.arange(n) + first_block * block_size)
        positions.append(torch.arange(n))
        first_block, start = first_block + blocks, start + n
        query_starts.append(start)
    meta = AttentionMetadata(torch.cat(slots).to(device), 0, torch.zeros(0, dtype=torch.int32, device=device),
                             torch.zeros(0, 0, dtype=torch.int32, device=device), spans,
                             torch.tensor(query_starts, dtype=torch.int32, device=device),
                             torch.tensor(seq_lens, dtype=torch.int32, device=device), tables.to(device),
                             max(seq_lens))
    hidden = model(torch.zeros(start, dtype=torch.int64, device=device), torch.cat(positions).to(device),
                   kv_caches, meta)
    model.compute_logits(hidden[:min(max_num_seqs, start)])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    del kv_caches, hidden
    torch.cuda.empty_cache()
    return peak
