"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a ViT with window attention, a 2x2 patch merger, and a
Qwen2 text model (``llama``'s decoder) with M-RoPE.

Vision tower (``encode_images``): the image processor's patches (``multimodal.processing`` hands them over as
the resized image ``[C, H, W]``, H and W multiples of ``patch * merge``) through the 3-D patch embedding (a
single image is its own second frame), then the blocks in window order: the merger's 2x2 blocks grouped into
windows of ``window_size`` pixels, full attention over the image at ``fullatt_block_indexes``, attention
within each window elsewhere (its rows gathered into a padded block: ``N * window`` work, not ``N * N``),
the 2-D rotary of each patch's row and column; the merger maps each 2x2 block to one text token, and the
tokens go back to row-major order. An image of ``H x W`` pixels is ``(H / 28) * (W / 28)`` tokens
(``num_tokens``); each image size is its own pixel shape, hence its own encoder program.

M-RoPE: the text model's rotary frequencies are split in ``mrope_section`` parts turned by the temporal,
height and width rows of 3-D positions (``mrope_positions``: text tokens on the diagonal, an image's tokens at
its start plus their row and column, the text after it shifted to continue after the image's largest side),
computed on the host from each image's offset, length and grid; the step's positions are ``[3, T]`` for this
family. Text-only requests have three equal rows: plain RoPE.

Config: ``config.json`` holds the text model's fields (top level, transformers 4) or a ``text_config``
(transformers 5), a ``vision_config``, the special token ids and ``rope_scaling`` / ``rope_parameters`` with
``mrope_section``; ``ModelConfig.extra`` keeps the vision facts and the image processor's defaults (dummy
weights). Checkpoint names: the text model's as Qwen2's, ``visual.`` (or ``model.visual.``) for the tower.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.layers.decoder import REPLICATED, DecoderFamily, DecoderModel, DecoderSpec, _param, \
    _to_internal, _w
from jaxserve.models.layers.vision import GatedVisionLayer, PatchMerger, axial_rotary

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
WRAPPER_FIELDS = ("architectures", "torch_dtype", "dtype", "tie_word_embeddings")
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31]}
IMAGE_TOKEN = "<|image_pad|>"


def unwrap_hf(hf: dict) -> dict:
    """The text config as Qwen2's (transformers' defaults filled in, plain RoPE), with the vision facts under
    ``"_qwen_vl"`` for ``read_hf``."""
    if hf.get("model_type") not in MODEL_TYPES:
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    text = dict(hf.get("text_config") or {k: v for k, v in hf.items() if k != "vision_config"})
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ModelLoadError(f"Qwen2.5-VL rope type {kind!r} is not supported (mrope)")
    section = rope.get("mrope_section") or [16, 24, 24]
    theta = float(rope.get("rope_theta", text.get("rope_theta", 1000000.0)))
    for k in ("model_type", "architectures", "rope_theta", "vision_config", "text_config"):
        text.pop(k, None)
    vision_in = dict(hf.get("vision_config") or {})
    vision_in.setdefault("in_channels", vision_in.get("in_chans", 3))      # the hub's original spelling
    vision = {k: vision_in.get(k, v) for k, v in VISION_DEFAULTS.items()}
    vision["rope_theta"] = float((vision_in.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    facts = {"vision": vision, "mrope_section": [int(s) for s in section],
             "image_token_id": int(hf.get("image_token_id", 151655)),
             "vision_start_token_id": int(hf.get("vision_start_token_id", 151652))}
    full = AutoConfig.for_model("qwen2", **text, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return full.to_dict() | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": "qwen2",
                                                                            "_qwen_vl": facts}


def read_hf(hf: dict, fields: dict) -> dict:
    facts = hf.get("_qwen_vl")
    fields = llama.read_hf(hf, fields)
    if facts is None:
        raise ModelLoadError("a Qwen2_5_VLForConditionalGeneration config needs its vision_config")
    v = facts["vision"]
    p, m = int(v["patch_size"]), int(v["spatial_merge_size"])
    # Qwen2.5-VL's own processing (the hub's preprocessor_config.json): what dummy weights get
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
    if v["hidden_act"] != "silu":
        raise ModelLoadError(f"vision hidden_act {v['hidden_act']!r} is not supported (silu)")
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
@functools.lru_cache(maxsize=64)
def window_layout(grid_h: int, grid_w: int, merge: int, window: int) -> tuple[np.ndarray, tuple]:
    """Of a ``grid_h x grid_w`` patch grid, windows of ``window`` merge blocks a side: (the merge blocks in
    window order: windows row-major, blocks row-major within one; the patch windows in that order as
    ``layers.vision._attend_windows`` reads them)."""
    lh, lw = grid_h // merge, grid_w // merge
    r, c = np.divmod(np.arange(lh * lw), lw)
    wid = (r // window) * -(-lw // window) + c // window
    order = np.argsort(wid, kind="stable")
    _, sizes = np.unique(wid, return_counts=True)        # windows with patches, in order
    sizes = sizes * merge * merge
    n, span = int(sizes.sum()), window * window * merge * merge
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    slot = np.arange(span)
    valid = slot[None, :] < sizes[:, None]
    gather = np.where(valid, starts[:, None] + slot[None, :], n)
    back = np.flatnonzero(valid.reshape(-1))              # row i of the window order sits at back[i]
    return order, (gather.astype(np.int32), valid, back.astype(np.int32))


class QwenVisionTower(nnx.Module):
    def __init__(self, facts: tuple):
        v = dict(facts)
        d, p = v["hidden_size"], v["patch_size"]
        self.facts = facts              # hashable: static in the graph
        self.patch_embed = _param((v["in_channels"] * v["temporal_patch_size"] * p * p, d), REPLICATED)
        self.layers = nnx.List([GatedVisionLayer(d, v["intermediate_size"], v["num_heads"])
                                for _ in range(v["depth"])])
        self.merger = PatchMerger(d, v["out_hidden_size"], v["spatial_merge_size"])

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """``pixel_values [B, C, H, W]`` (one image size) → tokens ``[B, (H / p / m) * (W / p / m), text]``."""
        v = dict(self.facts)
        p, m, tp = v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]
        w = _w(self.patch_embed)
        b, c, hgt, wid = pixel_values.shape
        gh, gw = hgt // p, wid // p
        # patches in merge-block order, each flattened (C, frame, row, col) as the 3-D conv reads it
        x = pixel_values.astype(w.dtype).reshape(b, c, gh // m, m, p, gw // m, m, p).transpose(0, 2, 5, 3, 6, 1, 4, 7)
        x = jnp.broadcast_to(x[:, :, :, :, :, :, None], (*x.shape[:6], tp, p, p))
        x = x.reshape(b, gh * gw, c * tp * p * p) @ w
        order, windows = window_layout(gh, gw, m, v["window_size"] // (p * m))
        patch_order = (order[:, None] * m * m + np.arange(m * m)).reshape(-1)
        x = x[:, patch_order]
        cos, sin = (t[patch_order] for t in axial_rotary(gh, gw, v["hidden_size"] // v["num_heads"],
                                                         v["rope_theta"], m))
        full = set(v["fullatt_block_indexes"])
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if i in full else windows)
        return self.merger(x)[:, np.argsort(order)]


class QwenVLModel(DecoderModel):
    """The text decoder's weights and modules, plus ``vision`` (the tower and its merger)."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec):
        super().__init__(cfg, spec)
        self.vision = QwenVisionTower(_vision_facts(cfg))


@functools.lru_cache(maxsize=16)
def _vision_facts(cfg: ModelConfig) -> tuple:
    v = dict(cfg.extra_dict["vision"])
    v["fullatt_block_indexes"] = tuple(v["fullatt_block_indexes"])
    return tuple(sorted(v.items()))


def vision_facts(cfg: ModelConfig) -> dict:
    return dict(_vision_facts(cfg))


def mrope_positions(pos: np.ndarray, features: list) -> np.ndarray:
    """The 3-D positions ``[3, n]`` int32 of one request's tokens at sequence indices ``pos [n]`` (HF's
    ``get_rope_index``): ``features`` are its images (offset, length, ``image_grid_thw``) in prompt order."""
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
        v = vision_facts(cfg)
        d = v["hidden_size"]
        plan.append((("vision", "patch_embed"), ["visual.patch_embed.proj.weight"], "patch_t"))
        for i in range(v["depth"]):
            pre = f"visual.blocks.{i}."
            names = {"norm1": ("same", "norm1.weight"), "norm2": ("same", "norm2.weight"),
                     "wo": ("t", "attn.proj.weight"), "wo_bias": ("same", "attn.proj.bias")}
            for j, w in enumerate(("wq", "wk", "wv")):
                names[w] = (("rows_t", j * d, (j + 1) * d), "attn.qkv.weight")
                names[w + "_bias"] = (("rows_t", j * d, (j + 1) * d), "attn.qkv.bias")
            for w in ("gate", "up", "down"):
                names[w], names[w + "_bias"] = ("t", f"mlp.{w}_proj.weight"), ("same", f"mlp.{w}_proj.bias")
            plan += [(("vision", "layers", i, w), [pre + hf], build) for w, (build, hf) in names.items()]
        for ours, theirs, build in (("norm", "ln_q.weight", "same"), ("fc1", "mlp.0.weight", "t"),
                                    ("fc1_bias", "mlp.0.bias", "same"), ("fc2", "mlp.2.weight", "t"),
                                    ("fc2_bias", "mlp.2.bias", "same")):
            plan.append((("vision", "merger", ours), ["visual.merger." + theirs], build))
        return plan

    def encode_images(self, params: dict, pixel_values: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``pixel_values [B, C, H, W]`` → image embeddings ``[B, tokens per image, hidden_size]``."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).vision(pixel_values)


FAMILY = QwenVLFamily(decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                      model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=unwrap_hf)
