"""Byte-level text from the Python standard library's own source, for ``--task lm``.

The corpus ships with the package (``kaisa/train/corpus/stdlib-text.gz``, its license
beside it): the first 2 MiB of CPython 3.11.7's standard-library ``.py`` files (test
directories and ``site-packages`` excluded), sorted by path and concatenated. It is the
same bytes on every machine, whatever Python runs it; a copy whose checksum differs is
refused. Bytes are the tokens (vocabulary 256). The first 90% of the bytes train, the
last 10% validate (a split by position). Training batches are random windows of
``context + 1`` bytes whose starts are a function of (seed, epoch); the validation (and
training-evaluation) windows are fixed and evenly spaced.

An lm "epoch" is ``--steps-per-epoch`` optimiser steps of random windows (not a pass
over the corpus): evaluation, checkpoints and ``--resume`` happen at those boundaries.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kaisa.train.data import Dataset

#: ``--dataset`` name of the corpus.
STDLIB_TEXT = "stdlib-text"

#: Directory names whose files are left out (tests, installed packages, caches).
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)

#: Default corpus size, and the size of the shipped corpus: 2 MiB.
DEFAULT_BYTES = 2 * 2**20

#: The shipped corpus (gzip) and the SHA-256 of its decompressed bytes.
CORPUS = Path(__file__).with_name("corpus") / "stdlib-text.gz"
CORPUS_SHA256 = "f407df9517a4ac0fa7f98731572c86c752c01c376b00571b26adf337115a7c48"


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The ``.py`` files under ``root``, sorted by their path relative to it.

    ``root`` defaults to the running interpreter's standard library; this order is the
    one the shipped corpus was cut in.
    """
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    found = []
    # os.walk, pruned: excluded directories (site-packages above all) are not descended
    # into; symbolic links to directories are not followed.
    for directory, subdirectories, names in os.walk(base):
        subdirectories[:] = [d for d in subdirectories if d not in EXCLUDED_DIRS]
        relative = Path(directory).relative_to(base)
        for name in names:
            if name.endswith(".py") and (Path(directory) / name).is_file():
                found.append((relative / name).as_posix())
    return [base / name for name in sorted(found)]


def files_bytes(root: Path, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of :func:`stdlib_files` of ``root``, concatenated."""
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_files(root):
        if total >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


@functools.cache
def shipped_corpus() -> bytes:
    """The shipped corpus, checked against :data:`CORPUS_SHA256`.

    Raises:
        ValueError: the file is missing, unreadable or not the bytes it should be.
    """
    try:
        data = gzip.decompress(CORPUS.read_bytes())
    except (OSError, EOFError) as error:
        raise ValueError(f"cannot read the shipped corpus {CORPUS}: {error}") from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"{CORPUS} is not the shipped corpus (SHA-256 {digest}, expected "
                         f"{CORPUS_SHA256}): reinstall kaisa")
    return data


def load_corpus(*, max_bytes: int = DEFAULT_BYTES, root: Path | None = None) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the corpus, as a ``uint8`` tensor.

    Args:
        max_bytes: How many bytes (at most :data:`DEFAULT_BYTES` of the shipped corpus).
        root: Cut the corpus from the ``.py`` files under this directory instead
            (:func:`stdlib_files` order), as the shipped one was cut.

    Raises:
        ValueError: ``max_bytes`` exceeds the shipped corpus, or the file is not it.
    """
    if root is not None:
        data = files_bytes(root, max_bytes)
    elif max_bytes > DEFAULT_BYTES:
        raise ValueError(f"the corpus holds {DEFAULT_BYTES} bytes; {max_bytes} asked for")
    else:
        data = shipped_corpus()[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split(corpus: torch.Tensor, valid_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation bytes: the last ``valid_fraction`` of the corpus validates."""
    cut = len(corpus) - int(len(corpus) * valid_fraction)
    return corpus[:cut], corpus[cut:]


def windows(stream: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """Rows ``stream[s : s + context + 1]`` for every start ``s``, as ``int64``."""
    index = starts.view(-1, 1) + torch.arange(context + 1).view(1, -1)
    return stream[index].long()


def fixed_windows(stream: torch.Tensor, count: int, context: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``context + 1`` bytes over ``stream``."""
    if len(stream) < context + 1:
        raise ValueError(f"{len(stream)} bytes cannot hold a window of {context + 1}")
    starts = torch.linspace(0, len(stream) - context - 1, count).round().long()
    return windows(stream, starts, context)


@dataclass(frozen=True)
class TextData(Dataset):
    """Byte windows of the corpus; ``train_x``/``test_x`` are the fixed evaluation windows.

    ``test_x``/``test_y`` hold the validation windows (inputs and next-byte targets),
    ``train_x``/``train_y`` as many fixed windows of the training bytes (for
    ``--eval-train``). Training batches come from :meth:`batch`.
    """

    train_stream: torch.Tensor
    context: int
    examples_per_epoch: int
    seed: int

    @property
    def train_size(self) -> int:
        """Window slots per epoch (``steps * batch * processes``)."""
        return self.examples_per_epoch

    def starts(self, epoch: int) -> torch.Tensor:
        """Random window starts of ``epoch``, a function of (seed, epoch) only."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        high = len(self.train_stream) - self.context
        return torch.randint(high, (self.examples_per_epoch,), generator=generator)

    def batch(self, index: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(len(index), context)`` of the window slots ``index``."""
        rows = windows(self.train_stream, self.starts(epoch)[index], self.context)
        return rows[:, :-1], rows[:, 1:]


def load_text(
    *,
    context: int,
    examples_per_epoch: int,
    max_bytes: int = DEFAULT_BYTES,
    eval_windows: int = 256,
    seed: int = 0,
    root: Path | None = None,
) -> TextData:
    """Load the corpus (:func:`load_corpus`) and split it by position (last 10% validates)."""
    train, valid = split(load_corpus(max_bytes=max_bytes, root=root))
    valid_rows = fixed_windows(valid, eval_windows, context)
    train_rows = fixed_windows(train, eval_windows, context)
    return TextData(
        name=STDLIB_TEXT,
        train_x=train_rows[:, :-1],
        train_y=train_rows[:, 1:],
        test_x=valid_rows[:, :-1],
        test_y=valid_rows[:, 1:],
        num_classes=256,
        train_stream=train,
        context=context,
        examples_per_epoch=examples_per_epoch,
        seed=seed,
    )


def add_arguments(parser: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    """The ``--task lm`` flags (``positive`` parses an integer >= 1)."""
    group = parser.add_argument_group("language model (--task lm, --dataset stdlib-text)")
    add = group.add_argument
    add("--context", type=positive, default=128, metavar="T",
        help="bytes of context per window (default: %(default)s)")
    add("--d-model", type=positive, default=128, metavar="D",
        help="GPT width; 4 layers, 4 heads, feed-forward 4D (default: %(default)s)")
    add("--steps-per-epoch", type=positive, default=100, metavar="N",
        help="optimiser steps of random windows per lm epoch (default: %(default)s)")
    add("--text-bytes", type=positive, default=DEFAULT_BYTES, metavar="N",
        help="corpus size: its first N bytes, at most %(default)s; the last 10%% validate "
        "(default: %(default)s)")
    add("--eval-windows", type=positive, default=256, metavar="N",
        help="fixed validation windows (and training windows with --eval-train) "
        "(default: %(default)s)")
