"""Symmetric packing's old home, kept for compatibility: the upper triangle of ``(..., n, n)``.

The functions live in :mod:`kaisa.utils.packing` (also re-exported by
:mod:`kaisa.distributed`); this module keeps ``kaisa.distributed.packing`` importable.
"""

from __future__ import annotations

from kaisa.utils.packing import pack_symmetric as pack_symmetric
from kaisa.utils.packing import packed_numel as packed_numel
from kaisa.utils.packing import unpack_symmetric as unpack_symmetric

__all__ = ["pack_symmetric", "packed_numel", "unpack_symmetric"]
