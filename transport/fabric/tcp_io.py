"""The I/O threads of the tcp fabric: a fixed number per fabric, whatever the number of peers and sockets.

* Readers (``threads`` of them) all wait in one epoll set that holds every socket of the fabric, each registered
  one-shot (``EPOLLONESHOT``): a socket that turns readable wakes one reader, which takes the socket's reader token
  (``Sock.reader``), reads what is there -- whole messages, each through ``SocketFabric.read_one`` -- and arms
  the socket again. So a socket is read by one thread at a time, its messages in order, and no thread waits on an
  idle socket. A reader that does not get the token leaves the socket alone: whoever holds it (another reader, or
  a caller reading its own ack, ``TcpPoster.await_rows``) arms the socket again after letting go, so no readiness
  is lost. After an acknowledged small write a reader keeps reading that socket without sleeping for a while
  (``recv_spin``, the socket's ``AdaptiveSpin``): the next small batch of a sender that waits for each ack comes
  within it.
* Senders (``threads`` of them) serve a queue of sockets that have something to send (``Sock.ctrl`` / ``data``):
  a message queued on an idle socket puts the socket at the back of the queue (``Sock.wake``); a sender takes
  it, sends control messages first, then up to ``TURN`` messages, and puts it back behind the others while it
  has more. A socket is in the queue at most once, so its messages leave in order, one sender at a time.

Staging buffers (the look-ahead buffer a header read fills, the payload staging, the piece tables) belong to the
thread that reads, not to the socket: a socket's look-ahead reader (``Rx``) borrows the reading thread's buffer
for one turn, and leaves it empty. Memory per peer is then its sockets and their bookkeeping.

A peer that stops reading, or stops in the middle of a message, holds a thread only for ``io_timeout`` seconds
(``SO_SNDTIMEO`` / ``SO_RCVTIMEO`` on its sockets, the fabric's ``ack_timeout``): the send or receive then fails and
fails the endpoint, as a hung peer's unacknowledged message does after the same time. Receiving threads never wait
on a send (acks go out by ``send_now`` or through the senders), so two peers that both send cannot deadlock.

An endpoint that fails (EOF, reset, a malformed stream, ``fail()``) has its sockets shut down: the reader that
next touches one sees the end and takes the socket out of the epoll set (``Sock.dropped``); only then, and once
no sender holds it, may its file descriptor be closed (``Sock.busy``).
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Dict, List

from transport.fabric.sockets import Rx, Sock, send_ctrl_frames
from transport.fabric.spin import AdaptiveSpin
from transport.fabric.wire import HDR, SMALL_MESSAGE

log = logging.getLogger(__name__)

_ARM = getattr(select, "EPOLLIN", 1) | getattr(select, "EPOLLONESHOT", 1 << 30)


def reader_state(stage: int) -> dict:
    """One reading thread's buffers: the look-ahead buffer its turns lend to a socket's ``Rx``, the payload
    staging (``stage`` bytes, grown on demand by large runs of small pieces), the piece tables, the header."""
    hdr = bytearray(HDR.size)
    buf = bytearray(HDR.size + SMALL_MESSAGE)
    return {"table": bytearray(64 * 48), "stage": bytearray(stage), "hdr": hdr, "hview": memoryview(hdr),
            "rxbuf": buf, "rxview": memoryview(buf), "rx": None}


class TcpIo:
    """The readers and senders of one ``TcpFabric`` (module docstring). ``threads``: readers, and as many senders;
    ``io_timeout``: seconds one blocking send or receive may wait on a peer; ``recv_spin``: a reader's spin after
    a small write (seconds)."""

    TURN = 8  # messages a sender sends on one socket before it serves the next socket in the queue
    READ_TURN = 16  # messages a reader reads from one socket before it lets the other readable sockets come first
    STAGE = 1 << 20  # a reader's payload staging, bytes

    def __init__(self, fabric, threads: int, io_timeout: float, recv_spin: float):
        self._fab = fabric
        self.threads = int(threads)
        self.io_timeout = float(io_timeout)
        self.recv_spin = float(recv_spin)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # level-triggered: once written, every reader that waits or comes to wait sees it (close)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._lock = threading.Lock()  # the epoll registrations and ``_socks``
        self._socks: Dict[int, tuple] = {}  # fd -> (endpoint, socket), the sockets in the epoll set
        self._tx_cv = threading.Condition()
        self._tx_q: collections.deque = collections.deque()  # (endpoint, socket) with something to send
        self._stop = False
        self._workers: List[threading.Thread] = []

    def start(self, label: str) -> None:
        for i in range(self.threads):
            for fn, role in ((self._read_loop, "read"), (self._send_loop, "send")):
                t = threading.Thread(target=fn, daemon=True, name=f"pxn-tcp-{role}{i}-{label}")
                self._workers.append(t)
                t.start()

    def stop(self) -> None:
        """Stop every thread and wait (2 s each at most); the endpoints were failed before (their sockets shut
        down, which ends a blocked send or receive)."""
        with self._lock:
            if self._stop:
                return
            self._stop = True
        with self._tx_cv:
            self._tx_cv.notify_all()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        me = threading.current_thread()
        for t in self._workers:
            if t is not me:
                t.join(timeout=2.0)
        with self._lock:
            self._socks.clear()
            self._epoll.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # --- sockets in and out ----------------------------------------------------------------------------------
    def add(self, ep) -> None:
        """Serve the sockets of a new endpoint: their time limits, their spin, their sends through the queue, and
        every one in the epoll set."""
        tv = struct.pack("ll", int(self.io_timeout), int((self.io_timeout % 1) * 1e6))
        for s in ep.socks:
            for opt in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
                try:
                    s.sock.setsockopt(socket.SOL_SOCKET, opt, tv)
                except OSError:
                    pass
            s.rx = Rx(s.sock, 0)
            s.spin = AdaptiveSpin(self.recv_spin)
            s.pooled = True
            with s.cv:
                # the endpoint's own method, bound to this socket and the queue: no call of ours around it
                s.wake = functools.partial(ep.queue_socket, s, self._tx_q, self._tx_cv)
                if s.ctrl or s.data:
                    s.wake()
        with self._lock:
            for s in ep.socks:
                if self._stop:
                    s.dropped = True
                    continue
                self._socks[s.fd] = (ep, s)
                s.poller = self
                self._epoll.register(s.fd, _ARM)

    def disarm(self, s: Sock) -> bool:
        """Keep the readers off socket ``s`` (for its reader token's holder, a caller reading its ack itself);
        False: the socket is out of the epoll set (its endpoint failed)."""
        with self._lock:
            if s.dropped:
                return False
            try:
                self._epoll.modify(s.fd, 0)
            except (OSError, ValueError):
                return False
            return True

    def rearm(self, ep, s: Sock) -> None:
        """Let the readers see socket ``s`` again (after whoever held its reader token let go); a socket of a failed
        endpoint leaves the epoll set instead, for good."""
        with self._lock:
            if s.dropped:
                return
            if ep.alive and not self._stop:
                try:
                    self._epoll.modify(s.fd, _ARM)
                    return
                except (OSError, ValueError):
                    pass
            s.dropped = True
            s.poller = None
            self._socks.pop(s.fd, None)
            try:
                self._epoll.unregister(s.fd)
            except (OSError, ValueError):
                pass

    # --- readers ----------------------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        st = reader_state(self.STAGE)
        poll = self._epoll.poll
        socks = self._socks
        while not self._stop:
            try:
                events = poll(-1, 1)
            except (OSError, ValueError):  # the set was closed: the fabric is closing
                return
            for fd, _ in events:
                ent = socks.get(fd)
                if ent is not None:
                    try:
                        self._serve(ent[0], ent[1], st)
                    except Exception:  # noqa: BLE001 — a failing failure path must not take a shared thread along
                        log.exception("tcp reader: serving %s/%d failed", ent[0].peer_id, ent[1].index)

    def _serve(self, ep, s: Sock, st: dict) -> None:
        """One reader's turn on readable socket ``s``: every message there, then a spin after a small write."""
        token = s.reader
        if not token.acquire(False):
            return  # its holder arms the socket again after letting go
        fab = self._fab
        try:
            rx = s.rx
            rx.attach(st["rxbuf"], st["rxview"])
            st["rx"] = rx
            read_one = fab.read_one
            spin = s.spin
            mono = time.monotonic
            n = self.READ_TURN
            while n > 0 and rx.ready():  # else a caller read what woke this reader
                read_one(ep, s, rx, st)
                n -= 1
                while rx.pos < rx.end:  # the rest of what one receive took; more in the socket is seen below
                    read_one(ep, s, rx, st)
                    n -= 1
                # only after an acknowledged small write (a small batch): its sender may send the next one as soon
                # as it has the ack; after a chunk, an ack or an unacked write the next message is not that close
                # (not at the end of the turn: a hit would leave read-ahead bytes nobody reads)
                small = st.pop("small", False)
                if n <= 0 or not (small and spin.budget):
                    continue
                until = spin.until(mono())
                if until:
                    hit = rx.ready()
                    while not hit and mono() < until:
                        hit = rx.ready()
                    spin.done(hit)
        except Exception as e:  # noqa: BLE001 — EOF, reset, or a malformed stream: the link is unusable
            if ep.alive and not fab.closed:
                log.debug("receive on %s/%d ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")
        finally:
            st["rx"] = None
            token.release()
        self.rearm(ep, s)

    # --- senders ----------------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        q, cv = self._tx_q, self._tx_cv
        while True:
            with cv:
                while not q and not self._stop:
                    cv.wait()
                if self._stop:
                    return
                ep, s = q.popleft()
            if self._drain(ep, s):
                with cv:  # its turn is over: behind the other sockets with something to send
                    q.append((ep, s))
                    cv.notify()

    def _drain(self, ep, s: Sock) -> bool:
        """Send what socket ``s`` has queued, control messages first, ``TURN`` messages at most; True: more is
        queued (the socket stays in the queue)."""
        transmit = self._fab.transmit
        try:
            for _ in range(self.TURN):
                # taken before the queues are read: the rest of a message that a thread began to send itself
                # (``send_now``) is at the head of ``ctrl`` by the time the lock is free
                with s.wire_lock:
                    with s.cv:
                        if s.closed or (not s.ctrl and not s.data):
                            s.queued = False
                            return False
                        ctrl = list(s.ctrl)
                        s.ctrl.clear()
                        msg = s.data.popleft() if (not ctrl and s.data) else None
                    if ctrl:
                        send_ctrl_frames(s, ctrl)
                    if msg is not None:
                        transmit(ep, s, msg)
            return True
        except Exception as e:  # noqa: BLE001 — any send failure (a timeout included) means the link is gone
            with s.cv:
                s.queued = False
            if ep.alive and not self._fab.closed:
                log.debug("send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")
            return False
