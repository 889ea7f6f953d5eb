"""The Mosaic GPU prefill kernel's persistent programs (``kernels/prefill_mgpu.py``).

Interpret mode on CPU against the pure-jnp reference: a few programs each loop over many work items (empty
ones, ragged tiles, tiles of different lengths), so the protocol across items (K/V steps numbered across
items, Q loaded one item ahead, the ping-pong barrier balanced per item) is exercised. Interpret mode checks
that every barrier phase is observed by every waiter, in order (a mismatch raises or hangs), and its race
detector (``detect_races``) that no shared-memory buffer is reused before the asynchronous copy or MMA using
it is waited for: it reports the output buffer rewritten with the previous item's TMA store unwaited.
Only prefill tokens' rows are compared (the kernel writes no other row; interpret mode reads unwritten
memory as NaN). Then the GPU build lowers for CUDA on CPU (register A operand, accumulation in the MMA, the
227 KiB shared-memory limit).
"""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from support import synthetic
from jaxserve.kernels import prefill_mgpu, ref_attention

RACES = plgpu.InterpretGPUParams(detect_races=True)     # prints "RACE DETECTED" for each race


def _batch(seed, q_lens, ctx_lens, *, hq, kvh, d, bs, pad_tokens=3, pad_reqs=1):
    rng = np.random.default_rng(seed)
    return synthetic.make_batch(rng, q_lens, ctx_lens, block_size=bs, num_q_heads=hq, num_kv_heads=kvh,
                                head_dim=d, dtype=jnp.bfloat16, pad_tokens=pad_tokens, pad_reqs=pad_reqs)


def _prefill_rows(md, q_lens):
    qsl = np.asarray(md.query_start_loc)
    return np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r, n in enumerate(q_lens) if n > 1])


@pytest.mark.parametrize("q_lens,ctx_lens,hq,kvh,d,bs,block_kv,stages,num_programs", [
    # tiles that end 1 row short, exactly, and 1 row past a warpgroup's 64; decodes and a 2-token chunk
    # between; padding. 7 slots x 4 heads = 28 items over 3 programs, most of them empty
    ([64, 1, 63, 65, 2], [64, 3, 100, 65, 40], 4, 2, 64, 16, 64, 2, 3),
    # GQA group 3, 32-token pages, 3 stages; a 200-token chunk on a 190-token cached prefix next to a fresh
    # 130-token prompt: items of 1 to 7 K/V steps, 8 slots x 6 heads over 5 programs
    pytest.param([1, 200, 1, 5, 130], [30, 390, 7, 300, 130], 6, 2, 64, 32, 64, 3, 5,
                 marks=pytest.mark.slow),     # ~16 s
    # head_dim 128, 2 pages per K/V step; more programs asked for than there are items (clamped to 5 x 2)
    ([129, 1, 70], [129, 20, 200], 2, 1, 128, 32, 64, 2, 132),
    # block_kv 128: half-width last steps, for the first warpgroup of aligned tiles (the 129-token prompt)
    # and for the second (a 200-token chunk on a 64-token prefix: rows end at 191 and 263)
    pytest.param([129, 1, 200], [129, 20, 264], 2, 1, 64, 16, 128, 2, 4, marks=pytest.mark.slow),   # ~8 s
])
def test_persistent_matches_reference(q_lens, ctx_lens, hq, kvh, d, bs, block_kv, stages, num_programs, capsys):
    q, k, v, md = _batch(hq * 10 + bs, q_lens, ctx_lens, hq=hq, kvh=kvh, d=d, bs=bs)
    ref = ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=d ** -0.5)
    out = prefill_mgpu.prefill_attention(q, k, v, md, sm_scale=d ** -0.5, block_kv=block_kv, stages=stages,
                                         interpret=RACES, num_programs=num_programs)
    assert "RACE DETECTED" not in capsys.readouterr().out
    assert out.shape == q.shape and out.dtype == q.dtype
    rows = _prefill_rows(md, q_lens)
    got, want = np.asarray(out[rows], np.float32), np.asarray(ref[rows], np.float32)
    assert not np.isnan(got).any(), "a prefill row was never written"
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= 1e-2, f"max rel err {err:.2e}"


def test_persistent_shared_memory():
    """The Q staging buffer costs 32 KiB at head_dim 128: 224 KiB of 227 at block_kv 128, 2 stages."""
    q, k = jnp.zeros((8, 4, 128), jnp.bfloat16), jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    assert prefill_mgpu.smem_bytes(128, 128, 2) == 224 * 1024
    assert prefill_mgpu.supported(q, k)
    assert not prefill_mgpu.supported(q, k, block_kv=64, stages=5)
    q64, k64 = jnp.zeros((8, 4, 64), jnp.bfloat16), jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    assert prefill_mgpu.supported(q64, k64, stages=3)


@pytest.mark.parametrize("d,bs,block_kv,stages,pad", [
    (128, 16, 128, 2, 7),   # the benchmarked configuration: 224 KiB of shared memory
    (64, 32, 64, 3, 3),
    (64, 16, 256, 2, 3),    # half-width steps of 128 keys
])
def test_persistent_lowers_for_cuda(d, bs, block_kv, stages, pad):
    """The GPU build of the persistent kernel lowers to Mosaic GPU for CUDA on CPU (the lowering checks the
    shared-memory limit); token counts 208 and 204 (a multiple of 8 and not)."""
    q, k, v, md = _batch(6, [200, 1], [300, 40], hq=4, kvh=2, d=d, bs=bs, pad_tokens=pad)
    fn = jax.jit(functools.partial(prefill_mgpu.prefill_attention, sm_scale=0.1, block_kv=block_kv,
                                   stages=stages))
    text = fn.trace(q, k, v, md).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_slot_order_sorts_tiles_by_their_kv_steps():
    """The persistent programs take slots most-K/V-steps first: checked against the steps counted by hand
    for a batch with a decode, a chunk on a cached prefix, a ragged prompt and padding."""
    q_lens, ctx_lens = [1, 200, 300, 2], [50, 456, 300, 40]
    q, k, v, md = _batch(5, q_lens, ctx_lens, hq=2, kvh=1, d=64, bs=16, pad_tokens=5, pad_reqs=1)
    T, R = q.shape[0], md.seq_lens.shape[0]
    n_slots = T // prefill_mgpu.TILE + R
    order = np.asarray(prefill_mgpu.slot_order(md, n_slots, 64))
    assert sorted(order.tolist()) == list(range(n_slots))          # a permutation of the slots
    qsl, seq_lens = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    steps = np.zeros(n_slots, int)
    for r in range(int(md.num_seqs)):
        n = qsl[r + 1] - qsl[r]
        if n < 2:
            continue                                                 # decodes: not this kernel's
        first = qsl[r] // prefill_mgpu.TILE + r
        for t in range(-(-n // prefill_mgpu.TILE)):
            seen = seq_lens[r] - n + min((t + 1) * prefill_mgpu.TILE, n)
            steps[first + t] = -(-seen // 64)
    assert steps.max() == 8 and (steps > 0).sum() == 6               # 456 keys; 2 + 3 + 1 tiles
    got = steps[order]
    assert list(got) == sorted(steps, reverse=True)                  # most steps first, empty slots last
    assert list(order[:6]) == [2, 1, 5, 4, 3, 6]


def test_persistent_snake_deal_covers_every_item(capsys):
    """5 slots (4 tiles of one 512-token prompt, 1 empty) over 3 programs: round 1 runs backwards and is
    partial, so its two items (one of them a real tile) go to programs 1 and 2; a miscounted deal leaves
    rows unwritten (NaN)."""
    q, k, v, md = _batch(9, [512], [512], hq=1, kvh=1, d=64, bs=16, pad_tokens=0, pad_reqs=0)
    out = prefill_mgpu.prefill_attention(q, k, v, md, sm_scale=0.125, block_kv=64, interpret=RACES,
                                         num_programs=3)
    assert "RACE DETECTED" not in capsys.readouterr().out
    got = np.asarray(out, np.float32)
    assert not np.isnan(got).any(), "a tile was never computed"
    want = np.asarray(ref_attention.ragged_paged_attention(q, k, v, md, sm_scale=0.125), np.float32)
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-2


@pytest.mark.parametrize("q_lens,hq", [([2048], 32), ([1024, 1024], 32), ([512] * 4, 32), ([2048] * 8, 32),
                                       ([300, 1, 1, 700, 1], 8)])
def test_snake_deal_balances_the_programs(q_lens, hq):
    """The deal the kernel uses (``slot_order``, ``snake_item``, ``snake_count``) gives every item to exactly
    one of the 132 programs, and the busiest program at most ~3 % over the balanced bound (a step of overhead
    per item), where the earlier round-robin from the last slot was 19-47 % over for 1-4 prompts."""
    P, block_kv = 132, 128
    T = sum(q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    R = len(q_lens)
    md = prefill_mgpu.AttentionMetadata(slot_mapping=np.zeros(T, np.int32), block_tables=np.zeros((R, 1), np.int32),
                                        seq_lens=np.asarray(q_lens, np.int32), query_start_loc=qsl,
                                        num_seqs=np.int32(R))
    n_slots = T // prefill_mgpu.TILE + R
    order = np.asarray(prefill_mgpu.slot_order(md, n_slots, block_kv))
    steps = np.zeros(n_slots)
    for r, n in enumerate(q_lens):
        if n > 1:
            first = qsl[r] // prefill_mgpu.TILE + r
            for t in range(-(-n // prefill_mgpu.TILE)):
                steps[first + t] = -(-min((t + 1) * prefill_mgpu.TILE, n) // block_kv)
    cost = np.where(steps > 0, steps + 1, 0)            # one step of overhead per real item
    n_all = hq * n_slots
    P = min(P, n_all)
    load, seen = np.zeros(P), []
    for pid in range(P):
        for t in range(int(prefill_mgpu.snake_count(pid, P, n_all))):
            j = int(prefill_mgpu.snake_item(t, pid, P))
            seen.append(j)
            load[pid] += cost[order[j // hq]]
    assert sorted(seen) == list(range(n_all))
    bound = max(load.sum() / P, cost.max())
    assert load.max() <= 1.035 * bound, (load.max(), bound)
