"""The step's packed host inputs: what the jitted code unpacks equals what the host packed, and the layout (a
jit static argument) depends only on shapes, so a bucket keeps one compiled program."""
import jax
import numpy as np

from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.runner import packing, sampler as sampler_mod
from jaxserve.runner.step_inputs import forward_pack
from jaxserve.sampling_params import SamplingParams


def test_pack_unpack_roundtrip_all_kinds_inside_jit():
    rng = np.random.default_rng(0)
    arrays = {
        "f": rng.standard_normal((3, 5)).astype(np.float32),
        "i": rng.integers(-2**31, 2**31 - 1, size=(7,), dtype=np.int64).astype(np.int32),
        "u": rng.integers(0, 2**32 - 1, size=(4, 2), dtype=np.uint64).astype(np.uint32),   # high bit set too
        "b": rng.random(6) < 0.5,
        "scalar": np.int32(42),
        "empty": np.zeros((3, 0), np.int32),
        "f2": np.array([np.inf, -0.0, 1e-30], np.float32),
    }
    ints, floats, layout = packing.pack(arrays)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    assert ints.size == 7 + 8 + 6 + 1 and floats.size == 15 + 3
    out = jax.jit(packing.unpack, static_argnums=2)(ints, floats, layout)
    for name, a in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(a).dtype and got.shape == np.shape(a), name
        np.testing.assert_array_equal(got, a, err_msg=name)


def _md(T, R, P, rng):
    return AttentionMetadata(slot_mapping=rng.integers(0, 99, T).astype(np.int32),
                             block_tables=rng.integers(0, 99, (R, P)).astype(np.int32),
                             seq_lens=rng.integers(0, 99, R).astype(np.int32),
                             query_start_loc=np.sort(rng.integers(0, T, R + 1)).astype(np.int32),
                             num_seqs=np.int32(rng.integers(0, R)))


def test_forward_layout_depends_on_the_bucket_only():
    rng = np.random.default_rng(1)
    layouts = set()
    for _ in range(5):
        T, R, P = 16, 8, 4
        ints, layout = forward_pack(rng.integers(0, 9, T).astype(np.int32), np.arange(T, dtype=np.int32),
                                    _md(T, R, P, rng), rng.integers(0, T, R).astype(np.int32),
                                    np.full(T, -1, np.int32))
        layouts.add(layout)
        x = packing.unpack(ints, np.zeros(0, np.float32), layout)
        assert x["md.block_tables"].shape == (R, P) and x["md.num_seqs"].shape == ()
    assert len(layouts) == 1


def test_sampling_metadata_survives_packing():
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, min_p=0.1),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5)]
    meta = sampler_mod.make_sampling_metadata(params, [[1, 2], [3]], [[4, 5, 6], [7]], [2, 1], vocab_size=50,
                                              pad_to=4, request_seeds=[3, None], penalty_width=8)
    ints, floats, layout = packing.pack(packing.fields(meta))
    back = sampler_mod.SamplingMetadata(**jax.jit(packing.unpack, static_argnums=2)(ints, floats, layout))
    for name, a in packing.fields(meta).items():
        np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(a), err_msg=name)
