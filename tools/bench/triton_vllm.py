"""The `triton-vllm` mode's server: vLLM hosted by Triton's own vLLM backend
(github.com/triton-inference-server/vllm_backend) in the tritonserver we use, behind our OpenAI
frontend. The backend's code is not ours to ship: the mode takes a checkout of it
(`--vllm-backend-src`) and copies its `src/` into a backend directory under a scratch folder.

The backend's model runs in a Python stub started by the vLLM venv's Python (first on PATH), and
takes text prompts only, so the frontend runs with `--prompt-as-text`. vLLM's SamplingParams has
no cache_salt, so this mode's model runs without a prefix cache: each run starts with nothing of
its prompts cached, as the other served modes' salts ensure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from tools.bench.servers import stop, vllm_environment, wait_http
from tools.bench.workloads import resolved_model

BACKEND_SRC_ENV = "TRITONLLM_VLLM_BACKEND_SRC"
MODEL_NAME = "llm"  # the frontend's generation model (openai_frontend/triton.py)
CONFIG_PBTXT = """backend: "vllm"
instance_group [{ count: 1, kind: KIND_MODEL }]
"""
BACKEND_MODULE = "vllm_backend_model"  # the checkout's src/model.py, renamed for the shim below
# The backend's model.py is this shim, then the checkout's module. Triton's stub starts its Python with
# an ASCII preferred encoding whatever LANG, LC_ALL or PYTHONUTF8 say, and `import vllm` reads UTF-8
# files without naming the encoding: a UTF-8 LC_CTYPE first (open() follows it). And vllm_backend's main
# (January 2026) imports two names from where vLLM kept them before 0.32 moved them: aliased back.
SHIM = f"""\"\"\"Written by tritonllm's bench (tools/bench/triton_vllm.py): a UTF-8 locale, then the backend.\"\"\"
import locale
import sys

locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

import vllm.inputs  # noqa: E402
import vllm.v1.metrics.loggers  # noqa: E402

try:
    import vllm.inputs.data  # noqa: F401
except ImportError:
    import vllm.inputs.llm
    sys.modules["vllm.inputs.data"] = vllm.inputs.llm
if not hasattr(vllm.v1.metrics.loggers, "build_1_2_5_buckets"):
    from vllm.v1.metrics.buckets import build_1_2_5_buckets
    vllm.v1.metrics.loggers.build_1_2_5_buckets = build_1_2_5_buckets

from {BACKEND_MODULE} import TritonPythonModel  # noqa: E402,F401
"""


def vllm_engine_args(model: str, dtype: str, stream_interval: int = 1) -> dict:
    """model.json: the flags `vllm serve` gets in the vllm-serve mode, as vLLM's engine arguments."""
    values = {"model": model, "dtype": dtype, "seed": 0, "enable_prefix_caching": False}
    if stream_interval != 1:
        values["stream_interval"] = stream_interval
    return values


def write_vllm_backend_repository(workdir: Path, backend_src: Path, engine_args: dict) -> Path:
    """Lay out, under `workdir`, the backend (`backends/vllm/`: the checkout's `src/` and SHIM) and a model
    repository holding one model, `llm`, that Triton's vLLM backend serves with `engine_args`.
    Returns the repository."""
    source = Path(backend_src) / "src"
    if not (source / "model.py").is_file():
        raise SystemExit(f"--vllm-backend-src: {backend_src} is not a vllm_backend checkout (no src/model.py)")
    backend = workdir / "backends" / "vllm"
    if backend.exists():
        shutil.rmtree(backend)
    shutil.copytree(source, backend, ignore=shutil.ignore_patterns("__pycache__"))
    (backend / "model.py").rename(backend / f"{BACKEND_MODULE}.py")
    (backend / "model.py").write_text(SHIM, encoding="utf-8")
    repository = workdir / "model_repository"
    version = repository / MODEL_NAME / "1"
    version.mkdir(parents=True, exist_ok=True)
    (repository / MODEL_NAME / "config.pbtxt").write_text(CONFIG_PBTXT, encoding="utf-8")
    (version / "model.json").write_text(json.dumps(engine_args, indent=2) + "\n", encoding="utf-8")
    return repository


def stub_python(folder: Path, vllm_python: str) -> Path:
    """A venv over the vLLM venv, for Triton's stub, whose numpy is this Python's (below 2): the
    stub (Triton 2.51's, built against numpy 1) misreads numpy 2's arrays, and the vLLM venv has
    numpy 2, which its opencv requires, so it is left as it is. The venv's own site-packages holds
    links to our numpy and comes first; the vLLM venv's follows. Returns its python3."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"triton-vllm: Triton's stub needs numpy<2, and this Python has {numpy.__version__}")
    vllm_venv = Path(vllm_python).absolute().parent.parent
    site_packages = folder / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site_packages.mkdir(parents=True, exist_ok=True)
    (folder / "bin").mkdir(exist_ok=True)
    shutil.copy2(vllm_venv / "pyvenv.cfg", folder / "pyvenv.cfg")
    (folder / "bin" / "python3").symlink_to(Path(vllm_python).resolve())
    ours = Path(numpy.__file__).parent.parent
    for entry in ours.glob("numpy*"):  # the package, its libraries and its dist-info
        (site_packages / entry.name).symlink_to(entry)
    theirs = vllm_venv / site_packages.relative_to(folder)
    (site_packages / "vllm_venv.pth").write_text(f"import site; site.addsitedir({str(theirs)!r})\n",
                                                 encoding="utf-8")
    return folder / "bin" / "python3"


def start_triton_vllm(args) -> tuple[subprocess.Popen, dict]:
    """tritonserver with Triton's vLLM backend, and our frontend in the same process group (so that
    `stop` ends both, the stub and vLLM's engine process with them)."""
    from tools.triton_server import TritonServer, find_triton, free_port, remove_stale_shm_regions, server_environment

    backend_src = args.vllm_backend_src or os.environ.get(BACKEND_SRC_ENV)
    if not backend_src:
        raise SystemExit(f"triton-vllm needs --vllm-backend-src DIR (or ${BACKEND_SRC_ENV}): a vllm_backend checkout")
    workdir = Path(tempfile.mkdtemp(prefix="tritonllm-bench-triton-vllm-"))
    model = resolved_model(args)
    repository = write_vllm_backend_repository(workdir, Path(backend_src),
                                               vllm_engine_args(model, args.dtype, args.stream_interval))
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    server = TritonServer(repository, workdir, http_port=ports["http"], grpc_port=ports["grpc"],
                          metrics_port=ports["metrics"])
    install = find_triton(workdir)  # the Python backend and its stub; backends/vllm stays
    env = {**server_environment(install), **vllm_environment(args), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    # The stub runs the first python3 on PATH, with its site-packages: the vLLM venv's, under our numpy.
    env["PATH"] = os.pathsep.join([str(stub_python(workdir / "stub-python", args.vllm_python).parent), env["PATH"]])
    remove_stale_shm_regions()
    log = open(workdir / "tritonserver.log", "ab")
    print(f"triton-vllm: tritonserver log {workdir / 'tritonserver.log'}", file=sys.stderr)
    # A process group of its own (not a session: the frontend could not join it from ours).
    process = subprocess.Popen(server.command(install), env=env, stdout=log, stderr=subprocess.STDOUT,
                               process_group=0)
    log.close()
    try:
        wait_http(f"http://{server.http_url}/v2/health/ready", 900, process)
        frontend = subprocess.Popen([sys.executable, "-m", "openai_frontend", "--grpc-url", server.grpc_url,
                                     "--port", str(ports["openai"]), "--model", model, "--prompt-as-text",
                                     "--log-level", "warning"], process_group=process.pid)
        wait_http(f"http://127.0.0.1:{ports['openai']}/health", 300, frontend)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['openai']}/v1/models") as response:
            served = json.loads(response.read())["data"][0]["id"]
    except BaseException:
        stop(process)
        raise
    return process, {"grpc": server.grpc_url, "openai": f"http://127.0.0.1:{ports['openai']}",
                     "metrics": server.metrics_url, "model": served}
