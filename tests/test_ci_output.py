"""What CI shows at the end of a run (``pytest -q``, which hides the header): the seed to replay the run's
random data, and the pyverbs install hint once, not once per skipped verbs case."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_pytest(*args, seed="4242"):
    env = dict(os.environ, PXN_TEST_SEED=seed)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_seed_is_the_last_line_with_q():
    rc, out = run_pytest("tests/test_doc_snippets.py::test_collector_reads_fences", seed="4242")
    assert rc == 0, out
    assert out.strip().splitlines()[-1] == "pxn test seed: 4242 (replay with PXN_TEST_SEED=4242)"


def test_pyverbs_hint_once():
    try:
        import pyverbs  # noqa: F401
        return  # verbs cases run here instead of skipping: nothing to collapse
    except ImportError:
        pass
    from transport.fabric.verbs import INSTALL_HINT
    rc, out = run_pytest("tests/test_fabric_conformance.py", "-k", "verbs")
    assert rc == 0, out
    assert out.count(INSTALL_HINT) == 1, out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED") and "pyverbs" in line]
    assert len(skipped) == 1 and "install hint at the end" in skipped[0], out
    assert int(re.match(r"SKIPPED \[(\d+)\]", skipped[0]).group(1)) > 1, skipped[0]  # many cases, one line


def test_ci_runs_the_slow_cases_too():
    """CI (``.ci/run``) runs ``make test``, whose pytest selects no marker, and pytest.ini's options deselect
    nothing: the ``slow`` cases run there; only a developer's ``-m "not slow"`` leaves them out."""
    import configparser
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), re.M)
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe and "pytest" in recipe.group(1), "no pytest in make test's recipe"
    args = recipe.group(1).split("pytest", 1)[1].split()
    assert "-m" not in args and "-k" not in args, recipe.group(1)
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    addopts = ini.get("pytest", "addopts", fallback="")
    assert "-m" not in addopts.split() and "-k" not in addopts.split(), addopts
    used = sum(p.read_text().count("@pytest.mark.slow") for p in (REPO / "tests").glob("test_*.py"))
    assert used > 0, "the slow marker is declared in pytest.ini and used by no test"
