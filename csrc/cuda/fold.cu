// CUDA kernels of fold: micro-batch factors folded into their running factors.
//
// The semantics are kaisa.ops._reference.fold's (csrc/cpu/fold.cpp), for each tensor i
// of the lists on its own: where every entry of batch[i] is finite, out = running[i] *
// s + batch[i] * weight with s = decay unless stamp[i] == round (then s = 1), the stamp
// becomes round; else out = running[i] and the skip count grows by one. No host
// synchronisation, and a constant number of launches for up to kChunk tensors: one fill
// zeroes a flag per tensor, a multi-tensor grid-stride kernel sets a tensor's flag on a
// non-finite entry of its batch, and the multi-tensor update kernel reads the flag and
// the stamp on the device (the first thread of a tensor writes its new stamp and count).
// The tensors' pointers and sizes go by value in a FoldChunk (Apex's multi_tensor_apply
// style): blockIdx.y is the tensor within the chunk, x strides over its elements; longer
// lists take two launches per kChunk tensors. Products and sums are rounded one at a
// time (__fmul_rn, __fadd_rn: no fused multiply-add), as the reference and the CPU
// kernel round them.

#include <algorithm>
#include <tuple>
#include <vector>

#include "common.cuh"

namespace kaisa::cuda {
namespace {

constexpr int kThreads = 256;
// At most this many blocks along x (per tensor): the grid-stride loops cover the rest.
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// Tensors per launch: their pointers and sizes travel by value in the kernel arguments.
constexpr int kChunk = 8;

// Up to kChunk tensors of one fold call (slots past the chunk's size are null).
template <typename T>
struct FoldChunk {
  const T* r[kChunk];
  const T* b[kChunk];
  T* out[kChunk];
  int64_t n[kChunk];
  const int64_t* stamp[kChunk];
  const int64_t* skipped[kChunk];
  int64_t* new_stamp[kChunk];
  int64_t* new_skipped[kChunk];
  int* flag;  // one per tensor of the chunk: 1 when its batch has a non-finite entry
};

// flag[t] = 1 when an entry of b[t] is not finite (every writer writes 1); t = blockIdx.y.
template <typename T>
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(FoldChunk<T> c) {
  const int t = static_cast<int>(blockIdx.y);
  const T* __restrict__ b = c.b[t];
  const int64_t n = c.n[t];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    if (!isfinite(b[i])) {
      c.flag[t] = 1;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fold_kernel(FoldChunk<T> c, int64_t round, T decay, T weight) {
  const int t = static_cast<int>(blockIdx.y);
  const T* __restrict__ r = c.r[t];
  const T* __restrict__ b = c.b[t];
  T* __restrict__ out = c.out[t];
  const int64_t n = c.n[t];
  const bool bad = c.flag[t] != 0;
  const bool scale = *c.stamp[t] != round;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) {
    *c.new_stamp[t] = bad ? *c.stamp[t] : round;
    *c.new_skipped[t] = *c.skipped[t] + (bad ? 1 : 0);
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

FoldResult fold_cuda(at::TensorList running, at::TensorList batch, at::TensorList stamp,
                     at::TensorList skipped, int64_t round, double decay, double weight) {
  check_fold_args(running, batch, stamp, skipped);
  FoldResult result;
  const int64_t count = static_cast<int64_t>(running.size());
  if (count == 0) {
    return result;
  }
  check_device_type(running[0], c10::kCUDA, "fold", "running");  // one device for all
  const c10::cuda::CUDAGuard guard(running[0].device());
  // Named references, not structured bindings: a lambda (C++17) cannot capture those.
  std::vector<at::Tensor>& outs = std::get<0>(result);
  std::vector<at::Tensor>& stamps = std::get<1>(result);
  std::vector<at::Tensor>& counts = std::get<2>(result);
  std::vector<at::Tensor> rs;
  std::vector<at::Tensor> bs;
  for (int64_t i = 0; i < count; ++i) {
    rs.push_back(running[i].contiguous());
    bs.push_back(batch[i].contiguous());
    outs.push_back(at::empty_like(rs.back(), at::MemoryFormat::Contiguous));
    stamps.push_back(at::empty_like(stamp[i]));
    counts.push_back(at::empty_like(skipped[i]));
  }
  at::Tensor flags = at::zeros({count}, rs[0].options().dtype(at::kInt));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(rs[0].scalar_type(), "kaisa_fold_cuda", [&] {
    for (int64_t first = 0; first < count; first += kChunk) {
      const int size = static_cast<int>(std::min<int64_t>(kChunk, count - first));
      FoldChunk<scalar_t> c{};
      int64_t most = 0;
      for (int j = 0; j < size; ++j) {
        const int64_t i = first + j;
        c.r[j] = rs[i].const_data_ptr<scalar_t>();
        c.b[j] = bs[i].const_data_ptr<scalar_t>();
        c.out[j] = outs[i].mutable_data_ptr<scalar_t>();
        c.n[j] = rs[i].numel();
        c.stamp[j] = stamp[i].const_data_ptr<int64_t>();
        c.skipped[j] = skipped[i].const_data_ptr<int64_t>();
        c.new_stamp[j] = stamps[i].mutable_data_ptr<int64_t>();
        c.new_skipped[j] = counts[i].mutable_data_ptr<int64_t>();
        most = std::max(most, c.n[j]);
      }
      c.flag = flags.mutable_data_ptr<int>() + first;
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>(
                          1, std::min<int64_t>(ceil_div<int64_t>(most, kThreads), kMaxBlocks))),
                      static_cast<unsigned>(size));
      nonfinite_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      fold_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          c, round, static_cast<scalar_t>(decay), static_cast<scalar_t>(weight));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return result;
}

}  // namespace
}  // namespace kaisa::cuda

TORCH_LIBRARY_IMPL(kaisa, CUDA, m) {
  m.impl("fold", &kaisa::cuda::fold_cuda);
}
