// The int4 GEMM's XLA FFI handler (included by quant_gemv.cu after the kernels): checks the call and runs the
// variant it names: the register-pipelined kernel (int4_gemv.cuh) at 2, 3 or 4 resident blocks an SM.
#pragma once

#include "int4_gemv.cuh"

namespace {

// The `variant` attribute (quant_gemv.py's VARIANTS, in this order)
enum Int4Variant : int64_t { kV1 = 0, kOcc3 = 1, kOcc4 = 2, kVariants = 3 };

ffi::Error Int4GemvImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer packed,
                        ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> partials, int64_t group_size, int64_t splits, int64_t chunk,
                        int64_t slot, int64_t variant) {
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
  if (variant < 0 || variant >= kVariants) return ffi::Error::InvalidArgument(name + "unknown variant");
  const int64_t tiles = (n + kCols - 1) / kCols;
  if (splits < 1 || splits > k / kStepK || (chunk != kMinChunk && chunk != kMaxChunk) || slot < 0 || slot >= kSlots ||
      (splits > 1 && (tiles > kSlotTiles ||
                      partials->element_count() < static_cast<size_t>(splits * m * n)))) {
    return ffi::Error::InvalidArgument(name + "bad splits/chunk/slot or partials buffer");
  }
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
  unsigned* counters = g_counters[device] + slot * kSlotTiles;
  const bool tall = m > 8;
  const int gsteps = static_cast<int>(group_size / kStepK), ci = static_cast<int>(chunk);
  const int mi = static_cast<int>(m), ki = static_cast<int>(k), ni = static_cast<int>(n);
  const int gi = static_cast<int>(group_size), si = static_cast<int>(splits);
  const void* xp = x.untyped_data();
  const void* pp = packed.untyped_data();
  const void* sp = scales.untyped_data();
  const void* zp = zeros.untyped_data();
  void* op = out->untyped_data();
  void* tp = partials->untyped_data();
  auto run = [&](auto scale_type) {
    using S = decltype(scale_type);
    switch (variant) {
      case kOcc3:   // up to 8 rows (more spill hundreds of bytes under the caps: the default kernel runs them)
      case kOcc4:
        if (tall) {
          launch_for<S, 2>(true, ci, gsteps, stream, grid, xp, pp, sp, zp, op, tp, counters, mi, ki, ni, gi, si);
        } else if (variant == kOcc3) {
          launch_for<S, 3>(false, ci, gsteps, stream, grid, xp, pp, sp, zp, op, tp, counters, mi, ki, ni, gi, si);
        } else {
          launch_for<S, 4>(false, ci, gsteps, stream, grid, xp, pp, sp, zp, op, tp, counters, mi, ki, ni, gi, si);
        }
        break;
      default:
        launch_for<S, 2>(tall, ci, gsteps, stream, grid, xp, pp, sp, zp, op, tp, counters, mi, ki, ni, gi, si);
    }
  };
  switch (scales.element_type()) {
    case ffi::DataType::BF16:
      run(__nv_bfloat16{});
      break;
    case ffi::DataType::F16:
      run(__half{});
      break;
    case ffi::DataType::F32:
      run(float{});
      break;
    default:
      return ffi::Error::InvalidArgument(name + "scales must be bf16, f16 or f32");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
