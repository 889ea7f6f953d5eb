"""Qwen2.5-VL through the real server (`jaxserve serve` of the tiny checkpoint, CPU) with the openai SDK:
HF's greedy continuation for chat requests with data-URL images of different sizes, an earlier turn's image
and text only; ``--mm-processor-kwargs`` (``max_pixels``) changes the image's token count as the processor
says."""
from __future__ import annotations

import os

import openai
import pytest

from support.server_process import ROOT, ServerProcess
from test_qwen2_vl import CASES, FOLDER, GREEDY, openai_messages


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(FOLDER, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "128", "--served-model-name", "qwen-vl",
                        "--compilation-cache-dir", os.path.join(ROOT, ".jax_cache"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def greedy_text(case) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(FOLDER).decode(case["greedy_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["one_image", "two_images", "two_turns", "text_only"])
def test_sdk_chat_with_data_urls_matches_hf(client, name):
    r = client.chat.completions.create(model="qwen-vl", messages=openai_messages(CASES[name]), max_tokens=GREEDY,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy_text(CASES[name])
    assert r.usage.prompt_tokens == len(CASES[name]["prompt_ids"])
