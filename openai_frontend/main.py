"""`python -m openai_frontend`: serve the OpenAI API against one running Triton or several.

    python -m openai_frontend --grpc-url 127.0.0.1:8001 --port 9000 --model /path/to/hf-folder
    python -m openai_frontend --triton-url 10.0.0.5:8001 --triton-url 10.0.0.6:8001 --routing prefix
    python -m openai_frontend --triton-url dns:///tritonllm-triton:8001   # every address of the name
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields

from openai_frontend.app import Settings, build_app
from openai_frontend.replicas import ROUTING
from openai_frontend.tool_parsers import PARSERS

API_KEY_ENV = "TRITONLLM_API_KEY"
HELP = {
    "grpc_url": "one Triton's gRPC address (host:port); the same as one --triton-url (default: none)",
    "triton_url": "a Triton replica's gRPC address, host:port, or dns:///name:port for every address the "
                  "name resolves to (a Kubernetes headless Service), re-resolved every 2 s; repeat for "
                  "more (default: 127.0.0.1:8001)",
    "triton_urls_file": "a file with one such address a line (# comments), re-read every 2 s",
    "routing": "how a request picks a replica: least-outstanding, prefix (the prompt's first blocks pick "
               "a replica, so shared system prompts hit its prefix cache) or round-robin",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on every endpoint but /health, /version, /metrics "
               f"and the API docs (default: ${API_KEY_ENV}, which `ps` does not show)",
    "model": "HF model folder: tokenizer, chat template, context length (default: the prepared SmolLM2)",
    "tokenizer": "tokenizer folder, if not the model's",
    "served_model_name": "the LLM's id for clients (default: the model folder's name)",
    "max_model_len": "the engine's context length, if set below the model's",
    "max_body_bytes": "largest request body accepted (413 above)",
    "embeddings_model_name": "the embeddings model's id for clients",
    "log_requests": "log prompts and completions (never logged otherwise)",
    "lora_modules": "LoRA adapters to serve, each as a model id: name=path [name=path ...] (the Tritons must "
                    "serve them too: tritonllm serve --lora-modules passes them to both)",
    "allow_runtime_lora_updating": "add vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
                                   "--api-key; also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    "tool_call_parser": "how tool calls are written in the model's output: hermes (<tool_call>{...}</tool_call>) "
                        "or json",
}


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, str]:
    parser = argparse.ArgumentParser(prog="openai_frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type.startswith("bool"):
            parser.add_argument(flag, action="store_true", help=HELP[f.name])
            continue
        if f.type.startswith("list"):  # repeated, or several after one flag (vLLM's --lora-modules a=x b=y)
            parser.add_argument(flag, action="extend", nargs="+", default=[], help=HELP[f.name])
            continue
        kind = int if f.type.startswith("int") else str
        default = os.environ.get(API_KEY_ENV) if f.name == "api_key" else f.default
        help_text = HELP[f.name] if "default" in HELP[f.name] else f"{HELP[f.name]} (default: {f.default})"
        parser.add_argument(flag, type=kind, default=default, help=help_text,
                            choices={"routing": ROUTING, "tool_call_parser": sorted(PARSERS)}.get(f.name))
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)}), args.log_level


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    settings, log_level = parse_settings(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(settings)
    except ValueError as error:
        print(f"openai_frontend: {error}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
