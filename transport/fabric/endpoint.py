"""An endpoint of a socket fabric: the sockets of one peer connection, the sequence numbers of each direction, the
sender's pending messages and their in-order completions, the target's in-order delivery of RECV_IMM events.
"""
from __future__ import annotations

import collections
import logging
import socket
import struct
import threading
import time
from typing import Dict, List, Optional

from transport.errors import PeerLost
from transport.fabric.base import Completion, Endpoint
from transport.fabric.messages import OutMsg
from transport.fabric.sockets import Sock
from transport.fabric.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)


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
