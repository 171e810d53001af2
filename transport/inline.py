"""The inline route: a batch written from the caller's thread, on fabrics with ``inline_writes`` (tcp, ipc).

When the planner would send a batch whole, in order, as one direct unit (or as direct runs of whole pieces on
several rails, or relayed whole), the caller's thread makes the same writes on the same rails through
``Fabric.write_inline`` / ``write_inline_regions``, without the posted path's unit, attempt, request, post and
completion (each a few function calls of host time per batch, which on the message path cost more than the copy
of most batches). Anything the fabric declines or fails returns None, and the caller posts the batch instead
(the writes are idempotent).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from transport.batches import Batch
from transport.errors import FabricError, TransferError
from transport.fabric.base import DEVICE_HOST, RegionSpans, WriteBounds
from transport.fabric.gpu_copy import Pending
from transport.planner import DIRECT, RELAYED, Unit
from transport.packing import host_memmove
from transport.telemetry import now_ns

if TYPE_CHECKING:  # annotations only
    from transport.batches import Validated
    from transport.peers import Peer

log = logging.getLogger("transport.engine")  # one logger for the engine and its parts

_SPANS_MEMO = 64  # batch layouts over several regions remembered per engine (InlineRoute._region_spans)


class InlineRoute:
    """Writes batches from the caller's thread (see the module docstring).

    Arguments: inflight: the ``transport.inflight.InFlight`` (batch ids); accounts: the
    ``transport.batches.Accounts`` (batches done); planner: the engine's ``Planner`` (a peer may have its own);
    fabrics, rail_stats: one per rail; counters: the engine's; ring: ``ring(device, rail)``, the relay ring of
    a device on a rail (``Pipeline.ring``); relay_copies: the GPU relay fills' ``BoundCopies``; directory: the
    ``transport.peers.PeerDirectory`` (usable rails); not_taken: what ``submit`` returns for a batch it does
    not take."""

    def __init__(self, inflight, accounts, planner, fabrics: list, counters, rail_stats: list, ring, relay_copies,
                 directory, not_taken):
        self.not_taken = not_taken
        self.inflight = inflight
        self.accounts = accounts
        self.planner = planner
        self.fabrics = fabrics
        self.counters = counters
        self.rail_stats = rail_stats
        self.ring = ring
        self.relay_copies = relay_copies
        self.directory = directory
        self._spans_memo = {}  # _region_spans: the regions of batches over several regions, by layout
        self._spans_lock = threading.Lock()

    def _planner(self, peer: "Peer"):
        """The planner of ``peer``'s routes (its own when its landing slots are smaller than our chunks): the
        inline route asks the one the posted route plans with, so that both pick the same rails."""
        return peer.planner or self.planner

    def submit(self, v: "Validated"):
        """The route's entry for a validated batch (``Pipeline.submit``): None when written (and counted) while
        the caller waited, a ``Batch`` holding the writes still running (``async_``), or ``not_taken`` (the batch
        does not qualify, or the fabric declined: nothing counted, the posted route takes it)."""
        if v.one_region:
            pending = self.write(v, int(v.devices), v.lsnap.regions[v.idx], v.rsnap.regions[v.ridx])
        else:
            pending = self.write_regions(v)
        if pending is None:
            return self.not_taken
        if not v.async_:
            return None
        batch = Batch(self.inflight.new_batch_id(), v.peer, v.src, v.dst, v.ln, v.nbytes)
        batch.pending, batch.path = pending, "inline"
        return batch

    def write(self, v: "Validated", dev: int, local, remote):
        """Write batch ``v`` from the calling thread (fabrics with ``inline_writes``) when the planner would send
        it whole, in order, as one direct unit: the same rail and the same writes as the planned path, without
        its unit, attempt, request, post and completion (each a few function calls of host time per batch, which
        on the message path cost more than the copy of most batches).
        ``dev``: the sources' device; ``local`` and ``remote``: the one region on each side holding every piece.
        Waits until every byte is placed unless ``v.async_``. Returns the fabric's ``Pending`` (already waited
        for when waiting; the batch counted, and done when waited for), or None with nothing counted when the
        batch does not qualify or the fabric did not take or make the writes: the caller then plans and posts it,
        and that path reports any failure (a batch written in part is written again: the writes are
        idempotent)."""
        peer = v.peer
        choices, load, c = self._whole_batch_rail(dev, v)
        if c is not None:
            rail = c.rail
            bounds = WriteBounds(v.lmin, v.lmax, v.smin, v.send, v.dmin, v.dend, remote.keys[rail],
                                 local.keys[rail].lkey)
            src, dst, ln, nbytes, wait = v.src, v.dst, v.ln, v.nbytes, not v.async_
            return self._inline_on_rail(v, rail, lambda fab, ep: fab.write_inline(ep, src, dst, ln, bounds, nbytes,
                                                                                     wait))
        if self._planner(peer).relays_all(choices, v.lmin, peer.forward):
            return self._relay_inline(v, dev, remote, choices, load)
        if not self._planner(peer).direct_runs_all(choices, int(v.ln.size), v.lmin, v.lmax, peer.forward):
            return None

        def write_run(fab, ep, rail, a, b, s, d, n, run_bytes, lmin, lmax):
            # the run's own lengths; the batch's address spans hold every one of its pieces
            bd = WriteBounds(lmin, lmax, v.smin, v.send, v.dmin, v.dend, remote.keys[rail], local.keys[rail].lkey)
            return fab.write_inline(ep, s, d, n, bd, run_bytes, wait=False)
        return self._direct_runs_inline(v, dev, choices, load, write_run)

    def _whole_batch_rail(self, dev: int, v: "Validated"):
        """(the usable rails of ``dev`` to the batch's peer, their load, ``Planner.whole_batch_rail``'s choice or
        None) for batch ``v``."""
        peer = v.peer
        choices = self.directory.rail_choices(dev, peer)
        load = {pr.rail: pr.bytes_in_flight for pr in peer.rails} if len(choices) > 1 else {}
        planner = self._planner(peer)
        return choices, load, planner.whole_batch_rail(dev, choices, load, int(v.ln.size), v.nbytes, v.lmin, v.lmax,
                                                       peer.forward)

    def _inline_on_rail(self, v: "Validated", rail: int, write):
        """Make an inline write of batch ``v`` (``write(fabric, endpoint)`` of rail ``rail``) and count it as one
        direct unit; the fabric's ``Pending``, or None with nothing counted when it declined or failed (logged)."""
        peer, n, nbytes = v.peer, int(v.ln.size), v.nbytes
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
            self._planner(peer).rewind()
            return None
        t3 = now_ns()
        # the rail's view: one post of n writes, complete once placed (``wait`` for an async batch)
        self.rail_stats[rail].add_many((("post_calls", 1), ("writes_posted", n), ("bytes_posted", nbytes),
                                        ("time_post_s", (t3 - t2) / 1e9), ("completions", 1),
                                        ("bytes_completed", nbytes)))
        self._count_inline(DIRECT, 1, n, nbytes, (v.t0, v.t1, t2, t3), not v.async_)
        return pending

    def write_regions(self, v: "Validated"):
        """``write`` for a batch whose pieces lie in several registered regions on either side (``v.idx`` /
        ``v.ridx``: each piece's region in ``v.lsnap`` / ``v.rsnap``, or one index for all), as sglang's calls do:
        it registers each layer's KV buffer and each aux buffer apart, so one call names a region per layer or
        per aux buffer on each side. Taken when every source is on one device and the planner would send the
        batch whole as one direct unit; the fabric gets each side's regions (``RegionSpans``) instead of one key.
        The same returns as ``write``."""
        devices, lsnap, idx, rsnap, ridx = v.devices, v.lsnap, v.idx, v.rsnap, v.ridx
        if getattr(devices, "ndim", 0):
            dev = int(devices[0])
            if int(devices.min()) != dev or int(devices.max()) != dev:
                return None  # sources on several devices: one unit per device, posted
        else:
            dev = int(devices)
        choices, load, c = self._whole_batch_rail(dev, v)
        if c is not None:
            rail = c.rail
            spans = RegionSpans(v.lmin, v.lmax, v.smin, v.send, v.dmin, v.dend,
                                *self._region_spans(rail, lsnap, idx, rsnap, ridx))
            src, dst, ln, nbytes, wait = v.src, v.dst, v.ln, v.nbytes, not v.async_
            return self._inline_on_rail(v, rail, lambda fab, ep: fab.write_inline_regions(ep, src, dst, ln, spans,
                                                                                            nbytes, wait))
        if not self._planner(v.peer).direct_runs_all(choices, int(v.ln.size), v.lmin, v.lmax, v.peer.forward):
            return None
        many_local, many_remote = getattr(idx, "ndim", 0), getattr(ridx, "ndim", 0)

        def write_run(fab, ep, rail, a, b, s, d, n, run_bytes, lmin, lmax):
            # the run's regions (remembered per run as per batch: the planner cuts a layout the same way
            # while the rails' loads are the same), its own lengths, the batch's address spans
            sp = RegionSpans(lmin, lmax, v.smin, v.send, v.dmin, v.dend, *self._region_spans(
                rail, lsnap, idx[a:b] if many_local else idx, rsnap, ridx[a:b] if many_remote else ridx))
            return fab.write_inline_regions(ep, s, d, n, sp, run_bytes, wait=False)
        return self._direct_runs_inline(v, dev, choices, load, write_run)

    def _region_spans(self, rail: int, lsnap, idx, rsnap, ridx) -> tuple:
        """``RegionSpans``' (local, remote, remote_index) on ``rail`` for pieces in regions ``idx`` of ``lsnap`` and
        ``ridx`` of ``rsnap`` (arrays, or one index for all). Remembered by the snapshots and the index arrays'
        bytes: sglang names the same regions (a KV buffer per layer, an aux buffer per field) in the same order
        call after call, and working them out again costs a ``np.unique`` and a Python step per region and call.
        The same ``local`` and ``remote`` tuple
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

    def _direct_runs_inline(self, v: "Validated", dev: int, choices, load: dict, write_run):
        """``write`` for a batch the planner cuts into DIRECT runs of whole pieces on several rails (a
        batch of at least twice ``MIN_RUN_BYTES`` with two rails or more): the same runs on the same rails, each
        written by the calling thread through its rail's fabric (``write_run(fabric, endpoint, rail, first, end,
        srcs, dsts, lengths, bytes, smallest length, largest)`` for the run of pieces ``first:end``, not waited
        for), then waited for together when ``wait``. No unit, attempt, request, post or completion per run.
        Returns the runs' joined ``Pending``, or None with nothing counted when a fabric declined or failed a run
        (on ipc: a rail that has not yet had the peer's region described): the runs already written are waited
        for, and the caller posts the whole batch (the writes are idempotent)."""
        peer, ln, nbytes, wait = v.peer, v.ln, v.nbytes, not v.async_
        units = self._planner(peer).plan(v.src, v.dst, ln, None, {dev: choices}, load, [dev], None, None,
                                         (nbytes, v.lmax, v.lmin))
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
                                   (v.t0, v.t1, t2), wait)

    def _relay_inline(self, v: "Validated", dev: int, remote, choices, load: dict):
        """``write`` for a batch the planner relays whole (every piece a RELAYED unit): for each unit the
        caller takes a slot of the unit's relay ring, fills it on the slot's lane stream, has the fabric write it
        from there on the same stream (``write_inline``, not waited for) and gives the slot back at once: its
        next fill follows that write on the stream. No attempt, post, completer thread or completion chain, and
        each unit's write starts as soon as its own fill is done while the next unit fills on another lane.
        Returns the units' joined ``Pending`` (waited for when ``wait``), or None with nothing counted when a
        fabric declined or failed a unit: the writes already made are waited for, and the caller posts the
        whole batch (the writes are idempotent)."""
        peer, ln, nbytes, wait = v.peer, v.ln, v.nbytes, not v.async_
        units = self._planner(peer).plan(v.src, v.dst, ln, None, {dev: choices}, load, [dev], None, None,
                                         (nbytes, v.lmax, v.lmin))
        t2 = now_ns()
        pendings = []
        per_rail: Dict[int, List[int]] = {}
        # the fills run on the rings' lane streams: each lane waits once for what the caller queued on the data
        # GPU's current stream (the sources' producers) before its first fill of this batch
        after, waited = None, set()
        dspan = (v.dmin, v.dend)  # of the batch
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
                                   nbytes, (v.t0, v.t1, t2), wait)

    @staticmethod
    def _tally(per_rail: Dict[int, List[int]], rail: int, writes: int, nbytes: int) -> None:
        """Count one inline unit of ``writes`` writes and ``nbytes`` bytes on ``rail`` in ``per_rail`` (rail ->
        [posts, writes, bytes]) for ``_settle_inline``."""
        counts = per_rail.setdefault(rail, [0, 0, 0])
        counts[0] += 1
        counts[1] += writes
        counts[2] += nbytes

    def _settle_inline(self, peer: "Peer", what: str, got, pendings: list, per_rail: Dict[int, List[int]],
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
            self._planner(peer).rewind()  # the posted path plans the same rails
            return None
        t3 = now_ns()
        for rail, (posts, writes, rail_bytes) in per_rail.items():
            self.rail_stats[rail].add_many((("post_calls", posts), ("writes_posted", writes),
                                             ("bytes_posted", rail_bytes), ("completions", posts),
                                             ("bytes_completed", rail_bytes)))
        self._count_inline(kind, units, n, nbytes, (*times, t3), wait)
        return got

    def _count_inline(self, kind: str, units: int, n: int, nbytes: int, times: tuple, wait: bool) -> None:
        """The batch counters of an inline batch of ``units`` units of ``kind`` (DIRECT / RELAYED), ``n`` pieces
        and ``nbytes`` bytes; ``times``: (submitted, validated, planned, written) in ns. A batch already placed
        (``wait``) counts as ok and done here; an async one when ``_wait`` finds its copies done."""
        t0, t1, t2, t3 = times
        counts = [("batches_submitted", 1), ("route_inline", 1), ("items", n), ("bytes", nbytes),
                  (f"path_{kind}_units", units), (f"path_{kind}_bytes", nbytes), ("time_validate_s", (t1 - t0) / 1e9),
                  ("time_plan_s", (t2 - t1) / 1e9), ("time_dispatch_s", (t3 - t2) / 1e9)]
        if wait:
            counts.append(("batches_ok", 1))
        self.counters.add_many(counts)
        if wait:
            self.accounts.done(f"batch {self.inflight.new_batch_id()}", t0, t3, n, nbytes, True, kind, counted=True)

    def _relay_unit_inline(self, peer: "Peer", u: Unit, remote, k: int, dspan: Tuple[int, int], after=None,
                           waited: Optional[set] = None):
        """The ``k``-th RELAYED unit of ``_relay_inline``: slot (of lane ``k``: consecutive units on alternating
        streams), fill, inline write on the slot's lane; the fabric's ``Pending``, or None (declined, or the ring
        is closed). ``dspan``: (lowest destination, highest destination end) of the batch. ``after``: a CUDA
        event the fill waits for, once per lane (``waited``: the (ring, lane) pairs that already wait for it)."""
        relay = u.relay_device if u.device >= 0 else DEVICE_HOST
        if relay >= 0 and u.device != relay:
            from pxn_kernels.peer_access import ensure_peer_access
            ensure_peer_access(relay, {u.device})  # the relay GPU's fill reads the sources' GPU
        ring = self.ring(relay, u.rail)
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
                copies = self.relay_copies
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
