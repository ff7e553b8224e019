"""`tritonllm serve`: one command from a model folder to a running tritonserver (and the OpenAI
frontend, when it is installed), shut down cleanly on Ctrl-C or SIGTERM.

The engine flags (tools/cli.py) are EngineConfig's fields with dashes (`--max-model-len`,
`--block-size`, ...), the names vLLM's `serve` uses; the given ones are written into the runtime
copy of model_repository/llm/1/model.json. No `--model` means the prepared default (SmolLM2).
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import fields
from pathlib import Path

from backend.config import EngineConfig
from backend.worker.cpu_policy import yield_to_compute
from tools.triton_server import MODEL_NAME, TritonServer, popen_with_parent, write_model_repository

FRONTEND_MODULE = "openai_frontend.main"
API_KEY_ENV = "TRITONLLM_API_KEY"
ADMIN_KEY_HEADER = "triton-admin-key"
ADMIN_KEY_FILE = "triton-admin-key"
# Triton reads the key from `--http-restricted-api=<apis>:<header>=<key>`: no `:`, `,` or `=` in it.
ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/-]{16,}")
STUB_CHECK_S = 0.5
WATCHED_MODELS = (MODEL_NAME, "embeddings")  # the models serve loads, whose stubs Triton never restarts


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers' flags; the engine's (one per EngineConfig field) come from tools.cli."""
    servers = parser.add_argument_group("servers (docs/security.md: what listens where)")
    servers.add_argument("--host", default="127.0.0.1",
                         help="address the OpenAI frontend, the public door, listens on (0.0.0.0 in the container)")
    servers.add_argument("--port", type=int, default=9000, help="OpenAI frontend port")
    servers.add_argument("--triton-host", default="127.0.0.1",
                         help="address Triton's HTTP, gRPC and metrics ports listen on; they take no API key, "
                              "so keep them off the network unless a firewall guards them")
    servers.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port")
    servers.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port")
    servers.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port")
    servers.add_argument("--api-key", default=None,
                         help=f"OpenAI frontend: require `Authorization: Bearer <key>`. Prefer ${API_KEY_ENV} or "
                              "--api-key-file: a key on the command line shows in `ps`")
    servers.add_argument("--api-key-file", type=Path, default=None,
                         help="a file holding the API key (its first line)")
    servers.add_argument("--admin-key-file", type=Path, default=None,
                         help="Triton's admin key chosen by the operator (a trusted CI): the first line of a file "
                              "only its owner may read (chmod 600), read once at start; default: a fresh random "
                              "key each run, in <workdir>/triton-admin-key")
    servers.add_argument("--model-control", choices=("none", "explicit"), default="none",
                         help="Triton's model control: `none` loads every model at start and refuses load "
                              "and unload; `explicit` allows them to holders of the admin key (docs/security.md)")
    servers.add_argument("--serving-sched", choices=("batch", "normal"), default="batch",
                         help="Linux CPU policy of Triton and the frontend: `batch` (SCHED_BATCH) keeps their "
                              "wake-ups from preempting the engine's compute threads, which take back the "
                              "normal policy (backend/worker/cpu_policy.py); `normal` leaves every process as "
                              "started")
    servers.add_argument("--log-requests", action="store_true",
                         help="OpenAI frontend: log prompts and completions (never logged otherwise)")
    servers.add_argument("--tool-call-parser", default="hermes",
                         choices=("hermes", "json", "llama3_json", "mistral", "pythonic"),
                         help="the model's tool-call format, for the OpenAI frontend's tools support")
    servers.add_argument("--enable-auto-tool-choice", action="store_true",
                         help="OpenAI frontend: tool_choice auto, calls read from the model's text (vLLM's flag)")
    servers.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                         help="OpenAI frontend: return the model's <think> block apart as `reasoning`")
    servers.add_argument("--chat-template", default=None,
                         help="OpenAI frontend: a Jinja chat template, or a file holding one, instead of the model's")
    servers.add_argument("--enable-prompt-tokens-details", action="store_true",
                         help="OpenAI frontend: usage.prompt_tokens_details.cached_tokens (prefix-cache hits)")
    servers.add_argument("--allowed-media-domains", nargs="+", action="extend", default=None,
                         help="OpenAI frontend: hosts whose http(s) image URLs are fetched, at public addresses only "
                              "(vLLM's flag; default: none, remote images refused)")
    servers.add_argument("--allow-private-media-hosts", action="store_true",
                         help="OpenAI frontend: those hosts may resolve to private addresses (a trusted network)")
    servers.add_argument("--allowed-local-media-path", default=None,
                         help="OpenAI frontend: file:// image URLs are read from under this folder (vLLM's flag)")
    servers.add_argument("--max-media-bytes", type=int, default=None,
                         help="OpenAI frontend: largest image accepted (default: 20 MiB)")
    servers.add_argument("--media-fetch-timeout", type=float, default=None,
                         help="OpenAI frontend: seconds to fetch one remote image (default: 10)")
    servers.add_argument("--limit-mm-per-prompt", default=None,
                         help="OpenAI frontend: images per request, as vLLM's JSON '{\"image\": 2}' (default: 16)")
    servers.add_argument("--no-frontend", action="store_true",
                         help="Triton only (no OpenAI frontend): a replica of a scale-out deployment, behind "
                              "one frontend given every replica's gRPC address (docs/deploy.md)")
    servers.add_argument("--disable-log-stats", action="store_true",
                         help="vLLM's flag, accepted: the engine logs no periodic stats (metrics are on the metrics port)")
    servers.add_argument("--disable-log-requests", action="store_true",
                         help="vLLM's flag, accepted: requests are never logged unless --log-requests")
    servers.add_argument("--workdir", type=Path, default=None,
                         help="where the runtime model repository, Triton's log and admin key go "
                              "(default: a new temporary folder)")
    servers.add_argument("--ready-timeout", type=float, default=600.0,
                         help="seconds to wait for the model to load")


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $TRITONLLM_API_KEY, else none."""
    if args.api_key:
        return args.api_key
    if args.api_key_file is not None:
        key = args.api_key_file.read_text().strip().splitlines()
        if not key or not key[0].strip():
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key[0].strip()
    return os.environ.get(API_KEY_ENV) or None


def triton_arguments(args: argparse.Namespace, admin_key: str) -> list[str]:
    """Model control, and Triton's own APIs that change the server (repository, logging,
    tracing) closed to any client without the admin key's header."""
    control = (["--model-control-mode=none"] if args.model_control == "none"
               else ["--model-control-mode=explicit", "--load-model=*"])
    restricted = f"model-repository,logging,trace:{ADMIN_KEY_HEADER}={admin_key}"
    return control + [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]


def read_admin_key_file(path: Path) -> str:
    """The operator's admin key: the first line of `path`, which group and others must not be able to
    read or write (0600 or 0400); a key is a root password here (docs/security.md)."""
    with open(path, encoding="utf-8") as file:  # the mode checked is the mode of the file read
        mode = os.fstat(file.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"--admin-key-file {path}: group or others may access it (mode {mode:o}); "
                             "chmod 600 it")
        key = file.readline().strip()
    if not ADMIN_KEY_PATTERN.fullmatch(key):
        raise ValueError(f"--admin-key-file {path}: its first line must be a key of at least 16 letters, digits "
                         "or . _ ~ + / - (e.g. `openssl rand -hex 32`)")
    return key


def write_admin_key(workdir: Path) -> str:
    """A fresh random admin key for this run, readable by our user only."""
    key = secrets.token_urlsafe(32)
    path = workdir / ADMIN_KEY_FILE
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")
    return key


def engine_arguments(args: argparse.Namespace) -> dict:
    """The engine flags that were given, validated; the default model is prepared if none was."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    config = EngineConfig.from_dict(given)  # ValueError naming the field, before Triton starts
    parsed = config.to_dict()  # cast ("1024" -> 1024) and parsed, as JSON values for model.json
    values = {name: parsed[name] for name in given}
    if config.model is None:
        from tools.prepare_model import prepare_model
        values["model"] = str(prepare_model())
    else:  # a folder, or a hub id found in the local Hugging Face cache (docs/triton.md)
        from backend.model_paths import resolve_model_path
        values["model"] = str(Path(resolve_model_path(config.model, config.revision)).resolve())
        values.pop("revision", None)  # resolved: the folder is the revision's snapshot
    return values


def start_frontend(args: argparse.Namespace, server: TritonServer, engine_args: dict,
                   key: str | None) -> subprocess.Popen | None:
    if getattr(args, "no_frontend", False):
        print("OpenAI frontend: off (--no-frontend); serving Triton only")
        return None
    try:
        present = importlib.util.find_spec(FRONTEND_MODULE) is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        print(f"OpenAI frontend: absent ({FRONTEND_MODULE} is not installed); serving Triton only")
        return None
    command = [sys.executable, "-m", FRONTEND_MODULE, "--host", args.host, "--port", str(args.port),
               "--grpc-url", server.grpc_url, "--model", engine_args["model"]]
    for name in ("served_model_name", "tokenizer", "max_model_len", "chat_template", "allowed_local_media_path",
                 "max_media_bytes", "media_fetch_timeout", "limit_mm_per_prompt"):
        if getattr(args, name, None) is not None:
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if engine_args.get("lora_modules"):  # the frontend serves each adapter as a model id
        command += ["--lora-modules", *(f"{name}={path}" for name, path in engine_args["lora_modules"].items())]
    if getattr(args, "allowed_media_domains", None):
        command += ["--allowed-media-domains", *args.allowed_media_domains]
    if getattr(args, "allow_private_media_hosts", False):
        command.append("--allow-private-media-hosts")
    if getattr(args, "log_requests", False):
        command.append("--log-requests")
    if getattr(args, "enable_prompt_tokens_details", False):
        command.append("--enable-prompt-tokens-details")
    command += ["--tool-call-parser", args.tool_call_parser]
    if getattr(args, "enable_auto_tool_choice", False):
        command.append("--enable-auto-tool-choice")
    if getattr(args, "reasoning_parser", None):
        command += ["--reasoning-parser", args.reasoning_parser]
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if key is not None:
        env[API_KEY_ENV] = key  # not on the command line, where `ps` shows it to everyone
    return popen_with_parent(command, env=env, start_new_session=True)


def wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
    raise RuntimeError(f"the OpenAI frontend did not come up at {url}")


def stop_process(process: subprocess.Popen | None, timeout: float = 30.0) -> None:
    if process is None or process.poll() is not None:
        return
    # SIGTERM, not SIGINT: a process started in the background inherits an ignored SIGINT.
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def ipaddress_is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shown(host: str) -> str:
    return "localhost" if host in ("0.0.0.0", "::") else host


def print_banner(args: argparse.Namespace, model_path: str, frontend, key: str | None) -> None:
    triton = shown(args.triton_host)
    print(f"\nTriton HTTP     http://{triton}:{args.http_port}  (model '{MODEL_NAME}'; no API key)")
    print(f"Triton gRPC     {triton}:{args.grpc_port}")
    print(f"Metrics         http://{triton}:{args.metrics_port}/metrics")
    if frontend is not None:
        host = shown(args.host)
        print(f"OpenAI API      http://{host}:{args.port}/v1" + ("  (API key required)" if key else ""))
        body = {"model": getattr(args, "served_model_name", None) or Path(model_path).name,
                "messages": [{"role": "user", "content": "What is Triton Inference Server?"}],
                "max_tokens": 64}
        auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if key else ""
        print(f"\ncurl http://{host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{json.dumps(body)}'")
    else:
        body = {"text_input": "Triton Inference Server is",
                "parameters": {"max_tokens": 64, "temperature": 0}}
        print(f"\ncurl http://{triton}:{args.http_port}/v2/models/{MODEL_NAME}/generate -d '{json.dumps(body)}'")
    print("\nCtrl-C stops everything.", flush=True)


def interrupt(signum, frame) -> None:
    """SIGTERM (docker stop, systemd) takes the same road as Ctrl-C."""
    raise KeyboardInterrupt


class StubWatch:
    """Notices a model's Python stub (llm's or embeddings') dying while tritonserver lives on.
    Triton restarts neither and keeps reporting the model ready: the llm's requests would hang, and
    the embeddings model would stay down (the frontend fails its requests and /health with a 503).
    serve exits non-zero instead, and its supervisor (systemd, Kubernetes, docker's restart policy)
    starts a fresh service. Reloading in-process is what issue 31 showed unsafe."""

    def __init__(self, server: TritonServer, explicit: bool) -> None:
        self.server, self.explicit = server, explicit
        self.pids = {model: set(server.stub_pids(model)) for model in WATCHED_MODELS}

    def dead(self) -> str | None:
        """The model whose stub died, if one did."""
        for model, known in self.pids.items():
            if not self.explicit:  # no load or unload can happen: the first stubs are the only ones
                if not all(map(self.alive, known)):
                    return model
                continue
            pids = set(self.server.stub_pids(model))
            if pids:  # an admin may reload: follow the current stub
                self.pids[model] = pids
            elif model_ready(self.server, model):  # no stub: an unload (not ready) or a death (ready)
                return model
        return None

    def alive(self, pid: int) -> bool:
        """Whether `pid` is still a live child of tritonserver: one small read, where stub_pids
        reads all of /proc (every 0.5 s for the life of the service)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ...
        return fields[0] != "Z" and self.server.process is not None and int(fields[1]) == self.server.process.pid


def model_ready(server: TritonServer, model: str = MODEL_NAME) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def run_serve(args: argparse.Namespace) -> int:
    try:
        engine_args = engine_arguments(args)
        key = api_key(args)
        chosen_admin_key = read_admin_key_file(args.admin_key_file) if args.admin_key_file else None
        if getattr(args, "chat_template", None) is not None:  # checked now, not after Triton loaded
            template = Path(args.chat_template).expanduser()
            if template.is_file():
                args.chat_template = str(template.resolve())
            elif "{" not in args.chat_template:
                raise ValueError(f"--chat-template: {args.chat_template!r} is neither a file nor a Jinja template")
    except (ValueError, OSError) as error:
        print(f"tritonllm serve: {error}", file=sys.stderr)
        return 2
    from tools.prepare_embeddings import prepare_embeddings
    prepare_embeddings()  # the `embeddings` model's weights, fetched once like the LLM's
    if key is None and not ipaddress_is_loopback(args.host):
        print(f"tritonllm serve: warning: the OpenAI frontend listens on {args.host} without an API key; "
              f"set ${API_KEY_ENV} or --api-key-file (docs/security.md)", file=sys.stderr)
    if not ipaddress_is_loopback(args.triton_host):
        print(f"tritonllm serve: warning: Triton's ports listen on {args.triton_host}; they take no API key "
              "(docs/security.md)", file=sys.stderr)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tritonllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    repository = write_model_repository(workdir / "model_repository", engine_args)
    log_file = workdir / "tritonserver.log"
    admin_key = chosen_admin_key or write_admin_key(workdir)
    server = TritonServer(repository, workdir, host=args.triton_host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_file=log_file,
                          extra_args=triton_arguments(args, admin_key))
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    frontend = None
    stop_timeout = 60.0  # Triton's graceful stop: in-flight requests finish, models unload
    if args.serving_sched == "batch":
        yield_to_compute()  # this thread starts Triton and the frontend: they inherit it
    print(f"starting tritonserver (log: {log_file}) with model {engine_args['model']}", flush=True)
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        watch = StubWatch(server, explicit=args.model_control == "explicit")
        frontend = start_frontend(args, server, engine_args, key)
        if frontend is not None:
            wait_http(f"http://{args.host}:{args.port}/health", frontend, timeout=120)
        print_banner(args, engine_args["model"], frontend, key)
        while server.process.poll() is None and (frontend is None or frontend.poll() is None):
            if (dead := watch.dead()) is not None:
                print(f"tritonllm serve: the '{dead}' model's Python stub died; stopping, so that a "
                      "supervisor can restart the service", file=sys.stderr, flush=True)
                stop_timeout = 5.0  # Triton cannot unload a model whose stub is gone
                return 1
            time.sleep(STUB_CHECK_S)
        print("a server exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"tritonllm serve: {error}", file=sys.stderr)
        return 1
    finally:
        stop_process(frontend)
        server.stop(stop_timeout)


def main(argv: list[str] | None = None) -> int:
    from tools.cli import main as cli_main
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
