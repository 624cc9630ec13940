"""pytest setup: the repository root on sys.path, GPU tests skipped without a Hopper GPU.
Shared helpers live in tests/helpers.py."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
