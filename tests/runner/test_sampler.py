"""On-device sampler against numpy references of vLLM's formulas, exact supports and empirical frequencies."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import sampler as S
from jaxserve.sampling_params import SamplingParams

V = 64
R = 8

sample_jit = jax.jit(S.sample, static_argnames=("num_logprobs", "max_candidates"))
top_k_top_p_jit = jax.jit(S.apply_top_k_top_p, static_argnames=("max_candidates",))
penalties_jit = jax.jit(S.apply_penalties)


def meta_for(params, *, outputs=None, prompts=None, num_out=None, pad_to=R, vocab=V, **kw):
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    prompts = prompts or [[0] for _ in range(n)]
    num_out = num_out if num_out is not None else [len(o) for o in outputs]
    return S.make_sampling_metadata(params, outputs, prompts, num_out, vocab, pad_to, **kw)


@pytest.fixture(scope="module")
def logits():
    return np.asarray(jax.random.normal(jax.random.PRNGKey(0), (R, V)) * 3.0, np.float32)


def np_log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


# ---- numpy references of vLLM's formulas -----------------------------------------------------------
def ref_penalties(logits, outputs, prompts, presence, frequency, repetition):
    out = logits.copy()
    for i in range(out.shape[0]):
        counts = np.bincount(np.asarray(outputs[i], int), minlength=out.shape[1]).astype(np.float32)
        seen = (counts > 0) | (np.bincount(np.asarray(prompts[i], int), minlength=out.shape[1]) > 0)
        rep = np.where(seen, repetition[i], 1.0)
        row = out[i]
        row = np.where(row > 0, row / rep, row * rep)
        out[i] = row - frequency[i] * counts - presence[i] * (counts > 0)
    return out


def ref_top_k_top_p(logits, top_k, top_p):
    """vLLM's apply_top_k_top_p: top-k by the k-th value, then top-p over an ascending sort."""
    out = logits.astype(np.float64).copy()
    for i, row in enumerate(out):
        if 0 < top_k[i] < row.size:
            row[row < np.sort(row)[::-1][top_k[i] - 1]] = -np.inf
        if top_p[i] < 1:
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            order = np.argsort(probs, kind="stable")
            remove = np.cumsum(probs[order]) <= 1 - top_p[i]
            remove[-1] = False
            row[order[remove]] = -np.inf
    return out


def ref_inverse_cdf(row, key):
    """The token a row's key draws from softmax(row): first cumulative probability >= 1 - u."""
    probs = np.exp(row.astype(np.float64) - row.max())
    cdf = np.cumsum(probs) / probs.sum()
    return int(np.searchsorted(cdf, 1.0 - float(jax.random.uniform(key, ())), side="left"))


# ---- greedy and degenerate filters -----------------------------------------------------------------
def test_greedy_is_argmax_and_logprobs_match_numpy(logits):
    m = meta_for([SamplingParams(temperature=0)] * 5)          # rows 5..7 are padding (greedy too)
    out = sample_jit(logits, m, num_logprobs=4)
    np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(1))
    ref = np_log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(out.logprob, ref.max(1), atol=1e-5)
    np.testing.assert_array_equal(out.rank, np.ones(R))
    np.testing.assert_array_equal(out.topk_ids, np.argsort(-ref, axis=1)[:, :4])
    np.testing.assert_allclose(out.topk_logprobs, -np.sort(-ref, axis=1)[:, :4], atol=1e-5)
    assert out.topk_ids.dtype == jnp.int32 and out.token_ids.dtype == jnp.int32


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, temperature=1.5), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=1.0, temperature=2.0),
                                    SamplingParams(top_k=3, top_p=1e-6, seed=5)])
def test_filters_that_keep_one_token_give_argmax(logits, params):
    for step in range(3):
        out = sample_jit(logits, meta_for([params] * R, step=step))
        np.testing.assert_array_equal(np.asarray(out.token_ids), logits.argmax(1))


def test_sampled_logprob_and_rank_are_those_of_the_raw_distribution(logits):
    m = meta_for([SamplingParams(temperature=2.0, presence_penalty=2.0)] * R, outputs=[[1, 2]] * R)
    out = sample_jit(logits, m, num_logprobs=0)
    ref = np_log_softmax(logits.astype(np.float64))
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprob, ref[np.arange(R), ids], atol=1e-5)
    np.testing.assert_array_equal(out.rank, (ref >= ref[np.arange(R), ids][:, None]).sum(1))
    assert out.topk_ids.shape == (R, 0) and out.topk_logprobs.shape == (R, 0)


# ---- top-k / top-p / min-p masks -------------------------------------------------------------------
@pytest.mark.parametrize("max_candidates", [4, 16, V])
def test_top_k_top_p_mask_matches_vllm_reference(max_candidates):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(R, V)).astype(np.float32) * rng.uniform(0.3, 4, size=(R, 1)).astype(np.float32)
    top_k = np.array([0, 1, 5, 20, 0, 0, 3, V + 5], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 0.8, 0.5, 0.95, 0.3, 1.0], np.float32)
    got = np.asarray(top_k_top_p_jit(x, top_k, top_p, max_candidates=max_candidates))
    ref = ref_top_k_top_p(x, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_array_equal(got[np.isfinite(got)], x[np.isfinite(got)])   # kept logits unchanged


def test_top_k_top_p_mask_matches_reference_on_random_parameters():
    rng = np.random.default_rng(11)
    for _ in range(25):
        x = (rng.normal(size=(R, V)) * rng.uniform(0.2, 6, size=(R, 1))).astype(np.float32)
        top_k = np.where(rng.random(R) < 0.5, 0, rng.integers(1, V + 3, size=R)).astype(np.int32)
        top_p = np.where(rng.random(R) < 0.3, 1.0, rng.uniform(0.05, 1.0, size=R)).astype(np.float32)
        for max_candidates in (8, V):
            got = np.asarray(top_k_top_p_jit(x, top_k, top_p, max_candidates=max_candidates))
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref_top_k_top_p(x, top_k, top_p)))


def test_top_k_top_p_is_identity_when_no_row_filters():
    x = np.random.default_rng(2).normal(size=(R, V)).astype(np.float32)
    got = top_k_top_p_jit(x, np.zeros(R, np.int32), np.ones(R, np.float32), max_candidates=4)
    np.testing.assert_array_equal(np.asarray(got), x)


def test_min_p_mask():
    x = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04], [0.5, 0.3, 0.1, 0.06, 0.04]], np.float32))
    got = np.asarray(jax.jit(S.apply_min_p)(x, np.array([0.15, 0.0], np.float32)))
    np.testing.assert_array_equal(np.isfinite(got[0]), [True, True, True, False, False])  # >= 0.075 kept
    np.testing.assert_array_equal(got[1], x[1])


# ---- distributions ---------------------------------------------------------------------------------
DIST_ROWS = 4096
DIST_V = 8
DIST_LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def empirical(params, step=0):
    m = meta_for([params] * DIST_ROWS, pad_to=DIST_ROWS, vocab=DIST_V,
                 request_ids=[f"req-{i}" for i in range(DIST_ROWS)], step=step)
    out = sample_jit(np.tile(DIST_LOGITS, (DIST_ROWS, 1)), m)
    return np.bincount(np.asarray(out.token_ids), minlength=DIST_V) / DIST_ROWS


def softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


@pytest.mark.parametrize("params, support", [
    (SamplingParams(temperature=0.7), None),
    (SamplingParams(temperature=1.3, top_k=3), 3),
    (SamplingParams(temperature=1.0, top_p=0.75), None),
    (SamplingParams(temperature=1.0, min_p=0.2), None),
])
def test_empirical_frequencies_match_the_filtered_softmax(params, support):
    scaled = DIST_LOGITS / params.temperature
    masked = ref_top_k_top_p(scaled[None], np.array([params.top_k]), np.array([params.top_p]))[0]
    if params.min_p:
        masked[masked < masked.max() + np.log(params.min_p)] = -np.inf
    expected = softmax(masked)
    if support is not None:
        assert np.count_nonzero(expected) == support
    freq = (empirical(params, step=0) + empirical(params, step=1)) / 2
    assert np.all(freq[expected == 0] == 0), "sampled a token outside the kept set"
    # 8192 samples: the standard error of a frequency is <= 0.0055, so 0.03 is > 5 sigma
    np.testing.assert_allclose(freq, expected, atol=0.03)
    assert np.count_nonzero(freq) == np.count_nonzero(expected)


# ---- seeds -------------------------------------------------------------------------------------------
def test_seeded_rows_reproduce_whatever_the_batch(logits):
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    row = np.asarray(logits[3])

    def seeded_token(position, batch, num_out, extra_step):
        params = [other] * batch
        params[position] = seeded
        x = np.tile(np.roll(row, 0), (batch, 1))
        x[:position] += 1.0    # different neighbours must not matter
        m = meta_for(params, num_out=[num_out] * batch, pad_to=max(batch, R), step=extra_step,
                     request_ids=[f"n{i}" for i in range(batch)])
        x = np.pad(x, ((0, max(batch, R) - batch), (0, 0)))
        return int(sample_jit(x, m).token_ids[position])

    for num_out in range(6):
        tokens = {seeded_token(0, 1, num_out, 0), seeded_token(5, 8, num_out, 3), seeded_token(2, 3, num_out, 9)}
        assert len(tokens) == 1
        key = jax.random.fold_in(jax.random.PRNGKey(1234), num_out)
        assert tokens == {ref_inverse_cdf(row, key)}
    # and the stream is random, not constant
    assert len({seeded_token(0, 1, n, 0) for n in range(12)}) > 3


def test_request_seeds_act_as_seeds_unless_the_params_have_one(logits):
    params = [SamplingParams(), SamplingParams(seed=99), SamplingParams()]
    m = meta_for(params, num_out=[4, 4, 4], request_seeds=[7, 8, None], request_ids=["a", "b", "c"], step=2)
    assert m.seeded[:3].tolist() == [True, True, False]
    np.testing.assert_array_equal(m.seed_key_data[0], S.seed_key_data(7))
    np.testing.assert_array_equal(m.seed_key_data[1], S.seed_key_data(99))
    assert m.key_counter[:3].tolist() == [4, 4, 2]
    out = sample_jit(logits, m)
    assert int(out.token_ids[0]) == ref_inverse_cdf(logits[0], jax.random.fold_in(jax.random.PRNGKey(7), 4))


def test_unseeded_rows_differ_across_requests_and_steps(logits):
    flat = np.zeros((R, V), np.float32)
    ids = [f"r{i}" for i in range(R)]
    a = np.asarray(sample_jit(flat, meta_for([SamplingParams()] * R, request_ids=ids, step=0)).token_ids)
    b = np.asarray(sample_jit(flat, meta_for([SamplingParams()] * R, request_ids=ids, step=1)).token_ids)
    c = np.asarray(sample_jit(flat, meta_for([SamplingParams()] * R, request_ids=ids, step=0)).token_ids)
    np.testing.assert_array_equal(a, c)                  # same engine seed, request and step
    assert len(set(a.tolist())) > 3 and not np.array_equal(a, b)


def test_seed_key_data_matches_jax():
    for seed in (0, 1, 42, 2**31 - 1, 987654321):
        np.testing.assert_array_equal(S.seed_key_data(seed), jax.random.key_data(jax.random.PRNGKey(seed)))


# ---- penalties and min_tokens ----------------------------------------------------------------------
def test_penalties_match_numpy_reference(logits):
    rng = np.random.default_rng(3)
    params = [SamplingParams(presence_penalty=float(rng.uniform(-2, 2)),
                             frequency_penalty=float(rng.uniform(-2, 2)),
                             repetition_penalty=float(rng.uniform(0.5, 2))) for _ in range(6)]
    params[0] = SamplingParams()                                   # a row with no penalty at all
    outputs = [rng.integers(0, V, size=rng.integers(0, 20)).tolist() for _ in range(6)]
    outputs[1] = [7, 7, 7, 9]                                      # repeated ids count
    prompts = [rng.integers(0, V, size=rng.integers(1, 30)).tolist() for _ in range(6)]
    m = meta_for(params, outputs=outputs, prompts=prompts)
    got = np.asarray(penalties_jit(logits, m))
    ref = ref_penalties(logits[:6], outputs, prompts, [p.presence_penalty for p in params],
                        [p.frequency_penalty for p in params], [p.repetition_penalty for p in params])
    np.testing.assert_allclose(got[:6], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[6:], logits[6:])             # padding rows untouched
    # greedy rows pick the argmax of the penalised logits
    greedy = [SamplingParams(temperature=0, presence_penalty=p.presence_penalty,
                             frequency_penalty=p.frequency_penalty,
                             repetition_penalty=p.repetition_penalty) for p in params]
    out = sample_jit(logits, meta_for(greedy, outputs=outputs, prompts=prompts))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:6], ref.argmax(1))


def test_penalty_arrays_are_absent_unless_used():
    m = meta_for([SamplingParams(), SamplingParams(temperature=0)], outputs=[[1] * 40, [2]])
    assert m.output_token_ids.shape == (R, 0) and m.prompt_token_ids.shape == (R, 0)
    # min_tokens ids keep a fixed width (8) so a request entering/leaving min_tokens never recompiles
    assert m.blocked_token_ids.shape == (R, 8) and np.all(m.blocked_token_ids == V)
    m = meta_for([SamplingParams(frequency_penalty=1.0), SamplingParams()], outputs=[[1] * 40, [2]])
    assert m.output_token_ids.shape == (R, 64) and m.prompt_token_ids.shape == (R, 0)
    assert m.output_token_ids[0, 39] == 1 and m.output_token_ids[0, 40] == V    # padding is out of range
    assert [S.length_bucket(n) for n in (0, 1, 16, 17, 100)] == [0, 16, 16, 32, 128]
    # the runner fixes the width (its max_model_len bucket) so steady state never recompiles
    m = meta_for([SamplingParams(presence_penalty=1.0)], outputs=[[3] * 5], penalty_width=256)
    assert m.output_token_ids.shape == (R, 256) and m.prompt_token_ids.shape == (R, 256)
    assert meta_for([SamplingParams()], penalty_width=256).output_token_ids.shape == (R, 0)
    with pytest.raises(ValueError, match="a prompt or output of 300 tokens exceeds penalty_width=256"):
        meta_for([SamplingParams(presence_penalty=1.0)], prompts=[[1] * 300], penalty_width=256)


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    x = np.zeros((R, V), np.float32)
    x[:, 2] = 10.0      # eos is by far the most likely
    x[:, 5] = 9.0       # then a stop token id
    x[:, 11] = 8.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    p.update_from_generation_config({}, eos_token_id=2)
    q = SamplingParams(temperature=0, ignore_eos=True, min_tokens=3)
    q.update_from_generation_config({}, eos_token_id=2)
    for num_out, expected in [(0, 11), (2, 11), (3, 2)]:
        out = sample_jit(x, meta_for([p, q], num_out=[num_out, num_out]))
        # q has no stop ids: only eos is blocked (even with ignore_eos, as in vLLM)
        assert np.asarray(out.token_ids)[:2].tolist() == [expected, 5 if num_out < 3 else 2]
        assert int(out.token_ids[2]) == 2        # padding rows are not blocked
    # random rows are blocked too
    r = SamplingParams(temperature=1.0, min_tokens=2)
    r.update_from_generation_config({}, eos_token_id=2)
    ids = [f"m{i}" for i in range(R)]
    blocked = np.asarray(sample_jit(x, meta_for([r] * R, num_out=[1] * R, request_ids=ids)).token_ids)
    free = np.asarray(sample_jit(x, meta_for([r] * R, num_out=[2] * R, request_ids=ids)).token_ids)
    assert set(blocked.tolist()) <= {5, 11}    # 2 is blocked; 5 (not a stop id of r) and 11 dominate
    assert 2 in free.tolist()


def test_padding_rows_do_not_change_real_rows(logits):
    params = [SamplingParams(seed=3), SamplingParams(temperature=0), SamplingParams(seed=4, top_p=0.9)]
    small = sample_jit(logits[:4], meta_for(params, pad_to=4), num_logprobs=2)
    big = sample_jit(logits, meta_for(params, pad_to=R), num_logprobs=2)
    for field in small._fields:
        np.testing.assert_array_equal(np.asarray(getattr(small, field))[:3], np.asarray(getattr(big, field))[:3])
    assert np.all(np.isfinite(np.asarray(big.logprob)))


def test_builder_takes_numpy_rows_like_lists():
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5)]
    outputs, prompts = [[1, 2, 2], [5]], [[7, 8], [9, 9, 9]]
    as_lists = meta_for(params, outputs=outputs, prompts=prompts)
    as_arrays = meta_for(params, outputs=[np.array(o, np.int32) for o in outputs],
                         prompts=[np.array(p, np.int32) for p in prompts], num_out=[3, 1])
    for a, b in zip(jax.tree.leaves(as_lists), jax.tree.leaves(as_arrays)):
        np.testing.assert_array_equal(a, b)


def test_builder_rejects_too_many_rows():
    with pytest.raises(ValueError, match="do not fit the request bucket pad_to=1"):
        meta_for([SamplingParams()] * 2, pad_to=1)


def test_static_filter_modes_equal_dynamic_sampling():
    """The GPU path (filtering static, no lax.cond) samples exactly what the CPU path (lax.cond) does."""
    from jaxserve.runner import sampler as S
    rng = np.random.default_rng(0)
    V, R = 300, 8
    logits = jnp.asarray(rng.normal(size=(R, V)) * 3, jnp.float32)
    filtered = [SamplingParams(temperature=0.8, top_p=0.7, top_k=k, seed=i) for i, k in enumerate([0, 5, 0, 300, 2, 0, 50, 1])]
    plain = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 0.5, 1, 0, 0.7, 0, 1, 2])]
    for params, mode in ((filtered, True), (plain, False)):
        m = S.make_sampling_metadata(params, [[]] * R, [[1]] * R, [0] * R, V, pad_to=R)
        assert np.array_equal(S.sample(logits, m, filtering=None).token_ids, S.sample(logits, m, filtering=mode).token_ids)


# ---- logit_bias, allowed_token_ids, bad words ---------------------------------------------------------
processed_jit = jax.jit(S.processed_logits)


def ref_processed(logits, params, outputs, prompts, num_out):
    """vLLM v1's order, in numpy: allowed_token_ids, bad words, min_tokens, logit_bias, penalties."""
    out = logits.astype(np.float64).copy()
    for i, p in enumerate(params):
        row = out[i]
        if p.allowed_token_ids:
            keep = np.zeros(row.size, bool)
            keep[p.allowed_token_ids] = True
            row[~keep] = -np.inf
        for word in p.bad_words_token_ids or ():
            if len(word) == 1 or outputs[i][len(outputs[i]) - len(word) + 1:] == word[:-1] \
                    and len(outputs[i]) >= len(word) - 1:
                row[word[-1]] = -np.inf
        if num_out[i] < p.min_tokens:
            row[sorted(p.all_stop_token_ids)] = -np.inf
        for t, b in (p.logit_bias or {}).items():
            row[t] += b
    pen = ref_penalties(out, outputs, prompts, [p.presence_penalty for p in params],
                        [p.frequency_penalty for p in params], [p.repetition_penalty for p in params])
    return pen


def restricted(bad=None, **kw):
    """SamplingParams whose bad words are given as token sequences (what update_from_tokenizer makes)."""
    p = SamplingParams(bad_words=["w"] * bool(bad), **kw)
    p._bad_words_token_ids = bad
    p.update_from_generation_config({}, eos_token_id=2)
    return p


@pytest.mark.parametrize("seed", range(4))
def test_token_restrictions_match_vllms_order_in_numpy(logits, seed):
    rng = np.random.default_rng(seed)
    params, outputs = [], []
    for i in range(R - 1):
        out = rng.integers(0, V, size=int(rng.integers(0, 6))).tolist()
        kw = {}
        if rng.random() < 0.5:
            kw["logit_bias"] = {int(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, int(rng.integers(1, 20)))}
        if rng.random() < 0.4:
            kw["allowed_token_ids"] = rng.choice(V, int(rng.integers(1, 40)), replace=False).tolist()
        if rng.random() < 0.5:
            kw["repetition_penalty"] = float(rng.uniform(0.5, 2))
            kw["frequency_penalty"] = float(rng.uniform(-2, 2))
        bad = None
        if rng.random() < 0.6:      # one-token words, and words whose prefix the output ends with (or not)
            bad = [[int(rng.integers(V))], out[-1:] + [int(rng.integers(V))], [V - 1, 5, 6], out[-2:] + [9]]
            bad = [w for w in bad if w]
        params.append(restricted(bad, min_tokens=int(rng.integers(0, 3)), **kw))
        outputs.append(out)
    prompts = [rng.integers(0, V, size=5).tolist() for _ in params]
    num_out = [len(o) for o in outputs]
    m = meta_for(params, outputs=outputs, prompts=prompts, num_out=num_out)
    got = np.asarray(processed_jit(logits, m))
    ref = ref_processed(logits[:R - 1], params, outputs, prompts, num_out)
    np.testing.assert_array_equal(np.isinf(got[:R - 1]), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[:R - 1][finite], ref[finite], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got[R - 1], logits[R - 1])          # the padding row is untouched
    greedy = [dataclasses.replace(p, temperature=0) for p in params]
    for g, p in zip(greedy, params):
        g._bad_words_token_ids = p._bad_words_token_ids
        g.update_from_generation_config({}, eos_token_id=2)
    out = sample_jit(logits, meta_for(greedy, outputs=outputs, prompts=prompts, num_out=num_out))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:R - 1], ref.argmax(1))


def test_greedy_with_a_plus_100_bias_emits_that_token_and_logprobs_stay_raw(logits):
    low = logits.argmin(1)
    params = [SamplingParams(temperature=0, logit_bias={int(t): 100}) for t in low[:4]] + \
        [SamplingParams(temperature=0, logit_bias={int(logits[4].argmax()): -100})]
    out = sample_jit(logits, meta_for(params), num_logprobs=2)
    assert np.asarray(out.token_ids)[:4].tolist() == low[:4].tolist()
    assert int(out.token_ids[4]) == int(np.argsort(-logits[4])[1])     # the top token pushed below the second
    raw = np_log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(np.asarray(out.logprob)[:4], raw[np.arange(4), low[:4]], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.rank)[:4], np.full(4, V))     # vLLM's raw logprobs and ranks


def test_random_rows_sample_only_allowed_and_never_bad_tokens(logits):
    allowed = [3, 17, 40]
    rows = [SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=i) for i in range(R // 2)] + \
        [restricted([[int(t)] for t in np.argsort(-logits[i])[:5]], temperature=1.0, seed=i) for i in range(R // 2)]
    seen = set()
    for step in range(30):
        m = meta_for(rows, num_out=[step] * R)
        toks = np.asarray(sample_jit(logits, m).token_ids)
        seen |= set(toks[:R // 2].tolist())
        for i in range(R // 2):
            assert toks[R // 2 + i] not in np.argsort(-logits[i])[:5]
    assert seen == set(allowed)


def test_bad_word_rule_on_the_host():
    words = [[5], [7, 8], [1, 2, 3]]
    assert S.blocked_by_bad_words(words, []) == [5]
    assert S.blocked_by_bad_words(words, [9, 7]) == [5, 8]
    assert S.blocked_by_bad_words(words, np.array([1, 2], np.int32)) == [5, 3]
    assert S.blocked_by_bad_words(words, [2]) == [5]                  # the prefix must be the output's tail
    p = restricted([[5], [7, 8]], min_tokens=2, stop_token_ids=[6])
    m = meta_for([p], outputs=[[7]], num_out=[1])
    assert sorted(m.blocked_token_ids[0][m.blocked_token_ids[0] < V].tolist()) == [2, 5, 6, 8]


# the packed layout of a sampling step at R=4 before logit_bias / allowed_token_ids / bad words existed
PLAIN_LAYOUT_R4 = (
    ("temperature", (4,), "f32"), ("top_p", (4,), "f32"), ("top_k", (4,), "i32"), ("min_p", (4,), "f32"),
    ("presence_penalty", (4,), "f32"), ("frequency_penalty", (4,), "f32"), ("repetition_penalty", (4,), "f32"),
    ("seed_key_data", (4, 2), "u32"), ("seeded", (4,), "bool"), ("request_hash", (4,), "u32"),
    ("key_counter", (4,), "u32"), ("engine_key_data", (2,), "u32"), ("output_token_ids", (4, 0), "i32"),
    ("prompt_token_ids", (4, 0), "i32"), ("blocked_token_ids", (4, 8), "i32"))


def test_a_step_without_token_restrictions_keeps_its_layout_hence_its_program():
    """The sampler variant's key holds the packed layout: a step whose rows use none of the new fields packs
    exactly as before they existed (no empty pieces), so it runs the same compiled program; one that uses
    them adds power-of-two-wide pieces."""
    from jaxserve.runner import packing
    from jaxserve.runner.input_batch import InputBatch
    from jaxserve.engine.request import Request
    from jaxserve.engine.scheduler_output import ScheduledRequest

    def layout(params, **kw):
        return packing.pack(packing.fields(meta_for(params, pad_to=4, **kw)))[2]
    plain = [SamplingParams(temperature=0.7, top_k=5, min_tokens=2, stop_token_ids=[3]), SamplingParams(seed=1)]
    assert tuple(tuple(p) for p in layout(plain)) == PLAIN_LAYOUT_R4
    batch = InputBatch(4, 2, V)
    sched = [ScheduledRequest(Request(f"r{i}", [1], p), 1, 0, []) for i, p in enumerate(plain)]
    fast = batch.sampling_metadata(batch.rows_for(sched), np.array([3, 3]), 4, step=0, engine_seed=0)
    assert tuple(tuple(p) for p in packing.pack(packing.fields(fast))[2]) == PLAIN_LAYOUT_R4
    used = layout([SamplingParams(logit_bias={1: 2.0, 3: -1.0}), SamplingParams(allowed_token_ids=list(range(20)))])
    assert tuple(used[:15]) == PLAIN_LAYOUT_R4
    assert [tuple(p) for p in used[15:]] == [("allowed_token_ids", (4, 32), "i32"), ("logit_bias_ids", (4, 16), "i32"),
                                              ("logit_bias_values", (4, 16), "f32")]
    bad = layout([restricted([[4], [5]])])                           # bad words share the blocked ids' 8
    assert tuple(tuple(p) for p in bad) == PLAIN_LAYOUT_R4
    # a restricted row always takes the general path (the persistent rows hold no lists)
    rows = batch.rows_for([ScheduledRequest(Request("b", [1], SamplingParams(logit_bias={1: 1.0})), 1, 0, [])])
    assert batch.needs_general_path(rows, np.array([5]))
