"""LLaVA-NeXT end to end against HF transformers (tests/make_llava_next_fixtures.py: a tiny random checkpoint
with anyres tiles and ``image_newline``, its images of four aspect ratios and HF's float32 outputs): the anyres
geometry equals HF's processor and packing for many image sizes, the prompt's logits within 1e-4, HF's greedy
continuation through the engine for one image, two images of different tile grids, text around an image, a
raw prompt, batched with text-only requests, under chunked prefill; the encoder compiles one program per tile
count at start-up and nothing per image size."""
from __future__ import annotations

import itertools
import json
import sys

import numpy as np
import pytest

from support.vision import VisionFixture, llm_fixture

NAME = "tiny-llava-next"
# steps of 64 tokens (an image's 56 to 88 tokens span steps), an encoder budget of two images
VISION = VisionFixture(NAME, max_num_batched_tokens=64, max_num_encoder_input_tokens=176)
FOLDER, CASES = VISION.folder, VISION.cases
run_case, image = VISION.run_case, VISION.image
PINPOINTS = [(28, 56), (56, 28), (56, 56), (84, 28), (28, 84)]
TILE, PATCH = 28, 7
SIZES = [(h, w) for h, w in itertools.product((1, 5, 27, 28, 30, 48, 64, 90, 333, 1000), repeat=2)]

llm = llm_fixture(VISION)


def _hf_packing(size, num_tiles_hw, p):
    """HF's ``pack_image_features`` on labelled features (each patch's row in the encoder output, the newline
    as -1): the view / permute / ``unpad_image`` / newline concatenation, in numpy."""
    gh, gw = num_tiles_hw
    feats = (p * p + np.arange(gh * gw * p * p)).reshape(gh, gw, p, p).transpose(0, 2, 1, 3).reshape(gh * p, gw * p)
    h, w = size
    ch, cw = feats.shape
    if w / h > cw / ch:
        pad = (ch - int(round(h * (cw / w), 7))) // 2
        feats = feats[pad:ch - pad]
    else:
        pad = (cw - int(round(w * (ch / h), 7))) // 2
        feats = feats[:, pad:cw - pad]
    feats = np.concatenate([feats, np.full((feats.shape[0], 1), -1)], axis=1).reshape(-1)
    return np.concatenate([np.arange(p * p), feats])


def test_anyres_geometry_matches_hf():
    """Grid choice, token count (HF's processor) and each token's encoder row (HF's packing) for image sizes
    from 1 pixel to 1000, every aspect ratio between."""
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    from jaxserve.multimodal import anyres
    hf = LlavaNextProcessor.__new__(LlavaNextProcessor)        # the counting needs no tokenizer
    hf.patch_size, hf.num_additional_image_tokens = PATCH, 0
    hf.image_processor = type("P", (), {"image_grid_pinpoints": [list(p) for p in PINPOINTS]})()
    p = TILE // PATCH
    for size in SIZES:
        assert anyres.select_best_resolution(size, PINPOINTS) == tuple(select_best_resolution(size, PINPOINTS))
        n = anyres.num_image_tokens(size, PINPOINTS, TILE, PATCH)
        assert n == hf._get_number_of_features(*size, TILE, TILE), size
        slots = anyres.token_slots(size, PINPOINTS, TILE, PATCH)
        grid = anyres.tile_grid(size, PINPOINTS, TILE)
        want = _hf_packing(size, grid, p)
        newline = (grid[0] * grid[1] + 1) * p * p
        assert len(slots) == n and (slots[want >= 0] == want[want >= 0]).all(), size
        # the newlines: one encoder row each, after the tiles' rows
        assert (slots[want < 0] == newline + np.arange((want < 0).sum())).all()
        assert (want < 0).sum() <= anyres.max_rows(grid[0] * grid[1] + 1, PINPOINTS, TILE, PATCH)


def test_logits_match_hf():
    """The first case's prompt prefilled in one step, its image's tiles through the encoder and packed by
    ``image_slots``: logits within 1e-4 of HF float32."""
    from jaxserve.models.loader import load_model
    from jaxserve.multimodal.processing import ImageProcessing
    model = load_model(FOLDER, dtype="float32")
    case = CASES["one_image"]
    proc = ImageProcessing.from_folder(FOLDER, model.config.extra_dict, tokenizer=model.tokenizer)
    ids, feats = proc.process(model.tokenizer.encode(case["prompt"], add_special_tokens=False),
                              [image(n).convert("RGB") for n in case["images"]])
    assert ids == case["prompt_ids"] and len(feats) == 1
    f = feats[0]
    out = np.asarray(model.family.encode_images(model.params, f.pixel_values[None], model.config))[0]
    n_out, slots = model.family.image_slots(model.config, f)
    assert out.shape[0] == n_out
    index = np.stack([np.arange(f.offset, f.end), np.arange(f.length)])
    VISION.check_prefill_logits(model, ids, out[slots], index, max_len=128)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf(llm, name):
    out = run_case(llm, CASES[name])
    assert out.prompt_token_ids == CASES[name]["prompt_ids"]
    assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"]


def test_batched_with_text_only_requests(llm):
    """Image prompts of two tile grids and text prompts in one batch: each as alone."""
    VISION.check_batched_with_text_only(llm, ("text_around", "raw_placeholder"))


def test_image_requests_compile_nothing_after_the_warm_up(llm):
    """The encoder compiles one program per tile count (3, 4, 5 tiles) and batch bucket at start-up: images of
    every size and grid (one image, two images of other grids) then run without compiling."""
    runner = llm.engine.core.runner
    assert runner.encoder._step._cache_size() >= 3
    VISION.check_no_compiles_after_warmup(llm, ("one_image", "two_images", "text_around"))


def test_chunked_prefill_and_encoder_budget_split_the_images():
    """A step budget of 16 tokens splits each image's tokens over steps; an encoder budget of one image
    encodes the second image of a prompt in a later step. The outputs stay HF's."""
    engine = VISION.make_llm(max_num_batched_tokens=16, max_num_seqs=4, max_num_encoder_input_tokens=88,
                             encoder_cache_size=128, skip_warmup=True)
    for name in ("two_images", "one_image"):
        out = run_case(engine, CASES[name])
        assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"], name
    engine.shutdown()


def test_processing_without_processor_files_is_the_checkpoints():
    """A checkpoint without its processor files (dummy weights) gets LLaVA-NeXT's processing from config.json:
    the same tiles, sizes and expanded ids as the fixture's processor_config.json."""
    from jaxserve.models.configs import model_config_from_folder
    from jaxserve.multimodal.processing import ImageProcessing
    from transformers import AutoTokenizer
    extra = model_config_from_folder(FOLDER)[0].extra_dict
    tok = AutoTokenizer.from_pretrained(FOLDER)
    case = CASES["two_images"]
    prompt = tok.encode(case["prompt"], add_special_tokens=False)
    imgs = [image(n).convert("RGB") for n in case["images"]]
    ids, feats = ImageProcessing.from_folder(FOLDER, extra, tokenizer=tok).process(prompt, imgs)
    ids_d, feats_d = ImageProcessing.from_folder(None, extra, tokenizer=tok).process(prompt, imgs)
    assert ids == ids_d == case["prompt_ids"]
    for f, g in zip(feats, feats_d):
        assert f.pixel_values.shape == g.pixel_values.shape and np.array_equal(f.extra["image_sizes"],
                                                                              g.extra["image_sizes"])
        np.testing.assert_allclose(f.pixel_values, g.pixel_values, atol=1e-6)


TP_CASES = ("one_image", "two_images")


@pytest.mark.slow     # a fake-device TP run: make test-slow
def test_tensor_parallel_2_matches_hf():
    VISION.check_tensor_parallel(__file__, TP_CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--tp-worker"]:
    print(json.dumps(VISION.tp_report(TP_CASES)))
