"""Telemetry: counters, time per relay-slot state, bytes per rail, batch latency percentiles, Chrome trace.

Everything here is cheap enough to stay on in production: a state change is two ``perf_counter_ns`` reads and a
few additions under the owner's lock. The optional trace (``PXN_TRACE=<file>`` or ``trace_path=``) records one
Chrome trace "complete" event per slot state and per batch, bounded by ``max_events``, and is written as JSON at
``close()`` (open it in chrome://tracing or https://ui.perfetto.dev).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Dict, List, Optional

import numpy as np

log = logging.getLogger(__name__)

# Slot states, in the order a slot goes through them (FREE -> FILLING -> READY -> POSTED -> [WAITING] -> FREE).
FREE, FILLING, READY, POSTED, WAITING = "free", "filling", "ready", "posted", "waiting"
SLOT_STATES = (FREE, FILLING, READY, POSTED, WAITING)


now_ns = time.perf_counter_ns  # the clock of every span and latency (ns); bound, not wrapped: no Python frame


class Trace:
    """Collects Chrome trace events; thread-safe; written once at ``write()``."""

    def __init__(self, path: str, max_events: int = 2_000_000):
        self.path = path
        self.max_events = max_events
        self._events: List[dict] = []
        self._lock = threading.Lock()
        self._dropped = 0
        self._t0 = now_ns()
        self._pid = os.getpid()

    def complete(self, name: str, cat: str, tid: str, start_ns: int, end_ns: int, args: Optional[dict] = None):
        ev = {"name": name, "cat": cat, "ph": "X", "pid": self._pid, "tid": tid,
              "ts": (start_ns - self._t0) / 1000.0, "dur": max(0.0, (end_ns - start_ns) / 1000.0)}
        if args:
            ev["args"] = args
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(ev)
            else:
                self._dropped += 1

    def instant(self, name: str, cat: str, tid: str, args: Optional[dict] = None):
        ev = {"name": name, "cat": cat, "ph": "i", "s": "t", "pid": self._pid, "tid": tid,
              "ts": (now_ns() - self._t0) / 1000.0}
        if args:
            ev["args"] = args
        with self._lock:
            if len(self._events) < self.max_events:
                self._events.append(ev)

    def write(self) -> None:
        with self._lock:
            events = list(self._events)
            dropped = self._dropped
        meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": f"pxn engine {self._pid}"}}]
        try:
            with open(self.path, "w", encoding="utf-8") as f:
                json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms",
                           "otherData": {"dropped_events": dropped}}, f)
            log.info("wrote %d trace events to %s", len(events), self.path)
        except OSError as e:
            log.error("cannot write trace %s: %s", self.path, e)


class SlotStats:
    """Per-slot counters: how often each state was entered and the total time spent in it."""

    __slots__ = ("counts", "time_ns", "state", "since")

    def __init__(self):
        self.counts = {s: 0 for s in SLOT_STATES}
        self.time_ns = {s: 0 for s in SLOT_STATES}
        self.state = FREE
        self.since = now_ns()

    def enter(self, state: str, t: int) -> int:
        """Switch to ``state`` at time ``t``; returns when the previous state began."""
        prev_since = self.since
        self.time_ns[self.state] += t - prev_since
        self.counts[state] += 1
        self.state = state
        self.since = t
        return prev_since

    def to_dict(self) -> dict:
        t = now_ns()
        time_ns = dict(self.time_ns)
        time_ns[self.state] += t - self.since  # include the current state so far
        return {"state": self.state, "counts": dict(self.counts),
                "time_s": {k: round(v / 1e9, 6) for k, v in time_ns.items()}}


class LatencyWindow:
    """The last ``size`` batch latencies, for percentiles."""

    def __init__(self, size: int = 100_000):
        self._values = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self.count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._values.append(seconds)
            self.count += 1

    def summary(self) -> dict:
        with self._lock:
            values = np.fromiter(self._values, dtype=np.float64, count=len(self._values))
            count = self.count
        if values.size == 0:
            return {"count": count, "p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None,
                    "mean_ms": None}
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {"count": count, "p50_ms": round(p50 * 1e3, 4), "p90_ms": round(p90 * 1e3, 4),
                "p99_ms": round(p99 * 1e3, 4), "max_ms": round(float(values.max()) * 1e3, 4),
                "mean_ms": round(float(values.mean()) * 1e3, 4)}


class Counters:
    """Named counters (ints or float seconds) behind one lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: Dict[str, float] = collections.defaultdict(int)

    def add(self, name: str, value=1) -> None:
        with self._lock:
            self._values[name] += value

    def add_many(self, pairs) -> None:
        with self._lock:
            for name, value in pairs:
                self._values[name] += value

    def get(self, name: str):
        with self._lock:
            return self._values.get(name, 0)

    def to_dict(self) -> dict:
        with self._lock:
            return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in sorted(self._values.items())}
