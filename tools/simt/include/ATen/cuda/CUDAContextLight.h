// SIMT emulator fake of ATen/cuda/CUDAContextLight.h: device properties and
// torch's per-thread cuBLAS handle (bound to the current stream on every
// call, as torch binds its own).
#pragma once

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <simt/device.h>

namespace at::cuda {

inline int64_t getNumGPUs() { return simt::device_count(); }
inline int warp_size() { return simt::device_properties(simt::current_device())->warpSize; }
inline cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device) {
  return simt::device_properties(device);
}
inline cudaDeviceProp* getCurrentDeviceProperties() {
  return simt::device_properties(simt::current_device());
}
// Defined in tools/simt/src/cublas.cpp.
cublasHandle_t getCurrentCUDABlasHandle(bool setup = true);

}  // namespace at::cuda
