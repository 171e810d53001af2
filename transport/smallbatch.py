"""Small batches on fabrics that take ``WriteRows`` (tcp): a batch of a few small host pieces, every source in
one registered region and every destination in one of the peer's, submitted in a few Python steps.

What the general path (``Pipeline._submit``) does for such a batch -- argument arrays, reductions, the plan, a
``WriteBatch`` of arrays, the fabric's array checks and framing -- is a few dozen numpy calls on arrays of a
dozen items: more host time than the batch's wire round trip. Here the same checks run
on the caller's lists of ints (a short array or tensor is made a list first: one route per batch, whatever the
types of its arguments), and the batch becomes the plan's own result for it (``Planner.direct_pieces``): one
DIRECT unit on the least loaded rail, one ``WriteRows`` request, posted by the caller with ``Pipeline._post``'s
bookkeeping done here in one lock section. Its ack completes the batch straight away (``WriteRows.on_acked``,
``Completions.rows_acked``) when nothing posted earlier on the endpoint is still waiting; otherwise it completes
through the fabric's completions like any write.

Anything else -- a non-int entry, a piece that is not small, a source or destination outside one region, an
unknown or unconnected peer, no usable rail -- is left to the general path, which handshakes, refreshes the
peer's regions, and names the bad entry; nothing is written or counted here before every check passed.
Failover and failure handling are the general path's: the unit and its attempt are the same kind of objects.
"""
from __future__ import annotations

import _thread
from typing import Optional, Sequence

from transport.batches import _Attempt, _Batch
from transport.errors import FabricError, InvalidTransfer, PeerLost, RegionError, RemoteRejected
from transport.fabric.base import DEVICE_HOST, WriteRows
from transport.planner import DIRECT, Unit
from transport.regions import span_region
from transport.telemetry import now_ns

_END_MAX = 1 << 62  # span_region's bound on region ends; pieces past it take the general path

_LISTS = (list, tuple)


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
    if cls in _LISTS:
        return values
    try:
        if values.ndim != 1 or values.shape[0] > limit:  # shape, not len(): a tensor's len() costs microseconds
            return None
        return values.tolist()
    except (AttributeError, TypeError, RuntimeError):  # not an array, or a tensor that cannot be read here
        return None


def submit_rows(pipe, session_id, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                read_ack: bool = False):
    """Submit a small batch as one ``WriteRows`` post from this thread. Returns the ``_Batch`` (posted; its
    completion sets ``batch.event``), or None when the batch does not qualify (nothing was done: the caller takes
    the general path). ``read_ack``: this thread waits for the batch next (``Pipeline._wait``) and may read the
    ack itself when the fabric lets it (``batch.reader`` set: then ``_wait`` must follow)."""
    t0 = now_ns()
    limit = pipe.direct_pieces
    srcs, dsts, lengths = _short(srcs, limit), _short(dsts, limit), _short(lengths, limit)
    if srcs is None or dsts is None or lengths is None:
        return None
    n = len(lengths)
    if not 0 < n <= pipe.direct_pieces or len(srcs) != n or len(dsts) != n:
        return None
    peer = pipe._peers.get(session_id)
    if peer is None or not peer.ready or peer.retired or peer.loadstore is not None or peer.forward is not None:
        return None
    try:
        req = WriteRows(srcs, lengths, dsts, 0, 0)  # checks the values; the keys follow with the rail
    except ValueError:
        return None
    lmax = req.max_length
    if lmax >= pipe.coalesce_bytes:
        return None
    (smin, send), (dmin, dend) = req.local_span, req.remote_span
    if send >= _END_MAX or dend >= _END_MAX:
        return None
    lsnap = pipe._regions.snapshot()
    li = span_region(lsnap, smin, send - 1, send, lmax)  # every piece has a byte: no start is past send - 1
    if li is None:
        return None
    local = lsnap.regions[li]
    if local.device != DEVICE_HOST:
        return None  # GPU sources: gathered into a chunk on the GPU, one launch
    rsnap = peer.regions.snapshot()
    ri = span_region(rsnap, dmin, dend - 1, dend, lmax)
    if ri is None:
        return None
    # the least loaded usable rail, ties going to the planner's current turn without moving it: one small batch
    # after another keeps to one rail (and its socket, ``TcpEndpoint.enqueue_one``), where the peer's receive
    # thread is still awake from the last one (``recv_spin``); batches in flight at once still spread by load
    rails = peer.rails
    k = len(rails)
    r = (peer.planner or pipe.planner)._rotate
    pr = None
    for j in range(k):
        c = rails[(r + j) % k]
        if c.alive and c.ep.alive and (pr is None or c.bytes_in_flight < pr.bytes_in_flight):
            pr = c
    if pr is None:
        return None
    rail = pr.rail
    nbytes = req.nbytes
    batch = _Batch(next(pipe._batch_ids), peer, srcs, dsts, lengths, nbytes, Signal())
    batch.spans = (lsnap, li, rsnap, ri)  # a failover's re-post finds its keys without a lookup per piece
    batch.remaining = 1
    la, ra = req.local_addr, req.remote_addr
    unit = Unit(DIRECT, DEVICE_HOST, rail, DEVICE_HOST, nbytes, src=la[0], dst=ra[0], wire_bytes=nbytes,
                segs=list(zip(la, ra, req.length)))
    t1 = now_ns()
    req.rkey, req.lkey = rsnap.regions[ri].keys[rail], local.keys[rail].lkey
    # ``Pipeline._post`` for this one attempt and request, its bookkeeping in the same lock section as the
    # attempt's creation
    with pipe._lock:
        a = _Attempt(pipe, unit, batch, pr)
        pr.inflight.add(a)
        pr.bytes_in_flight += nbytes
        req.wr_id = wr_id = next(pipe._wr_ids)
        pipe._inflight[wr_id] = a
        a.reqs = [req]
        a.pending = 1
        a.posted = True
    if pipe._by_callback:  # completions by callback: the ack completes the batch at once (``Completions.rows_acked``)
        req.on_acked = a.rows_acked
        req.read_ack = read_ack
    try:
        if not pr.ep.alive:
            raise PeerLost(f"rail {rail} endpoint to {pr.remote_id} is dead")
        fab = pipe.fabrics[rail]
        fab.post_writes(pr.ep, (req,))
        posted = True
        if req.reader is not None:
            batch.reader = (fab, req)
    except (FabricError, OSError, ValueError) as e:
        posted = False
        with pipe._lock:
            pipe._unpost(a)
        if isinstance(e, (FabricError, OSError)) and not isinstance(e, RegionError):
            pipe._rail_failed(pr, e)  # the rail is gone: the attempt fails over, as from ``_post``
            if a.cancelled:
                pipe._drop(a)  # a failover that took the attempt while it was being posted re-sent its unit
        else:
            pipe._fail_batch(batch, RemoteRejected(f"post refused: {e}", [e]) if isinstance(e, RegionError)
                            else InvalidTransfer(f"post refused locally: {e}", [e]))
            pipe._drop(a)
    t2 = now_ns()
    if posted:
        pipe._rail_stats[rail].add_many((("post_calls", 1), ("writes_posted", n), ("bytes_posted", nbytes),
                                        ("time_post_s", (t2 - t1) / 1e9)))
        if pipe.trace is not None:
            pipe.trace.complete("post", "fabric", f"post/rail{rail}", t1, t2, {"writes": 1, "bytes": nbytes})
    pipe.counters.add_many((("batches_submitted", 1), ("route_rows", 1), ("items", n), ("bytes", nbytes),
                           ("time_validate_s", (t1 - t0) / 1e9), ("time_dispatch_s", (t2 - t1) / 1e9)))
    return batch
