"""TCP fabric: one-sided writes over real sockets, the fallback for machines without RDMA and the CI stand-in.

Wire protocol (little-endian), per socket, in both directions:

* First the shared-secret challenge-response of ``transport.auth`` (nothing else is read or answered before it),
  then HELLO / HELLO_ACK (JSON body), so that the accepting side builds the symmetric endpoint. Each incoming
  connection authenticates in its own thread within ``handshake_timeout`` (``transport.auth.Gate``), so idle
  sockets cannot hold the listener, and the listener survives running out of file descriptors.
* Every frame after the handshake (HELLO included) carries in its header a 16-byte tag under the connection's
  session key (``transport.auth.Session``) over an implicit per-socket, per-direction sequence number, the header
  and the piece table (the whole body for ACK and control messages); the payload is not covered, it only lands
  inside the regions the checked table names. A wrong tag fails the endpoint before anything is acted on.
* WRITE: a 48-byte header (32 bytes of fields, the tag), a table of ``count`` 48-byte piece descriptors, then the pieces' payloads back to
  back. One message carries many writes (4 KB writes cost one table row, not one syscall each), and a large
  write is cut into pieces spread over the peer's sockets (striping). Every piece carries the bounds of its
  *whole* write, so all pieces of a write are accepted or refused together. A message with header flag
  ``H_WHOLE`` carries exactly one whole write (a ``GatherWrite``: a relay chunk sent from its header in the slot
  and its pieces' sources) and may exceed the sender's message size, up to ``MAX_WHOLE``.
* ACK: header + one status byte per piece; the sender reports completions only from acks, i.e. after the bytes
  are placed at the target. A WRITE with header flag ``H_NOACK`` (an unacked write, ``WriteRequest.acked`` False:
  one small write, a receiver's ack of a chunk) is not acknowledged; its sender keeps no record of it.

The target validates every piece (rkey known, whole write inside that region) before placing anything; a refused
piece's payload is read and discarded, so nothing outside a registered region is ever written. Host pieces are
received straight into the destination (``recv_into`` a memoryview on the raw address, no extra copy); GPU pieces
land in a host staging buffer and are copied to the device by torch. A whole write with an immediate into a region
with a landing handler (``set_landing_handler``: a receiver's landing slots) is read as far as the handler asks
(a chunk's header and table), and the byte ranges the handler then names go straight to their destinations.

Ordering: messages of one endpoint carry a sequence number across all its sockets; the sender releases
completions and the target releases RECV_IMM events in sequence order, so a RECV_IMM means that every write
posted before it on that endpoint has landed, as on an RDMA RC queue pair.

Every length on the wire is bounded before anything is allocated for it: piece tables by ``MAX_TABLE``, a
message's payload by the sender's ``message_bytes`` (from its hello), acks by the pieces of the acked message,
HELLO bodies by ``MAX_HELLO``.

Threads: one listener per fabric (one short-lived thread per connection while it authenticates); per socket one receiver thread (never blocks on sending) and one sender thread
(owns all sends on the socket, control messages first), which rules out the cross-peer deadlock where both
sides block sending while nobody drains.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
import uuid
from hmac import compare_digest
from itertools import islice, repeat
from operator import add, eq, le, sub
from typing import Dict, List, Optional, Sequence

import numpy as np

from transport import auth
from transport.arrays import distinct
from transport.errors import ConfigError, FabricClosed, FabricError, PeerLost, RegionError, UnknownPeer
from transport.fabric.base import (
    DEVICE_HOST, IMM_MAX, Capabilities, Completion, CompletionQueue, Endpoint, Fabric, GatherWrite, MemoryRegion,
    Opcode, WriteBatch, WriteRequest, WriteRows, check_range,
)
from transport.fabric.memory import (BIG_GPU_PIECE, check_device, cuda_stream, device_scratch, gpu_batch_copy,
                                     memcpy_async, pinned_buffer, raw_view)
from transport.fabric.spin import AdaptiveSpin

log = logging.getLogger(__name__)

MAGIC = b"PXNT"
T_HELLO, T_HELLO_ACK, T_WRITE, T_ACK, T_REQ, T_GRANT, T_DONE, T_NOTIFY = 1, 2, 3, 4, 5, 6, 7, 8
# magic, type, flags, reserved, count, seq, body bytes (table/JSON + payload), then the 16-byte tag (packed as zeros;
# ``_seal`` fills it at send time, when the frame's place in the socket's sequence is known)
HDR = struct.Struct("<4sBBHIQQ4x16x")
assert HDR.size == 48
_TABLE_TYPES = frozenset((3, 5, 8))  # WRITE, REQ, NOTIFY: the tag covers the piece table, not what follows it
_TCB = struct.Struct("<4xB3xI8xQ")  # type, count, body bytes of a frame header
_SEQ = struct.Struct("<Q")
_NO_TAG = bytes(16)


def _seal(sess, buf):
    """``buf`` (one or more frames back to back, each header and what its tag covers inside it; the last one's
    payload may follow in other buffers) with every frame's tag filled in, in order, under ``sess`` (None: ``buf``
    as is). Call it where the frames go out, under the socket's send lock: each tag takes the next sequence
    number. A tag is keyed BLAKE2b over the sequence number, then the header with its tag field zero (as packed)
    and the covered bytes, which follow it: one contiguous range."""
    if sess is None:
        return buf
    typ, count, blen = _TCB.unpack_from(buf, 0)
    end = 48 + (count * 48 if typ in _TABLE_TYPES else blen)
    n = len(buf)
    if n <= 48 + blen:  # one frame (the usual case): hashed in place, copied once with its tag
        if end > n:
            raise AssertionError(f"frame of type {typ}: its covered bytes end at {end}, past the buffer {n}")
        h = sess._tx.copy()
        h.update(_SEQ.pack(sess.tx_n))
        sess.tx_n += 1
        h.update(buf if end == n else memoryview(buf)[:end])
        return b"".join((buf[:32], h.digest(), buf[48:]))
    b = bytearray(buf)
    off = 0
    while off + 48 <= n:
        typ, count, blen = _TCB.unpack_from(b, off)
        end = off + 48 + (count * 48 if typ in _TABLE_TYPES else blen)
        if end > n:
            raise AssertionError(f"frame of type {typ} at {off}: its covered bytes end at {end}, past the buffer {n}")
        h = sess._tx.copy()
        h.update(_SEQ.pack(sess.tx_n))
        sess.tx_n += 1
        h.update(memoryview(b)[off:end])
        b[off + 32:off + 48] = h.digest()
        off += 48 + blen
    return b


def _frame_check(sess, hdr, body) -> None:
    """Check a whole received frame (``hdr`` 48 bytes, ``body`` what its tag covers); raises AuthError."""
    if sess is not None:
        sess.check(hdr[32:48], hdr[:32], _NO_TAG, body)


def _keyed(sock):
    sess = auth.session_of(sock)
    return sess if sess is not None and sess.keyed else None
PIECE_DT = np.dtype([("addr", "<u8"), ("len", "<u8"), ("waddr", "<u8"), ("wlen", "<u8"),
                     ("rkey", "<u4"), ("flags", "<u4"), ("imm", "<u4"), ("wr", "<u4")])
assert PIECE_DT.itemsize == 48
F_IMM = 1
# header flag of a WRITE message that carries one whole write (a ``GatherWrite``, i.e. a relay chunk): its payload may
# exceed the sender's message size, up to MAX_WHOLE bytes, since it goes into one registered region (or is discarded
# through the fixed staging buffer) and nothing is allocated for it
H_WHOLE = 1
MAX_WHOLE = 64 << 20
# header flag of a WRITE message the target does not acknowledge (``WriteRequest.acked`` False): its sender keeps no
# pending record and reports no completion for it, so an ACK would only cost a send and a receive on each side
H_NOACK = 2
# payload bytes of an unacked write at most; larger ones go as acknowledged writes (the target receives unacked ones
# in one piece, as a small message)
UNACKED_MAX = 4096
_ROW = struct.Struct("<QQQQIIII")  # one PIECE_DT row
_EPOLLIN = getattr(select, "EPOLLIN", 1)

ST_OK, ST_BAD_RKEY, ST_BOUNDS, ST_FAILED = 0, 1, 2, 3
_STATUS_TEXT = {ST_BAD_RKEY: "rkey unknown to the target", ST_BOUNDS: "range outside the target's region",
                ST_FAILED: "target failed to place the bytes"}

# Pieces under this size are received into a staging run and scattered by memmove: one recv per run instead of
# one syscall per 64 B piece.
SMALL_PIECE = 32 << 10
# A WRITE message of at most this many bytes (table and payload) is received in one piece into the staging buffer
# and placed from there (``_on_small_write``): one receive and no numpy call, where the bytes copied once more
# cost less than the steps saved.
SMALL_MESSAGE = 64 << 10
MAX_TABLE = 1 << 16  # pieces per message; a peer claiming more is broken or hostile
# A post of one message at most this large (pieces, bytes on the wire) is sent by the posting thread itself when
# its socket is idle; larger ones go to the sender threads, which stream them over every socket in parallel.
INLINE_PIECES = 256
INLINE_BYTES = 64 << 10
_VECTOR_MIN = 16  # posts of more writes than this are checked and framed by numpy, not one write at a time
_I64 = (1 << 63) - 1
_LAYOUTS_KEPT = 64  # batch layouts over several local regions whose checks a fabric remembers (_remember_layout)
# seconds a thread reads its socket without sleeping before it blocks, at most (``AdaptiveSpin`` keeps it on only
# while it pays): a waiting caller for its small batch's ack (``ack_spin``), a receive thread for the next message
# (``recv_spin``)
SPIN = 150e-6
MAX_HELLO = 1 << 16  # bytes of a HELLO body
MAX_MESSAGE_BYTES = 1 << 30  # largest message_bytes a peer may announce
MAX_CTRL_BODY = 1 << 20  # bytes of a control message body beyond its per-piece statuses (an ipc GRANT's JSON)

def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOF raises ``ConnectionError``."""
    while len(view):
        n = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        view = view[n:]


def recv_views(rx, views: List[memoryview]) -> None:
    """Fill every view of ``views`` in order from ``rx`` (a socket, or an ``_Rx`` whose look-ahead bytes go first):
    scattered receives (``recvmsg_into``, up to 1000 buffers a call) instead of one call per view."""
    i, n = 0, len(views)
    while i < n and isinstance(rx, _Rx) and rx.end > rx.pos:  # bytes already read ahead
        recv_exact(rx, views[i])
        i += 1
    sock = rx.sock if isinstance(rx, _Rx) else rx
    while i < n:
        batch = views[i:i + 1000]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        if got == sum(map(len, batch)):  # the usual case: every view filled (one C loop, not a step per view)
            i += len(batch)
            continue
        for v in batch:  # a short receive (a signal, a huge batch): finish the view it stopped in, go on after it
            if got >= len(v):
                got -= len(v)
                i += 1
                continue
            recv_exact(sock, v[got:])
            i += 1
            break


def send_buffers(sock: socket.socket, bufs: List) -> None:
    """Send every buffer in order with gathered ``sendmsg`` calls (at most IOV_MAX buffers per call)."""
    i = 0
    while i < len(bufs):
        batch = bufs[i:i + 1000]
        sent = sock.sendmsg(batch)
        total = sum(len(b) for b in batch)
        if sent == total:
            i += len(batch)
            continue
        # Partial send (signal / tiny buffers): skip what went out and continue from inside the buffer.
        for j, b in enumerate(batch):
            if sent >= len(b):
                sent -= len(b)
                continue
            bufs = [memoryview(b)[sent:]] + batch[j + 1:] + bufs[i + len(batch):]
            i = 0
            break


class _Rx:
    """A socket read through a look-ahead buffer: a header read takes whatever the kernel holds (a small message
    that arrived in one piece: one receive for its header and body instead of one per field); every other read
    goes straight into its destination once the buffered bytes are used up: a large payload read ahead in
    buffer-sized steps would be copied twice, through the buffer. Offers ``recv_into`` as a socket does, for
    ``recv_exact``."""

    __slots__ = ("sock", "buf", "view", "pos", "end")
    AHEAD = 32  # reads of at most this many bytes (a message header) fill the buffer; longer ones skip it

    def __init__(self, sock: socket.socket, size: int):
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0

    def recv_into(self, view, nbytes: int = 0, flags: int = 0) -> int:
        n = nbytes or len(view)
        have = self.end - self.pos
        if have:
            k = have if have < n else n
            view[:k] = self.view[self.pos:self.pos + k]
            self.pos += k
            return k
        if n > self.AHEAD:
            return self.sock.recv_into(view, n, flags)
        got = self.sock.recv_into(self.buf)
        k = got if got < n else n
        view[:k] = self.view[:k]
        self.pos, self.end = k, got
        return k

    def ready(self) -> bool:
        """True when a message's first bytes are here: in the buffer, or taken from the socket by one receive that
        does not wait. Raises ConnectionError at EOF."""
        if self.end > self.pos:
            return True
        try:
            got = self.sock.recv_into(self.buf, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        if got == 0:
            raise ConnectionError("connection closed by peer")
        self.pos, self.end = 0, got
        return True

    def unpack(self, st: struct.Struct) -> tuple:
        """The next ``st.size`` bytes (a message header) unpacked by ``st``, read from the look-ahead buffer, which
        one receive of whatever the kernel holds refills when it runs short: no copy out of the buffer."""
        pos, size = self.pos, st.size
        if self.end - pos < size:
            have = self.end - pos
            if have:
                self.buf[:have] = self.buf[pos:self.end]
            pos = 0
            while have < size:
                got = self.sock.recv_into(self.view[have:])
                if got == 0:
                    raise ConnectionError("connection closed by peer")
                have += got
            self.end = have
        self.pos = pos + size
        return st.unpack_from(self.buf, pos)

    def take(self, n: int, stage: memoryview) -> memoryview:
        """The next ``n`` bytes: a view into the buffer when they are all there (valid until the next read), else
        read into ``stage``."""
        if self.end - self.pos >= n:
            self.pos += n
            return self.view[self.pos - n:self.pos]
        recv_exact(self, stage[:n])
        return stage[:n]


_ROW = struct.Struct("<QQQQIIII")  # one row of PIECE_DT
_TABLES: Dict[int, struct.Struct] = {}


def _table_struct(count: int) -> struct.Struct:
    """A ``struct.Struct`` of ``count`` rows of PIECE_DT (cached: small messages have at most
    ``SMALL_MESSAGE // PIECE_DT.itemsize`` rows)."""
    t = _TABLES.get(count)
    if t is None:
        t = _TABLES[count] = struct.Struct("<" + "QQQQIIII" * count)
    return t


assert _ROW.size == PIECE_DT.itemsize


class _WrRecord:
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


class _OutMsg:
    """One WRITE message on the wire: its pieces and where each piece's bytes come from."""

    __slots__ = ("seq", "table", "recs", "last", "src", "statuses", "done", "posted_at", "batch", "final", "src_arr",
                 "pieces", "rows", "bufs", "whole", "on_acked")

    def __init__(self, seq: int):
        self.seq = seq
        self.posted_at = 0.0
        self.table: Optional[np.ndarray] = None
        self.recs: List[_WrRecord] = []  # per piece
        self.last: List[bool] = []  # per piece: is this the write's final piece
        self.src: List[tuple] = []  # per piece: (local_addr, length, device)
        self.statuses: Optional[bytes] = None
        self.done = False
        self.batch: Optional[_BatchRecord] = None  # a message carrying (part of) a WriteBatch: recs/last unused
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
                    f"0x{int(t['rkey'][i]):x} of batch wr_id={b.wr_id}: {_STATUS_TEXT.get(int(arr[i]), int(arr[i]))}")
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
                        f"0x{rec.rkey:x}: {_STATUS_TEXT.get(st[i], st[i])}")
            if last and (rec.signaled or rec.error is not None):
                out.append(Completion(rec.wr_id, rec.opcode, peer_id, rec.length, rec.imm, rec.error))
        return out

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else self.pieces

    @property
    def nbytes(self) -> int:
        """Payload bytes of the message (a message without a table carries its whole batch)."""
        return int(self.table["len"].sum()) if self.table is not None else self.batch.length


class _BatchRecord:
    """Sender-side state of one posted ``WriteBatch`` (its messages share it)."""

    __slots__ = ("wr_id", "length", "error", "reported")

    def __init__(self, b: WriteBatch):
        self.wr_id = b.wr_id
        self.length = b.nbytes
        self.error: Optional[BaseException] = None
        self.reported = False


class _Sock:
    """One socket of an endpoint with its sender queue."""

    def __init__(self, sock: socket.socket, index: int):
        self.sock = sock
        self.index = index
        self.cv = threading.Condition()
        self.ctrl: collections.deque = collections.deque()  # small control messages, sent first
        self.data: collections.deque = collections.deque()  # _OutMsg
        self.closed = False
        self.threads: List[threading.Thread] = []
        # ipc uses these to hand a GRANT from the receiver thread to the waiting sender thread
        self.grant_cv = threading.Condition()
        self.grants: Dict[int, tuple] = {}
        self.send_lock = threading.Lock()  # ipc sends small messages from several threads
        # tcp: held while one message's bytes go out, by the sender thread or by a thread that sends a small message
        # itself while no other is sending (``TcpFabric._send_now``), so that two messages never interleave
        self.wire_lock = threading.Lock()
        self.granted: Dict[int, tuple] = {}  # ipc target: seq -> (table, statuses, pinned) until DONE
        self.tx_cache: dict = {}  # sender thread's pinned / device staging buffers and CUDA streams
        # tcp, shared reading (``TcpFabric._recv_loop``): whoever holds ``reader`` reads the socket, through the
        # receive thread's state ``rx_state``; ``poller`` is that thread's epoll set (None once it ended)
        self.reader = threading.Lock()
        self.rx_state: Optional[dict] = None
        self.poller = None
        self.fd = sock.fileno()
        self.sess = _keyed(sock)  # the connection's tags (None without a secret)
        self.want_shared = False  # a caller asked for shared reading (the receive thread switches after a message)
        self.own_reads = 0  # acks of small batches their waiting callers read themselves (counted under ``reader``)
        self.spin: Optional[AdaptiveSpin] = None  # the receive thread's spin while it reads blocking (``recv_spin``)


class TcpEndpoint(Endpoint):
    """A connection to one peer: ``n`` sockets striped, one sequence space per direction."""

    def __init__(self, fabric: "TcpFabric", peer_id: str, socks: List[socket.socket]):
        self.fabric = fabric
        self.peer_id = peer_id
        self.socks = [_Sock(s, i) for i, s in enumerate(socks)]
        self._lock = threading.Lock()
        self._out_seq = 0
        self._out_local = 0  # keys of messages completed without the peer: -1, -2, ...
        self._pending: "collections.OrderedDict[int, _OutMsg]" = collections.OrderedDict()
        self._rr = 0
        self._small = 0  # index of the socket small messages go to (``enqueue_one``)
        self._in_lock = threading.Lock()
        self._in_next = 0
        self._in_done: Dict[int, List[Completion]] = {}
        self._alive = True
        self._cause: Optional[str] = None
        self.max_payload = MAX_MESSAGE_BYTES  # payload bytes of one incoming message (the peer's message_bytes)

    @property
    def alive(self) -> bool:
        return self._alive

    def __repr__(self):
        return f"TcpEndpoint({self.peer_id!r}, sockets={len(self.socks)}, alive={self._alive})"

    def start(self) -> None:
        for s in self.socks:
            for fn, role in ((self.fabric._recv_loop, "recv"), (self.fabric._send_loop, "send")):
                t = threading.Thread(target=fn, args=(self, s), daemon=True,
                                     name=f"pxn-{self.fabric.name}-{role}-{self.peer_id}-{s.index}")
                s.threads.append(t)
                t.start()

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
            if not self._alive:
                return
            self._alive = False
            self._cause = cause
            pending = list(self._pending.values())
            self._pending.clear()
        log.log(logging.WARNING if pending else logging.INFO,
                "%s: connection to %s lost (%s); failing %d pending message(s)",
                self.fabric.local_id, self.peer_id, cause, len(pending))
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
        self.fabric._push(out)

    def close_sockets(self) -> None:
        for s in self.socks:
            try:
                s.sock.close()
            except OSError:
                pass

    def check_alive(self) -> None:
        if not self._alive:
            raise PeerLost(f"endpoint {self.peer_id} is dead ({self._cause}); reconnect first")

    # --- sender side ----------------------------------------------------------------------------------------
    def enqueue(self, msgs: List[_OutMsg], queue: bool = True, local: Optional[List[bool]] = None) -> List[_Sock]:
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
                        s.cv.notify()
        return out

    def enqueue_one(self, m: _OutMsg, reader: bool = False) -> _Sock:
        """``enqueue([m], queue=False)``: register one message as pending and return the socket to send it on
        (the poster's inline send of a small message, ``TcpFabric._post_rows``). Small messages keep to one socket
        (``_small``) while it serves: a sender of one small batch after another then meets the same receive thread
        at the peer, still awake from the last one (``recv_spin``), and the same caches. ``reader``: the poster
        will wait for the ack and read it itself, so a socket whose reader token another waiting caller holds is
        passed over when another's is free. ``small_busy`` moves the choice on when the socket was busy."""
        with self._lock:
            if not self._alive:
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

    def small_busy(self, s: _Sock) -> None:
        """The small message just given socket ``s`` had to wait for it (its sender thread was sending): the next
        small message tries the next socket."""
        socks = self.socks
        if socks[self._small] is s:
            self._small = (s.index + 1) % len(socks)

    def reserve(self, sock: Optional[_Sock] = None) -> tuple:
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
        self.fabric._push(out)

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
            self.fabric._push(out)

    def send_ctrl(self, s: _Sock, payload: bytes) -> None:
        with s.cv:
            if s.closed:
                return
            s.ctrl.append(payload)
            s.cv.notify()


class TcpFabric(Fabric):
    """One-sided writes over TCP sockets.

    Options: ``hostname`` to bind (default 127.0.0.1), ``port`` (0 = ephemeral), ``connections_per_peer``
    (sockets striped per endpoint, default 2..4 by core count), ``message_bytes`` (target payload bytes per wire message,
    default 4 MiB: big enough to amortise the per-message Python cost, small enough to spread one 64 MB write
    over every socket), ``connect_timeout`` (seconds), ``keepalive`` (seconds of silence before a vanished
    host is declared dead via TCP keepalive / TCP_USER_TIMEOUT, default 3), ``ack_timeout`` (seconds the oldest
    pending message may wait for its ack before the endpoint is failed, default 30: catches a peer process that
    hangs while its kernel keeps the TCP connection up), ``secret`` (shared secret of ``transport.auth``, at least
    16 bytes; None: ``PXN_SECRET``, else the per-user secret file on a loopback ``hostname``; elsewhere
    ``insecure`` must be set), ``insecure`` (run without a secret when none is set; None: ``PXN_INSECURE``),
    ``handshake_timeout`` (seconds an incoming connection has
    to authenticate and say hello, default 5), ``guard_claims`` (the engine's mode: an incoming connection is
    taken only for a peer id announced by ``expect_peer``, and never replaces a live endpoint of that id unless
    announced again), ``max_peers_per_addr`` (live incoming endpoints per source address, default 256),
    ``own_acks`` (default True: a thread that posted a small ``WriteRows`` with ``read_ack`` may read its ack from
    the socket itself, ``await_rows``; False: only the receive threads read), ``ack_spin`` (seconds such a thread
    keeps reading its socket without sleeping before it blocks in ``poll``, at most; default ``PXN_ACK_SPIN_US`` or
    ``SPIN``; 0: block at once), ``recv_spin`` (the same for a receive thread in blocking reads after it placed and
    acknowledged a small write, waiting for the next message; default ``PXN_RECV_SPIN_US`` or ``SPIN``). A spin saves the waiting thread's wake-up and
    the peer's cost of waking it where a core is free meanwhile, and costs the peer its core where none is
    (benchmarks/NOTES.md has both): each is an ``AdaptiveSpin``, on only while what it waits for comes within it
    and the waiting thread gets a core whenever it wants one.
    """

    name = "tcp"
    capabilities = Capabilities(selective_signaling=True, completion_callback=True, authenticated_rails=True,
                               write_batches=True, write_rows=True, gather_writes=True, landing_handlers=True,
                               unacked_writes=True)
    # 2 sockets per rail: enough to overlap send and receive, few threads on small CI boxes
    engine_options = {"connections_per_peer": 2}
    # a chunk whose pieces average at least this many bytes is sent as a GatherWrite and placed as it arrives; below
    # it the Python step per piece (a buffer on each side) costs more than the gather and scatter copies it saves
    # (benchmarks/NOTES.md, "Coalesced chunks on tcp without the host copies"), so such chunks are copied into
    # the slot and scattered from it
    gather_min_bytes = 16 << 10
    # a few small pieces go as rows of one message (placed by the receiving thread) rather than in a chunk, whose
    # gather, landing slot and ack each add a thread hand-off; many pieces still pay off as a chunk, whose table
    # the receiver checks and scatters in whole-array steps
    config_defaults = {"direct_pieces": 64}

    def __init__(self, hostname: str = "127.0.0.1", port: int = 0, connections_per_peer: Optional[int] = None,
                 message_bytes: int = 4 << 20, connect_timeout: float = 10.0, keepalive: float = 3.0,
                 ack_timeout: float = 30.0, secret=None, handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
                 guard_claims: bool = False, max_peers_per_addr: int = 256, own_acks: bool = True,
                 ack_spin: Optional[float] = None, recv_spin: Optional[float] = None,
                 insecure: Optional[bool] = None):
        if connections_per_peer is None:
            # loopback on a 2-core box peaks at 2 sockets (more threads only contend); bigger hosts use 4
            connections_per_peer = max(2, min(4, (os.cpu_count() or 2) // 2))
        if not isinstance(connections_per_peer, int) or not 1 <= connections_per_peer <= 64:
            raise ValueError(f"connections_per_peer must be an int in 1..64, got {connections_per_peer!r}")
        if not isinstance(message_bytes, int) or not 4096 <= message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"message_bytes must be an int in [4096, {MAX_MESSAGE_BYTES}], got {message_bytes!r}")
        self.connections_per_peer = connections_per_peer
        self.message_bytes = message_bytes
        self.connect_timeout = float(connect_timeout)
        self.keepalive = float(keepalive)
        self.ack_timeout = float(ack_timeout)
        self._secret = auth.resolve_secret(secret, hostname, insecure)
        self.guard_claims = bool(guard_claims)
        self.max_peers_per_addr = int(max_peers_per_addr)
        self._claims = auth.RailClaims(self.guard_claims)
        self._groups: Dict[str, dict] = {}  # connection id -> sockets of one incoming endpoint, still gathering
        self._group_cv = threading.Condition()
        self._closed = False
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._regions: Dict[int, MemoryRegion] = {}
        self._regions_gen = 0  # bumped whenever ``_regions`` changes: ``_remember_layout``'s entries hold its value
        self._local_layouts: Dict[bytes, tuple] = {}  # ``_remember_layout``: lkeys' bytes -> (counter, ...)
        # rkey -> (region, writable view of it) for host regions: small pieces are placed by slice assignment,
        # a C copy without the ctypes call (and GIL release) of a memmove per piece
        self._host_views: Dict[int, tuple] = {}
        self._region_use: Dict[int, int] = {}  # rkey -> pieces being placed right now (deregister waits)
        self._landing: Dict[int, object] = {}  # rkey -> landing handler (``set_landing_handler``)
        # per receiving thread: the ACK of a landed write whose RECV_IMM is being delivered, held so that an unacked
        # write its handler posts back to the same peer (a receiver's ack of the chunk) leaves in the same send
        self._held = threading.local()
        self._region_lock = threading.Lock()
        self._region_cv = threading.Condition(self._region_lock)  # ``with`` on the lock itself: no Python frame
        self._endpoints: Dict[str, TcpEndpoint] = {}
        self._all_eps: List[TcpEndpoint] = []
        self._cq = CompletionQueue()
        self._cuda_streams: Dict[int, object] = {}
        # a subclass that handles messages itself (ipc) keeps every message on its own ``_on_message``
        self._small_writes = type(self)._on_message is TcpFabric._on_message
        # unacked writes need the receiving side of ``_on_small_write`` (a subclass without it acks every write)
        self._unacked = self._small_writes and self.capabilities.unacked_writes
        # a caller waiting for a small batch it posted reads the ack itself (``await_rows``); False: receive threads
        # read every message, and block in ``recv`` rather than in epoll
        self._own_acks = self._small_writes and bool(own_acks) and hasattr(select, "epoll")
        spins = []
        for name, v, env in (("ack_spin", ack_spin, "PXN_ACK_SPIN_US"), ("recv_spin", recv_spin, "PXN_RECV_SPIN_US")):
            if v is None and os.environ.get(env):
                text = os.environ[env]
                try:
                    v = float(text) / 1e6
                except ValueError:
                    v = None
                if v is None or not 0.0 <= v <= 1.0:
                    raise ConfigError(f"environment variable {env}={text!r} is not microseconds in [0, 1000000]")
            elif v is None:
                v = SPIN
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"{name} must be seconds in [0, 1], got {v!r}")
            spins.append(float(v))
        self._spin, self._recv_spin = spins
        self._ack_spin = AdaptiveSpin(self._spin)  # one for every caller of this fabric: the acks come from peers
        # whose pace is the host's and the network's, the same for each caller
        try:
            self._listener = socket.create_server((hostname, port), backlog=128)
        except OSError as e:
            raise FabricError(f"{self.name}: cannot listen on {hostname}:{port}: {e}") from e
        self.hostname = hostname
        self.port = self._listener.getsockname()[1]
        self._id = f"{hostname}:{self.port}"
        self.gate = auth.Gate(f"{self.name} {self._id}", self._incoming, handshake_timeout=handshake_timeout)
        for key in ("refused_hello", "refused_claims"):  # authenticated, then refused: a bad hello, a claimed id
            self.gate.count(key, 0)
        self._listen_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"pxn-{self.name}-listen-{self.port}")
        self._listen_thread.start()
        self._watchdog = threading.Thread(target=self._watchdog_loop, daemon=True,
                                          name=f"pxn-{self.name}-watchdog-{self.port}")
        self._watchdog.start()
        log.debug("%s fabric listening on %s", self.name, self._id)

    # --- Fabric API -----------------------------------------------------------------------------------------
    @property
    def local_id(self) -> str:
        return self._id

    def _check_open(self) -> None:
        if self._closed:
            raise FabricClosed(f"{self.name} fabric {self._id} is closed")

    def register(self, addr: int, length: int, device: int = DEVICE_HOST) -> MemoryRegion:
        self._check_open()
        check_range(addr, length, "register")
        check_device(device)
        if addr == 0:
            raise ValueError("register: address 0 (NULL) cannot be registered")
        with self._lock:
            while True:
                key = secrets.randbits(32)
                # random keys: a stale rkey of a deregistered region is unlikely to match a new one
                if key and key not in self._regions:
                    break
            mr = MemoryRegion(addr=addr, length=length, lkey=key, rkey=key, device=device)
            self._regions[key] = mr
            self._regions_gen += 1
            if device == DEVICE_HOST:
                self._host_views[key] = (mr, raw_view(addr, length, writable=True))
        self._on_register(mr)
        return mr

    def _on_register(self, mr: MemoryRegion) -> None:
        """Hook for subclasses (ipc exports GPU handles)."""

    def deregister(self, mr: MemoryRegion) -> None:
        self._check_open()
        with self._lock:
            cur = self._regions.get(getattr(mr, "rkey", None))
            if cur is None or cur != mr:
                raise RegionError(f"deregister: region {mr!r} is not registered with {self._id}")
            del self._regions[mr.rkey]
            self._regions_gen += 1
            self._host_views.pop(mr.rkey, None)
            self._landing.pop(mr.rkey, None)
        # A write being placed right now may still touch the memory: wait until it is done so the caller can
        # free the memory safely once we return.
        deadline = time.monotonic() + 10.0
        with self._region_cv:
            while self._region_use.get(mr.rkey, 0) > 0:
                if not self._region_cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    log.warning("deregister of rkey 0x%x: placements still running after 10 s", mr.rkey)
                    break

    def set_landing_handler(self, mr: MemoryRegion, handler) -> None:
        """Capability ``landing_handlers``: let ``handler`` place writes with an immediate into the host region
        ``mr`` (a receiver's landing slots) straight into their final destinations.

        For such a write, checked as any write (rkey, whole write inside ``mr``) and carried whole in one message,
        the receiving thread calls ``handler(peer_id, addr, length, imm, read)`` before placing anything;
        ``read(n)`` receives the write's next ``n`` bytes into ``mr`` at their own place and returns a view of
        them (a chunk's header and table). The handler returns None (the rest of the write lands in ``mr`` as
        usual) or a plan: ``dsts``, ``lens``, ``offs`` (lists of ints: byte ``offs[i]`` of the write onwards,
        ``lens[i]`` bytes, go to host address ``dsts[i]``, which the handler vouches for; offsets ascending, past
        what it read, without overlap, inside the write) and ``done()``, called once every byte is placed. Bytes
        of the write outside the plan land in ``mr``. The RECV_IMM of the write follows as for any write."""
        with self._lock:
            if self._regions.get(mr.rkey) is not mr or mr.device != DEVICE_HOST:
                raise RegionError(f"set_landing_handler: {mr!r} is not a host region registered with {self._id}")
            if handler is None:
                self._landing.pop(mr.rkey, None)
            else:
                self._landing[mr.rkey] = handler

    def descriptor(self) -> bytes:
        self._check_open()
        return json.dumps({"fabric": self.name, "id": self._id, "host": self.hostname, "port": self.port,
                           "message_bytes": self.message_bytes, **self._descriptor_extra()}).encode()

    def _descriptor_extra(self) -> dict:
        return {}

    def connect(self, peer_descriptor: bytes) -> Endpoint:
        self._check_open()
        try:
            d = json.loads(bytes(peer_descriptor))
            peer_id, host, port = d["id"], d["host"], int(d["port"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"connect: malformed peer descriptor {bytes(peer_descriptor)[:100]!r}: {e}") from e
        if d.get("fabric") != self.name:
            raise ValueError(f"connect: descriptor is for fabric {d.get('fabric')!r}, this is {self.name!r}")
        self._check_peer(d)
        with self._lock:
            ep = self._endpoints.get(peer_id)
            if ep is not None and ep.alive:
                return ep
        conn_id = uuid.uuid4().hex
        n = self.connections_per_peer
        socks = []
        try:
            for i in range(n):
                s = socket.create_connection((host, port), timeout=self.connect_timeout)
                socks.append(s)
                self._tune(s)
                auth.client_handshake(s, self._secret, self.name, self.connect_timeout)
                hello = json.dumps({"id": self._id, "conn": conn_id, "index": i, "n": n,
                                    "desc": json.loads(self.descriptor())}).encode()
                s.sendall(_seal(_keyed(s), HDR.pack(MAGIC, T_HELLO, 0, 0, 0, 0, len(hello)) + hello))
            for s in socks:
                hdr = bytearray(HDR.size)
                recv_exact(s, memoryview(hdr))
                magic, typ, _, _, status, _, blen = HDR.unpack(hdr)
                if blen > MAX_HELLO:
                    raise FabricError(f"connect to {peer_id}: HELLO_ACK of {blen} B is implausible")
                body = bytearray(blen)
                recv_exact(s, memoryview(body))
                _frame_check(_keyed(s), hdr, body)
                if magic != MAGIC or typ != T_HELLO_ACK or status != 0:
                    raise FabricError(f"connect to {peer_id}: handshake refused: {bytes(body)[:200]!r}")
                s.settimeout(None)
        except auth.AuthError as e:
            for s in socks:
                s.close()
            raise PeerLost(f"connect to {peer_id} ({host}:{port}): authentication failed: {e}") from e
        except (OSError, ConnectionError) as e:
            for s in socks:
                s.close()
            raise PeerLost(f"connect to {peer_id} ({host}:{port}) failed: {e}") from e
        except BaseException:
            for s in socks:
                s.close()
            raise
        ep = self._make_endpoint(peer_id, socks, d)
        return ep

    def _check_peer(self, desc: dict) -> None:
        """Hook: ipc refuses peers on another host."""

    def _make_endpoint(self, peer_id: str, socks: List[socket.socket], desc: dict) -> TcpEndpoint:
        ep = TcpEndpoint(self, peer_id, socks)
        ep.peer_desc = desc
        try:
            ep.max_payload = max(64 << 10, min(MAX_MESSAGE_BYTES, int(desc.get("message_bytes", MAX_MESSAGE_BYTES))))
        except (TypeError, ValueError):
            pass
        with self._lock:
            if self._closed:
                ep.close_sockets()
                raise FabricClosed(f"{self.name} fabric {self._id} closed during connect")
            old = self._endpoints.get(peer_id)
            if old is not None and old.alive:
                # Simultaneous connects: keep both working, newest answers endpoint(peer_id).
                log.info("%s: second connection to %s; both stay usable", self._id, peer_id)
            self._endpoints[peer_id] = ep
            # forget dead endpoints whose threads are gone (their sockets were only shut down so far)
            keep = []
            for old_ep in self._all_eps:
                if old_ep.alive or any(t.is_alive() for s in old_ep.socks for t in s.threads):
                    keep.append(old_ep)
                else:
                    old_ep.close_sockets()
            self._all_eps = keep + [ep]
        ep.start()
        return ep

    def endpoint(self, peer_id: str) -> Endpoint:
        self._check_open()
        with self._lock:
            ep = self._endpoints.get(peer_id)
        if ep is None:
            raise UnknownPeer(f"{self._id} has no endpoint for peer {peer_id!r}; connect first")
        return ep

    def _lookup_local(self, r: WriteRequest) -> MemoryRegion:
        mr = self._regions.get(r.lkey)
        if mr is None:
            raise RegionError(f"wr_id={r.wr_id}: lkey 0x{r.lkey:x} is not a region registered with {self._id}")
        if not mr.contains(r.local_addr, r.length):
            raise RegionError(f"wr_id={r.wr_id}: local range 0x{r.local_addr:x}+{r.length} lies outside the "
                              f"region of lkey 0x{r.lkey:x} (0x{mr.addr:x}+{mr.length})")
        return mr

    def _validate(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> List[MemoryRegion]:
        self._check_open()
        if not isinstance(ep, TcpEndpoint) or ep.fabric is not self:
            raise UnknownPeer(f"post_writes: {ep!r} is not an endpoint of {self.name} fabric {self._id}")
        ep.check_alive()
        if len(requests) > _VECTOR_MIN:
            mrs = self._validate_many(requests)
            if mrs is not None:
                return mrs
        mrs = []
        for r in requests:
            check_range(r.local_addr, r.length, f"wr_id={r.wr_id} local")
            check_range(r.remote_addr, r.length, f"wr_id={r.wr_id} remote")
            if not isinstance(r.rkey, int) or not 0 <= r.rkey <= 0xFFFFFFFF:
                raise ValueError(f"wr_id={r.wr_id}: rkey must be a 32-bit unsigned int, got {r.rkey!r}")
            if r.imm is not None and (not isinstance(r.imm, int) or not 0 <= r.imm <= IMM_MAX):
                raise ValueError(f"wr_id={r.wr_id}: imm must be a 32-bit unsigned int, got {r.imm!r}")
            mrs.append(self._lookup_local(r))
        return mrs

    def _validate_many(self, requests: Sequence[WriteRequest]) -> Optional[List[MemoryRegion]]:
        """The checks of ``_validate`` for many requests in a few numpy calls (a Python step per request was most
        of a post of many writes: benchmarks/NOTES.md, "The message path on two GPUs"). None when any request
        fails a check: the per-request loop then raises the error that names it."""
        cols = [(r.local_addr, r.length, r.remote_addr, r.rkey, r.lkey, 0 if r.imm is None else r.imm)
                for r in requests]
        if not set(map(type, itertools.chain.from_iterable(cols))) <= {int}:
            return None  # a bool, float or other non-int somewhere
        try:
            a = np.array(cols, dtype=np.int64)
        except OverflowError:
            return None
        la, ln, ra, rk, lk, imm = a.T
        regions, k, problem = self._check_write_arrays(la, ln, ra, rk, lk, imm)
        if problem is not None:
            return None
        return [regions[0]] * len(requests) if len(regions) == 1 else [regions[j] for j in k.tolist()]

    @staticmethod
    def _first_bad_value(la, ln, ra, rk, imm) -> Optional[tuple]:
        """``(write, "value", what is wrong)`` for the first write with a bad value, in the order of the checks;
        None when every value is good."""
        checks = [(ln <= 0, "length must be positive"), (la < 0, "local address is negative"),
                  (ra < 0, "remote address is negative"), (la > _I64 - ln, "local range overflows"),
                  (ra > _I64 - ln, "remote range overflows"),
                  ((rk < 0) | (rk > 0xFFFFFFFF), "rkey is not a 32-bit unsigned int")]
        if imm is not None:
            checks.append(((imm < 0) | (imm > IMM_MAX), "imm is not a 32-bit unsigned int"))
        for bad, what in checks:
            if bad.any():
                return int(np.flatnonzero(bad)[0]), "value", what
        return None

    def _check_write_arrays(self, la, ln, ra, rk, lk, imm=None) -> tuple:
        """The local checks of a post on whole int64 arrays (local address, length, remote address, rkey, lkey,
        immediate): lengths, addresses and keys in range, each local range inside the region of its lkey. Returns
        ``(regions, k, None)``: the distinct regions and each write's index into them; or ``(None, None,
        (write, kind, detail))`` for the first bad write, ``kind`` "value" (``detail``: what is wrong), "lkey"
        (the unknown key) or "outside" (its region)."""
        def first(mask) -> int:
            return int(np.flatnonzero(mask)[0])

        lmax, la_min = int(ln.max()), int(la.min())
        if not (int(ln.min()) > 0 and la_min >= 0 and int(ra.min()) >= 0 and int(la.max()) + lmax <= _I64
                and int(ra.max()) + lmax <= _I64 and int(rk.min()) >= 0 and int(rk.max()) <= 0xFFFFFFFF
                and (imm is None or (int(imm.min()) >= 0 and int(imm.max()) <= IMM_MAX))):
            # some value may be bad (these extremes, fewer numpy calls than the masks, pass every good post):
            # the first write at fault, in the order of the checks
            problem = self._first_bad_value(la, ln, ra, rk, imm)
            if problem is not None:
                return None, None, problem
        layout = self._local_layouts.get(lk.tobytes()) if lk.size > 1 and lk.dtype == np.int64 else None
        if layout is not None and layout[0] == self._regions_gen:
            _, regions, k, lo, hi, _ = layout
        else:
            keys = np.asarray(distinct(lk), dtype=np.int64)
            regions = []
            for key in keys.tolist():
                mr = self._regions.get(key)
                if mr is None:
                    return None, None, (first(lk == key), "lkey", key)
                regions.append(mr)
            if len(regions) == 1:
                # one region (the common case): its bounds against the extremes, without per-write index arrays
                m = regions[0]
                k = np.zeros(ln.size, dtype=np.int64)
                if la_min >= m.addr and int((la + ln).max()) <= m.addr + m.length:
                    return regions, k, None
                lo, hi = m.addr, m.addr + m.length
            else:
                _, regions, k, lo, hi, _ = self._remember_layout(lk, keys, regions)
        out = (la < lo) | (la + ln > hi)
        if out.any():
            i = first(out)
            return None, None, (i, "outside", regions[int(k[i])])
        return regions, k, None

    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        if len(requests) == 1:
            r = requests[0]
            if type(r) is WriteRows:
                self._post_rows(ep, r)
                return
            if type(r) is WriteRequest and not r.acked and not r.signaled and self._unacked \
                    and self._post_unacked(ep, r):
                return
        requests = list(requests)
        batches = [r for r in requests if isinstance(r, WriteBatch)]
        if batches:
            requests = [r for r in requests if not isinstance(r, WriteBatch)]
        mrs = self._validate(ep, requests)
        devices = [self._validate_batch(b) for b in batches]  # every check before anything is posted
        gathers = [self._check_gather(r, mr) for r, mr in zip(requests, mrs) if type(r) is GatherWrite]
        if gathers:
            msgs = []
            plain, plain_mrs = [], []
            for r, mr in zip(requests, mrs):  # posting order kept: plain runs between the gather writes
                if type(r) is GatherWrite:
                    if plain:
                        msgs.extend(self._build_messages(plain, plain_mrs, len(ep.socks)))
                        plain, plain_mrs = [], []
                    msgs.append(self._build_gather(r, mr, gathers.pop(0)))
                else:
                    plain.append(r)
                    plain_mrs.append(mr)
            if plain:
                msgs.extend(self._build_messages(plain, plain_mrs, len(ep.socks)))
        else:
            msgs = self._build_messages(requests, mrs, len(ep.socks)) if requests else []
        for b, dev in zip(batches, devices):
            msgs.extend(self._build_batch(b, dev, len(ep.socks)))
        if msgs:
            self._send(ep, msgs)

    def _post_unacked(self, ep: Endpoint, r: WriteRequest) -> bool:
        """Post one unacked write (``WriteRequest.acked`` False) as a message with ``H_NOACK``: its bytes copied
        into the message now, a sequence number but no pending record, sent by this thread when the socket is idle
        (else queued as a control message). With the ACK of a landed write held by this thread (``_finish_message``)
        and ``ep`` that write's endpoint, both leave in one send on its socket. False: not posted (larger than
        ``UNACKED_MAX`` or not host memory); post it as an acknowledged write."""
        if not isinstance(r.length, int) or r.length > UNACKED_MAX:
            return False
        mr, = self._validate(ep, [r])
        if mr.device != DEVICE_HOST:
            return False
        body = _ROW.pack(r.remote_addr, r.length, r.remote_addr, r.length, r.rkey,
                         0 if r.imm is None else F_IMM, r.imm or 0, 0) + raw_view(r.local_addr, r.length).tobytes()
        held = self._held.__dict__.pop("ack", None)
        if held is not None and held[0] is not ep:  # another endpoint's ACK: it goes out on its own, first
            self._send_ctrl(*held)
            held = None
        s, seq = ep.reserve(held[1] if held is not None else None)
        wire = HDR.pack(MAGIC, T_WRITE, H_NOACK, 0, 1, seq, len(body)) + body
        if held is not None:
            wire = held[2] + wire
        try:
            if self._send_now(s, [wire]):
                return True
        except OSError as e:  # as in the sender thread: the link is unusable, pending work fails over
            log.debug("inline send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")
            return True
        ep.send_ctrl(s, wire)
        return True

    def _check_gather(self, r: GatherWrite, mr: MemoryRegion) -> tuple:
        """The local checks of a ``GatherWrite`` beyond ``_validate``'s (which checked its own range): the gather
        arrays well formed, the replaced ranges ascending, without overlap and inside the write, every source inside
        a host region registered here. Returns (sources, replaced addresses, lengths) as lists and the source
        region's view when one region holds every source (else None)."""
        if mr.device != DEVICE_HOST or len(r.gather) != 3:
            raise ValueError(f"wr_id={r.wr_id}: a gather write goes from host memory and needs (sources, local "
                             f"addresses, lengths)")
        try:
            src, loc, ln = (np.asarray(v, dtype=np.int64) for v in r.gather)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"wr_id={r.wr_id}: gather arrays: {e}") from e
        n = ln.size
        if not (n >= 1 and src.shape == loc.shape == ln.shape == (n,)):
            raise ValueError(f"wr_id={r.wr_id}: gather arrays of sizes {src.size}, {loc.size}, {n}: need one size >= 1")
        ends = loc + ln
        if int(ln.min()) < 1 or int(loc[0]) < r.local_addr or int(ends[-1]) > r.local_addr + r.length or \
                int(src.min()) < 0 or int(src.max()) > _I64 - int(ln.max()) or (n > 1 and bool((loc[1:] < ends[:-1]).any())):
            raise ValueError(f"wr_id={r.wr_id}: gather ranges must have lengths >= 1 and lie in ascending order, "
                             f"without overlap, inside the write's local range 0x{r.local_addr:x}+{r.length}")
        lo, hi = int(src.min()), int((src + ln).max())
        with self._lock:
            hosts = [self._host_views[k] for k, m in self._regions.items() if m.device == DEVICE_HOST]
        for m, view in hosts:
            if m.addr <= lo and hi <= m.addr + m.length:
                return src, loc, ln, (m.addr, view)
        src_l, ln_l = src.tolist(), ln.tolist()
        for i, (a, k) in enumerate(zip(src_l, ln_l)):
            if not any(m.contains(a, k) for m, _ in hosts):
                raise RegionError(f"wr_id={r.wr_id}: gather source {i} 0x{a:x}+{k} lies outside every host region "
                                  f"registered with {self._id}")
        return src, loc, ln, None

    def _build_gather(self, r: GatherWrite, mr: MemoryRegion, checked: tuple) -> _OutMsg:
        """One message for a checked ``GatherWrite``: one whole-write row, the payload as buffers in order (the
        write's own bytes between the gathered ranges, each gathered range from its source)."""
        src, loc, ln, region = checked
        flags = F_IMM if r.imm is not None else 0
        m = _OutMsg(0)
        m.table = np.array([(r.remote_addr, r.length, r.remote_addr, r.length, r.rkey, flags, r.imm or 0, 0)],
                           dtype=PIECE_DT)
        m.recs = [_WrRecord(r)]
        m.last = [True]
        m.whole = True
        own = self._host_views[mr.rkey][1]
        bufs = []
        pos, end = r.local_addr, r.local_addr + r.length
        if region is not None:
            sbase, sview = region
            # runs of pieces whose sources follow each other in memory and whose ranges follow each other in the
            # write go as one buffer: found by numpy, so that the loop below takes a step per run, not per piece
            ends = loc + ln
            start = np.empty(ln.size, dtype=bool)
            start[0] = True
            np.not_equal(loc[1:], ends[:-1], out=start[1:])
            start[1:] |= src[1:] != src[:-1] + ln[:-1]
            first = np.flatnonzero(start)
            last = np.append(first[1:], ln.size) - 1
            for a, l, e in zip(src[first].tolist(), loc[first].tolist(), ends[last].tolist()):
                if l > pos:
                    bufs.append(own[pos - mr.addr:l - mr.addr])
                a -= sbase
                bufs.append(sview[a:a + e - l])
                pos = e
        else:
            for a, l, k in zip(src.tolist(), loc.tolist(), ln.tolist()):
                if l > pos:
                    bufs.append(own[pos - mr.addr:l - mr.addr])
                bufs.append(raw_view(a, k))
                pos = l + k
        if pos < end:
            bufs.append(own[pos - mr.addr:end - mr.addr])
        m.bufs = bufs
        return m

    def _validate_batch(self, b: WriteBatch) -> np.ndarray:
        """The checks of ``_validate`` for a ``WriteBatch``, in whole-array numpy. Returns each write's source
        device. Raises ``ValueError`` / ``RegionError`` naming the first bad write."""
        la, ln, ra, rk = b.local_addr, b.length, b.remote_addr, b.rkey
        regions, k, problem = self._check_write_arrays(la, ln, ra, rk, b.lkey)
        if problem is not None:
            i, kind, detail = problem
            if kind == "value":
                raise ValueError(f"batch wr_id={b.wr_id}, write {i} (local 0x{int(la[i]):x}, {int(ln[i])} B, remote "
                                 f"0x{int(ra[i]):x}, rkey {int(rk[i])}): {detail}")
            if kind == "lkey":
                raise RegionError(f"batch wr_id={b.wr_id}, write {i}: lkey 0x{detail:x} is not a region registered "
                                  f"with {self._id}")
            raise RegionError(f"batch wr_id={b.wr_id}, write {i}: local range 0x{int(la[i]):x}+{int(ln[i])} lies "
                              f"outside the region of lkey 0x{detail.lkey:x} (0x{detail.addr:x}+{detail.length})")
        if len(regions) > 1:
            layout = self._local_layouts.get(b.lkey.tobytes()) if b.lkey.dtype == np.int64 else None
            if layout is not None and layout[1] is regions:
                return layout[5]
        return np.array([m.device for m in regions], dtype=np.int64)[k]

    def _remember_layout(self, lk: np.ndarray, keys: np.ndarray, regions: list) -> tuple:
        """Remember, by the bytes of the lkey array ``lk``, what ``_check_write_arrays`` derives from it when it
        names several regions (``keys``: its distinct values, ``regions`` theirs): (the registration counter,
        regions, each write's index into them, start and end of each write's region, each write's device). Why: a
        batch over many regions (sglang registers a buffer per layer) paid a ``np.unique`` and Python steps per
        region and post for these, though its lkeys repeat call after call (benchmarks/NOTES.md, "A region per
        layer on the GPU"); any registration or deregistration changes the counter, and the entry is made again.
        The arrays are shared between calls: read only."""
        k = np.searchsorted(keys, lk)
        lo = np.array([m.addr for m in regions], dtype=np.int64)[k]
        hi = lo + np.array([m.length for m in regions], dtype=np.int64)[k]
        devices = np.array([m.device for m in regions], dtype=np.int64)[k]
        for a in (k, lo, hi, devices):
            a.flags.writeable = False
        layout = (self._regions_gen, regions, k, lo, hi, devices)
        memo = self._local_layouts
        if len(memo) >= _LAYOUTS_KEPT:
            try:
                memo.pop(next(iter(memo)))
            except (StopIteration, RuntimeError, KeyError):  # another thread changed it: it stays bounded
                pass
        if lk.dtype == np.int64:
            memo[lk.tobytes()] = layout
        return layout

    def _post_rows(self, ep: Endpoint, b: WriteRows) -> None:
        """Post a ``WriteRows``: the checks of ``_validate_batch`` in Python, then one message (up to
        ``MAX_TABLE`` writes and ``message_bytes``; more go through the numpy path). A message of host sources
        small enough for an inline send is registered, framed and sent here in one step (what ``_send``,
        ``enqueue``, ``_wire_buffers`` and ``_send_now`` do for it), since its Python steps are its latency."""
        if self._closed:
            self._check_open()
        if not isinstance(ep, TcpEndpoint) or ep.fabric is not self:
            raise UnknownPeer(f"post_writes: {ep!r} is not an endpoint of {self.name} fabric {self._id}")
        la, ln, ra, rk, lk = b.local_addr, b.length, b.remote_addr, b.rkey, b.lkey
        n = len(ln)
        nbytes = b.nbytes
        if n > MAX_TABLE or nbytes > self.message_bytes:
            arrays = [np.asarray(v, dtype=np.int64) for v in (la, ln, ra)]
            self.post_writes(ep, [WriteBatch(*arrays, np.full(n, rk, dtype=np.int64), np.full(n, lk, dtype=np.int64),
                                             wr_id=b.wr_id)])
            return
        if not ep._alive:
            ep.check_alive()
        if rk.__class__ is not int or lk.__class__ is not int or not (0 <= rk <= 0xFFFFFFFF and 0 <= lk <= 0xFFFFFFFF):
            for name, v in (("rkey", rk), ("lkey", lk)):
                if v.__class__ is not int or not 0 <= v <= 0xFFFFFFFF:
                    raise ValueError(f"batch wr_id={b.wr_id}: {name} {v!r} is not a 32-bit unsigned int")
        mr = self._regions.get(lk)
        if mr is None:
            raise RegionError(f"batch wr_id={b.wr_id}: lkey 0x{lk:x} is not a region registered with {self._id}")
        first, end = b.local_span  # the writes' own checks: WriteRows
        base = mr.addr
        if first < base or end > base + mr.length:
            i = next(i for i, (a, k) in enumerate(zip(la, ln)) if a < mr.addr or a + k > mr.addr + mr.length)
            raise RegionError(f"batch wr_id={b.wr_id}, write {i}: local range 0x{la[i]:x}+{ln[i]} lies outside the "
                              f"region of lkey 0x{lk:x} (0x{mr.addr:x}+{mr.length})")
        pack = _ROW.pack
        m = _OutMsg(0)
        rows = m.rows = b"".join([pack(r, k, r, k, rk, 0, 0, 0) for r, k in zip(ra, ln)])
        m.pieces = n
        m.batch = _BatchRecord(b)
        m.final = True
        m.on_acked = b.on_acked
        if mr.device != DEVICE_HOST:  # GPU sources: staged through pinned memory by the sender (``_source_buffers``)
            m.table = np.frombuffer(m.rows, dtype=PIECE_DT)
            m.rows = None
            m.src = [(a, k, mr.device) for a, k in zip(la, ln)]
            self._send(ep, [m])
            return
        # the sources as slices of one view of the region (the one kept since registration, else one of the
        # span: a view per piece costs a ctypes call each), pieces that follow each other in memory as one buffer
        ent = self._host_views.get(lk)
        if ent is not None and ent[0] is mr:
            span = ent[1]
        else:
            span, base = raw_view(first, end - first), first
        bufs = []
        start = end = -1
        for a, k in zip(la, ln):
            if a != end:
                if end > start:
                    bufs.append(span[start - base:end - base])
                start = a
            end = a + k
        bufs.append(span[start - base:end - base])
        m.bufs = bufs
        if n > INLINE_PIECES or nbytes > INLINE_BYTES:
            ep.enqueue([m])
            return
        s = ep.enqueue_one(m, b.read_ack)
        wire = [HDR.pack(MAGIC, T_WRITE, 0, 0, n, m.seq, len(rows) + nbytes) + rows, *bufs]
        poller = s.poller
        if b.read_ack and poller is None and self._own_acks:
            s.want_shared = True  # this ack still comes through the receive thread; later ones need not
        elif b.read_ack and poller is not None and self._own_acks and s.reader.acquire(False):
            # the ack will be read by this thread (``await_rows``): taken before the send, so that the receive
            # thread, out of the epoll set meanwhile, never sees it
            try:
                if s.poller is poller:
                    poller.modify(s.fd, 0)
                    b.reader = (ep, s, m)
            except (OSError, ValueError):  # the receive thread ended meanwhile
                pass
            if b.reader is None:
                s.reader.release()
        try:
            self._send_inline(ep, s, m, wire)
        except BaseException:
            self.await_rows(b, 0.0)
            raise

    def await_rows(self, b: WriteRows, deadline: float) -> None:
        """For the thread that posted ``b`` with ``read_ack`` and got its socket (``b.reader`` set): read that
        socket -- every message on it, whoever it is for -- until ``b``'s ack is handled, the endpoint failed or
        ``time.monotonic()`` passes ``deadline``, then hand the socket back to its receive thread. The ack
        completes ``b`` as the receive thread would have (``on_acked`` or a completion). A read that fails (EOF,
        reset, a malformed stream) fails the endpoint, as in the receive thread. No-op when ``b.reader`` is None."""
        held = b.reader
        if held is None:
            return
        b.reader = None
        ep, s, m = held
        try:
            st = s.rx_state
            rx = st["rx"]
            wait = st["wait"]
            spin = self._ack_spin
            spin_until = spin.until(time.monotonic())
            spun = spin_until > 0.0  # reported to ``spin`` once: a hit when the ack is in before the spin ends
            while not m.done and ep._alive:
                if rx.pos == rx.end:
                    now = time.monotonic()
                    if now < spin_until:
                        if not rx.ready():
                            continue
                    else:
                        if spun:
                            spun = False
                            spin.done(False)
                        left = deadline - now
                        if left <= 0:
                            break
                        if not wait.poll(left * 1000.0 + 1.0) or not rx.ready():
                            continue
                self._read_one(ep, s, rx, st)
            if spun:
                spin.done(m.done)
            if m.done:
                s.own_reads += 1
            # what the last receive took beyond the ack (another message, whole or in part) is read here: the
            # receive thread is woken by bytes still in the socket, never by bytes already in the buffer
            while ep._alive and rx.pos < rx.end:
                self._read_one(ep, s, rx, st)
        except Exception as e:  # noqa: BLE001 — as in ``_recv_loop``: the link is unusable
            if ep.alive and not self._closed:
                log.debug("receive on %s/%d by a waiting caller ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")
        finally:
            poller = s.poller
            if poller is not None:
                try:
                    poller.modify(s.fd, _EPOLLIN)
                except (OSError, ValueError):
                    pass
            s.reader.release()

    def _message_target(self, total: int, nsocks: int) -> int:
        """Payload bytes per message for a post of ``total`` bytes: a share per socket (each socket's sender thread
        streams its messages in parallel), at most ``message_bytes``."""
        return max(64 << 10, min(self.message_bytes, -(-total // nsocks)))

    def _build_batch(self, b: WriteBatch, devices: np.ndarray, nsocks: int) -> List[_OutMsg]:
        """The messages of one batch: writes larger than a message cut into pieces, then runs of pieces of about
        ``message_bytes`` (fewer when the batch is small, so every socket gets a share), all in numpy."""
        la, ln, ra, rk = b.local_addr, b.length, b.remote_addr, b.rkey
        target = self._message_target(b.nbytes, nsocks)
        if int(ln.max()) > target:
            parts = -(-ln // target)
            which = np.repeat(np.arange(ln.size), parts)
            first_part = np.cumsum(parts) - parts
            off = (np.arange(which.size) - first_part[which]) * target
            plen = np.minimum(ln[which] - off, target)
            la, ra, rk, devices, wa, wl = la[which] + off, ra[which] + off, rk[which], devices[which], ra[which], \
                ln[which]
            ln = plen
        else:
            wa, wl = ra, ln
        cum = np.cumsum(ln)
        n = int(ln.size)
        msgs: List[_OutMsg] = []
        rec = _BatchRecord(b)
        start = 0
        while start < n:
            base = int(cum[start - 1]) if start else 0
            end = max(int(np.searchsorted(cum, base + target, side="right")), start + 1)
            end = min(end, start + MAX_TABLE, n)
            m = _OutMsg(0)
            t = np.zeros(end - start, dtype=PIECE_DT)
            t["addr"], t["len"], t["waddr"], t["wlen"], t["rkey"] = (ra[start:end], ln[start:end], wa[start:end],
                                                                      wl[start:end], rk[start:end])
            m.table = t
            m.batch = rec
            m.src_arr = np.stack([la[start:end], ln[start:end], devices[start:end]], axis=1)
            msgs.append(m)
            start = end
        msgs[-1].final = True
        return msgs

    def _send(self, ep: TcpEndpoint, msgs: List[_OutMsg]) -> None:
        """Hand checked messages over: to the sockets' sender threads, except a post of one small message, which
        this thread sends itself when its socket is idle (``_send_now``)."""
        m = msgs[0] if len(msgs) == 1 else None
        # GPU sources are staged through the socket's buffers, which its sender thread owns
        if m is None or len(m) > INLINE_PIECES or m.nbytes > INLINE_BYTES or (
                m.bufs is None and any(d != DEVICE_HOST for _, _, d in m.sources())):
            ep.enqueue(msgs)
            return
        s, = ep.enqueue(msgs, queue=False)
        self._send_inline(ep, s, m, self._wire_buffers(s, m))

    def _send_inline(self, ep: TcpEndpoint, s: _Sock, m: _OutMsg, buffers) -> None:
        """Send message ``m`` (already numbered on socket ``s``) from the posting thread when the socket is free,
        else hand it to the socket's sender thread, behind what it holds."""
        try:
            if self._send_now(s, buffers):
                return
        except OSError as e:  # as in the sender thread: the link is unusable, pending work fails over
            log.debug("inline send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")
            return
        ep.small_busy(s)
        with s.cv:
            s.data.append(m)
            s.cv.notify()

    def _build_messages(self, requests, mrs, nsocks: int) -> List[_OutMsg]:
        """Cut the writes into messages of about ``message_bytes`` (fewer, smaller ones when the batch is small,
        so that every socket gets a share); a write spanning a boundary becomes several pieces."""
        total = sum(r.length for r in requests)
        target = self._message_target(total, nsocks)
        if len(requests) > _VECTOR_MIN and all(r.length <= target for r in requests):
            return self._build_whole(requests, mrs, target)
        msgs: List[_OutMsg] = []
        rows: List[tuple] = []
        cur = _OutMsg(0)
        cur_bytes = 0

        def flush():
            nonlocal cur, rows, cur_bytes
            cur.table = np.array(rows, dtype=PIECE_DT)
            msgs.append(cur)
            cur, rows, cur_bytes = _OutMsg(0), [], 0

        for r, mr in zip(requests, mrs):
            rec = _WrRecord(r)
            flags = F_IMM if r.imm is not None else 0
            imm = r.imm or 0
            off = 0
            while off < r.length:
                room = target - cur_bytes
                if room <= 0 or len(rows) >= MAX_TABLE:
                    flush()
                    continue
                n = min(r.length - off, room)
                last = off + n == r.length
                rows.append((r.remote_addr + off, n, r.remote_addr, r.length, r.rkey,
                             flags if last else 0, imm, 0))
                cur.recs.append(rec)
                cur.last.append(last)
                cur.src.append((r.local_addr + off, n, mr.device))
                cur_bytes += n
                off += n
        if rows:
            flush()
        return msgs

    @staticmethod
    def _build_whole(requests, mrs, target: int) -> List[_OutMsg]:
        """``_build_messages`` for writes that each fit a message: whole writes, in order, a message closed once
        it holds ``target`` bytes or ``MAX_TABLE`` pieces; the table built by numpy, not row by row."""
        n = len(requests)
        la = np.fromiter((r.local_addr for r in requests), dtype=np.int64, count=n)
        ln = np.fromiter((r.length for r in requests), dtype=np.int64, count=n)
        ra = np.fromiter((r.remote_addr for r in requests), dtype=np.int64, count=n)
        # greedy: a message closes before the write that would take it past ``target`` (never above it: the
        # peer refuses a payload larger than the message size this fabric announced)
        bounds = [0]
        used = 0
        for i, k in enumerate(ln.tolist()):
            if used + k > target and i > bounds[-1]:
                bounds.append(i)
                used = 0
            used += k
        bounds.append(n)
        msgs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            for lo in range(a, b, MAX_TABLE):
                hi = min(b, lo + MAX_TABLE)
                m = _OutMsg(0)
                part = requests[lo:hi]
                t = np.zeros(hi - lo, dtype=PIECE_DT)
                t["addr"] = t["waddr"] = ra[lo:hi]
                t["len"] = t["wlen"] = ln[lo:hi]
                t["rkey"] = [r.rkey for r in part]
                t["flags"] = [F_IMM if r.imm is not None else 0 for r in part]
                t["imm"] = [r.imm or 0 for r in part]
                m.table = t
                m.recs = [_WrRecord(r) for r in part]
                m.last = [True] * (hi - lo)
                m.src = list(zip(la[lo:hi].tolist(), ln[lo:hi].tolist(), [mr.device for mr in mrs[lo:hi]]))
                msgs.append(m)
        return msgs

    def poll(self, max_n: int = 64, timeout: float = 0.0) -> List[Completion]:
        self._check_open()
        return self._cq.take(max_n, timeout)

    def set_completion_handler(self, handler) -> None:
        self._cq.set_handler(handler)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            eps = list(self._all_eps)
            self._endpoints.clear()
            self._all_eps.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # close() alone does not wake a thread blocked in accept()
        except OSError:
            pass
        with self._group_cv:
            self._group_cv.notify_all()
        try:
            self._listener.close()
        except OSError:
            pass
        for ep in eps:
            ep.fail("fabric closed")
        for ep in eps:
            for s in ep.socks:
                for t in s.threads:
                    if t is not threading.current_thread():
                        t.join(timeout=2.0)
            ep.close_sockets()
        self._listen_thread.join(timeout=2.0)
        self._watchdog.join(timeout=2.0)
        self._cq.close()
        self._on_close()

    def _on_close(self) -> None:
        """Hook for subclasses."""

    # --- internals ------------------------------------------------------------------------------------------
    def _watchdog_loop(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                eps = list(self._all_eps)
            for ep in eps:
                with ep._lock:
                    oldest = next(iter(ep._pending.values()), None) if ep._alive else None
                if oldest is not None and now - oldest.posted_at > self.ack_timeout:
                    ep.fail(f"message {oldest.seq} unacknowledged for {self.ack_timeout:g} s")

    def _push(self, comps: List[Completion]) -> None:
        if comps:
            self._cq.push(comps)

    def _tune(self, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer host that vanishes (no FIN/RST) is detected by keepalive when idle and TCP_USER_TIMEOUT when
        # data is unacknowledged, so pending work fails within a few seconds instead of ~15 minutes.
        k = max(1, int(self.keepalive))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", k), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3),
                         ("TCP_USER_TIMEOUT", int(self.keepalive * 1000) + 2000)):
            if hasattr(socket, opt):
                try:
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
                except OSError:
                    pass

    # --- incoming connections -------------------------------------------------------------------------------
    def expect_peer(self, peer_id: str, ttl: float = 60.0) -> None:
        """Allow one incoming connection to take ``peer_id`` within ``ttl`` seconds, replacing a live endpoint
        of that id if there is one (with ``guard_claims``; the engine calls this for the rail ids a sender
        announced over its authenticated control connection)."""
        self._claims.expect(peer_id, ttl)

    def _claim_locked(self, peer_id: str) -> Optional[str]:
        """Why an incoming connection may not take ``peer_id`` (None: it may); consumes an announcement."""
        old = self._endpoints.get(peer_id)
        return self._claims.refusal(peer_id, old is not None and old.alive)

    def admission_stats(self) -> dict:
        """Incoming connections: accepted, authenticated, refused by cause (``transport.auth.Gate.stats``), plus
        ``refused_claims`` (a peer id held by a live connection, or never announced)."""
        return self.gate.stats()

    def _accept_loop(self) -> None:
        self.gate.serve(self._listener, lambda: self._closed)

    def _refuse(self, s: socket.socket, why: str) -> None:
        try:
            msg = why.encode()[:1024]
            s.sendall(_seal(_keyed(s), HDR.pack(MAGIC, T_HELLO_ACK, 0, 0, 1, 0, len(msg)) + msg))
        except OSError:
            pass

    def _incoming(self, a: "auth.Admitted") -> None:
        """One incoming socket (its own thread, ``transport.auth.Gate``): authenticate, read its HELLO, wait
        until every socket of its endpoint arrived, then build the endpoint (the last one to arrive does)."""
        s = a.sock
        self._tune(s)
        auth.server_handshake(s, self._secret, self.name, a.deadline, a.established)
        hdr = auth.recv_exact(s, HDR.size, a.deadline)
        magic, typ, _, _, _, _, blen = HDR.unpack(hdr)
        try:
            if magic != MAGIC or typ != T_HELLO or blen > MAX_HELLO:
                raise ValueError(f"bad hello header {hdr!r}")
            body = auth.recv_exact(s, blen, a.deadline)
            _frame_check(_keyed(s), hdr, body)  # before the hello is parsed or acted on
            hello = json.loads(body)
            conn, idx, n = str(hello["conn"]), int(hello["index"]), int(hello["n"])
            peer_id, desc = hello["id"], hello["desc"]
            if not isinstance(peer_id, str) or not isinstance(desc, dict) or len(conn) > 64:
                raise ValueError(f"bad hello fields id={peer_id!r}")
            if not 1 <= n <= 64 or not 0 <= idx < n:
                raise ValueError(f"bad hello index {idx} of {n}")
            self._check_peer(desc)
        except Exception as e:  # noqa: BLE001 — a broken client must not kill anything
            log.warning("%s: refused connection from %s: %s", self._id, a.addr, e)
            self.gate.count("refused_hello")
            self._refuse(s, str(e))
            return
        with self._group_cv:
            entry = self._groups.get(conn)
            if entry is None:
                if len(self._groups) >= 4 * self.gate.max_pending:
                    self.gate.count("refused_hello")
                    self._refuse(s, "too many connections gathering")
                    return
                entry = self._groups[conn] = {"socks": {}, "id": peer_id, "n": n, "done": False, "error": None}
            if entry["id"] != peer_id or entry["n"] != n or idx in entry["socks"]:
                self.gate.count("refused_hello")
                self._refuse(s, f"hello does not match connection {conn}")
                return
            entry["socks"][idx] = s
            last = len(entry["socks"]) == n
            if last:
                del self._groups[conn]
            else:
                while not entry["done"] and not self._closed:
                    left = a.deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._group_cv.wait(left)
                if not entry["done"]:  # the other sockets never came: give up on the whole endpoint
                    self._groups.pop(conn, None)
                    entry["done"], entry["error"] = True, "not every socket of the connection arrived in time"
                    self._group_cv.notify_all()
                if entry["error"] is None:
                    a.sock = None  # the endpoint owns it now
                else:
                    self._refuse(s, entry["error"])
                return
        error = None
        socks = [entry["socks"][i] for i in range(n)]
        host = a.host
        with self._lock:
            error = self._claim_locked(peer_id)
            if error is None and host is not None and sum(
                    1 for ep in self._endpoints.values()
                    if ep.alive and getattr(ep, "remote_host", None) == host) >= self.max_peers_per_addr:
                error = f"{host} already has {self.max_peers_per_addr} endpoints"
        if error is not None:
            self.gate.count("refused_claims")
            log.warning("%s: refused connection from %s: %s", self._id, a.addr, error)
        else:
            for sk in socks:
                # Blocking before the endpoint's receive threads start: a recv entered while the handshake
                # timeout was still set kept it, and an idle rail then died after the timeout
                sk.settimeout(None)
            try:
                ep = self._make_endpoint(peer_id, socks, desc)
            except FabricClosed as e:
                error = str(e)
            else:
                ep.remote_host = host
                for sk in socks:
                    try:
                        sk.sendall(_seal(_keyed(sk), HDR.pack(MAGIC, T_HELLO_ACK, 0, 0, 0, 0, 0)))
                    except OSError as e:
                        ep.fail(f"handshake: {e}")
                        break
                a.sock = None
        with self._group_cv:
            entry["done"], entry["error"] = True, error
            self._group_cv.notify_all()
        if error is not None:
            self._refuse(s, error)

    def _send_loop(self, ep: TcpEndpoint, s: _Sock) -> None:
        try:
            while True:
                with s.cv:
                    while not s.ctrl and not s.data and not s.closed:
                        s.cv.wait()
                    if s.closed:
                        return
                # taken before the queues are read: the rest of a message that a thread began to send itself
                # (``_send_now``) is at the head of ``ctrl`` by the time the lock is free
                with s.wire_lock:
                    with s.cv:
                        ctrl = list(s.ctrl)
                        s.ctrl.clear()
                        msg = s.data.popleft() if (not ctrl and s.data) else None
                    if ctrl:
                        sess = s.sess
                        if sess is not None:  # new frames get their tags now; a memoryview continues a frame
                            ctrl = [c if type(c) is memoryview else _seal(sess, c) for c in ctrl]
                        send_buffers(s.sock, ctrl)
                    if msg is not None:
                        self._transmit(ep, s, msg)
        except Exception as e:  # noqa: BLE001 — any send failure means the link is gone
            if ep.alive and not self._closed:
                log.debug("send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")

    def _source_buffers(self, s: _Sock, msg: _OutMsg) -> List:
        srcs = msg.sources()
        gpu = [(i, a, n, d) for i, (a, n, d) in enumerate(srcs) if d != DEVICE_HOST]
        if not gpu:
            return [raw_view(a, n) for a, n, _ in srcs]
        # GPU sources: the socket cannot read device memory, so pack them into pinned host memory first
        # (big pieces: one D2H each; small ones: one gather launch on the device, then one D2H).
        import torch
        total = sum(n for _, _, n, _ in gpu)
        host = pinned_buffer(s.tx_cache, total)
        hbase = host.data_ptr()
        where, off = {}, 0
        by_dev: Dict[int, list] = {}
        for i, a, n, d in gpu:
            where[i] = off
            by_dev.setdefault(d, []).append((off, a, n))
            off += n
        for dev, items in by_dev.items():
            stream = cuda_stream(s.tx_cache, dev)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                small = [it for it in items if it[2] < BIG_GPU_PIECE]
                for o, a, n in items:
                    if n >= BIG_GPU_PIECE:
                        memcpy_async(hbase + o, a, n, stream)
                if small:
                    lo, hi = small[0][0], small[-1][0] + small[-1][2]
                    scratch = device_scratch(s.tx_cache, dev, hi - lo)
                    sp = scratch.data_ptr() - lo
                    gpu_batch_copy([a for _, a, _ in small], [sp + o for o, _, _ in small],
                                   [n for _, _, n in small], dev)
                    host[lo:hi].copy_(scratch[:hi - lo], non_blocking=True)
            stream.synchronize()
        return [raw_view(hbase + where[i], n) if d != DEVICE_HOST else raw_view(a, n)
                for i, (a, n, d) in enumerate(srcs)]

    def _wire_buffers(self, s: _Sock, msg: _OutMsg) -> List:
        """A WRITE message as buffers to send in order: header and table, then each piece's source bytes."""
        if msg.rows is not None:
            return [HDR.pack(MAGIC, T_WRITE, 0, 0, msg.pieces, msg.seq, len(msg.rows) + msg.batch.length)
                    + msg.rows] + msg.bufs
        if msg.whole:
            table = msg.table.tobytes()
            return [HDR.pack(MAGIC, T_WRITE, H_WHOLE, 0, 1, msg.seq, len(table) + int(msg.table["len"][0]))
                    + table] + msg.bufs
        table = msg.table.tobytes()
        payload = int(msg.table["len"].sum())
        hdr = HDR.pack(MAGIC, T_WRITE, 0, 0, len(msg.table), msg.seq, len(table) + payload)
        return [hdr + table] + self._source_buffers(s, msg)

    def _transmit(self, ep: TcpEndpoint, s: _Sock, msg: _OutMsg) -> None:
        bufs = self._wire_buffers(s, msg)
        if s.sess is not None:
            bufs[0] = _seal(s.sess, bufs[0])
        send_buffers(s.sock, bufs)

    @staticmethod
    def _send_now(s: _Sock, bufs: List) -> bool:
        """Send ``bufs`` (one message) from this thread when no other thread is sending on the socket and the
        kernel takes at least its first byte without waiting; what it does not take goes to the head of the
        socket's queue, for the sender thread to send before anything else. False: nothing was sent (the socket
        is busy or full; queue the message). Never blocks: receiving threads send their acks this way.

        Why: handing a small message to the sender thread costs a thread wake-up on each side of the wire, more
        than the message's own send; the sender thread stays for large messages and for a socket that is full."""
        if not s.wire_lock.acquire(blocking=False):
            return False
        try:
            # anything queued for control may be the rest of a message sent in part: it goes first
            if s.closed or s.ctrl:
                return False
            sess = s.sess
            if sess is not None:
                # the tag takes the socket's next sequence number: only once the bytes are sure to go out now
                tx_n = sess.tx_n
                bufs = [_seal(sess, bufs[0]), *bufs[1:]]
            try:
                sent = s.sock.sendmsg(bufs, (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if sess is not None:
                    sess.tx_n = tx_n  # nothing went out: the message is queued and sealed again when sent
                return False
            rest = []
            for i, b in enumerate(bufs):
                n = len(b)
                if sent < n:
                    # memoryviews: the sender thread sends them as the rest of a sealed message, not new ones
                    rest = [memoryview(b)[sent:]] + [memoryview(x) for x in bufs[i + 1:]]
                    break
                sent -= n
            if rest:
                with s.cv:
                    s.ctrl.extendleft(reversed(rest))
                    s.cv.notify()
            return True
        finally:
            s.wire_lock.release()

    def _recv_loop(self, ep: TcpEndpoint, s: _Sock) -> None:
        hdr = bytearray(HDR.size)
        st = {"table": bytearray(64 * 48), "stage": bytearray(1 << 20), "hdr": hdr, "hview": memoryview(hdr)}
        # a subclass reading the socket itself (ipc) gets the bare socket
        rx = st["rx"] = _Rx(s.sock, HDR.size + SMALL_MESSAGE) if self._small_writes else s.sock
        try:
            if rx is s.sock:
                while True:
                    self._read_one(ep, s, rx, st)
            # Blocking reads, by this thread alone, until a caller on this side waits for a small batch of its own
            # here (``want_shared``; a target that only receives stays here: a wake-up from ``recv`` is one step
            # less than one from epoll). After a small write it acknowledged, this thread reads without sleeping
            # for a while before it blocks (``recv_spin``), while the next message comes within that while and the
            # host has a core to spare: a sender of back-to-back small batches then finds it awake. Then shared reading: this thread waits
            # for readability (epoll) and reads under the socket's reader token, so that a caller waiting for its
            # own small batch can take the token and read its ack itself (``await_rows``), one thread wake-up fewer
            # on its critical path. While a caller holds the token the socket is left out of this thread's epoll
            # set (its events mask 0), so the ack does not wake this thread too; hang-ups and errors still do.
            spin = s.spin = AdaptiveSpin(self._recv_spin)
            mono = time.monotonic
            while not s.want_shared:
                # only after an acknowledged small write (a small batch): its sender may send the next one as soon
                # as it has the ack; after a chunk, an ack or an unacked write the next message is not that close
                if rx.pos == rx.end and st.pop("small", False) and spin.budget:
                    until = spin.until(mono())
                    if until:
                        hit = rx.ready()
                        while not hit and mono() < until:
                            hit = rx.ready()
                        spin.done(hit)
                self._read_one(ep, s, rx, st)
            poller = select.epoll(1)
            poller.register(s.fd, _EPOLLIN)
            st["wait"] = select.poll()  # a caller's wait for readability, with a timeout (``await_rows``)
            st["wait"].register(s.fd, select.POLLIN)
            s.rx_state = st
            s.poller = poller
            token = s.reader
            try:
                while True:
                    if rx.pos == rx.end:
                        poller.poll()
                    with token:
                        if rx.ready():  # else a caller read what woke this thread
                            self._read_one(ep, s, rx, st)
                            while rx.pos < rx.end:  # the rest of what one receive took; more wakes the poll
                                self._read_one(ep, s, rx, st)
            finally:
                with token:
                    s.poller = None
                    poller.close()
        except Exception as e:  # noqa: BLE001 — EOF, reset, or a malformed stream: the link is unusable
            if ep.alive and not self._closed:
                log.debug("receive on %s/%d ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")

    def _read_one(self, ep: TcpEndpoint, s: _Sock, rx, st: dict) -> None:
        """Read and handle one message from socket ``s`` (through ``rx``, its look-ahead reader or the bare socket);
        blocks until the whole message is read. Raises on EOF, a reset or a malformed stream."""
        sess = s.sess
        if rx is not s.sock:
            magic, typ, hflags, _, count, seq, blen = rx.unpack(HDR)
            if sess is not None:  # the header is checked with what its tag covers, before anything acts on it
                p = rx.pos - 48
                mac = sess._rx.copy()  # Session.rx_begin, inline: this runs once per frame
                mac.update(_SEQ.pack(sess.rx_n))
                sess.rx_n += 1
                mac.update(rx.view[p:p + 32])
                mac.update(_NO_TAG)
                tag = bytes(rx.view[p + 32:p + 48])
        else:
            recv_exact(rx, st["hview"])
            magic, typ, hflags, _, count, seq, blen = HDR.unpack(st["hdr"])
            if sess is not None:
                mac = sess._rx.copy()
                mac.update(_SEQ.pack(sess.rx_n))
                sess.rx_n += 1
                mac.update(st["hview"][:32])
                mac.update(_NO_TAG)
                tag = bytes(st["hview"][32:48])
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        if typ == T_ACK:
            if count > MAX_TABLE or blen != count:
                raise ValueError(f"ack of {count} statuses in {blen} B (at most {MAX_TABLE})")
            if rx is not s.sock:  # the statuses are usually in the look-ahead buffer already
                body = bytes(rx.take(count, memoryview(st["stage"])))
            else:
                body = bytearray(count)
                recv_exact(rx, memoryview(body))
                body = bytes(body)
            if sess is not None:
                mac.update(body)
                if not compare_digest(mac.digest(), tag):
                    sess.rx_end(mac, tag)  # raises, naming the connection
            ep.on_ack(seq, body)
        elif typ in (T_WRITE, T_REQ, T_NOTIFY):
            if count > MAX_TABLE:
                raise ValueError(f"piece count {count} above {MAX_TABLE}")
            tb = count * PIECE_DT.itemsize
            if blen < tb:
                raise ValueError(f"body {blen} B shorter than its table {tb} B")
            whole = hflags & H_WHOLE and typ == T_WRITE and count == 1
            if blen - tb > (MAX_WHOLE if whole else ep.max_payload):
                raise ValueError(f"payload {blen - tb} B above the peer's message size {ep.max_payload} B")
            if typ == T_WRITE and blen <= SMALL_MESSAGE and self._small_writes:
                self._on_small_write(ep, s, seq, count, tb, blen, st, hflags, (mac, tag) if sess else None)
                return
            if len(st["table"]) < tb:
                st["table"] = bytearray(tb)
            tview = memoryview(st["table"])[:tb]
            recv_exact(rx, tview)
            if sess is not None:
                mac.update(tview)
                if not compare_digest(mac.digest(), tag):
                    sess.rx_end(mac, tag)
            table = np.frombuffer(st["table"], dtype=PIECE_DT, count=count).copy()
            if whole and blen - tb > ep.max_payload and not (
                    table["addr"][0] == table["waddr"][0] and table["len"][0] == table["wlen"][0]):
                raise ValueError(f"a message of {blen - tb} B above the peer's message size is not one whole "
                                 f"write")
            self._on_message(ep, s, typ, seq, table, blen - tb, st, ack=not hflags & H_NOACK)
        else:
            if typ not in self._OTHER_TYPES:
                raise ValueError(f"{self.name} fabric got unexpected message type {typ}")
            if count > MAX_TABLE or blen > count + MAX_CTRL_BODY:
                raise ValueError(f"control message of {count} statuses in {blen} B is implausible")
            body = bytearray(blen)
            recv_exact(rx, memoryview(body))
            if sess is not None:
                mac.update(body)
                if not compare_digest(mac.digest(), tag):
                    sess.rx_end(mac, tag)  # raises, naming the connection
            self._on_other(ep, s, typ, count, seq, bytes(body))

    _OTHER_TYPES: tuple = ()  # message types besides WRITE / REQ / ACK this fabric receives (ipc: GRANT, DONE)

    def _on_other(self, ep: TcpEndpoint, s: _Sock, typ: int, count: int, seq: int, body: bytes) -> None:
        raise ValueError(f"{self.name} fabric got unexpected message type {typ}")

    def _send_ctrl(self, ep: TcpEndpoint, s: _Sock, payload: bytes) -> None:
        """Send a small control message (ack): at once when the socket is idle, else through its sender thread
        (the receiving thread that calls this never waits on a send)."""
        if not self._send_now(s, [payload]):
            ep.send_ctrl(s, payload)

    def _validate_pieces(self, table: np.ndarray) -> tuple:
        """Check every piece against this fabric's regions and pin the regions it uses (deregister waits).
        Returns (statuses bytearray, regions per piece, pinned rkeys)."""
        return self._validate_lists(table["addr"].tolist(), table["len"].tolist(), table["waddr"].tolist(),
                                    table["wlen"].tolist(), table["rkey"].tolist())

    def _validate_lists(self, addrs, lens, waddrs, wlens, rkeys) -> tuple:
        """``_validate_pieces`` of a table given as one list of ints per column."""
        n = len(lens)
        statuses = bytearray(n)
        regions: List[Optional[MemoryRegion]] = [None] * n
        pinned = set()
        with self._region_cv:
            for i in range(n):
                mr = self._regions.get(rkeys[i])
                if mr is None:
                    statuses[i] = ST_BAD_RKEY
                    continue
                a, ln, wa, wl = addrs[i], lens[i], waddrs[i], wlens[i]
                # the whole write must be inside the region and the piece inside the whole write
                if not (ln >= 1 and mr.contains(wa, wl) and wa <= a and a + ln <= wa + wl):
                    statuses[i] = ST_BOUNDS
                    continue
                regions[i] = mr
                pinned.add(mr.rkey)
            for k in pinned:
                self._region_use[k] = self._region_use.get(k, 0) + 1
        return statuses, regions, pinned

    def _unpin(self, pinned) -> None:
        with self._region_cv:
            for k in pinned:
                c = self._region_use.get(k, 0) - 1
                if c <= 0:
                    self._region_use.pop(k, None)
                else:
                    self._region_use[k] = c
            self._region_cv.notify_all()

    def _on_message(self, ep: TcpEndpoint, s: _Sock, typ: int, seq: int, table: np.ndarray, payload: int,
                    st: dict, ack: bool = True) -> None:
        """Receive one WRITE message (table read, payload still on the socket) and put its accepted pieces in
        place; ``ack`` False for an unacked write (header flag ``H_NOACK``), whose sender waits for no ACK."""
        if typ != T_WRITE:
            raise ValueError(f"tcp fabric got message type {typ}")
        lens = table["len"].tolist()
        if sum(lens) != payload:
            raise ValueError(f"payload {payload} B does not match the table's {sum(lens)} B")
        statuses, regions, pinned = self._validate_pieces(table)
        landed = False
        try:
            mr = regions[0] if len(lens) == 1 else None
            handler = self._landing.get(mr.rkey) if mr is not None and self._landing else None
            if handler is not None:
                addr, _, waddr, wlen, _, flags, imm, _ = table[0].tolist()  # ints: one call, not one per field
            if handler is not None and flags & F_IMM and addr == waddr and lens[0] == wlen:
                self._place_landed(ep, st.get("rx", s.sock), handler, mr, addr, lens[0], imm, st)
                landed = True
            else:
                self._place(st.get("rx", s.sock), table, lens, statuses, regions, st)
        finally:
            self._unpin(pinned)
        self._finish_message(ep, s, seq, table, statuses, ack=ack, hold=landed and ack)

    def _place_landed(self, ep: TcpEndpoint, sock, handler, mr: MemoryRegion, addr: int, length: int, imm: int,
                      st: dict) -> None:
        """Receive one whole write with an immediate into a region with a landing handler
        (``set_landing_handler``): the handler reads what it needs and may name destinations for byte ranges of
        the write, which are then received straight there; everything else lands in ``mr``. Runs with ``mr``
        pinned (checked by ``_validate_pieces``)."""
        ent = self._host_views.get(mr.rkey)
        own = ent[1] if ent is not None and ent[0] is mr else raw_view(mr.addr, mr.length, writable=True)
        base = mr.addr
        pos = addr
        end = addr + length

        def read(n: int) -> memoryview:
            nonlocal pos
            n = max(0, min(int(n), end - pos))
            v = own[pos - base:pos - base + n]
            recv_exact(sock, v)
            pos += n
            return v

        plan = None
        try:
            plan = handler(ep.peer_id, addr, length, imm, read)
            if plan is not None:
                dsts, lens, offs = plan.dsts, plan.lens, plan.offs
                # an empty plan is bad too: the span of its ranges (``_pin_span``) has no ends
                ok = len(dsts) == len(lens) == len(offs) >= 1
                if ok:
                    # every range of at least one byte, after what was read and after the range before it, and
                    # inside the write: builtin reductions (C loops), where a Python step per range cost more
                    ends = list(map(add, offs, lens))
                    ok = min(lens) >= 1 and offs[0] >= pos - addr and ends[-1] <= length \
                        and all(map(le, ends, islice(offs, 1, None)))
                if not ok:
                    log.warning("%s: landing handler gave a bad plan for a write of %d B; landing it whole", self._id,
                                length)
                    plan = None
        except Exception:  # noqa: BLE001 — a handler bug must not break the link: the write lands as usual
            log.exception("%s: landing handler failed; landing the write whole", self._id)
            plan = None
        if plan is not None:
            pinned = self._pin_span(dsts, lens)
            try:
                dview = pinned[1] if pinned is not None else None
                views = []
                if dview is not None and offs[0] + addr == pos and all(map(eq, ends, islice(offs, 1, None))):
                    # the ranges follow each other in the write (no padding, nothing for the slot): one view of
                    # the region per range, made by C loops
                    starts = list(map(sub, dsts, repeat(pinned[2], len(dsts))))
                    views = list(map(dview.__getitem__, map(slice, starts, map(add, starts, lens))))
                    pos = ends[-1] + addr
                else:
                    for d, k, o in zip(dsts, lens, offs):
                        o += addr
                        if o > pos:
                            views.append(own[pos - base:o - base])
                        if dview is not None:
                            d -= pinned[2]
                            views.append(dview[d:d + k])
                        else:
                            views.append(raw_view(d, k, writable=True))
                        pos = o + k
                recv_views(sock, views)
            finally:
                if pinned is not None:
                    self._unpin((pinned[0],))
        if pos < end:
            recv_exact(sock, own[pos - base:end - base])
        if plan is not None:
            plan.done()

    def _pin_span(self, dsts, lens) -> Optional[tuple]:
        """(rkey, writable view, base address) of a host region registered here that holds every range
        (``dsts[i]``, ``lens[i]``), pinned against ``deregister`` (``_unpin``); None when no one region does."""
        lo, hi = min(dsts), max(map(add, dsts, lens))
        with self._region_cv:
            for rk, (m, view) in list(self._host_views.items()):
                # still registered (deregister drops it before it waits for pinned placements, under this lock)
                if m.addr <= lo and hi <= m.addr + m.length and self._regions.get(rk) is m:
                    self._region_use[rk] = self._region_use.get(rk, 0) + 1
                    return rk, view, m.addr
        return None

    def _on_small_write(self, ep: TcpEndpoint, s: _Sock, seq: int, count: int, tb: int, blen: int,
                        st: dict, hflags: int = 0, mac=None) -> None:
        """``_on_message`` for a WRITE message of at most ``SMALL_MESSAGE`` bytes: table and payload taken in one
        receive, the table read by one ``struct`` call, every accepted piece copied to its place from there. The
        checks are ``_validate_pieces``'s, before anything is placed; a table of whole writes into one host region
        (what a ``WriteRows`` post sends) is checked by its extremes."""
        view = st["rx"].take(blen, memoryview(st["stage"]))
        if mac is not None:  # the header and table checked before the table is read
            mac[0].update(view[:tb])
            if not compare_digest(mac[0].digest(), mac[1]):
                s.sess.rx_end(*mac)
        cols = _table_struct(count).unpack_from(view)
        addrs, lens, waddrs, wlens, rkeys, flags = cols[0::8], cols[1::8], cols[2::8], cols[3::8], cols[4::8], cols[5::8]
        payload = blen - tb
        if sum(lens) != payload:
            raise ValueError(f"payload {payload} B does not match the table's {sum(lens)} B")
        statuses = None
        if count and addrs == waddrs and lens == wlens and rkeys.count(rkeys[0]) == count and min(lens) > 0:
            rk = rkeys[0]
            lo, hi = min(addrs), max(map(add, addrs, lens))
            with self._region_lock:
                ent = self._host_views.get(rk)
                mr = self._regions.get(rk)
                if ent is not None and ent[0] is mr and lo >= mr.addr and hi <= mr.addr + mr.length:
                    # placed while holding the lock instead of pinning the region: ``deregister`` waits for this
                    # lock before it returns, and the copies of at most SMALL_MESSAGE bytes never block
                    statuses = bytearray(count)
                    dst, base = ent[1], mr.addr
                    off = tb
                    for a, k in zip(addrs, lens):
                        a -= base
                        dst[a:a + k] = view[off:off + k]
                        off += k
            if statuses is not None:
                view.release()
        if statuses is None:
            statuses, regions, pinned = self._validate_lists(addrs, lens, waddrs, wlens, rkeys)
            try:
                off = tb
                gpu = []
                views = self._host_views
                for i, mr in enumerate(regions):
                    k = lens[i]
                    if mr is not None:
                        ent = views.get(mr.rkey)
                        if ent is not None and ent[0] is mr:  # the view of this very region (checked above)
                            a = addrs[i] - mr.addr
                            ent[1][a:a + k] = view[off:off + k]
                        elif mr.device == DEVICE_HOST:  # deregistered meanwhile: still pinned, deregister waits
                            raw_view(addrs[i], k, writable=True)[:] = view[off:off + k]
                        else:
                            gpu.append((i, off - tb, k))
                    off += k
                if gpu:  # GPU regions: staged through pinned memory, as ``_place`` does
                    host = pinned_buffer(st, payload)
                    raw_view(host.data_ptr(), payload, writable=True)[:] = view[tb:blen]
                    self._place_gpu(host, gpu, addrs, regions, statuses, st)
            finally:
                view.release()
                self._unpin(pinned)
        events = []
        if any(flags):
            imms = cols[6::8]
            for i, f in enumerate(flags):
                if f & F_IMM and statuses[i] == ST_OK:
                    events.append(Completion(0, Opcode.RECV_IMM, ep.peer_id, wlens[i], imms[i]))
        if not hflags & H_NOACK:
            self._send_ctrl(ep, s, HDR.pack(MAGIC, T_ACK, 0, 0, count, seq, count) + bytes(statuses))
            st["small"] = True  # the receive thread may spin for the next one (``recv_spin``)
        elif statuses.count(0) != count:
            i = next(i for i, v in enumerate(statuses) if v)
            log.warning("%s: refused an unacked write from %s: %d B at 0x%x rkey 0x%x: %s", self._id, ep.peer_id,
                        wlens[i], waddrs[i], rkeys[i], _STATUS_TEXT.get(statuses[i], statuses[i]))
        ep.deliver_in_order(seq, events)

    def _finish_message(self, ep: TcpEndpoint, s: _Sock, seq: int, table: np.ndarray, statuses,
                        ack: bool = True, hold: bool = False) -> None:
        """Ack the sender (unless ``ack`` is False: it completed the message itself), then release this message's
        RECV_IMM events in order. ``hold``: the ACK waits while the events are delivered, for an unacked write
        that their handler posts to this peer to take it along (``_post_unacked``), and is sent on its own after
        them otherwise."""
        events = []
        flags = table["flags"]
        if len(flags) == 1:  # one piece (a whole write, a relay chunk): its row as ints, no numpy steps
            _, _, _, wlen, _, f, imm, _ = table[0].tolist()
            if f & F_IMM and statuses[0] == ST_OK:
                events.append(Completion(0, Opcode.RECV_IMM, ep.peer_id, wlen, imm))
        elif flags.any():
            for i in np.nonzero(flags & F_IMM)[0].tolist():
                if statuses[i] == ST_OK:
                    events.append(Completion(0, Opcode.RECV_IMM, ep.peer_id, int(table["wlen"][i]),
                                             int(table["imm"][i])))
        if ack:
            payload = HDR.pack(MAGIC, T_ACK, 0, 0, len(statuses), seq, len(statuses)) + bytes(statuses)
            if hold and events:
                held = self._held.__dict__
                held["ack"] = (ep, s, payload)
                try:
                    ep.deliver_in_order(seq, events)
                finally:
                    if held.pop("ack", None) is not None:
                        self._send_ctrl(ep, s, payload)
                return
            self._send_ctrl(ep, s, payload)
        ep.deliver_in_order(seq, events)

    def _place(self, sock: socket.socket, table, lens, statuses, regions, st: dict) -> None:
        """Read the message payload from ``sock`` and put each accepted piece at its address."""
        addrs = table["addr"].tolist()
        n = len(lens)
        i = 0
        gpu_pieces = []
        while i < n:
            ln = lens[i]
            mr = regions[i]
            if ln >= SMALL_PIECE and mr is not None and mr.device == DEVICE_HOST:
                recv_exact(sock, raw_view(addrs[i], ln, writable=True))  # zero copy: straight to its place
                i += 1
                continue
            if ln >= SMALL_PIECE and mr is None:
                self._discard(sock, ln, st)
                i += 1
                continue
            # a run of small pieces (or a GPU piece): one recv into staging, then scatter
            j, run = i, 0
            while j < n and (lens[j] < SMALL_PIECE or (regions[j] is not None and regions[j].device >= 0)) \
                    and (run == 0 or run + lens[j] <= (8 << 20)):
                run += lens[j]
                j += 1
            if any(regions[k] is not None and regions[k].device >= 0 for k in range(i, j)):
                stage = pinned_buffer(st, run)  # pinned: the H2D copies run async on the copy engine
                base = stage.data_ptr()
                recv_exact(sock, raw_view(base, run, writable=True))
            else:
                if len(st["stage"]) < run:
                    st["stage"] = bytearray(run)
                stage = st["stage"]
                recv_exact(sock, memoryview(stage)[:run])
                base = ctypes.addressof(ctypes.c_char.from_buffer(stage))
            off = 0
            for k in range(i, j):
                mr = regions[k]
                if mr is not None:
                    if mr.device == DEVICE_HOST:
                        ctypes.memmove(addrs[k], base + off, lens[k])
                    else:
                        gpu_pieces.append((k, off, lens[k]))
                off += lens[k]
            if gpu_pieces:
                self._place_gpu(stage, gpu_pieces, addrs, regions, statuses, st)
                gpu_pieces = []
            i = j

    def _discard(self, sock: socket.socket, n: int, st: dict) -> None:
        stage = memoryview(st["stage"])
        while n:
            k = min(n, len(stage))
            recv_exact(sock, stage[:k])
            n -= k

    def _place_gpu(self, host, pieces, addrs, regions, statuses, st: dict) -> None:
        """Copy GPU pieces from the pinned staging tensor ``host`` (offsets increasing) to their devices: big
        pieces one H2D copy each, small ones one H2D of their span into device scratch + one scatter launch."""
        import torch
        by_dev: Dict[int, list] = {}
        for k, off, ln in pieces:
            by_dev.setdefault(regions[k].device, []).append((k, off, ln))
        for dev, items in by_dev.items():
            stream = cuda_stream(st, dev)
            try:
                with torch.cuda.device(dev), torch.cuda.stream(stream):
                    small = [it for it in items if it[2] < BIG_GPU_PIECE]
                    for k, off, ln in items:
                        if ln >= BIG_GPU_PIECE:
                            memcpy_async(addrs[k], host.data_ptr() + off, ln, stream)
                    if small:
                        lo, hi = small[0][1], small[-1][1] + small[-1][2]
                        scratch = device_scratch(st, dev, hi - lo)
                        scratch[:hi - lo].copy_(host[lo:hi], non_blocking=True)
                        sp = scratch.data_ptr() - lo
                        gpu_batch_copy([sp + off for _, off, _ in small], [addrs[k] for k, _, _ in small],
                                       [ln for _, _, ln in small], dev)
                # the staging buffers are reused next and the ack promises placed bytes: wait for the copies
                stream.synchronize()
            except Exception as e:  # noqa: BLE001
                log.error("placing %d piece(s) on cuda:%d failed: %s", len(items), dev, e)
                for k, _, _ in items:
                    statuses[k] = ST_FAILED
