// Shared declarations of the kaisa operator library.
//
// The operator schemas live in csrc/kaisa.cpp (the single TORCH_LIBRARY block,
// see csrc/SCHEMAS.md). Backend kernels register against them with
// TORCH_LIBRARY_IMPL(kaisa, <DispatchKey>, m): CPU kernels in csrc/cpu/*.cpp and
// CUDA kernels in csrc/cuda/*.cu. The CPU entry points are declared here so the
// C++ tests (tests/cpp) can call them directly as well as via the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kaisa {

// Accumulation dtype of the factor computations: double for double inputs,
// float for every other floating dtype.
inline at::ScalarType accumulate_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Output spatial size of a convolution along one dimension.
inline int64_t conv_out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// Validates the arguments shared by the conv factor ops (TORCH_CHECK with
// messages naming the argument). Returns nothing; throws c10::Error on failure.
void check_conv_args(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// Validates the arguments of eigen_precondition.
void check_eigen_precondition_args(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda);

namespace cpu {

at::Tensor covariance(const at::Tensor& x, double scale, bool bias);

at::Tensor conv_covariance(const at::Tensor& x, at::IntArrayRef kernel_size,
                           at::IntArrayRef stride, at::IntArrayRef padding,
                           at::IntArrayRef dilation, int64_t groups, bool bias, double scale);

void covariance_ema_(const at::Tensor& running, const at::Tensor& x, double scale, bool bias,
                     double rho);

void conv_covariance_ema_(const at::Tensor& running, const at::Tensor& x,
                          at::IntArrayRef kernel_size, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                          bool bias, double scale, double rho);

at::Tensor eigen_precondition(const at::Tensor& grad, const at::Tensor& qa, const at::Tensor& qg,
                              const std::optional<at::Tensor>& da,
                              const std::optional<at::Tensor>& dg,
                              const std::optional<at::Tensor>& dgda, double damping);

std::tuple<at::Tensor, at::Tensor> batched_eigh(const at::Tensor& a);

}  // namespace cpu
}  // namespace kaisa
