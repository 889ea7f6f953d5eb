#!/usr/bin/env bash
# The project's H200 benchmark run, in sequence, sized to fit ~8 minutes on one H200:
#   1. offline, one process (one engine load + warm-up shared): h200-llama8b-latency-bs1 (+ HF generate),
#      h200-llama8b-throughput (+ HF generate_batch on 64 prompts), h200-llama8b-decode
#   2. h200-llama8b-serve-sweep (its own process: the server needs the GPU to itself)
#   3. h200-kernels (benchmarks/kernels_bench.py)
#   embed: benchmarks/embed_bench.py on MiniLM-L6's shapes with random weights, bf16 (only when asked)
#   4. h200x2-llama8b-tp2 next to h200-llama8b-latency-bs1 (TP=1), only when asked
#      (`benchmarks/run_h200.sh tp2` on a 2-GPU machine)
#   diagnostics: allreduce (benchmarks/allreduce_probe.py, NCCL vs XLA's one-shot kernel), oneshot
#   (benchmarks/oneshot_allreduce_probe.py, a Pallas peer-write all-reduce vs psum, 2 GPUs), stepdiag
#   (benchmarks/step_diag.py --profile: TP=1, and TP=2 on 2 GPUs), smallbatch (kernels_bench.py section 6)
#   tpload: 8B safetensors vs orbax load time into TP=1 and TP=2 (2 GPUs)
#   ab: offline configs (AB_CONFIGS, default h200-llama8b-decode) at commit AB_BASE (default 5a76e75, checked out
#   as a git worktree) against this tree, interleaved base / head / base / head, HF baseline off
#   tpcar / carcheck (2 GPUs): the custom all-reduce at TP=2, fused with the add + norm or not, against XLA's and
#   TP=1 (tp_bench.py); its kernels' us per call and greedy decoding against TP=1 (custom_allreduce_probe.py)
# Usage: benchmarks/run_h200.sh [offline|serve|kernels|embed|tp2|tpbench|tpcar|carcheck|tpmulti|tpload|allreduce|oneshot|stepdiag|smallbatch|gemm|ab ...]
#        (default: offline serve kernels)
# A fresh GPU host has an empty compile cache: the server compiles its 28 step variants in ~70 s before the
# sweep starts (2026-11-30), hence the serve limit.
# Results: $OUT/results/<date>-<name>/ when $OUT is set, else benchmarks/results/; the summary is printed
# last and written to <results root>/h200-summary.txt. Step time limits are env-tunable (seconds).
set -u
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
RESULTS=${OUT:+$OUT/results}
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)                      # absolute: the ab step runs from another checkout
case $PY in */*) [ "${PY#/}" = "$PY" ] && PY=$(pwd)/$PY ;; esac
SUMMARY="$RESULTS/h200-summary.txt"
: > "$SUMMARY"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
STEPS=("$@")
if [ ${#STEPS[@]} -eq 0 ]; then
  STEPS=(offline serve kernels)
fi

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

for step in "${STEPS[@]}"; do
  case $step in
    offline) bench "${OFFLINE_LIMIT_S:-300}" offline --config h200-llama8b-latency-bs1 \
               --config h200-llama8b-throughput --config h200-llama8b-decode ;;
    serve)   bench "${SERVE_LIMIT_S:-180}" serve --config h200-llama8b-serve-sweep ;;
    kernels) bench "${KERNELS_LIMIT_S:-60}" kernels --config h200-kernels ;;
    tp2)     if [ "${NGPU:-0}" -lt 2 ]; then echo "tp2: skipped, needs 2 GPUs (${NGPU:-0} visible)" | tee -a "$SUMMARY"; continue; fi
             # TP=1 and TP=2 single-stream in one run (same prompt, same process; HF skipped)
             bench "${TP2_LIMIT_S:-240}" tp2 --config h200-llama8b-latency-bs1 --config h200x2-llama8b-tp2 \
               --set baseline.hf=false ;;
    tpbench) if [ "${NGPU:-0}" -lt 2 ]; then echo "tpbench: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # TP=1 vs TP=2 driven by one process (uni) and by a process per GPU (mp), single stream + offline
             # with 8-step decoding (run D of 2026-11-30-h200x2-multistep-tp.md: children took 94-115 s; on a fresh
             # host's empty compile cache a TP=2 mp child ran past 190 s, 2026-11-30-h200-eighth-session.md)
             echo "=== tpbench: benchmarks/tp_bench.py --skip-load --executors uni mp --num-scheduler-steps ${TPBENCH_STEPS:-8}" | tee -a "$SUMMARY"
             timeout "${TPBENCH_LIMIT_S:-560}" "$PY" benchmarks/tp_bench.py --skip-load --executors uni mp \
               --num-scheduler-steps ${TPBENCH_STEPS:-8} \
               --num-prompts 256 --max-num-batched-tokens 2048 --child-timeout "${TPBENCH_CHILD_S:-240}" --results-dir "$RESULTS" 2>&1 \
               | tee "$RESULTS/tpbench.log" | grep -E '^\| |failed' >> "$SUMMARY" ;;
    tpcar)   if [ "${NGPU:-0}" -lt 2 ]; then echo "tpcar: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # TP=2 single stream with the custom all-reduce fused with the residual add + RMSNorm (the default),
             # unfused, XLA's all-reduce, and TP=1, one tp_bench command (process per GPU, 8-step decoding)
             echo "=== tpcar: benchmarks/tp_bench.py --tp 2 1 --executors mp --all-reduce custom custom-unfused xla" | tee -a "$SUMMARY"
             timeout "${TPCAR_LIMIT_S:-570}" "$PY" benchmarks/tp_bench.py --model llama-3.1-8b --skip-load --skip-offline \
               --tp 2 1 --executors mp --all-reduce custom custom-unfused xla --num-scheduler-steps 8 \
               --max-num-batched-tokens 2048 --child-timeout "${TPCAR_CHILD_S:-200}" --results-dir "$RESULTS" 2>&1 \
               | tee "$RESULTS/tpcar.log" | grep -E '^\| |failed' >> "$SUMMARY" ;;
    carcheck) if [ "${NGPU:-0}" -lt 2 ]; then echo "carcheck: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # the custom all-reduce kernels at TP=2: the fused kernel's us per call against the unfused one and
             # XLA's add + norm; then greedy decoding through the engine, TP=2 (custom, XLA) against TP=1
             echo "=== carcheck: custom_allreduce_probe.py --fused; --engine llama-3.2-1b (float32, bfloat16)" | tee -a "$SUMMARY"
             timeout "${CARCHECK_PROBE_S:-150}" "$PY" benchmarks/custom_allreduce_probe.py --processes 2 --fused \
               --tokens 1 4 8 128 2>&1 | tee "$RESULTS/carcheck.log" | grep -E '^\||Error|mismatch' >> "$SUMMARY"
             for dt in float32 bfloat16; do
               timeout "${CARCHECK_ENGINE_S:-200}" "$PY" benchmarks/custom_allreduce_probe.py --engine llama-3.2-1b \
                 --dtype "$dt" 2>&1 | tee -a "$RESULTS/carcheck.log" | grep -E '^\||^#|Error' >> "$SUMMARY"
             done ;;
    tpload)  if [ "${NGPU:-0}" -lt 2 ]; then echo "tpload: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # 8B weights (random, HF safetensors layout) vs their orbax conversion, loaded into TP=1 and TP=2
             echo "=== tpload: benchmarks/tp_bench.py --skip-speed --tp 1 2 --load-repeats 1" | tee -a "$SUMMARY"
             timeout "${TPLOAD_LIMIT_S:-400}" "$PY" benchmarks/tp_bench.py --skip-speed --tp 1 2 --load-repeats 1 \
               --child-timeout 200 --results-dir "$RESULTS" 2>&1 | tee "$RESULTS/tpload.log" | grep -E '^\| |failed' >> "$SUMMARY" ;;
    oneshot) if [ "${NGPU:-0}" -lt 2 ]; then echo "oneshot: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # the Pallas Mosaic GPU peer-write all-reduce vs psum (a protocol error can hang: hence the limit)
             for pa_ in "" "--processes 2"; do       # one process for both GPUs, then one per GPU
               echo "=== oneshot: benchmarks/oneshot_allreduce_probe.py $pa_" | tee -a "$SUMMARY"
               # shellcheck disable=SC2086
               timeout "${ONESHOT_LIMIT_S:-150}" "$PY" benchmarks/oneshot_allreduce_probe.py $pa_ 2>&1 \
                 | tee -a "$RESULTS/oneshot.log" | grep -E '^\||Error' >> "$SUMMARY"
             done ;;
    allreduce) # XLA all-reduce latency: NCCL vs XLA's one-shot collective kernel, one process and one per GPU
             for fl in "" "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"; do
               for np_ in 1 2; do
                 echo "=== allreduce: XLA_FLAGS='$fl' processes=$np_" | tee -a "$SUMMARY"
                 pa=(); [ "$np_" -gt 1 ] && pa=(--processes "$np_")
                 XLA_FLAGS="$fl" timeout 120 "$PY" benchmarks/allreduce_probe.py "${pa[@]}" 2>&1 \
                   | grep -E '^\[|Error|error' | head -5 | tee -a "$SUMMARY"
               done
             done ;;
    stepdiag) # where a decode step goes: e2e vs forward replay, GPU kernels and host spans per step
             tps=(1); [ "${NGPU:-0}" -ge 2 ] && tps=(1 2)
             read -r -a fls <<< "${STEPDIAG_FLAGS:-default coll-kernels}"
             echo "=== stepdiag: benchmarks/step_diag.py --tp ${tps[*]} --flags ${fls[*]} --profile" | tee -a "$SUMMARY"
             timeout "${STEPDIAG_LIMIT_S:-420}" "$PY" benchmarks/step_diag.py --tp "${tps[@]}" --flags "${fls[@]}" \
               --profile --json "$RESULTS/step_diag.json" 2>&1 | tee "$RESULTS/stepdiag.log" | grep -v '^  tp=' >> "$SUMMARY" ;;
    tpmulti) if [ "${NGPU:-0}" -lt 2 ]; then echo "tpmulti: skipped, needs 2 GPUs" | tee -a "$SUMMARY"; continue; fi
             # TP=2 under 8-step decoding, one process: XLA flag sets (graph-nccl: all-reduces as NCCL inside the
             # command buffers; with the mp executor it measured 265.1 tok/s, no better than default flags,
             # 2026-11-30-h200-sixth-session.md). A child loads the 8B and compiles the 8-step loops in > 110 s.
             read -r -a fls <<< "${TPMULTI_FLAGS:-default graph-nccl}"
             echo "=== tpmulti: step_diag.py --tp 2 --flags ${fls[*]} --num-scheduler-steps 8" | tee -a "$SUMMARY"
             timeout "${TPMULTI_LIMIT_S:-400}" "$PY" benchmarks/step_diag.py --tp 2 --flags "${fls[@]}" \
               --num-scheduler-steps 8 --child-timeout 170 --json "$RESULTS/step_diag_multistep.json" 2>&1 \
               | tee "$RESULTS/tpmulti.log" | grep -E '^\||error|timeout' >> "$SUMMARY" ;;
    gemm)    # the decode step's weight GEMMs per GPU at TP=1 / TP=2 shapes under XLA flag sets (one GPU is enough)
             echo "=== gemm: benchmarks/gemm_probe.py" | tee -a "$SUMMARY"
             timeout "${GEMM_LIMIT_S:-300}" "$PY" benchmarks/gemm_probe.py --child-timeout 120 2>&1 \
               | tee "$RESULTS/gemm.log" | grep -E '^\||^\(' >> "$SUMMARY" ;;
    smallbatch) echo "=== smallbatch: benchmarks/kernels_bench.py --only 6" | tee -a "$SUMMARY"
             timeout "${SMALLBATCH_LIMIT_S:-150}" "$PY" benchmarks/kernels_bench.py --only 6 2>&1 \
               | tee "$RESULTS/smallbatch.log" | grep '^|' >> "$SUMMARY" ;;
    embed)   echo "=== embed: benchmarks/embed_bench.py --random-weights configs/models/all-minilm-l6-v2 --dtype bfloat16" | tee -a "$SUMMARY"
             timeout "${EMBED_LIMIT_S:-120}" "$PY" benchmarks/embed_bench.py --random-weights configs/models/all-minilm-l6-v2 \
               --dtype bfloat16 --out "$RESULTS/embed_h200.json" 2>&1 | tee "$RESULTS/embed.log" | grep '^{"batch"' >> "$SUMMARY" ;;
    ab)      # the same offline configs at AB_BASE and at this tree, interleaved, in one session (one GPU host)
             base=${AB_BASE:-5a76e75}
             wt=$(mktemp -d)/base
             if ! git worktree add --detach "$wt" "$base" > /dev/null 2>&1; then
               echo "ab: cannot check out $base as a worktree" | tee -a "$SUMMARY"; continue
             fi
             read -r -a cfgs <<< "${AB_CONFIGS:-h200-llama8b-decode}"
             cargs=(); for c in "${cfgs[@]}"; do cargs+=(--config "$c"); done
             for rnd in 1 2; do
               for side in base head; do
                 dir=$(pwd); label="this tree"
                 [ "$side" = base ] && { dir=$wt; label=$base; }
                 echo "=== ab round $rnd, $side ($label): benchmarks.runner ${cargs[*]} --set baseline.hf=false" | tee -a "$SUMMARY"
                 (cd "$dir" && timeout "${AB_LIMIT_S:-200}" "$PY" -m benchmarks.runner --out "$RESULTS/ab-$side-$rnd" \
                   "${cargs[@]}" --set baseline.hf=false) > "$RESULTS/ab-$side-$rnd.log" 2>&1
                 sed -n '/^== summary ==$/,$p' "$RESULTS/ab-$side-$rnd.log" | tail -n +2 >> "$SUMMARY"
               done
             done
             git worktree remove --force "$wt" ;;
    *) echo "unknown step $step (offline, serve, kernels, embed, tp2, tpbench, tpcar, carcheck, tpmulti, tpload, allreduce, oneshot, stepdiag, smallbatch, gemm, ab)" >&2; exit 2 ;;
  esac
done

echo
echo "================ H200 summary ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null), ${NGPU:-0} GPU(s)) ================"
cat "$SUMMARY"
