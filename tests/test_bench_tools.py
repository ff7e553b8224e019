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


def test_offline_and_hf_modes_report_ratios(tmp_path, model_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--modes", "offline,hf-sequential,hf-batch", "--num-prompts", "3",
                              "--input-len", "16", "--output-len", "4", "--hf-sequential-prompts", "1",
                              "--model", model_path, "--dtype", "float32",
                              "--engine-args", '{"kv_cache_memory_bytes": 33554432}',
                              "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    assert bench.run(args) == 0
    results = json.loads(out.read_text())["results"]
    assert results["offline"]["output_tokens_per_s"] > 0 and results["offline"]["failed"] == 0
    assert results["hf-batch"]["requests"] == 3
    assert "vs offline" in capsys.readouterr().out
    assert (tmp_path / "bench.png").stat().st_size > 0
