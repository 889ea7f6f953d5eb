"""The front end's image handling without a model: bounded decoding (a decompression bomb is refused from
its header, before any pixel is decoded), URL rules, the chat conversion for both template forms, and the
limits of a text-only and a vision model."""
from __future__ import annotations

import base64
import io
import struct
import types
import zlib

import pytest
from PIL import Image

from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal.chat import image_conversation, template_reads_parts
from jaxserve.multimodal.media import MediaLimits, decode_image, load_image_url


def _png(size=(4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size).save(buf, "PNG")
    return buf.getvalue()


def _with_header_size(png: bytes, width: int, height: int) -> bytes:
    """``png`` whose IHDR claims ``width`` x ``height`` (CRC fixed): a bomb as its header tells it."""
    ihdr = bytearray(png[16:29])
    ihdr[0:8] = struct.pack(">II", width, height)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + bytes(ihdr)) & 0xFFFFFFFF)
    return png[:16] + bytes(ihdr) + crc + png[33:]


def test_a_bomb_is_refused_from_its_header_before_decoding():
    """The header claims a huge image whose data (a 4x4 image's) would fail to decode: the refusal names the
    pixels, so the header's size was checked before any decoding."""
    for side in (10_000, 100_000):       # over our limit; over PIL's own bomb limit too
        bomb = _with_header_size(_png(), side, side)
        with pytest.raises(InvalidRequestError, match="pixel limit|pixels, more than"):
            decode_image(bomb, MediaLimits(max_pixels=1 << 24))


def test_data_urls_and_schemes(tmp_path):
    limits = MediaLimits(allowed_local_path=str(tmp_path))
    good = "data:image/png;base64," + base64.b64encode(_png((3, 2))).decode()
    assert load_image_url(good, limits).size == (3, 2)
    for url, words in [("data:image/png,abc", "base64"), ("data:image/png;base64,%%%", "base64"),
                       ("data:image/png;base64," + base64.b64encode(b"text").decode(), "not a readable image"),
                       ("gopher://x/y", "scheme"), ("file:///etc/hostname", "outside")]:
        with pytest.raises(InvalidRequestError, match=words):
            load_image_url(url, limits)
    (tmp_path / "a.png").write_bytes(_png((5, 5)))
    assert load_image_url(f"file://{tmp_path}/a.png", limits).size == (5, 5)
    with pytest.raises(InvalidRequestError, match="refused"):
        load_image_url(f"file://{tmp_path}/a.png", MediaLimits())


def test_chat_conversion_for_both_template_forms():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u1"}},
                                             {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": "A cat."}]
    parts_template = "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}"
    assert template_reads_parts(parts_template) and not template_reads_parts("{{ message['content'] }}")
    conv, urls = image_conversation(messages, parts_template, "<image>")
    assert urls == ["u1"] and conv[0]["content"] == [{"type": "image"}, {"type": "text", "text": "What?"}]
    assert conv[1]["content"] == [{"type": "text", "text": "A cat."}]
    conv, _ = image_conversation(messages, "{{ message['content'] }}", "<image>")
    assert conv[0]["content"] == "<image>\nWhat?" and conv[1]["content"] == "A cat."
    with pytest.raises(InvalidRequestError, match="limit"):
        image_conversation(messages * 3, parts_template, "<image>", limit=2)
    with pytest.raises(InvalidRequestError, match="audio"):
        image_conversation([{"role": "user", "content": [{"type": "audio"}]}], parts_template, "<image>")


def test_image_limits_of_text_and_vision_models():
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import MultiModalInputs
    config = EngineConfig()
    config.multimodal.limit_mm_per_prompt = {"image": 1}
    text = MultiModalInputs(types.SimpleNamespace(config=config, is_multimodal=False, served_model_name="m"))
    with pytest.raises(InvalidRequestError, match="does not take images"):
        text.check_count(1)
    text.check_count(0)
    vision = MultiModalInputs(types.SimpleNamespace(config=config, is_multimodal=True, served_model_name="m",
                                                    model_config=types.SimpleNamespace(extra_dict={})))
    vision.check_count(1)
    with pytest.raises(InvalidRequestError, match="limit of 1"):
        vision.check_count(2)
