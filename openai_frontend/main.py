"""`python -m openai_frontend`: serve the OpenAI API against one running Triton or several, on
uvicorn's HTTP/1.1 server with deadlines on reading each request (see TimedH11Protocol).

    python -m openai_frontend --grpc-url 127.0.0.1:8001 --port 9000 --model /path/to/hf-folder
    python -m openai_frontend --triton-url 10.0.0.5:8001 --triton-url 10.0.0.6:8001 --routing prefix
    python -m openai_frontend --triton-url dns:///tritonllm-triton:8001   # every address of the name
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import fields

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from backend.lora import RUNTIME_LORA_ENV

from openai_frontend.app import Settings, build_app
from openai_frontend.replicas import ROUTING
from openai_frontend.reasoning_parsers import PARSERS as REASONING_PARSERS
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
    "kv_events_endpoint": "with --routing prefix: a replica's KV-event endpoint (its engine's kv_events_config), "
                          "REPLICA=ENDPOINT (e.g. 10.0.0.5:8001=tcp://10.0.0.5:5557), or one ENDPOINT with {host} "
                          "for every replica (tcp://{host}:5557); the router then routes by what each replica's "
                          "prefix cache holds (default: none, first-block hashing)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require `Authorization: Bearer <key>` on every endpoint but /health (/ready, /live), /version, /metrics "
               f"and the API docs (default: ${API_KEY_ENV}, which `ps` does not show)",
    "model": "HF model folder: tokenizer, chat template, context length (default: the prepared SmolLM2)",
    "tokenizer": "tokenizer folder, if not the model's",
    "served_model_name": "the LLM's id for clients (default: the model folder's name)",
    "max_model_len": "the engine's context length, if set below the model's",
    "max_body_bytes": "largest request body accepted (413 above)",
    "embeddings_model_name": "the embeddings model's id for clients",
    "log_requests": "log prompts and completions (never logged otherwise)",
    "enable_prompt_tokens_details": "report usage.prompt_tokens_details.cached_tokens, the prompt tokens served "
                                    "from the prefix cache (vLLM's flag)",
    "chat_template": "a Jinja chat template, or a file holding one, used instead of the model's (vLLM's "
                     "--chat-template)",
    "lora_modules": "LoRA adapters to serve, each as a model id: name=path [name=path ...] (the Tritons must "
                    "serve them too: tritonllm serve --lora-modules passes them to both)",
    "allow_runtime_lora_updating": "add vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
                                   f"--api-key; also on with {RUNTIME_LORA_ENV}=true)",
    "tool_call_parser": "how tool calls are written in the model's output: hermes (<tool_call>{...}</tool_call>), "
                        "json, llama3_json, mistral or pythonic",
    "enable_auto_tool_choice": "tool_choice auto (the default when a request has tools): the model may call "
                               "tools, read from its text by --tool-call-parser (vLLM's flag; without it, 400)",
    "reasoning_parser": "how the model's thinking is written, to return it apart as `reasoning`: deepseek_r1 or "
                        "qwen3 (<think>...</think>; default: none, thinking stays in content)",
    "request_timeout": "seconds a whole request may take, streams included, before it fails with 504 and "
                       "Triton cancels it (default: none; requests stuck on a dead or frozen Triton fail "
                       "anyway, see docs/openai.md)",
    "header_timeout": "seconds a client has to send a request's headers, else 408 and the connection closed",
    "body_timeout": "seconds a client has to send a request's body once its headers are in, else 408 and the "
                    "connection closed",
    "write_timeout": "seconds a response may wait for a client that does not read it (a full send buffer), then "
                     "its request is cancelled, freeing its KV blocks, and the connection closed",
    "keep_alive_timeout": "seconds an idle connection is kept open between requests; keep it longer than the "
                          "clients' and any load balancer's idle timeout, so they close first",
    "prompt_as_text": "send each prompt to Triton as text (`text_input`, decoded from its token ids) with only the "
                      "inputs of Triton's own vLLM backend, serving it as the `llm` model; cache_salt is refused",
    "allowed_media_domains": "hosts whose http(s) image URLs are fetched, comma-separated or repeated (vLLM's flag; "
                             "default: none, remote images refused); only at public addresses, no redirects",
    "allow_private_media_hosts": "let those hosts resolve to private, loopback or link-local addresses (a trusted "
                                 "network, tests); off, such fetches are refused (SSRF)",
    "allowed_local_media_path": "file:// image URLs are read from under this folder, symlinks resolved (vLLM's "
                                "flag; default: none, refused)",
    "max_media_bytes": "largest image, as a data URL's bytes, a fetched body or a file",
    "media_fetch_timeout": "seconds to fetch one remote image, all of it",
    "limit_mm_per_prompt": "images a request may hold, as vLLM's JSON: '{\"image\": 2}' (default: 16, the llm "
                           "model's own bound)",
}
READ_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# What a connection buffers for a client that reads slower than the server writes: past it, writing
# waits (uvicorn's flow control) and the stream stops pulling from Triton. asyncio's default, made explicit.
WRITE_BUFFER_BYTES = 64 * 1024


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on reading a request and on writing a response, which
    uvicorn lacks (its timeout_keep_alive covers only the idle time between requests): the headers
    must arrive within `header_timeout` of the connection or of the request's first byte, the body
    within `body_timeout` of the headers. Past either the client gets a 408 (if no response has
    started) and the connection is closed, so slow or stalled clients cannot hold connections open.
    A response whose write buffer (WRITE_BUFFER_BYTES) stays full for `write_timeout`, a client that
    stopped reading, has its connection aborted: the app sees a disconnect, which cancels the
    request's Triton calls (and frees its KV blocks) as when the client leaves."""

    header_timeout = 10.0
    body_timeout = 30.0
    write_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self.reading: str | None = None  # "headers" or "body" while a deadline runs
        self.read_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None  # runs while the write buffer is full
        self.arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start reading the next, pipelined request
        self.follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self.arm(None)
        self.resume_writing()  # nothing waits to be written any more: no write deadline
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is past its high-water mark: the client is not keeping up."""
        super().pause_writing()
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.write_timeout, self.write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def write_expired(self) -> None:
        self.write_timer = None
        self.logger.info("%s:%d - closed: the client did not read its response for %g s", *(self.client or ("?", 0)),
                         self.write_timeout)
        self.transport.abort()  # close() would wait to send the buffer; connection_lost tells the app

    def follow(self) -> None:
        """Run the deadline that fits what is being read now, if any."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.reading != "body":
                self.arm("body")
        elif state is h11.IDLE:
            if self.reading is None and self.conn.trailing_data[0]:  # part of the next request is in
                self.arm("headers")
        else:
            self.arm(None)  # the request is in (or the connection is done): nothing to wait for

    def arm(self, reading: str | None) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
        self.reading, self.read_timer = reading, None
        if reading is not None:
            timeout = self.header_timeout if reading == "headers" else self.body_timeout
            self.read_timer = self.loop.call_later(timeout, self.expired)

    def expired(self) -> None:
        what, self.reading, self.read_timer = self.reading, None, None
        if self.transport.is_closing():
            return
        self.logger.debug("%s:%d - closed: request %s not received in time", *(self.client or ("?", 0)), what)
        if what == "headers" or not self.cycle.response_started:
            self.transport.write(READ_TIMEOUT_RESPONSE)
        if what == "body":  # the app waiting for the rest of the body sees a disconnect
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


def server_config(app, settings: Settings, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for the frontend: its address, the reading and writing deadlines and how long
    an idle connection is kept."""
    protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": settings.header_timeout,
                                                              "body_timeout": settings.body_timeout,
                                                              "write_timeout": settings.write_timeout})
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level, http=protocol,
                          timeout_keep_alive=settings.keep_alive_timeout)


def parse_settings(argv: list[str] | None = None) -> tuple[Settings, str]:
    parser = argparse.ArgumentParser(prog="openai_frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type.startswith("bool"):
            parser.add_argument(flag, action="store_true", help=HELP[f.name])
            continue
        if f.type.startswith(("list", "dict")):  # repeated, or several after one (vLLM's --lora-modules a=x b=y)
            parser.add_argument(flag, action="extend", nargs="+", default=[], help=HELP[f.name])
            continue
        kind = int if f.type.startswith("int") else float if f.type.startswith("float") else str
        default = os.environ.get(API_KEY_ENV) if f.name == "api_key" else f.default
        help_text = HELP[f.name] if "default" in HELP[f.name] else f"{HELP[f.name]} (default: {f.default})"
        parser.add_argument(flag, type=kind, default=default, help=help_text,
                            choices={"routing": ROUTING, "tool_call_parser": sorted(PARSERS),
                                     "reasoning_parser": sorted(REASONING_PARSERS)}.get(f.name))
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    try:
        settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
    except ValueError as error:  # lora_modules, read as Settings is built
        parser.error(str(error))
    return settings, args.log_level


def main(argv: list[str] | None = None) -> int:
    settings, log_level = parse_settings(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(settings)
    except ValueError as error:
        print(f"openai_frontend: {error}", file=sys.stderr)
        return 2
    uvicorn.Server(server_config(app, settings, log_level)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
