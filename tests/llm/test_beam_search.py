"""Beam search (jaxserve/beam_search.py): the algorithm on scripted candidates (HF transformers' rules), then
``LLM.beam_search`` on the embedded SmolLM2 in float32 against HF's ``generate(num_beams=...)``
(tests/fixtures/beam_search_golden.json, written by tests/make_beam_search_fixtures.py): the same best beam,
and the beams' requests served the prompt's KV blocks from the prefix cache."""
from __future__ import annotations

import math
import os

import pytest

from jaxserve.beam_search import BeamSearch, beam_score, check_beam_width, num_candidates
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import BeamSearchParams
from support import FIXTURES

GOLDEN = os.path.join(FIXTURES, "beam_search_golden.json")
EOS = 2
BLOCK_SIZE = 16


def position(**logprobs: float) -> dict:
    """{token id: Logprob} from t<id>=logprob keywords, ranked by logprob."""
    ranked = sorted(((int(k[1:]), v) for k, v in logprobs.items()), key=lambda kv: -kv[1])
    return {tok: Logprob(lp, rank) for rank, (tok, lp) in enumerate(ranked, 1)}


# -- the algorithm on scripted candidates -------------------------------------------------------------------

def test_first_step_keeps_the_best_width_candidates_best_first():
    search = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=5), [EOS])
    search.advance([position(t10=-0.5, t11=-0.1, t12=-2.0, t13=-3.0)])
    assert [b.tokens for b in search.running] == [[7, 8, 11], [7, 8, 10]]
    assert [b.cum_logprob for b in search.running] == [-0.1, -0.5]
    assert search.num_candidates == 4 == num_candidates(2, [EOS])


def test_an_eos_among_the_top_width_finishes_a_beam_and_one_below_does_not():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=5), [EOS])
    search.advance([position(t10=-0.1, t11=-0.2, t2=-0.3)])      # EOS ranks third: not a hypothesis
    assert search.finished == [] and len(search.running) == 2
    search.advance([position(t2=-0.1, t12=-1.0), position(t13=-0.5, t14=-0.6)])
    # candidates: [7,10,EOS] -0.2, [7,11,13] -0.7, [7,11,14] -0.8, [7,10,12] -1.1: the EOS one finishes
    (score, beam), = search.finished
    assert beam.tokens == [7, 10, 2] and beam.finish_reason == "stop" and beam.stop_reason == EOS
    assert score == pytest.approx(-0.2 / 2)                 # over its generated length, EOS counted
    assert [b.tokens for b in search.running] == [[7, 11, 13], [7, 11, 14]]


def test_ignore_eos_keeps_eos_beams_running():
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), [EOS])
    search.advance([position(t2=-0.1, t10=-0.2)])
    assert search.finished == [] and search.running[0].tokens == [7, 2]


def test_the_budget_finishes_the_top_width_and_orders_them_by_score():
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=1.0), [EOS])
    search.advance([position(t10=-0.1, t11=-0.2)])
    search.advance([position(t12=-1.0, t13=-3.0), position(t14=-0.5, t15=-4.0)])
    assert search.done
    best = search.result()
    assert [b.tokens for b in best] == [[7, 11, 14], [7, 10, 12]]
    assert [b.finish_reason for b in best] == ["length", "length"]


def test_the_search_stops_once_no_live_beam_can_beat_the_finished_ones():
    search = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=50), [EOS])
    search.advance([position(t2=-0.1, t10=-1.0)])
    # finished [EOS] scores -0.1; the live beam scores -1.0 at length 1: it cannot beat it (HF's heuristic)
    assert search.done and search.result()[0].tokens == [7, 2]


@pytest.mark.parametrize("length_penalty, best", [(1.0, [7, 10, 13, 17]), (0.0, [7, 2])])
def test_the_length_penalty_decides_between_a_short_and_a_long_beam(length_penalty, best):
    search = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty), [EOS])
    search.advance([position(t10=-0.1, t2=-0.2, t11=-0.3, t12=-0.4)])   # [EOS] finishes at -0.2
    search.advance([position(t13=-0.1, t14=-0.2), position(t15=-0.1, t16=-0.5)])
    assert not search.done                                              # one finished of two: search on
    search.advance([position(t17=-0.1, t19=-1.0), position(t18=-0.05, t20=-1.0)])
    # at the budget [10,13,17] -0.3 and [10,14,18] -0.35 finish: per token -0.1 and -0.117 beat -0.2; summed
    # (penalty 0) neither does
    assert search.done and search.result()[0].tokens == best


def test_scores_survive_hostile_length_penalties():
    assert beam_score(-2.0, 4, 1.0) == -0.5
    assert beam_score(-2.0, 4, 0.0) == -2.0
    assert beam_score(-2.0, 4, 1e6) == -0.0                    # the power overflows: scored 0
    assert beam_score(-2.0, 4, -1e6) == -math.inf              # the power vanishes
    assert beam_score(0.0, 4, -1e6) == 0.0


@pytest.mark.parametrize("kw, message", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an integer >= 1"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(beam_width=2, max_tokens=4, length_penalty="long"), "length_penalty must be a finite number"),
    (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, temperature=3.0), "temperature"),
])
def test_bad_beam_search_params_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kw)


def test_beam_width_is_capped_by_max_logprobs():
    check_beam_width(10, [EOS], 20)
    with pytest.raises(ValueError, match="beam_width must be at most 10: .* max_logprobs is 20; got 11"):
        check_beam_width(11, [EOS], 20)
    with pytest.raises(ValueError, match="at most 6: each beam step asks for the top 3 x beam_width"):
        check_beam_width(7, [EOS, 3], 20)                   # two EOS ids: 3 candidates per beam (HF's)
    check_beam_width(1000, [EOS], -1)                       # -1: no limit


# -- LLM.beam_search on the embedded SmolLM2 against HF -----------------------------------------------------

LLM_ARGS = dict(model=None, dtype="float32", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
                block_size=BLOCK_SIZE, use_tqdm_on_load=False)


@pytest.mark.slow     # ~40 s; tests/server/test_beam_search_server.py matches HF's beams in make test
def test_beam_search_matches_hf_num_beams(llm, golden):
    """Every golden case: the same best beam (token ids) as HF's num_beams search, the same scores, and the
    other beams the same wherever HF's scores set them apart."""
    assert tuple(llm.engine.facts().eos_token_ids) == (golden["eos_token_id"],)
    for case in golden["cases"]:
        params = BeamSearchParams(beam_width=case["beam_width"], max_tokens=case["max_tokens"],
                                  length_penalty=case["length_penalty"])
        out, = llm.beam_search([{"prompt_token_ids": case["prompt_ids"]}], params)
        n = len(case["prompt_ids"])
        got = [(b.tokens[n:], beam_score(b.cum_logprob, len(b.tokens) - n, params.length_penalty))
               for b in out.sequences]
        want = [(b["ids"], b["score"]) for b in case["beams"]]
        what = f"{case['prompt']!r} width {params.beam_width} penalty {params.length_penalty}"
        assert got[0][0] == want[0][0], what
        assert len(got) == len(want), what
        for (ids, score), (hf_ids, hf_score) in zip(got, want):
            assert score == pytest.approx(hf_score, rel=1e-3, abs=1e-3), what
        assert [ids for ids, _ in got] == [ids for ids, _ in want], what
        best = out.sequences[0]
        assert best.tokens[:n] == case["prompt_ids"] and best.text == llm.get_tokenizer().decode(best.tokens)
        assert best.finish_reason == ("stop" if best.tokens[-1] == golden["eos_token_id"] else "length")


def test_beams_share_the_prompts_kv_blocks(llm, golden):
    """Each beam step's requests find every full KV block of their tokens but the last in the prefix cache:
    the prompt's, and the generated ones the beam shares with the beam it grew from."""
    case = next(c for c in golden["cases"] if c["kind"] == "chat" and c["beam_width"] >= 3)
    steps = []
    generate = llm.generate

    def recording_generate(prompts, params, **kw):
        outputs = generate(prompts, params, **kw)
        steps.append([(len(o.prompt_token_ids), o.num_cached_tokens) for o in outputs])
        return outputs

    llm.generate = recording_generate
    try:
        llm.beam_search([case["prompt_ids"]], BeamSearchParams(beam_width=case["beam_width"], max_tokens=8))
    finally:
        del llm.generate
    assert len(steps) == 8 and [len(s) for s in steps[1:]] == [case["beam_width"]] * 7
    n = len(case["prompt_ids"])
    assert n >= 2 * BLOCK_SIZE
    for beams in steps[1:]:
        for length, cached in beams:
            assert cached == (length - 1) // BLOCK_SIZE * BLOCK_SIZE >= n // BLOCK_SIZE * BLOCK_SIZE
