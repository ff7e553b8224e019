"""`tritonllm bench`: one command that measures tritonllm and its baselines on the same workload.

Modes (any subset, in one run, same prompts):
  offline        LLM.generate with every request at once
  triton         Triton gRPC streaming (tritonclient.grpc.aio), at each --concurrency / --request-rate
  openai         the OpenAI frontend's /v1/completions with SSE streaming, likewise
  hf-sequential  Hugging Face `generate`, one prompt at a time (a subset: its rate does not depend on it)
  hf-batch       Hugging Face `generate` on all prompts padded into one batch
  vllm-offline   vLLM's LLM.generate, run by the Python given with --vllm-python (its own venv)
  vllm-serve     `vllm serve` (that Python's OpenAI server), driven by the same client as `openai`
  triton-vllm    vLLM in our tritonserver by Triton's own vLLM backend (a checkout of it given with
                 --vllm-backend-src), behind our OpenAI frontend; driven as `openai` is

`--dtype bfloat16,float32` runs every mode at each dtype, and `--vllm-cores default,all` each vLLM
mode with vLLM's default binding (a core left to its front end) and with all cores bound: the
issue's whole table in one command. Ratios compare with tritonllm's offline figure at the same dtype.

`--client vllm-bench` drives the openai, vllm-serve and triton-vllm modes with vLLM's own `vllm bench serve`
(random dataset, --input-len/--output-len, ignore_eos) from the --vllm-python venv instead of this
tool's client: the same external client for both servers. `--client aiperf` does the same with
NVIDIA's aiperf (the executable given with --aiperf; tools/setup_aiperf.sh installs it into
.venv-aiperf and prints it), a second opinion on the same workload.

Reports request and token throughput, TTFT / TPOT / inter-token / end-to-end latency p50-p90-p99,
peak KV usage, preemptions and the prefix-cache hit rate, prints ratios against tritonllm's offline
figure, and writes JSON (--json) and a PNG (--plot) of throughput and latency against concurrency.

Every run starts with nothing of its prompts in the prefix cache, as on a fresh server: warm-ups use
prompts that share no prefix with the workload, and each served run (mode x concurrency, which share
one server) sends its own `cache_salt` (triton-vllm, whose backend takes none, runs without a prefix cache).
"""

# The docstring above is `tritonllm bench --help`. The package: workloads (the prompts), runners (one
# function per mode), clients (this tool's streaming clients and the metrics reader), external_clients
# (`vllm bench serve`, aiperf), servers (starting and stopping them), triton_vllm (the triton-vllm mode's
# server), report (figures, table, PNG), cli (flags and the run plan); vllm_scripts/ holds the files the
# vLLM venv's Python runs by path.
