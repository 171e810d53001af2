"""Batch and attempt records, and their accounting.

* ``Batch``: one call's pieces, how many units are left, its error and its completion event;
* ``Attempt``: one try of one unit on one rail (a failed-over unit gets a fresh attempt on another rail);
* ``Validated``: one batch's arguments once checked, with its regions and extremes: what every route takes;
* ``BatchHandle``: what ``batch_write_async`` returns;
* ``Accounts``: the one place a batch or a unit is counted done or failed (counters, latency window, trace).
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

from transport.errors import InvalidTransfer, TransferError
from transport.planner import COALESCED, DIRECT, RELAYED, Unit
from transport.telemetry import now_ns

if TYPE_CHECKING:  # annotations only
    from transport.fabric.base import WriteRequest
    from transport.peers import Peer, PeerRail
    from transport.relay import RelayRing

NOT_TAKEN = object()  # what a route returns for a batch it does not take (the next route gets it)

# a finished unit's two counters, by unit kind
PATH_COUNTERS = {kind: (f"path_{kind}_units", f"path_{kind}_bytes") for kind in (DIRECT, RELAYED, COALESCED)}


def batch_timeout(timeout, default: float, poll: bool = False) -> float:
    """The seconds a batch may take: ``timeout``, or ``default`` when it is None.

    Raises ``InvalidTransfer`` (a ``ValueError``) for anything but a finite number of seconds > 0, as the
    engine's constructor refuses such a ``timeout``; the caller checks it before anything is sent. ``poll``:
    0 is allowed too (a handle's ``wait(0)`` looks without waiting)."""
    if timeout is None:
        return default
    if timeout.__class__ is float and 0.0 < timeout < math.inf:
        return timeout  # the common case (the Mooncake API passes its rule's seconds), without the ABC test
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or not (timeout >= 0 if poll else timeout > 0):
        raise InvalidTransfer(f"timeout must be a finite number of seconds {'>=' if poll else '>'} 0, "
                              f"got {timeout!r}")
    return float(timeout)


@dataclass(slots=True)
class Validated:
    """A batch as ``Pipeline.submit`` checked it, once, for every route to decide on: its arrays (int64), the
    source devices (one int, or one per piece), each side's region table and the index of the region holding
    each piece (one index when one region holds them all), its extremes (smallest and largest length, the
    sources' and destinations' lowest address and highest end), its timings (ns: submitted, validated) and
    whether the caller waits for it (``async_`` False)."""

    peer: "Peer"
    src: Any
    dst: Any
    ln: Any
    devices: Any
    lsnap: Any
    idx: Any
    rsnap: Any
    ridx: Any
    nbytes: int
    lmin: int
    lmax: int
    smin: int
    send: int
    dmin: int
    dend: int
    one_region: bool  # one region on each side holds every piece (``idx`` and ``ridx`` are ints)
    t0: int
    t1: int
    async_: bool


class BatchHandle:
    """What ``batch_write_async`` returns: ``wait(timeout)`` raises the batch's error, ``done()`` polls."""

    def __init__(self, pipe, batch: "Batch", timeout: Optional[float]):
        self._pipe = pipe  # the data path that waits for the batch (``Pipeline.wait``)
        self._batch = batch
        self._timeout = timeout

    def done(self) -> bool:
        """True once the batch finished (successfully or not)."""
        pending = self._batch.pending
        if pending is not None:
            return pending.done()
        return self._batch.event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the batch. Arguments: timeout in seconds >= 0 (default: the one given at submission; 0: look
        without waiting).
        Raises the batch's ``TransferError`` (``TransferTimeout`` when it did not finish in time)."""
        self._pipe.wait(self._batch, batch_timeout(timeout, self._timeout, poll=True))

    @property
    def nbytes(self) -> int:
        return self._batch.nbytes


class Batch:
    __slots__ = ("id", "nbytes", "remaining", "event", "error", "t0", "lock", "srcs", "dsts", "lengths",
                 "peer", "n_items", "pending", "path", "spans", "checked", "reader", "counts")

    def __init__(self, bid: int, peer: "Peer", srcs, dsts, lengths, nbytes: int, event=None):
        self.id = bid
        self.peer = peer
        self.srcs, self.dsts, self.lengths = srcs, dsts, lengths
        self.n_items = len(lengths)
        self.nbytes = nbytes
        self.remaining = 0
        self.event = threading.Event() if event is None else event  # or another with set / is_set / wait
        self.error: Optional[BaseException] = None
        self.t0 = now_ns()
        self.lock = threading.Lock()
        self.pending = None  # load/store or inline path: the device work still running (gpu_copy.Pending)
        self.path = "loadstore"  # the path of ``pending``: "loadstore" or "inline" (``transport.inline``)
        self.spans = None  # (local snapshot, region index, peer snapshot, region index) when one region on each
        # side holds every piece (the validation's finding, reused for the write keys)
        self.checked: Optional[Validated] = None  # the validation's record when one region on each side holds
        # every piece: a WriteBatch of these same arrays carries its extremes
        self.reader = None  # (fabric, WriteRows) whose ack the submitting thread reads itself in ``_wait``
        self.counts = None  # counter updates of its submission, made with its wait's (``Pipeline.wait``)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def local_region(self, lsnap):
        """The local region holding every piece, as the validation found it, while ``lsnap`` is still the table
        it found it in (a table is replaced on every change, never edited: the same object means nothing
        changed); else None. Its key then serves every piece, with no lookup per piece."""
        spans = self.spans
        return lsnap.regions[spans[1]] if spans is not None and spans[0] is lsnap else None

    def peer_region(self, rsnap):
        """``local_region`` for the peer's regions (``rsnap``: a snapshot of the peer's table)."""
        spans = self.spans
        return rsnap.regions[spans[3]] if spans is not None and spans[2] is rsnap else None


class Attempt:
    """One try of one work unit on one rail. A failed-over unit gets a fresh attempt on another rail; the old
    one is marked cancelled and only gives its resources back when the fabric is done with them."""

    __slots__ = ("unit", "batch", "prail", "ring", "slot", "landing", "wr_id", "cancelled", "posted",
                 "write_done", "acked", "finished", "reqs", "completions", "pending", "demand", "landing_at")

    def __init__(self, completions, unit: Unit, batch: Batch, prail: "PeerRail"):
        self.completions = completions  # where the attempt ends (``transport.completions.Completions``)
        self.unit = unit
        self.batch = batch
        self.prail = prail
        self.ring: Optional["RelayRing"] = None
        self.slot = None
        self.landing: Optional[int] = None
        self.wr_id = 0
        self.cancelled = False
        self.posted = False
        self.write_done = False
        self.acked = False
        self.finished = False
        self.reqs: List["WriteRequest"] = []
        self.pending = 0  # writes posted and not completed
        self.demand = False  # counted in its rail's chunk_demand (a chunk that holds no credit yet)
        self.landing_at = (0, False)  # a chunk's (pool slot of its credit, whether more chunks wait for credits)

    def rows_acked(self) -> bool:
        """The fabric's ``on_acked`` of this attempt's ``WriteRows``: see ``Completions.rows_acked``."""
        return self.completions.rows_acked(self)

    def fail_local(self, exc: BaseException) -> None:
        """A copy into a slot failed (the ring gives the slot back): fail the batch, retire the attempt."""
        self.completions.fail(self, exc if isinstance(exc, TransferError)
                              else TransferError(f"local copy failed: {exc}", [exc]))


class Accounts:
    """Counts batches and units done or failed: the engine's counters, its latency window and the trace (None
    when off)."""

    def __init__(self, counters, latency, trace):
        self.counters = counters
        self.latency = latency
        self.trace = trace

    def done(self, name: str, t0: int, t: int, n_items: int, nbytes: int, ok: bool, path: Optional[str] = None,
             counted: bool = False) -> None:
        """A batch finished at ``t`` (ns; submitted at ``t0``): latency window, ok/failed count (unless the caller
        ``counted`` it with its own counters, one lock round fewer), trace event."""
        self.latency.add((t - t0) / 1e9)
        if not counted:
            self.counters.add("batches_ok" if ok else "batches_failed")
        if self.trace is not None:
            args = {"items": n_items, "bytes": nbytes}
            if path:
                args["path"] = path
            self.trace.complete(name, "batch", "batches", t0, t, args)

    def unit_done(self, b: Batch, u: Unit) -> None:
        """One unit of ``b`` succeeded (claimed once by its caller): count it, and the batch when it was the last."""
        if u.kind == COALESCED:
            self.counters.add_many((("chunks", 1), ("chunk_items", len(u.segs) if u.items is None
                                                    else int(u.items.size)), ("chunk_wire_bytes", u.wire_bytes)))
        with b.lock:
            b.remaining -= 1
            last = b.remaining == 0 and not b.event.is_set()
        units, nbytes = PATH_COUNTERS[u.kind]
        if not last:
            self.counters.add_many(((units, 1), (nbytes, u.nbytes)))
            return
        # the batch's ok count with the unit's counters: one lock round; then ``done`` of a counted batch, written
        # out (this runs once per batch on the message path, where a call and a name nobody traces cost)
        self.counters.add_many(((units, 1), (nbytes, u.nbytes), ("batches_ok", 1)))
        t = now_ns()
        self.latency.add((t - b.t0) / 1e9)
        if self.trace is not None:
            self.trace.complete(f"batch {b.id}", "batch", "batches", b.t0, t, {"items": b.n_items, "bytes": b.nbytes})
        b.event.set()

    def fail(self, b: Batch, exc: BaseException) -> None:
        """Fail ``b`` with ``exc`` unless it finished already; wakes its waiter."""
        with b.lock:
            if b.event.is_set():
                return
            b.error = exc
        self.counters.add("batches_failed")
        if self.trace is not None:
            self.trace.instant(f"batch {b.id} failed", "batch", "batches", {"error": str(exc)[:200]})
        b.event.set()
