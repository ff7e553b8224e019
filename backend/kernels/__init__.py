"""Triton kernels for the hot path, each checked against the torch reference in `reference.py`.

| module | kernel |
|---|---|
| `paged_attention.py` | decode attention over the paged KV cache: GQA, split-K for long contexts |
| `prefill_attention.py` | prefill/extend attention: causal queries over their cached prefix plus themselves |
| `cache.py` | `reshape_and_cache`: write new keys and values into their slots |
| `rms_norm.py` | RMSNorm, optionally fused with the residual add |
| `rotary.py` | rotary embedding of queries and keys, in place |
| `activation.py` | SiLU-and-mul |
| `quant_matmul.py` | fused dequantize + matmul of AWQ / GPTQ weights |
| `fused_moe.py` | mixture of experts: tokens aligned by expert into tiles + two grouped GEMMs |

The CPU path imports `reference.py` alone: `backend/ops/__init__.py` loads the kernel modules (and Triton,
through `jit.py`) only when it runs a kernel, on CUDA tensors or, in the tests, on CPU tensors through
Triton's interpreter.
"""
