"""The data path of ``TransferEngine``: a batch's lifecycle from validation to its posts.

``Pipeline`` owns the state that moves batches (the attempt table and its lock, the relay rings, the planner)
and composes the parts of the data path:

* submission (``_submit``): argument checks, region lookups and the route a batch takes to the fabric: the
  load/store writer of a same-host peer, small rows (``transport.smallbatch``), the inline route
  (``transport.inline``), or the posted route: the plan (``transport.planner``), attempts per unit, direct
  units posted by the caller, chunks and relayed pieces to the relay rings;
* the copy thread's fill of a slot (gather into a chunk, or relayed pieces into the slot) and landing credits;
* posts (one doorbell per rail endpoint, ``WriteBatch`` where the fabric takes it);
* completions (``transport.completions``), accounting (``transport.batches.Accounts``), failover
  (``transport.peers.Failover``);
* waiting for a batch.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from transport.arrays import as_arrays, distinct
from transport.batches import Accounts, _Attempt, _Batch
from transport.completions import Completions
from transport.fills import SlotFills
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, InvalidTransfer, PeerGone, PeerLost,
                              RegionError, RemoteRejected, TransferError, TransferTimeout)
from transport.fabric.base import DEVICE_HOST, WriteBatch, WriteBounds, WriteRequest
from transport.fabric.gpu_copy import BoundCopies
from transport.inline import InlineRoute
from transport.peers import Failover, PeerDirectory, _Peer, all_rails_failed
from transport.planner import COALESCED, DIRECT, RELAYED, Planner, Unit
from transport.regions import first_bad, locate_inside, span_region
from transport.relay import RelayRing
from transport.smallbatch import submit_rows
from transport.telemetry import POSTED, now_ns

log = logging.getLogger("transport.engine")  # one logger for the engine and its data path

NOT_TAKEN = object()  # what a route returns for a batch it does not take (the next route gets it)
# the routes a submitted batch can take, in the order tried; each counts its batches as ``route_<name>``
ROUTES = ("rows", "loadstore", "inline", "posted")
_READ_MAX = 3600.0  # seconds a caller reads its own ack at most without a timeout (then it waits as any other)


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
    """The engine's data path (see the module docstring); owned by ``TransferEngine``.

    Arguments: config: the engine's ``EngineConfig``; caps: the fabric's ``Capabilities``; fabrics: one per rail;
    regions: this engine's ``RegionTable``; directory: the ``PeerDirectory``; receiver, progress: the engine's
    receiver and progress loop; counters, rail_stats, latency, trace: its telemetry (trace None when off);
    engine_id: the id chunks carry."""

    def __init__(self, config, caps, fabrics: list, regions, directory: PeerDirectory, receiver, progress,
                 counters, rail_stats: list, latency, trace, engine_id: int):
        self.config = config
        self.fabrics = fabrics
        self._regions = regions
        self.directory = directory
        self._peers = directory.peers
        self._lock = directory.lock  # attempt state and peers
        self._progress = progress
        self.counters = counters
        self._rail_stats = rail_stats
        self.trace = trace
        self.engine_id = engine_id
        self.session_id = "?"  # the engine's, once its control listener is bound
        self.control = None  # the engine's ControlPlane, once made (handshakes and region refreshes)
        self._closed = False
        self.coalesce_bytes = config.coalesce_bytes  # read on every batch: one attribute, not two
        self.planner = Planner(config)
        self._wr_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._inflight: Dict[int, _Attempt] = {}
        self._rings: Dict[Tuple[int, int], RelayRing] = {}
        self._relay_copies = BoundCopies()  # GPU relay fills: plans by lengths, bound launches, per ring thread
        self._selective = caps.selective_signaling
        self._batches = caps.write_batches
        # small batches as one WriteRows post, checked in Python (transport.smallbatch)
        self._rows = caps.write_rows and config.direct_pieces > 0
        self.direct_pieces = config.direct_pieces
        self._by_callback = caps.completion_callback
        self.accounts = Accounts(counters, latency, trace)
        self._fail_batch = self.accounts.fail
        self._account_done = self.accounts.done
        self.failover = Failover(self, directory, fabrics)
        self._rail_failed = self.failover.rail_failed
        self._fail_peer = self.failover.fail_peer
        self._rail_choices = directory.rail_choices
        self.fills = SlotFills(self)
        self.completions = Completions(self, directory, receiver, progress, len(fabrics))
        self._finish = self.completions.finish
        self._rows_acked = self.completions.rows_acked
        # a batch that goes whole as one direct unit, or relayed whole, is written by the caller's thread
        self._inline = InlineRoute(self, directory, NOT_TAKEN) if caps.inline_writes else None

    def ring(self, device: int, rail: int) -> RelayRing:
        """The relay ring of ``device`` (-1: host) on ``rail``, made at first use."""
        key = (device, rail)
        ring = self._rings.get(key)
        if ring is None:
            with self._lock:
                ring = self._rings.get(key)
                if ring is None:
                    cfg = self.config
                    name = f"{'host' if device < 0 else f'cuda{device}'}/rail{rail}"
                    ring = RelayRing(name, self.fabrics[rail], device, cfg.lanes, cfg.relay_slots,
                                     cfg.relay_slot_bytes, self.fills.fill, self._post, self.trace)
                    self._rings[key] = ring
        return ring

    def _peer(self, session_id: str) -> _Peer:
        """The connected peer of ``session_id``, handshaking first when there is none. Raises UnknownSession
        naming why the handshake failed."""
        while True:
            try:
                return self.control.peer(session_id)
            except PeerGone as e:
                if e.peer is None:
                    raise  # forgotten already, and nobody answers at its session: the caller's error
                # every endpoint died while nothing was in flight to notice (the peer restarted while idle): fail
                # the rails now so the peer is forgotten, then handshake again
                self._fail_peer(e.peer, None)

    def _refresh_regions(self, peer: _Peer) -> None:
        """Fetch the peer's region list again; when nobody (or a different engine) answers at its session any
        more the peer is forgotten. Raises TransferError naming the cause."""
        try:
            self.control.refresh_regions(peer)
        except PeerGone as e:
            gone = e.cause or e
            self._fail_peer(peer, PeerLost(f"control connection to {peer.session}: {gone}"))
            raise PeerGone(f"cannot refresh the region list of {peer.session}: {gone}; forgot the peer, the "
                           f"next batch to it handshakes again", None, gone) from None

    def close(self) -> None:
        """Fail the batches in flight, stop the completions and the relay rings."""
        self._closed = True
        self.completions.closed = True
        with self._lock:
            pending = list(self._inflight.values())
        for a in pending:
            self._fail_batch(a.batch, TransferError(f"engine {self.session_id} closed"))

    def close_rings(self) -> None:
        for ring in list(self._rings.values()):
            ring.close()

    # --- submission ----------------------------------------------------------------------------------------
    def _submit(self, session_id, srcs, dsts, lengths, async_: bool = False) -> Optional[_Batch]:
        self._check_open()
        if self._rows:
            # a few small pieces, given as lists, tuples, arrays or tensors alike: transport.smallbatch
            batch = submit_rows(self, session_id, srcs, dsts, lengths, read_ack=not async_)
            if batch is not None:
                return batch
        t0 = now_ns()
        src, dst, ln = as_arrays(("srcs", srcs), ("dsts", dsts), ("lengths", lengths))
        if ln.size == 0:
            self._peer(session_id)  # an unknown session is an error even for an empty batch
            return None
        # One pass of reductions serves the argument checks and the common case of the region lookups below
        # (every source in one registered buffer, every destination in one of the peer's): per-call host time
        # is the cost that matters for small batches, and each numpy call has a fixed cost of its own.
        # rows: src, dst, lengths; two axis reductions instead of six whole-array ones. Each side's pieces lie in
        # [smallest start, largest start + longest length): a span holding all of them, the exact one when the
        # lengths are equal, which is what the one-region lookups below need; the ends themselves are summed only
        # when that span is not inside one region (two passes over the batch fewer in the common case).
        n = ln.size
        rows = np.empty((3, n), dtype=np.int64)
        rows[0], rows[1], rows[2] = src, dst, ln
        smin, dmin, lmin = rows.min(axis=1).tolist()
        smax, dmax, lmax = rows.max(axis=1).tolist()
        send, dend = smax + lmax, dmax + lmax
        if lmin < 1:
            i = int(np.argmin(ln))
            if lmin < 0:
                raise InvalidTransfer(f"lengths[{i}] = {int(ln[i])}: every length must be >= 0")
            # zero-length pieces are done by definition, as in Mooncake: dropped unchecked, the rest goes on
            keep = ln != 0
            return self._submit(session_id, src[keep], dst[keep], ln[keep], async_)
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
            got = self._write_loadstore(writer, peer, src, dst, ln, devices, ridx, rsnap, nbytes, lmin, lmax, t0, t1,
                                        async_)
            if got is not NOT_TAKEN:
                return got
        one_region = getattr(idx, "ndim", 0) == 0 and getattr(ridx, "ndim", 0) == 0
        extremes = (lmin, lmax, smin, send, dmin, dend)
        if self._inline is not None:
            got = self._inline.submit(peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx, one_region, extremes,
                                      nbytes, t0, t1, async_)
            if got is not NOT_TAKEN:
                return got
        return self._submit_posted(peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx, one_region, extremes, nbytes,
                                   t0, t1)

    def _write_loadstore(self, writer, peer: _Peer, src, dst, ln, devices, ridx, rsnap, nbytes: int, lmin: int,
                         lmax: int, t0: int, t1: int, async_: bool):
        """The load/store route (a same-host peer on a fabric with ``loadstore``): the peer's ``writer`` moves the
        validated batch from this thread. Returns None (written and counted), a ``_Batch`` holding the copies
        still running (``async_``), or ``NOT_TAKEN`` (the writer declined: nothing counted)."""
        try:
            pending = writer.write(src, dst, ln, devices, ridx, rsnap, wait=not async_,
                                   length_stats=(nbytes, lmin, lmax))
        except (TransferError, PeerLost) as e:
            self.counters.add_many((("batches_submitted", 1), ("batches_failed", 1)))
            if isinstance(e, PeerLost):
                # the same-host peer's process is gone (ESRCH): forget it now, as a dead rail would, so the next
                # call (whose handshake nobody answers) names it gone too, whichever thread notices the death first
                self._fail_peer(peer, e)
                if not isinstance(e, PeerGone):
                    raise PeerGone(f"peer {peer.session} is gone: {e}", peer, e) from e
            raise
        if pending is None:
            return NOT_TAKEN
        t2 = now_ns()
        counts = [("batches_submitted", 1), ("route_loadstore", 1), ("items", int(ln.size)), ("bytes", nbytes),
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

    def _submit_posted(self, peer: _Peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx, one_region: bool,
                       extremes: tuple, nbytes: int, t0: int, t1: int) -> _Batch:
        """The posted route, which takes any validated batch: plan its units (``transport.planner``), dispatch
        them (direct units posted by this thread, chunks and relayed pieces through the relay rings); returns
        the ``_Batch`` its completions finish."""
        lmin, lmax = extremes[0], extremes[1]
        batch = _Batch(next(self._batch_ids), peer, src, dst, ln, nbytes)
        if one_region:
            batch.spans = (lsnap, int(idx), rsnap, int(ridx))
            batch.extremes = extremes
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
                raise all_rails_failed(peer, f"no usable rail to {peer.session} for device {dev}")
        load = {pr.rail: pr.bytes_in_flight for pr in peer.rails}
        dst_devices = None
        if peer.forward is not None and lmax >= self.coalesce_bytes:
            dst_devices = rsnap.devices[ridx]
            if getattr(dst_devices, "ndim", 0) == 0:
                dst_devices = np.full(ln.size, int(dst_devices), dtype=np.int64)
        # a peer whose landing slots are smaller than our chunks has its own planner, which cuts them to fit
        planner = peer.planner or self.planner
        units = _group_direct(planner.plan(src, dst, ln, devices, rails_of, load, device_list, dst_devices,
                                           peer.forward, (nbytes, lmax, lmin)))
        t2 = now_ns()
        batch.remaining = len(units)
        self._dispatch(batch, units)
        t3 = now_ns()
        self.counters.add_many((("batches_submitted", 1), ("route_posted", 1), ("items", int(ln.size)),
                                ("bytes", batch.nbytes), ("time_validate_s", (t1 - t0) / 1e9),
                                ("time_plan_s", (t2 - t1) / 1e9), ("time_dispatch_s", (t3 - t2) / 1e9)))
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

    def _dispatch(self, batch: _Batch, units: List[Unit], from_engine: bool = False) -> None:
        """Create attempts for units and hand them to rings (chunks, relayed pieces) or post them (direct)."""
        direct: Dict[int, List[_Attempt]] = {}
        to_copy: Dict[Tuple[int, int], List[_Attempt]] = {}
        with self._lock:
            attempts = []
            for u in units:
                pr = batch.peer.rails[u.rail]
                a = _Attempt(self, u, batch, pr)
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
        if a.demand:
            a.demand = False
            pr = a.prail
            with pr.cv:
                pr.chunk_demand -= 1
        return first, slot, landing

    def _release(self, a: _Attempt, slot, landing) -> None:
        if slot is not None:
            slot.ring.release(slot)
        if landing is not None:
            self.fills.release_landing(a.prail, landing, a)

    def _drop(self, a: _Attempt) -> None:
        """Give back an attempt's resources when it will not be (or is no longer) in flight. Idempotent."""
        with self._lock:
            _, slot, landing = self._retire_locked(a)
        self._release(a, slot, landing)

    def _post_later(self, attempts: List[_Attempt]) -> None:
        """Post re-dispatched attempts from the progress loop, after the task that re-dispatched them, so that a
        poller that found the failure keeps polling."""
        self._progress.submit(self._post_if_open, attempts)

    def _post_if_open(self, attempts: List[_Attempt]) -> None:
        # _post handles its own failures; the progress loop logs anything else
        if not self._closed:
            self._post(attempts)

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
