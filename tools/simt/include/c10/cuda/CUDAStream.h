// SIMT emulator fake of c10/cuda/CUDAStream.h: the part csrc/cuda uses.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>
#include <simt/device.h>

#include <ostream>

namespace c10::cuda {

class CUDAStream {
 public:
  CUDAStream(cudaStream_t stream, DeviceIndex device) : stream_(stream), device_(device) {}
  cudaStream_t stream() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: c10's implicit conversion
  DeviceIndex device_index() const { return device_; }
  Device device() const { return Device(DeviceType::CUDA, device_); }
  int64_t id() const { return simt::stream_id(stream_); }
  void synchronize() const { simt::drain(stream_); }
  bool operator==(const CUDAStream& other) const { return stream_ == other.stream_; }
  bool operator!=(const CUDAStream& other) const { return stream_ != other.stream_; }

 private:
  cudaStream_t stream_;
  DeviceIndex device_;
};

inline DeviceIndex resolve_device(DeviceIndex device) {
  return device < 0 ? static_cast<DeviceIndex>(simt::current_device()) : device;
}

inline CUDAStream getCurrentCUDAStream(DeviceIndex device = -1) {
  const DeviceIndex d = resolve_device(device);
  return CUDAStream(simt::current_stream(d), d);
}

inline CUDAStream getDefaultCUDAStream(DeviceIndex device = -1) {
  const DeviceIndex d = resolve_device(device);
  return CUDAStream(simt::default_stream(d), d);
}

inline CUDAStream getStreamFromPool(const bool isHighPriority = false, DeviceIndex device = -1) {
  const DeviceIndex d = resolve_device(device);
  return CUDAStream(simt::pool_stream(d, isHighPriority), d);
}

inline void setCurrentCUDAStream(CUDAStream stream) { simt::set_current_stream(stream.stream()); }

inline std::ostream& operator<<(std::ostream& os, const CUDAStream& s) {
  return os << "simt stream " << s.id() << " on cuda:" << static_cast<int>(s.device_index());
}

}  // namespace c10::cuda

namespace at::cuda {
using c10::cuda::CUDAStream;
using c10::cuda::getCurrentCUDAStream;
using c10::cuda::getDefaultCUDAStream;
using c10::cuda::getStreamFromPool;
using c10::cuda::setCurrentCUDAStream;
}  // namespace at::cuda
