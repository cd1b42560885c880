// SIMT emulator (tests/simt): cuBLAS entry points, computed by a plain
// column-major reference on the handle's stream.
//
// Documented semantics kept: argument checks at the call
// (CUBLAS_STATUS_INVALID_VALUE for a negative size or batch, an unknown
// operation, a leading dimension below max(1, rows)); alpha and beta read at
// the call (host pointer mode); C not read when beta == 0; k == 0 gives
// beta * C. The products accumulate in the compute type (no TF32).
#include <cublas_v2.h>

#include "internal.h"

#include <ATen/cuda/CUDAContextLight.h>

#include <algorithm>
#include <array>

struct simt_cublas_st {
  cudaStream_t stream = nullptr;
};

namespace {

bool valid_op(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; }

template <typename T>
cublasStatus_t gemm_strided_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                    int m, int n, int k, const T* alpha, const T* A, int lda,
                                    long long sa, const T* B, int ldb, long long sb,
                                    const T* beta, T* C, int ldc, long long sc, int batch) {
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_op(ta) || !valid_op(tb) || m < 0 || n < 0 || k < 0 || batch < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int rows_a = ta == CUBLAS_OP_N ? m : k;
  const int rows_b = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, rows_a) || ldb < std::max(1, rows_b) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const T a = *alpha;
  const T b = *beta;
  if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  const bool tra = ta == CUBLAS_OP_T;
  const bool trb = tb == CUBLAS_OP_T;
  simt::enqueue(h->stream, [=]() {
    for (int p = 0; p < batch; ++p) {
      const T* Ap = A + p * sa;
      const T* Bp = B + p * sb;
      T* Cp = C + p * sc;
      for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
          T acc = T(0);
          for (int l = 0; l < k; ++l) {
            const T x = tra ? Ap[l + static_cast<long long>(i) * lda]
                            : Ap[i + static_cast<long long>(l) * lda];
            const T y = trb ? Bp[j + static_cast<long long>(l) * ldb]
                            : Bp[l + static_cast<long long>(j) * ldb];
            acc += x * y;
          }
          T& c = Cp[i + static_cast<long long>(j) * ldc];
          c = b == T(0) ? a * acc : a * acc + b * c;
        }
      }
    }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

namespace at::cuda {

// torch's handle: one per host thread and device, bound to the current
// stream on every call.
cublasHandle_t getCurrentCUDABlasHandle(bool /*setup*/) {
  thread_local std::array<simt_cublas_st, 8> handles;
  const int dev = simt::current_device();
  simt_cublas_st& h = handles.at(static_cast<size_t>(dev));
  h.stream = simt::current_stream(dev);
  return &h;
}

}  // namespace at::cuda

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new simt_cublas_st;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

const char* cublasGetStatusString(cublasStatus_t status) { return cublasGetStatusName(status); }

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const float* alpha, const float* A, int lda,
                                         long long int strideA, const float* B, int ldb,
                                         long long int strideB, const float* beta, float* C,
                                         int ldc, long long int strideC, int batchCount) {
  return gemm_strided_batched<float>(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B,
                                     ldb, strideB, beta, C, ldc, strideC, batchCount);
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa,
                                         cublasOperation_t transb, int m, int n, int k,
                                         const double* alpha, const double* A, int lda,
                                         long long int strideA, const double* B, int ldb,
                                         long long int strideB, const double* beta, double* C,
                                         int ldc, long long int strideC, int batchCount) {
  return gemm_strided_batched<double>(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B,
                                      ldb, strideB, beta, C, ldc, strideC, batchCount);
}

}  // extern "C"
