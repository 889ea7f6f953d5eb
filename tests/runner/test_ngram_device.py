"""The device n-gram lookup (``runner.ngram_device``) equals the host's ``propose_ngram`` on random sequences
(many lengths, repeats, no match, a match near the end, K longer than what follows), and its per-step call
appends each row's emitted tokens (sliding a full window) before proposing."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.ngram_device import DeviceNgram, append_and_propose, lookup
from jaxserve.runner.ngram_proposer import propose_ngram


def _batch(seqs, L):
    hist = np.zeros((len(seqs), L), np.int32)
    for r, s in enumerate(seqs):
        hist[r, :len(s)] = s
    return hist, np.array([len(s) for s in seqs], np.int32)


@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 3), (2, 4, 5), (1, 1, 1), (3, 5, 8)])
def test_lookup_equals_propose_ngram_on_random_sequences(min_n, max_n, k):
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k)
    L = 48
    seqs = []
    for _ in range(200):
        n = int(rng.integers(0, L + 1))
        vocab = int(rng.choice([2, 3, 5, 50]))          # small vocabularies repeat; 50 rarely matches
        s = rng.integers(1, vocab + 1, size=n)
        if n > 8 and rng.random() < 0.3:                 # a copied span, the suffix near the end
            a = int(rng.integers(0, n - 6))
            s[n - 4:] = s[a:a + 4]
        seqs.append(s.tolist())
    seqs += [[], [7], [7, 7], [1, 2, 3, 4], [5, 6, 5, 6], [1, 2, 1, 2, 1, 2]]
    hist, n = _batch(seqs, L)
    drafts, counts = lookup(jnp.asarray(hist), jnp.asarray(n), min_n, max_n, k)
    drafts, counts = np.asarray(drafts), np.asarray(counts)
    hits = 0
    for r, s in enumerate(seqs):
        want = propose_ngram(np.array(s, np.int64), min_n, max_n, k)
        assert counts[r] == len(want), (s, want)
        assert drafts[r, :counts[r]].tolist() == want and not drafts[r, counts[r]:].any()
        hits += bool(want)
    assert 10 < hits < len(seqs)


def test_append_then_propose_slides_a_full_window():
    L, k = 8, 3
    hist = jnp.zeros((3, L), jnp.int32).at[0, :6].set(jnp.array([1, 2, 3, 4, 1, 2]))
    hist_len = jnp.array([6, 0, 0], jnp.int32)
    rows = np.array([0, -1], np.int32)
    emitted = jnp.array([[3, 4, 9, 0], [5, 5, 5, 5]], jnp.int32)
    # row 0 emits 3 tokens: 9 tokens > L = 8, so its oldest one slides out; step row 1 samples nothing
    hist, hist_len, drafts, counts = append_and_propose(hist, hist_len, rows, emitted, jnp.array([3, 4]),
                                                        min_n=1, max_n=2, k=k, max_rows=4)
    assert np.asarray(hist[0]).tolist() == [2, 3, 4, 1, 2, 3, 4, 9] and np.asarray(hist_len).tolist() == [8, 0, 0]
    assert np.asarray(counts).tolist() == [0, 0, 0, 0]               # 9 occurs nowhere before
    hist, hist_len, drafts, counts = append_and_propose(hist, hist_len, rows[:1], jnp.array([4], jnp.int32), None,
                                                        min_n=1, max_n=2, k=k, max_rows=4)
    # [..., 9, 4]: the 2-gram misses, the 1-gram [4] last occurred before 9: 9, 4
    assert np.asarray(hist[0]).tolist() == [3, 4, 1, 2, 3, 4, 9, 4]
    assert np.asarray(counts).tolist()[:1] == [2] and np.asarray(drafts)[:k].tolist() == [9, 4, 0]

    # forced drafts (JAXSERVE_SPEC_FORCE_DRAFTS, the benchmarks' verify-step cost): K of the last token for every
    # row that sampled, none for one that did not
    _, _, drafts, counts = append_and_propose(hist, hist_len, rows, emitted, jnp.array([1, 4]), min_n=1, max_n=2,
                                              k=k, max_rows=4, force=True)
    assert np.asarray(counts).tolist() == [k, 0, 0, 0] and np.asarray(drafts)[:k].tolist() == [3, 3, 3]


def _entry(req, samples=True):
    n = len(req.all_token_ids)
    return SimpleNamespace(request=req, samples=samples, start_pos=0, num_new_tokens=n, spec_token_ids=None)


def test_rows_are_written_once_and_kept_when_they_run_out():
    spec = SimpleNamespace(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    ng = DeviceNgram(spec, max_model_len=16, max_num_seqs=2)         # 4 history rows
    ng.warmup([2])
    compiles = []

    def on_event(name, *_, **__):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    reqs = {c: SimpleNamespace(request_id=c, all_token_ids=[i + 1, i + 2, i + 1]) for i, c in enumerate("ABCDE")}

    def step(names, emitted):
        sched = [_entry(reqs[c]) for c in names]
        rows = ng.hist_rows(sched, 2)
        counts = ng.after_step(SimpleNamespace(token_ids=jnp.asarray(emitted, jnp.int32)),
                               {c: i for i, c in enumerate(names)}, rows, spec=False)
        return rows.tolist(), np.asarray(counts)[:len(names)].tolist()

    def history(c):
        row = ng._owner(reqs[c])
        return np.asarray(ng.hist)[row, :int(np.asarray(ng.hist_len)[row])].tolist()

    assert step("AB", [9, 8]) == ([0, 1], [0, 0])
    assert history("A") == [1, 2, 1, 9] and history("B") == [2, 3, 2, 8]
    assert step("AB", [1, 2]) == ([0, 1], [2, 2])        # A: [1, 2, 1, 9, 1] proposes 9, 1 (after the latest 1)
    assert np.asarray(ng.drafts).tolist() == [9, 1, 8, 2]
    assert step("CD", [5, 5])[0] == [2, 3]
    # out of rows: A (in this step) keeps its history, moved to row 0; E gets a row; B, C, D lose theirs
    assert step("AE", [7, 7])[0] == [0, 1]
    assert history("A") == [1, 2, 1, 9, 1, 7] and history("E") == [5, 6, 5, 7]
    assert ng._owner(reqs["B"]) is None
    assert not compiles          # the steps, row writes and the compaction ran what the warm-up compiled
    # a row that samples nothing (a prompt chunk before its last) gets none
    assert ng.hist_rows([_entry(reqs["B"], samples=False), _entry(reqs["A"])], 2).tolist() == [-1, 0]
