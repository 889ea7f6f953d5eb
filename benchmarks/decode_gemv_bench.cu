// The decode GEMV kernel (kernels/decode_gemv.cu) alone, timed with CUDA events on Llama-3.1-8B's per-GPU
// decode shapes, next to a read-only kernel that streams the same bytes with the same grid and access pattern
// (what the loads alone cost) and a device-to-device copy of the first weight's bytes (the memory ceiling;
// its TB/s counts reads and writes). No JAX:
// this isolates the kernel from XLA's graph and the probe's harness, and it is what `ncu` profiles.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/gemv_bench benchmarks/decode_gemv_bench.cu
//   /tmp/gemv_bench [--tp 1] [--tokens 4] [--ctas-per-sm 2] [--splits 0] [--reps 20]
//
// Each (shape, splits) runs the 32 layers' distinct weights back to back (so they stream from HBM, not L2):
// microseconds per call and weight bytes per second. `--splits N` forces N splits (0: the Python side's
// default for --ctas-per-sm, decode_gemv.default_splits).
#define JAXSERVE_GEMV_NO_FFI
#include "../kernels/decode_gemv.cu"

#include <cstdio>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16((static_cast<int>(h & 0xffff) - 32768) * (1.f / 32768.f) * 0.02f);
  }
}

// The GEMV's loads with no math: the same grid (tiles x splits), blocks of 16 rows per warp and lane pattern.
__global__ void __launch_bounds__(kThreads, JAXSERVE_GEMV_MIN_CTAS) stream_read(const __nv_bfloat16* w, int K,
                                                                              int ld, int kc, unsigned* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int c_lo = blockIdx.x * kTile + 8 * g, c_hi = c_lo + kTile / 2;
  const int k0 = blockIdx.y * kc, k1 = min(K, k0 + kc);
  unsigned acc = 0;
  for (int kb = k0 + 16 * warp; kb < k1; kb += 16 * kWarps) {
    const int r[4] = {kb + 2 * t4, kb + 2 * t4 + 1, kb + 2 * t4 + 8, kb + 2 * t4 + 9};
    int4 v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = c_lo < ld ? load_stream(w + static_cast<size_t>(r[i]) * ld + c_lo) : make_int4(0, 0, 0, 0);
      v[2 * i + 1] = c_hi < ld ? load_stream(w + static_cast<size_t>(r[i]) * ld + c_hi) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;   // never (keeps the loads)
}

struct Shape {
  const char* name;
  int K;
  std::vector<int64_t> widths;   // one per segment (silu: I)
  bool silu;
  int epilogue;
  int rope_mask;
};

int default_splits(int k, int tiles, int sms, double ctas_per_sm) {
  int s = static_cast<int>(std::floor(sms * ctas_per_sm / std::max(1, tiles)));
  s = std::max(s, 1);
  return std::min(std::min(s, std::max(1, k / 128)), k);
}

}  // namespace

int main(int argc, char** argv) {
  int tp = 1, T = 4, reps = 20, forced = 0, layers = 32;
  double ctas = 2.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tp")) tp = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tokens")) T = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--ctas-per-sm")) ctas = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--splits")) forced = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int H = 4096, I = 14336 / tp, NQ = 4096 / tp, NKV = 1024 / tp, D = 128;
  const Shape shapes[] = {
      {"qkv+rope", H, {NQ, NKV, NKV}, false, kPlain, 0b011},
      {"o+residual", NQ, {H}, false, kResidual, 0},
      {"gate_up+silu", H, {I}, true, kSiluMul, 0},
      {"down+residual", I, {H}, false, kResidual, 0},
  };
  unsigned* counters = allocate_counters();
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 64));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("# decode_gemv_bench: TP=%d shapes, T=%d, %d SMs, min CTAs/SM %d, %d layers\n", tp, T, sms,
              JAXSERVE_GEMV_MIN_CTAS, layers);
  std::printf("| kind | tiles x splits | kernel us | TB/s | loads only us | TB/s | D2D copy us | TB/s moved |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    const int nseg = static_cast<int>(s.widths.size());
    std::vector<std::vector<__nv_bfloat16*>> w(layers, std::vector<__nv_bfloat16*>(nseg));
    std::vector<std::vector<int64_t>> dims(nseg);
    size_t bytes_per_layer = 0, out_cols = 0;
    int tiles = 0;
    for (int g = 0; g < nseg; ++g) {
      const int64_t n = s.widths[g];
      dims[g] = s.silu ? std::vector<int64_t>{s.K, 2, n} : std::vector<int64_t>{s.K, n};
      const size_t elems = static_cast<size_t>(s.K) * n * (s.silu ? 2 : 1);
      bytes_per_layer += elems * 2;
      out_cols += n;
      tiles += s.silu ? (n + kTile / 2 - 1) / (kTile / 2) : (n + kTile - 1) / kTile;
      for (int l = 0; l < layers; ++l) {
        CHECK(cudaMalloc(&w[l][g], elems * 2));
        fill<<<1024, 256>>>(w[l][g], elems, 17u * l + g);
      }
    }
    const int splits = forced > 0 ? forced : default_splits(s.K, tiles, sms, ctas);
    __nv_bfloat16 *x, *res, *out, *cs, *sn, *copy_dst;
    float* ws;
    CHECK(cudaMalloc(&x, static_cast<size_t>(T) * s.K * 2));
    CHECK(cudaMalloc(&res, T * out_cols * 2));
    CHECK(cudaMalloc(&out, T * out_cols * 2));
    CHECK(cudaMalloc(&cs, T * D * 2));
    CHECK(cudaMalloc(&sn, T * D * 2));
    const size_t ws_bytes = static_cast<size_t>(splits) * 8 * tiles * kTile * 4;
    CHECK(cudaMalloc(&ws, ws_bytes));
    CHECK(cudaMalloc(&copy_dst, bytes_per_layer));
    fill<<<64, 256>>>(x, static_cast<size_t>(T) * s.K, 99);
    fill<<<64, 256>>>(res, T * out_cols, 98);
    fill<<<8, 256>>>(cs, T * D, 97);
    fill<<<8, 256>>>(sn, T * D, 96);
    std::vector<Params> params(layers);
    dim3 grid;
    int tm = 1;
    for (int l = 0; l < layers; ++l) {
      Weight wd[kMaxSegments];
      for (int g = 0; g < nseg; ++g) wd[g] = Weight{w[l][g], dims[g].data(), static_cast<int>(dims[g].size())};
      const Call c{x, T, s.K, res, cs, sn, static_cast<int64_t>(T * out_cols), T * D, T * D, out,
                   static_cast<int64_t>(T * out_cols), ws, ws_bytes, nseg, s.epilogue, s.rope_mask, splits, D};
      const std::string why = plan(c, wd, counters, params[l], grid, tm);
      if (!why.empty()) {
        std::printf("| %s | plan failed: %s |\n", s.name, why.c_str());
        return 1;
      }
    }
    auto time_it = [&](auto&& body) {
      body();
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaEventRecord(e0));
      for (int r = 0; r < reps; ++r) body();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return ms * 1e3 / (reps * layers);
    };
    const double us = time_it([&] {
      for (int l = 0; l < layers; ++l) launch(s.epilogue, tm, grid, 0, params[l]);
    });
    CHECK(cudaGetLastError());
    // loads only: one launch per segment, the same tiles x splits layout per segment
    const double us_read = time_it([&] {
      for (int l = 0; l < layers; ++l) {
        for (int g = 0; g < nseg; ++g) {
          const int ld = static_cast<int>(dims[g].back() * (s.silu ? 2 : 1));
          const dim3 gr((ld + kTile - 1) / kTile, params[l].splits);
          stream_read<<<gr, kThreads>>>(w[l][g], s.K, ld, params[l].kc, sink);
        }
      }
    });
    const double us_copy = time_it([&] {
      for (int l = 0; l < layers; ++l) {
        CHECK(cudaMemcpyAsync(copy_dst, w[l][0], bytes_per_layer / nseg, cudaMemcpyDeviceToDevice));
      }
    });
    const double gb = bytes_per_layer / 1e3;   // bytes per us -> /1e6 = TB/s
    // the copy moves the first weight's bytes (a 1/nseg share) twice: read and write
    std::printf("| %s | %d x %d | %.1f | %.2f | %.1f | %.2f | %.1f | %.2f |\n", s.name, grid.x, grid.y, us,
                gb / us / 1e3, us_read, gb / us_read / 1e3, us_copy, 2 * gb / nseg / us_copy / 1e3);
    for (int l = 0; l < layers; ++l)
      for (int g = 0; g < nseg; ++g) CHECK(cudaFree(w[l][g]));
    CHECK(cudaFree(x));
    CHECK(cudaFree(res));
    CHECK(cudaFree(out));
    CHECK(cudaFree(cs));
    CHECK(cudaFree(sn));
    CHECK(cudaFree(ws));
    CHECK(cudaFree(copy_dst));
  }
  return 0;
}
