// SIMT emulator fake of ATen/cuda/Exceptions.h: torch's status-checking
// macros, with torch's messages (the status name, the failing call).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cublas_v2.h>
#include <cusolverDn.h>

namespace at::cuda::blas {
inline const char* _cublasGetErrorEnum(cublasStatus_t error) { return cublasGetStatusName(error); }
}  // namespace at::cuda::blas

namespace at::cuda::solver {
const char* cusolverGetErrorMessage(cusolverStatus_t status);  // src/cusolver.cpp
constexpr const char* _cusolver_backend_suggestion = "(SIMT emulator)";
}  // namespace at::cuda::solver

#define TORCH_CUDABLAS_CHECK(EXPR)                                                    \
  do {                                                                                \
    cublasStatus_t __err = EXPR;                                                      \
    TORCH_CHECK(__err == CUBLAS_STATUS_SUCCESS, "CUDA error: ",                       \
                at::cuda::blas::_cublasGetErrorEnum(__err), " when calling `" #EXPR "`"); \
  } while (0)

#define TORCH_CUSOLVER_CHECK(EXPR)                                                        \
  do {                                                                                    \
    cusolverStatus_t __err = EXPR;                                                        \
    if (__err == CUSOLVER_STATUS_INVALID_VALUE) {                                         \
      TORCH_CHECK_LINALG(false, "cusolver error: ",                                       \
                         at::cuda::solver::cusolverGetErrorMessage(__err),                \
                         ", when calling `" #EXPR "`",                                    \
                         ". This error may appear if the input matrix contains NaN. ",    \
                         at::cuda::solver::_cusolver_backend_suggestion);                 \
    } else {                                                                              \
      TORCH_CHECK(__err == CUSOLVER_STATUS_SUCCESS, "cusolver error: ",                   \
                  at::cuda::solver::cusolverGetErrorMessage(__err), ", when calling `" #EXPR \
                  "`. ",                                                                  \
                  at::cuda::solver::_cusolver_backend_suggestion);                        \
    }                                                                                     \
  } while (0)
