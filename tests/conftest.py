import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # tests/gradcheck.py and friends


def pytest_collection_modifyitems(config, items):
    from mpitrain.backend import gpu_available
    no_gpu = pytest.mark.skip(reason="no GPU visible to CuPy")
    no_torch = pytest.mark.skip(reason="torch is not installed (.ci/run installs it)")
    has_gpu = gpu_available()
    has_torch = importlib.util.find_spec("torch") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(no_gpu)
        if "torch" in item.keywords and not has_torch:
            item.add_marker(no_torch)
