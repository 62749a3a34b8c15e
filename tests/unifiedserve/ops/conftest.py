"""The native ops' fixtures, shared by the paged-copy and fused-op tests, and the skinny GEMM's table reset around
each of its tune() tests."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from unifiedserve import ops
from unifiedserve.ops import skinny


@pytest.fixture(scope="session")
def native():
    """The native ops, built once per session (seconds the first time, then cached on disk)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get("UNIFIEDSERVE_NO_NATIVE"):
        pytest.skip("no C++ compiler, or UNIFIEDSERVE_NO_NATIVE is set")
    assert ops.native_available(), f"a compiler is present but the build failed: {ops.build_info()['reason']}"
    return torch.ops.unifiedserve


@pytest.fixture(scope="session")
def cuda_native():
    """The extension's CUDA kernels: a CUDA torch with nvcc must have built them."""
    reason = ops._cuda_toolchain()
    if reason:
        pytest.skip(reason)
    assert ops.native_available() and ops.build_info()["cuda"], ops.build_info().get("cuda_reason")
    return torch.ops.unifiedserve


@pytest.fixture
def clean_table():
    """skinny's table of choices empty before and after the test (tune() fills it for the whole process)."""
    skinny.reset()
    yield
    skinny.reset()
