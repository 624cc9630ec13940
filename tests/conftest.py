"""Shared test helpers: bitwise comparison means bytes."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def row_mismatches(a, b):
    """(number of rows whose bytes differ, max_abs_diff over finite entries)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = bits(a) != bits(b)
    rows = diff.reshape(diff.shape[0], -1).any(axis=1).sum() if diff.ndim else int(diff)
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[np.isfinite(d)]
    return int(rows), float(d.max()) if d.size else 0.0


def assert_bitwise_equal(a, b, what=""):
    rows, mad = row_mismatches(a, b)
    assert rows == 0, f"{what}: {rows} rows differ in bytes, max_abs_diff={mad}"


def _has_hopper():
    from pallas_kernels import is_available  # the backend's own rule: a CUDA GPU of cc 9.x

    return is_available()


def pytest_collection_modifyitems(config, items):
    if _has_hopper():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
