"""A one-shot peer-write all-reduce in Pallas Mosaic GPU, checked against and timed next to XLA's psum (NCCL).

    python benchmarks/oneshot_allreduce_probe.py [--blocks 1 4 16 32] [--sizes 4096 65536]
    python benchmarks/oneshot_allreduce_probe.py --processes 2      # one process per GPU (jax.distributed)

Why: at batch 1, TP=2 spends ~0.55 ms per token on 65 all-reduces of 16-23 us each (NCCL, whatever
NCCL_PROTO / NCCL_ALGO; XLA's own one-shot collective kernel was no faster; 2026-11-30 results), and the
profile arithmetic says 1.75x needs them near 3 us. Each device here writes its shard straight into a
receive buffer on every peer (``plgpu.remote_ref``: in one process driving all GPUs, XLA hands the kernel
its peers' argument pointers, no NVSHMEM), signals the peer's semaphore, waits for every peer's signal and
adds the shards in f32, rounded once (with 2 devices the same bits on both, and the same as psum's). No
NVLink multicast (``multimem``), which this project leaves off.

Per block: TMA the block's slice of x into shared memory, TMA it into ``recv[me]`` of each peer, signal
each peer once; then wait until every peer's blocks have signalled (``(D - 1) * blocks``, as JAX's collective
matmul waits: the semaphore counts from zero per launch), TMA the peers' slices in, add, store.

With ``--processes N`` each GPU has its own process (the engine's mp executor); there Mosaic GPU marks the
kernel's arguments for symmetric memory, which XLA must then provide: whether it does is part of what the
run answers. Measured on 2 H200s (2026-11-30, ninth session, ``benchmarks/results/2026-11-30-h200-ninth-session.md``):
in one process the kernel equals psum bit for bit but takes 24.5 us at best against NCCL's 20.9 (not profiled;
likely XLA's per-launch host rendezvous for collectives); with a process per GPU every launch fails, since
NCCL cannot give the peer pointers. So the engine keeps XLA's all-reduce. The script prints, per size and block count: bit-equality with psum after
a chain of calls (a protocol error shows as a mismatch or a hang, so run it under ``timeout``), and us per
all-reduce in a jitted chain of 64, next to psum's.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

AXIS = "tp"
WIDTH = 128          # elements per TMA row (a copy box is at most 256 per dimension)


def oneshot_allreduce(x, *, axis_name: str = AXIS, num_devices: int, blocks: int = 16):
    """Sum of ``x [N]`` over ``axis_name`` (inside ``shard_map``); ``N`` a multiple of ``128 * blocks``."""
    n = x.shape[0]
    if x.ndim != 1 or n % (WIDTH * blocks):
        raise ValueError(f"x must be [N] with N a multiple of {WIDTH * blocks}, got {x.shape}")
    rows = n // WIDTH // blocks
    if rows > 256:
        raise ValueError(f"{rows} rows per block: use more blocks (a TMA box is at most 256 rows)")
    d = num_devices

    def body(x_ref, y_ref, recv_ref, mine, theirs, bars):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        me = lax.axis_index(axis_name)
        sl = pl.ds(lax.axis_index("blocks") * rows, rows)
        peers = [lax.rem(me + p, d) for p in range(1, d)]
        plgpu.copy_gmem_to_smem(x_ref.at[sl], mine, bars.at[0])
        plgpu.barrier_wait(bars.at[0])
        for peer in peers:
            plgpu.copy_smem_to_gmem(mine, plgpu.remote_ref(recv_ref, peer).at[me, sl])
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)       # the writes landed before the signal
        for peer in peers:
            pl.semaphore_signal(sem, device_id=peer)
        pl.semaphore_wait(sem, value=(d - 1) * blocks, decrement=False)
        for i, peer in enumerate(peers):
            plgpu.copy_gmem_to_smem(recv_ref.at[peer, sl], theirs.at[i], bars.at[1])
        plgpu.barrier_wait(bars.at[1])
        acc = mine[...].astype(jnp.float32)
        for i in range(d - 1):                                  # f32 sum, rounded once (2 devices: order-free)
            acc = acc + theirs[i].astype(jnp.float32)
        mine[...] = acc.astype(mine.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(mine, y_ref.at[sl])
        plgpu.wait_smem_to_gmem(0)

    def entry(x_ref, y_ref, recv_ref):
        pl.run_scoped(lambda mine, theirs, bars: body(x_ref, y_ref, recv_ref, mine, theirs, bars),
                      plgpu.SMEM((rows, WIDTH), x.dtype), plgpu.SMEM((max(d - 1, 1), rows, WIDTH), x.dtype),
                      plgpu.Barrier(num_barriers=2, num_arrivals=1))

    y, _ = plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((n // WIDTH, WIDTH), x.dtype),
                  jax.ShapeDtypeStruct((d, n // WIDTH, WIDTH), x.dtype)],     # recv: written by the peers
        grid=(blocks,), grid_names=("blocks",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x.reshape(n // WIDTH, WIDTH))
    return y.reshape(n)


def build(mesh, *, blocks: int, chain: int, which: str):
    """jit over the mesh: ``chain`` all-reduces in a row (each halved so values stay bounded)."""
    d = mesh.shape[AXIS]

    def step(x):
        if which == "psum":
            return lax.psum(x, AXIS)
        return oneshot_allreduce(x, num_devices=d, blocks=blocks)

    def body(x):
        for _ in range(chain):
            x = (step(x).astype(jnp.float32) * 0.5).astype(x.dtype)
        return x
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


def _same(got, want, *, exact: bool) -> bool:
    """Every process's shards of ``got`` equal ``want``'s: bit for bit (2 devices: one rounding of the same
    f32 sum), else within bf16 rounding (NCCL sums in another order)."""
    ok = True
    for g, w in zip(got.addressable_shards, want.addressable_shards):
        g, w = np.asarray(g.data, np.float32), np.asarray(w.data, np.float32)
        ok &= bool(np.array_equal(g, w) if exact else np.allclose(g, w, rtol=2e-2, atol=1e-2))
    if jax.process_count() > 1:
        ok = bool(multihost_utils.process_allgather(np.array(ok)).all())
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--processes" in argv and "--pid" not in argv:        # spawn one child per GPU, each one device
        n = int(argv[argv.index("--processes") + 1])
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--pid", str(i)]) for i in range(n)]
        return max(p.wait() for p in procs)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16 * 4096],
                    help="elements per device (bf16): one decode row, a 16-token step (the engine's "
                         "batch-1 bucket until 2026-11-30, now MIN_TOKEN_BUCKET)")
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.pid is not None:
        jax.distributed.initialize("127.0.0.1:12358", num_processes=a.processes, process_id=a.pid,
                                   local_device_ids=[a.pid])
    say = print if jax.process_index() == 0 else (lambda *_, **__: None)
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    d = mesh.shape[AXIS]
    say(f"# oneshot_allreduce_probe: jax {jax.__version__}, {d} x {jax.devices()[0].device_kind}", flush=True)
    say(f"({jax.process_count()} process(es))\n| elems per device | kernel | blocks | equals psum | us per all-reduce |\n|---|---|---|---|---|", flush=True)
    for n in a.sizes:
        host = np.random.default_rng(n).standard_normal(d * n).astype(jnp.bfloat16)   # the same in every process
        x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(AXIS)), lambda idx: host[idx])
        want = build(mesh, blocks=1, chain=3, which="psum")(x)
        for which, blocks in [("psum", 0)] + [("oneshot", b) for b in a.blocks]:
            try:
                same = "-"
                if which == "oneshot":
                    got = build(mesh, blocks=blocks, chain=3, which=which)(x)
                    same = _same(got, want, exact=d == 2)
                f = build(mesh, blocks=blocks, chain=a.chain, which=which)
                y = f(x).block_until_ready()
                t = time.perf_counter()
                for _ in range(a.reps):
                    y = f(y)
                y.block_until_ready()
                us = (time.perf_counter() - t) / (a.reps * a.chain) * 1e6
                say(f"| {n} | {which} | {blocks or '-'} | {same} | {us:.1f} |", flush=True)
            except Exception as e:          # a configuration that does not build is reported, not fatal
                say(f"| {n} | {which} | {blocks} | failed: {type(e).__name__}: {str(e)[:300]} | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
