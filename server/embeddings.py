"""POST /v1/embeddings: tokenize the inputs, embed them in the engine, answer floats or base64."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np

from .errors import bad_request
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .serving import Serving


async def create_embeddings(serving: Serving, data: EmbeddingRequest) -> EmbeddingResponse:
    serving.check_model(data.model)
    inputs = data.input
    if isinstance(inputs, str):
        batch: list = [inputs]
    elif all(isinstance(x, int) for x in inputs):
        batch = [list(inputs)]
    else:
        batch = list(inputs)
    if any(isinstance(x, int) for x in batch):
        raise bad_request("input must be a string, a list of strings, a list of token ids or a list of "
                          "token-id lists (not a mix)", "input")
    # truncating the tokens after: no character bound (the engine keeps the last ones)
    what = "input" if data.truncate_prompt_tokens is None else None
    token_lists = [(await serving.encode(x, what=what)) if isinstance(x, str) else list(x) for x in batch]
    kw: dict[str, Any] = {"dimensions": data.dimensions}
    if data.truncate_prompt_tokens is not None:
        kw["truncate_prompt_tokens"] = data.truncate_prompt_tokens
    # the engine says "the loaded model does not support embeddings" (400) when it generates text
    vectors = await serving.engine.embed(token_lists, **kw)
    items = []
    for i, v in enumerate(vectors):
        v = np.asarray(getattr(getattr(v, "outputs", None), "embedding", v), dtype=np.float32)
        emb: Any = base64.b64encode(v.tobytes()).decode() if data.encoding_format == "base64" else v.tolist()
        items.append(EmbeddingData(i, emb))
    n = sum(len(t) for t in token_lists)
    return EmbeddingResponse(data.model or serving.model_name, items, EmbeddingUsage(n, n))
