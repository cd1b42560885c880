// SIMT emulator fake of ATen/cuda/CUDAEvent.h: an event created on its first
// record; block() makes a stream wait for the recorded point.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <utility>

namespace at::cuda {

struct CUDAEvent {
  CUDAEvent() = default;
  explicit CUDAEvent(unsigned int flags) : flags_(flags) {}
  CUDAEvent(const CUDAEvent&) = delete;
  CUDAEvent& operator=(const CUDAEvent&) = delete;
  CUDAEvent(CUDAEvent&& other) noexcept { swap(other); }
  CUDAEvent& operator=(CUDAEvent&& other) noexcept {
    if (this != &other) swap(other);
    return *this;
  }
  ~CUDAEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  bool isCreated() const { return event_ != nullptr; }
  cudaEvent_t event() const { return event_; }

  void record() { record(getCurrentCUDAStream()); }
  void record(const CUDAStream& stream) {
    if (event_ == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags_));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
    was_recorded_ = true;
  }
  void block(const CUDAStream& stream) {
    if (was_recorded_) C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
  }
  bool query() const { return !was_recorded_ || cudaEventQuery(event_) == cudaSuccess; }
  void synchronize() const {
    if (was_recorded_) C10_CUDA_CHECK(cudaEventSynchronize(event_));
  }

 private:
  void swap(CUDAEvent& other) noexcept {
    std::swap(flags_, other.flags_);
    std::swap(was_recorded_, other.was_recorded_);
    std::swap(event_, other.event_);
  }
  unsigned int flags_ = cudaEventDisableTiming;
  bool was_recorded_ = false;
  cudaEvent_t event_ = nullptr;
};

}  // namespace at::cuda
