"""The converted-GGUF weight cache (models/weight_cache): a second load maps the converted weights instead
of dequantizing the file, gives the same arrays, and a changed file or dtype is converted afresh."""
import os

import jax
import jax.numpy as jnp
import pytest

from jaxserve.models import gguf_loader, weight_cache
from test_gguf_families import FIXTURES, write_gguf
from support.tiny_models import params_equal


@pytest.fixture
def gguf_path(tmp_path):
    path = str(tmp_path / "tiny-qwen3.gguf")
    write_gguf(os.path.join(FIXTURES, "tiny-qwen3"), path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setattr(weight_cache, "directory_for", lambda compile_cache_dir: str(folder))
    return folder


def conversions(monkeypatch) -> list:
    calls, real = [], gguf_loader.load_weights

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(gguf_loader, "load_weights", counting)
    return calls


def test_a_second_load_maps_the_converted_weights(gguf_path, cache, monkeypatch):
    calls = conversions(monkeypatch)
    first = gguf_loader.load_gguf(gguf_path, dtype="float32")
    assert len(calls) == 1 and len(os.listdir(cache)) == 1
    again = gguf_loader.load_gguf(gguf_path, dtype="float32")
    assert len(calls) == 1                                  # not converted again
    assert params_equal(first.params, again.params)
    assert again.config == first.config


def test_a_changed_file_or_dtype_is_converted_again_and_a_torn_entry_is_not_used(gguf_path, cache, monkeypatch):
    calls = conversions(monkeypatch)
    f32 = gguf_loader.load_gguf(gguf_path, dtype="float32")
    bf16 = gguf_loader.load_gguf(gguf_path, dtype="bfloat16")
    assert len(calls) == 2 and len(os.listdir(cache)) == 2
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16.params))
    # a torn entry (cut short): converted again, and rewritten whole
    for name in os.listdir(cache):
        blob = (cache / name).read_bytes()
        (cache / name).write_bytes(blob[:len(blob) // 2])
    again = gguf_loader.load_gguf(gguf_path, dtype="float32")
    assert len(calls) == 3 and params_equal(f32.params, again.params)
    # the same file rewritten (another modification time): its entry no longer matches
    os.utime(gguf_path, ns=(os.stat(gguf_path).st_atime_ns, os.stat(gguf_path).st_mtime_ns + 10**9))
    gguf_loader.load_gguf(gguf_path, dtype="float32")
    assert len(calls) == 4
    assert len(os.listdir(cache)) == 2                      # it replaced the float32 entry of the old file
    gguf_loader.load_gguf(gguf_path, dtype="float32")
    assert len(calls) == 4


def test_the_folder_is_the_compile_caches_or_jaxserves_own_cache(tmp_path, monkeypatch):
    """Next to a persistent compile cache when one is on; else (the CPU backend's default) in
    $JAXSERVE_CACHE_DIR/weights, so a CPU start still maps the converted weights."""
    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "jc"))
    assert weight_cache.directory_for("/x/xla") == os.path.join("/x/xla", "jaxserve-weights")
    assert weight_cache.directory_for(None) == str(tmp_path / "jc" / "weights")
