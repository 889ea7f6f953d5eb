"""Images through the real server (`jaxserve serve` of the tiny LLaVA, CPU) with the openai SDK: HF's greedy
continuation for chat requests with data-URL, http-URL and file-URL images, and every bad input a 400 in
OpenAI's shape naming the problem while the other requests keep answering. A text-only model refuses an
image part (the scripted engine)."""
from __future__ import annotations

import base64
import functools
import http.server as http_server
import io
import os
import threading

import httpx
import openai
import pytest
from PIL import Image

from support.api_errors import api_error
from support.server_process import XLA_CACHE_FLAGS, ServerProcess
from test_llava import CASES, FOLDER, GREEDY, data_url, openai_messages
from support.server_fakes import FakeEngine, InProcessServer

LIMIT = 2


@pytest.fixture(scope="module")
def media_server():
    """A local http server over the fixture folder on 127.0.0.1; /redirect sends the client elsewhere."""
    class Handler(http_server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "http://example.invalid/x.png")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass
    srv = http_server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=FOLDER))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(FOLDER, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "64", "--served-model-name", "llava",
                        *XLA_CACHE_FLAGS,
                        "--limit-mm-per-prompt", f'{{"image": {LIMIT}}}', "--max-image-pixels", "1000000",
                        "--allowed-local-media-path", FOLDER, "--allowed-media-domains", "127.0.0.1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def chat(client, messages):
    return client.chat.completions.create(model="llava", messages=messages, max_tokens=GREEDY, temperature=0,
                                          extra_body={"ignore_eos": True})


def greedy_text(case) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(FOLDER).decode(case["greedy_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("name", ["one_image", "two_images", "two_turns", "text_only"])
def test_sdk_chat_with_data_urls_matches_hf(client, name):
    r = chat(client, openai_messages(CASES[name]))
    assert r.choices[0].message.content == greedy_text(CASES[name])
    assert r.usage.prompt_tokens == len(CASES[name]["prompt_ids"])


def test_http_and_file_urls(client, media_server):
    case = CASES["one_image"]
    for url in (f"{media_server}/red.png", "file://" + os.path.join(FOLDER, "red.png")):
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What?"}]}]
        r = chat(client, msgs)
        assert r.choices[0].message.content == greedy_text(case), url


def _png(size: tuple[int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _with_image(url: str, n: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * n +
             [{"type": "text", "text": "What?"}]}]


@pytest.mark.parametrize("kind, words", [
    ("broken data url", "base64"),
    ("not an image", "not a readable image"),
    ("too many pixels", "pixels"),
    ("too many images", "limit"),
    ("unreachable url", "could not be fetched"),
    ("disallowed domain", "not allowed"),
    ("redirect to a disallowed domain", "not allowed"),
    ("file outside the folder", "outside"),
    ("unknown scheme", "scheme"),
])
def test_bad_images_are_400_naming_the_problem(http, media_server, kind, words):
    url = {"broken data url": "data:image/png;base64,@@@not-base64@@@",
           "not an image": "data:image/png;base64," + base64.b64encode(b"hello, not a png").decode(),
           "too many pixels": _png((2000, 1000)),
           "too many images": data_url("red.png"),
           "unreachable url": "http://127.0.0.1:1/none.png",
           "disallowed domain": "http://example.invalid/x.png",
           "redirect to a disallowed domain": f"{media_server}/redirect",
           "file outside the folder": "file:///etc/passwd",
           "unknown scheme": "ftp://127.0.0.1/x.png"}[kind]
    n = LIMIT + 1 if kind == "too many images" else 1
    body = {"model": "llava", "messages": _with_image(url, n), "max_tokens": 4}
    err = api_error(http.post("/v1/chat/completions", json=body), 400)
    assert words in err["message"], err
    # and the server still answers
    ok = http.post("/v1/chat/completions", json={"model": "llava", "max_tokens": 2,
                                                 "messages": openai_messages(CASES["one_image"])})
    assert ok.status_code == 200


def test_fields_the_image_path_cannot_honour_are_400(http):
    """prompt_logprobs (the scoring forward has no image embeddings) and truncate_prompt_tokens (positions would
    move) are refused for a prompt with images, not answered wrongly."""
    for field, value in (("prompt_logprobs", 1), ("truncate_prompt_tokens", 4)):
        body = {"model": "llava", "max_tokens": 2, "messages": openai_messages(CASES["one_image"]), field: value}
        err = api_error(http.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == field, err


def test_metrics_count_images(http):
    text = http.get("/metrics").text
    assert "jaxserve:images_total" in text and "jaxserve:encoder_seconds_total" in text


def test_text_only_model_refuses_an_image_part():
    srv = InProcessServer(FakeEngine())
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "fake-model", "messages": _with_image(
            data_url("red.png")), "max_tokens": 2})
        assert "does not take images" in api_error(r, 400)["message"]
    finally:
        srv.stop()
