// SIMT emulator (tools/simt): declarations shared by the runtime sources.
#pragma once

#include <cuda_runtime.h>
#include <simt/device.h>

#include <string>
#include <vector>

namespace simt {

// stream.cpp
void set_last_error(cudaError_t error);
cudaStream_t stream_by_id(int device, int64_t id);  // 0: default, 1..16: pool
bool idle(cudaStream_t stream);
void drain_device(int device);
int64_t pending(int device);  // queued tasks on every stream of the device

// shared.cpp: the __shared__ arrays (static locals) of a kernel function.
struct SharedArray {
  void* data;
  size_t bytes;
};
const std::vector<SharedArray>& shared_arrays(const void* kernel);

// fiber.cpp
int schedule();
void set_schedule(int schedule);
std::vector<std::string> launch_log();
void log_call(const std::string& entry);  // a library call, in the launch log
void clear_launch_log();

// cusolver.cpp: the next call of `routine` ("syevd", "syevjBatched",
// "XsyevBatched") reports `code` in the info of matrix `matrix`.
void inject_solver_info(const std::string& routine, int64_t matrix, int64_t code);
// XsyevBatched's limit on n * lda * batchSize (cuSOLVER: INT32_MAX); returns the old one.
int64_t set_xsyev_max_elements(int64_t limit);
// cusolver.cpp: whether a matrix with a non-finite entry gets finite, wrong results and
// info 0 (true) or NaN results (false, the default); returns the old setting.
bool set_nonfinite_garbage(bool on);

}  // namespace simt
