"""Qwen2-VL (``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a ViT
with a 2x2 patch merger (``layers.qwen_vision``: the two generations' blocks as spec choices) and a Qwen2 text
model (``llama``'s decoder) with M-RoPE.

Vision tower: the image processor's patches (``multimodal.processing`` hands them over by merge block,
``[lh, lw, merge**2 * C * p * p]`` in the tower's dtype: ``qwen_vision.image_blocks``' layout) packed by
``pack_images`` into rows of a bucket of patches (the runner's ``EncoderCache`` picks the bucket: one compiled
program per bucket, whatever the image sizes), through ``encode_packed``; the image's ``lh * lw`` tokens come
back where ``pack_images`` says. ``encode_images`` encodes images of one grid unpadded.

M-RoPE: the text model's rotary frequencies are split in ``mrope_section`` parts turned by the temporal,
height and width rows of 3-D positions (``mrope_positions``: text tokens on the diagonal, an image's tokens at
its start plus their row and column, the text after it shifted to continue after the image's largest side),
computed on the host from each image's offset, length and grid; the step's positions are ``[3, T]`` for this
family. Text-only requests have three equal rows: plain RoPE.

Config: ``config.json`` holds the text model's fields (top level, transformers 4) or a ``text_config``
(transformers 5), a ``vision_config`` (Qwen2-VL's names: ``embed_dim`` the ViT's width, ``hidden_size`` the
merger's output, ``mlp_ratio``; Qwen2.5-VL's: ``hidden_size``, ``out_hidden_size``, ``intermediate_size``,
``window_size``, ``fullatt_block_indexes``), the special token ids and ``rope_scaling`` / ``rope_parameters``
with ``mrope_section``; ``ModelConfig.extra`` keeps the vision facts in the 2.5 names and the image
processor's defaults (dummy weights). Checkpoint names: the text model's as Qwen2's, ``visual.`` (or
``model.visual.``) for the tower.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.layers.decoder import DecoderFamily, DecoderModel, DecoderSpec, _to_internal
from jaxserve.models.layers.qwen_vision import QwenVisionSpec, QwenVisionTower, pack
from jaxserve.models.layers.vision import VISION_ACTIVATIONS

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")
MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration"}
WRAPPER_FIELDS = ("architectures", "torch_dtype", "dtype", "tie_word_embeddings")
VISION_COMMON = {"depth": 32, "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                 "temporal_patch_size": 2}
VISION_DEFAULTS = {                 # transformers' defaults of each generation's vision_config
    "qwen2_5_vl": {"hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "window_size": 112,
                   "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]},
    "qwen2_vl": {"embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4},
}
IMAGE_TOKEN = "<|image_pad|>"


def _vision(model_type: str, vision_in: dict) -> dict:
    """The vision config in Qwen2.5-VL's names, plus the block kinds (``norm``, ``mlp``)."""
    vision_in = dict(vision_in)
    vision_in.setdefault("in_channels", vision_in.get("in_chans", 3))      # the hub's original spelling
    v = {k: vision_in.get(k, d) for k, d in (VISION_COMMON | VISION_DEFAULTS[model_type]).items()}
    v["rope_theta"] = float((vision_in.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if model_type == "qwen2_5_vl":
        return v | {"norm": "rms", "mlp": "gated"}
    width = int(v.pop("embed_dim"))
    return v | {"hidden_size": width, "out_hidden_size": v["hidden_size"],
                "intermediate_size": int(width * v.pop("mlp_ratio")), "window_size": 0,
                "fullatt_block_indexes": [], "norm": "layer", "mlp": "fc"}


def unwrap_hf(hf: dict) -> dict:
    """The text config as Qwen2's (transformers' defaults filled in, plain RoPE), with the vision facts under
    ``"_qwen_vl"`` for ``read_hf``."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ModelLoadError(f"{MODEL_TYPES[model_type]} rope type {kind!r} is not supported (mrope)")
    section = rope.get("mrope_section") or [16, 24, 24]
    theta = float(rope.get("rope_theta", text.get("rope_theta", 1000000.0)))
    for k in ("model_type", "architectures", "rope_theta", "vision_config", "text_config"):
        text.pop(k, None)
    facts = {"vision": _vision(model_type, hf.get("vision_config") or {}),
             "mrope_section": [int(s) for s in section],
             "image_token_id": int(hf.get("image_token_id", 151655)),
             "vision_start_token_id": int(hf.get("vision_start_token_id", 151652))}
    full = AutoConfig.for_model("qwen2", **text, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return full.to_dict() | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": "qwen2",
                                                                            "_qwen_vl": facts}


def read_hf(hf: dict, fields: dict) -> dict:
    facts = hf.get("_qwen_vl")
    fields = llama.read_hf(hf, fields)
    if facts is None:
        raise ModelLoadError("a Qwen2-VL / Qwen2.5-VL config needs its vision_config")
    v = facts["vision"]
    p, m = int(v["patch_size"]), int(v["spatial_merge_size"])
    # Qwen2-VL's and 2.5's own processing (the hub's preprocessor_config.json): what dummy weights get
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56,
                 "max_pixels": 28 * 28 * 16384, "patch_size": p, "merge_size": m,
                 "temporal_patch_size": int(v["temporal_patch_size"])}
    fields["extra"] = dict(fields["extra"]) | facts | {
        "image_processor": processor, "image_token": IMAGE_TOKEN, "patch_size": p * m,
        "num_additional_image_tokens": 0}
    return fields


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    extra = cfg.extra_dict
    v = dict(extra["vision"])
    if sum(extra["mrope_section"]) * 2 != cfg.head_dim:
        raise ModelLoadError(f"mrope_section {list(extra['mrope_section'])} does not cover head_dim {cfg.head_dim}")
    acts = ("silu",) if v["mlp"] == "gated" else tuple(VISION_ACTIVATIONS)
    if v["hidden_act"] not in acts:
        raise ModelLoadError(f"vision hidden_act {v['hidden_act']!r} is not supported ({', '.join(acts)})")
    if v["temporal_patch_size"] != 2 or v["hidden_size"] % v["num_heads"]:
        raise ModelLoadError("vision_config: temporal_patch_size 2 and heads dividing hidden_size are supported")
    if v["window_size"] % (v["patch_size"] * v["spatial_merge_size"]):
        raise ModelLoadError("vision_config.window_size must be a multiple of patch_size * spatial_merge_size")


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    spec = llama.decoder_spec(cfg)
    section = tuple(int(s) for s in cfg.extra_dict["mrope_section"])
    return dataclasses.replace(spec, rotaries=tuple(dataclasses.replace(r, mrope_section=section)
                                                    for r in spec.rotaries))


# ---------------------------------------------------------------------------------------- vision tower
@functools.lru_cache(maxsize=16)
def vision_spec(cfg: ModelConfig) -> QwenVisionSpec:
    v = dict(cfg.extra_dict["vision"])
    p, m = v["patch_size"], v["spatial_merge_size"]
    return QwenVisionSpec(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], num_heads=v["num_heads"],
        depth=v["depth"], in_channels=v["in_channels"], patch_size=p, merge=m,
        temporal_patch_size=v["temporal_patch_size"], out_hidden_size=v["out_hidden_size"],
        rope_theta=v["rope_theta"], norm=v["norm"], mlp=v["mlp"], activation=v["hidden_act"],
        window=v["window_size"] // (p * m), full_blocks=tuple(v["fullatt_block_indexes"]))


class QwenVLModel(DecoderModel):
    """The text decoder's weights and modules, plus ``vision`` (the tower and its merger)."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec):
        super().__init__(cfg, spec)
        self.vision = QwenVisionTower(vision_spec(cfg))


def _text_shift(features: list) -> int:
    """What text after all of ``features`` adds to its sequence index: each image advances the positions by
    its grid's longer side in merged tokens instead of its token count."""
    shift = 0
    for f in features:
        _, h, w = (int(g) for g in np.asarray(f.extra["image_grid_thw"]).reshape(3))
        merge = round(math.sqrt(h * w / f.length))
        shift += max(h // merge, w // merge) - f.length
    return shift


def mrope_positions(pos: np.ndarray, features: list) -> np.ndarray:
    """The 3-D positions ``[3, n]`` int32 of one request's tokens at sequence indices ``pos [n]`` (HF's
    ``get_rope_index``): ``features`` are its images (offset, length, ``image_grid_thw``) in prompt order.
    Tokens past the last image (every decode step's) are their index plus one shift: that path stays in
    Python scalars, as it runs for each such request every step."""
    last = features[-1]
    if pos[0] >= last.offset + last.length:         # a request's tokens of a step are consecutive
        return np.broadcast_to((pos + _text_shift(features)).astype(np.int32), (3, len(pos)))
    offs = np.fromiter((f.offset for f in features), np.int64, len(features))
    lens = np.fromiter((f.length for f in features), np.int64, len(features))
    grids = np.stack([np.asarray(f.extra["image_grid_thw"]).reshape(3) for f in features]).astype(np.int64)
    merge = np.rint(np.sqrt(grids[:, 1] * grids[:, 2] / lens)).astype(np.int64)
    lh, lw = grids[:, 1] // merge, grids[:, 2] // merge
    shift = np.concatenate([[0], np.cumsum(np.maximum(lh, lw) - lens)])   # before image k; [K]: after all
    k = np.searchsorted(offs, pos, side="right") - 1
    out = np.broadcast_to(pos + shift[k + 1], (3, len(pos))).copy()
    inside = np.flatnonzero((k >= 0) & (pos < offs[k] + lens[k]))
    if inside.size:
        ki = k[inside]
        j = pos[inside] - offs[ki]
        start = offs[ki] + shift[ki]
        out[0, inside], out[1, inside], out[2, inside] = start, start + j // lw[ki], start + j % lw[ki]
    return out.astype(np.int32)


class QwenVLFamily(DecoderFamily):
    """A ``DecoderFamily`` (Qwen2's decoder with M-RoPE) whose model also has the vision tower:
    ``encode_images`` is the runner's encoder step, ``mrope_positions`` the step's 3-D positions."""

    mrope_positions = staticmethod(mrope_positions)

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one family object, as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: QwenVLModel(cfg, self.decoder_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        plan = super().weight_plan(cfg)
        v = vision_spec(cfg)
        d = v.hidden_size
        plan.append((("vision", "patch_embed"), ["visual.patch_embed.proj.weight"], "patch_t"))
        norms = ("norm1", "norm2") + (("norm1_bias", "norm2_bias") if v.norm == "layer" else ())
        mlp = ("gate", "up", "down") if v.mlp == "gated" else ("fc1", "fc2")
        for i in range(v.depth):
            pre = f"visual.blocks.{i}."
            names = {w: ("same", w.replace("_bias", "") + (".bias" if w.endswith("_bias") else ".weight"))
                     for w in norms}
            names |= {"wo": ("t", "attn.proj.weight"), "wo_bias": ("same", "attn.proj.bias")}
            for j, w in enumerate(("wq", "wk", "wv")):
                names[w] = (("rows_t", j * d, (j + 1) * d), "attn.qkv.weight")
                names[w + "_bias"] = (("rows_t", j * d, (j + 1) * d), "attn.qkv.bias")
            for w in mlp:
                hf = f"mlp.{w}_proj" if v.mlp == "gated" else f"mlp.{w}"
                names[w], names[w + "_bias"] = ("t", hf + ".weight"), ("same", hf + ".bias")
            plan += [(("vision", "layers", i, w), [pre + hf], build) for w, (build, hf) in names.items()]
        merger = [("norm", "ln_q.weight", "same"), ("fc1", "mlp.0.weight", "t"), ("fc1_bias", "mlp.0.bias", "same"),
                  ("fc2", "mlp.2.weight", "t"), ("fc2_bias", "mlp.2.bias", "same")]
        if v.norm == "layer":
            merger.append(("norm_bias", "ln_q.bias", "same"))
        for ours, theirs, build in merger:
            plan.append((("vision", "merger", ours), ["visual.merger." + theirs], build))
        return plan

    def packed_patches(self, cfg: ModelConfig, pixel_shape: tuple) -> int:
        """The patches an image of pixel payload ``[lh, lw, ...]`` takes in ``pack_images``' rows."""
        return vision_spec(cfg).patches(pixel_shape)

    def warmup_payload(self, cfg: ModelConfig, tokens: int, dtype) -> tuple[np.ndarray, np.ndarray]:
        """The pixel payload (zero bytes) of the smallest square image of at least ``tokens`` merged tokens, and
        its value table in ``dtype`` (an RGB image's, as the front end sends it): its patch bucket is the one the
        encoder cache compiles at start-up, which smaller images can run in."""
        spec = vision_spec(cfg)
        side = math.isqrt(max(tokens, 1) - 1) + 1
        return np.zeros((side, side, spec.merge ** 2 * spec.in_channels * spec.patch_size ** 2), np.uint8), \
            np.zeros((spec.in_channels, 256), dtype)

    def patch_unit(self, cfg: ModelConfig) -> int:
        """What every bucket of ``pack_images`` must be a multiple of."""
        return vision_spec(cfg).unit

    def pack_images(self, cfg: ModelConfig, rows: list, num_rows: int, bucket: int, tables: list | None = None,
                    single: bool = False) -> tuple:
        """Host: pixel payloads ``[lh, lw, ...]`` (the images of each row; uint8 ones with their value
        ``tables``) as ``encode_packed``'s input of ``num_rows`` rows of ``bucket`` patches, each image's token
        indices in its output, their number (``qwen_vision.pack``; ``single``: rows of at most one image)."""
        return pack(vision_spec(cfg), rows, num_rows, bucket, tables, single)

    def encode_packed(self, params: dict, inputs: tuple, cfg: ModelConfig) -> jax.Array:
        """``pack_images``' arrays → merged tokens ``[rows, bucket / merge**2, hidden_size]`` (packed order)."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).vision(*inputs)

    def encode_images(self, params: dict, pixel_values: np.ndarray, cfg: ModelConfig) -> jax.Array:
        """Host pixel payloads ``[B, lh, lw, ...]`` (one grid, each image a row of its own, unpadded) → image
        embeddings ``[B, tokens per image, hidden_size]``."""
        b = len(pixel_values)
        inputs, tokens, _ = self.pack_images(cfg, [[px] for px in pixel_values], b,
                                          self.packed_patches(cfg, pixel_values.shape[1:]), single=True)
        out = self.encode_packed(params, inputs, cfg)
        return out.reshape(-1, out.shape[-1])[np.stack(tokens)]


FAMILY = QwenVLFamily(decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                      model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=unwrap_hf)
