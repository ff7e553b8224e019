"""The benchmark tooling runs and reports (figures themselves are never asserted)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from tools.bench import cli as bench
from tools.bench import cpu_usage, servers, triton_vllm
from tools.bench.external_clients import aiperf_command, figures_from_export
from tools.bench.report import RequestRecord, percentile, summarize
from tools.bench.runners import linear_flop, run_server_mode
from tools.bench.workloads import make_workload


def test_workloads_are_deterministic_and_shaped(tokenizer):
    fixed = make_workload("fixed", tokenizer, 8, seed=1)
    assert fixed.prompts == make_workload("fixed", tokenizer, 8, seed=1).prompts
    assert all(112 <= len(p) <= 144 for p in fixed.prompts) and fixed.output_lens == [128] * 8
    shared = make_workload("shared-prefix", tokenizer, 4)
    assert len({tuple(p[:1000]) for p in shared.prompts}) == 1
    mixed = make_workload("mixed", tokenizer, 32)
    assert len(set(mixed.output_lens)) > 1 and max(map(len, mixed.prompts)) <= 1024
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None
    long = make_workload("long", tokenizer, 3, input_len=2000, output_len=16)
    assert [len(p) for p in long.prompts] == [2000] * 3 and long.output_lens == [16] * 3
    assert len({tuple(p[:64]) for p in long.prompts}) == 3  # distinct prompts: nothing for the prefix cache


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
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert list(results) == [f"{mode} {dtype}" for dtype in ("float32", "bfloat16")
                             for mode in ("offline", "hf-sequential", "hf-batch")]
    for dtype in ("float32", "bfloat16"):
        offline = results[f"offline {dtype}"]
        assert offline["output_tokens_per_s"] > 0 and offline["failed"] == 0 and offline["dtype"] == dtype
        assert results[f"hf-batch {dtype}"]["requests"] == 3
        assert offline["linear_gflops"] > 0
    assert results["offline float32"]["fma_peak_gflops"] > 0 and results["offline bfloat16"]["fma_peak_gflops"] is None
    report = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("hf-batch")}
    for dtype in ("float32", "bfloat16"):  # each ratio against the offline figure at its own dtype
        ratio = results[f"offline {dtype}"]["output_tokens_per_s"] / results[f"hf-batch {dtype}"]["output_tokens_per_s"]
        assert report[dtype].split()[-2:] == [f"{1 / ratio:.2f}x", "-"]  # the ratio, then goodput (none offline)
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


# A real aiperf 0.13.0 export (profile_export_aiperf.json of 64 requests, 128 tokens in and out, at
# concurrency 64, against `vllm serve` on the 2-core machine), trimmed to the entries the bench reads.
AIPERF_EXPORT = {
    "schema_version": "1.4", "aiperf_version": "0.13.0",
    "request_throughput": {"unit": "requests/sec", "avg": 2.058},
    "request_count": {"unit": "requests", "avg": 64.0},
    "time_to_first_token": {"unit": "ms", "avg": 6252.882, "p50": 6273.552, "p90": 10007.224, "p99": 10009.685,
                            "count": 64},
    "inter_token_latency": {"unit": "ms", "avg": 193.892, "p50": 193.483, "p90": 221.202, "p99": 227.747,
                            "count": 64},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 263.398},
    "inter_chunk_latency": {"unit": "ms", "avg": 199.437, "p50": 167.201, "p90": 186.177, "p99": 2415.374,
                            "count": 7902},
    "request_latency": {"unit": "ms", "avg": 30877.125, "p50": 30906.123, "p90": 31045.502, "p99": 31062.663,
                        "count": 64},
    "benchmark_duration": {"unit": "sec", "avg": 31.094},
    "input_token_throughput": {"unit": "tokens/sec", "avg": 263.398},
}


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_aiperf_command_asks_for_the_vllm_bench_workload():
    command = aiperf_command(".venv-aiperf/bin/aiperf", "http://127.0.0.1:9000", "llm", "/models/smol",
                             input_len=128, output_len=64, num_prompts=32, concurrency=8,
                             request_rate=float("inf"), seed=3, artifact_dir="/tmp/out")
    assert command[:2] == [".venv-aiperf/bin/aiperf", "profile"]
    flags = {}
    for flag, value in zip(command, command[1:] + [None]):
        if flag.startswith("--"):
            flags.setdefault(flag, []).append(None if value is None or value.startswith("--") else value)
    assert {flag: values[0] for flag, values in flags.items()} == {
        "--model": "llm", "--tokenizer": "/models/smol", "--url": "http://127.0.0.1:9000",
        "--extra-inputs": "ignore_eos:true",
        "--endpoint-type": "completions", "--streaming": None, "--isl": "128", "--isl-stddev": "0",
        "--osl": "64", "--osl-stddev": "0", "--prompt-corpus": "random", "--random-seed": "3",
        "--use-legacy-max-tokens": None, "--use-server-token-count": None, "--request-count": "32",
        "--concurrency": "8", "--ui-type": "none", "--no-server-metrics": None, "--no-gpu-telemetry": None,
        "--no-auto-plot": None, "--export-level": "summary", "--artifact-dir": "/tmp/out"}
    assert all(len(values) == 1 for values in flags.values())
    paced = aiperf_command("aiperf", "u", "m", "t", input_len=1, output_len=1, num_prompts=1, concurrency=1,
                           request_rate=2.5, seed=0, artifact_dir="d")
    assert paced[paced.index("--request-rate") + 1] == "2.5"


def test_aiperf_export_becomes_the_bench_figures():
    figures = figures_from_export(AIPERF_EXPORT)
    assert figures == {
        "output_tokens_per_s": 263.398, "request_throughput": 2.058, "input_tokens_per_s": 263.398,
        "seconds": 31.094, "requests": 64.0, "failed": 0, "client": "aiperf 0.13.0",
        "ttft_p50_ms": 6273.552, "ttft_p90_ms": 10007.224, "ttft_p99_ms": 10009.685,
        # aiperf's per-request inter-token latency is our TPOT; its inter-chunk latency our ITL.
        "tpot_p50_ms": 193.483, "tpot_p90_ms": 221.202, "tpot_p99_ms": 227.747,
        "itl_p50_ms": 167.201, "itl_p90_ms": 186.177, "itl_p99_ms": 2415.374,
        "e2e_p50_ms": 30906.123, "e2e_p90_ms": 31045.502, "e2e_p99_ms": 31062.663}
    failing = {**AIPERF_EXPORT, "error_request_count": {"unit": "requests", "avg": 3.0}}
    assert figures_from_export(failing)["failed"] == 3.0 and figures_from_export(failing)["requests"] == 67.0


def test_aiperf_gets_the_goodput_objectives_in_its_names():
    command = aiperf_command("aiperf", "u", "m", "t", input_len=1, output_len=1, num_prompts=1, concurrency=1,
                             request_rate=2.0, seed=0, artifact_dir="d",
                             goodput=[("ttft", 2000.0), ("tpot", 150.0), ("e2el", 30000.0)])
    # one argument, as aiperf takes it; its inter_token_latency is per request, as vLLM's tpot
    assert command[command.index("--goodput") + 1] == (
        "time_to_first_token:2000 inter_token_latency:150 request_latency:30000")
    assert "--goodput" not in aiperf_command("aiperf", "u", "m", "t", input_len=1, output_len=1, num_prompts=1,
                                             concurrency=1, request_rate=2.0, seed=0, artifact_dir="d")
    assert "goodput" not in figures_from_export(AIPERF_EXPORT)  # not asked for: no column
    export = {**AIPERF_EXPORT, "goodput": {"unit": "requests/sec", "avg": 1.75}}
    assert figures_from_export(export)["goodput"] == 1.75


def test_client_aiperf_runs_the_given_executable_per_concurrency(tmp_path, monkeypatch):
    # A stand-in executable: it records what it was run with and writes the real export above
    # where aiperf would, so this checks the bench's plumbing without aiperf installed.
    seen = tmp_path / "seen.jsonl"
    stand_in = tmp_path / "aiperf"
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(seen)!r}, 'a').write(json.dumps([sys.argv, 'HF_HUB_OFFLINE' in os.environ]) + '\\n')\n"
        "out = sys.argv[sys.argv.index('--artifact-dir') + 1]\n"
        f"open(os.path.join(out, 'profile_export_aiperf.json'), 'w').write({json.dumps(AIPERF_EXPORT)!r})\n")
    stand_in.chmod(0o755)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # aiperf 0.13 cannot load a local tokenizer under it
    args = bench_args("--client", "aiperf", "--aiperf", str(stand_in), "--model", str(tmp_path),
                      "--num-prompts", "16")
    args.concurrency = [4, 16]
    results = run_server_mode("openai", {"openai": "http://127.0.0.1:9", "model": "llm"}, args, None)
    assert [(r["concurrency"], r["client"], r["output_tokens_per_s"]) for r in results] == [
        (4, "aiperf 0.13.0", 263.398), (16, "aiperf 0.13.0", 263.398)]
    runs = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [argv[argv.index("--concurrency") + 1] for argv, _ in runs] == ["4", "16"]
    assert all(argv[argv.index("--tokenizer") + 1] == str(tmp_path) for argv, _ in runs)
    assert not any(offline for _, offline in runs)
    salts = [[v for f, v in zip(argv, argv[1:]) if f == "--extra-inputs" and v.startswith("cache_salt:")]
             for argv, _ in runs]
    assert [len(s) for s in salts] == [1, 1] and salts[0] != salts[1]  # each run its own cold prefix cache


def vllm_bench_stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the vLLM venv's Python: it records `vllm bench serve`'s arguments (a JSON line
    per call in the second path) and writes a result file where that command would."""
    seen = tmp_path / "seen.jsonl"
    stand_in = tmp_path / "python"
    result = {"output_throughput": 400.0, "request_throughput": 3.1, "total_input_tokens": 8192, "duration": 20.0}
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(seen)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
        "out = sys.argv[sys.argv.index('--result-dir') + 1]\n"
        f"open(os.path.join(out, 'result.json'), 'w').write({json.dumps(result)!r})\n")
    stand_in.chmod(0o755)
    return stand_in, seen


def test_client_vllm_bench_sends_each_run_its_own_cache_salt(tmp_path):
    stand_in, seen = vllm_bench_stand_in(tmp_path)
    args = bench_args("--client", "vllm-bench", "--vllm-python", str(stand_in), "--model", str(tmp_path))
    args.concurrency = [8, 64]
    results = run_server_mode("openai", {"openai": "http://127.0.0.1:9", "model": "llm"}, args, None)
    assert [(r["concurrency"], r["output_tokens_per_s"]) for r in results] == [(8, 400.0), (64, 400.0)]
    bodies = [json.loads(argv[argv.index("--extra-body") + 1]) for argv in map(json.loads, seen.read_text().splitlines())]
    assert [set(body) for body in bodies] == [{"cache_salt"}] * 2 and bodies[0] != bodies[1]


def test_client_aiperf_needs_its_executable():
    with pytest.raises(SystemExit, match="--aiperf PATH"):
        bench.run(bench_args("--modes", "openai", "--client", "aiperf"))


def test_stream_interval_reaches_both_servers(tmp_path, monkeypatch):
    commands = []

    def popen(command, **_):
        commands.append(command)
        raise RuntimeError("not started")  # the command line is all this test needs

    monkeypatch.setattr(servers.subprocess, "Popen", popen)
    args = bench_args("--stream-interval", "4", "--model", str(tmp_path), "--vllm-python", sys.executable)
    for start in (servers.start_tritonllm, servers.start_vllm_serve):
        with pytest.raises(RuntimeError, match="not started"):
            start(args)
    assert [c[c.index("--stream-interval") + 1] for c in commands] == ["4", "4"]
    with pytest.raises(SystemExit, match="--stream-interval"):
        bench.run(bench_args("--stream-interval", "0"))


def test_vllm_offline_script_runs_by_path_in_another_python(tmp_path, monkeypatch):
    # The vLLM venv has no tritonllm: its scripts import only the standard library and vllm. A stand-in
    # `vllm` on PYTHONPATH answers LLM.generate, so this runs the real script through its file protocol.
    import ast

    from tools.bench.runners import VLLM_OFFLINE, run_vllm_offline
    from tools.bench.workloads import Workload

    for script in VLLM_OFFLINE.parent.glob("*.py"):
        nodes = list(ast.walk(ast.parse(script.read_text())))
        imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
        assert imported <= {"json", "sys", "time", "importlib", "vllm"}, (script.name, imported)
    fake = tmp_path / "vllm"
    fake.mkdir()
    # A stand-in engine that gives every unfinished request one token a step, as deltas.
    (fake / "sampling_params.py").write_text("class RequestOutputKind:\n    DELTA = 1\n")
    (fake / "__init__.py").write_text(
        "from types import SimpleNamespace as N\n"
        "class SamplingParams:\n"
        "    def __init__(self, max_tokens, **_): self.max_tokens = max_tokens\n"
        "class Engine:\n"
        "    def __init__(self): self.left = {}\n"
        "    def add_request(self, request_id, prompt, params): self.left[request_id] = params.max_tokens\n"
        "    def has_unfinished_requests(self): return bool(self.left)\n"
        "    def step(self):\n"
        "        outputs = []\n"
        "        for request_id in list(self.left):\n"
        "            self.left[request_id] -= 1\n"
        "            finished = self.left[request_id] == 0\n"
        "            if finished: del self.left[request_id]\n"
        "            outputs.append(N(request_id=request_id, finished=finished, outputs=[N(token_ids=[7])]))\n"
        "        return outputs\n"
        "class LLM:\n"
        "    def __init__(self, model, dtype, seed): assert dtype == 'float32'; self.llm_engine = Engine()\n"
        "    def generate(self, prompts, params):\n"
        "        if isinstance(params, list) and len(params) != len(prompts):  # vLLM refuses it too\n"
        "            raise ValueError(f'The lengths of prompts ({len(prompts)}) and params ({len(params)})')\n"
        "        params = params if isinstance(params, list) else [params] * len(prompts)\n"
        "        return [N(outputs=[N(token_ids=[7] * p.max_tokens)]) for p in params]\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = bench_args("--vllm-python", sys.executable, "--model", str(tmp_path), "--dtype", "float32")
    figures = run_vllm_offline(args, Workload("w", [[1, 2, 3], [4, 5]], [3, 5]))
    assert figures["output_tokens_per_s"] * figures["seconds"] == pytest.approx(8)
    assert figures["request_throughput"] * figures["seconds"] == pytest.approx(2)
    assert 0 < figures["ttft_p50_ms"] <= figures["e2e_p99_ms"]  # each request's first token, as ours are timed
    one = run_vllm_offline(args, Workload("w", [[1, 2, 3]], [4]))  # --num-prompts 1: one warm-up prompt
    assert one["output_tokens_per_s"] * one["seconds"] == pytest.approx(4)


def test_goodput_counts_requests_meeting_every_objective():
    # TTFT 0.1 s / TPOT (1.1 - 0.1) / 10 = 0.1 s; TTFT 0.5 s / TPOT 0.05 s; TTFT 0.1 s / TPOT 0.3 s;
    # one token (no TPOT, counted as 0, as vLLM does); a failed request never counts.
    records = [RequestRecord(8, 11, ttft=0.1, e2e=1.1), RequestRecord(8, 11, ttft=0.5, e2e=1.0),
               RequestRecord(8, 11, ttft=0.1, e2e=3.1), RequestRecord(8, 1, ttft=0.2, e2e=0.2),
               RequestRecord(8, error="boom")]
    assert "goodput" not in summarize(records, 2.0)
    assert summarize(records, 2.0, {"ttft": 200})["goodput"] == 3 / 2.0
    assert summarize(records, 2.0, {"ttft": 200, "tpot": 100})["goodput"] == 2 / 2.0
    assert summarize(records, 2.0, {"ttft": 600, "tpot": 60})["goodput"] == 2 / 2.0
    assert summarize(records, 2.0, {"e2el": 1000})["goodput"] == 2 / 2.0


def test_goodput_objectives_parse_as_vllm_spells_them(tmp_path, capsys):
    assert bench_args("--goodput", "ttft:2000", "tpot:150").goodput == [("ttft", 2000.0), ("tpot", 150.0)]
    for wrong in ("itl:5", "ttft", "ttft:fast"):
        with pytest.raises(SystemExit):
            bench_args("--goodput", wrong)
        assert "--goodput" in capsys.readouterr().err


def test_client_vllm_bench_gets_the_goodput_objectives(tmp_path):
    seen = tmp_path / "seen.json"
    stand_in = tmp_path / "python"
    result = {"output_throughput": 400.0, "request_throughput": 3.1, "total_input_tokens": 8192, "duration": 20.0,
              "request_goodput": 2.5}
    stand_in.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(sys.argv))\n"
        "out = sys.argv[sys.argv.index('--result-dir') + 1]\n"
        f"open(os.path.join(out, 'result.json'), 'w').write({json.dumps(result)!r})\n")
    stand_in.chmod(0o755)
    args = bench_args("--client", "vllm-bench", "--vllm-python", str(stand_in), "--model", str(tmp_path),
                      "--goodput", "ttft:2000", "tpot:150")
    args.concurrency = [8]
    [summary] = run_server_mode("openai", {"openai": "http://127.0.0.1:9", "model": "llm"}, args, None)
    argv = json.loads(seen.read_text())
    assert argv[argv.index("--goodput") + 1:argv.index("--goodput") + 3] == ["ttft:2000", "tpot:150"]
    assert summary["goodput"] == 2.5


def test_triton_vllm_repository_serves_the_llm_model_by_the_given_vllm_backend(tmp_path):
    checkout = tmp_path / "vllm_backend"
    (checkout / "src" / "utils").mkdir(parents=True)
    (checkout / "src" / "model.py").write_text("# the backend\n", encoding="utf-8")
    (checkout / "src" / "utils" / "request.py").write_text("# a helper\n", encoding="utf-8")
    workdir = tmp_path / "work"
    engine_args = triton_vllm.vllm_engine_args("/models/smol", "float32", stream_interval=4)
    repository = triton_vllm.write_vllm_backend_repository(workdir, checkout, engine_args)
    assert sorted(p.name for p in repository.iterdir()) == ["llm"]  # only the model the frontend asks for
    assert 'backend: "vllm"' in (repository / "llm" / "config.pbtxt").read_text(encoding="utf-8")
    assert json.loads((repository / "llm" / "1" / "model.json").read_text(encoding="utf-8")) == {
        "model": "/models/smol", "dtype": "float32", "seed": 0, "enable_prefix_caching": False, "stream_interval": 4}
    backend = workdir / "backends" / "vllm"
    # The checkout's model.py under another name, loaded by a shim of ours that sets a UTF-8 locale first.
    assert (backend / "vllm_backend_model.py").read_text(encoding="utf-8") == "# the backend\n"
    shim = (backend / "model.py").read_text(encoding="utf-8")
    assert "C.UTF-8" in shim and "from vllm_backend_model import TritonPythonModel" in shim
    assert (backend / "utils" / "request.py").read_text(encoding="utf-8") == "# a helper\n"
    with pytest.raises(SystemExit, match="no src/model.py"):
        triton_vllm.write_vllm_backend_repository(workdir, tmp_path / "elsewhere", engine_args)


def test_triton_vllm_is_a_vllm_mode_that_needs_the_backend_checkout(monkeypatch):
    runs = bench.plan_runs(["triton-vllm"], ["float32"], ["default", "all"])
    assert [r.label for r in runs] == ["triton-vllm default-cores", "triton-vllm all-cores"]
    with pytest.raises(SystemExit, match="--vllm-python"):
        bench.run(bench_args("--modes", "triton-vllm"))
    monkeypatch.delenv(triton_vllm.BACKEND_SRC_ENV, raising=False)
    with pytest.raises(SystemExit, match="--vllm-backend-src"):
        triton_vllm.start_triton_vllm(bench_args("--vllm-python", sys.executable))


def test_client_vllm_bench_sends_no_cache_salt_to_an_unsalted_server(tmp_path):
    stand_in, seen = vllm_bench_stand_in(tmp_path)
    args = bench_args("--client", "vllm-bench", "--vllm-python", str(stand_in), "--model", str(tmp_path))
    args.concurrency = [8]
    run_server_mode("openai", {"openai": "http://127.0.0.1:9", "model": "llm"}, args, None, salted=False)
    assert "--extra-body" not in json.loads(seen.read_text(encoding="utf-8"))


def test_triton_vllm_stub_python_is_the_vllm_venv_under_our_numpy(tmp_path):
    vllm_venv = tmp_path / "venv-vllm"
    (vllm_venv / "bin").mkdir(parents=True)
    (vllm_venv / "pyvenv.cfg").write_text("home = /usr/bin\n", encoding="utf-8")
    (vllm_venv / "bin" / "python").symlink_to(sys.executable)
    python = triton_vllm.stub_python(tmp_path / "stub", str(vllm_venv / "bin" / "python"))
    assert python.resolve() == Path(sys.executable).resolve()
    assert (tmp_path / "stub" / "pyvenv.cfg").read_text(encoding="utf-8") == "home = /usr/bin\n"
    site_packages = next((tmp_path / "stub" / "lib").glob("python3.*/site-packages"))
    assert (site_packages / "numpy" / "__init__.py").is_file()
    assert str(vllm_venv / site_packages.relative_to(tmp_path / "stub")) in \
        (site_packages / "vllm_venv.pth").read_text(encoding="utf-8")


def test_prompt_as_text_sends_only_the_vllm_backend_inputs():
    """`--prompt-as-text` (the triton-vllm mode's frontend): the prompt goes as `text_input`, decoded
    from its token ids (UTF-8 kept), with no token ids and none of the inputs Triton's vLLM backend
    lacks; a parameter vLLM's SamplingParams has no field for is refused before anything is sent."""
    import asyncio
    import struct

    from openai_frontend.errors import OpenAIError
    from openai_frontend.replicas import ReplicaUnavailable
    from openai_frontend.triton import TritonClient

    sent: list[dict] = []

    def stream_infer(requests, stream_timeout=None):
        async def answers():
            async for request in requests:
                sent.append(request)
            return
            yield  # an async generator that answers nothing: the stream closes

        return answers()

    async def run(parameters: dict) -> None:
        client = TritonClient("127.0.0.1:1", decode=lambda ids: "héllo " + " ".join(map(str, ids)))
        client.client.stream_infer = stream_infer  # type: ignore[method-assign]
        try:
            async for _ in client.generate([7, 8], parameters, stream=True):
                pass
        finally:
            await client.close()

    with pytest.raises(ReplicaUnavailable):  # nothing answered: the request was only sent
        asyncio.run(run({"max_tokens": 4}))
    inputs = {tensor.name(): tensor for tensor in sent[0]["inputs"]}
    assert "text_input" in inputs and "input_ids" not in inputs
    assert "return_prompt_logprobs" not in inputs and "return_num_cached_tokens" not in inputs
    raw = inputs["text_input"]._get_content()
    assert raw[4:].decode() == "héllo 7 8" and struct.unpack("<I", raw[:4])[0] == len("héllo 7 8".encode())
    with pytest.raises(OpenAIError) as error:
        asyncio.run(run({"max_tokens": 4, "cache_salt": "tenant"}))
    assert error.value.status == 400 and "cache_salt" in error.value.message
    assert len(sent) == 1


def test_linear_flop_counts_every_projection_per_token_fed_in_and_the_head_per_output():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)])
    model.embed_tokens = torch.nn.Embedding(10, 4)
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    # 2 requests, 5 prompt tokens and 3 output tokens in all: 5 + 3 - 2 tokens through the layers
    assert linear_flop(model, prompt_tokens=5, output_tokens=3, requests=2) == 2 * ((24 + 24) * 6 + 40 * 3)


def test_served_runs_report_cpu_by_process_with_the_client(tmp_path):
    stand_in, _ = vllm_bench_stand_in(tmp_path)
    args = bench_args("--client", "vllm-bench", "--vllm-python", str(stand_in), "--model", str(tmp_path))
    args.concurrency = [8]
    (result,) = run_server_mode("openai", {"openai": "http://127.0.0.1:9", "model": "llm"}, args, None)
    usage = result["cpu"]
    assert usage["processes"][cpu_usage.CHILD_CLIENT]["cpu_s"] > 0  # the stand-in client ran and exited
    assert usage["switches_per_token"] is not None and usage["cpu_s"] >= usage["processes"][cpu_usage.CHILD_CLIENT]["cpu_s"]
    lines = cpu_usage.format_usage("openai c=8", usage)
    assert lines[0].startswith("openai c=8: ") and any(cpu_usage.CHILD_CLIENT in line for line in lines)


def test_cpu_usage_is_the_difference_per_process_and_busiest_thread():
    sample = cpu_usage.ThreadSample
    before = {"stub 7/7": sample("stub 7", "engine 7", 10.0, 100, 10), "stub 7/8": sample("stub 7", "sender 8", 1.0, 50, 0)}
    after = {"stub 7/7": sample("stub 7", "engine 7", 30.0, 300, 30), "stub 7/8": sample("stub 7", "sender 8", 1.5, 90, 5),
             "stub 7/9": sample("stub 7", "omp 9", 19.0, 20, 20),  # born during the run: counted from zero
             "idle 3/3": sample("idle 3", "idle 3", 0.01, 1, 0)}
    usage = cpu_usage.difference(before, after, output_tokens=100)
    stub = usage["processes"]["stub 7"]
    assert stub["cpu_s"] == pytest.approx(39.5) and stub["switches"] == 260 and stub["involuntary"] == 45
    assert list(stub["threads"]) == ["engine 7", "omp 9"]  # the sender's 0.5 CPU-s is under 5% of the process
    assert "idle 3" not in usage["processes"]
    assert usage["switches_per_token"] == pytest.approx(2.61) and usage["idle_s"] is None
    with_idle = cpu_usage.difference(before, after, output_tokens=100, idle=(100.0, 103.5))
    assert with_idle["idle_s"] == pytest.approx(3.5)
    assert ", 3.5 CPU-s idle," in cpu_usage.format_usage("openai c=64", with_idle)[0]
    idle_now = cpu_usage.host_idle_s()
    assert idle_now is None or idle_now > 0
