"""prompt_logprobs through the scheduler: scored chunk by chunk as the prompt prefills, sharing the step's
budget with other requests' decodes, counted in running/waiting, abortable between chunks."""
import functools
import threading

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.engine.scoring_budget import SCORING_SHARE
from support.tiny_models import tiny_llm

LLM_ARGS = dict(max_num_batched_tokens=16, max_num_seqs=8)
make_llm = functools.partial(tiny_llm, **LLM_ARGS)


PROMPT = np.random.default_rng(3).integers(1, 250, size=150).tolist()


def scored(llm, prompt, k=2):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out[0].prompt_logprobs


def test_chunked_scoring_equals_one_chunk(llm):
    """150 prompt tokens scored in chunks of at most 8 (a 16-token budget that counts each scored position
    twice; after a request that leaves half the prompt in the prefix cache: scoring takes no hits) equal an
    engine scoring them in two chunks."""
    llm.generate([PROMPT[:80]], SamplingParams(max_tokens=1), use_tqdm=False)
    chunked = scored(llm, PROMPT)
    whole = scored(make_llm(max_num_batched_tokens=256), PROMPT)
    assert len(chunked) == len(whole) == len(PROMPT) and chunked[0] is None and whole[0] is None
    for i in range(1, len(PROMPT)):
        assert set(chunked[i]) == set(whole[i]) and PROMPT[i] in chunked[i]
        for tok, lp in chunked[i].items():
            assert lp.logprob == pytest.approx(whole[i][tok].logprob, abs=1e-4)
            assert lp.rank == whole[i][tok].rank


def test_scoring_shares_the_step_and_is_counted_and_abortable(llm):
    """While a long prompt is scored, a decoding request gets a token every step; the scoring request is
    running (not invisible) and an abort mid-prompt frees it."""
    engine = llm.engine
    engine.add_request("decode", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("score", PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert engine.core.scheduler.num_scoring == 1
    score = engine.core.scheduler.get_request("score")
    decoded = []
    for _ in range(4):
        outs = engine.step()
        decoded += [o for o in outs if o.request_id == "decode"]
    assert 0 < score.num_computed_tokens < len(PROMPT)           # still prefilling, chunk by chunk
    assert 0 < score.num_prompt_positions_scored <= score.num_computed_tokens
    assert len(decoded) >= 3                                      # the decode was not stalled
    assert engine.core.scheduler.get_stats()["num_running"] == 2
    engine.abort_request("score")
    assert engine.core.scheduler.num_scoring == 0 and engine.core.scheduler.get_request("score") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv_manager.usage == 0.0


def test_scoring_compiles_in_the_background_and_never_stalls_the_engine(monkeypatch):
    """The first scoring request makes the scorer, whose compile runs on background threads (held here until
    released): meanwhile the engine keeps decoding, the scoring request waits in the queue (counted there)
    and no step waits for a compile; once compiled it is scheduled and scored."""
    from jaxserve.runner.prompt_logprobs import PromptLogprobsScorer
    release, lowering = threading.Event(), threading.Event()
    real_lower = PromptLogprobsScorer._lower

    def held_lower(self, S):
        lowering.set()
        assert release.wait(120)
        return real_lower(self, S)
    monkeypatch.setattr(PromptLogprobsScorer, "_lower", held_lower)
    engine = make_llm().engine
    engine.add_request("decode", [5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.add_request("score", PROMPT[:40], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert lowering.wait(60)
    decoded = 0
    for _ in range(5):
        decoded += sum(o.request_id == "decode" for o in engine.step())
    score = engine.core.scheduler.get_request("score")
    assert decoded >= 4 and score.num_computed_tokens == 0
    assert engine.core.scheduler.get_stats()["num_waiting"] == 1 and engine.stats()["step_variants_pending"] >= 1
    release.set()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outs["score"].prompt_logprobs) == 40 and engine.core._scorer.compiler.on_first_use == []
    assert engine.core.runner.variants.on_first_use == []


def test_scored_positions_count_against_the_step_budget():
    """Each position a step scores is a second forward over it: the step's tokens plus its scored positions
    stay within max_num_batched_tokens (16). While a decode runs beside them the two scoring requests take at
    most 1/SCORING_SHARE of each step together; alone, they fill the steps."""
    llm = make_llm()
    engine = llm.engine
    engine.add_request("decode", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for rid, prompt in (("score", PROMPT[:60]), ("score2", PROMPT[60:120])):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    engine.core._scorer.compiler.wait_all()
    real_dispatch, steps, scored_positions = engine.core._scorer.dispatch, [], []

    def counting_dispatch(scheduled, kv_caches):
        kv_caches, chunks = real_dispatch(scheduled, kv_caches)
        scoring = sum(s.num_new_tokens for s in scheduled if s.request_id.startswith("score")) + \
            sum(c.count for c in chunks)
        steps.append((any(s.request_id == "decode" for s in scheduled),
                      sum(s.num_new_tokens for s in scheduled) + sum(c.count for c in chunks), scoring))
        scored_positions.extend(c.count for c in chunks)
        return kv_caches, chunks
    engine.core._scorer.dispatch = counting_dispatch
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outs["score"].prompt_logprobs) == len(outs["score2"].prompt_logprobs) == 60
    assert max(spent for _, spent, _ in steps) <= 16, steps                  # never over
    shared = [scoring for with_decode, _, scoring in steps if with_decode]
    alone = [spent for with_decode, spent, _ in steps if not with_decode]
    assert shared and max(shared) <= 16 // SCORING_SHARE, steps              # held to its share beside the decode
    assert alone and max(alone) >= 14, steps                                 # full steps once alone
    assert sum(scored_positions) == 2 * 59                                   # every position scored once


def test_a_request_arriving_while_a_long_prompt_is_scored_starts_at_once(llm):
    """A short request that arrives while a long prompt is being scored is prefilled in the next step and
    gets its first token while the scoring goes on: the scored prompt does not take every step's budget
    until it is done (what made an echo + logprobs request stall everyone's time to first token)."""
    engine = llm.engine
    engine.add_request("score", PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    engine.core._scorer.compiler.wait_all()
    engine.step()
    score = engine.core.scheduler.get_request("score")
    engine.add_request("short", PROMPT[:6], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    steps = 0
    while not any(o.request_id == "short" for o in engine.step()):
        steps += 1
        assert steps < 4, "the short request waited for the scored prompt"
    assert score.num_computed_tokens < len(PROMPT)                           # still scoring
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv_manager.usage == 0.0
