"""A sharded safetensors checkpoint read by the loader's threads (``hf_weights.load_weights(threads=N)``,
JAXSERVE_LOAD_THREADS): the same weights as one tensor at a time, in their shardings under tensor
parallelism, a bounded host footprint (numpy copies, and the process's peak RSS), and a truncated or missing
shard or a tensor of the wrong shape stopping the load with one line that names the file and the tensor."""
import json
import os
import textwrap
import tracemalloc

import jax
import numpy as np
import pytest

from jaxserve.errors import ModelLoadError
from jaxserve.models.loader import load_model
from jaxserve.models.random_checkpoint import write_random_checkpoint

from support.fake_devices import run_on_fake_devices
from support.safetensors_files import SHARDED_LLAMA as HF, llama_tensors, write_sharded

# SHARDED_LLAMA scaled up to a few hundred MB, in shards of about 70 MB
LARGER = dict(HF, hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=8,
              vocab_size=8192)
from support.tiny_models import params_equal


def load_with_threads(folder, threads: int, monkeypatch):
    monkeypatch.setenv("JAXSERVE_LOAD_THREADS", str(threads))
    return load_model(str(folder), dtype="bfloat16")


def test_threads_load_the_same_weights_as_one_at_a_time(tmp_path, monkeypatch):
    write_sharded(tmp_path)
    serial = load_with_threads(tmp_path, 0, monkeypatch)
    parallel = load_with_threads(tmp_path, 4, monkeypatch)
    assert params_equal(parallel.params, serial.params)
    tensors = llama_tensors(HF)
    np.testing.assert_array_equal(np.asarray(parallel.params["layers"][5]["down"]),
                                  tensors["model.layers.5.mlp.down_proj.weight"].T)


def test_the_host_holds_a_bounded_number_of_tensors(tmp_path, monkeypatch):
    write_sharded(tmp_path)
    load_with_threads(tmp_path, 4, monkeypatch)          # compiles the builds, imports the tokenizer
    tracemalloc.start()
    model = load_with_threads(tmp_path, 4, monkeypatch)
    jax.block_until_ready(model.params)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    total = sum(a.nbytes for a in jax.tree.leaves(model.params))
    largest = max(a.nbytes for a in llama_tensors(HF).values())
    # the tensors go from the memory-mapped files to the device: numpy copies none of them (threads x 2 in
    # flight would be the bound if it did)
    assert peak < largest < total / 8, (peak, largest, total)


def test_peak_rss_stays_under_the_weights_and_one_shard(tmp_path, monkeypatch):
    """A second load in a fresh process (the first compiled the builds and built the tokenizer), its peak
    resident set (VmHWM, reset before it) against the RSS before it: on a CPU backend the weights themselves
    are host memory, so the bound is their bytes, plus what is in flight (eight threads' tensors and the shard
    pages they touch: about one shard, up to two on a loaded machine), plus a margin. Every page of the
    memory-mapped shards that a load read used to stay mapped until its end: the whole checkpoint (four shards) on
    top of the weights, which this bound still fails."""
    shards = list(map(os.path.getsize, write_random_checkpoint(str(tmp_path), LARGER, shards=4)))
    code = textwrap.dedent("""
        import gc, json, sys
        import jax
        from jaxserve.models.loader import load_model

        def status(key):
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

        jax.block_until_ready(load_model(sys.argv[1], dtype="bfloat16").params)
        gc.collect()
        try:
            open("/proc/self/clear_refs", "w").write("5")        # VmHWM from here on
        except OSError:
            print(json.dumps(None))
            sys.exit()
        before = status("VmRSS")
        params = jax.block_until_ready(load_model(sys.argv[1], dtype="bfloat16").params)
        print(json.dumps({"before": before, "peak": status("VmHWM"),
                          "weights": sum(a.nbytes for a in jax.tree.leaves(params))}))
    """)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))   # freed arrays go back to the system at once
    monkeypatch.setenv("JAXSERVE_LOAD_THREADS", "8")
    rss = json.loads(run_on_fake_devices(["-c", code, str(tmp_path)], 1, timeout=600).strip().splitlines()[-1])
    if rss is None:
        pytest.skip("/proc/self/clear_refs is not writable here")
    grown, bound = rss["peak"] - rss["before"], rss["weights"] + 2 * max(shards) + (64 << 20)
    assert rss["weights"] + sum(shards) > bound                 # the bound tells the regression apart
    assert grown < bound, f"peak RSS grew {grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB ({rss})"


def test_a_truncated_shard_names_its_file_and_tensor(tmp_path, monkeypatch):
    files = write_sharded(tmp_path)
    path = tmp_path / files[2]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])                     # a download cut short
    with pytest.raises(ModelLoadError) as e:
        load_with_threads(tmp_path, 4, monkeypatch)
    msg = str(e.value)
    assert msg.startswith(f"{files[2]}: corrupt safetensors file: tensor model.layers.") and "\n" not in msg, msg


def test_a_missing_shard_names_its_file_and_a_tensor_in_it(tmp_path, monkeypatch):
    files = write_sharded(tmp_path)
    os.remove(tmp_path / files[3])
    with pytest.raises(ModelLoadError) as e:
        load_with_threads(tmp_path, 4, monkeypatch)
    msg = str(e.value)
    assert msg.startswith(f"{files[3]}: file not found") and "the index lists tensor " in msg and "\n" not in msg


def test_a_shape_mismatch_names_its_file_and_tensor(tmp_path, monkeypatch):
    tensors = llama_tensors(HF)
    tensors["model.layers.2.self_attn.k_proj.weight"] = tensors["model.layers.2.self_attn.k_proj.weight"][:32]
    files = write_sharded(tmp_path, tensors=tensors)
    with pytest.raises(ModelLoadError) as e:
        load_with_threads(tmp_path, 4, monkeypatch)
    msg = str(e.value)
    assert msg.split(":")[0] in files and "model.layers.2.self_attn.k_proj.weight (32, 512)" in msg, msg
    assert "\n" not in msg


def test_threads_place_each_weight_in_its_sharding_under_tp2(tmp_path):
    write_sharded(tmp_path)
    code = textwrap.dedent("""
        import os, sys
        import jax, numpy as np
        from jaxserve import parallel
        from jaxserve.models.loader import load_model
        mesh = parallel.make_mesh(2)
        loads = {}
        for threads in ("0", "4"):
            os.environ["JAXSERVE_LOAD_THREADS"] = threads
            loads[threads] = load_model(sys.argv[1], dtype="bfloat16", mesh=mesh)
        m = loads["4"]
        want = jax.tree.leaves(parallel.param_shardings(m.family.param_partition_specs(m.config), mesh, m.config))
        got, serial = jax.tree.leaves(m.params), jax.tree.leaves(loads["0"].params)
        assert all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(got, want))
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, serial))
        print("ok")
    """)
    assert run_on_fake_devices(["-c", code, str(tmp_path)], 2, timeout=600).strip().splitlines()[-1] == "ok"
