"""`tritonllm serve` as an attacker and an operator meet it (issue 26): Triton's model control is
closed (no unload, no load with a `file:` override), its repository, logging and trace APIs need
the admin key (Triton's header on HTTP, its gRPC form on gRPC; an operator's key from
--admin-key-file, issue 42), the API key sits on no command line, a dead llm or embeddings stub makes
serve exit non-zero, and `kill -9` of serve leaves no process and no listening port behind; every server binds
loopback by default.

Each test runs the real `serve` (tritonserver, both stubs, the frontend) on a tiny random Llama.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys

import psutil
import pytest

from tests.utils import ROOT
from tests.utils.serve import Serve, listening
from tools.serve import ADMIN_KEY_FILE, ADMIN_KEY_HEADER, read_admin_key_file
from tools.triton_server import SHM_REGION_PREFIX, remove_stale_shm_regions

API_KEY = "sk-security-test-0123456789"  # distinctive: no command line may hold it
CI_ADMIN_KEY = "ci-admin-key-0123456789abcdef"  # an operator's choice, as a trusted CI would make it
GRPC_ADMIN_HEADER = "triton-grpc-protocol-triton-admin-key"  # Triton's gRPC form of the HTTP header


@pytest.fixture
def serve(tmp_path, tiny_llama):
    """Starts `serve` with the given flags (one per test), stopped at the end of the test."""
    started = []

    def start(*flags: str) -> Serve:
        started.append(Serve(tiny_llama, tmp_path / f"serve{len(started)}", "--max-num-seqs", "4", *flags,
                             kv_cache_bytes=8 << 20, max_model_len=256, api_key=API_KEY))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def test_model_control_is_closed_and_a_dead_stub_stops_serve(serve):
    serve = serve()
    # Without the admin key: Triton's repository API is refused before it looks at the request.
    malicious = {"parameters": {"config": json.dumps({"backend": "python"}),
                                "file:1/model.py": "aW1wb3J0IG9zOyBvcy5zeXN0ZW0oJ3RvdWNoIC90bXAvcHduZWQnKQ=="}}
    for path, body in (("/v2/repository/models/llm/unload", None),
                       ("/v2/repository/models/evil/load", malicious),
                       ("/v2/repository/index", None)):
        status, text = serve.triton(path, body)
        assert status == 403 and ADMIN_KEY_HEADER in text, (path, status, text)
    # With it: model control is off, so no model can be unloaded or loaded all the same.
    for path, body in (("/v2/repository/models/llm/unload", None),
                       ("/v2/repository/models/evil/load", malicious)):
        status, text = serve.triton(path, body, admin=True)
        assert status >= 400 and "not allowed" in text, (path, status, text)
    assert serve.triton("/v2/repository/index", admin=True)[0] == 200
    assert serve.triton("/v2/models/llm/ready")[0] == 200
    assert not (serve.work / "model_repository" / "evil").exists()

    # The key is on no command line (`ps` shows those to every user); Triton and the frontend listen
    # on loopback.
    for process in [psutil.Process(serve.process.pid), *serve.descendants()]:
        assert API_KEY not in " ".join(process.cmdline()), process.cmdline()
    triton = next(p for p in serve.descendants() if p.name() == "tritonserver")
    frontend = next(p for p in serve.descendants() if "openai_frontend" in " ".join(p.cmdline()))
    for server in (triton, frontend):
        addresses = {ipaddress.ip_address(c.laddr.ip) for c in server.net_connections("tcp") if c.status == "LISTEN"}
        assert addresses and all((getattr(a, "ipv4_mapped", None) or a).is_loopback for a in addresses), \
            (server.cmdline(), addresses)

    # The llm stub dies: serve notices, kills the rest and exits non-zero for its supervisor.
    [stub] = [p for p in serve.descendants() if "triton_python_backend_stub" in " ".join(p.cmdline()[:1])
              and "/llm/" in " ".join(p.cmdline())]
    others = serve.descendants()
    stub.kill()
    assert serve.process.wait(60) == 1
    assert "stub died" in serve.log()
    gone, alive = psutil.wait_procs(others, timeout=10)
    assert not alive, alive


def test_a_dead_embeddings_stub_stops_serve_too(serve):
    """Triton restarts neither stub: a dead embeddings model would stay down (the frontend fails its
    requests and /health, naming it), so serve exits for its supervisor as for the llm's."""
    serve = serve()
    [stub] = [p for p in serve.descendants() if "triton_python_backend_stub" in " ".join(p.cmdline()[:1])
              and "/embeddings/" in " ".join(p.cmdline())]
    others = serve.descendants()
    stub.kill()
    assert serve.process.wait(60) == 1
    assert "the 'embeddings' model's Python stub died" in serve.log()
    gone, alive = psutil.wait_procs(others, timeout=10)
    assert not alive, alive


def test_servers_default_to_loopback():
    """Every server binds loopback unless told otherwise: serve's frontend and Triton, the frontend
    run alone, and Triton as tools/triton_server.py starts it (bench, tests)."""
    import argparse
    import inspect

    from openai_frontend import Settings
    from tools.serve import add_serve_arguments
    from tools.triton_server import TritonServer

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.host, defaults.triton_host) == ("127.0.0.1", "127.0.0.1")
    assert Settings().host == "127.0.0.1"
    assert inspect.signature(TritonServer).parameters["host"].default == "127.0.0.1"


def key_file(folder, key: str, mode: int):
    path = folder / "admin.key"
    path.write_text(key + "\n")
    path.chmod(mode)
    return path


def test_admin_key_file_is_the_operators_own_and_private(tmp_path, tiny_llama):
    assert read_admin_key_file(key_file(tmp_path, CI_ADMIN_KEY, 0o600)) == CI_ADMIN_KEY
    assert read_admin_key_file(key_file(tmp_path, CI_ADMIN_KEY, 0o400)) == CI_ADMIN_KEY
    for key, mode, message in ((CI_ADMIN_KEY, 0o640, "group or others may access it (mode 640)"),
                               (CI_ADMIN_KEY, 0o604, "(mode 604)"), (CI_ADMIN_KEY, 0o620, "(mode 620)"),
                               ("short", 0o600, "at least 16"), ("with:colon-0123456789", 0o600, "at least 16"),
                               ("", 0o600, "at least 16")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_admin_key_file(key_file(tmp_path, key, mode))
    # serve refuses it before starting anything.
    done = subprocess.run([sys.executable, "-m", "tools.serve", "--model", tiny_llama, "--workdir", str(tmp_path / "w"),
                           "--admin-key-file", str(key_file(tmp_path, CI_ADMIN_KEY, 0o644))],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "chmod 600" in done.stderr, done.stderr
    assert not (tmp_path / "w" / "tritonserver.log").exists()


def test_explicit_control_with_the_operators_key_over_http_and_grpc_and_kill_9_of_serve_leaves_nothing(
        serve, tmp_path):
    """docs/triton.md's migration step for the vLLM backend's load/unload tests, as written there:
    `--model-control explicit --admin-key-file`, and the key in tritonclient's `headers=`."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    admin_key = key_file(tmp_path, CI_ADMIN_KEY, 0o600)
    serve = serve("--model-control", "explicit", "--admin-key-file", str(admin_key))
    assert not (serve.work / ADMIN_KEY_FILE).exists()  # the operator's file is the only copy
    http = httpclient.InferenceServerClient(f"127.0.0.1:{serve.ports['http-port']}")
    grpc = grpcclient.InferenceServerClient(serve.grpc_url)
    for client, admin in ((http, {"triton-admin-key": CI_ADMIN_KEY}), (grpc, {GRPC_ADMIN_HEADER: CI_ADMIN_KEY})):
        # Without the key, with the other protocol's header, or with a wrong key: refused.
        other = {"triton-admin-key" if client is grpc else GRPC_ADMIN_HEADER: CI_ADMIN_KEY}
        for headers in (None, other, {next(iter(admin)): "wrong-key-0123456789"}):
            for method, args in (("get_model_repository_index", ()), ("unload_model", ("llm",)),
                                 ("load_model", ("llm",))):
                with pytest.raises(InferenceServerException, match="triton-admin-key"):
                    getattr(client, method)(*args, headers=headers)
        assert client.is_model_ready("llm")
        # With it: unload and load again, and the index says so.
        client.unload_model("llm", headers=admin)
        assert not client.is_model_ready("llm")
        client.load_model("llm", headers=admin)
        assert client.is_model_ready("llm")
        index = client.get_model_repository_index(headers=admin)
        names = [m["name"] for m in index] if client is http else [m.name for m in index.models]
        assert {"llm", "embeddings"} <= set(names)
    status, text = serve.triton("/v2/logging", {"log_verbose_level": 1})
    assert status == 403, (status, text)
    assert CI_ADMIN_KEY not in serve.log()
    # docs/triton.md's example runs as written there, but for the ports and the key file's path.
    docs = (ROOT / "docs" / "triton.md").read_text(encoding="utf-8")
    example = re.search(r"### The vLLM backend's load/unload tests.*?```bash\n(.*?)```.*?```python\n(.*?)```", docs, re.S)
    assert "tritonllm serve --model-control explicit --admin-key-file admin.key" in example.group(1)
    code = (example.group(2).replace("localhost:8001", serve.grpc_url)
            .replace("localhost:8000", f"127.0.0.1:{serve.ports['http-port']}")
            .replace('open("admin.key")', f"open({str(admin_key)!r})"))
    exec(compile(code, "docs/triton.md", "exec"), {})
    assert http.is_model_ready("llm") and grpc.is_model_ready("llm")

    processes = serve.descendants()
    assert len(processes) >= 4, processes  # tritonserver, two stubs, the frontend
    serve.process.kill()
    serve.process.wait()
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert not [port for port in serve.ports.values() if listening(port)]


def test_stale_shm_regions_are_removed_but_not_live_ones(tmp_path):
    stale = tmp_path / f"{SHM_REGION_PREFIX}stale"
    live = tmp_path / f"{SHM_REGION_PREFIX}live"
    other = tmp_path / "not-ours"
    for path in (stale, live, other):
        path.write_bytes(b"\0" * 16)
    with open(live, "rb"):  # held by a live process: this one
        assert remove_stale_shm_regions(tmp_path) == [stale]
    assert live.exists() and other.exists() and not stale.exists()
