// SIMT emulator (tools/simt): force-included (-include simt/prelude.h) before
// every csrc/cuda/*.cu file and csrc/kaisa.cpp when they are compiled as host
// C++. It gives the CUDA keywords their host meaning and renames the
// registration namespace: the ops register as torch.ops.kaisa_simt.* (schemas
// from csrc/kaisa.cpp, kernels from csrc/cuda/*.cu under the CUDA key), so the
// emulated kernels never replace or shadow kaisa._C's torch.ops.kaisa.*.
#pragma once

#include <simt/simt.h>

#include <cmath>
#include <string_view>

// Function qualifiers: every function is a host function here.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Per-block storage shared by the block's fibers: blocks never run at the same
// time (every queued task runs under the runtime's lock, src/stream.cpp), so
// one static instance serves each block in turn. Not reset between blocks.
#define __shared__ static

// CUDA's math overloads for float (fma(float, float, float) is fmaf, not the
// double fma).
using std::fma;
using std::isfinite;

// CUDA's round-to-nearest arithmetic intrinsics (never contracted into an fma):
// the host's IEEE operations (the emulator is built without contraction).
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }

// Registration under the test namespace (see the header comment): kaisa's
// library becomes kaisa_simt; the emulator's own test kernels
// (tools/simt/kernels) keep their namespace simt_selftest; any other
// namespace is an error.
#include <torch/library.h>

#define SIMT_NS_kaisa kaisa_simt
#define SIMT_NS_simt_selftest simt_selftest
#define SIMT_RENAME(ns) C10_STRINGIZE(SIMT_NS_##ns)
#define SIMT_CHECK_NAMESPACE(ns)                                            \
  static_assert(std::string_view(SIMT_RENAME(ns)).substr(0, 8) != "SIMT_NS_", \
                "simt: no emulator namespace for this operator library")

#undef TORCH_LIBRARY
#define TORCH_LIBRARY(ns, m)                                                          \
  SIMT_CHECK_NAMESPACE(ns);                                                           \
  static void SIMT_LIBRARY_init_##ns(torch::Library&);                                \
  static const torch::detail::TorchLibraryInit SIMT_LIBRARY_static_init_##ns(         \
      torch::Library::DEF, &SIMT_LIBRARY_init_##ns, SIMT_RENAME(ns), std::nullopt,    \
      __FILE__, __LINE__);                                                            \
  void SIMT_LIBRARY_init_##ns(torch::Library& m)

#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) SIMT_LIBRARY_IMPL(ns, k, m, C10_UID)
#define SIMT_LIBRARY_IMPL(ns, k, m, uid)                                                   \
  SIMT_CHECK_NAMESPACE(ns);                                                                \
  static void C10_CONCATENATE(SIMT_LIBRARY_IMPL_init_##ns##_##k##_, uid)(torch::Library&); \
  static const torch::detail::TorchLibraryInit C10_CONCATENATE(                            \
      SIMT_LIBRARY_IMPL_static_init_##ns##_##k##_, uid)(                                   \
      torch::Library::IMPL, &C10_CONCATENATE(SIMT_LIBRARY_IMPL_init_##ns##_##k##_, uid),   \
      SIMT_RENAME(ns), std::make_optional(c10::DispatchKey::k), __FILE__, __LINE__);       \
  void C10_CONCATENATE(SIMT_LIBRARY_IMPL_init_##ns##_##k##_, uid)(torch::Library & m)
