"""The benchmark tooling runs and reports (figures themselves are never asserted)."""

from __future__ import annotations

import argparse
import json

from tools import bench
from tools.bench_workloads import make_workload, percentile


def test_workloads_are_deterministic_and_shaped(tokenizer):
    fixed = make_workload("fixed", tokenizer, 8, seed=1)
    assert fixed.prompts == make_workload("fixed", tokenizer, 8, seed=1).prompts
    assert all(112 <= len(p) <= 144 for p in fixed.prompts) and fixed.output_lens == [128] * 8
    shared = make_workload("shared-prefix", tokenizer, 4)
    assert len({tuple(p[:1000]) for p in shared.prompts}) == 1
    mixed = make_workload("mixed", tokenizer, 32)
    assert len(set(mixed.output_lens)) > 1 and max(map(len, mixed.prompts)) <= 1024
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


def test_offline_and_hf_modes_report_ratios_per_dtype(tmp_path, model_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--modes", "offline,hf-sequential,hf-batch", "--num-prompts", "3",
                              "--input-len", "16", "--output-len", "4", "--hf-sequential-prompts", "1",
                              "--model", model_path, "--dtype", "float32,bfloat16",
                              "--engine-args", '{"kv_cache_memory_bytes": 33554432}',
                              "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    assert bench.run(args) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == [f"{mode} {dtype}" for dtype in ("float32", "bfloat16")
                             for mode in ("offline", "hf-sequential", "hf-batch")]
    for dtype in ("float32", "bfloat16"):
        offline = results[f"offline {dtype}"]
        assert offline["output_tokens_per_s"] > 0 and offline["failed"] == 0 and offline["dtype"] == dtype
        assert results[f"hf-batch {dtype}"]["requests"] == 3
    report = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("hf-batch")}
    for dtype in ("float32", "bfloat16"):  # each ratio against the offline figure at its own dtype
        ratio = results[f"offline {dtype}"]["output_tokens_per_s"] / results[f"hf-batch {dtype}"]["output_tokens_per_s"]
        assert report[dtype].endswith(f"{1 / ratio:.2f}x")
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_runs_cover_each_dtype_and_each_vllm_binding():
    runs = bench.plan_runs(["offline", "vllm-offline"], ["bfloat16", "float32"], ["default", "all"])
    assert [(r.label, r.dtype, r.vllm_cores) for r in runs] == [
        ("offline bfloat16", "bfloat16", None),
        ("vllm-offline bfloat16 default-cores", "bfloat16", "default"),
        ("vllm-offline bfloat16 all-cores", "bfloat16", "all"),
        ("offline float32", "float32", None),
        ("vllm-offline float32 default-cores", "float32", "default"),
        ("vllm-offline float32 all-cores", "float32", "all")]
    # One dtype and one binding: the bare mode names, as single runs have always been labelled.
    assert [r.label for r in bench.plan_runs(["offline", "vllm-serve"], ["bfloat16"], ["all"])] == [
        "offline", "vllm-serve"]
