"""Weight loaders: sharded safetensors, GGUF layout, dummy weights, the mesh hook, and clear errors."""
from __future__ import annotations

import json
import os
import shutil
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models import gguf_loader, hf_weights, llama, packaged, registry
from jaxserve.models.configs import model_config_from_hf, read_json
from jaxserve.models.loader import load_model
from jaxserve.models.safetensors_loader import SafetensorsFile, safetensors_getter
import support
from support.fake_devices import run_on_fake_devices
from support.safetensors_files import write_safetensors
from support.tiny_models import params_equal

FIXTURES = os.path.join(support.FIXTURES, "models")
TINY_QWEN2 = os.path.join(FIXTURES, "tiny-qwen2")


def tensors_of(folder: str) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {n: np.array(f.get(n)) for n in f.names()}


def copy_config(src: str, dst, **overrides) -> None:
    hf = read_json(os.path.join(src, "config.json"))
    hf.update(overrides)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)


@pytest.fixture(scope="module")
def qwen2_single():
    return load_model(TINY_QWEN2, dtype="float32")


def test_sharded_safetensors_with_index(tmp_path, qwen2_single):
    tensors = tensors_of(TINY_QWEN2)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in shards.items():
        write_safetensors(str(tmp_path / fname), {n: tensors[n] for n in part})
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fname for fname, part in shards.items() for n in part}}, f)
    copy_config(TINY_QWEN2, tmp_path)
    sharded = load_model(str(tmp_path), dtype="float32")
    assert params_equal(sharded.params, qwen2_single.params)
    assert sharded.load_format == "safetensors"


def test_weights_layout_and_dtype(qwen2_single):
    """HF [out, in] Linear weights land transposed; gate/up fused on axis 1; bf16 values upcast exactly."""
    tensors = tensors_of(TINY_QWEN2)
    layer = qwen2_single.params["layers"][1]
    np.testing.assert_array_equal(np.asarray(layer["q"]), tensors["model.layers.1.self_attn.q_proj.weight"].T.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(layer["gate_up"][:, 1]), tensors["model.layers.1.mlp.up_proj.weight"].T.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(layer["k_bias"]), tensors["model.layers.1.self_attn.k_bias".replace("k_bias", "k_proj.bias")].astype(np.float32))
    shapes = llama.FAMILY.param_shapes(qwen2_single.config)
    got = jax.tree.map(lambda a: a.shape, qwen2_single.params)
    assert got == jax.tree.map(tuple, shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(qwen2_single.params))


def test_gguf_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf permutes q/k rows; the loader undoes it exactly."""
    rng = np.random.default_rng(0)
    for n_head in (9, 3):
        w = rng.standard_normal((n_head * 64, 576)).astype(np.float32)
        llama_cpp = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(llama.unpermute_rope_rows(llama_cpp, n_head), w)
    assert gguf_loader.gguf_name("model.layers.3.self_attn.k_proj.weight") == "blk.3.attn_k.weight"
    assert gguf_loader.gguf_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"


# ------------------------------------------------------------------------------------------------ dummy
@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b"])
def test_dummy_param_shapes_of_shipped_configs(name):
    cfg = model_config_from_hf(read_json(str(packaged.DUMMY_CONFIG_DIR / f"{name}.json")))
    abstract = jax.eval_shape(lambda: llama.FAMILY.init_dummy_params(cfg, jnp.bfloat16))
    expected = llama.FAMILY.param_shapes(cfg)
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(tuple, expected, is_leaf=lambda x: isinstance(x, tuple))
    assert {a.dtype for a in jax.tree.leaves(abstract)} == {jnp.dtype(jnp.bfloat16)}
    specs = llama.FAMILY.param_partition_specs(cfg)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == \
        jax.tree.structure(abstract)


def test_dummy_load_by_name(tmp_path, monkeypatch):
    copy_config(os.path.join(FIXTURES, "tiny-llama3"), tmp_path)
    os.rename(tmp_path / "config.json", tmp_path / "tiny-test.json")
    monkeypatch.setattr(packaged, "DUMMY_CONFIG_DIR", tmp_path)
    m = load_model("tiny-test")
    assert m.source == "dummy:tiny-test" and m.load_format == "dummy"
    assert m.dtype == jnp.bfloat16                                # the config's torch_dtype
    shapes = jax.tree.map(tuple, llama.FAMILY.param_shapes(m.config), is_leaf=lambda x: isinstance(x, tuple))
    assert jax.tree.map(lambda a: a.shape, m.params) == shapes
    q = np.asarray(m.params["layers"][0]["q"], np.float32)
    assert 0.01 < q.std() < 0.03 and np.all(np.asarray(m.params["final_norm"]) == 1)
    assert m.tokenizer.encode("Hello world") == [19556, 905]      # the embedded SmolLM2 tokenizer


def test_dummy_fill_is_uniform_std_002_and_seeded():
    from jaxserve.models.layers import dummy_init
    fill = dummy_init.dummy_init_fn("normal", (256, 3, 512), jnp.dtype(jnp.float32), None)
    a = np.asarray(fill(dummy_init.leaf_seed(0, 1)))
    assert abs(a.std() - dummy_init.DUMMY_STD) < 5e-4 and abs(a.mean()) < 5e-4
    assert np.abs(a).max() <= dummy_init.DUMMY_STD * 3 ** 0.5
    assert len(np.unique(a)) > a.size * 0.98        # each its own 24-bit draw (~1 % meet by chance)
    assert np.array_equal(a, np.asarray(fill(dummy_init.leaf_seed(0, 1))))  # the same seed, the same weights
    b = np.asarray(fill(dummy_init.leaf_seed(0, 2)))                        # another leaf: unrelated values
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01
    rows = a.reshape(-1, 512)
    assert abs(np.corrcoef(rows[0], rows[1])[0, 1]) < 0.2 and abs(np.corrcoef(rows[:, 0], rows[:, 1])[0, 1]) < 0.2


def test_dummy_fill_is_the_same_in_any_sharding():
    # fake devices need XLA_FLAGS before JAX starts: a child process with two of them
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxserve.models.layers import dummy_init
        mesh = jax.make_mesh((2,), ("tp",))
        seed = dummy_init.leaf_seed(0, 5)
        fill = lambda sharding: dummy_init.dummy_init_fn("normal", (6, 4, 8), jnp.dtype(jnp.bfloat16), sharding)
        one = fill(None)(seed)
        for spec in (P(None, None, "tp"), P("tp")):
            split = fill(NamedSharding(mesh, spec))(seed)
            assert split.sharding.spec == spec and len(split.addressable_shards) == 2
            assert np.array_equal(np.asarray(split), np.asarray(one))
        print("ok")
    """)
    assert run_on_fake_devices(["-c", code], 2, timeout=300).strip() == "ok"


def test_dummy_load_format_for_a_folder():
    m = load_model(TINY_QWEN2, load_format="dummy", dtype="float32")
    assert m.load_format == "dummy" and m.params["layers"][0]["q_bias"].shape == (64,)


# ---------------------------------------------------------------------------------------------- errors
def test_missing_weights_file(tmp_path):
    copy_config(TINY_QWEN2, tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_index_names_a_missing_shard(tmp_path):
    copy_config(TINY_QWEN2, tmp_path)
    shutil.copy(os.path.join(TINY_QWEN2, "model.safetensors"), tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in tensors_of(TINY_QWEN2)}
    weight_map["model.layers.1.mlp.down_proj.weight"] = "model-00002-of-00002.safetensors"
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors: file not found"):
        load_model(str(tmp_path))


def test_missing_tensor(tmp_path):
    copy_config(TINY_QWEN2, tmp_path)
    tensors = tensors_of(TINY_QWEN2)
    del tensors["model.layers.0.self_attn.v_proj.bias"]
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.v_proj.bias not found"):
        load_model(str(tmp_path))


def test_wrong_shape_names_file_and_tensor(tmp_path):
    copy_config(TINY_QWEN2, tmp_path, intermediate_size=128)
    shutil.copy(os.path.join(TINY_QWEN2, "model.safetensors"), tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.0.mlp.gate_proj.weight (96, 64)" in msg
    assert "\n" not in msg


def test_corrupt_safetensors(tmp_path):
    copy_config(TINY_QWEN2, tmp_path)
    data = open(os.path.join(TINY_QWEN2, "model.safetensors"), "rb").read()
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(data[: len(data) // 2])                          # truncated download
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt safetensors file"):
        load_model(str(tmp_path))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(b"\xff" * 64)                                    # not a safetensors file at all
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt"):
        load_model(str(tmp_path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ModelLoadError, match="broken.gguf: not a valid GGUF file"):
        load_model(str(path))


def test_unsupported_architecture(tmp_path):
    copy_config(TINY_QWEN2, tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path))
    assert "GPT2LMHeadModel" in str(e.value)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "BertModel"):
        assert name in str(e.value)


def test_unknown_model_and_limits(tmp_path):
    with pytest.raises(ModelLoadError, match="llama-3.1-8b"):      # lists the dummy configs
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="max_position_embeddings 256"):
        load_model(TINY_QWEN2, max_model_len=1024)
    copy_config(TINY_QWEN2, tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="'dynamic' is not supported"):
        load_model(str(tmp_path))


def test_hf_spec_maps_weight_specs_back_to_hf_layout():
    from jax.sharding import PartitionSpec as P
    assert hf_weights._hf_spec("t", P(None, "tp")) == P("tp", None)           # column-parallel [in, out]
    assert hf_weights._hf_spec("t", P("tp", None)) == P(None, "tp")           # row-parallel
    assert hf_weights._hf_spec("stack_t", P(None, None, "tp")) == P("tp", None)
    assert hf_weights._hf_spec("same", P("tp", None)) == P("tp", None)
    assert hf_weights._hf_spec("t", P()) == P(None, None)
    with pytest.raises(ValueError):
        hf_weights._hf_spec("stack_t", P(None, "tp", None))


def test_encoder_architectures_route_to_bert():
    name, module = registry.resolve_architecture(["BertModel"])
    assert name == "BertModel" and module.__name__ == "jaxserve.models.bert"
    assert registry.is_encoder("BertForMaskedLM") and not registry.is_encoder("LlamaForCausalLM")


# ------------------------------------------------------------------------------------------------- mesh
MESH_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxserve.kernels import ops
    from jaxserve.kernels.metadata import AttentionMetadata
    from jaxserve.models.loader import load_model
    path = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ref = load_model(path, dtype="float32")
    import jaxserve.models.hf_weights as hf_weights
    real_put, puts = jax.device_put, []
    def put(x, sharding=None, **kw):               # what each HF tensor travels as
        puts.append((x.shape, sharding.spec if sharding is not None else None))
        return real_put(x, sharding, **kw)
    hf_weights.jax.device_put = put
    tp = load_model(path, dtype="float32", mesh=mesh)
    hf_weights.jax.device_put = real_put
    # HF layout [out, in]: column-parallel q and gate/up split on out, row-parallel o/down on in; no
    # tensor that the mesh splits ever goes whole to one device
    specs = dict(puts)
    assert specs[(64, 64)] in (P("tp", None), P(None, "tp")) and P() not in [s for _, s in puts if len(_) == 2], puts
    q = tp.params["layers"][0]["q"]
    assert q.sharding.spec == P(None, "tp") and len(q.addressable_shards) == 2, q.sharding
    assert q.addressable_shards[0].data.shape == (64, 32)
    assert tp.params["layers"][0]["o"].sharding.spec == P("tp", None)
    assert tp.params["embed"].sharding.spec == P("tp", None)
    ids = jnp.arange(3, 13, dtype=jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.arange(4, 14, dtype=jnp.int32), block_tables=jnp.array([[1, 2, 3]], jnp.int32),
                           seq_lens=jnp.array([10], jnp.int32), query_start_loc=jnp.array([0, 10], jnp.int32),
                           num_seqs=jnp.array(1, jnp.int32))
    def logits(m):
        caches = ops.init_kv_caches(m.config.num_layers, 4, 4, m.config.num_kv_heads, m.config.head_dim, jnp.float32)
        fn = jax.jit(lambda p, c: m.family.compute_logits(p, m.family.forward(p, c, ids, jnp.arange(10), md, m.config)[0], m.config))
        return np.asarray(fn(m.params, caches))
    err = np.abs(logits(ref) - logits(tp)).max()
    assert err < 1e-4, err
    print("OK", err)
""")


def test_mesh_places_weights_with_partition_specs():
    """With a 2-device "tp" mesh (fake CPU devices, in a subprocess) each weight carries its Megatron spec
    and the sharded model computes the same logits."""
    assert "OK" in run_on_fake_devices(["-c", MESH_SCRIPT, TINY_QWEN2], 2, timeout=300)


@pytest.mark.slow    # ~13 s; test_parallel_safetensors bounds the host memory of the threaded load
def test_host_memory_is_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Loading converts tensor by tensor: host (numpy) allocations peak at a fraction of the weights, in
    either target dtype; a whole-model float32 staging copy would be >= 1x (2x for a bf16 checkpoint)."""
    import tracemalloc

    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 1024,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    cfg = model_config_from_hf(hf)
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (1024, 256), "model.norm.weight": (256,), "lm_head.weight": (1024, 256)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (256,), p + "post_attention_layernorm.weight": (256,),
                   p + "self_attn.q_proj.weight": (256, 256), p + "self_attn.k_proj.weight": (128, 256),
                   p + "self_attn.v_proj.weight": (128, 256), p + "self_attn.o_proj.weight": (256, 256),
                   p + "mlp.gate_proj.weight": (1024, 256), p + "mlp.up_proj.weight": (1024, 256),
                   p + "mlp.down_proj.weight": (256, 1024)}
    write_safetensors(str(tmp_path / "model.safetensors"),
                      {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in shapes.items()})
    get, file_of = safetensors_getter(str(tmp_path))
    numpy_only = [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)]   # robust to other threads
    live: list[int] = []
    real_device_put = jax.device_put

    def device_put(x, *args, **kwargs):    # sample numpy's live bytes where the transients peak
        live.append(sum(st.size for st in tracemalloc.take_snapshot().filter_traces(numpy_only).statistics("filename")))
        return real_device_put(x, *args, **kwargs)

    monkeypatch.setattr(hf_weights.jax, "device_put", device_put)
    for dtype in (jnp.bfloat16, jnp.float32):
        live.clear()
        tracemalloc.start()
        try:
            params = hf_weights.load_weights(cfg, llama.FAMILY, get, dtype)
        finally:
            tracemalloc.stop()
        weight_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
        assert len(live) == len(shapes)            # each HF tensor goes to the device once, as it is
        assert max(live) < 0.5 * weight_bytes, (dtype, max(live), weight_bytes)
