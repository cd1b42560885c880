// Fused (implicit-GEMM) covariance kernels for K-FAC factors.
//
//   covariance(x, scale, bias)            = scale * Xb^T Xb,        Xb = [x | 1]
//   conv_covariance(x, k, s, p, d, g, ...) = scale * Pb_k^T Pb_k,   per group k
//
// Pb is the im2col patch matrix exactly as F.unfold builds it (zero padding;
// columns: channel slowest, then kernel row, then kernel column; ones column
// last when bias). It is never materialised: each thread block owns one
// 64x64 tile of the (symmetric) output, only for tile pairs (bi <= bj), and
// gathers the patch elements it needs for a 32-row slab straight from the
// input into shared memory (converted to the accumulator type), then does a
// register-blocked 4x4 outer-product update. Rows are optionally split over
// gridDim.z ("split-K") when there are too few tiles to fill the GPU; each
// split writes its partial tile to a workspace and a second, tiled kernel sums
// the splits in a fixed order (deterministic), applies scale, casts
// to the output dtype and mirrors the upper tiles into the lower triangle
// (exactly symmetric result). Without a split there is no workspace and no
// second kernel: the tile kernel writes the scaled, cast tile and its mirror
// into the output.
//
// A second path computes the same result with cuBLAS GEMMs (tensor cores): the
// rows of P are processed in chunks, each chunk's patches packed (im2col) into a
// workspace and accumulated with cublasGemmEx (beta = 1 after the first chunk)
// into an fp32 / fp64 accumulator, which the finalize kernel scales, mirrors and
// casts. A cost model (CovarianceChoice) picks the path from the shapes, the dtype
// and torch's fp32 matmul precision; KAISA_COVARIANCE_IMPL=auto|fused|gemm forces
// one. See docs/cuda-kernels.md.
//
// Both paths guard against a sum that overflows before its scale (a finite result of
// a finite input; kaisa/ops/_overflow.py states the rule): when rows * max|x|^2 could
// reach the dtype's maximum, every element of P (the bias column too) is multiplied by
// sqrt(scale) as it is loaded or packed and the result by scale / sqrt(scale)^2
// instead of scale. The choice is read on the device from x's minimum and maximum
// (one aminmax before the kernels): no host synchronisation, no copy of x, and with
// no risk the factor 1 changes no bit.
#include "common.cuh"

#include <ATen/Context.h>
#include <ATen/ops/aminmax.h>
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>

namespace kaisa::cuda {
namespace {

constexpr int kTile = 64;                 // output tile edge (columns of P)
constexpr int kChunk = 32;                // rows of P per shared-memory slab
constexpr int kThreads = 256;             // 16 x 16 threads
constexpr int kThreadsPerDim = 16;        // kTile / kMicro
constexpr int kMicro = kTile / kThreadsPerDim;  // 4x4 outputs per thread
constexpr int kPad = 1;                   // smem padding: conflict-free column writes
constexpr int kMinChunksPerSplit = 8;     // >= 256 rows per split
constexpr int64_t kMaxWorkspaceBytes = int64_t{512} << 20;

// Column-descriptor sentinels.
constexpr int64_t kBiasColumn = -1;
constexpr int64_t kZeroColumn = -2;

static_assert(kMicro * kThreadsPerDim == kTile, "tile / micro-tile mismatch");
static_assert(kThreadsPerDim * kThreadsPerDim == kThreads, "block shape mismatch");
static_assert(kThreads % kChunk == 0 && kThreads % kTile == 0, "loader mapping");
static_assert((kChunk * kTile) % kThreads == 0, "loader mapping");

// Geometry of the implicit patch matrix P (rows x d). For the linear case
// only rows / d_data / bias are used and P = x (rows, d_data) row-major.
struct Geom {
  int64_t rows = 0;    // rows of P: N*Ho*Wo (conv) or x.size(0) (linear)
  int d = 0;           // columns of P including the bias column
  int d_data = 0;      // columns of P excluding the bias column
  bool bias = false;
  // conv only
  int C = 0, H = 0, W = 0, Cg = 0;
  int kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  int Ho = 1, Wo = 1;
};

// Tile-pair index -> (bi, bj), bi <= bj, row-major over the upper triangle.
__device__ __forceinline__ void decode_pair(int pair, int n_tiles, int& bi, int& bj) {
  int b = 0;
  int rem = pair;
  while (rem >= n_tiles - b) {
    rem -= n_tiles - b;
    ++b;
  }
  bi = b;
  bj = b + rem;
}

// The overflow guard of one call (see the top of the file): x's minimum and maximum
// (device scalars; null without a guard), the threshold of max|x| and sqrt(scale).
template <typename scalar_t, typename acc_t>
struct Guard {
  const scalar_t* lo = nullptr;
  const scalar_t* hi = nullptr;
  acc_t threshold = acc_t(0);
  acc_t root = acc_t(1);
};

// The factor every element of P is multiplied by: root when max|x| > threshold (an
// infinity included; a NaN compares false and stays in the factor), else 1.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t guard_factor(const Guard<scalar_t, acc_t>& q) {
  if (q.lo == nullptr) return acc_t(1);
  const acc_t top = to_acc<acc_t>(*q.hi);
  const acc_t bottom = -to_acc<acc_t>(*q.lo);
  return (top > q.threshold || bottom > q.threshold) ? q.root : acc_t(1);
}

// Partial (unscaled) Gram tiles. grid = (tile pairs, groups, splits).
// ws layout: [split][group][d][d]; only tiles (bi <= bj) are written.
// Without split-K (splits == 1, ws == nullptr) the block writes the finished
// tile instead: scale * acc cast to the output type (scale / f^2 under the
// overflow guard's factor f, by which every loaded element is multiplied), into `out` (groups, d, d)
// at (i, j) and, off the diagonal tiles, mirrored at (j, i) (a diagonal tile's
// (j, i) is its own element, bit-identical to (i, j), see below).
template <typename scalar_t, typename acc_t, bool kConv>
__global__ void __launch_bounds__(kThreads)
    gram_tile_kernel(const scalar_t* __restrict__ x, const Geom g, acc_t* __restrict__ ws,
                     scalar_t* __restrict__ direct, const acc_t scale,
                     const Guard<scalar_t, acc_t> guard, const int n_tiles,
                     const int64_t chunks_per_split) {
  __shared__ acc_t As[kChunk][kTile + kPad];
  __shared__ acc_t Bs[kChunk][kTile + kPad];
  // conv: per-column channel offset (or sentinel) and kernel-tap offsets for
  // the 2*kTile columns of the two tiles (A columns first, then B columns).
  __shared__ int64_t col_off[2 * kTile];
  __shared__ int col_dh[2 * kTile];
  __shared__ int col_dw[2 * kTile];
  // conv: per-row sample offset (-1: row past the end), top-left input pixel.
  __shared__ int64_t row_base[kChunk];
  __shared__ int row_h[kChunk];
  __shared__ int row_w[kChunk];

  const acc_t pre = guard_factor(guard);  // 1 but for a sum that could overflow
  const int tid = threadIdx.x;
  const int tx = tid % kThreadsPerDim;
  const int ty = tid / kThreadsPerDim;
  const int group = blockIdx.y;
  const int split = blockIdx.z;

  int bi, bj;
  decode_pair(blockIdx.x, n_tiles, bi, bj);
  const bool diag = bi == bj;
  const int i0 = bi * kTile;
  const int j0 = bj * kTile;

  const int64_t total_chunks = ceil_div<int64_t>(g.rows, kChunk);
  const int64_t c_begin = static_cast<int64_t>(split) * chunks_per_split;
  const int64_t c_end = std::min<int64_t>(c_begin + chunks_per_split, total_chunks);

  if constexpr (kConv) {
    if (tid < 2 * kTile) {
      const int c = tid < kTile ? i0 + tid : j0 + (tid - kTile);
      const int taps = g.kh * g.kw;
      int64_t off = kZeroColumn;
      int oh = 0, ow = 0;
      if (c < g.d_data) {
        const int ch = c / taps;
        const int t = c - ch * taps;
        const int ki = t / g.kw;
        const int kj = t - ki * g.kw;
        off = (static_cast<int64_t>(group) * g.Cg + ch) * g.H * g.W;
        oh = ki * g.dh;
        ow = kj * g.dw;
      } else if (g.bias && c == g.d_data) {
        off = kBiasColumn;
      }
      col_off[tid] = off;
      col_dh[tid] = oh;
      col_dw[tid] = ow;
    }
  }

  acc_t acc[kMicro][kMicro];
#pragma unroll
  for (int m = 0; m < kMicro; ++m) {
#pragma unroll
    for (int n = 0; n < kMicro; ++n) acc[m][n] = acc_t(0);
  }

  const int64_t CHW = static_cast<int64_t>(g.C) * g.H * g.W;
  const int64_t HoWo = static_cast<int64_t>(g.Ho) * g.Wo;

  for (int64_t chunk = c_begin; chunk < c_end; ++chunk) {
    const int64_t r0 = chunk * kChunk;
    if constexpr (kConv) {
      if (tid < kChunk) {
        const int64_t r = r0 + tid;
        if (r < g.rows) {
          const int64_t n = r / HoWo;
          const int64_t p = r - n * HoWo;
          const int oh = static_cast<int>(p / g.Wo);
          const int ow = static_cast<int>(p - static_cast<int64_t>(oh) * g.Wo);
          row_base[tid] = n * CHW;
          row_h[tid] = oh * g.sh - g.ph;
          row_w[tid] = ow * g.sw - g.pw;
        } else {
          row_base[tid] = -1;
          row_h[tid] = 0;
          row_w[tid] = 0;
        }
      }
      // Also orders this slab's smem writes after the previous slab's reads
      // (see the trailing __syncthreads) and the column set-up above.
      __syncthreads();
    }

    // Gather one operand slab: S[k][c] = P[r0 + k][col0 + c].
    auto load = [&](acc_t(*S)[kTile + kPad], const int col0, const int cdesc) {
      if constexpr (kConv) {
        // consecutive threads walk consecutive rows (output pixels): the
        // input reads are contiguous for stride 1 along the width.
#pragma unroll
        for (int it = 0; it < (kChunk * kTile) / kThreads; ++it) {
          const int k = tid % kChunk;
          const int c = tid / kChunk + it * (kThreads / kChunk);
          acc_t v = acc_t(0);
          const int64_t rb = row_base[k];
          if (rb >= 0) {
            const int64_t off = col_off[cdesc + c];
            if (off >= 0) {
              const int ih = row_h[k] + col_dh[cdesc + c];
              const int iw = row_w[k] + col_dw[cdesc + c];
              if (static_cast<unsigned>(ih) < static_cast<unsigned>(g.H) &&
                  static_cast<unsigned>(iw) < static_cast<unsigned>(g.W)) {
                v = to_acc<acc_t>(x[rb + off + static_cast<int64_t>(ih) * g.W + iw]) * pre;
              }
            } else if (off == kBiasColumn) {
              v = pre;
            }
          }
          S[k][c] = v;
        }
      } else {
        (void)cdesc;
        // consecutive threads walk consecutive columns of a row of x.
#pragma unroll
        for (int it = 0; it < (kChunk * kTile) / kThreads; ++it) {
          const int c = tid % kTile;
          const int k = tid / kTile + it * (kThreads / kTile);
          const int64_t r = r0 + k;
          const int col = col0 + c;
          acc_t v = acc_t(0);
          if (r < g.rows) {
            if (col < g.d_data) {
              v = to_acc<acc_t>(x[r * g.d_data + col]) * pre;
            } else if (g.bias && col == g.d_data) {
              v = pre;
            }
          }
          S[k][c] = v;
        }
      }
    };

    load(As, i0, 0);
    if (!diag) load(Bs, j0, kTile);
    __syncthreads();

    // Diagonal tiles reuse the A slab: acc[m][n] and its mirror are then the
    // same FMA sequence with swapped (commuting) operands, i.e. bit-identical.
    acc_t(*Bp)[kTile + kPad] = diag ? As : Bs;
#pragma unroll 8
    for (int k = 0; k < kChunk; ++k) {
      acc_t a[kMicro], b[kMicro];
#pragma unroll
      for (int m = 0; m < kMicro; ++m) a[m] = As[k][ty + m * kThreadsPerDim];
#pragma unroll
      for (int n = 0; n < kMicro; ++n) b[n] = Bp[k][tx + n * kThreadsPerDim];
#pragma unroll
      for (int m = 0; m < kMicro; ++m) {
#pragma unroll
        for (int n = 0; n < kMicro; ++n) acc[m][n] = fma(a[m], b[n], acc[m][n]);
      }
    }
    __syncthreads();
  }

  if (ws == nullptr) {
    const acc_t factor = scale / (pre * pre);  // scale itself when pre is 1
    scalar_t* o = direct + static_cast<int64_t>(group) * g.d * g.d;
#pragma unroll
    for (int m = 0; m < kMicro; ++m) {
      const int i = i0 + ty + m * kThreadsPerDim;
      if (i >= g.d) continue;
#pragma unroll
      for (int n = 0; n < kMicro; ++n) {
        const int j = j0 + tx + n * kThreadsPerDim;
        if (j >= g.d) continue;
        const scalar_t v = from_acc<scalar_t>(factor * acc[m][n]);
        o[static_cast<int64_t>(i) * g.d + j] = v;
        if (!diag) o[static_cast<int64_t>(j) * g.d + i] = v;
      }
    }
    return;
  }
  acc_t* out = ws + (static_cast<int64_t>(split) * gridDim.y + group) * g.d * g.d;
#pragma unroll
  for (int m = 0; m < kMicro; ++m) {
    const int i = i0 + ty + m * kThreadsPerDim;
    if (i >= g.d) continue;
#pragma unroll
    for (int n = 0; n < kMicro; ++n) {
      const int j = j0 + tx + n * kThreadsPerDim;
      if (j < g.d) out[static_cast<int64_t>(i) * g.d + j] = acc[m][n];
    }
  }
}

constexpr int kFinTile = 32;
constexpr int kFinRows = 8;  // block = 32 x 8 threads, 4 rows each

// out[g][i][j] = scale / f^2 * sum_s ws[s][g][min(i,j)][max(i,j)], f the guard's factor.
// grid = (ceil(d/32), ceil(d/32), groups); each block owns one 32x32 output
// tile and reads the mirrored source tile through shared memory so both the
// reads and the writes stay coalesced.
template <typename acc_t, typename out_t>
__global__ void __launch_bounds__(kFinTile* kFinRows)
    finalize_kernel(const acc_t* __restrict__ ws, out_t* __restrict__ out, const int d,
                    const int splits, const acc_t scale, const Guard<out_t, acc_t> guard) {
  __shared__ acc_t tile[kFinTile][kFinTile + 1];
  const acc_t pre = guard_factor(guard);
  const acc_t factor = scale / (pre * pre);
  const int groups = gridDim.z;
  const int group = blockIdx.z;
  const int ti = blockIdx.y;
  const int tj = blockIdx.x;
  const bool upper = ti <= tj;
  // source tile (in the computed upper region)
  const int si0 = (upper ? ti : tj) * kFinTile;
  const int sj0 = (upper ? tj : ti) * kFinTile;
  const int64_t dd = static_cast<int64_t>(d) * d;

  for (int r = threadIdx.y; r < kFinTile; r += kFinRows) {
    const int i = si0 + r;
    const int j = sj0 + threadIdx.x;
    acc_t s = acc_t(0);
    if (i < d && j < d) {
      const acc_t* p = ws + static_cast<int64_t>(group) * dd + static_cast<int64_t>(i) * d + j;
      for (int sp = 0; sp < splits; ++sp) s += p[static_cast<int64_t>(sp) * groups * dd];
    }
    tile[r][threadIdx.x] = s;
  }
  __syncthreads();

  out_t* o = out + static_cast<int64_t>(group) * dd;
  for (int r = threadIdx.y; r < kFinTile; r += kFinRows) {
    const int i = ti * kFinTile + r;
    const int j = tj * kFinTile + threadIdx.x;
    if (i >= d || j >= d) continue;
    // element (min(i,j), max(i,j)) in source-tile coordinates
    const int a = i <= j ? i : j;
    const int b = i <= j ? j : i;
    o[static_cast<int64_t>(i) * d + j] = from_acc<out_t>(factor * tile[a - si0][b - sj0]);
  }
}

// The overflow guard of one call, on the host: x's minimum and maximum (0-d tensors on
// x's device, undefined without a guard: an empty input, no rows, or a scale outside
// (0, 1)), the threshold sqrt(max / 4 / rows) of max|x| (max: x's dtype's largest
// value, a margin of 4 for rounding) and sqrt(scale).
struct Bounds {
  at::Tensor lo, hi;
  double threshold = 0;
  double root = 1;

  template <typename scalar_t, typename acc_t>
  Guard<scalar_t, acc_t> guard() const {
    Guard<scalar_t, acc_t> q;
    if (lo.defined()) {
      q.lo = lo.const_data_ptr<scalar_t>();
      q.hi = hi.const_data_ptr<scalar_t>();
      q.threshold = static_cast<acc_t>(threshold);
      q.root = static_cast<acc_t>(root);
    }
    return q;
  }
};

Bounds guard_bounds(const at::Tensor& x, int64_t rows, double scale) {
  Bounds b;
  if (x.numel() == 0 || rows == 0 || !(scale > 0.0 && scale < 1.0)) return b;
  double largest = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "kaisa_guard", [&] {
    largest = static_cast<double>(std::numeric_limits<scalar_t>::max());
  });
  b.threshold = std::sqrt(largest / 4.0 / static_cast<double>(rows));
  b.root = std::sqrt(scale);
  std::tie(b.lo, b.hi) = at::aminmax(x);
  return b;
}

// out (groups, d, d) = scale * (sum over the splits of ws[split][group]), its
// upper triangle mirrored, cast to out's dtype: the finalize kernel on the
// current stream (scale / f^2 under the guard's factor f). ws: (splits, groups, d, d),
// fp32 or fp64.
void launch_finalize(const at::Tensor& ws, const at::Tensor& out, int d, int groups, int splits,
                     double scale, const Bounds& bounds) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int ft = ceil_div(d, kFinTile);
  const dim3 fgrid(static_cast<unsigned>(ft), static_cast<unsigned>(ft),
                   static_cast<unsigned>(groups));
  const dim3 fblock(kFinTile, kFinRows);
  AT_DISPATCH_FLOATING_TYPES(ws.scalar_type(), "kaisa_gram_finalize_acc", [&] {
    using acc_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, out.scalar_type(), "kaisa_gram_finalize_out", [&] {
          using out_t = scalar_t;
          finalize_kernel<acc_t, out_t><<<fgrid, fblock, 0, stream>>>(
              ws.const_data_ptr<acc_t>(), out.mutable_data_ptr<out_t>(), d, splits,
              static_cast<acc_t>(scale), bounds.guard<out_t, acc_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
  });
}

// Runs the Gram kernel for x with geometry g over `groups` groups and writes
// the finished (groups, d, d) result scale * cov into `out` (contiguous, on
// x's device).
void gram_into(const at::Tensor& x, const Geom& g, int groups, double scale, bool conv,
               const Bounds& bounds, const at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.scalar_type() == x.scalar_type());
  if (g.d == 0 || groups == 0) return;
  TORCH_CHECK(groups <= 65535, "kaisa: at most 65535 groups are supported, got ", groups);
  const int n_tiles = ceil_div(g.d, kTile);
  const int64_t pairs = static_cast<int64_t>(n_tiles) * (n_tiles + 1) / 2;
  const int64_t total_chunks = ceil_div<int64_t>(g.rows, kChunk);
  const bool dbl = x.scalar_type() == at::kDouble;
  const int64_t acc_bytes = dbl ? 8 : 4;
  const int64_t slab_bytes = static_cast<int64_t>(groups) * g.d * g.d * acc_bytes;

  // Split rows over gridDim.z until ~4 blocks per SM exist, keeping >= 256
  // rows per split and the workspace bounded.
  const int64_t blocks = pairs * groups;
  const int64_t target = 4 * static_cast<int64_t>(sm_count());
  int64_t splits = std::max<int64_t>(1, ceil_div<int64_t>(target, blocks));
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, total_chunks / kMinChunksPerSplit));
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, kMaxWorkspaceBytes / slab_bytes));
  splits = std::min<int64_t>(splits, 65535);
  int64_t chunks_per_split = ceil_div<int64_t>(total_chunks, splits);
  if (chunks_per_split > 0) splits = ceil_div<int64_t>(total_chunks, chunks_per_split);
  splits = std::max<int64_t>(splits, 1);

  // The fp32 / fp64 workspace of the partial tiles only when the rows are split;
  // otherwise the tile kernel writes the finished result (no finalize kernel).
  at::Tensor ws;
  if (splits > 1) {
    ws = at::empty({splits, groups, g.d, g.d}, x.options().dtype(dbl ? at::kDouble : at::kFloat));
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(pairs), static_cast<unsigned>(groups),
                  static_cast<unsigned>(splits));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "kaisa_gram_tile", [&] {
        using acc_t = acc_type_t<scalar_t>;
        acc_t* partial = ws.defined() ? ws.mutable_data_ptr<acc_t>() : nullptr;
        scalar_t* direct = ws.defined() ? nullptr : out.mutable_data_ptr<scalar_t>();
        const auto s = static_cast<acc_t>(scale);
        const auto q = bounds.guard<scalar_t, acc_t>();
        if (conv) {
          gram_tile_kernel<scalar_t, acc_t, true><<<grid, kThreads, 0, stream>>>(
              x.const_data_ptr<scalar_t>(), g, partial, direct, s, q, n_tiles,
              chunks_per_split);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        } else {
          gram_tile_kernel<scalar_t, acc_t, false><<<grid, kThreads, 0, stream>>>(
              x.const_data_ptr<scalar_t>(), g, partial, direct, s, q, n_tiles,
              chunks_per_split);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
  if (!ws.defined()) return;
  launch_finalize(ws, out, g.d, groups, static_cast<int>(splits), scale, bounds);
}

// ------------------------------------------------------------ GEMM path --
//
// cov = scale * sum over row chunks c of P_c^T P_c. A chunk of at most
// `chunk_rows` rows of P (one group's columns, bias column included) is packed
// row-major into a workspace of the input dtype (pack_patches_kernel: the
// im2col of those rows, or the rows of x plus a ones column), then
//   acc (d x d, fp32 / fp64) = P_c^T P_c + beta * acc,  beta = 0 for the first
//   chunk and 1 after,
// with one cublasGemmEx: the row-major chunk (rows x d) is the column-major
// d x rows matrix M (ld d), and M M^T (CUBLAS_OP_N, CUBLAS_OP_T) is P_c^T P_c. The
// linear op without bias needs no packing: x itself is P (A = B = x + r0 * d).
// The finalize kernel (one split) then scales, mirrors the upper triangle
// (exact symmetry: cuBLAS gives no bitwise-symmetric product) and casts.
//
// Memory: the accumulator (groups * d * d * 4 or 8 bytes) plus one chunk buffer
// (chunk_rows * d * element size) stay within kMaxWorkspaceBytes, the bound of the
// fused kernel's split-K workspace; the path is not taken when the accumulator and
// kGemmRowAlign rows do not fit.

constexpr int kPackThreads = 256;
constexpr int64_t kGemmRowAlign = 32;  // chunk rows are a multiple of this (but the last)

// P_c[rl][c] = f * P[r0 + rl][c] of group `group`, row-major (nrows x d), c fastest
// (coalesced writes), f the overflow guard's factor (1 but for a sum that could
// overflow); the bias column holds f.
template <typename scalar_t, bool kConv>
__global__ void __launch_bounds__(kPackThreads)
    pack_patches_kernel(const scalar_t* __restrict__ x, const Geom g, const int group,
                        const int64_t r0, const int64_t nrows, scalar_t* __restrict__ P,
                        const Guard<scalar_t, acc_type_t<scalar_t>> guard) {
  using acc_t = acc_type_t<scalar_t>;
  const acc_t pre = guard_factor(guard);
  const int64_t total = nrows * g.d;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rl = e / g.d;
    const int c = static_cast<int>(e - rl * g.d);
    const int64_t r = r0 + rl;
    scalar_t v = static_cast<scalar_t>(0.0f);
    if (c >= g.d_data) {
      v = static_cast<scalar_t>(1.0f);  // the bias column (the only one past the data)
    } else if constexpr (kConv) {
      const int64_t HoWo = static_cast<int64_t>(g.Ho) * g.Wo;
      const int64_t n = r / HoWo;
      const int64_t p = r - n * HoWo;
      const int oh = static_cast<int>(p / g.Wo);
      const int ow = static_cast<int>(p - static_cast<int64_t>(oh) * g.Wo);
      const int taps = g.kh * g.kw;
      const int ch = c / taps;
      const int t = c - ch * taps;
      const int ki = t / g.kw;
      const int kj = t - ki * g.kw;
      const int ih = oh * g.sh - g.ph + ki * g.dh;
      const int iw = ow * g.sw - g.pw + kj * g.dw;
      if (static_cast<unsigned>(ih) < static_cast<unsigned>(g.H) &&
          static_cast<unsigned>(iw) < static_cast<unsigned>(g.W)) {
        v = x[n * g.C * static_cast<int64_t>(g.H) * g.W +
              (static_cast<int64_t>(group) * g.Cg + ch) * g.H * g.W +
              static_cast<int64_t>(ih) * g.W + iw];
      }
    } else {
      v = x[r * g.d_data + c];
    }
    P[e] = pre == acc_t(1) ? v : static_cast<scalar_t>(to_acc<acc_t>(v) * pre);
  }
}

enum class CovImpl { kAuto, kFused, kGemm };

CovImpl requested_cov_impl() {
  const char* env = std::getenv("KAISA_COVARIANCE_IMPL");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return CovImpl::kAuto;
  if (std::strcmp(env, "fused") == 0) return CovImpl::kFused;
  if (std::strcmp(env, "gemm") == 0) return CovImpl::kGemm;
  TORCH_CHECK(false, "kaisa: KAISA_COVARIANCE_IMPL must be auto, fused or gemm, got '", env,
              "'");
}

// The fp32 GEMM math torch's float32_matmul_precision allows ("highest": IEEE fp32,
// "high": TF32, "medium": TF32 as torch maps it, or bf16 where set explicitly).
cublasComputeType_t fp32_compute_type() {
  const at::Float32Precision p =
      at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL);
  if (p == at::Float32Precision::TF32) return CUBLAS_COMPUTE_32F_FAST_TF32;
  if (p == at::Float32Precision::BF16) return CUBLAS_COMPUTE_32F_FAST_16BF;
  return CUBLAS_COMPUTE_32F;
}

// The GEMM path's rows per chunk: as many as the memory bound allows (a multiple of
// kGemmRowAlign unless all rows fit), at most INT_MAX (cuBLAS's k) and at most
// KAISA_COVARIANCE_GEMM_ROWS when set (it lowers the chunk, never raises it); 0 when
// the path does not fit the bound.
int64_t gemm_chunk_rows(const Geom& g, int groups, bool pack, at::ScalarType st) {
  const int64_t acc_bytes = st == at::kDouble ? 8 : 4;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(st));
  const int64_t acc_total = static_cast<int64_t>(groups) * g.d * g.d * acc_bytes;
  if (acc_total > kMaxWorkspaceBytes) return 0;
  int64_t rows = std::min<int64_t>(std::max<int64_t>(g.rows, 1),
                                   std::numeric_limits<int>::max());
  if (pack) {
    const int64_t fit = (kMaxWorkspaceBytes - acc_total) / (static_cast<int64_t>(g.d) * elem);
    if (fit < std::min<int64_t>(kGemmRowAlign, rows)) return 0;
    rows = std::min(rows, fit);
  }
  const char* env = std::getenv("KAISA_COVARIANCE_GEMM_ROWS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(env, &end, 10);
    TORCH_CHECK(*end == '\0' && v > 0, "kaisa: KAISA_COVARIANCE_GEMM_ROWS must be a positive ",
                "integer, got '", env, "'");
    return std::min<int64_t>(rows, v);
  }
  if (rows < g.rows && rows >= kGemmRowAlign) rows -= rows % kGemmRowAlign;
  return rows;
}

// Cost model: estimated seconds of each path on an H100 SXM, from its datasheet
// peaks (dense) and efficiencies fitted to one H100 run's forced-path timings of
// ResNet-50's convolutions and linear shapes (bench/gpu/fit_cost_model.py; the fit
// picks the faster path on 63 of 79 shapes, the datasheet guesses on 49).
// docs/cuda-kernels.md gives the arithmetic and the measurements.
constexpr double kSimtFp32 = 67e12;    // FP32 FMA units, flop/s
constexpr double kSimtFp64 = 34e12;    // FP64 FMA units
constexpr double kTensorTf32 = 495e12;
constexpr double kTensor16 = 990e12;   // fp16 / bf16 inputs, fp32 accumulation
constexpr double kTensorFp64 = 67e12;
constexpr double kHbm = 3.35e12;       // bytes/s
constexpr double kFusedEfficiency = 0.2;      // of the SIMT peak (measured 0.06-0.3)
constexpr double kGemmEfficiencyIeee = 0.7;   // cuBLAS fp32 on the FMA units (measured)
constexpr double kGemmEfficiencyTf32 = 0.3;   // of the TF32 tensor peak (measured)
constexpr double kGemmEfficiency16 = 0.25;    // of the 16-bit tensor peak (measured)
constexpr double kGemmEfficiencyFp64 = 0.6;   // not measured
constexpr double kBandwidthEfficiency = 0.8;
constexpr double kLaunchSeconds = 25e-6;  // per call: launch, workspace, host overhead (fitted)

struct CovarianceChoice {
  bool gemm = false;
  int64_t chunk_rows = 0;
  bool pack = false;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  double fused_seconds = 0;
  double gemm_seconds = 0;
};

CovarianceChoice choose_covariance(const Geom& g, int groups, bool conv, at::ScalarType st,
                                   bool guarded) {
  CovarianceChoice c;
  c.pack = conv || g.bias || guarded;  // the guard's factor is applied as rows are packed
  c.compute = st == at::kDouble  ? CUBLAS_COMPUTE_64F
              : st == at::kFloat ? fp32_compute_type()
                                 : CUBLAS_COMPUTE_32F;
  const CovImpl impl = requested_cov_impl();
  if (impl == CovImpl::kFused || g.d == 0 || groups == 0) return c;
  c.chunk_rows = gemm_chunk_rows(g, groups, c.pack, st);
  if (c.chunk_rows == 0) return c;  // over the memory bound: the fused kernel
  if (impl == CovImpl::kGemm) {
    c.gemm = true;
    return c;
  }
  const double rows = static_cast<double>(g.rows);
  const double d = g.d;
  const double n_tiles = ceil_div(g.d, kTile);
  const double pairs = n_tiles * (n_tiles + 1) / 2;
  const double simt = st == at::kDouble ? kSimtFp64 : kSimtFp32;
  c.fused_seconds = 2 * rows * pairs * kTile * kTile * groups / (kFusedEfficiency * simt) +
                    kLaunchSeconds;
  double peak = kGemmEfficiencyIeee * kSimtFp32;  // cuBLAS fp32 without TF32: FMA units
  if (st == at::kDouble) {
    peak = kGemmEfficiencyFp64 * kTensorFp64;
  } else if (st != at::kFloat || c.compute == CUBLAS_COMPUTE_32F_FAST_16BF) {
    peak = kGemmEfficiency16 * kTensor16;
  } else if (c.compute == CUBLAS_COMPUTE_32F_FAST_TF32) {
    peak = kGemmEfficiencyTf32 * kTensorTf32;
  }
  const double chunks = std::ceil(rows / static_cast<double>(c.chunk_rows));
  const double elem = static_cast<double>(c10::elementSize(st));
  c.gemm_seconds = 2 * rows * d * d * groups / peak +
                   (c.pack ? 2 * rows * d * elem * groups / (kBandwidthEfficiency * kHbm) : 0) +
                   chunks * groups * (c.pack ? 2 : 1) * kLaunchSeconds + kLaunchSeconds;
  c.gemm = c.gemm_seconds < c.fused_seconds;
  return c;
}

cudaDataType cuda_type(at::ScalarType st) {
  switch (st) {
    case at::kDouble: return CUDA_R_64F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// The GEMM path (see above) into `out` (groups, d, d), on the current stream.
void gemm_covariance_into(const at::Tensor& x, const Geom& g, int groups, double scale,
                          bool conv, const CovarianceChoice& c, const Bounds& bounds,
                          const at::Tensor& out) {
  const bool dbl = x.scalar_type() == at::kDouble;
  const auto acc_options = x.options().dtype(dbl ? at::kDouble : at::kFloat);
  at::Tensor acc = g.rows == 0 ? at::zeros({1, groups, g.d, g.d}, acc_options)
                               : at::empty({1, groups, g.d, g.d}, acc_options);
  at::Tensor packed;
  if (c.pack && g.rows > 0) {
    packed = at::empty({std::min(c.chunk_rows, g.rows), g.d}, x.options());
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const cudaDataType ab_type = cuda_type(x.scalar_type());
  const cudaDataType c_type = dbl ? CUDA_R_64F : CUDA_R_32F;
  const int64_t dd = static_cast<int64_t>(g.d) * g.d;
  const int max_blocks = sm_count() * 8;

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "kaisa_covariance_gemm", [&] {
        using acc_t = acc_type_t<scalar_t>;
        const acc_t one = acc_t(1);
        const acc_t zero = acc_t(0);
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const auto q = bounds.guard<scalar_t, acc_t>();
        for (int group = 0; group < groups; ++group) {
          acc_t* cp = acc.mutable_data_ptr<acc_t>() + group * dd;
          for (int64_t r0 = 0; r0 < g.rows; r0 += c.chunk_rows) {
            const int64_t nrows = std::min(c.chunk_rows, g.rows - r0);
            const scalar_t* a = xp + r0 * g.d_data;
            if (c.pack) {
              scalar_t* pp = packed.mutable_data_ptr<scalar_t>();
              const int blocks = static_cast<int>(std::max<int64_t>(
                  1, std::min<int64_t>(ceil_div<int64_t>(nrows * g.d, kPackThreads),
                                       max_blocks)));
              if (conv) {
                pack_patches_kernel<scalar_t, true><<<blocks, kPackThreads, 0, stream>>>(
                    xp, g, group, r0, nrows, pp, q);
              } else {
                pack_patches_kernel<scalar_t, false><<<blocks, kPackThreads, 0, stream>>>(
                    xp, g, group, r0, nrows, pp, q);
              }
              C10_CUDA_KERNEL_LAUNCH_CHECK();
              a = pp;
            }
            const acc_t* beta = r0 == 0 ? &zero : &one;
            TORCH_CUDABLAS_CHECK(cublasGemmEx(
                handle, CUBLAS_OP_N, CUBLAS_OP_T, g.d, g.d, static_cast<int>(nrows), &one, a,
                ab_type, g.d, a, ab_type, g.d, beta, cp, c_type, g.d, c.compute,
                CUBLAS_GEMM_DEFAULT));
          }
        }
      });
  launch_finalize(acc, out, g.d, groups, 1, scale, bounds);
}

// scale * P^T P per group into `out`: the fused kernel or the GEMM path, as the
// cost model (or KAISA_COVARIANCE_IMPL) chooses.
void covariance_into(const at::Tensor& x, const Geom& g, int groups, double scale, bool conv,
                     const at::Tensor& out) {
  if (g.d == 0 || groups == 0) return;
  TORCH_CHECK(groups <= 65535, "kaisa: at most 65535 groups are supported, got ", groups);
  const Bounds bounds = guard_bounds(x, g.rows, scale);
  const CovarianceChoice c =
      choose_covariance(g, groups, conv, x.scalar_type(), bounds.lo.defined());
  if (c.gemm) {
    gemm_covariance_into(x, g, groups, scale, conv, c, bounds, out);
  } else {
    gram_into(x, g, groups, scale, conv, bounds, out);
  }
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "kaisa: ", what,
              " out of range: ", v);
  return static_cast<int>(v);
}

// ---------------------------------------------------------------- linear --

Geom linear_geom(const at::Tensor& x, bool bias) {
  Geom g;
  g.d_data = checked_int(x.size(1), "feature dimension");
  g.rows = x.size(0);
  g.bias = bias;
  g.d = checked_int(static_cast<int64_t>(g.d_data) + (bias ? 1 : 0), "covariance size");
  return g;
}

at::Tensor covariance_cuda(const at::Tensor& x, double scale, bool bias) {
  check_device_type(x, c10::DeviceType::CUDA, "covariance", "x");
  check_covariance_args(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const Geom g = linear_geom(xc, bias);
  at::Tensor out = at::empty({g.d, g.d}, xc.options());
  covariance_into(xc, g, 1, scale, /*conv=*/false, out);
  return out;
}

// ------------------------------------------------------------------ conv --

// Geometry of a conv input already validated by check_conv_covariance_args.
Geom conv_geom(const at::Tensor& x, at::IntArrayRef kernel_size, at::IntArrayRef stride,
               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool bias) {
  Geom g;
  g.C = checked_int(x.size(1), "channels");
  g.H = checked_int(x.size(2), "height");
  g.W = checked_int(x.size(3), "width");
  g.Cg = checked_int(x.size(1) / groups, "channels per group");
  g.kh = checked_int(kernel_size[0], "kernel height");
  g.kw = checked_int(kernel_size[1], "kernel width");
  g.sh = checked_int(stride[0], "stride");
  g.sw = checked_int(stride[1], "stride");
  g.ph = checked_int(padding[0], "padding");
  g.pw = checked_int(padding[1], "padding");
  g.dh = checked_int(dilation[0], "dilation");
  g.dw = checked_int(dilation[1], "dilation");
  const int64_t ho = conv_out_size(x.size(2), kernel_size[0], stride[0], padding[0], dilation[0]);
  const int64_t wo = conv_out_size(x.size(3), kernel_size[1], stride[1], padding[1], dilation[1]);
  g.Ho = checked_int(ho, "output height");
  g.Wo = checked_int(wo, "output width");
  g.rows = x.size(0) * ho * wo;
  g.d_data = checked_int(static_cast<int64_t>(g.Cg) * g.kh * g.kw, "patch size");
  g.bias = bias;
  g.d = checked_int(static_cast<int64_t>(g.d_data) + (bias ? 1 : 0), "covariance size");
  return g;
}

at::Tensor conv_covariance_cuda(const at::Tensor& x, at::IntArrayRef kernel_size,
                                at::IntArrayRef stride, at::IntArrayRef padding,
                                at::IntArrayRef dilation, int64_t groups, bool bias,
                                double scale) {
  check_device_type(x, c10::DeviceType::CUDA, "conv_covariance", "x");
  check_conv_covariance_args(x, kernel_size, stride, padding, dilation, groups);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const Geom g = conv_geom(xc, kernel_size, stride, padding, dilation, groups, bias);
  at::Tensor out = at::empty({groups, g.d, g.d}, xc.options());
  covariance_into(xc, g, static_cast<int>(groups), scale, /*conv=*/true, out);
  return out;
}

}  // namespace
}  // namespace kaisa::cuda

TORCH_LIBRARY_IMPL(kaisa, CUDA, m) {
  m.impl("covariance", &kaisa::cuda::covariance_cuda);
  m.impl("conv_covariance", &kaisa::cuda::conv_covariance_cuda);
}
