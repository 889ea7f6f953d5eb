"""Images → the model's inputs, with transformers' own image processors (their PIL backends: no torch).

``ImageProcessing.from_folder`` reads the checkpoint's ``preprocessor_config.json`` (or the
``image_processor`` of ``processor_config.json``, transformers 5's layout; a dummy model: the defaults its
family puts in ``ModelConfig.extra["image_processor"]``) and the placeholder facts of
``processor_config.json`` (image token, patch size, extra tokens). ``process`` expands each image token of a
prompt into the image's N tokens, as HF's processor does (it replaces the placeholder text by N copies
before tokenizing; the placeholder is one special token, so expanding ids gives the same ids), and returns
one ``ImageFeature`` per image. A family whose image run has text around it (Gemma 3: ``"\n\n<start_of_image>"``
before ``mm_tokens_per_image`` soft tokens, ``"<end_of_image>\n\n"`` after) names that text in
``ModelConfig.extra["image_wrap"]`` and the run's token in ``"image_fill_token_id"``; a newline the wrap adds
next to a prompt's newline token merges into one token where the vocabulary has the longer run (as the
tokenizer would have made it from HF's expanded text; vLLM's rule). An image the processor also cuts into
crops (Gemma 3's pan-and-scan) becomes one feature per picture, in the text ``"image_crops_text"`` puts
around them; ``"image_processor_call_defaults"``: what the HF processor passes where the image processor's
config leaves a setting unset. Blocking, CPU-bound: the server runs it on worker threads.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxserve.errors import InvalidRequestError, ModelLoadError
from jaxserve.multimodal import anyres
from jaxserve.multimodal.inputs import ImageFeature, image_hash, pixel_dtype
from jaxserve.multimodal.qwen_vl_pixels import QwenVLPixels


def _read(folder: str | None, name: str) -> dict:
    path = os.path.join(folder, name) if folder else None
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _thaw(value: Any) -> Any:
    """A dict that ``ModelConfig.extra`` froze into ``((key, value), ...)`` pairs, as a dict again."""
    if isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                  for p in value):
        return {k: _thaw(v) for k, v in value}
    return value


def _pil_image_processor(config: dict, kwargs: dict) -> Any:
    import transformers  # noqa: PLC0415  (only multimodal models pay for the import)

    config = dict(config)
    kind = config.pop("image_processor_type", None) or "CLIPImageProcessor"
    config.pop("processor_class", None)
    kind = kind.removesuffix("Fast")
    cls = getattr(transformers, kind + "Pil", None) or getattr(transformers, kind, None)
    if cls is None:
        raise ModelLoadError(f"image processor {kind!r} is not available in transformers "
                             f"{transformers.__version__} without torch")
    return cls(**(config | kwargs))


def patch_blocks(patches: np.ndarray, grid_thw: np.ndarray, processor, dtype=np.float32) -> np.ndarray:
    """A Qwen2-VL processor's flattened patches of one still image (``[h * w, C * frames * p * p]``, each
    ``merge x merge`` block's patches consecutive, the frames copies of the image) as the tower's pixel
    payload ``[h / merge, w / merge, merge**2 * C * p * p]`` in ``dtype`` (the tower's: it would cast them
    on the device): one frame, the processor's order kept, so the engine core packs the image with one
    gather of whole blocks and the shape says the grid."""
    _, h, w = (int(g) for g in np.asarray(grid_thw).reshape(3))
    p, m, tp = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    c = patches.shape[-1] // (tp * p * p)
    frame = np.asarray(patches).reshape(h // m, w // m, m * m, c, tp, p * p)[:, :, :, :, 0]
    return frame.astype(dtype).reshape(h // m, w // m, -1)


class ImageProcessing:
    """One model's image preprocessing and placeholder expansion (LLaVA's rule: ``(H / patch) * (W / patch)
    + extra_tokens`` image tokens for pixel values of ``H x W``; a family with another rule passes
    ``num_tokens``; Qwen2-VL's processors: one token per merge block of the image's grid; LLaVA-NeXT's: the
    base tile's and the cropped tile grid's, ``multimodal.anyres``). ``pixel_dtype``:
    what Qwen2-VL's pixel payloads are stored in (the model's dtype where it is a 16-bit float); an RGB image
    through ``QwenVLPixels`` goes as its bytes with ``extra["pixel_table"]`` (``[C, 256]`` in that dtype)."""

    def __init__(self, image_processor: Any, image_token: str, image_token_id: int, patch_size: int,
                 extra_tokens: int = 0, processor_kwargs: dict | None = None, num_tokens=None,
                 wrap: tuple[list[int], list[int]] = ([], []), fill_token_id: int | None = None,
                 merges: dict | None = None, crops=None, pixel_dtype=np.float32):
        self.image_processor, self.pixel_dtype = image_processor, pixel_dtype
        self._qwen_vl = QwenVLPixels.of(image_processor)     # Qwen2-VL's processor, its output made directly
        self.image_token, self.image_token_id = image_token, image_token_id
        # the placeholder's replacement: ``wrap[0]``, the image's tokens (``fill_token_id``), ``wrap[1]``; an
        # image the processor cut into crops (pan-and-scan): ``crops(k)``, the ids of the text around the
        # original and its k crops, an image's tokens going after each placeholder id in it
        self.wrap, self.merges, self.crops = wrap, dict(merges or {}), crops
        self.fill_token_id = image_token_id if fill_token_id is None else fill_token_id
        self.patch_size, self.extra_tokens = patch_size, extra_tokens
        self.processor_kwargs = dict(processor_kwargs or {})
        self._kwargs_key = json.dumps(self.processor_kwargs, sort_keys=True, default=str)
        self._num_tokens = num_tokens

    @classmethod
    def from_folder(cls, folder: str | None, model_extra: dict, processor_kwargs: dict | None = None,
                    tokenizer: Any = None, dtype: str | None = None):
        proc = _read(folder, "processor_config.json")
        image_config = _read(folder, "preprocessor_config.json") or proc.get("image_processor") \
            or _thaw(model_extra.get("image_processor") or ())
        if not image_config:
            raise ModelLoadError(f"{folder}: no preprocessor_config.json (the image processor's settings)")
        patch = int(proc.get("patch_size") or model_extra.get("patch_size") or 14)
        strategy = proc.get("vision_feature_select_strategy") or model_extra.get("vision_feature_select_strategy")
        additional = int(proc.get("num_additional_image_tokens", model_extra.get("num_additional_image_tokens", 1)))
        extra_tokens = additional - (1 if strategy == "default" else 0)
        kwargs = dict(processor_kwargs or {})
        if "image_grid_pinpoints" in image_config:      # LLaVA-NeXT's, frozen into tuples in ModelConfig.extra
            image_config = dict(image_config) | {
                "image_grid_pinpoints": [[int(h), int(w)] for h, w in image_config["image_grid_pinpoints"]]}
        # the processor's call defaults (Gemma 3's pan-and-scan sizes) where its config leaves them unset
        image_config = (_thaw(model_extra.get("image_processor_call_defaults")) or {}) | \
            {k: v for k, v in image_config.items() if v is not None}
        try:
            processor = _pil_image_processor(image_config, kwargs)
        except TypeError as e:
            raise ModelLoadError(f"--mm-processor-kwargs: {e}") from None
        image_token, image_token_id = proc.get("image_token") or model_extra.get("image_token", "<image>"), \
            int(model_extra["image_token_id"])
        wrap = _thaw(model_extra.get("image_wrap")) or ()
        wrap_ids = tuple(encode_around(tokenizer, t, image_token, image_token_id) for t in wrap) if wrap else ([], [])
        crops = None
        if model_extra.get("image_crops_text"):
            intro, middle, sep = _thaw(model_extra["image_crops_text"])
            full = "".join(wrap)

            def crops(k: int) -> list[int]:
                return encode_around(tokenizer, intro + full + middle + sep.join([full] * k), image_token,
                                     image_token_id)
        fixed = model_extra.get("image_tokens_per_image")    # Mllama: the placeholder stays one token
        return cls(processor, image_token, image_token_id, patch, extra_tokens, kwargs, wrap=wrap_ids,
                   num_tokens=(lambda pv, ex: fixed) if fixed else None,
                   fill_token_id=model_extra.get("image_fill_token_id"),
                   merges=newline_merges(tokenizer) if wrap else None, crops=crops,
                   pixel_dtype=pixel_dtype(dtype))

    def num_tokens(self, pixel_values: np.ndarray, extra: dict) -> int:
        if self._num_tokens is not None:
            return self._num_tokens(pixel_values, extra)
        if "image_grid_thw" in extra:
            return int(np.prod(extra["image_grid_thw"])) // self.image_processor.merge_size ** 2
        if "image_sizes" in extra:      # LLaVA-NeXT's anyres tiles: the image's size picks its grid
            size = tuple(int(s) for s in np.asarray(extra["image_sizes"]).reshape(2))
            return anyres.num_image_tokens(size, self.image_processor.image_grid_pinpoints,
                                           pixel_values.shape[-1], self.patch_size) + self.extra_tokens
        h, w = pixel_values.shape[-2:]
        return (h // self.patch_size) * (w // self.patch_size) + self.extra_tokens

    def process_image(self, image) -> list[tuple[np.ndarray, dict, str]]:
        """[(pixel values, the family's extra arrays, content hash)] of one image: the image, then its crops
        where the processor cuts some (pan-and-scan)."""
        pixels = np.asarray(image)
        digest = image_hash(pixels, image.mode, self._kwargs_key)
        if self._qwen_vl is not None and getattr(image, "mode", None) == "RGB":
            # the image's bytes and each channel's byte -> value table: the tower looks them up on the device
            payload, extra = self._qwen_vl.byte_blocks(image)
            extra["pixel_table"] = self._qwen_vl.value_table(self.pixel_dtype)
            return [(payload, extra, digest)]
        out = self.image_processor(images=[image], return_tensors="np")
        extra = {k: np.asarray(v[0]) for k, v in out.items() if k != "pixel_values"}
        if "image_grid_thw" in out:     # Qwen2-VL's processors: the image's patches, flattened
            return [(patch_blocks(out["pixel_values"], extra["image_grid_thw"], self.image_processor,
                                  self.pixel_dtype), extra, digest)]
        return [(np.asarray(pv, np.float32), extra, digest if i == 0 else f"{digest}-crop{i}")
                for i, pv in enumerate(out["pixel_values"])]

    def count_placeholders(self, prompt_token_ids: list[int]) -> int:
        return sum(1 for t in prompt_token_ids if t == self.image_token_id)

    def process(self, prompt_token_ids: list[int], images: list) -> tuple[list[int], list[ImageFeature]]:
        """The prompt with each image token expanded, and the images' features (in prompt order)."""
        n_placeholders = self.count_placeholders(prompt_token_ids)
        if n_placeholders != len(images):
            raise InvalidRequestError(
                f"the prompt has {n_placeholders} image placeholder(s) ({self.image_token}) but {len(images)} "
                "image(s) were given", param="multi_modal_data")
        out: list[int] = []
        features: list[ImageFeature] = []
        it = iter(images)
        wrapped = False
        for t in prompt_token_ids:
            if t != self.image_token_id:
                _extend(out, [t], self.merges if wrapped else {})
                wrapped = False
                continue
            items = self.process_image(next(it))
            if len(items) > 1 and self.crops is None:
                raise InvalidRequestError("this model's prompts have no place for an image's crops: serve "
                                          "without pan-and-scan", param="mm_processor_kwargs")
            template = self._template(len(items) - 1)
            _extend(out, template[:1] if template[0] is not None else [], self.merges)
            slots = iter(items)
            for tok in template[1:] if template[0] is not None else template:
                if tok is not None:
                    out.append(tok)
                    continue
                pixel_values, extra, digest = next(slots)
                n = self.num_tokens(pixel_values, extra)
                features.append(ImageFeature(digest, len(out), n, pixel_values, extra))
                out.extend([self.fill_token_id] * n)
            wrapped = template[-1] is not None
        return out, features

    def _template(self, num_crops: int) -> list:
        """The placeholder's replacement ids, None where an image's tokens go."""
        if not num_crops:
            return [*self.wrap[0], None, *self.wrap[1]]
        ids = self.crops(num_crops)
        return [x for t in ids for x in ((t, None) if t == self.image_token_id else (t,))]


def encode_around(tokenizer: Any, text: str, placeholder: str, placeholder_id: int,
                  add_special_tokens: bool = False) -> list[int]:
    """``text`` tokenized with each ``placeholder`` as ``placeholder_id``, as a tokenizer that has it as a
    special token does (it splits the text there): the same ids from a tokenizer that lacks it (random
    weights served with another model's tokenizer)."""
    first, *rest = text.split(placeholder)
    ids = list(tokenizer.encode(first, add_special_tokens=add_special_tokens))
    for piece in rest:
        ids += [placeholder_id, *tokenizer.encode(piece, add_special_tokens=False)]
    return ids


def _extend(out: list[int], ids: list[int], merges: dict) -> None:
    """``out += ids``, the junction's two tokens merged where ``merges`` says."""
    if ids and out and (out[-1], ids[0]) in merges:
        out[-1] = merges[out[-1], ids[0]]
        ids = ids[1:]
    out.extend(ids)


def newline_merges(tokenizer: Any, longest: int = 31) -> dict:
    """``{(a, b): ab}`` of the newline-run tokens ("\n" up to ``longest`` newlines) a tokenizer has: two
    adjacent runs its tokenizer would have made one token (Gemma's SentencePiece vocabulary has them)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    ids = {n: vocab["\n" * n] for n in range(1, longest + 1) if "\n" * n in vocab}
    return {(ids[a], ids[b]): ids[a + b] for a in ids for b in ids if a + b in ids}
