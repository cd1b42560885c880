// SIMT emulator (tools/simt): what device code and kernel launches see.
//
// A launch runs every block of the grid on the host, one block at a time;
// the threads of a block are fibers (stackful coroutines) on one OS thread
// that run until they reach a barrier (__syncthreads, a warp
// synchronisation) or return. Between barriers the scheduler runs the
// threads one after the other in the order of the current schedule, so a
// read of shared memory that another thread writes without a barrier in
// between sees the old value under one of the two schedules (see
// tools/simt/src/fiber.cpp and docs/cuda-kernels.md).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// Built-in variables, set for the running fiber by the block scheduler.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

namespace simt {

// Launch configuration of `kernel<<<grid, block, shmem, stream>>>`; the
// build step (tools/simt/build.py) rewrites that launch into
// `kernel ^ ::simt::Config("kernel", grid, block, shmem, stream) ^ ::simt::args(...)`.
struct LaunchConfig {
  const char* name;
  dim3 grid;
  dim3 block;
  size_t shmem;
  cudaStream_t stream;
};

inline LaunchConfig Config(const char* name, dim3 grid, dim3 block, size_t shmem = 0,
                           cudaStream_t stream = nullptr) {
  return LaunchConfig{name, grid, block, shmem, stream};
}

namespace detail {
// Validates the configuration (setting the thread's last CUDA error when it
// is invalid) and queues `thread_body` (one call per thread) of `kernel` on
// the stream.
void launch(const LaunchConfig& cfg, const void* kernel, std::function<void()> thread_body);
// Barrier of the whole block; file/line name the call site (divergence check).
void sync_block(const char* file, int line);
// Barrier of the lanes in `mask` of the calling thread's warp.
void sync_warp(unsigned mask);
// Every lane in `mask` publishes `bits`; returns the bits lane `src` published.
uint64_t warp_exchange(unsigned mask, uint64_t bits, int src);
// Lane of the calling thread (linear thread index modulo 32).
int lane_id();
}  // namespace detail

template <class... P>
struct KernelRef {
  void (*fn)(P...);
  LaunchConfig cfg;
};

template <class... P>
KernelRef<P...> operator^(void (*fn)(P...), const LaunchConfig& cfg) {
  return KernelRef<P...>{fn, cfg};
}

template <class... A>
struct KernelArgs {
  std::tuple<A...> values;
};

template <class... A>
KernelArgs<A&&...> args(A&&... a) {
  return KernelArgs<A&&...>{std::forward_as_tuple(std::forward<A>(a)...)};
}

// The launch itself: the arguments are converted to the kernel's parameter
// types and copied now (as CUDA copies them at the launch); every thread
// gets its own copy of the parameters.
template <class... P, class... A>
void operator^(const KernelRef<P...>& kernel, KernelArgs<A...>&& a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
  using Params = std::tuple<std::decay_t<P>...>;
  auto params = std::make_shared<const Params>(std::make_from_tuple<Params>(std::move(a.values)));
  void (*fn)(P...) = kernel.fn;
  detail::launch(kernel.cfg, reinterpret_cast<const void*>(fn),
                 [fn, params]() { std::apply(fn, Params(*params)); });
}

}  // namespace simt

// ------------------------------------------------------------ intrinsics --

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  asm volatile("" ::: "memory");
  ::simt::detail::sync_block(file, line);
  asm volatile("" ::: "memory");
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  asm volatile("" ::: "memory");
  ::simt::detail::sync_warp(mask);
  asm volatile("" ::: "memory");
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

namespace simt::detail {
template <class T>
T shuffle(unsigned mask, T v, int src) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of a T CUDA cannot");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = warp_exchange(mask, bits, src);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace simt::detail

// CUDA's rules: lanes form segments of `width`; a source outside the
// caller's segment (down/up/xor) returns the caller's own value.
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {
  const int lane = ::simt::detail::lane_id();
  const int base = lane & ~(width - 1);
  return ::simt::detail::shuffle(mask, v, base + (src_lane & (width - 1)));
}

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  const int lane = ::simt::detail::lane_id();
  const int seg = lane & (width - 1);
  const int src = seg + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
  return ::simt::detail::shuffle(mask, v, src);
}

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
  const int lane = ::simt::detail::lane_id();
  const int seg = lane & (width - 1);
  const int src = seg >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
  return ::simt::detail::shuffle(mask, v, src);
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
  const int lane = ::simt::detail::lane_id();
  const int src = lane ^ lane_mask;
  const bool same_segment = (src & ~(width - 1)) == (lane & ~(width - 1));
  return ::simt::detail::shuffle(mask, v, same_segment ? src : lane);
}

// Atomics: real read-modify-write operations (blocks may one day run on
// several OS threads); return the old value like CUDA.
template <class T>
T atomicAdd(T* address, T val) {
  static_assert(std::is_arithmetic_v<T>, "atomicAdd of a non-arithmetic type");
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
  } else {
    T old;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    T desired = static_cast<T>(old + val);
    while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
      desired = static_cast<T>(old + val);
    }
    return old;
  }
}
