// CPU kernels of the K-FAC factor ops: covariance and conv_covariance.
//
// All of them reduce to a SYRK, C += alpha * M^T M, over a (rows, d) matrix M:
//  * only the upper-triangle blocks of an nb x nb block grid are computed
//    (nb (nb + 1) / 2 of nb^2 GEMMs, ~58% of the flops for d = 576), then the
//    upper triangle is mirrored so the result is exactly symmetric;
//  * the block GEMMs are at::addmm_ on views of the accumulator (BLAS writes
//    straight into it, no temporaries), run as independent single-threaded
//    tasks of one at::parallel_for region (one synchronisation per tile rather
//    than one per GEMM, which matters on small or contended machines);
//  * the bias column is never materialised: it is the column sums of M and
//    the row count;
//  * accumulation is in float32 (float64 for double inputs).
// conv_covariance unfolds tiles of output rows (kTileBytes of patches at a
// time) into one reused buffer with a parallel im2col and feeds each tile to the
// SYRK, so the whole patch matrix is never materialised. 1x1 / stride 1 /
// padding 0 convolutions use the input itself as the patch matrix.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../kaisa.h"

namespace kaisa::cpu {
namespace {

// Minimum block size of the upper-triangle SYRK (columns).
constexpr int64_t kBlock = 96;
// Block boundaries are rounded to multiples of this (SIMD width friendly).
constexpr int64_t kAlign = 16;
// Target size of the im2col / dtype-conversion buffer.
constexpr int64_t kTileBytes = int64_t{8} << 20;
// Minimum number of patch rows per tile (GEMM efficiency).
constexpr int64_t kMinTileRows = 512;
// Groups with fewer columns than this are handled by one batched GEMM.
constexpr int64_t kSmallGroup = 64;

// True if a 2-D matrix can be handed to BLAS without a copy.
bool blas_compatible(const at::Tensor& m) {
  const int64_t r = m.size(0);
  const int64_t c = m.size(1);
  return (m.stride(1) == 1 && m.stride(0) >= std::max<int64_t>(c, 1)) ||
         (m.stride(0) == 1 && m.stride(1) >= std::max<int64_t>(r, 1));
}

// Block size of the upper-triangle SYRK for a factor of dimension d.
int64_t syrk_block(int64_t d) {
  const int64_t target = std::max(kBlock, d / 16);
  const int64_t nb = (d + target - 1) / target;
  const int64_t bs = (d + nb - 1) / nb;
  return (bs + kAlign - 1) / kAlign * kAlign;
}

// For every group k: acc[k] (upper blocks) += alpha * M_k^T M_k with
// M_k = m[:, k*dg:(k+1)*dg]. The upper-triangle block GEMMs write disjoint
// parts of acc, so they run as independent tasks of one parallel region, each
// a single-threaded BLAS call (BLAS does not nest inside at::parallel_for):
// one synchronisation per call instead of one per GEMM.
void syrk_upper(const at::Tensor& acc, const at::Tensor& m, int64_t groups, int64_t dg,
                double alpha) {
  if (dg <= 0 || groups <= 0) {
    return;
  }
  const int64_t bs = syrk_block(dg);
  const int64_t nb = (dg + bs - 1) / bs;
  struct Block {
    int64_t k, i, j;
  };
  std::vector<Block> blocks;
  blocks.reserve(static_cast<size_t>(groups * nb * (nb + 1) / 2));
  for (int64_t k = 0; k < groups; ++k) {
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t j = i; j < nb; ++j) {
        blocks.push_back({k, i, j});
      }
    }
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Block& blk = blocks[static_cast<size_t>(b)];
      const int64_t i0 = blk.i * bs;
      const int64_t j0 = blk.j * bs;
      const int64_t ni = std::min(bs, dg - i0);
      const int64_t nj = std::min(bs, dg - j0);
      const at::Tensor mk = m.narrow(1, blk.k * dg, dg);
      at::Tensor out = acc.select(0, blk.k).narrow(0, i0, ni).narrow(1, j0, nj);
      out.addmm_(mk.narrow(1, i0, ni).t(), mk.narrow(1, j0, nj), 1.0, alpha);
    }
  });
}

// acc: (groups, d, d) in the accumulation dtype, d = dg + bias. m: (rows,
// groups * dg) in the accumulation dtype. Adds alpha * Mb_k^T Mb_k (upper
// blocks, plus the bias row/column when `bias`) for every group k.
// `colsums` (groups * dg values), when defined, are the precomputed column sums
// of m; otherwise they are computed here.
void accumulate_groups(const at::Tensor& acc, const at::Tensor& m, int64_t groups, int64_t dg,
                       bool bias, double alpha, const at::Tensor& colsums = at::Tensor()) {
  const int64_t rows = m.size(0);
  if (rows == 0) {
    return;
  }
  if (groups > 1 && dg < kSmallGroup) {
    const at::Tensor mg = m.unflatten(1, {groups, dg}).permute({1, 2, 0});  // (g, dg, rows)
    const at::Tensor prod = at::bmm(mg, mg.transpose(1, 2));
    acc.narrow(1, 0, dg).narrow(2, 0, dg).add_(prod, alpha);
  } else {
    syrk_upper(acc, m, groups, dg, alpha);
  }
  if (bias) {
    const at::Tensor sums = (colsums.defined() ? colsums : m.sum(0)).view({groups, dg});
    acc.narrow(1, 0, dg).select(2, dg).add_(sums, alpha);
    acc.select(1, dg).select(1, dg).add_(alpha * static_cast<double>(rows));
  }
}

// Copies the upper triangle of each (d, d) matrix of a contiguous (..., d, d)
// tensor onto its lower triangle (cache-blocked).
void mirror_upper_(const at::Tensor& a) {
  TORCH_INTERNAL_ASSERT(a.is_contiguous());
  const int64_t d = a.size(-1);
  if (d == 0) {
    return;
  }
  const int64_t count = a.numel() / (d * d);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "kaisa_mirror_upper", [&] {
    scalar_t* base = a.data_ptr<scalar_t>();
    constexpr int64_t kB = 32;
    at::parallel_for(0, count, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        scalar_t* p = base + b * d * d;
        for (int64_t ib = 0; ib < d; ib += kB) {
          const int64_t ie = std::min(ib + kB, d);
          for (int64_t jb = 0; jb <= ib; jb += kB) {
            for (int64_t i = ib; i < ie; ++i) {
              const int64_t je = std::min(jb + kB, i);
              for (int64_t j = jb; j < je; ++j) {
                p[i * d + j] = p[j * d + i];
              }
            }
          }
        }
      }
    });
  });
}

// ---------------------------------------------------------------------------
// covariance
// ---------------------------------------------------------------------------

// acc (1, d, d) contiguous accumulator; adds alpha * Xb^T Xb (upper blocks).
void covariance_accumulate(const at::Tensor& acc, const at::Tensor& x, bool bias, double alpha) {
  const int64_t rows = x.size(0);
  const int64_t dx = x.size(1);
  if (rows == 0) {
    return;
  }
  if (x.scalar_type() == acc.scalar_type() && blas_compatible(x)) {
    accumulate_groups(acc, x, 1, dx, bias, alpha);
    return;
  }
  // Convert (or densify) row tiles into a reused buffer.
  const int64_t esize = static_cast<int64_t>(c10::elementSize(acc.scalar_type()));
  const int64_t tile =
      std::min(rows, std::max(kMinTileRows, kTileBytes / std::max<int64_t>(dx * esize, 1)));
  at::Tensor buf = at::empty({tile, dx}, acc.options());
  for (int64_t r0 = 0; r0 < rows; r0 += tile) {
    const int64_t t = std::min(tile, rows - r0);
    at::Tensor b = buf.narrow(0, 0, t);
    b.copy_(x.narrow(0, r0, t));
    accumulate_groups(acc, b, 1, dx, bias, alpha);
  }
}

// ---------------------------------------------------------------------------
// conv_covariance
// ---------------------------------------------------------------------------

struct ConvGeometry {
  int64_t n, c, h, w;
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t oh, ow;
  int64_t groups;
};

ConvGeometry make_geometry(const at::Tensor& x, at::IntArrayRef ks, at::IntArrayRef st,
                           at::IntArrayRef pd, at::IntArrayRef dl, int64_t groups) {
  ConvGeometry g{};
  g.n = x.size(0);
  g.c = x.size(1);
  g.h = x.size(2);
  g.w = x.size(3);
  g.kh = ks[0];
  g.kw = ks[1];
  g.sh = st[0];
  g.sw = st[1];
  g.ph = pd[0];
  g.pw = pd[1];
  g.dh = dl[0];
  g.dw = dl[1];
  g.oh = conv_out_size(g.h, g.kh, g.sh, g.ph, g.dh);
  g.ow = conv_out_size(g.w, g.kw, g.sw, g.pw, g.dw);
  g.groups = groups;
  return g;
}

// Writes the transposed patch matrix of output rows [unit0, unit0 + units)
// (a unit is one output row (n, oh) of `ow` patches) into out, a row-major
// (C * kh * kw, units * ow) buffer: out[(c, ki, kj), (u, o)]. When `sums` is
// not null, sums[r] receives the sum of row r (the bias column of the factor).
template <typename src_t, typename acc_t>
void im2col_tile(const src_t* x, const int64_t* xs, const ConvGeometry& g, int64_t unit0,
                 int64_t units, acc_t* out, acc_t* sums) {
  const int64_t t = units * g.ow;
  const int64_t khw = g.kh * g.kw;
  const int64_t rows = g.c * khw;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(t, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t c = r / khw;
      const int64_t ki = (r / g.kw) % g.kh;
      const int64_t kj = r % g.kw;
      const int64_t off_w = kj * g.dw - g.pw;  // iw = o * sw + off_w
      int64_t o_lo = off_w >= 0 ? 0 : (-off_w + g.sw - 1) / g.sw;
      int64_t o_hi = (g.w - 1 - off_w) < 0 ? 0 : (g.w - 1 - off_w) / g.sw + 1;
      o_lo = std::min(o_lo, g.ow);
      o_hi = std::max(o_lo, std::min(o_hi, g.ow));
      acc_t* dst_row = out + r * t;
      for (int64_t u = 0; u < units; ++u) {
        const int64_t unit = unit0 + u;
        const int64_t img = unit / g.oh;
        const int64_t orow = unit % g.oh;
        const int64_t ih = orow * g.sh - g.ph + ki * g.dh;
        acc_t* dst = dst_row + u * g.ow;
        if (ih < 0 || ih >= g.h) {
          std::fill(dst, dst + g.ow, acc_t(0));
          continue;
        }
        const src_t* src = x + img * xs[0] + c * xs[1] + ih * xs[2] + off_w * xs[3];
        std::fill(dst, dst + o_lo, acc_t(0));
        const int64_t step = g.sw * xs[3];
        if (step == 1) {
          for (int64_t o = o_lo; o < o_hi; ++o) {
            dst[o] = static_cast<acc_t>(src[o]);
          }
        } else {
          for (int64_t o = o_lo; o < o_hi; ++o) {
            dst[o] = static_cast<acc_t>(src[o * step]);
          }
        }
        std::fill(dst + o_hi, dst + g.ow, acc_t(0));
      }
      if (sums != nullptr) {
        double total = 0;
        for (int64_t i = 0; i < t; ++i) {
          total += static_cast<double>(dst_row[i]);
        }
        sums[r] = static_cast<acc_t>(total);
      }
    }
  });
}

// Runs process(tile, buffer) for tile = 0 .. tiles - 1 with one reused buffer
// of buffer_numel elements (accumulation dtype).
template <typename Fn>
void run_tiles(const at::Tensor& acc, int64_t tiles, int64_t buffer_numel, const Fn& process) {
  if (tiles <= 0) {
    return;
  }
  at::Tensor buf = at::empty({std::max<int64_t>(buffer_numel, 1)}, acc.options());
  for (int64_t t = 0; t < tiles; ++t) {
    process(t, buf);
  }
}

// acc: contiguous (groups, d, d) accumulator. Adds alpha * Pb_k^T Pb_k (upper
// blocks) for every group.
void conv_accumulate(const at::Tensor& acc, const at::Tensor& x, const ConvGeometry& g,
                     bool bias, double alpha) {
  const int64_t total_units = g.n * g.oh;
  if (total_units == 0 || g.ow == 0) {
    return;
  }
  const int64_t dtot = g.c * g.kh * g.kw;
  const int64_t dg = dtot / g.groups;
  if (dtot == 0) {  // no channels: only the bias entry is non-zero
    if (bias) {
      acc.select(1, 0).select(1, 0).add_(alpha * static_cast<double>(total_units * g.ow));
    }
    return;
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(acc.scalar_type()));
  const bool pointwise = g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 &&
                         g.pw == 0;
  if (pointwise && x.scalar_type() == acc.scalar_type()) {
    // The patch matrix is the input itself: (N * H * W, C).
    if (x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
      accumulate_groups(acc, x.permute({0, 2, 3, 1}).view({g.n * g.h * g.w, g.c}), g.groups, dg,
                        bias, alpha);
      return;
    }
    if (x.stride(3) == 1 && x.stride(2) == g.w && g.h * g.w >= kMinTileRows) {
      run_tiles(acc, g.n, 0, [&](int64_t i, const at::Tensor& /*buf*/) {
        const at::Tensor m = x.select(0, i).flatten(1).t();  // (H * W, C)
        accumulate_groups(acc, m, g.groups, dg, bias, alpha);
      });
      return;
    }
  }
  const int64_t target_rows = std::max(kMinTileRows, kTileBytes / (dtot * esize));
  const int64_t units_per_tile =
      std::min(total_units, std::max<int64_t>(1, target_rows / g.ow));
  const int64_t tiles = (total_units + units_per_tile - 1) / units_per_tile;
  const int64_t xs[4] = {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
  const bool acc_double = acc.scalar_type() == at::kDouble;
  const int64_t buf_numel = dtot * units_per_tile * g.ow;
  run_tiles(acc, tiles, buf_numel + (bias ? dtot : 0),
            [&](int64_t tile, const at::Tensor& buf) {
              const int64_t u0 = tile * units_per_tile;
              const int64_t units = std::min(units_per_tile, total_units - u0);
              const int64_t t = units * g.ow;
              at::Tensor pt = buf.narrow(0, 0, dtot * t).view({dtot, t});
              at::Tensor sums = bias ? buf.narrow(0, buf_numel, dtot) : at::Tensor();
              AT_DISPATCH_FLOATING_TYPES_AND2(
                  at::kHalf, at::kBFloat16, x.scalar_type(), "kaisa_im2col", [&] {
                    if (acc_double) {
                      im2col_tile<scalar_t, double>(
                          x.const_data_ptr<scalar_t>(), xs, g, u0, units, pt.data_ptr<double>(),
                          bias ? sums.data_ptr<double>() : nullptr);
                    } else {
                      im2col_tile<scalar_t, float>(
                          x.const_data_ptr<scalar_t>(), xs, g, u0, units, pt.data_ptr<float>(),
                          bias ? sums.data_ptr<float>() : nullptr);
                    }
                  });
              accumulate_groups(acc, pt.t(), g.groups, dg, bias, alpha, sums);
            });
}

}  // namespace

at::Tensor covariance(const at::Tensor& x, double scale, bool bias) {
  check_device_type(x, c10::DeviceType::CPU, "covariance", "x");
  check_covariance_args(x);
  const int64_t d = x.size(1) + (bias ? 1 : 0);
  at::Tensor acc = at::zeros({1, d, d}, x.options().dtype(accumulate_dtype(x.scalar_type())));
  covariance_accumulate(acc, x, bias, scale);
  mirror_upper_(acc);
  return acc.squeeze(0).to(x.scalar_type());
}

at::Tensor conv_covariance(const at::Tensor& x, at::IntArrayRef kernel_size,
                           at::IntArrayRef stride, at::IntArrayRef padding,
                           at::IntArrayRef dilation, int64_t groups, bool bias, double scale) {
  check_device_type(x, c10::DeviceType::CPU, "conv_covariance", "x");
  check_conv_covariance_args(x, kernel_size, stride, padding, dilation, groups);
  const ConvGeometry g = make_geometry(x, kernel_size, stride, padding, dilation, groups);
  const int64_t d = g.c / groups * g.kh * g.kw + (bias ? 1 : 0);
  at::Tensor acc =
      at::zeros({groups, d, d}, x.options().dtype(accumulate_dtype(x.scalar_type())));
  conv_accumulate(acc, x, g, bias, scale);
  mirror_upper_(acc);
  return acc.to(x.scalar_type());
}

}  // namespace kaisa::cpu

TORCH_LIBRARY_IMPL(kaisa, CPU, m) {
  m.impl("covariance", &kaisa::cpu::covariance);
  m.impl("conv_covariance", &kaisa::cpu::conv_covariance);
}
