"""`tritonllm serve`: one command from a model folder to a running tritonserver (and the OpenAI
frontend, when it is installed), shut down cleanly on Ctrl-C or SIGTERM.

The engine flags (tools/cli.py) are EngineConfig's fields with dashes (`--max-model-len`,
`--block-size`, ...), the names vLLM's `serve` uses; the given ones are written into the runtime
copy of model_repository/llm/1/model.json. No `--model` means the prepared default (SmolLM2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
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
from tools.triton_server import MODEL_NAME, TritonServer, write_model_repository

FRONTEND_MODULE = "openai_frontend.main"
API_KEY_ENV = "TRITONLLM_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers' flags; the engine's (one per EngineConfig field) come from tools.cli."""
    servers = parser.add_argument_group("servers")
    servers.add_argument("--host", default="127.0.0.1",
                         help="address every server listens on (0.0.0.0 in a container)")
    servers.add_argument("--port", type=int, default=9000, help="OpenAI frontend port")
    servers.add_argument("--http-port", type=int, default=8000, help="Triton HTTP port")
    servers.add_argument("--grpc-port", type=int, default=8001, help="Triton gRPC port")
    servers.add_argument("--metrics-port", type=int, default=8002, help="Triton metrics port")
    servers.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                         help=f"OpenAI frontend: require `Authorization: Bearer <key>` (default: ${API_KEY_ENV})")
    servers.add_argument("--log-requests", action="store_true",
                         help="OpenAI frontend: log prompts and completions (never logged otherwise)")
    servers.add_argument("--tool-call-parser", default="hermes", choices=("hermes", "json"),
                         help="the model's tool-call format, for the OpenAI frontend's tools support")
    servers.add_argument("--workdir", type=Path, default=None,
                         help="where the runtime model repository and Triton's log go (default: a temp folder)")
    servers.add_argument("--ready-timeout", type=float, default=600.0,
                         help="seconds to wait for the model to load")


def engine_arguments(args: argparse.Namespace) -> dict:
    """The engine flags that were given, validated; the default model is prepared if none was."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
             if getattr(args, f.name, None) is not None}
    config = EngineConfig.from_dict(given)  # ValueError naming the field, before Triton starts
    values = {name: getattr(config, name) for name in given}  # cast: "1024" -> 1024
    if config.model is None:
        from tools.prepare_model import prepare_model
        values["model"] = str(prepare_model())
    else:
        values["model"] = str(Path(config.model).expanduser().resolve())
    return values


def start_frontend(args: argparse.Namespace, server: TritonServer,
                   engine_args: dict) -> subprocess.Popen | None:
    try:
        present = importlib.util.find_spec(FRONTEND_MODULE) is not None
    except ModuleNotFoundError:
        present = False
    if not present:
        print(f"OpenAI frontend: absent ({FRONTEND_MODULE} is not installed); serving Triton only")
        return None
    command = [sys.executable, "-m", FRONTEND_MODULE, "--host", args.host, "--port", str(args.port),
               "--grpc-url", server.grpc_url, "--model", engine_args["model"]]
    for name in ("served_model_name", "tokenizer", "max_model_len"):
        if getattr(args, name, None) is not None:
            command += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if engine_args.get("lora_modules"):  # the frontend serves each adapter as a model id
        command += ["--lora-modules", *(f"{name}={path}" for name, path in engine_args["lora_modules"].items())]
    if getattr(args, "log_requests", False):
        command.append("--log-requests")
    command += ["--tool-call-parser", args.tool_call_parser]
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if args.api_key is not None:
        env[API_KEY_ENV] = args.api_key  # not on the command line, where `ps` shows it to everyone
    return subprocess.Popen(command, env=env, start_new_session=True)


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


def print_banner(args: argparse.Namespace, model_path: str, frontend) -> None:
    host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    print(f"\nTriton HTTP     http://{host}:{args.http_port}  (model '{MODEL_NAME}')")
    print(f"Triton gRPC     {host}:{args.grpc_port}")
    print(f"Metrics         http://{host}:{args.metrics_port}/metrics")
    if frontend is not None:
        print(f"OpenAI API      http://{host}:{args.port}/v1")
        body = {"model": getattr(args, "served_model_name", None) or Path(model_path).name,
                "messages": [{"role": "user", "content": "What is Triton Inference Server?"}],
                "max_tokens": 64}
        print(f"\ncurl http://{host}:{args.port}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{json.dumps(body)}'")
    else:
        body = {"text_input": "Triton Inference Server is",
                "parameters": {"max_tokens": 64, "temperature": 0}}
        print(f"\ncurl http://{host}:{args.http_port}/v2/models/{MODEL_NAME}/generate -d '{json.dumps(body)}'")
    print("\nCtrl-C stops everything.", flush=True)


def interrupt(signum, frame) -> None:
    """SIGTERM (docker stop, systemd) takes the same road as Ctrl-C."""
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    try:
        engine_args = engine_arguments(args)
    except ValueError as error:
        print(f"tritonllm serve: {error}", file=sys.stderr)
        return 2
    from tools.prepare_embeddings import prepare_embeddings
    prepare_embeddings()  # the `embeddings` model's weights, fetched once like the LLM's
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tritonllm-"))
    repository = write_model_repository(workdir / "model_repository", engine_args)
    log_file = workdir / "tritonserver.log"
    # Explicit model control lets the model unload itself if its engine fails (so it reads as
    # not ready); every model in the repository is loaded at start.
    server = TritonServer(repository, workdir, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_file=log_file,
                          extra_args=["--model-control-mode=explicit", "--load-model=*"])
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    frontend = None
    print(f"starting tritonserver (log: {log_file}) with model {engine_args['model']}", flush=True)
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        frontend = start_frontend(args, server, engine_args)
        if frontend is not None:
            wait_http(f"http://{args.host}:{args.port}/health", frontend, timeout=120)
        print_banner(args, engine_args["model"], frontend)
        while server.process.poll() is None and (frontend is None or frontend.poll() is None):
            time.sleep(0.5)
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
        server.stop()


def main(argv: list[str] | None = None) -> int:
    from tools.cli import main as cli_main
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
