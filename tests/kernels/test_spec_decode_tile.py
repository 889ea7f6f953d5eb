"""The decode-only launch over steps whose requests have 1 to ``md.max_q_len`` new tokens (a speculative verify
step: the last known token and its drafts), in interpret mode on CPU (compiled on a GPU host), against the
reference: attention alone, and with the step's K/V written in the same launch (``ops.write_kv_and_attend``'s
packed call), whose caches must equal the reference scatter's.

Cases: q_len 1..max_q_len mixed in one step (a bound that is not a power of two included), odd contexts over
many pages, GQA groups 1, 4 and 8, sliding windows, soft-capping, one split and flash-decoding splits (a
request's new tokens across a split edge), padding tokens and requests, an fp8 cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import synthetic
from jaxserve.kernels import ops, ref_attention
from jaxserve.kernels import paged_attention_pallas as pa

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
INTERPRET = jax.default_backend() != "gpu"


def _step(seed, q_lens, ctx_lens, *, d=32, dtype=jnp.float32, max_q_len=None, **kw):
    """A verify step (``max_q_len``: default the longest request's tokens), 3 padding tokens, a padding request."""
    return synthetic.fused_decode_step(seed, q_lens, ctx_lens, d=d, dtype=dtype, pad_tokens=3,
                                       max_q_len=max_q_len or max(q_lens), **kw)


def _real_rows(md):
    return int(np.asarray(md.query_start_loc)[int(md.num_seqs)])


def _close(got, want, n, tol):
    got, want = np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32)
    assert not np.isnan(got).any()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= tol, f"max rel err {err:.2e} > {tol:.0e}"


CASES = [   # (q_lens, ctx_lens, hq, kvh)
    ([5, 1, 3, 2], [37, 1, 130, 19], 4, 4),          # group 1; 4 splits: an edge at 32, the first new token
    ([1, 4, 2, 5], [9, 77, 200, 66], 8, 2),          # group 4; 4 and 8 splits put an edge at 64, in 61..65
    ([3, 5, 1], [17, 150, 64], 8, 1),                # group 8
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("splits,window,soft_cap", [(1, None, None), (4, None, 30.0), (1, 20, None), (4, 40, 20.0)])
def test_multi_token_decode_matches_the_reference(case, splits, window, soft_cap):
    q_lens, ctx_lens, hq, kvh = CASES[case]
    q, _, _, k_cache, v_cache, md, _ = _step(11 + case, q_lens, ctx_lens, hq=hq, kvh=kvh)
    kw = dict(sm_scale=0.2, sliding_window=window, soft_cap=soft_cap)
    want = ref_attention.ragged_paged_attention(q, k_cache, v_cache, md, **kw)
    got = pa.ragged_paged_attention(q, k_cache, v_cache, md, poison_output=True, decode_splits=splits,
                                    decode_block_k=16, interpret=INTERPRET, **kw)
    _close(got, want, _real_rows(md), TOL[jnp.float32])


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("splits,window", [(1, None), (8, None), (4, 24)])
def test_fused_write_of_all_new_tokens(case, splits, window):
    """The launch stores every new token's K/V (the split holding its position) and attends to them from
    registers: the output and the caches equal the reference's scatter then attention."""
    q_lens, ctx_lens, hq, kvh = CASES[case]
    q, new_k, new_v, k_cache, v_cache, md, _ = _step(21 + case, q_lens, ctx_lens, hq=hq, kvh=kvh)
    kw = dict(sm_scale=0.2, sliding_window=window)
    want, wk, wv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, **kw)
    got, gk, gv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, backend="pallas",
                                          interpret=INTERPRET, decode_splits=splits, decode_block_k=16, **kw)
    _close(got, want, _real_rows(md), TOL[jnp.float32])
    for g, w in ((gk, wk), (gv, wv)):       # block 0 aside: the reference's padding tokens land there
        np.testing.assert_array_equal(np.asarray(g[1:].astype(jnp.float32)), np.asarray(w[1:].astype(jnp.float32)))


def test_bound_above_the_step_and_not_a_power_of_two():
    """max_q_len 7 (K = 6) over a step whose longest request has 3 tokens: rows padded to 8 tokens, masked."""
    q, new_k, new_v, k_cache, v_cache, md, _ = _step(31, [3, 1, 2], [50, 8, 260], hq=4, kvh=2, max_q_len=7)
    want, *_ = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, sm_scale=0.2)
    for splits in (1, 4):
        got, *_ = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, sm_scale=0.2, backend="pallas",
                                          interpret=INTERPRET, decode_splits=splits, decode_block_k=16)
        _close(got, want, _real_rows(md), TOL[jnp.float32])


def test_fp8_cache_bf16():
    """An fp8 cache (V pages transposed, per-head scales): the new tokens quantized on the way in, as the
    reference's write does, split and not."""
    q, new_k, new_v, k_cache, v_cache, md, kw = _step(41, [4, 1, 5], [40, 9, 100], hq=6, kvh=3, d=64,
                                                      dtype=jnp.bfloat16, cache="fp8")
    want, wk, wv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, sm_scale=0.125, **kw)
    for splits in (1, 4):
        got, gk, gv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, sm_scale=0.125,
                                              backend="pallas", interpret=INTERPRET, decode_splits=splits,
                                              decode_block_k=16, **kw)
        _close(got, want, _real_rows(md), TOL[jnp.bfloat16])
        for g, w in ((gk, wk), (gv, wv)):
            np.testing.assert_array_equal(np.asarray(g[1:].astype(jnp.float32)),
                                          np.asarray(w[1:].astype(jnp.float32)))


@pytest.mark.parametrize("cache", [None, "fp8"])
@pytest.mark.parametrize("hq,kvh", [(8, 2), (32, 4)])
def test_verify_launch_lowers_for_cuda(cache, hq, kvh):
    """The multi-token decode launch's GPU build lowers to Triton here (tile shapes powers of two, 32 and 64 rows):
    one launch with one split, the decode then the combine with four; no separate K/V write kernel."""
    q, new_k, new_v, k_cache, v_cache, md, kw = _step(51, [5, 1, 3], [40, 9, 300], hq=hq, kvh=kvh, d=128,
                                                      dtype=jnp.bfloat16, cache=cache)
    for splits, launches in ((1, 1), (4, 2)):
        text = synthetic.lower_fused_decode_for_h200((q, new_k, new_v, k_cache, v_cache), md, splits, **kw)
        assert text.count("__gpu$xla.gpu.triton") == launches
        assert "paged_kv_write" not in text
