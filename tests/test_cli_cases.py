"""How ``pxn`` and the engine answer a user's mistakes and interruptions: one line, a fitting exit status, no
traceback, and nothing run or written before the mistake is found. Each case is one a user met: a Ctrl-C, an
unwritable ``--json``, ``PXN_FABRIC``, a malformed ``PXN_*`` value, ``| head -1``, a shapes file's ``count``
and huge lengths, a negative timeout, ``stats()`` types, ``--version``, ``--hot -1``, the no-secret warning
and what ``make`` says while it installs."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from transport import bench_cli
from transport.config import EngineConfig
from transport.errors import ConfigError, InvalidTransfer
from transport.peer_process import PeerProcess, serve

REPO = Path(__file__).resolve().parents[1]


def pxn(*argv, env=None, timeout=300):
    """``pxn ARGV`` in a fresh interpreter, as a user runs it; returns (exit status, stdout, stderr)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    full.update(PYTHONPATH=str(REPO), **(env or {}))
    p = subprocess.run([sys.executable, "-m", "transport.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env=full)
    return p.returncode, p.stdout, p.stderr


def one_line(rc, err, status=2, *words):
    assert rc == status, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def small_shapes(tmp_path, seed):
    """A shapes file of a few odd-sized pieces: a run of ``pxn bench`` on it takes seconds."""
    import random
    rnd = random.Random(seed)
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [1, 63, rnd.randint(2, 9000)]},
                                          "mla_latent_1k": {"length": 4096 + rnd.randint(1, 999)}}}))
    return path


# --- 1. Ctrl-C: the peer process stays quiet ----------------------------------------------------------------
def _echo_main(conn):
    serve(conn, lambda: {"pid": os.getpid()}, lambda cmd, kw: kw, lambda: None)


def test_peer_process_ignores_sigint():
    """A Ctrl-C reaches every process of the terminal's group; the peer must leave it to its parent (which
    closes it) instead of dying with a traceback of its own."""
    with PeerProcess(_echo_main, name="pxn-test-echo") as peer:
        os.kill(peer.proc.pid, signal.SIGINT)
        time.sleep(0.5)  # the scenario: a window in which a peer that took the SIGINT would die (no event for "not")
        assert peer.proc.is_alive()
        assert peer.call("echo", x=7) == {"x": 7}
    assert not peer.proc.is_alive()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the parent's own handler is back


def test_ctrl_c_while_the_peer_process_starts_is_not_lost():
    """A Ctrl-C that comes while the peer process is being made reaches the parent as a KeyboardInterrupt once
    the start is over: not thrown away (SIGINT set to ignored for that window), and not raised inside the start
    (between the spawn and the hand-over of its start data, which leaves a child dying with a traceback). Another
    thread is running, as in the bench: the kernel may hand it the signal while the starting thread holds it."""
    import threading
    from transport.peer_process import _start_without_sigint

    class StartHit:
        finished = False

        def start(self):  # the Ctrl-C lands inside the start, which then has more to do
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                pass
            self.finished = True

    other = threading.Event()
    bystander = threading.Thread(target=other.wait, daemon=True)
    bystander.start()
    proc = StartHit()
    try:
        with pytest.raises(KeyboardInterrupt):
            _start_without_sigint(proc)
            time.sleep(1.0)  # where another thread took the signal, it is raised here at the latest
    finally:
        other.set()
    assert proc.finished, "the interrupt was raised inside the start"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_peer_process_starts_through_a_storm_of_ctrl_c(tmp_path):
    """SIGINT to the whole group every 2 ms while a fresh process makes its first peer process: the child's
    interpreter starts with SIGINT held, so it neither dies at start ("Fatal Python error: init_import_site",
    a ``KeyboardInterrupt`` traceback) nor later; the parent gets every Ctrl-C (its handler counts them) and its
    thread is left unblocked. A process's first spawn also starts multiprocessing's resource tracker, which
    unblocks SIGINT in the calling thread: hence a fresh process."""
    script = tmp_path / "storm.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading, time
        from transport.peer_process import PeerProcess, serve

        def _echo(conn):
            serve(conn, lambda: {"pid": os.getpid()}, lambda cmd, kw: kw, lambda: None)

        if __name__ == "__main__":
            seen = []
            signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
            stop = threading.Event()

            def storm():
                while not stop.wait(0.002):
                    os.killpg(os.getpgid(0), signal.SIGINT)
            threading.Thread(target=storm, daemon=True).start()
            try:
                with PeerProcess(_echo, name="pxn-test-storm") as peer:
                    time.sleep(0.3)  # the scenario: the child serving while the storm goes on
                    print(peer.call("echo", x=5)["x"], peer.proc.is_alive())
            finally:
                stop.set()
            print(len(seen) > 0, signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set()))
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120, start_new_session=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["5 True", "True False"], (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr


def _warning_main(conn):
    import logging
    logging.basicConfig(level=logging.WARNING, format="child %(levelname)s: %(message)s")
    serve(conn, lambda: {"pid": os.getpid()}, lambda cmd, kw: logging.getLogger("pxn.test").warning(kw["text"]),
          lambda: None)


def test_peer_process_is_quiet_after_a_ctrl_c(capfd):
    """After a Ctrl-C, which the parent reports in one line, the peer process logs nothing more (a connection
    its parent dropped is not news) and goes on answering until it is closed."""
    with PeerProcess(_warning_main, name="pxn-test-quiet") as peer:
        peer.call("warn", text="before the ctrl-c")
        assert "before the ctrl-c" in capfd.readouterr().err  # written before the answer
        os.kill(peer.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 10
        while True:  # the child's main thread runs the handler when its wait for a command is interrupted
            peer.call("warn", text="after the ctrl-c")
            err = capfd.readouterr().err
            if "after the ctrl-c" not in err or time.monotonic() > deadline:
                break
        assert peer.proc.is_alive()
    assert "after the ctrl-c" not in err, err


@pytest.mark.slow
def test_ctrl_c_during_bench_is_one_line(small_shapes):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.Popen([sys.executable, "-m", "transport.cli", "bench", "--fabric", "tcp", "--repeat", "100000",
                          "--shapes", str(small_shapes)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert "starting the peer" in p.stdout.readline()
        assert "aux_metadata" in p.stdout.readline()  # the peer is up and serving
        os.killpg(p.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "pxn bench: interrupted", err


# --- 2. --json / --plot checked before the run ---------------------------------------------------------------
def test_unwritable_json_refused_before_the_run(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    rc, out, err = pxn("bench", "--json", a_file / "out.json")
    line = one_line(rc, err, 2, "--json", "not a directory")
    assert "File exists" not in line
    assert "starting the peer" not in out
    rc, out, err = pxn("bench", "--json", tmp_path)
    one_line(rc, err, 2, "--json", "is a directory")
    rc, out, err = pxn("bench", "--plot", a_file / "deeper" / "x.png")
    one_line(rc, err, 2, "--plot", "does not exist")
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


# --- 3. PXN_FABRIC honoured by pxn bench, a bad value refused ------------------------------------------------
@pytest.mark.parametrize("value", ["foo", "TCP", "rdma"])
def test_bench_refuses_unknown_pxn_fabric(value):
    rc, out, err = pxn("bench", env={"PXN_FABRIC": value})
    one_line(rc, err, 2, "PXN_FABRIC", repr(value))
    assert "starting the peer" not in out


@pytest.mark.slow
@pytest.mark.parametrize("fabric", ["ipc", "tcp"])
def test_bench_runs_the_fabric_pxn_fabric_names(fabric, small_shapes, tmp_path):
    out_json = tmp_path / "run.json"
    rc, out, err = pxn("bench", "--quick", "--layers", 2, "--repeat", 1, "--shapes", small_shapes,
                       "--json", out_json, env={"PXN_FABRIC": fabric})
    assert rc == 0, out + err
    assert out.startswith(f"pxn bench: fabric {fabric} (PXN_FABRIC),"), out
    doc = json.loads(out_json.read_text())
    assert doc["fabric"] == fabric and doc["stats"]["engine"]["fabric"] == fabric
    assert {r["verified"] for r in doc["rows"]} == {"byte-exact"}
    # --fabric on the command line still wins over the variable
    rc, out, err = pxn("bench", "--fabric", "tcp", "--quick", "--layers", 2, "--repeat", 1,
                       "--shapes", small_shapes, env={"PXN_FABRIC": "foo"})
    assert rc == 0 and out.startswith("pxn bench: fabric tcp,"), out + err


# --- 4. a malformed PXN_* value is the user's error, named -----------------------------------------------------
@pytest.mark.parametrize("var,value", [("PXN_RAILS", "abc"), ("PXN_RAILS", "0"), ("PXN_LANDING_SLOTS", "-2"),
                                       ("PXN_TIMEOUT", "soon"), ("PXN_COALESCE_BYTES", "64Q"),
                                       ("PXN_ACK_SPIN_US", "fast"), ("PXN_SWITCH_INTERVAL", "-1"),
                                       ("PXN_SWITCH_INTERVAL", "0"), ("PXN_TRACE", "/proc/t.json")])
def test_bench_names_a_bad_pxn_variable(var, value, small_shapes):
    rc, out, err = pxn("bench", "--fabric", "tcp", "--shapes", small_shapes, env={var: value})
    line = one_line(rc, err, 2, f"pxn bench: error: environment variable {var}={value!r}: ")
    assert "unexpected" not in line and "pxn --traceback" not in line and "ConfigError" not in line
    assert out == ""  # refused before the header line


def test_config_error_is_a_value_error_naming_the_variable():
    with pytest.raises(ConfigError, match=r"PXN_LANES='0': lanes must be an int >= 1, got 0"):
        EngineConfig.from_env({"PXN_LANES": "0"})
    with pytest.raises(ValueError, match=r"PXN_RELAY='sometimes'"):
        EngineConfig.from_env({"PXN_RELAY": "sometimes"})
    with pytest.raises(ConfigError) as e:  # a constructor argument is named as the argument, not the variable
        EngineConfig.from_env({"PXN_LANES": "3"}, lanes=0)
    assert "PXN_LANES" not in str(e.value) and "lanes must be" in str(e.value)
    assert EngineConfig.from_env({"PXN_LANES": "0"}, lanes=2).lanes == 2  # a given argument hides the variable


# --- 5. | head -1 stops at once ------------------------------------------------------------------------------------
def test_bench_into_a_closed_pipe_stops_at_once():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.Popen([sys.executable, "-m", "transport.cli", "bench", "--fabric", "tcp", "--repeat", "1000"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = p.stdout.readline()
        p.stdout.close()  # like `pxn bench | head -1`: the reader leaves after the first line
        t0 = time.monotonic()
        rc = p.wait(timeout=120)
        waited = time.monotonic() - t0
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert first.startswith(b"pxn bench: fabric tcp")
    line = one_line(rc, "\n".join(l for l in err.splitlines() if "no shared secret" not in l), 2, "broken pipe")
    assert "BrokenPipeError" not in line
    assert waited < 10, f"took {waited:.1f} s to notice the closed pipe"


# --- 6. shapes files: count honoured, huge lengths refused up front -------------------------------------------
def test_shapes_count_is_honoured(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [64, 7]},
                                          "mla_latent_1k": {"count": 5, "length": 4099},
                                          "mla_latent_8k": {"length": 1001}}}))
    shapes = {s["name"]: s for s in bench_cli.sglang_shapes(path=str(path))}
    assert len(shapes["mla_latent_1k (5x4099)"]["len"]) == 5
    assert len(shapes[f"mla_latent_8k ({bench_cli.DEFAULT_LAYERS}x1001)"]["len"]) == bench_cli.DEFAULT_LAYERS
    names = [s["name"] for s in bench_cli.sglang_shapes(layers=3, path=str(path))]  # --layers wins
    assert "mla_latent_1k (3x4099)" in names and "mla_latent_8k (3x1001)" in names


@pytest.mark.parametrize("count", [0, -1, "many", 1.5, True, 1 << 20])
def test_shapes_bad_count_is_refused(tmp_path, count):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [64]},
                                          "mla_latent_8k": {"count": count, "length": 4096}}}))
    rc, out, err = pxn("bench", "--shapes", path)
    one_line(rc, err, 2, "calls.mla_latent_8k.count", repr(count))
    assert "starting the peer" not in out


@pytest.mark.slow
def test_shapes_huge_length_is_refused_naming_the_entry(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [64]},
                                          "mla_latent_1k": {"length": 1 << 40}}}))
    rc, out, err = pxn("bench", "--shapes", path)
    one_line(rc, err, 2, "calls.mla_latent_1k.length", str(1 << 40))
    assert "starting the peer" not in out and "MemoryError" not in err
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [64, 1 << 33]}}}))
    rc, out, err = pxn("bench", "--shapes", path)
    one_line(rc, err, 2, "calls.aux_metadata.lengths[1]")


def test_shapes_larger_than_memory_are_refused_before_the_peer_starts(tmp_path):
    path = tmp_path / "s.json"  # each piece is allowed; together, 65536 x 4 GiB, they fit no machine
    path.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [64]},
                                          "mla_latent_1k": {"count": 1 << 16, "length": 1 << 32}}}))
    rc, out, err = pxn("bench", "--fabric", "tcp", "--shapes", path)
    one_line(rc, err, 2, "memory", "mla_latent_1k (65536x4294967296)")
    assert "starting the peer" not in out


# --- 7 and 8. the engine: a negative timeout refused, stats() of plain numbers ----------------------------------
@pytest.fixture(scope="module")
def pair():
    from transport.engine import TransferEngine
    with TransferEngine(fabric="tcp", rails=1) as a, TransferEngine(fabric="tcp", rails=1) as b:
        src = np.arange(4096, dtype=np.uint32).view(np.uint8).copy()
        dst = np.full(len(src), 0x5A, dtype=np.uint8)
        a.register(src.ctypes.data, len(src))
        b.register(dst.ctypes.data, len(dst))
        yield a, b, src, dst


@pytest.mark.parametrize("timeout", [-1, 0, -0.5, float("nan"), float("inf"), "5", True])
def test_batch_timeout_must_be_positive(pair, timeout):
    a, b, src, dst = pair
    dst.fill(0x5A)
    args = (b.session_id, [src.ctypes.data + 3], [dst.ctypes.data + 5], [1001])
    with pytest.raises(InvalidTransfer, match="timeout must be") as e:
        a.batch_write(*args, timeout=timeout)
    assert repr(timeout) in str(e.value)
    with pytest.raises(InvalidTransfer, match="timeout must be"):
        a.batch_write_async(*args, timeout=timeout)
    with pytest.raises(InvalidTransfer, match="timeout must be"):
        a.batch_read(b.session_id, [src.ctypes.data], [dst.ctypes.data], [8], timeout=timeout)
    assert (dst == 0x5A).all()  # nothing was written
    handle = a.batch_write_async(*args)
    if timeout == 0:
        handle.wait(30)
        handle.wait(0)  # on a handle, 0 looks without waiting
    else:
        with pytest.raises(InvalidTransfer, match="timeout must be"):
            handle.wait(timeout)
    handle.wait()
    assert bytes(dst[5:1006]) == bytes(src[3:1004]) and dst[4] == 0x5A and dst[1006] == 0x5A


def test_stats_holds_plain_python_values(pair):
    a, b, src, dst = pair
    a.batch_write(b.session_id, [src.ctypes.data + 1, src.ctypes.data + 900], [dst.ctypes.data + 2,
                                                                                dst.ctypes.data + 1700], [77, 301])
    plain = (int, float, str, bool, type(None))
    for eng in (a, b):
        stack = [("stats()", eng.stats())]
        seen = 0
        while stack:
            where, v = stack.pop()
            if isinstance(v, dict):
                stack += [(f"{where}[{k!r}]", x) for k, x in v.items()]
            elif isinstance(v, (list, tuple)):
                stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
            else:
                assert type(v) in plain, f"{where} is {type(v).__name__}"
                seen += 1
        assert seen > 20
    json.dumps(a.stats())  # and serialises as it is


def test_plain_converts_numpy_scalars_inside_containers():
    from transport.engine import _plain
    out = _plain({"a": np.float64(1.5), "b": [np.int64(3), (np.bool_(True), 2.0)], "c": "x"})
    assert out == {"a": 1.5, "b": [3, (True, 2.0)], "c": "x"}
    assert type(out["a"]) is float and type(out["b"][0]) is int and type(out["b"][1][0]) is bool


# --- 9 and 10. --version, topo --hot ----------------------------------------------------------------------------
def test_version():
    import re
    rc, out, err = pxn("--version")
    assert rc == 0 and err == ""
    init = (REPO / "transport" / "__init__.py").read_text()
    assert out.strip() == "pxn " + re.search(r'^__version__ = "([^"]+)"', init, re.M)[1]
    assert "VERSION" in (REPO / "setup.py").read_text()  # setup.py installs under the same number


def test_topo_hot_negative_or_absent(tmp_path):
    rc, out, err = pxn("topo", "--hot", -1)
    one_line(rc, err, 2, "--hot -1")
    assert out == ""
    empty = tmp_path / "root"
    (empty / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (empty / "sys" / "class" / "infiniband").mkdir(parents=True)
    rc, out, err = pxn("topo", "--sysfs", empty, "--hot", 0)
    one_line(rc, err, 2, "--hot 0", "no GPU")


def test_topo_hot_beyond_the_gpus(tmp_path):
    from sysfs_builder import build_tree
    build_tree(tmp_path / "root", "h800_32port.json")
    rc, out, err = pxn("topo", "--sysfs", tmp_path / "root", "--hot", 8)
    one_line(rc, err, 2, "--hot 8", "GPUs 0..7")
    rc, out, err = pxn("topo", "--sysfs", tmp_path / "root", "--hot", 7)
    assert rc == 0, err


# --- 11. a no-secret warning only where it matters, once per process ---------------------------------------------
def test_no_secret_warning_once_per_process_and_once_per_bench(small_shapes):
    """On loopback without a secret the engines share the per-user secret file: no warning at all, in a program
    or in ``pxn bench``. Without a secret on another address (``insecure=True``): one warning for the process,
    however many engines it makes."""
    code = ("import logging; logging.basicConfig()\n"
            "from transport.engine import TransferEngine\n"
            "with TransferEngine(fabric='tcp') as a, TransferEngine(fabric='tcp') as b: pass\n"
            "with TransferEngine(fabric='tcp', hostname='0.0.0.0', insecure=True) as a, "
            "TransferEngine(fabric='tcp', hostname='0.0.0.0', insecure=True) as b: pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_") or k == "PXN_SECRET_FILE"}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    warnings = [ln for ln in p.stderr.splitlines() if ln.startswith("WARNING") and "shared secret" in ln]
    assert len(warnings) == 1 and "insecure" in warnings[0], p.stderr
    rc, out, err = pxn("bench", "--fabric", "tcp", "--quick", "--layers", 2, "--repeat", 1, "--shapes", small_shapes)
    assert rc == 0, out + err
    assert "shared secret" not in err, err  # loopback: the per-user secret, nothing to warn of


# --- 12. make says what it installs ---------------------------------------------------------------------------------
def test_make_install_says_what_it_is_doing(tmp_path):
    """``make bench`` on a fresh machine: each pip step is announced before it runs (a stand-in python that
    has nothing installed records the calls instead of installing)."""
    fake = tmp_path / "python"
    log = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    "case \"$1\" in -c) exit 1;; esac\nexit 0\n")
    fake.chmod(0o755)
    p = subprocess.run(["make", "-s", "-C", str(REPO), "install", f"PYTHON={fake}", f"SYSTEM_PYTHON={fake}"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    calls = log.read_text()
    assert "-m pip install -q torch==" in calls and "-m pip install -q -e .[test]" in calls, calls
    said = p.stdout.splitlines()
    assert any("torch" in line and "install" in line for line in said), p.stdout
    assert any("pxn" in line and "install" in line for line in said), p.stdout
