"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE with the config's
scaling, grouped-query attention over the paged KV cache, SwiGLU, optionally tied embeddings.

The hot-path ops come from `backend/ops.py` (Triton kernels on CUDA, torch on the CPU). Numerics
follow Hugging Face's implementation step for step (norms in float32, RoPE tables in float32 cast
to the activation dtype) so greedy tokens match it exactly in float32.

Tensor parallelism (Megatron style): q/k/v and gate/up are column-parallel (each rank holds its
heads and its slice of the MLP; KV heads are replicated when ranks outnumber them), o_proj and
down_proj row-parallel with an all-reduce after them, the embedding and LM head split by vocabulary.
The layers stay plain nn.Linear, sharded as the weights load. Pipeline parallelism gives each stage
a contiguous run of layers; the first embeds, the last normalises and computes logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from backend import ops, parallel_state
from backend.attention import AttentionMetadata
from backend.parallel_state import ParallelState


@dataclass
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "LlamaArgs":
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = config.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", config.get("model_type") == "qwen2"),
            hidden_act=config.get("hidden_act", "silu"),
        )


def check_parallel(args: LlamaArgs, tp: int, pp: int) -> None:
    """Start-up errors for shapes the ranks cannot split evenly."""
    problems = []
    if args.num_heads % tp:
        problems.append(f"num_attention_heads ({args.num_heads})")
    if args.num_kv_heads % tp and tp % args.num_kv_heads:
        problems.append(f"num_key_value_heads ({args.num_kv_heads}; or tp a multiple of it)")
    if args.intermediate_size % tp:
        problems.append(f"intermediate_size ({args.intermediate_size})")
    if problems:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide {', '.join(problems)}")
    if pp > args.num_layers:
        raise ValueError(f"pipeline_parallel_size: {pp} exceeds the model's {args.num_layers} layers")


def stage_layers(num_layers: int, state: ParallelState) -> range:
    """The layers of this pipeline stage: contiguous, the first stages taking any remainder."""
    per_stage, extra = divmod(num_layers, state.pp_size)
    start = state.stage * per_stage + min(state.stage, extra)
    return range(start, start + per_stage + (state.stage < extra))


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported yet")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        tp = parallel.tp_size
        self.num_heads, self.head_dim = args.num_heads // tp, args.head_dim
        self.num_kv_heads = max(1, args.num_kv_heads // tp)
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary_embedding(q.view(-1, self.num_heads, self.head_dim),
                                    k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.o_proj(ops.paged_attention(q, k, v, kv_cache, meta, self.scale))
        return parallel_state.all_reduce(out, self.parallel)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelState) -> None:
        super().__init__()
        if args.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {args.hidden_act!r} is not supported yet")
        self.parallel = parallel
        intermediate = args.intermediate_size // parallel.tp_size
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_state.all_reduce(self.down_proj(ops.linear_silu_and_mul(self.gate_up_proj, x)), self.parallel)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelState) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, parallel)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, parallel)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """Returns (this layer's output, the residual stream before it is added): the next norm
        adds the two in one kernel."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.args = args
        self.parallel = parallel = parallel or ParallelState()
        check_parallel(args, parallel.tp_size, parallel.pp_size)
        self.layer_ids = stage_layers(args.num_layers, parallel)
        # The vocabulary padded to a multiple of tp; each rank embeds and scores one slice of it.
        self.vocab_per_rank = -(-args.vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.vocab_per_rank
        self.embed_tokens = nn.Embedding(self.vocab_per_rank, args.hidden_size) if parallel.is_first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(args, parallel) for _ in self.layer_ids)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if parallel.is_last_stage else None
        self.lm_head = nn.Linear(args.hidden_size, self.vocab_per_rank, bias=False) if parallel.is_last_stage else None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.post_init()

    @property
    def tied(self) -> bool:
        """The LM head shares the embedding's weight (tied, and both on this stage)."""
        return self.args.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None

    def post_init(self) -> None:
        """Tie embeddings and compute the RoPE tables; call again after `to_empty`."""
        if self.tied:
            self.lm_head.weight = self.embed_tokens.weight
        device = self.layers[0].input_layernorm.weight.device
        if device.type == "meta":
            return
        positions = torch.arange(self.args.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(self.args))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos().to(device), emb.sin().to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_per_rank)
        x = self.embed_tokens(local.clamp(0, self.vocab_per_rank - 1)) * mine.unsqueeze(-1)
        return parallel_state.all_reduce(x, self.parallel)

    def run_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  meta: AttentionMetadata, hidden: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's layers: from the token ids on the first stage, else from the previous
        stage's (hidden, residual). Returns (hidden, residual) before the final norm."""
        x = self.embed(input_ids) if hidden is None else hidden
        cos = self.rope_cos[positions].to(x.dtype)  # [T, D]
        sin = self.rope_sin[positions].to(x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
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
        return None if logits is None else logits[:, :self.args.vocab_size]

    # Hugging Face checkpoint names -> ours. Separate q/k/v and gate/up are fused on load.
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def local_name(self, name: str) -> str | None:
        """A checkpoint name as this stage's parameter name, or None when another stage holds it."""
        name = name.removeprefix("model.")
        parts = name.split(".")
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

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This tensor rank's slice of a checkpoint tensor (by its Hugging Face module name)."""
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        if tp == 1:
            return tensor
        module = name.split(".")[-2]
        if module in ("q_proj", "gate_proj", "up_proj"):
            return tensor.chunk(tp, dim=0)[rank]
        if module in ("k_proj", "v_proj"):
            kv_heads = self.args.num_kv_heads
            if kv_heads % tp == 0:
                return tensor.chunk(tp, dim=0)[rank]
            head = rank * kv_heads // tp  # fewer KV heads than ranks: replicated
            return tensor.view(kv_heads, -1, *tensor.shape[1:])[head]
        if module in ("o_proj", "down_proj"):
            return tensor.chunk(tp, dim=1)[rank]
        if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
            padded = torch.zeros(self.vocab_per_rank * tp, tensor.shape[1], dtype=tensor.dtype)
            padded[:tensor.shape[0]] = tensor
            return padded[self.vocab_start:self.vocab_start + self.vocab_per_rank]
        return tensor  # norms: replicated

    def fuse_shards(self, target: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """q/k/v (gate/up) as one tensor: joined along nn.Linear's output dim 0, or along the dim a
        quantized module's `fused_dims` names for that tensor; None there means one copy shared by
        all shards (GPTQ's g_idx)."""
        module, _, tensor_name = target.rpartition(".")
        dim = getattr(self.get_submodule(module), "fused_dims", {}).get(tensor_name, 0)
        if dim is not None:
            return torch.cat(shards, dim)
        if any(not torch.equal(shard, shards[0]) for shard in shards[1:]):
            raise ValueError(f"{target}: the fused layers' copies differ")
        return shards[0]

    def load_weights(self, weights) -> None:
        """weights: iterable of (hf_name, tensor); each rank keeps its stage's layers and its shard."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            local = self.local_name(name)
            if local is None:
                continue
            tensor = self.shard(name, tensor)
            name = local
            parts = name.split(".")
            fused = self.FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                target = ".".join(parts[:-2] + [fused[0], parts[-1]])
                pending.setdefault(target, {})[fused[1]] = tensor
                expected = 3 if fused[0] == "qkv_proj" else 2
                if len(pending[target]) < expected:
                    continue
                shards = pending.pop(target)
                tensor = self.fuse_shards(target, [shards[i] for i in range(expected)])
                name = target
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if self.tied:
            missing.discard("lm_head.weight")
        if missing or pending:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing | set(pending))[:5]}")
