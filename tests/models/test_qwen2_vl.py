"""Qwen2.5-VL end to end against HF transformers (tests/make_qwen_vl_fixtures.py: a tiny random checkpoint with
window attention in its ViT, its images of three sizes and HF's float32 outputs): the prompt's logits within
1e-4, and HF's greedy continuation through the engine for one image, two images of different sizes, text around
an image, a two-turn chat with an earlier image and a text-only chat; batched with text-only requests, under
the prefix cache, with chunked prefill splitting an image, and at tensor parallelism 2 on fake CPU devices."""
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
from support.vision import GREEDY, VisionFixture

NAME = "tiny-qwen2.5-vl"
VISION = VisionFixture(NAME, max_num_batched_tokens=128)
FOLDER, CASES = VISION.folder, VISION.cases
image, data_url, openai_messages, make_llm = VISION.image, VISION.data_url, VISION.openai_messages, VISION.make_llm


def sampling():
    from jaxserve.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)


def request(case: dict):
    """The case as ``LLM.generate``'s prompt (raw text) or ``LLM.chat``'s messages."""
    if "raw" in case:
        return {"prompt": case["prompt"], "multi_modal_data": {"image": [image(n) for n in case["images"]]}}
    return openai_messages(case)


def run_case(llm, case: dict):
    if "raw" in case:
        return llm.generate(request(case), sampling(), use_tqdm=False)[0]
    return llm.chat(request(case), sampling(), use_tqdm=False)[0]


def check(out, case: dict) -> None:
    assert out.prompt_token_ids == case["prompt_ids"]
    assert list(out.outputs[0].token_ids) == case["greedy_ids"]


@pytest.fixture(scope="module")
def llm():
    engine = make_llm()
    yield engine
    engine.shutdown()


def processed(model, case: dict):
    from jaxserve.multimodal.processing import ImageProcessing
    proc = ImageProcessing.from_folder(FOLDER, model.config.extra_dict)
    return proc.process(model.tokenizer.encode(case["prompt"], add_special_tokens=False),
                        [image(n).convert("RGB") for n in case["images"]])


def test_logits_match_hf():
    """The first case's prompt (a 12x8-patch image: windows and full attention) prefilled in one step, its
    image embedded by the encoder, 3-D positions from the step inputs: logits within 1e-4."""
    from jaxserve.models.loader import load_model
    from jaxserve.runner.step_variants import forward_fn
    model = load_model(FOLDER, dtype="float32")
    case = CASES["one_image"]
    ids, feats = processed(model, case)
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
    err = np.abs(np.asarray(logits) - hf_logits(NAME)).max()
    assert err <= 1e-4, f"max abs logit error {err:.2e} vs HF float32"


def test_images_of_one_size_encode_as_a_batch():
    """Two images of one size in one encoder batch (padding images included: a batch bucket of 4) give
    each image's tokens alone."""
    from jaxserve.models.loader import load_model
    model = load_model(FOLDER, dtype="float32")
    _, feats = processed(model, CASES["one_image"])
    a = feats[0].pixel_values
    b = a[:, ::-1, :].copy()
    batch = np.stack([a, b, np.zeros_like(a), np.zeros_like(a)])
    together = np.asarray(model.family.encode_images(model.params, batch, model.config))
    for i, px in enumerate((a, b)):
        alone = np.asarray(model.family.encode_images(model.params, px[None], model.config))[0]
        np.testing.assert_allclose(together[i], alone, atol=1e-5)


def test_pixels_round_trip_the_processors_patches():
    """The encoder's image ``[C, H, W]`` is the processor's flattened patches rearranged, losslessly."""
    from transformers import Qwen2VLImageProcessorPil

    from jaxserve.multimodal.processing import patches_to_image
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    out = proc(images=[image("wide.png").convert("RGB")], return_tensors="np")
    pixels = patches_to_image(out["pixel_values"], out["image_grid_thw"][0], proc)
    assert pixels.shape == (3, 112, 168)
    again, gh, gw = proc.patchify(pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    np.testing.assert_array_equal(again, out["pixel_values"])


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


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf(llm, name):
    check(run_case(llm, CASES[name]), CASES[name])


def test_batched_with_text_only_requests(llm):
    """Image prompts and text prompts in one batch (text-only rows: three equal position rows): each as alone."""
    text_ids = CASES["text_only"]["prompt_ids"]
    outs = llm.generate([{"prompt_token_ids": text_ids}, request(CASES["text_around"]),
                         {"prompt_token_ids": text_ids}], sampling(), use_tqdm=False)
    expect = [CASES["text_only"], CASES["text_around"], CASES["text_only"]]
    assert [list(o.outputs[0].token_ids) for o in outs] == [c["greedy_ids"] for c in expect]


def test_prefix_cache_same_image_shares_and_other_image_does_not():
    """The same image reuses the prompt's blocks (the 3-D positions come from the features, not the cache);
    another image of the same size with the same text shares only the block before it."""
    engine = make_llm(block_size=8, enable_prefix_caching=True)
    case = CASES["text_around"]          # 33 tokens; the image's 10 tokens start at 9
    other = Image.fromarray(np.random.default_rng(9).integers(0, 256, (150, 60, 3), dtype=np.uint8), "RGB")

    def run(img):
        return engine.generate({"prompt": case["prompt"], "multi_modal_data": {"image": [img]}}, sampling(),
                               use_tqdm=False)[0]
    first, again, third = run(image("tall.png")), run(image("tall.png")), run(other)
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == case["greedy_ids"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert third.num_cached_tokens == 8 and third.prompt_token_ids == case["prompt_ids"]
    engine.shutdown()


def test_chunked_prefill_splits_images_and_multi_step_decodes():
    """A step budget of 8 tokens splits the 24-token and 10-token images over steps (each chunk's 3-D
    positions from its own range); decoding 4 steps per dispatch keeps the KV slots on the sequence index."""
    engine = make_llm(max_num_batched_tokens=8, max_num_seqs=4, max_num_encoder_input_tokens=24,
                      encoder_cache_size=48, num_scheduler_steps=4)
    for name in ("two_images", "one_image"):
        check(run_case(engine, CASES[name]), CASES[name])
    engine.shutdown()


# ------------------------------------------------------------------------------- tensor parallelism
def _tp_worker() -> dict:
    import jax as jax_
    assert jax_.device_count() == 2
    engine = make_llm(tensor_parallel_size=2, skip_warmup=True, compilation_cache_dir="")
    report = {name: list(run_case(engine, CASES[name]).outputs[0].token_ids)
              for name in ("one_image", "two_images", "text_around")}
    layer = engine.engine.core.model.params["vision"]["layers"][0]
    report["specs"] = [str(layer[w].sharding.spec) for w in ("wq", "gate", "down")]
    return report


def test_tensor_parallel_2_matches_hf():
    report = fake_device_report([os.path.abspath(__file__), "--tp-worker"], 2)
    for name in ("one_image", "two_images", "text_around"):
        assert report[name] == CASES[name]["greedy_ids"], name
    assert all("tp" in s for s in report["specs"])       # the encoder is sharded like the decoder


if __name__ == "__main__" and sys.argv[1:] == ["--tp-worker"]:
    print(json.dumps(_tp_worker()))


def test_mm_processor_kwargs_max_pixels():
    """``max_pixels`` as a processor option: the image shrinks (the processor's own grid) and so does its
    token count; the request still runs."""
    from transformers import Qwen2VLImageProcessorPil
    grid = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 6)(
        images=[image("wide.png").convert("RGB")], return_tensors="np")["image_grid_thw"][0]
    engine = make_llm(mm_processor_kwargs={"max_pixels": 28 * 28 * 6})
    out = run_case(engine, CASES["one_image"])
    n_image = sum(1 for t in out.prompt_token_ids if t == 5)
    assert n_image == grid[1] * grid[2] // 4 < 24 and len(out.outputs[0].token_ids) == GREEDY
    engine.shutdown()


def test_transformers5_tensor_names_load_the_same(tmp_path):
    """A checkpoint saved with the text model under ``model.language_model.`` and the tower under
    ``model.visual.`` loads the same weights."""
    import shutil

    from safetensors.flax import load_file, save_file

    from jaxserve.models.loader import load_model
    for f in os.listdir(FOLDER):
        if f != "model.safetensors":
            shutil.copy(os.path.join(FOLDER, f), tmp_path / f)
    renamed = {}
    for k, v in load_file(os.path.join(FOLDER, "model.safetensors")).items():
        k = "model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
        renamed[k] = v
    save_file(renamed, str(tmp_path / "model.safetensors"))
    a, b = load_model(FOLDER, dtype="float32"), load_model(str(tmp_path), dtype="float32")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
