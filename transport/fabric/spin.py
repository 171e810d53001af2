"""Adaptive busy waiting before a thread sleeps on a socket (tcp fabric).

A thread that blocks in ``recv`` or ``poll`` and is woken by the peer's message pays a wake-up (on a VM, an
interrupt to an idle virtual CPU) on its critical path, and the peer's send pays for waking it. Reading the socket
without sleeping for a short while first saves both when the message comes within that while -- and costs a core
meanwhile, which is only free when the host has one to spare: a spinning thread on a busy host takes the core the
peer needs to answer.

``AdaptiveSpin`` keeps a spin on only while it pays: each wait reports whether what it waited for came within the
spin (``hit``); a window of waits with too many misses, or a window in which the waiting thread spent more than a
small share of its time runnable but waiting for a core (its ``run_delay`` in ``/proc/thread-self/schedstat``: the
host has no core to spare), turns the spin off for a number of waits that doubles while the condition holds, after
which a window of spins tries again. Counters say what it did (``stats``). Its state is updated without a lock by
whichever thread waits: a race can only shift a decision by a wait.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

_tls = threading.local()


class _SchedStat:
    """This thread's ``/proc/thread-self/schedstat``, opened once (the file stays bound to the thread that opened
    it) and closed when the thread's local storage goes."""

    __slots__ = ("fd", "last")

    def __init__(self):
        try:
            self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = -1
        self.last = None  # (monotonic ns, run delay ns) at the last reading

    def __del__(self):
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass


def run_delay_share() -> Optional[float]:
    """The share of the wall time since this thread's last call that the thread spent runnable but waiting for a
    core (the second field of its schedstat); None on its first call and where the file is not readable (then only
    the misses decide)."""
    st = _tls.__dict__.get("schedstat")
    if st is None:
        st = _tls.schedstat = _SchedStat()
    if st.fd < 0:
        return None
    try:
        delay = int(os.pread(st.fd, 64, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None
    now = time.monotonic_ns()
    last, st.last = st.last, (now, delay)
    if last is None or now <= last[0]:
        return None
    return (delay - last[1]) / (now - last[0])


class AdaptiveSpin:
    """Whether, and until when, a waiting thread spins before it sleeps. ``budget``: seconds of one spin at most
    (0: never spin). ``until(now)`` gives the deadline of the spin of a wait starting at ``now`` (0.0: do not spin);
    a wait that spun reports ``done(hit)``."""

    WINDOW = 32  # spins per decision
    MISSES = 8  # misses in a window that turn the spin off (a wait that outlasts the spin pays spin and wake-up)
    BUSY_SHARE = 0.1  # share of a window the waiting thread may wait for a core before the host counts as busy
    BACKOFF_MIN = 64  # waits without spinning after a window that turned it off; doubles each such window
    BACKOFF_MAX = 4096

    __slots__ = ("budget", "_n", "_misses", "_skip", "_backoff", "spins", "hits", "offs", "busy_offs")

    def __init__(self, budget: float):
        if not 0.0 <= float(budget) <= 1.0:
            raise ValueError(f"spin budget must be seconds in [0, 1], got {budget!r}")
        self.budget = float(budget)
        self._n = self._misses = self._skip = 0
        self._backoff = self.BACKOFF_MIN
        self.spins = self.hits = self.offs = self.busy_offs = 0

    @property
    def on(self) -> bool:
        """The next wait spins."""
        return self.budget > 0.0 and not self._skip

    def until(self, now: float) -> float:
        if self._skip:
            self._skip -= 1
            if not self._skip:
                run_delay_share()  # the next window's share counts from here, not from the last window spun
            return 0.0
        budget = self.budget
        return now + budget if budget else 0.0

    def done(self, hit: bool) -> None:
        self.spins += 1
        self._n += 1
        if hit:
            self.hits += 1
        else:
            self._misses += 1
            if self._misses > self.MISSES:  # enough misses for this window already
                self._off(False)
                return
        if self._n >= self.WINDOW:
            share = run_delay_share()
            if share is not None and share > self.BUSY_SHARE:
                self._off(True)
            else:
                self._n = self._misses = 0
                self._backoff = self.BACKOFF_MIN

    def _off(self, busy: bool) -> None:
        self._n = self._misses = 0
        self._skip = self._backoff
        self._backoff = min(2 * self._backoff, self.BACKOFF_MAX)
        self.offs += 1
        if busy:
            self.busy_offs += 1

    def stats(self) -> dict:
        return {"budget_us": self.budget * 1e6, "spins": self.spins, "hits": self.hits, "offs": self.offs,
                "busy_offs": self.busy_offs, "on": self.on}
