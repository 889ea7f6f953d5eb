#!/usr/bin/env bash
# The project's H200 runs, each step sized to fit one device call (~8 minutes on one H200):
#   offline   the three h200-llama8b offline configs (HF side by side), one process: one engine load + warm-up
#   serve     h200-llama8b-serve-sweep (its own process: the server needs the GPU to itself)
#   kernels   h200-kernels; bandwidth: the read and copy ceilings of configs/hardware/h200.yaml; ab OLD: below
#   split     the engine core in the caller's process (JAXSERVE_ENABLE_MULTIPROCESSING=0, old) vs its own (=1, new),
#             interleaved: h200-llama8b-decode old/new, then h200-llama8b-serve-sweep at concurrency 1 and 256 old/new
#             (warm compile cache: ~8 minutes; split-decode / split-serve: one half each)
#   hostcore  the engine core's own host ms per step at 256 decodes (host_overhead.py --engine core: the tiny
#             fixture model, so the GPU's time is small) and its cProfile per-function table (~3 minutes)
#   frontend  the front end's CPU per generated token at 256 streams against a fake engine core (no GPU used:
#             frontend_overhead.py on the host's CPU, plain and with stop strings + logprobs; ~1 minute);
#             FRONTEND_OLD=TREE runs an older tree's first (a plain checkout, as for ab)
#   startup   serve llama-3.1-8b dummy until /health 200 and a first completion, fresh compile cache then warm
#   embed, gpucheck, stepdiag: the diagnostics of the same names in benchmarks/diagnostics/
#   phases    where the steady-state 256-decode step's time goes, llama-3.1-8b dummy (decode_phases.py: host phases,
#             GPU busy / span per step, cProfile; ~2-3 minutes)
#   tp2, carcheck (2 GPUs): h200x2-llama8b-tp2 next to TP=1; the custom all-reduce against psum and TP=1
#   x2-70b, x2-more, x2-extra (2 GPUs; issue 36), one device call each, most important first; x2: all three.
#             x2-70b: Llama-3.1-70B TP=2 batch 1 + offline (one process), then its serve sweep (the warm start-up:
#             the server log's "ready in" line); x2-more: Qwen3-32B offline TP=2 then TP=1, Mixtral-8x7B EP=2 then
#             TP=2 (batch 1 + offline each); x2-extra: Llama-3.1-70B fp8 batch 1 on one GPU (also runs with one),
#             then the 70B TP=2 serve start-up, cold and warm. TP=2 runs a process per GPU (X2_BACKEND=mp, the
#             custom all-reduce; uni: one process drives both; an mp engine that never starts is retried as uni)
#   families  batch-1 latency of each decoder family (h200-family-latency-bs1, one process per model) for the
#             configs/models names in $FAMILIES (default: qwen3-8b gemma-2-9b gemma-3-12b phi-4 command-r-35b;
#             ~8-9 minutes on a cold host: each model loads and compiles its 3 forwards in ~1-2 minutes)
#   families-throughput  offline 1000 x 1024 / 128 of the same models (h200-family-throughput, with the
#             per-family settings of family_sets below); all five take ~11 minutes cold, so split them over two
#             calls: FAMILIES="qwen3-8b gemma-2-9b gemma-3-12b", then FAMILIES="phi-4 command-r-35b"
#   gemma2-long  h200-gemma2-9b-long-prompts (200 x 8064 / 128: the sliding-window layers at long context)
#   moe       h200-qwen3-30b-a3b-latency-bs1 + -throughput in one process, then the two h200-mixtral-8x7b configs
#             in another (93 GB of weights: JAX may take 95 % of HBM); ~7-8 minutes on a cold host
#   moe-ab    the MoE kernels and multi-step decoding at batch 1, 4 and 16 (h200-<model>-latency-bs1 / -bs4 / -bs16
#             on one engine sized for them, 128 out, 3 iterations): one runner process per MODEL:GEMM:STEPS of
#             $MOE_AB_VARIANTS (JAXSERVE_MOE_GROUPED_GEMM: auto = rows on a GPU, or pallas, ragged_dot, ...;
#             engine.num_scheduler_steps), in that order (default: Qwen3-30B-A3B and Mixtral-8x7B on auto at 1 step,
#             then at 4), each cut at MOE_AB_LIMIT_S (180), none started with less than MOE_AB_MIN_S (60) of
#             MOE_AB_BUDGET_S (510) left; ends with one table (output tok/s, decode step ms, against the model's
#             first variant). MOE_AB_SETS: more --set KEY=VALUE words for every variant
#   moe-serve h200-qwen3-30b-a3b-serve-sweep (concurrency 1 / 16 / 64 / 256, TTFT / TPOT)
#   launch-ab the batch-1 step's launch cost: h200-$LAUNCH_AB_MODEL-latency-bs1 (default qwen3-30b-a3b; 128 out,
#             buckets 4 and 256) under each NAME=XLA_FLAGS of $LAUNCH_AB_VARIANTS, in that order (default: jaxserve's
#             flags, XLA's own command-buffer update mode, nocache); NAME nocache also turns the stored step programs
#             off (engine.compilation_cache_dir empty), NAME old runs LAUNCH_AB_OLD=TREE's jaxserve (a plain
#             checkout, as for ab); LAUNCH_AB_ROUNDS rounds (default 2) interleaved, each run cut at
#             LAUNCH_AB_LIMIT_S (150), none started with less than 60 s of LAUNCH_AB_BUDGET_S (540) left; one table
#             (output tok/s, decode step ms, host ms per step)
# Usage: benchmarks/run_h200.sh [offline|serve|kernels|bandwidth|ab OLD_TREE|split|split-decode|split-serve|hostcore|frontend|startup|embed|gpucheck|stepdiag|phases|tp2|carcheck|
#        families|families-throughput|gemma2-long|moe|moe-ab|moe-serve|launch-ab ...]
# ab OLD_TREE: h200-llama8b-latency-bs1 and -throughput at OLD_TREE (a plain checkout of the old commit, e.g. .ab-old/,
# carried with the device call) and at this tree, each pip-installed into its own folder and run from its own root,
# old / new, then (AB_ROUNDS, default 2) old / new of the latency config alone, HF off; the compile cache is shared
# (a cold compile: ~2 minutes; the two rounds take ~8.5 minutes).
# Default: offline serve kernels. Results: $OUT/results/ if $OUT is set, else benchmarks/results/; the summary is
# printed last and kept in <results root>/h200-summary.txt. Each step is cut at its time limit (env, seconds).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
case $PY in */*) [ "${PY#/}" = "$PY" ] && PY=$(pwd)/$PY ;; esac   # absolute: the ab step runs in other folders
RESULTS=${OUT:+$OUT/results}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY="$RESULTS/h200-summary.txt"
: > "$SUMMARY"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
STEPS=()
AB_OLD=""
while [ $# -gt 0 ]; do
  STEPS+=("$1")
  if [ "$1" = ab ]; then
    if [ $# -lt 2 ] || [ ! -d "$2" ]; then echo "ab needs the old tree's folder: run_h200.sh ab OLD_TREE" >&2; exit 2; fi
    AB_OLD=$(cd "$2" && pwd); shift
  fi
  shift
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=(offline serve kernels)

bench() {   # bench LIMIT_S LOG_NAME ARGS...: one runner process under a time limit; keeps its summary lines
  local limit=$1 name=$2; shift 2
  local log="$RESULTS/$name.log" t0=$SECONDS
  echo "=== $name (limit ${limit}s): $PY -m benchmarks.runner $*" | tee -a "$SUMMARY"
  timeout --signal=TERM --kill-after=20 "$limit" "$PY" -m benchmarks.runner --out "$RESULTS" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  # the runner's own summary: the lines after "== summary ==" (absent if it was cut short)
  sed -n '/^== summary ==$/,$p' "$log" | tail -n +2 >> "$SUMMARY"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "$name: TIMED OUT after ${limit}s (partial results in $RESULTS)" >> "$SUMMARY"; fi
  echo "($name: exit $rc, $((SECONDS - t0)) s)" >> "$SUMMARY"
}

diag() {   # diag LIMIT_S NAME FILTER ARGS...: "$PY ARGS" under a time limit, logged to NAME.log; the lines
  local limit=$1 name=$2 filter=(-E -- "$3"); shift 3   # matching FILTER (grep -E; !FILTER: not matching) join
  [ "${filter[2]#!}" != "${filter[2]}" ] && filter=(-v -E -- "${filter[2]#!}")   # the summary
  echo "=== $name: $*" | tee -a "$SUMMARY"
  timeout "$limit" "$PY" "$@" 2>&1 | tee "$RESULTS/$name.log" | grep "${filter[@]}" >> "$SUMMARY"
}

needs_2_gpus() {
  if [ "${NGPU:-0}" -lt 2 ]; then echo "$1: skipped, needs 2 GPUs (${NGPU:-0} visible)" | tee -a "$SUMMARY"; return 1; fi
}

FAMILIES=${FAMILIES:-qwen3-8b gemma-2-9b gemma-3-12b phi-4 command-r-35b}

family_sets() {   # family_sets MODE MODEL: the --set values MODEL needs beyond the family config
  # Throughput: max_num_seqs no more than the sequences of 1152 tokens the KV cache holds (the engine's
  # cache gets 90 % of JAX's default 75 % of HBM, less the weights; K/V per token: gemma-2-9b 344 KB,
  # gemma-3-12b 393 KB, command-r-35b 1.31 MB beside 70 GB of weights), so the run neither preempts nor
  # waits on blocks; command-r runs 128 prompts (1000 at 16 at a time would take ~4 minutes).
  case "$1:$2" in
    throughput:gemma-2-9b)    echo "engine.max_num_seqs=192" ;;
    throughput:gemma-3-12b)   echo "engine.max_num_seqs=160" ;;
    throughput:command-r-35b) echo "engine.max_num_seqs=16 engine.token_buckets=[16,2048] workload.num_prompts=128" ;;
  esac
}

families() {   # families MODE CONFIG LIMIT_S: CONFIG for each model of $FAMILIES, one runner process each
  local mode=$1 config=$2 limit=$3 suffix=latency-bs1 m
  [ "$mode" = throughput ] && suffix=throughput
  for m in $FAMILIES; do
    local sets=(--set "model.name=$m" --set "name=h200-$m-$suffix") s
    for s in $(family_sets "$mode" "$m"); do sets+=(--set "$s"); done
    bench "$limit" "family-$m-$suffix" --config "$config" "${sets[@]}" --no-plots
  done
}

run_limit() {   # run_limit BUDGET START LIMIT MIN: LIMIT, or the seconds left of BUDGET since START if fewer; nothing
  local left=$(($1 - (SECONDS - $2)))          # (and status 1) when fewer than MIN are left
  [ "$left" -lt "$4" ] && { echo "$left"; return 1; }
  [ "$left" -lt "$3" ] && echo "$left" || echo "$3"
}

# the default GEMM (auto: rows on a GPU) at a single step on both models (Mixtral is device-bound), then
# multi-step (Qwen3 is launch-bound at batch 1); name other GEMMs in MOE_AB_VARIANTS to compare them
MOE_AB_VARIANTS=${MOE_AB_VARIANTS:-qwen3-30b-a3b:auto:1 mixtral-8x7b:auto:1 qwen3-30b-a3b:auto:4 mixtral-8x7b:auto:4}

moe_ab() {   # moe_ab: batch 1 / 4 / 16 of each MODEL:GEMM:STEPS of $MOE_AB_VARIANTS (the header says how)
  local budget=${MOE_AB_BUDGET_S:-510} t0=$SECONDS v model gemm nss limit s more ran=()
  # bs1's engine made the one of bs4 / bs16 (no-ops for them); fewer tokens and iterations to fit the call
  local sets=(--set engine.max_model_len=512 --set engine.max_num_seqs=16 --set "engine.token_buckets=[4,16,2048]"
              --set workload.output_len=128 --set workload.iters=3 --set workload.prefill_iters=2 --no-plots)
  read -r -a more <<< "${MOE_AB_SETS:-}"
  for s in "${more[@]}"; do sets+=(--set "$s"); done
  for v in $MOE_AB_VARIANTS; do
    IFS=: read -r model gemm nss <<< "$v"
    if ! limit=$(run_limit "$budget" "$t0" "${MOE_AB_LIMIT_S:-180}" "${MOE_AB_MIN_S:-60}"); then
      echo "moe-ab $v: skipped, $limit s of the step's $budget s left" | tee -a "$SUMMARY"; continue
    fi
    ran+=("$v")
    ( [ "$model" = mixtral-8x7b ] && export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95   # 93 GB of weights
      JAXSERVE_MOE_GROUPED_GEMM=$gemm bench "$limit" "moe-ab-$model-$gemm-nss$nss" \
        --config "h200-$model-latency-bs1" --config "h200-$model-latency-bs4" --config "h200-$model-latency-bs16" \
        "${sets[@]}" --set "engine.num_scheduler_steps=$nss" --out "$RESULTS/moe-ab/$model-$gemm-nss$nss" )
  done
  moe_ab_table "${ran[*]}" | tee -a "$SUMMARY"
}

# one row per (model, batch, variant) that finished, against the model's first variant there
moe_ab_table() {   # moe_ab_table "MODEL:GEMM:STEPS ..."
  "$PY" - "$RESULTS/moe-ab" "$1" <<'EOF'
import glob, json, sys
root, variants = sys.argv[1], [v.split(":") for v in sys.argv[2].split()]
print("| model | batch | JAXSERVE_MOE_GROUPED_GEMM, num_scheduler_steps | output tok/s "
      "| decode step ms | × first |")
print("|---|---|---|---|---|---|")
got = {}                      # (model, batch, gemm, steps) -> (output tok/s, decode step s)
for model, gemm, nss in variants:
    for f in glob.glob(f"{root}/{model}-{gemm}-nss{nss}/*/result.json"):
        j = json.load(open(f)).get("jaxserve") or {}
        got[model, j.get("batch_size"), gemm, nss] = (j.get("output_tok_per_s"), j.get("decode_step_s"))
for model in dict.fromkeys(m for m, _, _ in variants):
    for batch in sorted({b for m, b, _, _ in got if m == model and b is not None}):
        base = None
        for _, gemm, nss in (v for v in variants if v[0] == model):
            if (model, batch, gemm, nss) in got:
                tok, step = got[model, batch, gemm, nss]
                base = base or tok
                ratio = f"{tok / base:.2f}" if base and tok else "-"
                print(f"| {model} | {batch} | {gemm} {nss} | {tok:.1f} | {step * 1e3:.2f} | {ratio} |")
EOF
}

AB_SITE=${TMPDIR:-/tmp}/ab-site
install_tree() {   # install_tree SIDE TREE: TREE's packages into $AB_SITE/SIDE (each side runs from its own root)
  if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$AB_SITE/$1" "$2" \
       > "$RESULTS/ab-install-$1.log" 2>&1; then
    echo "installing the $1 tree ($2) failed: $RESULTS/ab-install-$1.log" | tee -a "$SUMMARY"; return 1
  fi
}

ab() {   # ab OLD_TREE: the two configs at the old tree and at this one, interleaved; prints old / new / ratio
  local old=$1 new=$PWD site=$AB_SITE
  rm -rf "$site"; mkdir -p "$site"
  install_tree old "$old" && install_tree new "$new" || return 1
  local cfgs=(--config h200-llama8b-latency-bs1 --config h200-llama8b-throughput --set baseline.hf=false --no-plots)
  for rnd in $(seq 1 "${AB_ROUNDS:-2}"); do
    [ "$rnd" -gt 1 ] && cfgs=(--config h200-llama8b-latency-bs1 --set baseline.hf=false --no-plots)  # fits one call
    for side in old new; do
      local tree=$new; [ $side = old ] && tree=$old
      local t0=$SECONDS
      echo "=== ab round $rnd, $side ($tree): benchmarks.runner ${cfgs[*]}" | tee -a "$SUMMARY"
      (cd "$tree" && PYTHONPATH="$site/$side${PYTHONPATH:+:$PYTHONPATH}" timeout --kill-after=20 "${AB_LIMIT_S:-240}" \
        "$PY" -m benchmarks.runner --out "$RESULTS/ab-$side-$rnd" "${cfgs[@]}") > "$RESULTS/ab-$side-$rnd.log" 2>&1
      echo "(exit $?, $((SECONDS - t0)) s)" >> "$SUMMARY"
    done
    ab_table | tee -a "$SUMMARY"        # after every round: a run cut short still has the rounds it finished
  done
}

ab_table() {   # old / new / ratio of output tok/s, the median over the rounds so far
  "$PY" - "$RESULTS" <<'EOF'
import glob, json, statistics, sys
print("| config | old output tok/s | new output tok/s | new / old | runs |\n|---|---|---|---|---|")
for name in ("h200-llama8b-latency-bs1", "h200-llama8b-throughput"):
    got = {side: [json.load(open(f))["jaxserve"]["output_tok_per_s"]
                  for f in sorted(glob.glob(f"{sys.argv[1]}/ab-{side}-*/*-{name}/result.json"))] for side in ("old", "new")}
    med = {s: statistics.median(v) if v else float("nan") for s, v in got.items()}
    runs = "; ".join(f"{s}: {', '.join(f'{x:.1f}' for x in v)}" for s, v in got.items())
    print(f"| {name} | {med['old']:.1f} | {med['new']:.1f} | {med['new'] / med['old']:.3f} | {runs} |")
EOF
}

LAUNCH_AB_VARIANTS=${LAUNCH_AB_VARIANTS:-default= always=--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE nocache=}

launch_ab() {   # launch_ab: batch 1 of one model under XLA flag sets, without stored programs, at an old tree
  local model=${LAUNCH_AB_MODEL:-qwen3-30b-a3b} rnd v name flags tree sets limit
  local budget=${LAUNCH_AB_BUDGET_S:-540} start=$SECONDS
  local cfg=(--config "h200-$model-latency-bs1" --set workload.output_len=128 --set workload.iters=3
             --set workload.prefill_iters=2 --set engine.max_num_batched_tokens=256
             --set "engine.token_buckets=[4,256]" --set baseline.hf=false --no-plots)
  local variants=($LAUNCH_AB_VARIANTS)
  if [[ " ${variants[*]} " == *" old="* ]]; then
    rm -rf "$AB_SITE"; mkdir -p "$AB_SITE"
    install_tree old "$(cd "${LAUNCH_AB_OLD:?launch-ab: a variant named old needs LAUNCH_AB_OLD=TREE}" && pwd)" || return 1
  fi
  for rnd in $(seq 1 "${LAUNCH_AB_ROUNDS:-2}"); do
    for v in "${variants[@]}"; do
      name=${v%%=*}; flags=${v#*=}; tree=$PWD; sets=()
      [ "$name" = nocache ] && sets=(--set engine.compilation_cache_dir=)
      [ "$name" = old ] && tree=$(cd "$LAUNCH_AB_OLD" && pwd)
      if ! limit=$(run_limit "$budget" "$start" "${LAUNCH_AB_LIMIT_S:-150}" 60); then
        echo "launch-ab round $rnd, $name: skipped, $limit s left" | tee -a "$SUMMARY"; continue
      fi
      echo "=== launch-ab round $rnd, $name (XLA_FLAGS='$flags', tree $tree)" | tee -a "$SUMMARY"
      local t0=$SECONDS
      (cd "$tree" && if [ "$name" = old ]; then export PYTHONPATH="$AB_SITE/old${PYTHONPATH:+:$PYTHONPATH}"; fi
       flags="${XLA_FLAGS:-} $flags"; flags=$(echo $flags)   # XLA reads a blank XLA_FLAGS as a file name
       if [ -n "$flags" ]; then export XLA_FLAGS=$flags; else unset XLA_FLAGS; fi
       timeout --kill-after=10 "$limit" \
         "$PY" -m benchmarks.runner --out "$RESULTS/launch-ab/$name-$rnd" "${cfg[@]}" "${sets[@]}") \
        > "$RESULTS/launch-ab-$name-$rnd.log" 2>&1
      echo "(exit $?, $((SECONDS - t0)) s)" >> "$SUMMARY"
    done
  done
  "$PY" - "$RESULTS/launch-ab" <<'EOF' | tee -a "$SUMMARY"
import glob, json, os, sys
print("| variant-round | output tok/s | decode step ms | host ms/step | device ms/step |\n|---|---|---|---|---|")
for d in sorted(glob.glob(f"{sys.argv[1]}/*"), key=lambda d: (d.rsplit("-", 1)[1], d)):
    for f in glob.glob(f"{d}/*/result.json"):
        j = json.load(open(f))["jaxserve"]; st = j.get("engine_steps") or {}
        g = lambda k: f"{st[k]:.2f}" if st.get(k) is not None else "-"
        print(f"| {os.path.basename(d)} | {j['output_tok_per_s']:.1f} | {j['decode_step_s'] * 1e3:.2f} | "
              f"{g('host_ms_per_step')} | {g('device_ms_per_step')} |")
EOF
}

X2_BACKEND=${X2_BACKEND:-mp}

x2_steps() {   # x2_steps 70b|more|extra: issue 36's two-GPU measurements (the header says what each runs)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast off
  local be=(--set "engine.distributed_executor_backend=$X2_BACKEND") log
  case $1 in
    70b)
      needs_2_gpus x2-70b || return 0
      local pair=(--config h200x2-llama70b-tp2-latency-bs1 --config h200x2-llama70b-tp2-throughput --no-plots)
      bench "${X2_70B_LIMIT_S:-400}" x2-llama70b "${pair[@]}" "${be[@]}"
      if [ "$X2_BACKEND" = mp ] && ! grep -q "^\[bench\] engine up in" "$RESULTS/x2-llama70b.log"; then
        X2_BACKEND=uni; be=(--set engine.distributed_executor_backend=uni)
        echo "x2-70b: the engine with a process per GPU did not start; again with one process (uni)" >> "$SUMMARY"
        bench "${X2_70B_LIMIT_S:-400}" x2-llama70b-uni "${pair[@]}" "${be[@]}"
      fi
      grep -hs "^\[bench\] engine up in" "$RESULTS"/x2-llama70b.log "$RESULTS"/x2-llama70b-uni.log | sed 's/^\[bench\]/x2-70b offline:/' >> "$SUMMARY"
      bench "${X2_SERVE_LIMIT_S:-180}" x2-llama70b-serve --config h200x2-llama70b-tp2-serve "${be[@]}" --no-plots
      for log in "$RESULTS"/*-h200x2-llama70b-tp2-serve*/server.log; do
        [ -f "$log" ] && grep -o "load [0-9.]* s, warm-up.*ready in [0-9.]* s" "$log" | sed 's/^/x2-70b serve start-up (warm cache): /' >> "$SUMMARY"
      done ;;
    more)
      needs_2_gpus x2-more || return 0
      bench "${X2_QWEN_LIMIT_S:-120}" x2-qwen3-32b-tp2 --config h200x2-qwen3-32b-tp2-throughput "${be[@]}" --no-plots
      CUDA_VISIBLE_DEVICES=0 bench "${X2_QWEN_LIMIT_S:-120}" x2-qwen3-32b-tp1 --config h200x2-qwen3-32b-tp2-throughput \
        --set engine.tensor_parallel_size=1 --set engine.distributed_executor_backend=uni \
        --set name=h200-qwen3-32b-throughput --no-plots
      local split
      for split in ep2 tp2; do
        bench "${X2_MIXTRAL_LIMIT_S:-170}" "x2-mixtral-8x7b-$split" --config "h200x2-mixtral-8x7b-$split-latency-bs1" \
          --config "h200x2-mixtral-8x7b-$split-throughput" --no-plots
      done ;;
    extra)
      if [ "${NGPU:-0}" -lt 1 ]; then echo "x2-extra: skipped, needs a GPU" | tee -a "$SUMMARY"; return 0; fi
      CUDA_VISIBLE_DEVICES=0 bench "${X2_FP8_LIMIT_S:-240}" x2-llama70b-fp8 --config h200-llama70b-fp8-latency-bs1 --no-plots
      needs_2_gpus x2-startup || return 0
      diag "${X2_STARTUP_LIMIT_S:-330}" x2-startup '^(cold|warm):|Error' benchmarks/diagnostics/startup.py serve \
        --model llama-3.1-70b --load-format dummy --out "$RESULTS/startup_h200x2_llama70b_tp2.json" \
        --flags --dtype bfloat16 --tensor-parallel-size 2 --distributed-executor-backend "$X2_BACKEND" \
        --max-model-len 4096 --max-num-seqs 128 --max-num-batched-tokens 2048 --token-buckets 4 128 2048 ;;
  esac
}

split_ab() {   # split_ab decode|serve: one config with the engine core in-process (old) and in its own process (new)
  local what=$1 cfg
  if [ "$what" = decode ]; then
    cfg=(--config h200-llama8b-decode --set baseline.hf=false --no-plots)
  else
    cfg=(--config h200-llama8b-serve-sweep --set "workload.sweep.max_concurrency=[1, 256]"
         --set "workload.num_prompts=[16, 512]" --no-plots)
  fi
  for side in old new; do
    local mp=0 t0=$SECONDS; [ $side = new ] && mp=1
    echo "=== split $what, $side (JAXSERVE_ENABLE_MULTIPROCESSING=$mp): benchmarks.runner ${cfg[*]}" | tee -a "$SUMMARY"
    JAXSERVE_ENABLE_MULTIPROCESSING=$mp timeout --kill-after=20 "${SPLIT_LIMIT_S:-270}" \
      "$PY" -m benchmarks.runner --out "$RESULTS/split-$what-$side" "${cfg[@]}" > "$RESULTS/split-$what-$side.log" 2>&1
    echo "(exit $?, $((SECONDS - t0)) s)" >> "$SUMMARY"
  done
  split_table "$what" | tee -a "$SUMMARY"
}

split_table() {   # old (one process) / new (engine core in its own) for the split step's results
  "$PY" - "$RESULTS" "$1" <<'EOF'
import glob, json, sys
root, what = sys.argv[1], sys.argv[2]
def load(side):
    files = sorted(glob.glob(f"{root}/split-{what}-{side}/*/result.json"))
    return json.load(open(files[-1])) if files else None
res = {side: load(side) for side in ("old", "new")}
if what == "decode":
    print("| h200-llama8b-decode | output tok/s | runner host ms/step | engine host ms/step | device ms/step |\n|---|---|---|---|---|")
    for side, r in res.items():
        if r is None:
            print(f"| {side} | (no result) | | | |"); continue
        j = r["jaxserve"]; st = j.get("engine_steps") or {}
        f = lambda k: f"{st[k]:.2f}" if st.get(k) is not None else "-"
        print(f"| {side} | {j['output_tok_per_s']:.1f} | {f('host_ms_per_step')} | {f('engine_host_ms_per_step')} | {f('device_ms_per_step')} |")
else:
    print("| h200-llama8b-serve-sweep | concurrency | output tok/s | TPOT p50 ms | TTFT p50 ms | failed |\n|---|---|---|---|---|---|")
    for side, r in res.items():
        if r is None:
            print(f"| {side} | (no result) | | | | |"); continue
        for p in r.get("points", []):
            print(f"| {side} | {p['max_concurrency']} | {p['output_throughput']:.1f} | {p['tpot_ms']['p50']:.1f} | "
                  f"{p['ttft_ms']['p50']:.1f} | {p['failed']} |")
EOF
}

for step in "${STEPS[@]}"; do
  case $step in
    split)        split_ab decode; split_ab serve ;;
    split-decode) split_ab decode ;;
    split-serve)  split_ab serve ;;
    hostcore)     diag "${HOSTCORE_LIMIT_S:-400}" hostcore '^\||^\(|^cProfile|^20[0-9][0-9]-|Error' \
                    benchmarks/diagnostics/host_overhead.py --engine core --sampling both --profile "${TMPDIR:-/tmp}/host-core.prof" ;;
    offline)   bench "${OFFLINE_LIMIT_S:-300}" offline --config h200-llama8b-latency-bs1 \
                 --config h200-llama8b-throughput --config h200-llama8b-decode ;;
    serve)     bench "${SERVE_LIMIT_S:-240}" serve --config h200-llama8b-serve-sweep ;;
    kernels)   bench "${KERNELS_LIMIT_S:-90}" kernels --config h200-kernels ;;
    bandwidth) diag "${BANDWIDTH_LIMIT_S:-60}" bandwidth '^\||^#|_bandwidth|Error' benchmarks/diagnostics/bandwidth.py ;;
    ab)        ab "$AB_OLD" ;;
    frontend)  # FRONTEND_OLD=TREE: the same runs of an older tree first (its own frontend_overhead.py and code)
               for side in ${FRONTEND_OLD:+old} new; do
                 tree=.; [ $side = old ] && tree=$(cd "$FRONTEND_OLD" && pwd)
                 PYTHONPATH=$tree diag "${FRONTEND_LIMIT_S:-240}" "frontend-$side" '^\||^20[0-9][0-9]-|Error' \
                   "$tree/benchmarks/diagnostics/frontend_overhead.py" --repeat 3
                 PYTHONPATH=$tree diag "${FRONTEND_LIMIT_S:-240}" "frontend-stop-$side" '^\||^20[0-9][0-9]-|Error' \
                   "$tree/benchmarks/diagnostics/frontend_overhead.py" --repeat 3 --level server --stop --logprobs 2
               done ;;
    startup)   diag "${STARTUP_LIMIT_S:-540}" startup '^(cold|warm):|Error' benchmarks/diagnostics/startup.py serve \
                 --model llama-3.1-8b --load-format dummy --out "$RESULTS/startup_h200.json" ;;
    embed)     diag "${EMBED_LIMIT_S:-120}" embed '^\{"batch"' benchmarks/diagnostics/embed_bench.py \
                 --random-weights configs/models/all-minilm-l6-v2 --dtype bfloat16 --out "$RESULTS/embed_h200.json" ;;
    gpucheck)  diag "${GPUCHECK_LIMIT_S:-300}" gpucheck '^(#|- |gpu_check:)|Error' benchmarks/diagnostics/gpu_check.py ;;
    stepdiag)  tps=(1); [ "${NGPU:-0}" -ge 2 ] && tps=(1 2)
               read -r -a fls <<< "${STEPDIAG_FLAGS:-default}"
               diag "${STEPDIAG_LIMIT_S:-420}" stepdiag '!^  tp=' benchmarks/diagnostics/step_diag.py \
                 --tp "${tps[@]}" --flags "${fls[@]}" --profile --json "$RESULTS/step_diag.json" ;;
    phases)    diag "${PHASES_LIMIT_S:-360}" phases '^\| [^`]|^output tok/s|Error' benchmarks/diagnostics/decode_phases.py \
                 --model llama-3.1-8b --batch 256 --prompt-len 128 --steps 40 --profile --cprofile \
                 --json "$RESULTS/decode_phases.json" ;;
    tp2)       needs_2_gpus tp2 || continue
               bench "${TP2_LIMIT_S:-240}" tp2 --config h200-llama8b-latency-bs1 --config h200x2-llama8b-tp2 \
                 --set baseline.hf=false ;;
    carcheck)  needs_2_gpus carcheck || continue
               diag "${CARCHECK_PROBE_S:-150}" carcheck '^\||Error|mismatch' \
                 benchmarks/diagnostics/custom_allreduce_probe.py --processes 2 --fused --tokens 1 4 8 128
               for dt in float32 bfloat16; do
                 diag "${CARCHECK_ENGINE_S:-200}" "carcheck-$dt" '^\||^#|Error' \
                   benchmarks/diagnostics/custom_allreduce_probe.py --engine llama-3.2-1b --dtype "$dt"
               done ;;
    x2)        x2_steps 70b; x2_steps more; x2_steps extra ;;
    x2-70b|x2-more|x2-extra) x2_steps "${step#x2-}" ;;
    families)  families latency h200-family-latency-bs1 "${FAMILY_LIMIT_S:-200}" ;;
    families-throughput) families throughput h200-family-throughput "${FAMILY_THROUGHPUT_LIMIT_S:-240}" ;;
    gemma2-long) bench "${GEMMA2_LONG_LIMIT_S:-300}" gemma2-long --config h200-gemma2-9b-long-prompts --no-plots ;;
    moe)       bench "${MOE_QWEN3_LIMIT_S:-230}" moe-qwen3-30b-a3b --config h200-qwen3-30b-a3b-latency-bs1 \
                 --config h200-qwen3-30b-a3b-throughput --no-plots
               XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 bench "${MOE_MIXTRAL_LIMIT_S:-250}" moe-mixtral-8x7b \
                 --config h200-mixtral-8x7b-latency-bs1 --config h200-mixtral-8x7b-throughput --no-plots ;;
    moe-ab)    moe_ab ;;
    moe-serve) bench "${MOE_SERVE_LIMIT_S:-300}" moe-serve --config h200-qwen3-30b-a3b-serve-sweep --no-plots ;;
    launch-ab) launch_ab ;;
    *) echo "unknown step $step (offline, serve, kernels, bandwidth, ab OLD_TREE, split, split-decode, split-serve, hostcore, frontend, startup, embed, gpucheck, stepdiag, phases, tp2, carcheck," \
         "families, families-throughput, gemma2-long, moe, moe-ab, moe-serve, launch-ab)" >&2; exit 2 ;;
  esac
done

echo
echo "================ H200 summary ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), ${NGPU:-0} GPU(s)) ================"
cat "$SUMMARY"
