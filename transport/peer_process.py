"""A helper process driven over a pipe: the peer side of ``pxn bench`` and of the two-process tests.

The child runs ``target(conn, *args)``: it sends one ``{"ok": True, ...}`` message once it is ready (or
``{"ok": False, "error": ...}``), then answers each ``(command, kwargs)`` with ``{"ok": True, "value": ...}`` or
``{"ok": False, "error": ...}``, and exits after ``"close"``. Processes are spawned (not forked) so the child
starts with a clean CUDA and thread state.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing import resource_tracker
from typing import Callable, Optional, Tuple

import numpy as np

POISON = 0x5A
"""Byte value peers fill their buffers with before a write, so unwritten and stray bytes both show."""


def digest(arr) -> str:
    """Hash of a host byte array (compare a peer's whole buffer without shipping it)."""
    return hashlib.blake2b(memoryview(arr), digest_size=20).hexdigest()


class Buffer:
    """Host (numpy) or GPU (torch, ``device >= 0``) bytes with a raw address: a peer's or a sender's memory.

    Filled with ``fill`` (default ``POISON``), or with seeded random bytes when ``random_seed`` is given.
    """

    def __init__(self, nbytes: int, device: int, fill: Optional[int] = None, random_seed: Optional[int] = None):
        self.nbytes = nbytes
        self.device = device
        if device < 0:
            if random_seed is not None:
                self.arr = np.frombuffer(np.random.default_rng(random_seed).bytes(nbytes), dtype=np.uint8).copy()
            else:
                self.arr = np.full(nbytes, POISON if fill is None else fill, dtype=np.uint8)
            self.addr = self.arr.ctypes.data
        else:
            import torch
            if random_seed is not None:
                g = torch.Generator(device=f"cuda:{device}").manual_seed(random_seed)
                self.arr = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=f"cuda:{device}", generator=g)
            else:
                self.arr = torch.full((nbytes,), POISON if fill is None else fill, dtype=torch.uint8,
                                      device=f"cuda:{device}")
            self.addr = self.arr.data_ptr()

    def host(self) -> np.ndarray:
        """The bytes on the host (a copy for GPU memory, after the device's pending work)."""
        if self.device < 0:
            return self.arr
        return self.arr.cpu().numpy()

    def fill(self, value: int) -> None:
        self.arr.fill(value) if self.device < 0 else self.arr.fill_(value)


def _error(exc: BaseException) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}


def serve(conn, start: Callable[[], dict], handle: Callable[[str, dict], object], close: Callable[[], None]):
    """The child's side of ``PeerProcess``.

    Arguments:
        conn: the pipe end ``PeerProcess`` passed as the target's first argument.
        start: sets the child up; its dict goes into the ready message (``PeerProcess.ready``).
        handle: ``handle(command, kwargs)`` -> the value sent back; raise to refuse (the caller gets the error).
        close: called on the ``"close"`` command, after which the child returns.
    """
    try:
        ready = start()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(_error(exc))
        return
    conn.send({"ok": True, **ready})
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "close":
                close()
                conn.send({"ok": True, "value": None})
                break
            conn.send({"ok": True, "value": handle(cmd, kw)})
        except BaseException as exc:  # noqa: BLE001
            conn.send(_error(exc))


def _start_without_sigint(proc) -> None:
    """Start ``proc`` with SIGINT blocked in it until its first call (``_child_main``) says what SIGINT does there.

    A Ctrl-C at a terminal goes to every process of the foreground group: the child would die with a
    ``KeyboardInterrupt`` traceback of its own while the parent is still reporting the interruption. The
    signal mask is inherited through fork and exec, so the child's interpreter starts with SIGINT held; the
    parent then closes (or kills) the child itself.

    The parent holds a Ctrl-C that comes while the child is made and raises it once ``start`` has returned:
    raised inside it, between the spawn and the hand-over of the child's start data, the child would die with
    a traceback ("EOFError: Ran out of input"); setting SIGINT to ignored instead would throw it away."""
    # multiprocessing starts its resource tracker at a process's first spawn and then unblocks SIGINT in the
    # calling thread (``resource_tracker.ensure_running`` ends with SIG_UNBLOCK): started first, it leaves the
    # block below alone
    resource_tracker.ensure_running()
    held = []
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    # (another thread: the handler runs in the main thread, never inside this start; a handler set outside
    # Python, or none, is left alone)
    swap = handler is not None and handler is not signal.SIG_IGN
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    if swap:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        proc.start()
    finally:
        if swap:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if held:  # the parent's own handler now, as if the Ctrl-C came at this moment (it wins over an error)
            signal.raise_signal(signal.SIGINT)


def _wake_only(signum, frame) -> None:
    """The child's Python handler of SIGINT: stops nothing. It exists because the wake-up fd is written only for
    a signal Python handles (one set to ignored is thrown away by the kernel); the watch on that fd
    (``_quiet_when_woken``) does what a Ctrl-C means here."""


def _quiet_when_woken(fd: int) -> None:
    """The child's answer to SIGINT: the Ctrl-C reached its parent too, which reports it (one line) and closes the
    child, so what the child would log from here on (a connection its parent dropped mid-handshake, a batch cut
    short) is not news. The signal's C handler writes to ``fd`` at once, even while the main thread is inside a
    long C call (where a Python handler would wait), and this thread turns the logging off before another thread
    of the child can log what the parent's interruption causes. The child goes on serving until it is closed."""
    try:
        if os.read(fd, 64):
            logging.disable(logging.CRITICAL)
    except OSError:
        pass


def _child_main(target: Callable, conn, *args) -> None:
    """The child's first call: SIGINT, held since the start (``_start_without_sigint``), silences the child's
    logging and stops nothing (``_wake_only``, ``_quiet_when_woken``); then ``target``."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGINT, _wake_only)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    # started while SIGINT is still held here, which the watch keeps: the kernel hands the signal to the main
    # thread, whose C handler writes the wake-up byte
    threading.Thread(target=_quiet_when_woken, args=(wake_r,), name="pxn-peer-ctrl-c", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    target(conn, *args)


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
        self.proc = ctx.Process(target=_child_main, args=(target, child, *args), daemon=True, name=name)
        _start_without_sigint(self.proc)
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
