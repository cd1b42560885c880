from __future__ import annotations

import os
import sys

import pytest
import torch

import kaisa.ops

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    """With a CUDA device, gpu tests fail (never skip) when the CUDA kernels are missing."""
    if "gpu" in item.keywords and torch.cuda.is_available():
        problem = kaisa.ops.cuda_kernels_error()
        if problem is not None:
            pytest.fail(f"CUDA device present but {problem}", pytrace=False)
