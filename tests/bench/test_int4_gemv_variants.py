"""The int4 GEMV variants bench's command line: variant names, K splits after ``@``, chunk steps after ``/``."""
import pytest

from jaxserve.benchmarks.int4_gemv_variants import parse_variants


def test_variants_parse_with_their_splits_and_chunks():
    assert parse_variants("v1, occ3@2,v1/8,v1@2/4,none") == [
        ("v1", None, None), ("occ3", 2, None), ("v1", None, 8), ("v1", 2, 4)]
    assert parse_variants("none") == []


@pytest.mark.parametrize("text", ["ws", "v1/6", "nope@2"])
def test_unknown_variants_and_chunks_are_refused(text):
    with pytest.raises(ValueError, match="--variants"):
        parse_variants(text)
