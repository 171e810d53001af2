"""One progress thread for an engine's background work, in the manner of NCCL's proxy thread.

Its work is of two kinds:

* tasks handed to it (``submit``), run in the order given: the receiver's landed chunks, the failed completions of
  a fabric that reports completions by callback (in order per rail), the posts of units re-dispatched after a
  failover;
* duties run every so often (``every``): the receiver's sweep of departed senders, the rails' watchdogs.

Why one thread: a thread for each of these would be idle nearly all the time, and every thread of an engine is one
more contender for the GIL. A task must not block for long: it delays every task
behind it. None of the tasks above waits for the network or for another task.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, List

log = logging.getLogger(__name__)


class ProgressLoop:
    """A thread that runs submitted tasks in order and periodic duties (see the module docstring).

    Arguments:
        name: the thread's name.
    Tasks and duties that raise are logged and do not stop the loop. ``close()`` stops it (idempotent); tasks still
    queued then are dropped.
    """

    def __init__(self, name: str = "pxn-progress"):
        self.name = name
        self._cv = threading.Condition()
        self._tasks: collections.deque = collections.deque()
        self._duties: List[list] = []  # [period s, fn, next due (monotonic s)]
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` in the loop's thread, after every task submitted before it."""
        with self._cv:
            self._tasks.append((fn, args))
            self._cv.notify()

    def every(self, period_s: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in the loop's thread about every ``period_s`` seconds (> 0), between tasks."""
        if not period_s > 0:
            raise ValueError(f"ProgressLoop.every: period_s must be > 0, got {period_s!r}")
        with self._cv:
            self._duties.append([float(period_s), fn, time.monotonic() + period_s])
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._tasks and not self._closed:
                    if self._duties:
                        wait = min(d[2] for d in self._duties) - time.monotonic()
                        if wait <= 0:
                            break
                        self._cv.wait(wait)
                    else:
                        self._cv.wait()
                if self._closed:
                    return
                tasks = list(self._tasks)
                self._tasks.clear()
                duties = list(self._duties)
            now = time.monotonic()
            for duty in duties:
                if now >= duty[2]:
                    duty[2] = now + duty[0]
                    try:
                        duty[1]()
                    except Exception:  # noqa: BLE001 — one failing duty must not stop the others
                        log.exception("%s: %r failed", self.name, duty[1])
            for fn, args in tasks:
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 — one failing task must not stop the loop
                    log.exception("%s: %r failed", self.name, fn)

    def close(self) -> None:
        """Stop the thread (after the task it is running, if any) and wait for it, at most 2 s."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
