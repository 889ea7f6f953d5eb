"""The packed encoder's patch-bucket ladder (``encoder_cache.patch_bucket``): it holds the image, it is a
multiple of the unit, at least the floor, monotone in the patch count, pads under a fifth of a bucket past
its first steps, and the buckets an image size range can meet are four per doubling; the row batches
(``row_batch``) pad at most a third."""
from __future__ import annotations

import pytest

from jaxserve.runner.encoder_cache import BUCKET_STEPS, budget_rows, patch_bucket, row_batch, smallest_in_bucket


@pytest.mark.parametrize("unit, floor", [(64, 256), (4, 256), (64, 16), (16, 1), (100, 300)])
def test_ladder_holds_bounds_waste_and_is_monotone(unit, floor):
    prev = 0
    for n in range(1, 70_000, 7):
        b = patch_bucket(n, unit, floor)
        assert b >= n and b >= floor and b % unit == 0 and b >= prev
        need = unit * -(-max(n, floor) // unit)
        if need > BUCKET_STEPS[0] * unit:
            assert b - need < b / 5, (n, b)
        else:
            assert b == need
        prev = b


def test_ladder_of_a_unit_of_64():
    assert [patch_bucket(n, 64, 256) for n in (1, 256, 257, 320, 321, 449, 512, 513)] == \
        [256, 256, 320, 320, 384, 512, 512, 640]
    # a 1024-pixel square image resized to 74 x 74 patches, in spans of 64: 5,504 packed patches
    assert patch_bucket(5504, 64, 256) == 6144 and patch_bucket(8192, 64, 256) == 8192


def test_buckets_per_doubling():
    """Images of up to 65,536 patches (Qwen2-VL's default max_pixels) meet 4 * log2(65536 / 256) + 1 buckets."""
    assert len({patch_bucket(n, 64, 256) for n in range(1, 65_537)}) == 4 * 8 + 1


def test_row_batches():
    """1, 2, 3, then powers of two and their halfway points: padding rows are at most a third past three."""
    assert [row_batch(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    for n in range(4, 200):
        assert n <= row_batch(n) < n * 3 / 2 and row_batch(n) >= row_batch(n - 1)


@pytest.mark.parametrize("unit, floor", [(64, 256), (4, 256), (16, 1)])
def test_smallest_in_bucket_is_one_past_the_bucket_below(unit, floor):
    for b in sorted({patch_bucket(n, unit, floor) for n in range(1, 20_000, 3)}):
        n = smallest_in_bucket(b, unit, floor)
        assert patch_bucket(n, unit, floor) == b and (n == 1 or patch_bucket(n - 1, unit, floor) < b)


def test_budget_rows_of_qwen_images():
    """A 1024² image (5,504 packed patches, bucket 6,144, 1,536 tokens a row): two rows at most under a
    2,048-token encoder budget, eight (the batch cap) under 16,384; the smallest bucket may fill every row."""
    assert budget_rows(6144, 64, 256, 1536, 2048, 8) == 2
    assert budget_rows(6144, 64, 256, 1536, 16384, 8) == 8
    assert budget_rows(6144, 64, 256, 1536, 1369, 8) == 1
    assert budget_rows(256, 64, 256, 64, 2048, 8) == 8
