"""Small batches on fabrics that take ``WriteRows`` (tcp): a batch of a few small host pieces, every source in
one registered region and every destination in one of the peer's, submitted in a few Python steps.

What the general path (``Pipeline.submit``) does for such a batch -- argument arrays, reductions, the plan, a
``WriteBatch`` of arrays, the fabric's array checks and framing -- is a few dozen numpy calls on arrays of a
dozen items: more host time than the batch's wire round trip. Here the same checks run
on the caller's lists of ints (a short array or tensor is made a list first: one route per batch, whatever the
types of its arguments), and the batch becomes the plan's own result for it (``Planner.direct_pieces``): one
DIRECT unit on the least loaded rail, one ``WriteRows`` request, posted by the caller with ``Pipeline._post``'s
bookkeeping done here in one lock section. ``RowsRoute`` is the first route a batch meets: it declines a batch
with a piece that is not small before any check of its lists (that batch is checked once, by the general path).
Its ack completes the batch straight away (``WriteRows.on_acked``, ``Completions.rows_acked``) when nothing
posted earlier on the endpoint is still waiting; otherwise it completes through the fabric's completions like any
write.

Anything else -- a non-int entry, a piece that is not small, a source or destination outside one region, an
unknown or unconnected peer, no usable rail -- is left to the general path, which handshakes, refreshes the
peer's regions, and names the bad entry; nothing is written or counted here before every check passed.
Failover and failure handling are the general path's: the unit and its attempt are the same kind of objects.
"""
from __future__ import annotations

import _thread
from typing import Optional, Sequence

from transport.batches import NOT_TAKEN, Attempt, Batch
from transport.errors import FabricError, InvalidTransfer, PeerLost, RegionError, RemoteRejected
from transport.fabric.base import DEVICE_HOST, WriteRows
from transport.planner import DIRECT, Unit
from transport.regions import END_MAX, span_region
from transport.telemetry import now_ns

LISTS = (list, tuple)  # argument types taken as they are (an array or tensor is made a list first)


class Signal:
    """A ``threading.Event`` that is set once and never cleared, built on one lock held from creation until
    ``set``: a wait is one acquire, where an Event's condition variable allocates a lock and takes two more per
    wait (a cost the caller of a small batch pays on its critical path, with caches cold from the other side's
    work). Thread-safe for any number of setters and waiters."""

    __slots__ = ("_lock", "_set")

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        try:
            self._lock.release()
        except RuntimeError:  # a second setter at the same moment: the lock is already free
            pass

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(float(timeout), 0.0)):
            try:
                self._lock.release()  # for the next waiter
            except RuntimeError:  # a second setter released it meanwhile
                pass
        return self._set


def _short(values, limit: int):
    """``values`` itself when it is a list or a tuple; the entries of a flat numpy array or tensor of at most
    ``limit`` entries as a list (``tolist``: about half a microsecond for a dozen, where converting lists to
    arrays for the general path costs several); else None. So a batch takes this route by its size and
    values, whatever the type of its arguments."""
    cls = values.__class__
    if cls in LISTS:
        return values
    try:
        if values.ndim != 1 or values.shape[0] > limit:  # shape, not len(): a tensor's len() costs microseconds
            return None
        return values.tolist()
    except (AttributeError, TypeError, RuntimeError):  # not an array, or a tensor that cannot be read here
        return None


class RowsRoute:
    """Submits small batches as one ``WriteRows`` post from the caller's thread (see the module docstring).

    Arguments: inflight: the ``transport.inflight.InFlight``; completions: the
    ``transport.completions.Completions`` (an attempt's end; its ``rows_acked`` completes a batch from its ack);
    failover: the ``transport.peers.Failover`` (a rail found dead when posting); regions: this engine's
    ``RegionTable``; directory: the ``PeerDirectory``; fabrics, rail_stats: one per rail; counters, trace: the
    engine's telemetry; config: its ``EngineConfig`` (``direct_pieces``, ``coalesce_bytes``); by_callback: the
    fabric's ``completion_callback``."""

    def __init__(self, inflight, completions, failover, regions, directory, fabrics: list, rail_stats: list, counters,
                 trace, config, by_callback: bool):
        self.inflight = inflight
        self.completions = completions
        self.failover = failover
        self.regions = regions
        self.peers = directory.peers
        self.fabrics = fabrics
        self.rail_stats = rail_stats
        self.counters = counters
        self.trace = trace
        self.limit = config.direct_pieces
        self.coalesce_bytes = config.coalesce_bytes
        self.by_callback = by_callback

    def submit(self, session_id, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
               read_ack: bool = False):
        """Submit a small batch as one ``WriteRows`` post from this thread. Returns the ``Batch`` (posted; its
        completion sets ``batch.event``), or ``NOT_TAKEN`` when the batch does not qualify (nothing was done: the
        next route takes it). ``read_ack``: this thread waits for the batch next (``Pipeline.wait``) and may read
        the ack itself when the fabric lets it (``batch.reader`` set: then ``wait`` must follow)."""
        t0 = now_ns()
        limit = self.limit
        srcs, dsts, lengths = _short(srcs, limit), _short(dsts, limit), _short(lengths, limit)
        if srcs is None or dsts is None or lengths is None:
            return NOT_TAKEN
        n = len(lengths)
        if not 0 < n <= limit or len(srcs) != n or len(dsts) != n:
            return NOT_TAKEN
        peer = self.peers.get(session_id)
        if peer is None or not peer.ready or peer.retired or peer.loadstore is not None or peer.forward is not None:
            return NOT_TAKEN
        try:
            if max(lengths) >= self.coalesce_bytes:
                return NOT_TAKEN  # a large piece: the other routes', before any check of the lists here
            req = WriteRows(srcs, lengths, dsts, 0, 0)  # checks the values; the keys follow with the rail
        except (ValueError, TypeError):
            return NOT_TAKEN
        found = self._regions(peer, req)
        pr = self._rail(peer) if found is not None else None
        if pr is None:
            return NOT_TAKEN
        lsnap, li, rsnap, ri = found
        rail, nbytes = pr.rail, req.nbytes
        batch = Batch(self.inflight.new_batch_id(), peer, srcs, dsts, lengths, nbytes, Signal())
        batch.spans = found  # a failover's re-post finds its keys without a lookup per piece
        batch.remaining = 1
        la, ra = req.local_addr, req.remote_addr
        unit = Unit(DIRECT, DEVICE_HOST, rail, DEVICE_HOST, nbytes, src=la[0], dst=ra[0], wire_bytes=nbytes,
                    segs=list(zip(la, ra, req.length)))
        t1 = now_ns()
        req.rkey, req.lkey = rsnap.regions[ri].keys[rail], lsnap.regions[li].keys[rail].lkey
        # ``Pipeline._post`` for this one attempt and request, its bookkeeping in the same lock section as the
        # attempt's creation
        inflight = self.inflight
        with inflight.lock:
            a = Attempt(self.completions, unit, batch, pr)
            pr.inflight.add(a)
            pr.bytes_in_flight += nbytes
            inflight.post_one_locked(a, req)
        if self.by_callback:  # completions by callback: the ack completes the batch at once (``rows_acked``)
            req.on_acked = a.rows_acked
            req.read_ack = read_ack
        posted = self._post(a, req, pr)
        t2 = now_ns()
        if posted:
            self.rail_stats[rail].add_many((("post_calls", 1), ("writes_posted", n), ("bytes_posted", nbytes),
                                            ("time_post_s", (t2 - t1) / 1e9)))
            if self.trace is not None:
                self.trace.complete("post", "fabric", f"post/rail{rail}", t1, t2, {"writes": 1, "bytes": nbytes})
        self.counters.add_many((("batches_submitted", 1), ("route_rows", 1), ("items", n), ("bytes", nbytes),
                                ("time_validate_s", (t1 - t0) / 1e9), ("time_dispatch_s", (t2 - t1) / 1e9)))
        return batch

    def _regions(self, peer, req: WriteRows):
        """(local table, region, peer's table, region): the one host region holding every source of ``req`` and
        the one peer region holding every destination; None when there are no such two."""
        (smin, send), (dmin, dend) = req.local_span, req.remote_span
        if send >= END_MAX or dend >= END_MAX:  # span_region's bound; pieces past it take the general path
            return None
        lmax = req.max_length
        lsnap = self.regions.snapshot()
        li = span_region(lsnap, smin, send - 1, send, lmax)  # every piece has a byte: no start is past send - 1
        if li is None or lsnap.regions[li].device != DEVICE_HOST:
            return None  # GPU sources: gathered into a chunk on the GPU, one launch
        rsnap = peer.regions.snapshot()
        ri = span_region(rsnap, dmin, dend - 1, dend, lmax)
        if ri is None:
            return None
        return lsnap, li, rsnap, ri

    @staticmethod
    def _rail(peer):
        """The least loaded usable rail to ``peer``, ties going to the lowest: one small batch after another keeps
        to one rail (and its socket, ``TcpEndpoint.enqueue_one``), where the peer's receive thread is still awake
        from the last one (``recv_spin``); batches in flight at once still spread by load. None: no usable
        rail."""
        pr = None
        for c in peer.rails:
            if c.alive and c.ep.alive and (pr is None or c.bytes_in_flight < pr.bytes_in_flight):
                pr = c
        return pr

    def _post(self, a: Attempt, req: WriteRows, pr) -> bool:
        """Post ``req``, attempt ``a``'s one request, on rail endpoint ``pr``. False when the post failed: the
        rail failed over (a dead endpoint), or the batch failed (the peer or a local check refused it)."""
        try:
            if not pr.ep.alive:
                raise PeerLost(f"rail {pr.rail} endpoint to {pr.remote_id} is dead")
            fab = self.fabrics[pr.rail]
            fab.post_writes(pr.ep, (req,))
            if req.reader is not None:
                a.batch.reader = (fab, req)
            return True
        except (FabricError, OSError, ValueError) as e:
            inflight = self.inflight
            with inflight.lock:
                inflight.unpost_locked(a)
            if isinstance(e, (FabricError, OSError)) and not isinstance(e, RegionError):
                self.failover.rail_failed(pr, e)  # the rail is gone: the attempt fails over, as from ``_post``
                if a.cancelled:
                    inflight.drop(a)  # a failover that took the attempt while it was being posted re-sent its unit
            else:
                self.completions.fail(a, RemoteRejected(f"post refused: {e}", [e]) if isinstance(e, RegionError)
                                      else InvalidTransfer(f"post refused locally: {e}", [e]))
            return False
