from __future__ import annotations

import pytest
import torch

import kaisa.ops
from tests.support.backends import Backend, backend_params, load


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


@pytest.fixture(params=["ext", "torch"])
def each_backend(request):
    """Runs the test once per kaisa.ops backend (ext only where the extension loaded)."""
    if request.param == "ext" and not kaisa.ops.extension_available():
        pytest.skip(f"kaisa._C not available: {kaisa.ops.extension_error()}")
    with kaisa.ops.use_backend(request.param):
        yield request.param


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs the test once per device (CUDA tests carry the gpu marker)."""
    return torch.device(request.param)


@pytest.fixture(scope="module", params=backend_params())
def backend(request: pytest.FixtureRequest) -> Backend:
    """Where the CUDA kernels run: a GPU, or the SIMT emulator (tests/support/backends.py)."""
    return load(request.param)


@pytest.fixture(autouse=True)
def _seed_backend_tests(request: pytest.FixtureRequest) -> None:
    """Every test of the CUDA kernels (those using ``backend``) starts from seed 0."""
    if "backend" in request.fixturenames:
        torch.manual_seed(0)
