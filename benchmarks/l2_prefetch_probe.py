"""Can a TP=2 decode step hide its all-reduces by pulling the next GEMM's weights into L2 while they run?

    python benchmarks/l2_prefetch_probe.py                    # all local GPUs in one process (uni), + TP=1
    python benchmarks/l2_prefetch_probe.py --processes 2      # one process per GPU (the mp executor's shape)
    python benchmarks/l2_prefetch_probe.py --smoke            # CPU, tiny shapes, 2 fake devices

A batch-1 decode step at TP=2 spends ~64 all-reduces per token (two per layer) during which the GPU's HBM is
idle: the next GEMM needs the all-reduce's result. Its weights do not. This probe times the Llama-3.1-8B layer
stack without attention (norm, q/k/v, o, gate_up, down; T tokens) in these variants:
- ``tp1``: one device, no collectives (the reference the TP=2 speedup is measured against);
- ``gspmd``: weights sharded as the model shards them, XLA inserts the all-reduces (what the engine runs);
- ``sm``: the same with the row-parallel GEMMs and their psums written out in ``shard_map``;
- ``sm-noar``: ``sm`` with the psums removed (wrong numbers; its time minus ``sm``'s is what the all-reduces cost);
- ``sm-car``: ``sm`` with the psums replaced by the CUDA one-shot all-reduce (``kernels/custom_allreduce.py``;
  with ``--processes`` only: it shares buffers between processes);
- ``<variant>-split<N>``: from ``o`` on, each layer runs as N independent token chunks (N all-reduce chains that
  XLA may overlap with the other chunks' GEMMs; for large, compute-bound steps);
- ``sm+pf<MB>``: ``sm`` where, after each row-parallel GEMM and before its psum completes, a reduction reads
  the first <MB> MiB of the next GEMM's local weights (next layer's q/k/v after ``down``, ``gate_up`` after
  ``o``), so that GEMM finds them in L2. Ordering is forced by data: the read adds the GEMM's partial sum
  (times zero) to what it reads, and its result (times zero) is added to the psum's result.
Prints ms per forward (all layers), and for each variant the ops XLA scheduled between the first
all-reduce-start and its done.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

p = argparse.ArgumentParser()
p.add_argument("--processes", type=int, default=0)
p.add_argument("--pid", type=int, default=None)
p.add_argument("--tokens", type=int, default=8)
p.add_argument("--layers", type=int, default=32)
p.add_argument("--reps", type=int, default=30)
p.add_argument("--pf-mb", type=int, nargs="+", default=[8, 24, 40])
p.add_argument("--variants", nargs="+", default=None)
p.add_argument("--smoke", action="store_true")
p.add_argument("--dump", default=None, help="write each variant's compiled HLO text here")
args = p.parse_args()

if args.smoke:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
if args.processes and args.pid is None:
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--pid", str(i)])
             for i in range(args.processes)]
    sys.exit(max(p.wait() for p in procs))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

if args.pid is not None:
    jax.distributed.initialize("127.0.0.1:12359", num_processes=args.processes, process_id=args.pid,
                               local_device_ids=[args.pid])

H, Q, KV, I = (64, 64, 16, 128) if args.smoke else (4096, 4096, 1024, 14336)
HEAD_DIM = 8 if args.smoke else 128
T, L = args.tokens, (2 if args.smoke else args.layers)
DT = jnp.bfloat16
MIB = 1 << 20


def rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def prefetch(ws, after, budget):
    """Reduce over the first ``budget`` bytes of ``ws`` (in order), once ``after`` exists; returns the results."""
    toks = []
    for w in ws:
        row = w.dtype.itemsize * (w.size // w.shape[0])
        rows = min(w.shape[0], budget // row)
        if rows <= 0:
            break
        # a data dependency XLA cannot fold away (x * 0 is NaN for x = NaN) inside the read's own fusion; a
        # dynamic_slice start from ``after`` was not enough: XLA drops a slice that covers the whole array,
        # and the dependency with it (review of 3bd81ab)
        zero = (after.reshape(-1)[0] * 0).astype(w.dtype)
        toks.append(jnp.max(w[:rows] + zero))
        budget -= rows * row
    return toks


def join(y, toks):
    """``y`` made to depend on the prefetch results (a zero added; XLA drops an unused barrier operand and does
    not fold ``t * 0`` for floats, since it is NaN when t is)."""
    for t in toks:
        y = y + (t * 0).astype(y.dtype)
    return y


def layer_local(x, lp, nxt, *, psum, pf_bytes, split=1):
    """One layer on one device's shards (inside shard_map); ``nxt`` is the next layer's params (or None)."""
    h = rms(x)
    if "qkv" in lp:     # one GEMM over this device's q/k/v columns (the weights concatenated per device)
        q, k, v = jnp.split(h @ lp["qkv"], [lp["q"].shape[1], lp["q"].shape[1] + lp["k"].shape[1]], axis=1)
    else:
        q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
    # attention's stand-in: each q head plus its GQA group's k + v. Head-aligned, so neither XLA (gspmd) nor a
    # device's shard (sm) needs other devices' heads (a jnp.tile here cost gspmd an all-gather per layer in
    # the runs of 3bd81ab, and gave sm different numbers)
    t, d = q.shape[0], HEAD_DIM
    a = (q.reshape(t, k.shape[1] // d, -1, d) + (k + v).reshape(t, k.shape[1] // d, 1, d)).reshape(q.shape)
    if split > 1:       # o -> AR -> MLP -> AR per token chunk: independent chains XLA can overlap
        return jnp.concatenate([after_attention(xc, ac, lp, nxt, psum, pf_bytes)
                                for xc, ac in zip(jnp.split(x, split), jnp.split(a, split))])
    return after_attention(x, a, lp, nxt, psum, pf_bytes)


def after_attention(x, a, lp, nxt, psum, pf_bytes):
    part = a @ lp["o"]
    toks = prefetch([lp["gate_up"]], part, pf_bytes) if pf_bytes else []
    y = psum(part)
    y = join(y, toks)
    x = x + y
    gu = jnp.einsum("th,hci->tci", rms(x), lp["gate_up"])
    part = (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ lp["down"]
    nxt_w = ([nxt["qkv"]] if "qkv" in nxt else [nxt["q"], nxt["k"], nxt["v"]]) if nxt else []
    toks = prefetch(nxt_w, part, pf_bytes) if (pf_bytes and nxt) else []
    y = psum(part)
    y = join(y, toks)
    return x + y


def stack(x, layers, *, psum, pf_bytes, split=1):
    for i, lp in enumerate(layers):
        x = layer_local(x, lp, layers[i + 1] if i + 1 < len(layers) else None, psum=psum, pf_bytes=pf_bytes,
                        split=split)
    return x


SPECS = {"q": P(None, "tp"), "k": P(None, "tp"), "v": P(None, "tp"), "o": P("tp", None),
         "gate_up": P(None, None, "tp"), "down": P("tp", None)}
SHAPES = {"q": (H, Q), "k": (H, KV), "v": (H, KV), "o": (Q, H), "gate_up": (H, 2, I), "down": (I, H)}


def car_all_reduce(y):
    from jaxserve.kernels import custom_allreduce
    return custom_allreduce.all_reduce(y)


def make(mesh):
    gens = {name: jax.jit(lambda key, s=shape: jax.random.normal(key, s, DT) * jnp.asarray(0.02, DT),
                          out_shardings=NamedSharding(mesh, SPECS[name])) for name, shape in SHAPES.items()}
    layers = [{name: gens[name](jax.random.key(li * 16 + j)) for j, name in enumerate(SHAPES)} for li in range(L)]
    x = jax.jit(lambda: jnp.ones((T, H), DT), out_shardings=NamedSharding(mesh, P()))()
    return x, layers


def build(variant, mesh):
    fuse = variant.endswith("-qkv")     # the layers already hold "qkv" (time_variant concatenates per device)
    variant = variant.removesuffix("-qkv")
    if fuse and variant.startswith("gspmd"):
        raise ValueError("-qkv needs per-device offsets to split q/k/v: use it with tp1 or sm variants")
    split = int(variant.split("-split")[1]) if "-split" in variant else 1
    variant = variant.split("-split")[0]
    if variant in ("tp1", "gspmd"):
        return jax.jit(lambda x, layers: stack(x, layers, psum=lambda y: y, pf_bytes=0, split=split))
    pf = int(variant.split("pf")[1]) * MIB if "+pf" in variant else 0
    psum = {"sm-noar": lambda y: y, "sm-car": lambda y: car_all_reduce(y)}.get(
        variant, lambda y: jax.lax.psum(y, "tp"))
    specs = [{n: SPECS[n] for n in SHAPES} | ({"qkv": P(None, "tp")} if fuse else {}) for _ in range(L)]
    body = lambda x, layers: stack(x, layers, psum=psum, pf_bytes=pf, split=split)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs), out_specs=P(), check_vma=False))


def between_first_ar(text):
    """Op names XLA scheduled between the first all-reduce-start and its done (entry computation)."""
    lines = [ln.strip() for ln in text[text.find("ENTRY"):].splitlines()]
    for i, ln in enumerate(lines):
        if "all-reduce-start" in ln and "=" in ln:
            name = ln.split("=")[0].strip().lstrip("%").split()[0]
            out = []
            for ln2 in lines[i + 1:]:
                if "all-reduce-done" in ln2 and name in ln2:
                    return out
                lhs, _, rhs = ln2.partition("=")
                op = rhs.strip().split("(")[0].split()
                if op and lhs.strip():
                    out.append(op[-1] + ":" + lhs.strip().lstrip("%").split()[0])
            return out
    return None


def time_variant(variant, mesh):
    x, layers = make(mesh)
    if variant.endswith("-qkv"):   # per device [q_local | k_local | v_local]: concatenate shard by shard
        cat = jax.jit(jax.shard_map(lambda q, k, v: jnp.concatenate([q, k, v], axis=1), mesh=mesh,
                                    in_specs=(P(None, "tp"),) * 3, out_specs=P(None, "tp")))
        layers = [lp | {"qkv": cat(lp["q"], lp["k"], lp["v"])} for lp in layers]
    f = build(variant, mesh)
    t0 = time.perf_counter()
    comp = f.lower(x, layers).compile()
    compile_s = time.perf_counter() - t0
    y = comp(x, layers)
    shards = y.addressable_shards
    first = np.asarray(shards[0].data, np.float32) if shards else None
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(args.reps):
            y = comp(y, layers)
        y.block_until_ready()
        ts.append((time.perf_counter() - t) / args.reps)
    text = comp.as_text()
    if args.dump and jax.process_index() == 0:
        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, f"{variant}.hlo.txt"), "w") as fh:
            fh.write(text)
    n_ar = text.count("all-reduce-start(") or text.count("all-reduce(")
    try:
        mid = between_first_ar(text)
    except Exception as e:  # noqa: BLE001  (a diagnostic column; never lose the timing to a parse)
        mid = [f"unparsed: {e!r}"]
    return min(ts) * 1e3, compile_s, n_ar, mid, first


def main():
    devs = jax.devices()
    runs = []
    pf_variants = [f"sm+pf{mb}" for mb in args.pf_mb]
    if args.pid is None and len(devs) >= 1:
        runs.append(("tp1", Mesh(devs[:1], ("tp",))))
    if len(devs) >= 2:
        mesh = Mesh(devs[:2], ("tp",))
        runs += [(v, mesh) for v in ("gspmd", "sm", "sm-noar", *pf_variants)]
        if args.pid is not None:       # the CUDA all-reduce needs one process per GPU (CUDA IPC)
            runs.append(("sm-car", mesh))
    if args.variants:      # base variants as named, derived ones (<base>-qkv, <base>-split<N>) on their base's mesh
        meshes = dict(runs)
        derived = [(v, max((n for n in meshes if v.startswith(n + "-")), key=len, default=None))
                   for v in args.variants if v not in meshes]
        runs = [r for r in runs if r[0] in args.variants] + [(v, meshes[b]) for v, b in derived if b]
    lead = jax.process_index() == 0
    if any(v.startswith("sm-car") for v, _ in runs):
        from jaxserve.kernels import custom_allreduce
        n = jax.process_count()
        custom_allreduce.setup(jax.local_devices()[0], jax.process_index(), n,
                               custom_allreduce.distributed_exchange(jax.process_index(), n))
    if lead:
        print(f"| variant | procs | ms/forward ({L} layers, T={T}) | us/layer | compile s | all-reduces | "
              f"max diff / max (vs tp1, or sm) | between first AR start/done |", flush=True)
        print("|---|---|---|---|---|---|---|---|", flush=True)
    outs = {}
    for variant, mesh in runs:
        ms, cs, n_ar, mid, out = time_variant(variant, mesh)
        outs[variant] = out
        base = variant.removesuffix("-qkv").split("-split")[0]
        ref = outs.get("sm" if base.startswith(("sm+", "sm-car")) else "tp1", outs.get("gspmd")) if base == variant \
            else outs.get(base)                                                          # same math
        diff = "" if (variant == "sm-noar" or out is None or ref is None) else \
            f"{float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))):.2g}"
        if lead:
            mid_s = "n/a" if mid is None else (", ".join(mid[:6]) + (" ..." if len(mid) > 6 else "") or "(nothing)")
            print(f"| {variant} | {jax.process_count()} | {ms:.3f} | {ms * 1e3 / L:.1f} | {cs:.1f} | {n_ar} | "
                  f"{diff} | {mid_s} |", flush=True)


if __name__ == "__main__":
    main()
