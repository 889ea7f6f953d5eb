"""All-reduce latency and bandwidth over the local GPUs through XLA (NCCL), for the TP notes.

    NCCL_DEBUG=INFO python benchmarks/allreduce_probe.py      # prints NCCL's transport lines too
    python benchmarks/allreduce_probe.py --processes 2         # one process per GPU through jax.distributed

Times a jitted chain of all-reduces (shard_map psum over a "tp" axis of every local device) for a decode-sized
vector ([1, 4096] bf16 per device), a 16-token step ([16, 4096], 128 KiB: the engine's batch-1 bucket until 2026-11-30, now MIN_TOKEN_BUCKET) and a
large one (64 MiB per device). NCCL's environment (NCCL_PROTO, NCCL_ALGO, ...) passes through to the children.
"""
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

if "--processes" in sys.argv and "--pid" not in sys.argv:
    n = int(sys.argv[sys.argv.index("--processes") + 1])
    procs = [subprocess.Popen([sys.executable, __file__, "--processes", str(n), "--pid", str(i)]) for i in range(n)]
    sys.exit(max(p.wait() for p in procs))
if "--pid" in sys.argv:
    pid, nproc = int(sys.argv[sys.argv.index("--pid") + 1]), int(sys.argv[sys.argv.index("--processes") + 1])
    jax.distributed.initialize("127.0.0.1:12357", num_processes=nproc, process_id=pid, local_device_ids=[pid])

devs = jax.devices()
mesh = Mesh(devs, ("tp",))
n = len(devs)
for elems, chain, reps in ((4096, 64, 20), (16 * 4096, 64, 20), (32 << 20, 4, 5)):
    x = jax.jit(lambda: jnp.ones((n, elems), jnp.bfloat16), out_shardings=NamedSharding(mesh, P("tp")))()

    def body(x):
        for _ in range(chain):
            x = jax.lax.psum(x, "tp") * 0.5
        return x
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
    x = f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        x = f(x)
    x.block_until_ready()
    dt = (time.perf_counter() - t) / (reps * chain)
    nbytes = elems * 2
    if jax.process_index() == 0:
        print(f"[{jax.process_count()} process(es)] all-reduce {nbytes / 1024:.0f} KiB per device over {n} GPUs: {dt * 1e6:.1f} us, "
              f"bus bandwidth {2 * (n - 1) / n * nbytes / dt / 1e9:.1f} GB/s", flush=True)
