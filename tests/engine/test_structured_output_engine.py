"""The engine core's side of structured outputs (embedded SmolLM2, CPU, the engine in this process): a request
whose grammar is not compiled waits apart from the scheduler (WAITING_FOR_FSM) while the others run, the core
never compiles on its own thread, an abort drops the waiting request, a refused constraint and a matcher that
fails while generating end the request with finish_reason "error"."""
from __future__ import annotations

import threading
import time

import pytest

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.request import RequestStatus
from jaxserve.engine.structured_output.compiler import WORKER_PREFIX
from jaxserve.llm import engine_config_from_kwargs
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# two token buckets (16 and the largest) instead of five: fewer forwards to compile, nothing here is about them
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, token_buckets=[16],
              # a loaded CI machine compiles SLOW in well over a second: the budget is no part of what is tested here
              structured_outputs_config={"compile_timeout_s": 300})
PROMPT = [1, 504, 3458, 314, 260]
# a GBNF chain of rules: slow enough to compile (about a second) that the unconstrained request finishes first
SLOW = StructuredOutputsParams(grammar="root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(1200))
                               + '\nr1200 ::= "b"')


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(engine_config_from_kwargs(None, **ENGINE), progress=False)
    yield eng
    eng.shutdown()


def params(constraint=None, max_tokens=4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=constraint,
                          output_kind=RequestOutputKind.DELTA)


def add(engine, rid, constraint=None, max_tokens=4):
    """Queue a request as the server does: its grammar is not waited for on this thread."""
    engine.add_requests([engine.make_request(rid, PROMPT, params(constraint, max_tokens), wait_for_grammar=False)])


def run(engine, timeout_s=300) -> dict:
    """Step until nothing is unfinished; each request's final output."""
    finals, deadline = {}, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests():
            return finals
        outs = engine.step()
        if not outs:
            time.sleep(0.01)            # a grammar compiles on a worker
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def test_a_request_waits_for_its_grammar_apart_while_the_others_run(engine):
    so = engine.structured_output
    add(engine, "slow", SLOW, max_tokens=3)
    add(engine, "plain")
    assert engine.core.scheduler.get_request("slow") is None and so.is_waiting("slow")   # no batch slot
    finished_order = []
    deadline = time.monotonic() + 300          # the grammar compiles on a worker meanwhile: bounded in time, not steps
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outs = engine.step()
        if not outs:
            time.sleep(0.01)
        for out in outs:
            if out.finished:
                finished_order.append(out.request_id)
                assert out.outputs[0].finish_reason == "length", out
                if out.request_id == "slow":
                    assert out.outputs[0].text.strip("a") in ("", "b"), out.outputs[0].text
    assert finished_order == ["plain", "slow"]
    threads = so.compiler.stats()["compile_threads"]
    assert threads and all(name.startswith(WORKER_PREFIX) for name in threads)
    assert threading.current_thread().name not in threads            # the step loop's thread never compiled
    assert engine.stats()["structured_compilations_off_workers"] == 0


def test_an_abort_while_waiting_drops_the_request(engine):
    so = engine.structured_output
    slower = StructuredOutputsParams(grammar=SLOW.grammar.replace('"b"', '"c"'))
    add(engine, "gone", slower)
    assert so.is_waiting("gone")
    engine.abort_request("gone")
    assert not so.is_waiting("gone") and not engine.has_unfinished_requests()
    assert not engine.core.has_unfinished_requests()


def test_a_refused_constraint_ends_with_an_error(engine):
    add(engine, "bad", StructuredOutputsParams(regex="a(b"))
    add(engine, "fine")
    finals = run(engine)
    bad = finals["bad"].outputs[0]
    assert bad.finish_reason == "error" and "regex does not compile" in bad.stop_reason and bad.token_ids == []
    assert finals["fine"].outputs[0].finish_reason == "length"


def test_the_offline_path_still_refuses_before_anything_runs(engine):
    with pytest.raises(ValueError, match="regex does not compile"):
        engine.make_request("x", PROMPT, params(StructuredOutputsParams(regex="a(b")))


def test_a_matcher_that_fails_while_generating_ends_with_an_error_not_stop(engine):
    """One rule of 2,500 alternatives passes every pre-check and compiles, then needs more parser items in a
    row than llguidance allows at its first token."""
    wide = StructuredOutputsParams(grammar="start: " + " | ".join(f'"option number {i}"' for i in range(2500)))
    add(engine, "wide", wide, max_tokens=8)
    out = run(engine)["wide"].outputs[0]
    assert out.finish_reason == "error" and "max_parser_row_items" in out.stop_reason, out
    assert out.token_ids == [] and out.text == ""      # the token its matcher failed on is not kept
    assert engine.core.scheduler.get_request("wide") is None and not engine.structured_output.has_requests


def test_statuses_and_reasons():
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ERROR)
    from jaxserve.engine.request import finish_reason
    assert finish_reason(RequestStatus.FINISHED_ERROR) == "error"
