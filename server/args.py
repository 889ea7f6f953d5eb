"""Server options (vLLM's flag names where vLLM has the flag) and the argparse flags the CLI adds."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

from jaxserve import envs


@dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None                      # also read from $JAXSERVE_API_KEY / $VLLM_API_KEY
    served_model_name: list[str] | None = None      # None: the engine's name for the model
    max_waiting_requests: int | None = None         # 429 once this many requests wait; None = no limit
    metrics_prefix: str = "jaxserve"                # "vllm" emits vllm:* names for existing dashboards
    max_body_bytes: int = 8 * 1024 * 1024           # 413 above this
    drain_timeout: float = 30.0                     # SIGTERM: seconds to finish in-flight requests
    read_timeout: float = 30.0                      # a request's head and body must arrive within this (408)
    max_request_choices: int = 1024                 # prompts x n in one request (400 above)
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty = no CORS headers
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    root_path: str | None = None
    response_role: str = "assistant"
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    enable_log_requests: bool = False               # log each request's prompt and parameters (vLLM's)
    max_log_len: int | None = None                  # characters / token ids of a logged prompt (None: all)
    enable_auto_tool_choice: bool = False           # let the model decide to call tools (tool_choice "auto")
    tool_call_parser: str | None = None             # how to read calls from its output: hermes, mistral, ...
    tool_parser_plugin: str | None = None           # a Python file registering more parsers
    trust_request_chat_template: bool = False       # let a request's chat_template run (vLLM's; off: a 400)
    enable_tokenizer_info_endpoint: bool = False    # GET /tokenizer_info (vLLM's; off: it shows the chat template)


def _json_list(value: str) -> list[str]:
    try:
        out = json.loads(value)
    except json.JSONDecodeError:
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(out, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return [str(v) for v in out]


def _add(parser: argparse.ArgumentParser, flag: str, **kw) -> None:
    """Add a flag unless the CLI already defines it (some, like --served-model-name, are shared)."""
    if flag in parser._option_string_actions:
        return
    parser.add_argument(flag, **kw)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server flags to `parser` (the `serve` sub-command's). Defaults come from ServerArgs."""
    d = ServerArgs()
    g = parser.add_argument_group("server")
    _add(g, "--host", default=d.host, help="address to bind (default %(default)s)")
    _add(g, "--port", type=int, default=d.port, help="port to bind (default %(default)s)")
    _add(g, "--api-key", default=None,
         help="require 'Authorization: Bearer KEY' on every API route (also $JAXSERVE_API_KEY)")
    _add(g, "--served-model-name", nargs="+", default=None,
         help="model name(s) the API answers to; the first is reported (default: the model's path/name)")
    _add(g, "--max-waiting-requests", type=int, default=None,
         help="answer 429 when this many requests are waiting (default: no limit)")
    _add(g, "--metrics-prefix", choices=["jaxserve", "vllm"], default=d.metrics_prefix,
         help="prefix of the Prometheus metric names; 'vllm' matches vLLM's Grafana dashboards")
    _add(g, "--max-body-bytes", type=int, default=d.max_body_bytes,
         help="largest request body accepted, in bytes (413 above; default %(default)s)")
    _add(g, "--drain-timeout", type=float, default=d.drain_timeout,
         help="on SIGTERM, seconds to let in-flight requests finish (default %(default)s)")
    _add(g, "--read-timeout", type=float, default=d.read_timeout,
         help="seconds a client may take to send a request's headers and body, and an idle new connection to "
              "start one (408 and closed after; default %(default)s)")
    _add(g, "--max-request-choices", type=int, default=d.max_request_choices,
         help="most choices one request may ask for: prompts x n (400 above; default %(default)s)")
    _add(g, "--allowed-origins", type=_json_list, default=[], help="CORS origins, JSON list or comma separated")
    _add(g, "--allow-credentials", action="store_true", help="CORS: allow credentials")
    _add(g, "--allowed-methods", type=_json_list, default=d.allowed_methods, help="CORS methods")
    _add(g, "--allowed-headers", type=_json_list, default=d.allowed_headers, help="CORS headers")
    _add(g, "--root-path", default=None, help="ASGI root_path when behind a path-based proxy")
    _add(g, "--response-role", default=d.response_role, help="role of the generated chat message")
    _add(g, "--uvicorn-log-level", default=d.uvicorn_log_level,
         choices=["critical", "error", "warning", "info", "debug", "trace"])
    _add(g, "--disable-uvicorn-access-log", action="store_true", help="no per-request access log lines")
    _add(g, "--trust-request-chat-template", action="store_true",
         help="accept a request's chat_template (a Jinja program run on this server; refused with a 400 "
              "without this flag, as in vLLM)")
    _add(g, "--enable-tokenizer-info-endpoint", action="store_true",
         help="serve GET /tokenizer_info (the tokenizer's config and chat template, as vLLM does; lm-eval's "
              "local-completions tokenizer backend reads it)")
    _add(g, "--enable-log-requests", action="store_true",
         help="log each request: its prompt (cut to --max-log-len), sampling parameters and prompt token ids")
    _add(g, "--max-log-len", type=int, default=None,
         help="with --enable-log-requests: how many prompt characters and token ids a log line shows (default all)")
    t = parser.add_argument_group("tool calling")
    _add(t, "--enable-auto-tool-choice", action="store_true",
         help="let the model call tools on its own (tool_choice 'auto'); needs --tool-call-parser")
    _add(t, "--tool-call-parser", default=None, metavar="NAME",
         help="how the model writes tool calls: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), mistral, "
              "pythonic (Llama 3.2/4 pythonic), qwen3_xml (Qwen3-Coder), or a name from --tool-parser-plugin")
    _add(t, "--tool-parser-plugin", default=None, metavar="FILE",
         help="a Python file whose @register_tool_parser classes become --tool-call-parser names")
    return parser


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """Pick the ServerArgs fields out of parsed CLI args (missing ones keep their defaults)."""
    d = ServerArgs()
    kw = {f.name: getattr(ns, f.name) for f in fields(ServerArgs) if getattr(ns, f.name, None) is not None}
    args = ServerArgs(**kw)
    if args.api_key is None:
        args.api_key = envs.JAXSERVE_API_KEY or envs.VLLM_API_KEY
    if isinstance(args.served_model_name, str):
        args.served_model_name = [args.served_model_name]
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if "*" in args.allowed_origins and args.allow_credentials:
        raise SystemExit("jaxserve serve: --allowed-origins '*' with --allow-credentials is a combination browsers "
                         "refuse (the CORS spec forbids credentials with a wildcard origin); list the origins "
                         "explicitly, or drop --allow-credentials")
    if args.max_body_bytes <= 0:
        args.max_body_bytes = d.max_body_bytes
    if args.read_timeout <= 0:
        raise SystemExit(f"jaxserve serve: --read-timeout must be positive, got {args.read_timeout}")
    if args.max_request_choices < 1:
        raise SystemExit(f"jaxserve serve: --max-request-choices must be at least 1, got {args.max_request_choices}")
    try:
        resolve_tool_parser(args)   # before the model loads: a typo'd parser name fails in a second
    except (KeyError, ValueError, ImportError, OSError) as e:
        raise SystemExit(f"jaxserve serve: {e.args[0] if isinstance(e, KeyError) else e}") from None
    return args


_plugins_loaded: set[str] = set()


def resolve_tool_parser(args: ServerArgs) -> type | None:
    """The ToolParser class --tool-call-parser names (importing --tool-parser-plugin first), or None."""
    from .tool_parsers import get_tool_parser, import_tool_parser_plugin
    if args.tool_parser_plugin:
        path = os.path.abspath(args.tool_parser_plugin)
        if path not in _plugins_loaded:
            import_tool_parser_plugin(path)
            _plugins_loaded.add(path)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (how to read the model's calls)")
    return get_tool_parser(args.tool_call_parser) if args.tool_call_parser else None
