"""An endpoint of a socket fabric: the sockets of one peer connection, the sequence numbers of each direction, the
sender's pending messages (``OutMsg``, with the records of the posted writes and batches they carry) and their
in-order completions, the target's in-order delivery of RECV_IMM events.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from typing import Dict, List, Optional

import numpy as np

from transport.errors import PeerLost, RegionError
from transport.fabric.base import Completion, Endpoint, Opcode, WriteBatch, WriteRequest
from transport.fabric.sockets import Sock
from transport.fabric.wire import MAX_MESSAGE_BYTES, PIECE_DT, STATUS_TEXT

log = logging.getLogger(__name__)


class WrRecord:
    """Sender-side state of one posted write (possibly cut into several pieces)."""

    __slots__ = ("wr_id", "opcode", "length", "imm", "remote_addr", "rkey", "error", "signaled")

    def __init__(self, r: WriteRequest):
        self.wr_id = r.wr_id
        self.signaled = r.signaled
        self.opcode = Opcode.WRITE if r.imm is None else Opcode.WRITE_WITH_IMM
        self.length = r.length
        self.imm = r.imm
        self.remote_addr = r.remote_addr
        self.rkey = r.rkey
        self.error: Optional[BaseException] = None


class OutMsg:
    """One WRITE message on the wire: its pieces and where each piece's bytes come from."""

    __slots__ = ("seq", "table", "recs", "last", "src", "statuses", "done", "posted_at", "batch", "final", "src_arr",
                 "pieces", "rows", "bufs", "whole", "on_acked")

    def __init__(self, seq: int):
        self.seq = seq
        self.posted_at = 0.0
        self.table: Optional[np.ndarray] = None
        self.recs: List[WrRecord] = []  # per piece
        self.last: List[bool] = []  # per piece: is this the write's final piece
        self.src: List[tuple] = []  # per piece: (local_addr, length, device)
        self.statuses: Optional[bytes] = None
        self.done = False
        self.batch: Optional[BatchRecord] = None  # a message carrying (part of) a WriteBatch: recs/last unused
        self.final = False  # the batch's last message
        self.src_arr: Optional[np.ndarray] = None  # batch messages: ``src`` as int64 rows
        self.pieces = 0  # pieces of a message without a table (a batch the posting thread completes itself)
        self.rows: Optional[bytes] = None  # a WriteRows message: its table as wire bytes (``table`` stays None) ...
        self.bufs: Optional[list] = None  # ... and its payload as buffers of host memory, in order
        self.whole = False  # a GatherWrite: one whole write, ``table`` its one row and ``bufs`` its payload
        self.on_acked = None  # a WriteRows message: its request's ``on_acked``

    def source_array(self) -> np.ndarray:
        """``src`` as an int64 array of rows (local_addr, length, device)."""
        if self.src_arr is not None:
            return self.src_arr
        if not self.src:
            return np.empty((0, 3), dtype=np.int64)
        return np.array(self.src, dtype=np.int64).reshape(-1, 3)

    def sources(self) -> List[tuple]:
        """``src`` as (local_addr, length, device) tuples."""
        if self.src_arr is not None and not self.src:
            self.src = [tuple(r) for r in self.src_arr.tolist()]
        return self.src

    def completions(self, peer_id: str, cause: Optional[BaseException] = None) -> List[Completion]:
        """What this message completes once the peer acked it (``statuses`` set) or, with ``cause``, once it is
        lost: per write whose final piece it carries (unsignaled successes stay silent), or for a batch one
        completion, at its first failing message or its last."""
        st = self.statuses
        if self.batch is not None:
            b = self.batch
            if b.reported:
                return []
            if cause is not None and b.error is None:
                b.error = cause
            elif st is not None and b.error is None and st.count(0) != len(st):  # any(st) steps per byte
                arr = np.frombuffer(st, dtype=np.uint8)
                i = int(np.flatnonzero(arr)[0])
                t = self.table if self.table is not None else np.frombuffer(self.rows, dtype=PIECE_DT)
                b.error = RegionError(
                    f"peer {peer_id} refused write {int(t['wlen'][i])} B at 0x{int(t['waddr'][i]):x} rkey "
                    f"0x{int(t['rkey'][i]):x} of batch wr_id={b.wr_id}: {STATUS_TEXT.get(int(arr[i]), int(arr[i]))}")
            if b.error is None and not self.final:
                return []
            b.reported = True
            return [Completion(b.wr_id, Opcode.WRITE, peer_id, b.length, None, b.error)]
        out = []
        for i, (rec, last) in enumerate(zip(self.recs, self.last)):
            if rec.error is None:
                if cause is not None:
                    rec.error = cause
                elif st is not None and st[i]:
                    rec.error = RegionError(
                        f"peer {peer_id} refused wr_id={rec.wr_id}: {rec.length} B at 0x{rec.remote_addr:x} rkey "
                        f"0x{rec.rkey:x}: {STATUS_TEXT.get(st[i], st[i])}")
            if last and (rec.signaled or rec.error is not None):
                out.append(Completion(rec.wr_id, rec.opcode, peer_id, rec.length, rec.imm, rec.error))
        return out

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else self.pieces

    @property
    def nbytes(self) -> int:
        """Payload bytes of the message (a message without a table carries its whole batch)."""
        return int(self.table["len"].sum()) if self.table is not None else self.batch.length


class BatchRecord:
    """Sender-side state of one posted ``WriteBatch`` (its messages share it)."""

    __slots__ = ("wr_id", "length", "error", "reported")

    def __init__(self, b: WriteBatch):
        self.wr_id = b.wr_id
        self.length = b.nbytes
        self.error: Optional[BaseException] = None
        self.reported = False


class SocketEndpoint(Endpoint):
    """A connection to one peer: ``n`` sockets striped, one sequence space per direction."""

    alive: bool = True  # ``Endpoint.alive`` as a plain attribute (set in ``__init__``, cleared on failure)

    def __init__(self, fabric, peer_id: str, socks: List[socket.socket]):
        self.fabric = fabric
        self.peer_id = peer_id
        self.socks = [Sock(s, i) for i, s in enumerate(socks)]
        self._lock = threading.Lock()
        self._out_seq = 0
        self._out_local = 0  # keys of messages completed without the peer: -1, -2, ...
        self._pending: "collections.OrderedDict[int, OutMsg]" = collections.OrderedDict()
        self._rr = 0
        self._small = 0  # index of the socket small messages go to (``enqueue_one``)
        self._in_lock = threading.Lock()
        self._in_next = 0
        self._in_done: Dict[int, List[Completion]] = {}
        # True until the link failed (``fail``): a plain attribute, read once per message; only ``fail`` clears it
        self.alive = True
        self._cause: Optional[str] = None
        self.max_payload = MAX_MESSAGE_BYTES  # payload bytes of one incoming message (the peer's message_bytes)

    def __repr__(self):
        return f"{type(self).__name__}({self.peer_id!r}, sockets={len(self.socks)}, alive={self.alive})"

    def start(self) -> None:
        """Start serving the sockets (``SocketFabric.start_endpoint``: threads of their own, or the tcp fabric's
        I/O threads)."""
        self.fabric.start_endpoint(self)

    def busy(self) -> bool:
        """A thread may still use one of the sockets (``Sock.busy``): they must stay open."""
        return any(s.busy() for s in self.socks)

    def abort(self) -> None:
        """Break every socket of this endpoint abruptly (RST); pending work fails with ``PeerLost``."""
        for s in self.socks:
            try:
                s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.fail("aborted locally")

    def fail(self, cause: str) -> None:
        """Mark the endpoint dead, wake its threads, and fail every pending write with ``PeerLost``."""
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            self._cause = cause
            pending = list(self._pending.values())
            self._pending.clear()
        # INFO: the engine above says once, per peer, what the loss cost (``transport.peers``)
        log.info("%s: connection to %s lost (%s); failing %d pending message(s)", self.fabric.local_id,
                 self.peer_id, cause, len(pending))
        for s in self.socks:
            with s.cv:
                s.closed = True
                s.cv.notify_all()
            with s.grant_cv:
                s.grant_cv.notify_all()
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        out = []
        for m in pending:
            out.extend(m.completions(self.peer_id, PeerLost(
                f"peer {self.peer_id} lost ({cause}) before message {m.seq} ({len(m)} piece(s), {m.nbytes} B) was "
                f"acknowledged")))
        self.fabric.push_completions(out)

    def close_sockets(self) -> None:
        for s in self.socks:
            try:
                s.sock.close()
            except OSError:
                pass

    def oldest_pending(self):
        """The oldest message still waiting for its ack (the watchdog's ``ack_timeout`` check), or None: none
        pending, or the endpoint failed."""
        with self._lock:
            return next(iter(self._pending.values()), None) if self.alive else None

    def check_alive(self) -> None:
        if not self.alive:
            raise PeerLost(f"endpoint {self.peer_id} is dead ({self._cause}); reconnect first")

    # --- sender side ----------------------------------------------------------------------------------------
    def enqueue(self, msgs: List[OutMsg], queue: bool = True, local: Optional[List[bool]] = None) -> List[Sock]:
        """Register ``msgs`` as pending and hand them to the sockets round-robin (under one lock: seq order).
        ``queue=False``: only register them; the caller transmits each on the socket returned for it.
        ``local[i]``: message i never reaches the peer (the caller completes it with ``on_ack``): it gets a negative
        key instead of a sequence number, so the peer, which delivers in sequence order, waits for no gap, while
        its completion still waits for every message posted before it."""
        out = []
        with self._lock:
            self.check_alive()
            n = len(self.socks)
            for i, m in enumerate(msgs):
                if local is not None and local[i]:
                    self._out_local -= 1
                    m.seq = self._out_local
                else:
                    m.seq = self._out_seq
                    self._out_seq += 1
                m.posted_at = time.monotonic()
                self._pending[m.seq] = m
                s = self.socks[self._rr % n]
                self._rr += 1
                out.append(s)
                if queue:
                    with s.cv:
                        s.data.append(m)
                        s.wake()
        return out

    def enqueue_one(self, m: OutMsg, reader: bool = False) -> Sock:
        """``enqueue([m], queue=False)``: register one message as pending and return the socket to send it on
        (the poster's inline send of a small message, ``TcpPoster.post_rows``). Small messages keep to one socket
        (``_small``) while it serves: a sender of one small batch after another then meets the same receive thread
        at the peer, still awake from the last one (``recv_spin``), and the same caches. ``reader``: the poster
        will wait for the ack and read it itself, so a socket whose reader token another waiting caller holds is
        passed over when another's is free. ``small_busy`` moves the choice on when the socket was busy."""
        with self._lock:
            if not self.alive:
                self.check_alive()
            m.seq = seq = self._out_seq
            self._out_seq = seq + 1
            m.posted_at = time.monotonic()
            self._pending[seq] = m
            socks = self.socks
            s = socks[self._small]
            if reader and s.reader.locked():
                for t in socks:
                    if not t.reader.locked():
                        s = t
                        break
        return s

    def queue_socket(self, s: Sock, q: collections.deque, cv: threading.Condition) -> None:
        """``s.wake`` of this endpoint's socket ``s`` when a pool of sender threads serves it (``tcp_io.TcpIo``
        binds it with its queue ``q`` and condition ``cv``): called under ``s.cv`` once something was queued on
        ``s``, it puts (this endpoint, ``s``) at the back of the pool's queue and wakes a sender, unless ``s`` is
        queued already or closed."""
        if s.queued or s.closed:
            return
        s.queued = True
        with cv:
            q.append((self, s))
            cv.notify()

    def small_busy(self, s: Sock) -> None:
        """The small message just given socket ``s`` had to wait for it (its sender thread was sending): the next
        small message tries the next socket."""
        socks = self.socks
        if socks[self._small] is s:
            self._small = (s.index + 1) % len(socks)

    def reserve(self, sock: Optional[Sock] = None) -> tuple:
        """(socket, sequence number) for a message that gets no pending record (an unacked write): the peer
        delivers its RECV_IMM in sequence order like any message's. ``sock``: send it there (else round-robin)."""
        with self._lock:
            self.check_alive()
            seq = self._out_seq
            self._out_seq += 1
            if sock is None:
                sock = self.socks[self._rr % len(self.socks)]
                self._rr += 1
            return sock, seq

    def on_ack(self, seq: int, statuses: bytes) -> None:
        """Record an ack and release completions of every message acked so far, in sequence order. A message with
        ``on_acked`` (a ``WriteRows``) that is the only one released, every piece placed, is completed by that
        callable instead: no ``Completion`` and no trip through the completion handler."""
        out = []
        with self._lock:
            m = self._pending.get(seq)
            if m is None:
                return
            if len(statuses) != len(m):
                raise ValueError(f"ack of message {seq} carries {len(statuses)} statuses for {len(m)} pieces")
            m.statuses = statuses
            m.done = True
            pending = self._pending
            if m.on_acked is not None and next(iter(pending)) == seq and statuses.count(0) == len(statuses):
                del pending[seq]
                if not pending or not next(iter(pending.values())).done:
                    out = None
                else:  # later messages complete with it: all of them in order, as completions
                    out.extend(m.completions(self.peer_id))
            while out is not None and pending:
                first = next(iter(pending.values()))
                if not first.done:
                    break
                del pending[first.seq]
                out.extend(first.completions(self.peer_id))
        if out is None:
            if m.on_acked():
                return
            out = m.completions(self.peer_id)
        self.fabric.push_completions(out)

    # --- target side ----------------------------------------------------------------------------------------
    def deliver_in_order(self, seq: int, events: List[Completion]) -> None:
        """Release RECV_IMM events of message ``seq`` once every earlier message of this endpoint has landed."""
        with self._in_lock:
            if seq == self._in_next and not self._in_done:  # the usual case: the next message, nothing waiting
                self._in_next = seq + 1
                out = events
            else:
                out = []
                self._in_done[seq] = events
                while self._in_next in self._in_done:
                    out.extend(self._in_done.pop(self._in_next))
                    self._in_next += 1
        if out:
            self.fabric.push_completions(out)

    def send_ctrl(self, s: Sock, payload: bytes) -> None:
        with s.cv:
            if s.closed:
                return
            s.ctrl.append(payload)
            s.wake()
