// SIMT emulator fake of c10/cuda/CUDAFunctions.h.
#pragma once

#include <c10/core/Device.h>
#include <simt/device.h>

namespace c10::cuda {
inline DeviceIndex device_count() noexcept { return static_cast<DeviceIndex>(simt::device_count()); }
inline DeviceIndex current_device() { return static_cast<DeviceIndex>(simt::current_device()); }
inline void device_synchronize() { cudaDeviceSynchronize(); }
}  // namespace c10::cuda
