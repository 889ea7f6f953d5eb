// W4A16 decode GEMM for 1..16 rows as an XLA FFI custom call: y[M, N] = x[M, K] @ w[K, N], with w the int4
// layout of int4_matmul_pallas.py (packed int32 [K/8, N], nibble j of row r = input row 8r + j; scales and
// int8 zero points [K/G, N]). Built and loaded by int4_gemv.py, which says why and how it is used.
//
// Each warp owns 32 output columns and walks K in steps of 32 rows (4 packed rows). A step is one 16-byte load
// per thread: lane (g = lane / 4, c = lane % 4) reads packed row 4s + c, columns n0 + 4g .. n0 + 4g + 3 (a
// warp reads 4 runs of 128 contiguous bytes). The multiply runs on the tensor cores, m16n8k16 bf16 with float32
// accumulation, four n-tiles of 8 columns (n-tile i holds the thread's i-th column) and two k16 halves:
//   * B (weights): the thread's word holds 8 consecutive input rows of one column. A K index inside an mma is
//     only a label, so the 16 labels of an mma are given to real rows such that each thread's fragment comes
//     from its own word: label 2c, 2c+1 (b0) = real rows 8r + {0, 4}, label 2c+8, 2c+9 (b1) = 8r + {1, 5} in
//     the first half, 8r + {2, 6} and 8r + {3, 7} in the second (r = 4s + c).
//   * Dequantization: lop3 puts nibbles j and j + 4 into the mantissas of two bf16 128.0s (128 + q exactly),
//     one bf16x2 subtraction of 128 + z leaves q - z exactly: no int-to-float conversion.
//   * A (activations): lane's fragment for rows g and g + 8 is the same real rows of x, one 16-byte load of
//     x[row, 8r .. 8r + 7] per row, paired by byte permutes.
//   * C: the thread holds columns n0 + 8c + i and n0 + 8c + 4 + i of n-tile i; each step's product is scaled
//     there in float32 by the group's scale (8 consecutive scales: one 16-byte load), so the scale is applied
//     once per column and step, not per weight.
// The block's warps split its K range; their sums meet in shared memory. A launch with `splits` > 1 also
// splits K across blocks: each writes float32 partials, and the last block of a column tile (a per-device
// arrival counter it resets for the next call) adds them in split order and writes the output, so the result
// does not depend on which block finished first.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kTiles = 4;          // n-tiles of 8 columns per warp
constexpr int kCols = 8 * kTiles;  // columns per block
constexpr int kStepK = 32;         // input rows per warp step (4 packed rows)
constexpr int kMinChunk = 4;       // consecutive steps a warp loads before their math (16 packed rows) ...
constexpr int kMaxChunk = 8;       // ... or 32 packed rows (up to 8 rows of x and groups of 128 or more)
constexpr int kMaxRows = 16;
constexpr int kMaxDevices = 16;
constexpr int kSlots = 16;         // counter regions, so calls that may overlap use different counters
constexpr int kSlotTiles = 4096;   // column tiles per region (N up to 131072 with splits)
constexpr uint32_t kMagic = 0x43004300;  // bf16x2 (128.0, 128.0)

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

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 8 consecutive scales, kept as loaded (bf16 / f16: one 16-byte load, 4 registers) and read one at a time
__device__ __forceinline__ float scale_at(const uint32_t (&w)[4], int j, __nv_bfloat16) {
  return __uint_as_float(j & 1 ? w[j >> 1] & 0xffff0000u : w[j >> 1] << 16);
}
__device__ __forceinline__ float scale_at(const uint32_t (&w)[4], int j, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w[j >> 1] >> (16 * (j & 1)))));
}

template <typename S> struct Scales {
  static constexpr int kWords = 4;
  __device__ static void load(const S* p, uint32_t (&w)[kWords]) {
    const uint4 v = load_cached(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  }
  __device__ static float at(const uint32_t (&w)[kWords], int j) { return scale_at(w, j, S{}); }
};
template <> struct Scales<float> {
  static constexpr int kWords = 8;
  __device__ static void load(const float* p, uint32_t (&w)[kWords]) {
    const uint4 a = load_cached(p), b = load_cached(p + 4);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
  }
  __device__ static float at(const uint32_t (&w)[kWords], int j) { return __uint_as_float(w[j]); }
};

// The output element a thread's reduced value `idx` (0 .. 16 * 32) stands for: `idx / 32` = 4 * n-tile + C
// register, `idx % 32` = the lane that held it.
__device__ __forceinline__ void output_place(int idx, int n0, int& row, int& col) {
  const int j = idx >> 5, lane = idx & 31;
  const int tile = j >> 2, e = j & 3;
  row = (lane >> 2) + (e >= 2 ? 8 : 0);
  col = n0 + 8 * (lane & 3) + 4 * (e & 1) + tile;
}

// kTall: more than 8 rows (the mma's rows 8..15 are used). kChunk: consecutive steps a warp loads at once.
// kGroupSteps: consecutive steps of a chunk that share one group (gcd(kChunk, group / 32)): their products are
// summed before the one scale multiply.
template <typename S, bool kTall, int kChunk, int kGroupSteps>
__global__ void __launch_bounds__(kThreads, 2) int4_gemv_kernel(
    const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ packed, const S* __restrict__ scales,
    const uint8_t* __restrict__ zeros, __nv_bfloat16* __restrict__ out, float* __restrict__ partials,
    unsigned* __restrict__ counters, int m, int k, int n, int group, int splits) {
  constexpr int kGroups = kChunk / kGroupSteps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * kCols, split = blockIdx.y;
  const int wcol = n0 + 4 * g;   // the thread's 4 weight columns (B)
  const int scol = n0 + 8 * c;   // the thread's 8 output columns (C)
  const bool wvalid = wcol < n, svalid = scol < n;
  const bool row_lo = g < m, row_hi = kTall && g + 8 < m;
  const int ksteps = k / kStepK;
  const int chunks = (ksteps + kChunk - 1) / kChunk;
  const int lo = kChunk * static_cast<int>(static_cast<int64_t>(split) * chunks / splits);
  const int hi = min(ksteps, kChunk * static_cast<int>(static_cast<int64_t>(split + 1) * chunks / splits));
  const int gsteps = group / kStepK;
  const int gshift = (gsteps & (gsteps - 1)) == 0 ? __ffs(gsteps) - 1 : -1;   // a power of two: shift, not divide

  float acc[kTiles][4];
#pragma unroll
  for (int i = 0; i < kTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

  // pointers at the warp's first chunk, advanced by whole iterations (no per-load index arithmetic)
  const int first = lo + warp * kChunk;
  const uint32_t* wp = packed + static_cast<size_t>(4 * first + c) * n + wcol;
  const __nv_bfloat16* xp = x + static_cast<size_t>(g) * k + 8 * (4 * first + c);
  const size_t w_step = static_cast<size_t>(4) * n;                     // one step: 4 packed rows
  const size_t w_iter = static_cast<size_t>(kWarps * kChunk) * w_step;
  const size_t x_hi = static_cast<size_t>(8) * k;                       // row g + 8
  for (int s0 = first; s0 < hi; s0 += kWarps * kChunk, wp += w_iter, xp += kWarps * kChunk * kStepK) {
    // every load of the chunk first: kChunk consecutive steps (4 packed rows each), one scale/zero row per group
    uint4 w[kChunk], xa[kChunk], xb[kChunk];
    uint32_t zw[kGroups];
    uint32_t sc[kGroups][Scales<S>::kWords];
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const bool live = s0 + u < hi;
      w[u] = live && wvalid ? load_stream(wp + u * w_step) : zero4;
      xa[u] = live && row_lo ? load_cached(xp + u * kStepK) : zero4;
      xb[u] = live && row_hi ? load_cached(xp + x_hi + u * kStepK) : zero4;
    }
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int s = s0 + q * kGroupSteps;
      const bool live = s < hi;
      const size_t row = static_cast<size_t>(gshift >= 0 ? s >> gshift : s / gsteps) * n;
      zw[q] = live && wvalid ? __ldg(reinterpret_cast<const uint32_t*>(zeros + row + wcol)) : 0u;
      if (live && svalid) {
        Scales<S>::load(scales + row + scol, sc[q]);
      } else {
#pragma unroll
        for (int i = 0; i < Scales<S>::kWords; ++i) sc[q][i] = 0u;
      }
    }
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      uint32_t zz[kTiles];   // bf16x2 (128 + z, 128 + z) of each n-tile's column: one byte permute
#pragma unroll
      for (int i = 0; i < kTiles; ++i) zz[i] = __byte_perm(zw[q], 0x43434343u, 0x4040u | (0x101u * i));
      float t[kTiles][4];
#pragma unroll
      for (int i = 0; i < kTiles; ++i) t[i][0] = t[i][1] = t[i][2] = t[i][3] = 0.f;
#pragma unroll
      for (int v = 0; v < kGroupSteps; ++v) {
        const int u = q * kGroupSteps + v;
        // A fragments of the two k16 halves: (x[8r + j], x[8r + j + 4]) pairs (zeros past the range: no-ops)
        const uint32_t a0 = __byte_perm(xa[u].x, xa[u].z, 0x5410), a2 = __byte_perm(xa[u].x, xa[u].z, 0x7632);
        const uint32_t a1 = __byte_perm(xb[u].x, xb[u].z, 0x5410), a3 = __byte_perm(xb[u].x, xb[u].z, 0x7632);
        const uint32_t e0 = __byte_perm(xa[u].y, xa[u].w, 0x5410), e2 = __byte_perm(xa[u].y, xa[u].w, 0x7632);
        const uint32_t e1 = __byte_perm(xb[u].y, xb[u].w, 0x5410), e3 = __byte_perm(xb[u].y, xb[u].w, 0x7632);
        const uint32_t words[kTiles] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const uint32_t wq = words[i];
          const uint32_t b04 = sub_bf16x2(nibbles_to_bf16x2(wq), zz[i]);
          const uint32_t b15 = sub_bf16x2(nibbles_to_bf16x2(wq >> 4), zz[i]);
          const uint32_t b26 = sub_bf16x2(nibbles_to_bf16x2(wq >> 8), zz[i]);
          const uint32_t b37 = sub_bf16x2(nibbles_to_bf16x2(wq >> 12), zz[i]);
          mma_bf16(t[i], a0, a1, a2, a3, b04, b15);
          mma_bf16(t[i], e0, e1, e2, e3, b26, b37);
        }
      }
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const float s_lo = Scales<S>::at(sc[q], i), s_hi = Scales<S>::at(sc[q], 4 + i);
        acc[i][0] = fmaf(s_lo, t[i][0], acc[i][0]);
        acc[i][1] = fmaf(s_hi, t[i][1], acc[i][1]);
        if (kTall) {
          acc[i][2] = fmaf(s_lo, t[i][2], acc[i][2]);
          acc[i][3] = fmaf(s_hi, t[i][3], acc[i][3]);
        }
      }
    }
  }

  // the block's warps: sum through shared memory ([value][warp][lane]: conflict-free rows)
  __shared__ float red[kTiles * 4][kWarps][32];
#pragma unroll
  for (int i = 0; i < kTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) red[4 * i + e][warp][lane] = acc[i][e];
  }
  __syncthreads();
  constexpr int kValues = kTiles * 4 * 32;
  float sum[kValues / kThreads];
#pragma unroll
  for (int v = 0; v < kValues / kThreads; ++v) {
    const int idx = threadIdx.x + v * kThreads;
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) total += red[idx >> 5][q][idx & 31];
    sum[v] = total;
  }
  if (splits == 1) {
#pragma unroll
    for (int v = 0; v < kValues / kThreads; ++v) {
      int row, col;
      output_place(threadIdx.x + v * kThreads, n0, row, col);
      if (row < m && col < n) out[static_cast<size_t>(row) * n + col] = __float2bfloat16_rn(sum[v]);
    }
    return;
  }
#pragma unroll
  for (int v = 0; v < kValues / kThreads; ++v) {
    int row, col;
    output_place(threadIdx.x + v * kThreads, n0, row, col);
    if (row < m && col < n) partials[(static_cast<size_t>(split) * m + row) * n + col] = sum[v];
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
  for (int v = 0; v < kValues / kThreads; ++v) {
    int row, col;
    output_place(threadIdx.x + v * kThreads, n0, row, col);
    if (row < m && col < n) {
      float total = 0.f;
      for (int q = 0; q < splits; ++q) total += __ldcg(partials + (static_cast<size_t>(q) * m + row) * n + col);
      out[static_cast<size_t>(row) * n + col] = __float2bfloat16_rn(total);
    }
  }
  if (threadIdx.x == 0) *counter = 0;   // ready for the next call
}

template <typename S, bool kTall, int kChunk, int kGroupSteps>
void launch(cudaStream_t stream, dim3 grid, const void* x, const void* packed, const void* scales,
            const void* zeros, void* out, void* partials, unsigned* counters, int m, int k, int n, int group,
            int splits) {
  int4_gemv_kernel<S, kTall, kChunk, kGroupSteps><<<grid, kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const uint32_t*>(packed), static_cast<const S*>(scales),
      static_cast<const uint8_t*>(zeros), static_cast<__nv_bfloat16*>(out), static_cast<float*>(partials),
      counters, m, k, n, group, splits);
}

// The kernel instance for this call's rows and group: 8-step chunks where registers allow (up to 8 rows, groups
// of 128 rows or more), else 4; the steps sharing a group, gcd(chunk, group / 32).
template <typename S>
void launch_for(bool tall, int group_steps, cudaStream_t stream, dim3 grid, const void* x, const void* packed,
                const void* scales, const void* zeros, void* out, void* partials, unsigned* counters, int m,
                int k, int n, int group, int splits) {
#define JAXSERVE_INT4_LAUNCH(T, C, G) \
  launch<S, T, C, G>(stream, grid, x, packed, scales, zeros, out, partials, counters, m, k, n, group, splits)
  const int pow2 = group_steps & -group_steps;   // the largest power of two dividing group / 32
  if (tall) {
    if (pow2 >= 4) JAXSERVE_INT4_LAUNCH(true, kMinChunk, 4); else if (pow2 == 2) JAXSERVE_INT4_LAUNCH(true, kMinChunk, 2);
    else JAXSERVE_INT4_LAUNCH(true, kMinChunk, 1);
  } else {
    if (pow2 >= 8) JAXSERVE_INT4_LAUNCH(false, kMaxChunk, 8); else if (pow2 == 4) JAXSERVE_INT4_LAUNCH(false, kMaxChunk, 4);
    else if (pow2 == 2) JAXSERVE_INT4_LAUNCH(false, kMinChunk, 2); else JAXSERVE_INT4_LAUNCH(false, kMinChunk, 1);
  }
#undef JAXSERVE_INT4_LAUNCH
}

ffi::Error Int4GemvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer packed,
                        ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> partials, int64_t group_size, int64_t splits, int64_t slot) {
  const std::string name = "jaxserve int4 gemv: ";
  if (device < 0 || device >= kMaxDevices || g_counters[device] == nullptr) {
    return ffi::Error::InvalidArgument(name + "not initialized on CUDA device " + std::to_string(device));
  }
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scales.dimensions(), zd = zeros.dimensions();
  if (xd.size() != 2 || pd.size() != 2 || sd.size() != 2 || zd.size() != 2) {
    return ffi::Error::InvalidArgument(name + "x, packed, scales and zeros must be 2-D");
  }
  const int64_t m = xd[0], k = xd[1], n = pd[1];
  if (x.element_type() != ffi::DataType::BF16 || out->element_type() != ffi::DataType::BF16 ||
      packed.element_type() != ffi::DataType::S32 ||
      (zeros.element_type() != ffi::DataType::S8 && zeros.element_type() != ffi::DataType::U8)) {
    return ffi::Error::InvalidArgument(name + "x and the output bf16, packed int32, zeros int8");
  }
  if (m < 1 || m > kMaxRows || k % kStepK || n % 8 || pd[0] * 8 != k || group_size < kStepK ||
      group_size % kStepK || k % group_size || sd[0] != k / group_size || sd[1] != n || zd[0] != sd[0] ||
      zd[1] != n) {
    return ffi::Error::InvalidArgument(name + "unsupported shapes (M <= 16, K and the group multiples of 32, "
                                       "N of 8)");
  }
  const int64_t tiles = (n + kCols - 1) / kCols;
  if (splits < 1 || splits > k / kStepK || slot < 0 || slot >= kSlots ||
      (splits > 1 && (tiles > kSlotTiles ||
                      partials->element_count() < static_cast<size_t>(splits * m * n)))) {
    return ffi::Error::InvalidArgument(name + "bad splits/slot or partials buffer");
  }
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
  unsigned* counters = g_counters[device] + slot * kSlotTiles;
  const bool tall = m > 8;
  const int gsteps = static_cast<int>(group_size / kStepK);
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  const int gi = static_cast<int>(group_size), si = static_cast<int>(splits);
  switch (scales.element_type()) {
    case ffi::DataType::BF16:
      launch_for<__nv_bfloat16>(tall, gsteps, stream, grid, x.untyped_data(), packed.untyped_data(),
                                 scales.untyped_data(), zeros.untyped_data(), out->untyped_data(),
                                 partials->untyped_data(), counters, mi, ki, ni, gi, si);
      break;
    case ffi::DataType::F16:
      launch_for<__half>(tall, gsteps, stream, grid, x.untyped_data(), packed.untyped_data(), scales.untyped_data(),
                          zeros.untyped_data(), out->untyped_data(), partials->untyped_data(), counters, mi, ki,
                          ni, gi, si);
      break;
    case ffi::DataType::F32:
      launch_for<float>(tall, gsteps, stream, grid, x.untyped_data(), packed.untyped_data(), scales.untyped_data(),
                         zeros.untyped_data(), out->untyped_data(), partials->untyped_data(), counters, mi, ki,
                         ni, gi, si);
      break;
    default:
      return ffi::Error::InvalidArgument(name + "scales must be bf16, f16 or f32");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt4Gemv, Int4GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("group_size")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("slot"),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

// The split-K arrival counters of `device` (zeroed; each call's last block resets its own). Call once per
// device before the first call; 0 on success, else 1 with the reason in `err`.
int jaxserve_int4_gemv_init(int device, char* err, uint64_t err_len) {
  auto fail = [&](const char* what, cudaError_t e) {
    snprintf(err, err_len, "%s: %s", what, e == cudaSuccess ? "bad argument" : cudaGetErrorString(e));
    return 1;
  };
  if (device < 0 || device >= kMaxDevices) return fail("device ordinal", cudaSuccess);
  if (g_counters[device] != nullptr) return 0;
  int previous = 0;
  cudaError_t e = cudaGetDevice(&previous);
  if (e != cudaSuccess) return fail("cudaGetDevice", e);
  if ((e = cudaSetDevice(device)) != cudaSuccess) return fail("cudaSetDevice", e);
  unsigned* counters = nullptr;
  const size_t bytes = sizeof(unsigned) * kSlots * kSlotTiles;
  if ((e = cudaMalloc(&counters, bytes)) != cudaSuccess) return fail("cudaMalloc", e);
  if ((e = cudaMemset(counters, 0, bytes)) != cudaSuccess) return fail("cudaMemset", e);
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) return fail("cudaDeviceSynchronize", e);
  g_counters[device] = counters;
  cudaSetDevice(previous);
  return 0;
}

}  // extern "C"
