#!/usr/bin/env bash
# The GPU checks of tritonllm in one run of a few minutes, for a machine with an NVIDIA GPU:
#   1. the kernel tests (tests/ops/test_kernels.py) on CUDA, the engine's CUDA-graph path included;
#   2. decode attention micro-benchmark: achieved GB/s against the device's peak (and a measured
#      device-to-device copy), next to the torch reference;
#   3. offline throughput: LLM.generate against Hugging Face `generate` on the same GPU (sequential
#      and one static batch), 64 prompts of ~128 tokens, 128 out, greedy, bf16.
#
# Python: the machine's python3 when it already has a CUDA torch and Triton (GPU images; machines
# without network), so nothing is downloaded; otherwise a venv with torch 2.13.0 and triton 3.7.1
# (the pair torch's CUDA wheel pins) and the package's dependencies from PyPI.
# Model: $GPU_CHECK_MODEL, else the prepared SmolLM2 if present, else a model of SmolLM2-135M's
# shape with random weights and a word-level tokenizer, written locally (throughput with
# ignore_eos does not depend on the weights).
# Files go under $GPU_CHECK_WORK (default /tmp/tritonllm-gpu-check); the figures, as JSON too, to
# $GPU_CHECK_OUT (default: its figures/ folder).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
work="${GPU_CHECK_WORK:-/tmp/tritonllm-gpu-check}"
out="${GPU_CHECK_OUT:-$work/figures}"
mkdir -p "$work" "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stage() { echo; echo "== $* ($(date +%T))"; }

stage "python"
if python3 -c 'import torch, triton, transformers, pytest; assert torch.cuda.is_available()' 2>/dev/null; then
  py=python3
else
  if [ ! -x "$work/venv/bin/python" ]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/python" -m pip install --quiet "torch==2.13.0" "triton==3.7.1"
    "$work/venv/bin/python" -m pip install --quiet -e "$root" pytest
  fi
  py="$work/venv/bin/python"
fi
"$py" - <<'EOF'
import torch, triton, transformers
assert torch.cuda.is_available(), "no CUDA device visible to torch"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
EOF

stage "kernel tests on CUDA"
workers=()
if "$py" -c 'import xdist' 2>/dev/null; then workers=(-n 4); fi  # Triton compiles in parallel
timeout 600 "$py" -m pytest -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} tests/ops/test_kernels.py 2>&1 | tee "$out/kernel_tests.txt"

stage "decode attention: achieved bandwidth"
timeout 300 "$py" - "$out/decode_attention.json" <<'EOF'
import json, sys
import torch, triton
from triton.testing import do_bench
from backend.ops.attention import cache_views
from backend.kernels.paged_attention import _num_sms, choose_num_splits, paged_attention_decode
from backend.kernels.reference import paged_attention_decode_reference

peak = triton.testing.get_dram_gbps()  # memory clock x bus width, from the driver
src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
copy = 2 * src.numel() / do_bench(lambda: dst.copy_(src)) / 1e6  # read + write, GB/s
del src, dst
print(f"peak DRAM {peak:.0f} GB/s; device-to-device copy {copy:.0f} GB/s")
print(f"{'model shape':<14}{'batch':>6}{'context':>8}{'splits':>7}{'us':>9}{'GB/s':>8}{'% peak':>7}{'% copy':>7}"
      f"{'torch us':>10}{'speed-up':>9}")
rows = []
for name, kv_heads, group, head_dim in [("SmolLM2-135M", 3, 3, 64), ("Llama-3-8B", 8, 4, 128)]:
    for batch, context in [(1, 8192), (16, 2048), (64, 1024), (256, 1024), (64, 4096)]:
        torch.manual_seed(0)
        block_size, per_seq = 16, context // 16
        kv_cache = torch.randn(2, kv_heads, batch * per_seq, block_size, head_dim, dtype=torch.bfloat16,
                               device="cuda")  # the engine's layout: [2, KVH, num_blocks, block_size, D]
        key_cache, value_cache = cache_views(kv_cache)
        tables = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
        out = paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim ** -0.5)
        expected = paged_attention_decode_reference(query, key_cache, value_cache, tables, lens, head_dim ** -0.5)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        ms = do_bench(lambda: paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim ** -0.5))
        torch_ms = do_bench(lambda: paged_attention_decode_reference(query, key_cache, value_cache, tables, lens,
                                                                     head_dim ** -0.5))
        moved = 2 * batch * context * kv_heads * head_dim * 2 + 2 * query.numel() * 2 + tables.numel() * 4
        gbps = moved / ms / 1e6
        splits = choose_num_splits(batch, kv_heads, per_seq * block_size, _num_sms(query.device))
        rows.append(dict(model=name, batch=batch, context=context, splits=splits, us=ms * 1e3, gbps=gbps,
                         peak_gbps=peak, copy_gbps=copy, torch_us=torch_ms * 1e3))
        print(f"{name:<14}{batch:>6}{context:>8}{splits:>7}{ms * 1e3:>9.1f}{gbps:>8.0f}{100 * gbps / peak:>7.0f}"
              f"{100 * gbps / copy:>7.0f}{torch_ms * 1e3:>10.1f}{torch_ms / ms:>8.1f}x")
        del kv_cache, key_cache, value_cache
json.dump(rows, open(sys.argv[1], "w"), indent=2)
EOF

stage "model"
model="${GPU_CHECK_MODEL:-}"
if [ -z "$model" ]; then
  model="$("$py" -c 'from tools.prepare_model import default_model_dir, is_prepared
d = default_model_dir(); print(d if is_prepared(d) else "")')"
fi
if [ -z "$model" ]; then
  model="$work/smollm2-shape-random"
  if [ ! -f "$model/config.json" ]; then
    "$py" - "$model" <<'EOF'
import sys
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tools.bench.workloads import WORDS

config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
words.pre_tokenizer = pre_tokenizers.Whitespace()
PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                        pad_token="</s>").save_pretrained(sys.argv[1])
EOF
  fi
fi
echo "$model"

stage "offline throughput against Hugging Face on the GPU"
timeout 600 "$py" - "$model" "$out/offline.json" <<'EOF'
import json, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from backend import LLM, SamplingParams
from tools.bench.workloads import make_workload

model_path, result_path = sys.argv[1], sys.argv[2]
workload = make_workload("fixed", AutoTokenizer.from_pretrained(model_path), 64, 0, 128, 128)
out_len = 128
started = time.perf_counter()
llm = LLM(model_path, dtype="bfloat16", seed=0)
startup = time.perf_counter() - started
runner = llm.llm_engine.runner
llm.generate(workload.prompts[:2], SamplingParams(temperature=0, max_tokens=4))
started = time.perf_counter()
outputs = llm.generate(workload.prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
elapsed = time.perf_counter() - started
engine_rate = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
graphs = len(runner.cuda_graphs.graphs) if runner.cuda_graphs else 0
print(f"tritonllm: {engine_rate:.0f} out tok/s (start-up {startup:.1f} s with {graphs} CUDA graphs, "
      f"KV cache {runner.num_blocks} blocks = {runner.num_blocks * runner.block_bytes / 2**30:.1f} GiB)")
del llm, runner
torch.cuda.empty_cache()

hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
with torch.inference_mode():
    hf.generate(torch.tensor([workload.prompts[0]], device="cuda"), max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for prompt in workload.prompts[:4]:
        hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=out_len, min_new_tokens=out_len,
                    do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    sequential = 4 * out_len / (time.perf_counter() - started)
    longest = max(map(len, workload.prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in workload.prompts], device="cuda")
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in workload.prompts], device="cuda")
    started = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False,
                pad_token_id=0)
    torch.cuda.synchronize()
    batch = len(workload.prompts) * out_len / (time.perf_counter() - started)
print(f"HF sequential (4 prompts): {sequential:.0f} out tok/s; tritonllm / HF sequential = {engine_rate / sequential:.1f}x")
print(f"HF static batch (64 prompts): {batch:.0f} out tok/s; tritonllm / HF static batch = {engine_rate / batch:.2f}x")
json.dump({"model": model_path, "tritonllm_out_tok_s": engine_rate, "startup_s": startup, "cuda_graphs": graphs,
           "hf_sequential_out_tok_s": sequential, "hf_static_batch_out_tok_s": batch}, open(result_path, "w"), indent=2)
EOF
stage "done: figures in $out"
