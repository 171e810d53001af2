"""The data path's in-flight state, with one owner: the attempts posted and not completed, by write id, the lock
that guards them (and the peers' rails), the write and batch ids, and whether the engine still takes work.

Every part of the data path that posts, completes, fails over or drops an attempt does it through ``InFlight``'s
methods (``post_locked``, ``retire_locked``, ``drop``, ...), never through the table itself: a completion takes an
attempt out of flight once, whichever thread sees it first, and gives its relay slot and landing credit back
once.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:  # annotations only
    from transport.batches import Attempt


class InFlight:
    """The attempts in flight of one engine (see the module docstring).

    Arguments: lock: the lock of attempt state and peers (the ``PeerDirectory``'s); selective: the fabric's
    ``selective_signaling`` (writes other than an attempt's last complete silently on success)."""

    def __init__(self, lock, selective: bool):
        self.lock = lock
        self.selective = selective
        self.closed = False  # the engine closed: nothing new is posted, batches in flight are failed
        self.session_id = "?"  # the engine's, once its control listener is bound (for messages)
        self._by_wr_id: Dict[int, "Attempt"] = {}
        self._wr_ids = itertools.count(1)
        # a batch's id: ``new_batch_id()`` (the counter's own ``__next__``, no call of ours around it)
        self.new_batch_id = itertools.count(1).__next__

    def __len__(self) -> int:
        """The number of writes in flight (an attempt counts once per write it waits for)."""
        return len(self._by_wr_id)

    def attempts(self) -> List["Attempt"]:
        """The attempts in flight now (a copy)."""
        with self.lock:
            return list(self._by_wr_id.values())

    def post_locked(self, a: "Attempt") -> None:
        """With ``lock`` held: ``a``'s writes get their ids and are in flight. Its ``pending`` count: every write,
        or only the signaled ones where the fabric is silent about the others' success (an error on any of them
        still completes)."""
        table, ids = self._by_wr_id, self._wr_ids
        for r in a.reqs:
            r.wr_id = wid = next(ids)
            table[wid] = a
        a.pending = sum(1 for r in a.reqs if r.signaled) if self.selective else len(a.reqs)
        a.posted = True

    def post_one_locked(self, a: "Attempt", req) -> None:
        """``post_locked`` for an attempt of one signaled request ``req`` (the rows route)."""
        req.wr_id = wid = next(self._wr_ids)
        self._by_wr_id[wid] = a
        a.reqs = [req]
        a.pending = 1
        a.posted = True

    def unpost_locked(self, a: "Attempt") -> None:
        """With ``lock`` held, when a post failed: the attempt's writes are not in flight."""
        for r in a.reqs:
            self._by_wr_id.pop(r.wr_id, None)
        a.posted = False
        a.pending = 0

    def pop_locked(self, wr_id: int) -> Optional["Attempt"]:
        """With ``lock`` held: the attempt of a completed write ``wr_id``, out of the table (None: not in flight)."""
        return self._by_wr_id.pop(wr_id, None)

    def retire_locked(self, a: "Attempt"):
        """With ``lock`` held: take the attempt out of flight (once) and hand back (first, slot, landing): whether
        this call retired it, and the relay slot and landing credit for the caller to ``release`` outside the
        lock."""
        first = not a.finished
        if first:
            a.finished = True
            a.prail.inflight.discard(a)
            a.prail.bytes_in_flight -= a.unit.wire_bytes or a.unit.nbytes
            if self.selective and (len(a.reqs) > 1 or (a.reqs and not a.reqs[0].signaled)):
                for r in a.reqs:  # silent writes never complete: forget their ids here
                    self._by_wr_id.pop(r.wr_id, None)
        slot, a.slot = a.slot, None
        landing, a.landing = a.landing, None
        if a.demand:
            a.demand = False
            pr = a.prail
            with pr.cv:
                pr.chunk_demand -= 1
        return first, slot, landing

    @staticmethod
    def release(a: "Attempt", slot, landing) -> None:
        """Give back what ``retire_locked`` handed out: the relay slot to its ring, the landing credit to the
        rail."""
        if slot is not None:
            slot.ring.release(slot)
        if landing is not None:
            a.prail.release_landing(landing, a)

    def drop(self, a: "Attempt") -> None:
        """Give back an attempt's resources when it will not be (or is no longer) in flight. Idempotent."""
        with self.lock:
            _, slot, landing = self.retire_locked(a)
        self.release(a, slot, landing)
