"""Test set-up: without a GPU, Triton kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is created, so it is set here, before the
test modules import pxn_kernels. GPU-only tests carry the ``gpu`` marker and skip without CUDA.
"""
import os
import secrets

import pytest

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fresh random data every run; the seed is printed so a failure can be replayed with PXN_TEST_SEED.
SEED = int(os.environ.get("PXN_TEST_SEED", secrets.randbits(31)))


def pytest_report_header(config):
    return [f"pxn test seed: {SEED} (replay with PXN_TEST_SEED={SEED})",
            f"cuda: {HAS_CUDA}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"]


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    return SEED
