"""The stored step programs (runner/program_cache): a warm start lowers its variants from them without
tracing, runs the same program as the cold start, and never uses an entry made for another program."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.program_cache import ProgramCache
from jaxserve.utils.file_store import stable_repr
from test_startup import PROMPTS, greedy, make_llm


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float
    table: np.ndarray | None = None


def _fn(cfg, x, y, *, mode):
    out = x * cfg.scale + y
    if cfg.table is not None:
        out = out + jnp.asarray(cfg.table).sum()
    return out if mode == "add" else out * 2


def _jitted(cfg):
    return jax.jit(functools.partial(_fn, cfg), static_argnames=("mode",), donate_argnums=(1,))


ARGS = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))


def run(cache, cfg, mode="add", args=ARGS, key="v"):
    exe = cache.lower(key, _jitted(cfg), args, {"mode": mode}, donate_argnums=(1,)).compile()
    x = jnp.arange(4, dtype=jnp.float32)
    return np.asarray(exe(x, jnp.ones(4, jnp.float32)))


def entries(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_a_stored_program_is_used_by_the_next_start_and_gives_the_same_result(tmp_path):
    cold = ProgramCache(str(tmp_path))
    want = run(cold, Cfg(3.0))
    assert (cold.hits, cold.misses) == (0, 1) and len(entries(tmp_path)) == 1
    warm = ProgramCache(str(tmp_path))                      # a new process: a new cache object on the folder
    np.testing.assert_array_equal(run(warm, Cfg(3.0)), want)
    assert (warm.hits, warm.misses) == (1, 0)


def test_a_changed_config_static_argument_or_shape_misses(tmp_path):
    cache = ProgramCache(str(tmp_path))
    run(cache, Cfg(3.0))
    # a config field that changes no shape, a static argument, an input shape, a bound array's values
    np.testing.assert_array_equal(run(cache, Cfg(2.0)), np.arange(4) * 2.0 + 1)
    np.testing.assert_array_equal(run(cache, Cfg(3.0), mode="double"), (np.arange(4) * 3.0 + 1) * 2)
    assert cache.hits == 0 and cache.misses == 3
    big = np.zeros(2000, np.float32)
    other = big.copy()
    other[1234] = 1.0                                       # numpy's repr of both is the same abridged text
    assert repr(big) == repr(other) and stable_repr(big) != stable_repr(other)
    run(cache, Cfg(3.0, big))
    np.testing.assert_array_equal(run(cache, Cfg(3.0, other)), np.arange(4) * 3.0 + 2)
    assert cache.hits == 0 and cache.misses == 5 and len(entries(tmp_path)) == 5


def test_an_entry_made_for_another_program_or_a_torn_file_is_not_used(tmp_path):
    cache = ProgramCache(str(tmp_path))
    run(cache, Cfg(3.0))
    (a,) = entries(tmp_path)
    run(cache, Cfg(5.0))
    (b,) = [e for e in entries(tmp_path) if e != a]
    # the 5.0 entry's file now holds the 3.0 program (as if a hash collided or a file was copied over)
    (tmp_path / b).write_bytes((tmp_path / a).read_bytes())
    fresh = ProgramCache(str(tmp_path))
    np.testing.assert_array_equal(run(fresh, Cfg(5.0)), np.arange(4) * 5.0 + 1)
    assert (fresh.hits, fresh.misses) == (0, 1)
    # a torn write: the header intact, the program cut short
    blob = (tmp_path / a).read_bytes()
    (tmp_path / a).write_bytes(blob[:len(blob) - 100])
    np.testing.assert_array_equal(run(fresh, Cfg(3.0)), np.arange(4) * 3.0 + 1)
    assert (fresh.hits, fresh.misses) == (0, 2)
    again = ProgramCache(str(tmp_path))                    # rewritten whole: the next start uses it
    np.testing.assert_array_equal(run(again, Cfg(3.0)), np.arange(4) * 3.0 + 1)
    assert (again.hits, again.misses) == (1, 0)
    assert not [e for e in entries(tmp_path) if e.endswith(".partial")]


def test_no_folder_lowers_the_plain_jit():
    cache = ProgramCache(None)
    np.testing.assert_array_equal(run(cache, Cfg(3.0)), np.arange(4) * 3.0 + 1)
    assert (cache.hits, cache.misses) == (0, 0)


def test_a_warm_start_of_the_engine_lowers_every_variant_from_its_program_with_the_same_tokens(tmp_path):
    outs = []
    for start in ("cold", "warm"):
        llm = make_llm(skip_warmup=True)
        runner = llm.engine.core.runner
        programs = runner.variants.programs = ProgramCache(str(tmp_path), context=runner.variants.programs.context)
        runner.warmup_for([len(p) for p in PROMPTS])
        n = len(runner.variants)
        assert (programs.hits, programs.misses) == ((0, n) if start == "cold" else (n, 0))
        kv = jax.tree.leaves(runner.kv_caches)[0]
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)])
        assert kv.is_deleted()                               # the stored forward still donates the cache
        assert runner.variants.on_first_use == []
        llm.shutdown()
    assert outs[0] == outs[1]


def test_quantized_parameters_serialize_in_a_stored_program():
    """int4 / fp8 weights are dataclass pytrees with static fields: a stored program that takes them must
    serialize (else a quantized engine never gets a warm start) and come back with the same static fields."""
    import jax
    import jax.numpy as jnp

    from jaxserve.quantization.weights import Fp8Weight, Int4Weight
    from jaxserve.runner import program_cache

    program_cache._register_step_types()
    fp8 = Fp8Weight(weight=jnp.ones((8, 4), jnp.float8_e4m3fn), scale=jnp.ones((4,), jnp.float32),
                    input_scale=None, block=False, tp_axis=1)
    int4 = Int4Weight(packed=jnp.zeros((8, 4), jnp.int32), scales=jnp.ones((1, 32), jnp.float32),
                      zeros=jnp.zeros((1, 32), jnp.float32), perm=None, group_size=8, tp_axis=None)

    def f(a, b):
        return a.weight.astype(jnp.float32).sum() * a.scale.sum() + b.scales.sum(), (a, b)

    exported = jax.export.export(jax.jit(f))(fp8, int4)
    back = jax.export.deserialize(exported.serialize())
    total, (a, b) = back.call(fp8, int4)
    assert float(total) == float(f(fp8, int4)[0])
    assert (a.block, a.tp_axis, b.group_size, b.tp_axis) == (False, 1, 8, None)
