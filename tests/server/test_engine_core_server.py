"""`serve` with the engine core in its own process (the default) against one process
(JAXSERVE_ENABLE_MULTIPROCESSING=0), and what a killed core does to the server: every stream gets an error
chunk and [DONE], /health answers 503, the server exits 1."""
import json
import os
import re
import signal

import httpx
import openai
import pytest

from support.server_process import MAX_MODEL_LEN, XLA_CACHE_FLAGS, ServerProcess, start_long_streams

FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         *XLA_CACHE_FLAGS, "--served-model-name", "smol")


def core_pid(srv: ServerProcess) -> int:
    found = re.search(r"engine core in its own process \(pid (\d+)\)", srv.tail(1 << 20))
    assert found, srv.tail()
    return int(found.group(1))


def startup_phases(srv: ServerProcess) -> list[str]:
    """The start-up timeline's phases in the server's log (jaxserve/utils/startup_timeline.py)."""
    from jaxserve.utils.startup_timeline import LINE
    log = srv.tail(1 << 20)
    assert "start-up timeline: imports" in log
    return [name for name, _ in re.findall(LINE, log)]


@pytest.mark.slow     # two servers (~45 s); every other server test runs the split one
def test_one_process_and_split_servers_give_the_same_completions():
    split = ServerProcess(*FLAGS)
    try:
        assert core_pid(split)
        # both processes log their imports; the front end its wait for the core beyond the core's phases and
        # the tokenizer library it imports while the core loads
        assert sorted(startup_phases(split)) == sorted(["imports", "imports", "tokenizer imports", "device init",
                                                        "config/tokenizer", "weights", "KV cache", "warm-up",
                                                        "engine-core hand-shake"])
        one = ServerProcess(*FLAGS, env={"JAXSERVE_ENABLE_MULTIPROCESSING": "0"})
        try:
            assert "engine core in this process" in one.tail(1 << 20)
            assert sorted(startup_phases(one)) == sorted(["imports", "device init", "config/tokenizer", "weights",
                                                          "KV cache", "warm-up"])
            a = openai.OpenAI(base_url=split.url + "/v1", api_key="none", max_retries=0, timeout=300)
            b = openai.OpenAI(base_url=one.url + "/v1", api_key="none", max_retries=0, timeout=300)
            for kw in (dict(prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}),
                       dict(prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95, seed=7, n=2),
                       dict(prompt="The capital of France is", max_tokens=9, temperature=0, logprobs=2),
                       dict(prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7", "9,"])):
                x = a.completions.create(model="smol", **kw).choices
                y = b.completions.create(model="smol", **kw).choices
                assert [(c.text, c.finish_reason) for c in x] == [(c.text, c.finish_reason) for c in y]
                if kw.get("logprobs"):
                    assert x[0].logprobs.tokens == y[0].logprobs.tokens
                    assert x[0].logprobs.token_logprobs == pytest.approx(y[0].logprobs.token_logprobs, abs=1e-5)
            kw = dict(model="smol", prompt="Write a story", max_tokens=24, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in a.completions.create(**kw)) == \
                   "".join(c.choices[0].text for c in b.completions.create(**kw))
        finally:
            assert one.stop() == 0
    finally:
        assert split.stop() == 0                    # SIGTERM drains through both processes, exit 0


def test_a_killed_core_errors_every_stream_and_the_server_exits_1():
    srv = ServerProcess(*FLAGS)
    try:
        pid = core_pid(srv)
        threads, results = start_long_streams(srv.url, 4, wait_s=60)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream hung after the engine core died"
        for i, lines in results.items():
            assert lines[-1] == "data: [DONE]", (i, lines[-3:])
            error = json.loads(lines[-2][len("data: "):])
            assert "error" in error and "engine" in error["error"]["message"], error
        try:
            health = httpx.get(srv.url + "/health", timeout=5).status_code
            assert health == 503
        except httpx.HTTPError:
            pass                                     # already gone: also not healthy
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
