"""The receiver: a shared landing pool per rail, credits, chunk validation, scatter, and the ack back to the sender.

Landing memory is bounded in bytes and does not grow with the number of senders: per receiving rail (and landing
device) one pool of ``landing_bytes // stride`` slots is registered once, at the first hello
(``LandingPool``; ``stride`` = this engine's relay slot size, capped by ``MAX_LANDING_SLOT`` and by the budget).
Every sender writes into the same pool; slots are lent to senders as credits:

* a sender holds up to ``slots`` credits per rail (``min(its credit_slots, pool slots)``); credit ``k`` names pool
  slot ``p`` (``SenderState.lent``). Its chunk's immediate names ``k``; the receiver maps it to ``p`` and refuses a
  chunk naming a credit it does not hold. An ack (imm = ACK | status << 16 | k) gives credit ``k`` back to the
  sender, or, with ``F_RETURNED`` in the status, takes it back into the pool;
* the hello grants no credit (``landing_grants`` is there for a receiver that does): credits lent before the
  sender's rails connect would stay lent for the whole ``CONNECT_GRACE_S`` if it died meanwhile. Grants come in
  the reply to a ``credits`` request, back with acks (the credit stays with the sender) or as grant writes
  (status ``ST_GRANT``, the pool slot in the payload) into the sender's credit region;
* a sender out of credits asks for more with one small control message (``credits``: how many it wants, and the
  credits it returns unused) and waits: backpressure, never a refusal while it is alive;
* fairness: waiting senders queue per rail and get one slot at a time, round-robin; a chunk says whether its
  sender has more chunks waiting for credits (``MORE_FLAG`` in its immediate). At its ack the sender keeps the
  credit when nobody waits, or when it has more and holds less than its share (pool slots / senders holding
  or waiting); otherwise the slot goes to the next waiter (the sender, when it had more, queues again behind
  the others: ``F_QUEUED``). Credits a sender leaves unused it returns itself (``CREDIT_IDLE_S`` in
  ``transport.fills``);
* credits of a sender whose rail died (the liveness sweep, every ``SWEEP_S``) or that left go back to the pool.

The credit side (the ``credits`` op, the keep-or-return decision at each ack, grant writes, credits of dead
rails taken back) and the ack wire format are ``transport.credits`` (``CreditDesk``, ``Receiver.credit_desk``).

A sender's announced slot size is capped by the pool's stride: the hello answers ``landing_slot_bytes`` =
``min(announced, stride)`` (more than ``MAX_LANDING_SLOT`` is refused) and the sender cuts its chunks to it.
A hello costs at most ``slots x ACK_BYTES`` of
ack buffer per rail and its ``SenderState``, whatever it announces.

A chunk arrives as a WRITE_WITH_IMM (imm = credit index | MORE_FLAG | seq). The progress thread then

On fabrics with ``landing_handlers`` (tcp) steps 1 and 2 happen as the chunk arrives, in the fabric's receiving
thread (``_plan_landed``): once its header and table are in the landing slot and pass every check below, its
items are received straight into their destinations (no landing copy, no scatter), and the chunk's RECV_IMM only
has the ack sent (``on_chunk``). A chunk that fails a check there lands whole, as on any fabric, and goes the
progress thread's way, which rejects it with the reason.

1. parses and validates it (``pxn_kernels.chunk.parse_chunk``: magic, version, counts, the MAC of header and
   table under the sender's chunk key, offsets, checksum, size against the bytes that landed), checks the sender
   id, that its sequence number was not seen before (a replayed header and table), and every destination
   against the regions this receiver registered (exposed to every peer) -- landing and credit buffers are never
   valid destinations;
2. only then scatters the items (host: memmove; GPU: one scatter kernel launch);
3. writes an ack back into the sender's credit region: WRITE_WITH_IMM with imm = ACK | status << 16 | credit and,
   for a rejection, the reason text (UTF-8, up to ``ACK_BYTES - 8``) as the payload.

A rejected chunk writes nothing. A chunk whose MAC does not check, or whose sequence number came before, was
changed or replayed on its way (the fabric's own tags do not cover a chunk's table, which travels as payload):
the receiver writes nothing of it, sends no ack and aborts the rail's endpoint, and the sender fails the rail
over as for a frame with a wrong tag (``stats()["security"]["refused_chunk_mac"]``). This lives here, above
every fabric: a fabric only has to deliver the chunk's bytes and its immediate, and ``Endpoint.abort``.

Admission (``accept_sender``, after the control connection authenticated): at most ``max_senders`` senders are
connected at once; every field of the hello is type- and range-checked before anything is allocated; a rail
id belongs to the sender that announced it while that sender's rail is alive -- another engine claiming it is
refused and the holder is not touched. The rail ids of an accepted hello are announced to the fabrics
(``expect_peer``), which take an incoming rail connection only for an announced id.

A sender that lost every rail to this engine forgets it and handshakes again (same engine id, new credit
region): its previous state is retired at the new hello, chunks of the old connection still queued are
dropped unacknowledged (the sender gave up on them), its credits go back to the pool and it starts with none,
so nothing of the old connection can be mistaken for the new one's.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from transport import auth
from transport.credits import (ACK_BYTES, ACK_FLAG, CONNECT_GRACE_S, MORE_FLAG, ST_FAILED, ST_OK, ST_REJECTED,
                               CreditDesk, int_field)
from transport.errors import ChunkAuthError, ChunkFormatError
from transport.fabric.base import DEVICE_HOST
from transport.landing import LandingPool
from transport.packing import HostBuffer, gpu_scatter, host_memmove, scatter_words
from transport.progress import ProgressLoop
from transport.regions import RegionTable, first_bad, span_region
from transport.telemetry import Counters, Trace, now_ns

log = logging.getLogger(__name__)

MAX_LANDING_SLOT = 64 << 20
LANDING_BYTES = 32 << 20  # default landing pool per rail (docs/README-engine.md, "Landing pool")
BIG_PIECE = 256 << 10  # landed pieces of at least this many bytes are placed by the copy engine, not the kernel
SWEEP_S = 1.0  # how often the progress thread looks for departed senders
_BY_TABLE = object()  # ``_placed_rows`` cannot place the chunk from its rows: its parsed table decides
# A new sender whose rail id (host:port) is still held by the live-looking endpoint of a sender that just closed
# (the OS gave the port again before this side read the old connection's end) waits this long for that endpoint
# to die before its claim is refused: a closed peer's sockets reach end-of-file within milliseconds, a live
# holder stays alive and the claim is refused as before.
CLAIM_WAIT_S = 1.0
# Chunk sequence numbers of a sender (one counter over all its rails) are accepted once each, and only within this
# many of the highest seen: chunks in flight at once are bounded by its credits (at most 0xFFFF per rail), far
# fewer.
SEQ_WINDOW = 1 << 17

@dataclass
class SenderState:
    """What the receiver keeps per connected sender."""

    engine_id: int
    session: str
    rail_ids: List[str]  # the sender's fabric local_id per rail
    credit_addr: int
    credit_rkeys: List[int]
    slots: int  # credits it may hold per rail (entries of its credit region per rail)
    slot_bytes: int  # largest chunk it may write (its announced size, capped by the pool's stride)
    devices: List[int]  # per rail: where its landing slots are (-1 host, else a CUDA index)
    pools: List = field(default_factory=list)  # per rail: the LandingPool it writes into
    lent: List = field(default_factory=list)  # per rail: {credit index: pool slot}
    want: List = field(default_factory=list)  # per rail: credits it asked for and has not got yet
    queued: List = field(default_factory=list)  # per rail: whether it is in the pool's waiting queue
    returning: List = field(default_factory=list)  # per rail: credits taken back whose ack is not posted yet
    # per rail: {credit index: time.monotonic() it was lent or kept at an ack} of credits whose chunk has not
    # arrived since: a lease, which runs out after LEASE_S while others wait (``CreditDesk.sweep``)
    leased: List = field(default_factory=list)
    acks: List = field(default_factory=list)  # per rail: (HostBuffer, mr)
    hello_at: float = 0.0  # time.monotonic() of the handshake
    stale_eps: Dict = field(default_factory=dict)  # rail -> endpoint of an earlier connection, dead or dying
    retired: bool = False  # replaced by a newer handshake of the same sender, or released
    placed: Dict = field(default_factory=dict)  # (rail, imm) -> _Placed: chunks placed as they arrived
    chunks_queued: int = 0  # its landed chunks waiting for the progress loop (``on_chunk``), at most ``queue_cap``
    queue_lock: threading.Lock = field(default_factory=threading.Lock)
    # given to the sender in its hello reply: a request naming this sender on another control connection proves
    # it holds this (``transport.auth.claim_proof``), so no other holder of the secret can speak for it
    key: bytes = field(default_factory=lambda: os.urandom(16))
    chunk_key: Optional[bytes] = None  # the MAC key of its chunks (``transport.auth.chunk_key``); None: no secret
    seq_hi: int = 0  # the highest chunk sequence number accepted from it
    seq_seen: set = field(default_factory=set)  # those accepted within SEQ_WINDOW of seq_hi

    def fresh(self, seq: int) -> bool:
        """Whether chunk sequence number ``seq`` is new from this sender (then it is recorded): a header and table
        replayed from an earlier chunk carry a number seen before."""
        with self.queue_lock:
            if seq <= self.seq_hi - SEQ_WINDOW or seq in self.seq_seen:
                return False
            self.seq_seen.add(seq)
            if seq > self.seq_hi:
                self.seq_hi = seq
                if len(self.seq_seen) > 2 * SEQ_WINDOW:
                    self.seq_seen = {s for s in self.seq_seen if s > seq - SEQ_WINDOW}
            return True

    @property
    def queue_cap(self) -> int:
        """Chunks of this sender the progress loop may hold at once: one per credit it may hold on every rail (a
        sender that keeps to its credits never has more), so the queue is bounded in bytes per sender."""
        return max(1, self.slots) * max(1, len(self.rail_ids))

    def landing_addr(self, rail: int, slot: int) -> int:
        """Address of the pool slot behind credit ``slot`` on ``rail`` (KeyError: not lent to this sender)."""
        pool = self.pools[rail]
        return pool.buf.addr + self.lent[rail][slot] * pool.stride


class Receiver:
    """Receives chunks for one engine.

    Arguments:
        fabrics: the engine's rail fabrics (index = rail).
        exposed: the RegionTable of regions this engine registered (valid chunk destinations).
        landing_slots: credits one sender may hold per rail (at most the pool's slots).
        slot_bytes: this engine's relay slot size (bytes): the pool's slot stride, capped by ``landing_bytes`` and
            ``MAX_LANDING_SLOT``; the largest chunk a sender may write.
        landing_bytes: the landing pool per rail and landing device (bytes), shared by every sender.
        counters: shared telemetry counters; trace: optional Trace.
        secret: the engine's shared secret (None: none): every sender's chunks must carry a MAC under a key derived
            from it (``transport.auth.chunk_key``).
    """

    def __init__(self, fabrics, exposed: RegionTable, landing_slots: int, slot_bytes: int, counters: Counters,
                 trace: Optional[Trace] = None, max_senders: int = 256, progress: Optional[ProgressLoop] = None,
                 landing_bytes: int = LANDING_BYTES, secret: Optional[bytes] = None):
        if isinstance(landing_bytes, bool) or not isinstance(landing_bytes, int) or landing_bytes < 4096:
            raise ValueError(f"landing_bytes must be an int >= 4096, got {landing_bytes!r}")
        self.fabrics = fabrics
        self._secret = secret
        self.max_senders = max_senders
        self.exposed = exposed
        self.landing_slots = landing_slots
        self.landing_bytes = landing_bytes
        self.stride = min(slot_bytes, MAX_LANDING_SLOT, landing_bytes)
        self.slot_bytes = self.stride
        self._pools: Dict[Tuple[int, int], LandingPool] = {}
        self.counters = counters
        self.trace = trace
        self._lock = threading.Lock()
        self._senders: Dict[int, SenderState] = {}
        self._by_rail_id: Dict[str, Tuple[SenderState, int]] = {}
        # the ``credits`` control op, the keep-or-return decision at each ack, grant writes
        self.credit_desk = CreditDesk(fabrics, self._lock, self._senders, counters)
        self._closed = False
        # the engine's progress loop, or one of the receiver's own; its owner closes it before this receiver
        self._own_progress = progress is None
        self._progress = ProgressLoop("pxn-receiver") if progress is None else progress
        self._progress.every(SWEEP_S, self._sweep_if_open)
        self._scratch = None
        self._streams: Dict[int, object] = {}
        self._flushed_at: Dict[Tuple[int, int], int] = {}  # (rail, GPU) -> start of its last GPUDirect flush (ns)

    # --- handshake ------------------------------------------------------------------------------------------
    def accept_sender(self, hello: dict, device=DEVICE_HOST) -> dict:
        """Set up landing slots for the sender described by ``hello``; returns what it must know. A sender seen
        before (it handshakes again after losing every rail) gets fresh ones; its old state is retired.

        ``device``: where the landing slots go, one value for every rail or a list with one per rail (-1 host,
        else a CUDA index: the GPU next to the rail's NIC, which forwards chunks to other GPUs over NVLink)."""
        devices = list(device) if isinstance(device, (list, tuple)) else [device] * len(self.fabrics)
        if len(devices) != len(self.fabrics):
            raise ValueError(f"{len(devices)} landing devices for {len(self.fabrics)} rails")
        st, credit_slots = self._sender_of(hello, devices)
        n = len(self.fabrics)
        old = None
        grants: List[List[List[int]]] = []
        self._wait_for_departing_holders(st)
        try:
            with self._lock:
                # a second claim of a rail id held by another live sender is refused; the holder is not touched
                self._check_claims_locked(st)
                if st.engine_id not in self._senders and len(self._senders) >= self.max_senders:
                    self.counters.add("senders_refused_max")
                    raise ValueError(f"this receiver holds landing slots for max_senders={self.max_senders} "
                                     f"senders (PXN_MAX_SENDERS raises it); refused sender {st.session}")
                pools = [self._pool_locked(rail, devices[rail]) for rail in range(n)]
                st.pools = pools
                st.slots = min(self.landing_slots, credit_slots, min(p.nslots for p in pools))
                st.lent = [{} for _ in range(n)]
                st.want = [0] * n
                st.queued = [False] * n
                st.returning = [set() for _ in range(n)]
                st.leased = [{} for _ in range(n)]
                old = self._retire_locked(st.engine_id)
                self._attach_rails_locked(st)
                if old is not None:  # its credits are free for the new connection's first grant
                    for pool in old.pools:
                        pool.forget(old)
                # no first grant: credits lent before the rails connect would stay with a sender that dies
                # meanwhile for the whole connect grace; the first chunk asks (one control round trip)
                grants = [[] for _ in range(n)]
        finally:
            if old is not None:
                self._free(old)
                self.counters.add("rx_senders_replaced")
                log.info("receiver: sender %s handshook again; replaced its landing credits", old.session)
        return {"landing_addrs": [p.buf.addr for p in st.pools],
                "landing_rkeys": [p.mr.rkey for p in st.pools],
                "landing_slots": st.slots, "landing_slot_bytes": st.slot_bytes,
                "landing_stride": self.stride, "landing_grants": grants,
                "landing_device": devices[0], "landing_devices": devices, "sender_key": st.key.hex()}

    def _sender_of(self, hello: dict, devices: list) -> Tuple[SenderState, int]:
        """(the new sender's state, the credit slots it asks for) from its ``hello``, every field checked."""
        engine_id = int_field(hello, "engine_id", 1, (1 << 63) - 1)
        # the sender's chunk size (its relay slot size) capped by the pool's stride: the sender cuts its chunks to
        # what we answer, so a hello announcing huge slots costs what any other does
        slot_bytes = min(int_field(hello, "slot_bytes", 4096, MAX_LANDING_SLOT, self.slot_bytes), self.stride)
        credit_slots = int_field(hello, "credit_slots", 1, 0xFFFF, self.landing_slots)
        rail_ids, rkeys = hello.get("rail_ids"), hello.get("credit_rkeys")
        n = len(self.fabrics)
        if not (isinstance(rail_ids, list) and len(rail_ids) == n
                and all(isinstance(r, str) and 0 < len(r) <= 256 for r in rail_ids)):
            raise ValueError(f"sender rail_ids {str(rail_ids)[:200]}: need {n} peer ids (this engine has {n} "
                             f"rails; both ends must use the same rail count)")
        if not (isinstance(rkeys, list) and len(rkeys) == n
                and all(type(k) is int and 0 <= k <= 0xFFFFFFFF for k in rkeys)):
            raise ValueError(f"sender credit_rkeys {str(rkeys)[:200]}: need {n} 32-bit keys")
        session = hello.get("session", "?")
        st = SenderState(engine_id=engine_id, session=str(session)[:300],
                         rail_ids=list(rail_ids), credit_addr=int_field(hello, "credit_addr", 1, (1 << 64) - 1),
                         credit_rkeys=list(rkeys), slots=0, slot_bytes=slot_bytes, devices=devices,
                         hello_at=time.monotonic())
        st.chunk_key = auth.chunk_key(self._secret, st.key)
        return st, credit_slots

    def _retire_locked(self, engine_id: int) -> Optional[SenderState]:
        """The sender ``engine_id`` had before, retired, or None. A sender says hello again only after it forgot
        this engine (every rail failed): what it had is retired, so that stale chunks and acks of the old
        connection cannot touch the new one's slots."""
        old = self._senders.pop(engine_id, None)
        if old is not None:
            old.retired = True
            for rid in old.rail_ids:
                if self._by_rail_id.get(rid, (None, 0))[0] is old:
                    del self._by_rail_id[rid]
        return old

    def _attach_rails_locked(self, st: SenderState) -> None:
        """Make ``st`` the sender of its rail ids: the endpoints a reconnect replaces, one ack buffer per rail, and
        each fabric told to expect the rail's connection."""
        for rail, fab in enumerate(self.fabrics):
            try:
                st.stale_eps[rail] = fab.endpoint(st.rail_ids[rail])  # replaced when the rail connects
            except Exception:  # noqa: BLE001 — never connected: nothing stale
                pass
        for rail, fab in enumerate(self.fabrics):
            ack = HostBuffer(st.slots * ACK_BYTES)
            st.acks.append((ack, fab.register(ack.addr, ack.nbytes, DEVICE_HOST)))
        self._senders[st.engine_id] = st
        for rail, rid in enumerate(st.rail_ids):
            self._by_rail_id[rid] = (st, rail)
        for fab, rid in zip(self.fabrics, st.rail_ids):
            expect = getattr(fab, "expect_peer", None)
            if expect is not None:
                expect(rid, CONNECT_GRACE_S)

    def claim_key(self, engine_id) -> Optional[Tuple[bytes, bool]]:
        """For the live sender with ``engine_id``: (its key, whether it has departed: a rail it connected is dead),
        by which ``transport.control`` checks a request naming it on another connection than its hello's; None
        when no live sender has that id."""
        with self._lock:
            st = self._senders.get(engine_id) if type(engine_id) is int else None
            return None if st is None or st.retired else (st.key, self._departed(st))

    def _pool_locked(self, rail: int, device: int) -> LandingPool:
        """The landing pool of ``rail`` on ``device``, registered at its first use (``self._lock`` held)."""
        pool = self._pools.get((rail, device))
        if pool is None:
            fab = self.fabrics[rail]
            pool = self._pools[(rail, device)] = LandingPool(fab, rail, device, self.landing_bytes, self.stride)
            if device < 0 and fab.capabilities.landing_handlers:
                fab.set_landing_handler(pool.mr, functools.partial(self._plan_landed, pool))
            log.info("receiver: landing pool rail %d on %s: %d slots of %d B", rail,
                     "host" if device < 0 else f"cuda:{device}", pool.nslots, pool.stride)
        return pool

    def _other_holders(self, st: SenderState):
        """For each rail id of ``st`` held by another sender: (rail id, the holder's state, whether the holder's
        endpoint on that rail is alive, or None when it has not connected it yet)."""
        for rail, rid in enumerate(st.rail_ids):
            holder = self._by_rail_id.get(rid)
            if holder is None or holder[0].engine_id == st.engine_id:
                continue
            try:
                alive = self.fabrics[rail].endpoint(rid).alive
            except Exception:  # noqa: BLE001 — announced, not connected yet
                alive = None
            yield rid, holder[0], alive

    def _wait_for_departing_holders(self, st: SenderState) -> None:
        """Before the claims are checked (and without the lock): while a rail id of ``st`` is held by another
        sender whose endpoint still looks alive, wait up to ``CLAIM_WAIT_S`` for it to die (a sender that closed a
        moment ago, whose port the new one got). The check under the lock decides (a holder that has not
        connected yet included); this only gives a departing holder's end-of-file time to arrive."""
        deadline = time.monotonic() + CLAIM_WAIT_S
        while any(alive for _, _, alive in self._other_holders(st)) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _departed(self, holder: SenderState) -> bool:
        """Whether ``holder`` has closed or died: a rail it connected since its hello is dead. Its rails not
        connected yet are then not its any more: a live sender keeps its listening ports, so another engine that
        announces one of them as its rail id got the port after the holder let it go (a sender that used one of
        its rails and closed, its other port given to the next engine)."""
        for rail, rid in enumerate(holder.rail_ids):
            try:
                ep = self.fabrics[rail].endpoint(rid)
            except Exception:  # noqa: BLE001 — not connected
                continue
            if ep is not holder.stale_eps.get(rail) and not ep.alive:
                return True
        return False

    def _check_claims_locked(self, st: SenderState) -> None:
        for rid, holder, alive in self._other_holders(st):
            if alive is None:  # announced, not connected yet: still the holder's for a while, unless it is gone
                alive = time.monotonic() - holder.hello_at < CONNECT_GRACE_S and not self._departed(holder)
            if alive:
                self.counters.add("senders_refused_claim")
                raise ValueError(f"rail id {rid!r} belongs to sender {holder.session} (engine 0x"
                                 f"{holder.engine_id:x}); refused the claim of engine 0x{st.engine_id:x}")

    # --- chunks placed as they arrive (fabrics with landing_handlers) -----------------------------------------
    def _plan_landed(self, pool: LandingPool, peer_id: str, addr: int, length: int, imm: int, read):
        """The landing handler of ``pool`` (``TcpFabric.set_landing_handler``), called by the fabric's receiving
        thread before any byte of a write into it is placed: finds the sender of ``peer_id``, reads the chunk's
        header and table into the slot and checks them as ``_handle`` does (the credit named by the immediate is
        the sender's and the write is at its pool slot, the size, ``parse_chunk``, the sender id, every
        destination inside a host region this receiver registered). Returns where each item goes, or None (the
        chunk lands whole and ``_handle`` takes it, rejecting it with the reason when it is bad). Nothing is
        written outside the slot before every check passed."""
        # torch-free; lazy as in _handle
        from pxn_kernels.chunk import HEADER_BYTES, parse_chunk_rows, payload_offset_for
        found = self._lent_slot(pool, peer_id, addr, length, imm, HEADER_BYTES)
        if found is None:
            return None
        st, rail, slot = found
        st.leased[rail].pop(imm & 0xFFFF, None)  # written: its lease is kept
        t0 = now_ns()
        head = read(HEADER_BYTES)
        count = int.from_bytes(head[16:20], "little")
        need = payload_offset_for(count)
        if need > length:
            return None
        read(need - HEADER_BYTES)
        off = slot * pool.stride
        rows = parse_chunk_rows(pool.buf.array[off:off + need], length, st.chunk_key)
        if rows is not None:
            placed = self._placed_rows(st, rail, imm, length, count, rows, t0)
            if placed is not _BY_TABLE:
                return placed
        return self._placed_table(st, rail, imm, length, count, pool.buf.array[off:off + need], t0)

    def _lent_slot(self, pool: LandingPool, peer_id: str, addr: int, length: int, imm: int, header_bytes: int):
        """(sender, rail, slot) of a write into ``pool`` when it is a chunk into a slot lent to the sender of
        ``peer_id`` on this rail, at that slot's address, of a size a chunk may have; else None."""
        entry = self._by_rail_id.get(peer_id)
        if entry is None:
            return None
        st, rail = entry
        if st.retired or rail != pool.rail or st.pools[rail] is not pool:
            return None
        slot = st.lent[rail].get(imm & 0xFFFF)
        if imm & ACK_FLAG or slot is None or length > st.slot_bytes or length < header_bytes \
                or addr != pool.buf.addr + slot * pool.stride:
            return None
        return st, rail, slot

    def _placed_rows(self, st: SenderState, rail: int, imm: int, length: int, count: int, rows, t0: int):
        """The usual chunk (items in payload order, ``parse_chunk_rows``), checked in builtin steps: where its
        items go, None (``_handle`` takes it whole), or ``_BY_TABLE`` when its destinations are not all in one
        host region (the table's checks decide)."""
        seq, sender_id, _, dsts, lens, offs, lo, hi = rows
        if sender_id != st.engine_id or sum(lens) < getattr(self.fabrics[rail], "gather_min_bytes", 0) * count:
            return None
        snap = self.exposed.snapshot()
        i = span_region(snap, lo, hi - 1, hi, hi - lo)
        if i is None or snap.regions[i].device >= 0:
            return _BY_TABLE
        if st.fresh(seq):  # one host region holds them all
            return _Placed(self, st, rail, imm, length, dsts, lens, offs, t0)
        return None  # a replayed sequence number: _handle refuses it

    def _placed_table(self, st: SenderState, rail: int, imm: int, length: int, count: int, head, t0: int):
        """Any chunk, from its parsed table (``head``: the slot's header and table): where its items go, in
        payload order, or None (``_handle`` takes it whole, rejecting it with the reason when it is bad)."""
        from pxn_kernels.chunk import parse_chunk  # torch-free; lazy as in _handle
        try:
            table = parse_chunk(head, available_bytes=length, key=st.chunk_key)
        except ChunkFormatError:
            return None
        if table.sender_id != st.engine_id or not count:
            return None
        lens = table.lengths
        if int(lens.sum()) < getattr(self.fabrics[rail], "gather_min_bytes", 0) * count:
            return None  # small pieces: one scatter copy costs less than a receive step per piece
        idx, ok = self.exposed.locate(table.dst_addrs, lens)
        if not ok.all() or (self.exposed.snapshot().devices[idx] >= 0).any():
            return None  # outside every region (rejected by _handle), or GPU destinations (scattered there)
        if not st.fresh(table.seq):
            return None  # a replayed sequence number: _handle refuses it
        offs = table.offsets
        if count > 1 and not bool((offs[1:] > offs[:-1]).all()):
            order = np.argsort(offs, kind="stable")
            return _Placed(self, st, rail, imm, length, table.dst_addrs[order].tolist(), lens[order].tolist(),
                           offs[order].tolist(), t0)
        return _Placed(self, st, rail, imm, length, table.dst_addrs.tolist(), lens.tolist(), offs.tolist(), t0)

    # --- progress -------------------------------------------------------------------------------------------
    def on_chunk(self, rail: int, peer_id: str, imm: int, byte_len: int) -> None:
        """Called by the engine's poller for a chunk's RECV_IMM; the work happens in the progress loop, except
        for a chunk the fabric already placed (``_plan_landed``), which is acked here."""
        # the sender state is looked up now, when the chunk has landed: if the sender handshakes again before
        # the progress thread gets to it, the chunk still belongs to (and is dropped with) the old state
        entry = self._by_rail_id.get(peer_id)
        if entry is not None and entry[1] == rail:
            entry[0].leased[rail].pop(imm & 0xFFFF, None)  # written within its lease
        if entry is not None and entry[0].placed:
            placed = entry[0].placed.pop((rail, imm), None)
            if placed is not None:
                if placed.length == byte_len and entry[1] == rail:
                    self._acked_placed(placed)
                    return
                log.warning("receiver: placed chunk on rail %d imm 0x%x does not match its RECV_IMM (%d B vs %d B)",
                            rail, imm, byte_len, placed.length)
        if entry is not None:
            st = entry[0]
            with st.queue_lock:
                full = st.chunks_queued >= st.queue_cap
                if not full:
                    st.chunks_queued += 1
            if full:
                # more chunks than credits it may hold: not a sender that keeps to the protocol; nothing is
                # queued for it (its batch fails at its own timeout)
                self.counters.add("rx_chunks_over_credits")
                return
        self._progress.submit(self._handle_if_open, rail, peer_id, entry, imm, byte_len, now_ns())

    # in the progress loop, which logs what raises and goes on: nothing once this receiver is closed
    def _handle_if_open(self, rail, peer_id, entry, *item) -> None:
        if entry is not None:
            st = entry[0]
            with st.queue_lock:
                st.chunks_queued -= 1
        if not self._closed:
            self._handle(rail, peer_id, entry, *item)

    def _sweep_if_open(self) -> None:
        if not self._closed:
            self._sweep()
            self.credit_desk.sweep()

    def _sweep(self) -> None:
        """Free the landing and ack buffers of senders whose every rail is dead (the sender closed or died):
        without this a long-running receiver keeps landing_slots x slot size per rail for every sender it ever
        saw. A sender that has not connected its rails yet (``UnknownPeer``) is kept. Runs in the progress
        thread, so no chunk of that sender is being handled meanwhile. A sender with a rail not connected is kept
        unless a rail it did connect has died (``_departed``): one that used some of its rails and closed would
        otherwise keep its slots for ever."""
        gone = []
        now = time.monotonic()
        with self._lock:
            for engine_id, st in list(self._senders.items()):
                alive = unconnected = False
                for rail, fab in enumerate(self.fabrics):
                    try:
                        ep = fab.endpoint(st.rail_ids[rail])
                    except Exception:  # noqa: BLE001 — not connected yet (or fabric closing)
                        unconnected = True
                        continue
                    # the dead endpoint of an earlier connection of this sender: its new rail is still
                    # connecting, unless that takes longer than any connect could
                    alive = ep.alive or (ep is st.stale_eps.get(rail) and now - st.hello_at < CONNECT_GRACE_S)
                    if alive:
                        break
                if not alive and unconnected and not self._departed(st):
                    alive = True  # its rails are still to connect
                if not alive:
                    gone.append(self._senders.pop(engine_id))
                    st.retired = True
                    for rid in st.rail_ids:
                        self._by_rail_id.pop(rid, None)
        for st in gone:
            self._free(st)
            self.counters.add("rx_senders_released")
            log.info("receiver: sender %s is gone; released its landing slots", st.session)

    def _free(self, st: SenderState) -> None:
        """Give a departed (or replaced) sender's credits back to the pools, to the senders waiting first, and
        deregister its ack buffers."""
        grants = []
        with self._lock:
            for pool in st.pools:
                pool.forget(st)
                grants.extend(pool.dispatch())
        self.credit_desk.post_grants(grants)
        for rail, fab in enumerate(self.fabrics):
            if rail >= len(st.acks):
                break
            try:
                fab.deregister(st.acks[rail][1])
            except Exception:  # noqa: BLE001 — fabric may be closed already
                pass

    def _handle(self, rail: int, peer_id: str, entry, imm: int, byte_len: int, t_landed: int) -> None:
        if entry is None:
            log.warning("receiver: chunk from unknown peer %s (imm 0x%x) ignored", peer_id, imm)
            self.counters.add("rx_unknown_peer")
            return
        st, st_rail = entry
        if st.retired:
            # the sender forgot this connection and handshook again (or left): nobody waits for this ack
            self.counters.add("rx_stale_chunks")
            return
        k = imm & 0xFFFF
        more = bool(imm & MORE_FLAG)
        t0 = now_ns()
        slot = st.lent[rail].get(k) if st_rail == rail else None
        if slot is None or byte_len > st.slot_bytes:
            self._ack(st, rail, k % st.slots, ST_REJECTED,
                      f"chunk imm 0x{imm:x} names credit {k} / {byte_len} B (holds {sorted(st.lent[rail])} of "
                      f"{st.slots} credits, chunks up to {st.slot_bytes} B) on rail {rail}", more)
            return
        pool = st.pools[rail]
        buf, tensor = pool.buf, pool.tensor
        if tensor is not None:
            try:
                self._flush_landed(rail, pool.device, t_landed)
            except Exception as e:  # noqa: BLE001 — FabricError naming the NIC and GPU
                log.warning("receiver: GPUDirect flush for chunk from %s credit %d failed: %s", st.session, k, e)
                self._ack(st, rail, k, ST_FAILED, f"receiver GPUDirect flush failed: {e}", more)
                return
        try:
            header_bytes = self._read_header(buf, tensor, slot, pool.stride, byte_len)
            from pxn_kernels.chunk import parse_chunk
            table = parse_chunk(header_bytes, available_bytes=byte_len, key=st.chunk_key)
            if table.sender_id != st.engine_id:
                raise ChunkFormatError(f"chunk sender_id 0x{table.sender_id:x} is not the connected sender "
                                       f"0x{st.engine_id:x}")
            if not st.fresh(table.seq):
                raise ChunkAuthError(f"chunk sequence number {table.seq} came before from this sender (a replayed "
                                     f"header and table)")
            dst = table.dst_addrs.astype(np.uint64)
            _, ok = self.exposed.locate(dst, table.lengths)
            if not ok.all():
                i = first_bad(ok)
                raise ChunkFormatError(f"item {i}: destination 0x{int(dst[i]):x} + {int(table.lengths[i])} B is "
                                       f"outside every region this receiver registered")
        except ChunkAuthError as e:
            self._refuse_forged(st, rail, k, e)
            return
        except ChunkFormatError as e:
            self.counters.add("rx_rejected")
            log.warning("receiver: rejected chunk from %s credit %d: %s", st.session, k, e)
            self._ack(st, rail, k, ST_REJECTED, f"receiver rejected chunk (credit {k}): {e}", more)
            return
        t1 = now_ns()
        try:
            self._scatter(buf, tensor, slot, pool.stride, table)
        except Exception as e:  # noqa: BLE001
            log.exception("receiver: scatter failed")
            self._ack(st, rail, k, ST_FAILED, f"receiver scatter failed: {e}", more)
            return
        t2 = now_ns()
        self._ack(st, rail, k, ST_OK, "", more)
        t3 = now_ns()
        self.counters.add_many((("rx_chunks", 1), ("rx_items", table.item_count),
                                ("rx_bytes", int(table.lengths.sum())),
                                ("rx_queue_s", (t0 - t_landed) / 1e9), ("rx_validate_s", (t1 - t0) / 1e9),
                                ("rx_scatter_s", (t2 - t1) / 1e9), ("rx_ack_s", (t3 - t2) / 1e9)))
        if self.trace is not None:
            self.trace.complete("validate", "receiver", f"rx/rail{rail}", t0, t1, {"items": table.item_count})
            self.trace.complete("scatter", "receiver", f"rx/rail{rail}", t1, t2, {"bytes": int(table.lengths.sum())})

    def _flush_landed(self, rail: int, device: int, t_landed: int) -> None:
        """Before a chunk that a NIC wrote into GPU landing memory is read: flush that NIC's writes into the GPU
        (``Fabric.flush_gpu_writes``), unless a flush that began after the chunk's RECV_IMM was seen covers it
        already (chunks queued behind each other share one)."""
        fab = self.fabrics[rail]
        if not fab.capabilities.gpu_write_flush or self._flushed_at.get((rail, device), -1) > t_landed:
            return
        t0 = now_ns()
        method = fab.flush_gpu_writes(device)
        self._flushed_at[(rail, device)] = t0
        self.counters.add_many(((f"rx_gpu_flush_{method}", 1), ("rx_gpu_flush_s", (now_ns() - t0) / 1e9)))

    def _refuse_forged(self, st: SenderState, rail: int, k: int, e: ChunkAuthError) -> None:
        """A chunk whose header and table were changed or replayed on the way: nothing of it is placed and no ack
        goes back; the rail's endpoint is aborted, so that the sender fails the rail over as for a frame with a
        wrong tag (the stream that carried the chunk cannot be trusted). The credit comes back with the dead rail's
        (``CreditDesk.sweep``)."""
        self.counters.add("rx_chunks_forged")
        log.warning("receiver: chunk from %s on rail %d (credit %d) refused: %s; aborting the rail", st.session,
                    rail, k, e)
        try:
            self.fabrics[rail].endpoint(st.rail_ids[rail]).abort()
        except Exception:  # noqa: BLE001 — not connected any more, or the fabric is closing
            pass

    def _acked_placed(self, p: "_Placed") -> None:
        st = p.st
        if st.retired:
            self.counters.add("rx_stale_chunks")
            return
        t2 = now_ns()
        self._ack(st, p.rail, p.imm & 0xFFFF, ST_OK, "", bool(p.imm & MORE_FLAG))
        t3 = now_ns()
        self.counters.add_many((("rx_chunks", 1), ("rx_items", len(p.lens)), ("rx_bytes", sum(p.lens)),
                                ("rx_placed_chunks", 1), ("rx_validate_s", (p.t1 - p.t0) / 1e9),
                                ("rx_ack_s", (t3 - t2) / 1e9)))
        if self.trace is not None:
            self.trace.complete("validate", "receiver", f"rx/rail{p.rail}", p.t0, p.t1, {"items": len(p.lens)})

    def _stream(self, device):
        """A stream of the progress thread's own on ``device``: a created stream's handle names its GPU, where the
        default stream's (0) would mean whatever GPU is current in this thread."""
        import torch
        streams = self._streams
        st = streams.get(device.index)
        if st is None:
            st = streams[device.index] = torch.cuda.Stream(device=device)
        return st

    def _pinned(self, need: int, device):
        """One pinned + one device scratch buffer for the progress thread (GPU landing slots), grown on demand."""
        import torch
        if self._scratch is None:
            self._scratch = {}
        key = str(device)  # landing slots of different rails may sit on different GPUs
        st = self._scratch.get(key)
        if st is None or st[0].numel() < need:
            cap = 1 << (max(need, 64 << 10) - 1).bit_length()
            st = self._scratch[key] = (torch.empty(cap, dtype=torch.uint8, pin_memory=True),
                                       torch.empty(cap, dtype=torch.uint8, device=device))
        return st

    def _read_header(self, buf, tensor, slot: int, slot_bytes: int, byte_len: int) -> np.ndarray:
        """Header + table of the chunk in ``slot`` as host bytes (a copy for GPU landing slots: one D2H of the
        first 64 KiB covers chunks of up to ~4000 items; a longer table takes a second copy)."""
        from pxn_kernels.chunk import ENTRY_BYTES, HEADER_BYTES
        off = slot * slot_bytes
        if tensor is None:
            return buf.array[off:off + byte_len]
        first = min(byte_len, 64 << 10)
        pinned, _ = self._pinned(first, tensor.device)
        pinned[:first].copy_(tensor[off:off + first])
        head = pinned[:first].numpy()
        count = int(head[16:20].view(np.uint32)[0])
        need = min(byte_len, HEADER_BYTES + ENTRY_BYTES * count + 16)
        if need <= first:
            return head[:need].copy()
        return tensor[off:off + need].cpu().numpy()

    def _scatter(self, buf, tensor, slot: int, slot_bytes: int, table) -> None:
        off = slot * slot_bytes
        if tensor is None:
            base = buf.addr + off
            host_memmove(base + table.offsets, table.dst_addrs, table.lengths)
            return
        snap = self.exposed.snapshot()
        idx, _ = self.exposed.locate(table.dst_addrs, table.lengths)
        dst_dev = snap.devices[idx]
        on_host = dst_dev < 0
        if on_host.any():
            # GPU landing slot, host destination: bring the chunk over once, then memmove
            host = tensor[off:off + table.chunk_bytes].cpu()
            base = host.data_ptr()
            sel = np.nonzero(on_host)[0]
            host_memmove(base + table.offsets[sel], table.dst_addrs[sel], table.lengths[sel])
        sel = np.nonzero(~on_host)[0]
        if not sel.size:
            return
        landing = tensor.device.index
        lens = table.lengths[sel]
        dev_sel = dst_dev[sel]
        others = [d for d in np.unique(dev_sel).tolist() if d != landing]
        stream = self._stream(tensor.device)
        staged = []
        if others:
            # receive-side PXN: the chunk landed on the GPU next to the NIC; its pieces for other GPUs go over
            # NVLink in the same scatter launch (peer pointers as destinations)
            from pxn_kernels.peer_access import PeerAccessError, ensure_peer_access
            for d in others:
                try:
                    ensure_peer_access(landing, [d])
                except PeerAccessError:
                    staged.append(d)
            fwd = dev_sel != landing
            self.counters.add_many((("rx_forwarded", int(lens[fwd].sum())),
                                    ("rx_forwarded_items", int(fwd.sum()))))
        # large pieces (and pieces for GPUs without peer access, which the driver then stages through host memory):
        # one cudaMemcpyAsync each, the copy engine at link speed; the rest: one scatter launch
        stage = lens >= BIG_PIECE
        if staged:
            stage |= np.isin(dev_sel, staged)
        if stage.any():
            from transport.fabric.memory import memcpy_async
            base = tensor.data_ptr() + off
            for o, d, n in zip(table.offsets[sel][stage].tolist(), table.dst_addrs[sel][stage].tolist(),
                               lens[stage].tolist()):
                memcpy_async(d, base + o, n, stream)
            sel, lens = sel[~stage], lens[~stage]
            if not sel.size:
                stream.synchronize()
                return
        pinned, dev_buf = self._pinned(scatter_words(int(sel.size), tensor.device, int(lens.sum())),
                                       tensor.device)
        gpu_scatter(pinned, dev_buf, tensor[off:off + table.chunk_bytes], table.offsets[sel],
                    table.dst_addrs[sel].astype(np.int64), lens, stream)

    def _ack(self, st: SenderState, rail: int, k: int, status: int, reason: str, more: bool = False) -> None:
        """Ack the chunk in credit ``k``: the credit stays with the sender or goes back to the pool
        (``CreditDesk.settle``), and what that frees goes to waiting senders."""
        if st.retired:  # replaced while this chunk was handled: its credit region is not the sender's any more
            self.counters.add("rx_stale_chunks")
            return
        flags, grants = self.credit_desk.settle(st, rail, k, more)
        self.credit_desk.write(st, rail, k, status | flags, reason)
        if flags:
            with self._lock:
                st.returning[rail].discard(k)
        if grants:
            self.credit_desk.post_grants(grants)

    def close(self) -> None:
        """Free every sender's buffers and the pools. A receiver made with the engine's progress loop is closed
        after that loop (no chunk is being handled then); one with its own loop closes it first."""
        self._closed = True
        if self._own_progress:
            self._progress.close()
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
            self._by_rail_id.clear()
            for st in senders:
                st.retired = True
            pools = list(self._pools.values())
            self._pools.clear()
        for st in senders:
            self._free(st)
        for pool in pools:
            try:
                self.fabrics[pool.rail].deregister(pool.mr)
            except Exception:  # noqa: BLE001 — fabric may be closed already
                pass

    def landing_bytes_registered(self) -> int:
        """Bytes of landing memory this receiver holds (every pool), whatever the number of senders."""
        with self._lock:
            return sum(p.nbytes for p in self._pools.values())

    def stats(self) -> dict:
        with self._lock:
            landing = sorted({d for st in self._senders.values() for d in st.devices})
            return {"senders": len(self._senders), "landing_slots": self.landing_slots,
                    "slot_bytes": self.slot_bytes, "landing_devices": landing,
                    "landing_bytes": sum(p.nbytes for p in self._pools.values()),
                    "landing_pools": [p.stats() for p in self._pools.values()]}


class _Placed:
    """A chunk that passed ``Receiver._plan_landed``: where its items go (the fabric receives them there); once
    every byte is placed (``done``) it waits in its sender's ``placed`` for its RECV_IMM, which sends the ack."""

    __slots__ = ("rx", "st", "rail", "imm", "length", "dsts", "lens", "offs", "t0", "t1")

    def __init__(self, rx: Receiver, st: SenderState, rail: int, imm: int, length: int, dsts, lens, offs, t0: int):
        self.rx, self.st, self.rail, self.imm, self.length = rx, st, rail, imm, length
        self.dsts, self.lens, self.offs = dsts, lens, offs
        self.t0 = t0
        self.t1 = now_ns()

    def done(self) -> None:
        self.st.placed[(self.rail, self.imm)] = self
