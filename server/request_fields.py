"""What this server makes of a request field it does not act on: ignored (it cannot change the output;
named once in a warning), or a 400 naming it (it would change the output and is not implemented, or it is
unknown)."""
from __future__ import annotations

import msgspec
from msgspec import Struct

from .request_types import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                            TokenizeRequest)


# OpenAI's fields that cannot change the output: the request types declare them (typed), the routes ignore
# them and name each in a warning the first time a request sends it. verbosity is a hint OpenAI's own models
# read and no chat template does; prediction (predicted outputs) is a latency hint whose output is the same.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                  "prompt_cache_options", "safety_identifier", "verbosity", "prediction")

# OpenAI's and vLLM's request fields this server knows of and does not implement (each would change the
# output): named as such in the 400
NOT_IMPLEMENTED = frozenset({
    "functions", "function_call", "audio", "modalities", "moderation", "web_search_options",
    "logits_processors", "mm_processor_kwargs",
    "kv_transfer_params", "vllm_xargs", "guided_decoding_backend",
    "guided_whitespace_pattern", "prompt_embeds",
    "media_io_kwargs",
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
            "answers 400 rather than ignore a field that could change the output: remove "
            f"{'it' if len(fields) == 1 else 'them'} from the request.")
