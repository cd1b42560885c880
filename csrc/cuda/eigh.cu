// batched_eigh(a) -> (eigenvalues ascending (B, n), eigenvectors (B, n, n) in columns)
// for one batch of symmetric matrices, on cuSOLVER.
//
// Routine chosen per call (see docs/cuda-kernels.md), N = KAISA_SYEVJ_MAX_N
// (default 32, a performance knee to be set from a GPU benchmark, not an API limit):
//   n <= N                        cusolverDn{S,D}syevjBatched (Jacobi, one launch)
//   n > N, B == 1                 cusolverDn{S,D}syevd on the current stream
//   n > N, B > 1, cuSOLVER with
//     XsyevBatched (>= 11.7.1)    cusolverDnXsyevBatched (one call per chunk of the
//                                 batch under its n * lda * batch <= INT32_MAX limit)
//   otherwise                     cusolverDn{S,D}syevd per matrix, round-robin over
//                                 up to 4 pool streams joined back with events
// The environment variable KAISA_EIGH_IMPL=auto|syevj|xsyev_batched|syevd forces
// a routine (syevj only applies to n <= N, xsyev_batched only where compiled
// in; otherwise it falls back to the automatic choice) so tests and benchmarks
// can exercise every path. KAISA_XSYEV_MAX_ELEMENTS=N lowers the XsyevBatched
// element limit below INT32_MAX (never raises it), so tests reach the chunking at
// small sizes.
//
// cuSOLVER handles are the extension's own (solver_handle below): torch's
// at::cuda::getCurrentCUDASolverDnHandle lives in the lazily loaded
// libtorch_cuda_linalg.so and cannot be resolved from an extension.
//
// Like torch.linalg.eigh (UPLO='L'), only the lower triangle of each row-major
// matrix is read: it is the upper triangle of the column-major matrix cuSOLVER
// sees. Every cuSOLVER status is checked; the per-matrix `info` codes and a
// finiteness check of the eigenvalues and eigenvectors are copied back with one
// synchronisation (the op's only one), and any failure raises torch.linalg.LinAlgError (a
// RuntimeError) so the Python layer can retry in float64.
#include "common.cuh"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/stack.h>
#include <cusolverDn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(CUSOLVER_VERSION) && CUSOLVER_VERSION >= 11701
// cusolverDnXsyevBatched appeared in cuSOLVER 11.7.1 (CUDA 12.6 update 2).
#define KAISA_HAS_XSYEV_BATCHED 1
#else
#define KAISA_HAS_XSYEV_BATCHED 0
#endif

namespace kaisa::cuda {
namespace {

// syevjBatched accepts any n (cuSOLVER documents no size limit for it); its cost
// grows much faster with n than syevd's, so above some n the other routines are
// faster. 32 is that knee, measured on an H100 (batches of 64: syevj fastest up to
// n = 32, XsyevBatched from n = 48; bench/bench_kernels_gpu.py's test_syevj_knee);
// KAISA_SYEVJ_MAX_N (see syevj_max_n) overrides it.
constexpr int64_t kSyevjMaxN = 32;
// XsyevBatched's time hardly grows with the batch, one syevd per matrix's grows linearly.
// Measured on an H100 (bench/results/gpu-nvidia-h100-80gb-hbm3-2026-11-27.json): for
// n >= 576, batches of 3-6 took 1.4-2.5x as long in XsyevBatched as one syevd per
// matrix (torch.linalg.eigh), a batch of 14 at n = 1024 2.4x less; for n <= 512 it won
// at every batch timed. So a batch of fewer than 8 matrices above n = 512 goes to syevd.
constexpr int64_t kXsyevLargeN = 512;
constexpr int64_t kXsyevMinBatchLarge = 8;
constexpr int kMaxSyevdStreams = 4;    // streams for the per-matrix fallback
constexpr cusolverEigMode_t kJobz = CUSOLVER_EIG_MODE_VECTOR;
// Column-major upper == row-major lower (torch.linalg.eigh's default UPLO).
constexpr cublasFillMode_t kUplo = CUBLAS_FILL_MODE_UPPER;

enum class EighImpl { kAuto, kSyevj, kXsyevBatched, kSyevd };

const char* impl_name(EighImpl impl) {
  switch (impl) {
    case EighImpl::kSyevj:
      return "syevjBatched";
    case EighImpl::kXsyevBatched:
      return "XsyevBatched";
    case EighImpl::kSyevd:
      return "syevd";
    default:
      return "auto";
  }
}

EighImpl requested_impl() {
  const char* env = std::getenv("KAISA_EIGH_IMPL");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return EighImpl::kAuto;
  if (std::strcmp(env, "syevj") == 0) return EighImpl::kSyevj;
  if (std::strcmp(env, "xsyev_batched") == 0) return EighImpl::kXsyevBatched;
  if (std::strcmp(env, "syevd") == 0) return EighImpl::kSyevd;
  TORCH_CHECK(false, "kaisa::batched_eigh: KAISA_EIGH_IMPL must be auto, syevj, xsyev_batched ",
              "or syevd, got '", env, "'");
}

// The largest n decomposed by syevjBatched in the automatic choice (and allowed
// for KAISA_EIGH_IMPL=syevj): kSyevjMaxN, or KAISA_SYEVJ_MAX_N=N (0 never uses it).
int64_t syevj_max_n() {
  const char* env = std::getenv("KAISA_SYEVJ_MAX_N");
  if (env == nullptr || *env == '\0') return kSyevjMaxN;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= 0 && v <= std::numeric_limits<int>::max(),
              "kaisa::batched_eigh: KAISA_SYEVJ_MAX_N must be a non-negative integer, got '",
              env, "'");
  return v;
}

// cuSOLVER documents n * lda * batchSize <= INT32_MAX for one XsyevBatched
// call (a group of more than 127 factors at n = 4096 exceeds it): the batch is
// decomposed in chunks of at most this many matrices (0: not even one fits).
int64_t xsyev_chunk(int64_t n) {
  int64_t limit = std::numeric_limits<int32_t>::max();
  const char* env = std::getenv("KAISA_XSYEV_MAX_ELEMENTS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    TORCH_CHECK(*end == '\0' && v >= 1, "kaisa::batched_eigh: KAISA_XSYEV_MAX_ELEMENTS must be ",
                "a positive integer, got '", env, "'");
    limit = std::min<int64_t>(limit, v);
  }
  return limit / (n * n);  // lda = n
}

EighImpl choose_impl(int64_t batch, int64_t n) {
  const EighImpl req = requested_impl();
  const bool xsyev = KAISA_HAS_XSYEV_BATCHED && xsyev_chunk(n) >= 1;
  const bool syevj = n <= syevj_max_n();
  if (req == EighImpl::kSyevj && syevj) return req;
  if (req == EighImpl::kSyevd) return req;
  if (req == EighImpl::kXsyevBatched && xsyev) return req;
  if (syevj) return EighImpl::kSyevj;
  const bool few_large = n > kXsyevLargeN && batch < kXsyevMinBatchLarge;
  if (batch > 1 && xsyev && !few_large) return EighImpl::kXsyevBatched;
  return EighImpl::kSyevd;
}

// ------------------------------------------------------- typed wrappers --

template <typename T>
struct Cusolver;

template <>
struct Cusolver<float> {
  static constexpr cudaDataType kType = CUDA_R_32F;
  static cusolverStatus_t syevj_batched_buffer(cusolverDnHandle_t h, int n, const float* a,
                                               const float* w, int* lwork, syevjInfo_t p,
                                               int batch) {
    return cusolverDnSsyevjBatched_bufferSize(h, kJobz, kUplo, n, a, n, w, lwork, p, batch);
  }
  static cusolverStatus_t syevj_batched(cusolverDnHandle_t h, int n, float* a, float* w,
                                        float* work, int lwork, int* info, syevjInfo_t p,
                                        int batch) {
    return cusolverDnSsyevjBatched(h, kJobz, kUplo, n, a, n, w, work, lwork, info, p, batch);
  }
  static cusolverStatus_t syevd_buffer(cusolverDnHandle_t h, int n, const float* a,
                                       const float* w, int* lwork) {
    return cusolverDnSsyevd_bufferSize(h, kJobz, kUplo, n, a, n, w, lwork);
  }
  static cusolverStatus_t syevd(cusolverDnHandle_t h, int n, float* a, float* w, float* work,
                                int lwork, int* info) {
    return cusolverDnSsyevd(h, kJobz, kUplo, n, a, n, w, work, lwork, info);
  }
};

template <>
struct Cusolver<double> {
  static constexpr cudaDataType kType = CUDA_R_64F;
  static cusolverStatus_t syevj_batched_buffer(cusolverDnHandle_t h, int n, const double* a,
                                               const double* w, int* lwork, syevjInfo_t p,
                                               int batch) {
    return cusolverDnDsyevjBatched_bufferSize(h, kJobz, kUplo, n, a, n, w, lwork, p, batch);
  }
  static cusolverStatus_t syevj_batched(cusolverDnHandle_t h, int n, double* a, double* w,
                                        double* work, int lwork, int* info, syevjInfo_t p,
                                        int batch) {
    return cusolverDnDsyevjBatched(h, kJobz, kUplo, n, a, n, w, work, lwork, info, p, batch);
  }
  static cusolverStatus_t syevd_buffer(cusolverDnHandle_t h, int n, const double* a,
                                       const double* w, int* lwork) {
    return cusolverDnDsyevd_bufferSize(h, kJobz, kUplo, n, a, n, w, lwork);
  }
  static cusolverStatus_t syevd(cusolverDnHandle_t h, int n, double* a, double* w, double* work,
                                int lwork, int* info) {
    return cusolverDnDsyevd(h, kJobz, kUplo, n, a, n, w, work, lwork, info);
  }
};

// RAII owners of cuSOLVER parameter objects.
struct SyevjParams {
  syevjInfo_t p = nullptr;
  SyevjParams() {
    TORCH_CUSOLVER_CHECK(cusolverDnCreateSyevjInfo(&p));
  }
  ~SyevjParams() {
    if (p != nullptr) cusolverDnDestroySyevjInfo(p);
  }
  SyevjParams(const SyevjParams&) = delete;
  SyevjParams& operator=(const SyevjParams&) = delete;
};

#if KAISA_HAS_XSYEV_BATCHED
struct DnParams {
  cusolverDnParams_t p = nullptr;
  DnParams() {
    TORCH_CUSOLVER_CHECK(cusolverDnCreateParams(&p));
  }
  ~DnParams() {
    if (p != nullptr) cusolverDnDestroyParams(p);
  }
  DnParams(const DnParams&) = delete;
  DnParams& operator=(const DnParams&) = delete;
};
#endif

// The extension's cuSOLVER handles, cached per thread and device (a handle
// must not be used by two threads at once) and bound to `stream` on every call.
// Slot 0 serves the current stream; slots 1.. the side streams of the syevd
// fallback. Like torch's own handle pools they are intentionally never
// destroyed: the CUDA context may already be gone at thread / process exit.
cusolverDnHandle_t solver_handle(int slot, const c10::cuda::CUDAStream& stream) {
  thread_local std::unordered_map<int, std::vector<cusolverDnHandle_t>> cache;
  std::vector<cusolverDnHandle_t>& handles = cache[stream.device_index()];
  while (static_cast<int>(handles.size()) <= slot) {
    cusolverDnHandle_t h = nullptr;
    TORCH_CUSOLVER_CHECK(cusolverDnCreate(&h));
    handles.push_back(h);
  }
  cusolverDnHandle_t h = handles[static_cast<size_t>(slot)];
  TORCH_CUSOLVER_CHECK(cusolverDnSetStream(h, stream.stream()));
  return h;
}

// Slot 0 on the current stream of the current device.
cusolverDnHandle_t current_handle() {
  return solver_handle(0, at::cuda::getCurrentCUDAStream());
}

// Makes `main` wait for the side streams, also while unwinding from an error
// (so the caching allocator never recycles memory they still use).
struct JoinStreams {
  const c10::cuda::CUDAStream& main;
  const std::vector<c10::cuda::CUDAStream>& side;
  ~JoinStreams() {
    for (const auto& s : side) {
      cudaEvent_t ev = nullptr;
      if (C10_CUDA_ERROR_HANDLED(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) !=
          cudaSuccess) {
        // Cannot order the streams: fall back to waiting for the side stream.
        C10_CUDA_CHECK_WARN(cudaStreamSynchronize(s.stream()));
        continue;
      }
      C10_CUDA_CHECK_WARN(cudaEventRecord(ev, s.stream()));
      C10_CUDA_CHECK_WARN(cudaStreamWaitEvent(main.stream(), ev, 0));
      C10_CUDA_CHECK_WARN(cudaEventDestroy(ev));
    }
  }
};

template <typename T>
void run_syevj_batched(T* a, T* w, int* info, int n, int batch, const at::Tensor& like) {
  cusolverDnHandle_t handle = current_handle();
  SyevjParams params;
  // Defaults: tolerance = machine precision, 100 sweeps; eigenvalues sorted.
  TORCH_CUSOLVER_CHECK(cusolverDnXsyevjSetSortEig(params.p, 1));
  int lwork = 0;
  TORCH_CUSOLVER_CHECK(
      Cusolver<T>::syevj_batched_buffer(handle, n, a, w, &lwork, params.p, batch));
  at::Tensor work = at::empty({std::max(lwork, 1)}, like.options());
  TORCH_CUSOLVER_CHECK(Cusolver<T>::syevj_batched(handle, n, a, w, work.mutable_data_ptr<T>(),
                                                  lwork, info, params.p, batch));
}

#if KAISA_HAS_XSYEV_BATCHED
// One XsyevBatched call per chunk of at most xsyev_chunk(n) matrices, in order
// on the current stream, sharing one device workspace (sized for the largest
// call); each call gets its own host workspace in `host_ws`, which must
// outlive the synchronisation.
template <typename T>
void run_xsyev_batched(T* a, T* w, int* info, int64_t n, int64_t batch, const at::Tensor& like,
                       std::vector<std::vector<char>>& host_ws) {
  cusolverDnHandle_t handle = current_handle();
  DnParams params;
  constexpr cudaDataType t = Cusolver<T>::kType;
  const int64_t chunk = std::min(batch, xsyev_chunk(n));
  TORCH_INTERNAL_ASSERT(chunk >= 1);
  const int64_t last = batch - (batch - 1) / chunk * chunk;  // size of the last call
  size_t dev_bytes = 0;
  size_t host_bytes = 0;
  for (const int64_t calls : {chunk, last}) {
    size_t dev = 0;
    size_t host = 0;
    TORCH_CUSOLVER_CHECK(cusolverDnXsyevBatched_bufferSize(handle, params.p, kJobz, kUplo, n, t,
                                                           a, n, t, w, t, &dev, &host, calls));
    dev_bytes = std::max(dev_bytes, dev);
    host_bytes = std::max(host_bytes, host);
  }
  at::Tensor dev_ws = at::empty({static_cast<int64_t>(std::max<size_t>(dev_bytes, 1))},
                                like.options().dtype(at::kByte));
  host_ws.reserve(static_cast<size_t>((batch + chunk - 1) / chunk));
  for (int64_t b0 = 0; b0 < batch; b0 += chunk) {
    const int64_t calls = std::min(chunk, batch - b0);
    host_ws.emplace_back(std::max<size_t>(host_bytes, 1), 0);
    TORCH_CUSOLVER_CHECK(cusolverDnXsyevBatched(
        handle, params.p, kJobz, kUplo, n, t, a + b0 * n * n, n, t, w + b0 * n, t,
        dev_ws.mutable_data_ptr(), dev_bytes, host_ws.back().data(), host_bytes, info + b0,
        calls));
  }
}
#endif

template <typename T>
void run_syevd(T* a, T* w, int* info, int n, int64_t batch, const at::Tensor& like) {
  cusolverDnHandle_t handle = current_handle();
  int lwork = 0;
  TORCH_CUSOLVER_CHECK(Cusolver<T>::syevd_buffer(handle, n, a, w, &lwork));
  lwork = std::max(lwork, 1);
  const int64_t nn = static_cast<int64_t>(n) * n;
  const int n_streams = static_cast<int>(std::min<int64_t>(kMaxSyevdStreams, batch));

  if (n_streams <= 1) {
    at::Tensor work = at::empty({lwork}, like.options());
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CUSOLVER_CHECK(Cusolver<T>::syevd(handle, n, a + b * nn, w + b * n,
                                              work.mutable_data_ptr<T>(), lwork, info + b));
    }
    return;
  }

  // Fork: side streams wait for everything queued so far on the current one.
  const c10::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
  at::Tensor work = at::empty({static_cast<int64_t>(n_streams) * lwork}, like.options());
  T* work_ptr = work.mutable_data_ptr<T>();
  at::cuda::CUDAEvent fork;
  fork.record(main);
  std::vector<c10::cuda::CUDAStream> side;
  side.reserve(n_streams);
  for (int s = 0; s < n_streams; ++s) {
    side.push_back(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, main.device_index()));
    fork.block(side.back());
  }
  const JoinStreams join{main, side};  // joins even if a call below throws
  std::vector<cusolverDnHandle_t> handles;
  handles.reserve(side.size());
  for (int s = 0; s < n_streams; ++s) {
    handles.push_back(solver_handle(1 + s, side[static_cast<size_t>(s)]));
  }
  for (int64_t b = 0; b < batch; ++b) {
    const int s = static_cast<int>(b % n_streams);
    TORCH_CUSOLVER_CHECK(Cusolver<T>::syevd(handles[static_cast<size_t>(s)], n, a + b * nn,
                                            w + b * n, work_ptr + static_cast<int64_t>(s) * lwork,
                                            lwork, info + b));
  }
}

std::string describe_failure(EighImpl impl, int64_t b, int code, bool finite) {
  std::ostringstream ss;
  ss << "matrix " << b << ": ";
  if (code < 0) {
    ss << "parameter " << -code << " of cusolverDn " << impl_name(impl) << " was invalid";
  } else if (code > 0) {
    if (impl == EighImpl::kSyevj) {
      ss << "Jacobi iteration did not converge (info=" << code << ")";
    } else {
      ss << code << " off-diagonal elements of the tridiagonal form did not converge (info="
         << code << ")";
    }
  } else if (!finite) {
    ss << "non-finite eigenvalues or eigenvectors (input contains NaN/Inf or is badly "
          "conditioned)";
  }
  return ss.str();
}

// Host workspaces of XsyevBatched calls queued by batched_eigh_status (which
// does not wait for them), each freed once an event recorded after its calls
// has completed: cudaEventQuery, never a wait, on each later call. Like the
// handles, the list is intentionally never destroyed.
struct DeferredHostWorkspaces {
  std::mutex mutex;
  std::vector<std::pair<std::unique_ptr<at::cuda::CUDAEvent>, std::vector<std::vector<char>>>>
      pending;

  void reap() {
    const std::lock_guard<std::mutex> lock(mutex);
    pending.erase(std::remove_if(pending.begin(), pending.end(),
                                 [](const auto& p) { return p.first->query(); }),
                  pending.end());
  }

  void keep(std::vector<std::vector<char>>&& ws, const c10::cuda::CUDAStream& stream) {
    if (ws.empty()) return;
    auto done = std::make_unique<at::cuda::CUDAEvent>();
    done->record(stream);
    const std::lock_guard<std::mutex> lock(mutex);
    pending.emplace_back(std::move(done), std::move(ws));
  }
};

DeferredHostWorkspaces& deferred_host_workspaces() {
  static auto* deferred = new DeferredHostWorkspaces();
  return *deferred;
}

// Queues the decomposition of vecs_cm (in place) and vals; returns the status
// (B, 2) int32 on the device without waiting: per matrix the solver's info and
// 1 if an eigenvalue or eigenvector is not finite. XsyevBatched's host
// workspaces are moved into `host_ws`, which must live until the queued calls ran.
template <typename T>
at::Tensor eigh_impl(at::Tensor& vecs_cm, at::Tensor& vals, EighImpl impl,
                     std::vector<std::vector<char>>& host_ws) {
  const int64_t batch = vecs_cm.size(0);
  const int64_t n = vecs_cm.size(1);
  at::Tensor info = at::zeros({batch}, vecs_cm.options().dtype(at::kInt));
  T* a = vecs_cm.mutable_data_ptr<T>();
  T* w = vals.mutable_data_ptr<T>();
  int* inf = info.mutable_data_ptr<int>();

  switch (impl) {
    case EighImpl::kSyevj:
      run_syevj_batched<T>(a, w, inf, static_cast<int>(n), static_cast<int>(batch), vecs_cm);
      break;
    case EighImpl::kXsyevBatched:
#if KAISA_HAS_XSYEV_BATCHED
      run_xsyev_batched<T>(a, w, inf, n, batch, vecs_cm, host_ws);
      break;
#else
      TORCH_INTERNAL_ASSERT(false, "XsyevBatched not compiled in");
#endif
    case EighImpl::kSyevd:
    default:
      run_syevd<T>(a, w, inf, static_cast<int>(n), batch, vecs_cm);
      break;
  }

  const at::Tensor finite =
      at::isfinite(vals).all(-1).logical_and(at::isfinite(vecs_cm).flatten(1).all(-1));
  const at::Tensor nonfinite = finite.logical_not().to(at::kInt);
  return at::stack({info, nonfinite}, 1);
}

// Raises torch.linalg.LinAlgError naming the first failing matrix unless every
// row of the (B, 2) status is zero. The status's copy to the host is the op's
// only host synchronisation.
void raise_on_failure(const at::Tensor& status_dev, EighImpl impl, at::ScalarType dtype,
                      int64_t n) {
  const int64_t batch = status_dev.size(0);
  const at::Tensor status = status_dev.cpu();
  const int* st = status.const_data_ptr<int>();
  int failed = 0;
  std::string first;
  for (int64_t b = 0; b < batch; ++b) {
    const int code = st[2 * b];
    const bool finite = st[2 * b + 1] == 0;
    if (code != 0 || !finite) {
      if (failed == 0) first = describe_failure(impl, b, code, finite);
      ++failed;
    }
  }
  TORCH_CHECK_LINALG(failed == 0, "kaisa::batched_eigh: cusolverDn ", impl_name(impl), " (",
                     dtype, ", n=", n, ") failed for ", failed, " of ", batch,
                     " matrices; first failure: ", first,
                     ". Retrying in float64 may help.");
}

struct EighOutputs {
  at::Tensor vals;
  at::Tensor vecs;    // row-major, eigenvectors in columns
  at::Tensor status;  // (B, 2) int32 on the device
};

// Both ops' common part: queues the decomposition and the status. With `wait`
// the host workspaces are freed after raise_on_failure's synchronisation;
// without it they are handed to deferred_host_workspaces.
EighOutputs eigh_queued(const at::Tensor& a_in, bool wait) {
  const auto st = a_in.scalar_type();
  const bool unbatched = a_in.dim() == 2;
  const at::Tensor a = unbatched ? a_in.unsqueeze(0) : a_in;
  const int64_t batch = a.size(0);
  const int64_t n = a.size(1);
  TORCH_CHECK(n <= std::numeric_limits<int>::max() && batch <= std::numeric_limits<int>::max(),
              "kaisa::batched_eigh: batch or matrix too large");

  // Fresh column-major workspace: a symmetric matrix is its own transpose,
  // so the row-major copy is the column-major matrix (lower <-> upper).
  at::Tensor vecs_cm = at::empty({batch, n, n}, a.options());
  vecs_cm.copy_(a);
  at::Tensor vals = at::empty({batch, n}, a.options());
  at::Tensor status = at::zeros({batch, 2}, a.options().dtype(at::kInt));

  if (batch > 0 && n > 0) {
    deferred_host_workspaces().reap();
    // A matrix with a non-finite entry is flagged from its input and handed to the
    // solver as the identity: on an H100, syevjBatched's status for a batch holding one
    // NaN matrix did not flag exactly that matrix (tests/ops/test_cuda_eigh_status.py), so
    // the solvers' own NaN behaviour is not relied on, nor let near the other matrices.
    const at::Tensor bad_input = at::isfinite(a).flatten(1).all(-1).logical_not();
    vecs_cm.masked_fill_(bad_input.view({batch, 1, 1}), 0);
    vecs_cm.diagonal(0, 1, 2).masked_fill_(bad_input.view({batch, 1}), 1);
    const EighImpl impl = choose_impl(batch, n);
    std::vector<std::vector<char>> host_ws;  // must outlive the queued calls
    status = st == at::kFloat ? eigh_impl<float>(vecs_cm, vals, impl, host_ws)
                              : eigh_impl<double>(vecs_cm, vals, impl, host_ws);
    status.select(1, 1).bitwise_or_(bad_input.to(at::kInt));
    if (wait) {
      raise_on_failure(status, impl, st, n);
    } else {
      deferred_host_workspaces().keep(std::move(host_ws), at::cuda::getCurrentCUDAStream());
    }
  }

  // cuSOLVER wrote eigenvector k to column k of the column-major buffer,
  // i.e. row k of the row-major tensor. The op contract (csrc/SCHEMAS.md)
  // promises contiguous outputs with eigenvectors in columns: transpose.
  at::Tensor vecs = vecs_cm.mT().contiguous();
  if (unbatched) return {vals.squeeze(0), vecs.squeeze(0), status.squeeze(0)};
  return {vals, vecs, status};
}

std::tuple<at::Tensor, at::Tensor> batched_eigh_cuda(const at::Tensor& a) {
  check_device_type(a, c10::DeviceType::CUDA, "batched_eigh", "a");
  check_batched_eigh_args(a);
  const c10::cuda::CUDAGuard guard(a.device());
  EighOutputs out = eigh_queued(a, /*wait=*/true);
  return {out.vals, out.vecs};
}

// No host synchronisation: the caller reads the status when it chooses.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batched_eigh_status_cuda(const at::Tensor& a) {
  check_device_type(a, c10::DeviceType::CUDA, "batched_eigh_status", "a");
  check_batched_eigh_args(a);
  const c10::cuda::CUDAGuard guard(a.device());
  EighOutputs out = eigh_queued(a, /*wait=*/false);
  return {out.vals, out.vecs, out.status};
}

}  // namespace
}  // namespace kaisa::cuda

TORCH_LIBRARY_IMPL(kaisa, CUDA, m) {
  m.impl("batched_eigh", &kaisa::cuda::batched_eigh_cuda);
  m.impl("batched_eigh_status", &kaisa::cuda::batched_eigh_status_cuda);
}
