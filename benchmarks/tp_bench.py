"""Tensor parallelism on N GPUs: single-stream decode tok/s and offline throughput at each TP size in one run,
plus weight load time from safetensors vs orbax for the same (dummy) model.

    python benchmarks/tp_bench.py                       # 2×H200: Llama-3.1-8B dummy bf16, TP=1 and TP=2
    python benchmarks/tp_bench.py --smoke               # CPU, 2 fake devices, a tiny model: checks the script

Every measurement runs in a fresh child process (this script with ``--child``) so one configuration's device
memory, compilation cache in memory and page cache effects stay out of the next: the parent only orchestrates
and writes ``benchmarks/results/<date>-tp-bench-<device>.{json,md}`` with the commit, device and command.

Single-stream decode: one request, ``--prompt-len`` random tokens; decode tok/s = ``decode_tokens /
(t(1 + decode_tokens tokens) - t(1 token))`` so prefill is excluded (distinct prompts, so no prefix-cache hit).
Offline throughput: ``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` tokens each,
ignore_eos, like ``vllm bench throughput``.
Load time: an HF folder of random bf16 safetensors (written here, HF layout) vs its orbax conversion
(``jaxserve.models.orbax_io.convert``), each loaded into the TP mesh in a fresh process; wall time from
``load_model`` to every shard ready. The files were just written, so both reads mostly hit the page cache
unless ``--drop-caches`` (needs root) empties it first.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs", "models")
TINY_SMOKE = os.path.join(REPO, "tests", "fixtures", "models", "tiny-llama3")


# ------------------------------------------------------------------------------------------------ children
def child_speed(a) -> dict:
    import numpy as np

    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    # single stream only: the smallest bucket and the budget (the prompt's one step), not four buckets
    budget = a.max_num_batched_tokens
    buckets = tuple(sorted({a.smallest_one, budget})) if a.skip_offline else bench_buckets(a.smallest_one, budget)
    if a.all_reduce_one == "custom-unfused":       # read by every process's enable_custom_all_reduce
        os.environ["JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM"] = "0"
    t0 = time.perf_counter()
    llm = LLM(a.model_path, load_format="dummy", dtype=a.dtype, tensor_parallel_size=a.tp,
              distributed_executor_backend=a.executor if a.tp > 1 else "uni",
              max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=budget, enable_prefix_caching=False,
              token_buckets=buckets, num_scheduler_steps=a.steps_one, use_tqdm_on_load=False,
              disable_custom_all_reduce=a.all_reduce_one == "xla")
    startup_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def prompts(n, length):
        return [rng.integers(100, min(vocab, 30000), size=length).tolist() for _ in range(n)]

    outputs = []

    def timed(batch, max_tokens, temperature=0.0):
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(batch, sp, use_tqdm=False)
        outputs[:] = [o.outputs[0].token_ids for o in outs]
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    timed(prompts(1, a.prompt_len), 16)                      # first-touch effects out of the timings
    first_s = min(timed(prompts(1, a.prompt_len), 1)[0] for _ in range(3))
    runner = llm.engine.runner
    steps0, host0, dev0 = runner.stats.steps, runner.stats.host_ms, runner.stats.device_ms
    full_s, n_out = timed(prompts(1, a.prompt_len), a.decode_tokens + 1)
    greedy = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12]   # same model and prompt: same tokens?
    steps = max(runner.stats.steps - steps0, 1)
    decode = {"prompt_len": a.prompt_len, "decode_tokens": n_out - 1, "ttft_s": first_s,
              "decode_tok_s": (n_out - 1) / (full_s - first_s), "ms_per_token": 1e3 * (full_s - first_s) / (n_out - 1),
              "host_ms_per_step": (runner.stats.host_ms - host0) / steps,
              "device_wait_ms_per_step": (runner.stats.device_ms - dev0) / steps, "greedy_tokens_sha256": greedy}

    if a.skip_offline:
        offline = {}
        return _speed_result(a, llm, runner, startup_s, decode, offline)
    batch = prompts(a.num_prompts, a.input_len)
    timed(batch[:8], 8, 1.0)
    elapsed, out_tok = timed(batch, a.output_len, 1.0)
    offline = {"num_prompts": a.num_prompts, "input_len": a.input_len, "output_len": a.output_len,
               "elapsed_s": elapsed, "output_tok_s": out_tok / elapsed,
               "total_tok_s": (out_tok + a.num_prompts * a.input_len) / elapsed, "requests_s": a.num_prompts / elapsed}
    return _speed_result(a, llm, runner, startup_s, decode, offline)


def _all_reduce_label(llm, tp: int) -> str:
    from jaxserve.parallel import collectives
    if not llm.engine.custom_all_reduce:
        return "xla" if tp > 1 else "-"
    return "custom+norm" if collectives.fuses_norm() else "custom"


def _speed_result(a, llm, runner, startup_s, decode, offline) -> dict:
    return {"tp": a.tp, "executor": a.executor if a.tp > 1 else "uni", "num_scheduler_steps": a.steps_one,
            "all_reduce": _all_reduce_label(llm, a.tp),
            "smallest_bucket": a.smallest_one, "skip_offline": a.skip_offline,
            "token_buckets": list(llm.engine.runner.buckets),
            "startup_s": startup_s, "load_s": llm.engine.load_seconds,
            "warmup_s": llm.engine.warmup_seconds, "num_kv_blocks": runner.num_blocks,
            "single_stream": decode, "offline": offline}


def bench_buckets(smallest: int, budget: int) -> tuple[int, ...]:
    """The speed runs' token buckets: ``smallest`` (the batch-1 decode step's), 16, 256 and the budget."""
    return tuple(sorted({smallest, 16, 256, budget}))


def child_prepare(a) -> dict:
    """Write the random-weight HF safetensors folder and its orbax conversion (once per run)."""
    from jaxserve.models import orbax_io

    st_dir, ob_dir = os.path.join(a.workdir, "safetensors"), os.path.join(a.workdir, "orbax")
    for d in (st_dir, ob_dir):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    nbytes = write_random_hf_folder(a.config_json, st_dir)
    # a tokenizer in both folders, so neither load pays for building the embedded GGUF tokenizer
    from jaxserve.models.loader import embedded_tokenizer
    embedded_tokenizer().save_pretrained(st_dir)
    write_s = time.perf_counter() - t0
    summary = orbax_io.convert(st_dir, ob_dir, dtype=a.dtype, tensor_parallel_size=max(a.tps))
    return {"safetensors_bytes": nbytes, "safetensors_write_s": write_s, "orbax_convert": summary}


def child_load(a) -> dict:
    import jax

    from jaxserve.models import load_model
    from jaxserve.parallel import make_mesh

    path = os.path.join(a.workdir, a.format)
    mesh = make_mesh(a.tp) if a.tp > 1 else None
    t0 = time.perf_counter()
    model = load_model(path, dtype=a.dtype, load_format=a.format, mesh=mesh)
    jax.block_until_ready(model.params)
    return {"format": a.format, "tp": a.tp, "load_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- random HF safetensors folder
def write_random_hf_folder(config_json: str, out_dir: str, shard_bytes: int = 4 << 30) -> int:
    """An HF Llama folder (config.json + sharded bf16 safetensors + index) of random values in HF layout.

    Written tensor by tensor from one random block (128 MiB, longer than any compression window or orbax
    chunk, so orbax's zstd gains nothing a real checkpoint would not give it), each tensor starting at its
    own offset; needs neither torch nor the model's size in host memory, and takes seconds per GB rather
    than the minutes a full normal draw would."""
    import ml_dtypes
    import numpy as np

    hf = json.load(open(config_json))
    h, i, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hq, hkv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    d = hf.get("head_dim") or h // hq
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not hf.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for n in range(hf["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (hq * d, h), p + "self_attn.k_proj.weight": (hkv * d, h),
                   p + "self_attn.v_proj.weight": (hkv * d, h), p + "self_attn.o_proj.weight": (h, hq * d),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if hf.get("attention_bias"):
            shapes |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", hq * d), ("k", hkv * d),
                                                                         ("v", hkv * d))}
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    cfg = {k: val for k, val in hf.items() if not k.startswith("_")} | {"torch_dtype": "bfloat16"}
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    groups, cur, size = [], [], 0
    for name, shape in shapes.items():
        nb = 2 * int(np.prod(shape))
        if cur and size + nb > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nb
    groups.append(cur)
    weight_map, total = {}, 0
    for g, names in enumerate(groups):
        fname = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for name in names:
            nb = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in names:
                n, start = int(np.prod(shapes[name])), int(rng.integers(block.size))
                while n > 0:        # wrap around the block from a random start, in block-sized writes
                    piece = block[start:start + n]
                    f.write(piece.tobytes())
                    n, start = n - piece.size, 0
        total += off
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(out_dir, "model.safetensors.index.json"), "w"), indent=1)
    return total


# -------------------------------------------------------------------------------------------------- parent
def run_child(a, kind: str, **overrides) -> dict:
    args = [sys.executable, os.path.abspath(__file__), "--child", kind] + _forward_args(a, overrides)
    env = dict(os.environ)
    if a.smoke:
        env.update(JAX_PLATFORMS="cpu")
        if overrides.get("executor", "uni") == "mp":      # a process per device: one CPU device each
            env.pop("XLA_FLAGS", None)
        else:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(a.tps)}"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=a.child_timeout)
    except subprocess.TimeoutExpired as e:
        # one child over its limit costs its own row, not the results of the others
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"  {kind} {overrides}: timed out after {a.child_timeout}s\n{tail[-3000:]}", file=sys.stderr, flush=True)
        return {**overrides, "error": f"timed out after {a.child_timeout}s", "stderr_tail": tail[-3000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"  {kind} {overrides}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
        return {**overrides, "error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    line = lines[-1]
    result = json.loads(line[len("RESULT "):])
    print(f"  {kind} {overrides}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return result


def _forward_args(a, overrides: dict) -> list[str]:
    vals = {k: getattr(a, k) for k in ("model", "dtype", "prompt_len", "decode_tokens", "num_prompts",
                                        "input_len", "output_len", "max_model_len", "max_num_seqs",
                                        "max_num_batched_tokens", "workdir")} | overrides
    out = ["--tp", *map(str, a.tps), "--num-scheduler-steps", *map(str, a.steps)]
    out += ["--smallest-bucket", *map(str, a.smallest)] + (["--skip-offline"] if a.skip_offline else [])
    for k, v in vals.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="configs/models name (random weights)")
    p.add_argument("--tp", dest="tps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--executors", nargs="+", default=["uni"], choices=["uni", "mp"],
                   help="TP > 1 speed runs per executor: uni = one process drives every GPU, mp = a process per GPU")
    p.add_argument("--executor", default="uni", help=argparse.SUPPRESS)
    p.add_argument("--num-scheduler-steps", dest="steps", type=int, nargs="+", default=[1],
                   help="speed runs per multi-step setting (the engine's --num-scheduler-steps)")
    p.add_argument("--steps-one", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--all-reduce", dest="all_reduces", nargs="+", default=["custom"], choices=["custom", "custom-unfused", "xla"],
                   help="TP > 1 speed runs per all-reduce: custom = the engine's default (the CUDA one-shot kernel "
                        "where it can run, fused with the residual add and RMSNorm), custom-unfused = the kernel "
                        "alone (JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM=0), xla = --disable-custom-all-reduce")
    p.add_argument("--all-reduce-one", default="custom", help=argparse.SUPPRESS)
    p.add_argument("--smallest-bucket", dest="smallest", type=int, nargs="+", default=None,
                   help="speed runs per smallest token bucket (the batch-1 decode step's size; default the "
                        "engine's, MIN_TOKEN_BUCKET; 16, 256 and the budget are compiled too)")
    p.add_argument("--smallest-one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--skip-offline", action="store_true",
                   help="single stream only; each child then compiles two buckets (the smallest and the budget, "
                        "where the prompt's step lands) instead of four")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-load", action="store_true")
    p.add_argument("--load-repeats", type=int, default=2)
    p.add_argument("--drop-caches", action="store_true", help="empty the page cache before each load (root)")
    p.add_argument("--workdir", default="/tmp/jaxserve_tp_bench", help="where the 8B folders go (~32 GB)")
    p.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--child-timeout", type=int, default=3600)
    p.add_argument("--smoke", action="store_true", help="CPU, fake devices, tiny model, tiny workload")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tp-one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--format", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    from jaxserve.runner.model_runner import MIN_TOKEN_BUCKET
    a.smallest = a.smallest or [MIN_TOKEN_BUCKET]
    a.smallest_one = a.smallest_one or MIN_TOKEN_BUCKET
    if a.smoke:
        a.model, a.dtype = TINY_SMOKE, "float32"
        a.prompt_len, a.decode_tokens, a.num_prompts, a.input_len, a.output_len = 8, 8, 8, 16, 8
        a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens = 64, 8, 64
        a.workdir = a.workdir + "_smoke"
    a.model_path = a.model
    a.config_json = (os.path.join(a.model, "config.json") if os.path.isdir(a.model)
                     else os.path.join(CONFIGS, f"{a.model}.json"))
    if a.child:
        a.tp = a.tp_one
        fn = {"speed": child_speed, "prepare": child_prepare, "load": child_load}[a.child]
        print("RESULT " + json.dumps(fn(a)), flush=True)
        return 0

    started = dt.datetime.now(dt.timezone.utc)
    result = {"date_utc": started.isoformat(timespec="seconds"), "command": " ".join(["python", *sys.argv]),
              "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "-uno")),
              "host": platform.node(), "model": a.model, "dtype": a.dtype, "speed": [], "load": [],
              "device": _device_kind(a)}
    if not a.skip_speed:
        for tp in a.tps:
            for ex in (a.executors if tp > 1 else ["uni"]):
                for steps in a.steps:
                    for small in a.smallest:
                        for ar in (a.all_reduces if tp > 1 else ["custom"]):
                            result["speed"].append(run_child(a, "speed", tp_one=tp, executor=ex, steps_one=steps,
                                                             smallest_one=small, all_reduce_one=ar))
                            write_results(a, result, started, final=False)   # a run cut short keeps its rows
    if not a.skip_load:
        result["prepare"] = run_child(a, "prepare", tp_one=max(a.tps))
        for _ in range(a.load_repeats):
            for tp in a.tps:
                for fmt in ("safetensors", "orbax"):
                    dropped = drop_page_cache() if a.drop_caches else False
                    result["load"].append(run_child(a, "load", tp_one=tp, format=fmt) | {"page_cache_dropped": dropped})
        shutil.rmtree(a.workdir, ignore_errors=True)
    write_results(a, result, started)
    return 0


def _device_kind(a) -> str:
    if a.smoke:
        return "cpu"
    out = subprocess.run([sys.executable, "-c", "import jax; d=jax.devices(); print(len(d), d[0].device_kind)"],
                         capture_output=True, text=True, timeout=300).stdout.strip()
    return out or "unknown"


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def write_results(a, r: dict, started, final: bool = True) -> None:
    lines = [f"# Tensor parallelism: {r['model']} ({r['dtype']})", "",
             f"- date: {r['date_utc']}  commit: {r['commit']}{' (dirty)' if r['dirty'] else ''}",
             f"- device: {r['device']}  host: {r['host']}", f"- command: `{r['command']}`", ""]
    ok = [s for s in r["speed"] if "error" not in s]
    for s in r["speed"]:
        if "error" in s:
            lines.append(f"- TP={s.get('tp_one')} {s.get('executor', 'uni')} steps={s.get('steps_one', 1)} "
                         f"smallest bucket {s.get('smallest_one')}: **failed**, {s['error']}")
    if ok:
        lines += ["| TP | executor | all-reduce | scheduler steps | smallest bucket | single-stream decode tok/s | "
                  "ms/token | host ms/dispatch | speedup | greedy tokens (sha256) | offline output tok/s | "
                  "offline total tok/s | speedup | KV blocks | warm-up s |", "|" + "---|" * 15]
        # speedups against the smallest TP size run with the same scheduler steps and smallest bucket
        bases = {}
        for s in sorted(ok, key=lambda s: s["tp"]):
            bases.setdefault((s.get("num_scheduler_steps", 1), s.get("smallest_bucket", 16)), s)
        for s in ok:     # (runs before the smallest bucket was recorded used 16)
            base = bases[(s.get("num_scheduler_steps", 1), s.get("smallest_bucket", 16))]
            ss, off, boff = s["single_stream"], s["offline"], base["offline"]
            offline = (f"{off['output_tok_s']:.0f} | {off['total_tok_s']:.0f} | "
                       f"{off['output_tok_s'] / boff['output_tok_s']:.2f}x" if off and boff else "– | – | –")
            lines.append(f"| {s['tp']} | {s.get('executor', 'uni')} | {s.get('all_reduce', '?')} | "
                         f"{s.get('num_scheduler_steps', 1)} | {s.get('smallest_bucket', 16)} | "
                         f"{ss['decode_tok_s']:.1f} | {ss['ms_per_token']:.2f} | {ss['host_ms_per_step']:.2f} | "
                         f"{ss['decode_tok_s'] / base['single_stream']['decode_tok_s']:.2f}x | "
                         f"{ss.get('greedy_tokens_sha256', '?')} | {offline} | {s['num_kv_blocks']} | {s['warmup_s']:.0f} |")
        ss = ok[0]["single_stream"]
        lines += ["", f"Single stream: {ss['prompt_len']}-token prompt, {ss['decode_tokens']} decoded tokens."]
        o = next((s["offline"] for s in ok if s["offline"]), None)
        if o:
            lines[-1] += (f" Offline: {o['num_prompts']} prompts × {o['input_len']} in / {o['output_len']} out, "
                          "temperature 1, ignore_eos.")
        lines.append("")
    if r["load"]:
        prep = r["prepare"]
        lines += [f"Load time ({prep['safetensors_bytes'] / 2**30:.1f} GiB of weights; orbax conversion took "
                  f"{prep['orbax_convert']['save_seconds']:.0f}s to write):", "",
                  "| TP | format | load s (each run) | page cache dropped |", "|---|---|---|---|"]
        for tp in a.tps:
            for fmt in ("safetensors", "orbax"):
                runs = [x for x in r["load"] if x.get("tp") == tp and x.get("format") == fmt and "error" not in x]
                seconds = ", ".join(f"{x['load_s']:.1f}" for x in runs)
                dropped = all(x["page_cache_dropped"] for x in runs)
                lines.append(f"| {tp} | {fmt} | {seconds} | {dropped} |")
    text = "\n".join(lines) + "\n"
    if final:
        print(text)
    os.makedirs(a.results_dir, exist_ok=True)
    kind = str(r["device"]).replace(" ", "-").lower()
    stem = os.path.join(a.results_dir, f"{started:%Y-%m-%d}-tp-bench-{kind}{'-smoke' if a.smoke else ''}")
    json.dump(r, open(stem + ".json", "w"), indent=1)
    open(stem + ".md", "w").write(text)
    if final:
        print(f"wrote {stem}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
