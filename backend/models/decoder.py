"""The dense decoder every family runs: embeddings, a stack of attention + gated-MLP layers and an
LM head, with the options a family's config mapping picks in `ModelArgs` (norm placement, q/k
norms, biases, rotary variants, sliding windows, soft-capping, Gemma's and Granite's scalings).

The hot-path ops come from `backend/ops/__init__.py` (Triton kernels on CUDA, fused C++ ops or torch on the
CPU). Numerics follow Hugging Face step for step (norms in float32, RoPE tables in float32 cast to
the activation dtype) so greedy tokens match it exactly in float32.

Tensor parallelism (Megatron style): q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel with an all-reduce after them (their biases on rank 0 only), the embedding and LM head
split by vocabulary; norms, per-head q/k norms included, are replicated. Mixture-of-experts layers
(`layers/moe.py`) take the MLP's slot on the layers `MoEArgs.sparse_layers` marks. Layers stay plain
nn.Linear, sharded as the weights load: each layer names its parameters' loaders
(`layers/sharding.py`), and `models/loading.py` fills them under the names the family's mapping
gives (`ModelArgs.packed_modules_mapping`, `ModelArgs.checkpoint_names`). Pipeline parallelism gives
each stage a contiguous run of layers; the first embeds, the last normalises and computes logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from backend.worker import parallel_state
from backend.ops.attention import AttentionMetadata
from backend.layers.activation import gated_activation
from backend.layers.attention import Attention
from backend.layers.mla import LatentAttention, LatentAttentionArgs
from backend.layers.moe import MoEArgs, SparseMoE
from backend.layers.norm import RMSNorm
from backend.layers.rotary import mrope, rope_tables
from backend.layers.sharding import Part, output_rows, packed, row_parallel, vocab_parallel
from backend.worker.parallel_state import ParallelState

LAYOUTS = ("pre", "sandwich", "post")
# (checkpoint name, tensor, the model's args) -> (name, tensor) pairs under the decoder's names
CheckpointNames = Callable[[str, torch.Tensor, "ModelArgs"], list[tuple[str, torch.Tensor]]]


def as_stored(name: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor)]


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict[str, Any]  # rope_parameters(config): rope_type, rope_theta, ...
    local_rope: dict[str, Any] | None = None  # Gemma 3: the sliding layers' own RoPE
    sliding_windows: tuple[int | None, ...] = ()  # per layer (empty: no layer slides)
    layout: str = "pre"  # norms: "pre" (Llama), "sandwich" (Gemma 2/3: also after each block), "post" (OLMo 2)
    activation: str = "silu"  # "silu" | "gelu_tanh" | "gelu"
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + w)
    qk_norm: str | None = None  # "head": each head (Qwen3, Gemma 3); "full": across all heads (OLMo 2)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attention_scale: float | None = None  # default head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embed_multiplier: float | None = None  # Granite: x * m; Gemma: x * sqrt(hidden) (the factor in x's dtype)
    embed_multiplier_in_dtype: bool = False
    residual_multiplier: float | None = None  # Granite: residual + block(x) * m
    logits_divisor: float | None = None  # Granite: logits / logits_scaling
    moe: MoEArgs | None = None  # mixture-of-experts families: the MLP of their sparse layers
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    mla: LatentAttentionArgs | None = None  # DeepSeek: multi-head latent attention (head_dim: its rope part)
    # Vision-language families: the image encoder's spec (`build()`, `image_input`, `image_token_id`).
    vision: Any = None
    # M-RoPE (Qwen2.5-VL): the rotary frequencies' blocks turned by the temporal, height and width
    # positions; steps holding image placeholders bring positions [3, T] (`vision.rope_positions`).
    mrope_section: tuple[int, ...] | None = None
    # The family's checkpoint names (`models/loading.py`): checkpoint layers packed into one of ours
    # (q_proj -> (qkv_proj, 0)), and its renames and splits into the decoder's names.
    packed_modules_mapping: dict[str, tuple[str, int]] = field(default_factory=dict)
    checkpoint_names: CheckpointNames = as_stored

    def kv_cache_entry(self, tp: int = 1) -> tuple[int, int, int]:
        """(parts, KV heads, width) of one token's KV-cache entry in one layer on one tensor rank:
        a key and a value per KV head; under latent attention one latent, shared by every head."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, max(1, self.num_kv_heads // tp), self.head_dim

    def rope_for_layer(self, layer_id: int) -> dict[str, Any]:
        sliding = bool(self.sliding_windows) and self.sliding_windows[layer_id] is not None
        return self.local_rope if sliding and self.local_rope is not None else self.rope


def check_parallel(args: ModelArgs, tp: int, pp: int) -> None:
    """Start-up errors for shapes the ranks cannot split evenly."""
    problems = []
    if args.num_heads % tp:
        problems.append(f"num_attention_heads ({args.num_heads})")
    if args.num_kv_heads % tp and tp % args.num_kv_heads:
        problems.append(f"num_key_value_heads ({args.num_kv_heads}; or tp a multiple of it)")
    if args.intermediate_size % tp:
        problems.append(f"intermediate_size ({args.intermediate_size})")
    if args.moe is not None and args.moe.intermediate_size % tp:
        problems.append(f"moe_intermediate_size ({args.moe.intermediate_size})")
    if args.moe is not None and args.moe.shared_intermediate_size % tp:
        problems.append(f"shared expert intermediate size ({args.moe.shared_intermediate_size})")
    if problems:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide {', '.join(problems)}")
    if tp > 1 and args.qk_norm == "full":
        raise ValueError(f"tensor_parallel_size: {args.architecture}'s q/k norms span all heads, "
                         "which tensor parallelism does not split yet")
    if pp > args.num_layers:
        raise ValueError(f"pipeline_parallel_size: {pp} exceeds the model's {args.num_layers} layers")


def stage_layers(num_layers: int, state: ParallelState) -> range:
    """The layers of this pipeline stage: contiguous, the first stages taking any remainder."""
    per_stage, extra = divmod(num_layers, state.pp_size)
    start = state.stage * per_stage + min(state.stage, extra)
    return range(start, start + per_stage + (state.stage < extra))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel, self.activation = parallel, args.activation
        intermediate = args.intermediate_size // parallel.tp_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * intermediate, bias=args.mlp_bias)
        self.down_proj = nn.Linear(intermediate, args.hidden_size, bias=args.mlp_bias)
        gate_or_up = Part(args.intermediate_size, intermediate, output_rows(parallel))
        self.weight_loaders = {"gate_up_proj": packed([gate_or_up, gate_or_up], parallel.tp_size),
                               "down_proj": row_parallel(parallel)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(gated_activation(self.gate_up_proj, x, self.activation))
        return parallel_state.all_reduce(out, self.parallel)


class DecoderLayer(nn.Module):
    """(x, residual) in and out, the hidden state being x + residual: the next norm adds the two in
    one kernel (`ops.add_rms_norm`)."""

    def __init__(self, args: ModelArgs, parallel: ParallelState, layer_id: int) -> None:
        super().__init__()
        self.layout = args.layout
        self.residual_multiplier = args.residual_multiplier

        def norm() -> RMSNorm:
            return RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)

        if args.layout != "post":
            self.input_layernorm = norm()
        self.self_attn = (LatentAttention if args.mla else Attention)(args, parallel, layer_id)
        self.post_attention_layernorm = norm()
        if args.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if args.layout != "pre":
            self.post_feedforward_layernorm = norm()
        moe = args.moe
        self.mlp = SparseMoE(args.hidden_size, moe, parallel) if moe and moe.sparse_layers[layer_id] else MLP(args, parallel)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        if self.layout == "post":  # OLMo 2: h + norm(block(h)), no norm before the blocks
            hidden = x if residual is None else x + residual
            hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, cos, sin, kv_cache, meta))
            return self.post_feedforward_layernorm(self.mlp(hidden)), hidden
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        if self.layout == "sandwich":  # Gemma 2/3: norm after the block, then before the MLP
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier is not None:
            x = x * self.residual_multiplier
        return x, residual


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs, parallel: ParallelState | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.parallel = parallel = parallel or ParallelState()
        # RoPE tables cover the positions the engine uses (its context), not the model's whole range.
        self.max_positions = min(max_positions or args.max_position_embeddings, args.max_position_embeddings)
        check_parallel(args, parallel.tp_size, parallel.pp_size)
        self.layer_ids = stage_layers(args.num_layers, parallel)
        # The vocabulary padded to a multiple of tp; each rank embeds and scores one slice of it.
        self.vocab_per_rank = -(-args.vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.vocab_per_rank
        self.embed_tokens = nn.Embedding(self.vocab_per_rank, args.hidden_size) if parallel.is_first_stage else None
        # Images become embeddings where the token ids are, so their encoder lives on the first stage.
        self.vision = args.vision.build() if args.vision is not None and parallel.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(args, parallel, i) for i in self.layer_ids)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset) if parallel.is_last_stage else None
        self.lm_head = nn.Linear(args.hidden_size, self.vocab_per_rank, bias=False) if parallel.is_last_stage else None
        vocab = vocab_parallel(parallel, self.vocab_per_rank)
        self.weight_loaders = {"embed_tokens": vocab, "lm_head": vocab}
        self.packed_modules_mapping = args.packed_modules_mapping
        # Each distinct RoPE (Gemma 3: local and global) gets one table; layers index theirs.
        ropes = [args.rope_for_layer(i) for i in self.layer_ids]
        self.rope_params = [r for i, r in enumerate(ropes) if r not in ropes[:i]]
        self.layer_rope = [self.rope_params.index(r) for r in ropes]
        self.rope_cos: list[torch.Tensor] = []
        self.rope_sin: list[torch.Tensor] = []
        self.post_init()

    @property
    def tied(self) -> bool:
        """The LM head shares the embedding's weight (tied, and both on this stage)."""
        return self.args.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None

    def post_init(self) -> None:
        """Tie embeddings and compute the RoPE tables; call again after `to_empty`."""
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.layers[0].post_attention_layernorm.weight.device
        if device.type == "meta":
            return
        tables = [rope_tables(p, self.args.head_dim, self.args.max_position_embeddings, self.max_positions)
                  for p in self.rope_params]
        self.rope_cos = [cos.to(device) for cos, _ in tables]
        self.rope_sin = [sin.to(device) for _, sin in tables]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.vocab_start
            mine = (local >= 0) & (local < self.vocab_per_rank)
            x = self.embed_tokens(local.clamp(0, self.vocab_per_rank - 1)) * mine.unsqueeze(-1)
            x = parallel_state.all_reduce(x, self.parallel)
        multiplier = self.args.embed_multiplier
        if multiplier is None:
            return x
        return x * (torch.tensor(multiplier, dtype=x.dtype) if self.args.embed_multiplier_in_dtype else multiplier)

    def run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  meta: AttentionMetadata, hidden: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers: from the token ids on the first stage, else from the previous
        stage's (hidden, residual). Returns (hidden, residual) before the final norm."""
        x = self.embed(input_ids) if hidden is None else hidden
        cos = [table[positions].to(x.dtype) for table in self.rope_cos]  # [T, rotary_dim] each
        sin = [table[positions].to(x.dtype) for table in self.rope_sin]
        if positions.dim() == 2:  # M-RoPE: [3, T] positions, each part turning its section of the frequencies
            cos = [mrope(table, self.args.mrope_section) for table in cos]
            sin = [mrope(table, self.args.mrope_section) for table in sin]
        for layer, rope, kv_cache in zip(self.layers, self.layer_rope, kv_caches):
            x, residual = layer(x, residual, cos[rope], sin[rope], kv_cache, meta)
        return x, residual

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden] (a single-stage model)."""
        return self.final_norm(*self.run_stage(input_ids, positions, kv_caches, meta))

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] on tensor rank 0 (None on the others)."""
        logits = parallel_state.gather_last_dim(self.lm_head(hidden).float(), self.parallel)
        if logits is None:
            return None
        logits = logits[:, :self.args.vocab_size]
        if self.args.logits_divisor is not None:
            logits = logits / self.args.logits_divisor
        if self.args.final_logit_softcap is not None:
            cap = self.args.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    # -- loading (`models/loading.py`) ---------------------------------------------------------------
    def checkpoint_names(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as (name, tensor) pairs under the decoder's names (the family's mapping)."""
        return self.args.checkpoint_names(name, tensor, self.args)

    def local_name(self, name: str) -> str | None:
        """A checkpoint name (less the family's renames) as this stage's parameter name, or None when
        another stage holds it."""
        name = name.removeprefix("model.")
        parts = name.split(".")
        if parts[0] == "vision":
            return name if self.vision is not None else None
        if parts[0] == "layers":
            if int(parts[1]) not in self.layer_ids:
                return None
            return ".".join(["layers", str(int(parts[1]) - self.layer_ids.start), *parts[2:]])
        if name == "embed_tokens.weight" and self.embed_tokens is None:
            # A tied head on a later stage than the embedding loads the embedding's weight itself.
            return "lm_head.weight" if self.args.tie_word_embeddings and self.lm_head is not None else None
        if name == "lm_head.weight" and (self.lm_head is None or self.args.tie_word_embeddings):
            return None
        if name.startswith("norm.") and self.norm is None:
            return None
        return name
