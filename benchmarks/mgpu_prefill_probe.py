"""Quick H200 probe of the Mosaic GPU prefill kernel (kernels/prefill_mgpu.py): correctness against the
reference, then 8 x 2048 causal (no cache / 2048 cached prefix) and the mixed step for a few launch
configurations, next to our Triton prefill and the stock Mosaic GPU FA3 in the same process.

    python benchmarks/mgpu_prefill_probe.py [--configs 128x2 128x2p 64x2 64x3] [--engine-cases] [--repeat N]
    (p: persistent layout)
"""
from __future__ import annotations

import argparse
import functools
import sys
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from benchmarks import kernels_bench as kb  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["128x2", "64x2", "64x3"], help="block_kv x stages")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--block-sizes", nargs="+", type=int, default=[16], help="cache page sizes to time")
    ap.add_argument("--skip-others", action="store_true", help="no stock FA3 / cuDNN rows")
    ap.add_argument("--skip-triton", action="store_true", help="no Triton rows")
    ap.add_argument("--repeat", type=int, default=1, help="time the whole table N times (run-to-run spread)")
    ap.add_argument("--engine-cases", action="store_true",
                    help="also the engine's prefill step shapes (2048 token slots: 1 x 2048, 4 x 512, a 2048 chunk on "
                         "a 6144 prefix)")
    a = ap.parse_args(argv)
    S = kb.Sizes()
    kb.log(f"# mgpu_prefill_probe: jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if not a.skip_check:
        kb.log("## correctness (bf16, vs the pure-jnp reference)")
        kb.check_mgpu_prefill(S, [1, 1, 37, 1, 130, 1], [700, 33, 37, 1, 300, 17])
        kb.check_mgpu_prefill(S, [1, 1, 37, 1, 130, 1], [700, 33, 37, 1, 300, 17], mgpu_persistent=True)
    B, L = S.prefill_b, S.prefill_len
    nd, nc, c = S.mixed_decodes, S.mixed_chunks, S.mixed_chunk
    cases = {"8x2048 causal": ([L] * B, [L] * B), "8x2048 on 2048 prefix": ([L] * B, [2 * L] * B),
             f"mixed {nd}d+{nc}x{c}": ([1] * nd + [c] * nc, [S.mixed_ctx] * nd + [2 * c] * nc)}
    if a.engine_cases:
        cases.update({"1x2048": ([L], [L]), "4x512": ([L // 4] * 4, [L // 4] * 4),
                      "2048 on 6144 prefix": ([L], [4 * L])})
    cfgs = {"triton default": {}, "triton decode_stages=2": dict(decode_stages=2)}
    if a.skip_triton:
        cfgs = {}
    for spec in a.configs:
        persistent = spec.endswith("p")
        bk, st = map(int, spec.rstrip("p").split("x"))
        cfgs[f"mgpu bk{bk} st{st}{' persistent' if persistent else ''}"] = dict(
            prefill_kernel="mgpu", fused=False, mgpu_block_kv=bk, mgpu_stages=st, mgpu_persistent=persistent)
    for rep in range(a.repeat):
        if a.repeat > 1:
            kb.log(f"\n### repeat {rep + 1} of {a.repeat}")
        table(a, S, cfgs, cases)


def table(a, S, cfgs, cases):
    import dataclasses
    B, L = S.prefill_b, S.prefill_len
    kb.log("| kernel | page size | " + " | ".join(cases) + " |")
    kb.log("|---|---|" + "---|" * len(cases))
    for (name, cfg), bs in [(c, b) for b in a.block_sizes for c in cfgs.items()]:
        Sb = dataclasses.replace(S, bs=bs)
        cells = []
        for ql, cl in cases.values():
            try:
                t, tf = kb.time_ragged(Sb, ql, cl, **cfg)
                cells.append(f"{t * 1e3:.3f} ms, {tf:.0f} TFLOP/s")
            except Exception as e:
                cells.append(f"failed: {type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc()
                break
        kb.log(f"| {name} | {bs} | " + " | ".join(cells) + " |")
    if a.skip_others:
        return
    key = jax.random.key(3)
    q = jax.random.normal(key, (B, L, S.hq, S.d), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (B, L, S.kvh, S.d), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (B, L, S.kvh, S.d), jnp.bfloat16)
    flops = 4 * S.hq * S.d * B * L * (L + 1) // 2
    for name, f in {"stock Mosaic GPU FA3 (fp16, dense)": kb.mgpu_fa3,
                    "cuDNN": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                          implementation="cudnn")}.items():
        fn = jax.jit(lambda q, k, v, f=f: functools.reduce(lambda acc, _: f(acc, k, v), range(S.n_iter), q))
        t = kb.timed(fn, q, k, v, n_iter=S.n_iter, reps=S.reps)
        kb.log(f"| {name} | {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s | | |")


if __name__ == "__main__":
    main()
