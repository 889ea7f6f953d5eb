"""The Litestar app (`build_app`) and the process that serves it (`run_server`)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, head, post
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, OpenAPIMediaType, Operation, Schema, SecurityScheme
from litestar.params import FromPath, JSONBody
from litestar.types import ASGIApp, Receive, Scope, Send

import jaxserve
from jaxserve.errors import ModelLoadError

from .args import ServerArgs
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embeddings
from .engine_runs import ClientDisconnected
from .lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .errors import APIError, error_response, exception_handler
from .metrics import CONTENT_TYPE, arrival_middleware
from .request_types import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                            TokenizeRequest)
from .response_types import (ChatCompletionResponse, CompletionResponse, DetokenizeResponse, ErrorResponse, ModelCard,
                             ModelList, TokenizeResponse, VersionResponse)
from .serving import Serving
from .tokenization import detokenize_tokens, tokenize_prompt
from .validation import check_model

log = logging.getLogger("jaxserve.server")

# Routes anyone may call without the API key (probes and scrapers), as in vLLM.
OPEN_PATHS = ("/health", "/version", "/metrics", "/schema", "/ping")
CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it, the access log does


def _json(obj: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _errors(*statuses: int) -> dict[int, ResponseSpec]:
    return {s: ResponseSpec(data_container=ErrorResponse, description="OpenAI error body") for s in statuses}


@dataclass
class StreamableOperation(Operation):
    """A route whose 200 answer is JSON, or SSE chunks (``text/event-stream``) when the request says stream=true:
    the schema lists both content types."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if ok is not None and getattr(ok, "content", None) is not None:
            # any event: the chunk objects, then the "[DONE]" sentinel, which is not JSON
            ok.content["text/event-stream"] = OpenAPIMediaType(schema=Schema(
                description="server-sent events: one JSON chunk object per event, then [DONE]"))


def tokenizer_config(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info body: the tokenizer's init kwargs (its tokenizer_config.json) without the
    local file paths, special tokens as their strings, plus ``tokenizer_class`` and the chat template."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if hasattr(value, "content"):      # tokenizers.AddedToken
            return value.content
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return str(value)

    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "tokenizer_object")}
    out = plain(config)
    out["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        out["chat_template"] = chat_template
    return out


def auth_middleware(api_key: str):
    """401 with an OpenAI body unless 'Authorization: Bearer <key>' matches (constant-time compare)."""
    expected = f"Bearer {api_key}".encode()
    body = msgspec.json.encode(APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                        code="invalid_api_key").body())

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            # CORS preflights carry no credentials by design; they must pass for browsers to send the real call
            if scope["type"] == "http" and scope["method"] != "OPTIONS" and not scope["path"].startswith(OPEN_PATHS):
                given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if not hmac.compare_digest(given, expected):
                    await send({"type": "http.response.start", "status": 401,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode()),
                                            (b"www-authenticate", b"Bearer")]})
                    await send({"type": "http.response.body", "body": body})
                    return
            await app(scope, receive, send)
        return middleware
    return factory


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    """--enable-request-id-headers (vLLM's): every response carries X-Request-Id, the request's own header
    or a new random one."""
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
            await send(message)
        await app(scope, receive, send_with_id)
    return middleware


def build_app(engine: Any, server_args: ServerArgs | None = None) -> Litestar:
    """The OpenAI-compatible app on top of an AsyncLLMEngine-like `engine` (see docs/design.md)."""
    args = server_args or ServerArgs()
    serving = Serving(engine, args)
    created = int(time.time())

    async def run(request: Request, work) -> Response:
        try:
            result = await work
        except ClientDisconnected:
            return Response(content=b"", status_code=CLIENT_CLOSED)
        return result if isinstance(result, Response) else _json(result)

    @post("/v1/chat/completions", status_code=200, operation_class=StreamableOperation,
          responses={200: ResponseSpec(ChatCompletionResponse, description="a completion, or SSE chunks when "
                                       "stream=true"), **_errors(400, 401, 404, 413, 429, 500)})
    async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response:
        return await run(request, create_chat_completion(serving, data, request.receive,
                                                         request.headers.get("x-request-id")))

    @post("/v1/completions", status_code=200, operation_class=StreamableOperation,
          responses={200: ResponseSpec(CompletionResponse, description="a completion, or SSE chunks when "
                                       "stream=true"), **_errors(400, 401, 404, 413, 429, 500)})
    async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response:
        return await run(request, create_completion(serving, data, request.receive,
                                                    request.headers.get("x-request-id")))

    @post("/v1/embeddings", status_code=200, responses=_errors(400, 401, 404, 413))
    async def embeddings(data: JSONBody[EmbeddingRequest]) -> Response:
        return _json(await create_embeddings(serving, data))

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, max_model_len=serving.max_model_len, root=serving.model_names[0])

    def adapter_card(name: str) -> ModelCard:
        lora = serving.loras.resolve(name)
        return ModelCard(id=name, created=created, max_model_len=serving.max_model_len, root=lora.lora_path,
                         parent=lora.base_model_name)

    @get("/v1/models")
    async def models() -> ModelList:
        return ModelList([model_card(name) for name in serving.model_names] +
                         [adapter_card(name) for name in serving.loras.by_name])

    # `path`: served names are often "org/name"; OpenAI's retrieve-model route
    @get("/v1/models/{model_id:path}", responses=_errors(401, 404))
    async def retrieve_model(model_id: FromPath[str]) -> ModelCard:
        name = model_id.lstrip("/")
        check_model(serving, name)
        return model_card(name) if name in serving.model_names else adapter_card(name)

    @get("/tokenizer_info", responses=_errors(401))
    async def tokenizer_info() -> Response:
        return _json(tokenizer_config(serving.tokenizer, serving.prompts.chat_template))

    @post("/tokenize", status_code=200, responses=_errors(400, 401, 404))
    async def tokenize(data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
        return await tokenize_prompt(serving, data)

    @post("/detokenize", status_code=200, responses=_errors(400, 401, 404))
    async def detokenize(data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
        return detokenize_tokens(serving, data)

    @post("/v1/load_lora_adapter", status_code=200, media_type=MediaType.TEXT, responses=_errors(400, 401))
    async def load_lora_adapter(data: JSONBody[LoadLoRAAdapterRequest]) -> str:
        return await serving.loras.load(data.lora_name, data.lora_path)

    @post("/v1/unload_lora_adapter", status_code=200, media_type=MediaType.TEXT, responses=_errors(400, 401, 404))
    async def unload_lora_adapter(data: JSONBody[UnloadLoRAAdapterRequest]) -> str:
        return serving.loras.unload(data.lora_name)

    # with --api-key the schema says so (a bearer scheme on every route but the open ones)
    auth = dict(security=[{}]) if args.api_key else {}

    @get("/health", media_type=MediaType.TEXT, responses=_errors(503), **auth)
    async def health() -> Response:
        if serving.runs.draining:
            return error_response(APIError(503, "the server is shutting down", code="draining"))
        if not engine.is_healthy():
            return error_response(APIError(503, "the engine loop is dead or stuck", code="engine_unhealthy"))
        return Response(content=b"", status_code=200, media_type=MediaType.TEXT)   # 200, empty (vLLM's)

    @get("/version", **auth)
    async def version() -> VersionResponse:
        return VersionResponse(jaxserve.__version__)

    # the header given whole: as a media_type Litestar would append a second "; charset=utf-8"
    @get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(content=serving.metrics.render(), headers={"content-type": CONTENT_TYPE})

    @head("/metrics", include_in_schema=False)   # scrapers' and load balancers' liveness probe
    async def metrics_head() -> Response[None]:
        return Response(content=None, headers={"content-type": CONTENT_TYPE})

    # the arrival stamp first: time to first token counts from the request's arrival (metrics)
    middleware = [arrival_middleware, *([request_id_middleware] if args.enable_request_id_headers else []),
                  *([auth_middleware(args.api_key)] if args.api_key else [])]
    cors = None
    if args.allowed_origins:
        cors = CORSConfig(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                          allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app = Litestar(
        route_handlers=[chat_completions, completions, embeddings, models, tokenize, detokenize, health, version,
                        metrics, metrics_head, retrieve_model,
                        *([tokenizer_info] if args.enable_tokenizer_info_endpoint else []),
                        *([load_lora_adapter, unload_lora_adapter] if serving.loras.runtime_updates else [])],
        exception_handlers={Exception: exception_handler, HTTPException: exception_handler},
        middleware=middleware,
        cors_config=cors,
        request_max_body_size=args.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="jaxserve", version=jaxserve.__version__, path="/schema",
            **(dict(security=[{"bearer": []}],
                    components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}))
               if args.api_key else {})),
        logging_config=None,
    )
    app.state.serving = serving
    return app


# ---------------------------------------------------------------------------------------------------
# the process


def run_server(engine_config: Any, server_args: ServerArgs) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain in-flight requests, exit 0. The engine core runs in
    its own process (JAXSERVE_ENABLE_MULTIPROCESSING=0: in this one); if it dies, every in-flight request gets
    an error, /health answers 503, and the server stops and exits 1 (a supervisor restarts it). With
data-parallel replicas, one that dies fails only its requests and /health answers 503 while the others serve
on; the server exits 1 once none is left."""
    import uvicorn

    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.engine.core_client import use_multiprocess
    from jaxserve.utils import startup_timeline

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    startup_timeline.record_imports()
    # bind before the (minutes-long) load so a busy port fails at once; listen() comes with uvicorn
    sock = _bind(server_args.host, server_args.port)
    t0 = time.monotonic()
    try:
        engine = AsyncLLMEngine(engine_config, multiprocess=use_multiprocess(None, default=True,
                                                                             config=engine_config))
    except ModelLoadError as e:
        sock.close()
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 1
    app = build_app(engine, server_args)
    serving: Serving = app.state.serving
    from jaxserve.engine.gc_heap import prepare_gc_for_serving
    prepare_gc_for_serving()           # start-up's objects out of the collector's passes (gc_heap)
    facts = engine.facts()
    log.info("loaded %s from %s (%s, %s): max_model_len %d, %s KV blocks of %d tokens; load %.1f s, warm-up "
             "(the first-needed step variants; the others compile in the background) %.1f s, ready in %.1f s; "
             "engine core %s", serving.model_name,
             facts.model_source, facts.load_format, facts.dtype_name, serving.max_model_len,
             facts.num_kv_blocks if facts.num_kv_blocks is not None else "no", facts.config.cache.block_size,
             facts.load_seconds,
             facts.warmup_seconds, time.monotonic() - t0,
             _core_processes(engine.engine.client) if engine.multiprocess else "in this process")
    log.info("start-up timeline: %s", startup_timeline.summary())

    from .http_protocol import timed_http_protocol
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, loop="uvloop",
                            http=timed_http_protocol(server_args.read_timeout),
                            log_level=server_args.uvicorn_log_level, access_log=not server_args.disable_uvicorn_access_log,
                            root_path=server_args.root_path or "", timeout_graceful_shutdown=server_args.drain_timeout,
                            lifespan="off")
    server = _DrainingServer(config, serving)

    def on_engine_dead() -> None:       # the engine thread: streams have their errors; stop serving
        server.should_exit = True
    engine.on_dead = on_engine_dead
    if engine.dead:
        on_engine_dead()
    server.run(sockets=[sock])
    if engine.dead:
        log.error("the engine died; the server exits 1")
        engine.shutdown(drain_timeout=0)
        return 1
    log.info("HTTP server stopped; stopping the engine")
    engine.shutdown(drain_timeout=min(server_args.drain_timeout, 5.0))
    log.info("bye")
    return 0


def _core_processes(client: Any) -> str:
    replicas = getattr(client, "replicas", None)        # data-parallel replicas (engine.dp_client)
    if replicas is None:
        return f"in its own process (pid {client.process.pid})"
    return f"in {len(replicas)} data-parallel replica processes (pids {', '.join(str(r.process.pid) for r in replicas)})"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"jaxserve serve: cannot listen on {host}:{port}: {e.strerror or e} "
                         f"(choose another --port or stop what uses it)") from None
    sock.set_inheritable(True)
    return sock


class _DrainingServer:
    """uvicorn.Server that marks /health 503 on SIGTERM/SIGINT, lets uvicorn finish in-flight requests up
    to the drain timeout, and does not re-raise the signal afterwards (so the process exits 0)."""

    def __new__(cls, config, serving):
        import uvicorn

        class Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # uvicorn < 0.29
                self._install()

            def capture_signals(self):  # uvicorn >= 0.29 re-raises captured signals on exit; we do not
                import contextlib

                @contextlib.contextmanager
                def handlers():
                    self._install()
                    yield
                return handlers()

            def _install(self) -> None:
                loop = asyncio.get_event_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.add_signal_handler(sig, self._on_signal, sig)

            def _on_signal(self, sig) -> None:
                if serving.runs.draining:  # a second signal: stop now
                    self.force_exit = True
                else:
                    serving.runs.start_drain(config.timeout_graceful_shutdown or 0.0)
                log.info("%s: no new connections; finishing in-flight requests (up to %.0f s)",
                         signal.Signals(sig).name, config.timeout_graceful_shutdown or 0)
                self.should_exit = True

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started:
                    log.info("ready: http://%s:%d/v1 serving %s", config.host, config.port,
                             ", ".join(serving.model_names))

        return Server(config)
