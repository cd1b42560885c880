"""In-memory datasets for ``kaisa-train``: digits, CIFAR-10 and synthetic.

Every dataset is held as image tensors ``(N, C, H, W)`` in ``[0, 1]`` (CIFAR-10
is additionally normalised per channel); flat models (``mlp``,
``autoencoder``) flatten them themselves, so digits is seen as 64 features.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS: tuple[str, ...] = ("digits", "cifar10", "synthetic", "stdlib-text")
"""``stdlib-text`` (``--task lm``) lives in :mod:`kaisa.train.text`."""

#: Files expected in the CIFAR-10 directory (the "CIFAR-10 python version").
CIFAR_FILES: tuple[str, ...] = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")

_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)


class DatasetError(Exception):
    """A dataset could not be loaded (missing files, bad layout)."""


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors plus the shape information models need."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def train_size(self) -> int:
        """Training examples per epoch (what the sampler shuffles and shards)."""
        return len(self.train_x)

    def batch(self, index: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of the training examples ``index`` (``epoch``: unused here)."""
        del epoch
        return self.train_x[index], self.train_y[index]

    @property
    def in_channels(self) -> int:
        """Image channels."""
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        """Image height (= width)."""
        return int(self.train_x.shape[2])

    @property
    def input_dim(self) -> int:
        """Number of features of one flattened example."""
        return int(self.train_x[0].numel())


def load_digits(*, test_size: int = 360, seed: int = 0) -> Dataset:
    """Load scikit-learn's 8x8 digits with a fixed stratified split.

    Args:
        test_size: Examples held out for testing (default 360, leaving 1437).
        seed: Seed of the split; the default split is the same everywhere.

    Returns:
        Digits as ``(N, 1, 8, 8)`` float32 images scaled to ``[0, 1]``.
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_size, random_state=seed, stratify=y
    )
    return Dataset(
        name="digits",
        train_x=torch.from_numpy(x_tr),
        train_y=torch.from_numpy(y_tr),
        test_x=torch.from_numpy(x_te),
        test_y=torch.from_numpy(y_te),
        num_classes=10,
    )


def cifar_layout_message(data_dir: Path) -> str:
    """Describe the CIFAR-10 layout expected under ``data_dir``."""
    files = ", ".join(CIFAR_FILES)
    return (
        f"CIFAR-10 not found in {data_dir}: expected the python-pickle batches ({files}) "
        f"either directly in that directory or in {data_dir / 'cifar-10-batches-py'} "
        "(the layout of cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html; "
        "kaisa-train does not download it)"
    )


_CIFAR_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
})
"""The only globals CIFAR-10's batches (a dict of bytes, lists and uint8 numpy arrays,
pickled by Python 2 or 3) need; anything else in a batch file is refused unexecuted."""


class _CifarUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only :data:`_CIFAR_GLOBALS`."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _CIFAR_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name}: a CIFAR-10 batch holds only numpy arrays, "
            "bytes and lists")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open("rb") as handle:
        batch = _CifarUnpickler(handle, encoding="bytes").load()
    if not isinstance(batch, dict):
        raise ValueError(f"{path.name} is not a CIFAR-10 batch (a {type(batch).__name__})")
    data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{path.name}: {data.shape[0]} images but {labels.size} labels")
    return data, labels


def load_cifar10(data_dir: str | Path) -> Dataset:
    """Read CIFAR-10 from its python-pickle batches (no download).

    Args:
        data_dir: Directory holding ``data_batch_1..5`` and ``test_batch``, or
            their parent ``cifar-10-batches-py``.

    Returns:
        Normalised ``(N, 3, 32, 32)`` float32 images; 50000 train, 10000 test.

    Raises:
        DatasetError: If the files are missing or unreadable.
    """
    root = Path(data_dir)
    for candidate in (root, root / "cifar-10-batches-py"):
        if all((candidate / name).is_file() for name in CIFAR_FILES):
            break
    else:
        raise DatasetError(cifar_layout_message(root))
    try:
        train = [_read_cifar_batch(candidate / f"data_batch_{i}") for i in range(1, 6)]
        test_x, test_y = _read_cifar_batch(candidate / "test_batch")
    except (OSError, KeyError, ValueError, TypeError, EOFError, pickle.UnpicklingError) as error:
        raise DatasetError(f"cannot read CIFAR-10 batches in {candidate}: {error}") from error
    mean = torch.tensor(_CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_CIFAR_STD).view(1, 3, 1, 1)

    def normalise(images: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(images).float() / 255.0 - mean) / std

    return Dataset(
        name="cifar10",
        train_x=normalise(np.concatenate([b[0] for b in train])),
        train_y=torch.from_numpy(np.concatenate([b[1] for b in train])),
        test_x=normalise(test_x),
        test_y=torch.from_numpy(test_y),
        num_classes=10,
    )


def make_synthetic(
    *,
    in_channels: int = 3,
    image_size: int = 32,
    num_classes: int = 10,
    train_size: int = 1024,
    test_size: int = 256,
    seed: int = 0,
) -> Dataset:
    """Random uniform images with random labels, for throughput measurements."""
    generator = torch.Generator().manual_seed(seed)
    shape = (train_size + test_size, in_channels, image_size, image_size)
    x = torch.rand(shape, generator=generator)
    y = torch.randint(num_classes, (train_size + test_size,), generator=generator)
    return Dataset(
        name="synthetic",
        train_x=x[:train_size],
        train_y=y[:train_size],
        test_x=x[train_size:],
        test_y=y[train_size:],
        num_classes=num_classes,
    )


def augment_batch(images: torch.Tensor, generator: torch.Generator, *,
                  flip: bool = True) -> torch.Tensor:
    """Random padded crop and (with ``flip``) horizontal flip.

    The padding is an eighth of the image's height (at least one pixel): 4 pixels on
    CIFAR's 32x32 (the standard CIFAR augmentation), 1 on the 8x8 digits, which are not
    flipped (a mirrored digit is another glyph).
    """
    n, _, h, w = images.shape
    p = max(1, h // 8)
    padded = torch.nn.functional.pad(images, (p, p, p, p))
    dx = torch.randint(2 * p + 1, (n,), generator=generator)
    dy = torch.randint(2 * p + 1, (n,), generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h).view(1, h)).view(n, 1, h, 1)
    cols = (dx.view(n, 1) + torch.arange(w).view(1, w)).view(n, 1, 1, w)
    index_rows = rows.expand(n, padded.shape[1], h, padded.shape[3])
    cropped = padded.gather(2, index_rows)
    cropped = cropped.gather(3, cols.expand(n, padded.shape[1], h, w))
    if flip:
        flipped = torch.rand(n, generator=generator) < 0.5
        cropped[flipped] = cropped[flipped].flip(3)
    return cropped
