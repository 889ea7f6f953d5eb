"""logit_bias, allowed_token_ids and bad_words offline: LLM on the tiny Llama (float32, CPU, the embedded
SmolLM2 tokenizer; the model's 256 ids are the tokenizer's first 256: specials, punctuation, digits, letters).
Each changes the output as vLLM's does, a row's restriction never reaches the others in its batch, and plain
steps keep running the programs they ran before."""
import pytest

from jaxserve import SamplingParams
from jaxserve.errors import InvalidRequestError
from support.tiny_models import tiny_llm as make_llm

ONE, TWO = 33, 34                   # "1" and "2": "12" is these two tokens, " 12" three
# the engines here compile two token buckets (16 and the largest) instead of five: the restrictions are the
# sampler's, whatever the step size, and each bucket is a forward (and its samplers) compiled per engine
BUCKETS = [16]
LLM_ARGS = dict(token_buckets=BUCKETS)


def run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


def test_greedy_with_a_plus_100_bias_emits_that_token_and_leaves_other_rows_alone(llm):
    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43]]
    plain = run(llm, prompts, greedy())
    out = run(llm, prompts, [greedy(logit_bias={ONE: 100}), greedy(), greedy(logit_bias={str(TWO): 100.0})])
    assert out[0] == [ONE] * 12 and out[2] == [TWO] * 12 and out[1] == plain[1]
    # a -100 bias on each token greedy chose removes it from the output
    banned = sorted(set(plain[0]))
    assert not set(run(llm, prompts[:1], greedy(logit_bias={t: -100 for t in banned}))[0]) & set(banned)


def test_allowed_token_ids_restrict_greedy_and_random_sampling(llm):
    allowed = [ONE, TWO, 50, 60]
    out = run(llm, [[5, 6, 7]] * 3, [greedy(allowed_token_ids=allowed),
                                     SamplingParams(temperature=1.5, seed=1, max_tokens=24, ignore_eos=True,
                                                    allowed_token_ids=allowed), greedy()])
    assert set(out[0]) <= set(allowed) and set(out[1]) <= set(allowed) and len(set(out[1])) > 1
    assert not set(out[2]) <= set(allowed)


def test_bad_words_block_one_token_words_and_the_end_of_longer_ones(llm):
    """Only "1" and "2" allowed, sampled at random: "12" appears, unless it is a bad word (multi-token: its
    "2" is blocked right after a "1", which needs the output so far on the host under async scheduling);
    "1" as a bad word leaves only "2"."""
    params = dict(temperature=1.0, max_tokens=40, ignore_eos=True, allowed_token_ids=[ONE, TWO])
    seeds = range(4)
    free = run(llm, [[5, 6, 7]] * 4, [SamplingParams(seed=s, **params) for s in seeds])
    assert any((ONE, TWO) in zip(o, o[1:]) for o in free)
    blocked = run(llm, [[5, 6, 7]] * 4, [SamplingParams(seed=s, bad_words=["12"], **params) for s in seeds])
    assert all((ONE, TWO) not in zip(o, o[1:]) for o in blocked)
    assert all(ONE in o for o in blocked) and any(TWO in o for o in blocked)
    assert run(llm, [[5, 6, 7]], SamplingParams(seed=0, bad_words=[" 1"], **params))[0] == [TWO] * 40


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm):
    for kw, field in (({"logit_bias": {256: 1.0}}, "logit_bias"), ({"allowed_token_ids": [1, 999]},
                                                                    "allowed_token_ids")):
        with pytest.raises(InvalidRequestError, match=f"{field} has token ids outside the vocabulary "
                                                      r"\(size 256\)") as info:
            llm.generate([[1, 2]], greedy(**kw), use_tqdm=False)
        assert info.value.param == field


def test_plain_steps_run_the_programs_they_ran_before(llm):
    """Restricted steps compile their own sampler variants; plain steps after them compile nothing."""
    prompts = [[5, 6, 7], [9, 10]]
    run(llm, prompts, greedy())
    run(llm, prompts, [greedy(logit_bias={ONE: 3.0}), greedy(allowed_token_ids=[TWO], bad_words=["12"])])
    runner = llm.engine.core.runner
    runner.wait_compiled(timeout=600)
    before = runner.compiled_variants()
    run(llm, prompts, greedy())
    assert runner.compiled_variants() == before


def test_multi_step_decoding_applies_them_every_iteration(llm):
    """--num-scheduler-steps: bias, allowed ids and one-token bad words are fixed for a request's life, so its
    decode loop applies them at each iteration; a multi-token bad word runs single steps (it reads the output)."""
    multi = make_llm(num_scheduler_steps=4, token_buckets=BUCKETS)
    sched, steps = multi.engine.core.scheduler, []
    schedule = sched.schedule

    def counting():
        out = schedule()
        steps.append(out.num_steps)
        return out
    sched.schedule = counting
    prompts = [[5, 6, 7], [9, 10], [40, 41, 42, 43]]
    sampled = dict(temperature=1.0, max_tokens=24, ignore_eos=True, allowed_token_ids=[ONE, TWO, 50])
    params = [greedy(logit_bias={ONE: 2.0, TWO: 1.5}), SamplingParams(seed=3, **sampled),
              SamplingParams(seed=4, bad_words=["2"], **sampled)]
    assert run(multi, prompts, params) == run(llm, prompts, params)
    assert max(steps) == 4
    steps.clear()
    two_tokens = SamplingParams(seed=4, bad_words=["12"], **sampled)
    assert run(multi, prompts[:1], two_tokens) == run(llm, prompts[:1], two_tokens)
    assert max(steps) == 1
