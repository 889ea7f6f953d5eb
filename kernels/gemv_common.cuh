// Shared by the quantized decode GEMMs of quant_gemv.cu: block shape, loads, the bf16 tensor-core mma, and the
// block's end (its warps' sums, the split-K partials and their last-block reduction).
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kCols = 32;          // columns per block (and per warp)
constexpr int kMaxRows = 16;
constexpr int kMaxDevices = 16;
constexpr int kSlots = 16;         // counter regions, so calls that may overlap use different counters
constexpr int kSlotTiles = 4096;   // column tiles per region (N up to 131072 with splits)

// the split-K arrival counters of each device (jaxserve_quant_gemv_init)
unsigned* g_counters[kMaxDevices];

__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_cached(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A block's share of K, in whole chunks of `chunk` steps: [lo, hi) steps of `steps`
__device__ __forceinline__ void split_range(int steps, int chunk, int split, int splits, int& lo, int& hi) {
  const int chunks = (steps + chunk - 1) / chunk;
  lo = chunk * static_cast<int>(static_cast<int64_t>(split) * chunks / splits);
  hi = min(steps, chunk * static_cast<int>(static_cast<int64_t>(split + 1) * chunks / splits));
}

// Where a lane's accumulator v (0..15: 8 * A tile + 4 * row block + C register) goes. Row of y: C columns
// 2c, 2c + 1 of row block v / 4 % 2. Column: the kernel's A rows g, g + 8 of A tile v / 8.
__device__ __forceinline__ int output_row(int v, int lane) { return 2 * (lane & 3) + (v & 1) + 8 * ((v >> 2) & 1); }

// The block's end: its warps' accumulators summed through shared memory ([value][warp][lane]: conflict-free
// rows), times `col_scale[col]` when given, rounded to bf16 once. With `splits` > 1 each block writes float32
// partials and the last block of the column tile (its arrival counter, reset for the next call) adds them in
// split order and writes the output.
template <typename Columns>
__device__ __forceinline__ void finish(const float (&acc)[16], Columns columns, const float* __restrict__ col_scale,
                                       int m, int n, int n0, int split, int splits, __nv_bfloat16* __restrict__ out,
                                       float* __restrict__ partials, unsigned* __restrict__ counters) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float red[16][kWarps][32];
#pragma unroll
  for (int v = 0; v < 16; ++v) red[v][warp][lane] = acc[v];
  __syncthreads();
  constexpr int kPerThread = 16 * 32 / kThreads;
  float sum[kPerThread];
  int row[kPerThread], col[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = threadIdx.x + i * kThreads, v = idx >> 5, l = idx & 31;
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) total += red[v][q][l];
    sum[i] = total;
    row[i] = output_row(v, l);
    col[i] = columns(v, l, n0);
  }
  auto store = [&](int i, float value) {
    if (col_scale != nullptr) value *= col_scale[col[i]];
    out[static_cast<size_t>(row[i]) * n + col[i]] = __float2bfloat16_rn(value);
  };
  if (splits == 1) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (row[i] < m && col[i] < n) store(i, sum[i]);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (row[i] < m && col[i] < n) partials[(static_cast<size_t>(split) * m + row[i]) * n + col[i]] = sum[i];
  }
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  unsigned* counter = counters + blockIdx.x;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == static_cast<unsigned>(splits - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (row[i] < m && col[i] < n) {
      float total = 0.f;
      for (int q = 0; q < splits; ++q) total += __ldcg(partials + (static_cast<size_t>(q) * m + row[i]) * n + col[i]);
      store(i, total);
    }
  }
  if (threadIdx.x == 0) *counter = 0;   // ready for the next call
}

}  // namespace
