"""The rejection sampler (``runner.rejection_sampler``): greedy exact match, the bonus token, and a χ² test that
the emitted tokens follow the target distribution whatever the draft."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import sampler as sampler_mod
from jaxserve.runner.rejection_sampler import rejection_sample
from jaxserve.sampling_params import SamplingParams

V = 8


def _meta(params, num_out=None, seeds=None):
    n = len(params)
    return sampler_mod.make_sampling_metadata(params, [[]] * n, [[]] * n, num_out or [0] * n, V, pad_to=n,
                                              request_seeds=seeds or [None] * n)


def _run(logits, params, drafts, num_drafts, **kw):
    meta = jax.tree.map(jnp.asarray, _meta(params, **kw))
    out = jax.jit(rejection_sample)(jnp.asarray(logits, jnp.float32), meta, jnp.asarray(drafts, jnp.int32),
                                    jnp.asarray(num_drafts, jnp.int32))
    return np.asarray(out.token_ids), np.asarray(out.num_tokens)


def test_greedy_accepts_the_argmax_run_and_adds_the_target_token():
    K = 3
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2 * (K + 1), V)).astype(np.float32)
    best = logits.argmax(axis=1).reshape(2, K + 1)
    # row 0: all drafts are the argmax -> K accepted + bonus; row 1: the second draft is wrong
    drafts = np.stack([best[0, :K], best[1, :K]])
    drafts[1, 1] = (best[1, 1] + 1) % V
    toks, counts = _run(logits, [SamplingParams(temperature=0)] * 2, drafts, [K, K])
    assert counts.tolist() == [K + 1, 2]
    assert toks[0].tolist() == best[0].tolist()
    assert toks[1, :2].tolist() == [best[1, 0], best[1, 1]] and (toks[1, 2:] == -1).all()


def test_a_row_without_drafts_samples_as_the_ordinary_sampler():
    K = 2
    rng = np.random.default_rng(1)
    row = rng.normal(size=V).astype(np.float32)
    logits = np.tile(row, (K + 1, 1))
    p = SamplingParams(temperature=0.9, seed=7)
    toks, counts = _run(logits, [p], np.zeros((1, K)), [0], num_out=[5])
    meta = jax.tree.map(jnp.asarray, _meta([p], num_out=[5]))
    plain = sampler_mod.sample(jnp.asarray(row[None]), meta)
    assert counts.tolist() == [1] and toks[0, 0] == int(plain.token_ids[0])


@pytest.mark.parametrize("draft,temperature,top_k", [(0, 1.0, 0), (3, 1.0, 0), (1, 0.7, 4)])
def test_emitted_tokens_follow_the_target_distribution(draft, temperature, top_k):
    """χ² over many seeds: the first emitted token ~ p_0 (a likely draft, an unlikely one, one top-k may drop),
    and given an accepted first draft, the second emitted token ~ p_1; p as the sampler filters it."""
    K, n = 2, 4000
    rng = np.random.default_rng(2)
    base = rng.normal(size=(K + 1, V)).astype(np.float32)
    base[0, 0] += 1.5
    logits = np.tile(base, (n, 1))
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=s) for s in range(n)]
    drafts = np.tile(np.array([[draft, 5]]), (n, 1))
    toks, counts = _run(logits, params, drafts, [K] * n)
    x = base / temperature
    if top_k:
        x = np.where(x >= np.sort(x, axis=1)[:, -top_k][:, None], x, -np.inf)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    for pos, rows in ((0, np.ones(n, bool)), (1, toks[:, 0] == draft)):
        if rows.sum() < 200:
            continue                                        # a draft top-k dropped is never accepted
        seen = np.bincount(toks[rows, pos], minlength=V)
        kept = p[pos] > 0
        assert seen[~kept].sum() == 0
        expected = p[pos][kept] * rows.sum()
        chi2 = float(((seen[kept] - expected) ** 2 / expected).sum())
        assert chi2 < 24.3, (pos, chi2, seen, expected.round(1))      # <= 7 degrees of freedom, p = 0.001
    assert counts.min() >= 1 and counts.max() <= K + 1
