"""Driving an ``AsyncLLMEngine`` from tests: DELTA streams, some left early, and a soak with cancellations that
checks the engine is left with nothing running, waiting or allocated."""
import asyncio
import random
import time

from jaxserve.sampling_params import RequestOutputKind, SamplingParams


async def stream(front, rid, prompt, params, stop_after=None):
    """Concatenated DELTA text and tokens, the finish reason; ``stop_after``: leave after that many chunks."""
    text, toks, reason, n = "", [], None, 0
    async for out in front.generate(prompt, params, rid):
        o = out.outputs[0]
        text += o.text
        toks += o.token_ids
        reason = o.finish_reason
        n += 1
        if stop_after is not None and n >= stop_after:
            break
    return text, toks, reason


def delta(**kw):
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **kw)


def soak(front, num_requests: int, cancel_fraction: float, seed: int = 0):
    rng = random.Random(seed)

    async def one(i):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(2, 60))]
        params = delta(temperature=rng.choice([0, 0.8]), max_tokens=rng.randrange(1, 40),
                       stop=[" t"] if i % 5 == 0 else None)
        if rng.random() < cancel_fraction:
            task = asyncio.ensure_future(stream(front, f"k{seed}-{i}", prompt, params))
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return None
        return await stream(front, f"k{seed}-{i}", prompt, params)

    async def main():
        sem = asyncio.Semaphore(64)

        async def limited(i):
            async with sem:
                return await one(i)
        return await asyncio.gather(*(limited(i) for i in range(num_requests)))

    results = asyncio.run(main())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = front.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_cache_usage"] == 0.0:
            break
        time.sleep(0.05)
    s = front.stats()
    assert (s["num_running"], s["num_waiting"], s["kv_cache_usage"]) == (0, 0, 0.0), s
    assert not front.engine.output_processor.requests
    assert all(r is None or r[2] in ("stop", "length") for r in results)
    return results
