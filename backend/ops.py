"""The one place that picks an implementation for each hot-path op: the Triton kernels in
`backend/kernels/` for CUDA tensors, their torch references on the CPU. The model calls these
functions and never asks which device it is on.

On the CPU, the fused C++ ops of `backend/cpu_ops.py` run where they take the tensors (float32 or
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

from backend import attention, cpu_ops
from backend.attention import AttentionMetadata
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
    (a CPU PackedLinear packed gated: the offline bench in bfloat16, three paired runs, 1-2% faster)."""
    if isinstance(gate_up, cpu_ops.PackedLinear) and gate_up.gated:
        return gate_up.silu_and_mul(x)
    return silu_and_mul(gate_up(x))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Write the step's keys and values into the cache, then attend. query [T, H, D], key/value
    [T, KVH, D], kv_cache [2, KVH, num_blocks, block_size, D]. Returns [T, H * D].

    Hugging Face's semantics for the options: with a sliding window the query at position i sees
    keys j with i - window < j <= i; a soft cap turns the scaled scores s into cap * tanh(s / cap)
    before the softmax. Every path takes both; blocks wholly before a token's window are never read."""
    options: dict[str, Any] = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if not _use_triton(query):
        return attention.paged_attention(query, key, value, kv_cache, meta, scale, **options)
    kernels = _triton()
    key_cache, value_cache = attention.cache_views(kv_cache)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
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


def add_lora_cpu(out: torch.Tensor, x: torch.Tensor, lora_at: torch.Tensor, lora_bt: torch.Tensor, layout) -> None:
    """The CPU path of add_lora (see backend/lora/layers.py): lora_at [slots, in, R] and lora_bt
    [slots, R, out] in x's dtype, layout a backend.lora.layers.CPULayout."""
    num, length = layout.num, layout.length
    at, bt = lora_at[layout.slots], lora_bt[layout.slots]
    if layout.gather is None:
        rows = slice(layout.first, layout.first + num * length)
        shrunk = torch.bmm(x[rows].view(num, length, -1), at)
        out[rows].view(num, length, -1).baddbmm_(shrunk, bt)
        return
    delta = torch.bmm(torch.bmm(x.index_select(0, layout.gather).view(num, length, -1), at), bt)
    out.index_add_(0, layout.tokens, delta.view(num * length, -1).index_select(0, layout.valid))
