"""``QwenVLPixels`` (Qwen2-VL's image processing straight to the tower's payload) against transformers'
processor and ``patch_blocks``: bit-equal payloads and equal grids for images that are scaled up, down, kept,
capped by ``max_pixels`` and of odd aspect, in float32, bfloat16 and float16, for an even patch side (pixels
looked up in pairs) and an odd one; ``ImageProcessing`` uses it for RGB images and the processor otherwise,
with the same results (an RGB image as its bytes and value tables, which looked up are those results); the
tower's encoding of those bytes equals its encoding of the processor's payload, in bfloat16 and float32."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.processing import ImageProcessing, patch_blocks
from jaxserve.multimodal.qwen_vl_pixels import QwenVLPixels
from support.tiny_models import fixture_path
from support.vision import VisionFixture, looked_up

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


def test_payload_is_the_processors_patches_by_merge_block():
    """The tower's pixel payload made from the processor's flattened patches (``patch_blocks``, the front end)
    is the image's merge blocks as ``image_blocks`` lays them out, for grids of odd block counts too."""
    from transformers import Qwen2VLImageProcessorPil

    from jaxserve.models.layers.qwen_vision import image_blocks
    from jaxserve.multimodal.processing import patch_blocks
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    rng = np.random.default_rng(0)
    for h, w in ((112, 168), (28, 84), (140, 196)):
        image = rng.standard_normal((3, h, w)).astype(np.float32)
        patches, gh, gw = proc.patchify(image, patch_size=14, merge_size=2, temporal_patch_size=2)
        payload = patch_blocks(patches, np.array([1, gh, gw]), proc)
        assert payload.shape == (h // 28, w // 28, 4 * 3 * 14 * 14) and payload.dtype == np.float32
        np.testing.assert_array_equal(payload, image_blocks(image, 14, 2))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_byte_payload_encodes_as_the_processors_pixels(dtype):
    """An RGB image goes to the core as its bytes and a value table per channel (``QwenVLPixels``): looked
    up, they are the processor's payload bit for bit, and the encoder's slab rows for them equal those for
    that payload exactly (the tower looks the bytes up on the device), in a bucket with padding patches."""
    from jaxserve.models.loader import load_model
    from jaxserve.multimodal.inputs import ImageFeature
    from jaxserve.multimodal.processing import ImageProcessing
    vl = VisionFixture("tiny-qwen2.5-vl", max_num_batched_tokens=128)
    model = load_model(vl.folder, dtype=dtype)
    proc = ImageProcessing.from_folder(vl.folder, model.config.extra_dict, dtype=dtype)
    slow = ImageProcessing.from_folder(vl.folder, model.config.extra_dict, dtype=dtype)
    slow._qwen_vl = None                                    # transformers' processor
    from jaxserve.runner.encoder_cache import EncoderCache
    cache = EncoderCache(model, capacity=2048, max_batch=2, min_patches=256)
    for name in ("wide.png", "tall.png"):
        image = vl.image(name).convert("RGB")
        (px, extra, digest), = proc.process_image(image)
        (want, want_extra, want_digest), = slow.process_image(image)
        assert px.dtype == np.uint8 and extra["pixel_table"].dtype == want.dtype and digest == want_digest
        np.testing.assert_array_equal(looked_up(px, extra["pixel_table"]), want)
        n = proc.num_tokens(px, extra)
        assert n == slow.num_tokens(want, want_extra)
        cache.encode([ImageFeature(name, 0, n, px, extra), ImageFeature(name + "-f", 0, n, want, want_extra)])
        slab = np.asarray(cache.slab)
        np.testing.assert_array_equal(slab[cache.rows[name]], slab[cache.rows[name + "-f"]])
    assert {k[1] for k in cache.compiler.keys()} == {f"uint8>{dtype}", dtype}


def test_bfloat16_payload_encodes_as_float32_pixels():
    """A bfloat16 model's payload sent in bfloat16 (what the front end makes for it) encodes exactly as the
    float32 payload the tower casts on the device."""
    import ml_dtypes

    from jaxserve.models.loader import load_model
    from jaxserve.multimodal.processing import ImageProcessing
    vl = VisionFixture("tiny-qwen2.5-vl", max_num_batched_tokens=128)
    model = load_model(vl.folder, dtype="bfloat16")
    image = vl.image("wide.png").convert("RGB")
    proc16 = ImageProcessing.from_folder(vl.folder, model.config.extra_dict, dtype="bfloat16")
    (u8, extra, _), = proc16.process_image(image)
    px16 = looked_up(u8, extra["pixel_table"])
    px32 = ImageProcessing.from_folder(vl.folder, model.config.extra_dict)._qwen_vl(image, np.float32)[0]
    assert px16.dtype == ml_dtypes.bfloat16 and px32.dtype == np.float32
    np.testing.assert_array_equal(px16, px32.astype(ml_dtypes.bfloat16))
    a, b = (np.asarray(model.family.encode_images(model.params, px[None], model.config)) for px in (px16, px32))
    np.testing.assert_array_equal(a, b)
