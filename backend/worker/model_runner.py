"""ModelRunner: loads the model and its KV cache, and turns a scheduled step into logits.

A step arrives as (request, number of new tokens) pairs. The runner lays the tokens out flat
(decodes first, then prefill chunks), builds positions, the slot mapping and block tables, runs the
model and returns float32 logits for each request whose step reaches its last known token (and for
each speculative draft it verifies).

With tensor/pipeline parallelism the runner of rank 0 starts the other ranks (`backend/worker/rank.py`),
which build the same runner for their shard and wait in `serve_plans`. Each step rank 0 splits the
batch into one micro-batch per pipeline stage (so stages overlap), broadcasts their flat tensors,
and every rank runs its part: hidden states go stage to stage, logits come back to rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from backend import quantization
from backend.config import EngineConfig
from backend.core import kv_memory
from backend.core.kv_memory import KVCacheLayout
from backend.core.request import Request
from backend.core.step import ModelRunnerOutput, SchedulerOutput
from backend.multimodal import ImageInput
from backend.errors import check
from backend.lora.layers import LoRABatch, LoRAModel
from backend.models import check_parallel
from backend.ops.attention import AttentionMetadata, PrefillSpan
from backend.sampling import prompt_logprobs
from backend.sampling.prompt_logprobs import PromptScores
from backend.sampling.sampler import Sampler
from backend.sampling.verification import sample_and_verify
from backend.worker import distributed, parallel_state
from backend.worker.model_loader import load_model, model_args, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One micro-batch as every rank needs it: flat tensors, and the rows whose logits are sampled."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    lora: LoRABatch | None = None  # the tokens of each adapter, when LoRA is on
    prompt_rows: list[int] = dataclasses.field(default_factory=list)  # rows scoring prompt tokens
    image_rows: torch.Tensor | None = None  # rows whose embeddings are image features, not token ids'
    image_embeds: torch.Tensor | None = None  # [len(image_rows), hidden]

    @property
    def logit_rows(self) -> list[int]:
        return self.sample_rows + self.prompt_rows


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, hf_config: dict,
                 max_model_len: int, rank: int = 0) -> None:
        self.block_size, self.max_model_len = config.block_size, max_model_len
        self.args = model_args(hf_config)
        self.failure: str | None = None  # a worker rank died: every later step raises this
        self.on_failure: Callable[[str], None] | None = None
        self.workers: distributed.WorkerProcesses | None = None
        check_parallel(self.args, config.tensor_parallel_size, config.pipeline_parallel_size)
        self.quantization = quantization.detect(hf_config, config.quantization, world_size(config))
        self.config = config = self._start_workers(config, model_path, rank)
        self.host_threads = torch.get_num_threads()  # _place may take a share of them: shutdown gives it back
        self.device, self.dtype = self._place(config, rank)
        self.kv_cache_dtype = quantization.kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        try:
            self.parallel = parallel_state.init(config, rank, self.device, failure=lambda: self.failure)
            self.model = load_model(config, model_path, hf_config, self.parallel, self.quantization,
                                    self.device, self.dtype)
        except BaseException:
            self.shutdown()
            raise
        # LoRA wraps the loaded (on the CPU, packed) projections, before the KV cache is sized.
        self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.sampler = Sampler(config.seed)
        # Image features by image hash, from the step that first needs them until the step that
        # computes the last of their placeholders: a step never encodes an image twice.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # Gemma 3: the placeholders of one image attend to each other (the attention op is told where).
        self.bidirectional_images = bool(getattr(self.args.vision, "bidirectional_images", False))
        self._allocate_kv_cache()
        self.cuda_graphs = self._capture_cuda_graphs()
        logger.info("model %s on %s in %s; KV cache %d blocks of %d tokens", model_path,
                    self.device, self.dtype, self.num_blocks, self.block_size)

    def _start_workers(self, config: EngineConfig, model_path: str, rank: int) -> EngineConfig:
        """Rank 0 of a parallel engine starts this host's other ranks; the config it returns
        carries the rendezvous address they all meet at."""
        if world_size(config) == 1 or rank != 0:
            return config
        check(config.node_rank == 0, "node_rank",
              "the engine (rank 0) runs on node 0; other nodes run `tritonllm worker`")
        address, port = distributed.rendezvous(config)
        config = dataclasses.replace(config, master_addr=address, master_port=port)
        self.workers = distributed.WorkerProcesses(config, distributed.local_ranks(config)[1:], model_path,
                                                   self.max_model_len, on_failure=self._worker_failed)
        return config

    @staticmethod
    def _place(config: EngineConfig, rank: int) -> tuple[torch.device, torch.dtype]:
        """This rank's device (its own GPU, or a share of the host's cores) and the activation dtype."""
        device = resolve_device(config)
        ranks_per_host = world_size(config) // config.nnodes
        if device.type == "cuda" and world_size(config) > 1:
            device = torch.device("cuda", rank % ranks_per_host)
            torch.cuda.set_device(device)
        if device.type == "cpu" and world_size(config) > 1:  # the host's cores, shared among its ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_host))
        return device, resolve_dtype(config, device)

    def _allocate_kv_cache(self) -> None:
        """Size the KV cache to the budget (every rank holds as many blocks as the tightest one),
        allocate it and its host store: swap space for preemption_mode=swap, then the second KV
        tier's slots (kv_offloading_size)."""
        parts, self.num_kv_heads, width = self.args.kv_cache_entry(self.parallel.tp_size)
        self.num_layers = len(self.model.layers)
        self.layout = KVCacheLayout(self.num_layers, self.num_kv_heads, self.block_size, width,
                                    self.kv_cache_dtype, parts)
        budget = kv_memory.kv_cache_budget(self.config, self.layout, self.model, self.args, self.dtype,
                                           self.device, self.parallel.world_size, self.max_model_len)
        self.num_blocks = kv_memory.num_kv_blocks(self.config, self.layout, budget, self.device)
        self.num_swap_blocks, self.num_tier_blocks = kv_memory.host_store_blocks(self.config, self.layout,
                                                                                 self.parallel.world_size)
        if self.parallel.world_size > 1:
            self.num_blocks = min(all_gather(self.num_blocks))
            self.num_swap_blocks = min(all_gather(self.num_swap_blocks))
            self.num_tier_blocks = min(all_gather(self.num_tier_blocks))
        self.kv_caches = kv_memory.allocate_kv_caches(self.layout, self.num_blocks, self.device)
        self.host_caches = kv_memory.allocate_host_store(self.layout, self.num_swap_blocks + self.num_tier_blocks,
                                                         self.device)

    def _capture_cuda_graphs(self):
        """Decode steps as CUDA graphs: one GPU only (the ranks of a parallel engine run eagerly)."""
        if self.device.type != "cuda" or self.parallel.world_size > 1 or self.lora is not None:
            return None  # (LoRA steps run eagerly: a graph would freeze one step's adapter segments)
        from backend.worker.cuda_graphs import CudaGraphs, cuda_graph_batch_sizes  # GPU only: never imported on the CPU

        return CudaGraphs(self.model, self.kv_caches, cuda_graph_batch_sizes(self.config.max_num_seqs),
                          -(-self.max_model_len // self.block_size))

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @torch.inference_mode()
    def move_blocks(self, to_host: list[tuple[int, int]], to_device: list[tuple[int, int]]) -> None:
        """The block mover: copy (device block, host block) pairs to the host store (preempted
        blocks to swap space, evicted prefix blocks to the second tier), then (host block, device
        block) pairs back (resumed requests, second-tier prefix hits). In that order, before the
        step's forward pass: a block copied out may be handed to another request in the same step."""
        self._check_workers()
        if self.parallel.world_size > 1 and self.parallel.rank == 0:
            parallel_state.broadcast_plan(("move", to_host, to_device), self.parallel)
        for pairs, out in ((to_host, True), (to_device, False)):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for cache, host in zip(self.kv_caches, self.host_caches):
                source, target = (cache, host) if out else (host, cache)
                source, target = source.view(torch.uint8), target.view(torch.uint8)  # as bytes: fp8 too
                # (to the host: a blocking copy, which index_copy_ may read at once)
                blocks = source.index_select(2, src.to(source.device)).to(target.device, non_blocking=not out)
                target.index_copy_(2, dst.to(target.device), blocks)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample it: each request whose step reaches its last known token gets
        its next token (verifying drafts: the drafts the target agrees with, then its own)."""
        logits, requests, prompt_scores = self.execute(scheduler_output)
        output = ModelRunnerOutput(prompt_scores=prompt_scores)
        if requests:
            drafts = [scheduler_output.drafts(r) for r in requests]
            for request, (tokens, logprobs) in zip(requests, sample_and_verify(self.sampler, logits, requests, drafts)):
                output.sampled_token_ids[request.request_id] = tokens
                output.logprobs[request.request_id] = logprobs
        return output

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[Request], list[PromptScores]]:
        """Run one step. Returns logits [num_sampled, vocab] and the requests they belong to: one
        row each, or 1 + its number of drafts consecutive rows for a request verifying drafts; and
        the prompt tokens this step scored for requests asking prompt logprobs."""
        self._check_workers()
        plans, sample_requests, prompt_spans = self.prepare_inputs(scheduler_output)
        if self.parallel.world_size > 1:
            parallel_state.broadcast_plan(("step", plans), self.parallel)
        logits = self._run(plans)
        scores = []
        if prompt_spans:  # each plan's rows are its sampled rows, then its prompt rows
            sampled: list[int] = []
            scored: list[int] = []
            offset = 0
            for plan in plans:
                sampled.extend(range(offset, offset + len(plan.sample_rows)))
                offset += len(plan.sample_rows)
                scored.extend(range(offset, offset + len(plan.prompt_rows)))
                offset += len(plan.prompt_rows)
            scores = prompt_logprobs.score(logits[scored], prompt_spans)
            logits = logits[sampled]
        if not sample_requests:
            return torch.empty(0, self.args.vocab_size), [], scores
        return logits.cpu(), sample_requests, scores

    def prepare_inputs(self, scheduler_output: SchedulerOutput
                       ) -> tuple[list[StepPlan], list[Request], list[tuple[Request, range]]]:
        """The step as one plan per micro-batch (decodes first, then prefill chunks, each group in
        LoRA slot order), the requests that sample (in row order) and the prompt positions scored."""
        plans, sample_requests = [], []
        prompt_spans: list[tuple[Request, range]] = []
        drafts = scheduler_output.spec_token_ids
        for batch in micro_batches(scheduler_output.scheduled, self.parallel.pp_size):
            decodes = [(r, n) for r, n in batch if n == 1 and r.num_computed_tokens > 0]
            prefills = [(r, n) for r, n in batch if not (n == 1 and r.num_computed_tokens > 0)]
            lora_batch = None
            if self.lora is not None:
                decodes, prefills, lora_batch = self._lora_layout(decodes, prefills)
            input_ids, positions, meta = self._flat_inputs(decodes, prefills, drafts)
            positions = self._rope_positions(decodes + prefills, positions)
            image_rows, image_embeds = self._image_embeddings(decodes + prefills)
            # Only a request whose step reaches its last known token samples the next one; one with
            # speculative drafts also gets a row for each of them, to verify it.
            rows: list[int] = []
            prompt_rows: list[int] = []
            offset = 0
            for request, n in decodes + prefills:
                to_score = prompt_logprobs.positions_to_score(request, request.num_computed_tokens, n)
                if to_score:
                    first = offset + to_score.start - request.num_computed_tokens
                    prompt_rows.extend(range(first, first + len(to_score)))
                    prompt_spans.append((request, to_score))
                offset += n
                num_drafts = len(drafts.get(request.request_id, ()))
                if request.num_computed_tokens + n == request.num_tokens + num_drafts:
                    rows.extend(range(offset - 1 - num_drafts, offset))
                    sample_requests.append(request)
            plans.append(StepPlan(input_ids, positions, meta, rows, lora_batch, prompt_rows, image_rows, image_embeds))
        return plans, sample_requests, prompt_spans

    def _image_embeddings(self, scheduled: list[tuple[Request, int]]
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of a micro-batch that hold image placeholders and their features: each image
        encoded once (images of one size in one batch), kept until its last placeholder is computed."""
        wanted: list[tuple[int, ImageInput, tuple[int, int]]] = []  # (first row, image, feature span)
        offset = 0
        for request, n in scheduled:
            start = request.num_computed_tokens
            for image in request.images:
                span = image.overlap(start, start + n)
                if span is not None:
                    wanted.append((offset + image.offset + span[0] - start, image, span))
            offset += n
        if not wanted:
            return None, None
        missing = {image.hash: image for _, image, _ in wanted if image.hash not in self.encoder_cache}
        by_size: dict[tuple[int, ...], list[ImageInput]] = {}
        for image in missing.values():
            by_size.setdefault(tuple(image.pixel_values.shape), []).append(image)
        for images in by_size.values():
            extras = {key: torch.stack([i.extras[key] for i in images]).to(self.device) for key in images[0].extras}
            features = self.model.vision(torch.stack([i.pixel_values for i in images]).to(self.device, self.dtype),
                                         **extras)
            for image, feature in zip(images, features):
                self.encoder_cache[image.hash] = feature
        rows = torch.cat([torch.arange(row, row + span[1] - span[0]) for row, _, span in wanted])
        embeds = torch.cat([self.encoder_cache[image.hash][span[0]:span[1]] for _, image, span in wanted])
        for _, image, span in wanted:
            if span[1] == image.length:  # its last placeholder is computed this step
                self.encoder_cache.pop(image.hash, None)
        return rows.to(self.device), embeds

    def _rope_positions(self, scheduled: list[tuple[Request, int]], positions: torch.Tensor) -> torch.Tensor:
        """The positions RoPE turns by: the sequence positions, but where the model places its images'
        tokens itself (M-RoPE, `vision.rope_positions`) and a request has images, [3, T]; one row
        again when the three agree (decodes, text after the images), so those steps run as text does."""
        rope_positions = getattr(self.args.vision, "rope_positions", None)
        if rope_positions is None or not any(request.images for request, _ in scheduled):
            return positions
        sequence = positions.cpu()
        rows = sequence.expand(3, -1).clone()
        offset = 0
        for request, n in scheduled:
            if request.images:
                rows[:, offset:offset + n] = rope_positions(sequence[offset:offset + n], request.images)
            offset += n
        return (rows[0] if bool((rows == rows[0]).all()) else rows).to(self.device)

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
                shape = (len(plan.input_ids), self.args.hidden_size)
                hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
                residual = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(hidden, parallel.stage_rank(parallel.stage - 1))
                dist.recv(residual, parallel.stage_rank(parallel.stage - 1))
            rows = torch.tensor(plan.logit_rows, dtype=torch.int64, device=self.device)
            graph_ready = (self.cuda_graphs is not None and not plan.meta.prefills
                           and self.cuda_graphs.fits(plan.meta.num_decodes))
            if graph_ready:
                final = self.cuda_graphs.replay(plan.input_ids, plan.positions, plan.meta)[rows]
            else:
                if plan.image_rows is not None and parallel.is_first_stage:
                    hidden = model.embed(plan.input_ids)
                    hidden[plan.image_rows] = plan.image_embeds.to(hidden.dtype)
                hidden, residual = model.run_stage(plan.input_ids, plan.positions, self.kv_caches, plan.meta,
                                                   hidden, residual)
                if not parallel.is_last_stage:
                    next_rank = parallel.stage_rank(parallel.stage + 1)
                    sends += [dist.isend(hidden.contiguous(), next_rank), dist.isend(residual.contiguous(), next_rank)]
                    continue
                final = model.final_norm(hidden[rows], residual[rows])  # the norm is per row
            if not plan.logit_rows:
                continue
            out = model.compute_logits(final)  # on the stage's tensor rank 0 only
            if out is not None and parallel.rank != 0:
                sends.append(dist.isend(out.contiguous(), 0))
            elif out is not None:
                logits.append(out)
        if parallel.rank == 0 and not parallel.is_last_stage:
            for plan in plans:
                if plan.logit_rows:
                    out = torch.empty(len(plan.logit_rows), self.args.vocab_size, dtype=torch.float32,
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
                message = parallel_state.broadcast_plan(None, self.parallel)
                if message[0] == "step":
                    self._run(message[1])
                elif message[0] == "move":
                    self.move_blocks(message[1], message[2])
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
        """Stop the worker ranks (rank 0): a last broadcast tells them, then they are ended. The
        process's threads are its own again (a later engine in it uses all of the host's cores)."""
        torch.set_num_threads(self.host_threads)
        if self.workers is None:
            return
        workers, self.workers = self.workers, None
        if self.failure is None and dist.is_initialized():
            try:
                parallel_state.broadcast_plan(("stop",), self.parallel)
            except Exception:  # a dead peer: the processes are ended below anyway
                pass
        workers.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _flat_inputs(self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]],
                     drafts: dict[str, list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A micro-batch as flat tensors: token ids, positions and the attention metadata. Positions
        and cache slots come from each request's start and count with tensor ops (no per-token loop)."""
        block_size = self.block_size
        scheduled = decodes + prefills
        input_ids: list[int] = []
        for request, n in scheduled:
            start = request.num_computed_tokens
            tokens = request.all_token_ids[start:start + n]
            if len(tokens) < n:  # a decode verifying drafts: they follow its last token
                tokens += drafts[request.request_id][:n - len(tokens)]
            input_ids.extend(tokens)
        counts = torch.tensor([n for _, n in scheduled], dtype=torch.int64)
        starts = torch.tensor([r.num_computed_tokens for r, _ in scheduled], dtype=torch.int64)
        lens = (starts + counts).tolist()
        width = -(-max(lens, default=0) // block_size)
        block_tables = torch.tensor([r.block_table[:width] + [0] * (width - len(r.block_table[:width]))
                                     for r, _ in scheduled], dtype=torch.int32).view(len(scheduled), width)
        token_rows = torch.repeat_interleave(torch.arange(len(scheduled)), counts)
        first_token = torch.cumsum(counts, 0) - counts  # each request's first row in the flat batch
        positions = starts[token_rows] + torch.arange(len(token_rows)) - first_token[token_rows]
        slots = block_tables[token_rows, positions // block_size].to(torch.int64) * block_size + positions % block_size

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        block_tables = block_tables.to(self.device)
        prefill_lens = lens[len(decodes):]
        prefill_tables = block_tables[len(decodes):]
        spans, query_starts = [], [0]
        offset = len(decodes)
        for i, ((request, n), context_len) in enumerate(zip(prefills, prefill_lens)):
            spans.append(PrefillSpan(offset, n, context_len, prefill_tables[i, :-(-context_len // block_size)],
                                     self._image_ranges(request, context_len - n, context_len)))
            offset += n
            query_starts.append(query_starts[-1] + n)
        position_ids = positions.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            num_decodes=len(decodes),
            decode_seq_lens=int32(lens[:len(decodes)]),
            decode_block_tables=block_tables[:len(decodes)],
            prefills=spans,
            prefill_query_starts=int32(query_starts),
            prefill_seq_lens=int32(prefill_lens),
            prefill_block_tables=prefill_tables,
            max_prefill_query_len=max((n for _, n in prefills), default=0),
            block_tables=block_tables,
            token_rows=token_rows.to(device=self.device, dtype=torch.int32),
            token_context_lens=(position_ids + 1).to(torch.int32),  # each token attends up to itself
        )
        return torch.tensor(input_ids, device=self.device), position_ids, meta

    def _image_ranges(self, request: Request, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The position ranges of the images whose placeholders a prefill chunk [start, end) holds, for a
        model whose image placeholders see each other; () otherwise."""
        if not self.bidirectional_images:
            return ()
        return tuple((image.offset, image.offset + image.length) for image in request.images
                     if image.overlap(start, end) is not None)


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


def world_size(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size
