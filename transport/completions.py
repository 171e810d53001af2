"""Completions of the data path: a rail's writes and chunk acks coming back, finishing units and batches.

Fabrics with ``completion_callback`` (tcp, ipc) call ``on_completions`` in their own threads; a failed completion
and those after it on the same rail go, in order, through the engine's progress loop (failover must not run in
a fabric thread the fabric may be waiting on). Other fabrics (verbs) have one ``poll_loop`` thread per rail. A
``WriteRows`` post (``transport.smallbatch``) is completed by its ack straight away (``rows_acked``). Every
successful attempt ends in ``finish``, whose counting is ``Accounts.unit_done``.

Writes into this engine's credit region (``on_ack``) are acks of chunks, which may say that the credit went back
to the peer's landing pool (``F_RETURNED``; ``F_QUEUED``: a grant follows), or grants of credits
(``ST_GRANT``, the pool slot in the payload): see ``transport.receiver`` and ``transport.fills``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from transport.credits import (ACK_BYTES, ACK_FLAG, ACK_WR_BASE, F_QUEUED, F_RETURNED, ST_GRANT, ST_OK, decode_ack,
                                decode_ack_payload, decode_grant)
from transport.errors import FabricClosed, PeerLost, RegionError, RemoteRejected
from transport.fabric.base import Opcode
from transport.planner import COALESCED
from transport.telemetry import WAITING

if TYPE_CHECKING:  # annotations only
    from transport.batches import Attempt

log = logging.getLogger("transport.engine")  # one logger for the engine and its parts

WATCHDOG_S = 0.1  # seconds between two runs of a rail's watchdog


class Completions:
    """The completion side of one engine's data path (see the module docstring).

    Arguments: inflight: the ``transport.inflight.InFlight`` whose attempts complete here; accounts: the
    ``transport.batches.Accounts`` that counts units and batches done or failed; failover: the
    ``transport.peers.Failover`` that takes a failed rail's work; directory: the ``transport.peers.PeerDirectory``
    (acks name the peer's rail); receiver: the engine's ``transport.receiver.Receiver`` (incoming chunks);
    progress: the engine's progress loop; fabrics, rail_stats: one per rail; counters: the engine's."""

    def __init__(self, inflight, accounts, failover, directory, receiver, progress, fabrics: list, rail_stats: list,
                 counters):
        self.inflight = inflight
        self.accounts = accounts
        self.failover = failover
        self.directory = directory
        self.receiver = receiver
        self.progress = progress
        self.fabrics = fabrics
        self.rail_stats = rail_stats
        self.counters = counters
        self.closed = False
        self._deferring = [0] * len(fabrics)  # per rail: lists queued in the progress loop, not handled yet
        self._defer_lock = threading.Lock()

    def poll_loop(self, rail: int) -> None:
        """A rail's poller, on fabrics that report completions by ``poll`` (no ``completion_callback``)."""
        fab = self.fabrics[rail]
        last_check = time.monotonic()
        while not self.closed:
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
                    self.on_completion(rail, c)
                except Exception:  # noqa: BLE001 — one bad completion must not stop the poller
                    log.exception("rail %d: handling completion %r failed", rail, c)
            now = time.monotonic()
            if now - last_check > WATCHDOG_S:
                last_check = now
                self.watchdog(rail)

    def _deferred(self, rail: int, comps) -> None:
        """A rail's failed completions and those that came after them, in the progress loop (fabrics with
        ``completion_callback``: ``on_completions`` queues them there in order)."""
        for c in comps:
            try:
                self.on_completion(rail, c)
            except Exception:  # noqa: BLE001 — one bad completion must not stop the others
                log.exception("rail %d: handling completion %r failed", rail, c)
        with self._defer_lock:
            self._deferring[rail] -= 1

    def watchdogs(self) -> None:
        """Every rail's watchdog (the progress loop runs this every ``WATCHDOG_S``)."""
        for rail in range(len(self.fabrics)):
            try:
                self.watchdog(rail)
            except Exception:  # noqa: BLE001 — one rail's watchdog must not stop the others'
                log.exception("rail %d: watchdog failed", rail)

    def watchdog(self, rail: int) -> None:
        """A rail whose endpoint died with work in flight (e.g. chunks waiting for acks) fails over even when
        no completion reports it. Not while the rail's completions wait in the progress loop: a failed one among
        them carries the endpoint's own cause (a fabric hands its failure over before the endpoint reads as
        dead), and failing the rail first would name only "endpoint died"."""
        if self.deferring(rail):
            return
        for peer in list(self.directory.peers.values()):
            if peer.ready and rail < len(peer.rails):
                pr = peer.rails[rail]
                if pr.alive and not pr.ep.alive:
                    self.failover.rail_failed(pr, PeerLost(f"rail {rail} endpoint to {peer.session} died"))

    def deferring(self, rail: int) -> bool:
        """Whether completions of ``rail`` wait in the progress loop (a failed one among them carries the rail's
        own cause, which its endpoint reading dead does not)."""
        with self._defer_lock:
            return self._deferring[rail] > 0

    def after_deferred(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the progress loop after the completions queued there by now."""
        self.progress.submit(fn, *args)

    def on_completions(self, rail: int, comps) -> None:
        """Completion handler called by a fabric thread (fabrics with ``completion_callback``). Failures go to the
        engine's progress loop instead: failover deregisters and re-posts, which must not run in a fabric thread
        that the fabric itself may be waiting on."""
        if self.closed:
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
                self.progress.submit(self._deferred, rail, later)
        for c in comps:
            try:
                self.on_completion(rail, c)
            except Exception:  # noqa: BLE001 — one bad completion must not break the fabric's thread
                log.exception("rail %d: handling completion %r failed", rail, c)

    def rows_acked(self, a: "Attempt") -> bool:
        """A posted ``WriteRows`` (``transport.smallbatch``) was placed by the peer, in order on its endpoint: its
        completion without a ``Completion`` object, then ``finish``'s counting. False when completions of the
        rail go through the progress loop meanwhile (an earlier failure is being handled there): the fabric then
        reports the completion, which queues behind it."""
        if self.closed:
            return True
        rail = a.prail.rail
        with self._defer_lock:
            if self._deferring[rail]:
                return False
        req = a.reqs[0]
        inflight = self.inflight
        with self.inflight.lock:
            if inflight.pop_locked(req.wr_id) is None:
                return True
            a.pending = 0
            claimed = not a.finished and not a.cancelled
            _, slot, landing = inflight.retire_locked(a)
        self.rail_stats[rail].add_many((("completions", 1), ("bytes_completed", req.nbytes)))
        if slot is not None or landing is not None:
            inflight.release(a, slot, landing)
        if claimed:
            self.accounts.unit_done(a.batch, a.unit)
        return True

    def on_completion(self, rail: int, c) -> None:
        if c.opcode == Opcode.RECV_IMM:
            if c.imm is not None and c.imm & ACK_FLAG:
                self.on_ack(rail, c)
            else:
                self.receiver.on_chunk(rail, c.peer_id, c.imm or 0, c.byte_len)
            return
        if c.wr_id >= ACK_WR_BASE:
            if c.error is not None:
                self.counters.add("rx_ack_errors")
                log.info("ack write on rail %d failed: %s", rail, c.error)
            return
        with self.inflight.lock:
            a = self.inflight.pop_locked(c.wr_id)
            if a is not None:
                a.pending -= 1
                more = a.pending > 0
        if a is None:
            return
        stats = self.rail_stats[rail]
        if c.error is None:
            done_bytes = c.byte_len
            if not more and self.inflight.selective and (len(a.reqs) > 1 or not a.reqs[0].signaled):
                # the silent writes before it are done too (posting order)
                done_bytes += sum(r.length for r in a.reqs if not r.signaled)
            stats.add_many((("completions", 1), ("bytes_completed", done_bytes)))
            if more:
                return
            if a.unit.kind == COALESCED and not a.cancelled:
                with self.inflight.lock:
                    a.write_done = True
                    done = a.acked
                if done:
                    self.finish(a)
                elif a.slot is not None:
                    a.slot.enter(WAITING)
                return
            self.finish(a)
            return
        stats.add("completion_errors")
        if a.cancelled:
            self.inflight.drop(a)
            return
        if isinstance(c.error, RegionError):
            self.fail(a, RemoteRejected(f"{a.batch.peer.session} refused a write on rail {rail}: {c.error}",
                                        [c.error]))
            return
        with self.inflight.lock:
            a.write_done = True
        self.failover.rail_failed(a.prail, c.error)

    def on_ack(self, rail: int, c) -> None:
        entry = self.directory.by_remote_rail.get(c.peer_id)
        if entry is None:
            return
        peer, pr = entry
        slot, status = decode_ack(c.imm)
        flags, status = status & (F_RETURNED | F_QUEUED), status & ~(F_RETURNED | F_QUEUED)
        if not 0 <= slot < pr.slots:
            return
        off = (pr.rail * pr.slots + slot) * ACK_BYTES
        if status == ST_GRANT:
            pr.grant([(slot, decode_grant(peer.credit.array[off:off + ACK_BYTES]))])
            return
        with pr.cv:
            a = pr.landing_owner.get(slot)
            if flags & F_RETURNED:
                # the credit went back to the peer's pool: the chunk's release must not make it free here
                pr.credit_slot.pop(slot, None)
                if a is not None:
                    del pr.landing_owner[slot]
                # a grant follows, no need to ask; unless one already came (a grant written by another thread of
                # the receiver may overtake this ack): the rail then holds it, and asks at once when out again
                if flags & F_QUEUED and not pr.credit_slot:
                    pr.asked_at = time.monotonic()
        if a is None:
            return
        if status != ST_OK:
            reason = decode_ack_payload(peer.credit.array[off:off + ACK_BYTES])
            self.fail(a, RemoteRejected(f"{peer.session} rejected a chunk of batch {a.batch.id}: {reason}"))
            return
        silent = not a.reqs[0].signaled  # a silent chunk write: this ack completes it (see ``SlotFills.fill``)
        with self.inflight.lock:
            a.acked = True
            done = a.write_done or silent
        if silent:
            self.rail_stats[a.prail.rail].add("bytes_completed", a.reqs[0].length)
        if done:
            self.finish(a)

    def finish(self, a: "Attempt") -> None:
        """An attempt succeeded: give back its resources and count its unit done."""
        # one lock section decides between success and failover: rail_failed only takes attempts that are
        # neither finished nor cancelled, so a unit is never counted done twice
        inflight = self.inflight
        with self.inflight.lock:
            claimed = not a.finished and not a.cancelled
            _, slot, landing = inflight.retire_locked(a)
        inflight.release(a, slot, landing)
        if claimed:
            self.accounts.unit_done(a.batch, a.unit)

    def fail(self, a: "Attempt", exc: BaseException) -> None:
        """Attempt ``a`` cannot succeed: give back its resources, fail its batch with ``exc``."""
        self.inflight.drop(a)
        self.accounts.fail(a.batch, exc)
