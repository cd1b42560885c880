// SIMT emulator (tools/simt): cuBLAS entry points, computed by a plain
// column-major reference on the handle's stream.
//
// Documented semantics kept: argument checks at the call
// (CUBLAS_STATUS_INVALID_VALUE for a negative size or batch, an unknown
// operation, a leading dimension below max(1, rows)); alpha and beta read at
// the call (host pointer mode); C not read when beta == 0; k == 0 gives
// beta * C. The products accumulate in the compute type (no TF32).
//
// cublasGemmEx / cublasSgemm (one column-major product, no batch):
//   C = alpha * op(A) op(B) + beta * C, op(A) m x k, op(B) k x n, C m x n, every
//   matrix column-major with its leading dimension (element (i, j) of A at
//   A[i + j * lda]); op(X) = X (CUBLAS_OP_N) or X^T (CUBLAS_OP_T; A is then stored
//   k x m). Checks, as cuBLAS documents them: negative m, n, k, an unknown op, lda <
//   max(1, rows of A as stored), ldb likewise, ldc < max(1, m) give
//   CUBLAS_STATUS_INVALID_VALUE; a type combination cuBLAS does not list gives
//   CUBLAS_STATUS_NOT_SUPPORTED (the ones modelled: compute 32F with A/B 16F or 16BF
//   and C of the same type or 32F, compute 32F / 32F_PEDANTIC / 32F_FAST_16F /
//   32F_FAST_16BF / 32F_FAST_TF32 with A/B/C 32F, compute 64F with A/B/C 64F). alpha
//   and beta are host scalars of the compute type (float for every 32F compute type,
//   double for 64F). The product is computed in the compute type's precision (fp32
//   or fp64 FMAs; the reduced-precision FAST_* types and the handle's math mode are
//   recorded in the launch log but NOT emulated: no TF32 / bf16 rounding). Every call
//   is logged: `cublasGemmEx m=.. n=.. k=.. lda=.. ldb=.. ldc=.. opA=N opB=T A=16BF
//   C=32F compute=32F_FAST_TF32 beta=1 math=...`.
#include <cublas_v2.h>

#include "internal.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <sstream>
#include <vector>

struct simt_cublas_st {
  cudaStream_t stream = nullptr;
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
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

const char* type_name(cudaDataType t) {
  switch (t) {
    case CUDA_R_32F: return "32F";
    case CUDA_R_64F: return "64F";
    case CUDA_R_16F: return "16F";
    case CUDA_R_16BF: return "16BF";
    default: return "?";
  }
}

const char* compute_name(cublasComputeType_t c) {
  switch (c) {
    case CUBLAS_COMPUTE_32F: return "32F";
    case CUBLAS_COMPUTE_32F_PEDANTIC: return "32F_PEDANTIC";
    case CUBLAS_COMPUTE_32F_FAST_16F: return "32F_FAST_16F";
    case CUBLAS_COMPUTE_32F_FAST_16BF: return "32F_FAST_16BF";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "32F_FAST_TF32";
    case CUBLAS_COMPUTE_64F: return "64F";
    case CUBLAS_COMPUTE_64F_PEDANTIC: return "64F_PEDANTIC";
    default: return "?";
  }
}

const char* math_name(cublasMath_t m) {
  switch (m) {
    case CUBLAS_DEFAULT_MATH: return "DEFAULT";
    case CUBLAS_TENSOR_OP_MATH: return "TENSOR_OP";
    case CUBLAS_PEDANTIC_MATH: return "PEDANTIC";
    case CUBLAS_TF32_TENSOR_OP_MATH: return "TF32_TENSOR_OP";
    default: return "?";
  }
}

// Whether cuBLAS lists (Atype = Btype, Ctype, compute) for cublasGemmEx (the
// modelled subset, see the top of the file).
bool supported(cudaDataType ab, cudaDataType c, cublasComputeType_t compute) {
  switch (compute) {
    case CUBLAS_COMPUTE_32F:
      return ((ab == CUDA_R_16F || ab == CUDA_R_16BF) && (c == ab || c == CUDA_R_32F)) ||
             (ab == CUDA_R_32F && c == CUDA_R_32F);
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      return ab == CUDA_R_32F && c == CUDA_R_32F;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
      return ab == CUDA_R_64F && c == CUDA_R_64F;
    default:
      return false;
  }
}

template <typename T>
T load_as(const void* p, cudaDataType t, long long idx) {
  switch (t) {
    case CUDA_R_32F: return static_cast<T>(static_cast<const float*>(p)[idx]);
    case CUDA_R_64F: return static_cast<T>(static_cast<const double*>(p)[idx]);
    case CUDA_R_16F: return static_cast<T>(static_cast<float>(static_cast<const c10::Half*>(p)[idx]));
    case CUDA_R_16BF:
      return static_cast<T>(static_cast<float>(static_cast<const c10::BFloat16*>(p)[idx]));
    default: return T(0);
  }
}

template <typename T>
void store_as(void* p, cudaDataType t, long long idx, T v) {
  switch (t) {
    case CUDA_R_32F: static_cast<float*>(p)[idx] = static_cast<float>(v); break;
    case CUDA_R_64F: static_cast<double*>(p)[idx] = static_cast<double>(v); break;
    case CUDA_R_16F: static_cast<c10::Half*>(p)[idx] = c10::Half(static_cast<float>(v)); break;
    case CUDA_R_16BF:
      static_cast<c10::BFloat16*>(p)[idx] = c10::BFloat16(static_cast<float>(v));
      break;
    default: break;
  }
}

// One column-major GEMM in the compute precision T (float or double), queued.
template <typename T>
void queue_gemm(cudaStream_t stream, bool tra, bool trb, int m, int n, int k, T alpha,
                const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt, int ldb,
                T beta, void* C, cudaDataType ct, int ldc) {
  simt::enqueue(stream, [=]() {
    // op(A) as a dense row-major m x k, op(B) as k x n, then C row by row.
    std::vector<T> a(static_cast<size_t>(m) * k), b(static_cast<size_t>(k) * n), acc(n);
    for (int i = 0; i < m; ++i) {
      for (int l = 0; l < k; ++l) {
        const long long idx = tra ? l + static_cast<long long>(i) * lda
                                  : i + static_cast<long long>(l) * lda;
        a[static_cast<size_t>(i) * k + l] = load_as<T>(A, at, idx);
      }
    }
    for (int l = 0; l < k; ++l) {
      for (int j = 0; j < n; ++j) {
        const long long idx = trb ? j + static_cast<long long>(l) * ldb
                                  : l + static_cast<long long>(j) * ldb;
        b[static_cast<size_t>(l) * n + j] = load_as<T>(B, bt, idx);
      }
    }
    for (int i = 0; i < m; ++i) {
      std::fill(acc.begin(), acc.end(), T(0));
      for (int l = 0; l < k; ++l) {
        const T x = a[static_cast<size_t>(i) * k + l];
        const T* row = b.data() + static_cast<size_t>(l) * n;
        for (int j = 0; j < n; ++j) acc[j] += x * row[j];
      }
      for (int j = 0; j < n; ++j) {
        const long long idx = i + static_cast<long long>(j) * ldc;
        const T v = beta == T(0) ? alpha * acc[j] : alpha * acc[j] + beta * load_as<T>(C, ct, idx);
        store_as<T>(C, ct, idx, v);
      }
    }
  });
}

cublasStatus_t gemm_ex(const char* routine, cublasHandle_t h, cublasOperation_t ta,
                       cublasOperation_t tb, int m, int n, int k, const void* alpha,
                       const void* A, cudaDataType at, int lda, const void* B, cudaDataType bt,
                       int ldb, const void* beta, void* C, cudaDataType ct, int ldc,
                       cublasComputeType_t compute) {
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!valid_op(ta) || !valid_op(tb) || m < 0 || n < 0 || k < 0) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  const int rows_a = ta == CUBLAS_OP_N ? m : k;
  const int rows_b = tb == CUBLAS_OP_N ? k : n;
  if (lda < std::max(1, rows_a) || ldb < std::max(1, rows_b) || ldc < std::max(1, m)) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (at != bt || !supported(at, ct, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool dbl = compute == CUBLAS_COMPUTE_64F || compute == CUBLAS_COMPUTE_64F_PEDANTIC;
  const double a = dbl ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double b = dbl ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  std::ostringstream entry;
  entry << routine << " m=" << m << " n=" << n << " k=" << k << " lda=" << lda
        << " ldb=" << ldb << " ldc=" << ldc << " opA=" << (ta == CUBLAS_OP_T ? 'T' : 'N')
        << " opB=" << (tb == CUBLAS_OP_T ? 'T' : 'N') << " A=" << type_name(at)
        << " C=" << type_name(ct) << " compute=" << compute_name(compute) << " alpha=" << a
        << " beta=" << b << " math=" << math_name(h->math);
  simt::log_call(entry.str());
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const bool tra = ta == CUBLAS_OP_T;
  const bool trb = tb == CUBLAS_OP_T;
  if (dbl) {
    queue_gemm<double>(h->stream, tra, trb, m, n, k, a, A, at, lda, B, bt, ldb, b, C, ct, ldc);
  } else {
    queue_gemm<float>(h->stream, tra, trb, m, n, k, static_cast<float>(a), A, at, lda, B, bt,
                      ldb, static_cast<float>(b), C, ct, ldc);
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

namespace at::cuda {

// torch's handle: one per host thread and device, bound to the current
// stream on every call, its math mode set from torch's fp32 matmul precision
// on every call (TF32 tensor-op math when it is "tf32"), as torch does.
cublasHandle_t getCurrentCUDABlasHandle(bool /*setup*/) {
  thread_local std::array<simt_cublas_st, 8> handles;
  const int dev = simt::current_device();
  simt_cublas_st& h = handles.at(static_cast<size_t>(dev));
  h.stream = simt::current_stream(dev);
  const bool tf32 = at::globalContext().float32Precision(
                        at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
                    at::Float32Precision::TF32;
  h.math = tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
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

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->math = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t* mode) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *mode = handle->math;
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

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc) {
  return gemm_ex("cublasSgemm", handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B,
                 CUDA_R_32F, ldb, beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
  if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  return gemm_ex("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype,
                 ldb, beta, C, Ctype, ldc, computeType);
}

}  // extern "C"
