#!/usr/bin/env bash
# The project's H200 runs, each step sized to fit one device call (~8 minutes on one H200):
#   offline   the three h200-llama8b offline configs (HF side by side), one process: one engine load + warm-up
#   serve     h200-llama8b-serve-sweep (its own process: the server needs the GPU to itself)
#   kernels   h200-kernels; bandwidth: the read and copy ceilings of configs/hardware/h200.yaml; ab OLD: below
#   startup   serve llama-3.1-8b dummy until /health 200 and a first completion, fresh compile cache then warm
#   embed, gpucheck, stepdiag: the diagnostics of the same names in benchmarks/diagnostics/
#   tp2, carcheck (2 GPUs): h200x2-llama8b-tp2 next to TP=1; the custom all-reduce against psum and TP=1
# Usage: benchmarks/run_h200.sh [offline|serve|kernels|bandwidth|ab OLD_TREE|startup|embed|gpucheck|stepdiag|tp2|carcheck ...]
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

needs_2_gpus() {
  if [ "${NGPU:-0}" -lt 2 ]; then echo "$1: skipped, needs 2 GPUs (${NGPU:-0} visible)" | tee -a "$SUMMARY"; return 1; fi
}

ab() {   # ab OLD_TREE: the two configs at the old tree and at this one, interleaved; prints old / new / ratio
  local old=$1 new=$PWD
  local site=${TMPDIR:-/tmp}/ab-site
  rm -rf "$site"; mkdir -p "$site"
  for side in old new; do
    local tree=$new; [ $side = old ] && tree=$old
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site/$side" "$tree" \
         > "$RESULTS/ab-install-$side.log" 2>&1; then
      echo "ab: installing the $side tree ($tree) failed: $RESULTS/ab-install-$side.log" | tee -a "$SUMMARY"; return 1
    fi
  done
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

for step in "${STEPS[@]}"; do
  case $step in
    offline)   bench "${OFFLINE_LIMIT_S:-300}" offline --config h200-llama8b-latency-bs1 \
                 --config h200-llama8b-throughput --config h200-llama8b-decode ;;
    serve)     bench "${SERVE_LIMIT_S:-240}" serve --config h200-llama8b-serve-sweep ;;
    kernels)   bench "${KERNELS_LIMIT_S:-90}" kernels --config h200-kernels ;;
    bandwidth) echo "=== bandwidth: benchmarks/diagnostics/bandwidth.py" | tee -a "$SUMMARY"
               timeout "${BANDWIDTH_LIMIT_S:-60}" "$PY" benchmarks/diagnostics/bandwidth.py 2>&1 \
                 | tee "$RESULTS/bandwidth.log" | grep -E '^\||^#|_bandwidth|Error' >> "$SUMMARY" ;;
    ab)        ab "$AB_OLD" ;;
    startup)   echo "=== startup: benchmarks/diagnostics/startup.py serve --model llama-3.1-8b --load-format dummy" | tee -a "$SUMMARY"
               timeout "${STARTUP_LIMIT_S:-540}" "$PY" benchmarks/diagnostics/startup.py serve --model llama-3.1-8b \
                 --load-format dummy --out "$RESULTS/startup_h200.json" 2>&1 \
                 | tee "$RESULTS/startup.log" | grep -E '^(cold|warm):|Error' >> "$SUMMARY" ;;
    embed)     echo "=== embed: benchmarks/diagnostics/embed_bench.py --random-weights configs/models/all-minilm-l6-v2 --dtype bfloat16" | tee -a "$SUMMARY"
               timeout "${EMBED_LIMIT_S:-120}" "$PY" benchmarks/diagnostics/embed_bench.py \
                 --random-weights configs/models/all-minilm-l6-v2 --dtype bfloat16 --out "$RESULTS/embed_h200.json" 2>&1 \
                 | tee "$RESULTS/embed.log" | grep '^{"batch"' >> "$SUMMARY" ;;
    gpucheck)  echo "=== gpucheck: benchmarks/diagnostics/gpu_check.py" | tee -a "$SUMMARY"
               timeout "${GPUCHECK_LIMIT_S:-300}" "$PY" benchmarks/diagnostics/gpu_check.py 2>&1 \
                 | tee "$RESULTS/gpucheck.log" | tail -20 >> "$SUMMARY" ;;
    stepdiag)  tps=(1); [ "${NGPU:-0}" -ge 2 ] && tps=(1 2)
               read -r -a fls <<< "${STEPDIAG_FLAGS:-default}"
               echo "=== stepdiag: benchmarks/diagnostics/step_diag.py --tp ${tps[*]} --flags ${fls[*]} --profile" | tee -a "$SUMMARY"
               timeout "${STEPDIAG_LIMIT_S:-420}" "$PY" benchmarks/diagnostics/step_diag.py --tp "${tps[@]}" \
                 --flags "${fls[@]}" --profile --json "$RESULTS/step_diag.json" 2>&1 \
                 | tee "$RESULTS/stepdiag.log" | grep -v '^  tp=' >> "$SUMMARY" ;;
    tp2)       needs_2_gpus tp2 || continue
               bench "${TP2_LIMIT_S:-240}" tp2 --config h200-llama8b-latency-bs1 --config h200x2-llama8b-tp2 \
                 --set baseline.hf=false ;;
    carcheck)  needs_2_gpus carcheck || continue
               echo "=== carcheck: custom_allreduce_probe.py --fused; --engine llama-3.2-1b (float32, bfloat16)" | tee -a "$SUMMARY"
               timeout "${CARCHECK_PROBE_S:-150}" "$PY" benchmarks/diagnostics/custom_allreduce_probe.py --processes 2 \
                 --fused --tokens 1 4 8 128 2>&1 | tee "$RESULTS/carcheck.log" | grep -E '^\||Error|mismatch' >> "$SUMMARY"
               for dt in float32 bfloat16; do
                 timeout "${CARCHECK_ENGINE_S:-200}" "$PY" benchmarks/diagnostics/custom_allreduce_probe.py \
                   --engine llama-3.2-1b --dtype "$dt" 2>&1 | tee -a "$RESULTS/carcheck.log" | grep -E '^\||^#|Error' >> "$SUMMARY"
               done ;;
    *) echo "unknown step $step (offline, serve, kernels, bandwidth, ab OLD_TREE, embed, gpucheck, stepdiag, tp2, carcheck)" >&2; exit 2 ;;
  esac
done

echo
echo "================ H200 summary ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '(no git)'), ${NGPU:-0} GPU(s)) ================"
cat "$SUMMARY"
