// Shared declarations of the kaisa operator library.
//
// csrc/kaisa.cpp holds the single TORCH_LIBRARY(kaisa, m) block (every schema)
// and the argument checks below. Each op's checks are written once and called
// first by every backend kernel: the CPU kernels in csrc/cpu/*.cpp and the CUDA
// kernels in csrc/cuda/*.cu (TORCH_LIBRARY_IMPL(kaisa, <key>, m)). A check
// never looks at the device type; each kernel adds only "this tensor is on my
// device". The Python wrappers (kaisa/ops/__init__.py) validate the same
// contract earlier with ValueError/TypeError, and the fake kernels next to them
// promise the output shapes.
//
// This header only needs at::Tensor, so the CUDA sources (which use
// per-operator ATen headers) can include it too.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace kaisa {

// Accumulation dtype of the factor computations: double for double inputs,
// float for every other floating dtype.
inline at::ScalarType accumulate_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Output spatial size of a convolution along one dimension (the one C++
// definition: the CPU and CUDA conv_covariance kernels both use it).
inline int64_t conv_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// ---------------------------------------------------------------------------
// The op contract (one check per op, shared by every backend). Each throws
// c10::Error (a Python RuntimeError) whose message names the op and argument.
// ---------------------------------------------------------------------------

// covariance: x is 2-D (rows, d) float32/float64/float16/bfloat16.
void check_covariance_args(const at::Tensor& x);

// conv_covariance: x is 4-D (N, C, H, W) of a supported dtype; two values per
// geometry argument, kernel_size/stride/dilation >= 1, padding >= 0, groups
// divides C, the dilated kernel fits the padded input.
void check_conv_covariance_args(const at::Tensor& x, at::IntArrayRef kernel_size,
                                at::IntArrayRef stride, at::IntArrayRef padding,
                                at::IntArrayRef dilation, int64_t groups);

// eigen_precondition: grad (m, n) or (B, m, n); qa (.., n, n), qg (.., m, m)
// with the same leading batch; exactly one of (da (.., n), dg (.., m)) and
// dgda (.., m, n); one dtype and one device for all.
void check_eigen_precondition_args(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda);

// batched_eigh and batched_eigh_status: a is (n, n) or (B, n, n), float32 or float64.
void check_batched_eigh_args(const at::Tensor& a);

// fold: lists of one length; each running float32 or float64, all of one dtype and one
// device; each batch of its running's shape, dtype and device; each stamp and skipped
// 0-d int64 on that device. An error names the index.
void check_fold_args(at::TensorList running, at::TensorList batch, at::TensorList stamp,
                     at::TensorList skipped);

// What fold returns: the new running factors, stamps and skip counts.
using FoldResult =
    std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>;

// Helper for the per-backend device check: every defined tensor must be on a
// device of `type` (e.g. CPU kernels given a CUDA tensor).
void check_device_type(const at::Tensor& t, c10::DeviceType type, const char* op,
                       const char* name);

namespace cpu {

at::Tensor covariance(const at::Tensor& x, double scale, bool bias);

at::Tensor conv_covariance(const at::Tensor& x, at::IntArrayRef kernel_size,
                           at::IntArrayRef stride, at::IntArrayRef padding,
                           at::IntArrayRef dilation, int64_t groups, bool bias, double scale);

at::Tensor eigen_precondition(const at::Tensor& grad, const at::Tensor& qa, const at::Tensor& qg,
                              const std::optional<at::Tensor>& da,
                              const std::optional<at::Tensor>& dg,
                              const std::optional<at::Tensor>& dgda, double damping);

std::tuple<at::Tensor, at::Tensor> batched_eigh(const at::Tensor& a);

std::tuple<at::Tensor, at::Tensor, at::Tensor> batched_eigh_status(const at::Tensor& a);

FoldResult fold(at::TensorList running, at::TensorList batch, at::TensorList stamp,
                at::TensorList skipped, int64_t round, double decay, double weight);

}  // namespace cpu
}  // namespace kaisa
