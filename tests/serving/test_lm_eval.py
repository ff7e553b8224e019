"""lm-evaluation-harness against `tritonllm serve` (issue 29's done-when): a loglikelihood task of
32 questions (tests/data/lm_eval, local JSONL) run with `--model local-completions` (echo + logprobs
through the OpenAI frontend) and with `--model hf` on the same weights, float32 both: the metrics
equal within 1e-3, and so does every choice's loglikelihood.

lm-eval is not in the test extras: `pip install 'lm-eval[api]'` pulls numpy 2 (pandas 3, pyarrow 24+,
datasets 5) over tritonllm's numpy < 2; it installs beside it with pins (numpy==1.26.4,
pandas<2.3, pyarrow<20, datasets<4). The test skips where `lm_eval` is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import ROOT
from tests.utils.serve import API_KEY

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'lm-eval[api]')")
pytest.importorskip("tenacity", reason="lm-eval's API models need its `api` extra (pip install 'lm-eval[api]')")

TASK = "tritonllm_loglik"
TOLERANCE = 1e-3


def run_lm_eval(model: str, model_args: str, output: Path, *options: str) -> tuple[dict, list[list[float]]]:
    """The task's metrics and each document's choice loglikelihoods, from the lm_eval CLI."""
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
               "--tasks", TASK, "--include_path", str(ROOT / "tests/data/lm_eval"), "--batch_size", "1",
               "--output_path", str(output), "--log_samples", *options]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"lm_eval --model {model} failed:\n{done.stderr[-4000:]}"
    [results_file] = output.rglob("results_*.json")
    metrics = json.loads(results_file.read_text())["results"][TASK]
    [samples_file] = output.rglob(f"samples_{TASK}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    loglikelihoods = [[float(resp[0]) for resp in sample["filtered_resps"]] for sample in samples]
    return metrics, loglikelihoods


@pytest.mark.slow
def test_local_completions_equals_hf(serve, model_name, model_path, tmp_path):
    served, served_lls = run_lm_eval(
        "local-completions",
        f"model={model_name},base_url={serve.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_path},tokenized_requests=True,num_concurrent=4,max_retries=1",
        tmp_path / "served")
    reference, reference_lls = run_lm_eval("hf", f"pretrained={model_path},dtype=float32", tmp_path / "hf",
                                           "--device", "cpu")
    assert len(served_lls) == len(reference_lls) == 32
    for name in ("acc,none", "acc_norm,none"):
        assert abs(served[name] - reference[name]) <= TOLERANCE, (name, served[name], reference[name])
    worst = max(abs(a - b) for doc, ref in zip(served_lls, reference_lls) for a, b in zip(doc, ref))
    assert worst <= TOLERANCE, f"a choice's loglikelihood differs by {worst}"
    assert reference["acc,none"] > 0.5, "the task should be easy for the model (a broken run scores chance)"
