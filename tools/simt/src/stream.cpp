// SIMT emulator (tools/simt): the emulated device, its streams and events,
// and the CUDA runtime entry points of include/cuda_runtime.h.
//
// A stream is an in-order queue of host closures (kernel launches, cuBLAS and
// cuSOLVER calls, event waits, deferred frees). Nothing runs when it is
// queued: a stream runs its queue when the host waits for it
// (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize, or an
// ATen op issued on it: src/device.cpp), and a queued event wait first runs
// the other stream up to the recorded point. Work on a stream nobody waits
// for therefore stays queued, so a missing stream join or synchronisation
// shows up as a stale result, and memory freed too early as a use after free
// (AddressSanitizer build).
#include "internal.h"

#include <c10/util/Exception.h>

#include <array>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

struct simt_stream_st {
  int device = 0;
  int64_t id = 0;
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0;  // tasks ever queued
  uint64_t done = 0;    // tasks finished (a prefix of the queued ones)
  bool running = false;
};

struct simt_event_st {
  unsigned int flags = 0;
  simt_stream_st* stream = nullptr;
  uint64_t seq = 0;  // the stream's `queued` count when recorded
  bool recorded = false;
};

namespace simt {
namespace {

constexpr int kDevices = 1;
constexpr int kPoolStreams = 8;  // per priority

struct Device {
  cudaDeviceProp props{};
  simt_stream_st default_stream;
  std::array<simt_stream_st, 2 * kPoolStreams> pool;
  unsigned next_low = 0;
  unsigned next_high = 0;
};

std::recursive_mutex& mutex() {
  static auto* m = new std::recursive_mutex;  // never destroyed: used by exit-time frees
  return *m;
}

std::vector<Device>& devices() {
  static auto* d = [] {
    auto* v = new std::vector<Device>(kDevices);
    for (int i = 0; i < kDevices; ++i) {
      Device& dev = (*v)[i];
      cudaDeviceProp& p = dev.props;
      std::snprintf(p.name, sizeof(p.name), "kaisa SIMT emulator (host CPU)");
      p.major = 9;
      p.minor = 0;
      p.multiProcessorCount = 132;  // an H100 / H200 SXM
      p.maxThreadsPerBlock = 1024;
      p.maxThreadsDim[0] = 1024;
      p.maxThreadsDim[1] = 1024;
      p.maxThreadsDim[2] = 64;
      p.maxGridSize[0] = 2147483647;
      p.maxGridSize[1] = 65535;
      p.maxGridSize[2] = 65535;
      p.sharedMemPerBlock = 48 * 1024;
      p.warpSize = 32;
      dev.default_stream.device = i;
      dev.default_stream.id = 0;
      for (int s = 0; s < 2 * kPoolStreams; ++s) {
        dev.pool[s].device = i;
        dev.pool[s].id = s + 1;
      }
    }
    return v;
  }();
  return *d;
}

thread_local int tl_device = 0;
thread_local std::array<cudaStream_t, kDevices> tl_current{};
thread_local cudaError_t tl_last_error = cudaSuccess;

Device& device(int index) {
  TORCH_CHECK(index >= 0 && index < kDevices, "simt: no device ", index);
  return devices()[index];
}

simt_stream_st* resolve(cudaStream_t s) {
  return s != nullptr ? s : &device(tl_device).default_stream;
}

// Runs `s`'s queue until `seq` tasks have finished.
void run_until(simt_stream_st* s, uint64_t seq) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  while (s->done < seq) {
    TORCH_CHECK(!s->running, "simt: stream ", s->id,
                " waits for its own later work (cyclic stream dependency)");
    std::function<void()> task = std::move(s->queue.front());
    s->queue.pop_front();
    s->running = true;
    try {
      task();
    } catch (...) {
      s->running = false;
      ++s->done;
      throw;
    }
    s->running = false;
    ++s->done;
  }
}

}  // namespace

void set_last_error(cudaError_t error) { tl_last_error = error; }

int device_count() { return kDevices; }
int current_device() { return tl_device; }
void set_current_device(int d) {
  (void)device(d);
  tl_device = d;
}
cudaDeviceProp* device_properties(int d) { return &device(d < 0 ? tl_device : d).props; }

cudaStream_t default_stream(int d) { return &device(d).default_stream; }

cudaStream_t current_stream(int d) {
  (void)device(d);
  cudaStream_t s = tl_current[static_cast<size_t>(d)];
  return s != nullptr ? s : default_stream(d);
}

void set_current_stream(cudaStream_t s) {
  simt_stream_st* st = resolve(s);
  tl_current[static_cast<size_t>(st->device)] = st;
}

cudaStream_t pool_stream(int d, bool high_priority) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  Device& dev = device(d);
  unsigned& next = high_priority ? dev.next_high : dev.next_low;
  const unsigned slot = (high_priority ? kPoolStreams : 0) + (next++ % kPoolStreams);
  return &dev.pool[slot];
}

cudaStream_t stream_by_id(int d, int64_t id) {
  Device& dev = device(d);
  if (id == 0) return &dev.default_stream;
  TORCH_CHECK(id >= 1 && id <= 2 * kPoolStreams, "simt: no stream ", id);
  return &dev.pool[static_cast<size_t>(id - 1)];
}

int stream_device(cudaStream_t s) { return resolve(s)->device; }
int64_t stream_id(cudaStream_t s) { return resolve(s)->id; }

void enqueue(cudaStream_t stream, std::function<void()> work) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  simt_stream_st* s = resolve(stream);
  s->queue.push_back(std::move(work));
  ++s->queued;
}

bool idle(cudaStream_t stream) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  simt_stream_st* s = resolve(stream);
  return s->queue.empty() && !s->running;
}

void drain(cudaStream_t stream) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  simt_stream_st* s = resolve(stream);
  run_until(s, s->queued);
}

void drain_device(int d) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  Device& dev = device(d);
  for (bool again = true; again;) {  // a stream's work may queue work on another
    again = false;
    drain(&dev.default_stream);
    for (auto& s : dev.pool) {
      if (s.done < s.queued) {
        run_until(&s, s.queued);
        again = true;
      }
    }
  }
}

int64_t pending(int d) {
  const std::lock_guard<std::recursive_mutex> lock(mutex());
  Device& dev = device(d);
  auto n = static_cast<int64_t>(dev.default_stream.queue.size());
  for (auto& s : dev.pool) n += static_cast<int64_t>(s.queue.size());
  return n;
}

}  // namespace simt

// ------------------------------------------------------ CUDA runtime API --

extern "C" {

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = simt::tl_last_error;
  simt::tl_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return simt::tl_last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = simt::device_count();
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  *d = simt::current_device();
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= simt::device_count()) return cudaErrorInvalidDevice;
  simt::set_current_device(d);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  simt::log_call("sync cudaDeviceSynchronize");
  simt::drain_device(simt::current_device());
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  simt::log_call("sync cudaStreamSynchronize");
  simt::drain(stream);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  return simt::idle(stream) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr) return cudaErrorInvalidValue;
  *event = new simt_event_st{flags, nullptr, 0, false};
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  const std::lock_guard<std::recursive_mutex> lock(simt::mutex());
  simt_stream_st* s = simt::resolve(stream);
  event->stream = s;
  event->seq = s->queued;
  event->recorded = true;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  const std::lock_guard<std::recursive_mutex> lock(simt::mutex());
  return !event->recorded || event->stream->done >= event->seq ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  simt::log_call("sync cudaEventSynchronize");
  if (event->recorded) simt::run_until(event->stream, event->seq);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  if (flags != 0) return cudaErrorInvalidValue;
  if (!event->recorded) return cudaSuccess;  // waiting for an unrecorded event is a no-op
  simt_stream_st* source = event->stream;
  const uint64_t seq = event->seq;  // the record at the time of the call, as in CUDA
  simt::enqueue(stream, [source, seq]() { simt::run_until(source, seq); });
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  delete event;
  return cudaSuccess;
}

}  // extern "C"
