"""The front end's per-token fast paths give exactly what the general paths give: SSE frames from a
template, the per-token metrics' tally, the async streams' hand-over."""
import asyncio

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from jaxserve.engine.async_engine import _put_all, _Stream
from server.metrics import ITL_BUCKETS, _PerTokenCollector, _Tally
from server.protocol import ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionResponse
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
