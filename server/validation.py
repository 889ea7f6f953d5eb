"""The checks a request passes before any work (rendering, tokenizing, the engine): the model name, field
combinations each route refuses, the request's tools, admission (prompts x n against the server's limits),
and the warning that names an ignored field."""
from __future__ import annotations

import logging
from typing import Any

from jaxserve.engine.structured_output import check_tools
from jaxserve.errors import InvalidRequestError

from .errors import bad_request, model_not_found
from .request_fields import IGNORED_FIELDS
from .request_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, SamplingFields, TokenizeRequest
from .serving import Serving
from .tool_parsers.choice import ToolPlan, ToolRequestError, checked_tools, plan_tools

log = logging.getLogger("jaxserve.server")


def check_model(serving: Serving, name: str | None) -> None:
    if name is not None and name not in serving.model_names and serving.loras.resolve(name) is None:
        raise model_not_found(name)


def warn_ignored_fields(serving: Serving, req: Any) -> None:
    """One warning per ignored field name (request_fields.IGNORED_FIELDS), the first time a request sends it."""
    for name in IGNORED_FIELDS:
        if getattr(req, name, None) is not None and name not in serving.ignored_fields_named:
            serving.ignored_fields_named.add(name)
            log.warning("a request sent `%s`, which this server accepts and ignores (it cannot change the output); "
                        "this is said once per field", name)


def check_capacity(serving: Serving, num_requests: int, param: str = "n") -> None:
    """Admission for the whole request (prompts x n) before any work: 400 above --max-request-choices
    or if it can never fit the engine, 429 if not now."""
    limit = serving.args.max_request_choices
    if num_requests > limit:
        raise bad_request(f"this request asks for {num_requests} choices (prompts x n), more than the "
                          f"server's --max-request-choices {limit}; split it", param)
    serving.engine.check_admission(num_requests)


def check_unstreamed(req: SamplingFields) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is supported without stream only", "prompt_logprobs")


def check_chat_request(serving: Serving, req: ChatCompletionRequest) -> ToolPlan:
    """The request's use of tools (checked), once the request may run."""
    check_model(serving, req.model)
    warn_ignored_fields(serving, req)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    check_unstreamed(req)
    try:
        check_tools(req.tools, serving.structured_limits)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          enable_auto_tool_choice=serving.args.enable_auto_tool_choice,
                          parser_cls=serving.tool_parser_cls, closed_by_default=serving.closes_objects)
    except (ToolRequestError, InvalidRequestError) as e:
        raise bad_request(str(e), e.param) from None
    check_capacity(serving, req.n)
    return plan


def check_completion_request(serving: Serving, req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts (texts or token-id lists), once the request may run."""
    check_model(serving, req.model)
    warn_ignored_fields(serving, req)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    if req.scores_prompt() and req.stream:
        raise bad_request("echo with logprobs is supported without stream only", "stream")
    check_unstreamed(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
    try:
        batch = req.prompt_batch()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from e
    check_capacity(serving, len(batch) * req.n)
    return batch


def check_embedding_request(serving: Serving, req: EmbeddingRequest) -> list[str | list[int]]:
    """The inputs (texts or token-id lists)."""
    check_model(serving, req.model)
    warn_ignored_fields(serving, req)
    inputs = req.input
    if isinstance(inputs, str):
        batch: list = [inputs]
    elif all(isinstance(x, int) for x in inputs):
        batch = [list(inputs)]
    else:
        batch = list(inputs)
    if any(isinstance(x, int) for x in batch):
        raise bad_request("input must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists (not a mix)", "input")
    return batch


def check_tokenize_request(serving: Serving, req: TokenizeRequest) -> list[dict] | None:
    """The tools to render with the messages (checked as chat's are), or None."""
    check_model(serving, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if not req.tools:
        return None
    if req.messages is None:
        raise bad_request("tools are rendered by the chat template: send them with messages, not prompt", "tools")
    try:
        return checked_tools(req.tools)
    except ToolRequestError as e:
        raise bad_request(str(e), e.param) from None
