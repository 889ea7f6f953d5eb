"""Where a batch-1 decode step's time goes, per XLA flag set and tensor-parallel size (one fresh process per variant).

    python benchmarks/diagnostics/step_diag.py                          # 1 GPU: Llama-3.1-8B dummy bf16, TP=1, flag sets
    python benchmarks/diagnostics/step_diag.py --tp 1 2                 # 2 GPUs: TP=1 and TP=2
    python benchmarks/diagnostics/step_diag.py --smoke                  # CPU, tiny model, 2 fake devices (checks the script)
    python benchmarks/diagnostics/step_diag.py --smoke --model tests/fixtures/models/tiny-qwen3moe --profile
    python benchmarks/diagnostics/step_diag.py --layer-kernels --old-tree .ab-old   # kernels per layer, old vs this tree

Each variant (TP size x ``XLA_FLAGS`` set) runs in a child process and reports:
- ``e2e tok/s``: single-stream decode through ``LLM.generate`` (one request, ``--prompt-len`` in,
  ``--decode-tokens`` out; prefill excluded by subtracting a 1-token run), with the engine's host ms/step;
- ``forward ms``: the jitted model forward alone, replayed back to back on the arguments the engine passed it
  in a batch-1 decode step (the KV cache threaded through, as the engine donates it), i.e. device time with
  no host in the way;
- ``sampler ms``: the same for the greedy sampler call -- a small graph, so this is mostly the host's
  dispatch time per call, not device time;
- the compiled forward's collective counts (all-reduce / all-gather / reduce-scatter / collective-permute),
  and ``gap ms`` = e2e ms/token - forward ms - sampler ms (host, launch and sync overhead not hidden).
With ``--profile`` each variant also traces (``jax.profiler``) 10 forward replays and a 16-token decode and
prints, per forward, GPU time by kernel group and how busy the GPU was, and per engine step the host spans
(``benchmarks/diagnostics/profile_summary.py``).
Prints a Markdown table; ``--json`` writes the raw results. Many requests decoding at once (the steady-state
N-row decode step, by host phase): ``decode_phases.py``.

``--layer-kernels [MODEL ...]`` (default: Gemma 2, Gemma 3, Qwen3, Llama 3.1) measures the per-layer fixed cost
instead, without the engine: each model's real widths with ``--layers`` layers and dummy weights, one batch-1
decode step (token bucket 4) compiled as the engine compiles it, its forward ms, and on a GPU the traced
kernels of one layer in launch order (K/V write to K/V write) with their us, the kernels per layer and the idle
time between them inside the CUDA graph. ``--old-tree DIR`` (a plain checkout of another commit) runs the same
measurement on that tree's ``jaxserve`` first, in its own process; ``--flags`` adds XLA flag sets. Qwen3 is
Llama's layer plus a per-head q/k norm, so their difference in kernels per layer is what the q/k norm costs.
A layer is cut at its K/V write: the ``paged_kv_write`` launch, or the decode launch that writes the K/V itself.
``--lowered`` (any host, no GPU needed) lowers the same step's GPU build for CUDA instead of running it and counts
its Pallas launches per layer by kernel name (XLA's own fusions are only decided when a GPU compiles it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)        # benchmarks.diagnostics.profile_summary when run as a script

# Named XLA flag sets to compare (appended to any XLA_FLAGS already in the environment). Those measured without
# effect (PDL, command-buffer update modes, NCCL in the graph, exhaustive tiling, cuBLAS GEMMs) are in
# kernels/README.md's "tried and not adopted" table.
FLAG_SETS = {
    "default": "",
    "no-cmdbuf": "--xla_gpu_enable_command_buffer=",
    # XLA's Triton one-shot all-reduce in place of NCCL
    "coll-kernels": "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE",
    # fewer small kernels per layer? (--layer-kernels): no split-K GEMMs, whose partial sums are a kernel of
    # their own when a norm reads the projection (Gemma's post-norms); Triton fusions with several outputs;
    # XLA's loop/reduction fusions as Triton block-level fusions
    "split-k-1": "--xla_gpu_experimental_force_split_k=1",
    "triton-multi-output": "--xla_gpu_unsupported_enable_triton_multi_output_fusion=true",
    "block-level": "--xla_gpu_experimental_enable_fusion_block_level_rewriter=true",
}


def child(a) -> dict:
    import jax
    import numpy as np

    from jaxserve.llm import LLM
    from jaxserve.runner.model_runner import MIN_TOKEN_BUCKET
    from jaxserve.sampling_params import SamplingParams

    # --smoke: tiny-llama3, or the checkpoint directory --model names (e.g. tests/fixtures/models/tiny-qwen3moe)
    model = a.model if not a.smoke or os.path.isdir(a.model) else os.path.join(REPO, "tests", "fixtures", "models",
                                                                               "tiny-llama3")
    kw = dict(load_format="dummy") if not a.smoke else {}
    llm = LLM(model, dtype=a.dtype, tensor_parallel_size=a.tp_one, max_model_len=a.max_model_len,
              max_num_seqs=16, max_num_batched_tokens=a.max_num_batched_tokens,
              token_buckets=(MIN_TOKEN_BUCKET, a.max_num_batched_tokens), enable_prefix_caching=False,
              use_tqdm_on_load=False, num_scheduler_steps=a.num_scheduler_steps, **kw)
    runner = llm.engine.runner
    runner.wait_compiled()       # the steady state: the background variants (the short-context decode too) ready
    captured = {}
    variants = runner.variants
    get, need = variants.get, variants.need

    def capturing(key, exe):
        """The step compiler's executable for ``key``, wrapped to keep the arguments of one call: the
        batch-1 decode step's forward (the smallest bucket) after two warm-up calls, then the sampler call
        that follows it."""
        if exe is None or not isinstance(key, tuple):
            return exe
        if key[0] == "forward" and key[1] == MIN_TOKEN_BUCKET:
            def f(*args):
                if "fwd" not in captured and captured.get("seen", 0) >= 2:
                    captured["fwd"] = (exe, tuple(x for i, x in enumerate(args) if i != 1))
                captured["seen"] = captured.get("seen", 0) + 1
                return exe(*args)
            return f
        if key[0] == "sample":
            def g(*args):
                if "fwd" in captured and "sampler" not in captured:
                    captured["sampler"] = (exe, args)
                return exe(*args)
            return g
        return exe

    variants.get = lambda key: capturing(key, get(key))
    variants.need = lambda key, why="first use": capturing(key, need(key, why))
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def run(n_tokens):
        prompt = rng.integers(100, min(vocab, 30000), size=a.prompt_len).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t, len(out[0].outputs[0].token_ids)

    run(16)
    first = min(run(1)[0] for _ in range(3))
    st = runner.stats
    s0, h0 = st.steps, st.host_ms
    full, n = run(a.decode_tokens + 1)
    ms_tok = 1e3 * (full - first) / (n - 1)
    host_ms = (st.host_ms - h0) / max(st.steps - s0, 1)
    variants.get, variants.need = get, need

    res = {"tp": a.tp_one, "flags": a.flag_set, "e2e_tok_s": 1e3 / ms_tok, "ms_per_token": ms_tok,
           "host_ms_per_step": host_ms}
    if "fwd" in captured:
        fwd, (params, *rest) = captured["fwd"]
        caches = runner.kv_caches
        caches, logits, *_ = fwd(params, caches, *rest)
        jax.block_until_ready(logits)
        t = time.perf_counter()
        for _ in range(a.replays):
            caches, logits, *_ = fwd(params, caches, *rest)
        jax.block_until_ready((caches, logits))
        res["forward_ms"] = 1e3 * (time.perf_counter() - t) / a.replays
        if a.profile:
            import tempfile

            from benchmarks.diagnostics.profile_summary import summarize
            with tempfile.TemporaryDirectory() as d:
                jax.profiler.start_trace(d)
                for _ in range(10):
                    caches, logits, *_ = fwd(params, caches, *rest)
                jax.block_until_ready((caches, logits))
                jax.profiler.stop_trace()
                res["profile_forward"] = summarize(d, per=10)
        runner.kv_caches = caches
        try:
            hlo = fwd.as_text()
            res["hlo"] = {op: len(re.findall(rf"\b{op}(-start)?\(", hlo))
                          for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")}
            res["hlo"]["custom-call"] = len(re.findall(r"custom-call\(", hlo))
            res["hlo"]["fusion"] = len(re.findall(r"\bfusion\(", hlo))
        except Exception as e:  # diagnostics only
            res["hlo_error"] = f"{type(e).__name__}: {e}"[:200]
    if "sampler" in captured:
        f, args = captured["sampler"]
        jax.block_until_ready(f(*args))
        t = time.perf_counter()
        for _ in range(a.replays):
            out = f(*args)
        jax.block_until_ready(out)
        res["sampler_ms"] = 1e3 * (time.perf_counter() - t) / a.replays
    if a.profile:
        import tempfile

        from benchmarks.diagnostics.profile_summary import summarize
        with tempfile.TemporaryDirectory() as d:
            s0 = runner.stats.steps
            jax.profiler.start_trace(d)
            if a.num_scheduler_steps > 1:
                # per decoded token (the trace also holds the 128-token prefill step, a few % of it)
                _, n = run(8 * a.num_scheduler_steps + 1)
                per = n - 1
            else:
                run(16)
                per = runner.stats.steps - s0
            jax.profiler.stop_trace()
            res["profile_e2e"] = summarize(d, per=max(per, 1))
    res["gap_ms"] = ms_tok - res.get("forward_ms", 0.0) - res.get("sampler_ms", 0.0)
    return res


# ------------------------------------------------------------------------------ --layer-kernels: per-layer kernels
LAYER_MODELS = ("gemma-2-9b", "gemma-3-12b", "qwen3-8b", "llama-3.1-8b")


def layer_child(a) -> None:
    """Per model: the jitted forward + logits of a batch-1 decode step (token bucket 4, 4 request rows, one real
    request at ``--context`` tokens, block tables for ``--max-model-len``; the runner's short-context variant
    when the context is within ``metadata.SHORT_SEQ_LEN``) at the model's real widths with
    ``--layers`` layers and dummy weights, as the engine compiles it; its ms per replay, and on a GPU the kernels
    of 5 traced replays cut into layers at each layer's K/V write."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxserve
    from jaxserve.kernels import ops
    from jaxserve.kernels import metadata
    from jaxserve.kernels.metadata import AttentionMetadata
    from jaxserve.models import configs as model_configs
    from jaxserve.models import registry

    lowered = getattr(a, "lowered", False)
    backend = "pallas" if lowered else ops.default_backend()
    dtype = jnp.dtype(a.dtype)
    T = R = 4
    bs = 16
    pages = a.max_model_len // bs
    for name in a.models:
        hf = model_configs.read_json(os.path.join(REPO, "configs", "models", f"{name}.json"))
        hf["num_hidden_layers"] = a.layers
        hf.pop("layer_types", None)        # rederived for the new layer count (Gemma's sliding_window_pattern)
        if a.smoke:
            hf.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, vocab_size=1024)
        cfg = model_configs.model_config_from_hf(hf)
        _, family = registry.resolve_architecture(hf["architectures"])
        if lowered:          # shapes only: nothing is allocated or run
            params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), family.param_shapes(cfg),
                                  is_leaf=lambda x: isinstance(x, tuple))
            caches = [tuple(jax.ShapeDtypeStruct(s, dtype) for s in ops.kv_cache_shapes(
                pages + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype)) for _ in range(a.layers)]
        else:
            params = family.init_dummy_params(cfg, dtype)
            caches = ops.init_kv_caches(a.layers, pages + 1, bs, cfg.num_kv_heads, cfg.head_dim, dtype)
        n_blocks = -(-a.context // bs)
        tables = np.zeros((R, pages), np.int32)
        tables[0, :n_blocks] = np.arange(1, n_blocks + 1)
        slots = np.zeros(T, np.int32)
        slots[0] = tables[0, (a.context - 1) // bs] * bs + (a.context - 1) % bs
        md = AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                               seq_lens=jnp.asarray([a.context, 0, 0, 0], jnp.int32),
                               query_start_loc=jnp.asarray([0, 1, 1, 1, 1], jnp.int32), num_seqs=jnp.int32(1),
                               decode_only=backend != "reference")
        bound = getattr(metadata, "SHORT_SEQ_LEN", None)     # a tree without the runner's short-context variant
        if bound and backend != "reference" and a.context <= bound < a.max_model_len:
            md = dataclasses.replace(md, max_seq_len=bound)     # the variant the runner runs such a step in
        ids = jnp.asarray([7, 0, 0, 0], jnp.int32)
        pos = jnp.asarray([a.context - 1, 0, 0, 0], jnp.int32)

        def step(params, caches, ids, pos, md):
            hidden, caches = family.forward(params, caches, ids, pos, md, cfg, attn_backend=backend)
            return caches, family.compute_logits(params, hidden[jnp.zeros(R, jnp.int32)], cfg)

        if lowered:
            launches = pallas_launches(jax.jit(step, donate_argnums=(1,)), params, caches, ids, pos, md)
            print("RESULT " + json.dumps({
                "model": name, "layers": a.layers, "jaxserve": os.path.dirname(jaxserve.__file__), "lowered": True,
                "pallas_per_layer": sum(launches.values()) / a.layers,
                "pallas_kernels": {k: v / a.layers for k, v in sorted(launches.items())}}), flush=True)
            continue
        fwd = jax.jit(step, donate_argnums=(1,)).lower(params, caches, ids, pos, md).compile()
        hlo = fwd.as_text()
        if a.hlo_dir:        # the GPU's fusion decisions, for working out the next fusion without a GPU
            with open(os.path.join(a.hlo_dir, f"{a.tag}-{name}.hlo.txt"), "w") as fh:
                fh.write(hlo)
        caches, logits = fwd(params, caches, ids, pos, md)
        jax.block_until_ready(logits)
        t = time.perf_counter()
        for _ in range(a.replays):
            caches, logits = fwd(params, caches, ids, pos, md)
        jax.block_until_ready((caches, logits))
        res = {"model": name, "layers": a.layers, "jaxserve": os.path.dirname(jaxserve.__file__), "forward_ms": 1e3 * (time.perf_counter() - t) / a.replays,
               "hlo_fusions": len(re.findall(r"\bfusion\(", hlo)),
               "hlo_custom_calls": len(re.findall(r"custom-call\(", hlo))}
        if jax.default_backend() == "gpu":
            import tempfile

            from jax.profiler import ProfileData

            from benchmarks.diagnostics.profile_summary import kernel_group, latest_xspace
            with tempfile.TemporaryDirectory() as d:
                jax.profiler.start_trace(d)
                for _ in range(5):
                    caches, logits = fwd(params, caches, ids, pos, md)
                jax.block_until_ready((caches, logits))
                jax.profiler.stop_trace()
                data = ProfileData.from_file(latest_xspace(d))
                events = sorted((ev.start_ns, ev.end_ns, kernel_group(ev.name), ev.name) for plane in data.planes
                                if plane.name.startswith("/device:GPU:") for line in plane.lines
                                if line.name.startswith("Stream") for ev in line.events)
            res.update(layer_windows(events, a.layers))
            what = hlo_kernel_ops(hlo)
            for kind in res.get("layer_kinds", []):
                kind["ops"] = [what.get(n.replace(".", "_"), "") for n in kind.pop("names")]
        print("RESULT " + json.dumps(res), flush=True)      # per model: a child cut short keeps the rest
        del params, caches, logits


def pallas_launches(fn, *args) -> Counter:
    """``fn(*args)``'s GPU build traced on this host (not compiled, not run): its Pallas launches by kernel
    name, each call of a jitted helper counted. The attention backend's GPU check is lifted for the trace:
    nothing here runs a kernel."""
    from unittest import mock

    import jax

    from jaxserve.kernels import ops
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with mock.patch.object(ops, "_check_gpu", lambda interpret: None), jax.sharding.use_abstract_mesh(mesh):
        jaxpr = fn.trace(*args).jaxpr
    counts = Counter()

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info")
                counts[getattr(info, "name", None) or str(eqn.params.get("name", "pallas_call"))] += 1
                continue
            for val in eqn.params.values():     # sub-jaxprs: jit calls, conds, loops, shard_map bodies
                for sub in val if isinstance(val, (tuple, list)) else (val,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jaxpr.jaxpr)
    return counts


# a layer's cut: its K/V write, a launch of its own or inside the decode-only attention launch
LAYER_MARKS = ("paged_kv_write", "ragged_paged_decode_write_kv", "ragged_paged_decode_split_write_kv")


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(")


def hlo_kernel_ops(hlo: str) -> dict:
    """Optimized HLO text -> ``{kernel name: "kind: op op ..."}`` for each fusion (kernel names are the fusion
    instruction names with ``.`` as ``_``, as the GPU trace shows them): what a small kernel computes."""
    ops, calls, comp = {}, {}, None
    for line in hlo.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m and "=" not in line.split("{")[0]:
            comp = m.group(1)
            ops[comp] = []
            continue
        m = _HLO_INSTRUCTION.match(line)
        if not m or comp is None:
            continue
        name, opcode = m.groups()
        if opcode not in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
            ops[comp].append(opcode)
        c = re.search(r"kind=(\w+), calls=%?([\w.\-]+)", line)
        if opcode == "fusion" and c:
            calls[name.replace(".", "_")] = (c.group(1), c.group(2))
    return {k: f"{kind}: {' '.join(dict.fromkeys(ops.get(c, [])))}" for k, (kind, c) in calls.items()}


def layer_windows(events: list, layers: int) -> dict:
    """``events`` (start ns, end ns, kernel group[, kernel name]) of whole forwards in time order, cut at each layer's K/V
    write: the window from one layer's write to the next layer's is one layer's worth of kernels (the end of
    one, the start of the next); windows across two forwards are dropped. Returns the mean kernels, GPU-busy us
    and idle us (write start to next write start, less the busy time) per layer, and each distinct window
    (layers of two kinds, e.g. Gemma's sliding and global ones, give two) as ``[(kernel group, mean us)]``
    with how many windows had it."""
    groups = {ev[2] for ev in events}
    mark = next((m for m in LAYER_MARKS if m in groups), LAYER_MARKS[0])
    marks = [i for i, ev in enumerate(events) if ev[2] == mark]
    cuts = [(i, j) for n, (i, j) in enumerate(zip(marks, marks[1:])) if n % layers != layers - 1]
    if not cuts:
        return {"kernels_per_layer": None, "note": f"{len(marks)} {mark} launches: no layer window"}
    busy = [sum(ev[1] - ev[0] for ev in events[i:j]) / 1e3 for i, j in cuts]
    span = [(events[j][0] - events[i][0]) / 1e3 for i, j in cuts]
    by_sig = {}
    for i, j in cuts:
        by_sig.setdefault(tuple(ev[2] for ev in events[i:j]), []).append(events[i:j])
    kinds = []
    for sig, ws in sorted(by_sig.items(), key=lambda kv: -len(kv[1])):
        us = [sum(ev[1] - ev[0] for ev in col) / len(ws) / 1e3 for col in zip(*ws)]
        kinds.append({"windows": len(ws), "kernels": [(g, round(u, 2)) for g, u in zip(sig, us)],
                      "names": [ev[3] if len(ev) > 3 else ev[2] for ev in ws[0]]})
    return {"kernels_per_layer": sum(j - i for i, j in cuts) / len(cuts), "layer_busy_us": sum(busy) / len(cuts),
            "layer_gap_us": (sum(span) - sum(busy)) / len(cuts), "windows": len(cuts), "layer_kinds": kinds}


def layer_main(a) -> int:
    """One child per (tree, flag set); with ``--old-tree`` the old tree's children first, then this tree's."""
    if a.hlo_dir:
        os.makedirs(a.hlo_dir, exist_ok=True)
    trees = [("new", None)]
    site = None
    if a.old_tree:
        site = tempfile.mkdtemp(prefix="step-diag-old-")
        # the installed layout (pyproject's package-dir) without pip: kernels/ and server/ inside jaxserve/
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(os.path.join(a.old_tree, "jaxserve"), os.path.join(site, "jaxserve"), ignore=skip)
        for sub in ("kernels", "server"):
            shutil.copytree(os.path.join(a.old_tree, sub), os.path.join(site, "jaxserve", sub), ignore=skip)
        trees.insert(0, ("old", site))
    # one compilation cache for every child: a model whose program the two trees share compiles (and autotunes
    # its GEMMs) once, so both sides run the same executable and the command fits a few minutes
    cache = tempfile.mkdtemp(prefix="step-diag-cache-")
    results = []
    for (tree, path), fs in [(t, fs) for t in trees for fs in (a.flags or ["default"])]:
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), FLAG_SETS[fs]) if x)
        if path:
            env["PYTHONPATH"] = os.pathsep.join(x for x in (path, REPO, env.get("PYTHONPATH", "")) if x)
        if a.smoke:
            env.update(JAX_PLATFORMS="cpu")
        args = [sys.executable, os.path.abspath(__file__), "--layer-kernels", *a.models, "--layer-child",
                "--layers", str(a.layers), "--context", str(a.context), "--dtype", a.dtype,
                "--replays", str(a.replays), "--max-model-len", str(a.max_model_len), "--tag", f"{tree}-{fs}"] \
            + (["--smoke"] if a.smoke else []) + (["--hlo-dir", os.path.abspath(a.hlo_dir)] if a.hlo_dir else []) \
            + (["--lowered"] if a.lowered else [])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=a.child_timeout,
                                  cwd=a.old_tree if path else REPO)
            out, why = proc.stdout, (f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"
                                     if proc.returncode else "")
        except subprocess.TimeoutExpired as e:    # keep the models it finished
            out, why = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        got = [json.loads(ln[len("RESULT "):]) for ln in out.splitlines() if ln.startswith("RESULT ")]
        print(f"  {tree} tree, {fs}: {time.perf_counter() - t0:.0f}s, {len(got)} of {len(a.models)} models"
              + (f" ({why})" if why else ""), file=sys.stderr, flush=True)
        results += [dict(r, tree=tree, flags=fs) for r in got]
    if a.lowered:
        print("| model | tree | Pallas launches / layer (GPU build, lowered) | by kernel |")
        print("|---|---|---|---|")
        for r in results:
            kinds = ", ".join(f"{k} {v:g}" for k, v in r["pallas_kernels"].items())
            print(f"| {r['model']} ({r['layers']} layers) | {r['tree']} | {r['pallas_per_layer']:g} | {kinds} |")
        return 0 if results else 1
    print("| model | tree | XLA flags | kernels / layer | layer busy us | layer gap us | forward ms | HLO fusions | HLO custom calls |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        f = lambda k, fmt="{:.1f}": fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        print(f"| {r['model']} ({r['layers']} layers) | {r['tree']} | {r['flags']} | {f('kernels_per_layer')} | "
              f"{f('layer_busy_us')} | {f('layer_gap_us')} | {f('forward_ms', '{:.3f}')} | {r['hlo_fusions']} | "
              f"{r['hlo_custom_calls']} |")
    for r in results:
        for kind in r.get("layer_kinds", [])[:3]:
            print(f"\n{r['model']} {r['tree']} {r['flags']}: a layer, K/V write to K/V write, in {kind['windows']} of "
                  f"{r['windows']} windows (kernel, us, what the HLO fusion computes):")
            for (g, u), what in zip(kind["kernels"], kind.get("ops") or [""] * len(kind["kernels"])):
                print(f"    {g:32s} {u:7.2f}  {what[:110]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)
    for d in (site, cache):
        if d:
            shutil.rmtree(d, ignore_errors=True)
    return 0 if results else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", dest="tps", type=int, nargs="+", default=[1])
    p.add_argument("--flags", nargs="+", default=None, help=f"flag set names ({', '.join(FLAG_SETS)})")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--child-timeout", type=int, default=300)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="trace and print GPU kernels / host spans per step")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decoding; with --profile the engine trace is then per decoded token")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--layer-kernels", nargs="*", default=None, metavar="MODEL",
                   help=f"kernels per layer of a batch-1 decode forward (default models: {' '.join(LAYER_MODELS)})")
    p.add_argument("--layers", type=int, default=3, help="--layer-kernels: layers of each model")
    p.add_argument("--context", type=int, default=256, help="--layer-kernels: the request's context")
    p.add_argument("--old-tree", default=None, help="--layer-kernels: also measure this checkout (first)")
    p.add_argument("--hlo-dir", default=None, help="--layer-kernels: write each compiled forward's HLO here")
    p.add_argument("--lowered", action="store_true",
                   help="--layer-kernels: lower the GPU build for CUDA (any host) and count its Pallas launches")
    p.add_argument("--layer-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="new-default", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp-one", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--flag-set", default="default", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.layer_kernels is not None:
        a.models = a.layer_kernels or list(LAYER_MODELS)
        if a.layer_child:
            layer_child(a)
            return 0
        return layer_main(a)
    if a.child:
        if a.smoke:
            a.dtype, a.decode_tokens, a.replays, a.max_model_len, a.prompt_len = "float32", 8, 3, 256, 16
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    flag_sets = a.flags or (["default"] if a.smoke else ["default", "no-cmdbuf"]
                            + (["coll-kernels"] if max(a.tps) > 1 else []))
    results = []
    for tp in a.tps:
        for fs in flag_sets:
            if tp == 1 and "kernels" in fs:
                continue
            env = dict(os.environ)
            env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", ""), FLAG_SETS[fs]) if x)
            if a.smoke:
                env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={max(a.tps)}")
            args = [sys.executable, os.path.abspath(__file__), "--child", "--tp-one", str(tp), "--flag-set", fs,
                    "--model", a.model, "--dtype", a.dtype, "--prompt-len", str(a.prompt_len),
                    "--decode-tokens", str(a.decode_tokens), "--replays", str(a.replays),
                    "--max-model-len", str(a.max_model_len), "--max-num-batched-tokens",
                    str(a.max_num_batched_tokens), "--num-scheduler-steps", str(a.num_scheduler_steps)] \
                + (["--smoke"] if a.smoke else []) \
                + (["--profile"] if a.profile else [])
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=a.child_timeout,
                                      cwd=REPO)
            except subprocess.TimeoutExpired:
                results.append({"tp": tp, "flags": fs, "error": "timeout"})
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                results.append({"tp": tp, "flags": fs, "error": proc.stderr.strip().splitlines()[-3:]})
            else:
                results.append(json.loads(lines[-1][len("RESULT "):]))
            r = results[-1]                  # the numbers now too, so a sweep cut short keeps what it measured
            got = (f"{r['e2e_tok_s']:.1f} tok/s, forward {r.get('forward_ms', float('nan')):.3f} ms"
                   if "e2e_tok_s" in r else "failed")
            print(f"  tp={tp} {fs}: {time.perf_counter() - t0:.0f}s, {got}", file=sys.stderr, flush=True)
    print("| TP | XLA flags | e2e tok/s | ms/token | forward ms | sampler ms | gap ms | host ms/step | HLO |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['tp']} | {r['flags']} | failed: {r['error']} |")
            continue
        f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if k in r else "-"  # noqa: E731
        print(f"| {r['tp']} | {r['flags']} | {f('e2e_tok_s', '{:.1f}')} | {f('ms_per_token')} | {f('forward_ms')} | "
              f"{f('sampler_ms')} | {f('gap_ms')} | {f('host_ms_per_step')} | "
              f"{r.get('hlo', r.get('hlo_error', '-'))} |")
    if a.profile:
        from benchmarks.diagnostics.profile_summary import format_summary
        e2e = ("engine decode step" if a.num_scheduler_steps == 1
               else f"engine, {a.num_scheduler_steps}-step decode, per token")
        for r in results:
            for key, what in (("profile_forward", "forward replay"), ("profile_e2e", e2e)):
                if key in r:
                    print()
                    print(format_summary(r[key], title=f"TP={r['tp']} {r['flags']}: {what}"))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
