"""Qwen-VL's vision tower, its full-attention layers dense (the ``block x N`` query blocks of f5e35e6) against
this tree's (``segment_attention``: blockwise, key blocks outside a query block's images skipped, past
``2 * QUERY_BLOCK`` patches) and other block sizes, interleaved, best of N.

Random weights on a widened tower (``--width``, ``--heads``, ``--depth``; blocks 1 and 3 full attention, windows of
112 pixels: Qwen2.5-VL's layout) in float32. Cases: one 1024²-class image (1036², 5,476 patches, a 6,144-patch
bucket); four 448² images as the encoder cache packs them (a row each) and forced into one row. ``--siglip``:
a SigLIP-shaped tower (CLIP / SigLIP's shared ``VisionLayer``) on one 896² image (Gemma 3's 4,096 positions).
Prints each variant's best time, the compiled program's temporary bytes (XLA's memory analysis) and its
largest difference from the dense outputs.

    python -m benchmarks.vision_tower_attention --rounds 5             (--window 0: Qwen2-VL's all-full tower)
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.layers import qwen_vision, vision
from jaxserve.models.layers.qwen_vision import QwenVisionSpec, QwenVisionTower, image_blocks, pack
from jaxserve.models.layers.segment_attention import segment_attention
from jaxserve.models.layers.vision import VisionSpec, VisionTransformer, _attend
from jaxserve.runner.encoder_cache import MIN_PATCH_BUCKET, patch_bucket


def dense_segments(q, k, v, seg, span, query_block=4096):
    """The full-attention layers as at f5e35e6: scores ``N x N``, or ``block x N`` per query block past 4096."""
    r, n, heads, hd = q.shape
    if span is not None:
        q, k, v = (t.reshape(r * n // span, span, heads, hd) for t in (q, k, v))
        seg = seg.reshape(r * n // span, span)
    elif n > query_block:
        block = next(d for d in range(min(n, query_block), 0, -1) if n % d == 0)
        qs = q.reshape(r, n // block, block, heads, hd).swapaxes(0, 1)
        segs = seg.reshape(r, n // block, block).swapaxes(0, 1)
        out = jax.lax.map(lambda a: _attend(a[0], k, v, a[1][:, :, None] == seg[:, None, :]), (qs, segs))
        return out.swapaxes(0, 1).reshape(r, n, heads * hd)
    out = _attend(q, k, v, seg[:, :, None] == seg[:, None, :])
    return out.reshape(r, n, heads * hd)


def blockwise_segments(block: int, dynamic: bool):
    def attend(q, k, v, seg, span):
        if span is None and q.shape[1] > block:
            return segment_attention(q, k, v, seg, block, dynamic)
        return dense_segments(q, k, v, seg, span)
    return attend


def tower_spec(width: int, heads: int, depth: int, window: int) -> QwenVisionSpec:
    return QwenVisionSpec(hidden_size=width, intermediate_size=2 * width, num_heads=heads, depth=depth,
                          in_channels=3, patch_size=14, merge=2, temporal_patch_size=2, out_hidden_size=width,
                          rope_theta=10000.0, norm="rms", mlp="gated", activation="silu", window=window,
                          full_blocks=tuple(range(1, depth, 2)))


def cases(spec: QwenVisionSpec, sides: list[int], rng) -> dict:
    """name → (rows of payloads, rows, bucket)."""
    def image(side):
        return image_blocks(rng.standard_normal((3, side, side)).astype(np.float32), spec.patch_size, spec.merge)
    out = {}
    for side in sides:
        big = image(side)
        bucket = patch_bucket(spec.patches(big.shape), spec.unit, MIN_PATCH_BUCKET)
        out[f"one {side}² image (bucket {bucket})"] = ([[big]], 1, bucket)
    small = [image(448) for _ in range(4)]
    each = patch_bucket(spec.patches(small[0].shape), spec.unit, MIN_PATCH_BUCKET)
    row = patch_bucket(4 * spec.patches(small[0].shape), spec.unit, MIN_PATCH_BUCKET)
    out[f"4 × 448², a row each (4 × {each})"] = ([[s] for s in small], 4, each)
    out[f"4 × 448² in one row ({row})"] = ([small], 1, row)
    return out


def random_state(module):
    graphdef, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return graphdef, jax.tree.unflatten(tree, [jax.random.normal(kk, x.shape, jnp.float32) * 0.05
                                               for kk, x in zip(keys, leaves)])


def compare(name: str, graphdef, state, inputs: tuple, variants: dict, install, rounds: int, pick=None) -> None:
    """Each variant's program (``install(variant)`` before tracing it), interleaved rounds, best of ``rounds``;
    ``pick``: the output rows compared (an image's tokens)."""
    fns, temp, outs = {}, {}, {}
    for label, attend in variants.items():
        install(attend)                                  # traced into this variant's program only
        compiled = jax.jit(lambda s, x: nnx.merge(graphdef, s)(*x)).lower(state, inputs).compile()
        mem = compiled.memory_analysis()
        temp[label] = getattr(mem, "temp_size_in_bytes", 0) if mem is not None else 0
        fns[label] = compiled
        out = np.asarray(compiled(state, inputs))
        outs[label] = out.reshape(-1, out.shape[-1])[pick] if pick is not None else out
    best = {label: float("inf") for label in variants}
    for _ in range(rounds):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(state, inputs))
            best[label] = min(best[label], time.perf_counter() - t0)
    ref = next(iter(outs.values()))
    print(f"\n{name}")
    for label in variants:
        err = float(np.abs(outs[label] - ref).max())
        print(f"  {label:24s} best {best[label] * 1e3:8.1f} ms   temp {temp[label] / 2**20:8.1f} MiB   "
              f"max |diff| {err:.1e}", flush=True)


def siglip(args) -> None:
    """A SigLIP-shaped tower (Gemma 3's: no class token, 896 pixels, patch 14: 4,096 positions), widened."""
    spec = VisionSpec(hidden_size=args.width, intermediate_size=2 * args.width, num_layers=args.depth,
                      num_heads=args.heads, image_size=896, patch_size=14, activation="gelu_pytorch_tanh",
                      class_token=False, patch_bias=True, pre_norm=False, post_norm=True)
    graphdef, state = random_state(VisionTransformer(spec))
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 896, 896)), jnp.float32)
    variants = {"dense (f5e35e6)": _attend, "this tree": vision._attend_all}
    compare(f"SigLIP-shaped tower, one 896² image ({spec.num_patches} positions)", graphdef, state, (pixels,),
            variants, lambda f: setattr(vision, "_attend_all", f), args.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=320)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--window", type=int, default=4, help="window side in merge blocks (0: Qwen2-VL, all full)")
    ap.add_argument("--sides", default="1036", help="single images of these sides (pixels, multiples of 28)")
    ap.add_argument("--blocks", default="", help="also segment_attention at these block sizes (e.g. 256,1024)")
    ap.add_argument("--static", action="store_true", help="also the static trip count (every key block)")
    ap.add_argument("--only", default="", help="run the cases whose name holds this")
    ap.add_argument("--siglip", action="store_true", help="a SigLIP-shaped tower (Gemma 3's) instead")
    args = ap.parse_args()
    if args.siglip:
        return siglip(args)
    spec = tower_spec(args.width, args.heads, args.depth, args.window)
    graphdef, state = random_state(QwenVisionTower(spec))
    variants = {"dense (f5e35e6)": dense_segments, "this tree": qwen_vision._attend_segments}
    for b in (int(x) for x in args.blocks.split(",") if x):
        variants[f"blockwise {b}"] = blockwise_segments(b, True)
        if args.static:
            variants[f"blockwise {b} static"] = blockwise_segments(b, False)
    rng = np.random.default_rng(0)
    for name, (rows, num_rows, bucket) in cases(spec, [int(x) for x in args.sides.split(",")], rng).items():
        if args.only not in name:
            continue
        inputs, tokens, _ = pack(spec, rows, num_rows, bucket)
        compare(f"{name}: {num_rows} x {bucket} patches", graphdef, state, tuple(jnp.asarray(a) for a in inputs),
                variants, lambda f: setattr(qwen_vision, "_attend_segments", f), args.rounds,
                np.concatenate(tokens))


if __name__ == "__main__":
    main()
