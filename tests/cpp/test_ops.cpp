// Plain C++ tests of the kaisa CPU kernels against explicit loops.
// Built by CMakeLists.txt and run by ctest (.ci/cmake_ctest.sh). Exit code is
// the number of failed checks (0 on success).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kaisa.h"

namespace {

int g_failures = 0;
int g_checks = 0;

#define EXPECT(cond, ...)                                                  \
  do {                                                                     \
    ++g_checks;                                                            \
    if (!(cond)) {                                                         \
      ++g_failures;                                                        \
      std::printf("FAILED %s:%d: %s ", __FILE__, __LINE__, #cond);       \
      std::printf(__VA_ARGS__);                                            \
      std::printf("\n");                                                   \
    }                                                                      \
  } while (0)

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

bool exactly_symmetric(const at::Tensor& a) {
  return at::equal(a, a.transpose(-1, -2));
}

// scale * Xb^T Xb with explicit loops (double).
at::Tensor loop_covariance(const at::Tensor& x, double scale, bool bias) {
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  const int64_t rows = xd.size(0);
  const int64_t dx = xd.size(1);
  const int64_t d = dx + (bias ? 1 : 0);
  at::Tensor out = at::zeros({d, d}, at::kDouble);
  auto xa = xd.accessor<double, 2>();
  auto oa = out.accessor<double, 2>();
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      double s = 0;
      for (int64_t r = 0; r < rows; ++r) {
        const double a = i < dx ? xa[r][i] : 1.0;
        const double b = j < dx ? xa[r][j] : 1.0;
        s += a * b;
      }
      oa[i][j] = scale * s;
    }
  }
  return out;
}

// Patch matrices (groups, rows, d) with explicit loops (double).
at::Tensor loop_patches(const at::Tensor& x, std::vector<int64_t> k, std::vector<int64_t> s,
                        std::vector<int64_t> p, std::vector<int64_t> dl, int64_t groups,
                        bool bias) {
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  auto xa = xd.accessor<double, 4>();
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = kaisa::conv_out_size(h, k[0], s[0], p[0], dl[0]);
  const int64_t ow = kaisa::conv_out_size(w, k[1], s[1], p[1], dl[1]);
  const int64_t cg = c / groups;
  const int64_t d = cg * k[0] * k[1] + (bias ? 1 : 0);
  at::Tensor out = at::zeros({groups, n * oh * ow, d}, at::kDouble);
  auto oa = out.accessor<double, 3>();
  for (int64_t g = 0; g < groups; ++g) {
    int64_t row = 0;
    for (int64_t b = 0; b < n; ++b) {
      for (int64_t i = 0; i < oh; ++i) {
        for (int64_t j = 0; j < ow; ++j, ++row) {
          int64_t col = 0;
          for (int64_t ch = g * cg; ch < (g + 1) * cg; ++ch) {
            for (int64_t ki = 0; ki < k[0]; ++ki) {
              for (int64_t kj = 0; kj < k[1]; ++kj, ++col) {
                const int64_t ih = i * s[0] - p[0] + ki * dl[0];
                const int64_t iw = j * s[1] - p[1] + kj * dl[1];
                if (ih >= 0 && ih < h && iw >= 0 && iw < w) {
                  oa[g][row][col] = xa[b][ch][ih][iw];
                }
              }
            }
          }
          if (bias) {
            oa[g][row][col] = 1.0;
          }
        }
      }
    }
  }
  return out;
}

at::Tensor loop_conv_covariance(const at::Tensor& x, std::vector<int64_t> k,
                                std::vector<int64_t> s, std::vector<int64_t> p,
                                std::vector<int64_t> dl, int64_t groups, bool bias,
                                double scale) {
  const at::Tensor pm = loop_patches(x, k, s, p, dl, groups, bias);
  std::vector<at::Tensor> outs;
  for (int64_t g = 0; g < groups; ++g) {
    outs.push_back(loop_covariance(pm[g], scale, false));
  }
  return at::stack(outs);
}

void test_covariance() {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kDouble ? 1e-10 : 1e-4;
    for (bool bias : {false, true}) {
      for (auto shape : std::vector<std::vector<int64_t>>{{1, 1}, {37, 5}, {300, 150}}) {
        const at::Tensor x = at::randn(shape, at::TensorOptions().dtype(dtype));
        const at::Tensor got = kaisa::cpu::covariance(x, 0.5, bias);
        const double err = max_abs_diff(got, loop_covariance(x, 0.5, bias));
        EXPECT(err < tol * std::max<int64_t>(1, shape[0]), "covariance err %g", err);
        EXPECT(exactly_symmetric(got), "covariance not symmetric");
        EXPECT(got.scalar_type() == dtype, "covariance dtype");
        // Non-contiguous input.
        const at::Tensor xt = at::randn({shape[1], shape[0]}, x.options()).t();
        const double err_t =
            max_abs_diff(kaisa::cpu::covariance(xt, 1.0, bias), loop_covariance(xt, 1.0, bias));
        EXPECT(err_t < tol * std::max<int64_t>(1, shape[0]), "covariance(x^T) err %g", err_t);
      }
    }
  }
}

struct ConvCase {
  std::vector<int64_t> shape, k, s, p, d;
  int64_t groups;
};

void test_conv_covariance() {
  const std::vector<ConvCase> cases = {
      {{3, 4, 9, 11}, {3, 3}, {1, 1}, {1, 1}, {1, 1}, 1},
      {{2, 6, 13, 10}, {3, 2}, {2, 1}, {1, 0}, {2, 1}, 2},
      {{2, 6, 9, 9}, {3, 3}, {1, 1}, {1, 1}, {1, 1}, 6},
      {{2, 8, 24, 24}, {1, 1}, {1, 1}, {0, 0}, {1, 1}, 2},
      {{2, 3, 15, 17}, {7, 7}, {2, 2}, {3, 3}, {1, 1}, 1},
      {{2, 4, 11, 11}, {3, 3}, {2, 2}, {2, 2}, {2, 2}, 1},
  };
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kDouble ? 1e-9 : 1e-3;
    for (const auto& cs : cases) {
      for (bool bias : {false, true}) {
        const at::Tensor x = at::randn(cs.shape, at::TensorOptions().dtype(dtype));
        const at::Tensor got =
            kaisa::cpu::conv_covariance(x, cs.k, cs.s, cs.p, cs.d, cs.groups, bias, 0.25);
        const at::Tensor expected =
            loop_conv_covariance(x, cs.k, cs.s, cs.p, cs.d, cs.groups, bias, 0.25);
        EXPECT(got.sizes() == expected.sizes(), "conv_covariance shape");
        const double err = max_abs_diff(got, expected);
        EXPECT(err < tol, "conv_covariance err %g (k=%ld groups=%ld bias=%d)", err,
               static_cast<long>(cs.k[0]), static_cast<long>(cs.groups), bias ? 1 : 0);
        EXPECT(exactly_symmetric(got), "conv_covariance not symmetric");
        // Channels-last input gives the same result.
        const at::Tensor xcl = x.contiguous(at::MemoryFormat::ChannelsLast);
        const double err_cl = max_abs_diff(
            kaisa::cpu::conv_covariance(xcl, cs.k, cs.s, cs.p, cs.d, cs.groups, bias, 0.25),
            expected);
        EXPECT(err_cl < tol, "conv_covariance channels_last err %g", err_cl);
      }
    }
  }
}

void test_eigen_precondition() {
  const int64_t m = 5, n = 7;
  const double damping = 0.05;
  const at::Tensor grad = at::randn({m, n}, at::kDouble);
  const at::Tensor qa = std::get<0>(at::linalg_qr(at::randn({n, n}, at::kDouble)));
  const at::Tensor qg = std::get<0>(at::linalg_qr(at::randn({m, m}, at::kDouble)));
  const at::Tensor da = at::rand({n}, at::kDouble) + 0.1;
  const at::Tensor dg = at::rand({m}, at::kDouble) + 0.1;
  // Explicit loops: v = QG^T grad QA / (dg da^T + damping); out = QG v QA^T.
  auto G = grad.accessor<double, 2>();
  auto A = qa.accessor<double, 2>();
  auto Q = qg.accessor<double, 2>();
  auto DA = da.accessor<double, 1>();
  auto DG = dg.accessor<double, 1>();
  std::vector<double> v(m * n, 0.0), out(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t a = 0; a < m; ++a) {
        for (int64_t b = 0; b < n; ++b) {
          s += Q[a][i] * G[a][b] * A[b][j];
        }
      }
      v[i * n + j] = s / (DG[i] * DA[j] + damping);
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t a = 0; a < m; ++a) {
        for (int64_t b = 0; b < n; ++b) {
          s += Q[i][a] * v[a * n + b] * A[j][b];
        }
      }
      out[i * n + j] = s;
    }
  }
  const at::Tensor expected = at::tensor(out, at::kDouble).view({m, n});
  const at::Tensor got = kaisa::cpu::eigen_precondition(grad, qa, qg, da, dg, {}, damping);
  EXPECT(max_abs_diff(got, expected) < 1e-10, "eigen_precondition err %g",
         max_abs_diff(got, expected));
  const at::Tensor dgda = 1.0 / (at::outer(dg, da) + damping);
  const at::Tensor got2 = kaisa::cpu::eigen_precondition(grad.unsqueeze(0), qa.unsqueeze(0),
                                                         qg.unsqueeze(0), {}, {},
                                                         dgda.unsqueeze(0), 0.0);
  EXPECT(max_abs_diff(got2.squeeze(0), expected) < 1e-10, "eigen_precondition(dgda) err %g",
         max_abs_diff(got2.squeeze(0), expected));
}

void test_batched_eigh() {
  // n = 8: one linalg_eigh call; n = 80: the matrix-parallel path.
  for (const int64_t n : {8, 80}) {
    at::Tensor a = at::randn({3, n, n}, at::kDouble);
    a = a + a.transpose(1, 2);
    auto [vals, vecs] = kaisa::cpu::batched_eigh(a);
    const at::Tensor recon = at::bmm(at::bmm(vecs, at::diag_embed(vals)), vecs.transpose(1, 2));
    EXPECT(max_abs_diff(recon, a) < 1e-10, "batched_eigh(n=%ld) reconstruction err %g",
           static_cast<long>(n), max_abs_diff(recon, a));
    EXPECT(vecs.is_contiguous(), "batched_eigh eigenvectors must be contiguous");
    EXPECT((vals.narrow(1, 1, n - 1) >= vals.narrow(1, 0, n - 1)).all().item<bool>(),
           "batched_eigh eigenvalues not ascending");
  }
}

void test_dispatcher_and_errors() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("kaisa::covariance", "")
                .typed<at::Tensor(const at::Tensor&, double, bool)>();
  const at::Tensor x = at::randn({20, 4}, at::kDouble);
  EXPECT(max_abs_diff(op.call(x, 1.0, true), loop_covariance(x, 1.0, true)) < 1e-10,
         "dispatcher covariance mismatch");

  auto expect_throw = [](const std::function<void()>& fn, const std::string& needle) {
    bool thrown = false;
    try {
      fn();
    } catch (const c10::Error& e) {
      thrown = std::string(e.what()).find(needle) != std::string::npos;
      if (!thrown) {
        std::printf("unexpected message: %s\n", e.what());
      }
    }
    EXPECT(thrown, "expected an error containing '%s'", needle.c_str());
  };
  expect_throw([] { kaisa::cpu::covariance(at::randn({3}), 1.0, false); }, "x must be 2-D");
  expect_throw(
      [] {
        kaisa::cpu::conv_covariance(at::randn({1, 4, 5, 5}), {3, 3}, {1, 1}, {1, 1}, {1, 1}, 3,
                                    false, 1.0);
      },
      "groups");
  expect_throw(
      [] {
        kaisa::cpu::eigen_precondition(at::randn({3, 4}), at::eye(4), at::eye(3), {}, {}, {},
                                       0.0);
      },
      "one of (da, dg) or dgda");
  expect_throw([] { kaisa::cpu::batched_eigh(at::randn({2, 3, 4})); }, "square");
  expect_throw([] { kaisa::cpu::batched_eigh(at::randn({4, 2, 3, 3})); }, "(B, n, n)");
}

}  // namespace

int main() {
  at::manual_seed(0);
  test_covariance();
  test_conv_covariance();
  test_eigen_precondition();
  test_batched_eigh();
  test_dispatcher_and_errors();
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
