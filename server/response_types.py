"""The OpenAI response bodies (plus vLLM's extra fields) as msgspec Structs.

Responses always carry every field the OpenAI SDK models declare, with explicit nulls, so clients never guess.
"""
from __future__ import annotations

import time
import uuid

from msgspec import Struct, field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_ids(prefix: str, header: str | None, field: str | None) -> tuple[str, str]:
    """A response's id and the base of its engine request ids. vLLM's id: ``{prefix}-{X-Request-Id}``, else
    ``{prefix}-{request_id}`` (the body's field), else a random one. A client's id need not be unique, the
    engine's must: its engine ids carry a random suffix (vLLM's internal ids do too)."""
    given = header or field
    if not given:
        rid = random_id(prefix)
        return rid, rid
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------------
# chat completions


class PromptLogprob(Struct):
    """vLLM's Logprob as its server writes it: one candidate token at one prompt position."""
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt position, None for the first, else {token id: PromptLogprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatLogprobTop(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop]


class ChatLogprobs(Struct):
    content: list[ChatLogprobToken] | None


class FunctionCallOut(Struct):
    name: str
    arguments: str           # a JSON object as text


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class ChatResponseMessage(Struct):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    # --reasoning-parser: the thinking part, under DeepSeek's name and vLLM's newer one (clients read either)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionResponse(Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: Usage
    created: int = field(default_factory=now)
    object: str = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A streamed piece of a tool call: the first has id, type and name; later ones argument text."""
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None     # as ChatResponseMessage's
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None          # return_token_ids: this chunk's tokens


class ChatCompletionChunk(Struct):
    id: str
    model: str
    choices: list[ChatChunkChoice]
    created: int
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids: in the first chunk


# ---------------------------------------------------------------------------------------------------
# completions


class CompletionLogprobs(Struct):
    text_offset: list[int] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None   # return_token_ids (in a stream: its first chunk)
    token_ids: list[int] | None = None          # return_token_ids (in a stream: this chunk's)


class CompletionResponse(Struct):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    created: int = field(default_factory=now)
    object: str = "text_completion"
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------------------------------
# models, tokenize, embeddings, version, errors


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "jaxserve"
    root: str | None = None
    parent: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"
    id: str = field(default_factory=lambda: random_id("embd"))
    created: int = field(default_factory=now)


class VersionResponse(Struct):
    version: str


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


