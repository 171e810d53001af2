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

from transport.batches import _Batch
from transport.errors import FabricError, TransferError
from transport.fabric.base import DEVICE_HOST, RegionSpans, WriteBounds
from transport.fabric.gpu_copy import Pending
from transport.planner import DIRECT, RELAYED, Unit
from transport.packing import host_memmove
from transport.telemetry import now_ns

if TYPE_CHECKING:  # annotations only
    from transport.peers import _Peer

log = logging.getLogger("transport.engine")  # one logger for the engine and its parts

_SPANS_MEMO = 64  # batch layouts over several regions remembered per engine (InlineRoute._region_spans)


class InlineRoute:
    """Writes batches from the caller's thread (see the module docstring).

    Arguments: pipe: the data path (``transport.pipeline.Pipeline``), whose fabrics, planner, relay rings, rail
    counters and accounts this uses; directory: the ``transport.peers.PeerDirectory`` (usable rails)."""

    def __init__(self, pipe, directory, not_taken):
        self.not_taken = not_taken  # what ``submit`` returns for a batch it does not take
        self.fabrics = pipe.fabrics
        self.planner = pipe.planner
        self.counters = pipe.counters
        self.accounts = pipe.accounts
        self._rail_stats = pipe._rail_stats
        self._batch_ids = pipe._batch_ids
        self._ring = pipe.ring
        self._relay_copies = pipe._relay_copies
        self._rail_choices = directory.rail_choices
        self._spans_memo = {}  # _region_spans: the regions of batches over several regions, by layout
        self._spans_lock = threading.Lock()

    def _planner(self, peer: "_Peer"):
        """The planner of ``peer``'s routes (its own when its landing slots are smaller than our chunks): the
        inline route asks the one the posted route plans with, so that both pick the same rails."""
        return peer.planner or self.planner

    def submit(self, peer: "_Peer", src, dst, ln, devices, lsnap, idx, rsnap, ridx, one_region: bool,
               extremes: tuple, nbytes: int, t0: int, t1: int, async_: bool):
        """The route's entry for a validated batch (``Pipeline._submit``): None when written (and counted) while
        the caller waited, a ``_Batch`` holding the writes still running (``async_``), or ``not_taken`` (the batch
        does not qualify, or the fabric declined: nothing counted, the posted route takes it)."""
        if one_region:
            pending = self.write(peer, src, dst, ln, int(devices), lsnap.regions[idx], rsnap.regions[ridx], extremes,
                                 nbytes, t0, t1, not async_)
        else:
            pending = self.write_regions(peer, src, dst, ln, devices, lsnap, idx, rsnap, ridx, extremes, nbytes, t0,
                                         t1, not async_)
        if pending is None:
            return self.not_taken
        if not async_:
            return None
        batch = _Batch(next(self._batch_ids), peer, src, dst, ln, nbytes)
        batch.pending, batch.path = pending, "inline"
        return batch

    def write(self, peer: "_Peer", src, dst, ln, dev: int, local, remote, extremes: tuple, nbytes: int,
                      t0: int, t1: int, wait: bool):
        """Write a batch from the calling thread (fabrics with ``inline_writes``) when the planner would send it
        whole, in order, as one direct unit: the same rail and the same writes as the planned path, without its
        unit, attempt, request, post and completion (each a few function calls of host time per batch, which on
        the message path cost more than the copy of most batches).
        ``local`` and ``remote``: the one region on each side holding every piece; ``extremes``: (lmin, lmax, smin,
        send, dmin, dend) from the validation; ``wait``: return only once every byte is placed. Returns the
        fabric's ``Pending`` (already waited for when ``wait``; the batch counted, and done when ``wait``), or
        None with nothing counted when the batch does not qualify or the fabric did not take or make the writes:
        the caller then plans and posts it, and that path reports any failure (a batch written in part is written
        again: the writes are idempotent)."""
        choices, load, c = self._whole_batch_rail(dev, peer, int(ln.size), nbytes, extremes)
        if c is None:
            if self._planner(peer).relays_all(choices, extremes[0], peer.forward):
                return self._relay_inline(peer, src, dst, ln, dev, remote, extremes, nbytes, choices, load, t0, t1,
                                          wait)
            if self._planner(peer).direct_runs_all(choices, int(ln.size), extremes[0], extremes[1], peer.forward):
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
        planner = self._planner(peer)
        return choices, load, planner.whole_batch_rail(dev, choices, load, n, nbytes, extremes[0], extremes[1],
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
            self._planner(peer).rewind()
            return None
        t3 = now_ns()
        # the rail's view: one post of n writes, complete once placed (``_wait`` for an async batch)
        self._rail_stats[rail].add_many((("post_calls", 1), ("writes_posted", n), ("bytes_posted", nbytes),
                                         ("time_post_s", (t3 - t2) / 1e9), ("completions", 1),
                                         ("bytes_completed", nbytes)))
        self._count_inline(DIRECT, 1, n, nbytes, (t0, t1, t2, t3), wait)
        return pending

    def write_regions(self, peer: "_Peer", src, dst, ln, devices, lsnap, idx, rsnap, ridx, extremes: tuple,
                              nbytes: int, t0: int, t1: int, wait: bool):
        """``write`` for a batch whose pieces lie in several registered regions on either side (``idx`` /
        ``ridx``: each piece's region in ``lsnap`` / ``rsnap``, or one index for all), as sglang's calls do: it
        registers each layer's KV buffer and each aux buffer apart, so one call names a region per layer or per
        aux buffer on each side. Taken when every source is on one device and the planner would send the batch
        whole as one direct unit; the fabric gets each side's regions (``RegionSpans``) instead of one key. The
        same returns as ``write``."""
        if getattr(devices, "ndim", 0):
            dev = int(devices[0])
            if int(devices.min()) != dev or int(devices.max()) != dev:
                return None  # sources on several devices: one unit per device, posted
        else:
            dev = int(devices)
        choices, load, c = self._whole_batch_rail(dev, peer, int(ln.size), nbytes, extremes)
        if c is None:
            if not self._planner(peer).direct_runs_all(choices, int(ln.size), extremes[0], extremes[1], peer.forward):
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

    def _direct_runs_inline(self, peer: "_Peer", src, dst, ln, dev: int, extremes: tuple, nbytes: int, choices,
                            load: dict, t0: int, t1: int, wait: bool, write_run):
        """``write`` for a batch the planner cuts into DIRECT runs of whole pieces on several rails (a
        batch of at least twice ``MIN_RUN_BYTES`` with two rails or more): the same runs on the same rails, each
        written by the calling thread through its rail's fabric (``write_run(fabric, endpoint, rail, first, end,
        srcs, dsts, lengths, bytes, smallest length, largest)`` for the run of pieces ``first:end``, not waited
        for), then waited for together when ``wait``. No unit, attempt, request, post or completion per run.
        Returns the runs' joined ``Pending``, or None with nothing counted when a fabric declined or failed a run
        (on ipc: a rail that has not yet had the peer's region described): the runs already written are waited
        for, and the caller posts the whole batch (the writes are idempotent)."""
        units = self._planner(peer).plan(src, dst, ln, None, {dev: choices}, load, [dev], None, None,
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
        """``write`` for a batch the planner relays whole (every piece a RELAYED unit): for each unit the
        caller takes a slot of the unit's relay ring, fills it on the slot's lane stream, has the fabric write it
        from there on the same stream (``write_inline``, not waited for) and gives the slot back at once: its
        next fill follows that write on the stream. No attempt, post, completer thread or completion chain, and
        each unit's write starts as soon as its own fill is done while the next unit fills on another lane.
        Returns the units' joined ``Pending`` (waited for when ``wait``), or None with nothing counted when a
        fabric declined or failed a unit: the writes already made are waited for, and the caller posts the
        whole batch (the writes are idempotent)."""
        units = self._planner(peer).plan(src, dst, ln, None, {dev: choices}, load, [dev], None, None,
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
            self._planner(peer).rewind()  # the posted path plans the same rails
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
        counts = [("batches_submitted", 1), ("route_inline", 1), ("items", n), ("bytes", nbytes),
                  (f"path_{kind}_units", units), (f"path_{kind}_bytes", nbytes), ("time_validate_s", (t1 - t0) / 1e9),
                  ("time_plan_s", (t2 - t1) / 1e9), ("time_dispatch_s", (t3 - t2) / 1e9)]
        if wait:
            counts.append(("batches_ok", 1))
        self.counters.add_many(counts)
        if wait:
            self.accounts.done(f"batch {next(self._batch_ids)}", t0, t3, n, nbytes, True, kind, counted=True)

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
