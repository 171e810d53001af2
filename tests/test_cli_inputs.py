"""``pxn`` starts light and checks every input before it works: ``import transport`` and plain commands run where
torch cannot be imported, a Ctrl-C at any moment is one line, sizes have bounds that name the limit, output
paths (``--json``, ``--plot``, ``PXN_TRACE``) are refused before the run, and each refusal speaks in one voice:
``pxn <command>: error: <what>: <why>``."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BLOCKER = textwrap.dedent("""\
    # Loaded at start (sitecustomize): torch and Triton cannot be imported in this interpreter.
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "triton"):
                raise ImportError("planted: %s cannot be imported here" % name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    """)


def _env(extra_path=None, **more):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (extra_path, REPO) if p)
    env.update(more)
    return env


def pxn(*argv, env=None, timeout=300):
    p = subprocess.run([sys.executable, "-m", "transport.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env=env or _env())
    return p.returncode, p.stdout, p.stderr


def one_line(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err and "unexpected" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    assert "Error:" not in lines[0], lines[0]  # no class names (ConfigError: ...)
    return lines[0]


@pytest.fixture
def no_torch(tmp_path):
    """A folder holding a sitecustomize that blocks torch and Triton, to put first on PYTHONPATH."""
    folder = tmp_path / "no_torch"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return folder


# --- light to start --------------------------------------------------------------------------------------------
def test_the_blocker_blocks(no_torch):
    p = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, timeout=60,
                       env=_env(no_torch))
    assert p.returncode != 0 and "planted: torch cannot be imported" in p.stderr


def test_import_transport_without_torch(no_torch):
    code = ("import sys, transport, transport.topology, transport.config, transport.errors, transport.cli, "
            "transport.topo_cli, transport.bench_cli, pxn_kernels, pxn_kernels.chunk\n"
            "from transport import ConfigError, PeerGone, TransferError\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
            "assert not heavy, heavy\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=_env(no_torch))
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("argv,start", [(["--version"], "pxn "), (["topo", "--help"], "usage: pxn topo"),
                                        (["bench", "--help"], "usage: pxn bench"), (["--help"], "usage: pxn")])
def test_plain_commands_without_torch(no_torch, argv, start):
    rc, out, err = pxn(*argv, env=_env(no_torch))
    assert rc == 0 and err == "", err
    assert out.startswith(start), out


def test_topo_runs_without_torch(no_torch, tmp_path):
    from sysfs_builder import build_tree
    build_tree(tmp_path / "root", "h800_32port.json")
    rc, out, err = pxn("topo", "--sysfs", tmp_path / "root", env=_env(no_torch))
    assert rc == 0, err
    assert "GPU7" in out


def test_kernels_still_load_on_first_use():
    """The lazy package gives the same names as before: ``pxn_kernels.gather`` is the function, not the module."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    import pxn_kernels
    assert callable(pxn_kernels.gather) and callable(pxn_kernels.scatter) and callable(pxn_kernels.copy)
    assert pxn_kernels.gather.__module__ == "pxn_kernels.gather"
    assert pxn_kernels.chunk.__name__ == "pxn_kernels.chunk"
    with pytest.raises(AttributeError, match="no_such_name"):
        pxn_kernels.no_such_name  # noqa: B018
    assert set(pxn_kernels.__all__) <= set(dir(pxn_kernels))


@pytest.mark.slow
@pytest.mark.parametrize("fabric", ["tcp", "auto"])  # auto imports torch (seconds, partly in C++) to look for CUDA
def test_ctrl_c_at_any_moment_is_one_line(tmp_path, seed, fabric):
    """SIGINT to the whole group at moments from ``main``'s start on (the subcommand's import, the parsing, the
    peer's start, the run): one line, never a traceback, and the status a shell shows as 130. (Before ``main``:
    the interpreter's start and the few milliseconds of ``import transport.cli``, CPython answers by itself.)"""
    import json
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [1, 63, 4097]}}}))
    start = ("import sys; from transport.cli import main; print('started', flush=True); "
             "sys.exit(main(sys.argv[1:]))")
    rnd = random.Random(seed)
    for delay in [0.0, 0.005, 0.02] + sorted(rnd.uniform(0.05, 3.0) for _ in range(4)):
        p = subprocess.Popen([sys.executable, "-c", start, "bench", "--fabric", fabric, "--repeat", "100000",
                              "--shapes", str(shapes)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert p.stdout.readline() == "started\n"
            time.sleep(delay)  # the scenario: the SIGINT comes this long after main started
            os.killpg(p.pid, signal.SIGINT)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, f"after {delay:.3f} s: {err}"
        assert err.strip() == "pxn bench: interrupted", f"after {delay:.3f} s: {err}"
        # 130, or killed by SIGINT (CPython re-raises it at exit when an interrupt stopped code it ran, e.g.
        # inside torch's import): a shell shows both as 130.
        assert p.returncode in (130, -signal.SIGINT), (delay, p.returncode)


def test_ctrl_c_swallowed_by_a_callback_still_stops_the_run(tmp_path):
    """CPython swallows an exception raised inside a weakref callback or ``__del__`` ("Exception ignored in: ..."):
    a Ctrl-C that lands in one (the import system's module-lock callback, say) must still stop the run, with
    the one line and no trace of the swallowed one. The subcommand here makes the interrupt land in a callback
    every time, then works for a minute."""
    (tmp_path / "pxn_spin_cmd.py").write_text(textwrap.dedent("""
        import os, signal, time, weakref

        def add_arguments(parser):
            pass

        def run(args):
            class Thing:
                pass
            thing = Thing()
            keep = weakref.ref(thing, lambda ref: os.kill(os.getpid(), signal.SIGINT))
            del thing  # the callback runs here; the handler's KeyboardInterrupt is raised inside it
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)
            print("ran to the end", keep)
            return 0
    """))
    start = ("import sys; from transport import cli; "
             "cli.SUBCOMMANDS['spin'] = ('pxn_spin_cmd', 'a test subcommand'); sys.exit(cli.main(['spin']))")
    began = time.monotonic()
    p = subprocess.run([sys.executable, "-c", start], cwd=REPO, env=_env(str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    took = time.monotonic() - began
    assert "ran to the end" not in p.stdout, f"the interrupt was lost; stderr: {p.stderr}"
    assert p.stderr.strip() == "pxn spin: interrupted", p.stderr
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert took < 50, took


# --- bounds ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option,value,limit", [("--rails", 1000, "64"), ("--rails", 65, "64"),
                                                ("--repeat", 10 ** 7, "1000000"), ("--layers", 1 << 17, "65536")])
def test_sizes_have_bounds_that_name_the_limit(option, value, limit):
    rc, out, err = pxn("bench", "--fabric", "tcp", option, value)
    line = one_line(rc, err, f"pxn bench: error: {option} {value}:", limit)
    assert out == "", line  # nothing started


def test_pxn_rails_has_the_same_bound():
    rc, out, err = pxn("bench", "--fabric", "tcp", env=_env(PXN_RAILS="1000"))
    one_line(rc, err, "PXN_RAILS='1000'", "64")
    assert out == ""


# --- environment errors: before the header, named, no class --------------------------------------------------------
@pytest.mark.parametrize("var,value,words", [
    ("PXN_SWITCH_INTERVAL", "-1", ["(0, 1]"]), ("PXN_SWITCH_INTERVAL", "nan", []),
    ("PXN_RAILS", "abc", ["not a valid int"]), ("PXN_FABRIC", "foo", ["not a fabric"]),
    ("PXN_TIMEOUT", "0", ["timeout must be > 0"]), ("PXN_TRACE", "/proc/pxn-trace.json", ["/proc", "proc"]),
])
def test_environment_errors_come_before_any_work(var, value, words):
    rc, out, err = pxn("bench", env=_env(**{var: value}))
    one_line(rc, err, "pxn bench: error: environment variable", f"{var}={value!r}:", *words)
    assert out == ""  # not even the header line


# --- output paths ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("path,why", [("/proc/pxn-out.x", "proc file system"), ("/sys/pxn-out.x", "sysfs"),
                                      ("/proc/self/status", "proc file system")])
def test_kernel_file_systems_are_refused(option, path, why):
    rc, out, err = pxn("bench", "--fabric", "tcp", option, path)
    one_line(rc, err, f"pxn bench: error: {option} {path}: cannot write there:", why)
    assert out == ""


def test_missing_folder_is_refused_not_made(tmp_path):
    for option in ("--json", "--plot"):
        target = tmp_path / "missing" / "out.x"
        rc, out, err = pxn("bench", "--fabric", "tcp", option, target)
        one_line(rc, err, f"{option} {target}: cannot write there: folder {tmp_path / 'missing'} does not exist")
    # the plot beside --json is checked too
    rc, out, err = pxn("bench", "--fabric", "tcp", "--json", tmp_path / "a.json", "--plot", tmp_path / "none" / "p")
    one_line(rc, err, "--plot")
    assert list(tmp_path.iterdir()) == []  # nothing made, not even a probe


def test_unwritable_reasons(tmp_path):
    from transport.config import unwritable
    assert unwritable(tmp_path / "new.json") is None and not (tmp_path / "new.json").exists()
    (tmp_path / "old.json").write_text("keep")
    assert unwritable(tmp_path / "old.json") is None and (tmp_path / "old.json").read_text() == "keep"
    assert unwritable(tmp_path) == "it is a directory"
    assert unwritable(tmp_path / "old.json" / "x") == f"{tmp_path / 'old.json'} is not a directory"
    assert "does not exist" in unwritable(tmp_path / "no" / "x")
    assert "not a regular file" in unwritable("/dev/null")
    assert "proc" in unwritable("/proc/x") and "sysfs" in unwritable("/sys/x")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        assert "cannot create a file there" in unwritable(ro / "x")


def test_engine_refuses_a_bad_trace_path_at_once(tmp_path):
    from transport.config import EngineConfig
    from transport.errors import ConfigError
    with pytest.raises(ConfigError, match=r"PXN_TRACE='/proc/t.json'.*proc file system"):
        EngineConfig.from_env({"PXN_TRACE": "/proc/t.json"})
    with pytest.raises(ConfigError, match=r"trace_path .*nowhere.*does not exist"):
        EngineConfig.from_env({}, trace_path=str(tmp_path / "nowhere" / "t.json"))
    assert EngineConfig.from_env({"PXN_TRACE": str(tmp_path / "t.json")}).trace_path == str(tmp_path / "t.json")


def test_a_peer_error_is_one_line_without_class_names():
    from transport.bench_cli import _one_line
    peer = RuntimeError("pxn-bench-peer failed to start: ConfigError: environment variable PXN_LANES='0': lanes "
                        "must be an int >= 1, got 0\nTraceback (most recent call last):\n  File ...")
    assert _one_line(peer) == ("pxn-bench-peer failed to start: environment variable PXN_LANES='0': lanes must be an "
                               "int >= 1, got 0")
    assert _one_line(FileNotFoundError(2, "No such file or directory", "/x/y.json")) == \
        "No such file or directory: /x/y.json"


@pytest.mark.parametrize("var,value,limit", [("PXN_LANDING_BYTES", "100G", "68719476736"),
                                             ("PXN_RELAY_SLOT_BYTES", "2G", "1073741824"),
                                             ("PXN_RELAY_SLOTS", "100000", "1024"), ("PXN_LANES", "1000", "64"),
                                             ("PXN_RAILS", "65", "64")])
def test_settings_that_size_memory_have_upper_bounds(var, value, limit):
    from transport.config import EngineConfig
    from transport.errors import ConfigError
    with pytest.raises(ConfigError, match=rf"{var}='{value}': \w+ must be at most {limit}, got"):
        EngineConfig.from_env({var: value})
