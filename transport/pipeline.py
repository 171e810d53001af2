"""The data path of ``TransferEngine``: a batch's lifecycle from validation to its last completion.

``Pipeline`` holds the engine's methods that move a batch (the engine composes it; the state they use, such as
the rails, the rings and the in-flight table, belongs to the engine object):

* submission: argument checks, region lookups, the plan (``transport.planner``), the load/store shortcut;
* dispatch: attempts per unit, direct units posted by the caller, chunks and relayed pieces to the relay rings;
* the copy thread's fill of a slot (gather into a chunk, or relayed pieces into the slot) and landing credits;
* posts (one doorbell per rail endpoint, ``WriteBatch`` where the fabric takes it) and completions (by the
  fabric's callback, failures in order through the engine's progress loop), acks of chunks, finishing a unit;
* failure handling: a failed rail's work re-dispatched on another rail, a batch failed with every cause, a peer
  forgotten when every rail to it failed;
* waiting for a batch.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import socket
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from transport.arrays import distinct
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, InvalidTransfer, PeerLost, RegionError,
                              RemoteRejected, TransferError, TransferTimeout)
from transport.fabric.base import (DEVICE_HOST, GatherWrite, Opcode, RegionSpans, WriteBatch, WriteBounds,
                                   WriteRequest)
from transport.fabric.gpu_copy import Pending
from transport.fabric.memory import MEMCPY_MAX, memcpy_async
from transport.packing import gpu_pack, gpu_pack_large, host_memmove
from transport.planner import COALESCED, DIRECT, RELAYED, Unit
from transport.receiver import ACK_BYTES, ACK_FLAG, ACK_WR_BASE, ST_OK, chunk_imm, decode_ack, decode_ack_payload
from transport.regions import first_bad, locate_inside, span_region
from transport.smallbatch import submit_rows
from transport.telemetry import POSTED, WAITING, now_ns

if TYPE_CHECKING:  # annotations only: the engine module imports this one
    from transport.engine import TransferEngine, _Peer, _PeerRail
    from transport.relay import RelayRing

log = logging.getLogger("transport.engine")  # one logger for the engine and its data path


_SPANS_MEMO = 64  # batch layouts over several regions remembered per engine (Pipeline._region_spans)
_READ_MAX = 3600.0  # seconds a caller reads its own ack at most without a timeout (then it waits as any other)
WATCHDOG_S = 0.1  # seconds between two runs of a rail's watchdog
_PATH_COUNTERS = {kind: (f"path_{kind}_units", f"path_{kind}_bytes") for kind in (DIRECT, RELAYED, COALESCED)}


def _group_direct(units: List[Unit]) -> List[Unit]:
    """One DIRECT unit per (rail, device) holding every direct piece planned for it (its runs concatenated): one
    attempt, one post and one completion (a ``WriteBatch``, or selective signaling), where one unit per piece cost
    a unit, an attempt, a write request and a completion in Python for every piece, most of a call of many pieces
    (benchmarks/NOTES.md, "The message path on two GPUs"). Failover re-sends the whole group, which rewrites the
    same bytes. Other units keep their place."""
    groups: Dict[Tuple[int, int], List[Unit]] = {}
    out: list = []  # units, and the keys of the groups in the place of their first unit
    for u in units:
        if u.kind != DIRECT:
            out.append(u)
            continue
        key = (u.rail, u.device)
        g = groups.get(key)
        if g is None:
            groups[key] = [u]
            out.append(key)
        else:
            g.append(u)
    return [k if isinstance(k, Unit) else _merge_direct(groups[k]) for k in out]


def _merge_direct(units: List[Unit]) -> Unit:
    """One DIRECT unit of the given units' pieces, in order."""
    if len(units) == 1:
        return units[0]
    parts = [u.arrays() for u in units]
    runs = tuple(np.concatenate([p[i] for p in parts]) for i in range(3))
    u0 = units[0]
    return Unit(DIRECT, u0.device, u0.rail, u0.relay_device, sum(u.nbytes for u in units), src=u0.src, dst=u0.dst,
                wire_bytes=sum(u.wire_bytes or u.nbytes for u in units), runs=runs)


def batch_timeout(timeout, default: float, poll: bool = False) -> float:
    """The seconds a batch may take: ``timeout``, or ``default`` when it is None.

    Raises ``InvalidTransfer`` (a ``ValueError``) for anything but a finite number of seconds > 0, as the
    engine's constructor refuses such a ``timeout``; the caller checks it before anything is sent. ``poll``:
    0 is allowed too (a handle's ``wait(0)`` looks without waiting)."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or not (timeout >= 0 if poll else timeout > 0):
        raise InvalidTransfer(f"timeout must be a finite number of seconds {'>=' if poll else '>'} 0, "
                              f"got {timeout!r}")
    return float(timeout)


class BatchHandle:
    """What ``batch_write_async`` returns: ``wait(timeout)`` raises the batch's error, ``done()`` polls."""

    def __init__(self, engine: "TransferEngine", batch: "_Batch", timeout: Optional[float]):
        self._engine = engine
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
        self._engine._wait(self._batch, batch_timeout(timeout, self._timeout, poll=True))

    @property
    def nbytes(self) -> int:
        return self._batch.nbytes


class _Batch:
    __slots__ = ("id", "nbytes", "remaining", "event", "error", "t0", "lock", "srcs", "dsts", "lengths",
                 "peer", "n_items", "pending", "path", "spans", "extremes", "reader")

    def __init__(self, bid: int, peer: "_Peer", srcs, dsts, lengths, nbytes: int, event=None):
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
        self.path = "loadstore"  # the path of ``pending``: "loadstore" or "inline" (``_write_inline``)
        self.spans = None  # (local snapshot, region index, peer snapshot, region index) when one region on each
        # side holds every piece (the validation's finding, reused for the write keys)
        self.extremes = None  # the validation's (smallest length, largest, smallest source, largest source end,
        # smallest destination, largest destination end): a WriteBatch of these same arrays carries them
        self.reader = None  # (fabric, WriteRows) whose ack the submitting thread reads itself in ``_wait``

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


class _Attempt:
    """One try of one work unit on one rail. A failed-over unit gets a fresh attempt on another rail; the old
    one is marked cancelled and only gives its resources back when the fabric is done with them."""

    __slots__ = ("unit", "batch", "prail", "ring", "slot", "landing", "wr_id", "cancelled", "posted",
                 "write_done", "acked", "finished", "reqs", "engine", "pending")

    def __init__(self, engine, unit: Unit, batch: _Batch, prail: "_PeerRail"):
        self.engine = engine
        self.unit = unit
        self.batch = batch
        self.prail = prail
        self.ring: Optional[RelayRing] = None
        self.slot = None
        self.landing: Optional[int] = None
        self.wr_id = 0
        self.cancelled = False
        self.posted = False
        self.write_done = False
        self.acked = False
        self.finished = False
        self.reqs: List[WriteRequest] = []
        self.pending = 0  # writes posted and not completed

    def rows_acked(self) -> bool:
        """The fabric's ``on_acked`` of this attempt's ``WriteRows``: see ``Pipeline._rows_acked``."""
        return self.engine._rows_acked(self)

    def fail_local(self, exc: BaseException) -> None:
        """A copy into a slot failed (the ring gives the slot back): fail the batch, retire the attempt."""
        self.engine._fail_batch(self.batch, exc if isinstance(exc, TransferError)
                                else TransferError(f"local copy failed: {exc}", [exc]))
        self.engine._drop(self)


def _split_inline(atts: List[_Attempt], ring: RelayRing, from_engine: bool) -> Tuple[List[_Attempt], List[_Attempt]]:
    """(inline, queued), each in the order of ``atts``: on an ordered ring relayed pieces are filled and posted in
    the calling thread (it only enqueues GPU work), except when the engine redispatches them (a poller must keep
    polling); everything else goes to the ring's copy thread (chunks wait for the peer's landing credits, and
    their posts for their fills on the host)."""
    if not ring.ordered or from_engine:
        return [], atts
    inline, queued = [], []
    for a in atts:
        (inline if a.unit.kind == RELAYED else queued).append(a)
    return inline, queued


class Pipeline:
    """The engine's data path (see the module docstring); mixed into ``TransferEngine``."""

    # --- submission ----------------------------------------------------------------------------------------
    @staticmethod
    def _as_array(name: str, values) -> np.ndarray:
        """int64 array of a sequence of ints (list, tuple, numpy array, CPU tensor); anything else (floats,
        bools, strings, nested lists) raises InvalidTransfer naming the first bad entry."""
        if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
            return values  # the common case of callers with many pieces: nothing to convert or check
        if hasattr(values, "tolist") and not isinstance(values, np.ndarray):  # torch tensor
            values = values.tolist()
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError) as e:
            raise InvalidTransfer(f"{name}: not a sequence of ints: {e}") from None
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1:
            raise InvalidTransfer(f"{name} must be a flat sequence of ints, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            # numpy picked float / bool / object: name the first entry that is not an int
            for i, v in enumerate(values if isinstance(values, (list, tuple)) else arr.tolist()):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")
            raise InvalidTransfer(f"{name}: entries do not fit 64 bits")
        if arr.dtype.kind == "i" and isinstance(values, (list, tuple)) and int(arr.min()) <= 1:
            # numpy turns [4096, True] into ints: only a 0 or 1 can be a bool in disguise, so only then look
            for i, v in enumerate(values):
                if v.__class__ is bool:
                    raise InvalidTransfer(f"{name}[{i}] = {v!r} is not an int")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) >= 1 << 63:
            i = int(np.argmax(arr))
            raise InvalidTransfer(f"{name}[{i}] = {int(arr[i])} does not fit a 64-bit address")
        return arr.astype(np.int64, copy=False)

    @classmethod
    def _as_arrays(cls, *named) -> tuple:
        """``_as_array`` of each ``(name, values)`` pair; the arrays must have one length, else InvalidTransfer
        naming them and their lengths."""
        arrays = tuple([cls._as_array(name, values) for name, values in named])
        n = arrays[0].size
        if any(a.size != n for a in arrays):
            names = [name for name, _ in named]
            raise InvalidTransfer(f"{', '.join(names[:-1])} and {names[-1]} must have the same length, got "
                                  f"{', '.join(str(a.size) for a in arrays)}")
        return arrays

    def _submit(self, session_id, srcs, dsts, lengths, async_: bool = False) -> Optional[_Batch]:
        self._check_open()
        if self._rows and lengths.__class__ in (list, tuple):
            # a few small pieces: transport.smallbatch
            batch = submit_rows(self, session_id, srcs, dsts, lengths, read_ack=not async_)
            if batch is not None:
                return batch
        t0 = now_ns()
        src, dst, ln = self._as_arrays(("srcs", srcs), ("dsts", dsts), ("lengths", lengths))
        if ln.size == 0:
            self._peer(session_id)  # an unknown session is an error even for an empty batch
            return None
        # One pass of reductions serves the argument checks and the common case of the region lookups below
        # (every source in one registered buffer, every destination in one of the peer's): per-call host time
        # is the cost that matters for small batches, and each numpy call has a fixed cost of its own
        # (benchmarks/NOTES.md, "Engine").
        # rows: src, dst, lengths; two axis reductions instead of six whole-array ones. Each side's pieces lie in
        # [smallest start, largest start + longest length): a span holding all of them, the exact one when the
        # lengths are equal, which is what the one-region lookups below need; the ends themselves are summed only
        # when that span is not inside one region (two passes over the batch fewer in the common case:
        # benchmarks/NOTES.md, "Fewer passes over a batch's arrays").
        n = ln.size
        rows = np.empty((3, n), dtype=np.int64)
        rows[0], rows[1], rows[2] = src, dst, ln
        smin, dmin, lmin = rows.min(axis=1).tolist()
        smax, dmax, lmax = rows.max(axis=1).tolist()
        send, dend = smax + lmax, dmax + lmax
        if lmin < 1:
            i = int(np.argmin(ln))
            raise InvalidTransfer(f"lengths[{i}] = {int(ln[i])}: every length must be >= 1")
        for name, arr, lo in (("srcs", src, smin), ("dsts", dst, dmin)):
            if lo < 0:
                i = int(np.argmin(arr))
                raise InvalidTransfer(f"{name}[{i}] = {int(arr[i])} is negative")
        peer = self._peer(session_id)
        writer = peer.loadstore
        if writer is not None and writer.stale():
            self._refresh_regions(peer)  # the peer deregistered something: never write by a stale list
        # sources: every piece inside one local region
        lsnap = self._regions.snapshot()
        idx = span_region(lsnap, smin, smax, send, lmax)
        if idx is None and send < 1 << 63:  # no end wraps in int64: src + ln holds every true end
            idx, send = self._locate_ends(lsnap, src, ln, smin, smax, lmin, lmax, send)
        if idx is None:
            idx, ok = self._regions.locate(src, ln, lsnap)
            if not ok.all():
                i = first_bad(ok)
                raise AddressNotRegistered(f"srcs[{i}] = 0x{int(src[i]):x} + lengths[{i}] = {int(ln[i])} is not inside "
                                      f"a region registered with this engine")
        devices = lsnap.devices[idx]  # a scalar when one region holds every source
        # destinations: every piece inside a region the peer advertised (refresh once: it may have registered
        # more since the handshake)
        rsnap = peer.regions.snapshot()
        ridx = span_region(rsnap, dmin, dmax, dend, lmax)
        if ridx is None and dend < 1 << 63:
            ridx, dend = self._locate_ends(rsnap, dst, ln, dmin, dmax, lmin, lmax, dend)
        if ridx is None:
            ridx, ok = peer.regions.locate(dst, ln, rsnap)
            if not ok.all():
                self._refresh_regions(peer)
                rsnap = peer.regions.snapshot()
                ridx, ok = peer.regions.locate(dst, ln, rsnap)
                if not ok.all():
                    i = first_bad(ok)
                    raise AddressNotRegistered(f"dsts[{i}] = 0x{int(dst[i]):x} + lengths[{i}] = {int(ln[i])} is "
                                          f"outside every region session {session_id} registered; nothing was "
                                          f"written")
        t1 = now_ns()
        nbytes = lmin * n if lmin == lmax else int(ln.sum())
        if writer is not None and peer.connected():
            try:
                pending = writer.write(src, dst, ln, devices, ridx, rsnap, wait=not async_,
                                       length_stats=(nbytes, lmin, lmax))
            except TransferError:
                self.counters.add_many((("batches_submitted", 1), ("batches_failed", 1)))
                raise
            if pending is not None:
                t2 = now_ns()
                counts = [("batches_submitted", 1), ("items", int(ln.size)), ("bytes", nbytes),
                          ("path_loadstore_units", 1), ("path_loadstore_bytes", nbytes),
                          ("time_validate_s", (t1 - t0) / 1e9), ("time_loadstore_s", (t2 - t1) / 1e9)]
                if not async_:  # already complete: account for it here, nothing to wait for
                    counts.append(("batches_ok", 1))
                    self.counters.add_many(counts)
                    self._account_done("batch", t0, t2, int(ln.size), nbytes, True, "loadstore", counted=True)
                    return None
                self.counters.add_many(counts)
                batch = _Batch(next(self._batch_ids), peer, src, dst, ln, nbytes)
                batch.pending = pending
                return batch
        one_region = getattr(idx, "ndim", 0) == 0 and getattr(ridx, "ndim", 0) == 0
        if self._inline:
            extremes = (lmin, lmax, smin, send, dmin, dend)
            if one_region:
                pending = self._write_inline(peer, src, dst, ln, int(devices), lsnap.regions[idx],
                                             rsnap.regions[ridx], extremes, nbytes, t0, t1, not async_)
            else:
                pending = self._write_inline_regions(peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx, extremes,
                                                     nbytes, t0, t1, not async_)
            if pending is not None:
                if not async_:
                    return None
                batch = _Batch(next(self._batch_ids), peer, src, dst, ln, nbytes)
                batch.pending, batch.path = pending, "inline"
                return batch
        batch = _Batch(next(self._batch_ids), peer, src, dst, ln, nbytes)
        if one_region:
            batch.spans = (lsnap, int(idx), rsnap, int(ridx))
            batch.extremes = (lmin, lmax, smin, send, dmin, dend)
        if getattr(devices, "ndim", 0) == 0:
            device_list = [int(devices)]
            devices = None  # the planner reads one device from device_list
        else:
            device_list = distinct(devices)
        self._await_sources(device_list)
        rails_of = {}
        for dev in device_list:
            rails_of[dev] = self._rail_choices(dev, peer)
            if not rails_of[dev]:
                raise self._all_rails_failed(peer, f"no usable rail to {session_id} for device {dev}")
        load = {pr.rail: pr.bytes_in_flight for pr in peer.rails}
        dst_devices = None
        if peer.forward is not None and lmax >= self.coalesce_bytes:
            dst_devices = rsnap.devices[ridx]
            if getattr(dst_devices, "ndim", 0) == 0:
                dst_devices = np.full(ln.size, int(dst_devices), dtype=np.int64)
        units = _group_direct(self.planner.plan(src, dst, ln, devices, rails_of, load, device_list, dst_devices,
                                                peer.forward, (nbytes, lmax, lmin)))
        t2 = now_ns()
        batch.remaining = len(units)
        self._dispatch(batch, units)
        t3 = now_ns()
        self.counters.add_many((("batches_submitted", 1), ("items", int(ln.size)), ("bytes", batch.nbytes),
                                ("time_validate_s", (t1 - t0) / 1e9), ("time_plan_s", (t2 - t1) / 1e9),
                                ("time_dispatch_s", (t3 - t2) / 1e9)))
        return batch

    @staticmethod
    def _locate_ends(snap, addrs: np.ndarray, ln: np.ndarray, lo: int, hi_start: int, lmin: int, lmax: int,
                     span_end: int) -> tuple:
        """``(region, largest end)`` for one side of a batch whose span ``[lo, span_end)`` (smallest start to
        largest start + longest length, < 2**63) is not inside one region of ``snap``: with unequal lengths the
        pieces' own span (their largest end) may still be, and that region's index is returned; else each piece's
        region (``locate_inside``), or None when some piece is not inside one (the caller names it). The largest
        end is the pieces' own whenever the lengths differ."""
        ends = addrs + ln
        if lmin != lmax:
            span_end = int(ends.max())
            idx = span_region(snap, lo, hi_start, span_end, lmax)
            if idx is not None:
                return idx, span_end
        return locate_inside(snap, addrs, ends), span_end

    @staticmethod
    def _await_sources(devices) -> None:
        """Wait for the work the calling thread queued on the current stream of each source GPU in ``devices``
        (the sources' producers). The posted path reads GPU sources from other streams and threads (relay lanes,
        chunk gathers, the tcp sender's staging copies, a NIC), which nothing else orders after that work; the
        load/store and inline paths queue their copies behind it instead. Host sources: nothing to wait for."""
        gpus = [dev for dev in devices if dev >= 0]
        if gpus:
            import torch
            for dev in gpus:
                torch.cuda.current_stream(dev).synchronize()

    def _write_inline(self, peer: "_Peer", src, dst, ln, dev: int, local, remote, extremes: tuple, nbytes: int,
                      t0: int, t1: int, wait: bool):
        """Write a batch from the calling thread (fabrics with ``inline_writes``) when the planner would send it
        whole, in order, as one direct unit: the same rail and the same writes as the planned path, without its
        unit, attempt, request, post and completion (each a few function calls of host time per batch, which on
        the message path cost more than the copy of most batches: benchmarks/NOTES.md, section "Inline writes").
        ``local`` and ``remote``: the one region on each side holding every piece; ``extremes``: (lmin, lmax, smin,
        send, dmin, dend) from the validation; ``wait``: return only once every byte is placed. Returns the
        fabric's ``Pending`` (already waited for when ``wait``; the batch counted, and done when ``wait``), or
        None with nothing counted when the batch does not qualify or the fabric did not take or make the writes:
        the caller then plans and posts it, and that path reports any failure (a batch written in part is written
        again: the writes are idempotent)."""
        choices, load, c = self._whole_batch_rail(dev, peer, int(ln.size), nbytes, extremes)
        if c is None:
            if self.planner.relays_all(choices, extremes[0], peer.forward):
                return self._relay_inline(peer, src, dst, ln, dev, remote, extremes, nbytes, choices, load, t0, t1,
                                          wait)
            if self.planner.direct_runs_all(choices, int(ln.size), extremes[0], extremes[1], peer.forward):
                def write_run(fab, ep, rail, a, b, s, d, n, run_bytes, lmin, lmax):
                    # the run's own lengths; the batch's address spans hold every one of its pieces
                    bd = WriteBounds(lmin, lmax, *extremes[2:], remote.keys[rail], local.keys[rail].lkey)
                    return fab.write_inline(ep, s, d, n, bd, run_bytes, wait=False)
                return self._direct_runs_inline(peer, src, dst, ln, dev, extremes, nbytes, choices, load, t0, t1,
                                                wait, write_run)
            return None
        rail = c.rail
        bounds = WriteBounds(*extremes, remote.keys[rail], local.keys[rail].lkey)
        return self._inline_on_rail(peer, rail, lambda fab, ep: fab.write_inline(ep, src, dst, ln, bounds, nbytes,
                                                                                  wait),
                                    int(ln.size), nbytes, t0, t1, wait)

    def _whole_batch_rail(self, dev: int, peer: "_Peer", n: int, nbytes: int, extremes: tuple):
        """(the usable rails of ``dev`` to ``peer``, their load, ``Planner.whole_batch_rail``'s choice or None) for a
        batch of ``n`` pieces and ``nbytes`` bytes with the validation's ``extremes``."""
        choices = self._rail_choices(dev, peer)
        load = {pr.rail: pr.bytes_in_flight for pr in peer.rails} if len(choices) > 1 else {}
        return choices, load, self.planner.whole_batch_rail(dev, choices, load, n, nbytes, extremes[0], extremes[1],
                                                            peer.forward)

    def _inline_on_rail(self, peer: "_Peer", rail: int, write, n: int, nbytes: int, t0: int, t1: int, wait: bool):
        """Make an inline write (``write(fabric, endpoint)`` of rail ``rail``) and count it as one direct unit of
        ``n`` pieces; the fabric's ``Pending``, or None with nothing counted when it declined or failed (logged)."""
        t2 = now_ns()
        try:
            pending = write(self.fabrics[rail], peer.rails[rail].ep)
        except (FabricError, TransferError, OSError) as e:
            log.info("rail %d: the inline write of %d piece(s) to %s failed (%s); posting it instead", rail, n,
                     peer.session, e)
            pending = None
        if pending is None:
            # the posted path takes the same rail: what it does there (on ipc, a GRANT that describes the peer's
            # regions) lets that rail take the next batch inline
            self.planner.rewind()
            return None
        t3 = now_ns()
        # the rail's view: one post of n writes, complete once placed (``_wait`` for an async batch)
        self._rail_stats[rail].add_many((("post_calls", 1), ("writes_posted", n), ("bytes_posted", nbytes),
                                         ("time_post_s", (t3 - t2) / 1e9), ("completions", 1),
                                         ("bytes_completed", nbytes)))
        self._count_inline(DIRECT, 1, n, nbytes, (t0, t1, t2, t3), wait)
        return pending

    def _write_inline_regions(self, peer: "_Peer", src, dst, ln, devices, lsnap, idx, rsnap, ridx, extremes: tuple,
                              nbytes: int, t0: int, t1: int, wait: bool):
        """``_write_inline`` for a batch whose pieces lie in several registered regions on either side (``idx`` /
        ``ridx``: each piece's region in ``lsnap`` / ``rsnap``, or one index for all), as sglang's calls do: it
        registers each layer's KV buffer and each aux buffer apart, so one call names a region per layer or per
        aux buffer on each side. Taken when every source is on one device and the planner would send the batch
        whole as one direct unit; the fabric gets each side's regions (``RegionSpans``) instead of one key. The
        same returns as ``_write_inline``."""
        if getattr(devices, "ndim", 0):
            dev = int(devices[0])
            if int(devices.min()) != dev or int(devices.max()) != dev:
                return None  # sources on several devices: one unit per device, posted
        else:
            dev = int(devices)
        choices, load, c = self._whole_batch_rail(dev, peer, int(ln.size), nbytes, extremes)
        if c is None:
            if not self.planner.direct_runs_all(choices, int(ln.size), extremes[0], extremes[1], peer.forward):
                return None
            many_local, many_remote = getattr(idx, "ndim", 0), getattr(ridx, "ndim", 0)

            def write_run(fab, ep, rail, a, b, s, d, n, run_bytes, lmin, lmax):
                # the run's regions (remembered per run as per batch: the planner cuts a layout the same way
                # while the rails' loads are the same), its own lengths, the batch's address spans
                sp = RegionSpans(lmin, lmax, *extremes[2:], *self._region_spans(
                    rail, lsnap, idx[a:b] if many_local else idx, rsnap, ridx[a:b] if many_remote else ridx))
                return fab.write_inline_regions(ep, s, d, n, sp, run_bytes, wait=False)
            return self._direct_runs_inline(peer, src, dst, ln, dev, extremes, nbytes, choices, load, t0, t1, wait,
                                            write_run)
        rail = c.rail
        spans = RegionSpans(*extremes, *self._region_spans(rail, lsnap, idx, rsnap, ridx))
        return self._inline_on_rail(peer, rail, lambda fab, ep: fab.write_inline_regions(ep, src, dst, ln, spans,
                                                                                          nbytes, wait),
                                    int(ln.size), nbytes, t0, t1, wait)

    def _region_spans(self, rail: int, lsnap, idx, rsnap, ridx) -> tuple:
        """``RegionSpans``' (local, remote, remote_index) on ``rail`` for pieces in regions ``idx`` of ``lsnap`` and
        ``ridx`` of ``rsnap`` (arrays, or one index for all). Remembered by the snapshots and the index arrays'
        bytes: sglang names the same regions (a KV buffer per layer, an aux buffer per field) in the same order
        call after call, and working them out again costs a ``np.unique`` and a Python step per region and call
        (benchmarks/NOTES.md, "A region per layer on the GPU"). The same ``local`` and ``remote`` tuple
        objects come back for the same layout, which lets a fabric remember its own checks of them
        (``IpcFabric.write_inline_regions``). A snapshot is immutable and replaced on any change, so an entry
        holds its two snapshots and is used only for those very objects."""
        ikey = idx.tobytes() if getattr(idx, "ndim", 0) else int(idx)
        rkey = ridx.tobytes() if getattr(ridx, "ndim", 0) else int(ridx)
        key = (rail, id(lsnap), id(rsnap), ikey, rkey)
        memo = self._spans_memo
        got = memo.get(key)
        if got is not None and got[0] is lsnap and got[1] is rsnap:
            return got[2]
        local = []
        for i in (np.unique(idx).tolist() if getattr(idx, "ndim", 0) else (int(idx),)):
            r = lsnap.regions[i]
            local.append((r.keys[rail].lkey, r.addr, r.addr + r.length))
        if getattr(ridx, "ndim", 0):
            used, where = np.unique(ridx, return_inverse=True)
            used = used.tolist()
            where.flags.writeable = False  # shared by every batch of this layout
        else:
            used, where = (int(ridx),), None
        remote = []
        for i in used:
            r = rsnap.regions[i]
            remote.append((r.keys[rail], r.addr, r.addr + r.length))
        value = (tuple(local), tuple(remote), where)
        with self._spans_lock:
            if len(memo) >= _SPANS_MEMO:
                memo.pop(next(iter(memo)))  # the oldest layout
            memo[key] = (lsnap, rsnap, value)
        return value

    def _direct_runs_inline(self, peer: "_Peer", src, dst, ln, dev: int, extremes: tuple, nbytes: int, choices,
                            load: dict, t0: int, t1: int, wait: bool, write_run):
        """``_write_inline`` for a batch the planner cuts into DIRECT runs of whole pieces on several rails (a
        batch of at least twice ``MIN_RUN_BYTES`` with two rails or more): the same runs on the same rails, each
        written by the calling thread through its rail's fabric (``write_run(fabric, endpoint, rail, first, end,
        srcs, dsts, lengths, bytes, smallest length, largest)`` for the run of pieces ``first:end``, not waited
        for), then waited for together when ``wait``. No unit, attempt, request, post or completion per run.
        Returns the runs' joined ``Pending``, or None with nothing counted when a fabric declined or failed a run
        (on ipc: a rail that has not yet had the peer's region described): the runs already written are waited
        for, and the caller posts the whole batch (the writes are idempotent)."""
        units = self.planner.plan(src, dst, ln, None, {dev: choices}, load, [dev], None, None,
                                  (nbytes, extremes[1], extremes[0]))
        t2 = now_ns()
        pendings, per_rail, first = [], {}, 0
        got = None
        try:
            for u in units:
                if u.kind != DIRECT or u.runs is None:  # not what ``direct_runs_all`` promised: post it
                    break
                s_, d_, n_ = u.runs
                end = first + n_.size
                if u.nbytes <= 0 or end > ln.size:
                    break
                lmin, lmax = (int(n_[0]),) * 2 if n_.size == 1 else (int(n_.min()), int(n_.max()))
                one = write_run(self.fabrics[u.rail], peer.rails[u.rail].ep, u.rail, first, end, s_, d_, n_,
                                u.nbytes, lmin, lmax)
                if one is None:
                    break
                pendings.append(one)
                self._tally(per_rail, u.rail, int(n_.size), u.nbytes)
                first = end
            else:
                if first == ln.size:
                    got = Pending.joined(pendings)
                    if wait:
                        got.wait()
        except (FabricError, TransferError, OSError, RuntimeError) as e:
            log.info("the inline runs of %d piece(s) to %s failed (%s); posting them instead", ln.size,
                     peer.session, e)
            got = None
        return self._settle_inline(peer, "runs", got, pendings, per_rail, DIRECT, len(units), int(ln.size), nbytes,
                                   (t0, t1, t2), wait)

    def _relay_inline(self, peer: "_Peer", src, dst, ln, dev: int, remote, extremes: tuple, nbytes: int, choices,
                      load: dict, t0: int, t1: int, wait: bool):
        """``_write_inline`` for a batch the planner relays whole (every piece a RELAYED unit): for each unit the
        caller takes a slot of the unit's relay ring, fills it on the slot's lane stream, has the fabric write it
        from there on the same stream (``write_inline``, not waited for) and gives the slot back at once: its
        next fill follows that write on the stream. No attempt, post, completer thread or completion chain, and
        each unit's write starts as soon as its own fill is done while the next unit fills on another lane.
        Returns the units' joined ``Pending`` (waited for when ``wait``), or None with nothing counted when a
        fabric declined or failed a unit: the writes already made are waited for, and the caller posts the
        whole batch (the writes are idempotent)."""
        units = self.planner.plan(src, dst, ln, None, {dev: choices}, load, [dev], None, None,
                                  (nbytes, extremes[1], extremes[0]))
        t2 = now_ns()
        pendings = []
        per_rail: Dict[int, List[int]] = {}
        # the fills run on the rings' lane streams: each lane waits once for what the caller queued on the data
        # GPU's current stream (the sources' producers) before its first fill of this batch
        after, waited = None, set()
        dspan = (extremes[4], extremes[5])  # (dmin, dend) of the batch
        try:
            if dev >= 0:
                import torch
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(dev))
            for k, u in enumerate(units):
                got = self._relay_unit_inline(peer, u, remote, k, dspan, after, waited) if u.kind == RELAYED \
                    else None
                if got is None:
                    break
                pendings.append(got)
                writes = u.runs[2].size if u.runs is not None else len(u.segments())
                self._tally(per_rail, u.rail, writes, u.nbytes)
            else:
                got = Pending.joined(pendings)
                if wait:
                    got.wait()
        except (FabricError, TransferError, OSError, RuntimeError) as e:
            log.info("the inline relay of %d piece(s) to %s failed (%s); posting it instead", ln.size, peer.session,
                     e)
            got = None
        return self._settle_inline(peer, "relay", got, pendings, per_rail, RELAYED, len(units), int(ln.size),
                                   nbytes, (t0, t1, t2), wait)

    @staticmethod
    def _tally(per_rail: Dict[int, List[int]], rail: int, writes: int, nbytes: int) -> None:
        """Count one inline unit of ``writes`` writes and ``nbytes`` bytes on ``rail`` in ``per_rail`` (rail ->
        [posts, writes, bytes]) for ``_settle_inline``."""
        counts = per_rail.setdefault(rail, [0, 0, 0])
        counts[0] += 1
        counts[1] += writes
        counts[2] += nbytes

    def _settle_inline(self, peer: "_Peer", what: str, got, pendings: list, per_rail: Dict[int, List[int]],
                       kind: str, units: int, n: int, nbytes: int, times: tuple, wait: bool):
        """The end of an inline batch written unit by unit (``_direct_runs_inline``, ``_relay_inline``): ``got``,
        the units' joined ``Pending``, counted (``per_rail``: rail -> [posts, writes, bytes]; ``times``:
        submitted, validated, planned, in ns) and returned; or, when ``got`` is None (a unit declined or failed),
        the writes already made (``pendings``) waited for, the tie rotation taken back and None returned, for the
        caller to post the whole batch."""
        if got is None:
            try:
                Pending.joined(pendings).wait()  # nothing of this try may land after the posted path's writes
            except RuntimeError:
                log.exception("waiting for the inline %s writes to %s failed", what, peer.session)
            self.planner.rewind()  # the posted path plans the same rails
            return None
        t3 = now_ns()
        for rail, (posts, writes, rail_bytes) in per_rail.items():
            self._rail_stats[rail].add_many((("post_calls", posts), ("writes_posted", writes),
                                             ("bytes_posted", rail_bytes), ("completions", posts),
                                             ("bytes_completed", rail_bytes)))
        self._count_inline(kind, units, n, nbytes, (*times, t3), wait)
        return got

    def _count_inline(self, kind: str, units: int, n: int, nbytes: int, times: tuple, wait: bool) -> None:
        """The batch counters of an inline batch of ``units`` units of ``kind`` (DIRECT / RELAYED), ``n`` pieces
        and ``nbytes`` bytes; ``times``: (submitted, validated, planned, written) in ns. A batch already placed
        (``wait``) counts as ok and done here; an async one when ``_wait`` finds its copies done."""
        t0, t1, t2, t3 = times
        counts = [("batches_submitted", 1), ("items", n), ("bytes", nbytes), (f"path_{kind}_units", units),
                  (f"path_{kind}_bytes", nbytes), ("time_validate_s", (t1 - t0) / 1e9), ("time_plan_s", (t2 - t1) / 1e9),
                  ("time_dispatch_s", (t3 - t2) / 1e9)]
        if wait:
            counts.append(("batches_ok", 1))
        self.counters.add_many(counts)
        if wait:
            self._account_done(f"batch {next(self._batch_ids)}", t0, t3, n, nbytes, True, kind, counted=True)

    def _relay_unit_inline(self, peer: "_Peer", u: Unit, remote, k: int, dspan: Tuple[int, int], after=None,
                           waited: Optional[set] = None):
        """The ``k``-th RELAYED unit of ``_relay_inline``: slot (of lane ``k``: consecutive units on alternating
        streams), fill, inline write on the slot's lane; the fabric's ``Pending``, or None (declined, or the ring
        is closed). ``dspan``: (lowest destination, highest destination end) of the batch. ``after``: a CUDA
        event the fill waits for, once per lane (``waited``: the (ring, lane) pairs that already wait for it)."""
        relay = u.relay_device if u.device >= 0 else DEVICE_HOST
        if relay >= 0 and u.device != relay:
            from pxn_kernels.peer_access import ensure_peer_access
            ensure_peer_access(relay, {u.device})  # the relay GPU's fill reads the sources' GPU
        ring = self._ring(relay, u.rail)
        slot = ring.take(k)
        if slot is None:
            return None
        try:
            s_arr, d_arr, n_arr = u.arrays()
            local = slot.addr + (np.cumsum(n_arr) - n_arr)
            stream = ring.stream(slot.lane)
            if stream is None:  # a host ring
                host_memmove(s_arr, local, n_arr)
            else:
                if slot.reuse_after is not None:  # a posted write of this slot still reads it
                    stream.wait_event(slot.reuse_after)
                    slot.reuse_after = None
                if after is not None and (ring, slot.lane) not in waited:
                    stream.wait_event(after)
                    waited.add((ring, slot.lane))
                copies = self._relay_copies
                copies.finish([copies.copy(ring.device, s_arr, local, n_arr, stream=stream)], wait=False,
                              stream=stream)
            # the unit's own lengths (a piece larger than a slot is split, so the batch's extremes may not hold);
            # the batch's destination span holds every unit's destinations
            bounds = WriteBounds(int(n_arr.min()), int(n_arr.max()), slot.addr, slot.addr + u.nbytes, dspan[0],
                                 dspan[1], remote.keys[u.rail], ring.lkey)
            # on the fill's stream: the write follows the fill in stream order
            return self.fabrics[u.rail].write_inline(peer.rails[u.rail].ep, local, d_arr, n_arr, bounds, u.nbytes,
                                                     wait=False, stream=stream)
        finally:
            ring.release(slot)

    def _dispatch(self, batch: _Batch, units: List[Unit], from_engine: bool = False) -> None:
        """Create attempts for units and hand them to rings (chunks, relayed pieces) or post them (direct)."""
        direct: Dict[int, List[_Attempt]] = {}
        to_copy: Dict[Tuple[int, int], List[_Attempt]] = {}
        with self._lock:
            attempts = []
            for u in units:
                pr = batch.peer.rails[u.rail]
                a = _Attempt(self, u, batch, pr)
                pr.inflight.add(a)
                pr.bytes_in_flight += u.wire_bytes or u.nbytes
                attempts.append(a)
        for a in attempts:
            u = a.unit
            if u.kind == DIRECT:
                direct.setdefault(u.rail, []).append(a)
            else:
                # host pieces are gathered on the CPU; GPU pieces on the rail's relay GPU
                to_copy.setdefault((u.relay_device if u.device >= 0 else DEVICE_HOST, u.rail), []).append(a)
        for (dev, rail), atts in to_copy.items():
            if dev >= 0:
                # the relay GPU's gather reads the sources' GPUs through raw pointers: peer access first (a no-op
                # once done; refused pairs were refused at construction)
                self._ensure_peers(dev, atts)
            ring = self._ring(dev if dev >= 0 else DEVICE_HOST, rail)
            for a in atts:
                a.ring = ring
            inline, queued = _split_inline(atts, ring, from_engine)
            if queued:
                ring.enqueue_copy(queued)
            if inline:
                ring.fill_and_post(inline)  # only enqueues GPU work: the caller does it, no thread hand-off
        for rail, atts in direct.items():
            try:
                self._direct_requests(atts, batch.peer, rail)
            except InvalidTransfer as e:  # a region was deregistered while the batch was being planned
                self._fail_batch(batch, e)
                for a in atts:
                    self._drop(a)
                continue
            if from_engine:
                self._post_later(atts)  # redispatch from a poller: it keeps polling
            else:
                self._post(atts)  # the caller posts zero-copy writes itself: no thread hand-off

    def _ensure_peers(self, relay: int, atts: List[_Attempt]) -> None:
        sources = {a.unit.device for a in atts if a.unit.device >= 0 and a.unit.device != relay}
        if sources:
            from pxn_kernels.peer_access import ensure_peer_access
            ensure_peer_access(relay, sources)

    def _keys(self, a: _Attempt, src: int, dst: int, n: int) -> Tuple[int, int]:
        rail = a.prail.rail
        r = self._regions.find(src, n)
        if r is None:
            raise AddressNotRegistered(f"source 0x{src:x}+{n} was deregistered during the transfer")
        remote = a.batch.peer.regions.find(dst, n)
        if remote is None:
            raise AddressNotRegistered(f"destination 0x{dst:x}+{n} is no longer advertised by {a.batch.peer.session}")
        return r.keys[rail].lkey, remote.keys[rail]

    def _direct_requests(self, atts: List[_Attempt], peer: _Peer, rail: int) -> None:
        """Write requests of direct attempts on one rail, their keys looked up for all at once (scalar lookups cost
        more host time than the post itself): one ``WriteBatch`` per attempt on fabrics with ``write_batches``,
        else one ``WriteRequest`` per piece, of which, with selective signaling, only each attempt's last
        completes on success."""
        parts = [a.unit.arrays() for a in atts]
        lsnap, rsnap = self._regions.snapshot(), peer.regions.snapshot()
        batch = atts[0].batch
        local, remote = batch.local_region(lsnap), batch.peer_region(rsnap)
        if self._batches and local is not None and remote is not None and all(a.batch is batch for a in atts):
            # one region on each side holds the whole batch: one key each, no lookup per piece
            lkey, rkey = local.keys[rail].lkey, remote.keys[rail]
            for a, p in zip(atts, parts):
                m = p[2].size
                if batch.extremes is None:
                    nbytes = bounds = None
                elif p[2] is batch.lengths and p[0] is batch.srcs and p[1] is batch.dsts:
                    # the unit is the whole batch, whose arrays the validation reduced: the fabric checks those
                    # extremes instead of reducing the same arrays again
                    nbytes, bounds = batch.nbytes, WriteBounds(*batch.extremes, rkey, lkey)
                else:
                    # a part of the batch (a run of its pieces on one rail, or parts of pieces): its lengths'
                    # extremes are its own, and every write lies inside a piece of the batch, so the batch's
                    # address spans hold its writes; the fabric's checks against these spans cover each write
                    nbytes = a.unit.nbytes
                    bounds = WriteBounds(int(p[2].min()), int(p[2].max()), *batch.extremes[2:], rkey, lkey)
                a.reqs = [WriteBatch(p[0], p[2], p[1], np.full(m, rkey, dtype=np.int64),
                                     np.full(m, lkey, dtype=np.int64), nbytes=nbytes, bounds=bounds)]
            return
        if len(parts) == 1:
            src, dst, n = parts[0]
        else:
            src, dst, n = (np.concatenate([p[i] for p in parts]) for i in range(3))
        # every unit lies inside a piece the batch's validation accepted, so no end wraps
        li, ri = locate_inside(lsnap, src, src + n), locate_inside(rsnap, dst, dst + n)
        if li is None or ri is None:  # a region went away since validation: name it
            for a in atts:
                a.reqs = [WriteRequest(s_, n_, d_, *reversed(self._keys(a, s_, d_, n_)))
                          for s_, d_, n_ in a.unit.segments()]
            return
        if self._batches:
            # one WriteBatch per attempt: arrays end to end, one completion (an object per write cost a Python step
            # at each of five stages between here and the fabric's ack: benchmarks/NOTES.md, "The message path:
            # writes as arrays, completions at the writer")
            lkeys = np.array([r.keys[rail].lkey for r in lsnap.regions], dtype=np.int64)
            rkeys = np.array([r.keys[rail] for r in rsnap.regions], dtype=np.int64)
            k = 0
            for a, p in zip(atts, parts):
                m = p[2].size
                sl = slice(k, k + m)
                a.reqs = [WriteBatch(src[sl], n[sl], dst[sl], rkeys[ri[sl]], lkeys[li[sl]])]
                k += m
            return
        segs = list(zip(src.tolist(), dst.tolist(), n.tolist()))
        lkeys = [r.keys[rail].lkey for r in lsnap.regions]
        rkeys = [r.keys[rail] for r in rsnap.regions]
        li, ri = li.tolist(), ri.tolist()
        k = 0
        signal_all = not self._selective
        for a in atts:
            m = len(a.unit.segments())
            a.reqs = [WriteRequest(s_, n_, d_, rkeys[ri[j]], lkeys[li[j]], signaled=signal_all)
                      for j, (s_, d_, n_) in zip(range(k, k + m), segs[k:k + m])]
            a.reqs[-1].signaled = True
            k += m

    # --- copy thread ---------------------------------------------------------------------------------------
    def _fill(self, a: _Attempt, slot) -> bool:
        """Fill ``slot`` for attempt ``a`` (runs in the ring's copy thread). False: cancelled, slot unused. GPU
        copies are only enqueued on the slot's lane stream: the ring synchronises its streams once per round."""
        if a.cancelled or a.batch.failed:
            return False
        u = a.unit
        t0 = now_ns()
        if u.kind == COALESCED:
            landing = self._acquire_landing(a)
            if landing is None:
                if not (a.cancelled or a.batch.failed):
                    # the rail died while we waited for a credit: fail it over (this attempt included)
                    self._rail_failed(a.prail, a.prail.cause or PeerLost(
                        f"rail {a.prail.rail} endpoint to {a.batch.peer.session} died"))
                return False
            b = a.batch
            if u.items is not None:
                items = u.items
                srcs, dsts, lens = b.srcs[items], b.dsts[items], b.lengths[items]
            else:  # large pieces sent through the peer's landing slots (receive-side PXN)
                srcs, dsts, lens = (np.array(col, dtype=np.int64) for col in zip(*u.segs))
            seq = next(b.peer.seq)
            gather = None
            if slot.tensor is None:
                from pxn_kernels.chunk import build_header_table
                view = slot.ring._buf.array[slot.addr - slot.ring._buf.addr:][:slot.nbytes]
                _, offsets, chunk_bytes = build_header_table(dsts, lens, seq, self.engine_id, out=view)
                fab = self.fabrics[a.prail.rail]
                if fab.capabilities.gather_writes and int(lens.sum()) >= fab.gather_min_bytes * lens.size:
                    gather = (srcs, slot.addr + offsets, lens)  # the fabric sends each piece from its source
                else:
                    host_memmove(srcs, slot.addr + offsets, lens)
            elif u.items is None:  # large pieces for the peer to forward: the copy engine moves them
                chunk_bytes = gpu_pack_large(slot, srcs, lens, dsts, seq, self.engine_id, sync=False)
            else:
                chunk_bytes = gpu_pack(slot, srcs, lens, dsts, seq, self.engine_id, sync=False)
            pr = a.prail
            a.reqs = [(WriteRequest if gather is None else GatherWrite)(
                slot.addr, chunk_bytes, pr.landing_addr + landing * pr.slot_bytes, pr.landing_rkey, slot.ring.lkey,
                imm=chunk_imm(landing, seq))]
            if gather is not None:
                a.reqs[0].gather = gather
                # the receiver acks a chunk only once every byte of it has arrived, so the ack also completes the
                # write: where the fabric keeps successes silent, the chunk costs one completion, not two
                a.reqs[0].signaled = not self._selective
        elif (u.runs is None or u.runs[2].size <= MEMCPY_MAX) and not (slot.ring.ordered and u.device >= 0):
            # RELAYED, a few pieces: copy them into the slot, then one write per piece to its final address
            # (scalar steps: a few numpy calls per piece would cost more than the copies' host time)
            segs = u.segments()
            offs = [0]
            for _, _, n in segs[:-1]:
                offs.append(offs[-1] + n)
            if slot.tensor is None:
                host_memmove([sg[0] for sg in segs], [slot.addr + o for o in offs], [sg[2] for sg in segs])
            elif u.device < 0:
                from pxn_kernels import host_view
                for (s_addr, _, n), o in zip(segs, offs):
                    slot.tensor[o:o + n].copy_(host_view(s_addr, n))
            else:
                # large pieces: the copy engine (cudaMemcpyAsync, over NVLink from a peer GPU) runs at link speed
                # and needs no descriptor upload
                stream = slot.ring.stream(slot.lane)
                for (s_addr, _, n), o in zip(segs, offs):
                    memcpy_async(slot.addr + o, s_addr, n, stream)  # the ring waits for the stream once
            a.reqs = []
            for (s_addr, d_addr, n), o in zip(segs, offs):
                _, rkey = self._keys(a, s_addr, d_addr, n)
                a.reqs.append(WriteRequest(slot.addr + o, n, d_addr, rkey, slot.ring.lkey))
        else:  # RELAYED, many pieces (or GPU pieces to an event-ordered fabric): one gather into the slot, its writes
            s_arr, d_arr, n_arr = u.arrays()
            offs = np.cumsum(n_arr) - n_arr
            local = slot.addr + offs
            if slot.tensor is None:
                host_memmove(s_arr, local, n_arr)
            elif u.device < 0:
                from pxn_kernels import host_view
                for s_addr, o, n in zip(s_arr.tolist(), offs.tolist(), n_arr.tolist()):
                    slot.tensor[o:o + n].copy_(host_view(s_addr, n))
            else:
                # one bound batched-copy launch (replayed for lengths seen before), where a call per piece cost
                # host time for every piece (benchmarks/NOTES.md, "The message path: writes as arrays, completions
                # at the writer"); on the lane's stream, ordered after the lane's earlier work, which the ring
                # waits for or orders after
                stream = slot.ring.stream(slot.lane)
                self._relay_copies.finish([self._relay_copies.copy(slot.ring.device, s_arr, local, n_arr,
                                                                   stream=stream)], wait=False, stream=stream)
            rail = a.prail.rail
            rsnap = a.batch.peer.regions.snapshot()
            remote = a.batch.peer_region(rsnap)
            if remote is not None:  # one peer region holds the whole batch: its key for every piece
                rkeys = np.full(n_arr.size, remote.keys[rail], dtype=np.int64)
            else:
                ri = locate_inside(rsnap, d_arr, d_arr + n_arr)
                if ri is None:  # a region went away since validation: name it
                    for s_addr, d_addr, n in zip(s_arr.tolist(), d_arr.tolist(), n_arr.tolist()):
                        self._keys(a, s_addr, d_addr, n)
                    raise AddressNotRegistered(f"a destination of batch {a.batch.id} is no longer advertised by "
                                          f"{a.batch.peer.session}")
                rkeys = np.array([r.keys[rail] for r in rsnap.regions], dtype=np.int64)[ri]
            lkeys = np.full(n_arr.size, slot.ring.lkey, dtype=np.int64)
            if self._batches:
                a.reqs = [WriteBatch(local, n_arr, d_arr, rkeys, lkeys)]  # one completion, no object per piece
            else:
                a.reqs = [WriteRequest(lo, n, d, rk, slot.ring.lkey)
                          for lo, n, d, rk in zip(local.tolist(), n_arr.tolist(), d_arr.tolist(), rkeys.tolist())]
        with self._lock:
            if a.cancelled or a.finished:
                landing, a.landing = a.landing, None
            else:
                a.slot = slot
                landing = None
        if landing is not None:
            self._release_landing(a.prail, landing)
            return False  # the ring gives the slot back
        t1 = now_ns()
        self.counters.add("time_fill_s", (t1 - t0) / 1e9)
        if self.trace is not None:
            self.trace.complete("gather" if u.kind == COALESCED else "relay copy", "copy", f"copy/{slot.ring.name}",
                                t0, t1, {"bytes": u.nbytes, "batch": a.batch.id})
        return True

    def _acquire_landing(self, a: _Attempt) -> Optional[int]:
        """A free landing slot (credit) at the peer on the attempt's rail; waits (back-pressure). None when the
        rail died or the attempt was cancelled meanwhile."""
        pr = a.prail
        t0 = None
        with pr.cv:
            while True:
                if a.cancelled or a.batch.failed or not pr.alive or not pr.ep.alive:
                    return None
                if pr.free_landing:
                    s = pr.free_landing.pop()
                    pr.landing_owner[s] = a
                    a.landing = s
                    if t0 is not None:
                        self.counters.add("time_wait_credit_s", (now_ns() - t0) / 1e9)
                    return s
                if t0 is None:
                    t0 = now_ns()
                    self.counters.add("credit_waits")
                pr.cv.wait(0.25)

    def _release_landing(self, pr: _PeerRail, slot: int) -> None:
        with pr.cv:
            if pr.landing_owner.pop(slot, None) is not None:
                pr.free_landing.append(slot)
            pr.cv.notify()

    # --- submit --------------------------------------------------------------------------------------------
    def _post(self, attempts: List[_Attempt], after=None) -> None:
        """Post attempts (one doorbell per rail endpoint). Runs in a ring's copy thread, the progress loop
        (``_post_later``) or the caller.
        ``after``: CUDA events the writes must follow (a round of relay fills), for fabrics with
        ``event_ordered_writes``; their slots go back to the ring as soon as the writes are queued, to be
        refilled after the writes' own event."""
        groups: Dict[int, List[_Attempt]] = {}
        for a in attempts:
            groups.setdefault(id(a.prail), []).append(a)
        for atts in groups.values():
            pr = atts[0].prail
            live = []
            with self._lock:
                for a in atts:
                    if a.cancelled or a.batch.failed:
                        self._drop(a)
                        continue
                    for r in a.reqs:
                        r.wr_id = next(self._wr_ids)
                        self._inflight[r.wr_id] = a
                    # completions to wait for: every write, or only the signaled ones where the fabric is silent
                    # about the others' success (an error on any of them still completes)
                    a.pending = sum(1 for r in a.reqs if r.signaled) if self._selective else len(a.reqs)
                    a.posted = True
                    live.append(a)
            if not live:
                continue
            for a in live:
                if a.slot is not None:
                    a.slot.enter(POSTED)
            t0 = now_ns()
            try:
                if not pr.ep.alive:
                    raise PeerLost(f"rail {pr.rail} endpoint to {pr.remote_id} is dead")
                reqs = [r for a in live for r in a.reqs]
                if after is None:
                    self.fabrics[pr.rail].post_writes(pr.ep, reqs)
                    reusable = None
                else:
                    reusable = self.fabrics[pr.rail].post_writes_after(pr.ep, reqs, after)
            except (FabricError, OSError, ValueError) as e:
                with self._lock:
                    for a in live:
                        self._unpost(a)
                if isinstance(e, (FabricError, OSError)) and not isinstance(e, RegionError):
                    self._rail_failed(pr, e)  # the rail is gone: its work fails over
                    continue
                for a in live:
                    # the peer refused a region, or a local check failed (a bug or a racing deregister)
                    self._fail_batch(a.batch, RemoteRejected(f"post refused: {e}", [e]) if isinstance(e, RegionError)
                                     else InvalidTransfer(f"post refused locally: {e}", [e]))
                    self._drop(a)
                continue
            if reusable is not None:
                for a in live:
                    with self._lock:
                        slot, a.slot = a.slot, None  # unless a completion already released it
                    if slot is not None:
                        slot.ring.release(slot, after=reusable)
            t1 = now_ns()
            nbytes = writes = 0  # one loop, not two generator sums: this runs once per post
            for a in live:
                for r in a.reqs:
                    if isinstance(r, WriteBatch):
                        nbytes += r.nbytes
                        writes += r.count
                    else:
                        nbytes += r.length
                        writes += 1
            self._rail_stats[pr.rail].add_many((("post_calls", 1), ("writes_posted", writes),
                                                ("bytes_posted", nbytes), ("time_post_s", (t1 - t0) / 1e9)))
            if self.trace is not None:
                self.trace.complete("post", "fabric", f"post/rail{pr.rail}", t0, t1,
                                    {"writes": len(live), "bytes": nbytes})

    def _unpost(self, a: _Attempt) -> None:
        """Called with the lock held when a post failed: the attempt's writes are not in flight."""
        for r in a.reqs:
            self._inflight.pop(r.wr_id, None)
        a.posted = False
        a.pending = 0

    def _retire_locked(self, a: _Attempt):
        """With ``self._lock`` held: take the attempt out of flight (once) and hand back (slot, landing) for the
        caller to release outside the lock. Returns whether this call retired it."""
        first = not a.finished
        if first:
            a.finished = True
            a.prail.inflight.discard(a)
            a.prail.bytes_in_flight -= a.unit.wire_bytes or a.unit.nbytes
            if self._selective and (len(a.reqs) > 1 or (a.reqs and not a.reqs[0].signaled)):
                for r in a.reqs:  # silent writes never complete: forget their ids here
                    self._inflight.pop(r.wr_id, None)
        slot, a.slot = a.slot, None
        landing, a.landing = a.landing, None
        return first, slot, landing

    def _release(self, a: _Attempt, slot, landing) -> None:
        if slot is not None:
            slot.ring.release(slot)
        if landing is not None:
            self._release_landing(a.prail, landing)

    def _drop(self, a: _Attempt) -> None:
        """Give back an attempt's resources when it will not be (or is no longer) in flight. Idempotent."""
        with self._lock:
            _, slot, landing = self._retire_locked(a)
        self._release(a, slot, landing)

    # --- completions ---------------------------------------------------------------------------------------
    def _poll_loop(self, rail: int) -> None:
        """A rail's poller, on fabrics that report completions by ``poll`` (no ``completion_callback``)."""
        fab = self.fabrics[rail]
        last_check = time.monotonic()
        while not self._closed:
            try:
                comps = fab.poll(256, timeout=0.05)
            except FabricClosed:
                return
            except Exception:  # noqa: BLE001
                log.exception("poll on rail %d failed", rail)
                time.sleep(0.05)
                continue
            for c in comps or ():
                try:
                    self._on_completion(rail, c)
                except Exception:  # noqa: BLE001 — one bad completion must not stop the poller
                    log.exception("rail %d: handling completion %r failed", rail, c)
            now = time.monotonic()
            if now - last_check > WATCHDOG_S:
                last_check = now
                self._watchdog(rail)

    def _deferred_completions(self, rail: int, comps) -> None:
        """A rail's failed completions and those that came after them, in the progress loop (fabrics with
        ``completion_callback``: ``_on_completions`` queues them there in order)."""
        for c in comps:
            try:
                self._on_completion(rail, c)
            except Exception:  # noqa: BLE001 — one bad completion must not stop the others
                log.exception("rail %d: handling completion %r failed", rail, c)
        with self._defer_lock:
            self._deferring[rail] -= 1

    def _watchdogs(self) -> None:
        """Every rail's watchdog (the progress loop runs this every ``WATCHDOG_S``)."""
        for rail in range(len(self.fabrics)):
            try:
                self._watchdog(rail)
            except Exception:  # noqa: BLE001 — one rail's watchdog must not stop the others'
                log.exception("rail %d: watchdog failed", rail)

    def _post_later(self, attempts: List[_Attempt]) -> None:
        """Post re-dispatched attempts from the progress loop, after the task that re-dispatched them, so that a
        poller that found the failure keeps polling."""
        self._progress.submit(self._post_if_open, attempts)

    def _post_if_open(self, attempts: List[_Attempt]) -> None:
        # _post handles its own failures; the progress loop logs anything else
        if not self._closed:
            self._post(attempts)

    def _on_completions(self, rail: int, comps) -> None:
        """Completion handler called by a fabric thread (fabrics with ``completion_callback``). Failures go to the
        engine's progress loop instead: failover deregisters and re-posts, which must not run in a fabric thread
        that the fabric itself may be waiting on."""
        if self._closed:
            return
        with self._defer_lock:
            # from the first failure on, and while earlier ones wait, completions keep their order through the
            # progress loop: a unit's last write must never be counted done before an earlier write's error
            if len(comps) == 1:  # the common case (a batch's one completion): no generator
                first_bad = None if comps[0].error is None else 0
            else:
                first_bad = next((i for i, c in enumerate(comps) if c.error is not None), None)
            if self._deferring[rail] or first_bad is not None:
                cut = 0 if self._deferring[rail] else first_bad
                later = comps[cut:]
                comps = comps[:cut]
                self._deferring[rail] += 1
                self._progress.submit(self._deferred_completions, rail, later)
        for c in comps:
            try:
                self._on_completion(rail, c)
            except Exception:  # noqa: BLE001 — one bad completion must not break the fabric's thread
                log.exception("rail %d: handling completion %r failed", rail, c)

    def _rows_acked(self, a: _Attempt) -> bool:
        """A posted ``WriteRows`` (``transport.smallbatch``) was placed by the peer, in order on its endpoint: what
        ``_on_completions``, ``_on_completion`` and ``_finish`` do for its completion, with the locks taken once
        each and no ``Completion``. False when completions of the rail go through the poll loop meanwhile (an
        earlier failure is being handled there): the fabric then reports the completion, which queues behind it."""
        if self._closed:
            return True
        rail = a.prail.rail
        with self._defer_lock:
            if self._deferring[rail]:
                return False
        req = a.reqs[0]
        with self._lock:
            if self._inflight.pop(req.wr_id, None) is None:
                return True
            a.pending = 0
            claimed = not a.finished and not a.cancelled
            _, slot, landing = self._retire_locked(a)
        self._rail_stats[rail].add_many((("completions", 1), ("bytes_completed", req.nbytes)))
        if slot is not None or landing is not None:
            self._release(a, slot, landing)
        if not claimed:
            return True
        b = a.batch
        with b.lock:
            b.remaining -= 1
            last = b.remaining == 0 and not b.event.is_set()
        units, nbytes = _PATH_COUNTERS[a.unit.kind]
        if not last:
            self.counters.add_many(((units, 1), (nbytes, a.unit.nbytes)))
            return True
        self.counters.add_many(((units, 1), (nbytes, a.unit.nbytes), ("batches_ok", 1)))
        t = now_ns()
        self.latency.add((t - b.t0) / 1e9)  # ``_account_done`` of a counted batch
        if self.trace is not None:
            self.trace.complete(f"batch {b.id}", "batch", "batches", b.t0, t, {"items": b.n_items, "bytes": b.nbytes})
        b.event.set()
        return True

    def _watchdog(self, rail: int) -> None:
        """A rail whose endpoint died with work in flight (e.g. chunks waiting for acks) fails over even when
        no completion reports it."""
        for peer in list(self._peers.values()):
            if peer.ready and rail < len(peer.rails):
                pr = peer.rails[rail]
                if pr.alive and not pr.ep.alive:
                    self._rail_failed(pr, PeerLost(f"rail {rail} endpoint to {peer.session} died"))

    def _on_completion(self, rail: int, c) -> None:
        if c.opcode == Opcode.RECV_IMM:
            if c.imm is not None and c.imm & ACK_FLAG:
                self._on_ack(rail, c)
            else:
                self.receiver.on_chunk(rail, c.peer_id, c.imm or 0, c.byte_len)
            return
        if c.wr_id >= ACK_WR_BASE:
            if c.error is not None:
                self.counters.add("rx_ack_errors")
                log.info("ack write on rail %d failed: %s", rail, c.error)
            return
        with self._lock:
            a = self._inflight.pop(c.wr_id, None)
            if a is not None:
                a.pending -= 1
                more = a.pending > 0
        if a is None:
            return
        stats = self._rail_stats[rail]
        if c.error is None:
            done_bytes = c.byte_len
            if not more and self._selective and (len(a.reqs) > 1 or not a.reqs[0].signaled):
                # the silent writes before it are done too (posting order)
                done_bytes += sum(r.length for r in a.reqs if not r.signaled)
            stats.add_many((("completions", 1), ("bytes_completed", done_bytes)))
            if more:
                return
            if a.unit.kind == COALESCED and not a.cancelled:
                with self._lock:
                    a.write_done = True
                    done = a.acked
                if done:
                    self._finish(a)
                elif a.slot is not None:
                    a.slot.enter(WAITING)
                return
            self._finish(a)
            return
        stats.add("completion_errors")
        if a.cancelled:
            self._drop(a)
            return
        if isinstance(c.error, RegionError):
            self._drop(a)
            self._fail_batch(a.batch, RemoteRejected(f"{a.batch.peer.session} refused a write on rail {rail}: "
                                                     f"{c.error}", [c.error]))
            return
        with self._lock:
            a.write_done = True
        self._rail_failed(a.prail, c.error)

    def _on_ack(self, rail: int, c) -> None:
        entry = self._by_remote_rail.get(c.peer_id)
        if entry is None:
            return
        peer, pr = entry
        slot, status = decode_ack(c.imm)
        with pr.cv:
            a = pr.landing_owner.get(slot)
        if a is None:
            return
        if status != ST_OK:
            off = (pr.rail * pr.slots + slot) * ACK_BYTES
            reason = decode_ack_payload(peer.credit.array[off:off + ACK_BYTES])
            self._drop(a)
            self._fail_batch(a.batch, RemoteRejected(f"{peer.session} rejected a chunk of batch {a.batch.id}: "
                                                     f"{reason}"))
            return
        silent = not a.reqs[0].signaled  # a silent chunk write: this ack completes it (see ``_fill``)
        with self._lock:
            a.acked = True
            done = a.write_done or silent
        if silent:
            self._rail_stats[a.prail.rail].add("bytes_completed", a.reqs[0].length)
        if done:
            self._finish(a)

    def _finish(self, a: _Attempt) -> None:
        """An attempt succeeded: give back its resources and count its unit done."""
        # one lock section decides between success and failover: _rail_failed only takes attempts that are
        # neither finished nor cancelled, so a unit is never counted done twice
        with self._lock:
            claimed = not a.finished and not a.cancelled
            _, slot, landing = self._retire_locked(a)
        self._release(a, slot, landing)
        if not claimed:
            return
        b = a.batch
        u = a.unit
        if u.kind == COALESCED:
            self.counters.add_many((("chunks", 1), ("chunk_items", len(u.segs) if u.items is None else int(u.items.size)),
                                    ("chunk_wire_bytes", u.wire_bytes)))
        with b.lock:
            b.remaining -= 1
            last = b.remaining == 0 and not b.event.is_set()
        if last:
            # the batch's ok count with the unit's counters: one lock round
            self.counters.add_many(((f"path_{u.kind}_units", 1), (f"path_{u.kind}_bytes", u.nbytes), ("batches_ok", 1)))
            self._account_done(f"batch {b.id}", b.t0, now_ns(), b.n_items, b.nbytes, True, counted=True)
            b.event.set()
        else:
            self.counters.add_many(((f"path_{u.kind}_units", 1), (f"path_{u.kind}_bytes", u.nbytes)))

    def _account_done(self, name: str, t0: int, t: int, n_items: int, nbytes: int, ok: bool,
                      path: Optional[str] = None, counted: bool = False) -> None:
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

    # --- failure handling ----------------------------------------------------------------------------------
    def _fail_batch(self, b: _Batch, exc: BaseException) -> None:
        with b.lock:
            if b.event.is_set():
                return
            b.error = exc
        self.counters.add("batches_failed")
        if self.trace is not None:
            self.trace.instant(f"batch {b.id} failed", "batch", "batches", {"error": str(exc)[:200]})
        b.event.set()

    def _all_rails_failed(self, peer: _Peer, what: str) -> TransferError:
        causes = [pr.cause or PeerLost(f"rail {pr.rail}: endpoint dead") for pr in peer.rails]
        text = "; ".join(f"rail {pr.rail}: {c}" for pr, c in zip(peer.rails, causes))
        return TransferError(f"{what}: every rail failed ({text})", causes)

    def _rail_failed(self, pr: _PeerRail, cause: BaseException) -> None:
        """Mark a rail to a peer dead and re-send its unfinished work on the device's other rails."""
        with self._lock:
            if pr.alive:
                pr.alive = False
                pr.cause = cause
                # a peer that closed with nothing in flight is routine; lost work is worth a warning
                log.log(logging.WARNING if pr.inflight and not self._closed else logging.INFO,
                        "rail %d to %s failed (%s); re-dispatching %d unit(s)", pr.rail, pr.remote_id, cause,
                        len(pr.inflight))
                self.counters.add("rail_failures")
            victims = [a for a in pr.inflight if not a.cancelled and not a.finished]
            for a in victims:
                a.cancelled = True
            peer = pr.peer
            if peer is not None and victims:
                peer.lost_work = True
            lost = peer is not None and peer.ready and not peer.retired and not any(r.alive for r in peer.rails)
        with pr.cv:
            pr.cv.notify_all()
        if lost:
            # before the re-dispatch below: it finds no rail and fails the batches with every rail's cause
            self._forget_peer(peer)
        for a in victims:
            # the fabric may still read a slot of a posted write whose completion has not come: that slot is
            # given back by the completion; everything else now
            if not a.posted or a.write_done:
                self._drop(a)
            if a.batch.failed:
                continue
            self._redispatch(a)

    def _fail_peer(self, peer: _Peer, cause: Optional[BaseException]) -> None:
        """Fail every rail of ``peer`` (``cause``, or each rail's own: its endpoint died), which forgets it."""
        for pr in list(peer.rails):
            self._rail_failed(pr, cause or pr.cause or PeerLost(f"rail {pr.rail} endpoint to {peer.session} died"))
        self._forget_peer(peer)  # a peer without rails (cannot happen after a handshake) is forgotten too

    def _forget_peer(self, peer: _Peer) -> None:
        """Every rail to ``peer`` failed: drop what this engine holds for it (session entry, rails, credit region,
        control socket), so that the next batch to its session handshakes from scratch -- with the same process
        back after a network blip, or a new one at the same host:port. Batches still holding this peer keep
        its dead rails and fail with their causes; other peers are not touched. Idempotent."""
        with self._lock:
            if peer.retired:
                return
            peer.retired = True  # from now on _peer() replaces it instead of handing it out
            why = "; ".join(f"rail {pr.rail}: {pr.cause or 'endpoint dead'}" for pr in peer.rails)
            if not self._closed:
                # counted with the flag, under the lock: a batch failed by another thread that found the peer
                # retired must already see it in stats()
                self.counters.add("peers_lost")
                self._lost[peer.session] = why[:500]
                while len(self._lost) > 1024:  # only for error messages: keep the newest
                    self._lost.pop(next(iter(self._lost)))
        # an ack of the old connection still on its way is refused by the fabric (unknown rkey) from now on,
        # instead of landing in a credit region nobody reads
        mrs, peer.credit_mrs = peer.credit_mrs, []
        for fab, mr in zip(self.fabrics, mrs):
            try:
                fab.deregister(mr)
            except FabricError as e:  # a closed fabric released it already
                log.debug("forgetting %s: deregistering the credit region: %s", peer.session, e)
        with self._lock:
            if self._peers.get(peer.session) is peer:
                del self._peers[peer.session]
            for pr in peer.rails:
                if self._by_remote_rail.get(pr.remote_id, (None, None))[0] is peer:
                    del self._by_remote_rail[pr.remote_id]
        # the control socket: shutdown() wakes a region refresh blocked on it from any thread; close it here
        # unless that refresh holds the peer's lock (it closes it on the error it gets)
        sock = peer.ctrl
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if peer.lock.acquire(blocking=False):
                try:
                    self._close_ctrl_locked(peer)
                finally:
                    peer.lock.release()
        if self._closed:
            return
        # a peer that closed while idle is routine; one that took batches down with it is worth a warning
        log.log(logging.WARNING if peer.lost_work else logging.INFO,
                "engine %s: every rail to %s failed (%s); forgot the peer, the next batch to it handshakes again",
                self.session_id, peer.session, why)

    def _redispatch(self, old: _Attempt) -> None:
        b = old.batch
        u = old.unit
        choices = self._rail_choices(u.device, b.peer)
        if not choices:
            # rails whose endpoint died without a completion saying so yet: fail them now, so that the batch
            # names their real causes and a peer without any rail left is forgotten before the caller retries
            for pr in b.peer.rails:
                if pr.alive and not pr.ep.alive:
                    self._rail_failed(pr, PeerLost(f"rail {pr.rail} endpoint to {b.peer.session} died"))
            if b.peer.ready and not any(pr.alive for pr in b.peer.rails):
                # the thread that failed the last rail may not have forgotten the peer yet; the caller woken by
                # the failure below must find it forgotten (stats, and a fresh handshake on its next batch)
                self._forget_peer(b.peer)
            self._fail_batch(b, self._all_rails_failed(b.peer, f"batch {b.id} to {b.peer.session}"))
            return
        load = {pr.rail: pr.bytes_in_flight for pr in b.peer.rails}
        c = min(choices, key=lambda ch: load.get(ch.rail, 0))
        self.counters.add("failovers")
        relay_now = self.relay_mode == "always" or (self.relay_mode == "auto" and not c.local)
        if u.kind == COALESCED or (u.kind == RELAYED) == relay_now:
            units = [dataclasses.replace(u, rail=c.rail, relay_device=c.relay_device)]
        elif relay_now:  # direct pieces, and the new rail is not local to their memory: relay them in slot pieces
            units = []
            for s_, d_, length in u.segments():
                off = 0
                while off < length:
                    n = min(self.slot_bytes, length - off)
                    units.append(Unit(RELAYED, u.device, c.rail, c.relay_device, n, src=s_ + off, dst=d_ + off,
                                      wire_bytes=n, segs=[(s_ + off, d_ + off, n)]))
                    off += n
        else:  # relayed piece(s), and the new rail is local: write them straight from their sources
            units = [Unit(DIRECT, u.device, c.rail, c.relay_device, u.nbytes, src=u.src, dst=u.dst,
                          wire_bytes=u.nbytes, segs=list(u.segments()))]
        if len(units) > 1:
            with b.lock:
                b.remaining += len(units) - 1
        self._dispatch(b, units, from_engine=True)

    def _wait(self, b: _Batch, timeout: Optional[float]) -> None:
        t0 = now_ns()
        if b.pending is not None:
            if not b.event.is_set():
                try:
                    b.pending.wait()
                except RuntimeError as e:  # a CUDA error reported at the synchronise
                    b.error = TransferError(f"batch {b.id}: {b.path} copy failed: {e}", [e])
                t = now_ns()
                with b.lock:
                    first = not b.event.is_set()
                    b.event.set()
                if first:
                    self.counters.add("time_wait_s", (t - t0) / 1e9)
                    self._account_done(f"batch {b.id}", b.t0, t, b.n_items, b.nbytes, b.error is None, b.path)
            if b.error is not None:
                raise b.error
            return
        reader = b.reader
        if reader is not None:  # a small batch whose ack this thread reads itself (``transport.smallbatch``)
            b.reader = None
            start = time.monotonic()
            reader[0].await_rows(reader[1], start + (_READ_MAX if timeout is None else min(timeout, _READ_MAX)))
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        if not b.event.wait(timeout):
            self._fail_batch(b, TransferTimeout(f"batch {b.id} ({b.n_items} pieces, {b.nbytes} B) to "
                                                f"{b.peer.session} did not finish within {timeout} s"))
        self.counters.add("time_wait_s", (now_ns() - t0) / 1e9)
        if b.error is not None:
            # cancel what is still queued so the rings do not work for a dead batch
            raise b.error

    def _check_open(self) -> None:
        if self._closed:
            raise FabricClosed(f"engine {getattr(self, 'session_id', '?')} is closed")
