"""Relay rings: ``lanes × slots`` staging slots per (relay device, rail), each with one copy thread.

A slot goes FREE -> FILLING (gather / copy into it) -> READY (queued for the fabric) -> POSTED (write in flight)
-> [WAITING (chunk written, waiting for the receiver's ack)] -> FREE. The buffer behind all slots of a ring is
allocated once and registered once with the rail's fabric (one lkey), on the relay device: host memory on a
GPU-less machine, the NIC-local GPU otherwise.

Threads: the copy thread takes as many queued units as there are free slots (one when every slot is free: the wire
then starts after one fill), enqueues their gathers / copies on the lanes' CUDA streams (host rings: memmove), waits
once per lane, and posts the round's writes itself, many per doorbell. One synchronise per round rather than one per
slot, and no hand-off to a posting thread, because each of those costs about a slot's copy time in Python: as much
as overlapping a round's post with the next round's copies would gain. Direct units the engine re-dispatches after a
failover are posted by the engine's progress thread. Completions release slots, in whichever thread the fabric
reports them (its callback, or the engine's poll loop).

Stream-ordered rounds: on a GPU ring whose fabric declares ``event_ordered_writes`` (ipc: the wire is a GPU
copy too), nothing waits on the host. A round records an event per lane after its fills and posts with it
(``Fabric.post_writes_after``); the fabric's copy waits for that event on the GPU, and the slots go back to the
ring at once, marked with the copy's own event, which the slot's next fill waits for on its lane stream. Since
the host only enqueues work, the engine's caller runs such rounds itself (``fill_and_post``, one unit per
round, so each write overlaps the next fill) and the copy thread only takes chunks and re-dispatched units.

Back-pressure: the copy thread (on an ordered ring, the caller) waits for a free slot; nothing that releases
slots ever waits for one, so the ring cannot deadlock. An ordered ring's slot is back as soon as its write is
queued, so a caller waits only while other callers' rounds hold every slot.

Lanes: slots are split into lanes; on CUDA each lane has its own stream, so copies of different lanes overlap
with each other and with the fabric. The copy thread takes the lane with the most free slots.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, List, Optional

from transport.packing import HostBuffer
from transport.telemetry import FILLING, FREE, READY, SlotStats, Trace, now_ns

log = logging.getLogger(__name__)


class Slot:
    """One staging slot: ``nbytes`` at ``addr`` (registered; ``lkey`` of the ring's rail)."""

    __slots__ = ("ring", "lane", "index", "addr", "nbytes", "stats", "owner", "tensor", "staging", "reuse_after")

    def __init__(self, ring: "RelayRing", lane: int, index: int, addr: int, nbytes: int, tensor=None):
        self.ring = ring
        self.lane = lane
        self.index = index
        self.addr = addr
        self.nbytes = nbytes
        self.stats = SlotStats()
        self.owner = None  # the attempt using the slot
        self.tensor = tensor  # uint8 tensor view (CUDA rings) for kernels
        self.staging = None  # CUDA rings: (pinned host, device) descriptor buffers, reused (see gpu_pack)
        self.reuse_after = None  # CUDA event the next fill's stream waits for (the write still reading the slot)

    def enter(self, state: str) -> None:
        t = now_ns()
        with self.ring.stats_lock:
            prev = self.stats.state
            since = self.stats.enter(state, t)
        trace = self.ring.trace
        if trace is not None and prev != FREE:  # FREE time is idle, not worth an event
            trace.complete(prev, "slot", f"{self.ring.name}/lane{self.lane}", since, t, {"slot": self.index})


class RelayRing:
    """Staging slots and the copy thread of one (relay device, rail).

    Arguments:
        name: label for stats / trace (e.g. "host/rail0").
        fabric: the rail's fabric; the slot buffer is registered with it.
        device: relay device (-1 host, else CUDA index).
        lanes, slots: lanes and slots per lane. slot_bytes: bytes per slot.
        fill: ``fill(attempt, slot) -> bool`` runs in the copy thread; returns False when the attempt was
            cancelled meanwhile (the slot is then released).
        post: ``post(attempts, after)`` runs in the copy thread with a round's READY attempts (one doorbell per
            peer), ``after`` the round's CUDA events on an ordered fabric (else None: the copies are done).
        trace: optional Trace.
    """

    def __init__(self, name: str, fabric, device: int, lanes: int, slots: int, slot_bytes: int,
                 fill: Callable, post: Callable, trace: Optional[Trace] = None):
        self.name = name
        self.fabric = fabric
        self.device = device
        self.slot_bytes = slot_bytes
        self.trace = trace
        self.stats_lock = threading.Lock()
        self._fill = fill
        self._post = post
        total = lanes * slots * slot_bytes
        self._tensor = None
        self._streams: List = []
        if device < 0:
            self._buf = HostBuffer(total)
            base = self._buf.addr
        else:
            import torch
            self._tensor = torch.empty(total, dtype=torch.uint8, device=f"cuda:{device}")
            base = self._tensor.data_ptr()
            self._streams = [torch.cuda.Stream(device=device) for _ in range(lanes)]
        self.mr = fabric.register(base, total, device)
        self.lkey = self.mr.lkey
        self.slots: List[Slot] = []
        self._free: List[collections.deque] = [collections.deque() for _ in range(lanes)]
        for lane in range(lanes):
            for i in range(slots):
                off = (lane * slots + i) * slot_bytes
                view = self._tensor[off:off + slot_bytes] if self._tensor is not None else None
                s = Slot(self, lane, lane * slots + i, base + off, slot_bytes, view)
                self.slots.append(s)
                self._free[lane].append(s)
        self.lanes = lanes
        # A fabric that orders its writes after CUDA events (``event_ordered_writes``) gets a GPU ring's rounds
        # without a host wait between fill and post, and hands each slot back as soon as its write is queued
        # (the next fill waits for that write on the GPU). A round then takes at most half the slots, so that
        # the next round's fill runs while this round's write does.
        self.ordered = device >= 0 and fabric.capabilities.event_ordered_writes
        self.round_slots = max(1, len(self.slots) // 2) if self.ordered else len(self.slots)
        self._cv = threading.Condition()
        self._copy_q: collections.deque = collections.deque()
        self._closed = False
        self._slot_waiters = 0  # threads in take / _acquire waiting for a free slot (under _cv)
        self.waits_for_slot = 0
        self.wait_slot_ns = 0
        # One thread: it fills chunks and queued units and posts each round's writes itself (``_round``); inline
        # units are filled and posted by their caller (``fill_and_post``).
        self._thread = threading.Thread(target=self._copy_loop, name=f"pxn-copy-{name}", daemon=True)
        self._thread.start()

    def stream(self, lane: int):
        return self._streams[lane] if self._streams else None

    # --- queues ---------------------------------------------------------------------------------------------
    def enqueue_copy(self, attempts) -> None:
        with self._cv:
            self._copy_q.extend(attempts)
            self._cv.notify_all()

    def release(self, slot: Slot, after=None) -> None:
        """Give a slot back (any thread, never blocks on the ring's queues). ``after``: a CUDA event that fires
        once the slot's bytes have been read (an event-ordered write still in flight); the next fill of the slot
        waits for it on the GPU."""
        slot.reuse_after = after
        slot.owner = None
        slot.enter(FREE)
        with self._cv:
            self._free[slot.lane].append(slot)
            # only a thread waiting for a slot needs waking: an idle copy thread (it waits on the same condition
            # for queued attempts) would wake for nothing at every release of an inline relay's slot
            if self._slot_waiters:
                self._cv.notify_all()

    def take(self, lane: int) -> Optional[Slot]:
        """A free slot of lane ``lane % lanes`` for the calling thread, waiting for one when that lane has none
        (back-pressure): a caller that alternates lanes runs one slot's write while the next slot fills on
        another stream. None once the ring is closed. The caller gives it back with ``release``."""
        free = self._free[lane % self.lanes]
        t0 = None
        with self._cv:
            while not self._closed:
                if free:
                    if t0 is not None:
                        self.wait_slot_ns += now_ns() - t0
                    return free.popleft()
                if t0 is None:
                    t0 = now_ns()
                    self.waits_for_slot += 1
                self._wait_for_slot()
        return None

    def free_slots(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._free)

    # --- threads --------------------------------------------------------------------------------------------
    def _acquire(self) -> Optional[Slot]:
        """Called with ``self._cv`` held: a free slot from the lane with the most, waiting when none."""
        t0 = None
        while not self._closed:
            lane = max(range(self.lanes), key=lambda i: len(self._free[i]))
            if self._free[lane]:
                if t0 is not None:
                    self.wait_slot_ns += now_ns() - t0
                return self._free[lane].popleft()
            if t0 is None:
                t0 = now_ns()
                self.waits_for_slot += 1
            self._wait_for_slot()
        return None

    def _wait_for_slot(self) -> None:
        """Called with ``self._cv`` held: wait until ``release`` (or ``close``) wakes this thread, or 0.5 s."""
        self._slot_waiters += 1
        try:
            self._cv.wait(0.5)
        finally:
            self._slot_waiters -= 1

    def fill_and_post(self, attempts) -> None:
        """An ordered ring's work in the calling thread (``self.ordered``): for each attempt a slot (waiting for one
        when none is free), its fill enqueued on the slot's lane stream and its write posted after that fill on
        the GPU, the slot back in the ring as soon as the write is queued. The host only enqueues, so the caller
        needs no copy thread: a hand-off to it, and the GIL traffic between the two, cost more host time than
        the enqueues themselves. An attempt per
        round: each write starts as soon as its own fill is done, while the next fill runs."""
        for attempt in attempts:
            with self._cv:
                slot = None if self._closed else self._acquire()
            if slot is None:
                from transport.errors import FabricClosed
                attempt.fail_local(FabricClosed(f"relay ring {self.name} is closed"))
                continue
            self._round([(attempt, slot)])

    def _copy_loop(self) -> None:
        while True:
            with self._cv:
                while not self._copy_q and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                # take as many queued attempts as there are free slots (at least one, waiting for it): they
                # are filled back to back and posted together, one doorbell for all. A ring with every slot free
                # has nothing on the wire: its first fill goes out alone, so that the wire starts after one fill
                # instead of a round of them, and the next round fills while it is written.
                idle = self.free_slots() == len(self.slots)
                work = [(self._copy_q.popleft(), self._acquire())]
                if work[0][1] is None:
                    return
                limit = 1 if idle else self.round_slots
                while self._copy_q and any(self._free) and len(work) < limit:
                    work.append((self._copy_q.popleft(), self._acquire()))
            self._round(work)

    def _round(self, work) -> None:
        """Fill the slots of ``work`` ((attempt, slot) pairs), then post the filled ones together: after a host
        wait per lane, or, on an ordered ring, after an event per lane that the fabric's writes wait for."""
        filled = []
        for attempt, slot in work:
            slot.owner = attempt
            slot.enter(FILLING)
            try:
                if slot.reuse_after is not None:
                    self._streams[slot.lane].wait_event(slot.reuse_after)
                    slot.reuse_after = None
                ok = self._fill(attempt, slot)
            except Exception as e:  # noqa: BLE001 — a failed copy fails its batch, not the ring
                log.exception("%s: filling a slot failed", self.name)
                ok = False
                attempt.fail_local(e)
            if not ok:
                self.release(slot)
                continue
            filled.append((attempt, slot))
        if not filled:
            return
        # the copies of every slot of this round run back to back on the lanes' streams: an event per lane
        # for an ordered fabric, else one host wait per lane
        after = None
        try:
            lanes = sorted({slot.lane for _, slot in filled}) if self._streams else []
            if self.ordered:
                import torch
                after = []
                for lane in lanes:
                    event = torch.cuda.Event()
                    event.record(self._streams[lane])
                    after.append(event)
            else:
                self.wait_for_fills(lanes)
        except Exception as e:  # noqa: BLE001 — a CUDA error fails the round's batches, not the ring
            log.exception("%s: waiting for slot copies failed", self.name)
            for attempt, slot in filled:
                self.release(slot)
                attempt.fail_local(e)
            return
        ready = []
        for attempt, slot in filled:
            slot.enter(READY)
            ready.append(attempt)
        try:
            self._post(ready, after)  # from this thread: no hand-off to another
        except Exception:  # noqa: BLE001 — post() handles its own failures; this is a last resort
            log.exception("%s: submit failed", self.name)

    def wait_for_fills(self, lanes) -> None:
        """Block until the fills queued on ``lanes``' streams are done: a fabric whose NIC reads the slot over PCIe
        (verbs, GPUDirect RDMA) is unordered with CUDA streams, so its writes are posted only after this."""
        for lane in lanes:
            self._streams[lane].synchronize()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.fabric.deregister(self.mr)
        except Exception:  # noqa: BLE001 — fabric may already be closed
            pass

    def stats(self) -> dict:
        with self.stats_lock:
            slots = [s.stats.to_dict() for s in self.slots]
        lanes = []
        per_lane = len(self.slots) // self.lanes
        for lane in range(self.lanes):
            mine = slots[lane * per_lane:(lane + 1) * per_lane]
            agg_counts = collections.Counter()
            agg_time = collections.Counter()
            for s in mine:
                agg_counts.update(s["counts"])
                agg_time.update(s["time_s"])
            lanes.append({"lane": lane, "counts": dict(agg_counts),
                          "time_s": {k: round(v, 6) for k, v in agg_time.items()}, "slots": mine})
        return {"device": self.device, "slot_bytes": self.slot_bytes, "slots": len(self.slots),
                "free": self.free_slots(), "waits_for_slot": self.waits_for_slot,
                "wait_for_slot_s": round(self.wait_slot_ns / 1e9, 6), "lanes": lanes}
