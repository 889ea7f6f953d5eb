// The int4 W4A16 decode GEMM, warp-specialized (variant "ws", included by quant_gemv.cu after int4_gemv.cuh):
// the same math per step as int4_gemv_kernel (the weights as the mma's A operand, the K labels, the lop3 /
// bf16x2 dequantization, scales once per group in float32), fed through shared memory instead of registers.
//
// A block owns 128 output columns and one K range (split-K as the register kernel). Its last warp is the
// producer: per stage (4 steps = 128 input rows = 16 packed rows) it issues Hopper bulk asynchronous copies
// (cp.async.bulk, 1-D global -> shared, completing on the stage's mbarrier): one per packed row of the tile
// (512 contiguous bytes) and one per row of x (256 bytes), into a ring of 4 stages (3 with more than 8 rows of
// x: static shared memory stays under 48 KB). The 4 consumer warps (32 columns each, the register kernel's
// lane mapping) wait on a stage's full barrier, read their fragments with 16-byte shared loads, and release the
// stage on its empty barrier (one arrive per warp). Consumers hold no load registers in flight: the bytes in
// flight per SM are the ring's (32 KB a block), not the registers'. A consumer loads the next stage's scales and
// zero points (global, L2) while it works on the current one.
//
// Shared-memory rows are padded (544 bytes per packed row, 320 per row of x) so a quarter warp's 16-byte loads
// (lanes 8h .. 8h + 7: two column quads x four packed rows) fall in distinct banks. Columns past N (the last
// tile copies only its live columns) leave stale bytes in their A rows: those products land in outputs never
// written. Steps past the range are skipped (their x is not copied).
#pragma once

#include "int4_gemv.cuh"

namespace {

constexpr int kWsConsumers = 4;                         // math warps per block, 32 columns each
constexpr int kWsThreads = 32 * (kWsConsumers + 1);     // + the producer warp
constexpr int kWsCols = 32 * kWsConsumers;              // output columns per block
constexpr int kWsStageSteps = 4;                        // K steps per stage (128 input rows)
constexpr int kWsStageRows = 4 * kWsStageSteps;         // packed rows per stage
constexpr int kWsWPitch = 4 * kWsCols + 32;             // shared bytes per packed row (512 + 32: no conflicts)
constexpr int kWsXPitch = 2 * kStepK * kWsStageSteps + 64;   // shared bytes per row of x (256 + 64)
constexpr int kWsMinBlocks = 3;                         // launch bounds: 3 blocks of 160 threads an SM

template <bool kTall> struct WsLayout {
  static constexpr int kStages = kTall ? 3 : 4;
  static constexpr int kXRows = kTall ? 16 : 8;
  static constexpr int kW = kWsStageRows * kWsWPitch;   // a stage's weights
  static constexpr int kSlot = kW + kXRows * kWsXPitch; // + its rows of x
  static constexpr int kBytes = kStages * kSlot;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WS_WAIT;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src` to shared `dst`, completing on `bar`
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void bulk_copy_hint(void* dst, const void* src, unsigned bytes, uint64_t* bar,
                                               uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}

__device__ __forceinline__ void consumers_sync() {   // the consumer warps only (the producer may have left)
  asm volatile("bar.sync 1, %0;" ::"n"(32 * kWsConsumers) : "memory");
}

// kGroupSteps: consecutive steps of a stage sharing one group (gcd(4, group / 32)).
template <typename S, bool kTall, int kGroupSteps>
__global__ void __launch_bounds__(kWsThreads, kWsMinBlocks) int4_gemv_ws_kernel(
    const __nv_bfloat16* __restrict__ x, const uint32_t* __restrict__ packed, const S* __restrict__ scales,
    const uint8_t* __restrict__ zeros, __nv_bfloat16* __restrict__ out, float* __restrict__ partials,
    unsigned* __restrict__ counters, int m, int k, int n, int group, int splits) {
  using L = WsLayout<kTall>;
  constexpr int kStages = L::kStages;
  constexpr int kGroups = kWsStageSteps / kGroupSteps;
  constexpr int kBlocks = kTall ? 2 : 1;   // 8-row blocks of x
  __shared__ __align__(128) unsigned char smem[L::kBytes];
  __shared__ __align__(8) uint64_t full[kStages];
  __shared__ __align__(8) uint64_t empty[kStages];
  __shared__ bool last;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = blockIdx.x * kWsCols, split = blockIdx.y;
  int lo, hi;
  split_range(k / kStepK, kWsStageSteps, split, splits, lo, hi);
  const int stages = (hi - lo + kWsStageSteps - 1) / kWsStageSteps;

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kWsConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warp == kWsConsumers) {   // the producer
    const int cols = min(kWsCols, n - n0);
    const uint64_t policy = evict_first_policy();
    for (int i = 0; i < stages; ++i) {
      const int slot = i % kStages;
      if (i >= kStages) mbar_wait(&empty[slot], (i / kStages - 1) & 1);
      const int s0 = lo + i * kWsStageSteps, live = min(kWsStageSteps, hi - s0);
      unsigned char* ws = smem + slot * L::kSlot;
      if (lane == 0) {
        mbar_arrive_expect_tx(&full[slot], static_cast<unsigned>(4 * live * cols * 4 + m * live * kStepK * 2));
      }
      __syncwarp();
      if (lane < 4 * live) {
        bulk_copy_hint(ws + lane * kWsWPitch, packed + static_cast<size_t>(4 * s0 + lane) * n + n0,
                       static_cast<unsigned>(cols * 4), &full[slot], policy);
      } else if (lane >= 16 && lane - 16 < m) {
        bulk_copy(ws + L::kW + (lane - 16) * kWsXPitch, x + static_cast<size_t>(lane - 16) * k + s0 * kStepK,
                  static_cast<unsigned>(live * kStepK * 2), &full[slot]);
      }
    }
    return;
  }

  // a consumer: warp `warp` owns columns n0 + 32 * warp .., lane (g, c) the 4 from wcol, packed rows 4u + c
  const int g = lane >> 2, c = lane & 3;
  const int n0w = n0 + 32 * warp;
  const int wcol_in = min(n0w + 4 * g, n - 4);
  const int gsteps = group / kStepK, grows = k / group;
  const int gshift = (gsteps & (gsteps - 1)) == 0 ? __ffs(gsteps) - 1 : -1;
  const int row_a = min(g, m - 1), row_b = min(g + 8, m - 1);
  const int w_off = c * kWsWPitch + 4 * (n0w - n0 + 4 * g);
  const int xa_off = L::kW + row_a * kWsXPitch + 16 * c, xb_off = L::kW + row_b * kWsXPitch + 16 * c;
  float acc[16] = {};

  uint32_t zw[kGroups], sc[kGroups][Scales<S>::kWords];
  auto load_groups = [&](int i, uint32_t(&z)[kGroups], uint32_t(&s)[kGroups][Scales<S>::kWords]) {
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      const int step = lo + i * kWsStageSteps + q * kGroupSteps;
      const int grow = min(gshift >= 0 ? step >> gshift : step / gsteps, grows - 1);   // past the range: clamped
      const size_t row = static_cast<size_t>(grow) * n;
      z[q] = __ldg(reinterpret_cast<const uint32_t*>(zeros + row + wcol_in));
      Scales<S>::load(scales + row + wcol_in, s[q]);
    }
  };
  if (stages > 0) load_groups(0, zw, sc);

  for (int i = 0; i < stages; ++i) {
    const int slot = i % kStages;
    uint32_t zn[kGroups], sn[kGroups][Scales<S>::kWords];
    load_groups(min(i + 1, stages - 1), zn, sn);   // the next stage's (this one's again at the last)
    const int live = min(kWsStageSteps, hi - (lo + i * kWsStageSteps));
    const unsigned char* base = smem + slot * L::kSlot;
    mbar_wait(&full[slot], (i / kStages) & 1);
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      uint32_t zz[4];
      zero_pairs(zw[q], zz);
      float t[2][2][4] = {};
#pragma unroll
      for (int v = 0; v < kGroupSteps; ++v) {
        const int u = q * kGroupSteps + v;
        if (u < live) {
          const uint4 wv = *reinterpret_cast<const uint4*>(base + w_off + 4 * u * kWsWPitch);
          uint4 xs[2];
          xs[0] = *reinterpret_cast<const uint4*>(base + xa_off + 64 * u);
          xs[1] = kTall ? *reinterpret_cast<const uint4*>(base + xb_off + 64 * u) : make_uint4(0, 0, 0, 0);
          mma_step<kBlocks>(wv, xs, zz, t);
        }
      }
      add_scaled<S, kBlocks>(acc, t, sc[q]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);   // the warp's reads of this stage are done
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      zw[q] = zn[q];
#pragma unroll
      for (int w = 0; w < Scales<S>::kWords; ++w) sc[q][w] = sn[q][w];
    }
  }

  // The warp's 32 columns are whole in its accumulators: no block-wide sum. Split-K as finish() does, the
  // consumer warps only.
  auto col_of = [&](int v) { return Int4Columns{}(v, lane, n0w); };
  if (splits == 1) {
#pragma unroll
    for (int v = 0; v < 16; ++v) {
      const int row = output_row(v, lane), col = col_of(v);
      if (row < m && col < n) out[static_cast<size_t>(row) * n + col] = __float2bfloat16_rn(acc[v]);
    }
    return;
  }
#pragma unroll
  for (int v = 0; v < 16; ++v) {
    const int row = output_row(v, lane), col = col_of(v);
    if (row < m && col < n) partials[(static_cast<size_t>(split) * m + row) * n + col] = acc[v];
  }
  __threadfence();
  consumers_sync();
  unsigned* counter = counters + blockIdx.x;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == static_cast<unsigned>(splits - 1);
  consumers_sync();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int v = 0; v < 16; ++v) {
    const int row = output_row(v, lane), col = col_of(v);
    if (row < m && col < n) {
      float total = 0.f;
      for (int q = 0; q < splits; ++q) total += __ldcg(partials + (static_cast<size_t>(q) * m + row) * n + col);
      out[static_cast<size_t>(row) * n + col] = __float2bfloat16_rn(total);
    }
  }
  if (threadIdx.x == 0) *counter = 0;   // ready for the next call
}

template <typename S, bool kTall, int kGroupSteps>
void launch_ws(cudaStream_t stream, int tiles, const void* x, const void* packed, const void* scales,
               const void* zeros, void* out, void* partials, unsigned* counters, int m, int k, int n, int group,
               int splits) {
  int4_gemv_ws_kernel<S, kTall, kGroupSteps><<<dim3(tiles, splits), kWsThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const uint32_t*>(packed), static_cast<const S*>(scales),
      static_cast<const uint8_t*>(zeros), static_cast<__nv_bfloat16*>(out), static_cast<float*>(partials),
      counters, m, k, n, group, splits);
}

// The instance for this call: gcd(4, group / 32) steps of a stage share a group
template <typename S>
void launch_ws_for(bool tall, int group_steps, cudaStream_t stream, int tiles, const void* x, const void* packed,
                   const void* scales, const void* zeros, void* out, void* partials, unsigned* counters, int m,
                   int k, int n, int group, int splits) {
  const int pow2 = group_steps & -group_steps;
#define JAXSERVE_WS_ARGS stream, tiles, x, packed, scales, zeros, out, partials, counters, m, k, n, group, splits
#define JAXSERVE_WS_TALL(kTall)                                   \
  if (pow2 >= 4) {                                                \
    launch_ws<S, kTall, 4>(JAXSERVE_WS_ARGS);                     \
  } else if (pow2 == 2) {                                         \
    launch_ws<S, kTall, 2>(JAXSERVE_WS_ARGS);                     \
  } else {                                                        \
    launch_ws<S, kTall, 1>(JAXSERVE_WS_ARGS);                     \
  }
  if (tall) {
    JAXSERVE_WS_TALL(true)
  } else {
    JAXSERVE_WS_TALL(false)
  }
#undef JAXSERVE_WS_TALL
#undef JAXSERVE_WS_ARGS
}

}  // namespace
