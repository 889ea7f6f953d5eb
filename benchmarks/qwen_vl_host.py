"""The host work of one image for Qwen2.5-VL, stage by stage (no device work is timed).

One ``--size`` RGB image (random pixels as a JPEG data URL, as ``jaxserve bench``'s image workloads send) through
the stages a served request takes, each timed best of ``--repeat`` with ``time.perf_counter``:

- front end (the server's worker threads; the offline ``LLM``'s calling thread): ``decode`` (the data URL to an
  RGB PIL image, ``media.load_image_url``), ``hash`` (the content hash), ``pixels`` (the processor's work:
  ``QwenVLPixels`` or transformers' processor; ``payload``: its part after the resize, the patch order and
  the table lookup), ``process_image`` (hash and pixels, as the front end calls them), ``pickle`` (the
  ``ImageFeature`` into the core's request message, msgpack bytes);
- engine core process, on its step loop: ``unpickle`` (the message decoded, its features unpickled),
  ``pack`` (the tower's packed input at its patch bucket: ``pack_images``), ``to_device`` (``jax.device_put``
  of the packed arrays, what the encoder step's call does with host arrays).

``front_end`` and ``core_loop`` are the sums of each side's best times (decode + process_image + pickle;
unpickle + pack + to_device).

The processor's settings are the hub's Qwen2.5-VL-7B ones (``min_pixels`` 56², ``max_pixels`` 28² x 16384);
the vision spec is the 7B's (patch 14, merge 2, window 112): the host path depends on those, not on widths.

    .venv/bin/python -m benchmarks.qwen_vl_host --repeat 20
"""
from __future__ import annotations

import argparse
import json
import pickle
import time

import numpy as np


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def stages(size: int, repeat: int, dtype: str) -> dict:
    import jax

    from benchmarks.workloads import random_image_url
    from transformers import Qwen2VLImageProcessorPil

    from jaxserve.engine import messages as m
    from jaxserve.models.layers.qwen_vision import QwenVisionSpec
    from jaxserve.models.qwen2_vl import pack
    from jaxserve.multimodal.media import MediaLimits, load_image_url
    from jaxserve.multimodal.processing import ImageProcessing, _pixel_dtype
    from jaxserve.runner.encoder_cache import MIN_PATCH_BUCKET, patch_bucket

    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    proc = ImageProcessing(processor, "<|image_pad|>", 5, 28, pixel_dtype=_pixel_dtype(dtype))
    spec = QwenVisionSpec(hidden_size=1280, intermediate_size=3420, num_heads=16, depth=32, in_channels=3,
                          patch_size=14, merge=2, temporal_patch_size=2, out_hidden_size=3584, rope_theta=1e4,
                          norm="rms", mlp="gated", activation="silu", window=4, full_blocks=(7, 15, 23, 31))
    url = random_image_url(np.random.default_rng(0), size)
    limits = MediaLimits()
    out: dict[str, float] = {}
    out["decode"], image = _best(lambda: load_image_url(url, limits), repeat)
    (px, extra, digest), = proc.process_image(image)
    out["hash"], _ = _best(lambda: _hash(image, proc), repeat)
    out["pixels"], _ = _best(lambda: proc._qwen_vl(image, proc.pixel_dtype) if proc._qwen_vl is not None
                             else proc.process_image(image), repeat)
    if proc._qwen_vl is not None:       # the payload of an image already at the processor's size: no resize
        h, w = (int(g) * 14 for g in extra["image_grid_thw"][1:])
        sized = image.resize((w, h), resample=proc._qwen_vl.resample)
        out["payload"], _ = _best(lambda: proc._qwen_vl(sized, proc.pixel_dtype), repeat)
    out["process_image"], items = _best(lambda: proc.process_image(image), repeat)
    features = [_feature(items[0], proc)]
    enc, dec = msgspec_codec(m)
    out["pickle"], wire = _best(lambda: enc.encode(_request(m, features)), repeat)
    out["unpickle"], got = _best(lambda: _features(m, dec.decode(wire)), repeat)
    px = got[0].pixel_values
    bucket = patch_bucket(spec.patches(px.shape), spec.unit, MIN_PATCH_BUCKET)
    out["pack"], (inputs, _, _) = _best(lambda: pack(spec, [[px]], 1, bucket), repeat)
    out["to_device"], _ = _best(lambda: jax.block_until_ready(jax.device_put(inputs)), repeat)
    return {"size": size, "dtype": dtype, "grid": [int(g) for g in extra["image_grid_thw"]],
            "payload_bytes": int(px.nbytes), "wire_bytes": len(wire), "bucket": bucket,
            "ms": {k: round(v, 2) for k, v in out.items()},
            "front_end": round(out["decode"] + out["process_image"] + out["pickle"], 2),
            "core_loop": round(out["unpickle"] + out["pack"] + out["to_device"], 2)}


def _hash(image, proc):
    from jaxserve.multimodal.inputs import image_hash
    return image_hash(np.asarray(image), image.mode, proc._kwargs_key)


def _feature(item, proc):
    from jaxserve.multimodal.inputs import ImageFeature
    px, extra, digest = item
    return ImageFeature(digest, 8, proc.num_tokens(px, extra), px, extra)


def _request(m, features):
    """The core's request message of ``features`` as the front end sends it."""
    if hasattr(m, "dump_features"):
        data, buffers = m.dump_features(features)
        return m.EngineCoreRequest("0", [1] * 8, b"", 0.0, 0, mm_features=data, mm_buffers=buffers)
    return m.EngineCoreRequest("0", [1] * 8, b"", 0.0, 0, mm_features=pickle.dumps(features))  # before dump_features


def _features(m, msg):
    if hasattr(m, "load_features"):
        return m.load_features(msg.mm_features, msg.mm_buffers)
    return pickle.loads(msg.mm_features)


def msgspec_codec(m):
    import msgspec
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.ToCore)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    print(json.dumps(stages(args.size, args.repeat, args.dtype)))


if __name__ == "__main__":
    main()
