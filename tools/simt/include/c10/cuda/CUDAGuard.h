// SIMT emulator fake of c10/cuda/CUDAGuard.h: CUDAGuard selects the current
// device of the host thread and restores the previous one.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>
#include <simt/device.h>

namespace c10::cuda {

struct CUDAGuard {
  explicit CUDAGuard(DeviceIndex device) : previous_(simt::current_device()) { set_index(device); }
  explicit CUDAGuard(Device device) : previous_(simt::current_device()) {
    TORCH_CHECK(device.is_cuda(), "CUDAGuard: expected a CUDA device, got ", device);
    set_index(device.index());
  }
  CUDAGuard(const CUDAGuard&) = delete;
  CUDAGuard& operator=(const CUDAGuard&) = delete;
  ~CUDAGuard() { simt::set_current_device(previous_); }

 private:
  static void set_index(DeviceIndex device) {
    if (device < 0) return;  // "the current device"
    TORCH_CHECK(device < simt::device_count(), "CUDAGuard: device ", static_cast<int>(device),
                " does not exist (the emulator has ", simt::device_count(), ")");
    simt::set_current_device(device);
  }
  int previous_;
};

}  // namespace c10::cuda
