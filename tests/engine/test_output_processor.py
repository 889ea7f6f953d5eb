"""The output path: the core's ``apply_sampled_tokens``, the one place that decides a request is finished (EOS,
stop ids, min_tokens, length), then the front end's ``OutputProcessor``, which matches stop strings and assembles
the outputs (DELTA / CUMULATIVE / FINAL_ONLY, logprobs, prompt logprobs)."""
import pytest

from jaxserve.engine.core_outputs import apply_sampled_tokens
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.outputs import Logprob
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

EOS = 0
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED


def params(**kw):
    return SamplingParams(**{"detokenize": False, "max_tokens": None, "output_kind": RequestOutputKind.FINAL_ONLY, **kw})


def running(front, p, eos=(EOS,), prompt=(1, 2, 3), max_model_len=100, rid="r"):
    """The core's request as the scheduler leaves it: queued (length limit lowered to max_model_len) and
    running; its front-end twin goes to ``front``."""
    r = Request(rid, list(prompt), p, eos_token_ids=eos)
    r.max_output_tokens = min(r.max_output_tokens, max_model_len - r.num_prompt_tokens)
    r.status = RequestStatus.RUNNING
    front.add_request(Request(rid, list(prompt), p, eos_token_ids=eos))
    return r


def read(front, r, tokens, logprobs=None, next_in_flight=0):
    """Dispatch ``tokens`` as one (multi-)step of placeholders, then (async scheduling) ``next_in_flight``
    placeholders of the next step, then read the first step: the core applies its tokens, the front end
    renders the core's outputs. Returns (RequestOutputs, the core's finished requests by status, the ids
    a stop string ended in the front end)."""
    first = r.num_output_tokens - r.num_placeholders
    r.append_placeholders(len(tokens) - r.num_placeholders + next_in_flight)
    core_outputs, finished = apply_sampled_tokens([(r, first)], {r.request_id: list(tokens)},
                                                  {r.request_id: logprobs} if logprobs else None)
    outputs, stopped_here = front.process_outputs(core_outputs)
    return outputs, finished, stopped_here


@pytest.mark.parametrize("case", [
    # (params, eos ids, tokens, max_model_len, finished status, stop_reason, tokens kept)
    (params(), {EOS}, [5, EOS], 100, STOPPED, None, 2),
    (params(ignore_eos=True), {EOS}, [5, EOS], 100, None, None, 2),
    (params(stop_token_ids=[7]), {EOS}, [5, 7], 100, STOPPED, 7, 2),
    (params(min_tokens=3), {EOS}, [5, EOS], 100, None, None, 2),
    (params(min_tokens=3, stop_token_ids=[7]), {EOS}, [5, 7], 100, None, None, 2),
    (params(min_tokens=2), {EOS}, [5, EOS], 100, STOPPED, None, 2),
    (params(max_tokens=2), {EOS}, [5, 6], 100, LENGTH, None, 2),
    (params(max_tokens=2), {EOS}, [5, EOS], 100, STOPPED, None, 2),             # the stop wins
    (params(max_tokens=5), {EOS}, [5, 6], 100, None, None, 2),
    (params(), {EOS}, [5, 6], 5, LENGTH, None, 2),                              # 3 + 2 = max_model_len
    (params(min_tokens=10), {EOS}, [5, 6], 5, LENGTH, None, 2),
    (params(), {EOS, 9}, [9], 100, STOPPED, None, 1),                           # any eos id
    (params(), {EOS}, [5, EOS, 6, 7], 100, STOPPED, None, 2),                   # tokens after a stop dropped
    (params(max_tokens=2), {EOS}, [5, 6], 100, LENGTH, None, 2),
])
def test_the_stop_decision(case):
    p, eos, tokens, max_model_len, status, stop_reason, kept = case
    front = OutputProcessor(tokenizer=None)
    r = running(front, p, eos=eos, max_model_len=max_model_len)
    outputs, finished, _ = read(front, r, tokens)
    assert finished == ({status: ["r"]} if status else {})
    assert r.output_token_ids == tokens[:kept] and r.num_placeholders == 0 and r.stop_reason == stop_reason
    assert r.status == RequestStatus.RUNNING                # the scheduler sets it when it frees the request
    if status is None:
        assert outputs == []                                # FINAL_ONLY: nothing while running
    else:
        (out,) = outputs
        assert out.finished and out.outputs[0].finish_reason == {STOPPED: "stop", LENGTH: "length"}[status]
        assert out.outputs[0].stop_reason == stop_reason and out.outputs[0].token_ids == tokens[:kept]


def test_finished_or_aborted_requests_are_skipped():
    r = running(OutputProcessor(tokenizer=None), params())
    r.append_placeholders(1)
    r.status = RequestStatus.FINISHED_ABORTED
    assert apply_sampled_tokens([(r, 0)], {"r": 5}, None) == ([], {})
    assert r.output_token_ids == [PLACEHOLDER]


def test_stop_string_finishes_and_cuts_the_text(tok):
    front = OutputProcessor(tok)
    ids = tok.encode("Hello world! The quick brown fox")
    r = running(front, SamplingParams(max_tokens=50, stop=["quick"], output_kind=RequestOutputKind.DELTA), eos=())
    texts, stopped = [], []
    for i, t in enumerate(ids):
        outputs, finished, stopped = read(front, r, [t])
        texts += [o.outputs[0].text for o in outputs]
        if stopped:
            break
    # the front end finished it (the core, which cannot see text, is told to abort it)
    assert finished == {} and stopped == ["r"] and not front.has_unfinished_requests()
    assert (outputs[-1].outputs[0].finish_reason, outputs[-1].outputs[0].stop_reason) == ("stop", "quick")
    assert "".join(texts) == "Hello world! The "
    # a stop string on the token that also reaches max_tokens reports stop
    r = running(front, SamplingParams(max_tokens=len(ids), stop=["fox"]), eos=(), rid="s")
    (out,), finished, stopped = read(front, r, ids)
    assert finished == {LENGTH: ["s"]} and stopped == []            # the core ended it by length
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "fox")


def test_delta_cumulative_and_logprobs(tok):
    proc = OutputProcessor(tok)
    ids = tok.encode("one two three four")
    lp = [(-0.5 * (i + 1), 1, [t, 7], [-0.5 * (i + 1), -3.0]) for i, t in enumerate(ids)]
    prompt_lps = [None, {2: Logprob(-1.0, 1, "x")}, {3: Logprob(-2.0, 1, "y")}]
    outs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        r = running(proc, SamplingParams(max_tokens=len(ids), logprobs=1, output_kind=kind), eos=(), rid=kind.name)
        r.prompt_logprobs = prompt_lps
        # async scheduling: the next step's placeholder is already there when a step is read
        outs[kind] = [o for i, (t, x) in enumerate(zip(ids, lp))
                      for o in read(proc, r, [t], [x], next_in_flight=int(i < len(ids) - 1))[0]]
    delta, cumulative, final = outs[RequestOutputKind.DELTA], outs[RequestOutputKind.CUMULATIVE], \
        outs[RequestOutputKind.FINAL_ONLY]
    assert len(delta) == len(cumulative) == len(ids) and len(final) == 1
    assert [t for o in delta for t in o.outputs[0].token_ids] == ids == final[0].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in delta) == cumulative[-1].outputs[0].text \
        == final[0].outputs[0].text == tok.decode(ids, skip_special_tokens=True)
    assert [o.prompt_logprobs for o in delta] == [prompt_lps] + [None] * (len(ids) - 1)   # once, with the first
    assert all(o.prompt_logprobs == prompt_lps for o in cumulative + final)
    assert sum(len(o.outputs[0].logprobs) for o in delta) == len(ids) == len(final[0].outputs[0].logprobs)
    assert final[0].outputs[0].cumulative_logprob == pytest.approx(sum(x[0] for x in lp))
    assert all(o.finished == (i == len(ids) - 1) for i, o in enumerate(delta))
    assert [o.outputs[0].token_ids for o in cumulative] == [ids[:i + 1] for i in range(len(ids))]
    assert final[0].outputs[0].finish_reason == "length"
    m = delta[-1].metrics               # the front end's: the core stamps the first token, the front end the rest
    assert m.first_token_time <= m.last_token_time <= m.finished_time
