"""The structured-output manager's step pieces without a model: the mask started on the worker thread is the
mask the matchers give one by one, and advancing the matchers in one pass before the output processor
gives the verdicts (and grammar states) that consuming token by token gives.

A fixed seed walks a few dozen constrained requests (JSON schemas, a regex, a choice list) through their
grammars, each step picking one allowed token per row, as a sampler under the mask would.
"""
from __future__ import annotations

from types import SimpleNamespace

import llguidance.numpy as llnp
import numpy as np
import pytest

from jaxserve.engine.request import RequestStatus
from jaxserve.engine.structured_output import StructuredOutputManager, bitmask_width
from jaxserve.models.tokenizers import embedded_tokenizer
from jaxserve.sampling_params import StructuredOutputsParams

VOCAB = 128256          # the serving benchmark's shape: Llama-3's ids over the SmolLM2 tokenizer
SPECS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"answer": {"type": "string", "minLength": 64}},
                                  "required": ["answer"], "additionalProperties": False}),
    StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age"]}),
    StructuredOutputsParams(regex=r"[a-z]{2,6}(-[0-9]{1,3})?"),
    StructuredOutputsParams(choice=["yes", "no", "maybe"]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return embedded_tokenizer()


def make_manager(tokenizer, n: int) -> tuple[StructuredOutputManager, list]:
    manager = StructuredOutputManager(tokenizer, VOCAB, (tokenizer.eos_token_id,))
    requests = [SimpleNamespace(request_id=f"r{i}", status=RequestStatus.RUNNING,
                                sampling_params=SimpleNamespace(structured_outputs=SPECS[i % len(SPECS)]))
                for i in range(n)]
    for r in requests:
        manager.add_request(r)
    return manager, requests


def serial_mask(manager: StructuredOutputManager, rows, num_rows: int) -> np.ndarray:
    """The reference: one matcher at a time into an all-ones mask."""
    mask = np.full((num_rows, bitmask_width(VOCAB)), -1, np.int32)
    for i, rid in rows:
        llnp.fill_next_token_bitmask(manager._matchers[rid], mask, i)
    return mask


def allowed(mask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB])


def test_the_started_fill_is_the_serial_fill_and_leaves_other_rows_open(tokenizer):
    manager, requests = make_manager(tokenizer, 40)
    rng = np.random.default_rng(0)
    num_rows = 64                                   # padded rows past the requests, and gaps between them
    live = list(requests)
    for _ in range(12):
        rows = [(k + k // 2, r.request_id) for k, r in enumerate(live)]
        got = manager.start_fill(rows, num_rows).result()
        want = serial_mask(manager, rows, num_rows)
        np.testing.assert_array_equal(got, want)
        open_rows = sorted(set(range(num_rows)) - {i for i, _ in rows})
        assert (got[open_rows] == -1).all()
        by_id = {r.request_id: r for r in live}
        sampled, tokens = [], {}
        for i, rid in rows:
            tokens[rid] = int(rng.choice(allowed(got[i])))
            sampled.append((by_id[rid], 0))
        manager.advance(sampled, tokens)
        finished = {rid for rid, tok in tokens.items() if manager.accept(rid, tok)}
        for rid in finished:
            manager.remove(rid)
        live = [r for r in live if r.request_id not in finished]
    assert manager.stats()["structured_steps"] == 12
    assert manager.stats()["structured_mask_wait_ms"] >= 0


def test_advancing_in_one_pass_gives_the_token_by_token_verdicts_and_states(tokenizer):
    batched, requests = make_manager(tokenizer, 16)
    one_by_one, _ = make_manager(tokenizer, 16)
    rng = np.random.default_rng(1)
    rows = [(i, r.request_id) for i, r in enumerate(requests)]
    done: set[str] = set()
    for step in range(30):
        mask = batched.fill_bitmask(rows, len(rows))
        np.testing.assert_array_equal(mask, one_by_one.fill_bitmask(rows, len(rows)))
        tokens = {rid: int(rng.choice(allowed(mask[i]))) for i, rid in rows}
        if step == 3:               # a request finished or aborted meanwhile: neither path advances it
            requests[5].status = RequestStatus.FINISHED_ABORTED
            done.add(requests[5].request_id)
        batched.advance([(r, 0) for r in requests], tokens)
        for i, rid in rows:
            if rid in done:
                continue
            verdict = batched.accept(rid, tokens[rid])
            assert verdict == one_by_one.accept(rid, tokens[rid]), (step, rid)
            if verdict:
                done.add(rid)
                requests[i].status = RequestStatus.FINISHED_STOPPED
    # the choice requests reach the end of their grammar (yes / no / maybe) within a few tokens
    assert {r.request_id for r in requests[3::4]} <= done


def test_accept_without_a_pass_consumes_the_token_itself(tokenizer):
    manager, (req,) = make_manager(tokenizer, 1)
    req.sampling_params.structured_outputs = SPECS[3]
    manager.remove(req.request_id)
    manager.add_request(req)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert len(yes) == 1
    assert manager.accept(req.request_id, yes[0]) is True       # "yes" ends the choice grammar
    assert manager.accept("not-constrained", 5) is False
