"""Multi-LoRA: one batch mixing the base model and two peft adapters (different ranks and target
modules, random non-zero A and B) is token-exact against transformers + peft with each adapter
(greedy float32), also under preemption with fewer slots than adapters and with the prefix cache
on; adapters never share KV; bad adapters are clear errors; the Triton kernel matches its torch
reference (under TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from backend import LLM, LoRARequest, SamplingParams
from backend.errors import EngineError
from backend.kernels.lora import add_lora  # at collection, before anything imports Triton otherwise
from backend.kernels.reference import add_lora_reference
from backend.lora.layers import LoRABatch
from tests.utils.models import BLOCK_BYTES_FP32
from tests.utils.prompts import PROMPTS

peft = pytest.importorskip("peft")

MAX_TOKENS = 16
# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {"sql": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
            "poet": (4, 8, ["gate_proj", "up_proj", "down_proj", "v_proj"], True)}


def random_adapter(model_path: str, folder, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      lora_dropout=0.0, use_rslora=rslora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peft starts B at zero (a no-op adapter): make both matter
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i + 1, random_adapter(model_path, root / name, *spec, seed=i + 1))
            for i, (name, spec) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def peft_greedy(model_path, adapters):
    """Greedy continuation by transformers + peft with the named adapter (None: the base model)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]].lora_path, adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name].lora_path, adapter_name=name)
    model.eval()

    @functools.lru_cache(maxsize=None)
    def generate(prompt_ids: tuple[int, ...], adapter: str | None) -> list[int]:
        kwargs = dict(input_ids=torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                      eos_token_id=None, pad_token_id=2)
        with torch.inference_mode():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                model.set_adapter(adapter)
                out = model.generate(**kwargs)
        return out[0, len(prompt_ids):].tolist()
    return generate


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def mixed_batch(tokenizer, adapters, num_prompts: int):
    """Every prompt with the base model and with each adapter, interleaved."""
    prompts, loras = [], []
    for text in PROMPTS[:num_prompts]:
        for lora in [None, *adapters.values()]:
            prompts.append(tokenizer(text).input_ids)
            loras.append(lora)
    return prompts, loras


def assert_matches_peft(outputs, prompts, loras, peft_greedy):
    mismatches = []
    for output, ids, lora in zip(outputs, prompts, loras):
        expected = peft_greedy(tuple(ids), None if lora is None else lora.lora_name)
        if output.outputs[0].token_ids != expected:
            mismatches.append((lora and lora.lora_name, output.outputs[0].token_ids, expected))
    assert not mismatches, f"{len(mismatches)} of {len(outputs)} differ from peft: {mismatches[:2]}"


def test_mixed_batch_matches_peft(model_path, tokenizer, adapters, peft_greedy):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    prompts, loras = mixed_batch(tokenizer, adapters, 4)
    outputs = llm.generate(prompts, greedy(), lora_request=loras)
    assert_matches_peft(outputs, prompts, loras, peft_greedy)
    # The adapters change the output: the deltas matter (this test could not pass with them dropped).
    by_adapter = [[o.outputs[0].token_ids for o, lo in zip(outputs, loras) if lo == lora]
                  for lora in [None, *adapters.values()]]
    assert by_adapter[0] != by_adapter[1] and by_adapter[0] != by_adapter[2] and by_adapter[1] != by_adapter[2]
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks


def test_preemption_and_fewer_slots_than_adapters(model_path, tokenizer, adapters, peft_greedy):
    """One slot for two adapters (the scheduler runs them in turns, the slot reloads) and a KV cache
    small enough to preempt."""
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=10 * BLOCK_BYTES_FP32, enable_lora=True,
              max_loras=1, max_lora_rank=8, max_num_batched_tokens=256)
    prompts, loras = mixed_batch(tokenizer, adapters, 4)  # the requests of the test above: HF's answers are cached
    outputs = llm.generate(prompts, greedy(), lora_request=loras)
    preemptions = {m.name: m.value for m in llm.get_metrics()}["vllm:num_preemptions"]
    assert preemptions > 0, "the KV budget was meant to force preemptions"
    assert_matches_peft(outputs, prompts, loras, peft_greedy)
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks


def test_prefix_cache_keys_blocks_by_adapter(model_path, tokenizer, adapters, peft_greedy):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=64 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8, enable_prefix_caching=True)
    ids = tokenizer(PROMPTS[8]).input_ids  # the long prompt: many full blocks
    sql, poet = adapters["sql"], adapters["poet"]
    runs = [(sql, 0), (poet, 0), (None, 0), (sql, 1), (poet, 1), (None, 1)]  # (adapter, seen before)
    for lora, seen in runs:
        [output] = llm.generate([ids], greedy(), lora_request=lora)
        if seen:
            assert output.num_cached_tokens >= len(ids) - 16, "the same adapter and prompt should hit"
        else:
            assert output.num_cached_tokens == 0, f"{lora and lora.lora_name} reused another adapter's KV"
        assert output.outputs[0].token_ids == peft_greedy(tuple(ids), lora and lora.lora_name)


def test_bad_adapters_are_clear_errors(model_path, adapters, tmp_path):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=16 << 20, enable_lora=True, max_loras=1,
              max_lora_rank=4)

    def error(lora) -> EngineError:
        with pytest.raises(EngineError) as info:
            llm.generate("Hello", greedy(), lora_request=lora)
        return info.value

    assert "is not a folder" in str(error(LoRARequest("gone", 7, str(tmp_path / "missing"))))
    assert "max_lora_rank" in str(error(adapters["sql"]))  # rank 8 > 4
    # Wrong target shapes: a rank-4 adapter whose A is cut short of the model's hidden size.
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "misshapen"
    folder.mkdir()
    source = adapters["poet"].lora_path
    (folder / "adapter_config.json").write_text(open(f"{source}/adapter_config.json", encoding="utf-8").read())
    tensors = {name: (t[:, :100].contiguous() if "lora_A" in name and "down_proj" not in name else t)
               for name, t in load_file(f"{source}/adapter_model.safetensors").items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    message = str(error(LoRARequest("misshapen", 8, str(folder))))
    assert "do not fit the model's projection" in message and message.startswith("lora_path:")
    # An adapter of a module LoRA cannot serve here (DoRA, too).
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert "use_dora" in str(error(LoRARequest("dora", 9, str(folder))))
    assert llm.llm_engine.kv_cache.num_free_blocks == llm.llm_engine.kv_cache.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_requests_info_names_running_and_waiting_adapters(model_path, adapters):
    llm = LLM(model_path, dtype="float32", kv_cache_memory_bytes=16 << 20, enable_lora=True, max_loras=1,
              max_lora_rank=8)
    engine = llm.llm_engine

    def labels() -> dict:
        return next(m.labels for m in llm.get_metrics() if m.name == "vllm:lora_requests_info")

    assert labels() == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "1"}
    engine.add_request("a", "Hello", greedy(), lora_request=adapters["sql"])
    engine.add_request("b", "Hello", greedy(), lora_request=adapters["poet"])
    assert labels()["waiting_lora_adapters"] == "poet,sql"
    engine.step()  # one slot: sql runs, poet waits for it
    assert labels() == {"running_lora_adapters": "sql", "waiting_lora_adapters": "poet", "max_lora": "1"}
    engine.abort_request("a")
    engine.abort_request("b")
    assert labels()["running_lora_adapters"] == "" and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_lora_needs_enable_lora(llm, adapters):
    with pytest.raises(EngineError, match="enable_lora"):
        llm.generate("Hello", greedy(), lora_request=adapters["sql"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype):
    torch.manual_seed(0)
    num_slots, rank, num_in, num_out = 3, 24, 96, 80  # rank: three slices of 8, padded to 32 inside
    lora_a = (torch.randn(num_slots, rank, num_in) * 0.1).to(dtype)
    lora_b = (torch.randn(num_slots, num_out, rank) * 0.1).to(dtype)
    # Runs of 1 to 21 tokens; slot -1 (the base model) is in no segment and must stay untouched.
    rows = [(1, 2), (1, 2), (1, 0), (1, -1), (1, 1), (21, 0), (3, -1), (5, 2), (17, 1)]
    x = torch.randn(sum(n for n, _ in rows), num_in).to(dtype)
    base = torch.randn(x.shape[0], num_out).to(dtype)
    batch = LoRABatch.build(rows, torch.device("cpu"))
    assert [s[2] for s in batch.segments] == [2, 0, 1, 0, 2, 1]  # (1, 2) twice: one run
    expected, out = base.clone(), base.clone()
    add_lora_reference(expected, x, lora_a, lora_b, batch)
    add_lora(out, x, lora_a, lora_b, batch.starts, batch.lengths, batch.slots, batch.max_length)
    assert torch.equal(out[3], base[3]) and torch.equal(out[26:29], base[26:29])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert not torch.allclose(out.float(), base.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "gemms"])
def test_cpu_path_matches_reference(dtype, path, monkeypatch):
    """A LoRALinear on the CPU, its small steps on the C++ kernel (pair-packed weights in bfloat16
    where the CPU has AVX512-BF16) and larger ones as two GEMMs per segment, against the per-segment
    reference: uneven segments, slots out of order, tokens of no adapter between them untouched,
    adapters of different ranks and one that leaves a slice alone (rank columns padded inside)."""
    from torch import nn

    from backend.ops import cpu_ops

    from backend import ops
    from backend.lora.layers import LoRAContext, LoRALinear

    if path == "gemms":
        monkeypatch.setattr(ops, "LORA_KERNEL_TOKENS", 0)
    elif not cpu_ops.available():
        pytest.skip("the C++ kernels are not built here")
    torch.manual_seed(1)
    num_in, sizes, max_rank = 64, [48, 16, 16], 8
    layer = LoRALinear(nn.Linear(num_in, sum(sizes), bias=False).to(dtype), sizes, 4, max_rank, LoRAContext())
    for slot, rank in {0: 8, 1: 4, 2: 8, 3: 2}.items():
        for index, size in enumerate(sizes):
            if (slot, index) != (1, 1):
                layer.set_slice(slot, index, torch.randn(rank, num_in) * 0.1, torch.randn(size, rank) * 0.1, 0.5)
    assert layer.kernel_weights is not None and layer.pairs == cpu_ops.lora_pairs(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    cases = (([(2, 1), (3, 3), (1, -1), (4, 1), (2, -1), (5, 2)], [5, 10, 11]),  # uneven, out of order, gaps
             ([(1, 0), (3, -1), (4, 1), (4, 2), (4, 3)], [1, 2, 3]),
             ([(7, 1), (7, 3), (7, 2)], []))  # rows of 6 and 1 in the kernel's tiles
    for rows, untouched in cases:
        x = torch.randn(sum(n for n, _ in rows), num_in).to(dtype)
        base = layer.base(x)
        layer.context.batch = batch = LoRABatch.build(rows, torch.device("cpu"))
        expected = base.clone()
        add_lora_reference(expected, x, layer.lora_a, layer.lora_b, batch)
        out = layer(x)
        assert torch.equal(out[untouched], base[untouched])
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
        assert not torch.allclose(out.float(), base.float())


# -- served: `tritonllm serve --enable-lora --lora-modules ...`, tritonclient and the OpenAI SDK --------
API_KEY = "lora-key"
SERVED_PROMPTS = [PROMPTS[0], PROMPTS[2]]


@pytest.fixture(scope="module")
def serve(tmp_path_factory, model_path, adapters):
    """Triton (llm + embeddings) and the OpenAI frontend, serving both adapters by name, with
    vLLM's runtime load/unload endpoints opted into (behind the API key)."""
    import os

    from tests.utils.serve import Serve

    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--lora-modules", *(f"{name}={lora.lora_path}" for name, lora in adapters.items())]
    with Serve(model_path, tmp_path_factory.mktemp("serve_lora"), *flags, kv_cache_bytes=64 << 20,
               max_model_len=512, api_key=API_KEY, env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
               start_timeout=300, stop_timeout=60) as served:
        yield {"openai": served.url, "grpc": served.grpc_url, "metrics": served.metrics_url}


def triton_generate(url: str, prompt: str, params: dict) -> str:
    """One streamed gRPC request with the vLLM backend's tensors; the text, or the error raised."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array, datatype in (("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                                  ("sampling_parameters", np.array([json.dumps(params).encode()], dtype=np.object_),
                                   "BYTES"),
                                  ("stream", np.array([False]), "BOOL"),
                                  ("exclude_input_in_output", np.array([True]), "BOOL")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
        text = ""
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                raise error
            array = result.as_numpy("text_output")
            text += "".join(t.decode() for t in array) if array is not None else ""
            if result.get_response().parameters["triton_final_response"].bool_param:
                return text
    finally:
        client.stop_stream()
        client.close()


def expected_text(tokenizer, peft_greedy, prompt: str, adapter: str | None) -> str:
    return tokenizer.decode(peft_greedy(tuple(tokenizer(prompt).input_ids), adapter), skip_special_tokens=True)


def test_served_tritonclient_picks_adapters_by_lora_name(serve, tokenizer, peft_greedy):
    from tritonclient.utils import InferenceServerException

    for prompt in SERVED_PROMPTS:
        for adapter in (None, "sql", "poet"):
            params = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            if adapter:
                params["lora_name"] = adapter
            assert triton_generate(serve["grpc"], prompt, params) == \
                expected_text(tokenizer, peft_greedy, prompt, adapter), (prompt, adapter)
    with pytest.raises(InferenceServerException, match="lora_name: unknown LoRA adapter"):
        triton_generate(serve["grpc"], "Hello", {"max_tokens": 4, "lora_name": "nope"})
    with pytest.raises(InferenceServerException, match="lora_path"):  # a Triton client never names a folder
        triton_generate(serve["grpc"], "Hello", {"max_tokens": 4, "lora_name": "x", "lora_path": "/etc"})


def test_served_openai_sdk_serves_adapters_as_models(serve, tokenizer, peft_greedy, model_path, adapters):
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{serve['openai']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    base = model_path.rstrip("/").split("/")[-1]
    cards = {card.id: card for card in client.models.list().data}
    assert {base, "sql", "poet"} <= set(cards)
    assert cards["sql"].parent == base and cards["poet"].parent == base and cards["sql"].root == adapters["sql"].lora_path
    for prompt in SERVED_PROMPTS:
        for model, adapter in ((base, None), ("sql", "sql"), ("poet", "poet")):
            completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert completion.model == model
            assert completion.choices[0].text == expected_text(tokenizer, peft_greedy, prompt, adapter), (prompt, model)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=4)

    # Runtime updating: behind the API key, a folder that is no adapter is a 400, and a loaded
    # adapter serves at once (here the sql adapter's folder under a new name).
    url = serve["openai"]
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}).status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=auth,
                        json={"lora_name": "sql2", "lora_path": adapters["sql"].lora_path})
    assert loaded.status_code == 200, loaded.text
    completion = client.completions.create(model="sql2", prompt=SERVED_PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected_text(tokenizer, peft_greedy, SERVED_PROMPTS[0], "sql")
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql2"}, headers=auth).status_code == 200
    assert "sql2" not in {card.id for card in client.models.list().data}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql2"}, headers=auth).status_code == 404


def test_served_metrics_name_the_adapters(serve):
    """vllm:lora_requests_info: one series per set of labels, valued by when it was set; the latest
    is the current state (vLLM's form)."""
    import time
    import urllib.request

    triton_generate(serve["grpc"], "Hello", {"max_tokens": 2, "lora_name": "poet"})
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(serve["metrics"], timeout=10) as response:
            lines = [line for line in response.read().decode().splitlines()
                     if line.startswith("vllm:lora_requests_info{")]
        latest = max(lines, key=lambda line: float(line.rsplit(" ", 1)[1]), default="")
        if 'running_lora_adapters=""' in latest or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert 'max_lora="2"' in latest and 'running_lora_adapters=""' in latest \
        and 'waiting_lora_adapters=""' in latest, lines
    assert any('running_lora_adapters="poet"' in line for line in lines), lines
