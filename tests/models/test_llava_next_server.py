"""LLaVA-NeXT through the real server (`jaxserve serve` of the tiny LLaVA-NeXT, CPU) with the openai SDK: HF's
greedy continuation for a chat with a data-URL image, and the hostile inputs a 400 naming the problem while the
server keeps answering: an image whose tile grid takes more tokens than the encoder budget, more images than
``--limit-mm-per-prompt``."""
from __future__ import annotations


import httpx
import openai
import pytest

from support.api_errors import api_error
from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from test_llava_next import CASES, FOLDER, VISION

LIMIT = 2
BUDGET = 80          # the square image's 2x2 grid takes 88 tokens; the wide one's 70


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(FOLDER, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
                        "--max-num-batched-tokens", "64", "--served-model-name", "llava-next",
                        "--max-num-encoder-input-tokens", str(BUDGET),
                        *XLA_CACHE_FLAGS,
                        "--limit-mm-per-prompt", f'{{"image": {LIMIT}}}')
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_sdk_chat_with_a_data_url_matches_hf(client):
    VISION.check_sdk_chat(client, "llava-next", "one_image")


def _with_images(names: list[str]) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": VISION.data_url(n)}}
                                         for n in names] + [{"type": "text", "text": "What?"}]}]


@pytest.mark.parametrize("names, words", [
    (["square.png"], f"more than the encoder budget of {BUDGET}"),
    (["wide.png"] * (LIMIT + 1), "limit"),
])
def test_hostile_images_are_400_and_the_server_keeps_answering(server, names, words):
    with httpx.Client(base_url=server.url, timeout=300) as http:
        body = {"model": "llava-next", "messages": _with_images(names), "max_tokens": 4}
        err = api_error(http.post("/v1/chat/completions", json=body), 400)
        assert words in err["message"], err
        ok = http.post("/v1/chat/completions", json={"model": "llava-next", "max_tokens": 2,
                                                     "messages": VISION.openai_messages(CASES["one_image"])})
        assert ok.status_code == 200
