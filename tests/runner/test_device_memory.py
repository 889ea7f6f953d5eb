"""The KV cache's memory budget (``jaxserve/runner/device_memory.py``): the allocator's own figures where it
reports them (BFC), the device's memory times JAX's fraction less the live arrays where it does not (the VMM
allocator that jaxserve's default XLA flags select), nothing on a CPU. The context that budget holds
(``kv_cache.fit``): a model default that does not fit shrinks to what does, an explicit --max-model-len is one
line naming both numbers (the server's and generate's output)."""
import os
import re
import subprocess
import sys
import types

import pytest

import jax
import jax.numpy as jnp

from jaxserve.runner import device_memory


class FakeDevice:
    def __init__(self, platform, stats, hardware_id=0):
        self.platform, self._stats, self.local_hardware_id = platform, stats, hardware_id

    def memory_stats(self):
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


def test_allocator_statistics_when_reported():
    dev = FakeDevice("gpu", {"bytes_limit": 100 << 30, "bytes_in_use": 60 << 30})
    assert device_memory.limit_and_use(dev) == (100 << 30, 60 << 30)


def test_vmm_allocator_without_statistics_uses_total_memory_and_live_arrays(monkeypatch):
    seen = []
    monkeypatch.setattr(device_memory, "cuda_total_memory", lambda ordinal: seen.append(ordinal) or 140 << 30)
    monkeypatch.setattr(device_memory, "live_bytes", lambda dev: 61 << 30)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    for stats in (None, {}, RuntimeError("GetAllocatorStats() is only implemented with MultiDeviceAdapter")):
        assert device_memory.limit_and_use(FakeDevice("gpu", stats, hardware_id=1)) == (105 << 30, 61 << 30)
    assert seen == [1, 1, 1]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert device_memory.limit_and_use(FakeDevice("gpu", None))[0] == int((140 << 30) * 0.95)
    monkeypatch.setattr(device_memory, "cuda_total_memory", lambda ordinal: None)   # no driver answer
    assert device_memory.limit_and_use(FakeDevice("gpu", None)) is None


def test_cpu_reports_nothing_and_live_bytes_count_this_devices_shards(monkeypatch):
    assert device_memory.limit_and_use(FakeDevice("cpu", None)) is None
    dev = jax.devices()[0]
    x = jnp.ones((1024, 256), jnp.float32)
    assert device_memory.live_bytes(dev) >= x.nbytes                  # the real arrays of this process
    shard = lambda device, nbytes: types.SimpleNamespace(device=device, data=types.SimpleNamespace(nbytes=nbytes))
    arrays = [types.SimpleNamespace(addressable_shards=[shard("d0", 100), shard("d1", 100)]),   # sharded
              types.SimpleNamespace(addressable_shards=[shard("d0", 7)])]
    monkeypatch.setattr(jax, "live_arrays", lambda: arrays)
    assert device_memory.live_bytes("d0") == 107 and device_memory.live_bytes("d1") == 100
    assert device_memory.cuda_total_memory(0) is None or device_memory.cuda_total_memory(0) > 0


# ---------------------------------------------------------------------------------------------- the context
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4        # K and V, float32


def fit(max_model_len, explicit, kv_bytes=None, override=None, max_num_seqs=4):
    from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from jaxserve.runner import kv_cache
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=32,
                      num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM)
    config = EngineConfig(max_model_len=max_model_len if explicit else None,
                          cache=CacheConfig(block_size=16, kv_cache_memory_bytes=kv_bytes,
                                            num_gpu_blocks_override=override),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64))
    return kv_cache.fit(cfg, config, max_model_len, jnp.float32)


def test_a_model_default_context_shrinks_to_what_the_kv_cache_holds(caplog):
    with caplog.at_level("WARNING", logger="jaxserve.runner.kv_cache"):
        blocks, length = fit(32768, explicit=False, kv_bytes=101 * 16 * BYTES_PER_TOKEN)
    assert (blocks, length) == (101, 100 * 16)                  # block 0 is the null block
    (record,) = caplog.records
    assert "max_model_len 1600: the model's 32768 tokens do not fit the KV cache (101 blocks of 16 tokens" in \
        record.getMessage()
    assert fit(32768, explicit=False, override=11) == (11, 160)
    # one that fits keeps its length, and the blocks stop at what max_num_seqs requests can use
    assert fit(256, explicit=False, kv_bytes=1000 * 16 * BYTES_PER_TOKEN) == (4 * 16 + 1, 256)


@pytest.mark.parametrize("kv_bytes", [101 * 16 * BYTES_PER_TOKEN, 16 * BYTES_PER_TOKEN])
def test_an_explicit_context_or_none_at_all_that_does_not_fit_is_an_error(kv_bytes):
    from jaxserve.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match=r"^--max-model-len 4096 does not fit the KV cache: \d+ blocks of 16 "
                                             r"tokens in 0 MiB hold \d+ tokens for one request; lower --max-model-len "
                                             r"to \d+ or less, or give the cache more memory \(--kv-cache-memory"):
        fit(4096, explicit=kv_bytes > 16 * BYTES_PER_TOKEN, kv_bytes=kv_bytes)


def test_an_explicit_max_model_len_that_does_not_fit_is_one_line_from_serve_and_generate():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = ["--max-model-len", "512", "--kv-cache-memory", "10000000"]
    for cmd in (["generate", *flags, "--max-tokens", "2"], ["serve", "--port", "0", *flags]):
        out = subprocess.run([sys.executable, "-m", "jaxserve", *cmd], cwd=root, capture_output=True, text=True,
                             timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        lines = [ln for ln in out.stderr.splitlines() if "max-model-len" in ln]
        assert len(lines) == 1 and re.fullmatch(
            rf"jaxserve {cmd[0]}: --max-model-len 512 does not fit the KV cache: \d+ blocks of 16 tokens in 10 MiB "
            r"hold (\d+) tokens for one request; lower --max-model-len to \1 or less, or give the cache more memory "
            r"\(--kv-cache-memory, --gpu-memory-utilization\)", lines[0]), out.stderr[-3000:]


def test_a_budget_over_xla_planning_share_of_the_gpu_is_warned(monkeypatch, caplog):
    from jaxserve.runner import kv_cache
    monkeypatch.setattr(device_memory, "cuda_total_memory", lambda ordinal: 140 << 30)
    gpu = FakeDevice("gpu", {})
    # the H200 case: 8.5 GiB of fp8 weights and a 109.6 GiB cache (fraction 0.95) against 80 % of 140 GiB
    with caplog.at_level("WARNING", logger=kv_cache.__name__):
        assert kv_cache.warn_over_xla_planning_base(gpu, int(8.5 * 2**30), int(109.6 * 2**30))
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in caplog.text
    assert not kv_cache.warn_over_xla_planning_base(gpu, int(8.5 * 2**30), int(84.3 * 2**30))   # fraction 0.75
    assert not kv_cache.warn_over_xla_planning_base(FakeDevice("cpu", {}), 1 << 40, 1 << 40)


def test_a_one_byte_cache_between_2_and_4_gib_a_layer_is_capped_at_2_gib(caplog):
    """Pallas's Triton kernels address arrays of up to 4 GiB with 32-bit element offsets: a 1-byte (fp8) cache
    array of 2 to 4 GiB would be read past 2 GiB at wrapped offsets, so the blocks stop at 2 GiB a layer there;
    16-bit caches and arrays over 4 GiB (64-bit offsets) keep every block."""
    from jaxserve.config import ModelConfig
    from jaxserve.runner import kv_cache
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=HEADS * HEAD_DIM,
                      intermediate_size=32, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
                      head_dim=HEAD_DIM)
    per_block = 16 * HEADS * HEAD_DIM                                  # one layer's K (or V) array, 1 byte each
    fp8 = jnp.float8_e4m3fn
    with caplog.at_level("WARNING", logger="jaxserve.runner.kv_cache"):
        assert kv_cache.offset_safe_blocks(cfg, 16, fp8, None, 3 * 2**30 // per_block) == 2**31 // per_block
    assert "holds 8388608 blocks, not 12582912" in caplog.text
    for n in (2**31 // per_block, 2**32 // per_block + 1, 1000):             # at 2 GiB, over 4 GiB, small
        assert kv_cache.offset_safe_blocks(cfg, 16, fp8, None, n) == n
    assert kv_cache.offset_safe_blocks(cfg, 16, jnp.bfloat16, None, 3 * 2**30 // per_block) == 3 * 2**30 // per_block
