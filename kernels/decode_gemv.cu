// Split-K weight-streaming GEMV for decode steps (T <= 8 tokens), bf16, as an XLA FFI custom call, with the
// split-K reduction and the next elementwise op in the same launch. Built and loaded by decode_gemv.py; the
// design and its measurements are there.
//
// out = epilogue(x [T, K] @ [w0 | w1 | w2]): up to three weights [K, n_s] share x and write one packed output
// [T, sum n_s] (q, k and v as the attention kernels take them). Grid (tiles, splits): a tile is 128 output
// columns of one weight (kSiluMul: 64 gate + the matching 64 up columns of w0 [K, 2, I]), a split is a
// contiguous run of `kc` rows of K (a multiple of 16). The products run on the tensor cores: each warp takes
// blocks of 16 rows (warp w: rows k0 + 16 w, k0 + 16 (w + 8), ...) and multiplies them with x as
// mma.m16n8k16 (A = 16 weight columns x 16 rows, B = 16 rows x 8 tokens, float32 accumulators). The weight
// bytes go global -> registers in 16-byte coalesced loads (one block ahead) and are already in A's fragment
// layout after one byte permute per register: which columns make up an MMA's 16 A rows is ours to choose, so
// lane (g, t) loads columns 8 g .. 8 g + 7 of rows 2t, 2t+1, 2t+8, 2t+9 and MMA j takes column 8 g + j. (The
// first version's CUDA-core loop, 8 FMAs per weight pair and token, was issue-bound at 2.2-2.8 TB/s.)
// The warps' sums meet in shared memory. With splits > 1 every CTA writes its [T, 128] partial to
// the workspace, and the last CTA of the tile (a per-tile counter, reset by that CTA for the next call) sums
// the splits in split order, so the result's bits do not depend on which CTA finishes last. (Summing a tile's
// splits as one thread-block cluster, from distributed shared memory, measured 1.3-1.5x slower: 703e442.)
// That CTA then applies the epilogue:
//   kPlain     out = bf16(acc), with rotate-half RoPE on the segments in rope_mask (the rounding of
//              llama.apply_rope: bf16(bf16(x cos) + bf16(rot(x) sin)) on the bf16-rounded product)
//   kResidual  out = bf16(residual + bf16(acc))                         (the o / down projection's add)
//   kSiluMul   out = bf16(bf16(g sigmoid(g)) u), g, u = bf16(acc) of the gate / up column  (the MLP)
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#ifndef JAXSERVE_GEMV_NO_FFI
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
#endif

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 128;            // output columns per CTA (kSiluMul: 64 gate + 64 up)
constexpr int kMaxSegments = 3;
constexpr int kMaxDevices = 16;
constexpr int kMaxTiles = 16384;

enum Epilogue : int { kPlain = 0, kResidual = 1, kSiluMul = 2 };

unsigned* g_counters[kMaxDevices];    // per device: one counter per tile, zero between calls

struct Segment {
  const __nv_bfloat16* w;
  int n;           // output columns (kSiluMul: I)
  int ld;          // row stride of w in elements (kSiluMul: 2 I)
  int tile_begin;  // first tile of this segment
  int out_off;     // first output column
};

struct Params {
  const __nv_bfloat16* x;       // [T, K]
  const __nv_bfloat16* residual;  // [T, ldo] (kResidual)
  const __nv_bfloat16* cos;     // [T, head_dim] (rope)
  const __nv_bfloat16* sin;
  __nv_bfloat16* out;           // [T, ldo]
  float* ws;                    // [splits, TM, tiles * kTile]
  unsigned* counters;           // [tiles]
  Segment seg[kMaxSegments];
  int nseg, T, K, kc, splits, tiles, ldo, rope_mask, head_dim;
};

__device__ __forceinline__ int4 load_stream(const void* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bf16 element j (0..7) of a 16-byte row piece `lo` next to the same element of the row below, `hi`: one
// 32-bit MMA operand register holding two consecutive k of one column
__device__ __forceinline__ uint32_t k_pair(const int4& lo, const int4& hi, int j) {
  const uint32_t a = reinterpret_cast<const uint32_t*>(&lo)[j / 2], b = reinterpret_cast<const uint32_t*>(&hi)[j / 2];
  return __byte_perm(a, b, (j & 1) ? 0x7632 : 0x5410);
}

#ifndef JAXSERVE_GEMV_MIN_CTAS
#define JAXSERVE_GEMV_MIN_CTAS 2
#endif
template <int TM, int EPI>
__global__ void __launch_bounds__(kThreads, JAXSERVE_GEMV_MIN_CTAS) decode_gemv(const Params p) {
  __shared__ float red[kWarps * 8 * kTile];   // the warps' sums [warp][token][column], then [token][column] totals
  __shared__ bool last;
  const int tile = blockIdx.x, split = blockIdx.y;
  int s = 0;
  while (s + 1 < p.nseg && tile >= p.seg[s + 1].tile_begin) ++s;
  const Segment seg = p.seg[s];
  const int lt = tile - seg.tile_begin;
  const int k0 = split * p.kc, k1 = min(p.K, k0 + p.kc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;

  // The tile's 128 columns as two halves of 64 (kSiluMul: gate, then the matching up columns). Lane (g, t4)
  // streams, per block of 16 rows, rows 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 at columns 8 g .. 8 g + 7 of both
  // halves: 8 coalesced 16-byte loads. MMA j (0..7) takes column 8 g + j of the first half as its A row g and
  // of the second half as A row g + 8, so the loaded bytes are already its A fragment, two k per register.
  int c_lo, c_hi;
  if (EPI == kSiluMul) {
    c_lo = lt * (kTile / 2) + 8 * g;
    c_hi = seg.n + c_lo;
  } else {
    c_lo = lt * kTile + 8 * g;
    c_hi = c_lo + kTile / 2;
  }
  // widths are multiples of 8: a 16-byte piece is wholly inside the weight or wholly past its end
  const bool lo_ok = c_lo < seg.n;
  const bool hi_ok = EPI == kSiluMul ? lo_ok : c_hi < seg.n;
  const __nv_bfloat16* w_lo = seg.w + c_lo;
  const __nv_bfloat16* w_hi = seg.w + c_hi;
  const size_t ld = static_cast<size_t>(seg.ld);
  auto load_block = [&](int4* v, int kb) {
    const int r[4] = {kb + 2 * t4, kb + 2 * t4 + 1, kb + 2 * t4 + 8, kb + 2 * t4 + 9};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = lo_ok ? load_stream(w_lo + r[i] * ld) : make_int4(0, 0, 0, 0);
      v[2 * i + 1] = hi_ok ? load_stream(w_hi + r[i] * ld) : make_int4(0, 0, 0, 0);
    }
  };
  // x as the MMA's B operand (8 token columns): x[g][kb + 2 t4 .. + 1] and x[g][kb + 2 t4 + 8 .. + 9]
  const __nv_bfloat16* xg = p.x + static_cast<size_t>(g) * p.K + 2 * t4;
  const bool x_ok = g < p.T;

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // register double buffering: the next block (8 x 16 bytes per lane, and its x pairs) is in flight while
  // this one is multiplied (a shared-memory cp.async pipeline of 2-6 stages measured 1.7-2x slower)
  constexpr int kStep = 16 * kWarps;
  int4 cur[8], nxt[8];
  uint32_t b0 = 0, b1 = 0, nb0 = 0, nb1 = 0;
  int kb = k0 + 16 * warp;
  if (kb < k1) {
    load_block(cur, kb);
    if (x_ok) {
      b0 = *reinterpret_cast<const uint32_t*>(xg + kb);
      b1 = *reinterpret_cast<const uint32_t*>(xg + kb + 8);
    }
  }
  for (; kb < k1; kb += kStep) {
    if (kb + kStep < k1) {
      load_block(nxt, kb + kStep);
      if (x_ok) {
        nb0 = *reinterpret_cast<const uint32_t*>(xg + kb + kStep);
        nb1 = *reinterpret_cast<const uint32_t*>(xg + kb + kStep + 8);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // rows (2 t4, 2 t4 + 1) and (2 t4 + 8, 2 t4 + 9) of columns 8 g + j of each half
      const uint32_t a[4] = {k_pair(cur[0], cur[2], j), k_pair(cur[1], cur[3], j), k_pair(cur[4], cur[6], j),
                             k_pair(cur[5], cur[7], j)};
      mma_bf16(acc[j], a, b0, b1);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) cur[i] = nxt[i];
    b0 = nb0;
    b1 = nb1;
  }

  // the warps' sums, in warp order: thread c < kTile ends up with (virtual) column c of every token.
  // acc[j] = D rows g (column 8 g + j of the first half) and g + 8 (of the second), tokens 2 t4, 2 t4 + 1
  float* part = red + warp * 8 * kTile;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    part[(2 * t4) * kTile + 8 * g + j] = acc[j][0];
    part[(2 * t4 + 1) * kTile + 8 * g + j] = acc[j][1];
    part[(2 * t4) * kTile + kTile / 2 + 8 * g + j] = acc[j][2];
    part[(2 * t4 + 1) * kTile + kTile / 2 + 8 * g + j] = acc[j][3];
  }
  __syncthreads();
  const int c = threadIdx.x;
  float total[TM];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    float sum = 0.f;
    if (c < kTile) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += red[(w * 8 + t) * kTile + c];
    }
    total[t] = sum;
  }
  __syncthreads();

  if (p.splits > 1) {
    const size_t cols = static_cast<size_t>(p.tiles) * kTile;
    if (c < kTile) {
      float* mine = p.ws + static_cast<size_t>(split) * TM * cols + static_cast<size_t>(tile) * kTile + c;
#pragma unroll
      for (int t = 0; t < TM; ++t) mine[t * cols] = total[t];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&p.counters[tile], 1u) == static_cast<unsigned>(p.splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* all = p.ws + static_cast<size_t>(tile) * kTile + c;
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      float sum = 0.f;
      if (c < kTile) {
        for (int q = 0; q < p.splits; ++q) sum += __ldcg(all + (static_cast<size_t>(q) * TM + t) * cols);
      }
      total[t] = sum;
    }
    if (threadIdx.x == 0) p.counters[tile] = 0u;   // ready for the next call on this stream
  }

  const bool rope = (p.rope_mask >> s) & 1;
  if (EPI == kSiluMul || rope) {
    if (c < kTile) {
#pragma unroll
      for (int t = 0; t < TM; ++t) red[t * kTile + c] = total[t];
    }
    __syncthreads();
  }
  if (c >= kTile) return;
  if (EPI == kSiluMul) {
    const int half = kTile / 2;
    const int oc = lt * half + c;
    if (c < half && oc < seg.n) {
      for (int t = 0; t < p.T; ++t) {
        const float g = bf16_round(red[t * kTile + c]), u = bf16_round(red[t * kTile + c + half]);
        const float act = bf16_round(g * bf16_round(1.f / (1.f + __expf(-g))));
        p.out[static_cast<size_t>(t) * p.ldo + seg.out_off + oc] = __float2bfloat16_rn(act * u);
      }
    }
    return;
  }
  const int oc = lt * kTile + c;
  if (oc >= seg.n) return;
  for (int t = 0; t < p.T; ++t) {
    float y = bf16_round(total[t]);
    const size_t o = static_cast<size_t>(t) * p.ldo + seg.out_off + oc;
    if (EPI == kResidual) {
      y = __bfloat162float(p.residual[o]) + y;
    } else if (rope) {
      const int hd = p.head_dim, hh = hd / 2, j = oc % hd;
      const float other = bf16_round(red[t * kTile + (j < hh ? c + hh : c - hh)]);
      const float rot = j < hh ? -other : other;
      const float cs = __bfloat162float(p.cos[t * hd + j]), sn = __bfloat162float(p.sin[t * hd + j]);
      y = bf16_round(y * cs) + bf16_round(rot * sn);
    }
    p.out[o] = __float2bfloat16_rn(y);
  }
}

template <int EPI>
void launch_epilogue(int tm, dim3 grid, cudaStream_t stream, const Params& p) {
  switch (tm) {
    case 1: decode_gemv<1, EPI><<<grid, kThreads, 0, stream>>>(p); break;
    case 2: decode_gemv<2, EPI><<<grid, kThreads, 0, stream>>>(p); break;
    case 4: decode_gemv<4, EPI><<<grid, kThreads, 0, stream>>>(p); break;
    default: decode_gemv<8, EPI><<<grid, kThreads, 0, stream>>>(p); break;
  }
}

// One weight operand as the planner sees it: `dims` of a bf16 array, first K.
struct Weight {
  const void* data;
  const int64_t* dims;
  int rank;
};

// What one call needs besides the weights (pointers may be null where the epilogue does not read them).
struct Call {
  const void* x;
  int64_t T, K;
  const void *residual, *cos, *sin;
  int64_t residual_count, cos_count, sin_count;   // element counts, for the checks
  void* out;
  int64_t out_count;
  void* ws;
  size_t ws_bytes;
  int64_t nseg, epilogue, rope_mask, splits, head_dim;
};

// Check a call, fill `p` and the grid; an empty string when it can run, else why not.
std::string plan(const Call& c, const Weight* w, unsigned* counters, Params& p, dim3& grid, int& tm) {
  if (counters == nullptr) return "not set up on this device";
  if (c.T < 1 || c.T > 8) return "x must be bf16 [T, K] with 1 <= T <= 8";
  if (c.nseg < 1 || c.nseg > kMaxSegments || (c.epilogue != kPlain && c.nseg != 1) || c.epilogue < kPlain ||
      c.epilogue > kSiluMul) {
    return "1..3 weights (one with an epilogue)";
  }
  p = Params{};
  p.T = static_cast<int>(c.T);
  p.K = static_cast<int>(c.K);
  tm = p.T <= 1 ? 1 : p.T <= 2 ? 2 : p.T <= 4 ? 4 : 8;
  if (c.splits < 1 || c.splits > p.K) return "splits must be in [1, K]";
  if (p.K % 16 != 0) return "K must be a multiple of 16";
  // splits of whole 16-row MMA blocks
  p.kc = ((p.K + static_cast<int>(c.splits) - 1) / static_cast<int>(c.splits) + 15) / 16 * 16;
  p.splits = (p.K + p.kc - 1) / p.kc;   // <= splits
  int tiles = 0, ldo = 0;
  for (int i = 0; i < c.nseg; ++i) {
    if (w[i].rank < 2 || w[i].dims[0] != p.K) return "weights must be bf16 [K, ...]";
    int64_t ld = 1;
    for (int d = 1; d < w[i].rank; ++d) ld *= w[i].dims[d];
    if (ld % 8 != 0) return "weight columns must be a multiple of 8";
    Segment& sg = p.seg[i];
    sg.w = static_cast<const __nv_bfloat16*>(w[i].data);
    sg.ld = static_cast<int>(ld);
    sg.tile_begin = tiles;
    sg.out_off = ldo;
    if (c.epilogue == kSiluMul) {
      if (w[i].rank != 3 || w[i].dims[1] != 2) return "silu-mul weight is [K, 2, I]";
      sg.n = static_cast<int>(w[i].dims[2]);
      tiles += (sg.n + kTile / 2 - 1) / (kTile / 2);
    } else {
      sg.n = static_cast<int>(ld);
      tiles += (sg.n + kTile - 1) / kTile;
    }
    ldo += sg.n;
  }
  p.nseg = static_cast<int>(c.nseg);
  p.tiles = tiles;
  p.ldo = ldo;
  if (tiles > kMaxTiles) return "too many output columns";
  if (c.out_count != c.T * ldo) return "out must be bf16 [T, " + std::to_string(ldo) + "]";
  const size_t need = p.splits > 1 ? static_cast<size_t>(p.splits) * tm * tiles * kTile * sizeof(float) : 0;
  if (c.ws_bytes < need) return "workspace too small";
  if (c.epilogue == kResidual && c.residual_count != c.T * ldo) return "residual must be bf16 like out";
  p.rope_mask = static_cast<int>(c.rope_mask);
  p.head_dim = static_cast<int>(c.head_dim);
  if (p.rope_mask != 0) {
    if (c.epilogue != kPlain || c.head_dim < 2 || c.head_dim % 2 != 0 || kTile % c.head_dim != 0 ||
        c.cos_count != c.T * c.head_dim || c.sin_count != c.T * c.head_dim) {
      return "rope needs bf16 cos/sin [T, head_dim], head_dim dividing 256";
    }
    for (int i = 0; i < c.nseg; ++i) {
      if (((p.rope_mask >> i) & 1) && p.seg[i].n % c.head_dim != 0) return "a rope segment must be whole heads";
    }
  }
  p.x = static_cast<const __nv_bfloat16*>(c.x);
  p.residual = static_cast<const __nv_bfloat16*>(c.residual);
  p.cos = static_cast<const __nv_bfloat16*>(c.cos);
  p.sin = static_cast<const __nv_bfloat16*>(c.sin);
  p.out = static_cast<__nv_bfloat16*>(c.out);
  p.ws = static_cast<float*>(c.ws);
  p.counters = counters;
  grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(p.splits));
  return "";
}

void launch(int epilogue, int tm, dim3 grid, cudaStream_t stream, const Params& p) {
  switch (epilogue) {
    case kResidual: launch_epilogue<kResidual>(tm, grid, stream, p); break;
    case kSiluMul: launch_epilogue<kSiluMul>(tm, grid, stream, p); break;
    default: launch_epilogue<kPlain>(tm, grid, stream, p); break;
  }
}

unsigned* allocate_counters() {
  unsigned* c = nullptr;
  if (cudaMalloc(&c, kMaxTiles * sizeof(unsigned)) != cudaSuccess) return nullptr;
  if (cudaMemset(c, 0, kMaxTiles * sizeof(unsigned)) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    cudaFree(c);
    return nullptr;
  }
  return c;
}

#ifndef JAXSERVE_GEMV_NO_FFI
bool is_bf16(const ffi::AnyBuffer& b) { return b.element_type() == ffi::DataType::BF16; }

ffi::Error GemvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w0, ffi::AnyBuffer w1,
                    ffi::AnyBuffer w2, ffi::AnyBuffer residual, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws, int64_t nseg,
                    int64_t epilogue, int64_t rope_mask, int64_t splits, int64_t head_dim) {
  const std::string name = "jaxserve_decode_gemv: ";
  const auto xd = x.dimensions();
  if (!is_bf16(x) || xd.size() != 2) return ffi::Error::InvalidArgument(name + "x must be bf16 [T, K]");
  const ffi::AnyBuffer* wb[kMaxSegments] = {&w0, &w1, &w2};
  Weight w[kMaxSegments];
  for (int i = 0; i < kMaxSegments; ++i) {
    const auto d = wb[i]->dimensions();
    w[i] = Weight{wb[i]->untyped_data(), d.begin(), static_cast<int>(d.size())};
    if (i < nseg && !is_bf16(*wb[i])) return ffi::Error::InvalidArgument(name + "weights must be bf16");
  }
  if (!is_bf16(*out) || (epilogue == kResidual && !is_bf16(residual)) ||
      (rope_mask != 0 && (!is_bf16(cos) || !is_bf16(sin)))) {
    return ffi::Error::InvalidArgument(name + "out, residual, cos and sin must be bf16");
  }
  const Call c{x.untyped_data(), xd[0], xd[1], residual.untyped_data(), cos.untyped_data(), sin.untyped_data(),
               static_cast<int64_t>(residual.element_count()), static_cast<int64_t>(cos.element_count()),
               static_cast<int64_t>(sin.element_count()), out->untyped_data(),
               static_cast<int64_t>(out->element_count()), ws->untyped_data(), ws->size_bytes(), nseg, epilogue,
               rope_mask, splits, head_dim};
  Params p;
  dim3 grid;
  int tm = 1;
  const std::string why = plan(c, w, device >= 0 && device < kMaxDevices ? g_counters[device] : nullptr, p,
                               grid, tm);
  if (!why.empty()) return ffi::Error::InvalidArgument(name + why + " (device " + std::to_string(device) + ")");
  launch(static_cast<int>(epilogue), tm, grid, stream, p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}
#endif  // JAXSERVE_GEMV_NO_FFI

}  // namespace

#ifndef JAXSERVE_GEMV_NO_FFI
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveDecodeGemv, GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // w0
                                  .Arg<ffi::AnyBuffer>()   // w1 (unused unless nseg >= 2)
                                  .Arg<ffi::AnyBuffer>()   // w2 (unused unless nseg == 3)
                                  .Arg<ffi::AnyBuffer>()   // residual (kResidual)
                                  .Arg<ffi::AnyBuffer>()   // cos (rope)
                                  .Arg<ffi::AnyBuffer>()   // sin (rope)
                                  .Ret<ffi::AnyBuffer>()   // out
                                  .Ret<ffi::AnyBuffer>()   // workspace
                                  .Attr<int64_t>("nseg")
                                  .Attr<int64_t>("epilogue")
                                  .Attr<int64_t>("rope_mask")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("head_dim"),
                              {ffi::Traits::kCmdBufferCompatible});

#endif  // JAXSERVE_GEMV_NO_FFI

extern "C" {

// Allocate (once) the zeroed tile counters of `device`. Returns 0, or a CUDA error code.
int jaxserve_gemv_init(int device) {
  if (device < 0 || device >= kMaxDevices) return -1;
  if (g_counters[device] != nullptr) return 0;
  const cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return static_cast<int>(e);
  g_counters[device] = allocate_counters();
  return g_counters[device] == nullptr ? -2 : 0;
}

}  // extern "C"
