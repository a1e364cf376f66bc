"""pytest configuration for the mla-kernels Python suite (CPU reference backend).

* registers the `cuda` marker: such tests are skipped, with a visible reason, when no CUDA device
  is available;
* seeds torch per test from the test's node id, so inputs are fresh for every test but
  reproducible run to run.
"""

import os
import sys
import zlib

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped when none is available)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield seed
