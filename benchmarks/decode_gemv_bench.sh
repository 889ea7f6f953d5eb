#!/usr/bin/env bash
# Build benchmarks/decode_gemv_bench.cu and run it at TP=1 and TP=2 shapes (one GPU), then profile the o and
# gate_up launches with Nsight Compute when it can read the counters (NO_NCU=1 skips that).
#   bash benchmarks/decode_gemv_bench.sh [OUTDIR]
set -u
out=${1:-/tmp/decode_gemv_bench}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvcc=${JAXSERVE_NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
"$nvcc" -O3 -std=c++17 -arch=sm_90 -o "$out/gemv_bench" benchmarks/decode_gemv_bench.cu || exit 1
for tp in 1 2; do
  echo "## --tp $tp"
  "$out/gemv_bench" --tp "$tp" --tokens 4 | tail -n +2
done
[ -n "${NO_NCU:-}" ] && exit 0
if command -v ncu >/dev/null; then
  # 16 layers x (1 + 2 reps) launches per kind: skip 50 lands on o+residual, 100 on gate_up+silu
  for skip in 50 100; do
    timeout 120 ncu --clock-control none --kernel-name regex:decode_gemv --launch-skip $skip --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
      "$out/gemv_bench" --tp 1 --tokens 4 --reps 2 --layers 16 > "$out/ncu-$skip.txt" 2>&1
    grep -E "decode_gemv|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Grid Size|Duration|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|ERR|rror" \
      "$out/ncu-$skip.txt" | head -30
  done
fi
