// CPU kernel of fold: micro-batch factors folded into their running factors.
//
// Each tensor i of the lists on its own (running for running[i], and so on): where every
// entry of batch is finite, out = running * s + batch * weight, with s = decay unless
// stamp == round (the factor was scaled in this round already; then s = 1), the new
// stamp is round and the skip count stays; else out = running and the stamp stay and
// the count grows by one. The products and the sum are rounded one at a time, as
// kaisa.ops._reference.fold computes them (this file is built with -ffp-contract=off: no
// fused multiply-add). New tensors; the inputs are not modified.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "../kaisa.h"

namespace kaisa::cpu {
namespace {

// Elements per parallel task.
constexpr int64_t kGrain = int64_t{1} << 15;

template <typename scalar_t>
bool all_finite(const scalar_t* b, int64_t n) {
  std::atomic<bool> finite{true};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    bool ok = true;
    for (int64_t i = begin; i < end; ++i) {
      ok = ok && std::isfinite(b[i]);
    }
    if (!ok) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  return finite.load();
}

template <typename scalar_t>
void scaled_sum(const scalar_t* r, const scalar_t* b, scalar_t* out, int64_t n, scalar_t s,
                scalar_t w, bool scale) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t kept = scale ? r[i] * s : r[i];
      const scalar_t added = b[i] * w;
      out[i] = kept + added;
    }
  });
}

}  // namespace

namespace {

// One tensor of the lists: (out, new stamp, new skipped).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fold_one(const at::Tensor& running,
                                                         const at::Tensor& batch,
                                                         const at::Tensor& stamp,
                                                         const at::Tensor& skipped,
                                                         int64_t round, double decay,
                                                         double weight) {
  const at::Tensor r = running.contiguous();
  const at::Tensor b = batch.contiguous();
  const int64_t n = r.numel();
  at::Tensor out = at::empty_like(r, at::MemoryFormat::Contiguous);
  bool finite = true;
  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "kaisa_fold_cpu", [&] {
    finite = all_finite(b.const_data_ptr<scalar_t>(), n);
    if (!finite) {
      return;
    }
    const bool scale = stamp.item<int64_t>() != round;
    scaled_sum(r.const_data_ptr<scalar_t>(), b.const_data_ptr<scalar_t>(),
               out.mutable_data_ptr<scalar_t>(), n, static_cast<scalar_t>(decay),
               static_cast<scalar_t>(weight), scale);
  });
  if (!finite) {
    out.copy_(r);
    return {out, stamp.clone(), skipped + 1};
  }
  return {out, at::full({}, round, stamp.options()), skipped.clone()};
}

}  // namespace

FoldResult fold(at::TensorList running, at::TensorList batch, at::TensorList stamp,
                at::TensorList skipped, int64_t round, double decay, double weight) {
  check_fold_args(running, batch, stamp, skipped);
  FoldResult result;
  std::vector<at::Tensor>& outs = std::get<0>(result);
  std::vector<at::Tensor>& stamps = std::get<1>(result);
  std::vector<at::Tensor>& counts = std::get<2>(result);
  for (size_t i = 0; i < running.size(); ++i) {
    check_device_type(running[i], c10::kCPU, "fold", "running");
    auto [out, new_stamp, new_skipped] =
        fold_one(running[i], batch[i], stamp[i], skipped[i], round, decay, weight);
    outs.push_back(std::move(out));
    stamps.push_back(std::move(new_stamp));
    counts.push_back(std::move(new_skipped));
  }
  return result;
}

}  // namespace kaisa::cpu

TORCH_LIBRARY_IMPL(kaisa, CPU, m) {
  m.impl("fold", &kaisa::cpu::fold);
}
