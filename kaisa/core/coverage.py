"""Which trainable parameters the curvature blocks cover (``docs/conventions.md``, "Coverage").

Every trainable parameter, named as ``model.named_parameters()`` names it (a tied one once,
under its first name), is covered by a block (its kind) or is :data:`FIRST_ORDER`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from kaisa.blocks import CurvatureBlock

__all__ = ["FIRST_ORDER", "coverage_line", "parameter_coverage"]

#: The coverage of a trainable parameter that no block covers.
FIRST_ORDER = "first-order"


def parameter_coverage(
    model: nn.Module, blocks: Mapping[str, CurvatureBlock]
) -> dict[str, str]:
    """``{parameter name: block kind or 'first-order'}`` for every trainable parameter."""
    kinds = {id(p): b.kind for b in blocks.values() for p in b.parameters()}
    return {
        name: kinds.get(id(p), FIRST_ORDER)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def coverage_line(coverage: Mapping[str, str], model: nn.Module, blocks: int) -> str:
    """One line: how many parameters and elements the blocks cover, and the rest."""
    sizes = dict(model.named_parameters())
    rest = [n for n, kind in coverage.items() if kind == FIRST_ORDER]
    total = sum(sizes[n].numel() for n in coverage) or 1
    covered = sum(sizes[n].numel() for n in coverage if n not in rest)
    shown = ", ".join(rest[:8]) + (f" and {len(rest) - 8} more" if len(rest) > 8 else "")
    return (
        f"kaisa: K-FAC preconditions {len(coverage) - len(rest)} of "
        f"{len(coverage)} trainable parameters ({100 * covered / total:.1f}% of "
        f"the elements) in {blocks} blocks; first-order: {shown or 'none'}"
    )
