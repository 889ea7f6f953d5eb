"""POST /v1/embeddings: check the request, tokenize the inputs, embed them in the engine, answer floats or
base64."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from .request_types import EmbeddingRequest
from .response_types import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from .serving import Serving
from .validation import check_embedding_request


async def create_embeddings(serving: Serving, req: EmbeddingRequest) -> EmbeddingResponse:
    batch = check_embedding_request(serving, req)
    # truncating the tokens after: no character bound (the engine keeps the last ones)
    what = "input" if req.truncate_prompt_tokens is None else None
    token_lists = [(await serving.prompts.encode(x, what=what)) if isinstance(x, str) else list(x) for x in batch]
    kw: dict[str, Any] = {"dimensions": req.dimensions}
    if req.truncate_prompt_tokens is not None:
        kw["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    # the engine says "the loaded model does not support embeddings" (400) when it generates text
    vectors = await serving.engine.embed(token_lists, **kw)
    return embedding_response(serving, req, token_lists, vectors)


def embedding_response(serving: Serving, req: EmbeddingRequest, token_lists: list[list[int]],
                       vectors: list[Any]) -> EmbeddingResponse:
    items = []
    for i, v in enumerate(vectors):
        v = np.asarray(getattr(getattr(v, "outputs", None), "embedding", v), dtype=np.float32)
        emb: Any = base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        items.append(EmbeddingData(i, emb))
    n = sum(len(t) for t in token_lists)
    return EmbeddingResponse(req.model or serving.model_name, items, EmbeddingUsage(n, n))
