"""Request -> SamplingParams, in one place: the token budget (max_tokens against max_model_len), the sampling
fields, the output constraint (``response_format``, ``structured_outputs``, ``guided_*``, or the one a tool
plan needs), and that constraint compiled before the response starts."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams, check_seed

from .engine_runs import Prompt, race_disconnect
from .errors import APIError, bad_request
from .request_types import SamplingFields, StructuredOutputs
from .serving import Serving
from .tool_parsers.choice import ToolPlan

MAX_LOGIT_BIAS_TOKENS = 300     # OpenAI's limit on logit_bias entries


def structured_outputs_from_request(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from ``response_format``, ``structured_outputs`` or a ``guided_*`` field
    (vLLM's rules: at most one of them); None without one. Raises a 400 naming the conflicting fields."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema (the JSON schema)",
                              "response_format")
        found.append(("response_format", {"json": rf.json_schema.schema,
                                          "disable_additional_properties": rf.json_schema.strict is True}))
    elif rf is not None and rf.type == "structural_tag":
        found.append(("response_format", {"structural_tag": {"structures": rf.structures, "triggers": rf.triggers}}))
    so = req.structured_outputs
    if so is not None:
        given = {name: getattr(so, name) for name in StructuredOutputs.CONSTRAINTS
                 if getattr(so, name) is not None and getattr(so, name) is not False}
        if len(given) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, "
                              f"json_object, structural_tag; got {', '.join(given) or 'none'}", "structured_outputs")
        if so.disable_additional_properties:
            given["disable_additional_properties"] = True
        found.append(("structured_outputs", given))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint per request; got {' and '.join(n for n, _ in found)}",
                          found[1][0])
    field_name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(str(e), field_name) from e



def resolve_max_tokens(serving: Serving, num_prompt_tokens: int, requested: int | None, what: str) -> int:
    """OpenAI's context-length check, naming both numbers; default = what is left of max_model_len."""
    max_model_len = serving.max_model_len
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; your "
                                f"{what} has {num_prompt_tokens} tokens, which leaves no room for a completion.",
                           param=what, code="context_length_exceeded")
        return room
    if num_prompt_tokens + requested > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {what}, "
                            f"{requested} in the completion). Please reduce the length of the {what} or "
                            f"max_tokens.", param=what, code="context_length_exceeded")
    return requested


def request_constraint(req: SamplingFields, tools: ToolPlan | None = None,
                       reasoning_end: list[int] | None = None) -> StructuredOutputsParams | None:
    """The request's output constraint, built once for all its prompts and choices: the one a tool plan's
    named or required tool_choice needs, else the request's own (both is a 400). ``reasoning_end``: the
    end-of-thinking marker's token ids of an answer that thinks first (the constraint holds after them)."""
    own = structured_outputs_from_request(req)
    planned = tools.structured_outputs() if tools is not None else None
    if planned is not None and own is not None and tools.mode == "auto":
        planned = None              # auto's calls go unconstrained where the request constrains the text
    if planned is not None and own is not None:
        raise bad_request(f"tool_choice {tools.mode!r} constrains the output to tool calls; it cannot be combined "
                          "with another output constraint (response_format / structured_outputs)", "tool_choice")
    constraint = planned if planned is not None else own
    if constraint is not None and reasoning_end:
        constraint = dataclasses.replace(constraint, reasoning_end_token_ids=list(reasoning_end))
    return constraint


def sampling_params(serving: Serving, req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    constraint: StructuredOutputsParams | None, tools: ToolPlan | None = None,
                    score_prompt: bool = False) -> list[SamplingParams]:
    """One prompt's SamplingParams, one per choice (``req.n``; choice i samples with ``seed + i``).
    ``logprobs``: top logprobs per token (None: none); ``constraint``: ``request_constraint``'s;
    ``tools``: a chat request's tool plan; ``score_prompt``: echo + logprobs, which scores the prompt's
    tokens with at least ``logprobs`` alternatives. The prompt is scored once, by the first choice (the
    others share its prompt: the response carries its logprobs once)."""
    try:
        check_seed(req.seed, req.n)
    except ValueError as e:
        raise bad_request(str(e), "seed") from None
    out = []
    for i in range(req.n):
        params = choice_params(serving, req, max_tokens=max_tokens, choice_index=i, logprobs=logprobs,
                               constraint=constraint)
        if i > 0:
            params.prompt_logprobs = None
        elif score_prompt and params.prompt_logprobs != -1:
            params.prompt_logprobs = max(logprobs, params.prompt_logprobs or 0)
        if tools is not None and tools.needs_special_tokens:    # markers such as [TOOL_CALLS] are special tokens
            params.skip_special_tokens = False
        out.append(params)
    return out


def check_logprobs(serving: Serving, req: SamplingFields, logprobs: int | None) -> None:
    """The request's top logprobs per token against the server's --max-logprobs."""
    if logprobs is not None and logprobs > serving.max_logprobs:
        raise bad_request(f"at most {serving.max_logprobs} logprobs per token are supported, got {logprobs}",
                          "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs")


def choice_params(serving: Serving, req: SamplingFields, *, max_tokens: int, choice_index: int,
                  logprobs: int | None, constraint: StructuredOutputsParams | None) -> SamplingParams:
    check_logprobs(serving, req, logprobs)
    if req.prompt_logprobs is not None and req.prompt_logprobs > serving.max_logprobs:
        raise bad_request(f"at most {serving.max_logprobs} prompt logprobs per token are supported, got "
                          f"{req.prompt_logprobs}", "prompt_logprobs")
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(req.logit_bias)}",
                          "logit_bias")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kw: dict[str, Any] = dict(
        n=1,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,  # -1 ("off", vLLM's) and < -1 (a 400) are SamplingParams' call
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=None if req.seed is None or req.seed == -1 else req.seed + choice_index,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=constraint,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
    )
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                          "min_tokens")
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # SamplingParams' messages start with the field they are about
        param = getattr(e, "param", None) or str(e).split(" ", 1)[0]
        raise bad_request(str(e), param if param.isidentifier() else None) from e


async def compile_structured_outputs(serving: Serving, prompts: list[Prompt], receive) -> None:
    """Await the verdict on the request's constraint (compiled on the grammar workers, once per distinct
    constraint), so a schema, regex or grammar that does not compile or exceeds a limit is a 400 before any
    response header. A client that leaves meanwhile gives up its interest: a compile nobody else waits for
    is dropped before it starts."""
    manager = getattr(serving.engine, "structured_output", None)
    specs = {id(c.params.structured_outputs): c.params.structured_outputs
             for p in prompts for c in p.choices if c.params.structured_outputs is not None}
    if manager is None or not specs:
        return
    futures = [asyncio.wrap_future(manager.submit(spec)) for spec in specs.values()]
    try:
        await race_disconnect(receive, asyncio.gather(*futures))
    except InvalidRequestError as e:
        raise bad_request(e.message, e.param) from None
    finally:
        for f in futures:               # (wrapped: cancelling one cancels this asker's compile future)
            f.cancel()
