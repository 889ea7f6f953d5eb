// The int4 W4A16 decode GEMM (included by quant_gemv.cu): y[M, N] = x[M, K] @ w[K, N], with w the int4 layout of
// int4_matmul_pallas.py (packed int32 [K/8, N], nibble j of row r = input row 8r + j; scales and int8 zero
// points [K/G, N]).
//
// Each warp owns 32 output columns and walks K in steps of 32 rows (4 packed rows). A step is one 16-byte load
// per thread: lane (g = lane / 4, c = lane % 4) reads packed row 4s + c, columns n0 + 4g .. n0 + 4g + 3 (a
// warp reads 4 runs of 128 contiguous bytes). The multiply runs on the tensor cores, m16n8k16 bf16 with float32
// accumulation, with the weights as the 16-row A operand and x as the 8-column B operand (y^T = w^T x^T: up to
// 8 rows of x fill the mma, none padded; 9..16 rows take a second mma). Per step, mma j (0, 1) covers columns
// n0 + 4g + 2j (its A row g) and n0 + 4g + 2j + 1 (row g + 8), in two k16 halves:
//   * K labels: a K index inside an mma is only a label, so the 16 labels are given to real rows such that each
//     thread's fragment comes from its own words: labels 2c, 2c+1 = real rows 8r + {0, 4}, labels 2c+8, 2c+9 =
//     8r + {1, 5} in the first half, 8r + {2, 6} and 8r + {3, 7} in the second (r = 4s + c).
//   * Dequantization: lop3 puts nibbles j and j + 4 into the mantissas of two bf16 128.0s (128 + q exactly),
//     one bf16x2 subtraction of 128 + z leaves q - z exactly: no int-to-float conversion.
//   * B (activations): lane's fragment is x row g at the same real rows, one 16-byte load of x[g, 8r .. 8r + 7]
//     paired by byte permutes.
//   * C: the thread holds rows 2c, 2c + 1 of its columns 2j and 2j + 1; the products of the steps sharing a
//     group are scaled there once in float32 (the thread's 4 scales: one 8-byte load), not per weight.
// The block's warps split its K range; their sums meet in shared memory. A launch with `splits` > 1 also
// splits K across blocks: each writes float32 partials, and the last block of a column tile (a per-device
// arrival counter it resets for the next call) adds them in split order and writes the output, so the result
// does not depend on which block finished first.
#pragma once

#include "gemv_common.cuh"

namespace {

constexpr int kStepK = 32;         // input rows per warp step (4 packed rows)
constexpr int kMinChunk = 4;       // consecutive steps a warp loads before their math (16 packed rows) ...
constexpr int kMaxChunk = 8;       // ... or 32 packed rows (up to 8 rows of x and groups of 128 or more)
constexpr uint32_t kMagic = 0x43004300;  // bf16x2 (128.0, 128.0)

// (a & mask) | magic in one instruction
__device__ __forceinline__ uint32_t nibbles_to_bf16x2(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(0x000f000fu), "r"(kMagic));
  return r;
}

__device__ __forceinline__ uint32_t sub_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The thread's 4 consecutive scales, kept as loaded (bf16 / f16: one 8-byte load, 2 registers) and read one
// at a time
__device__ __forceinline__ float scale_at(const uint32_t (&w)[2], int j, __nv_bfloat16) {
  return __uint_as_float(j & 1 ? w[j >> 1] & 0xffff0000u : w[j >> 1] << 16);
}
__device__ __forceinline__ float scale_at(const uint32_t (&w)[2], int j, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w[j >> 1] >> (16 * (j & 1)))));
}

template <typename S> struct Scales {
  static constexpr int kWords = 2;
  __device__ static void load(const S* p, uint32_t (&w)[kWords]) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  }
  __device__ static float at(const uint32_t (&w)[kWords], int j) { return scale_at(w, j, S{}); }
};
template <> struct Scales<float> {
  static constexpr int kWords = 4;
  __device__ static void load(const float* p, uint32_t (&w)[kWords]) {
    const uint4 v = load_cached(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  }
  __device__ static float at(const uint32_t (&w)[kWords], int j) { return __uint_as_float(w[j]); }
};

// bf16x2 (128 + z, 128 + z) of each of the thread's 4 columns, from their packed zero-point word: one byte
// permute each
__device__ __forceinline__ void zero_pairs(uint32_t zw, uint32_t (&zz)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) zz[i] = __byte_perm(zw, 0x43434343u, 0x4040u | (0x101u * i));
}

// One step (4 packed rows) of the thread's 4 columns against x's kBlocks 8-row blocks, into t[mma j][block]:
// B fragments are (x[8r + p], x[8r + p + 4]) pairs of both k16 halves, A the columns' nibble pairs (p, p + 4)
// as exact bf16 q - z
template <int kBlocks>
__device__ __forceinline__ void mma_step(const uint4& wv, const uint4 (&xs)[2], const uint32_t (&zz)[4],
                                         float (&t)[2][2][4]) {
  uint32_t b[2][4];
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk) {
    b[blk][0] = __byte_perm(xs[blk].x, xs[blk].z, 0x5410);
    b[blk][1] = __byte_perm(xs[blk].x, xs[blk].z, 0x7632);
    b[blk][2] = __byte_perm(xs[blk].y, xs[blk].w, 0x5410);
    b[blk][3] = __byte_perm(xs[blk].y, xs[blk].w, 0x7632);
  }
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
  uint32_t d[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int pr = 0; pr < 4; ++pr) d[i][pr] = sub_bf16x2(nibbles_to_bf16x2(words[i] >> (4 * pr)), zz[i]);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      mma_bf16(t[j][blk], d[2 * j][0], d[2 * j + 1][0], d[2 * j][1], d[2 * j + 1][1], b[blk][0], b[blk][1]);
      mma_bf16(t[j][blk], d[2 * j][2], d[2 * j + 1][2], d[2 * j][3], d[2 * j + 1][3], b[blk][2], b[blk][3]);
    }
  }
}

// A group's products t scaled once by its columns' scales into the accumulators
template <typename S, int kBlocks>
__device__ __forceinline__ void add_scaled(float* acc, const float (&t)[2][2][4],
                                           const uint32_t (&sc)[Scales<S>::kWords]) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float s_even = Scales<S>::at(sc, 2 * j), s_odd = Scales<S>::at(sc, 2 * j + 1);
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      float* a = acc + 8 * j + 4 * blk;
      a[0] = fmaf(s_even, t[j][blk][0], a[0]);
      a[1] = fmaf(s_even, t[j][blk][1], a[1]);
      a[2] = fmaf(s_odd, t[j][blk][2], a[2]);
      a[3] = fmaf(s_odd, t[j][blk][3], a[3]);
    }
  }
}

struct Int4Columns {   // mma j's A rows g, g + 8 = the lane's columns 2j, 2j + 1 (4 per lane, from n0 + 4g)
  __device__ int operator()(int v, int lane, int n0) const {
    return n0 + 4 * (lane >> 2) + 2 * (v >> 3) + ((v & 3) >> 1);
  }
};

// kTall: more than 8 rows (a second mma per A tile for x's rows 8..15). kChunk: consecutive steps a warp loads
// at once. kGroupSteps: consecutive steps of a chunk that share one group (gcd(kChunk, group / 32)): their
// products are summed before the one scale multiply. kMinBlocks: resident blocks an SM the registers must allow
// (2: <= 128 registers, the default; the occupancy variants ask 3 (<= 80) or 4 (<= 64)).
template <typename S, bool kTall, int kChunk, int kGroupSteps, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) int4_gemv_kernel(
    const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ packed, const S* __restrict__ scales,
    const uint8_t* __restrict__ zeros, __nv_bfloat16* __restrict__ out, float* __restrict__ partials,
    unsigned* __restrict__ counters, int m, int k, int n, int group, int splits) {
  constexpr int kGroups = kChunk / kGroupSteps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * kCols, split = blockIdx.y;
  const int wcol = n0 + 4 * g;   // the thread's 4 columns (n % 8 == 0: all 4 or none inside)
  const int ksteps = k / kStepK;
  int lo, hi;
  split_range(ksteps, kChunk, split, splits, lo, hi);
  const int gsteps = group / kStepK;
  const int gshift = (gsteps & (gsteps - 1)) == 0 ? __ffs(gsteps) - 1 : -1;   // a power of two: shift, not divide

  constexpr int kBlocks = kTall ? 2 : 1;   // 8-row blocks of x
  float acc[16] = {};                       // [mma j][row block][C register], flattened

  // Columns past N (the last tile) and rows of x past M read a valid column / row instead: their products
  // land in outputs that are never written. Pointers at the warp's first chunk, advanced by whole iterations.
  const int wcol_in = min(wcol, n - 4);
  const int first = lo + warp * kChunk;
  const uint32_t* wp = packed + static_cast<size_t>(4 * first + c) * n + wcol_in;
  const __nv_bfloat16* xpa = x + static_cast<size_t>(min(g, m - 1)) * k + 8 * (4 * first + c);
  const __nv_bfloat16* xpb = x + static_cast<size_t>(min(g + 8, m - 1)) * k + 8 * (4 * first + c);
  const size_t w_step = static_cast<size_t>(4) * n;                     // one step: 4 packed rows
  const size_t w_iter = static_cast<size_t>(kWarps * kChunk) * w_step;
  constexpr int x_iter = kWarps * kChunk * kStepK;
  for (int s0 = first; s0 < hi; s0 += kWarps * kChunk, wp += w_iter, xpa += x_iter, xpb += x_iter) {
   // a whole chunk loads unpredicated; the last one of a range zeroes the activations of its steps past `hi`
   // (their products vanish) and skips their scale rows
   auto run_chunk = [&](auto whole) {
    constexpr bool kWhole = decltype(whole)::value;
    uint4 w[kChunk], xa[kChunk], xb[kChunk];
    uint32_t zw[kGroups];
    uint32_t sc[kGroups][Scales<S>::kWords];
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const bool live = kWhole || s0 + u < hi;
      w[u] = live ? load_stream(wp + u * w_step) : zero4;
      xa[u] = live ? load_cached(xpa + u * kStepK) : zero4;
      xb[u] = kTall && live ? load_cached(xpb + u * kStepK) : zero4;
    }
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int s = s0 + q * kGroupSteps;
      const bool live = kWhole || s < hi;
      const size_t row = static_cast<size_t>(gshift >= 0 ? s >> gshift : s / gsteps) * n;
      zw[q] = live ? __ldg(reinterpret_cast<const uint32_t*>(zeros + row + wcol_in)) : 0u;
      if (live) {
        Scales<S>::load(scales + row + wcol_in, sc[q]);
      } else {
#pragma unroll
        for (int i = 0; i < Scales<S>::kWords; ++i) sc[q][i] = 0u;
      }
    }
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      uint32_t zz[4];
      zero_pairs(zw[q], zz);
      float t[2][2][4] = {};
#pragma unroll
      for (int v = 0; v < kGroupSteps; ++v) {
        const int u = q * kGroupSteps + v;
        const uint4 xs[2] = {xa[u], xb[u]};
        mma_step<kBlocks>(w[u], xs, zz, t);
      }
      add_scaled<S, kBlocks>(acc, t, sc[q]);
    }
   };
   if (s0 + kChunk <= hi) {
     run_chunk(std::true_type{});
   } else {
     run_chunk(std::false_type{});
   }
  }

  finish(acc, Int4Columns{}, nullptr, m, n, n0, split, splits, out, partials, counters);
}

template <typename S, bool kTall, int kChunk, int kGroupSteps, int kMinBlocks>
void launch(cudaStream_t stream, dim3 grid, const void* x, const void* packed, const void* scales,
            const void* zeros, void* out, void* partials, unsigned* counters, int m, int k, int n, int group,
            int splits) {
  int4_gemv_kernel<S, kTall, kChunk, kGroupSteps, kMinBlocks><<<grid, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const uint32_t*>(packed), static_cast<const S*>(scales),
      static_cast<const uint8_t*>(zeros), static_cast<__nv_bfloat16*>(out), static_cast<float*>(partials),
      counters, m, k, n, group, splits);
}

#define JAXSERVE_INT4_ARGS stream, grid, x, packed, scales, zeros, out, partials, counters, m, k, n, group, splits

// The steps of a chunk sharing a group: gcd(kChunk, group / 32), from `pow2`, the largest power of two dividing
// group / 32 (a chunk of 8 runs only for groups of 128 rows or more)
template <typename S, bool kTall, int kChunk, int kMinBlocks>
void launch_chunk(int pow2, cudaStream_t stream, dim3 grid, const void* x, const void* packed,
                  const void* scales, const void* zeros, void* out, void* partials, unsigned* counters, int m,
                  int k, int n, int group, int splits) {
  if (pow2 >= kChunk) {
    launch<S, kTall, kChunk, kChunk, kMinBlocks>(JAXSERVE_INT4_ARGS);
  } else if constexpr (kChunk == kMaxChunk) {
    launch<S, kTall, kChunk, kMinChunk, kMinBlocks>(JAXSERVE_INT4_ARGS);
  } else if (pow2 == 2) {
    launch<S, kTall, kChunk, 2, kMinBlocks>(JAXSERVE_INT4_ARGS);
  } else {
    launch<S, kTall, kChunk, 1, kMinBlocks>(JAXSERVE_INT4_ARGS);
  }
}

// The kernel instance for this call: chunks of 8 steps where asked for and registers allow (up to 8 rows, groups
// of 128 rows or more, the default 2 blocks an SM), else 4. `tall` only with kMinBlocks == 2.
template <typename S, int kMinBlocks>
void launch_for(bool tall, int chunk, int group_steps, cudaStream_t stream, dim3 grid, const void* x,
                const void* packed, const void* scales, const void* zeros, void* out, void* partials,
                unsigned* counters, int m, int k, int n, int group, int splits) {
  const int pow2 = group_steps & -group_steps;
  if constexpr (kMinBlocks == 2) {
    if (tall) {
      launch_chunk<S, true, kMinChunk, kMinBlocks>(pow2, JAXSERVE_INT4_ARGS);
    } else if (chunk == kMaxChunk && pow2 >= kMinChunk) {
      launch_chunk<S, false, kMaxChunk, kMinBlocks>(pow2, JAXSERVE_INT4_ARGS);
    } else {
      launch_chunk<S, false, kMinChunk, kMinBlocks>(pow2, JAXSERVE_INT4_ARGS);
    }
  } else {   // the occupancy variants: up to 8 rows, chunks of 4 (8 would hold 64 registers of loads alone)
    launch_chunk<S, false, kMinChunk, kMinBlocks>(pow2, JAXSERVE_INT4_ARGS);
  }
}
#undef JAXSERVE_INT4_ARGS

}  // namespace
