"""Every test module stands alone: none imports another test module or conftest (what they share lives in the
``*_helpers`` modules and ``suite_env``), and each collects in a process of its own, from the repository root and
from another directory, as ``python -m pytest tests/test_x.py`` does when a developer runs one file."""
import ast
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
MODULES = sorted(TESTS.glob("test_*.py"))


def _imported_names(path: pathlib.Path) -> set:
    """Top-level names of the modules ``path`` imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another_or_conftest():
    """A test module importing another one (or conftest) runs that module's code in its own collection, ties the
    two together and breaks when either moves; shared code goes in a helper module."""
    test_names = {p.stem for p in MODULES} | {"conftest"}
    found = {p.name: sorted(_imported_names(p) & test_names - {p.stem})
             for p in sorted(TESTS.glob("*.py")) if p.name != "conftest.py"}
    found = {name: got for name, got in found.items() if got}
    assert not found, f"test modules imported by other modules of tests/: {found}"


def _collect(module: pathlib.Path, cwd: pathlib.Path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(module)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return module.name, str(cwd), p.returncode, (p.stdout + p.stderr)[-2000:]


@pytest.mark.slow
def test_every_module_collects_alone(tmp_path):
    """Each ``tests/test_*.py`` collected by itself (a fresh interpreter each), from the repository root and from
    an unrelated directory: no collection error, and at least one test (a module whose tests all skip still
    collects them)."""
    jobs = [(m, cwd) for m in MODULES for cwd in (ROOT, tmp_path)]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda job: _collect(*job), jobs))
    # exit 0: tests collected, none errored (2 is a collection error, 5 no test at all)
    bad = [f"{name} (from {cwd}): exit {rc}\n{out}" for name, cwd, rc, out in results if rc != 0]
    assert not bad, "\n\n".join(bad)
