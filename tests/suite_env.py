"""What the test run found once, read by conftest and by the test modules: whether CUDA is there, and the seed of
the run's random data (``PXN_TEST_SEED`` replays one; otherwise fresh each run)."""
import os
import secrets

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    HAS_CUDA = False

SEED = int(os.environ.get("PXN_TEST_SEED", secrets.randbits(31)))
