"""The one place that picks an implementation for each hot-path op: the Triton kernels in
`backend/kernels/` for CUDA tensors, their torch references on the CPU. The model calls these
functions and never asks which device it is on.

On the CPU, the fused C++ ops of `backend/ops/cpu_ops.py` run where they take the tensors (float32 or
bfloat16, whole vectors), the torch references elsewhere.

`triton_kernels()` sends CPU tensors through the Triton kernels too (run by Triton's interpreter),
which is how the tests check the kernel path end to end without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any

import torch

from backend.ops import attention, cpu_ops
from backend.ops.attention import AttentionMetadata
from backend.kernels import reference

_kernels_on_cpu = False


@contextlib.contextmanager
def triton_kernels():
    """Run the Triton kernels on CPU tensors as well (through the interpreter) while inside."""
    global _kernels_on_cpu
    previous, _kernels_on_cpu = _kernels_on_cpu, True
    try:
        yield
    finally:
        _kernels_on_cpu = previous


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or _kernels_on_cpu


@functools.cache
def _triton() -> SimpleNamespace:
    """The kernels, imported on first use: the CPU path never loads Triton."""
    from backend.kernels import activation, cache, paged_attention, prefill_attention, rms_norm, rotary
    return SimpleNamespace(rms_norm=rms_norm.rms_norm, add_rms_norm=rms_norm.add_rms_norm,
                           rotary_embedding=rotary.rotary_embedding, silu_and_mul=activation.silu_and_mul,
                           reshape_and_cache=cache.reshape_and_cache,
                           paged_attention_decode=paged_attention.paged_attention_decode,
                           paged_attention_prefill=prefill_attention.paged_attention_prefill)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return _triton().rms_norm(x, weight, eps)
    if cpu_ops.supports(x):
        return cpu_ops.rms_norm(x, weight, eps)
    return reference.rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if _use_triton(x):
        return _triton().add_rms_norm(x, residual, weight, eps)
    if cpu_ops.supports(x):
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm_reference(x, residual, weight, eps)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D], cos/sin [T, D] -> rotated (query, key); the Triton
    kernel rotates in place."""
    if _use_triton(query):
        return _triton().rotary_embedding(query, key, cos, sin)
    if cpu_ops.supports(query, multiple=32):  # each half of a head in whole vectors
        return cpu_ops.rotary_embedding(query, key, cos, sin)
    return reference.rotary_embedding_reference(query, key, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        return _triton().silu_and_mul(x)
    if cpu_ops.supports(x, multiple=32):  # gate and up in whole vectors
        return cpu_ops.silu_and_mul(x)
    return reference.silu_and_mul_reference(x)


def linear_silu_and_mul(gate_up: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up(x)), bit for bit, in one pass where the linear applies it as it writes
    (a CPU PackedLinear packed gated; docs/benchmarks.md, "Measured reasons behind code choices")."""
    if isinstance(gate_up, cpu_ops.PackedLinear) and gate_up.gated:
        return gate_up.silu_and_mul(x)
    return silu_and_mul(gate_up(x))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Write the step's keys and values into the cache, then attend. query [T, H, D], key/value
    [T, KVH, D], kv_cache [2, KVH, num_blocks, block_size, D]. Returns [T, H * D].

    Hugging Face's semantics for the options: with a sliding window the query at position i sees
    keys j with i - window < j <= i; a soft cap turns the scaled scores s into cap * tanh(s / cap)
    before the softmax; `sinks` [H] (gpt-oss) join each head's softmax denominator as one more logit
    that attends to nothing. Every path takes all three; blocks wholly before a token's window are
    never read. An 8-bit cache (float8 E4M3 or E5M2) holds keys / k_scale and values / v_scale, and
    every path reads them back times their scale (`reference.quantize_kv`, `dequantize_kv`)."""
    options: dict[str, Any] = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                                   k_scale=k_scale, v_scale=v_scale)
    if not _use_triton(query):
        return attention.paged_attention(query, key, value, kv_cache, meta, scale, **options)
    kernels = _triton()
    key_cache, value_cache = attention.cache_views(kv_cache)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = query.shape
    out = query.new_empty(num_tokens, num_heads, head_dim)
    num_decodes = meta.num_decodes
    if num_decodes:
        kernels.paged_attention_decode(query[:num_decodes], key_cache, value_cache, meta.decode_block_tables,
                                       meta.decode_seq_lens, scale, out=out[:num_decodes], **options)
    if meta.prefills:
        kernels.paged_attention_prefill(query[num_decodes:], key_cache, value_cache, meta.prefill_block_tables,
                                        meta.prefill_query_starts, meta.prefill_seq_lens,
                                        meta.max_prefill_query_len, scale, out=out[num_decodes:], **options)
    for span in meta.prefills:
        if span.bidirectional:  # an image's placeholders see each other (Gemma 3): the kernel is causal
            rows = slice(span.start, span.start + span.num_query_tokens)
            out[rows] = attention.reference_prefill(query[rows], kv_cache, span, scale, **options)
    return out.view(num_tokens, num_heads * head_dim)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for group-quantized integer weights (AWQ, GPTQ): qweight
    [N, K * bits / 32] int32 packed along K, scales and zeros [N, G]. The fused Triton kernel on
    CUDA; on the CPU the weight is dequantized for this call and handed to F.linear."""
    if _use_triton(x):
        from backend.kernels.quant_matmul import quant_matmul as kernel
        return kernel(x, qweight, scales, zeros, bits, bias)
    return reference.quant_matmul_reference(x, qweight, scales, zeros, bits, bias)


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch) -> None:
    """out += each token's LoRA delta, in place: x [T, in], lora_a [slots, R, in], lora_b [slots, out, R],
    batch a backend.lora.layers.LoRABatch (segments of tokens sharing a slot)."""
    if _use_triton(x):
        from backend.kernels.lora import add_lora as kernel
        kernel(out, x, lora_a, lora_b, batch.starts, batch.lengths, batch.slots, batch.max_length)
        return
    reference.add_lora_reference(out, x, lora_a, lora_b, batch)


LORA_KERNEL_TOKENS = 256  # steps up to this many adapter tokens take the C++ kernel (decodes)


def add_lora_cpu(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, batch,
                 ranks: int, kernel_weights: tuple[torch.Tensor, torch.Tensor] | None, pairs: bool) -> None:
    """The CPU path of add_lora for the first `ranks` rank columns (see backend/lora/layers.py):
    a small step in one call of the C++ kernel on its copies of the weights (`kernel_weights`,
    pair-packed where `pairs`), a larger one as two GEMMs per segment (each adapter's tokens are one
    or two segments: the runner sorts a step by slot), which oneDNN runs at full speed there."""
    if (kernel_weights is not None and batch.num_tokens <= LORA_KERNEL_TOKENS and cpu_ops.available()
            and x.stride(-1) == 1 and out.stride(-1) == 1):
        cpu_ops.lora(out, x, *kernel_weights, batch.cpu_segments, -(-ranks // 16) * 16, pairs)
        return
    for start, end, slot in batch.segments:
        out[start:end].addmm_(x[start:end] @ lora_a[slot, :ranks].T, lora_b[slot, :, :ranks].T)


def fused_moe_applies(x: torch.Tensor) -> bool:
    """The fused MoE Triton kernel runs (CUDA, or CPU tensors inside `triton_kernels()`); elsewhere
    `layers/moe.py` groups tokens by expert over the CPU's linears."""
    return _use_triton(x)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with SiLU-gated experts stacked as
    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]."""
    from backend.kernels.fused_moe import fused_moe as kernel
    return kernel(x, w13, w2, topk_weights, topk_ids)
