"""The model tests' fixtures."""
import pytest

from support.llms import packaged_model_or_skip


@pytest.fixture(scope="module")
def gemma3_path():
    """The packaged Gemma 3 270M GGUF (skips where its packages are not installed)."""
    return packaged_model_or_skip("gemma3-270m")
