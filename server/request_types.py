"""The OpenAI request bodies (plus vLLM's extra fields) as msgspec Structs.

A request field this server does not implement is a 400 naming it (``forbid_unknown_fields`` on each request
body; ``request_fields`` lists them all for the message), never silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
MAX_REQUEST_ID_CHARS = 512
LogitBias = Annotated[dict[str, float], Meta(extra_json_schema={
    "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 300,
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})]


# ---------------------------------------------------------------------------------------------------
# shared request pieces


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(Struct, kw_only=True):
    """OpenAI's ``response_format.json_schema`` (``strict`` true: its objects are closed whatever the server's
    default, ``--structured-outputs-config`` ``disable_additional_properties``)."""
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema; vLLM's
    ``structural_tag`` (free text whose segments that start with a trigger follow their schemas)."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None      # structural_tag: [{begin, schema, end}]
    triggers: list[str] | None = None                   # structural_tag


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` extra body: exactly one constraint (unknown keys are a 400, not ignored),
    and ``disable_additional_properties`` (true: the JSON schema's objects are closed whatever the server's
    default)."""
    CONSTRAINTS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_additional_properties: bool | None = None


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields chat and completions requests share: OpenAI's, then vLLM's extras (same names)."""
    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    max_tokens: NonNegInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = 0.0
    # token id (JSON keys are strings) -> bias: SamplingParams checks both, naming a bad entry; the schema says so
    logit_bias: LogitBias | None = None
    # OpenAI's fields that cannot change the output: accepted (typed, so a bad value is still a 400) and
    # ignored, each named once in a warning (request_fields.IGNORED_FIELDS)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    # vLLM's extras
    # the response id's tail (an X-Request-Id header wins), as vLLM: "chatcmpl-{request_id}", "cmpl-{request_id}"
    request_id: Annotated[str, Meta(max_length=MAX_REQUEST_ID_CHARS)] | None = None
    allowed_token_ids: Annotated[list[NonNegInt], Meta(min_length=1)] | None = None
    bad_words: list[Annotated[str, Meta(pattern=r"\S")]] | None = None     # a word is never blank
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    # each prompt token's logprob and top-k (-1: max_logprobs); answered whole, not streamed
    prompt_logprobs: Annotated[int, Meta(ge=-1)] | None = None
    return_token_ids: bool | None = None            # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:{id}"
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # beam search (server/beam_search.py): the n choices are the n best beams; a beam's score is its summed
    # logprob over its generated length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # lower first under --scheduling-policy priority (any other value is a 400 under fcfs, as vLLM's)
    priority: int = 0
    # the request's prefix-cache namespace: requests with different salts never share cached blocks
    cache_salt: str | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: up to max_model_len), before anything else reads it
    truncate_prompt_tokens: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None




# ---------------------------------------------------------------------------------------------------
# chat completions


class TextContentPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageURL(Struct, kw_only=True):
    url: str
    detail: Literal["auto", "low", "high"] | None = None     # accepted, as OpenAI's; the model's processing decides


class ImageURLContentPart(Struct, tag="image_url", tag_field="type"):
    image_url: ImageURL


class FunctionCallIn(Struct, kw_only=True):
    name: str
    arguments: str = "{}"    # a JSON object as text, as the model returned it


class ToolCallIn(Struct, kw_only=True):
    """An earlier assistant turn's tool call, sent back in the history."""
    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"


class PredictedOutput(Struct, kw_only=True):
    """OpenAI's ``prediction`` (predicted outputs): a latency hint, it never changes the output."""
    type: Literal["content"]
    content: str | list[TextContentPart]


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageURLContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None    # assistant turns that called tools
    tool_call_id: str | None = None               # role "tool": the call this result answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def num_images(self) -> int:
        return 0 if not isinstance(self.content, list) else \
            sum(isinstance(part, ImageURLContentPart) for part in self.content)


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema
    # the schema is enforced where the output is constrained (named and required tool_choice); strict true
    # closes its objects (no undeclared keys) whatever the server's default
    strict: bool | None = None


class ChatTool(Struct, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[ChatTool] | None = None
    # None: "auto" when tools are sent, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the chat template holds BOS and friends, so none are added to the rendered prompt unless asked
    add_special_tokens: bool = False
    echo: bool = False            # the reply starts with the last message's content when it has the reply's role
    documents: list[dict[str, str]] | None = None    # passed to the chat template (RAG templates read them)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # a chat template variable (vLLM's); "none" turns thinking off (reasoning.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True      # --reasoning-parser: false drops the thinking part from the answer
    prediction: PredictedOutput | None = None     # ignored (request_fields.IGNORED_FIELDS)

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer OpenAI name; it wins when both are sent
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort (vLLM passes it so)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def requested_logprobs(self) -> int | None:
        """Top logprobs per token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None



# ---------------------------------------------------------------------------------------------------
# completions


class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type per union, so the
    # items are a union and `prompt_batch()` checks the list is homogeneous.
    prompt: str | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0)] | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def scores_prompt(self) -> bool:
        """echo + logprobs: the prompt's tokens are scored too (prompt logprobs: what lm-eval's loglikelihood
        tasks send, often with max_tokens=0 = score only); answered whole, not streamed."""
        return bool(self.echo and self.logprobs is not None)

    def prompt_batch(self) -> list[str | list[int]]:
        """The prompts as a list of texts or a list of token-id lists; ValueError if mixed."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in p):
            if any(len(x) == 0 for x in p):  # type: ignore[arg-type]
                raise ValueError("prompt: a token-id prompt must not be empty")
            return list(p)  # type: ignore[arg-type]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of token-id lists (not a mix)")



# ---------------------------------------------------------------------------------------------------
# tokenize, embeddings


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize takes either a completion-style `prompt` or chat `messages` (with the `tools` the chat
    template renders)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False




class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[NonNegInt]
    model: str | None = None




class EmbeddingRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PosInt | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the first N tokens (-1 = the model's limit)

