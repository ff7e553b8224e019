"""tools/bench_images.py's plumbing on its smallest configuration: the LLaVA it builds (a tiny tower here),
the offline mode's figures and encoder clock, the vLLM side's file protocol (a stand-in `vllm`) and the
served client's command. Figures themselves are never asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tools import bench_images


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, model_path):
    """The tool's LLaVA with a 2-layer tower on 32 x 32 images in 8 x 8 patches (16 image tokens)."""
    return bench_images.prepare_llava(tmp_path_factory.mktemp("bench_images") / "llava", image_size=32,
                                      patch_size=8, vision_layers=2, vision_width=64)


def test_the_model_is_a_llava_in_the_released_layout_with_its_processor(tiny_llava):
    from safetensors import safe_open
    from transformers import AutoProcessor

    config = json.loads((Path(tiny_llava) / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["text_config"]["num_hidden_layers"] == 30  # SmolLM2-135M's decoder
    with safe_open(str(Path(tiny_llava) / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert any(n.startswith("vision_tower.vision_model.encoder.layers.1.") for n in names)  # what vLLM reads
    assert not any(n.startswith("vision_tower.encoder.") for n in names)
    processor = AutoProcessor.from_pretrained(tiny_llava)
    workload = bench_images.make_workload((48, 40), 2, seed=0)
    ids = processor(text=workload["prompts"][0], images=workload["images"][0])["input_ids"][0]
    assert ids.count(config["image_token_index"]) == 16
    assert workload["images"][0].size == (48, 40) and workload["prompts"] == bench_images.make_workload(
        (48, 40), 2, seed=0)["prompts"]
    assert bench_images.prepare_llava(Path(tiny_llava)) == tiny_llava  # built once


def test_offline_mode_reports_each_image_size_with_its_encoder_time(tiny_llava, tmp_path, capsys):
    out = tmp_path / "images.json"
    assert bench_images.main(["--model", tiny_llava, "--modes", "offline", "--image-sizes", "32x32,48x40",
                              "--num-prompts", "2", "--output-len", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]["offline"]
    assert list(results) == ["32x32", "48x40"]
    for figures in results.values():
        assert figures["requests"] == 2 and figures["failed"] == 0
        assert figures["tokens"] and all(len(t) == 3 for t in figures["tokens"])
        assert figures["encoded_images"] == 2  # the workload's images, not the warm-up's
        assert 0 < figures["encoder_ms_per_image"] and 0 < figures["encoder_share"] < 1
        assert 0 < figures["ttft_p50_ms"] <= figures["e2e_p99_ms"]
    assert "offline       48x40" in capsys.readouterr().out


def test_vllm_side_runs_by_path_and_its_tokens_are_compared(tmp_path, monkeypatch):
    """tools/bench/vllm_scripts/vllm_images.py through its file protocol, with a stand-in `vllm` that
    gives every request token 7 a step and says it encoded each image."""
    fake = tmp_path / "vllm"
    (fake / "multimodal").mkdir(parents=True)
    (fake / "multimodal" / "__init__.py").write_text("")
    (fake / "multimodal" / "utils.py").write_text(
        "def fetch_image(url):\n    assert url.startswith('file://') and open(url[7:], 'rb').read(4) == b'\\x89PNG'\n"
        "    return url\n")
    (fake / "sampling_params.py").write_text("class RequestOutputKind:\n    DELTA = 1\n")
    (fake / "__init__.py").write_text(
        "from types import SimpleNamespace as N\n"
        "class SamplingParams:\n"
        "    def __init__(self, max_tokens, **_): self.max_tokens = max_tokens\n"
        "class Engine:\n"
        "    def __init__(self, model): self.left, self.model = {}, model\n"
        "    def add_request(self, request_id, prompt, params):\n"
        "        self.left[request_id] = params.max_tokens\n"
        "        self.model.embed_multimodal(image=prompt['multi_modal_data']['image'])\n"
        "    def has_unfinished_requests(self): return bool(self.left)\n"
        "    def step(self):\n"
        "        outputs = []\n"
        "        for request_id in list(self.left):\n"
        "            self.left[request_id] -= 1\n"
        "            finished = self.left[request_id] == 0\n"
        "            if finished: del self.left[request_id]\n"
        "            outputs.append(N(request_id=request_id, finished=finished, prompt_token_ids=[1, 2],\n"
        "                             outputs=[N(token_ids=[7])]))\n"
        "        return outputs\n"
        "class Model:\n"
        "    def embed_multimodal(self, **kwargs): return [kwargs]\n"
        "class LLM:\n"
        "    def __init__(self, model, dtype, seed, limit_mm_per_prompt):\n"
        "        self.model = Model(); self.llm_engine = Engine(self.model)\n"
        "    def apply_model(self, func): return [func(self.model)]\n"
        "    def generate(self, prompts, params, use_tqdm):\n"
        "        for p in prompts: self.model.embed_multimodal(image=p['multi_modal_data']['image'])\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    workloads = [bench_images.make_workload((24, 16), 3, seed=0)]
    vllm = bench_images.run_vllm_offline(sys.executable, str(tmp_path), "float32", workloads, 4, env=None)
    figures = vllm["24x16"]
    assert figures["tokens"] == [[7] * 4] * 3 and figures["requests"] == 3
    assert figures["encoded_images"] == 3  # the warm-up's two not counted
    assert bench_images.agreement(figures["tokens"], [[7] * 4, [7, 7, 8, 7], [8] * 4]) == {
        "equal": 1, "of": 3, "mean_common_prefix": (4 + 2 + 0) / 3}


def test_served_modes_are_driven_by_vllm_bench_with_images_of_each_size(tmp_path):
    """The client's command: chat completions with one image of the workload's size (height, width in
    vLLM's bucket key) per request, every request at once, its own cache salt; its figures read back."""
    seen = tmp_path / "seen.json"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, sys\nargs = sys.argv[1:]\nopen({str(seen)!r}, 'w').write(json.dumps(args))\n"
        "folder = args[args.index('--result-dir') + 1]\n"
        "json.dump({'completed': 5, 'duration': 2.0, 'request_throughput': 2.5, 'output_throughput': 40.0,\n"
        "           'total_input_tokens': 100, 'p50_ttft_ms': 300.0}, open(folder + '/result.json', 'w'))\n")
    stand_in.chmod(0o755)
    workload = bench_images.make_workload((1024, 768), 1, seed=0)
    figures = bench_images.run_vllm_bench_images(str(stand_in), {"openai": "http://x", "model": "m"}, "/models/m",
                                                 workload, 5, 64, 0, env=None)
    args = json.loads(seen.read_text())
    option = {key: value for key, value in zip(args, args[1:]) if key.startswith("--")}
    assert option["--dataset-name"] == "random-mm" and option["--backend"] == "openai-chat"
    assert option["--random-mm-bucket-config"] == "{(768, 1024, 1): 1.0}"
    assert option["--max-concurrency"] == option["--num-prompts"] == "5" and "--ignore-eos" in args
    assert json.loads(option["--extra-body"])["cache_salt"]
    assert figures["ttft_p50_ms"] == 300.0 and figures["output_tokens_per_s"] == 40.0
