// CPU kernels of the eigendecomposition based ops: eigen_precondition and
// batched_eigh.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kaisa.h"

namespace kaisa::cpu {
namespace {

// v[b, i, j] /= dg[b, i] * da[b, j] + damping, in place; v contiguous (B, m, n),
// dg (B, m) and da (B, n) contiguous. The denominator is formed on the fly, no
// outer-product tensor is allocated.
void divide_by_outer_(const at::Tensor& v, const at::Tensor& dg, const at::Tensor& da,
                      double damping) {
  const int64_t batch = v.size(0);
  const int64_t m = v.size(1);
  const int64_t n = v.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(),
                                  "kaisa_divide_by_outer", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* pv = v.data_ptr<scalar_t>();
    const scalar_t* pg = dg.const_data_ptr<scalar_t>();
    const scalar_t* pa = da.const_data_ptr<scalar_t>();
    const opmath_t damp = static_cast<opmath_t>(damping);
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
    at::parallel_for(0, batch * m, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / m;
        const opmath_t g = static_cast<opmath_t>(pg[r]);
        const scalar_t* arow = pa + b * n;
        scalar_t* row = pv + r * n;
        for (int64_t j = 0; j < n; ++j) {
          row[j] = static_cast<scalar_t>(static_cast<opmath_t>(row[j]) /
                                         (g * static_cast<opmath_t>(arow[j]) + damp));
        }
      }
    });
  });
}

}  // namespace

at::Tensor eigen_precondition(const at::Tensor& grad, const at::Tensor& qa, const at::Tensor& qg,
                              const std::optional<at::Tensor>& da,
                              const std::optional<at::Tensor>& dg,
                              const std::optional<at::Tensor>& dgda, double damping) {
  TORCH_CHECK(grad.device().is_cpu(),
              "kaisa eigen_precondition (CPU kernel): grad must be on the CPU, got ",
              grad.device());
  check_eigen_precondition_args(grad, qa, qg, da, dg, dgda);
  const bool batched = grad.dim() == 3;
  const at::Tensor g3 = batched ? grad : grad.unsqueeze(0);
  const at::Tensor qa3 = batched ? qa : qa.unsqueeze(0);
  const at::Tensor qg3 = batched ? qg : qg.unsqueeze(0);
  // v = QG^T grad QA (fresh, contiguous: safe to modify in place).
  at::Tensor v = at::bmm(at::bmm(qg3.transpose(1, 2), g3), qa3).contiguous();
  if (dgda.has_value()) {
    v.mul_(batched ? *dgda : dgda->unsqueeze(0));
  } else {
    const at::Tensor dg2 = (batched ? *dg : dg->unsqueeze(0)).contiguous();
    const at::Tensor da2 = (batched ? *da : da->unsqueeze(0)).contiguous();
    divide_by_outer_(v, dg2, da2, damping);
  }
  at::Tensor out = at::bmm(at::bmm(qg3, v), qa3.transpose(1, 2));
  return batched ? out : out.squeeze(0);
}

std::tuple<at::Tensor, at::Tensor> batched_eigh(const at::Tensor& a) {
  TORCH_CHECK(a.device().is_cpu(), "kaisa batched_eigh (CPU kernel): a must be on the CPU, got ",
              a.device());
  TORCH_CHECK(a.dim() >= 2, "kaisa batched_eigh: a must be (B, n, n) or (n, n), got ",
              a.sizes());
  TORCH_CHECK(a.size(-1) == a.size(-2), "kaisa batched_eigh: a must hold square matrices, got ",
              a.sizes());
  TORCH_CHECK(at::isFloatingType(a.scalar_type()),
              "kaisa batched_eigh: a must be floating point, got ", a.scalar_type());
  auto [vals, vecs] = at::linalg_eigh(a, "L");
  // linalg_eigh returns column-major eigenvectors; the op contract is contiguous
  // outputs (see csrc/SCHEMAS.md).
  return {vals.contiguous(), vecs.contiguous()};
}

}  // namespace kaisa::cpu

TORCH_LIBRARY_IMPL(kaisa, CPU, m) {
  m.impl("eigen_precondition", &kaisa::cpu::eigen_precondition);
  m.impl("batched_eigh", &kaisa::cpu::batched_eigh);
}
