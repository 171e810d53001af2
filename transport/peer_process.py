"""A helper process driven over a pipe: the peer side of ``pxn bench`` and of the two-process tests.

The child runs ``target(conn, *args)``: it sends one ``{"ok": True, ...}`` message once it is ready (or
``{"ok": False, "error": ...}``), then answers each ``(command, kwargs)`` with ``{"ok": True, "value": ...}`` or
``{"ok": False, "error": ...}``, and exits after ``"close"``. Processes are spawned (not forked) so the child
starts with a clean CUDA and thread state.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Callable, Optional, Tuple


class PeerProcess:
    """Start ``target`` in a spawned process and wait until it says it is ready.

    Arguments:
        target: the child's main function, called as ``target(conn, *args)``.
        args: its further arguments (picklable).
        name: the process name, also used in error messages.
        start_timeout: seconds to wait for the ready message (a child that dies earlier fails at once).
        call_timeout: default seconds ``call`` waits for an answer.
    Attributes:
        ready: the ready message (a dict; e.g. the peer's session id and buffer addresses).
    Raises:
        RuntimeError naming the process and the child's exit code or error.
    """

    def __init__(self, target: Callable, args: Tuple = (), name: str = "pxn-peer", start_timeout: float = 120.0,
                 call_timeout: float = 120.0):
        ctx = mp.get_context("spawn")
        self.name = name
        self.call_timeout = call_timeout
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True, name=name)
        self.proc.start()
        deadline = time.monotonic() + start_timeout
        while not self._conn.poll(0.2):  # a child that dies at start must not cost the whole timeout
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"{name} did not start (exit code {self.proc.exitcode}); a script that starts "
                                   f"it needs an `if __name__ == '__main__':` guard")
        msg = self._conn.recv()
        if not msg["ok"]:
            raise RuntimeError(f"{name} failed to start: {msg['error']}")
        self.ready = msg

    def call(self, cmd: str, timeout: Optional[float] = None, **kw):
        """Send a command and return the child's value; RuntimeError on a refusal or no answer in time."""
        timeout = self.call_timeout if timeout is None else timeout
        self._conn.send((cmd, kw))
        if not self._conn.poll(timeout):
            raise RuntimeError(f"{self.name} did not answer {cmd!r} within {timeout} s")
        msg = self._conn.recv()
        if not msg["ok"]:
            raise RuntimeError(f"{self.name} command {cmd!r} failed: {msg['error']}")
        return msg["value"]

    def close(self) -> None:
        """Ask the child to close, then make sure it is gone. Idempotent."""
        try:
            if self.proc.is_alive():
                self.call("close", timeout=30)
        except Exception:  # noqa: BLE001 - a dead or stuck child is killed below
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
