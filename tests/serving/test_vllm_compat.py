"""Drop-in for Triton vLLM-backend users (issue 27): vLLM's engine argument names in model.json, hub
ids from the local Hugging Face cache, generation_config defaults, and a repository written for the
vLLM backend loading under `backend: "tritonllm"` in a real tritonserver."""

from __future__ import annotations

import json
import os
import queue
from pathlib import Path

import numpy as np
import pytest

from backend.config import EngineConfig, generation_defaults
from backend.errors import MODEL_UNAVAILABLE, EngineError
from backend.model_paths import hf_cache_snapshot, resolve_model_path
from backend.vllm_args import SAME_NAME, VLLM_ENGINE_ARGS, unset

# vLLM's EngineArgs / AsyncEngineArgs field names (vLLM 0.10-0.11, plus older ones Triton's vLLM
# backend users still have in their model.json). Written out here, independent of the table.
VLLM_NAMES = """
model served_model_name tokenizer hf_config_path runner convert task skip_tokenizer_init
enable_prompt_embeds tokenizer_mode trust_remote_code allowed_local_media_path allowed_media_domains
download_dir safetensors_load_strategy load_format config_format dtype kv_cache_dtype seed
max_model_len cuda_graph_sizes distributed_executor_backend pipeline_parallel_size
tensor_parallel_size decode_context_parallel_size data_parallel_size data_parallel_rank
data_parallel_start_rank data_parallel_size_local data_parallel_address data_parallel_rpc_port
data_parallel_hybrid_lb data_parallel_backend enable_expert_parallel eplb_config enable_eplb
num_redundant_experts eplb_window_size eplb_step_interval eplb_log_balancedness
max_parallel_loading_workers block_size enable_prefix_caching prefix_caching_hash_algo
disable_sliding_window disable_cascade_attn swap_space cpu_offload_gb gpu_memory_utilization
kv_cache_memory_bytes max_num_batched_tokens max_num_partial_prefills max_long_partial_prefills
long_prefill_token_threshold max_num_seqs max_logprobs logprobs_mode disable_log_stats revision
code_revision rope_scaling rope_theta hf_token hf_overrides tokenizer_revision quantization
enforce_eager max_seq_len_to_capture disable_custom_all_reduce limit_mm_per_prompt
interleave_mm_strings media_io_kwargs mm_processor_kwargs disable_mm_preprocessor_cache
mm_processor_cache_gb mm_encoder_tp_mode io_processor_plugin skip_mm_profiling enable_lora
enable_lora_bias max_loras max_lora_rank default_mm_loras fully_sharded_loras max_cpu_loras
lora_dtype lora_extra_vocab_size long_lora_scaling_factors enable_prompt_adapter max_prompt_adapters
max_prompt_adapter_token device num_scheduler_steps multi_step_stream_outputs ray_workers_use_nsight
num_gpu_blocks_override num_lookahead_slots model_loader_extra_config ignore_patterns
preemption_mode scheduler_delay_factor enable_chunked_prefill disable_chunked_mm_input
disable_hybrid_kv_cache_manager guided_decoding_backend guided_decoding_disable_fallback
guided_decoding_disable_any_whitespace guided_decoding_disable_additional_properties
structured_outputs_config logits_processor_pattern speculative_config speculative_model
num_speculative_tokens ngram_prompt_lookup_max ngram_prompt_lookup_min
show_hidden_metrics_for_version otlp_traces_endpoint collect_detailed_traces
collect_model_forward_time collect_model_execute_time disable_async_output_proc scheduling_policy
scheduler_cls override_neuron_config override_pooler_config pooler_config compilation_config
worker_cls worker_extension_cls kv_transfer_config kv_events_config generation_config
override_generation_config enable_sleep_mode model_impl override_attention_dtype
calculate_kv_scales mamba_cache_dtype mamba_ssm_cache_dtype additional_config reasoning_parser
use_tqdm_on_load pt_load_map_location enable_multimodal_encoder_data_parallel async_scheduling
kv_sharing_fast_prefill use_v2_block_manager disable_log_requests enable_log_requests
tokenizer_pool_size tokenizer_pool_type tokenizer_pool_extra_config logits_processors
""".split()

# The sample repository of Triton's vLLM-backend documentation (the hub id is our prepared model's
# name, found through a local Hugging Face cache below).
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SAMPLE_MODEL_JSON = {"model": HUB_ID, "disable_log_requests": True, "gpu_memory_utilization": 0.5,
                     "enforce_eager": True}
SAMPLE_CONFIG_PBTXT = """backend: "tritonllm"

# The usage of device is deferred to the vLLM engine
instance_group [
  {
    count: 1
    kind: KIND_MODEL
  }
]
"""
NON_DEFAULT = (True, 2, "something-else", {"key": 1})


def test_every_vllm_engine_argument_is_ours_or_in_the_table():
    missing = [name for name in VLLM_NAMES if name not in SAME_NAME and name not in VLLM_ENGINE_ARGS]
    assert not missing
    own = {f for f in EngineConfig.__dataclass_fields__}
    assert set(SAME_NAME) <= own, set(SAME_NAME) - own


@pytest.mark.parametrize("name", sorted(VLLM_ENGINE_ARGS))
def test_each_vllm_argument_is_accepted_or_refused_with_its_reason(name):
    arg = VLLM_ENGINE_ARGS[name]
    assert arg.reason
    if arg.target is not None or name in EngineConfig.__dataclass_fields__:
        return  # an alias, or our own field: test_vllm_aliases_and_refusals
    EngineConfig.from_dict({name: None})  # vLLM's default is always accepted
    for value in NON_DEFAULT:
        if arg.accepts(value):
            EngineConfig.from_dict({name: value})  # accepted (and logged as ignored)
        else:
            with pytest.raises(EngineError) as error:
                EngineConfig.from_dict({name: value})
            assert error.value.param == name and arg.reason in str(error.value)
    refused = [v for v in NON_DEFAULT if not arg.accepts(v)]
    if arg.accepts is not VLLM_ENGINE_ARGS["enforce_eager"].accepts:  # not a plain ignored one
        assert refused, f"{name} is listed as honoured at its default only but refuses nothing"


def test_the_docs_sample_model_json_is_accepted_and_ignored_keys_are_logged(caplog):
    with caplog.at_level("WARNING"):
        config = EngineConfig.from_dict({**SAMPLE_MODEL_JSON, "disable_log_stats": True})
    assert config.model == HUB_ID and config.gpu_memory_utilization == 0.5
    logged = caplog.text
    for name in ("enforce_eager", "disable_log_requests", "disable_log_stats"):
        assert f"{name}=True ignored" in logged


def test_vllm_aliases_and_refusals():
    assert EngineConfig.from_dict({"dtype": "half"}).dtype == "float16"
    assert EngineConfig.from_dict({"dtype": "float"}).dtype == "float32"
    assert EngineConfig.from_dict({"served_model_name": ["a", "b"]}).served_model_name == "a"
    assert EngineConfig.from_dict({"trust_remote_code": "false"}).trust_remote_code is False
    for values in ({"trust_remote_code": True}, {"trust_remote_code": "true"}):
        with pytest.raises(EngineError, match="trust_remote_code: no remote code runs here"):
            EngineConfig.from_dict(values)
    with pytest.raises(EngineError, match="data_parallel_size: 2 is not supported"):
        EngineConfig.from_dict({"data_parallel_size": 2})
    EngineConfig.from_dict({"data_parallel_size": 1, "task": "generate", "load_format": "auto"})
    with pytest.raises(EngineError, match="task: 'embed' is not supported: text generation only"):
        EngineConfig.from_dict({"task": "embed"})
    with pytest.raises(EngineError, match=r"unknown engine argument\(s\): not_a_knob"):
        EngineConfig.from_dict({"not_a_knob": 1})
    assert unset(None) and unset(False) and not unset(True)


def fake_hf_cache(root: Path, model_path: str, commit: str = "0123abcd") -> Path:
    """A Hugging Face hub cache holding our prepared model as HUB_ID at `commit` (branch main)."""
    repo = root / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "refs" / "v1").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(Path(model_path).resolve())
    return repo / "snapshots" / commit


def test_hub_id_resolves_from_the_local_hf_cache_and_never_downloads(tmp_path, monkeypatch, model_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snapshot = fake_hf_cache(tmp_path, model_path)
    assert resolve_model_path(HUB_ID) == str(snapshot)
    assert resolve_model_path(HUB_ID, "v1") == str(snapshot)  # a tag through refs/
    assert hf_cache_snapshot(HUB_ID, "0123abcd") == snapshot  # a commit hash
    for model, revision in ((HUB_ID, "v2"), ("someone/absent-model", None)):
        with pytest.raises(EngineError, match="nothing is downloaded here") as error:
            resolve_model_path(model, revision)
        assert error.value.code == MODEL_UNAVAILABLE and error.value.param == "model"
    with pytest.raises(EngineError, match="huggingface-cli download someone/absent-model"):
        resolve_model_path("someone/absent-model")


def test_generation_config_defaults(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}))
    auto = EngineConfig(model=str(folder))
    assert generation_defaults(auto, str(folder)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    assert generation_defaults(EngineConfig(generation_config="vllm"), str(folder)) == {}
    override = EngineConfig(override_generation_config='{"temperature": 0.0}')
    assert generation_defaults(override, str(folder))["temperature"] == 0.0
    other = tmp_path / "other"
    other.mkdir()
    assert generation_defaults(EngineConfig(generation_config=str(folder)), str(other))["top_k"] == 20
    with pytest.raises(EngineError, match="generation_config: no generation_config.json"):
        generation_defaults(EngineConfig(generation_config=str(other)), str(folder))
    with pytest.raises(EngineError, match="override_generation_config: unknown key"):
        EngineConfig(override_generation_config={"beams": 2})


def test_offline_llm_takes_generation_config_defaults(tmp_path, model_path):
    from backend import LLM

    folder = tmp_path / "model"
    folder.mkdir()
    for entry in Path(model_path).iterdir():
        if entry.name != "generation_config.json":
            (folder / entry.name).symlink_to(entry)
    generation = json.loads((Path(model_path) / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 5,
                                                               "temperature": 0.0}))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    assert llm.get_default_sampling_params().max_tokens == 5
    output = llm.generate("Hello, my name is")[0]  # no SamplingParams: the model's defaults
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].finish_reason == "length"
    again = llm.generate("Hello, my name is")[0]
    assert again.outputs[0].token_ids == output.outputs[0].token_ids  # temperature 0: greedy


# -- the vLLM backend's sample repository, under `backend: "tritonllm"` ---------------------------
@pytest.fixture(scope="module")
def triton(tmp_path_factory, model_path):
    from tools.triton_server import TritonServer, free_port

    work = tmp_path_factory.mktemp("vllm_compat")
    fake_hf_cache(work / "hf", model_path)
    repository = work / "model_repository"
    (repository / "vllm_model" / "1").mkdir(parents=True)
    (repository / "vllm_model" / "config.pbtxt").write_text(SAMPLE_CONFIG_PBTXT)
    (repository / "vllm_model" / "1" / "model.json").write_text(json.dumps(SAMPLE_MODEL_JSON, indent=2))
    server = TritonServer(repository, work, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_file=work / "triton.log",
                          extra_args=["--exit-timeout-secs=5"])
    saved = {name: os.environ.get(name) for name in ("HF_HOME", "HF_HUB_CACHE")}
    os.environ["HF_HOME"] = str(work / "hf")
    os.environ.pop("HF_HUB_CACHE", None)
    try:
        server.start()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        server.wait_ready(300)
        yield server
    finally:
        assert server.stop() == 0, "tritonserver did not exit cleanly"


def test_vllm_backend_sample_repository_streams_with_tritonclient(triton):
    """The docs' streaming example, unchanged but for the model's name and prompt."""
    import tritonclient.grpc as grpcclient

    def tensor(name, value, datatype):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else bool))
        return t

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    config = client.get_model_config("vllm_model", as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True  # filled by auto_complete_config
    assert {"text_input", "stream", "sampling_parameters"} <= {t["name"] for t in config["input"]}
    assert config["instance_group"][0]["kind"] == "KIND_MODEL"
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("vllm_model", [
        tensor("text_input", b"Triton Inference Server is", "BYTES"),
        tensor("stream", True, "BOOL"),
        tensor("sampling_parameters", json.dumps({"max_tokens": 16, "temperature": 0}).encode(), "BYTES"),
    ], enable_empty_final_response=True)
    pieces = []
    while True:
        result, error = responses.get(timeout=120)
        assert error is None, error
        text = result.as_numpy("text_output")
        if text is not None and len(text):
            pieces.append(text[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert len(pieces) >= 2 and "".join(pieces).strip()


# Their L0 tests compare these whole (ci/L0_backend_vllm: enabled_stream, request_cancellation).
VLLM_STREAM_ECHO_ERROR = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
VLLM_CANCEL_LOG_LINES = ("[vllm] Cancelling the request", "[vllm] Successfully cancelled the request")


def test_vllm_backend_wording_for_a_streamed_echo_and_a_cancellation(triton):
    """Their enabled_stream and request_cancellation tests' checks, unchanged: the error's whole text,
    and the two log lines in Triton's log; the frontend still reads the error's code and parameter."""
    import time

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from openai_frontend.errors import from_triton_message
    from tests.utils import wait_for
    from tests.utils.triton import Stream, make_inputs

    stream = Stream(triton.grpc_url)
    try:
        stream.send(make_inputs("The future of AI is", {"max_tokens": 4}, stream=True, exclude_input_in_output=False),
                    model="vllm_model")
        result, error = stream.next()
    finally:
        stream.close()
    assert isinstance(error, InferenceServerException) and error.message() == VLLM_STREAM_ECHO_ERROR, error
    refused = from_triton_message(error.message())
    assert (refused.status, refused.param) == (400, "exclude_input_in_output")

    log = Path(triton.log_file)
    assert not any(line in log.read_text(encoding="utf-8", errors="replace") for line in VLLM_CANCEL_LOG_LINES)
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put(error))
    client.async_stream_infer("vllm_model", make_inputs(
        "Write an original and creative poem of at least 200 words.",
        {"temperature": "0", "top_p": "1", "max_tokens": "1500"}, stream=False), request_id="1")
    time.sleep(1)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert str(answers.get(timeout=10).status()) == "StatusCode.CANCELLED"
    wait_for(lambda: all(line in log.read_text(encoding="utf-8", errors="replace") for line in VLLM_CANCEL_LOG_LINES), timeout=10,
             message="the vLLM backend's cancellation log lines")


# -- `tritonllm serve` flags -----------------------------------------------------------------------
def test_serve_refuses_trust_remote_code_before_starting_anything(tmp_path):
    import subprocess
    import sys

    from tests.utils import ROOT

    done = subprocess.run([sys.executable, "-m", "tools.serve", "--trust-remote-code", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "trust_remote_code: no remote code runs here" in done.stderr
    assert not (tmp_path / "tritonserver.log").exists()


def test_serve_no_frontend_runs_triton_only(tmp_path, model_path):
    """A scale-out replica: Triton's ports answer, the OpenAI port stays closed; vLLM's log flags and
    a hub id with --revision (from the local Hugging Face cache) are accepted."""
    from tests.utils.serve import Serve, listening

    fake_hf_cache(tmp_path / "hf", model_path)
    saved = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(tmp_path / "hf")
    try:
        serve = Serve(HUB_ID, tmp_path / "serve", "--no-frontend", "--revision", "v1", "--disable-log-stats",
                      "--disable-log-requests", "--generation-config", "vllm", "--max-num-seqs", "4",
                      kv_cache_bytes=8 << 20, max_model_len=256)
    finally:
        os.environ.pop("HF_HOME") if saved is None else os.environ.__setitem__("HF_HOME", saved)
    try:
        assert "serving Triton only" in serve.log()
        assert serve.triton("/v2/models/llm/ready")[0] == 200
        status, body = serve.triton("/v2/models/llm/generate", {"text_input": "Hello", "parameters": {"max_tokens": 4}})
        assert status == 200 and json.loads(body)["text_output"]
        assert not listening(serve.ports["port"])
        model_json = json.loads((tmp_path / "serve" / "model_repository" / "llm" / "1" / "model.json").read_text())
        assert model_json["model"] == str(Path(model_path).resolve()) and "revision" not in model_json
    finally:
        serve.stop()


# -- sampling parameters: bad_words, allowed_token_ids, truncate_prompt_tokens, priority ----------
PROMPT = "The capital of France is Paris. The capital of Germany is"


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_allowed_token_ids_masks_every_other_token(llm, tokenizer):
    from backend import SamplingParams

    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    for params in (SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=allowed)):
        tokens = llm.generate(PROMPT, params)[0].outputs[0].token_ids
        assert len(tokens) == 8 and set(tokens) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10 ** 7]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_ban_a_words_last_token_after_its_prefix(llm, tokenizer):
    """Greedy: the output equals the unconstrained one up to where that one spells a bad word;
    there the word's last token is banned, and no bad word's tokens ever appear."""
    from backend import SamplingParams

    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    word = base.text.split()[1]  # a word the model certainly writes
    banned = llm.llm_engine.bad_words_token_ids([word])
    assert any(contains(base.token_ids, ids) for ids in banned)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, bad_words=[word]))[0].outputs[0]
    assert not any(contains(out.token_ids, ids) for ids in banned)
    first = min(i + len(ids) - 1 for ids in banned for i in range(len(base.token_ids))
                if base.token_ids[i:i + len(ids)] == ids)
    assert out.token_ids[:first] == base.token_ids[:first]  # unchanged before the banned token
    assert out.token_ids[first] != base.token_ids[first]
    # With and without a leading space, as vLLM tokenizes bad words.
    spaced, bare = tokenizer.encode(" Berlin", add_special_tokens=False), tokenizer.encode("Berlin", add_special_tokens=False)
    assert llm.llm_engine.bad_words_token_ids(["Berlin"]) == ([bare, spaced] if spaced[0] != bare[0]
                                                              and len(spaced) == len(bare) else [bare])


def test_truncate_prompt_tokens_keeps_the_prompts_tail(llm, tokenizer):
    from backend import SamplingParams

    ids = tokenizer.encode(PROMPT)
    truncated = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=5))[0]
    tail = llm.generate(ids[-5:], SamplingParams(temperature=0, max_tokens=6))[0]
    assert truncated.prompt_token_ids == ids[-5:]
    assert truncated.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=-1))[0]
    assert whole.prompt_token_ids == ids  # -1: max_model_len, longer than the prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens: must be at most max_model_len"):
        llm.generate(PROMPT, SamplingParams(truncate_prompt_tokens=10 ** 6))


def test_sampling_parameters_json_takes_the_new_names():
    from backend import SamplingParams

    params = SamplingParams.from_dict({"bad_words": "x", "allowed_token_ids": "[1, 2]", "truncate_prompt_tokens": "7"})
    assert SamplingParams.from_dict({"bad_words": '["a b", "c"]'}).bad_words == ["a b", "c"]
    assert params.bad_words == ["x"] and params.allowed_token_ids == [1, 2] and params.truncate_prompt_tokens == 7


def test_priority_needs_priority_scheduling_and_orders_the_queue(model_path, llm):
    from backend import LLM, SamplingParams

    with pytest.raises(ValueError, match="priority: needs the engine's scheduling_policy priority"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0])
    engine = LLM(model_path, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128,
                 max_num_seqs=1, scheduling_policy="priority").llm_engine
    params = SamplingParams(temperature=0, max_tokens=3)
    for request_id, rank in (("late", 5), ("urgent", -1), ("normal", 0)):
        engine.add_request(request_id, PROMPT, params, priority=rank)
    finished = []
    while engine.has_unfinished_requests():
        finished += [output.request_id for output in engine.step() if output.finished]
    assert finished == ["urgent", "normal", "late"]


def test_new_sampling_parameters_through_triton(triton, tokenizer):
    """bad_words, allowed_token_ids, truncate_prompt_tokens and priority in `sampling_parameters`
    (the HTTP generate endpoint's "parameters"); priority needs priority scheduling."""
    import urllib.error
    import urllib.request

    def generate(parameters: dict) -> tuple[int, dict]:
        body = json.dumps({"text_input": PROMPT, "exclude_input_in_output": True, "parameters": parameters}).encode()
        request = urllib.request.Request(f"http://{triton.http_url}/v2/models/vllm_model/generate", body)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    status, base = generate({"max_tokens": 8, "temperature": 0})
    assert status == 200
    words = sorted({word.strip(".,;:!?") for word in base["text_output"].split()} - {""})
    status, banned = generate({"max_tokens": 8, "temperature": 0, "bad_words": json.dumps(words), "priority": 0,
                               "truncate_prompt_tokens": 64})
    assert status == 200 and banned["text_output"] != base["text_output"], banned  # exact rule: offline tests
    allowed = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no")]
    status, only = generate({"max_tokens": 4, "temperature": 0, "allowed_token_ids": json.dumps(allowed)})
    assert status == 200 and only["text_output"].split() and set(only["text_output"].split()) <= {"yes", "no"}
    status, error = generate({"max_tokens": 4, "priority": 1})
    assert status == 400 and "priority" in error["error"] and "scheduling_policy" in error["error"]
    status, error = generate({"max_tokens": 4, "bad_words": '[""]'})
    assert status == 400 and "bad_words" in error["error"]


def test_chat_template_from_a_file_or_inline(tmp_path, model_path):
    from openai_frontend.prompts import PromptBuilder

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "template.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    for given in (template, str(tmp_path / "template.jinja")):
        text, ids = PromptBuilder(model_path, chat_template=given).render_chat(messages, True, False)
        assert text == "<<hi>>"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        PromptBuilder(model_path, chat_template=str(tmp_path / "absent.jinja"))


def test_serve_prompt_tokens_details_chat_template_and_openai_priority(tmp_path, model_path):
    """--enable-prompt-tokens-details: usage counts the prompt tokens the prefix cache served;
    --chat-template reaches the frontend; the OpenAI `priority` field reaches priority scheduling."""
    import httpx

    from tests.utils.serve import AUTH, Serve

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    serve = Serve(model_path, tmp_path / "serve", "--enable-prompt-tokens-details", "--chat-template", template,
                  "--scheduling-policy", "priority", "--max-num-seqs", "4", kv_cache_bytes=8 << 20, max_model_len=256)
    try:
        url, auth = f"{serve.url}/v1", AUTH
        prompt = "A long shared system prompt that spans a few KV blocks of sixteen tokens each, " * 2
        body = {"model": Path(model_path).name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        first = httpx.post(f"{url}/completions", json=body, headers=auth, timeout=120).json()
        second = httpx.post(f"{url}/completions", json={**body, "priority": -1}, headers=auth, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 16 <= cached < second["usage"]["prompt_tokens"] and cached % 16 == 0
        chat = httpx.post(f"{url}/chat/completions", headers=auth, timeout=120, json={
            "model": Path(model_path).name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
        # The template writes the message alone: the same tokens as the completion's prompt but BOS.
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] in (first["usage"]["prompt_tokens"],
                                                         first["usage"]["prompt_tokens"] - 1)
    finally:
        serve.stop()
