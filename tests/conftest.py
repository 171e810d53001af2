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

# Engines on loopback without a secret use the per-user secret file (transport.auth): the tests' own, in a fresh
# private directory, so a run neither reads nor creates one in the home directory (spawned peers inherit it).
if not os.environ.get("PXN_SECRET_FILE"):
    import tempfile
    os.environ["PXN_SECRET_FILE"] = os.path.join(tempfile.mkdtemp(prefix="pxn-test-secret-"), "secret")

# Fresh random data every run; the seed is printed so a failure can be replayed with PXN_TEST_SEED.
SEED = int(os.environ.get("PXN_TEST_SEED", secrets.randbits(31)))


def _seed_line() -> str:
    return f"pxn test seed: {SEED} (replay with PXN_TEST_SEED={SEED})"


def pytest_report_header(config):
    return [_seed_line(), f"cuda: {HAS_CUDA}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"]


# Skip reasons that carry a long install hint (the verbs fabric without pyverbs): the summary groups the skips
# under one short reason and prints the hint once, instead of once per test.
_HINTS_SEEN = set()


def _install_hints():
    try:
        from transport.fabric.verbs import INSTALL_HINT
    except Exception:  # noqa: BLE001 - a hint is a nicety; never break the run for it
        return ()
    return (INSTALL_HINT,)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not isinstance(report.longrepr, tuple) or len(report.longrepr) != 3:
        return
    path, _lineno, reason = report.longrepr
    for hint in _install_hints():
        if hint in reason:
            _HINTS_SEEN.add(hint)
            short = reason.replace(hint, "install hint at the end").replace("Skipped: ", "")
            report.longrepr = (path, None, short)


def pytest_unconfigure(config):
    # After pytest's own summary (the last lines CI shows), also with -q, which hides the header.
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is None:
        return
    for hint in sorted(_HINTS_SEEN):
        reporter.write_line(hint)
    reporter.write_line(_seed_line())


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
