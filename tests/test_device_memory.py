"""The KV cache's memory budget (``jaxserve/runner/device_memory.py``): the allocator's own figures where it
reports them (BFC), the device's memory times JAX's fraction less the live arrays where it does not (the VMM
allocator that jaxserve's default XLA flags select), nothing on a CPU."""
import types

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
