"""benchmarks/oneshot_allreduce_probe: the peer-write all-reduce's GPU build lowers to Mosaic GPU for CUDA on CPU,
under a 2-device "tp" mesh, for the engine's batch-1 size and a single decode row. The protocol itself needs two
GPUs (the probe checks it against psum there). Fake devices need XLA_FLAGS before JAX starts, so the lowering
runs in one subprocess."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from benchmarks.oneshot_allreduce_probe import oneshot_allreduce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [(16 * 4096, 16), (4096, 1), (4096, 4)]
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from benchmarks.oneshot_allreduce_probe import AXIS, build
mesh = jax.make_mesh((2,), (AXIS,))
out = {}
for n, blocks in json.loads(sys.argv[1]):
    x = jax.device_put(jnp.zeros((2 * n,), jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
    text = build(mesh, blocks=blocks, chain=2, which="oneshot").trace(x).lower(lowering_platforms=("cuda",)).as_text()
    out[f"{n}/{blocks}"] = {"custom_calls": text.count("custom_call"), "mosaic": "mosaic_gpu" in text,
                            "xla_all_reduce": "all_reduce" in text}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lowered():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("n,blocks", CASES)
def test_oneshot_allreduce_lowers_for_cuda(lowered, n, blocks):
    case = lowered[f"{n}/{blocks}"]
    # both all-reduces of the chain are the Mosaic GPU kernel, none is XLA's collective (the psum build's text
    # has "all_reduce" and no custom call)
    assert case["mosaic"] and case["custom_calls"] == 2 and not case["xla_all_reduce"]


def test_harness_runs_on_cpu():
    """The probe's harness under 2 fake devices: psum is timed, the kernel's row reports that it cannot run on CPU
    (Mosaic GPU needs a GPU; its interpret mode fails on the kernel) instead of ending the script."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "oneshot_allreduce_probe.py"), "--blocks",
                          "1", "--sizes", "4096", "--chain", "2", "--reps", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 4096")]
    assert rows[0].startswith("| 4096 | psum | - | - | ") and float(rows[0].split("|")[5]) > 0
    assert rows[1].startswith("| 4096 | oneshot | 1 | failed")


def test_rejects_sizes_the_copy_boxes_cannot_split():
    with pytest.raises(ValueError, match="multiple of"):
        oneshot_allreduce(jnp.zeros((1000,), jnp.bfloat16), num_devices=2, blocks=1)
    with pytest.raises(ValueError, match="TMA box"):
        oneshot_allreduce(jnp.zeros((128 * 512,), jnp.bfloat16), num_devices=2, blocks=1)
