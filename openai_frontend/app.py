"""The FastAPI app: settings, the shared state every router reads, the edge checks (API key, body
size and encoding) and the mapping of every failure to OpenAI's error envelope."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from backend.lora import RUNTIME_LORA_ENV, parse_lora_modules, runtime_lora_updating
from backend.model_paths import EMBEDDINGS_MODEL_NAME, prepared_default_model

from openai_frontend.errors import OpenAIError, invalid, model_not_found, validation_error
from openai_frontend.generation import CLIENT_GONE, ClientDisconnected
from openai_frontend.kv_index import KVEventIndex, parse_endpoints
from openai_frontend.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_MEDIA_BYTES, MediaPolicy, images_per_prompt
from openai_frontend.metrics import FrontendMetrics, MetricsMiddleware
from openai_frontend.prompts import PromptBuilder
from openai_frontend.replicas import DNS_PREFIX, ROUTING, Replicas
from openai_frontend.routers import chat, completions, embeddings, lora, models, responses, system, tokenize

DEFAULT_TRITON_URL = "127.0.0.1:8001"
# Open without the API key: probes and scrapers. Everything else (every /v1 route) needs it.
PUBLIC_PATHS = frozenset({"/health", "/health/ready", "/health/live", "/version", "/metrics", "/openapi.json",
                          "/docs", "/redoc"})
logger = logging.getLogger(__name__)


@dataclass
class Settings:
    """The frontend's knobs; the CLI flags carry the same names. `model`, `tokenizer`,
    `served_model_name` and `max_model_len` mean what they mean in EngineConfig. The Tritons are
    every `grpc_url`, `triton_url` and line of `triton_urls_file` (127.0.0.1:8001 if none)."""
    grpc_url: str | None = None  # one Triton's gRPC address: a triton_url by its older name
    triton_url: list[str] = field(default_factory=list)  # `host:port`, or `dns:///name:port` for all its addresses
    triton_urls_file: str | None = None  # one address a line; re-read every few seconds
    routing: str = "least-outstanding"  # or `prefix` (cache-aware), `round-robin`
    # Replicas' KV events for `prefix` routing: `host:port=tcp://host:port` pairs, or one endpoint with {host}
    kv_events_endpoint: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 9000
    api_key: str | None = None
    model: str | None = None  # HF folder: tokenizer, chat template, context length; default: the prepared SmolLM2
    tokenizer: str | None = None
    served_model_name: str | None = None  # default: the model folder's name
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_body_bytes: int = 1 << 20
    embeddings_model_name: str = EMBEDDINGS_MODEL_NAME
    log_requests: bool = False  # log prompts and completions (clients' data: off unless asked)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    chat_template: str | None = None  # a Jinja chat template, or a file holding one, instead of the model's
    tool_call_parser: str = "hermes"  # the model's tool-call format (openai_frontend/tool_parsers.py)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (the default with tools): calls read from free text
    reasoning_parser: str | None = None  # the model's thinking format (openai_frontend/reasoning_parsers.py)
    # Adapters served as model ids: `name=path` pairs (the CLI's) or any form EngineConfig's lora_modules
    # takes, {name: absolute path} once constructed (the engine's parser: one reading of the knob).
    lora_modules: dict[str, str] = field(default_factory=dict)
    # vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter (they load files: API key required)
    allow_runtime_lora_updating: bool = False
    request_timeout: float | None = None  # seconds for a whole request (Triton cancels it past them); none
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    body_timeout: float = 30.0  # seconds a client has to send a request's body, once its headers are in
    write_timeout: float = 30.0  # seconds a response may wait for a client that reads nothing; then cancelled
    # Seconds an idle connection is kept between requests. Longer than clients' own idle pools (httpx's,
    # so the openai SDK's, 5 s; aiohttp's 15 s) and load balancers' (60 s), so the client closes first:
    # uvicorn's 5 s closed connections a client had just sent a request on (it got a reset), and after
    # the frontend was paused (a stalled host, a long GC) longer than that, every request sent meanwhile.
    keep_alive_timeout: int = 65
    prompt_as_text: bool = False  # the llm model is Triton's own vLLM backend: text prompts, its inputs only
    # Images in chat content (openai_frontend/media.py): data URLs always; these open other sources.
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts of http(s) image URLs; none: refused
    allow_private_media_hosts: bool = False  # those hosts may resolve to private addresses (a trusted network)
    allowed_local_media_path: str | None = None  # file:// image URLs under this folder
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES  # each image, however it comes
    media_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S  # seconds for one remote image, all of it
    limit_mm_per_prompt: str | None = None  # vLLM's JSON, '{"image": 2}'; default: the llm model's bound (16)

    def __post_init__(self) -> None:
        self.lora_modules = parse_lora_modules(self.lora_modules)  # EngineError (a ValueError) naming lora_modules

    def resolved(self) -> "Settings":
        model = self.model
        if model is None:
            model = str(prepared_default_model())
        model = str(Path(model).expanduser())
        if self.routing not in ROUTING:
            raise ValueError(f"routing: one of {', '.join(ROUTING)}, got {self.routing!r}")
        for name in ("request_timeout", "header_timeout", "body_timeout", "write_timeout", "keep_alive_timeout",
                     "media_fetch_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive seconds, got {getattr(self, name)}")
        parse_endpoints(self.kv_events_endpoint)  # ValueError naming it
        if self.kv_events_endpoint and self.routing != "prefix":
            raise ValueError("kv_events_endpoint: the replicas' KV events serve --routing prefix")
        if self.triton_urls_file is not None and not Path(self.triton_urls_file).is_file():
            raise ValueError(f"triton_urls_file: {self.triton_urls_file} is not a file")
        for url in self.triton_urls():
            if not url.removeprefix(DNS_PREFIX).rpartition(":")[2].isdigit():
                raise ValueError(f"triton_url: `{url}` needs a port (host:port or dns:///name:port)")
        if self.max_media_bytes < 1:
            raise ValueError(f"max_media_bytes: must be positive, got {self.max_media_bytes}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path: {self.allowed_local_media_path} is not a folder")
        images_per_prompt(self.limit_mm_per_prompt)  # ValueError naming it
        allow_updates = self.allow_runtime_lora_updating or runtime_lora_updating()
        if allow_updates and not self.api_key:
            raise ValueError(f"allow_runtime_lora_updating ({RUNTIME_LORA_ENV}): the endpoints load files, "
                             "so they need an API key (--api-key)")
        return Settings(**{**self.__dict__, "model": model, "allow_runtime_lora_updating": allow_updates,
                           "served_model_name": self.served_model_name or Path(model).name})

    def triton_urls(self) -> list[str]:
        urls = [*([self.grpc_url] if self.grpc_url else []), *self.triton_url]
        return urls or ([] if self.triton_urls_file else [DEFAULT_TRITON_URL])


class Frontend:
    """What the routers share: settings, prompt building, the Triton replicas, the rules for images
    and the metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.prompts = PromptBuilder(settings.model, settings.tokenizer, settings.max_model_len,
                                     settings.chat_template)
        # Connected inside the event loop (lifespan); TritonClient's calls, routed.
        self.triton = Replicas(settings.triton_urls(), settings.routing, settings.triton_urls_file,
                               settings.request_timeout,
                               self.prompts.tokenizer.decode if settings.prompt_as_text else None,
                               KVEventIndex(*parse_endpoints(settings.kv_events_endpoint))
                               if settings.kv_events_endpoint else None)
        self.media = MediaPolicy.from_settings(settings)
        self.metrics = FrontendMetrics(self.triton)
        self.started = int(time.time())
        # LoRA adapters served as model ids: name -> (path, registered at runtime). The Triton model
        # knows the static ones by name; a runtime one travels with its path.
        self.loras: dict[str, tuple[str, bool]] = {name: (path, False) for name, path in settings.lora_modules.items()}

    def check_llm_model(self, name: str) -> dict[str, str]:
        """The sampling parameters that pick the model: {} for the base, the adapter's for a LoRA."""
        if name == self.settings.served_model_name:
            return {}
        if name in self.loras:
            path, runtime = self.loras[name]
            return {"lora_name": name, "lora_path": path} if runtime else {"lora_name": name}
        if name == self.settings.embeddings_model_name:
            raise invalid("model", f"model: `{name}` is an embeddings model; use /v1/embeddings")
        raise model_not_found(name)

    def check_embeddings_model(self, name: str) -> None:
        if name == self.settings.embeddings_model_name:
            return
        if name == self.settings.served_model_name:
            raise invalid("model", f"model: `{name}` is not an embeddings model; "
                                   f"use `{self.settings.embeddings_model_name}`")
        raise model_not_found(name)


async def send_error(send, error: OpenAIError, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error.body()).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in {**error.headers(), **(headers or {})}.items()]
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


def digest(secret: bytes) -> bytes:
    # Comparing fixed-size digests keeps the comparison's time independent of the key's length too.
    return hashlib.sha256(secret).digest()


class EdgeMiddleware:
    """ASGI middleware, before any parsing: 401 for every path but PUBLIC_PATHS without the API key
    (when one is set); 413 for bodies over max_body_bytes, declared or not (the body is read here,
    up to the limit, then handed on); 400 for a body that is not UTF-8."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.api_key_digest = None if api_key is None else digest(api_key.encode())

    def authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        matches = hmac.compare_digest(digest(token.strip()), self.api_key_digest)
        return matches and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        too_large = OpenAIError(413, f"The request body exceeds {self.max_body_bytes} bytes.", None,
                                "request_too_large")
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return await send_error(send, too_large)
        if self.api_key_digest is not None and scope["path"] not in PUBLIC_PATHS \
                and not self.authorized(headers):
            return await send_error(send, OpenAIError(
                401, "Incorrect or missing API key; send it as `Authorization: Bearer <key>`.",
                None, "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await send_error(send, too_large)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as error:
            return await send_error(send, invalid(None, f"The request body is not valid UTF-8 "
                                                        f"({error.reason} at byte {error.start})."))

        async def replay_body():
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the disconnect, if it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay_body, send)


def build_app(settings: Settings) -> FastAPI:
    settings = settings.resolved()
    frontend = Frontend(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await frontend.triton.start()
        yield
        await frontend.triton.close()

    app = FastAPI(title="tritonllm OpenAI-compatible API", version=system.package_version(), lifespan=lifespan)
    app.state.frontend = frontend
    for router in (models, completions, chat, responses, embeddings, system, tokenize):
        app.include_router(router.router)
    if settings.allow_runtime_lora_updating:  # never without an API key (Settings.resolved)
        app.include_router(lora.router)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_, error: OpenAIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, error: RequestValidationError):
        return validation_error(error).response()

    @app.exception_handler(HTTPException)
    async def on_http_error(_, error: HTTPException):
        if error.status_code == 400 and error.detail == "There was an error parsing the body":
            # FastAPI's words for a body json.loads gave up on without a JSONDecodeError.
            return invalid(None, "The request body could not be parsed as JSON (nested too deeply?).").response()
        return OpenAIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(ClientDisconnected)
    async def on_client_gone(_, error: ClientDisconnected):
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request, error: Exception):
        # The traceback, never the body: request bodies hold clients' prompts.
        logger.exception("%s %s failed", request.method, request.url.path)
        return OpenAIError(500, f"internal error: {type(error).__name__}").response()

    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes, api_key=settings.api_key)
    app.add_middleware(MetricsMiddleware, metrics=frontend.metrics)
    return app
