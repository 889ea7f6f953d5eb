// One-shot peer-write all-reduce for small tensor-parallel activations (decode steps), as an XLA FFI
// custom call. Built and loaded by custom_allreduce.py; the design and its measurements are there.
//
// Each rank owns one CUDA IPC buffer: a flag table [MAX_BLOCKS][MAX_RANKS] of uint32 epochs, then two
// receive areas (call parity 0/1), each with one slot per rank. A call with epoch e (per device, counted on
// the device so CUDA-graph replays advance it) runs `blocks` CTAs; CTA b:
//   1. writes its slice of the input straight into slot[me] of area e&1 on every peer (NVLink stores),
//   2. publishes e in flag[b][me] on every peer (release, system scope),
//   3. waits until flag[b][q] >= e in its own table for every peer q (acquire, system scope),
//   4. sums the ranks' slices in rank order in float32 and rounds once, so every rank gets the same bits.
// Two areas are enough: a rank enters call e+2 only after seeing a peer's flag for e+1, which the peer
// raises only after it has finished reading area e&1 in call e (kernels on one stream run in order).
// The last CTA to finish advances the epoch.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kMaxDevices = 16;
constexpr int kThreads = 512;
constexpr uint64_t kWaitLimitNs = 120ull * 1000 * 1000 * 1000;  // a peer this late is gone
constexpr size_t kDataOffset = 4096;  // flag table (kMaxBlocks * kMaxRanks * 4 = 2 KiB) padded
static_assert(kMaxBlocks * kMaxRanks * sizeof(uint32_t) <= kDataOffset, "flag table too large");

struct Peers {
  char* base[kMaxRanks];
};

struct DeviceState {
  bool ready = false;
  int rank = 0;
  int world = 0;
  size_t slot_bytes = 0;
  char* local = nullptr;       // this rank's IPC buffer
  uint32_t* epoch = nullptr;   // [0] epoch, [1] CTAs done in the current call (plain device memory)
  Peers peers{};               // every rank's buffer as mapped here (peers[rank] == local)
};

DeviceState g_state[kMaxDevices];
// Buffers of an earlier setup on a device are retired, never freed: executables (and CUDA graphs) compiled
// while they were current hold their addresses.
DeviceState g_retired[kMaxDevices * 8];
int g_num_retired = 0;

__device__ __forceinline__ uint32_t* flag_ptr(char* base, int block, int rank) {
  return reinterpret_cast<uint32_t*>(base) + block * kMaxRanks + rank;
}

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <typename T> struct Vec;  // 16 bytes of T as float32 lanes
template <> struct Vec<float> {
  static constexpr int kLanes = 4;
  __device__ static void add(float* acc, const int4& v) {
    const float* f = reinterpret_cast<const float*>(&v);
    for (int i = 0; i < 4; ++i) acc[i] += f[i];
  }
  __device__ static int4 pack(const float* acc) {
    int4 out;
    float* f = reinterpret_cast<float*>(&out);
    for (int i = 0; i < 4; ++i) f[i] = acc[i];
    return out;
  }
};
template <> struct Vec<__nv_bfloat16> {
  static constexpr int kLanes = 8;
  __device__ static void add(float* acc, const int4& v) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int i = 0; i < 4; ++i) {
      float2 f = __bfloat1622float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float* acc) {
    int4 out;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&out);
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return out;
  }
};
template <> struct Vec<__half> {
  static constexpr int kLanes = 8;
  __device__ static void add(float* acc, const int4& v) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    for (int i = 0; i < 4; ++i) {
      float2 f = __half22float2(h[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float* acc) {
    int4 out;
    __half2* h = reinterpret_cast<__half2*>(&out);
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(acc[2 * i], acc[2 * i + 1]);
    return out;
  }
};

// Steps 1-3 and the epoch of one call, shared by both kernels.
__device__ __forceinline__ uint32_t call_epoch(const uint32_t* epoch_state) {
  return *reinterpret_cast<const volatile uint32_t*>(epoch_state) + 1;
}

// 1. push vectors [lo, hi) of this rank's input into slot[rank] of every peer's receive area
__device__ __forceinline__ void push(const int4* __restrict__ in, int64_t lo, int64_t hi, int rank, int world,
                                     const Peers& peers, size_t area, size_t slot_bytes) {
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const int4 v = in[i];
    for (int q = 0; q < world; ++q) {
      if (q == rank) continue;
      int4* slot = reinterpret_cast<int4*>(peers.base[q] + kDataOffset + area + rank * slot_bytes);
      slot[i] = v;
    }
  }
}

// 2-3. one thread per peer: publish, then wait for the peer's publication of this block
// (the release is cumulative: it covers the block's NVLink stores ordered before it by the barrier)
__device__ __forceinline__ void publish_and_wait(int rank, int world, const Peers& peers, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x < world && threadIdx.x != rank) {
    const int q = threadIdx.x;
    store_release_sys(flag_ptr(peers.base[q], blockIdx.x, rank), epoch);
    const uint32_t* mine = flag_ptr(peers.base[rank], blockIdx.x, q);
    const uint64_t start = global_timer_ns();
    while (static_cast<int32_t>(load_acquire_sys(mine) - epoch) < 0) {
      // a peer that died or stopped calling: fail the step (the process sees a CUDA error) instead of hanging
      if (global_timer_ns() - start > kWaitLimitNs) __trap();
    }
  }
  __syncthreads();
}

// 4. the ranks' vector i summed in rank order in float32 (not rounded yet)
template <typename T>
__device__ __forceinline__ void sum_ranks(float* acc, const int4* __restrict__ in, int64_t i, int rank, int world,
                                          const char* recv, size_t slot_bytes) {
  for (int l = 0; l < Vec<T>::kLanes; ++l) acc[l] = 0.f;
  for (int r = 0; r < world; ++r) {
    const int4 v = r == rank ? in[i] : __ldcg(reinterpret_cast<const int4*>(recv + r * slot_bytes) + i);
    Vec<T>::add(acc, v);
  }
}

// the last CTA to finish advances the epoch for the next call on this device
__device__ __forceinline__ void end_call(uint32_t* epoch_state, uint32_t epoch) {
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(epoch_state + 1, 1u);
    if (done == gridDim.x - 1) {
      epoch_state[1] = 0;
      epoch_state[0] = epoch;
      __threadfence();
    }
  }
}

template <typename T>
__device__ __forceinline__ void unpack(float* f, const int4& v) {
  for (int l = 0; l < Vec<T>::kLanes; ++l) f[l] = 0.f;
  Vec<T>::add(f, v);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) oneshot_all_reduce(const int4* __restrict__ in,
                                                               int4* __restrict__ out, int64_t num_vecs,
                                                               int rank, int world, Peers peers,
                                                               uint32_t* epoch_state, size_t slot_bytes) {
  const uint32_t epoch = call_epoch(epoch_state);
  const size_t area = static_cast<size_t>(epoch & 1u) * world * slot_bytes;
  const int64_t per_block = (num_vecs + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * per_block;
  const int64_t hi = lo + per_block < num_vecs ? lo + per_block : num_vecs;
  push(in, lo, hi, rank, world, peers, area, slot_bytes);
  publish_and_wait(rank, world, peers, epoch);
  const char* recv = peers.base[rank] + kDataOffset + area;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float acc[Vec<T>::kLanes];
    sum_ranks<T>(acc, in, i, rank, world, recv, slot_bytes);
    out[i] = Vec<T>::pack(acc);
  }
  end_call(epoch_state, epoch);
}

// The all-reduce fused with what follows it in a pre-norm transformer layer:
//   sum = residual + all_reduce(in)           (the all-reduce rounded to T first, as the unfused ops do)
//   normed = weight * T(sum * rsqrt(mean(sum^2) + eps))   (statistics in float32: HF's RMSNorm)
// A row (one token) belongs to one CTA (rows r, r + grid, ...), so the row's mean needs no other CTA.
template <typename T>
__global__ void __launch_bounds__(kThreads) oneshot_all_reduce_add_rms_norm(
    const int4* __restrict__ in, const int4* __restrict__ residual, const int4* __restrict__ weight,
    int4* __restrict__ out_sum, int4* __restrict__ out_normed, int64_t rows, int64_t row_vecs, int64_t width,
    float eps, int rank, int world, Peers peers, uint32_t* epoch_state, size_t slot_bytes) {
  constexpr int L = Vec<T>::kLanes;
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float row_scale;
  const uint32_t epoch = call_epoch(epoch_state);
  const size_t area = static_cast<size_t>(epoch & 1u) * world * slot_bytes;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    push(in, r * row_vecs, (r + 1) * row_vecs, rank, world, peers, area, slot_bytes);
  }
  publish_and_wait(rank, world, peers, epoch);
  const char* recv = peers.base[rank] + kDataOffset + area;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float sq = 0.f;
    for (int64_t i = r * row_vecs + threadIdx.x; i < (r + 1) * row_vecs; i += blockDim.x) {
      float acc[L], h[L];
      sum_ranks<T>(acc, in, i, rank, world, recv, slot_bytes);
      unpack<T>(h, Vec<T>::pack(acc));            // the all-reduce's result, rounded once
      Vec<T>::add(h, residual[i]);
      const int4 s = Vec<T>::pack(h);
      out_sum[i] = s;
      unpack<T>(h, s);
      for (int l = 0; l < L; ++l) sq += h[l] * h[l];
    }
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < (blockDim.x + 31) / 32; ++w) total += warp_sums[w];
      row_scale = rsqrtf(total / static_cast<float>(width) + eps);
    }
    __syncthreads();
    const float scale = row_scale;
    for (int64_t i = r * row_vecs + threadIdx.x; i < (r + 1) * row_vecs; i += blockDim.x) {
      float h[L], w[L];
      unpack<T>(h, out_sum[i]);                   // this thread's own store above
      for (int l = 0; l < L; ++l) h[l] *= scale;
      unpack<T>(h, Vec<T>::pack(h));              // the normalised value in T, before the weight
      unpack<T>(w, weight[i - r * row_vecs]);
      for (int l = 0; l < L; ++l) h[l] *= w[l];
      out_normed[i] = Vec<T>::pack(h);
    }
    __syncthreads();                              // warp_sums / row_scale are reused by the next row
  }
  end_call(epoch_state, epoch);
}

bool retire(DeviceState& s) {
  if (s.local == nullptr) return true;
  if (g_num_retired == kMaxDevices * 8) return false;
  g_retired[g_num_retired++] = s;
  s = DeviceState{};
  return true;
}

void set_error(char* err, size_t len, const char* what, cudaError_t e) {
  if (err != nullptr && len > 0) {
    snprintf(err, len, "%s: %s", what, e == cudaSuccess ? "failed" : cudaGetErrorString(e));
  }
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> y, int64_t blocks) {
  if (device < 0 || device >= kMaxDevices || !g_state[device].ready) {
    return ffi::Error::InvalidArgument("jaxserve custom all-reduce: not set up on CUDA device " +
                                       std::to_string(device));
  }
  const DeviceState& s = g_state[device];
  const size_t bytes = x.size_bytes();
  if (bytes % 16 != 0 || bytes > s.slot_bytes || y->size_bytes() != bytes) {
    return ffi::Error::InvalidArgument("jaxserve custom all-reduce: " + std::to_string(bytes) +
                                       " bytes (needs a multiple of 16, at most " +
                                       std::to_string(s.slot_bytes) + ")");
  }
  if (blocks < 1 || blocks > kMaxBlocks) {
    return ffi::Error::InvalidArgument("jaxserve custom all-reduce: blocks must be in [1, 64]");
  }
  const int64_t num_vecs = static_cast<int64_t>(bytes / 16);
  if (num_vecs == 0) return ffi::Error::Success();
  const auto* in = static_cast<const int4*>(x.untyped_data());
  auto* out = static_cast<int4*>(y->untyped_data());
  const dim3 grid(static_cast<unsigned>(blocks)), block(kThreads);
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      oneshot_all_reduce<__nv_bfloat16><<<grid, block, 0, stream>>>(in, out, num_vecs, s.rank, s.world,
                                                                    s.peers, s.epoch, s.slot_bytes);
      break;
    case ffi::DataType::F16:
      oneshot_all_reduce<__half><<<grid, block, 0, stream>>>(in, out, num_vecs, s.rank, s.world, s.peers,
                                                             s.epoch, s.slot_bytes);
      break;
    case ffi::DataType::F32:
      oneshot_all_reduce<float><<<grid, block, 0, stream>>>(in, out, num_vecs, s.rank, s.world, s.peers,
                                                            s.epoch, s.slot_bytes);
      break;
    default:
      return ffi::Error::InvalidArgument("jaxserve custom all-reduce: dtype must be bf16, f16 or f32");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("jaxserve custom all-reduce launch: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

ffi::Error AllReduceAddRmsNormImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                  ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                                  ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> normed,
                                  int64_t blocks, float eps) {
  const std::string name = "jaxserve custom all-reduce + add + RMSNorm: ";
  if (device < 0 || device >= kMaxDevices || !g_state[device].ready) {
    return ffi::Error::InvalidArgument(name + "not set up on CUDA device " + std::to_string(device));
  }
  const DeviceState& s = g_state[device];
  const auto dims = x.dimensions();
  const int64_t width = dims.size() == 0 ? 0 : dims[dims.size() - 1];
  const size_t bytes = x.size_bytes();
  const auto type = x.element_type();
  if (width <= 0 || residual.element_type() != type || weight.element_type() != type ||
      residual.size_bytes() != bytes || sum->size_bytes() != bytes || normed->size_bytes() != bytes ||
      static_cast<int64_t>(weight.element_count()) != width) {
    return ffi::Error::InvalidArgument(name + "x, residual [.., width] and weight [width] must agree");
  }
  const size_t row_bytes = bytes / (x.element_count() / width);
  if (row_bytes % 16 != 0 || bytes > s.slot_bytes) {
    return ffi::Error::InvalidArgument(name + std::to_string(bytes) + " bytes, rows of " +
                                       std::to_string(row_bytes) + " (rows must be a multiple of 16 bytes, "
                                       "the whole at most " + std::to_string(s.slot_bytes) + ")");
  }
  if (blocks < 1 || blocks > kMaxBlocks) return ffi::Error::InvalidArgument(name + "blocks must be in [1, 64]");
  const int64_t rows = static_cast<int64_t>(x.element_count()) / width;
  if (rows == 0) return ffi::Error::Success();
  const int64_t row_vecs = static_cast<int64_t>(row_bytes / 16);
  const auto* in = static_cast<const int4*>(x.untyped_data());
  const auto* res = static_cast<const int4*>(residual.untyped_data());
  const auto* w = static_cast<const int4*>(weight.untyped_data());
  auto* out_sum = static_cast<int4*>(sum->untyped_data());
  auto* out_normed = static_cast<int4*>(normed->untyped_data());
  const dim3 grid(static_cast<unsigned>(blocks < rows ? blocks : rows)), block(kThreads);
#define JAXSERVE_LAUNCH_FUSED(T)                                                                        \
  oneshot_all_reduce_add_rms_norm<T><<<grid, block, 0, stream>>>(in, res, w, out_sum, out_normed, rows,    \
                                                                 row_vecs, width, eps, s.rank, s.world,    \
                                                                 s.peers, s.epoch, s.slot_bytes)
  switch (type) {
    case ffi::DataType::BF16: JAXSERVE_LAUNCH_FUSED(__nv_bfloat16); break;
    case ffi::DataType::F16: JAXSERVE_LAUNCH_FUSED(__half); break;
    case ffi::DataType::F32: JAXSERVE_LAUNCH_FUSED(float); break;
    default: return ffi::Error::InvalidArgument(name + "dtype must be bf16, f16 or f32");
  }
#undef JAXSERVE_LAUNCH_FUSED
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCustomAllReduce, AllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("blocks"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCustomAllReduceAddRmsNorm, AllReduceAddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("blocks")
                                  .Attr<float>("eps"),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

// Allocate this rank's buffer on `device` and write its 64-byte IPC handle to `handle_out`.
int jaxserve_car_create(int device, int rank, int world, uint64_t slot_bytes, void* handle_out, char* err,
                        uint64_t err_len) {
  if (device < 0 || device >= kMaxDevices || world < 2 || world > kMaxRanks || rank < 0 || rank >= world ||
      slot_bytes % 16 != 0) {
    set_error(err, err_len, "bad arguments", cudaSuccess);
    return 1;
  }
  DeviceState& s = g_state[device];
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return set_error(err, err_len, "cudaSetDevice", e), 1;
  if (!retire(s)) return set_error(err, err_len, "too many set-ups in one process", cudaSuccess), 1;
  const size_t total = kDataOffset + 2 * static_cast<size_t>(world) * slot_bytes;
  if ((e = cudaMalloc(&s.local, total)) != cudaSuccess) return set_error(err, err_len, "cudaMalloc", e), 1;
  if ((e = cudaMemset(s.local, 0, total)) != cudaSuccess) return set_error(err, err_len, "cudaMemset", e), 1;
  if ((e = cudaMalloc(&s.epoch, 2 * sizeof(uint32_t))) != cudaSuccess) return set_error(err, err_len, "cudaMalloc", e), 1;
  if ((e = cudaMemset(s.epoch, 0, 2 * sizeof(uint32_t))) != cudaSuccess) return set_error(err, err_len, "cudaMemset", e), 1;
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) return set_error(err, err_len, "cudaDeviceSynchronize", e), 1;
  cudaIpcMemHandle_t handle;
  if ((e = cudaIpcGetMemHandle(&handle, s.local)) != cudaSuccess) {
    return set_error(err, err_len, "cudaIpcGetMemHandle", e), 1;
  }
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "IPC handle size");
  memcpy(handle_out, &handle, sizeof(handle));
  s.rank = rank;
  s.world = world;
  s.slot_bytes = slot_bytes;
  return 0;
}

// Map every peer's buffer (`handles`: world * 64 bytes, in rank order) and mark the device ready.
int jaxserve_car_open(int device, const void* handles, char* err, uint64_t err_len) {
  if (device < 0 || device >= kMaxDevices || g_state[device].local == nullptr) {
    set_error(err, err_len, "jaxserve_car_create was not called for this device", cudaSuccess);
    return 1;
  }
  DeviceState& s = g_state[device];
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return set_error(err, err_len, "cudaSetDevice", e), 1;
  for (int q = 0; q < s.world; ++q) {
    if (q == s.rank) {
      s.peers.base[q] = s.local;
      continue;
    }
    cudaIpcMemHandle_t handle;
    memcpy(&handle, static_cast<const char*>(handles) + 64 * q, sizeof(handle));
    void* ptr = nullptr;
    if ((e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess)) != cudaSuccess) {
      return set_error(err, err_len, "cudaIpcOpenMemHandle", e), 1;
    }
    s.peers.base[q] = static_cast<char*>(ptr);
  }
  s.ready = true;
  return 0;
}

}  // extern "C"
