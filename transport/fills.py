"""The copy thread's side of the coalesced and relayed routes: filling a relay slot and taking landing credits.

A relay ring's copy thread (``transport.relay.RelayRing``) calls ``SlotFills.fill`` for each attempt it holds a
slot for: a COALESCED unit's pieces are gathered into a chunk (header table and payload; on the GPU by one
kernel) bound for one of the peer's landing slots, whose credit it waits for; a RELAYED unit's pieces are copied
into the slot and written from there to their destinations.

Landing credits (the receiver's side: ``transport.receiver``): a rail holds the credits the peer lent it out of
its shared landing pool (``PeerRail.credit_slot``: credit index -> pool slot). A chunk takes a free one; a rail
holding none asks the peer for some (the ``credits`` control op, again every ``CREDIT_ASK_S`` while none
comes), and grants come in the reply, with acks, or as grant writes into the credit region
(``transport.completions``). Credits a rail has not used for ``CREDIT_IDLE_S`` go back to the pool
(``return_idle_credits``, in the progress loop), where other senders may wait for them.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np

from transport.control import proof_on
from transport.credits import chunk_imm
from transport.errors import AddressNotRegistered, FabricError, PeerLost, TransferError
from transport.fabric.base import GatherWrite, WriteBatch, WriteRequest
from transport.fabric.memory import MEMCPY_MAX, memcpy_async, raw_view
from transport.planner import COALESCED
from transport.regions import locate_inside
from transport.packing import gpu_pack, gpu_pack_large, host_memmove
from transport.telemetry import now_ns

if TYPE_CHECKING:  # annotations only
    from transport.batches import Attempt
    from transport.peers import PeerRail

log = logging.getLogger("transport.engine")  # one logger for the engine and its parts

CREDIT_ASK_S = 1.0  # a rail holding no credit asks the peer again after this many seconds without a grant
CREDIT_IDLE_S = 0.1  # credits unused for this long (no chunk waiting) go back to the peer's landing pool
CREDIT_RETURN_TIMEOUT_S = 1.0  # the progress loop waits this long at most for a peer's reply to an idle return
DEFER = -1  # _acquire_landing: no credit now, and waiting would wait for the caller's own round


def _request(control, peer, msg: dict, timeout: Optional[float]) -> dict:
    """``control.request`` on the peer's control connection, with ``timeout`` seconds for the reply (None: its
    own, 30 s), with the proof that this engine speaks for itself on a connection the peer does not know it on
    yet (``transport.control``; the hello's, and one a request was answered on, need none)."""
    if peer.ctrl is not None:
        peer.ctrl.settimeout(30.0 if timeout is None else timeout)
        if peer.claim_key is not None and peer.ctrl is not peer.proven_ctrl:
            msg["proof"] = proof_on(peer.ctrl, peer.claim_key)
    try:
        rep = control.request(peer, msg)
        peer.proven_ctrl = peer.ctrl  # answered: the peer knows this engine on that connection from now on
        return rep
    finally:
        if peer.ctrl is not None:
            peer.ctrl.settimeout(30.0)


def write_keys(regions, a: Attempt, src: int, dst: int, n: int) -> Tuple[int, int]:
    """(lkey, rkey) on attempt ``a``'s rail of a write of ``n`` bytes from ``src`` (in ``regions``, this engine's
    ``RegionTable``) to ``dst`` at the peer. Raises AddressNotRegistered when a region went away since the
    batch's validation."""
    rail = a.prail.rail
    r = regions.find(src, n)
    if r is None:
        raise AddressNotRegistered(f"source 0x{src:x}+{n} was deregistered during the transfer")
    remote = a.batch.peer.regions.find(dst, n)
    if remote is None:
        raise AddressNotRegistered(f"destination 0x{dst:x}+{n} is no longer advertised by {a.batch.peer.session}")
    return r.keys[rail].lkey, remote.keys[rail]


class SlotFills:
    """Fills relay slots for one engine's data path (see the module docstring).

    Arguments: inflight: the ``transport.inflight.InFlight`` (its lock guards an attempt's slot and credit);
    failover: the ``transport.peers.Failover`` (a rail found dead while a chunk waits for a credit); directory:
    the ``PeerDirectory``; regions: this engine's ``RegionTable`` (write keys); fabrics: one per rail;
    counters, trace: the engine's telemetry; engine_id: the id chunks carry; relay_copies: the GPU relay fills'
    ``BoundCopies``; write_batches: the fabric's capability of that name. ``control``: the engine's
    ``ControlPlane`` (credit requests), set once made."""

    def __init__(self, inflight, failover, directory, regions, fabrics: list, counters, trace, engine_id: int,
                 relay_copies, write_batches: bool):
        self.inflight = inflight
        self.failover = failover
        self.directory = directory
        self.regions = regions
        self.fabrics = fabrics
        self.counters = counters
        self.trace = trace
        self.engine_id = engine_id
        self.relay_copies = relay_copies
        self.write_batches = write_batches
        self.control = None

    def fill(self, a: Attempt, slot) -> bool:
        """Fill ``slot`` for attempt ``a`` (runs in the ring's copy thread). False: cancelled, slot unused. GPU
        copies are only enqueued on the slot's lane stream: the ring synchronises its streams once per round."""
        if a.cancelled or a.batch.failed:
            return False
        u = a.unit
        t0 = now_ns()
        if u.kind == COALESCED:
            if not self._fill_chunk(a, slot):
                return False
        elif (u.runs is None or u.runs[2].size <= MEMCPY_MAX) and not (slot.ring.ordered and u.device >= 0):
            self._fill_relayed_few(a, slot)
        else:  # RELAYED, many pieces (or GPU pieces to an event-ordered fabric)
            self._fill_relayed_many(a, slot)
        with self.inflight.lock:
            if a.cancelled or a.finished:
                landing, a.landing = a.landing, None
            else:
                a.slot = slot
                landing = None
        if landing is not None:
            a.prail.release_landing(landing, a)
            return False  # the ring gives the slot back
        t1 = now_ns()
        self.counters.add("time_fill_s", (t1 - t0) / 1e9)
        if self.trace is not None:
            self.trace.complete("gather" if u.kind == COALESCED else "relay copy", "copy", f"copy/{slot.ring.name}",
                                t0, t1, {"bytes": u.nbytes, "batch": a.batch.id})
        return True

    def _fill_chunk(self, a: Attempt, slot) -> bool:
        """A COALESCED unit: a landing credit at the peer, then its pieces gathered into the slot as one chunk
        (header table and payload), one write to the credit's landing slot. False: no credit (deferred behind
        this round, or the rail died: failed over), slot unused."""
        u = a.unit
        landing = self._acquire_landing(a)
        if landing == DEFER:
            # the credits this chunk waits for are held by chunks of this very round, posted only at its end:
            # behind them in the ring's queue, not blocking the round
            a.ring.enqueue_copy([a])
            self.counters.add("credit_defers")
            return False
        if landing is None:
            if not (a.cancelled or a.batch.failed):
                # the rail died while we waited for a credit: fail it over (this attempt included)
                self.failover.rail_failed(a.prail, a.prail.cause or PeerLost(
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
            view = np.frombuffer(raw_view(slot.addr, slot.nbytes, writable=True), dtype=np.uint8)
            _, offsets, chunk_bytes = build_header_table(dsts, lens, seq, self.engine_id, out=view,
                                                         key=b.peer.chunk_key)
            fab = self.fabrics[a.prail.rail]
            if fab.capabilities.gather_writes and int(lens.sum()) >= fab.gather_min_bytes * lens.size:
                gather = (srcs, slot.addr + offsets, lens)  # the fabric sends each piece from its source
            else:
                host_memmove(srcs, slot.addr + offsets, lens)
        elif u.items is None:  # large pieces for the peer to forward: the copy engine moves them
            chunk_bytes = gpu_pack_large(slot, srcs, lens, dsts, seq, self.engine_id, sync=False,
                                         key=b.peer.chunk_key)
        else:
            chunk_bytes = gpu_pack(slot, srcs, lens, dsts, seq, self.engine_id, sync=False, key=b.peer.chunk_key)
        pr = a.prail
        pool_slot, more = a.landing_at
        a.reqs = [(WriteRequest if gather is None else GatherWrite)(
            slot.addr, chunk_bytes, pr.landing_addr + pool_slot * pr.stride, pr.landing_rkey, slot.ring.lkey,
            imm=chunk_imm(landing, seq, more))]
        if gather is not None:
            a.reqs[0].gather = gather
            # the receiver acks a chunk only once every byte of it has arrived, so the ack also completes the
            # write: where the fabric keeps successes silent, the chunk costs one completion, not two
            a.reqs[0].signaled = not self.inflight.selective
        return True

    def _fill_relayed_few(self, a: Attempt, slot) -> None:
        """A RELAYED unit of a few pieces: copy them into the slot, then one write per piece to its final address
        (scalar steps: a few numpy calls per piece would cost more than the copies' host time)."""
        u = a.unit
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
            _, rkey = write_keys(self.regions, a, s_addr, d_addr, n)
            a.reqs.append(WriteRequest(slot.addr + o, n, d_addr, rkey, slot.ring.lkey))

    def _fill_relayed_many(self, a: Attempt, slot) -> None:
        """A RELAYED unit of many pieces (or GPU pieces to an event-ordered fabric): one gather into the slot,
        then its writes (one ``WriteBatch`` where the fabric takes them)."""
        u = a.unit
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
            # one bound batched-copy launch (replayed for lengths seen before), where a call per piece costs
            # host time for every piece; on the lane's stream, ordered after the lane's earlier work, which the ring
            # waits for or orders after
            stream = slot.ring.stream(slot.lane)
            copies = self.relay_copies
            copies.finish([copies.copy(slot.ring.device, s_arr, local, n_arr, stream=stream)], wait=False,
                          stream=stream)
        rkeys = self._remote_keys(a, s_arr, d_arr, n_arr)
        lkeys = np.full(n_arr.size, slot.ring.lkey, dtype=np.int64)
        if self.write_batches:
            a.reqs = [WriteBatch(local, n_arr, d_arr, rkeys, lkeys)]  # one completion, no object per piece
        else:
            a.reqs = [WriteRequest(lo, n, d, rk, slot.ring.lkey)
                      for lo, n, d, rk in zip(local.tolist(), n_arr.tolist(), d_arr.tolist(), rkeys.tolist())]

    def _remote_keys(self, a: Attempt, s_arr, d_arr, n_arr) -> np.ndarray:
        """The rkey of each write of a relayed unit on its rail. Raises AddressNotRegistered naming a destination
        that a region no longer holds."""
        rail = a.prail.rail
        rsnap = a.batch.peer.regions.snapshot()
        remote = a.batch.peer_region(rsnap)
        if remote is not None:  # one peer region holds the whole batch: its key for every piece
            return np.full(n_arr.size, remote.keys[rail], dtype=np.int64)
        ri = locate_inside(rsnap, d_arr, d_arr + n_arr)
        if ri is None:  # a region went away since validation: name it
            for s_addr, d_addr, n in zip(s_arr.tolist(), d_arr.tolist(), n_arr.tolist()):
                write_keys(self.regions, a, s_addr, d_addr, n)
            raise AddressNotRegistered(f"a destination of batch {a.batch.id} is no longer advertised by "
                                       f"{a.batch.peer.session}")
        return np.array([r.keys[rail] for r in rsnap.regions], dtype=np.int64)[ri]

    def _acquire_landing(self, a: Attempt) -> Optional[int]:
        """A free credit (landing slot) at the peer on the attempt's rail; waits (back-pressure). A rail holding
        no credit asks the peer for some (``ask_credits``), again every ``CREDIT_ASK_S`` while none comes. None
        when the rail died or the attempt was cancelled meanwhile; ``DEFER`` when the credits it would wait for
        are held by chunks of the same ring round, not yet posted (a peer lends fewer credits than a round has
        slots)."""
        pr = a.prail
        t0 = None
        while True:
            with pr.cv:
                while True:
                    if a.cancelled or a.batch.failed or not pr.alive or not pr.ep.alive:
                        return None
                    if pr.free_landing:
                        k = pr.free_landing.pop()
                        pr.landing_owner[k] = a
                        a.landing = k
                        if a.demand:
                            a.demand = False
                            pr.chunk_demand -= 1
                        # the receiver lets us keep this credit after its ack only if more chunks wait for one
                        a.landing_at = (pr.credit_slot[k], pr.chunk_demand > 0)
                        pr.idle_since = time.monotonic()
                        if t0 is not None:
                            self.counters.add("time_wait_credit_s", (now_ns() - t0) / 1e9)
                        return k
                    if a.ring is not None and any(o is not a and o.ring is a.ring and not o.posted
                                                  for o in pr.landing_owner.values()):
                        return DEFER
                    if t0 is None:
                        t0 = now_ns()
                        self.counters.add("credit_waits")
                    now = time.monotonic()
                    if not pr.credit_slot and now - pr.asked_at >= CREDIT_ASK_S:
                        pr.asked_at = now
                        want = max(1, min(pr.chunk_demand, pr.slots))
                        break
                    pr.cv.wait(0.25)
            self.ask_credits(pr, want, [])

    def ask_credits(self, pr: PeerRail, want: int, release: List[int]) -> None:
        """One ``credits`` request to the peer for rail ``pr`` (the copy thread of a chunk that waits): return the
        credits ``release``, ask for ``want`` more. Grants in the reply are free at once; the rest come as grant
        writes (``Completions.on_ack``). A failure is logged: the rail's own failure, if any, shows on its
        endpoint, and a waiting chunk asks again."""
        peer = pr.peer
        with peer.lock:
            if not peer.retired:
                self._request_credits_locked(pr, want, release, None)

    def _request_credits_locked(self, pr: PeerRail, want: int, release: List[int], timeout: Optional[float]) -> bool:
        """The ``credits`` request of ``ask_credits`` with ``peer.lock`` held, once more on a new control connection
        when that one dropped. ``timeout``: seconds for the connect and the reply (the progress loop's idle returns
        must not stall it); None: the control connection's own. False when it failed (the control connection is
        then closed: a late reply must not answer the next request)."""
        peer = pr.peer
        control = self.control
        msg = {"op": "credits", "engine_id": self.engine_id, "rail": pr.rail, "want": want, "release": release}
        grants_before = pr.grants_in
        try:
            try:
                rep = _request(control, peer, msg, timeout)
            except (OSError, ConnectionError):
                # the control connection alone dropped (an idle timeout, or a failed request): once more on a new one
                control.close_ctrl_locked(peer)
                peer.ctrl = control.connect(peer.session, timeout=timeout or 10.0)
                rep = _request(control, peer, msg, timeout)
        except (OSError, ConnectionError, ValueError, FabricError, TransferError) as e:
            control.close_ctrl_locked(peer)
            self.counters.add("credit_requests_failed")
            log.info("credits request to %s rail %d failed: %s", peer.session, pr.rail, e)
            return False
        self.counters.add("credit_requests")
        grants = rep.get("grants") or []
        if grants:
            pr.grant([(int(k), int(p)) for k, p in grants])
            grants_before += 1
        if rep.get("queued"):
            with pr.cv:
                # a grant write may overtake this reply (it comes on the data connection): then the queue entry
                # the reply speaks of is already served, and waiting CREDIT_ASK_S for another grant would stall
                if pr.grants_in == grants_before:
                    pr.asked_at = time.monotonic()
        return True

    def return_idle_credits(self) -> None:
        """In the progress loop, every ``CREDIT_IDLE_S``: credits a rail has not used for that long, with no
        chunk waiting for one, go back to the peer's pool, where other senders may wait for them. A peer whose
        control connection is busy (a handshake, a region refresh, a chunk asking) is left for the next round; a
        return that fails keeps the credits here (they are used or returned later)."""
        if self.inflight.closed:
            return
        now = time.monotonic()
        with self.inflight.lock:
            peers = [p for p in self.directory.values() if p.ready and not p.retired]
        for peer in peers:
            if not any(pr.free_landing and pr.alive for pr in peer.rails) or not peer.lock.acquire(blocking=False):
                continue
            try:
                for pr in peer.rails:
                    with pr.cv:
                        if not pr.free_landing or pr.chunk_demand or now - pr.idle_since < CREDIT_IDLE_S \
                                or not pr.alive:
                            continue
                        release, pr.free_landing = pr.free_landing, []
                        held = [(k, pr.credit_slot.pop(k)) for k in release if k in pr.credit_slot]
                    if peer.retired:
                        break
                    if self._request_credits_locked(pr, 0, [k for k, _ in held], CREDIT_RETURN_TIMEOUT_S):
                        self.counters.add("credits_returned_idle", len(held))
                    else:
                        pr.grant(held)
            finally:
                peer.lock.release()
