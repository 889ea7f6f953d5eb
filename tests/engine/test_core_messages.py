"""``messages.dump_features`` / ``load_features``: a prompt's ImageFeatures through the engine core's request
message (msgpack) with their pixel arrays out of band: equal arrays and extras on the other side (float32,
bfloat16, a non-contiguous array), the large array a view of the received message rather than a copy."""
from __future__ import annotations

import ml_dtypes
import msgspec
import numpy as np

from jaxserve.engine import messages as m
from jaxserve.multimodal.inputs import ImageFeature


def through_the_wire(features: list) -> tuple[list, bytes]:
    data, buffers = m.dump_features(features)
    wire = msgspec.msgpack.encode(m.EngineCoreRequest("r", [1, 2], b"", 0.0, 0, mm_features=data,
                                                      mm_buffers=buffers))
    msg = msgspec.msgpack.Decoder(m.ToCore).decode(memoryview(wire))
    return m.load_features(msg.mm_features, msg.mm_buffers), wire


def test_features_arrive_equal_and_unpickled_in_place():
    rng = np.random.default_rng(0)
    features = [ImageFeature("a" * 32, 3, 16, rng.standard_normal((4, 4, 96)).astype(ml_dtypes.bfloat16),
                             {"image_grid_thw": np.array([1, 8, 8], np.int64)}),
                ImageFeature("b" * 32, 30, 4, rng.standard_normal((3, 5, 7), np.float32)[:, ::2], {})]
    got, wire = through_the_wire(features)
    assert len(wire) < sum(f.pixel_values.nbytes for f in features) + 1024        # each array once
    for f, g in zip(features, got):
        assert (g.hash, g.offset, g.length) == (f.hash, f.offset, f.length)
        assert g.pixel_values.dtype == f.pixel_values.dtype
        np.testing.assert_array_equal(g.pixel_values, f.pixel_values)
        assert g.extra.keys() == f.extra.keys()
        for k in f.extra:
            np.testing.assert_array_equal(g.extra[k], f.extra[k])
    big = got[0].pixel_values
    assert not big.flags.owndata and not big.flags.writeable        # a view of the message, not a copy


def test_a_request_without_images_has_no_buffers():
    msg = msgspec.msgpack.Decoder(m.ToCore).decode(msgspec.msgpack.encode(m.EngineCoreRequest("r", [1], b"", 0.0, 0)))
    assert msg.mm_features is None and msg.mm_buffers is None
