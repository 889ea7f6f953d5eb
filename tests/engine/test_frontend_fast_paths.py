"""The front end's per-token fast paths give exactly what the general paths give: SSE frames from a
template, the per-token metrics' tally, the async streams' hand-over."""
import asyncio

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jaxserve.engine.async_engine import _put_all, _Stream
from server.metrics import ITL_BUCKETS, _PerTokenCollector, _Tally
from server.response_types import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice,
                                   CompletionResponse)
from server.streaming import TextFrame, sse

TEXTS = ["", "hello", " world", 'quote " and \\ backslash', "line\nbreak\t", "naïve café 東京 🙂", "\x00\x1f",
         "\x00text\x00"]


@pytest.mark.parametrize("index", [0, 3])
def test_text_frames_are_the_structs_encoded(index):
    def completion(text):
        return CompletionResponse(id="cmpl-1", model="m/x", choices=[CompletionChoice(index, text, None, None)],
                                  usage=None, created=123)

    def chat(text):
        return ChatCompletionChunk(id="chatcmpl-1", model="m", created=5,
                                   choices=[ChatChunkChoice(index, ChatDelta(content=text), None, None)])
    for make in (completion, chat):
        frame = TextFrame(make)
        for text in TEXTS:
            assert frame(text) == sse(make(text))


def test_tally_matches_prometheus_histogram():
    values = [0.0, 0.01, 0.0100001, 0.05, 0.3, 0.33, 79.0, 80.0, 81.0, 1e9]
    reg = CollectorRegistry()
    h = Histogram("x_inter_token_latency_seconds", "time between output tokens", ["model_name"],
                  buckets=ITL_BUCKETS, registry=reg).labels("m")
    col = _PerTokenCollector("x_", "m")
    for v in values:
        h.observe(v)
        h.observe(v)
        col.itl.observe(v, 2)
    ours = CollectorRegistry()
    ours.register(col)
    want = [line for line in generate_latest(reg).decode().splitlines() if not line.startswith("#")]
    got = generate_latest(ours).decode().splitlines()
    assert all(line in got for line in want)
    assert any(line.startswith("x_time_per_output_token_seconds_count") for line in got)


def test_tally_bounds_are_inclusive():
    t = _Tally([1.0, 2.0])
    for v in (1.0, 1.5, 2.0, 2.5):
        t.observe(v)
    assert t.counts == [1, 2, 1] and t.sum == 7.0
    assert t.buckets() == [("1.0", 1.0), ("2.0", 3.0), ("+Inf", 4.0)]


def test_stream_hands_items_over_in_order_and_survives_a_cancelled_wait():
    async def main():
        loop = asyncio.get_running_loop()
        s = _Stream(loop)
        waiting = asyncio.ensure_future(s.get())
        await asyncio.sleep(0)
        waiting.cancel()                       # a consumer that went away mid-wait
        await asyncio.gather(waiting, return_exceptions=True)
        got = asyncio.ensure_future(asyncio.gather(*(s.get() for _ in range(1))))
        await asyncio.sleep(0)
        _put_all([(s, 1)])
        loop.call_soon_threadsafe(s.put_nowait, 2)
        s.put(3)
        assert await got == [1]
        assert [await s.get(), await s.get()] == [2, 3]
    asyncio.run(main())


# ---- the front end's output processor: DELTA text sliced from the emitted text, checked against full decodes

from jaxserve.engine.messages import EngineCoreOutput  # noqa: E402
from jaxserve.engine.output_processor import OutputProcessor  # noqa: E402
from jaxserve.engine.request import Request, RequestStatus  # noqa: E402
from jaxserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

LENGTH = int(RequestStatus.FINISHED_LENGTH_CAPPED)


def _run_front(tok, streams, abort_at=None):
    """Feed each request's ids one per step (the core's EngineCoreOutputs, finishing by length at the
    end) through the front end's OutputProcessor; returns every output's fields, step by step."""
    proc = OutputProcessor(tok)
    for rid, (ids, params) in streams.items():
        proc.add_request(Request(rid, [1, 2, 3], params, eos_token_ids=()))
    seen, stopped = [], []
    for step in range(max(len(ids) for ids, _ in streams.values())):
        if abort_at is not None and step == abort_at[1]:
            proc.remove(abort_at[0])
        outs = [EngineCoreOutput(rid, [ids[step]], LENGTH if step == len(ids) - 1 else 0, None,
                                 [(-0.5, 1, [ids[step], 7], [-0.5, -2.0])] if params.logprobs is not None else None)
                for rid, (ids, params) in streams.items() if step < len(ids)]
        results, stopped_here = proc.process_outputs(outs)
        stopped += stopped_here
        seen.append([(o.request_id, o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason,
                      o.outputs[0].stop_reason, o.outputs[0].logprobs, o.finished) for o in results])
    return seen, stopped


def test_front_end_outputs_match_full_decodes(tok):
    text = "Hello wörld! 東京 🙂 naïve — the quick brown fox jumps over the lazy dog. END here"
    ids = tok.encode(text, add_special_tokens=False)
    delta = RequestOutputKind.DELTA
    streams = {
        "plain": (ids, SamplingParams(max_tokens=len(ids), output_kind=delta)),
        "stop": (ids, SamplingParams(max_tokens=len(ids), stop=["ck br", "END"], output_kind=delta)),
        "stop-incl": (ids, SamplingParams(max_tokens=len(ids), stop=["🙂 na"], include_stop_str_in_output=True,
                                          output_kind=delta)),
        "logprobs": (ids, SamplingParams(max_tokens=len(ids), logprobs=1, output_kind=delta)),
        "cumulative": (ids, SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.CUMULATIVE)),
        "final": (ids[:7], SamplingParams(max_tokens=7, output_kind=RequestOutputKind.FINAL_ONLY)),
        "aborted": (ids, SamplingParams(max_tokens=len(ids), output_kind=delta)),
    }
    seen, stopped = _run_front(tok, streams, abort_at=("aborted", 5))
    assert stopped == ["stop-incl", "stop"]          # stop strings the front end found: aborted in the core
    by_rid = {}
    for step in seen:
        for rid, text_, toks, finish, reason, lps, _fin in step:
            by_rid.setdefault(rid, []).append((text_, toks, finish, reason, lps))
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(t for t, *_ in by_rid["plain"]) == full
    assert [t for _, ts, *_ in by_rid["plain"] for t in ts] == ids
    # step by step, the DELTA texts add up to the CUMULATIVE text
    deltas = [t for t, *_ in by_rid["plain"]]
    assert [t for t, *_ in by_rid["cumulative"]] == ["".join(deltas[:i + 1]) for i in range(len(deltas))]
    assert by_rid["plain"][-1][2:4] == by_rid["cumulative"][-1][2:4] == ("length", None)
    # stop strings across token boundaries: the text ends before (or with) the string; nothing after it
    assert "".join(t for t, *_ in by_rid["stop"]) == text[:text.index("ck br")]
    assert by_rid["stop"][-1][2:4] == ("stop", "ck br")
    assert "".join(t for t, *_ in by_rid["stop-incl"]) == text[:text.index("🙂 na") + len("🙂 na")]
    assert by_rid["stop-incl"][-1][2:4] == ("stop", "🙂 na")
    assert [len(lps) for *_, lps in by_rid["logprobs"]] == [1] * len(ids)
    assert "".join(t for t, *_ in by_rid["logprobs"]) == full
    assert len(by_rid["aborted"]) == 5                      # nothing after the abort
    assert by_rid["final"] == [(tok.decode(ids[:7]), ids[:7], "length", None, None)]
