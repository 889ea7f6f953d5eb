"""Gemma 3 as a vision model (``Gemma3ForConditionalGeneration``, 4B and up): a SigLIP ViT, Gemma 3's
pooled projector, and the Gemma 3 text model (``gemma``'s decoder) whose image-token rows take the projected
image features.

Vision tower (``encode_images``): SigLIP (``layers.vision.VisionTransformer``: a biased patch convolution,
learned position embeddings, pre-LN blocks with biased attention and a tanh-GELU MLP, ``post_layernorm``)
at the fixed ``image_size``; the projector as HF's ``Gemma3MultiModalProjector``: the patch grid average-
pooled to ``mm_tokens_per_image`` tokens (row-major), Gemma's ``(1 + w)`` RMSNorm (``mm_soft_emb_norm``),
then ``mm_input_projection_weight`` (``[vision hidden, text hidden]``, no transpose). The embeddings replace
the image tokens' rows after the text embedding's ``sqrt(hidden)`` scaling, as HF inserts them.

Text attention: each image's tokens attend to one another both ways (HF's ``token_type_ids`` mask: global
layers causal OR same image, sliding layers that AND the window). The runner gives such a step a
per-token attend limit (``AttentionMetadata.attend_limit``: the image span's last position inside a span,
-1 elsewhere; ``bidirectional_images``), and the scheduler never ends a chunk inside an image
(``--disable-chunked-mm-input``, forced on for this family).

Prompts: the chat template prints ``<start_of_image>`` (``boi``) per image; the processor replaces it with
``"\\n\\n<start_of_image>" + mm_tokens_per_image x <image_soft_token> + "<end_of_image>\\n\\n"``
(``multimodal.processing``, ``image_wrap``). Pan-and-scan (``--mm-processor-kwargs '{"do_pan_and_scan":
true}'``: a wide or tall image also cut into crops, each its own 256 tokens) as the processor does it:
"Here is the original image ... and here are some crops to help you see better ..." (``image_crops_text``).

Config: ``config.json`` wraps a ``text_config`` (read as ``gemma3_text``) and a ``vision_config``
(``siglip_vision_model``) with ``mm_tokens_per_image`` and the boi / eoi / image token ids; checkpoint
names: the text model's under ``language_model.model.`` / ``model.language_model.``, ``vision_tower.``
(``vision_tower.vision_model.`` on the hub) and ``multi_modal_projector.``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import gemma
from jaxserve.models.layers.decoder import REPLICATED, DecoderFamily, DecoderModel, DecoderSpec, _param, \
    _to_internal, _w
from jaxserve.models.layers.norms import offset_rms_norm
from jaxserve.models.layers.vision import VISION_ACTIVATIONS, VISION_KEYS, VisionSpec, VisionTransformer, \
    tower_weight_plan

ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
MODEL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration"}
BOI, EOI = "<start_of_image>", "<end_of_image>"
# Gemma3Processor's text around an image and its pan-and-scan crops, and its pan-and-scan call defaults
CROPS_TEXT = ["Here is the original image ", " and here are some crops to help you see better ", " "]
PAN_AND_SCAN_DEFAULTS = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                         "pan_and_scan_min_ratio_to_activate": 1.2}


def unwrap_hf(hf: dict) -> dict:
    """The text config (``gemma.unwrap_hf``) with the vision facts under ``"_gemma3_vision"``."""
    if hf.get("model_type") != "gemma3":
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    vision = dict(hf.get("vision_config") or {})
    vision.pop("model_type", None)
    vision = AutoConfig.for_model("siglip_vision_model", **vision).to_dict()
    facts = {"vision": {k: vision[k] for k in VISION_KEYS},
             "mm_tokens_per_image": int(hf.get("mm_tokens_per_image", 256)),
             "image_fill_token_id": int(hf.get("image_token_index", hf.get("image_token_id", 262144))),
             "image_token_id": int(hf.get("boi_token_index", hf.get("boi_token_id", 255999)))}
    return gemma.unwrap_hf(hf) | {"_gemma3_vision": facts}


def read_hf(hf: dict, fields: dict) -> dict:
    facts = hf.get("_gemma3_vision")
    fields = gemma.read_hf(hf, fields)
    if facts is None:
        raise ModelLoadError("a Gemma3ForConditionalGeneration config needs text_config and vision_config")
    size = int(facts["vision"]["image_size"])
    side = max(1, round(facts["mm_tokens_per_image"] ** 0.5))
    # Gemma 3's processing (the hub's preprocessor_config.json): what dummy weights get
    processor = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": size, "width": size},
                 "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "rescale_factor": 1 / 255}
    # ``patch_size``: pixels per image token side, so ImageProcessing counts mm_tokens_per_image tokens
    fields["extra"] = dict(fields["extra"]) | facts | {
        "image_processor": processor, "image_token": BOI, "patch_size": size // side,
        "num_additional_image_tokens": 0, "image_wrap": ["\n\n" + BOI, EOI + "\n\n"],
        "image_crops_text": CROPS_TEXT, "image_processor_call_defaults": PAN_AND_SCAN_DEFAULTS}
    return fields


def check_config(cfg: ModelConfig) -> None:
    gemma.check_config(cfg)
    extra = cfg.extra_dict
    v = dict(extra["vision"])
    patches, side = v["image_size"] // v["patch_size"], round(extra["mm_tokens_per_image"] ** 0.5)
    if side * side != extra["mm_tokens_per_image"] or patches % side:
        raise ModelLoadError(f"mm_tokens_per_image {extra['mm_tokens_per_image']} must be a square whose side "
                             f"divides the {patches} x {patches} patch grid")
    if v["hidden_act"] not in VISION_ACTIVATIONS:
        raise ModelLoadError(f"vision hidden_act {v['hidden_act']!r} is not supported")


@functools.lru_cache(maxsize=16)
def vision_spec(cfg: ModelConfig) -> VisionSpec:
    return VisionSpec.from_hf(dict(cfg.extra_dict["vision"]), class_token=False, patch_bias=True, pre_norm=False,
                              post_norm=True)


class Gemma3Projector(nnx.Module):
    """HF's ``Gemma3MultiModalProjector``: average pool of the patch grid, Gemma RMSNorm, projection."""

    def __init__(self, vspec: VisionSpec, text_size: int, tokens_per_image: int, eps: float):
        self.patches = vspec.image_size // vspec.patch_size
        self.kernel = self.patches // round(tokens_per_image ** 0.5)
        self.eps = eps
        self.norm = _param((vspec.hidden_size,), REPLICATED, "zeros")
        self.proj = _param((vspec.hidden_size, text_size), REPLICATED)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, _, d = x.shape
        n, k = self.patches // self.kernel, self.kernel
        pooled = x.astype(jnp.float32).reshape(b, n, k, n, k, d).mean(axis=(2, 4)).reshape(b, n * n, d)
        h = offset_rms_norm(pooled.astype(x.dtype), _w(self.norm), self.eps)
        return (h @ _w(self.proj)).astype(x.dtype)


class Gemma3VisionModel(DecoderModel):
    """The text decoder's weights and modules, plus ``vision`` (SigLIP) and ``projector``."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, vspec: VisionSpec):
        super().__init__(cfg, spec)
        self.vision = VisionTransformer(vspec)
        self.projector = Gemma3Projector(vspec, cfg.hidden_size, cfg.extra_dict["mm_tokens_per_image"], vspec.eps)

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        return self.projector(self.vision(pixel_values))


class Gemma3VisionFamily(DecoderFamily):
    """Gemma 3's decoder with a vision tower: ``encode_images`` is the runner's encoder step; its image tokens
    attend bidirectionally (``bidirectional_images``)."""

    bidirectional_images = True

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one family object, as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: Gemma3VisionModel(cfg, self.decoder_spec(cfg), vision_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        mmp = "multi_modal_projector."
        return super().weight_plan(cfg) + tower_weight_plan(vision_spec(cfg), "vision_tower.") + [
            (("projector", "norm"), [mmp + "mm_soft_emb_norm.weight"], "same"),
            (("projector", "proj"), [mmp + "mm_input_projection_weight"], "same")]

    def encode_images(self, params: dict, pixel_values: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``pixel_values [B, C, H, W]`` → image embeddings ``[B, mm_tokens_per_image, hidden_size]``."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).encode_images(pixel_values)


FAMILY = Gemma3VisionFamily(gemma.decoder_spec, check_config, gemma.LAYER_NAMES, architectures=ARCHITECTURES,
                            model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=unwrap_hf)
