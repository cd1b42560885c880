// SIMT emulator fake of c10/cuda/CUDAException.h: the checking macros, with
// c10's behaviour (C10_CUDA_CHECK throws, _WARN warns and clears the error).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#define C10_CUDA_CHECK(EXPR)                                                              \
  do {                                                                                    \
    const cudaError_t __err = EXPR;                                                       \
    TORCH_CHECK(__err == cudaSuccess, "CUDA error: ", cudaGetErrorString(__err), " (", \
                cudaGetErrorName(__err), ") when calling `" #EXPR "`");                  \
  } while (0)

#define C10_CUDA_CHECK_WARN(EXPR)                                \
  do {                                                           \
    const cudaError_t __err = EXPR;                              \
    if (C10_UNLIKELY(__err != cudaSuccess)) {                    \
      [[maybe_unused]] auto error_unused = cudaGetLastError();   \
      TORCH_WARN("CUDA warning: ", cudaGetErrorString(__err));   \
    }                                                            \
  } while (0)

#define C10_CUDA_ERROR_HANDLED(EXPR) EXPR

#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
