// The kaisa operator library: the single TORCH_LIBRARY block with every schema,
// the device-independent argument checks, and (when built as the Python
// extension kaisa._C) a minimal Python module init.
//
// Keep the schemas in sync with csrc/SCHEMAS.md; CPU kernels live in
// csrc/cpu/*.cpp and CUDA kernels in csrc/cuda/*.cu.

#include "kaisa.h"

#include <torch/library.h>

#ifdef KAISA_PYTHON_MODULE
#include <Python.h>
#endif

namespace kaisa {

void check_conv_args(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                     at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  TORCH_CHECK(x.dim() == 4, "kaisa conv_covariance: x must be 4-D (N, C, H, W), got ",
              x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()),
              "kaisa conv_covariance: x must be floating point, got ", x.scalar_type());
  TORCH_CHECK(kernel_size.size() == 2, "kaisa conv_covariance: kernel_size must have 2 values");
  TORCH_CHECK(stride.size() == 2, "kaisa conv_covariance: stride must have 2 values");
  TORCH_CHECK(padding.size() == 2, "kaisa conv_covariance: padding must have 2 values");
  TORCH_CHECK(dilation.size() == 2, "kaisa conv_covariance: dilation must have 2 values");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(kernel_size[i] >= 1, "kaisa conv_covariance: kernel_size must be >= 1, got ",
                kernel_size);
    TORCH_CHECK(stride[i] >= 1, "kaisa conv_covariance: stride must be >= 1, got ", stride);
    TORCH_CHECK(padding[i] >= 0, "kaisa conv_covariance: padding must be >= 0, got ", padding);
    TORCH_CHECK(dilation[i] >= 1, "kaisa conv_covariance: dilation must be >= 1, got ",
                dilation);
    const int64_t span = dilation[i] * (kernel_size[i] - 1) + 1;
    TORCH_CHECK(x.size(2 + i) + 2 * padding[i] >= span,
                "kaisa conv_covariance: padded input size ", x.size(2 + i) + 2 * padding[i],
                " is smaller than the dilated kernel extent ", span);
  }
  TORCH_CHECK(groups >= 1, "kaisa conv_covariance: groups must be >= 1, got ", groups);
  TORCH_CHECK(x.size(1) % groups == 0, "kaisa conv_covariance: groups (", groups,
              ") must divide the channel count of x (", x.size(1), ")");
}

void check_eigen_precondition_args(const at::Tensor& grad, const at::Tensor& qa,
                                   const at::Tensor& qg, const std::optional<at::Tensor>& da,
                                   const std::optional<at::Tensor>& dg,
                                   const std::optional<at::Tensor>& dgda) {
  const char* op = "kaisa eigen_precondition: ";
  TORCH_CHECK(grad.dim() == 2 || grad.dim() == 3, op, "grad must be (m, n) or (B, m, n), got ",
              grad.sizes());
  TORCH_CHECK(at::isFloatingType(grad.scalar_type()), op, "grad must be floating point, got ",
              grad.scalar_type());
  const bool batched = grad.dim() == 3;
  const int64_t m = grad.size(-2);
  const int64_t n = grad.size(-1);
  auto check_same = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == grad.scalar_type(), op, name, " has dtype ", t.scalar_type(),
                " but grad has dtype ", grad.scalar_type());
    TORCH_CHECK(t.device() == grad.device(), op, name, " is on ", t.device(),
                " but grad is on ", grad.device());
  };
  auto expect = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape) {
    if (batched) {
      shape.insert(shape.begin(), grad.size(0));
    }
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), op, name, " must have shape ",
                at::IntArrayRef(shape), ", got ", t.sizes());
    check_same(t, name);
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

}  // namespace kaisa

TORCH_LIBRARY(kaisa, m) {
  m.def("covariance(Tensor x, float scale, bool bias) -> Tensor");
  m.def(
      "conv_covariance(Tensor x, int[2] kernel_size, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, bool bias, float scale) -> Tensor");
  m.def(
      "covariance_ema_(Tensor(a!) running, Tensor x, float scale, bool bias, float rho) -> ()");
  m.def(
      "conv_covariance_ema_(Tensor(a!) running, Tensor x, int[2] kernel_size, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, bool bias, float scale, float rho) -> ()");
  m.def(
      "eigen_precondition(Tensor grad, Tensor qa, Tensor qg, Tensor? da, Tensor? dg, "
      "Tensor? dgda, float damping) -> Tensor");
  m.def("batched_eigh(Tensor a) -> (Tensor, Tensor)");
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
