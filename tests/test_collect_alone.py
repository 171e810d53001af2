"""Every test module stands alone: none imports another test module or conftest (what they share lives in the
``*_helpers`` modules and ``suite_env``), and each collects in a process of its own, from the repository root and
from another directory, as ``python -m pytest tests/test_x.py`` does when a developer runs one file."""
import ast
import json
import os
import pathlib
import subprocess
import sys

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


# One clean interpreter imports what every collection imports anyway (torch, numpy, pytest: seconds each time) and
# forks a child per collection; nothing of pxn or of tests/ is imported before the fork, so each child collects its
# module as alone as a fresh ``python -m pytest`` would (its own sys.path, cwd, conftest and imports).
_FORKER = r"""
import json, os, sys
import numpy, pytest, torch  # noqa: F401  (loaded once, before any fork)
jobs, workers, out_dir = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
running, results = {}, {}
def reap():
    pid, status = os.wait()
    results[running.pop(pid)] = os.waitstatus_to_exitcode(status)
for i, (module, cwd) in enumerate(jobs):
    while len(running) >= workers:
        reap()
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(out_dir, f"{i}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(cwd)
        sys.path[0] = cwd  # as python -m pytest run there
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", module])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(rc))
    running[pid] = i
while running:
    reap()
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_module_collects_alone(tmp_path):
    """Each ``tests/test_*.py`` collected by itself (a child process each), from the repository root and from
    an unrelated directory: no collection error, and at least one test (a module whose tests all skip still
    collects them)."""
    jobs = [(str(m), str(cwd)) for m in MODULES for cwd in (ROOT, tmp_path / "elsewhere")]
    (tmp_path / "elsewhere").mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    workers = max(1, min(4, os.cpu_count() or 1))
    p = subprocess.run([sys.executable, "-c", _FORKER, json.dumps(jobs), str(workers), str(logs)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout + p.stderr
    codes = {int(i): rc for i, rc in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    # exit 0: tests collected, none errored (2 is a collection error, 5 no test at all)
    bad = [f"{pathlib.Path(m).name} (from {cwd}): exit {codes.get(i)}\n{(logs / f'{i}.log').read_text()[-2000:]}"
           for i, (m, cwd) in enumerate(jobs) if codes.get(i) != 0]
    assert not bad, "\n\n".join(bad)
