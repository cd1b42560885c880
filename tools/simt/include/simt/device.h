// SIMT emulator (tools/simt): the emulated device as the fake ATen/c10 CUDA
// headers see it (implemented in tools/simt/src/stream.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

namespace simt {

int device_count();
int current_device();          // of this host thread
void set_current_device(int device);
cudaDeviceProp* device_properties(int device);

cudaStream_t default_stream(int device);
cudaStream_t current_stream(int device);  // of this host thread; the default one initially
void set_current_stream(cudaStream_t stream);
cudaStream_t pool_stream(int device, bool high_priority);  // round robin, like c10's pool
int stream_device(cudaStream_t stream);
int64_t stream_id(cudaStream_t stream);  // 0 for the default stream

// Queues `work` on `stream` behind everything queued there before; it runs
// when the host waits for the stream (cudaStreamSynchronize, an event, an
// ATen op on the stream: see src/device.cpp).
void enqueue(cudaStream_t stream, std::function<void()> work);
// Runs `stream`'s queue to its end (what the host sees after a synchronize).
void drain(cudaStream_t stream);

}  // namespace simt
