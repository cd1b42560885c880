// eigen_precondition: K-FAC preconditioning in the Kronecker eigenbasis,
//
//   result = QG ((QG^T grad QA) / (dg da^T + damping)) QA^T
//   result = QG ((QG^T grad QA) * dgda) QA^T          (dgda given: precomputed
//                                                      reciprocal, (B, m, n))
//
// for a batch of B layers with the same (m, n). Four strided-batched cuBLAS
// GEMMs (S or D; fp16/bf16 inputs are computed in fp32 and cast back) with a
// single elementwise kernel between the second and third one. Buffers: the
// intermediate t (B, m, n) and the output; the eigenbasis-space matrix lives
// in the output buffer until the last GEMM overwrites it:
//
//   t   = QG^T grad          (gemm 1)
//   out = t QA               (gemm 2)
//   out = out / (dg da^T + damping)   or  out *= dgda    (elementwise)
//   t   = QG out             (gemm 3)
//   out = t QA^T             (gemm 4)
//
// All row-major products are issued as column-major cuBLAS calls on the
// transposed problem (C^T = op(B)^T op(A)^T), so no operand is copied or
// transposed in memory. The argument contract (check_eigen_precondition_args
// in csrc/kaisa.cpp) is the CPU kernel's: every operand has grad's batch
// dimension, or none of them has one.
#include "common.cuh"

#include <ATen/cuda/Exceptions.h>
#include <cublas_v2.h>

#include <limits>
#include <optional>

namespace kaisa::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Blas;

template <>
struct Blas<float> {
  static cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                             int n, int k, const float* alpha, const float* a, int lda,
                             long long sa, const float* b, int ldb, long long sb,
                             const float* beta, float* c, int ldc, long long sc, int batch) {
    return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c,
                                     ldc, sc, batch);
  }
};

template <>
struct Blas<double> {
  static cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                             int n, int k, const double* alpha, const double* a, int lda,
                             long long sa, const double* b, int ldb, long long sb,
                             const double* beta, double* c, int ldc, long long sc, int batch) {
    return cublasDgemmStridedBatched(h, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c,
                                     ldc, sc, batch);
  }
};

// Row-major C (m x n) = op(A) (m x k) @ op(B) (k x n), batched with element
// strides sa / sb / sc. op(X) = X^T when tX: A is then stored (k x m), B (n x k).
// Issued as column-major C^T = op(B)^T op(A)^T.
template <typename T>
void gemm_rm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, const T* a, int64_t sa,
             const T* b, int64_t sb, T* c, int64_t sc, int batch) {
  const T one = T(1);
  const T zero = T(0);
  const int lda = ta ? m : k;
  const int ldb = tb ? k : n;
  TORCH_CUDABLAS_CHECK(Blas<T>::gemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &one, b, ldb, sb,
                                     a, lda, sa, &zero, c, n, sc, batch));
}

// v[b][i][j] /= dg[b][i] * da[b][j] + damping; v (B, m, n), dg (B, m) and
// da (B, n) contiguous. gridDim.y strides over the batch, the threads of
// gridDim.x over the m * n elements of one matrix, fewer than 2^31
// (check_eigen_precondition_args): the per-element index math is 32-bit, one
// unsigned division for the row, the 64-bit batch offsets once per matrix.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    divide_kernel(T* __restrict__ v, const T* __restrict__ dg, const T* __restrict__ da,
                  const int batch, const int m, const int n, const T damping) {
  const unsigned mn = static_cast<unsigned>(m) * static_cast<unsigned>(n);
  const unsigned un = static_cast<unsigned>(n);
  const unsigned step = gridDim.x * blockDim.x;  // e + step < 2^32: e < 2^31, step < 2^31
  for (int b = blockIdx.y; b < batch; b += gridDim.y) {
    T* vb = v + static_cast<int64_t>(b) * mn;
    const T* dgb = dg + static_cast<int64_t>(b) * m;
    const T* dab = da + static_cast<int64_t>(b) * n;
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < mn; e += step) {
      const unsigned i = e / un;
      const unsigned j = e - i * un;
      vb[e] = vb[e] / (dgb[i] * dab[j] + damping);
    }
  }
}

// v[b][i][j] *= dgda[b][i][j]; v and dgda (B, m, n) contiguous.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    multiply_kernel(T* __restrict__ v, const T* __restrict__ dgda, const int64_t total) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    v[e] = v[e] * dgda[e];
  }
}

// The operand as a contiguous (B, ...) tensor of the compute dtype.
at::Tensor prepare(const at::Tensor& t, bool unbatched, at::ScalarType compute) {
  return (unbatched ? t.unsqueeze(0) : t).to(compute).contiguous();
}

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v <= std::numeric_limits<int>::max(), "kaisa::eigen_precondition: ", what,
              " too large (", v, ")");
  return static_cast<int>(v);
}

// Every operand is a contiguous (B, ...) tensor (see prepare): the batch
// strides are the matrix sizes.
template <typename T>
void precondition_impl(const at::Tensor& g, const at::Tensor& qa, const at::Tensor& qg,
                       const at::Tensor* dg, const at::Tensor* da, const at::Tensor* dgda,
                       double damping, at::Tensor& t, at::Tensor& out) {
  const int batch = to_int(g.size(0), "batch");
  const int m = to_int(g.size(1), "m");
  const int n = to_int(g.size(2), "n");
  const int64_t mn = static_cast<int64_t>(m) * n;
  const int64_t sqa = static_cast<int64_t>(n) * n;
  const int64_t sqg = static_cast<int64_t>(m) * m;
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  const T* G = g.const_data_ptr<T>();
  const T* QA = qa.const_data_ptr<T>();
  const T* QG = qg.const_data_ptr<T>();
  T* Tp = t.mutable_data_ptr<T>();
  T* O = out.mutable_data_ptr<T>();

  gemm_rm<T>(h, /*ta=*/true, /*tb=*/false, m, n, m, QG, sqg, G, mn, Tp, mn, batch);   // t = QG^T g
  gemm_rm<T>(h, false, false, m, n, n, Tp, mn, QA, sqa, O, mn, batch);                // o = t QA

  const int64_t total = mn * batch;
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * 8;
  if (dgda != nullptr) {
    const int blocks = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(total, kThreads), max_blocks)));
    multiply_kernel<T><<<blocks, kThreads, 0, stream>>>(O, dgda->const_data_ptr<T>(), total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    // About max_blocks blocks in all: matrices over y, each matrix's elements over x.
    const int64_t gy = std::min<int64_t>(batch, 65535);
    const int64_t gx = std::max<int64_t>(
        1, std::min(ceil_div<int64_t>(mn, kThreads), ceil_div<int64_t>(max_blocks, gy)));
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
    divide_kernel<T><<<grid, kThreads, 0, stream>>>(O, dg->const_data_ptr<T>(),
                                                     da->const_data_ptr<T>(), batch, m, n,
                                                     static_cast<T>(damping));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  gemm_rm<T>(h, false, false, m, n, m, QG, sqg, O, mn, Tp, mn, batch);   // t = QG o
  gemm_rm<T>(h, false, true, m, n, n, Tp, mn, QA, sqa, O, mn, batch);    // o = t QA^T
}

at::Tensor eigen_precondition_cuda(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda, double damping) {
  check_device_type(grad, c10::DeviceType::CUDA, "eigen_precondition", "grad");
  check_eigen_precondition_args(grad, qa, qg, da, dg, dgda);
  const c10::cuda::CUDAGuard guard(grad.device());

  const auto gt = grad.scalar_type();
  const bool unbatched = grad.dim() == 2;
  const at::ScalarType ct = gt == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor g = prepare(grad, unbatched, ct);
  const int64_t batch = g.size(0);
  const int64_t m = g.size(1);
  const int64_t n = g.size(2);

  const bool use_dgda = dgda.has_value();
  const at::Tensor qa_c = prepare(qa, unbatched, ct);
  const at::Tensor qg_c = prepare(qg, unbatched, ct);
  at::Tensor da_c, dg_c, dgda_c;
  if (use_dgda) {
    dgda_c = prepare(*dgda, unbatched, ct);
  } else {
    da_c = prepare(*da, unbatched, ct);
    dg_c = prepare(*dg, unbatched, ct);
  }

  at::Tensor out = at::empty({batch, m, n}, g.options());
  if (out.numel() > 0) {
    at::Tensor t = at::empty_like(out);
    if (ct == at::kDouble) {
      precondition_impl<double>(g, qa_c, qg_c, use_dgda ? nullptr : &dg_c,
                                use_dgda ? nullptr : &da_c, use_dgda ? &dgda_c : nullptr, damping,
                                t, out);
    } else {
      precondition_impl<float>(g, qa_c, qg_c, use_dgda ? nullptr : &dg_c,
                               use_dgda ? nullptr : &da_c, use_dgda ? &dgda_c : nullptr, damping,
                               t, out);
    }
  }
  at::Tensor result = out.to(gt);
  return unbatched ? result.squeeze(0) : result;
}

}  // namespace
}  // namespace kaisa::cuda

TORCH_LIBRARY_IMPL(kaisa, CUDA, m) {
  m.impl("eigen_precondition", &kaisa::cuda::eigen_precondition_cuda);
}
