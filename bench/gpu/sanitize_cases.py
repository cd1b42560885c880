"""Every kaisa kernel once, at small shapes: what ``compute-sanitizer`` runs over.

Each case calls one op (one code path: the fused covariance kernel with and without
split rows, its GEMM path with and without packing, conv covariance, each eigh routine,
the status form, the fp32 and 16-bit preconditioners), synchronises, and checks the
result against :mod:`kaisa.ops._reference` in float64, so a kernel that writes garbage
fails here even when the sanitizer sees no bad access. Exit code 0: every case ran and
agreed. Small shapes keep the sanitizers' slowdown (10-100x) within a minute.

    compute-sanitizer --tool memcheck python bench/gpu/sanitize_cases.py --device cuda
    python bench/gpu/sanitize_cases.py --device cpu     # the same plumbing on the CPU
    python bench/gpu/sanitize_cases.py --list           # the case names, in run order
    python bench/gpu/sanitize_cases.py --after "eigh syevj"   # resume after a case
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

import torch

import kaisa.ops  # loads the extension: torch.ops.kaisa.*
from kaisa.ops import _reference as ref


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Sets kaisa's per-call environment switches inside the block."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Relative max error of ``got`` against the float64 ``want`` within ``tol``."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(g).all(), "non-finite output"
    err = (g - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def cases(device: str) -> dict[str, Callable[[], None]]:
    """The named cases on ``device``."""
    ops = torch.ops.kaisa
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def covariance(rows: int, d: int, impl: str, dtype: torch.dtype, bias: bool) -> None:
        x = rand(rows, d, dtype=dtype)
        with env(KAISA_COVARIANCE_IMPL=impl):
            got = ops.covariance(x, 1.0 / rows, bias)
        tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        close(got, ref.covariance(x.double().cpu(), 1.0 / rows, bias=bias), tol)

    def conv(impl: str, dtype: torch.dtype) -> None:
        x = rand(2, 5, 9, 9, dtype=dtype)
        args = ((3, 3), (2, 2), (1, 1), (1, 1), 1, True, 0.1)
        with env(KAISA_COVARIANCE_IMPL=impl):
            got = ops.conv_covariance(x, *args)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        close(got, ref.conv_covariance(x.double().cpu(), *args), tol)

    def eigh(impl: str, n: int, batch: int) -> None:
        x = rand(batch, n, n, dtype=torch.float64)
        a = (x @ x.mT / n + torch.eye(n, device=device, dtype=torch.float64)).float()
        with env(KAISA_EIGH_IMPL=impl):
            w, v = ops.batched_eigh(a)
        close(v @ torch.diag_embed(w) @ v.mT, a, 1e-4)

    def eigh_status() -> None:
        x = rand(3, 40, 40, dtype=torch.float64)
        a = (x @ x.mT / 40 + torch.eye(40, device=device, dtype=torch.float64)).float()
        w, v, status = ops.batched_eigh_status(a)
        assert int(status.abs().sum()) == 0, status
        close(v @ torch.diag_embed(w) @ v.mT, a, 1e-4)

    def precondition(dtype: torch.dtype, dgda: bool) -> None:
        b, m, n = 2, 33, 20
        grad = rand(b, m, n)
        qa = torch.linalg.qr(rand(b, n, n))[0]
        qg = torch.linalg.qr(rand(b, m, m))[0]
        da, dg = rand(b, n).abs(), rand(b, m).abs()
        r = (1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + 0.1)).to(dtype) if dgda else None
        pa, pg = (None, None) if dgda else (da.to(dtype), dg.to(dtype))
        got = ops.eigen_precondition(grad.to(dtype), qa.to(dtype), qg.to(dtype), pa, pg, r, 0.1)
        want = ref.eigen_precondition(grad.to(dtype).double(), qa.to(dtype).double(),
                                      qg.to(dtype).double(), pa, pg, r, 0.1)
        close(got, want, 2e-2 if dtype == torch.bfloat16 else 1e-4)

    out: dict[str, Callable[[], None]] = {
        "covariance fused": lambda: covariance(37, 70, "fused", torch.float32, True),
        "covariance fused split": lambda: covariance(3000, 40, "fused", torch.float32, False),
        "covariance fused bf16": lambda: covariance(300, 65, "fused", torch.bfloat16, False),
        "covariance gemm": lambda: covariance(300, 70, "gemm", torch.float32, True),
        "covariance gemm bf16": lambda: covariance(300, 64, "gemm", torch.bfloat16, False),
        "covariance gemm fp64": lambda: covariance(100, 33, "gemm", torch.float64, False),
        "conv covariance fused": lambda: conv("fused", torch.float32),
        "conv covariance gemm": lambda: conv("gemm", torch.float32),
        "conv covariance gemm bf16": lambda: conv("gemm", torch.bfloat16),
        "eigh syevj": lambda: eigh("syevj", 20, 3),
        "eigh xsyev_batched": lambda: eigh("xsyev_batched", 50, 3),
        "eigh syevd one": lambda: eigh("syevd", 50, 1),
        "eigh syevd streams": lambda: eigh("syevd", 50, 5),
        "eigh status": eigh_status,
        "precondition fp32": lambda: precondition(torch.float32, False),
        "precondition fp32 dgda": lambda: precondition(torch.float32, True),
        "precondition bf16": lambda: precondition(torch.bfloat16, False),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    """Runs every case; prints one line each; exit code 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--after", default=None,
                        help="run only the cases after this one (resuming past a crash)")
    args = parser.parse_args(argv)
    names = list(cases("cpu"))
    if args.list:
        print("\n".join(names))
        return 0
    if args.after is not None and args.after not in names:
        parser.error(f"unknown case {args.after!r}")
    skip = names.index(args.after) + 1 if args.after is not None else 0
    print(f"kaisa.ops backend {kaisa.ops.backend()}, device {args.device}", flush=True)
    failed = 0
    for name, case in list(cases(args.device).items())[skip:]:
        try:
            case()
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"ok    {name}", flush=True)
        except Exception as err:  # every case runs; the failures are counted
            failed += 1
            print(f"FAIL  {name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}",
                  flush=True)
    print(f"{failed} of {len(names) - skip} cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
