// SIMT emulator (tools/simt): torch.ops.simt.*, how tests drive the emulator.
#include "internal.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace simt {
namespace {

at::Tensor to_device(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "simt.to_device: expected a CPU tensor, got ", t.device());
  return t.to(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(current_device())));
}

void synchronize() { drain_device(current_device()); }

int64_t set_schedule_op(int64_t s) {
  const int previous = schedule();
  set_schedule(static_cast<int>(s));
  return previous;
}

int64_t set_sm_count(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= 1024, "simt.set_sm_count: expected 1..1024, got ", n);
  cudaDeviceProp* p = device_properties(current_device());
  const int previous = p->multiProcessorCount;
  p->multiProcessorCount = static_cast<int>(n);
  return previous;
}

int64_t set_stream(int64_t id) {
  const int dev = current_device();
  const int64_t previous = stream_id(current_stream(dev));
  set_current_stream(stream_by_id(dev, id));
  return previous;
}

std::vector<std::string> launches() { return launch_log(); }

int64_t pending_tasks() { return pending(current_device()); }

int64_t xsyev_limit(int64_t limit) { return set_xsyev_max_elements(limit); }

bool nonfinite_garbage(bool on) { return set_nonfinite_garbage(on); }

void inject(const std::string& routine, int64_t matrix, int64_t code) {
  inject_solver_info(routine, matrix, code);
}

}  // namespace
}  // namespace simt

TORCH_LIBRARY(simt, m) {
  m.def("to_device(Tensor t) -> Tensor", &simt::to_device);
  m.def("synchronize() -> ()", &simt::synchronize);
  m.def("set_schedule(int schedule) -> int", &simt::set_schedule_op);
  m.def("set_sm_count(int count) -> int", &simt::set_sm_count);
  m.def("set_stream(int id) -> int", &simt::set_stream);
  m.def("launch_log() -> str[]", &simt::launches);
  m.def("clear_launch_log() -> ()", &simt::clear_launch_log);
  m.def("pending() -> int", &simt::pending_tasks);
  m.def("inject_solver_info(str routine, int matrix, int code) -> ()", &simt::inject);
  m.def("set_xsyev_max_elements(int limit) -> int", &simt::xsyev_limit);
  m.def("set_nonfinite_garbage(bool on) -> bool", &simt::nonfinite_garbage);
}
