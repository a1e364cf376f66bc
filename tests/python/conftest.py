"""pytest configuration for the mla-kernels Python suite (CPU reference backend and CUDA kernels).

* registers the `cuda` marker: such tests are skipped, with a visible reason, when no CUDA device
  is available;
* the `device` fixture runs a test once on "cpu" and once on "cuda" (id "cuda", marked `cuda`, so
  `-k cuda` selects the CUDA runs and `-m "not cuda"` leaves them out). Tests build their inputs on
  the CPU (the float64 reference stays there) and move the library's inputs to `device`;
* seeds torch per test from the test's node id, without its cpu/cuda part: the CPU and the CUDA run
  of a test see the same inputs, and CPU inputs are the same as before the device split.
"""

import os
import re
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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=["cpu", "cuda"])
def device(request):
    """Where the library's inputs live and its kernels run: "cpu" or "cuda"."""
    return request.param


_DEVICE_ID = re.compile(r"^(cpu|cuda)$")


def _seed_key(nodeid: str) -> str:
    """The node id without a cpu / cuda parameter id: `test_x[case-cuda]` -> `test_x[case]`,
    `test_x[cpu]` -> `test_x`."""
    m = re.match(r"^(.*?)\[(.*)\]$", nodeid)
    if not m:
        return nodeid
    parts = [p for p in m.group(2).split("-") if not _DEVICE_ID.match(p)]
    return m.group(1) + (f"[{'-'.join(parts)}]" if parts else "")


@pytest.fixture(autouse=True)
def _seed(request):
    seed = zlib.crc32(_seed_key(request.node.nodeid).encode())
    torch.manual_seed(seed)
    yield seed
