"""The request fields a route's type lacks, and what this server makes of them (the 400's message)."""
from __future__ import annotations

import msgspec
from msgspec import Struct

from .request_types import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                            TokenizeRequest)


# OpenAI's and vLLM's request fields this server knows of and does not implement: named as such in the 400
NOT_IMPLEMENTED = frozenset({
    "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "store", "metadata",
    "service_tier", "reasoning_effort", "verbosity", "web_search_options", "prompt_cache_key", "safety_identifier",
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "priority",
    "request_id", "logits_processors", "documents", "mm_processor_kwargs", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "include_reasoning",
    "prompt_embeds", "echo", "add_special_tokens", "media_io_kwargs",
})

REQUEST_BODIES: dict[str, type[Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
}


def unknown_fields(path: str, body: bytes | None) -> list[str]:
    """The top-level fields of a JSON ``body`` sent to ``path`` that its request type lacks (empty when the
    body is no JSON object or the path takes none)."""
    cls = REQUEST_BODIES.get(path)
    if cls is None or not body:
        return []
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return []
    if not isinstance(obj, dict):
        return []
    known = set(cls.__struct_fields__)
    return [k for k in obj if k not in known]


def unknown_fields_message(fields: list[str]) -> str:
    """OpenAI's "Unrecognized request argument supplied" for each field, with what this server makes of it."""
    named = ", ".join(f"`{f[:100]}`" for f in fields[:20]) + (f" and {len(fields) - 20} more" if len(fields) > 20 else "")
    known = [f for f in fields if f in NOT_IMPLEMENTED]
    why = (f"; {', '.join(f'`{f}`' for f in known)} {'is' if len(known) == 1 else 'are'} not implemented by this "
           "server" if known else "")
    return (f"Unrecognized request argument{'s' if len(fields) > 1 else ''} supplied: {named}{why}. This server "
            "answers 400 rather than ignore a field it does not implement: remove "
            f"{'it' if len(fields) == 1 else 'them'} from the request.")
