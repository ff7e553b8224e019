"""ModelRunner: loads the model and its KV cache, and turns a scheduled step into logits.

A step arrives as (request, number of new tokens) pairs. The runner lays the tokens out flat
(decodes first, then prefill chunks), builds positions, the slot mapping and block tables, runs the
model and returns float32 logits for each request whose step reaches its last known token (and for
each speculative draft it verifies).

With tensor/pipeline parallelism the runner of rank 0 starts the other ranks (`backend/worker.py`),
which build the same runner for their shard and wait in `serve_plans`. Each step rank 0 splits the
batch into one micro-batch per pipeline stage (so stages overlap), broadcasts their flat tensors,
and every rank runs its part: hidden states go stage to stage, logits come back to rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from backend import cpu_ops, distributed, quantization
from backend.attention import AttentionMetadata, PrefillSpan
from backend.config import EngineConfig
from backend.lora.layers import LoRABatch, LoRAModel
from backend.models.llama import LlamaArgs, LlamaForCausalLM, check_parallel
from backend.request import Request

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def load_hf_config(model_path: str) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_path!r} is not a Hugging Face model folder (no config.json)")
    config = json.loads(path.read_text())
    architectures = set(config.get("architectures") or [])
    if not architectures & SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model: architecture {sorted(architectures)} is not supported "
                         f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})")
    return config


def iterate_safetensors(model_path: str):
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors files in {model_path!r} (pickle checkpoints are never loaded)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass
class StepPlan:
    """One micro-batch as every rank needs it: flat tensors, and the rows whose logits are sampled."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    lora: LoRABatch | None = None  # the tokens of each adapter, when LoRA is on


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, hf_config: dict,
                 max_model_len: int, rank: int = 0) -> None:
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.args = LlamaArgs.from_hf_config(hf_config)
        self.failure: str | None = None  # a worker rank died: every later step raises this
        self.on_failure: Callable[[str], None] | None = None
        self.workers: distributed.WorkerProcesses | None = None
        world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        check_parallel(self.args, config.tensor_parallel_size, config.pipeline_parallel_size)
        self.quantization = quantization.detect(hf_config, config.quantization, world_size)
        if world_size > 1 and rank == 0:
            if config.node_rank != 0:
                raise ValueError("node_rank: the engine (rank 0) runs on node 0; other nodes run `tritonllm worker`")
            address, port = distributed.rendezvous(config)
            config = dataclasses.replace(config, master_addr=address, master_port=port)
            self.workers = distributed.WorkerProcesses(config, distributed.local_ranks(config)[1:], model_path,
                                                       max_model_len, on_failure=self._worker_failed)
        self.config = config
        self.device = resolve_device(config)
        if self.device.type == "cuda" and world_size > 1:
            self.device = torch.device("cuda", rank % (world_size // config.nnodes))
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config, self.device)
        if self.device.type == "cpu" and world_size > 1:  # the host's cores, shared among its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // (world_size // config.nnodes)))
        self.kv_cache_dtype = quantization.kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        try:
            self.parallel = distributed.init(config, rank, self.device, failure=lambda: self.failure)
            with torch.device("meta"):
                model = LlamaForCausalLM(self.args, self.parallel)
                quantization.prepare(model, self.quantization, model_path, self.dtype)
        except BaseException:
            self.shutdown()
            raise
        model = model.to_empty(device=self.device)
        model.post_init()
        model.load_weights(quantization.iterate_weights(model_path, self.quantization, hf_config)
                           or iterate_safetensors(model_path))
        self.model = model.to(self.dtype).eval()
        quantization.quantize_loaded(self.model, self.quantization)  # before pack_linears: not nn.Linear then
        if self.device.type == "cpu":
            cpu_ops.pack_linears(self.model, config.max_num_seqs)
        # Wraps the projections (after packing, around the packed ones); before the KV cache is sized.
        self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        attention = self.model.layers[0].self_attn
        self.num_kv_heads, self.num_layers = attention.num_kv_heads, len(self.model.layers)
        self.num_blocks = self._num_blocks()
        if self.parallel.world_size > 1:  # every rank holds as many blocks as the tightest one
            self.num_blocks = min(all_gather(self.num_blocks))
        shape = (2, self.num_kv_heads, self.num_blocks, self.block_size, self.args.head_dim)
        if self.device.type == "cpu":
            self.kv_caches = [cpu_ops.huge_page_zeros(shape, self.kv_cache_dtype) for _ in range(self.num_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
                              for _ in range(self.num_layers)]
        # Swap space for preemption_mode="swap": host memory (pinned when the cache is on a GPU).
        self.num_swap_blocks = 0
        self.swap_caches: list[torch.Tensor] = []
        if config.preemption_mode == "swap":
            self.num_swap_blocks = int(config.swap_space * (1 << 30)) // self.block_bytes
            swap_shape = (2, self.num_kv_heads, self.num_swap_blocks, self.block_size, self.args.head_dim)
            pin = self.device.type == "cuda"
            self.swap_caches = [torch.zeros(swap_shape, dtype=self.kv_cache_dtype, pin_memory=pin)
                                for _ in range(self.num_layers)]
        self.cuda_graphs = None
        if self.device.type == "cuda" and self.parallel.world_size == 1 and self.lora is None:
            # (LoRA steps run eagerly: a graph would freeze one step's token-to-adapter segments.)
            from backend.cuda_graphs import CudaGraphs  # GPU only: never imported on the CPU

            self.cuda_graphs = CudaGraphs(self.model, self.kv_caches, cuda_graph_batch_sizes(config.max_num_seqs),
                                          -(-max_model_len // self.block_size))
        logger.info("model %s on %s in %s; KV cache %d blocks of %d tokens", model_path,
                    self.device, self.dtype, self.num_blocks, self.block_size)

    @property
    def block_bytes(self) -> int:
        element = torch.finfo(self.kv_cache_dtype).bits // 8
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.args.head_dim * element

    def _num_blocks(self) -> int:
        if self.config.kv_cache_memory_bytes is not None:
            budget = self.config.kv_cache_memory_bytes
        elif self.device.type == "cuda" and self.parallel.world_size > 1:
            # No profiling pass across ranks: hold back a generous share for the activations.
            free, total = torch.cuda.mem_get_info(self.device)
            step_bytes = 64 * max_step_tokens(self.config, self.max_model_len) * self.args.hidden_size * 4
            budget = gpu_kv_cache_budget(total, free, step_bytes, self.config.gpu_memory_utilization)
        elif self.device.type == "cuda":
            from backend.cuda_graphs import profile_step_memory

            peak = profile_step_memory(self.model, self.args, self.dtype, self.device, self.block_size,
                                       profile_sequence_lengths(max_step_tokens(self.config, self.max_model_len),
                                                                self.max_model_len),
                                       self.config.max_num_seqs)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_cache_budget(total, free, peak, self.config.gpu_memory_utilization)
        else:
            budget = min(4 << 30, available_memory_bytes() // 4)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            knob = ("gpu_memory_utilization" if self.device.type == "cuda"
                    and self.config.kv_cache_memory_bytes is None else "kv_cache_memory_bytes")
            raise ValueError(f"{knob}: leaves {budget} bytes for the KV cache, which hold no block "
                             f"(one block takes {self.block_bytes} bytes)")
        return int(num_blocks)

    @torch.inference_mode()
    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy preempted blocks to swap space, then resumed ones back (in that order: a block
        swapped out may be handed to a resumed request in the same step)."""
        self._check_workers()
        if self.parallel.world_size > 1 and self.parallel.rank == 0:
            distributed.broadcast_plan(("swap", swap_out, swap_in), self.parallel)
        for pairs, to_swap in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for cache, swap in zip(self.kv_caches, self.swap_caches):
                source, target = (cache, swap) if to_swap else (swap, cache)
                source, target = source.view(torch.uint8), target.view(torch.uint8)  # as bytes: fp8 too
                blocks = source.index_select(2, src.to(source.device)).to(target.device, non_blocking=True)
                target.index_copy_(2, dst.to(target.device), blocks)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """Run one step. Returns logits [num_sampled, vocab] and the requests they belong to: one
        row each, or 1 + len(request.spec_token_ids) consecutive rows for a request with drafts."""
        self._check_workers()
        plans, sample_requests = [], []
        for batch in micro_batches(scheduled, self.parallel.pp_size):
            decodes = [(r, n) for r, n in batch if n == 1 and r.num_computed_tokens > 0]
            prefills = [(r, n) for r, n in batch if not (n == 1 and r.num_computed_tokens > 0)]
            lora_batch = None
            if self.lora is not None:
                decodes, prefills, lora_batch = self._lora_layout(decodes, prefills)
            input_ids, positions, meta = self._prepare(decodes, prefills)
            # Only a request whose step reaches its last known token samples the next one; one with
            # speculative drafts also gets a row for each of them, to verify it.
            rows, offset = [], 0
            for request, n in decodes + prefills:
                offset += n
                num_drafts = len(request.spec_token_ids)
                if request.num_computed_tokens + n == request.num_tokens + num_drafts:
                    rows.extend(range(offset - 1 - num_drafts, offset))
                    sample_requests.append(request)
            plans.append(StepPlan(input_ids, positions, meta, rows, lora_batch))
        if self.parallel.world_size > 1:
            distributed.broadcast_plan(("step", plans), self.parallel)
        logits = self._run(plans)
        if not sample_requests:
            return torch.empty(0, self.args.vocab_size), []
        return logits.cpu(), sample_requests

    def _lora_layout(self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]):
        """Load the step's adapters into slots and order the decodes, then the prefills, by slot,
        so that each adapter's tokens form one run (a segment) in each: (decodes, prefills, LoRABatch)."""
        slot_of = self.lora.activate([r.lora_request for r, _ in decodes + prefills if r.lora_request is not None])

        def slot(item: tuple[Request, int]) -> int:
            lora = item[0].lora_request
            return -1 if lora is None else slot_of[lora.lora_int_id]

        decodes, prefills = sorted(decodes, key=slot), sorted(prefills, key=slot)
        return decodes, prefills, LoRABatch.build([(n, slot((r, n))) for r, n in decodes + prefills], self.device)

    def _run(self, plans: list[StepPlan]) -> torch.Tensor | None:
        """This rank's part of a step; on rank 0, the sampled rows' logits of all micro-batches."""
        parallel, model = self.parallel, self.model
        logits, sends = [], []
        for plan in plans:
            if self.lora is not None:
                self.lora.context.batch = plan.lora
            hidden = residual = None
            if not parallel.is_first_stage:  # the previous stage's output for this micro-batch
                shape = (len(plan.positions), self.args.hidden_size)
                hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
                residual = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(hidden, parallel.stage_rank(parallel.stage - 1))
                dist.recv(residual, parallel.stage_rank(parallel.stage - 1))
            rows = torch.tensor(plan.sample_rows, dtype=torch.int64, device=self.device)
            graph_ready = (self.cuda_graphs is not None and not plan.meta.prefills
                           and self.cuda_graphs.fits(plan.meta.num_decodes))
            if graph_ready:
                final = self.cuda_graphs.replay(plan.input_ids, plan.positions, plan.meta)[rows]
            else:
                hidden, residual = model.run_stage(plan.input_ids, plan.positions, self.kv_caches, plan.meta,
                                                   hidden, residual)
                if not parallel.is_last_stage:
                    next_rank = parallel.stage_rank(parallel.stage + 1)
                    sends += [dist.isend(hidden.contiguous(), next_rank), dist.isend(residual.contiguous(), next_rank)]
                    continue
                final = model.final_norm(hidden[rows], residual[rows])  # the norm is per row
            if not plan.sample_rows:
                continue
            out = model.compute_logits(final)  # on the stage's tensor rank 0 only
            if out is not None and parallel.rank != 0:
                sends.append(dist.isend(out.contiguous(), 0))
            elif out is not None:
                logits.append(out)
        if parallel.rank == 0 and not parallel.is_last_stage:
            for plan in plans:
                if plan.sample_rows:
                    out = torch.empty(len(plan.sample_rows), self.args.vocab_size, dtype=torch.float32,
                                      device=self.device)
                    dist.recv(out, parallel.last_stage_leader)
                    logits.append(out)
        for work in sends:
            work.wait()
        if parallel.rank != 0:
            return None
        if len(logits) == 1:
            return logits[0]  # no copy: 64 rows of a 49k vocabulary are 12 MB
        return torch.cat(logits) if logits else torch.empty(0, self.args.vocab_size, device=self.device)

    # -- tensor / pipeline parallel ranks ------------------------------------------------------------
    def serve_plans(self) -> None:
        """A worker rank's loop: run what rank 0 broadcasts until it says stop."""
        with torch.inference_mode():
            while True:
                message = distributed.broadcast_plan(None, self.parallel)
                if message[0] == "step":
                    self._run(message[1])
                elif message[0] == "swap":
                    self.swap_blocks(message[1], message[2])
                else:
                    break
        dist.destroy_process_group()

    def _worker_failed(self, message: str) -> None:
        self.failure = message
        if self.on_failure is not None:
            self.on_failure(message)

    def _check_workers(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def shutdown(self) -> None:
        """Stop the worker ranks (rank 0): a last broadcast tells them, then they are ended."""
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        if self.failure is None and dist.is_initialized():
            try:
                distributed.broadcast_plan(("stop",), self.parallel)
            except Exception:  # noqa: BLE001 - a dead peer: the processes are ended below anyway
                pass
        workers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _prepare(self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step as flat tensors: token ids, positions and the attention metadata."""
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for request, n in decodes + prefills:
            start = request.num_computed_tokens
            tokens = request.all_token_ids
            if request.spec_token_ids:
                tokens = tokens + request.spec_token_ids
            input_ids.extend(tokens[start:start + n])
            table = request.block_table
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)

        def tables(requests: list[Request], lens: list[int]) -> torch.Tensor:
            """Each request's blocks covering its length, padded with block 0 to the longest."""
            width = -(-max(lens, default=0) // block_size)
            rows = [r.block_table[:width] + [0] * (width - len(r.block_table[:width])) for r in requests]
            return torch.tensor(rows, dtype=torch.int32).view(len(requests), width).to(self.device)

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        decode_lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        prefill_lens = [r.num_computed_tokens + n for r, n in prefills]
        block_tables = tables([r for r, _ in decodes + prefills], decode_lens + prefill_lens)
        prefill_tables = block_tables[len(decodes):]
        spans, query_starts = [], [0]
        offset = len(decodes)
        for i, ((request, n), context_len) in enumerate(zip(prefills, prefill_lens)):
            spans.append(PrefillSpan(offset, n, context_len, prefill_tables[i, :-(-context_len // block_size)]))
            offset += n
            query_starts.append(query_starts[-1] + n)
        counts = int32([n for _, n in decodes + prefills])
        position_ids = torch.tensor(positions, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decodes=len(decodes),
            decode_seq_lens=int32(decode_lens),
            decode_block_tables=block_tables[:len(decodes)],
            prefills=spans,
            prefill_query_starts=int32(query_starts),
            prefill_seq_lens=int32(prefill_lens),
            prefill_block_tables=prefill_tables,
            max_prefill_query_len=max((n for _, n in prefills), default=0),
            block_tables=block_tables,
            token_rows=torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32, device=self.device),
                                               counts),
            token_context_lens=(position_ids + 1).to(torch.int32),  # each token attends up to itself
        )
        return torch.tensor(input_ids, device=self.device), position_ids, meta


def micro_batches(scheduled: list[tuple[Request, int]], count: int) -> list[list[tuple[Request, int]]]:
    """The step's requests in up to `count` groups of about equal tokens (one per pipeline stage,
    so that stage k works on group i while stage k - 1 works on group i + 1)."""
    if count == 1 or len(scheduled) <= 1:
        return [scheduled]
    target = sum(n for _, n in scheduled) / count
    groups: list[list[tuple[Request, int]]] = [[]]
    tokens = 0
    for request, n in scheduled:
        if tokens >= target * len(groups) and len(groups) < count:
            groups.append([])
        groups[-1].append((request, n))
        tokens += n
    return groups


def all_gather(value: int) -> list[int]:
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def max_step_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The most tokens one step computes (the engine's max_num_batched_tokens default)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return 2048 if config.enable_chunked_prefill else max(2048, max_model_len)


def profile_sequence_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The profiling step: num_tokens of prefill in sequences no longer than max_model_len."""
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def gpu_kv_cache_budget(total: int, free: int, peak_step_bytes: int, utilization: float,
                        reserve: int = 256 << 20) -> int:
    """Bytes left for KV blocks: the utilization share of the GPU, less what is in use now
    (weights, the CUDA context, other processes), the largest step's activations (measured by
    the profiling pass) and a reserve for the CUDA graphs' pool and allocator slack."""
    return int(total * utilization) - (total - free) - peak_step_bytes - reserve


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


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
