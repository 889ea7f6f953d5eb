// Quantized decode GEMMs for 1..16 rows as XLA FFI custom calls, built and loaded by quant_gemv.py (which says
// why and how they are used): int4 W4A16 (int4_gemv.cuh; the handler int4_gemv_ffi.cuh) and fp8 e4m3
// weight-only W8A16 (fp8_gemv.cuh), both on the bf16 tensor cores with the weights as the mma's A operand,
// sharing the block shape and the split-K end (gemv_common.cuh).
#include "gemv_common.cuh"
#include "int4_gemv.cuh"
#include "int4_gemv_ffi.cuh"
#include "fp8_gemv.cuh"

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
                                  .Attr<int64_t>("chunk")
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("variant"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFp8Gemv, Fp8GemvImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("slot"),
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" {

// The split-K arrival counters of `device` (zeroed; each call's last block resets its own). Call once per
// device before the first call; 0 on success, else 1 with the reason in `err`.
int jaxserve_quant_gemv_init(int device, char* err, uint64_t err_len) {
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

