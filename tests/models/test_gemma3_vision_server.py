"""Gemma 3 (vision) through the real server (`jaxserve serve` of the tiny checkpoint, CPU) with the openai SDK:
HF's greedy continuation for chat requests with data-URL images (one, two with text between, an earlier
turn's image) and text only."""
from __future__ import annotations


import openai
import pytest

from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from support.vision import GREEDY
from test_gemma3_vision import CASES, FOLDER, VISION

pytestmark = pytest.mark.slow     # its own server (~13 s); the engine tests match HF for Gemma 3 vision


@pytest.fixture(scope="module")
def client():
    srv = ServerProcess(FOLDER, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "64", "--served-model-name", "gemma3-vision",
                        *XLA_CACHE_FLAGS)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
    srv.stop()


@pytest.mark.parametrize("name", ["one_image", "two_images", "two_turns", "text_only"])
def test_sdk_chat_with_data_urls_matches_hf(client, name):
    from transformers import AutoTokenizer
    r = client.chat.completions.create(model="gemma3-vision", messages=VISION.openai_messages(CASES[name]),
                                       max_tokens=GREEDY, temperature=0, extra_body={"ignore_eos": True})
    want = AutoTokenizer.from_pretrained(FOLDER).decode(CASES[name]["greedy_ids"], skip_special_tokens=True)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(CASES[name]["prompt_ids"])
