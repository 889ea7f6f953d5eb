"""Golden fixtures of a tiny random Qwen2.5-VL (its ViT with window attention + patch merger, a Qwen2 text model
with M-RoPE) and of a tiny random Qwen2-VL (its ViT: LayerNorm, a quick-GELU MLP, full attention in every block,
a LayerNorm before the merger) from HF transformers; run through tests/make_vision_fixtures.py with the oracle env:
    .venv-oracle/bin/python tests/make_vision_fixtures.py qwen2_5_vl qwen2_vl

Writes tests/fixtures/models/tiny-qwen2.5-vl/ (and tiny-qwen2-vl/): config.json, model.safetensors (bfloat16, read back as float32),
the processor's configs (Qwen2-VL image processing, PIL backend, at most 64 merged tokens per image), a
byte-level tokenizer with Qwen's special tokens and a Qwen2-VL chat template, the test images (three sizes:
windows padded and not), golden.json (per case: prompt, HF's expanded ids, image grids, HF's greedy
continuation, the smallest top-1/top-2 margin) and logits.npy (HF float32 logits of the first case's prompt).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from make_vision_fixtures import GREEDY_TOKENS, chat_cases, greedy_without_eos as greedy, make_images, \
    make_tokenizer
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                          Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor,
                          Qwen2VLVideoProcessor)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")
# per variant: (folder, config class, model class, processor class, its vision config)
VARIANTS = {
    "qwen2_5_vl": ("tiny-qwen2.5-vl", Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                   dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=56,
                        out_hidden_size=64, fullatt_block_indexes=[1, 3], initializer_range=0.08)),
    "qwen2_vl": ("tiny-qwen2-vl", Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor,
                 dict(depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, hidden_act="quick_gelu",
                      in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      initializer_range=0.08)),
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 5, 6, 3, 4
# Qwen2-VL's template (the system line shortened)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "Be brief.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' or 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# (width, height, seed): 168x112 → 12x8 patches, 3x2 windows; 64x48 → 4x4 (one padded window); 60x150 → 4x10
IMAGES = {"wide.png": (170, 110, 4), "small.png": (64, 48, 5), "tall.png": (60, 150, 6)}
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 64


def cases() -> list[dict]:
    chat = chat_cases("wide.png", ("small.png", "tall.png"), "small.png")
    return [chat["one_image"], chat["two_images"],
            {"name": "text_around", "raw": "look at <|vision_start|><|image_pad|><|vision_end|> and tell me:",
             "images": ["tall.png"]},
            chat["two_turns"], chat["text_only"]]


@torch.no_grad()
def main(variant: str = "qwen2_5_vl") -> None:
    folder, config_cls, model_cls, processor_cls, vision = VARIANTS[variant]
    out_dir = os.path.join(FIXTURES, folder)
    torch.set_num_threads(2)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = make_tokenizer(SPECIALS, bos=None, eos="<|im_end|>", unk="<|endoftext|>", pad="<|endoftext|>",
                               additional=SPECIALS[1:], chat_template=CHAT_TEMPLATE)
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab + 9, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=2, pad_token_id=0, initializer_range=0.08)
    config = config_cls(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                              video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
                              vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    for p in model.parameters():          # stored as bfloat16: the float32 model holds exactly those values
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    model = model_cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor = processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "processor_config.json")) as f:      # as a hub checkpoint names it
        saved = json.load(f)
    saved["image_processor"]["image_processor_type"] = "Qwen2VLImageProcessor"
    with open(os.path.join(out_dir, "processor_config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    images = make_images(IMAGES, out_dir)
    golden = []
    for i, case in enumerate(cases()):
        prompt = case["raw"] if "raw" in case else processor.apply_chat_template(case["messages"],
                                                                                  add_generation_prompt=True)
        imgs = [images[n] for n in case["images"]] or None
        inputs = processor(text=prompt, images=imgs, return_tensors="pt", add_special_tokens=False)
        ids, margin, logits = greedy(model, inputs, GREEDY_TOKENS)
        if i == 0:
            np.save(os.path.join(out_dir, "logits.npy"), logits.astype(np.float32))
        grids = inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else []
        golden.append({**case, "prompt": prompt, "prompt_ids": inputs["input_ids"][0].tolist(), "grids": grids,
                       "greedy_ids": ids, "min_margin": round(margin, 5)})
        print(f"{case['name']}: {inputs['input_ids'].shape[1]} prompt tokens, grids {grids}, "
              f"margin {margin:.4f}, {ids[:6]}")
    with open(os.path.join(out_dir, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
