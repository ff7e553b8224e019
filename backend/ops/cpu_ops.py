"""The CPU path's fast ops: fused C++ kernels (`backend/csrc/cpu_ops.cpp`) and a bfloat16 linear
kernel (`backend/csrc/cpu_linear.cpp`), built on first use with the system C++ compiler into one
library, cached per source, compiler flags and CPU, and called through ctypes on tensors' memory;
and bfloat16 linear layers with their weights prepacked, for that kernel or for oneDNN.

`available()` is False when there is no compiler, the build fails (logged, with what to install),
or TRITONLLM_CPU_KERNELS=0; `backend/ops/__init__.py` then runs the torch references instead, with the same
results. float32 and bfloat16 rows of multiples of 16 floats only (other shapes and types take the
references); the sampler takes float32 logits of any width. The KV cache may also be 8-bit (float8
E4M3 or E5M2, `FP8_CACHES`), which reshape_and_cache and paged_attention quantize and read. Also the CPU KV cache's allocation on
huge pages.

The build targets this CPU (-march=native) unless TRITONLLM_CPU_ARCH names another -march
(x86-64-v2, x86-64-v3, ...: an older CPU's code, to test it here); TRITONLLM_CPU_KERNELS=portable
builds without the bfloat16 dot-product instructions (the code a CPU without AVX512-BF16 runs).
Both are part of the cached library's key.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parents[1] / "csrc"
SOURCES = [CSRC / "cpu_ops.cpp", CSRC / "cpu_prefill_attention.cpp", CSRC / "cpu_linear.cpp",
           CSRC / "cpu_linear_f32.cpp", CSRC / "cpu_lora.cpp", CSRC / "cpu_moe.cpp"]
HEADERS = [CSRC / "vectors.h", CSRC / "kv_cache.h", CSRC / "amx.h"]
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
PORTABLE_FLAGS = ["-mno-avx512bf16"]  # x86-64 only
# TRITONLLM_CPU_ARCH's x86-64 levels and the CPU flags each needs beyond the one below it (those
# that tell them apart): code for a level the CPU lacks would die on its first instruction.
X86_LEVELS = {"x86-64-v2": {"sse4_2", "popcnt"}, "x86-64-v3": {"avx2", "fma", "bmi2"},
              "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
i64, f32, ptr, flag = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_bool
SIGNATURES = {
    "rms_norm": [ptr, ptr, i64, ptr, i64, i64, f32],
    "add_rms_norm": [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, f32],
    "rotary": [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64],
    "silu_and_mul": [ptr, ptr, i64, i64],
    "reshape_and_cache": [ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64],
    "paged_attention": [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, f32],
    "sample_rows": [ptr, ptr, i64, i64, i64, ptr, ptr],
    "lora": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64],
    # An 8-bit cache: the float cache's arguments, then E5M2 (else E4M3), k_scale, v_scale.
    "reshape_and_cache_fp8": [ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, f32, f32],
    "paged_attention_fp8": [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, i64, f32,
                            i64, f32, f32],
    "prefill_attention": [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32],
    "prefill_attention_fp8": [ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, i64, f32, f32],
}
FLOAT32_ONLY = {"sample_rows"}  # logits are float32 whatever the model's dtype


def cache_dir() -> Path:
    """Where built libraries are kept: $TRITONLLM_CPU_OPS_CACHE, else cpu_ops/ in $TRITONLLM_CACHE
    (the models' cache, ~/.cache/tritonllm by default)."""
    if os.environ.get("TRITONLLM_CPU_OPS_CACHE"):
        return Path(os.environ["TRITONLLM_CPU_OPS_CACHE"])
    root = os.environ.get("TRITONLLM_CACHE") or Path.home() / ".cache" / "tritonllm"
    return Path(root) / "cpu_ops"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("flags", "Features")):  # x86-64, aarch64
                return line
    except OSError:
        pass
    return ""


def cpu_arch() -> str:
    return os.environ.get("TRITONLLM_CPU_ARCH") or "native"


def compile_flags(arch: str | None = None, portable: bool | None = None, machine: str | None = None) -> list[str]:
    """The compiler's flags: -march from `arch` (default $TRITONLLM_CPU_ARCH, else native: the
    kernels' vectors are then as wide as the CPU's registers, see csrc/vectors.h); `portable`
    (default: TRITONLLM_CPU_KERNELS=portable) leaves out AVX512-BF16 on x86-64 `machine`s."""
    arch = arch or cpu_arch()
    if portable is None:
        portable = os.environ.get("TRITONLLM_CPU_KERNELS") == "portable"
    x86 = (machine or platform.machine()).lower() in ("x86_64", "amd64")
    return [*FLAGS, f"-march={arch}", *(PORTABLE_FLAGS if portable and x86 else [])]


def runs_here(arch: str) -> bool:
    """Whether this CPU runs code built with -march=`arch` (native, or an x86-64 level it has; any
    other -march is taken on trust)."""
    if arch not in X86_LEVELS:
        return True
    flags, levels = set(cpu_flags().split()), list(X86_LEVELS)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return x86 and all(X86_LEVELS[level] <= flags for level in levels[:levels.index(arch) + 1])


def compile_library(compiler: str, flags: list[str], target: Path) -> None:
    """Compiles SOURCES into `target`; RuntimeError with the compiler's own words if it fails.
    Its output is decoded here, whatever the locale (in Triton's stub Python's may be ASCII, and
    g++ quotes in UTF-8), and a successful build's warnings are logged at debug level."""
    result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(target)], capture_output=True)
    output = (result.stdout + result.stderr).decode("utf-8", errors="replace").strip()
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} {' '.join(flags)} failed (exit {result.returncode}): {output[-2000:]}")
    if output:
        logger.debug("%s warned while building the CPU kernels: %s", compiler, output[-2000:])


def build() -> Path:
    """The library for these sources, flags and CPU; compiled when not cached (10-40 s)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    if not runs_here(cpu_arch()):
        raise RuntimeError(f"TRITONLLM_CPU_ARCH={cpu_arch()}: this CPU lacks its instructions")
    flags = compile_flags()
    texts = [source.read_bytes() for source in SOURCES + HEADERS]
    identity = "\0".join([compiler, *flags, cpu_flags()]).encode()
    key = hashlib.sha256(b"\0".join([*texts, identity])).hexdigest()[:16]
    library = cache_dir() / f"tritonllm_cpu_ops_{key}.so"
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:  # concurrent builds: last rename wins
        target = Path(scratch) / library.name
        compile_library(compiler, flags, target)
        os.replace(target, library)
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TRITONLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(build()))
        for name, argtypes in SIGNATURES.items():
            for suffix in ("f32",) if name in FLOAT32_ONLY else SUFFIXES.values():
                function = getattr(library, f"{name}_{suffix}")
                function.argtypes, function.restype = argtypes, None
    except Exception as error:  # whatever breaks, a kernel build never fails a model load: the references run
        logger.warning("CPU kernels unavailable, using the torch references (slower; install g++, or set CXX, "
                       "to get them): %s: %s", type(error).__name__, error)
        return None
    if hasattr(library, "linear_bf16"):  # built where the compiler targets AVX512-BF16
        library.pack_linear_bf16.argtypes, library.pack_linear_bf16.restype = [ptr, ptr, i64, i64, flag], None
        library.linear_bf16.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ptr, flag, flag]
        library.linear_bf16.restype = None
        library.lora_pairs_bf16.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
        library.lora_pairs_bf16.restype = None
        library.moe_experts_bf16.argtypes = [ptr, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64]
        library.moe_experts_bf16.restype = None
    library.prefill_attention_amx.argtypes, library.prefill_attention_amx.restype = [i64], i64
    library.paged_attention_amx.argtypes, library.paged_attention_amx.restype = [i64], i64
    if hasattr(library, "linear_f32"):  # built for AVX2 and FMA, or AVX-512
        library.linear_f32_multiple.argtypes, library.linear_f32_multiple.restype = [flag], i64
        library.pack_linear_f32.argtypes, library.pack_linear_f32.restype = [ptr, ptr, i64, i64, flag], None
        library.linear_f32.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ptr, flag, flag]
        library.linear_f32.restype = None
    return library


def available() -> bool:
    return _library() is not None


def supports(x: torch.Tensor, multiple: int = 16) -> bool:
    """Whether the C++ ops take x: on the CPU, float32 or bfloat16, its last dim packed and a
    multiple of `multiple` (the kernels work in whole vectors of 4, 8 or 16 floats, the target's
    width: 16 covers them all)."""
    return (x.device.type == "cpu" and x.dtype in SUFFIXES and x.stride(-1) == 1
            and x.shape[-1] % multiple == 0 and available())


def _call(name: str, dtype: torch.dtype, *args) -> None:
    getattr(_library(), f"{name}_{SUFFIXES[dtype]}")(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, size = x.shape
    out = torch.empty(rows, size, dtype=x.dtype)
    _call("rms_norm", x.dtype, out.data_ptr(), x.data_ptr(), x.stride(0), weight.data_ptr(), rows, size, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, size = x.shape
    residual = residual.contiguous()
    out, residual_out = torch.empty(rows, size, dtype=x.dtype), torch.empty(rows, size, dtype=x.dtype)
    _call("add_rms_norm", x.dtype, out.data_ptr(), residual_out.data_ptr(), x.data_ptr(), x.stride(0),
          residual.data_ptr(), weight.data_ptr(), rows, size, eps)
    return out, residual_out


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, KVH, D] with packed heads (rows may be strided); cos/sin [T, D]."""
    tokens, heads, dim = query.shape
    kv_heads = key.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty(tokens, heads, dim, dtype=query.dtype), torch.empty(tokens, kv_heads, dim, dtype=key.dtype)
    _call("rotary", query.dtype, q_out.data_ptr(), k_out.data_ptr(), query.data_ptr(), query.stride(0),
          key.data_ptr(), key.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, kv_heads, dim)
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate, then up) -> [T, I]."""
    x = x.contiguous()
    rows, size = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, size, dtype=x.dtype)
    _call("silu_and_mul", x.dtype, out.data_ptr(), x.data_ptr(), rows, size)
    return out


def lora_pairs(dtype: torch.dtype) -> bool:
    """Whether LoRA deltas in `dtype` run on AVX512-BF16 dot products, over weights packed in pairs
    along the sum (`pack_pairs`)."""
    library = _library()
    return dtype == torch.bfloat16 and library is not None and hasattr(library, "lora_pairs_bf16")


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[..., depth, width] -> [..., depth / 2, width, 2]: each column's two consecutive weights side
    by side (vdpbf16ps's operand layout); depth even."""
    *lead, depth, width = weight.shape
    return weight.reshape(*lead, depth // 2, 2, width).transpose(-1, -2).contiguous()


def lora(out: torch.Tensor, x: torch.Tensor, lora_at: torch.Tensor, lora_bt: torch.Tensor,
         segments: torch.Tensor, ranks: int, pairs: bool) -> None:
    """out[t] += x[t] @ A^T[s, :, :ranks] @ B^T[s, :ranks] for the tokens t of each segment (segments:
    [n, 3] int64, first token, tokens, slot s), in place. x [T, in] and out [T, out] with packed rows;
    A^T [slots, in, width] and B^T [slots, width, out] contiguous in x's dtype, or with `pairs`
    (`lora_pairs`) the same tensors holding what pack_pairs lays out; ranks and out a multiple of 16."""
    width = lora_bt.shape[1]
    function = _library().lora_pairs_bf16 if pairs else getattr(_library(), f"lora_{SUFFIXES[x.dtype]}")
    function(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), lora_at.data_ptr(), lora_bt.data_ptr(),
             segments.data_ptr(), segments.shape[0], x.shape[1], width, ranks, out.shape[1])


def moe_kernel_available() -> bool:
    """Whether bfloat16 MoE experts can run on `moe_experts` (built with AVX512-BF16)."""
    library = _library()
    return library is not None and hasattr(library, "moe_experts_bf16")


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """The MoE layer's grouped_experts (backend/layers/moe.py) in one C++ call
    (csrc/cpu_moe.cpp), bfloat16: SiLU-gated experts stacked as w13 [E, 2I, H] (gate rows, then up
    rows) and w2 [E, H, I], both contiguous; weights and ids [T, k]."""
    x = x.contiguous()
    weights, ids = weights.to(torch.float32).contiguous(), ids.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    _library().moe_experts_bf16(out.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], w13.data_ptr(),
                                w2.data_ptr(), w13.shape[0], w2.shape[2], weights.data_ptr(),
                                ids.data_ptr(), ids.shape[1])
    return out


FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the 8-bit caches the kernels read and write


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [T, KVH, D] (rows may be strided) into kv_cache [2, KVH, num_blocks, block_size, D]:
    of their dtype, or 8-bit (FP8_CACHES) holding key / k_scale and value / v_scale, rounded as
    `reference.quantize_kv` rounds them."""
    tokens, kv_heads, dim = key.shape
    num_slots = kv_cache.shape[2] * kv_cache.shape[3]
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    args = (kv_cache.data_ptr(), key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
            slot_mapping.data_ptr(), tokens, kv_heads, dim, num_slots)
    if kv_cache.dtype in FP8_CACHES:
        _call("reshape_and_cache_fp8", key.dtype, *args, kv_cache.dtype == torch.float8_e5m2, k_scale, v_scale)
    else:
        _call("reshape_and_cache", key.dtype, *args)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    token_rows: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query [T, H, D]; kv_cache [2, KVH, num_blocks, block_size, D] of query's dtype or 8-bit
    (FP8_CACHES: keys read as code * k_scale, values as code * v_scale); block_tables [S, W], token_rows
    and context_lens [T] int32: token t attends to the first context_lens[t] positions of the
    sequence in row token_rows[t] (a decode: all of it; a prefill token: up to itself), or with a
    sliding window to the last `sliding_window` of them only (the blocks before are not read, so
    their table entries may point anywhere). A soft cap turns scores s into cap * tanh(s / cap)
    before the softmax. Returns [T, H, D]."""
    query = query.contiguous()
    tokens, heads, dim = query.shape
    _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
    block_tables = block_tables.to(torch.int32).contiguous()
    token_rows = token_rows.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    args = (out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            token_rows.data_ptr(), context_lens.data_ptr(), tokens, heads, kv_heads, dim, num_blocks, block_size,
            scale, sliding_window or 0, logits_soft_cap or 0.0)
    if kv_cache.dtype in FP8_CACHES:
        _call("paged_attention_fp8", query.dtype, *args, kv_cache.dtype == torch.float8_e5m2, k_scale, v_scale)
    else:
        _call("paged_attention", query.dtype, *args)
    return out


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                      scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One prefill chunk's queries [Tq, H, D] (D 64 or 128, H a multiple of the cache's KV heads, at
    most 8 per KV head) at positions [context_len - Tq, context_len), each attending causally to
    every position up to its own, read in place from kv_cache [2, KVH, num_blocks, block_size, D]
    (query's dtype, or 8-bit as in `paged_attention`), which already holds the chunk's own keys and
    values; block_table [>= ceil(context_len / block_size)] int32 (`csrc/cpu_prefill_attention.cpp`).
    Returns [Tq, H, D]."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()
    tokens, heads, dim = query.shape
    _, kv_heads, num_blocks, block_size, _ = kv_cache.shape
    block_table = block_table.to(torch.int32).contiguous()
    out = torch.empty(tokens, heads, dim, dtype=query.dtype)
    args = (out.data_ptr(), query.data_ptr(), query.stride(0), kv_cache.data_ptr(), block_table.data_ptr(), tokens,
            context_len, heads, kv_heads, dim, num_blocks, block_size, scale)
    if kv_cache.dtype in FP8_CACHES:
        _call("prefill_attention_fp8", query.dtype, *args, kv_cache.dtype == torch.float8_e5m2, k_scale, v_scale)
    else:
        _call("prefill_attention", query.dtype, *args)
    return out


def prefill_on_amx(enable: bool | None = None) -> bool:
    """Whether `prefill_attention` multiplies bfloat16 on AMX tiles (built where the compiler targets
    AMX, and the OS lends the tiles); `enable` turns that on or off for the process first."""
    library = _library()
    return library is not None and bool(library.prefill_attention_amx(-1 if enable is None else int(enable)))


def decode_on_amx(enable: bool | None = None) -> bool:
    """Whether `paged_attention` runs bfloat16 decodes (float or 8-bit cache) on AMX tiles: the scores,
    and an 8-bit cache's output at head size 64 (built where the compiler targets AMX, and the OS
    lends the tiles); `enable` turns that on or off first."""
    library = _library()
    return library is not None and bool(library.paged_attention_amx(-1 if enable is None else int(enable)))


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """float32 logits [rows, vocab] -> int64 token ids [rows]: argmax where temperature is 0, else
    the inverse-CDF draw of softmax(logits / T) at `uniforms` (as backend.sampling.sampler.inverse_cdf)."""
    rows, vocab = logits.shape
    temperatures = temperatures.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float32).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    _call("sample_rows", torch.float32, out.data_ptr(), logits.data_ptr(), logits.stride(0), rows, vocab,
          temperatures.data_ptr(), uniforms.data_ptr())
    return out


def fma_peak_gflops(seconds: float = 0.5) -> float:
    """The float32 GFLOP/s this CPU's vector FMAs retire on torch's threads (chains of FMAs that
    touch no memory): the peak a kernel's GFLOP/s is a fraction of. Measured, since a VM does not
    report its clock; runs for about `seconds`."""
    library = _library()
    if library is None:
        raise RuntimeError("the CPU kernels are not built here")
    library.fma_peak_flop.argtypes, library.fma_peak_flop.restype = [i64], i64
    rounds = 1 << 16
    while True:
        start = time.perf_counter()
        flop = library.fma_peak_flop(rounds)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 4:
            break
        rounds *= 4
    best = flop / elapsed
    for _ in range(3):  # the fastest of a few: another process's slice only ever slows one down
        start = time.perf_counter()
        flop = library.fma_peak_flop(rounds)
        best = max(best, flop / (time.perf_counter() - start))
    return best / 1e9


@functools.cache
def own_linear_kernel(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether linears in `dtype` run on our kernels. bfloat16: `csrc/cpu_linear.cpp`, built for
    AVX512-BF16, on a CPU without AMX (oneDNN's AMX kernels are the faster ones where it has it).
    float32: `csrc/cpu_linear_f32.cpp`, built for AVX2 and FMA or AVX-512. TRITONLLM_CPU_LINEARS=onednn
    keeps oneDNN's for both."""
    library = _library()
    if library is None or os.environ.get("TRITONLLM_CPU_LINEARS") == "onednn":
        return False
    if dtype == torch.float32:
        return hasattr(library, "linear_f32")
    return dtype == torch.bfloat16 and hasattr(library, "linear_bf16") and not has_amx_bf16()


@functools.cache
def has_amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (oneDNN, and so torch's linears and flash
    attention, use them)."""
    return "amx_bf16" in cpu_flags().split()


def out_multiple(dtype: torch.dtype, gated: bool = False) -> int:
    """The output features our kernel in `dtype` takes a weight in: whole vectors (16 bfloat16
    outputs; 16 float32 outputs with AVX-512, 8 with AVX2), and for a gated weight whole gate + up
    panels (bfloat16: 32 + 32; float32: 32 + 32 with AVX-512, 8 + 8 with AVX2)."""
    if dtype == torch.bfloat16:
        return 64 if gated else 16
    library = _library()
    return library.linear_f32_multiple(gated) if library is not None and hasattr(library, "linear_f32") else 0


def own_kernel_takes(linear: nn.Linear) -> bool:
    out_features, in_features = linear.weight.shape
    dtype = linear.weight.dtype
    return (dtype in SUFFIXES and own_linear_kernel(dtype) and out_features % out_multiple(dtype) == 0
            and (dtype != torch.bfloat16 or in_features % 2 == 0)
            and (linear.bias is None or linear.bias.dtype == dtype))


@functools.cache
def onednn_packing(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs and runs linears in `dtype` here. In bfloat16 it needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT and raises without them (AVX2 CPUs such as AMD Zen 2): asked once, on a
    small weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError as error:
        logger.info("oneDNN does not pack %s linears on this CPU (F.linear runs them): %s", dtype, error)
        return False
    return True


class PackedLinear(nn.Module):
    """nn.Linear in bfloat16 or float32 with its weight packed once: into the panels of our C++
    kernels where `own_linear_kernel(dtype)` (bfloat16 on AVX512-BF16 without AMX; float32 on AVX2
    or AVX-512), else into oneDNN's blocked layout. docs/benchmarks.md has what each gains.
    Our kernels take output features in whole vectors (`out_multiple`) and, in bfloat16, even input
    features; their results are F.linear's but for the sums' order (bfloat16: about one output in
    20,000 a unit away; float32: the last bits). Where neither takes the weight (bfloat16 on a CPU
    without AVX-512: `onednn_packing`), it stays as it is and F.linear runs it.

    `gated`: the weight is an MLP's gate and up projections stacked, and `silu_and_mul(x)` gives
    ops.silu_and_mul(self(x)) in one pass, bit for bit (our kernels, output features a multiple of
    `out_multiple(dtype, gated=True)`; `self.gated` says whether it took the offer)."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int, gated: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        self.own_kernel = own_kernel_takes(linear)
        self.gated = gated and self.own_kernel and self.out_features % out_multiple(weight.dtype, gated=True) == 0
        self.onednn = not self.own_kernel and onednn_packing(weight.dtype)
        if self.own_kernel:
            weight = weight.contiguous()
            packed = torch.empty_like(weight)
            self.kernel = f"linear_{SUFFIXES[weight.dtype]}"  # looked up per call: the module stays picklable
            getattr(_library(), f"pack_{self.kernel}")(
                packed.data_ptr(), weight.data_ptr(), self.out_features, self.in_features, self.gated)
        elif self.onednn:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        else:
            packed = weight
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if not self.own_kernel:
            return F.linear(x, self.weight, self.bias)
        return self._run(x, silu=False)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gated, "silu_and_mul needs a PackedLinear whose `gated` is True"
        return self._run(x, silu=True)

    def _run(self, x: torch.Tensor, silu: bool) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out_features = self.out_features // 2 if silu else self.out_features
        out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
        kernel = getattr(_library(), self.kernel)
        kernel(out.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], self.in_features, self.weight.data_ptr(),
               self.out_features, None if self.bias is None else self.bias.data_ptr(), self.gated, silu)
        return out.view(*x.shape[:-1], out_features)


def pack_linears(model: nn.Module, batch_size_hint: int) -> None:
    """Swap every bfloat16 and float32 nn.Linear of a CPU model that a kernel packs (ours or
    oneDNN's) for a PackedLinear; a `gate_up_proj` packs gated. float32 sums in oneDNN's order, not MKL's (Hugging Face's): outputs
    differ in the last bits (~2e-6 at SmolLM2's shapes) and the greedy float32 tests against
    Hugging Face stay token-exact."""
    for module in list(model.modules()):
        if getattr(module, "keeps_linears_unpacked", False):  # MoE experts on their own kernel (layers/moe.py)
            continue
        for name, child in module.named_children():
            if (isinstance(child, nn.Linear) and child.weight.dtype in (torch.bfloat16, torch.float32)
                    and child.weight.device.type == "cpu"
                    and (own_kernel_takes(child) or onednn_packing(child.weight.dtype))):
                setattr(module, name, PackedLinear(child, batch_size_hint, gated=name == "gate_up_proj"))
