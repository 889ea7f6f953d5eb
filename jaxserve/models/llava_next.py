"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``): LLaVA-1.5's CLIP ViT, projector and Llama/Mistral text
model (``llava``), with "anyres" images: each image is a base tile plus a grid of tiles (``multimodal.anyres``),
all through the tower in one batch, and the grid's features cropped to the image's aspect ratio with the
learned ``image_newline`` after each row (HF's ``pack_image_features``).

Encoder step (``encode_images``): pixel values ``[B, T, C, S, S]`` (the image processor's tiles; ``T`` the
tile count, base tile first) → ``[B, T * P * P + R, hidden]``: the tiles' projected patch features in tile
order, then ``R`` copies of ``image_newline`` (``R``: the most patch rows a grid of ``T`` tiles has). The
image's tokens are a selection of those rows (``image_slots``: computed on the host from the image's size and
``image_grid_pinpoints``), which the encoder cache scatters into its slab. So the compiled encoder programs
depend on the tile count only (one per distinct grid size of ``image_grid_pinpoints``, times the batch
buckets), not on the image sizes; ``warmup_pixel_shapes`` lists them.

Config: LLaVA's (``llava.unwrap_hf``) plus ``image_grid_pinpoints``; ``vision_feature_select_strategy``
"default" only (HF's packing cannot reshape tiles that keep the class token). Checkpoint names: LLaVA's,
plus ``image_newline`` (``model.image_newline`` in transformers 5).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama, llava
from jaxserve.models.layers.decoder import REPLICATED, DecoderSpec, _param, _to_internal, _w
from jaxserve.multimodal import anyres

ARCHITECTURES = ("LlavaNextForConditionalGeneration",)
MODEL_TYPES = {"llava_next": "LlavaNextForConditionalGeneration"}


def read_hf(hf: dict, fields: dict) -> dict:
    fields = llava.read_hf(hf, fields)
    extra = fields["extra"]
    size = int(extra["vision"]["image_size"])
    # LLaVA-NeXT's processing at the tower's resolution: what a checkpoint without its processor files gets
    processor = dict(extra["image_processor"]) | {"image_processor_type": "LlavaNextImageProcessor",
                                                 "image_grid_pinpoints": extra["image_grid_pinpoints"]}
    fields["extra"] = extra | {"image_processor": processor, "tile_size": size}
    return fields


def check_config(cfg: ModelConfig) -> None:
    llava.check_config(cfg)
    extra = cfg.extra_dict
    if extra["vision_feature_select_strategy"] != "default":
        raise ModelLoadError("LlavaNextForConditionalGeneration: vision_feature_select_strategy "
                             f"{extra['vision_feature_select_strategy']!r} is not supported (default; HF's "
                             "anyres packing cannot reshape tiles that keep the class token)")
    tile = int(extra["tile_size"])
    bad = [list(p) for p in extra["image_grid_pinpoints"] if p[0] % tile or p[1] % tile or min(p) <= 0]
    if bad:
        raise ModelLoadError(f"image_grid_pinpoints {bad} are not multiples of the tower's image_size {tile}")


def _geometry(cfg: ModelConfig) -> tuple:
    extra = cfg.extra_dict
    return [tuple(p) for p in extra["image_grid_pinpoints"]], int(extra["tile_size"]), \
        int(dict(extra["vision"])["patch_size"])


class LlavaNextModel(llava.LlavaModel):
    """LLaVA's model plus ``image_newline`` (the vector after each row of an image's tile grid)."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, vspec):
        super().__init__(cfg, spec, vspec)
        self.image_newline = _param((cfg.hidden_size,), REPLICATED, "zeros")
        self.pinpoints, self.tile, self.patch = _geometry(cfg)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        b, t = pixel_values.shape[:2]
        features = super().encode_images(pixel_values.reshape(b * t, *pixel_values.shape[2:]))
        features = features.reshape(b, -1, features.shape[-1])                  # [B, T * P * P, hidden]
        rows = anyres.max_rows(t, self.pinpoints, self.tile, self.patch)
        newline = jnp.broadcast_to(_w(self.image_newline).astype(features.dtype), (b, rows, features.shape[-1]))
        return jnp.concatenate([features, newline], axis=1)


class LlavaNextFamily(llava.LlavaFamily):
    """LLaVA's family with anyres images: ``image_slots`` says which encoder rows are an image's tokens."""

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one family object, as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: LlavaNextModel(cfg, self.decoder_spec(cfg), llava.vision_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        return super().weight_plan(cfg) + [(("image_newline",), ["image_newline"], "same")]

    def encode_images(self, params: dict, pixel_values: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``pixel_values [B, T, C, S, S]`` → ``[B, T * P * P + R, hidden_size]`` (the module docstring)."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).encode_images(pixel_values)

    def image_slots(self, cfg: ModelConfig, feature) -> tuple[int, np.ndarray]:
        """(the encoder's output rows per image of ``feature``'s tile count, the row of each of its tokens)."""
        pinpoints, tile, patch = _geometry(cfg)
        t = feature.pixel_values.shape[0]
        slots = anyres.token_slots(tuple(int(s) for s in feature.extra["image_sizes"]), pinpoints, tile, patch)
        if len(slots) != feature.length:
            raise ValueError(f"an image of {len(slots)} tokens with {feature.length} placeholders")
        return t * (tile // patch) ** 2 + anyres.max_rows(t, pinpoints, tile, patch), slots

    def warmup_pixel_shapes(self, cfg: ModelConfig) -> list[tuple[int, ...]]:
        """The pixel shapes of one image the encoder compiles at start-up: one per tile count."""
        pinpoints, tile, _ = _geometry(cfg)
        channels = int(dict(cfg.extra_dict["vision"])["num_channels"])
        return [(t, channels, tile, tile) for t in anyres.tile_counts(pinpoints, tile)]


FAMILY = LlavaNextFamily(llama.decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                         model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=llava.unwrap_hf)
