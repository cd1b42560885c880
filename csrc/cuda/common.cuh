// Shared helpers for kaisa's CUDA kernels (csrc/cuda/*.cu).
//
// Every .cu file in this directory registers its own implementations with
// TORCH_LIBRARY_IMPL(kaisa, CUDA, m); the schemas and the argument checks every
// kernel calls first are defined once in csrc/kaisa.cpp (see csrc/kaisa.h).
#pragma once

// Per-operator headers instead of <ATen/ATen.h>: the full header costs most
// of the compile time of these small files.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/Exceptions.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "../kaisa.h"

namespace kaisa::cuda {

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Accumulator type: fp32 for fp32/fp16/bf16 inputs, fp64 for fp64 inputs.
template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t to_acc(scalar_t v) {
  return static_cast<acc_t>(static_cast<acc_type_t<scalar_t>>(v));
}

template <typename out_t, typename acc_t>
__device__ __forceinline__ out_t from_acc(acc_t v) {
  return static_cast<out_t>(v);
}

// Number of streaming multiprocessors of the current device.
inline int sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

}  // namespace kaisa::cuda
