"""The decode-only attention launch that also writes the step's K/V (``write_kv``; what ``ops.write_kv_and_attend``
runs for a decode-only step on the Pallas backends), in interpret mode on CPU and compiled on a GPU host, against
the reference's scatter then attention: the same output rows and the same caches (block 0, where the reference's
padding tokens land, aside); and the short-context variant the runner runs such steps in (``max_seq_len``).

Cases cover what the families need: GQA groups, head_dim 256, sliding windows, soft-capping, one split and
flash-decoding splits (the token's own key in the last split's range), contexts of 1 (the own key alone) and at
chunk edges, padding tokens and requests, an fp8 cache (quantized on the way in, V pages transposed), and a real
row whose slot is PAD_SLOT (a multi-step loop's finished row: it writes nothing and reads the cache as it is).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import synthetic
from jaxserve.kernels import flash_decoding, ops
from jaxserve.kernels import paged_attention_pallas as pa
from jaxserve.kernels.metadata import PAD_SLOT, SHORT_SEQ_LEN

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
INTERPRET = jax.default_backend() != "gpu"      # on a GPU host the same checks run the compiled kernels


def _step(seed, ctx_lens, *, hq, kvh, d, dtype, bs=16, cache=None):
    rng = np.random.default_rng(seed)
    q, k_cache, v_cache, md = synthetic.make_batch(rng, [1] * len(ctx_lens), ctx_lens, block_size=bs,
                                                   num_q_heads=hq, num_kv_heads=kvh, head_dim=d, dtype=dtype,
                                                   pad_tokens=2, pad_reqs=1)
    kw = {}
    if cache == "fp8":
        scale = jnp.asarray(np.linspace(0.5, 1.5, kvh), jnp.float32)
        k_cache, v_cache = synthetic.quantize_caches(k_cache, v_cache, jnp.float8_e4m3fn, scale, scale)
        kw = dict(k_scale=scale, v_scale=scale)
    new_k, new_v = (jnp.asarray(rng.standard_normal((q.shape[0], kvh, d)), dtype) for _ in range(2))
    return q, new_k, new_v, k_cache, v_cache, dataclasses.replace(md, decode_only=True), kw


def _check(q, new_k, new_v, k_cache, v_cache, md, *, tol, **kw):
    want, wk, wv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, **kw)
    got, gk, gv = ops.write_kv_and_attend(q, new_k, new_v, k_cache, v_cache, md, backend="pallas",
                                          interpret=INTERPRET, **kw)
    n = int(md.num_seqs)
    got, want = np.asarray(got[:n], np.float32), np.asarray(want[:n], np.float32)
    assert not np.isnan(got).any()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= tol, f"max rel err {err:.2e} > {tol:.0e}"
    for g, w in ((gk, wk), (gv, wv)):
        np.testing.assert_array_equal(np.asarray(g[1:].astype(jnp.float32)), np.asarray(w[1:].astype(jnp.float32)))


@pytest.mark.parametrize("splits,window,soft_cap", [(1, None, None), (4, None, 50.0), (1, 24, None), (4, 24, 20.0)])
def test_fused_write_matches_write_then_attend(splits, window, soft_cap):
    """Contexts of 1, at a 16-key chunk edge (16, 17, 33) and long (130): 8 q heads over 2 kv heads."""
    step = _step(31 + splits, [1, 16, 17, 33, 130], hq=8, kvh=2, d=64, dtype=jnp.float32)
    _check(*step[:-1], tol=TOL[jnp.float32], sm_scale=0.125, sliding_window=window, soft_cap=soft_cap,
           decode_splits=splits, decode_block_k=16)


@pytest.mark.parametrize("splits", [1, 8])
def test_fused_write_head_dim_256_bf16(splits):
    """Gemma 2's head shape (head_dim 256, groups of 2) in bf16 with its soft cap, one split and eight."""
    step = _step(41, [5, 70, 200], hq=4, kvh=2, d=256, dtype=jnp.bfloat16)
    _check(*step[:-1], tol=TOL[jnp.bfloat16], sm_scale=256 ** -0.5, soft_cap=50.0, decode_splits=splits)


def test_fused_write_fp8_cache():
    """An fp8 cache: the kernel quantizes the new K/V (per-head scales) as the reference's write does, stores V
    down its transposed page's column, and attends to the quantized values; 3 kv heads, split and not."""
    *step, kw = _step(51, [1, 9, 40, 77], hq=6, kvh=3, d=64, dtype=jnp.bfloat16, cache="fp8")
    for splits in (1, 4):
        _check(*step, tol=TOL[jnp.bfloat16], sm_scale=0.125, decode_splits=splits, decode_block_k=16, **kw)


def test_pad_slot_row_writes_nothing_and_reads_the_cache():
    """A real decode row whose slot is PAD_SLOT (multi-step: a finished row repeats its position) attends to the
    cache as it is, its own position included, like the reference; the other rows write and attend as usual."""
    q, new_k, new_v, k_cache, v_cache, md, _ = _step(61, [20, 35, 9], hq=4, kvh=2, d=64, dtype=jnp.float32)
    md = dataclasses.replace(md, slot_mapping=md.slot_mapping.at[1].set(PAD_SLOT))
    for splits in (1, 4):
        _check(q, new_k, new_v, k_cache, v_cache, md, tol=TOL[jnp.float32], sm_scale=0.125, decode_splits=splits,
               decode_block_k=16)


def test_write_kv_is_refused_outside_decode_only_steps():
    q, new_k, new_v, k_cache, v_cache, md, _ = _step(71, [20, 9], hq=4, kvh=2, d=64, dtype=jnp.float32)
    qkv = jnp.concatenate([q, new_k, new_v], axis=1)
    with pytest.raises(ValueError, match="decode-only"):
        pa.ragged_paged_attention(qkv, k_cache, v_cache, dataclasses.replace(md, decode_only=False), sm_scale=0.1,
                                  num_q_heads=4, write_kv=True, interpret=True)
    with pytest.raises(ValueError, match="packed"):
        pa.ragged_paged_attention(q, k_cache, v_cache, md, sm_scale=0.1, write_kv=True, interpret=True)


def _wide_tables(md, pages=128):
    """The block tables padded to ``pages`` columns (NULL_BLOCK): a 2048-token span, as at max_model_len 2048."""
    bt = md.block_tables
    return dataclasses.replace(md, block_tables=jnp.pad(bt, ((0, 0), (0, pages - bt.shape[1]))))


@pytest.mark.parametrize("cache", [None, "fp8"])
def test_fused_write_lowers_for_cuda(cache):
    """The fused launch's GPU build lowers for CUDA here, with no separate K/V write kernel: over a 2048-token
    block-table span it splits (the decode, then the combine: two Triton calls); with the host's bound
    ``max_seq_len`` = SHORT_SEQ_LEN it is one launch, and explicit ``decode_splits`` still win."""
    *step, kw = _step(81, [40, 9, 300], hq=8, kvh=2, d=128, dtype=jnp.bfloat16, cache=cache)
    md = _wide_tables(step[-1])

    def layer(q, new_k, new_v, k_cache, v_cache, md, splits):      # ops.write_kv_and_attend's packed call
        qkv = jnp.concatenate([q, new_k, new_v], axis=1)
        return pa.ragged_paged_attention(qkv, k_cache, v_cache, md, sm_scale=0.1, num_q_heads=q.shape[1],
                                         write_kv=True, decode_splits=splits, **kw)

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    short = dataclasses.replace(md, max_seq_len=SHORT_SEQ_LEN)
    for md_, splits, launches in ((md, None, 2), (short, None, 1), (md, 1, 1), (short, 4, 2)):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(layer, static_argnums=6).trace(*step[:-1], md_, splits).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == launches, (md_.max_seq_len, splits)
        assert "paged_kv_write" not in text


def test_short_context_bound_gives_the_same_attention():
    """``max_seq_len`` only shapes the launch: over a 2048-token span a step bounded by SHORT_SEQ_LEN runs one
    split where the unbounded one runs four, and both match the reference."""
    step = _step(91, [3, 100, 300], hq=4, kvh=2, d=64, dtype=jnp.float32)
    md = _wide_tables(step[-2])
    for bound in (None, SHORT_SEQ_LEN):
        _check(*step[:-2], dataclasses.replace(md, max_seq_len=bound), tol=TOL[jnp.float32], sm_scale=0.125,
               decode_block_k=64)
    assert flash_decoding.pick_splits(4, 2, 2048, 64) == 4 and flash_decoding.pick_splits(4, 2, SHORT_SEQ_LEN, 64) == 1


def _pallas_launches(fn, *args) -> dict[str, int]:
    """``fn(*args)`` traced for an H200 on this host (not compiled, not run): its Pallas launches by kernel name,
    each call of a jitted helper counted. The backend's GPU check is lifted for the trace: nothing runs."""
    from collections import Counter
    from unittest import mock
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with mock.patch.object(ops, "_check_gpu", lambda interpret: None), jax.sharding.use_abstract_mesh(mesh):
        jaxpr = fn.trace(*args).jaxpr
    counts = Counter()

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info")
                counts[getattr(info, "name", None) or str(eqn.params.get("name", "pallas_call"))] += 1
                continue
            for val in eqn.params.values():     # sub-jaxprs: jit calls, conds, loops, shard_map bodies
                for sub in val if isinstance(val, (tuple, list)) else (val,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jaxpr.jaxpr)
    return dict(counts)


def _decode_step_launches(name: str, layers: int, context: int, max_model_len: int = 4096) -> dict[str, float]:
    """Pallas launches per layer of a batch-1 decode step (bucket 4, one real request at ``context`` tokens) of a
    narrowed configs/models shape, as the runner builds it: the short-context variant when the context is
    within SHORT_SEQ_LEN."""
    import os

    from jaxserve.kernels.metadata import AttentionMetadata
    from jaxserve.models import configs as model_configs
    from jaxserve.models import registry
    hf = model_configs.read_json(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                              "configs", "models", f"{name}.json"))
    hf.pop("layer_types", None)              # rederived for the new layer count
    hf.update(num_hidden_layers=layers, hidden_size=256, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=1024)
    cfg = model_configs.model_config_from_hf(hf)
    _, family = registry.resolve_architecture(hf["architectures"])
    dtype, bs, R = jnp.bfloat16, 16, 4
    pages = max_model_len // bs
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), family.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    caches = [tuple(jax.ShapeDtypeStruct(s, dtype) for s in ops.kv_cache_shapes(pages + 1, bs, cfg.num_kv_heads,
                                                                                cfg.head_dim, dtype))
              for _ in range(layers)]
    tables = np.zeros((R, pages), np.int32)
    tables[0, :-(-context // bs)] = np.arange(1, -(-context // bs) + 1)
    slots = np.zeros(R, np.int32)
    slots[0] = tables[0, (context - 1) // bs] * bs + (context - 1) % bs
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                           seq_lens=jnp.asarray([context, 0, 0, 0], jnp.int32),
                           query_start_loc=jnp.asarray([0, 1, 1, 1, 1], jnp.int32), num_seqs=jnp.int32(1),
                           decode_only=True, max_seq_len=SHORT_SEQ_LEN if context <= SHORT_SEQ_LEN else None)
    ids, pos = jnp.asarray([7, 0, 0, 0], jnp.int32), jnp.asarray([context - 1, 0, 0, 0], jnp.int32)

    def step(params, caches, ids, pos, md):
        hidden, caches = family.forward(params, caches, ids, pos, md, cfg, attn_backend="pallas")
        return caches, family.compute_logits(params, hidden[jnp.zeros(R, jnp.int32)], cfg)

    launches = _pallas_launches(jax.jit(step, donate_argnums=(1,)), params, caches, ids, pos, md)
    return {k: v / layers for k, v in sorted(launches.items())}


def test_model_decode_step_has_no_separate_kv_write():
    """A batch-1 decode step of a (narrowed) Qwen3 traced for the GPU runs one Pallas launch a layer at a
    200-token context (the runner's short-context variant: the decode that writes K/V) and two at 2048 (that
    decode split, and the combine), none of them paged_kv_write."""
    assert _decode_step_launches("qwen3-8b", 2, 200) == {"ragged_paged_decode_write_kv": 1.0}
    assert _decode_step_launches("qwen3-8b", 2, 2048) == {"ragged_paged_combine": 1.0,
                                                           "ragged_paged_decode_split_write_kv": 1.0}


def test_runner_runs_short_context_decodes_in_their_own_variant(monkeypatch):
    """The runner plans a decode-only variant bounded by SHORT_SEQ_LEN where it changes the decode launch (fewer
    splits than at max_model_len), and a decode step within the bound runs it once compiled: the same tokens.
    (The switch is the Pallas backends'; here it is turned on over the reference attention, which takes the
    static bound and ignores it, with the bound at 64 tokens and a stand-in split rule, so the routing runs on
    CPU; the kernel's own rule is checked above.)"""
    from jaxserve import SamplingParams
    from jaxserve.runner import step_variants
    from support.tiny_models import tiny_llm

    bound = 64
    monkeypatch.setattr(step_variants, "SHORT_SEQ_LEN", bound)
    monkeypatch.setattr(step_variants.kernel_ops, "decode_splits", lambda reqs, kvh, n: 1 if n <= bound else 4)
    llm = tiny_llm(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory_bytes=1 << 22,
                   token_buckets=(4, 32), enforce_eager=True)
    runner = llm.engine.core.runner
    prompts = [list(range(5, 5 + n)) for n in (3, 11)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    runner.shapes.uniform_decode = runner.variants.short_decode = True
    _, rest = runner.variants.planned()
    short = ("forward", 4, True, bound)
    assert short in rest and ("forward", 32, True, bound) not in rest      # 32 tokens is past max_num_seqs
    runner.variants.compile_now([("forward", 4, True), short])   # what the warm-up compiles first, then later
    asked = []
    get = runner.variants.get
    runner.variants.get = lambda key: asked.append(key) or get(key)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == want and short in asked
    asked.clear()                                  # contexts past the bound: the ordinary decode-only variant
    llm.generate([list(range(5, 5 + bound + 1))], greedy, use_tqdm=False)
    assert ("forward", 4, True) in asked and short not in asked
