"""Random weights (``--load-format dummy``) are made on the devices, in their sharding and dtype: float and the
quantized storages, the same values for the same seed on any mesh, no weight ever whole on the host."""
import json
import textwrap

from support.fake_devices import fake_device_report

# a Llama whose embedding is large beside whatever else Python allocates while loading
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
          "vocab_size": 32768, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}

WORKER = textwrap.dedent("""
    import json, sys, tracemalloc
    from pathlib import Path
    import jax, numpy as np
    from jaxserve import parallel
    from jaxserve.models import loader, packaged
    from jaxserve.quantization.weights import Fp8Weight, Int4Weight

    packaged.DUMMY_CONFIG_DIR = Path(sys.argv[1])
    mesh = parallel.make_mesh(2)
    largest = []                 # the largest array any jax.device_put was handed
    put = jax.device_put
    def guarded_put(x, *a, **k):
        largest.append(max((int(np.size(l)) for l in jax.tree.leaves(x)), default=0))
        return put(x, *a, **k)
    jax.device_put = guarded_put

    def load(**kw):
        return loader.load_model("dummy-llama", load_format="dummy", dtype="bfloat16", **kw)

    report = {}
    one = load(mesh=mesh)
    tracemalloc.start()             # the second load compiles nothing: what Python allocates is the load's own
    again = load(mesh=mesh)
    jax.block_until_ready(again.params)
    report["host_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    leaves = jax.tree.leaves(one.params)
    report["largest_leaf_bytes"] = max(a.nbytes for a in leaves)
    want = jax.tree.leaves(parallel.param_shardings(one.family.param_partition_specs(one.config), mesh, one.config))
    report["as_declared"] = all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(leaves, want))
    report["dtypes"] = sorted({str(a.dtype) for a in leaves})
    report["same_seed_same_weights"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                                           for a, b in zip(leaves, jax.tree.leaves(again.params)))
    single = load()
    report["any_mesh_same_weights"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                                          for a, b in zip(leaves, jax.tree.leaves(single.params)))
    other = load(mesh=mesh, seed=1)
    report["another_seed_differs"] = not np.array_equal(np.asarray(one.params["layers"][0]["q"]),
                                                        np.asarray(other.params["layers"][0]["q"]))
    for method, cls, field in (("awq", Int4Weight, "packed"), ("fp8", Fp8Weight, "weight")):
        q = load(mesh=mesh, quantization=method)
        layer = q.params["layers"][1]
        report[method] = {n: isinstance(layer[n], cls) and
                          len({sh.index for sh in getattr(layer[n], field).addressable_shards}) == 2
                          for n in ("q", "k", "v", "o", "gate_up", "down")}
        q2 = load(mesh=mesh, quantization=method)
        report[method]["same_seed"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                                          for a, b in zip(jax.tree.leaves(q.params), jax.tree.leaves(q2.params)))
    report["largest_put"] = max(largest, default=0)
    print(json.dumps(report))
""")


def test_dummy_weights_are_made_sharded_on_the_devices(tmp_path):
    (tmp_path / "dummy-llama.json").write_text(json.dumps(CONFIG))
    r = fake_device_report(["-c", WORKER, str(tmp_path)], 2, timeout=600)
    assert r["as_declared"] and r["dtypes"] == ["bfloat16"], r
    assert r["same_seed_same_weights"] and r["any_mesh_same_weights"] and r["another_seed_differs"], r
    for method in ("awq", "fp8"):
        assert all(r[method].values()), (method, r[method])
    # no weight crosses from the host: nothing bigger than a scalar is put, and numpy never holds a weight
    assert r["largest_put"] <= 1, r
    assert r["host_peak_bytes"] < 0.25 * r["largest_leaf_bytes"], r


# sha256 (first 16 hex digits) of every leaf's bytes at seed 0, float and fp8: the fill is integer hashing and
# exactly rounded float steps, so any process, cache state or backend makes these same bits
SEED0_DIGESTS = {None: "326bc62b629f0bab", "fp8": "a732f39da899ab17"}


def test_dummy_weights_are_the_same_bits_in_every_process():
    import hashlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models import configs as model_configs
    from jaxserve.models import dummy_loader, registry

    cfg = model_configs.model_config_from_hf(CONFIG)
    _, family = registry.resolve_architecture(CONFIG["architectures"])
    for method, want in SEED0_DIGESTS.items():
        params = dummy_loader.dummy_params(cfg, family, jnp.bfloat16, 0, None, dummy_loader.dummy_quantization(method))
        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(params):
            digest.update(np.asarray(leaf).tobytes())
        assert digest.hexdigest()[:16] == want, method
