"""Golden fixtures of tiny random vision-language models from HF transformers: LLaVA-1.5 (CLIP ViT + MLP
projector + Llama), Qwen2.5-VL and Qwen2-VL (``make_qwen_vl_fixtures``) and Gemma 3
(``make_gemma3_vision_fixtures``) and Llama 3.2 Vision (``make_mllama_fixtures``).

Run with the oracle env (torch + torchvision + transformers); an argument picks one family:
    .venv-oracle/bin/python tests/make_vision_fixtures.py [llava | qwen2_5_vl | qwen2_vl | gemma3 | mllama]
(LLaVA-NeXT's: tests/make_llava_next_fixtures.py)

Writes tests/fixtures/models/tiny-llava/: config.json, model.safetensors (bfloat16, read back as float32 by
the oracle), preprocessor_config.json and processor_config.json (CLIP image processing at 56x56, 14-pixel
patches: 16 image tokens per image), a byte-level tokenizer with ``<image>`` and LLaVA's chat template, the
test images (PNG, made from fixed seeds), and golden.json: per case its prompt (chat messages or raw text),
the ids HF's processor expands it to (chat prompts without added special tokens), HF's greedy continuation (no eos stop) and the smallest top-1/top-2
margin on that path; logits.npy: HF float32 logits of the first case's prompt.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,  # noqa: E402
                          LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "tiny-llava")
GREEDY_TOKENS = 20
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
# llava-hf/llava-1.5-7b-hf's template: each message's images first, then its text
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
IMAGES = {"red.png": (64, 48, 1), "noise.png": (40, 80, 2), "tall.png": (30, 90, 3)}   # (width, height, seed)


def make_tokenizer(specials=tuple(SPECIALS), *, bos="<s>", eos="</s>", unk="<unk>", pad="<pad>",
                   additional=("<image>",), chat_template=CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level: one token per byte, the specials first (LLaVA's: ids 0..4, <image> = 4; bytes 5..260)."""
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk,
                                   pad_token=pad, additional_special_tokens=list(additional))
    fast.chat_template = chat_template
    return fast


def chat_cases(one: str, two: tuple[str, str], earlier: str) -> dict[str, dict]:
    """The chat cases a family with interleaved image parts is tested on, by name: one image, two images
    with text between, a two-turn chat with an image in the first turn, text only."""
    img = {"type": "image"}
    return {
        "one_image": {"name": "one_image", "messages": [
            {"role": "user", "content": [img, {"type": "text", "text": "What?"}]}], "images": [one]},
        "two_images": {"name": "two_images", "messages": [{"role": "user", "content": [
            img, {"type": "text", "text": "and"}, img, {"type": "text", "text": "Compare."}]}], "images": list(two)},
        "two_turns": {"name": "two_turns", "messages": [
            {"role": "user", "content": [img, {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Colours."}]},
            {"role": "user", "content": [{"type": "text", "text": "More?"}]}], "images": [earlier]},
        "text_only": {"name": "text_only", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}], "images": []},
    }


def make_images(images: dict = IMAGES, folder: str = OUT) -> dict[str, Image.Image]:
    """Random RGB images ``{name: (width, height, seed)}``, saved as PNG in ``folder``."""
    out = {}
    for name, (w, h, seed) in images.items():
        rng = np.random.default_rng(seed)
        out[name] = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        out[name].save(os.path.join(folder, name))
    return out


@torch.no_grad()
def greedy_without_eos(model, inputs, n: int) -> tuple[list[int], float, np.ndarray]:
    """HF's greedy continuation of ``inputs`` over ``n`` tokens (no eos stop), the smallest top-1/top-2 margin
    on it, and the prompt's float32 logits."""
    ids = inputs["input_ids"]
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    logits = model(**inputs).logits[0].float().numpy()
    return out.sequences[0, ids.shape[1]:].tolist(), min(margins), logits


def save_processor(processor, tokenizer, folder: str, image_processor_type: str) -> None:
    """The processor's and tokenizer's files, ``processor_config.json`` naming the image processor as a hub
    checkpoint does."""
    processor.save_pretrained(folder)
    with open(os.path.join(folder, "processor_config.json")) as f:
        saved = json.load(f)
    saved["image_processor"]["image_processor_type"] = image_processor_type
    with open(os.path.join(folder, "processor_config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    tokenizer.save_pretrained(folder)


def write_golden(folder: str, model, processor, case_list: list[dict], images: dict, greedy) -> None:
    """golden.json (per case: prompt, HF's expanded ids, ``greedy(model, inputs, n)``'s continuation and smallest
    margin) and logits.npy (the first case's logits); a case's ``processor_kwargs`` go to its processor call."""
    golden = []
    for i, case in enumerate(case_list):
        prompt = case["raw"] if "raw" in case else processor.apply_chat_template(case["messages"],
                                                                                  add_generation_prompt=True)
        imgs = [images[n] for n in case["images"]] or None
        # raw prompts get the tokenizer's BOS (LLM.generate's encode); a chat template holds what it wants
        # (jaxserve's and vLLM's chat default: add_special_tokens false)
        inputs = processor(text=prompt, images=imgs, return_tensors="pt", add_special_tokens="raw" in case,
                           **case.get("processor_kwargs", {}))
        ids, margin, logits = greedy(model, inputs, GREEDY_TOKENS)
        if i == 0:
            np.save(os.path.join(folder, "logits.npy"), logits.astype(np.float32))
        golden.append({**case, "prompt": prompt, "prompt_ids": inputs["input_ids"][0].tolist(), "greedy_ids": ids,
                       "min_margin": round(margin, 5)})
        print(f"{case['name']}: {inputs['input_ids'].shape[1]} prompt tokens, margin {margin:.4f}, {ids[:6]}")
    with open(os.path.join(folder, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)


def cases(images: dict) -> list[dict]:
    red, noise, tall = images["red.png"], images["noise.png"], images["tall.png"]
    img = {"type": "image"}
    return [
        {"name": "one_image", "messages": [{"role": "user", "content": [img, {"type": "text", "text": "What?"}]}],
         "images": ["red.png"]},
        {"name": "two_images", "messages": [{"role": "user", "content": [
            img, img, {"type": "text", "text": "Compare them."}]}], "images": ["red.png", "noise.png"]},
        {"name": "text_around", "raw": "USER: look at <image> and tell me ASSISTANT:", "images": ["tall.png"]},
        {"name": "two_turns", "messages": [
            {"role": "user", "content": [img, {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Colours."}]},
            {"role": "user", "content": [{"type": "text", "text": "More?"}]}], "images": ["noise.png"]},
        {"name": "raw_placeholder", "raw": "<image>\nA photo of", "images": ["noise.png"]},
        {"name": "text_only", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
         "images": []},
    ], (red, noise, tall)


@torch.no_grad()
def greedy(model, inputs, n: int) -> tuple[list[int], float, np.ndarray]:
    ids = inputs["input_ids"]
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=3)
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    logits = model(**inputs).logits[0].float().numpy()
    return out.sequences[0, ids.shape[1]:].tolist(), min(margins), logits


def tiny_llava_configs(vocab: int, image_size: int, patch_size: int,
                       max_positions: int) -> tuple[LlamaConfig, CLIPVisionConfig]:
    """The tiny LLaVA's text and vision configs (LLaVA-NeXT's fixture shares them)."""
    text = LlamaConfig(vocab_size=vocab + 11, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                       rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                       initializer_range=0.08)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=32,
                              hidden_act="quick_gelu", initializer_range=0.08)
    return text, vision


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    tokenizer = make_tokenizer()
    text, vision = tiny_llava_configs(len(tokenizer), 56, 14, 512)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=4, projector_hidden_act="gelu",
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    for p in model.parameters():          # stored as bfloat16: the float32 model holds exactly those values
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    model = LlavaForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    # the PIL backend, which jaxserve runs (no torch in the server); the torchvision one resizes differently
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                               num_additional_image_tokens=1)
    save_processor(processor, tokenizer, OUT, "CLIPImageProcessor")
    images = make_images()
    write_golden(OUT, model, processor, cases(images)[0], images, greedy)


if __name__ == "__main__":
    import sys

    which = sys.argv[1:] or ["llava", "qwen2_5_vl", "qwen2_vl", "gemma3", "mllama"]
    if "llava" in which:
        main()
    for variant in ("qwen2_5_vl", "qwen2_vl"):
        if variant in which:
            from make_qwen_vl_fixtures import main as qwen_main  # noqa: PLC0415

            qwen_main(variant)
    if "gemma3" in which:
        from make_gemma3_vision_fixtures import main as gemma3_main  # noqa: PLC0415

        gemma3_main()
    if "mllama" in which:
        from make_mllama_fixtures import main as mllama_main  # noqa: PLC0415

        mllama_main()
