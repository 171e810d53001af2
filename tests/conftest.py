"""Test set-up: without a GPU, Triton kernels run through Triton's CPU interpreter; without pyverbs, the verbs
fabric runs on softverbs where it is found.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is created, so it is set here, before the
test modules import pxn_kernels. GPU-only tests carry the ``gpu`` marker and skip without CUDA.

softverbs (a software model of pyverbs v59 and of RC verbs semantics) is looked for at ``PXN_SOFTVERBS`` or at
``../shared/softverbs`` beside the checkout. Where it is found and no real pyverbs is importable, it is put on
the path of this process and of every process it starts, with the device list ``SOFTVERBS_DEVICES`` (unless
set): a GID-less RoCE port first, as on machines where only some ports carry an address, then one with a GID.
"""
import importlib.util
import os
import sys
import tempfile

import pytest

from suite_env import HAS_CUDA, SEED

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

SOFTVERBS_DEVICES = "mlx5_0:1:eth:nogid,mlx5_1:1:eth:gid"


def _use_softverbs() -> str:
    """Put softverbs on the path where it is found and pyverbs is not importable; returns how verbs runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PXN_SOFTVERBS") or os.path.join(os.path.dirname(root), "shared", "softverbs")
    if importlib.util.find_spec("pyverbs") is not None:
        return "pyverbs (installed)"
    if not os.path.isdir(os.path.join(path, "pyverbs")):
        return f"none (no pyverbs, no softverbs at {path})"
    sys.path.insert(0, path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("SOFTVERBS_DEVICES", SOFTVERBS_DEVICES)
    os.environ.setdefault("SOFTVERBS_DIR", tempfile.mkdtemp(prefix="pxn-softverbs-"))
    return f"softverbs, devices {os.environ['SOFTVERBS_DEVICES']}"


VERBS = _use_softverbs()

# Engines on loopback without a secret use the per-user secret file (transport.auth): the tests' own, in a fresh
# private directory, so a run neither reads nor creates one in the home directory (spawned peers inherit it).
if not os.environ.get("PXN_SECRET_FILE"):
    os.environ["PXN_SECRET_FILE"] = os.path.join(tempfile.mkdtemp(prefix="pxn-test-secret-"), "secret")

# Fresh random data every run (suite_env.SEED); the seed is printed so a failure can be replayed with PXN_TEST_SEED.

def _seed_line() -> str:
    return f"pxn test seed: {SEED} (replay with PXN_TEST_SEED={SEED})"


def pytest_report_header(config):
    return [_seed_line(), f"cuda: {HAS_CUDA}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}",
            f"verbs: {VERBS}"]


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


@pytest.fixture(autouse=True, scope="module")
def _switch_interval_per_module():
    """The Mooncake layer's ``initialize`` sets the process's switch interval (``integration.mooncake``); each test
    module starts from the interpreter's own value, whatever ran before it."""
    old = sys.getswitchinterval()
    yield
    sys.setswitchinterval(old)
