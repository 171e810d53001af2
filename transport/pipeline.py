"""The data path of ``TransferEngine``: a batch's lifecycle from validation to its posts.

``Pipeline`` composes the parts of the data path, each given the collaborators it uses (no part reaches back into
``Pipeline``): the in-flight state (``transport.inflight.InFlight``: the attempt table, its lock, the ids), the
relay rings, the planner, and

* submission (``submit``): the route a batch takes to the fabric, tried in order: small rows
  (``transport.smallbatch``, on the caller's lists), then, on the batch's ``Validated`` record (argument checks,
  region lookups and extremes, made once): the load/store writer of a same-host peer, the inline route
  (``transport.inline``), or the posted route: the plan (``transport.planner``), attempts per unit, direct
  units posted by the caller, chunks and relayed pieces to the relay rings;
* the copy thread's fill of a slot (gather into a chunk, or relayed pieces into the slot) and landing credits;
* posts (one doorbell per rail endpoint, ``WriteBatch`` where the fabric takes it);
* completions (``transport.completions``), accounting (``transport.batches.Accounts``), failover
  (``transport.peers.Failover``);
* waiting for a batch.
"""
from __future__ import annotations

import logging
import time
from bisect import bisect_right
from typing import Dict, List, Optional, Tuple

import numpy as np

from transport.arrays import as_arrays, distinct, extremes_and_total, numpy_extremes_and_total
from transport.batches import NOT_TAKEN, Accounts, Attempt, Batch, Validated
from transport.completions import Completions
from transport.fills import SlotFills, write_keys
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, InvalidTransfer, PeerGone, PeerLost,
                              RegionError, RemoteRejected, TransferError, TransferTimeout)
from transport.fabric.base import DEVICE_HOST, WriteBatch, WriteBounds, WriteRequest
from transport.fabric.gpu_copy import BoundCopies
from transport.inflight import InFlight
from transport.inline import InlineRoute
from transport.peers import RAIL_CHOICES, Failover, PeerDirectory, Peer, all_rails_failed, rail_choice
from transport.planner import COALESCED, DIRECT, RELAYED, Planner, Unit
from transport.regions import END_MAX, first_bad, locate_inside, span_region
from transport.relay import RelayRing
from transport.smallbatch import LISTS, RowsRoute
from transport.telemetry import POSTED, now_ns

log = logging.getLogger("transport.engine")  # one logger for the engine and its data path

# the routes a submitted batch can take, in the order tried; each counts its batches as ``route_<name>``
ROUTES = ("rows", "loadstore", "inline", "posted")
_READ_MAX = 3600.0  # seconds a caller reads its own ack at most without a timeout (then it waits as any other)


def _rows_may_take(lengths, limit: int, coalesce_bytes: int) -> bool:
    """Whether the small-rows route (``RowsRoute.submit``) may take a batch of these lengths (a list or tuple): 1 to
    ``limit`` pieces, each smaller than ``coalesce_bytes``; True when an entry is not comparable (the route
    decides, and the general path names it)."""
    if not 0 < len(lengths) <= limit:
        return False
    try:
        return max(lengths) < coalesce_bytes
    except TypeError:
        return True


def _group_direct(units: List[Unit]) -> List[Unit]:
    """One DIRECT unit per (rail, device) holding every direct piece planned for it (its runs concatenated): one
    attempt, one post and one completion (a ``WriteBatch``, or selective signaling), where one unit per piece cost
    a unit, an attempt, a write request and a completion in Python for every piece, most of a call of many pieces.
    Failover re-sends the whole group, which rewrites the
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


def _split_inline(atts: List[Attempt], ring: RelayRing, from_engine: bool) -> Tuple[List[Attempt], List[Attempt]]:
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
    """The engine's data path (see the module docstring); owned by ``TransferEngine``.

    Arguments: config: the engine's ``EngineConfig``; caps: the fabric's ``Capabilities``; fabrics: one per rail;
    regions: this engine's ``RegionTable``; directory: the ``PeerDirectory``; receiver, progress: the engine's
    receiver and progress loop; counters, rail_stats, latency, trace: its telemetry (trace None when off);
    engine_id: the id chunks carry."""

    def __init__(self, config, caps, fabrics: list, regions, directory: PeerDirectory, receiver, progress,
                 counters, rail_stats: list, latency, trace, engine_id: int):
        self.config = config
        self.fabrics = fabrics
        self.regions = regions
        self.directory = directory
        self.inflight = InFlight(directory.lock, caps.selective_signaling)  # attempt state, ids, open or closed
        self._progress = progress
        self.counters = counters
        self.rail_stats = rail_stats
        self.trace = trace
        self.engine_id = engine_id
        self.coalesce_bytes = config.coalesce_bytes  # read on every batch: one attribute, not two
        self.planner = Planner(config)
        self._rings: Dict[Tuple[int, int], RelayRing] = {}
        self._relay_copies = BoundCopies()  # GPU relay fills: plans by lengths, bound launches, per ring thread
        self._selective = caps.selective_signaling
        self._batches = caps.write_batches
        self.direct_pieces = config.direct_pieces
        self.accounts = Accounts(counters, latency, trace)
        self.failover = Failover(self.inflight, self.accounts, directory, fabrics, counters, config)
        self.completions = Completions(self.inflight, self.accounts, self.failover, directory, receiver, progress,
                                       fabrics, rail_stats, counters)
        self.failover.connect(self.completions, self.dispatch)
        self.fills = SlotFills(self.inflight, self.failover, directory, regions, fabrics, counters, trace, engine_id,
                               self._relay_copies, caps.write_batches)
        # the routes a batch may take, in the order tried (``ROUTES``)
        # small batches as one WriteRows post, checked in Python (transport.smallbatch)
        self._rows = RowsRoute(self.inflight, self.completions, self.failover, regions, directory, fabrics,
                               rail_stats, counters, trace, config, caps.completion_callback) \
            if caps.write_rows and config.direct_pieces > 0 else None
        # a batch that goes whole as one direct unit, or relayed whole, is written by the caller's thread
        self._inline = InlineRoute(self.inflight, self.accounts, self.planner, fabrics, counters, rail_stats,
                                   self.ring, self._relay_copies, directory, NOT_TAKEN) \
            if caps.inline_writes else None

    @property
    def session_id(self) -> str:
        """The engine's session id (messages), once its control listener is bound."""
        return self.inflight.session_id

    @session_id.setter
    def session_id(self, value: str) -> None:
        self.inflight.session_id = value

    @property
    def control(self):
        """The engine's ``ControlPlane`` (handshakes, region refreshes, credit requests), once made."""
        return self.fills.control

    @control.setter
    def control(self, value) -> None:
        self.fills.control = value

    def rings(self) -> list:
        """The relay rings made so far."""
        return list(self._rings.values())

    def ring(self, device: int, rail: int) -> RelayRing:
        """The relay ring of ``device`` (-1: host) on ``rail``, made at first use."""
        key = (device, rail)
        ring = self._rings.get(key)
        if ring is None:
            with self.inflight.lock:
                ring = self._rings.get(key)
                if ring is None:
                    cfg = self.config
                    name = f"{'host' if device < 0 else f'cuda{device}'}/rail{rail}"
                    ring = RelayRing(name, self.fabrics[rail], device, cfg.lanes, cfg.relay_slots,
                                     cfg.relay_slot_bytes, self.fills.fill, self._post, self.trace)
                    self._rings[key] = ring
        return ring

    def peer(self, session_id: str) -> Peer:
        """The connected peer of ``session_id``, handshaking first when there is none. Raises UnknownSession
        naming why the handshake failed."""
        peer = self.directory.peers.get(session_id) if session_id.__class__ is str else None
        if peer is not None and peer.ready and not peer.retired:
            for pr in peer.rails:  # ``Peer.connected``, read from the rails' flags without the call
                if pr.alive and pr.ep.alive:
                    return peer  # the common case, as ``ControlPlane.peer`` finds it, without the call
        while True:
            try:
                return self.control.peer(session_id)
            except PeerGone as e:
                if e.peer is None:
                    raise  # forgotten already, and nobody answers at its session: the caller's error
                # every endpoint died while nothing was in flight to notice (the peer restarted while idle): fail
                # the rails now so the peer is forgotten, then handshake again
                self.failover.fail_peer(e.peer, None)

    def _refresh_regions(self, peer: Peer) -> None:
        """Fetch the peer's region list again; when nobody (or a different engine) answers at its session any
        more the peer is forgotten. Raises TransferError naming the cause."""
        try:
            self.control.refresh_regions(peer)
        except PeerGone as e:
            gone = e.cause or e
            self.failover.fail_peer(peer, PeerLost(f"control connection to {peer.session}: {gone}"))
            raise PeerGone(f"cannot refresh the region list of {peer.session}: {gone}; forgot the peer, the "
                           f"next batch to it handshakes again", None, gone) from None

    def close(self) -> None:
        """Fail the batches in flight, stop the completions and the relay rings."""
        self.inflight.closed = True
        self.completions.closed = True
        for a in self.inflight.attempts():
            self.accounts.fail(a.batch, TransferError(f"engine {self.session_id} closed"))

    def close_rings(self) -> None:
        for ring in list(self._rings.values()):
            ring.close()

    # --- submission ----------------------------------------------------------------------------------------
    def submit(self, session_id, srcs, dsts, lengths, async_: bool = False) -> Optional[Batch]:
        """Check a batch and hand it to the first route that takes it (``ROUTES``): small rows, load/store, inline,
        posted. Returns the ``Batch`` to wait for (``wait``), or None when nothing is left to wait for (written
        while the caller waited, or nothing to write)."""
        self.check_open()
        rows = self._rows
        if rows is not None and (lengths.__class__ not in LISTS or _rows_may_take(lengths, self.direct_pieces,
                                                                                   self.coalesce_bytes)):
            # a few small pieces, given as lists, tuples, arrays or tensors alike (a list the route would decline
            # by its size or a large piece is declined here, without the call: the route's own first tests)
            got = rows.submit(session_id, srcs, dsts, lengths, not async_)
            if got is not NOT_TAKEN:
                return got
        v = self._validate(session_id, srcs, dsts, lengths, async_)
        if v.__class__ is not Validated:
            return v  # nothing to write, or the batch of the pieces left once zero-length ones were dropped
        if v.peer.loadstore is not None:
            got = self._write_loadstore(v)
            if got is not NOT_TAKEN:
                return got
        if self._inline is not None:
            got = self._inline.submit(v)
            if got is not NOT_TAKEN:
                return got
        return self._submit_posted(v)

    def _validate(self, session_id, srcs, dsts, lengths, async_: bool):
        """The batch's ``Validated`` record: its arrays, checked; the regions holding its pieces on each side;
        its extremes. None for an empty batch (its session checked); for a batch with zero-length pieces, what
        ``submit`` returns for the rest. Raises InvalidTransfer / AddressNotRegistered naming the bad entry."""
        t0 = now_ns()
        src, dst, ln = as_arrays(("srcs", srcs), ("dsts", dsts), ("lengths", lengths))
        n = ln.size
        if n == 0:
            self.peer(session_id)  # an unknown session is an error even for an empty batch
            return None
        # One pass over the three columns (in C where the install built it) serves the argument checks and the
        # common case of the region lookups below (every source in one registered buffer, every destination in one
        # of the peer's): per-call host time is the cost that matters for small batches. Each side's pieces lie in
        # [smallest start, largest start + longest length): a span holding all of them, the exact one when the
        # lengths are equal, which is what the one-region lookups below need; the ends themselves are summed only
        # when that span is not inside one region (two passes over the batch fewer in the common case).
        try:
            smin, smax, dmin, dmax, lmin, lmax, nbytes = extremes_and_total(src, dst, ln)
        except ValueError:  # a strided view of an int64 array ("not C-contiguous"): numpy reads it
            smin, smax, dmin, dmax, lmin, lmax, nbytes = numpy_extremes_and_total(src, dst, ln)
        if lmin < 1:
            i = int(np.argmin(ln))
            if lmin < 0:
                raise InvalidTransfer(f"lengths[{i}] = {int(ln[i])}: every length must be >= 0")
            # zero-length pieces are done by definition, as in Mooncake: dropped unchecked, the rest goes on
            keep = ln != 0
            return self.submit(session_id, src[keep], dst[keep], ln[keep], async_)
        for name, arr, lo in (("srcs", src, smin), ("dsts", dst, dmin)):
            if lo < 0:
                i = int(np.argmin(arr))
                raise InvalidTransfer(f"{name}[{i}] = {int(arr[i])} is negative")
        peer = self.peer(session_id)
        writer = peer.loadstore
        if writer is not None and writer.stale():
            self._refresh_regions(peer)  # the peer deregistered something: never write by a stale list
        lsnap, rsnap = self.regions.snap, peer.regions.snap
        send, dend = smax + lmax, dmax + lmax
        # the common case, one region on each side holding each side's span (``span_region`` on the snapshots'
        # sorted lists: the region starting last at or before the span's start, its end past the span's; the
        # starts are >= 0, checked above, and the lengths >= 1); the others piece by piece
        idx = bisect_right(lsnap.start_list, smin) - 1
        if idx < 0 or not send <= lsnap.end_list[idx] < END_MAX:
            idx = None
        ridx = bisect_right(rsnap.start_list, dmin) - 1
        if ridx < 0 or not dend <= rsnap.end_list[ridx] < END_MAX:
            ridx = None
        if idx is None:
            idx, send = self._local_regions(lsnap, src, ln, smin, smax, lmin, lmax, send)
        if ridx is None:
            rsnap, ridx, dend = self._peer_regions(peer, dst, ln, dmin, dmax, lmin, lmax, dend)
        devices = lsnap.devices[idx]  # a scalar when one region holds every source
        return Validated(peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx,
                         nbytes, lmin, lmax, smin, send, dmin, dend,
                         getattr(idx, "ndim", 0) == 0 and getattr(ridx, "ndim", 0) == 0, t0, now_ns(), async_)

    def _local_regions(self, lsnap, src, ln, smin: int, smax: int, lmin: int, lmax: int, send: int) -> tuple:
        """(region index, or one per piece; the sources' largest end) of a batch whose every source must lie in a
        region of ``lsnap``, this engine's table, and whose span (``send``: largest start + longest length) is not
        inside one. Raises AddressNotRegistered naming the first that does not."""
        idx = None
        if send < 1 << 63:  # no end wraps in int64: src + ln holds every true end
            idx, send = self._locate_ends(lsnap, src, ln, smin, smax, lmin, lmax, send)
        if idx is None:
            idx, ok = self.regions.locate(src, ln, lsnap)
            if not ok.all():
                i = first_bad(ok)
                raise AddressNotRegistered(f"srcs[{i}] = 0x{int(src[i]):x} + lengths[{i}] = {int(ln[i])} is not "
                                           f"inside a region registered with this engine")
        return idx, send

    def _peer_regions(self, peer: Peer, dst, ln, dmin: int, dmax: int, lmin: int, lmax: int, dend: int) -> tuple:
        """(the peer's table, region index or one per piece, the destinations' largest end) of a batch whose
        every destination must lie in a region the peer advertised (refreshed once: it may have registered
        more since the handshake), and whose span (``dend``) is not inside one. Raises AddressNotRegistered
        naming the first that does not."""
        rsnap = peer.regions.snap
        ridx = None
        if dend < 1 << 63:
            ridx, dend = self._locate_ends(rsnap, dst, ln, dmin, dmax, lmin, lmax, dend)
        if ridx is None:
            ridx, ok = peer.regions.locate(dst, ln, rsnap)
            if not ok.all():
                self._refresh_regions(peer)
                rsnap = peer.regions.snap
                ridx, ok = peer.regions.locate(dst, ln, rsnap)
                if not ok.all():
                    i = first_bad(ok)
                    raise AddressNotRegistered(f"dsts[{i}] = 0x{int(dst[i]):x} + lengths[{i}] = {int(ln[i])} is "
                                               f"outside every region session {peer.session} registered; nothing "
                                               f"was written")
        return rsnap, ridx, dend

    def _write_loadstore(self, v: Validated):
        """The load/store route (a same-host peer on a fabric with ``loadstore``): the peer's writer moves the
        validated batch from this thread. Returns None (written and counted), a ``Batch`` holding the copies
        still running (``async_``), or ``NOT_TAKEN`` (not connected, or the writer declined: nothing counted)."""
        peer = v.peer
        if not peer.connected():
            return NOT_TAKEN
        try:
            pending = peer.loadstore.write(v.src, v.dst, v.ln, v.devices, v.ridx, v.rsnap, wait=not v.async_,
                                           length_stats=(v.nbytes, v.lmin, v.lmax))
        except (TransferError, PeerLost) as e:
            self.counters.add_many((("batches_submitted", 1), ("batches_failed", 1)))
            if isinstance(e, PeerLost):
                # the same-host peer's process is gone (ESRCH): forget it now, as a dead rail would, so the next
                # call (whose handshake nobody answers) names it gone too, whichever thread notices the death first
                self.failover.fail_peer(peer, e)
                if not isinstance(e, PeerGone):
                    raise PeerGone(f"peer {peer.session} is gone: {e}", peer, e) from e
            raise
        if pending is None:
            return NOT_TAKEN
        t0, t1, t2, n, nbytes = v.t0, v.t1, now_ns(), int(v.ln.size), v.nbytes
        counts = [("batches_submitted", 1), ("route_loadstore", 1), ("items", n), ("bytes", nbytes),
                  ("path_loadstore_units", 1), ("path_loadstore_bytes", nbytes),
                  ("time_validate_s", (t1 - t0) / 1e9), ("time_loadstore_s", (t2 - t1) / 1e9)]
        if not v.async_:  # already complete: account for it here, nothing to wait for
            counts.append(("batches_ok", 1))
            self.counters.add_many(counts)
            self.accounts.done("batch", t0, t2, n, nbytes, True, "loadstore", counted=True)
            return None
        self.counters.add_many(counts)
        batch = Batch(self.inflight.new_batch_id(), peer, v.src, v.dst, v.ln, nbytes)
        batch.pending = pending
        return batch

    def _submit_posted(self, v: Validated) -> Batch:
        """The posted route, which takes any validated batch: plan its units (``transport.planner``), dispatch
        them (direct units posted by this thread, chunks and relayed pieces through the relay rings); returns
        the ``Batch`` its completions finish."""
        peer, devices, ln = v.peer, v.devices, v.ln
        if getattr(devices, "ndim", 0) == 0:
            device_list = [int(devices)]
            devices = None  # the planner reads one device from device_list
        else:
            device_list = distinct(devices)
        if device_list[-1] >= 0:  # sorted: some source is on a GPU
            self._await_sources(device_list)
        rails_of = {}
        routed = self.directory.routes is not None
        for dev in device_list:
            if routed and dev >= 0:
                choices = self.directory.rail_choices(dev, peer)
            else:  # ``PeerDirectory.rail_choices`` of a device without routes: every usable rail, as it is
                choices = []
                for i, pr in enumerate(peer.rails):
                    if pr.alive and pr.ep.alive:  # the made-once choice, read without a call once it exists
                        choices.append(RAIL_CHOICES.get((i, True, dev)) or rail_choice(i, True, dev))
            if not choices:
                raise all_rails_failed(peer, f"no usable rail to {peer.session} for device {dev}")
            rails_of[dev] = choices
        load = {}  # a loop, not a comprehension: a frame fewer on every batch
        for pr in peer.rails:
            load[pr.rail] = pr.bytes_in_flight
        dst_devices = None
        if peer.forward is not None and v.lmax >= self.coalesce_bytes:
            dst_devices = v.rsnap.devices[v.ridx]
            if getattr(dst_devices, "ndim", 0) == 0:
                dst_devices = np.full(ln.size, int(dst_devices), dtype=np.int64)
        # a peer whose landing slots are smaller than our chunks has its own planner, which cuts them to fit
        planner = peer.planner or self.planner
        batch = Batch(self.inflight.new_batch_id(), peer, v.src, v.dst, ln, v.nbytes)
        if v.one_region:
            batch.spans = (v.lsnap, int(v.idx), v.rsnap, int(v.ridx))
            batch.checked = v
        units = planner.plan(v.src, v.dst, ln, devices, rails_of, load, device_list, dst_devices, peer.forward,
                             (v.nbytes, v.lmax, v.lmin))
        if len(units) > 1:
            units = _group_direct(units)
        t2 = now_ns()
        batch.remaining = len(units)
        self.dispatch(batch, units)
        t3 = now_ns()
        counts = (("batches_submitted", 1), ("route_posted", 1), ("items", int(ln.size)), ("bytes", batch.nbytes),
                  ("time_validate_s", (v.t1 - v.t0) / 1e9), ("time_plan_s", (t2 - v.t1) / 1e9),
                  ("time_dispatch_s", (t3 - t2) / 1e9))
        if v.async_:
            self.counters.add_many(counts)
        else:  # the caller waits next (``wait``): counted with the wait's time, in one update
            batch.counts = counts
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

    def dispatch(self, batch: Batch, units: List[Unit], from_engine: bool = False) -> None:
        """Create attempts for units and hand them to rings (chunks, relayed pieces) or post them (direct)."""
        direct: Dict[int, List[Attempt]] = {}
        to_copy: Dict[Tuple[int, int], List[Attempt]] = {}
        with self.inflight.lock:
            attempts = []
            for u in units:
                pr = batch.peer.rails[u.rail]
                a = Attempt(self.completions, u, batch, pr)
                if u.kind == COALESCED:
                    with pr.cv:
                        pr.chunk_demand += 1
                    a.demand = True
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
            ring = self.ring(dev if dev >= 0 else DEVICE_HOST, rail)
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
                self.accounts.fail(batch, e)
                for a in atts:
                    self.inflight.drop(a)
                continue
            if from_engine:
                self._post_later(atts)  # redispatch from a poller: it keeps polling
            else:
                self._post(atts)  # the caller posts zero-copy writes itself: no thread hand-off

    def _ensure_peers(self, relay: int, atts: List[Attempt]) -> None:
        sources = {a.unit.device for a in atts if a.unit.device >= 0 and a.unit.device != relay}
        if sources:
            from pxn_kernels.peer_access import ensure_peer_access
            ensure_peer_access(relay, sources)

    def _direct_requests(self, atts: List[Attempt], peer: Peer, rail: int) -> None:
        """Write requests of direct attempts on one rail, their keys looked up for all at once (scalar lookups cost
        more host time than the post itself): one ``WriteBatch`` per attempt on fabrics with ``write_batches``,
        else one ``WriteRequest`` per piece, of which, with selective signaling, only each attempt's last
        completes on success."""
        parts = [a.unit.runs if a.unit.runs is not None else a.unit.arrays() for a in atts]  # runs: no call
        lsnap, rsnap = self.regions.snap, peer.regions.snap
        batch = atts[0].batch
        spans = batch.spans  # ``Batch.local_region`` / ``peer_region``, written out: this runs once per post
        if self._batches and spans is not None and spans[0] is lsnap and spans[2] is rsnap \
                and all(a.batch is batch for a in atts):
            # one region on each side holds the whole batch: one key each, no lookup per piece
            _one_region_requests(atts, parts, batch, lsnap.regions[spans[1]].keys[rail].lkey,
                                 rsnap.regions[spans[3]].keys[rail])
            return
        if len(parts) == 1:
            src, dst, n = parts[0]
        else:
            src, dst, n = (np.concatenate([p[i] for p in parts]) for i in range(3))
        # every unit lies inside a piece the batch's validation accepted, so no end wraps
        li, ri = locate_inside(lsnap, src, src + n), locate_inside(rsnap, dst, dst + n)
        if li is None or ri is None:  # a region went away since validation: name it
            for a in atts:
                a.reqs = [WriteRequest(s_, n_, d_, *reversed(write_keys(self.regions, a, s_, d_, n_)))
                          for s_, d_, n_ in a.unit.segments()]
            return
        if self._batches:
            # one WriteBatch per attempt: arrays end to end, one completion (an object per write costs a Python
            # step at each of five stages between here and the fabric's ack)
            lkeys = np.array([r.keys[rail].lkey for r in lsnap.regions], dtype=np.int64)
            rkeys = np.array([r.keys[rail] for r in rsnap.regions], dtype=np.int64)
            k = 0
            for a, p in zip(atts, parts):
                m = p[2].size
                sl = slice(k, k + m)
                a.reqs = [WriteBatch(src[sl], n[sl], dst[sl], rkeys[ri[sl]], lkeys[li[sl]])]
                k += m
            return
        self._piece_requests(atts, src, dst, n, li, ri, lsnap, rsnap, rail)

    def _piece_requests(self, atts: List[Attempt], src, dst, n, li, ri, lsnap, rsnap, rail: int) -> None:
        """``_direct_requests`` on fabrics without ``write_batches``: one ``WriteRequest`` per piece (``li``, ``ri``:
        each piece's region on each side), of which, with selective signaling, only each attempt's last completes
        on success."""
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

    # --- posts ---------------------------------------------------------------------------------------------
    def _post(self, attempts: List[Attempt], after=None) -> None:
        """Post attempts (one doorbell per rail endpoint). Runs in a ring's copy thread, the progress loop
        (``_post_later``) or the caller.
        ``after``: CUDA events the writes must follow (a round of relay fills), for fabrics with
        ``event_ordered_writes``; their slots go back to the ring as soon as the writes are queued, to be
        refilled after the writes' own event."""
        groups: Dict[int, List[Attempt]] = {}
        for a in attempts:
            groups.setdefault(id(a.prail), []).append(a)
        for atts in groups.values():
            live = self._in_flight(atts)
            if live:
                self._post_rail(atts[0].prail, live, after)

    def _in_flight(self, atts: List[Attempt]) -> List[Attempt]:
        """The attempts of ``atts`` still wanted, their writes now in flight (the others dropped)."""
        live = []
        inflight = self.inflight
        with inflight.lock:
            for a in atts:
                if a.cancelled or a.batch.error is not None:
                    inflight.drop(a)
                    continue
                inflight.post_locked(a)
                live.append(a)
        for a in live:
            if a.slot is not None:
                a.slot.enter(POSTED)
        return live

    def _post_rail(self, pr, live: List[Attempt], after) -> None:
        """Post the writes of ``live`` (attempts in flight on rail endpoint ``pr``) with one doorbell, and count
        the post; a failed post fails the rail over, or the batches when the peer or a local check refused it."""
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
            self._post_failed(pr, live, e)
            return
        if reusable is not None:
            for a in live:
                with self.inflight.lock:
                    slot, a.slot = a.slot, None  # unless a completion already released it
                if slot is not None:
                    slot.ring.release(slot, after=reusable)
        t1 = now_ns()
        nbytes = writes = 0  # one loop, not two generator sums: this runs once per post
        for a in live:
            for r in a.reqs:
                if isinstance(r, WriteBatch):
                    nbytes += r.nbytes
                    writes += len(r.length)  # its ``count``, without the property's call
                else:
                    nbytes += r.length
                    writes += 1
        self.rail_stats[pr.rail].add_many((("post_calls", 1), ("writes_posted", writes),
                                           ("bytes_posted", nbytes), ("time_post_s", (t1 - t0) / 1e9)))
        if self.trace is not None:
            self.trace.complete("post", "fabric", f"post/rail{pr.rail}", t0, t1, {"writes": len(live), "bytes": nbytes})

    def _post_failed(self, pr, live: List[Attempt], e: BaseException) -> None:
        """A post of ``live`` on ``pr`` raised ``e``: their writes are not in flight; a dead rail fails over, a
        refused post fails the batches."""
        inflight = self.inflight
        with inflight.lock:
            for a in live:
                inflight.unpost_locked(a)
        if isinstance(e, (FabricError, OSError)) and not isinstance(e, RegionError):
            self.failover.rail_failed(pr, e)  # the rail is gone: its work fails over
            return
        for a in live:
            # the peer refused a region, or a local check failed (a bug or a racing deregister)
            self.accounts.fail(a.batch, RemoteRejected(f"post refused: {e}", [e]) if isinstance(e, RegionError)
                               else InvalidTransfer(f"post refused locally: {e}", [e]))
            inflight.drop(a)

    def _post_later(self, attempts: List[Attempt]) -> None:
        """Post re-dispatched attempts from the progress loop, after the task that re-dispatched them, so that a
        poller that found the failure keeps polling."""
        self._progress.submit(self._post_if_open, attempts)

    def _post_if_open(self, attempts: List[Attempt]) -> None:
        # _post handles its own failures; the progress loop logs anything else
        if not self.inflight.closed:
            self._post(attempts)

    # --- waiting -------------------------------------------------------------------------------------------
    def wait(self, b: Batch, timeout: Optional[float]) -> None:
        """Wait for batch ``b`` (``timeout`` seconds, None: without limit). Raises its error, or TransferTimeout."""
        if b.pending is not None:
            self._wait_pending(b)
            return
        t0 = now_ns()
        reader = b.reader
        if reader is not None:  # a small batch whose ack this thread reads itself (``transport.smallbatch``)
            b.reader = None
            start = time.monotonic()
            reader[0].await_rows(reader[1], start + (_READ_MAX if timeout is None else min(timeout, _READ_MAX)))
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - start))
        if not b.event.wait(timeout):
            self.accounts.fail(b, TransferTimeout(f"batch {b.id} ({b.n_items} pieces, {b.nbytes} B) to "
                                                  f"{b.peer.session} did not finish within {timeout} s"))
        counts = b.counts
        if counts is None:
            self.counters.add("time_wait_s", (now_ns() - t0) / 1e9)
        else:  # a batch the caller waited for as it submitted it: its submission's counts too (``_submit_posted``)
            b.counts = None
            self.counters.add_many(counts + (("time_wait_s", (now_ns() - t0) / 1e9),))
        if b.error is not None:
            # cancel what is still queued so the rings do not work for a dead batch
            raise b.error

    def _wait_pending(self, b: Batch) -> None:
        """``wait`` for a batch of the load/store or inline route whose device work is still running."""
        t0 = now_ns()
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
                self.accounts.done(f"batch {b.id}", b.t0, t, b.n_items, b.nbytes, b.error is None, b.path)
        if b.error is not None:
            raise b.error

    def check_open(self) -> None:
        """Raises FabricClosed once the engine is closed."""
        if self.inflight.closed:
            raise FabricClosed(f"engine {self.session_id} is closed")


def _one_region_requests(atts: List[Attempt], parts: list, batch: Batch, lkey: int, rkey: int) -> None:
    """One ``WriteBatch`` per direct attempt of a batch that one region on each side holds (keys ``lkey`` and
    ``rkey`` for every write), carrying the validation's extremes (``WriteBounds``) when it has them."""
    v = batch.checked
    for a, p in zip(atts, parts):
        m = p[2].size
        if v is None:
            nbytes = bounds = None
        elif p[2] is batch.lengths and p[0] is batch.srcs and p[1] is batch.dsts:
            # the unit is the whole batch, whose arrays the validation reduced: the fabric checks those
            # extremes instead of reducing the same arrays again
            nbytes, bounds = batch.nbytes, WriteBounds(v.lmin, v.lmax, v.smin, v.send, v.dmin, v.dend, rkey, lkey)
        else:
            # a part of the batch (a run of its pieces on one rail, or parts of pieces): its lengths'
            # extremes are its own, and every write lies inside a piece of the batch, so the batch's
            # address spans hold its writes; the fabric's checks against these spans cover each write
            nbytes = a.unit.nbytes
            bounds = WriteBounds(int(p[2].min()), int(p[2].max()), v.smin, v.send, v.dmin, v.dend, rkey, lkey)
        a.reqs = [WriteBatch(p[0], p[2], p[1], np.full(m, rkey, dtype=np.int64),
                             np.full(m, lkey, dtype=np.int64), nbytes=nbytes, bounds=bounds)]
