"""``QwenVLPixels`` (Qwen2-VL's image processing straight to the tower's payload) against transformers'
processor and ``patch_blocks``: bit-equal payloads and equal grids for images that are scaled up, down, kept,
capped by ``max_pixels`` and of odd aspect, in float32, bfloat16 and float16, for an even patch side (pixels
looked up in pairs) and an odd one; ``ImageProcessing`` uses it for RGB images and the processor otherwise,
with the same results (an RGB image as its bytes and value tables, which looked up are those results)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.processing import ImageProcessing, patch_blocks
from jaxserve.multimodal.qwen_vl_pixels import QwenVLPixels
from support.tiny_models import fixture_path

SIZES = [(1024, 1024), (517, 1023), (20, 30), (56, 84), (3000, 41), (700, 1900)]      # (H, W) pixels


def hf_payload(processor, image, dtype):
    out = processor(images=[image], return_tensors="np")
    return patch_blocks(out["pixel_values"], out["image_grid_thw"][0], processor, dtype), out["image_grid_thw"][0]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("kwargs", [{}, {"max_pixels": 28 * 28 * 256, "min_pixels": 28 * 28 * 4},
                                    {"patch_size": 15, "max_pixels": 30 * 30 * 64, "min_pixels": 30 * 30 * 4}])
def test_payload_equals_the_processors(kwargs, dtype):
    from transformers import Qwen2VLImageProcessorPil
    processor = Qwen2VLImageProcessorPil(**({"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384} | kwargs))
    port = QwenVLPixels.of(processor)
    rng = np.random.default_rng(0)
    for h, w in SIZES:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        want, grid = hf_payload(processor, image, dtype)
        got, extra = port(image, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(extra["image_grid_thw"], grid)
        assert extra["image_grid_thw"].dtype == grid.dtype


def test_other_settings_use_the_processor():
    from transformers import Qwen2VLImageProcessorPil
    assert QwenVLPixels.of(Qwen2VLImageProcessorPil(do_resize=False)) is None
    assert QwenVLPixels.of(object()) is None
    plain = Qwen2VLImageProcessorPil(do_normalize=False, do_rescale=False)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (90, 60, 3), dtype=np.uint8), "RGB")
    np.testing.assert_array_equal(QwenVLPixels.of(plain)(image, np.float32)[0],
                                  hf_payload(plain, image, np.float32)[0])


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen2-vl"])
def test_image_processing_takes_the_direct_path_for_rgb(name):
    from jaxserve.models.loader import load_model
    model = load_model(fixture_path(name), dtype="float32")
    proc = ImageProcessing.from_folder(fixture_path(name), model.config.extra_dict, dtype="bfloat16")
    slow = ImageProcessing.from_folder(fixture_path(name), model.config.extra_dict, dtype="bfloat16")
    assert proc._qwen_vl is not None
    slow._qwen_vl = None
    for file in ("small.png", "tall.png", "wide.png"):
        for image in (Image.open(fixture_path(name) + "/" + file).convert("RGB"),
                      Image.open(fixture_path(name) + "/" + file).convert("RGBA")):      # RGBA: the processor
            (px, extra, digest), = proc.process_image(image)
            (want, want_extra, want_digest), = slow.process_image(image)
            assert want.dtype == ml_dtypes.bfloat16 and digest == want_digest
            if image.mode == "RGB":             # its bytes and their value table, looked up on the device
                table = extra.pop("pixel_table")
                assert px.dtype == np.uint8 and table.dtype == ml_dtypes.bfloat16
                lh, lw, k = px.shape
                px = table[np.arange(3)[:, None], px.reshape(lh, lw, 4, 3, -1)].reshape(lh, lw, k)
            np.testing.assert_array_equal(px, want)
            np.testing.assert_array_equal(extra["image_grid_thw"], want_extra["image_grid_thw"])
