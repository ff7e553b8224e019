"""The CPU path on every CPU class and locale (#38): the kernels built for each instruction set we can
run here pass the kernel and exactness tests, compile without warnings for the others (aarch64 with a
cross compiler), a build's failure or its non-ASCII output never fails a load, and the real server,
building its kernels afresh inside Triton's Python stub, answers a non-ASCII prompt under
LANG=C.UTF-8 and under LC_ALL=C."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from backend.ops import cpu_ops
from tests.utils import ROOT
from tools.triton_server import TritonServer, free_port, write_model_repository

COMPILER = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler: the torch references run instead")
# What g++ prints on an AVX2 CPU for a vector wider than its registers, quoted as it quotes in UTF-8.
UTF8_WARNING = "vectors.h:23:34: warning: AVX512F vector return without AVX512F enabled changes the ABI [‘-Wpsabi’]"
NON_ASCII_PROMPT = "Café, naïve, Zürich — 東京 ✓. The weather is"
# Python as Triton's stub runs it under LANG=C.UTF-8: its preferred encoding is ASCII.
ASCII_PYTHON = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def fake_compiler(path: Path, exit_status: int) -> str:
    """A compiler that says UTF-8 things and exits with `exit_status`, leaving junk as its -o."""
    path.write_text("#!/bin/sh\n"
                    f"printf '%s\\n' '{UTF8_WARNING}' >&2\n"
                    'while [ $# -gt 1 ]; do [ "$1" = -o ] && echo junk > "$2"; shift; done\n'
                    f"exit {exit_status}\n", encoding="utf-8")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("exit_status", [0, 1])
def test_a_build_never_fails_the_caller_whatever_the_locale(tmp_path, exit_status):
    """Under an ASCII locale, a build whose compiler prints UTF-8 and fails (or succeeds and leaves
    a library that does not load) leaves the kernels unavailable with a warning saying why."""
    code = ("import logging; from backend.ops import cpu_ops; logging.basicConfig(level=logging.WARNING); "
            "print('available', cpu_ops.available())")
    env = {**os.environ, **ASCII_PYTHON, "CXX": fake_compiler(tmp_path / "c++", exit_status),
           "TRITONLLM_CPU_OPS_CACHE": str(tmp_path / "kernels")}
    env.pop("TRITONLLM_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True)
    stdout, stderr = result.stdout.decode(), result.stderr.decode("utf-8", errors="replace")
    assert result.returncode == 0 and stdout.strip() == "available False", stderr[-3000:]
    assert "CPU kernels unavailable, using the torch references" in stderr
    assert ("-Wpsabi" in stderr) == (exit_status != 0)  # a failed build says what the compiler said


def test_a_level_this_cpu_lacks_is_refused_not_run(tmp_path):
    """Code for an x86-64 level above this CPU's would die on its first instruction: refused, with
    the references running instead."""
    missing = [level for level in cpu_ops.X86_LEVELS if not cpu_ops.runs_here(level)]
    if not missing or not x86():
        pytest.skip("this CPU runs every x86-64 level" if x86() else "not x86-64")
    code = "from backend.ops import cpu_ops; print('available', cpu_ops.available())"
    env = {**os.environ, "TRITONLLM_CPU_ARCH": missing[0], "TRITONLLM_CPU_OPS_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            encoding="utf-8", errors="replace")
    assert result.stdout.strip() == "available False", result.stderr[-3000:]
    assert f"TRITONLLM_CPU_ARCH={missing[0]}: this CPU lacks its instructions" in result.stderr
    assert not list(tmp_path.iterdir())  # nothing was built


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["x86-64-v4", "x86-64-v3", "x86-64-v2"])
def test_kernel_and_exactness_tests_pass_on_each_instruction_set(arch):
    """The C++ ops' tests and a greedy run against Hugging Face on the library built for an older
    x86-64 level than this CPU's (its vectors 16, 8 or 4 floats wide); the default, native build
    runs them in the suite itself. A library per level, cached as any other (about 20 s to build)."""
    if not cpu_ops.runs_here(arch):
        pytest.skip(f"this CPU cannot run {arch} code ({'not x86-64' if not x86() else 'missing flags'})")
    env = {**os.environ, "TRITONLLM_CPU_ARCH": arch}
    env.pop("TRITONLLM_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/ops/test_cpu_ops.py", "-k", "not portable",
                             "tests/engine/test_exactness.py::test_greedy_matches_hf_with_ample_kv"],
                            env=env, cwd=ROOT, capture_output=True, text=True, encoding="utf-8", errors="replace")
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


CROSS_TARGETS = {  # target: (compiler, -march)
    "x86-64-v2": ("x86_64-linux-gnu-g++" if not x86() else COMPILER, "x86-64-v2"),
    "x86-64-v3": ("x86_64-linux-gnu-g++" if not x86() else COMPILER, "x86-64-v3"),
    "x86-64-v4": ("x86_64-linux-gnu-g++" if not x86() else COMPILER, "x86-64-v4"),
    "aarch64": ("aarch64-linux-gnu-g++" if x86() else COMPILER, "armv8-a"),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", list(CROSS_TARGETS))
def test_kernels_compile_without_warnings_for_each_target(tmp_path, target):
    """-Wall -Werror with the build's own flags: in particular no -Wpsabi, which a vector wider
    than the target's registers draws (15-25 s a target). aarch64 from an x86-64 host needs
    `apt-get install g++-aarch64-linux-gnu`."""
    compiler, arch = CROSS_TARGETS[target]
    if compiler is None or shutil.which(compiler) is None:
        pytest.skip(f"no compiler for {target} ({compiler or 'g++'} not on PATH)")
    machine = "aarch64" if target == "aarch64" else "x86_64"
    flags = [*cpu_ops.compile_flags(arch, portable=False, machine=machine), "-Wall", "-Werror"]
    cpu_ops.compile_library(compiler, flags, tmp_path / "kernels.so")
    assert (tmp_path / "kernels.so").stat().st_size > 0


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("locale", [{"LANG": "C.UTF-8"}, {"LC_ALL": "C"}], ids=["LANG=C.UTF-8", "LC_ALL=C"])
def test_server_builds_its_kernels_and_answers_non_ascii_under_each_locale(tmp_path, model_path, monkeypatch,
                                                                           locale):
    """tritonserver with a fresh kernel cache and a compiler that warns in UTF-8 (as g++ did on AVX2
    CPUs): the stub builds the kernels, loads the model and answers a prompt with non-ASCII text."""
    for name in ("LANG", "LC_ALL", "LC_CTYPE", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONCOERCECLOCALE",
                 "TRITONLLM_CPU_KERNELS", "TRITONLLM_CPU_ARCH"):
        monkeypatch.delenv(name, raising=False)
    for name, value in locale.items():
        monkeypatch.setenv(name, value)
    wrapper = tmp_path / "c++"
    wrapper.write_text(f"#!/bin/sh\nprintf '%s\\n' '{UTF8_WARNING}' >&2\nexec {COMPILER} \"$@\"\n", encoding="utf-8")
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("TRITONLLM_CPU_OPS_CACHE", str(tmp_path / "kernels"))
    repository = write_model_repository(tmp_path / "repository", {
        "model": model_path, "dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 256})
    log = tmp_path / "triton.log"
    with TritonServer(repository, tmp_path, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                      log_file=log, extra_args=["--exit-timeout-secs=5"]) as server:
        server.wait_ready(300)
        body = {"text_input": NON_ASCII_PROMPT, "parameters": {"temperature": 0, "max_tokens": 8}}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate",
                                         json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read().decode("utf-8"))["text_output"]
    assert text.startswith(NON_ASCII_PROMPT) and len(text) > len(NON_ASCII_PROMPT)
    assert list((tmp_path / "kernels").glob("tritonllm_cpu_ops_*.so")), log.read_text(encoding="utf-8", errors="replace")
    assert "CPU kernels unavailable" not in log.read_text(encoding="utf-8", errors="replace")


@pytest.mark.slow
def test_engine_reads_and_writes_no_text_in_the_locale_encoding(model_path):
    """The offline engine under an ASCII locale, with every text-mode I/O of ours that leaves the
    encoding to the locale made an error (PEP 597's EncodingWarning): loading, a non-ASCII prompt,
    a chat whose template and messages have non-ASCII text."""
    code = f"""
import json, warnings
warnings.filterwarnings("error", category=EncodingWarning, module=r"(backend|tools)(\\.|$)")
from backend import LLM, SamplingParams
llm = LLM(model={model_path!r}, dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256)
params = SamplingParams(temperature=0, max_tokens=8)
[completion] = llm.generate([{ascii(NON_ASCII_PROMPT)}], params)
[chat] = llm.chat([{{"role": "user", "content": {ascii(NON_ASCII_PROMPT)}}}], params)
print(json.dumps([completion.outputs[0].text, chat.outputs[0].text]))
"""
    env = {**os.environ, **ASCII_PYTHON}
    result = subprocess.run([sys.executable, "-X", "warn_default_encoding", "-c", code], env=env, cwd=ROOT,
                            capture_output=True)
    stderr = result.stderr.decode("utf-8", errors="replace")
    assert result.returncode == 0, stderr[-3000:]
    completion, chat = json.loads(result.stdout.decode().splitlines()[-1])
    assert completion and chat
