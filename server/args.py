"""Server options (vLLM's flag names where vLLM has the flag) and the argparse flags the CLI adds."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from jaxserve import envs
from jaxserve.options import add_options, from_namespace, option

from .reasoning import REASONING_PARSERS


def _json_list(value: str) -> list[str]:
    try:
        out = json.loads(value)
    except json.JSONDecodeError:
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(out, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return [str(v) for v in out]


def _tools(default, help: str, **kw):
    return option(default, help=help, group="tool calling", **kw)


@dataclass
class ServerArgs:
    host: str = option("127.0.0.1", help="address to bind")
    port: int = option(8000, help="port to bind")
    api_key: str | None = option(
        None, help="require 'Authorization: Bearer KEY' on every API route (also $JAXSERVE_API_KEY / $VLLM_API_KEY)")
    served_model_name: list[str] | None = option(
        None, nargs="+", help="model name(s) the API answers to; the first is reported (default: the model's "
                              "path/name)")
    metrics_prefix: str = option(
        "jaxserve", choices=("jaxserve", "vllm"),
        help="prefix of the Prometheus metric names; 'vllm' matches vLLM's Grafana dashboards")
    max_body_bytes: int = option(8 * 1024 * 1024, help="largest request body accepted, in bytes (413 above)")
    drain_timeout: float = option(30.0, help="on SIGTERM, seconds to let in-flight requests finish")
    read_timeout: float = option(
        30.0, help="seconds a client may take to send a request's headers and body, and an idle new connection "
                   "to start one (408 and closed after)")
    max_request_choices: int = option(1024, help="most choices one request may ask for: prompts x n (400 above)")
    allowed_origins: list[str] = option(default_factory=list, type=_json_list,
                                        help="CORS origins, JSON list or comma separated (none: no CORS headers)")
    allow_credentials: bool = option(False, help="CORS: allow credentials")
    allowed_methods: list[str] = option(default_factory=lambda: ["*"], type=_json_list, help="CORS methods")
    allowed_headers: list[str] = option(default_factory=lambda: ["*"], type=_json_list, help="CORS headers")
    root_path: str | None = option(None, help="ASGI root_path when behind a path-based proxy")
    response_role: str = option("assistant", help="role of the generated chat message")
    uvicorn_log_level: str = option("info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                                    help="uvicorn's log level")
    disable_uvicorn_access_log: bool = option(False, help="no per-request access log lines")
    trust_request_chat_template: bool = option(
        False, help="accept a request's chat_template (a Jinja program run on this server; refused with a 400 "
                    "without this flag, as in vLLM)")
    enable_tokenizer_info_endpoint: bool = option(
        False, help="serve GET /tokenizer_info (the tokenizer's config and chat template, as vLLM does; "
                    "lm-eval's local-completions tokenizer backend reads it)")
    enable_request_id_headers: bool = option(
        False, help="answer every request with an X-Request-Id header: the request's own, else a new one (vLLM's)")
    enable_log_requests: bool = option(
        False, help="log each request: its prompt (cut to --max-log-len), sampling parameters and prompt token ids")
    max_log_len: int | None = option(
        None, help="with --enable-log-requests: how many prompt characters and token ids a log line shows "
                   "(default all)")
    enable_auto_tool_choice: bool = _tools(
        False, "let the model call tools on its own (tool_choice 'auto'); needs --tool-call-parser")
    tool_call_parser: str | None = _tools(
        None, "how the model writes tool calls: hermes (Qwen2.5/3, Hermes), llama3_json (Llama 3.x), mistral, "
              "pythonic (Llama 3.2/4 pythonic), qwen3_xml (Qwen3-Coder), or a name from --tool-parser-plugin",
        metavar="NAME")
    tool_parser_plugin: str | None = _tools(
        None, "a Python file whose @register_tool_parser classes become --tool-call-parser names", metavar="FILE")
    lora_modules: list[str] | None = option(
        None, nargs="+", metavar="NAME=PATH", group="LoRA adapters",
        help="LoRA adapters served by name with --enable-lora: name=path, or vLLM's JSON form "
             '\'{"name": "a", "path": "/p", "base_model_name": "m"}\' (requests name one as their model)')
    reasoning_parser: str | None = option(
        None, choices=tuple(REASONING_PARSERS), metavar="NAME", group="reasoning",
        help="split a thinking model's output at </think> into message.reasoning_content and content (chat, "
             "streamed as delta.reasoning_content): deepseek_r1 (DeepSeek-R1 and its distills, QwQ), qwen3 "
             "(Qwen3; a tool call inside the thinking part also ends it)")


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server flags to ``parser`` (the ``serve`` sub-command's), declared by ServerArgs."""
    return add_options(parser, ServerArgs, "server")


def server_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """Pick the ServerArgs fields out of parsed CLI args (missing ones keep their defaults)."""
    d = ServerArgs()
    args = from_namespace(ServerArgs, ns)
    if args.api_key is None:
        args.api_key = envs.JAXSERVE_API_KEY or envs.VLLM_API_KEY
    if isinstance(args.served_model_name, str):
        args.served_model_name = [args.served_model_name]
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
