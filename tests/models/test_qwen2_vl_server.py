"""Qwen2.5-VL and Qwen2-VL through the real server (`jaxserve serve` of each tiny checkpoint, CPU) with the
openai SDK: HF's greedy continuation for chat requests with data-URL images of different sizes, an earlier
turn's image and text only."""
from __future__ import annotations


import openai
import pytest

from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from test_qwen2_vl import FIXTURES, GREEDY, NAMES


@pytest.fixture(scope="module", params=[NAMES[0], pytest.param(NAMES[1], marks=pytest.mark.slow)])   # a server each
def served(request):
    vl = FIXTURES[request.param]
    srv = ServerProcess(vl.folder, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "128", "--served-model-name", "qwen-vl",
                        *XLA_CACHE_FLAGS)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
    yield vl, client
    srv.stop()


def greedy_text(vl, case) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(vl.folder).decode(case["greedy_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["one_image", "two_images", "two_turns", "text_only"])
def test_sdk_chat_with_data_urls_matches_hf(served, name):
    vl, client = served
    case = vl.cases[name]
    r = client.chat.completions.create(model="qwen-vl", messages=vl.openai_messages(case), max_tokens=GREEDY,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == greedy_text(vl, case)
    assert r.usage.prompt_tokens == len(case["prompt_ids"])
