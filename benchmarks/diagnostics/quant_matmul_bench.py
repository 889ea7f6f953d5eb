"""Quantized projection matmuls vs bf16 at Llama-3.1-8B's shapes: the int4 W4A16 Pallas kernel (the launch the
engine uses), the int4 dequantize-then-dot path (the engine's prefill path), FP8 W8A8 (XLA's fp8 dot) and the
bf16 dot, at decode (M = 1, 4, 16, 64) and prefill (M = 256, 2048) sizes; at decode sizes also FP8 as W8A16
(the weight converted inside XLA's GEMM, no activation quantization).

Each figure is one matmul's share of ``--layers`` matmuls over as many distinct weights inside one jitted
program, as the model's layers run them: a separate dispatch per matmul would measure the ~40 us launch, and one
weight reused would be read from L2. Prints a markdown table row by row (a run cut short still says something):
microseconds per matmul, the weight-read rate in TB/s and its share of the read ceiling
(configs/hardware/h200.yaml), and the speed-up over bf16. ``--tune`` then sweeps the int4 kernel's launch
options (``kernels.int4_matmul_pallas.Config``; a handful per shape) at ``--tune-m`` after the table and prints
each result and the best per shape.

    python -m benchmarks.diagnostics.quant_matmul_bench [--tune] [--tune-m 4,16] [--m 1,4,16] [--out FILE]
        [--write-launches kernels/int4_launches.json]   # the sweep's best launches for the engine, then the table
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.diagnostics.timing import back_to_back_seconds
from jaxserve.kernels import int4_matmul_pallas as k4
from jaxserve.quantization import online
from jaxserve.quantization.weights import INT4_KERNEL_MAX_TOKENS, _fp8_matmul

READ_CEILING = 4.60e12          # configs/hardware/h200.yaml read_bandwidth
# (name, K, N) of one Llama-3.1-8B layer's projections (gate_up fused: N = 2 x 14336)
SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "q/o": (4096, 4096), "k/v": (4096, 1024)}
M_SIZES = (1, 4, 16, 64, 256, 2048)
GROUP = 128


def time_us(fn, args, layers: int, iters: int = 10) -> float:
    """Microseconds per matmul: the best of 3 runs of ``iters`` calls, each call ``layers`` matmuls."""
    return min(back_to_back_seconds(fn, *args, iters=iters, repeats=3)) / layers * 1e6


def layered(matmul):
    """One program: every layer's activation times its own weight (distinct activations, so no common work is
    shared between layers, as none is in the model)."""
    return jax.jit(lambda xs, ws: [matmul(x, w) for x, w in zip(xs, ws)])


@dataclasses.dataclass
class Weights:
    bf16: list
    int4: list          # (packed, scales, zeros) per layer
    fp8: list

    @property
    def int4_bytes(self) -> int:
        return sum(a.nbytes for a in self.int4[0])

    @property
    def fp8_bytes(self) -> int:
        return self.fp8[0].weight.nbytes + self.fp8[0].scale.nbytes


def make_weights(k: int, n: int, layers: int, kinds=("bf16", "int4", "fp8")) -> Weights:
    out = Weights([], [], [])
    quant4 = jax.jit(lambda w: online.quantize_int4(w, GROUP, jnp.bfloat16))
    for layer in range(layers):
        w = jax.random.normal(jax.random.key(layer), (k, n), jnp.bfloat16) * 0.02
        if "int4" in kinds:
            q = quant4(w)
            out.int4.append((q.packed, q.scales, q.zeros))
        if "fp8" in kinds:
            out.fp8.append(online.quantize_fp8_per_channel(w))
        if "bf16" in kinds:
            out.bf16.append(w)
        else:
            del w
    return out


def activations(m: int, k: int, layers: int) -> list:
    return [jax.random.normal(jax.random.key(1000 + i), (m, k), jnp.bfloat16) for i in range(layers)]


def int4_fn(config: k4.Config | None = None, live_rows: int | None = None):
    """``live_rows``: the step's real rows (the engine passes them: batch 1 is one live row of a bucket of 4)."""
    live = None if live_rows is None else jnp.int32(live_rows)
    return layered(lambda x, w: k4.int4_matmul(x, *w, group_size=GROUP, config=config, live_rows=live))


def tune_configs(m: int, k: int, n: int) -> list[k4.Config]:
    """The launches worth trying at this size, the likeliest first: the gemv kernel (one multiply-add per weight
    and row; 64-row steps give a thread 8 columns), the fma kernel at one row and the dot kernel from two, with
    the split-K heuristic's choice and twice / half of it."""
    R = dataclasses.replace

    def splits(c: k4.Config) -> list[k4.Config]:
        k_blocks = k // k4.step_rows(c, GROUP)
        tiles = n // c.block_n * (1 if c.method != "dot" else -(-m // 16))
        auto = k4._split_k(k_blocks, tiles, c.num_warps, c.unroll, k4.GEMV_MIN_STEPS if c.method == "gemv" else 1)
        return [R(c, split_k=auto * 2), R(c, split_k=max(1, auto // 2))]

    gemv = k4.Config("gemv", block_n=256, block_k=64, num_warps=1)
    fma = k4.Config("fma", block_n=128, num_warps=1)
    dot = k4.Config("dot", block_n=128, num_warps=8, num_stages=3)
    gemv_variants = [gemv, R(gemv, block_n=128, block_k=None), R(gemv, block_n=128, block_k=32),
                     R(gemv, block_n=512, num_warps=2), *splits(gemv), R(gemv, unroll=2)]
    if m == 1:
        cands = [*gemv_variants, fma, *splits(fma), dot]
    elif m <= k4.GEMV_MAX_ROWS:        # the dot kernel second: a short sweep still has both kinds
        cands = [gemv_variants[0], dot, *gemv_variants[1:], R(dot, block_n=64, num_warps=4), *splits(dot),
                 R(dot, unroll=2)]
    else:
        cands = [dot, R(dot, block_n=64, num_warps=4), R(dot, block_n=256), R(dot, unroll=2), R(dot, num_stages=2),
                 *splits(dot), R(dot, block_n=64, num_warps=4, unroll=2), R(dot, num_warps=4)]
    seen, out = set(), []
    for c in cands:
        k_blocks = k // k4.step_rows(c, GROUP)
        if c not in seen and (c.split_k is None or k_blocks % c.split_k == 0) and n % c.block_n == 0:
            seen.add(c)
            out.append(c)
    return out


def describe(c: k4.Config) -> str:
    bk = f" bk={c.block_k}" if c.block_k else ""
    return (f"{c.method} bn={c.block_n}{bk} split={c.split_k or 'auto'} unroll={c.unroll} warps={c.num_warps} "
            f"stages={c.num_stages}")


def tune(shapes, ms, layers: int, max_configs: int, emit) -> list[dict]:
    """Times each launch of ``tune_configs`` (and the gemv ones again with one live row, the engine's batch 1
    in a bucket of more rows); returns the best per (shape, M, live rows) as ``int4_launches.json`` entries."""
    emit("| shape | M | live rows | us | TB/s (% read) | speed-up over bf16 | launch |")
    emit("|---|---|---|---|---|---|---|")
    best = []
    bf16 = layered(lambda x, w: x @ w)
    for name in shapes:
        k, n = SHAPES[name]
        w = make_weights(k, n, layers, kinds=("int4", "bf16"))
        for m in ms:
            xs = activations(m, k, layers)
            t_bf16 = time_us(bf16, (xs, w.bf16), layers)
            emit(f"| {name} | {m} | | {t_bf16:.1f} | | 1.00x | bf16 (XLA) |")
            want = np.asarray(jax.jit(lambda x, p: k4.int4_matmul_reference(x, *p, GROUP))(xs[0], w.int4[0]),
                              np.float32)
            results = {None: [], 1: []}
            for cfg in tune_configs(m, k, n)[:max_configs]:
                for live in ([None, 1] if cfg.method == "gemv" and m > 1 else [None]):
                    fn = int4_fn(cfg, live)
                    try:
                        got = np.asarray(fn(xs, w.int4)[0], np.float32)
                        us = time_us(fn, (xs, w.int4), layers)
                    except Exception as e:  # noqa: BLE001  (a launch Triton cannot compile is skipped, and said)
                        emit(f"| {name} | {m} | {live or m} | skip | | | {describe(cfg)}: {type(e).__name__} |")
                        continue
                    rows = live or m            # the padding rows of a one-live-row call come back zero
                    err = np.abs(got[:rows] - want[:rows]).max() / (np.abs(want).max() + 1e-9)
                    if err > 0.02 or (rows < m and np.abs(got[rows:]).max() > 0):
                        emit(f"| {name} | {m} | {live or m} | MISMATCH | | | {describe(cfg)}: relative {err:.3g} |")
                        continue
                    results[live].append((us, describe(cfg), cfg))
                    rate = w.int4_bytes / us / 1e6
                    emit(f"| {name} | {m} | {live or m} | {us:.1f} | {rate:.2f} ({100e12 * rate / READ_CEILING:.0f} %) "
                         f"| {t_bf16 / us:.2f}x | {describe(cfg)} |")
            if m > 1:       # a launch without the live-row loop costs its all-rows time at one live row too
                results[1] += [r for r in results[None] if r[2].method != "gemv"]
            for live, rs in results.items():
                if rs and (live is None or m > 1):
                    us, what, cfg = min(rs, key=lambda r: r[0])
                    emit(f"| **{name}** | **{m}** | **{live or m}** | **{us:.1f}** | best | **{t_bf16 / us:.2f}x** | {what} |")
                    best.append({"key": k4.launch_key(k, n, m, live == 1), "us": round(us, 2),
                                 "config": dataclasses.asdict(cfg)})
        del w
    return best


def write_launches(path: str, entries: list[dict]) -> None:
    """The tuned table the engine reads (``kernels.int4_matmul_pallas.LAUNCHES_FILE``), merged into ``path``'s
    entries for other shapes."""
    old = json.loads(pathlib.Path(path).read_text())["launches"] if pathlib.Path(path).exists() else []
    keys = {e["key"] for e in entries}
    merged = [e for e in old if e["key"] not in keys] + entries
    doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "group_size": GROUP,
           "launches": sorted(merged, key=lambda e: e["key"])}
    pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def table(shapes, ms, layers: int, emit) -> None:
    emit("| shape | M | bf16 us | int4 us (path) | int4 TB/s (% read) | fp8 us | fp8 TB/s (% read) | "
         "int4 / fp8 speed-up | fp8 W8A16 us | int4 us, 1 row live (speed-up) |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    bf16 = layered(lambda x, w: x @ w)
    kernel, dequant = int4_fn(), layered(lambda x, w: k4.int4_matmul_reference(x, *w, GROUP))
    fp8 = layered(lambda x, w: _fp8_matmul(x, w, w.weight.shape[0]))
    # what JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS switches decode steps to: no activation quantization, the weight's
    # e4m3 -> bf16 convert left for XLA to fuse into its GEMM, the channel scale on the result
    fp8_w8a16 = layered(lambda x, w: (jax.lax.dot_general(x, w.weight.astype(x.dtype), (((1,), (1,)), ((), ())),
                                                          preferred_element_type=jnp.float32) * w.scale
                                      ).astype(x.dtype))
    for name in shapes:
        k, n = SHAPES[name]
        w = make_weights(k, n, layers)
        for m in ms:
            xs = activations(m, k, layers)
            t_bf16 = time_us(bf16, (xs, w.bf16), layers)
            use_kernel = m <= INT4_KERNEL_MAX_TOKENS and k4.supports(m, k, n, GROUP)
            t_4 = time_us(kernel if use_kernel else dequant, (xs, w.int4), layers)
            t_8 = time_us(fp8, (xs, w.fp8), layers)
            w8a16 = f"{time_us(fp8_w8a16, (xs, w.fp8), layers):.1f}" if m <= INT4_KERNEL_MAX_TOKENS else "–"
            live = "–"
            live_cfg = k4.default_config(m, k, n, GROUP, live_one=True)
            if use_kernel and 1 < m and live_cfg.method == "gemv":     # the engine's batch 1 in this bucket
                t_live = time_us(int4_fn(live_cfg, 1), (xs, w.int4), layers)
                live = f"{t_live:.1f} ({t_bf16 / t_live:.2f}x)"
            note = ""
            if use_kernel and m <= 4:       # one check per kernel (fma at 1 row, dot above): compiles are the cost
                got = kernel(xs[:1], w.int4[:1])[0].astype(jnp.float32)
                want = dequant(xs[:1], w.int4[:1])[0].astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-9))
                note = "" if err < 0.02 else f" MISMATCH (relative {err:.3g})"
            r4, r8 = w.int4_bytes / t_4 / 1e6, w.fp8_bytes / t_8 / 1e6
            emit(f"| {name} {k}x{n} | {m} | {t_bf16:.1f} | {t_4:.1f} ({'kernel' if use_kernel else 'dequant'}) | "
                 f"{r4:.2f} ({100e12 * r4 / READ_CEILING:.0f} %) | {t_8:.1f} | {r8:.2f} "
                 f"({100e12 * r8 / READ_CEILING:.0f} %) | {t_bf16 / t_4:.2f}x / {t_bf16 / t_8:.2f}x | {w8a16} | {live} |{note}")
        del w


NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier"}


def llama8b_config(layers: int):
    from jaxserve.config import ModelConfig  # noqa: PLC0415
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=4096,
                       tie_word_embeddings=False)


def step_kernels(quant: str, layers: int, tokens: int) -> collections.Counter:
    """The top-level operations (each a kernel launch on a GPU, bar bitcasts and tuples) of the compiled
    decode forward of a Llama-3.1-8B-shaped model of ``layers`` layers with ``quant`` projections (bf16, int4,
    fp8), by HLO opcode. Compiled from abstract weights: nothing is allocated, so it runs on a CPU too."""
    from jaxserve.kernels import ops  # noqa: PLC0415
    from jaxserve.kernels.metadata import AttentionMetadata  # noqa: PLC0415
    from jaxserve.models import llama  # noqa: PLC0415
    from jaxserve.quantization import loading  # noqa: PLC0415
    cfg = llama8b_config(layers)

    def transform(path, w):
        if not loading.is_linear(path) or quant == "bf16":
            return w
        return online.quantize_int4(w, GROUP, jnp.bfloat16) if quant == "int4" else online.quantize_fp8_per_channel(w)

    params = jax.eval_shape(lambda: llama.FAMILY.init_dummy_params(cfg, jnp.bfloat16, transform=transform))
    caches = jax.eval_shape(lambda: ops.init_kv_caches(layers, 64, 16, cfg.num_kv_heads, cfg.head_dim,
                                                       jnp.bfloat16))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
    md = AttentionMetadata(slot_mapping=i32(tokens), block_tables=i32(tokens, 16), seq_lens=i32(tokens),
                           query_start_loc=i32(tokens + 1), num_seqs=i32(), decode_only=True)
    backend = "pallas" if jax.default_backend() == "gpu" else "reference"

    def step(params, caches, ids, pos, md):
        return llama.FAMILY.forward(params, caches, ids, pos, md, cfg, attn_backend=backend)

    text = jax.jit(step).lower(params, caches, i32(tokens), i32(tokens), md).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    out = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([a-z\-]+)\(", line)
        if m and m.group(1) not in NOT_KERNELS:
            out[m.group(1)] += 1
    return out


def layer_kernels(quants: list[str], tokens: int, emit) -> None:
    """Kernels per decoder layer (a 2-layer step's less a 1-layer step's) of each weight storage."""
    emit(f"{jax.default_backend()}: kernels per decoder layer of the compiled {tokens}-token decode step")
    emit("| weights | kernels per layer | by HLO opcode |")
    emit("|---|---|---|")
    for quant in quants:
        d = step_kernels(quant, 2, tokens)
        d.subtract(step_kernels(quant, 1, tokens))
        emit(f"| {quant} | {sum(d.values())} | {', '.join(f'{k} {v}' for k, v in d.most_common() if v)} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default=",".join(map(str, M_SIZES)), help="token counts of the table")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=32, help="distinct weights per program (Llama-3.1-8B: 32)")
    ap.add_argument("--tune", action="store_true", help="then sweep the int4 kernel's launch options")
    ap.add_argument("--tune-m", default="1,4,16")
    ap.add_argument("--tune-configs", type=int, default=12, help="launches tried per shape and M")
    ap.add_argument("--no-table", action="store_true", help="only the sweep")
    ap.add_argument("--out", default=None, help="also write the output to this file (as it goes)")
    ap.add_argument("--layer-kernels", default=None, metavar="WEIGHTS",
                    help="only count the kernels per decoder layer of the compiled decode step for these weight "
                         "storages (bf16,int4,fp8; JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS picks fp8's W8A16)")
    ap.add_argument("--write-launches", default=None, metavar="FILE",
                    help=f"write the sweep's best launches for the engine (it reads {k4.LAUNCHES_FILE.name})")
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    out = open(a.out, "w") if a.out else None      # written line by line, like stdout: a cut run keeps its rows

    def emit(line: str) -> None:
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    if a.layer_kernels:
        layer_kernels(a.layer_kernels.split(","), int(a.m.split(",")[0]), emit)
        return 0
    emit(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {a.layers} layers per program, "
         f"groups of {GROUP}; us per matmul")
    tune_first = a.tune and a.write_launches       # then the table times the launches the sweep chose
    if not a.no_table and not tune_first:    # the engine's launches first: a run cut short keeps the headline
        table(shapes, [int(v) for v in a.m.split(",")], a.layers, emit)
        emit("")
    if a.tune:
        best = tune(shapes, [int(v) for v in a.tune_m.split(",")], a.layers, a.tune_configs, emit)
        if a.write_launches:
            write_launches(a.write_launches, best)
            k4.tuned_launches.cache_clear()
            emit(f"wrote {len(best)} launches to {a.write_launches}")
            emit("")
    if not a.no_table and tune_first:
        table(shapes, [int(v) for v in a.m.split(",")], a.layers, emit)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
