// The kaisa operator library: the single TORCH_LIBRARY block with every schema,
// the op contract (argument checks shared by the CPU and CUDA kernels, see
// kaisa.h) and, when built as the Python extension kaisa._C, a minimal module
// init.
//
// csrc/SCHEMAS.md documents these schemas; tests/ops/test_ops.py checks it against
// the registered torch.ops.kaisa.*._schema, so the document cannot drift.

#include "kaisa.h"

#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#ifdef KAISA_PYTHON_MODULE
#include <Python.h>
#endif

namespace kaisa {
namespace {

bool supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(supported_float(t.scalar_type()), "kaisa ", op, ": ", name,
              " must be float32, float64, float16 or bfloat16, got ", t.scalar_type());
}

}  // namespace

void check_device_type(const at::Tensor& t, c10::DeviceType type, const char* op,
                       const char* name) {
  TORCH_CHECK(t.device().type() == type, "kaisa ", op, " (", c10::DeviceTypeName(type),
              " kernel): ", name, " must be on ", c10::DeviceTypeName(type, /*lower_case=*/true),
              ", got ", t.device());
}

void check_covariance_args(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "kaisa covariance: x must be 2-D (rows, d), got ", x.sizes());
  check_dtype(x, "covariance", "x");
}

void check_conv_covariance_args(const at::Tensor& x, at::IntArrayRef kernel_size,
                                at::IntArrayRef stride, at::IntArrayRef padding,
                                at::IntArrayRef dilation, int64_t groups) {
  const char* op = "kaisa conv_covariance: ";
  TORCH_CHECK(x.dim() == 4, op, "x must be 4-D (N, C, H, W), got ", x.sizes());
  check_dtype(x, "conv_covariance", "x");
  TORCH_CHECK(kernel_size.size() == 2, op, "kernel_size must have 2 values");
  TORCH_CHECK(stride.size() == 2, op, "stride must have 2 values");
  TORCH_CHECK(padding.size() == 2, op, "padding must have 2 values");
  TORCH_CHECK(dilation.size() == 2, op, "dilation must have 2 values");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(kernel_size[i] >= 1, op, "kernel_size must be >= 1, got ", kernel_size);
    TORCH_CHECK(stride[i] >= 1, op, "stride must be >= 1, got ", stride);
    TORCH_CHECK(padding[i] >= 0, op, "padding must be >= 0, got ", padding);
    TORCH_CHECK(dilation[i] >= 1, op, "dilation must be >= 1, got ", dilation);
    const int64_t span = dilation[i] * (kernel_size[i] - 1) + 1;
    TORCH_CHECK(x.size(2 + i) + 2 * padding[i] >= span, op, "padded input size ",
                x.size(2 + i) + 2 * padding[i], " is smaller than the dilated kernel extent ",
                span);
  }
  TORCH_CHECK(groups >= 1, op, "groups must be >= 1, got ", groups);
  TORCH_CHECK(x.size(1) % groups == 0, op, "groups (", groups,
              ") must divide the channel count of x (", x.size(1), ")");
}

void check_eigen_precondition_args(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda) {
  const char* op = "kaisa eigen_precondition: ";
  TORCH_CHECK(grad.dim() == 2 || grad.dim() == 3, op, "grad must be (m, n) or (B, m, n), got ",
              grad.sizes());
  check_dtype(grad, "eigen_precondition", "grad");
  const bool batched = grad.dim() == 3;
  const int64_t m = grad.size(-2);
  const int64_t n = grad.size(-1);
  // The CUDA kernel's limits (cuBLAS's int sizes and batch count, 32-bit element
  // indices within one matrix), enforced for every backend.
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK((n == 0 || m <= kMax / n) && (!batched || grad.size(0) <= kMax), op,
              "grad must have at most 2^31 - 1 elements per matrix (m * n) and at most "
              "2^31 - 1 matrices, got ", grad.sizes());
  auto expect = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
    if (batched) {
      shape.insert(shape.begin(), grad.size(0));
    }
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), op, name, " must have shape ",
                at::IntArrayRef(shape), ", got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == grad.scalar_type(), op, name, " has dtype ", t.scalar_type(),
                " but grad has dtype ", grad.scalar_type());
    TORCH_CHECK(t.device() == grad.device(), op, name, " is on ", t.device(),
                " but grad is on ", grad.device());
  };
  expect(qa, "qa", {n, n});
  expect(qg, "qg", {m, m});
  const bool pair = da.has_value() || dg.has_value();
  TORCH_CHECK(!(pair && dgda.has_value()), op, "give either (da, dg) or dgda, not both");
  TORCH_CHECK(pair || dgda.has_value(), op, "one of (da, dg) or dgda must be given");
  if (dgda.has_value()) {
    expect(*dgda, "dgda", {m, n});
  } else {
    TORCH_CHECK(da.has_value() && dg.has_value(), op, "da and dg must be given together");
    expect(*da, "da", {n});
    expect(*dg, "dg", {m});
  }
}

void check_batched_eigh_args(const at::Tensor& a) {
  const char* op = "kaisa batched_eigh: ";
  TORCH_CHECK(a.dim() == 2 || a.dim() == 3, op, "a must be (n, n) or (B, n, n), got ",
              a.sizes());
  TORCH_CHECK(a.size(-1) == a.size(-2), op, "a must hold square matrices, got ", a.sizes());
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble, op,
              "a must be float32 or float64, got ", a.scalar_type());
}

void check_fold_args(at::TensorList running, at::TensorList batch, at::TensorList stamp,
                     at::TensorList skipped) {
  const char* op = "kaisa fold: ";
  const size_t count = running.size();
  TORCH_CHECK(batch.size() == count && stamp.size() == count && skipped.size() == count, op,
              "running, batch, stamp and skipped must be lists of one length, got ", count, ", ",
              batch.size(), ", ", stamp.size(), " and ", skipped.size());
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& r = running[i];
    const at::Tensor& b = batch[i];
    TORCH_CHECK(r.scalar_type() == at::kFloat || r.scalar_type() == at::kDouble, op,
                "running must be float32 or float64 at index ", i, ", got ", r.scalar_type());
    TORCH_CHECK(r.scalar_type() == running[0].scalar_type(), op,
                "running must have one dtype: ", running[0].scalar_type(), " at index 0, ",
                r.scalar_type(), " at index ", i);
    TORCH_CHECK(r.device() == running[0].device(), op, "running must be on one device: ",
                running[0].device(), " at index 0, ", r.device(), " at index ", i);
    TORCH_CHECK(b.scalar_type() == r.scalar_type(), op, "batch must have running's dtype ",
                r.scalar_type(), " at index ", i, ", got ", b.scalar_type());
    TORCH_CHECK(b.sizes() == r.sizes(), op, "batch must have running's shape ", r.sizes(),
                " at index ", i, ", got ", b.sizes());
    TORCH_CHECK(b.device() == r.device(), op, "batch must be on running's device ", r.device(),
                " at index ", i, ", got ", b.device());
    for (const auto& [t, name] :
         {std::pair{&stamp[i], "stamp"}, std::pair{&skipped[i], "skipped"}}) {
      TORCH_CHECK(t->dim() == 0 && t->scalar_type() == at::kLong, op, name,
                  " must be a 0-d int64 tensor at index ", i, ", got ", t->scalar_type(),
                  " of shape ", t->sizes());
      TORCH_CHECK(t->device() == r.device(), op, name, " must be on running's device ",
                  r.device(), " at index ", i, ", got ", t->device());
    }
  }
}

}  // namespace kaisa

TORCH_LIBRARY(kaisa, m) {
  m.def("covariance(Tensor x, float scale, bool bias) -> Tensor");
  m.def(
      "conv_covariance(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, bool bias, float scale) -> Tensor");
  m.def(
      "eigen_precondition(Tensor grad, Tensor qa, Tensor qg, Tensor? da, Tensor? dg, "
      "Tensor? dgda, float damping) -> Tensor");
  m.def("batched_eigh(Tensor a) -> (Tensor, Tensor)");
  m.def("batched_eigh_status(Tensor a) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fold(Tensor[] running, Tensor[] batch, Tensor[] stamp, Tensor[] skipped, int round, "
      "float decay, float weight) -> (Tensor[], Tensor[], Tensor[])");
}

#ifdef KAISA_PYTHON_MODULE
// kaisa._C only needs to be importable: loading the shared object runs the
// static registrations above. No Python API is exposed (everything goes through
// torch.ops.kaisa), so no pybind11 is needed.
extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",                                                     // m_name
      "kaisa C++/CUDA kernels, registered under torch.ops.kaisa",  // m_doc
      -1,                                                       // m_size
      nullptr,                                                  // m_methods
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
}
#endif
