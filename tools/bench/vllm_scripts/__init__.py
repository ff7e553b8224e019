"""Scripts that the vLLM venv's Python runs by path (`--vllm-python`): they import vllm and the
standard library, never tritonllm, which that venv does not have."""
