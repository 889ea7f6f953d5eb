"""The runner's host side (``step_inputs``, called on its own): vectorised step inputs and cached sampling
rows equal the plain per-request construction they replaced, on random ragged batches (decodes, prefill
chunks, placeholders)."""
import random
import types

import numpy as np
import pytest

from jaxserve.engine.request import Request
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.runner import sampler as S
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.step_contract import PLACEHOLDER
from jaxserve.runner.step_inputs import StepShapes, forward_inputs, token_buckets
from jaxserve.sampling_params import SamplingParams


def step_setup(block_size=4, max_model_len=128, max_num_seqs=32, max_tokens=256):
    """What a step's inputs depend on besides the scheduled entries: the block size, the buckets (each step
    in its own) and the persistent rows."""
    max_blocks_per_seq = -(-max_model_len // block_size)
    return types.SimpleNamespace(
        block_size=block_size, max_model_len=max_model_len, max_blocks_per_seq=max_blocks_per_seq,
        max_num_seqs=max_num_seqs, max_num_tokens=max_tokens, shapes=StepShapes(token_buckets(max_tokens), max_num_seqs),
        input_batch=InputBatch(max_num_seqs, max_blocks_per_seq, 256))


def prepare(setup, scheduled, prev=None):
    return forward_inputs(scheduled, setup.input_batch, setup.block_size, setup.shapes.own,
                          prev.rows if prev is not None else None)


# The per-request loop prepare() was before it was vectorised (commit 65fd2db), kept as the reference.
def reference_prepare(self, scheduled, prev=None):
    """Host arrays for one step. ``scheduled``: ScheduledRequest list (decodes first). A PLACEHOLDER
    token (sampled by ``prev``, not yet on the host) is read on device from ``prev``'s output."""
    n_tok = sum(s.num_new_tokens for s in scheduled)
    T = self.shapes.bucket_for(n_tok)
    R = self.shapes.num_reqs_for(T)
    if len(scheduled) > R:
        raise ValueError(f"{len(scheduled)} requests in a step of {T} tokens (max_num_seqs={self.max_num_seqs})")
    bs = self.block_size
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, PAD_SLOT, np.int32)
    tables = np.zeros((R, self.max_blocks_per_seq), np.int32)
    seq_lens = np.zeros(R, np.int32)
    qsl = np.zeros(R + 1, np.int32)
    logits_idx = np.zeros(R, np.int32)
    prev_index = np.full(T, -1, np.int32)
    off = 0
    for i, s in enumerate(scheduled):
        req, n, start = s.request, s.num_new_tokens, s.start_pos
        toks = req.all_token_ids[start:start + n]
        if toks[-1] == PLACEHOLDER:
            if prev is None or req.request_id not in prev.rows:
                raise RuntimeError(f"request {req.request_id}: its last token is still on the device but "
                                   "no step in flight sampled it")
            prev_index[off + n - 1] = prev.rows[req.request_id]
            toks = list(toks[:-1]) + [0]
        input_ids[off:off + n] = toks
        pos = np.arange(start, start + n, dtype=np.int32)
        positions[off:off + n] = pos
        blocks = np.asarray(s.block_ids, np.int32)
        slots[off:off + n] = blocks[pos // bs] * bs + pos % bs
        tables[i, :len(blocks)] = blocks
        seq_lens[i] = start + n
        off += n
        qsl[i + 1] = off
        logits_idx[i] = off - 1
    qsl[len(scheduled) + 1:] = off
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                           num_seqs=np.int32(len(scheduled)))
    return T, R, input_ids, positions, md, logits_idx, prev_index


def random_batch(rng, setup, n_decodes, n_chunks):
    """Requests with random block tables; decodes first, then prefill chunks; some last tokens are
    placeholders (sampled by a step in flight), listed in prev.rows."""
    bs = setup.block_size
    scheduled, rows = [], {}
    for i in range(n_decodes + n_chunks):
        total = rng.randint(2, setup.max_model_len - 1)
        prompt = [rng.randrange(1, 200) for _ in range(total)]
        req = Request(f"r{i}", prompt, SamplingParams())
        if i < n_decodes:
            n, start = 1, total - 1
        else:
            start = rng.randint(0, total - 2)
            n = rng.randint(2, total - start)
        placeholder = start + n == total and rng.random() < 0.5
        if placeholder:
            req.all_token_ids[-1] = PLACEHOLDER
            rows[req.request_id] = rng.randrange(setup.max_num_seqs)
        n_blocks = -(-(start + n) // bs)
        blocks = rng.sample(range(1, 4000), n_blocks)
        scheduled.append(ScheduledRequest(req, n, start, blocks, samples=start + n == total))
    return scheduled, types.SimpleNamespace(rows=rows)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, AttentionMetadata):
            for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "num_seqs"):
                gx, gy = np.asarray(getattr(x, f)), np.asarray(getattr(y, f))
                assert gx.dtype == gy.dtype and gx.shape == gy.shape and np.array_equal(gx, gy), f
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        else:
            assert x == y


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_prepare_equals_reference(seed):
    rng = random.Random(seed)
    setup = step_setup(block_size=rng.choice([1, 4, 16]), max_model_len=128)
    budget = setup.max_num_tokens
    n_dec = rng.randint(0, 24)
    n_chunk = rng.randint(0 if n_dec else 1, 3)
    scheduled, prev = random_batch(rng, setup, n_dec, n_chunk)
    while sum(s.num_new_tokens for s in scheduled) > budget:
        scheduled.pop()
    assert_same(prepare(setup, scheduled, prev), reference_prepare(setup, scheduled, prev))


def test_prepare_empty_and_placeholder_errors():
    setup = step_setup()
    assert_same(prepare(setup, [], None), reference_prepare(setup, [], None))
    req = Request("x", [5, 6, PLACEHOLDER], SamplingParams())
    s = [ScheduledRequest(req, 1, 2, [7])]
    with pytest.raises(RuntimeError, match="still on the device"):
        prepare(setup, s, None)
    with pytest.raises(RuntimeError, match="still on the device"):
        prepare(setup, s, types.SimpleNamespace(rows={"other": 0}))


def test_prepare_marks_uniform_decode_steps():
    """Under a Pallas backend a step whose requests all decode one token is marked decode-only (its own
    compiled variant); a step with a prefill chunk, an empty step, and the reference backend are not."""
    rng = random.Random(3)
    setup = step_setup()
    setup.shapes.uniform_decode = True
    decodes, prev = random_batch(rng, setup, 5, 0)
    assert prepare(setup, decodes, prev).md.decode_only
    mixed, prev_mixed = random_batch(rng, setup, 5, 1)
    assert not prepare(setup, mixed, prev_mixed).md.decode_only
    assert not prepare(setup, [], None).md.decode_only
    setup.shapes.uniform_decode = False
    assert not prepare(setup, decodes, prev).md.decode_only


def _params(rng, plain):
    kw = dict(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
              top_k=rng.choice([0, 5, 10_000]), min_p=rng.choice([0.0, 0.05]),
              seed=rng.choice([None, None, rng.randrange(2**40)]), min_tokens=rng.choice([0, 0, 3]),
              max_tokens=32)
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(300)]
    if plain:           # what the fast path takes: min_tokens 0 or only past it below, no penalties
        return SamplingParams(**kw)
    if rng.random() < 0.1:
        kw[rng.choice(["presence_penalty", "frequency_penalty"])] = 0.5
    if rng.random() < 0.1:
        kw["repetition_penalty"] = 1.2
    if rng.random() < 0.1:
        t = rng.randrange(256)
        kw.update(rng.choice([{"logit_bias": {t: 1.0}}, {"allowed_token_ids": [t]}]))
    p = SamplingParams(**kw)
    p.update_from_generation_config({"eos_token_id": [2]}, 2)
    return p


@pytest.mark.parametrize("seed", range(20))
def test_input_batch_sampling_equals_make_sampling_metadata(seed):
    """The persistent rows give make_sampling_metadata's arrays, over several steps of one batch whose
    requests come and go (rows reused after the batch runs out of them); a step that needs the general
    path is recognised exactly when that path builds something the rows cannot."""
    rng = random.Random(seed)
    V, plain = 256, seed % 2 == 0
    batch = InputBatch(8, 4, V)
    live: list = []
    for step in range(6):
        live = [r for r in live if rng.random() < 0.7]
        while len(live) < rng.randint(0, 8):
            p = _params(rng, plain)
            req = Request(f"q{rng.randrange(12)}", [1], p)       # ids recur: a new Request gets a new row
            req.sampling_seed = rng.choice([None, rng.randrange(2**31)])
            live.append(req)
        live = list({r.request_id: r for r in live}.values())
        n = len(live)
        R = max(n, 1) + rng.randint(0, 5)
        sched = [ScheduledRequest(r, 1, 0, []) for r in live]
        num_out = np.array([rng.randint(3 if plain else 0, 6) for _ in live], np.int64)
        rows = batch.rows_for(sched)
        step_count = rng.randrange(2**34)
        ref = S.make_sampling_metadata([r.sampling_params for r in live], [[1] * k for k in num_out],
                                       [[1]] * n, num_out.tolist(), V, pad_to=R,
                                       request_ids=[r.request_id for r in live],
                                       request_seeds=[r.sampling_seed for r in live], step=step_count,
                                       engine_seed=seed, penalty_width=128)
        general = batch.needs_general_path(rows, num_out)
        assert not (plain and general)
        assert general == bool(ref.output_token_ids.shape[1] or (ref.blocked_token_ids[:n] < V).any()
                               or ref.logit_bias_ids is not None or ref.allowed_token_ids is not None)
        if general:
            continue
        fast = batch.sampling_metadata(rows, num_out, R, step=step_count, engine_seed=seed)
        for f in ref.__dataclass_fields__:
            a, b = np.asarray(getattr(ref, f)), np.asarray(getattr(fast, f))
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f


def test_input_batch_block_tables_follow_the_live_lists():
    """A row copies only what its list gained, starts over for a new list (preemption: a new table), and
    leaves zeros past a row's blocks when a shorter table replaces a longer one."""
    batch = InputBatch(2, 6, 256)
    a, b = Request("a", [1], SamplingParams()), Request("b", [1], SamplingParams())
    ids_a, ids_b = [3, 4], [7]
    step = [ScheduledRequest(a, 1, 0, ids_a), ScheduledRequest(b, 1, 0, ids_b)]
    rows = batch.rows_for(step)
    assert batch.sync_block_tables(step, rows).tolist() == [2, 1]
    ids_a.append(5)
    assert batch.sync_block_tables(step, rows).tolist() == [3, 1]
    assert batch.block_table[rows].tolist() == [[3, 4, 5, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    step = [ScheduledRequest(a, 1, 0, [9]), ScheduledRequest(b, 1, 0, ids_b)]   # a was preempted
    rows = batch.rows_for(step)
    assert batch.sync_block_tables(step, rows).tolist() == [1, 1]
    assert batch.block_table[rows].tolist() == [[9, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    for i in range(3):                      # more requests than rows: the batch starts over, same tables
        c = Request(f"c{i}", [1], SamplingParams())
        step = [ScheduledRequest(c, 1, 0, [i + 1]), ScheduledRequest(b, 1, 0, ids_b)]
        rows = batch.rows_for(step)
        assert batch.sync_block_tables(step, rows).tolist() == [1, 1]
        assert batch.block_table[rows].tolist() == [[i + 1, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]]


def test_default_buckets_pad_a_single_decode_to_four_tokens():
    """A batch-1 decode step pads to 4 tokens by default (step_inputs' MIN_TOKEN_BUCKET: 8 decoded 2 % slower
    than 4 and 16 4 % slower than 8 on the H200), batches of 5-8 to 8, and the last bucket is the budget itself."""
    r = StepShapes(token_buckets(200), 32)
    assert r.sizes == [4, 8, 16, 32, 64, 128, 200]
    assert r.bucket_for(1) == 4 and r.num_reqs_for(4) == 4
    assert r.bucket_for(5) == 8 and r.num_reqs_for(8) == 8
    assert r.bucket_for(9) == 16 and r.bucket_for(200) == 200
