"""vLLM's ``priority`` (with ``--scheduling-policy priority``) and ``cache_salt`` through the real server
(embedded SmolLM2, CPU) with the openai SDK, their hostile values, and both offline (``LLM.generate``)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from support.api_errors import api_error
from support.servers import smol

PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
          "who repaired every clock in the valley and never once asked to be paid for his work.")


SERVER = smol("--scheduling-policy", "priority")


def prefix_cache_hits(http) -> float:
    text = http.get("/metrics").text
    return float(re.search(r"^\w+:prefix_cache_hits(?:_total)?\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_two_salts_never_share_cached_blocks_and_one_salt_does(client, http):
    kw = dict(model="smol", prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]) > 32     # two full blocks
    client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    hits = prefix_cache_hits(http)
    for salt in ("tenant-b", None):     # another salt, and none: no hit on tenant-a's blocks
        client.completions.create(**kw, extra_body={"cache_salt": salt} if salt else {})
        assert prefix_cache_hits(http) == hits, salt
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                       temperature=0, extra_body={"cache_salt": "tenant-c"})
    assert r.choices[0].message.content is not None
    client.completions.create(**kw, extra_body={"cache_salt": "tenant-a"})
    assert prefix_cache_hits(http) > hits


@pytest.mark.slow    # ~30 s; the scheduler's priority order is tested in tests/engine/test_scheduler.py
def test_a_lower_priority_value_is_scheduled_first(client):
    """Eight choices fill the server's eight sequences; two requests of eight more wait. The one sent later
    with the lower priority value runs first, so it finishes before the other starts."""
    done: dict[str, float] = {}

    def ask(name: str, priority: int, max_tokens: int) -> None:
        client.completions.create(model="smol", prompt=PROMPT, n=8, max_tokens=max_tokens, temperature=1.0, seed=1,
                                  extra_body={"priority": priority, "ignore_eos": True})
        done[name] = time.monotonic()

    threads = [threading.Thread(target=ask, args=("first", 10, 200))]
    threads[0].start()
    time.sleep(0.5)
    for name, priority in (("late", 5), ("urgent", -1)):
        threads.append(threading.Thread(target=ask, args=(name, priority, 16)))
        threads[-1].start()
        time.sleep(0.3)
    for t in threads:
        t.join()
    assert done["urgent"] < done["late"], done


@pytest.mark.parametrize("body, param", [
    ({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"), ({"priority": [1]}, "priority"),
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"), ({"cache_salt": ["a"]}, "cache_salt"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_values_are_400_naming_the_field(http, body, param, path):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    err = api_error(http.post(path, json={"model": "smol", "max_tokens": 2, **base, **body}), 400)
    assert err["param"] == param, err


@pytest.mark.slow     # ~30 s; the server tests above cover priority and salts
def test_offline_priority_and_cache_salt():
    from jaxserve import LLM, SamplingParams
    ids = list(range(100, 164))                 # four blocks of 16
    llm = LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=2, temperature=0)
    try:
        llm.generate([{"prompt_token_ids": ids, "cache_salt": "a"}], params, use_tqdm=False)
        b, a = llm.generate([{"prompt_token_ids": ids, "cache_salt": salt} for salt in ("b", "a")], params,
                            use_tqdm=False)
        assert b.num_cached_tokens == 0 and a.num_cached_tokens == 48
        with pytest.raises(ValueError, match="scheduling-policy priority"):
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, priority=[1])
        with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
            llm.generate([ids, ids], params, use_tqdm=False, priority=[0])
    finally:
        llm.shutdown()
    # each prompt takes a whole step's budget (64 tokens): one is admitted per step, in priority order
    llm = LLM(None, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority")
    try:
        prompts = [[t + k for t in ids] for k in range(3)]
        outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, -2, 0])
        order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert order == [1, 2, 0]
    finally:
        llm.shutdown()
