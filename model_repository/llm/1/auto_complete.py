"""The llm model's Triton config, filled in by `auto_complete_config`: what a repository that says
only `backend: "tritonllm"` (docs/triton.md, moving from the vLLM backend) gets. The tensors are the
vLLM backend's contract, the same as model_repository/llm/config.pbtxt spells out."""

from __future__ import annotations

FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
         "return_logprobs", "return_num_input_tokens", "return_num_output_tokens", "return_num_cached_tokens",
         "return_prompt_logprobs")
INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT32", "dims": [-1], "optional": True},
    {"name": "image", "data_type": "TYPE_STRING", "dims": [-1], "optional": True},  # base64, one per element
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in FLAGS),
]
OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    {"name": "num_cached_tokens", "data_type": "TYPE_UINT32", "dims": [1]},  # tritonllm's: prefix-cache hits
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [1]},  # tritonllm's: JSON, docs/triton.md
]


def complete_config(config):
    """Add the tensors the config does not name, no batching (the engine batches) and the decoupled
    transaction policy (streaming); what the config states already is left as it is."""
    current = config.as_dict()
    have_inputs = {tensor["name"] for tensor in current.get("input", [])}
    have_outputs = {tensor["name"] for tensor in current.get("output", [])}
    for tensor in INPUTS:
        if tensor["name"] not in have_inputs:
            config.add_input(tensor)
    for tensor in OUTPUTS:
        if tensor["name"] not in have_outputs:
            config.add_output(tensor)
    config.set_max_batch_size(0)
    config.set_model_transaction_policy({"decoupled": True})
    return config
