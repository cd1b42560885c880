// SIMT emulator (tools/simt): the emulated CUDA device as ATen sees it.
//
// The CPU build of torch has no CUDA kernels, yet the host code of
// csrc/cuda/*.cu allocates, copies and checks tensors on the device
// (at::empty, copy_, isfinite, cat, .cpu()). Here a "device tensor" is a
// TensorImpl with the CUDA dispatch key and device cuda:0 whose storage is a
// second view of a CPU storage ("its twin"): the same bytes. Every aten op
// that would otherwise have no CUDA kernel (all but the
// CompositeImplicitAutograd ones, which decompose into others) gets one
// boxed CUDA kernel, `redirect`, that
//   1. runs the current stream's queue first (an ATen op is issued on the
//      current stream and sees everything queued there before),
//   2. swaps every device tensor argument for its CPU view and every cuda
//      device argument for cpu, runs the CPU kernel, and
//   3. returns device views of the new outputs (an output that is an input,
//      as in in-place ops, is returned as that input; an explicit cpu device
//      argument, as in .cpu(), keeps the output on the host).
// Fresh allocations (the empty* ops) are filled with 0xFF bytes (NaN for
// floating types) like reused caching-allocator memory, so unwritten output
// shows. A device storage is released in stream order: its CPU memory is
// freed only once its allocation stream has run the work queued before the
// release, as the caching allocator reuses a block only in stream order.
// Mixing host and device tensors in one op is an error, as on a GPU.
#include "internal.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace simt {
namespace {

struct DeviceBlock {
  c10::intrusive_ptr<c10::StorageImpl> host;  // the CPU storage: keeps the bytes alive
  cudaStream_t stream;                         // allocation stream (frees are ordered on it)
};

std::mutex& twins_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

// CPU storage -> its device twin, so that views of one device tensor share
// one device storage.
std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>>& twins() {
  static auto* t =
      new std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>>;
  return *t;
}

void release_block(void* ctx) {
  auto* block = static_cast<DeviceBlock*>(ctx);
  {
    const std::lock_guard<std::mutex> lock(twins_mutex());
    auto it = twins().find(block->host.get());
    if (it != twins().end() && it->second.expired()) twins().erase(it);
  }
  if (idle(block->stream)) {
    delete block;
  } else {
    enqueue(block->stream, [block]() { delete block; });
  }
}

at::Tensor with_geometry(c10::intrusive_ptr<c10::StorageImpl> storage, c10::DispatchKey key,
                         const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(storage)), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  return t;
}

}  // namespace

bool is_device_tensor(const at::Tensor& t) {
  return t.defined() && t.is_cuda() && t.has_storage() &&
         t.storage().data_ptr().get_deleter() == &release_block;
}

// The device view of a CPU tensor (same bytes).
at::Tensor device_view(const at::Tensor& host) {
  TORCH_INTERNAL_ASSERT(host.device().is_cpu());
  c10::StorageImpl* hs = host.storage().unsafeGetStorageImpl();
  c10::intrusive_ptr<c10::StorageImpl> ds;
  {
    const std::lock_guard<std::mutex> lock(twins_mutex());
    auto it = twins().find(hs);
    if (it != twins().end()) ds = it->second.lock();
  }
  if (!ds) {
    const int dev = current_device();
    auto* block = new DeviceBlock{c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(hs),
                                  current_stream(dev)};
    c10::DataPtr dp(hs->nbytes() > 0 ? hs->mutable_data() : nullptr, block, &release_block,
                    c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev)));
    ds = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), hs->nbytes(),
                                               std::move(dp), nullptr, /*resizable=*/false);
    const std::lock_guard<std::mutex> lock(twins_mutex());
    twins().insert_or_assign(hs, c10::weak_intrusive_ptr<c10::StorageImpl>(ds));
  }
  return with_geometry(std::move(ds), c10::DispatchKey::CUDA, host);
}

// The CPU view of a device tensor (same bytes).
at::Tensor host_view(const at::Tensor& dev) {
  TORCH_CHECK(is_device_tensor(dev), "simt: a CUDA tensor the emulator did not allocate");
  auto* block = static_cast<DeviceBlock*>(dev.storage().data_ptr().get_context());
  return with_geometry(block->host, c10::DispatchKey::CPU, dev);
}

namespace {

const std::unordered_set<std::string>& poisoned_ops() {
  static const std::unordered_set<std::string> ops = {
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_permuted"};
  return ops;
}

// Ops that move data between the host and the device.
const std::unordered_set<std::string>& transfer_ops() {
  static const std::unordered_set<std::string> ops = {
      "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy"};
  return ops;
}

// "dtype=Float shape=[2, 3]" of a fresh tensor, for the allocation log.
std::string describe(const c10::IValue& v) {
  if (!v.isTensor()) return "?";
  const at::Tensor& t = v.toTensor();
  std::ostringstream ss;
  ss << "dtype=" << t.scalar_type() << " shape=" << t.sizes();
  return ss.str();
}

struct Swap {
  at::Tensor device;
  at::Tensor host;
  const void* data;
};

class Redirect {
 public:
  explicit Redirect(const c10::OperatorHandle& op) : op_(op) {}

  void to_host(c10::IValue& v) {
    if (v.isTensor()) {
      const at::Tensor t = v.toTensor();
      if (!t.defined()) return;
      if (!seen_tensor_) first_on_host_ = !t.is_cuda();
      seen_tensor_ = true;
      if (t.is_cuda()) {
        at::Tensor h = host_view(t);
        swaps_.push_back(Swap{t, h, h.storage().data()});
        v = h;
      } else {
        if (t.dim() > 0) host_inputs_.push_back(t);
        inputs_.push_back(t.unsafeGetTensorImpl());
      }
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        c10::IValue e(t);
        to_host(e);
        out.push_back(e.toTensor());
      }
      v = out;
    } else if (v.isList()) {
      c10::impl::GenericList in = v.toList();
      c10::impl::GenericList out(in.elementType());
      for (const c10::IValue& e : in) {
        c10::IValue c = e;
        to_host(c);
        out.push_back(std::move(c));
      }
      v = out;
    } else if (v.isDevice()) {
      target_ = v.toDevice();
      if (target_->is_cuda()) v = c10::IValue(c10::Device(c10::kCPU));
    }
  }

  void check_devices() const {
    if (swaps_.empty() || host_inputs_.empty()) return;
    if (transfer_ops().count(op_.schema().name()) > 0) return;
    TORCH_CHECK(false,
                "Expected all tensors to be on the same device, but found at least two devices, "
                "cuda:0 and cpu! (",
                op_.schema().name(), ", SIMT emulator)");
  }

  void to_device(c10::IValue& v, bool poison) {
    if (v.isTensor()) {
      const at::Tensor r = v.toTensor();
      if (!r.defined() || !r.device().is_cpu()) return;
      for (const Swap& s : swaps_) {
        if (r.unsafeGetTensorImpl() == s.host.unsafeGetTensorImpl()) {
          v = s.device;
          return;
        }
      }
      for (const c10::TensorImpl* in : inputs_) {
        if (r.unsafeGetTensorImpl() == in) return;  // a host input returned as is
      }
      if (target_.has_value() && target_->is_cpu()) return;  // e.g. .cpu()
      if (poison && r.storage().nbytes() > 0) {
        std::memset(r.storage().mutable_data(), 0xFF, r.storage().nbytes());
      }
      if (!poison && !shares_input_storage(r)) {
        // fresh device memory from another op (a .to(dtype) or .contiguous() copy, ...)
        log_call("alloc " + describe(v) + " by " + op_.schema().name());
      }
      v = device_view(r);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) {
        c10::IValue e(t);
        to_device(e, poison);
        out.push_back(e.toTensor());
      }
      v = out;
    }
  }

  // Whether the op reads device memory into host memory, which blocks the host until
  // the device is done on a GPU: a device tensor copied to an explicit cpu target
  // (.cpu(), .to("cpu"), .tolist()) or into a host tensor (copy_), or a scalar read
  // (.item(), bool(), int()).
  bool to_host_copy() const {
    if (swaps_.empty()) return false;
    const std::string& name = op_.schema().name();
    if (name == "aten::_local_scalar_dense") return true;
    if (name == "aten::copy_") return first_on_host_;  // copy_(self=host, src=device)
    return name == "aten::_to_copy" && target_.has_value() && target_->is_cpu();
  }

  // Whether r is a view of a device input (same bytes), not fresh memory.
  bool shares_input_storage(const at::Tensor& r) const {
    for (const Swap& s : swaps_) {
      if (r.storage().data() == s.data) return true;
    }
    return false;
  }

  void check_storages() const {
    for (const Swap& s : swaps_) {
      TORCH_CHECK(s.host.storage().data() == s.data, "simt: ", op_.schema().name(),
                  " reallocated the storage of a device tensor (unsupported by the emulator)");
    }
  }

 private:
  const c10::OperatorHandle& op_;
  std::vector<Swap> swaps_;
  std::vector<at::Tensor> host_inputs_;
  std::vector<const c10::TensorImpl*> inputs_;
  std::optional<c10::Device> target_;
  bool seen_tensor_ = false;
  bool first_on_host_ = false;  // the op's first tensor argument is a host tensor
};

void redirect(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/,
              torch::jit::Stack* stack) {
  drain(current_stream(current_device()));
  const c10::FunctionSchema& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  Redirect r(op);
  for (size_t i = stack->size() - nargs; i < stack->size(); ++i) r.to_host((*stack)[i]);
  r.check_devices();
  op.callBoxed(stack);
  r.check_storages();
  const bool poison = poisoned_ops().count(schema.name()) > 0;
  const size_t nret = schema.returns().size();
  if (poison) log_call("alloc " + describe((*stack)[stack->size() - nret]));
  if (r.to_host_copy()) log_call("sync " + schema.name() + " (device to host)");
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) r.to_device((*stack)[i], poison);
}

// Registers `redirect` as the CUDA kernel of every aten op that needs one.
struct Registrar {
  Registrar() {
    auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA,
                                   __FILE__, __LINE__);  // never destroyed: stays registered
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      const std::optional<c10::OperatorHandle> op = dispatcher.findOp(name);
      if (!op.has_value() || !op->hasSchema()) continue;
      if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
      if (op->hasKernelForDispatchKey(c10::DispatchKey::CUDA)) continue;
      std::string full = name.name;
      if (!name.overload_name.empty()) full += "." + name.overload_name;
      lib->impl(full.c_str(),
                torch::CppFunction::makeFromBoxedFunction<&redirect>());
    }
  }
};

const Registrar registrar;

}  // namespace
}  // namespace simt
