// SIMT emulator (tools/simt): cuSOLVER eigensolver entry points, computed on
// the handle's stream by a plain reference: each column-major matrix (leading
// dimension lda) is read from its `uplo` triangle only, decomposed by the CPU
// LAPACK (at::linalg_eigh) in the input precision, and overwritten by its
// eigenvectors (column j = eigenvector j); eigenvalues ascending.
//
// cuSOLVER's documented contract is kept: invalid arguments return
// CUSOLVER_STATUS_INVALID_VALUE at the call (n < 0, lda < max(1, n), an
// unknown jobz / uplo / data type, batch < 0, syevjBatched's n > 32,
// XsyevBatched's n * lda * batch > INT32_MAX); a workspace smaller than the
// bufferSize query said gives info = -(its parameter position) on the device;
// syevjBatched reports non-convergence as info = n + 1, syevd and
// XsyevBatched as info > 0. The workspaces are scribbled over when the call
// runs, so a workspace smaller than claimed is an AddressSanitizer error, and
// the host workspace of XsyevBatched is written then too (it must outlive the
// queued call). Modelling choices (not cuSOLVER's documented behaviour): a
// matrix with a non-finite entry in its triangle gives NaN eigenvalues and
// vectors with info 0 (syevd, XsyevBatched) or info n + 1 (syevjBatched);
// torch.ops.simt.set_nonfinite_garbage(True) makes every routine return finite,
// wrong results with info 0 for such a matrix instead (a solver that does not report
// it: on an H100, syevjBatched's status did not flag a NaN matrix);
// unsorted syevj eigenvalues (sort_eig = 0) come out descending; the
// workspace sizes are LAPACK's syevd size 1 + 6n + 2n^2 per matrix.
// torch.ops.simt.inject_solver_info makes a call report a chosen info code.
#include <cusolverDn.h>

#include "internal.h"

#include <ATen/ATen.h>
#include <ATen/cuda/Exceptions.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

struct simt_cusolver_st {
  cudaStream_t stream = nullptr;
};

struct simt_syevj_info_st {
  int sort_eig = 1;
  double tolerance = 0.0;
  int max_sweeps = 100;
};

struct simt_dn_params_st {};

namespace simt {
namespace {

struct Injection {
  int64_t matrix;
  int64_t code;
};

std::atomic<int64_t> g_xsyev_max_elements{std::numeric_limits<int32_t>::max()};
std::atomic<bool> g_nonfinite_garbage{false};

bool nonfinite_gives_garbage() { return g_nonfinite_garbage.load(); }

std::mutex g_inject_mutex;
std::map<std::string, std::vector<Injection>> g_injections;
std::map<std::string, int64_t> g_syevd_calls;  // syevd calls since its injection

// The info codes injected into the call of `routine` about to be queued:
// matrix index in the batch -> code (syevd: index = calls since injecting).
std::map<int64_t, int> take_injections(const std::string& routine, bool per_call) {
  const std::lock_guard<std::mutex> lock(g_inject_mutex);
  std::map<int64_t, int> out;
  auto it = g_injections.find(routine);
  if (it == g_injections.end()) return out;
  if (!per_call) {
    for (const Injection& inj : it->second) out[inj.matrix] = static_cast<int>(inj.code);
    g_injections.erase(it);
    return out;
  }
  const int64_t call = g_syevd_calls[routine]++;
  std::vector<Injection> rest;
  for (const Injection& inj : it->second) {
    if (inj.matrix == call) {
      out[0] = static_cast<int>(inj.code);
    } else if (inj.matrix > call) {
      rest.push_back(inj);
    }
  }
  if (rest.empty()) {
    g_injections.erase(it);
    g_syevd_calls.erase(routine);
  } else {
    it->second = rest;
  }
  return out;
}

int64_t syevd_lwork(int64_t n) { return 1 + 6 * n + 2 * n * n; }

bool valid_uplo(cublasFillMode_t u) {
  return u == CUBLAS_FILL_MODE_LOWER || u == CUBLAS_FILL_MODE_UPPER;
}
bool valid_jobz(cusolverEigMode_t j) {
  return j == CUSOLVER_EIG_MODE_NOVECTOR || j == CUSOLVER_EIG_MODE_VECTOR;
}

enum class NanPolicy { kInfoZero, kInfoNPlusOne };

// Decomposes one column-major matrix in place; returns its info code.
template <typename T>
int solve_one(T* A, int64_t lda, T* W, int64_t n, cublasFillMode_t uplo, bool vectors,
              bool sort_ascending, NanPolicy nan_policy) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  at::Tensor S = at::empty({n, n}, at::TensorOptions().dtype(dtype));
  T* s = S.mutable_data_ptr<T>();
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t i = 0; i < n; ++i) {
      const bool stored = uplo == CUBLAS_FILL_MODE_UPPER ? i <= j : i >= j;
      if (!stored) continue;
      const T v = A[i + j * lda];
      s[i * n + j] = v;
      s[j * n + i] = v;
      finite = finite && std::isfinite(v);
    }
  }
  const int fail = nan_policy == NanPolicy::kInfoZero ? 0 : static_cast<int>(n) + 1;
  auto poison = [&] {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    for (int64_t j = 0; j < n; ++j) {
      W[j] = nan;
      for (int64_t i = 0; i < n && vectors; ++i) A[i + j * lda] = nan;
    }
  };
  if (!finite && nonfinite_gives_garbage()) {  // finite, wrong results and info 0
    for (int64_t j = 0; j < n; ++j) {
      W[j] = static_cast<T>(j + 1);
      for (int64_t i = 0; i < n && vectors; ++i) A[i + j * lda] = static_cast<T>(0.5);
    }
    return 0;
  }
  if (!finite) {
    poison();
    return fail;
  }
  at::Tensor w;
  at::Tensor V;
  try {
    std::tie(w, V) = at::linalg_eigh(S, "L");
  } catch (const c10::Error&) {  // LAPACK did not converge
    poison();
    return nan_policy == NanPolicy::kInfoZero ? 1 : static_cast<int>(n) + 1;
  }
  const T* wp = w.const_data_ptr<T>();
  const at::Tensor Vc = V.contiguous();
  const T* v = Vc.const_data_ptr<T>();  // row-major: V[i][j] = component i of vector j
  for (int64_t j = 0; j < n; ++j) {
    const int64_t src = sort_ascending ? j : n - 1 - j;
    W[j] = wp[src];
    for (int64_t i = 0; i < n && vectors; ++i) A[i + j * lda] = v[i * n + src];
  }
  return 0;
}

void scribble(void* p, size_t bytes) {
  if (p != nullptr && bytes > 0) std::memset(p, 0xA5, bytes);
}

template <typename T>
cusolverStatus_t syevd(cusolverDnHandle_t h, cusolverEigMode_t jobz, cublasFillMode_t uplo, int n,
                       T* A, int lda, T* W, T* work, int lwork, int* info) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (n < 0 || lda < std::max(1, n) || !valid_jobz(jobz) || !valid_uplo(uplo)) {
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  log_call("syevd n=" + std::to_string(n) + " lda=" + std::to_string(lda) +
           " stream=" + std::to_string(stream_id(h->stream)));
  const std::map<int64_t, int> inject = take_injections("syevd", /*per_call=*/true);
  const int injected = inject.empty() ? 0 : inject.begin()->second;
  enqueue(h->stream, [=]() {
    if (lwork < syevd_lwork(n)) {
      *info = -8;  // lwork
      return;
    }
    scribble(work, sizeof(T) * static_cast<size_t>(lwork));
    const int code = solve_one<T>(A, lda, W, n, uplo, jobz == CUSOLVER_EIG_MODE_VECTOR, true,
                                  NanPolicy::kInfoZero);
    *info = injected != 0 ? injected : code;
  });
  return CUSOLVER_STATUS_SUCCESS;
}

template <typename T>
cusolverStatus_t syevd_buffer(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                              cublasFillMode_t uplo, int n, int lda, int* lwork) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (n < 0 || lda < std::max(1, n) || !valid_jobz(jobz) || !valid_uplo(uplo) ||
      lwork == nullptr) {
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  *lwork = static_cast<int>(syevd_lwork(n));
  return CUSOLVER_STATUS_SUCCESS;
}

int64_t syevj_lwork(int64_t n, int64_t batch) { return batch * syevd_lwork(n); }

template <typename T>
cusolverStatus_t syevj_batched_buffer(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                      cublasFillMode_t uplo, int n, int lda, int* lwork,
                                      syevjInfo_t params, int batch) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (n < 0 || n > 32 || lda < std::max(1, n) || !valid_jobz(jobz) || !valid_uplo(uplo) ||
      batch < 0 || params == nullptr || lwork == nullptr) {
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  *lwork = static_cast<int>(syevj_lwork(n, batch));
  return CUSOLVER_STATUS_SUCCESS;
}

template <typename T>
cusolverStatus_t syevj_batched(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                               cublasFillMode_t uplo, int n, T* A, int lda, T* W, T* work,
                               int lwork, int* info, syevjInfo_t params, int batch) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (n < 0 || n > 32 || lda < std::max(1, n) || !valid_jobz(jobz) || !valid_uplo(uplo) ||
      batch < 0 || params == nullptr) {
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  const simt_syevj_info_st p = *params;  // read at the call
  log_call("syevjBatched n=" + std::to_string(n) + " lda=" + std::to_string(lda) +
           " batch=" + std::to_string(batch) + " stream=" + std::to_string(stream_id(h->stream)));
  const std::map<int64_t, int> inject = take_injections("syevjBatched", /*per_call=*/false);
  enqueue(h->stream, [=]() {
    if (lwork < syevj_lwork(n, batch)) {
      if (batch > 0) info[0] = -8;  // lwork
      return;
    }
    scribble(work, sizeof(T) * static_cast<size_t>(lwork));
    const int64_t nn = static_cast<int64_t>(lda) * n;
    for (int64_t b = 0; b < batch; ++b) {
      const int code = solve_one<T>(A + b * nn, lda, W + b * n, n, uplo,
                                    jobz == CUSOLVER_EIG_MODE_VECTOR, p.sort_eig != 0,
                                    NanPolicy::kInfoNPlusOne);
      auto it = inject.find(b);
      info[b] = it != inject.end() ? it->second : code;
    }
  });
  return CUSOLVER_STATUS_SUCCESS;
}

size_t xsyev_type_size(cudaDataType t) {
  return t == CUDA_R_32F ? 4 : t == CUDA_R_64F ? 8 : 0;
}

// Argument checks of XsyevBatched and its bufferSize; 0 or the position of
// the first invalid parameter (not counting the handle).
int xsyev_invalid(cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n, cudaDataType ta,
                  int64_t lda, cudaDataType tw, cudaDataType tc, int64_t batch) {
  if (!valid_jobz(jobz)) return 2;
  if (!valid_uplo(uplo)) return 3;
  if (n < 0) return 4;
  if (xsyev_type_size(ta) == 0) return 5;
  if (lda < std::max<int64_t>(1, n)) return 7;
  if (tw != ta) return 8;
  if (tc != ta) return 10;
  if (batch < 0) return 16;
  // "The problem size is limited by n * lda * batchSize <= INT32_MAX."
  if (n > 0 && batch > 0 &&
      static_cast<long double>(n) * lda * batch > g_xsyev_max_elements.load()) {
    return 16;
  }
  return 0;
}

template <typename T>
void xsyev_run(T* A, int64_t lda, T* W, int64_t n, cublasFillMode_t uplo, bool vectors,
               int* info, int64_t batch, const std::map<int64_t, int>& inject) {
  for (int64_t b = 0; b < batch; ++b) {
    const int code = solve_one<T>(A + b * lda * n, lda, W + b * n, n, uplo, vectors, true,
                                  NanPolicy::kInfoZero);
    auto it = inject.find(b);
    info[b] = it != inject.end() ? it->second : code;
  }
}

}  // namespace

bool set_nonfinite_garbage(bool on) { return g_nonfinite_garbage.exchange(on); }

int64_t set_xsyev_max_elements(int64_t limit) {
  TORCH_CHECK(limit >= 1 && limit <= std::numeric_limits<int32_t>::max(),
              "simt.set_xsyev_max_elements: expected 1..INT32_MAX, got ", limit);
  return g_xsyev_max_elements.exchange(limit);
}

void inject_solver_info(const std::string& routine, int64_t matrix, int64_t code) {
  TORCH_CHECK(routine == "syevd" || routine == "syevjBatched" || routine == "XsyevBatched",
              "simt.inject_solver_info: unknown routine '", routine, "'");
  TORCH_CHECK(matrix >= 0, "simt.inject_solver_info: matrix must be >= 0");
  const std::lock_guard<std::mutex> lock(g_inject_mutex);
  g_injections[routine].push_back(Injection{matrix, code});
  if (routine == "syevd" && g_syevd_calls.count(routine) == 0) g_syevd_calls[routine] = 0;
}

}  // namespace simt

namespace at::cuda::solver {
const char* cusolverGetErrorMessage(cusolverStatus_t status) {
  switch (status) {
    case CUSOLVER_STATUS_SUCCESS: return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED: return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED: return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE: return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH: return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED: return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR: return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_MATRIX_TYPE_NOT_SUPPORTED";
    case CUSOLVER_STATUS_NOT_SUPPORTED: return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default: return "CUSOLVER_STATUS_UNKNOWN";
  }
}
}  // namespace at::cuda::solver

using simt::syevd;

extern "C" {

cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle) {
  if (handle == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  *handle = new simt_cusolver_st;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle) {
  if (handle == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  delete handle;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnGetStream(cusolverDnHandle_t handle, cudaStream_t* stream) {
  if (handle == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  *stream = handle->stream;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnCreateSyevjInfo(syevjInfo_t* info) {
  if (info == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  *info = new simt_syevj_info_st;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnDestroySyevjInfo(syevjInfo_t info) {
  delete info;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevjSetSortEig(syevjInfo_t info, int sort_eig) {
  if (info == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  info->sort_eig = sort_eig;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevjSetTolerance(syevjInfo_t info, double tolerance) {
  if (info == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  info->tolerance = tolerance;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevjSetMaxSweeps(syevjInfo_t info, int max_sweeps) {
  if (info == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  info->max_sweeps = max_sweeps;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnCreateParams(cusolverDnParams_t* params) {
  if (params == nullptr) return CUSOLVER_STATUS_INVALID_VALUE;
  *params = new simt_dn_params_st;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnDestroyParams(cusolverDnParams_t params) {
  delete params;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnSsyevjBatched_bufferSize(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                                    cublasFillMode_t uplo, int n, const float*,
                                                    int lda, const float*, int* lwork,
                                                    syevjInfo_t params, int batch) {
  return simt::syevj_batched_buffer<float>(h, jobz, uplo, n, lda, lwork, params, batch);
}

cusolverStatus_t cusolverDnDsyevjBatched_bufferSize(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                                    cublasFillMode_t uplo, int n, const double*,
                                                    int lda, const double*, int* lwork,
                                                    syevjInfo_t params, int batch) {
  return simt::syevj_batched_buffer<double>(h, jobz, uplo, n, lda, lwork, params, batch);
}

cusolverStatus_t cusolverDnSsyevjBatched(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                         cublasFillMode_t uplo, int n, float* A, int lda,
                                         float* W, float* work, int lwork, int* info,
                                         syevjInfo_t params, int batch) {
  return simt::syevj_batched<float>(h, jobz, uplo, n, A, lda, W, work, lwork, info, params,
                                    batch);
}

cusolverStatus_t cusolverDnDsyevjBatched(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                         cublasFillMode_t uplo, int n, double* A, int lda,
                                         double* W, double* work, int lwork, int* info,
                                         syevjInfo_t params, int batch) {
  return simt::syevj_batched<double>(h, jobz, uplo, n, A, lda, W, work, lwork, info, params,
                                     batch);
}

cusolverStatus_t cusolverDnSsyevd_bufferSize(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                             cublasFillMode_t uplo, int n, const float*, int lda,
                                             const float*, int* lwork) {
  return simt::syevd_buffer<float>(h, jobz, uplo, n, lda, lwork);
}

cusolverStatus_t cusolverDnDsyevd_bufferSize(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                             cublasFillMode_t uplo, int n, const double*, int lda,
                                             const double*, int* lwork) {
  return simt::syevd_buffer<double>(h, jobz, uplo, n, lda, lwork);
}

cusolverStatus_t cusolverDnSsyevd(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int n, float* A, int lda, float* W,
                                  float* work, int lwork, int* info) {
  return syevd<float>(h, jobz, uplo, n, A, lda, W, work, lwork, info);
}

cusolverStatus_t cusolverDnDsyevd(cusolverDnHandle_t h, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int n, double* A, int lda, double* W,
                                  double* work, int lwork, int* info) {
  return syevd<double>(h, jobz, uplo, n, A, lda, W, work, lwork, info);
}

cusolverStatus_t cusolverDnXsyevBatched_bufferSize(
    cusolverDnHandle_t h, cusolverDnParams_t params, cusolverEigMode_t jobz,
    cublasFillMode_t uplo, int64_t n, cudaDataType ta, const void*, int64_t lda, cudaDataType tw,
    const void*, cudaDataType tc, size_t* device_bytes, size_t* host_bytes, int64_t batch) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  if (params == nullptr || device_bytes == nullptr || host_bytes == nullptr ||
      simt::xsyev_invalid(jobz, uplo, n, ta, lda, tw, tc, batch) != 0) {
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  *device_bytes = static_cast<size_t>(batch * simt::syevd_lwork(n)) * simt::xsyev_type_size(ta);
  *host_bytes = static_cast<size_t>(64 * batch);
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevBatched(cusolverDnHandle_t h, cusolverDnParams_t params,
                                        cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
                                        cudaDataType ta, void* A, int64_t lda, cudaDataType tw,
                                        void* W, cudaDataType tc, void* device_ws,
                                        size_t device_bytes, void* host_ws, size_t host_bytes,
                                        int* info, int64_t batch) {
  if (h == nullptr) return CUSOLVER_STATUS_NOT_INITIALIZED;
  simt::log_call("XsyevBatched n=" + std::to_string(n) + " lda=" + std::to_string(lda) +
                 " batch=" + std::to_string(batch) +
                 " stream=" + std::to_string(simt::stream_id(h->stream)));
  const int bad = params == nullptr ? 1 : simt::xsyev_invalid(jobz, uplo, n, ta, lda, tw, tc, batch);
  if (bad != 0) {
    if (info != nullptr && batch > 0) simt::enqueue(h->stream, [info, bad]() { info[0] = -bad; });
    return CUSOLVER_STATUS_INVALID_VALUE;
  }
  const size_t need_device = static_cast<size_t>(batch * simt::syevd_lwork(n)) *
                             simt::xsyev_type_size(ta);
  const size_t need_host = static_cast<size_t>(64 * batch);
  const std::map<int64_t, int> inject = simt::take_injections("XsyevBatched", false);
  const bool vectors = jobz == CUSOLVER_EIG_MODE_VECTOR;
  simt::enqueue(h->stream, [=]() {
    if (batch == 0 || n == 0) return;
    if (device_bytes < need_device || host_bytes < need_host) {
      info[0] = device_bytes < need_device ? -12 : -14;
      return;
    }
    simt::scribble(device_ws, device_bytes);
    simt::scribble(host_ws, host_bytes);
    if (ta == CUDA_R_32F) {
      simt::xsyev_run<float>(static_cast<float*>(A), lda, static_cast<float*>(W), n, uplo,
                             vectors, info, batch, inject);
    } else {
      simt::xsyev_run<double>(static_cast<double*>(A), lda, static_cast<double*>(W), n, uplo,
                              vectors, info, batch, inject);
    }
  });
  return CUSOLVER_STATUS_SUCCESS;
}

}  // extern "C"
