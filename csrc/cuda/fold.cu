// CUDA kernels of fold: one micro-batch factor folded into a running factor.
//
// The semantics are kaisa.ops._reference.fold's (csrc/cpu/fold.cpp): where every
// entry of batch is finite, out = running * s + batch * weight with s = decay unless
// stamp == round (then s = 1), the stamp becomes round; else out = running and the
// skip count grows by one. No host synchronisation: a zeroed flag (one fill), a
// grid-stride kernel that sets it on a non-finite entry of batch, and the update kernel,
// which reads the flag and the stamp on the device (its first thread writes the new
// stamp and count). Products and sums are rounded one at a time (__fmul_rn,
// __fadd_rn: no fused multiply-add), as the reference and the CPU kernel round them.

#include <algorithm>
#include <tuple>

#include "common.cuh"

namespace kaisa::cuda {
namespace {

constexpr int kThreads = 256;
// At most this many blocks: the grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// flag[0] = 1 when an entry of b is not finite (every writer writes 1).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(const T* __restrict__ b, int64_t n, int* __restrict__ flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    if (!isfinite(b[i])) {
      *flag = 1;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fold_kernel(const T* __restrict__ r, const T* __restrict__ b, T* __restrict__ out, int64_t n,
                const int* __restrict__ flag, const int64_t* __restrict__ stamp,
                const int64_t* __restrict__ skipped, int64_t* __restrict__ new_stamp,
                int64_t* __restrict__ new_skipped, int64_t round, T decay, T weight) {
  const bool bad = *flag != 0;
  const bool scale = *stamp != round;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) {
    *new_stamp = bad ? *stamp : round;
    *new_skipped = *skipped + (bad ? 1 : 0);
  }
  for (int64_t i = first; i < n; i += stride) {
    if (bad) {
      out[i] = r[i];
    } else {
      const T kept = scale ? mul_rn(r[i], decay) : r[i];
      out[i] = add_rn(kept, mul_rn(b[i], weight));
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_cuda(const at::Tensor& running,
                                                          const at::Tensor& batch,
                                                          const at::Tensor& stamp,
                                                          const at::Tensor& skipped,
                                                          int64_t round, double decay,
                                                          double weight) {
  check_fold_args(running, batch, stamp, skipped);
  check_device_type(running, c10::kCUDA, "fold", "running");
  const c10::cuda::CUDAGuard guard(running.device());
  const at::Tensor r = running.contiguous();
  const at::Tensor b = batch.contiguous();
  const int64_t n = r.numel();
  at::Tensor out = at::empty_like(r, at::MemoryFormat::Contiguous);
  at::Tensor new_stamp = at::empty_like(stamp);
  at::Tensor new_skipped = at::empty_like(skipped);
  at::Tensor flag = at::zeros({1}, r.options().dtype(at::kInt));
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(ceil_div<int64_t>(n, kThreads), kMaxBlocks)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "kaisa_fold_cuda", [&] {
    if (n > 0) {
      nonfinite_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          b.const_data_ptr<scalar_t>(), n, flag.mutable_data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    fold_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
        r.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(),
        out.mutable_data_ptr<scalar_t>(), n, flag.const_data_ptr<int>(),
        stamp.const_data_ptr<int64_t>(), skipped.const_data_ptr<int64_t>(),
        new_stamp.mutable_data_ptr<int64_t>(), new_skipped.mutable_data_ptr<int64_t>(), round,
        static_cast<scalar_t>(decay), static_cast<scalar_t>(weight));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, new_stamp, new_skipped};
}

}  // namespace
}  // namespace kaisa::cuda

TORCH_LIBRARY_IMPL(kaisa, CUDA, m) {
  m.impl("fold", &kaisa::cuda::fold_cuda);
}
