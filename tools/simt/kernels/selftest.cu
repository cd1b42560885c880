// The SIMT emulator's own test kernels (tests/ops/test_simt.py): each one checks
// a property of the emulator that the csrc/cuda tests rely on. Compiled like
// csrc/cuda/*.cu (tools/simt/build.py), registered as torch.ops.simt_selftest.*.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cublas_v2.h>
#include <torch/library.h>

namespace {

constexpr int kMaxThreads = 1024;

// out[i] = x[n - 1 - i] within one block, through shared memory; with
// `barrier` false the exchange has no __syncthreads (a race).
__global__ void reverse_kernel(const float* x, float* out, int n, bool barrier) {
  __shared__ float s[kMaxThreads];
  const int t = threadIdx.x;
  s[t] = x[t];
  if (barrier) __syncthreads();
  out[t] = s[n - 1 - t];
}

// Per warp: out[lane] = the sum over the warp (xor butterfly), the value of
// lane 0 (broadcast), and the value `delta` lanes down (or its own).
__global__ void shuffle_kernel(const float* x, float* sum, float* bcast, float* down,
                               int delta) {
  const int t = threadIdx.x;
  float v = x[t];
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  sum[t] = v;
  bcast[t] = __shfl_sync(0xffffffffu, x[t], 0);
  down[t] = __shfl_down_sync(0xffffffffu, x[t], static_cast<unsigned>(delta));
}

// Every thread of every block adds its global index into total[0] and counts
// itself in count[0].
__global__ void atomic_kernel(double* total, int* count) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(total, static_cast<double>(g));
  atomicAdd(count, 1);
}

// Even threads wait at one __syncthreads, odd ones at another (an error).
__global__ void divergent_kernel(float* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

// Lane 1 exits; the others then synchronise naming it (an error).
__global__ void exited_lane_kernel(float* out) {
  if (threadIdx.x == 1) return;
  __syncwarp(0xffffffffu);
  out[threadIdx.x] = 1.0f;
}

// out[linear global thread index] = the CUDA formula for it, per dimension.
__global__ void index_kernel(int64_t* out) {
  const int64_t block = blockIdx.x + static_cast<int64_t>(gridDim.x) *
                                         (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  const int64_t threads = static_cast<int64_t>(blockDim.x) * blockDim.y * blockDim.z;
  const int64_t t = threadIdx.x + blockDim.x * (threadIdx.y + static_cast<int64_t>(blockDim.y) * threadIdx.z);
  out[block * threads + t] = block * 1000 + t;
}

__global__ void fill_kernel(float* out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

at::Tensor reverse(const at::Tensor& x, bool barrier) {
  at::Tensor out = at::empty_like(x);
  const int n = static_cast<int>(x.numel());
  reverse_kernel<<<1, n, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<float>(), out.mutable_data_ptr<float>(), n, barrier);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> shuffle(const at::Tensor& x, int64_t delta) {
  at::Tensor sum = at::empty_like(x);
  at::Tensor bcast = at::empty_like(x);
  at::Tensor down = at::empty_like(x);
  shuffle_kernel<<<1, static_cast<unsigned>(x.numel()), 0, at::cuda::getCurrentCUDAStream()>>>(
      x.const_data_ptr<float>(), sum.mutable_data_ptr<float>(), bcast.mutable_data_ptr<float>(),
      down.mutable_data_ptr<float>(), static_cast<int>(delta));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sum, bcast, down};
}

void atomics(const at::Tensor& total, const at::Tensor& count, int64_t blocks, int64_t threads) {
  atomic_kernel<<<static_cast<unsigned>(blocks), static_cast<unsigned>(threads), 0,
                  at::cuda::getCurrentCUDAStream()>>>(total.mutable_data_ptr<double>(),
                                                      count.mutable_data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void divergent(const at::Tensor& out) {
  divergent_kernel<<<1, 64, 0, at::cuda::getCurrentCUDAStream()>>>(out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void exited_lane(const at::Tensor& out) {
  exited_lane_kernel<<<1, 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void indices(const at::Tensor& out, at::IntArrayRef grid, at::IntArrayRef block) {
  const dim3 g(static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
               static_cast<unsigned>(grid[2]));
  const dim3 b(static_cast<unsigned>(block[0]), static_cast<unsigned>(block[1]),
               static_cast<unsigned>(block[2]));
  index_kernel<<<g, b, 0, at::cuda::getCurrentCUDAStream()>>>(out.mutable_data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Fills `out` with `value` on a pool stream; with `join` the current stream
// then waits for it (an event), as csrc/cuda/eigh.cu's syevd fan-out does.
void fill_on_side_stream(const at::Tensor& out, double value, bool join) {
  const c10::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, main.device_index());
  at::cuda::CUDAEvent fork;
  fork.record(main);
  fork.block(side);
  fill_kernel<<<4, 128, 0, side.stream()>>>(out.mutable_data_ptr<float>(), out.numel(),
                                              static_cast<float>(value));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (join) {
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(main);
  }
}

cudaDataType blas_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return CUDA_R_64F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// One cublasGemmEx on torch's handle with the types of a, b and c and the raw
// arguments given (compute: a cublasComputeType_t value); returns its status.
// alpha / beta are passed as the compute type's scalar (double for 64F).
int64_t gemm_ex(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t m,
                int64_t n, int64_t k, bool ta, bool tb, int64_t lda, int64_t ldb, int64_t ldc,
                double alpha, double beta, int64_t compute) {
  const auto ct = static_cast<cublasComputeType_t>(compute);
  const bool dbl = ct == CUBLAS_COMPUTE_64F || ct == CUBLAS_COMPUTE_64F_PEDANTIC;
  const float af = static_cast<float>(alpha), bf = static_cast<float>(beta);
  const void* ap = dbl ? static_cast<const void*>(&alpha) : &af;
  const void* bp = dbl ? static_cast<const void*>(&beta) : &bf;
  return cublasGemmEx(at::cuda::getCurrentCUDABlasHandle(), ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                      tb ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), ap, a.const_data_ptr(), blas_type(a),
                      static_cast<int>(lda), b.const_data_ptr(), blas_type(b),
                      static_cast<int>(ldb), bp, c.mutable_data_ptr(), blas_type(c),
                      static_cast<int>(ldc), ct, CUBLAS_GEMM_DEFAULT);
}

}  // namespace

TORCH_LIBRARY(simt_selftest, m) {
  m.def("reverse(Tensor x, bool barrier) -> Tensor");
  m.def("shuffle(Tensor x, int delta) -> (Tensor, Tensor, Tensor)");
  m.def("atomics(Tensor(a!) total, Tensor(b!) count, int blocks, int threads) -> ()");
  m.def("divergent(Tensor(a!) out) -> ()");
  m.def("exited_lane(Tensor(a!) out) -> ()");
  m.def("indices(Tensor(a!) out, int[3] grid, int[3] block) -> ()");
  m.def("fill_on_side_stream(Tensor(a!) out, float value, bool join) -> ()");
  m.def("gemm_ex(Tensor a, Tensor b, Tensor(a!) c, int m, int n, int k, bool ta, bool tb, "
        "int lda, int ldb, int ldc, float alpha, float beta, int compute) -> int");
}

TORCH_LIBRARY_IMPL(simt_selftest, CUDA, m) {
  m.impl("reverse", &reverse);
  m.impl("shuffle", &shuffle);
  m.impl("atomics", &atomics);
  m.impl("divergent", &divergent);
  m.impl("exited_lane", &exited_lane);
  m.impl("indices", &indices);
  m.impl("fill_on_side_stream", &fill_on_side_stream);
  m.impl("gemm_ex", &gemm_ex);
}
