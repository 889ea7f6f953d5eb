"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP ViT, a two-layer MLP projector, and a Llama/Mistral
text model (``llama``'s decoder) whose image-token rows take the projected image features.

An image's features are the ViT's hidden states after ``vision_feature_layer`` (-2: every block but the
last), without the class token under ``vision_feature_select_strategy = "default"``, through the projector:
``[num_patches, text hidden]`` per image, one row per image token of the expanded prompt. The runner's
encoder step calls ``encode_images``; the decoder step writes the rows into the token embeddings
(``DecoderModel(mm_embeds, mm_rows)``). Positions are 1-D and the text attention causal, as for text.

Config: ``config.json`` wraps a ``text_config`` (the text model, read as Llama) and a ``vision_config``
(CLIP), with ``image_token_index``, ``projector_hidden_act``, ``vision_feature_layer`` and
``vision_feature_select_strategy``; ``ModelConfig.extra`` keeps them (``vision``: the CLIP config) and the
image processor's defaults for a model without a ``preprocessor_config.json`` (dummy weights). Checkpoint
names: the text model's under ``language_model.`` / ``model.language_model.``, ``vision_tower.`` and
``multi_modal_projector.`` (or under ``model.``; ``checkpoint_names.wrapped_names``).
"""
from __future__ import annotations

import functools

import jax
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.layers.decoder import DecoderFamily, DecoderModel, DecoderSpec, _to_internal
from jaxserve.models.layers.vision import VISION_ACTIVATIONS, VISION_KEYS, Projector, VisionSpec, \
    VisionTransformer, tower_weight_plan

ARCHITECTURES = ("LlavaForConditionalGeneration",)
MODEL_TYPES = {"llava": "LlavaForConditionalGeneration"}
WRAPPER_FIELDS = ("architectures", "torch_dtype", "dtype")
OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def unwrap_hf(hf: dict) -> dict:
    """The text config (transformers' defaults filled in) under the wrapper's architecture, with the vision
    facts under ``"_llava"`` for ``read_hf``."""
    if hf.get("model_type") not in ("llava", "llava_next"):
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    text = dict(hf.get("text_config") or {})
    text_type = text.pop("model_type", "llama")
    vision = dict(hf.get("vision_config") or {})
    vision.pop("model_type", None)
    vision = AutoConfig.for_model("clip_vision_model", **vision).to_dict()
    facts = {"vision": {k: vision[k] for k in VISION_KEYS},
             "image_token_id": int(hf.get("image_token_index", hf.get("image_token_id", 32000))),
             "projector_hidden_act": hf.get("projector_hidden_act", "gelu"),
             "vision_feature_layer": hf.get("vision_feature_layer", -2),
             "vision_feature_select_strategy": hf.get("vision_feature_select_strategy", "default"),
             "projector_bias": bool(hf.get("multimodal_projector_bias", True))}
    if hf.get("model_type") == "llava_next":      # its anyres tiles (llava_next.py)
        facts["image_grid_pinpoints"] = [[int(h), int(w)] for h, w in hf.get("image_grid_pinpoints") or
                                         [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]]
    full = AutoConfig.for_model(text_type, **text).to_dict()
    return full | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": text_type, "_llava": facts}


def read_hf(hf: dict, fields: dict) -> dict:
    facts = hf.get("_llava")
    fields = llama.read_hf(hf, fields)
    if facts is None:
        raise ModelLoadError("a LLaVA config needs text_config and vision_config")
    v = facts["vision"]
    size = int(v["image_size"])
    # CLIP's processing at the tower's resolution: what a checkpoint without preprocessor_config.json gets
    processor = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": size},
                 "crop_size": {"height": size, "width": size}, "do_center_crop": True, "resample": 3,
                 "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD}
    fields["extra"] = dict(fields["extra"]) | facts | {
        "image_processor": processor, "patch_size": int(v["patch_size"]), "num_additional_image_tokens": 1}
    return fields


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    extra = cfg.extra_dict
    layer = extra["vision_feature_layer"]
    v = dict(extra["vision"])
    if not isinstance(layer, int) or not -v["num_hidden_layers"] - 1 <= layer <= v["num_hidden_layers"]:
        raise ModelLoadError(f"vision_feature_layer {layer!r} is not supported (one layer index)")
    if extra["vision_feature_select_strategy"] not in ("default", "full"):
        raise ModelLoadError(f"vision_feature_select_strategy {extra['vision_feature_select_strategy']!r} is not "
                             "supported (default, full)")
    for act in (v["hidden_act"], extra["projector_hidden_act"]):
        if act not in VISION_ACTIVATIONS:
            raise ModelLoadError(f"activation {act!r} is not supported ({', '.join(VISION_ACTIVATIONS)})")
    if not extra["projector_bias"]:
        raise ModelLoadError("multimodal_projector_bias=false is not supported")


@functools.lru_cache(maxsize=16)
def vision_spec(cfg: ModelConfig) -> VisionSpec:
    v, layer = dict(cfg.extra_dict["vision"]), cfg.extra_dict["vision_feature_layer"]
    n = int(v["num_hidden_layers"])
    return VisionSpec.from_hf(v, num_layers_run=n + layer + 1 if layer < 0 else layer)


class LlavaModel(DecoderModel):
    """The text decoder's weights and modules, plus ``vision`` (the ViT) and ``projector``."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, vspec: VisionSpec):
        super().__init__(cfg, spec)
        self.vision = VisionTransformer(vspec)
        self.projector = Projector(vspec.hidden_size, cfg.hidden_size, cfg.extra_dict["projector_hidden_act"])
        self.drop_class_token = cfg.extra_dict["vision_feature_select_strategy"] == "default"

    def encode_images(self, pixel_values: jax.Array) -> jax.Array:
        features = self.vision(pixel_values)
        if self.drop_class_token:
            features = features[:, 1:]
        return self.projector(features)


class LlavaFamily(DecoderFamily):
    """A ``DecoderFamily`` (Llama's decoder) whose model also has a vision tower: ``encode_images`` is the
    runner's encoder step."""

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one family object, as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: LlavaModel(cfg, self.decoder_spec(cfg), vision_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        plan = super().weight_plan(cfg) + tower_weight_plan(vision_spec(cfg), "vision_tower.")
        for j in (1, 2):
            plan += [(("projector", f"linear_{j}"), [f"multi_modal_projector.linear_{j}.weight"], "t"),
                     (("projector", f"linear_{j}_bias"), [f"multi_modal_projector.linear_{j}.bias"], "same")]
        return plan

    def encode_images(self, params: dict, pixel_values: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``pixel_values [B, C, H, W]`` → image embeddings ``[B, tokens per image, hidden_size]``."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).encode_images(pixel_values)


FAMILY = LlavaFamily(llama.decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                     model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=unwrap_hf)
