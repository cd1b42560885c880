// eigen_precondition: K-FAC preconditioning in the Kronecker eigenbasis,
//
//   result = QG ((QG^T grad QA) / (dg da^T + damping)) QA^T
//   result = QG ((QG^T grad QA) * dgda) QA^T          (dgda given: precomputed
//                                                      reciprocal, (B, m, n))
//
// for a batch of B layers with the same (m, n). Four strided-batched cuBLAS
// GEMMs (S or D) with a single elementwise kernel between the second and third
// one. fp16 / bf16 inputs take another route (precondition_16bit below): four
// launches of a kaisa GEMM kernel that reads the 16-bit operands in place and
// accumulates in fp32, so no fp32 copy of QA / QG (or grad) is made per call. Buffers: the
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

// v (B, m, n contiguous) /= dg da^T + damping, or v *= dgda: dg (B, m), da (B, n),
// dgda (B, m, n) contiguous of type T.
template <typename T>
void scale_in_eigenbasis(T* O, const at::Tensor* dg, const at::Tensor* da,
                         const at::Tensor* dgda, double damping, int batch, int m, int n,
                         cudaStream_t stream) {
  const int64_t mn = static_cast<int64_t>(m) * n;
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

  scale_in_eigenbasis<T>(O, dg, da, dgda, damping, batch, m, n, stream);

  gemm_rm<T>(h, false, false, m, n, m, QG, sqg, O, mn, Tp, mn, batch);   // t = QG o
  gemm_rm<T>(h, false, true, m, n, n, Tp, mn, QA, sqa, O, mn, batch);    // o = t QA^T
}

// ------------------------------------------------ 16-bit inputs: no copies --
//
// fp16 / bf16 operands are read as they are (any strides: a column-major basis
// from a QR or eigh is its transpose's row-major view) and every product
// accumulates in fp32 on the FMA units: cuBLAS has no GEMM with one 16-bit and
// one fp32 operand (cublasGemmEx takes A and B of one type), and the
// intermediates of the chain are fp32. The alternative, fp32 copies of QA / QG on
// every call, costs 2 (n^2 + m^2) * 4 bytes of traffic and memory per call; a
// cache of those copies keyed on the version counter is unsafe (collectives do
// not bump it).

constexpr int kMmTile = 64;  // output tile edge
constexpr int kMmK = 16;     // k per shared-memory slab
constexpr int kMmDim = 16;   // 16 x 16 threads, 4 x 4 outputs each (strided)
constexpr int kMmMicro = kMmTile / kMmDim;
static_assert(kMmDim * kMmDim == kThreads, "mixed GEMM block shape");
static_assert((kMmTile * kMmK) % kThreads == 0, "mixed GEMM loader mapping");

// A strided matrix of a batch: element (b, i, j) at p[b * sb + i * si + j * sj].
template <typename T>
struct View {
  T* p;
  int64_t sb, si, sj;
};

template <typename T>
View<const T> view(const at::Tensor& t) {  // t: (B, rows, cols), any strides
  return {t.const_data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
View<const T> transposed(View<const T> v) {
  return {v.p, v.sb, v.sj, v.si};
}

// C[b] (m x n) = A[b] (m x k) B[b] (k x n), read as TA / TB, fp32 accumulation,
// written as TC. grid = (ceil(n / 64), ceil(m / 64), min(batch, 65535)); blocks
// loop over the batch by gridDim.z.
template <typename TA, typename TB, typename TC>
__global__ void __launch_bounds__(kThreads)
    mixed_gemm_kernel(const View<const TA> A, const View<const TB> B, const View<TC> C,
                      const int batch, const int m, const int n, const int k) {
  __shared__ float As[kMmK][kMmTile + 1];
  __shared__ float Bs[kMmK][kMmTile + 1];
  const int tid = threadIdx.x;
  const int tx = tid % kMmDim;
  const int ty = tid / kMmDim;
  const int i0 = blockIdx.y * kMmTile;
  const int j0 = blockIdx.x * kMmTile;
  for (int b = blockIdx.z; b < batch; b += gridDim.z) {
    const TA* a = A.p + b * A.sb;
    const TB* bp = B.p + b * B.sb;
    float acc[kMmMicro][kMmMicro] = {};
    for (int k0 = 0; k0 < k; k0 += kMmK) {
#pragma unroll
      for (int it = 0; it < (kMmTile * kMmK) / kThreads; ++it) {
        const int e = tid + it * kThreads;
        const int kk = e % kMmK;  // A: consecutive threads along k
        const int r = e / kMmK;
        const int i = i0 + r;
        const int kg = k0 + kk;
        As[kk][r] = (i < m && kg < k) ? static_cast<float>(a[i * A.si + kg * A.sj]) : 0.0f;
        const int c = e % kMmTile;  // B: consecutive threads along n
        const int kb = k0 + e / kMmTile;
        const int j = j0 + c;
        Bs[e / kMmTile][c] =
            (j < n && kb < k) ? static_cast<float>(bp[kb * B.si + j * B.sj]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kMmK; ++kk) {
        float x[kMmMicro], y[kMmMicro];
#pragma unroll
        for (int q = 0; q < kMmMicro; ++q) x[q] = As[kk][ty + q * kMmDim];
#pragma unroll
        for (int q = 0; q < kMmMicro; ++q) y[q] = Bs[kk][tx + q * kMmDim];
#pragma unroll
        for (int u = 0; u < kMmMicro; ++u) {
#pragma unroll
          for (int v = 0; v < kMmMicro; ++v) acc[u][v] = fma(x[u], y[v], acc[u][v]);
        }
      }
      __syncthreads();
    }
    TC* c = C.p + b * C.sb;
#pragma unroll
    for (int u = 0; u < kMmMicro; ++u) {
      const int i = i0 + ty + u * kMmDim;
      if (i >= m) continue;
#pragma unroll
      for (int v = 0; v < kMmMicro; ++v) {
        const int j = j0 + tx + v * kMmDim;
        if (j < n) c[i * C.si + j * C.sj] = static_cast<TC>(acc[u][v]);
      }
    }
  }
}

template <typename TA, typename TB, typename TC>
void mixed_gemm(View<const TA> a, View<const TB> b, View<TC> c, int batch, int m, int n, int k,
                cudaStream_t stream) {
  const int64_t gy = ceil_div<int64_t>(m, kMmTile);
  TORCH_CHECK(gy <= 65535, "kaisa::eigen_precondition: m too large for 16-bit inputs (", m, ")");
  const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(n, kMmTile)),
                  static_cast<unsigned>(gy), static_cast<unsigned>(std::min(batch, 65535)));
  mixed_gemm_kernel<TA, TB, TC><<<grid, kThreads, 0, stream>>>(a, b, c, batch, m, n, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The four products for 16-bit grad / qa / qg (B, ...): t and v are fp32
// intermediates (B, m, n), the last product writes the 16-bit result.
template <typename scalar_t>
void precondition_16bit(const at::Tensor& g, const at::Tensor& qa, const at::Tensor& qg,
                        const at::Tensor* dg, const at::Tensor* da, const at::Tensor* dgda,
                        double damping, at::Tensor& t, at::Tensor& v, at::Tensor& result) {
  const int batch = to_int(g.size(0), "batch");
  const int m = to_int(g.size(1), "m");
  const int n = to_int(g.size(2), "n");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const View<const scalar_t> G = view<scalar_t>(g);
  const View<const scalar_t> QA = view<scalar_t>(qa);
  const View<const scalar_t> QG = view<scalar_t>(qg);
  const View<float> T{t.mutable_data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
  const View<float> V{v.mutable_data_ptr<float>(), v.stride(0), v.stride(1), v.stride(2)};
  const View<const float> Tc{T.p, T.sb, T.si, T.sj};
  const View<const float> Vc{V.p, V.sb, V.si, V.sj};
  const View<scalar_t> R{result.mutable_data_ptr<scalar_t>(), result.stride(0), result.stride(1),
                         result.stride(2)};
  mixed_gemm<scalar_t, scalar_t, float>(transposed(QG), G, T, batch, m, n, m, stream);  // QG^T g
  mixed_gemm<float, scalar_t, float>(Tc, QA, V, batch, m, n, n, stream);                 // t QA
  scale_in_eigenbasis<float>(V.p, dg, da, dgda, damping, batch, m, n, stream);
  mixed_gemm<scalar_t, float, float>(QG, Vc, T, batch, m, n, m, stream);                 // QG v
  mixed_gemm<float, scalar_t, scalar_t>(Tc, transposed(QA), R, batch, m, n, n, stream);  // t QA^T
}

// fp16 / bf16: grad, qa and qg read in place (no fp32 copies), see above; the
// eigenvalue vectors (or the reciprocal dgda) are converted to fp32.
at::Tensor precondition_16bit_cuda(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda, double damping,
                                   bool unbatched) {
  const auto batched = [&](const at::Tensor& t) { return unbatched ? t.unsqueeze(0) : t; };
  const at::Tensor g = batched(grad);
  const at::Tensor qa_b = batched(qa);
  const at::Tensor qg_b = batched(qg);
  at::Tensor da_c, dg_c, dgda_c;
  if (dgda.has_value()) {
    dgda_c = prepare(*dgda, unbatched, at::kFloat);
  } else {
    da_c = prepare(*da, unbatched, at::kFloat);
    dg_c = prepare(*dg, unbatched, at::kFloat);
  }
  at::Tensor result = at::empty({g.size(0), g.size(1), g.size(2)}, g.options());
  if (result.numel() > 0) {
    at::Tensor t = at::empty(result.sizes(), g.options().dtype(at::kFloat));
    at::Tensor v = at::empty_like(t);
    AT_DISPATCH_REDUCED_FLOATING_TYPES(g.scalar_type(), "kaisa_precondition_16bit", [&] {
      precondition_16bit<scalar_t>(g, qa_b, qg_b, dgda.has_value() ? nullptr : &dg_c,
                                   dgda.has_value() ? nullptr : &da_c,
                                   dgda.has_value() ? &dgda_c : nullptr, damping, t, v, result);
    });
  }
  return unbatched ? result.squeeze(0) : result;
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
  if (gt == at::kHalf || gt == at::kBFloat16) {
    return precondition_16bit_cuda(grad, qa, qg, da, dg, dgda, damping, unbatched);
  }
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
