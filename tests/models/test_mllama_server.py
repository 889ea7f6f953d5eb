"""Llama 3.2 Vision through the real server (`jaxserve serve` of the tiny checkpoint, CPU) with the openai SDK:
HF's greedy continuation for chat requests with data-URL images (one image, an earlier turn's image) and text
only; five images in one prompt (more than the model takes) a 400 naming it while the server keeps answering."""
from __future__ import annotations


import httpx
import openai
import pytest

from support.api_errors import api_error
from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from test_mllama import CASES, FOLDER, VISION


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(FOLDER, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "64", "--served-model-name", "mllama",
                        "--limit-mm-per-prompt", '{"image": 8}',
                        *XLA_CACHE_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize("name", ["one_image", "two_images", "two_turns", "text_only"])
def test_sdk_chat_with_data_urls_matches_hf(client, name):
    VISION.check_sdk_chat(client, "mllama", name)


def test_more_images_than_the_model_takes_are_a_400_naming_it(server):
    url = VISION.data_url("wide.png")
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 5 +
             [{"type": "text", "text": "Compare."}]}]
    with httpx.Client(base_url=server.url, timeout=300) as http:
        err = api_error(http.post("/v1/chat/completions", json={"model": "mllama", "messages": msgs,
                                                                "max_tokens": 4}), 400)
        assert "takes at most 4 per prompt" in err["message"], err
        ok = http.post("/v1/chat/completions", json={"model": "mllama", "max_tokens": 2,
                                                     "messages": VISION.openai_messages(CASES["one_image"])})
        assert ok.status_code == 200
