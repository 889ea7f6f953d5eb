"""Qwen2.5-VL and Qwen2-VL end to end against HF transformers (tests/make_qwen_vl_fixtures.py: tiny random
checkpoints, Qwen2.5-VL's ViT with window attention and Qwen2-VL's with full attention and LayerNorms, their
images of three sizes and HF's float32 outputs): the prompt's logits within 1e-4, and HF's greedy continuation
through the engine for one image, two images of different sizes, text around an image, a two-turn chat with an
earlier image and a text-only chat; batched with text-only requests, under the prefix cache, with chunked
prefill splitting an image, and at tensor parallelism 2 on fake CPU devices. The encoder bucketed by patch
count: equal to the unpadded encoder, one compiled program per bucket whatever the image sizes."""
from __future__ import annotations

import functools
import json
import os
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from support.fake_devices import fake_device_report
from support.tiny_models import PagedRunner, hf_logits
from support.vision import GREEDY, VisionFixture, looked_up

NAMES = ("tiny-qwen2.5-vl", "tiny-qwen2-vl")
FIXTURES = {name: VisionFixture(name, max_num_batched_tokens=128) for name in NAMES}
CASE_NAMES = list(FIXTURES[NAMES[0]].cases)


@pytest.fixture(scope="module", params=NAMES)
def vl(request) -> VisionFixture:
    return FIXTURES[request.param]


def sampling():
    from jaxserve.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)


def request(vl: VisionFixture, case: dict):
    """The case as ``LLM.generate``'s prompt (raw text) or ``LLM.chat``'s messages."""
    if "raw" in case:
        return {"prompt": case["prompt"], "multi_modal_data": {"image": [vl.image(n) for n in case["images"]]}}
    return vl.openai_messages(case)


def run_case(vl: VisionFixture, llm, case: dict):
    if "raw" in case:
        return llm.generate(request(vl, case), sampling(), use_tqdm=False)[0]
    return llm.chat(request(vl, case), sampling(), use_tqdm=False)[0]


def check(out, case: dict) -> None:
    assert out.prompt_token_ids == case["prompt_ids"]
    assert list(out.outputs[0].token_ids) == case["greedy_ids"]


@pytest.fixture(scope="module")
def llm(vl):
    engine = vl.make_llm()
    yield engine
    engine.shutdown()


@functools.lru_cache(maxsize=2)
def load(name: str):
    from jaxserve.models.loader import load_model
    return load_model(FIXTURES[name].folder, dtype="float32")


def processed(vl: VisionFixture, model, case: dict):
    from jaxserve.multimodal.processing import ImageProcessing
    proc = ImageProcessing.from_folder(vl.folder, model.config.extra_dict)
    ids, feats = proc.process(model.tokenizer.encode(case["prompt"], add_special_tokens=False),
                              [vl.image(n).convert("RGB") for n in case["images"]])
    for f in feats:         # the float payload the tower looks an RGB image's bytes up into
        f.pixel_values = looked_up(f.pixel_values, f.extra.pop("pixel_table"))
    return ids, feats


def test_logits_match_hf(vl):
    """The first case's prompt (a 12x8-patch image: windows and full attention in 2.5, full in 2) prefilled in
    one step, its image embedded by the encoder, 3-D positions from the step inputs: logits within 1e-4."""
    from jaxserve.runner.step_functions import forward_fn
    model = load(vl.name)
    case = vl.cases["one_image"]
    ids, feats = processed(vl, model, case)
    assert ids == case["prompt_ids"]
    assert [f.extra["image_grid_thw"].tolist() for f in feats] == case["grids"]
    emb = model.family.encode_images(model.params, np.stack([f.pixel_values for f in feats]), model.config)
    slab = np.asarray(emb).reshape(-1, model.config.hidden_size)
    index = np.stack([np.concatenate([np.arange(f.offset, f.end) for f in feats]), np.arange(len(slab))])
    runner = PagedRunner(model, max_reqs=1, max_len=128)
    ints, layout = runner.inputs([(0, ids, 0)], 128, logits_rows=list(range(len(ids))), mm_features=feats)
    step = jax.jit(functools.partial(forward_fn, model.family, model.config, "reference", False),
                   static_argnames=("layout",))
    _, logits = step(model.params, runner.kv_caches, ints, runner.no_prev, slab, index.astype(np.int32),
                     layout=layout)
    err = np.abs(np.asarray(logits) - hf_logits(vl.name)).max()
    assert err <= 1e-4, f"max abs logit error {err:.2e} vs HF float32"


def test_images_of_one_size_encode_as_a_batch(vl):
    """Two images of one size in one encoder batch (padding images included: a batch bucket of 4) give
    each image's tokens alone."""
    model = load(vl.name)
    _, feats = processed(vl, model, vl.cases["one_image"])
    a = feats[0].pixel_values
    b = a[:, ::-1, :].copy()
    batch = np.stack([a, b, np.zeros_like(a), np.zeros_like(a)])
    together = np.asarray(model.family.encode_images(model.params, batch, model.config))
    for i, px in enumerate((a, b)):
        alone = np.asarray(model.family.encode_images(model.params, px[None], model.config))[0]
        np.testing.assert_allclose(together[i], alone, atol=1e-5)


# ------------------------------------------------------------------------------- the bucketed encoder
SIZES = [(28, 28), (56, 28), (28, 84), (56, 56), (84, 56), (112, 84), (56, 140), (140, 112), (112, 168),
         (196, 84), (168, 168), (224, 196), (252, 224)]          # (H, W) pixels: 1 to 72 tokens


def features(sizes, seed: int = 0) -> list:
    """Random images of ``sizes`` as pixel payloads (the processor's patch order, by merge block)."""
    from jaxserve.models.layers.qwen_vision import image_blocks
    from jaxserve.multimodal.inputs import ImageFeature
    rng = np.random.default_rng(seed)
    return [ImageFeature(f"img{seed}-{i}", 0, (h // 28) * (w // 28),
                         image_blocks(rng.standard_normal((3, h, w)).astype(np.float32), 14, 2))
            for i, (h, w) in enumerate(sizes)]


def byte_features(sizes, seed: int = 0) -> list:
    """Random RGB images of ``sizes`` as the front end sends them: bytes by merge block, a value table."""
    from jaxserve.models.layers.qwen_vision import image_blocks
    from jaxserve.multimodal.inputs import ImageFeature
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((3, 256)).astype(np.float32)
    return [ImageFeature(f"bytes{seed}-{i}", 0, (h // 28) * (w // 28),
                         image_blocks(rng.integers(0, 256, (3, h, w), dtype=np.uint8), 14, 2),
                         {"pixel_table": table})
            for i, (h, w) in enumerate(sizes)]


def encoder(model, min_patches: int, max_batch: int = 4):
    from jaxserve.runner.encoder_cache import EncoderCache
    return EncoderCache(model, capacity=2048, max_batch=max_batch, min_patches=min_patches)


@pytest.mark.parametrize("query_block", [pytest.param(None, marks=pytest.mark.slow), 64])    # None: ~30 s more
@pytest.mark.parametrize("name", [NAMES[0], pytest.param(NAMES[1], marks=pytest.mark.slow)])    # ~25 s more
def test_bucketed_encoder_equals_the_unpadded_one(name, query_block, monkeypatch):
    """Images of many sizes encoded together (several to a row, rows batched, padding rows and patches; full
    attention in one piece or in blocks of 64 queries): each image's slab rows equal its unpadded encoding
    (in one piece) within 1e-5."""
    from jaxserve.models.layers import qwen_vision
    model = load(name)
    feats = features(SIZES)
    alone = [np.asarray(model.family.encode_images(model.params, f.pixel_values[None], model.config))[0]
             for f in feats]
    if query_block:
        monkeypatch.setattr(qwen_vision, "QUERY_BLOCK", query_block)
    cache = encoder(model, min_patches=256, max_batch=5)           # 5 rows: a batch of 6, one padding
    cache.encode(feats)
    rows = cache.bucket_rows(feats)
    assert any(len(r) > 1 for rs in rows.values() for r in rs)       # images share a row
    slab = np.asarray(cache.slab)
    for f, expect in zip(feats, alone):
        np.testing.assert_allclose(slab[cache.rows[f.hash]], expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", ["shared", "single"])
@pytest.mark.parametrize("name", NAMES)
def test_fused_attention_call_encodes_as_the_dense_scores(name, rows, monkeypatch):
    """``JAXSERVE_VISION_ATTENTION``'s fused call (``jax.nn.dot_product_attention``: cuDNN's kernel on a GPU, its
    XLA path here): the bucketed encoder's rows equal the dense scores' within 1e-5. ``shared``: windows, full
    attention over rows of several images (the smallest bucket) and rows of one, padding; ``single``: images in
    buckets above the smallest, a row each, whose full-attention blocks the call takes by sequence length over
    the image's patches gathered in front (no mask)."""
    model = load(name)
    feats, min_patches, max_batch = (features(SIZES), 256, 5) if rows == "shared" else (features(SIZES[3:9]), 16, 6)
    dense = encoder(model, min_patches=min_patches, max_batch=max_batch)
    dense.encode(feats)
    one_each = all(len(r) == 1 for rs in dense.bucket_rows(feats).values() for r in rs)
    assert one_each == (rows == "single")                     # shared: some images share a row
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv("JAXSERVE_VISION_ATTENTION", "xla")
    fused = encoder(model, min_patches=min_patches, max_batch=max_batch)
    fused.encode(feats)
    assert calls and all(kw["implementation"] == "xla" for kw in calls)
    assert rows == "shared" or any(kw.get("key_value_seq_lengths") is not None for kw in calls)
    for f in feats:
        np.testing.assert_allclose(np.asarray(fused.slab)[fused.rows[f.hash]],
                                   np.asarray(dense.slab)[dense.rows[f.hash]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_encoder_compiles_once_per_bucket(name):
    """Thirteen image sizes one at a time, then all together: the encoder compiles one program per (patch
    bucket, batch bucket) it meets, not one per size; more sizes in known buckets compile nothing."""
    from jaxserve.runner.encoder_cache import patch_bucket
    model = load(name)
    cache = encoder(model, min_patches=16, max_batch=1)
    unit = model.family.patch_unit(model.config)
    buckets = {patch_bucket(model.family.packed_patches(model.config, (h // 28, w // 28)), unit, 16)
               for h, w in SIZES}
    for f in features(SIZES):
        cache.encode([f])
    assert cache.compiler.wait_all(600)       # a bucket smaller than one compiled compiles in the background
    assert len(cache.compiler) == len(buckets) < len(SIZES)
    cache.encode(features(SIZES[::-1], seed=1))
    assert cache.compiler.wait_all(600) and len(cache.compiler) == len(buckets)


@pytest.mark.parametrize("name", NAMES[:1])
def test_encoder_compiles_a_buckets_other_row_batches_in_the_background(name):
    """A bucket's first batch compiles its own program (the step waits); its other row batches compile in the
    background, so later batches of that bucket wait for none, and a batch whose rows are not compiled yet
    runs in a compiled batch of up to twice its rows."""
    model = load(name)
    cache = encoder(model, min_patches=16, max_batch=4)
    size = [SIZES[0]]
    cache.encode(features(size))                                          # one row: compiled on first use
    assert [k[2] for k in cache.compiler.on_first_use] == [1]
    assert cache.compiler.wait_all(timeout=600)
    assert sorted(k[2] for k in cache.compiler.keys()) == [1, 2, 3, 4]
    feats = features(size * 3, seed=1) + features(size, seed=2)           # 4 images: rows of 2 ... 4
    cache.encode(feats)
    assert len(cache.compiler.on_first_use) == 1                          # nothing more compiled on a step
    kind = cache.compiler.keys()[0][:2]                                    # (bucket, payload dtype)
    cache.compiler._ready.pop((*kind, 3))                                 # 3 rows not compiled: 4 run them
    assert cache._rows_to_run(kind, 3) == 4


@pytest.mark.parametrize("name", NAMES[:1])
def test_a_new_bucket_runs_in_a_larger_compiled_one_meanwhile(name, monkeypatch):
    """An image whose bucket is not compiled yet runs in the smallest larger bucket compiled (its own queued
    for the background): no step waits for a compile, and its slab rows equal its unpadded encoding."""
    from jaxserve.runner.encoder_cache import patch_bucket
    from jaxserve.runner.step_compiler import StepCompiler
    model = load(name)
    cache = encoder(model, min_patches=16, max_batch=2)
    cache.encode(features([SIZES[-1]]))                    # nothing compiled yet: this step waits for its own
    assert cache.compiler.wait_all(600) and len(cache.compiler.on_first_use) == 1
    monkeypatch.setattr(StepCompiler, "_start_threads", lambda self: None)     # queued compiles stay queued
    (small,) = features([SIZES[3]], seed=1)
    unit = model.family.patch_unit(model.config)
    own = patch_bucket(model.family.packed_patches(model.config, small.pixel_values.shape), unit, 16)
    cache.encode([small])
    assert len(cache.compiler.on_first_use) == 1                              # no step waited
    assert own not in {k[0] for k in cache.compiler.keys()} and cache.pending() >= 1
    alone = np.asarray(model.family.encode_images(model.params, small.pixel_values[None], model.config))[0]
    np.testing.assert_allclose(np.asarray(cache.slab)[cache.rows[small.hash]], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES[:1])
def test_warmup_compiles_a_bucket_every_image_in_the_budget_runs_in(name, monkeypatch):
    """Warm-up queues (in the background) the bucket of a square image of the encoder budget's tokens: once
    it is compiled, images of new sizes up to the budget (the largest included) never wait for a compile, and
    their slab rows equal their unpadded encoding."""
    from jaxserve.runner.encoder_cache import EncoderCache
    from jaxserve.runner.step_compiler import StepCompiler
    model = load(name)
    cache = EncoderCache(model, capacity=2048, max_batch=2, min_patches=16, budget=72)   # SIZES[-1]: 72 tokens
    cache.warmup()
    assert cache.compiler.wait_all(600) and len(cache.compiler) >= 1 and not cache.compiler.on_first_use
    monkeypatch.setattr(StepCompiler, "_start_threads", lambda self: None)     # queued compiles stay queued
    feats = byte_features([SIZES[3], SIZES[-1]], seed=2)       # as the front end sends RGB images
    for f in feats:
        cache.encode([f])
    assert not cache.compiler.on_first_use and cache.pending() >= 1          # no step waited
    for f in feats:
        px = looked_up(f.pixel_values, f.extra["pixel_table"])
        alone = np.asarray(model.family.encode_images(model.params, px[None], model.config))[0]
        np.testing.assert_allclose(np.asarray(cache.slab)[cache.rows[f.hash]], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget_images", [1, 4])
def test_encoder_queues_only_the_row_batches_its_budget_can_fill(budget_images, monkeypatch):
    """A bucket's other row batches are queued only up to the rows a step can fill under the encoder budget
    (a step with one large image's worth of budget never needs two rows of its bucket), and ``pending``
    counts them until they compile (the engine's ``step_variants_pending`` adds them: benchmarks wait)."""
    from jaxserve.runner.encoder_cache import EncoderCache, budget_rows, row_batch
    from jaxserve.runner.step_compiler import StepCompiler
    monkeypatch.setattr(StepCompiler, "_start_threads", lambda self: None)     # queued compiles stay queued
    model = load(NAMES[0])
    (f,) = features([SIZES[-1]])
    cache = EncoderCache(model, capacity=2048, max_batch=4, min_patches=16, budget=budget_images * f.length)
    cache.encode([f])
    (kind,) = {k[:2] for k in cache.compiler.keys()}
    per_row = cache.family.pack_images(cache.cfg, [[f.pixel_values]], 1, kind[0])[2]
    rows = budget_rows(kind[0], cache.family.patch_unit(cache.cfg), 16, per_row, cache.budget, 4)
    assert rows == budget_images
    queued = sorted(k[2] for k in cache.compiler._queued)
    assert queued == [b for b in (2, 3, 4) if b <= row_batch(rows)]
    assert cache.pending() == len(queued)


def test_runner_counts_and_waits_for_the_encoders_compiles():
    """The runner's pending compiles and ``wait_compiled`` take a packed encoder's row batches with the step
    variants'."""
    from jaxserve.runner.model_runner import ModelRunner

    class Compiler:
        def __init__(self, pending):
            self.n = pending

        def pending(self):
            return self.n

        def wait_all(self, timeout=None):
            return self.n == 0

    runner = object.__new__(ModelRunner)
    runner.variants, runner.encoder = Compiler(0), type("Encoder", (), {"compiler": Compiler(2)})()
    assert runner.pending_compiles() == 2 and not runner.wait_compiled(timeout=0.01)
    runner.encoder.compiler.n = 0
    assert runner.pending_compiles() == 0 and runner.wait_compiled(timeout=0.01)


def test_mrope_positions_as_hf():
    """Text, an image (its start, then row and column), text continuing after the image's larger side."""
    from jaxserve.models.qwen2_vl import mrope_positions
    from jaxserve.multimodal.inputs import ImageFeature
    feats = [ImageFeature("a", 2, 6, None, {"image_grid_thw": np.array([1, 4, 6])}),
             ImageFeature("b", 9, 4, None, {"image_grid_thw": np.array([1, 4, 4])})]
    pos = mrope_positions(np.arange(15), feats)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 6, 6, 6, 8, 9],
                                        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 6, 7, 7, 8, 9],
                                        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9]])
    np.testing.assert_array_equal(mrope_positions(np.array([20]), feats), [[15], [15], [15]])
    full = mrope_positions(np.arange(40), feats)     # the general path, over the images
    for start in (13, 14, 27):                       # tokens past the last image only: the decode path
        np.testing.assert_array_equal(mrope_positions(np.arange(start, 40), feats), full[:, start:])


@pytest.mark.slow     # a bfloat16 engine of its own (~25 s)
def test_bfloat16_engine_sends_bfloat16_pixels():
    """A bfloat16 engine's front end makes bfloat16 payloads; its greedy ids are those of float32 payloads
    (another content key, so the second request encodes its image again)."""
    import ml_dtypes
    vl = FIXTURES[NAMES[0]]
    engine = vl.make_llm(dtype="bfloat16")
    proc = engine.engine.images.processing
    assert proc.pixel_dtype == ml_dtypes.bfloat16
    case = vl.cases["one_image"]
    first = run_case(vl, engine, case)
    proc.pixel_dtype, proc._kwargs_key = np.float32, proc._kwargs_key + "|float32 pixels"
    again = run_case(vl, engine, case)
    assert first.prompt_token_ids == case["prompt_ids"]
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids)
    assert len(first.outputs[0].token_ids) == GREEDY
    engine.shutdown()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_greedy_matches_hf(vl, llm, name):
    check(run_case(vl, llm, vl.cases[name]), vl.cases[name])


def test_engine_core_process_takes_the_images_out_of_band():
    """The engine core in its own process: the images cross as views of the request message's buffers
    (``messages.dump_features``), and HF's greedy continuation comes back (one family: the crossing is the
    same for both)."""
    vl = FIXTURES[NAMES[0]]
    engine = vl.make_llm(multiprocess=True)
    try:
        for name in ("one_image", "two_images"):
            if name in vl.cases:
                check(run_case(vl, engine, vl.cases[name]), vl.cases[name])
    finally:
        engine.shutdown()


def test_batched_with_text_only_requests(vl, llm):
    """Image prompts and text prompts in one batch (text-only rows: three equal position rows): each as alone."""
    cases = vl.cases
    text_ids = cases["text_only"]["prompt_ids"]
    outs = llm.generate([{"prompt_token_ids": text_ids}, request(vl, cases["text_around"]),
                         {"prompt_token_ids": text_ids}], sampling(), use_tqdm=False)
    expect = [cases["text_only"], cases["text_around"], cases["text_only"]]
    assert [list(o.outputs[0].token_ids) for o in outs] == [c["greedy_ids"] for c in expect]


def test_chats_of_one_call_load_and_process_their_images_together_each_as_alone(vl, llm, monkeypatch):
    """``LLM.chat`` of several conversations: all their images load in one ``map_media`` (worker threads), and
    ``generate`` preprocesses every image prompt through one ``MediaAhead``, each prompt still with its own
    images in order: HF's greedy continuation each."""
    from jaxserve import llm as llm_module
    calls, real, ahead = [], llm_module.map_media, []
    monkeypatch.setattr(llm_module, "map_media", lambda fn, items: calls.append(len(items)) or real(fn, items))

    class CountedAhead(llm_module.MediaAhead):
        def __init__(self, fn, items, window=None):
            ahead.append(len(items))
            super().__init__(fn, items, window)
    monkeypatch.setattr(llm_module, "MediaAhead", CountedAhead)
    names = [n for n in ("two_images", "one_image", "text_only", "two_turns") if n in vl.cases]
    outs = llm.chat([vl.openai_messages(vl.cases[n]) for n in names], sampling(), use_tqdm=False)
    for out, n in zip(outs, names):
        check(out, vl.cases[n])
    images = [len(vl.cases[n]["images"]) for n in names]
    assert calls == [sum(images)] and ahead == [sum(1 for k in images if k)]


def test_a_bad_prompt_among_image_prompts_leaves_none_queued(vl, llm):
    """An image prompt whose placeholders do not match its images, after a good one: the error the prompt
    would raise alone, and nothing of the call is left queued."""
    from jaxserve.errors import InvalidRequestError
    case = vl.cases["text_around"]
    bad = {"prompt": case["prompt"], "multi_modal_data": {"image": [vl.image(n) for n in case["images"]] * 2}}
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate([request(vl, case), bad], sampling(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    check(run_case(vl, llm, case), case)


def test_prefix_cache_same_image_shares_and_other_image_does_not(vl):
    """The same image reuses the prompt's blocks (the 3-D positions come from the features, not the cache);
    another image of the same size with the same text shares only the block before it."""
    engine = vl.make_llm(block_size=8, enable_prefix_caching=True)
    case = vl.cases["text_around"]          # 33 tokens; the image's 10 tokens start at 9
    other = Image.fromarray(np.random.default_rng(9).integers(0, 256, (150, 60, 3), dtype=np.uint8), "RGB")

    def run(img):
        return engine.generate({"prompt": case["prompt"], "multi_modal_data": {"image": [img]}}, sampling(),
                               use_tqdm=False)[0]
    first, again, third = run(vl.image("tall.png")), run(vl.image("tall.png")), run(other)
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == case["greedy_ids"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert third.num_cached_tokens == 8 and third.prompt_token_ids == case["prompt_ids"]
    engine.shutdown()


def test_chunked_prefill_splits_images_and_multi_step_decodes(vl):
    """A step budget of 8 tokens splits the 24-token and 10-token images over steps (each chunk's 3-D
    positions from its own range); decoding 4 steps per dispatch keeps the KV slots on the sequence index."""
    engine = vl.make_llm(max_num_batched_tokens=8, max_num_seqs=4, max_num_encoder_input_tokens=24,
                         encoder_cache_size=48, num_scheduler_steps=4)
    for name in ("two_images", "one_image"):
        check(run_case(vl, engine, vl.cases[name]), vl.cases[name])
    engine.shutdown()


# ------------------------------------------------------------------------------- tensor parallelism
TP_CASES = ("one_image", "two_images", "text_around")


def _tp_worker(name: str) -> dict:
    import jax as jax_
    assert jax_.device_count() == 2
    vl = FIXTURES[name]
    engine = vl.make_llm(tensor_parallel_size=2, skip_warmup=True, compilation_cache_dir="")
    report = {case: list(run_case(vl, engine, vl.cases[case]).outputs[0].token_ids) for case in TP_CASES}
    layer = engine.engine.core.model.params["vision"]["layers"][0]
    mlp = ("gate", "down") if "gate" in layer else ("fc1", "fc2")
    report["specs"] = [str(layer[w].sharding.spec) for w in ("wq", *mlp)]
    return report


@pytest.mark.slow     # fake-device TP runs: make test-slow
def test_tensor_parallel_2_matches_hf(vl):
    report = fake_device_report([os.path.abspath(__file__), "--tp-worker", vl.name], 2)
    for case in TP_CASES:
        assert report[case] == vl.cases[case]["greedy_ids"], case
    assert all("tp" in s for s in report["specs"])       # the encoder is sharded like the decoder


if __name__ == "__main__" and sys.argv[1:2] == ["--tp-worker"]:
    print(json.dumps(_tp_worker(sys.argv[2])))


def test_mm_processor_kwargs_max_pixels(vl):
    """``max_pixels`` as a processor option: the image shrinks (the processor's own grid) and so does its
    token count; the request still runs."""
    from transformers import Qwen2VLImageProcessorPil
    grid = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 6)(
        images=[vl.image("wide.png").convert("RGB")], return_tensors="np")["image_grid_thw"][0]
    engine = vl.make_llm(mm_processor_kwargs={"max_pixels": 28 * 28 * 6})
    out = run_case(vl, engine, vl.cases["one_image"])
    n_image = sum(1 for t in out.prompt_token_ids if t == 5)
    assert n_image == grid[1] * grid[2] // 4 < 24 and len(out.outputs[0].token_ids) == GREEDY
    engine.shutdown()


def test_transformers5_tensor_names_load_the_same(vl, tmp_path):
    """A checkpoint saved with the text model under ``model.language_model.`` and the tower under
    ``model.visual.`` loads the same weights."""
    import shutil

    from safetensors.flax import load_file, save_file

    from jaxserve.models.loader import load_model
    for f in os.listdir(vl.folder):
        if f != "model.safetensors":
            shutil.copy(os.path.join(vl.folder, f), tmp_path / f)
    renamed = {}
    for k, v in load_file(os.path.join(vl.folder, "model.safetensors")).items():
        k = "model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
        renamed[k] = v
    save_file(renamed, str(tmp_path / "model.safetensors"))
    a, b = load(vl.name), load_model(str(tmp_path), dtype="float32")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
