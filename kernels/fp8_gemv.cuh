// The fp8 weight-only (W8A16) decode GEMM (included by quant_gemv.cu): y[M, N] = x[M, K] @ w[K, N] with w stored
// output-major as Fp8Weight keeps it (e4m3 [N, K], K contiguous) and float32 scales per output channel ([N]) or
// per 128 x 128 block ([K/128, N/128], rounded up).
//
// Each warp owns 32 weight rows (output columns) as two m16n8k16 A tiles and walks K in steps of 64: lane
// (g, c) loads 16 bytes at k0 + 16c of rows n0 + g, + 8, + 16, + 24 (a warp reads 64 contiguous bytes of each of
// 32 rows). A K index inside an mma is a label: mma t (0..3) of a step gives labels 2c, 2c+1 to real k
// k0 + 16c + 4t + {0, 1} and labels 2c+8, 2c+9 to + {2, 3}, so each lane's A fragment is bytes 4t .. 4t+3 of its
// own loads and its B fragment words 2t, 2t+1 of its 32-byte load of x[g, k0 + 16c ..] (no permutes). e4m3
// pairs become bf16 pairs exactly (through f16 and f32: e4m3 is a subset of both). Block scales apply once per
// 128-row chunk in float32; channel scales once, on the result.
#pragma once

#include <cuda_fp8.h>

#include "gemv_common.cuh"

namespace {

constexpr int kFp8StepK = 64;      // input rows per warp step (16 bytes of each of 4 rows per lane)
constexpr int kFp8Chunk = 2;       // steps per warp load: 128 rows, one block-scale row

struct Fp8Columns {    // tile t's A rows g, g + 8 = weight rows n0 + 16t + g, n0 + 16t + g + 8
  __device__ int operator()(int v, int lane, int n0) const {
    return n0 + 16 * (v >> 3) + (lane >> 2) + 8 * ((v & 3) >> 1);
  }
};

// two e4m3 values (the low 16 bits, low byte first) as a bf16x2, exactly
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t v) {
  const __half2 h2 = __half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3));
  const float2 f = __half22float2(h2);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  uint32_t r;
  memcpy(&r, &b, 4);
  return r;
}

// kBlock: 128 x 128 block scales (else per output channel). kTall: more than 8 rows of x.
template <bool kBlock, bool kTall>
__global__ void __launch_bounds__(kThreads, 2) fp8_gemv_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ w, const float* __restrict__ scale,
    int scale_cols, __nv_bfloat16* __restrict__ out, float* __restrict__ partials, unsigned* __restrict__ counters,
    int m, int k, int n, int splits) {
  constexpr int kBlocks = kTall ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * kCols, split = blockIdx.y;
  int lo, hi;
  split_range(k / kFp8StepK, kFp8Chunk, split, splits, lo, hi);
  float acc[16] = {};   // [A tile][row block][C register]

  // rows past N and rows of x past M read a valid row instead: their products land in outputs never written
  const int first = lo + warp * kFp8Chunk;
  const uint8_t* wp[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    wp[i] = w + static_cast<size_t>(min(n0 + 8 * i + g, n - 1)) * k + kFp8StepK * first + 16 * c;
  }
  const __nv_bfloat16* xpa = x + static_cast<size_t>(min(g, m - 1)) * k + kFp8StepK * first + 16 * c;
  const __nv_bfloat16* xpb = x + static_cast<size_t>(min(g + 8, m - 1)) * k + kFp8StepK * first + 16 * c;
  constexpr int kIter = kWarps * kFp8Chunk * kFp8StepK;
  for (int s0 = first; s0 < hi; s0 += kWarps * kFp8Chunk) {
    const bool whole = s0 + kFp8Chunk <= hi;   // else the second step is past the range (K % 128 == 64 only)
    uint4 wq[kFp8Chunk][4], xs[kFp8Chunk][2][2];
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kFp8Chunk; ++u) {
      const bool live = u == 0 || whole;
#pragma unroll
      for (int i = 0; i < 4; ++i) wq[u][i] = live ? load_stream(wp[i] + u * kFp8StepK) : zero4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        xs[u][0][h] = live ? load_cached(xpa + u * kFp8StepK + 8 * h) : zero4;
        xs[u][1][h] = kTall && live ? load_cached(xpb + u * kFp8StepK + 8 * h) : zero4;
      }
    }
    const float s = kBlock ? scale[static_cast<size_t>(s0 * kFp8StepK / 128) * scale_cols + n0 / 128] : 1.f;
    float t[16] = {};
#pragma unroll
    for (int u = 0; u < kFp8Chunk; ++u) {
#pragma unroll
      for (int tile = 0; tile < 2; ++tile) {
        const uint4 lo_rows = wq[u][2 * tile], hi_rows = wq[u][2 * tile + 1];   // rows g and g + 8
        const uint32_t wl[4] = {lo_rows.x, lo_rows.y, lo_rows.z, lo_rows.w};
        const uint32_t wh[4] = {hi_rows.x, hi_rows.y, hi_rows.z, hi_rows.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t a0 = e4m3x2_to_bf16x2(wl[q]), a2 = e4m3x2_to_bf16x2(wl[q] >> 16);
          const uint32_t a1 = e4m3x2_to_bf16x2(wh[q]), a3 = e4m3x2_to_bf16x2(wh[q] >> 16);
#pragma unroll
          for (int blk = 0; blk < kBlocks; ++blk) {
            const uint4 xv = xs[u][blk][q >> 1];
            const uint32_t b0 = (q & 1) ? xv.z : xv.x, b1 = (q & 1) ? xv.w : xv.y;
            float(&c4)[4] = *reinterpret_cast<float(*)[4]>(t + 8 * tile + 4 * blk);
            mma_bf16(c4, a0, a1, a2, a3, b0, b1);
          }
        }
      }
    }
#pragma unroll
    for (int v = 0; v < 16; ++v) acc[v] = kBlock ? fmaf(s, t[v], acc[v]) : acc[v] + t[v];
#pragma unroll
    for (int i = 0; i < 4; ++i) wp[i] += kIter;
    xpa += kIter;
    xpb += kIter;
  }
  finish(acc, Fp8Columns{}, kBlock ? nullptr : scale, m, n, n0, split, splits, out, partials, counters);
}

ffi::Error Fp8GemvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> partials,
                       int64_t splits, int64_t slot) {
  const std::string name = "jaxserve fp8 gemv: ";
  if (device < 0 || device >= kMaxDevices || g_counters[device] == nullptr) {
    return ffi::Error::InvalidArgument(name + "not initialized on CUDA device " + std::to_string(device));
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || (sd.size() != 1 && sd.size() != 2)) {
    return ffi::Error::InvalidArgument(name + "x [M, K], w [N, K] and scale [N] or [K/128, N/128]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0];
  const bool block = sd.size() == 2;
  if (x.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16 ||
      w.element_type() != ffi::DataType::F8E4M3FN || scale.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(name + "x and the output bf16, w e4m3, scale f32");
  }
  if (m < 1 || m > kMaxRows || wd[1] != k || k % kFp8StepK || n % 8 ||
      (block ? sd[0] != (k + 127) / 128 || sd[1] != (n + 127) / 128 : sd[0] != n)) {
    return ffi::Error::InvalidArgument(name + "unsupported shapes (M <= 16, K a multiple of 64, N of 8)");
  }
  const int64_t tiles = (n + kCols - 1) / kCols;
  if (splits < 1 || splits > k / kFp8StepK || slot < 0 || slot >= kSlots ||
      (splits > 1 && (tiles > kSlotTiles || partials->element_count() < static_cast<size_t>(splits * m * n)))) {
    return ffi::Error::InvalidArgument(name + "bad splits/slot or partials buffer");
  }
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
  unsigned* counters = g_counters[device] + slot * kSlotTiles;
  const auto* xp = static_cast<const __nv_bfloat16*>(x.untyped_data());
  const auto* wp = static_cast<const uint8_t*>(w.untyped_data());
  const auto* sp = static_cast<const float*>(scale.untyped_data());
  auto* op = static_cast<__nv_bfloat16*>(out->untyped_data());
  auto* pp = static_cast<float*>(partials->untyped_data());
  const int sc = block ? static_cast<int>(sd[1]) : 0;
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n), si = static_cast<int>(splits);
  if (block) {
    if (m > 8) {
      fp8_gemv_kernel<true, true><<<grid, kThreads, 0, stream>>>(xp, wp, sp, sc, op, pp, counters, mi, ki, ni, si);
    } else {
      fp8_gemv_kernel<true, false><<<grid, kThreads, 0, stream>>>(xp, wp, sp, sc, op, pp, counters, mi, ki, ni, si);
    }
  } else if (m > 8) {
    fp8_gemv_kernel<false, true><<<grid, kThreads, 0, stream>>>(xp, wp, sp, sc, op, pp, counters, mi, ki, ni, si);
  } else {
    fp8_gemv_kernel<false, false><<<grid, kThreads, 0, stream>>>(xp, wp, sp, sc, op, pp, counters, mi, ki, ni, si);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
