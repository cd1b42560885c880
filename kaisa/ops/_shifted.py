"""The A factor of a stride-1 convolution from shifted channel correlations (CPU path).

For stride 1 and dilation 1, the patch Gram matrix ``P^T P`` of a ``kh x kw`` convolution
has a Toeplitz structure: its block for kernel offsets ``(i, j)`` and ``(i', j')`` is the
correlation of the input's channels at the shift ``delta = (i' - i, j' - j)``,

    ``block = sum_{u in U_i, v in V_j} x[:, u, v]^T x[:, u + delta_h, v + delta_w]``,

summed over the image positions ``(u, v)`` that some output position reads through
offset ``(i, j)`` (``U_i``: the rows ``i - ph .. i - ph + out_h - 1`` inside the image;
``V_j`` likewise). Only the ``(2 kh - 1)(2 kw - 1)`` shifts occur, and a shift and its
negative give transposed sums over the whole image, so ``(2 kh - 1)(2 kw - 1) / 2 + 1``
GEMMs of ``(C, N H W) x (N H W, C)`` replace the SYRK of the ``(N out_h out_w, C kh kw)``
patch matrix: ``13 C^2`` products per position instead of about ``40 C^2`` (81/2) for a
3x3 kernel. Each block then subtracts the few boundary rows and columns outside
``U_i x V_j`` (inclusion-exclusion; ``O(H + W)`` of ``O(H W)``). The result equals
:func:`kaisa.ops._reference.conv_covariance` up to float rounding (a different order of
summation) and is made exactly symmetric by mirroring its upper triangle.

The whole-image sums use one zero-padded channels-last copy of the input laid out so
that a shift is a constant offset into one flat ``(rows, C)`` buffer: each image has
``kh - 1`` zero rows above it and each row ``kw - 1`` zero columns after it (a shift to
the left of column 0 lands in the previous row's zeros), so every product reads two
contiguous row ranges of that buffer (in chunks of :data:`_CHUNK` rows, one batched GEMM,
whose partial sums are added) and nothing is unfolded.
"""

from __future__ import annotations

import torch

from kaisa.ops._checks import ConvArgs
from kaisa.utils.dtypes import working_dtype

__all__ = ["conv_covariance_shifted", "supports_shifted"]

#: Most rows per partial product of the whole-image sums: partial sums of at most this
#: many products are added up. One GEMM over all ``N H W`` rows of a 3-channel input was
#: 10-50x less accurate in float32 than the compiled kernel, and 8192-row chunks still 10x
#: on a constant input near float32's range; 1024 is as accurate as the compiled kernel
#: or more on both (``tests/ops/test_conv_shifted.py``), at no measurable cost.
_CHUNK = 1024


#: Where the shifted path pays on the CPU (``bench/kernels/conv_factor.py --crossover``, one
#: thread): at least this many input channels (3 never pays), image rows and columns (at
#: 4x4 the boundary and the padding dominate) and output positions in the batch (below,
#: the fixed cost of assembling ``(kh kw)^2`` blocks exceeds the SYRK it saves).
MIN_CHANNELS, MIN_SIDE, MIN_POSITIONS = 8, 8, 4096


def supports_shifted(x: torch.Tensor, conv: ConvArgs) -> bool:
    """Whether :func:`conv_covariance_shifted` computes this convolution's A factor, and pays.

    A kernel of more than one position (a 1x1 kernel has no shifts to share: its factor
    is one SYRK of the input, which the compiled kernel does without a copy), stride 1,
    dilation 1, one group, a float32/float64 CPU input of at least :data:`MIN_CHANNELS`
    channels, :data:`MIN_SIDE` rows and columns and :data:`MIN_POSITIONS` output positions.
    (:func:`conv_covariance_shifted` itself is exact for any size.)
    """
    if x.dim() != 4:
        return False
    n, c, h, w = x.shape
    oh, ow = conv.output_size(h, w)
    return (
        conv.kernel_size[0] * conv.kernel_size[1] > 1 and conv.stride == (1, 1)
        and conv.dilation == (1, 1) and conv.groups == 1 and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64) and c >= MIN_CHANNELS
        and min(h, w) >= MIN_SIDE and oh > 0 and ow > 0 and n * oh * ow >= MIN_POSITIONS
    )


class _Edges:
    """Along one image axis: which boundary positions each kernel offset leaves out."""

    def __init__(self, size: int, pad: int, out: int, k: int) -> None:
        #: Per offset ``i``: the positions ``u`` it reads none of (outside
        #: ``i - pad .. i - pad + out - 1``).
        self.excluded = [[u for u in range(size) if u < i - pad or u > i - pad + out - 1]
                         for i in range(k)]
        #: The positions some offset leaves out, each with the shifts that matter for it:
        #: used by an offset ``i`` excluding it (``-i <= a <= k - 1 - i``) and inside the
        #: image (``0 <= u + a < size``); empty ranges dropped.
        self.ranges: dict[int, tuple[int, int]] = {}
        for u in sorted({u for ex in self.excluded for u in ex}):
            offsets = [i for i, ex in enumerate(self.excluded) if u in ex]
            lo, hi = max(-u, -max(offsets)), min(size - 1 - u, k - 1 - min(offsets))
            if lo <= hi:
                self.ranges[u] = (lo, hi)
        self.k = k

    def weight(self, u: int, like: torch.Tensor) -> torch.Tensor:
        """``(k,)``: 1 where offset ``i`` leaves position ``u`` out."""
        return torch.tensor([float(u in ex) for ex in self.excluded], dtype=like.dtype)

    def kept(self, size: int, like: torch.Tensor) -> torch.Tensor:
        """``(k, size)``: 1 where offset ``i`` reads position ``u``."""
        return torch.tensor([[float(u not in ex) for u in range(size)] for ex in self.excluded],
                            dtype=like.dtype)


def _correlate(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(sh, sw, c, c)``: ``sum_{n, p} left[n, p]^T right[n, p, a, b]``, one GEMM.

    Args:
        left: ``(n, p, c)`` values at ``p`` positions.
        right: ``(n, p, sh, sw, c)`` the values at every shift of those positions.
    """
    n, p, c = left.shape
    sh, sw = right.shape[2], right.shape[3]
    prod = left.reshape(n * p, c).t() @ right.reshape(n * p, sh * sw * c)
    return prod.view(c, sh, sw, c).permute(1, 2, 0, 3)


def conv_covariance_shifted(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    padding: tuple[int, int],
    bias: bool,
    scale: float,
) -> torch.Tensor:
    """``scale * Pb^T Pb`` of a stride-1, dilation-1, one-group convolution's patches.

    Args:
        x: ``(N, C, H, W)`` input (float32 or float64, CPU).
        kernel_size: ``(kh, kw)``.
        padding: symmetric zero padding ``(ph, pw)``.
        bias: whether a ones column is appended (last).
        scale: multiplier of the Gram matrix.

    Returns:
        Exactly symmetric ``(1, C kh kw + bias, same)`` tensor of ``x``'s dtype.
    """
    n, c, h, w = x.shape
    (kh, kw), (ph, pw) = kernel_size, padding
    oh, ow = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    dtype = working_dtype(x.dtype)
    d = c * kh * kw + int(bias)
    if oh <= 0 or ow <= 0 or n == 0:
        return x.new_zeros((1, d, d))
    th, tw = kh - 1, kw - 1
    shifts = [(a, b) for a in range(-th, th + 1) for b in range(-tw, tw + 1)]
    whole = _whole_image(x.to(dtype), th, tw, shifts)
    # Boundary rows / columns some offset leaves out: their sums, per offset and shift.
    rows, cols = _Edges(h, ph, oh, kh), _Edges(w, pw, ow, kw)
    padded = x.new_zeros((n, h + 2 * th, w + 2 * tw, c), dtype=dtype)
    padded[:, th:th + h, tw:tw + w].copy_(x.permute(0, 2, 3, 1))
    grid = x.new_zeros((kh, kw, 2 * th + 1, 2 * tw + 1, c, c), dtype=dtype)
    for u, (a0, a1) in rows.ranges.items():  # row u against rows u + a, every column shift
        terms = _correlate(padded[:, th + u, tw:tw + w], padded[:, th + u + a0:th + u + a1 + 1]
                           .unfold(2, w, 1).permute(0, 4, 1, 2, 3))
        weight = rows.weight(u, grid).view(kh, 1, 1, 1, 1, 1)
        grid[:, :, th + a0:th + a1 + 1] += weight * terms
    for v, (b0, b1) in cols.ranges.items():  # column v against columns v + b, every row shift
        terms = _correlate(padded[:, th:th + h, tw + v], padded[:, :, tw + v + b0:tw + v + b1 + 1]
                           .unfold(1, h, 1).permute(0, 4, 1, 2, 3))
        weight = cols.weight(v, grid).view(1, kw, 1, 1, 1, 1)
        grid[:, :, :, tw + b0:tw + b1 + 1] += weight * terms
    for u, (a0, a1) in rows.ranges.items():  # positions in both: added back once
        for v, (b0, b1) in cols.ranges.items():
            terms = _correlate(padded[:, th + u, tw + v].unsqueeze(1), padded[
                :, th + u + a0:th + u + a1 + 1, tw + v + b0:tw + v + b1 + 1].unsqueeze(1))
            weight = torch.outer(rows.weight(u, grid), cols.weight(v, grid))
            grid[:, :, th + a0:th + a1 + 1, tw + b0:tw + b1 + 1] -= (
                weight.view(kh, kw, 1, 1, 1, 1) * terms)
    # Block (i, j, i', j') = whole[shift] - grid[i, j, shift], shift = (i' - i, j' - j).
    i, j, i2, j2 = torch.meshgrid(*(torch.arange(k) for k in (kh, kw, kh, kw)), indexing="ij")
    shift = (i2 - i + th) * (2 * tw + 1) + (j2 - j + tw)
    blocks = whole[shift] - grid.flatten(2, 3)[i, j, shift]  # (kh, kw, kh, kw, c, c)
    out = x.new_empty((d, d), dtype=dtype)
    core = c * kh * kw
    out[:core, :core] = blocks.permute(4, 0, 1, 5, 2, 3).reshape(core, core)
    if bias:  # column sums of the patches: the input's sums over each offset's window
        total = x.to(dtype).sum(0)  # (c, h, w)
        ones = torch.einsum("cuv,iu,jv->cij", total, rows.kept(h, total),
                            cols.kept(w, total)).reshape(core)
        out[:core, core] = ones
        out[core, :core] = ones
        out[core, core] = float(n * oh * ow)
    out.mul_(scale)
    upper = torch.triu(out)
    return (upper + torch.triu(out, diagonal=1).t()).to(x.dtype).unsqueeze(0)


def _whole_image(
    x: torch.Tensor, th: int, tw: int, shifts: list[tuple[int, int]]
) -> torch.Tensor:
    """``(shifts, C, C)``: ``sum_{n, u, v} x[n, :, u, v]^T x[n, :, u + a, v + b]`` per shift.

    One GEMM per pair of opposite shifts (the negative shift's sum is the transpose), on
    the flat layout of the module docstring.
    """
    n, c, h, w = x.shape
    hp, wp = h + th, w + tw
    lead = th * wp + tw  # zeros before image 0's own top rows, for the negative shifts
    length = (n - 1) * hp * wp + (h - 1) * wp + w  # image 0's first value to the last one
    chunks = -(-length // _CHUNK)
    rows = -(-length // chunks)  # at most _CHUNK, and fewer than `chunks` rows of padding
    span = chunks * rows
    flat = x.new_zeros((lead + th * wp + span + th * wp + tw, c))
    flat[lead:lead + n * hp * wp].view(n, hp, wp, c)[:, th:, :w].copy_(x.permute(0, 2, 3, 1))
    first = lead + th * wp  # image 0, row 0, column 0
    left = flat[first:first + span].view(chunks, rows, c).transpose(1, 2)
    sums: dict[tuple[int, int], torch.Tensor] = {}
    for a, b in shifts:
        if (-a, -b) not in sums:
            start = first + a * wp + b
            right = flat[start:start + span].view(chunks, rows, c)
            sums[(a, b)] = torch.bmm(left, right).sum(0)
    return torch.stack([sums[s] if s in sums else sums[(-s[0], -s[1])].t() for s in shifts])
