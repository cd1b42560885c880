// CPU kernels of the eigendecomposition based ops: eigen_precondition and
// batched_eigh.
//
// batched_eigh exists on the CPU for one reason: torch.linalg.eigh decomposes a
// batch one matrix after another, each LAPACK call threaded internally, which
// scales poorly for the mid-sized factors K-FAC produces (n ~ 100..1000). This
// kernel instead runs whole matrices in parallel (one single-threaded LAPACK
// call per matrix inside at::parallel_for) when there are at least two
// matrices of at least kParallelMinN. bench/bench_kernels_cpu.py measures it
// against one batched torch.linalg.eigh call.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "../kaisa.h"

namespace kaisa::cpu {
namespace {

// Smallest matrix size decomposed matrix-parallel (below it the per-call
// overhead outweighs the gain; see bench/bench_kernels_cpu.py).
constexpr int64_t kParallelMinN = 64;

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
  check_device_type(grad, c10::DeviceType::CPU, "eigen_precondition", "grad");
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
  check_device_type(a, c10::DeviceType::CPU, "batched_eigh", "a");
  check_batched_eigh_args(a);
  const int64_t batch = a.dim() == 3 ? a.size(0) : 1;
  const int64_t n = a.size(-1);
  if (batch < 2 || n < kParallelMinN || at::get_num_threads() < 2) {
    auto [vals, vecs] = at::linalg_eigh(a, "L");
    // linalg_eigh returns column-major eigenvectors; the op contract is
    // contiguous outputs (csrc/SCHEMAS.md).
    return {vals.contiguous(), vecs.contiguous()};
  }
  at::Tensor vals = at::empty({batch, n}, a.options());
  at::Tensor vecs = at::empty({batch, n, n}, a.options());
  // One matrix per task; inside the parallel region LAPACK runs single-threaded.
  // The first exception (e.g. torch.linalg.LinAlgError) is rethrown here.
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      auto [w, q] = at::linalg_eigh(a.select(0, b), "L");
      vals.select(0, b).copy_(w);
      vecs.select(0, b).copy_(q);
    }
  });
  return {vals, vecs};
}

// The status form: a matrix whose LAPACK call fails gets info 1 and NaN
// results instead of an exception (the CPU kernel does not see LAPACK's own
// code); the status is (B, 2) int32 [info, non-finite] as on the GPU
// (csrc/SCHEMAS.md), non-finite also where the input matrix has a non-finite entry.
// Each matrix is decomposed alone, in parallel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batched_eigh_status(const at::Tensor& a_in) {
  check_device_type(a_in, c10::DeviceType::CPU, "batched_eigh_status", "a");
  check_batched_eigh_args(a_in);
  const bool unbatched = a_in.dim() == 2;
  const at::Tensor a = unbatched ? a_in.unsqueeze(0) : a_in;
  const int64_t batch = a.size(0);
  const int64_t n = a.size(-1);
  at::Tensor vals = at::empty({batch, n}, a.options());
  at::Tensor vecs = at::empty({batch, n, n}, a.options());
  at::Tensor info = at::zeros({batch}, a.options().dtype(at::kInt));
  int* inf = info.mutable_data_ptr<int>();
  if (n > 0) {
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        try {
          auto [w, q] = at::linalg_eigh(a.select(0, b), "L");
          vals.select(0, b).copy_(w);
          vecs.select(0, b).copy_(q);
        } catch (const c10::Error&) {
          inf[b] = 1;
          vals.select(0, b).fill_(std::numeric_limits<double>::quiet_NaN());
          vecs.select(0, b).fill_(std::numeric_limits<double>::quiet_NaN());
        }
      }
    });
  }
  const at::Tensor finite = at::isfinite(vals)
                                .all(-1)
                                .logical_and(at::isfinite(vecs).flatten(1).all(-1))
                                .logical_and(at::isfinite(a).flatten(1).all(-1));
  at::Tensor status = at::stack({info, finite.logical_not().to(at::kInt)}, 1);
  if (unbatched) return {vals.squeeze(0), vecs.squeeze(0), status.squeeze(0)};
  return {vals, vecs, status};
}

}  // namespace kaisa::cpu

TORCH_LIBRARY_IMPL(kaisa, CPU, m) {
  m.impl("eigen_precondition", &kaisa::cpu::eigen_precondition);
  m.impl("batched_eigh", &kaisa::cpu::batched_eigh);
  m.impl("batched_eigh_status", &kaisa::cpu::batched_eigh_status);
}
