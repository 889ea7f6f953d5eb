"""What every route shares: the engine, the server's flags and model names, the metrics, and the helpers below
the routes that hold state (the prompt renderer, the engine runs, token names)."""
from __future__ import annotations

from typing import Any

from jaxserve.config_decoding import StructuredOutputsLimits

from .args import ServerArgs, resolve_tool_parser
from .engine_runs import EngineRuns
from .logprobs import TokenNames
from .lora_adapters import LoRAAdapters
from .metrics import ServerMetrics
from .prompts import PromptRenderer
from .reasoning import REASONING_PARSERS


class Serving:
    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = int(engine.max_model_len)
        self.model_names: list[str] = list(args.served_model_name or [engine.served_model_name])
        self.model_name = self.model_names[0]
        self.max_logprobs = int(getattr(engine, "max_logprobs", None) or 20)
        # the engine's limits on a request's constraint and tools (--structured-outputs-config)
        manager = getattr(engine, "structured_output", None)
        self.structured_limits = manager.limits if manager is not None else StructuredOutputsLimits()
        self.closes_objects = manager.builder.disable_additional_properties if manager is not None else True
        self.metrics = ServerMetrics(engine, self.model_name, args.metrics_prefix)
        self.tool_parser_cls = resolve_tool_parser(args)   # --tool-call-parser (None: no auto tool choice)
        # --reasoning-parser (None: no thinking part is split off)
        self.reasoning_parser_cls = REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None
        # its end marker's token ids: a constrained answer's grammar starts after them
        self.reasoning_end_token_ids: list[int] | None = list(self.tokenizer.encode(
            self.reasoning_parser_cls.end, add_special_tokens=False)) if self.reasoning_parser_cls else None
        self.prompts = PromptRenderer(engine, args)
        self.runs = EngineRuns(engine, args, self.metrics)
        self.token_names = TokenNames(self.tokenizer)
        self.ignored_fields_named: set[str] = set()        # each ignored request field is warned of once
        self.loras = LoRAAdapters(engine, self.model_names, args.lora_modules)   # adapters served by name
