"""A scheduler on a fake device, as the scheduler tests drive it (tests/engine/test_scheduler*.py).

The fake device stands in for the runner: it writes each scheduled token id into a flat slot array through
the request's block table (like write_kv) and reads the whole context back through the block table (like
paged attention), checking it equals the request's tokens. So a wrong block table, a prefix-cache hit on
a block with other content, or a shared block overwritten after eviction all fail loudly. Its "model"
samples a token that is a function of the context it read, so outputs are checkable after preemptions.
Each step runs as the engine core runs it: schedule, the device, ``update_from_output`` (placeholders), then
``apply_sampled_tokens`` reads the tokens and decides which requests finished, and the scheduler frees them.
"""
from __future__ import annotations

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.core_outputs import apply_sampled_tokens
from jaxserve.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 50
EOS = 0


def next_token(context) -> int:
    """The fake model: deterministic in the whole context, never EOS unless the test wants it."""
    return 1 + (sum(context) * 7 + len(context) * 3) % (VOCAB - 1)


class FakeDevice:
    def __init__(self, kv: KVCacheManager):
        self.bs = kv.block_size
        self.slots = [None] * (kv.num_blocks * kv.block_size)

    def execute(self, out: SchedulerOutput, eos_at: dict[str, int] | None = None) -> dict[str, list[int]]:
        """One step. A multi-step entry (num_steps > 1) runs like the runner's device loop: each iteration
        writes the previous sampled token's K/V at the next position and samples again (on past an EOS)."""
        sampled = {}
        for e in out.scheduled:
            req, bs = e.request, self.bs
            end = e.start_pos + e.num_new_tokens
            assert e.num_steps == 1 or (e.num_new_tokens == 1 and e.samples), "only a decode runs several steps"
            # (it may hold more: lookahead left from a multi-step plan that fell back to single steps)
            assert len(e.block_ids) >= cdiv(end + e.num_steps - 1, bs), \
                "block table must cover computed + scheduled tokens (+ a multi-step entry's later positions)"
            assert 0 not in e.block_ids, "the null block was handed out"
            for p in range(e.start_pos, end):                       # write_kv
                self.slots[e.block_ids[p // bs] * bs + p % bs] = req.all_token_ids[p]
            context = [self.slots[e.block_ids[p // bs] * bs + p % bs] for p in range(end)]   # attention
            assert context == req.all_token_ids[:end], f"{req.request_id} read a wrong KV context"
            if e.samples:
                n_out = req.num_output_tokens
                toks = []
                for i in range(e.num_steps):
                    if i:                                           # feed the last token back
                        p = end - 1 + i
                        self.slots[e.block_ids[p // bs] * bs + p % bs] = toks[-1]
                        context = [self.slots[e.block_ids[q // bs] * bs + q % bs] for q in range(p + 1)]
                        assert context == req.all_token_ids[:end] + toks, f"{req.request_id}: wrong KV in loop"
                    eos = eos_at and eos_at.get(req.request_id) == n_out + i
                    toks.append(EOS if eos else next_token(context))
                sampled[req.request_id] = toks
        return sampled


def params(max_tokens=None, min_tokens=0, ignore_eos=False, stop_token_ids=(), logprobs=None, penalties=False):
    return SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                          stop_token_ids=list(stop_token_ids), logprobs=logprobs,
                          repetition_penalty=1.1 if penalties else 1.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def make(num_blocks=64, block_size=4, max_model_len=64, budget=32, max_seqs=8, chunked=True, caching=True,
         steps=1, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, caching, max_model_len)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                            enable_chunked_prefill=chunked, num_scheduler_steps=steps,
                                            scheduling_policy=policy),
                            CacheConfig(block_size=block_size, enable_prefix_caching=caching), kv, max_model_len)
    return sched, kv, FakeDevice(kv)


def read_tokens(sched, out, sampled) -> list[Request]:
    """The core reads a step whose placeholders are counted (the only ones: steps here are read before the
    next is scheduled) and the scheduler frees what it says finished. Returns those requests."""
    entries = [(e.request, e.request.num_output_tokens - e.request.num_placeholders) for e in out.scheduled
               if e.samples and e.request.status == RequestStatus.RUNNING]
    _, finished = apply_sampled_tokens(entries, sampled, None)
    return [r for status, ids in finished.items() for r in sched.finish_requests(ids, status)]


def apply(sched, out, sampled) -> list[Request]:
    """The engine's half of a step after the device: count its placeholders, then read its tokens."""
    sched.update_from_output(out)
    return read_tokens(sched, out, sampled)


def preempted_since(sched, num_preemptions) -> list[str]:
    """The requests preempted since the scheduler counted ``num_preemptions``, in order (each re-enters the
    waiting queue at the front)."""
    return [r.request_id for r in reversed(list(sched.waiting)[:sched.num_preemptions - num_preemptions])]


def step(sched, dev, eos_at=None):
    out = sched.schedule()
    return out, apply(sched, out, dev.execute(out, eos_at))


def run_to_completion(sched, dev, max_steps=2000):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        finished += step(sched, dev)[1]
    raise AssertionError("requests did not finish: the scheduler is stuck")


def expected_outputs(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prefill(sched, dev, *reqs):
    """Add the requests and run their (multi-token) prompts: afterwards each decodes."""
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, dev)
    assert sorted(e.request_id for e in out.scheduled) == sorted(r.request_id for r in reqs)
    assert out.num_steps == 1 and all(e.num_steps == 1 and e.num_new_tokens > 1 for e in out.scheduled)
    return out
