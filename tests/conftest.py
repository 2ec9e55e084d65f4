"""Fixtures: per-test seeded generators, the impl axis, and skipping GPU-marked tests without a GPU."""

from __future__ import annotations

import os
import sys
import zlib

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # oracle.py and cases.py sit beside the tests

import jax_sparse_mla as jsm  # noqa: E402


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu() and jsm.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and the CUDA extension")
    for item in items:
        if "gpu" in item.keywords or "gpu_full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh per test, identical on every run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["auto", "xla"])
def impl(request):
    """The default lowering (the C++ CPU FFI kernel here) and the pure-JAX reference lowering."""
    return request.param


@pytest.fixture(autouse=True)
def _no_staging_unless_asked(monkeypatch):
    """CUDA plans never stage a cache here unless a test sets ``JSMLA_CUDA_STAGING`` itself (test_staging.py
    and the staging tests of tests/gpu): every other test runs the kernels of the format it names, as
    small caches would otherwise make the cost model stage some of them."""
    monkeypatch.setenv("JSMLA_CUDA_STAGING", "off")
