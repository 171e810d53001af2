"""The socket-message layer that the tcp and ipc fabrics share: options, the registered regions (``RegionBook``),
the connection set (``Connections``), the checks of a post and its cutting into messages, the sender threads, the
receive loop that reads and checks every frame, and the in-order release of acks and RECV_IMM events.

What a message does at the target is each fabric's own (its landing strategy: tcp places payload; or its own
``_on_message``: ipc grants and copies), and so is how a queued message goes out (``transmit``).

Threads: one listener and one watchdog per fabric (one short-lived thread per connection while it authenticates),
and what serves the sockets (``start_endpoint``): by default (ipc) per socket one receiver thread (never blocks on
sending) and one sender thread (owns all sends on the socket, control messages first), which rules out the
cross-peer deadlock where both sides block sending while nobody drains; the tcp fabric instead serves every socket
with a fixed number of I/O threads per fabric (``transport.fabric.tcp_io``), under the same rules.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from hmac import compare_digest
from typing import Callable, List, Optional, Sequence

import numpy as np

from transport import auth
from transport.errors import FabricClosed, UnknownPeer
from transport.fabric.base import (
    DEVICE_HOST, IMM_MAX, Completion, CompletionQueue, Endpoint, Fabric, MemoryRegion, Opcode, WriteBatch,
    WriteRequest, check_range,
)
from transport.fabric.connections import Connections
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.messages import OutMsg, batch_messages, write_messages
from transport.fabric.region_book import RegionBook
from transport.fabric.sockets import Sock, recv_exact, send_ctrl_frames, send_now
from transport.fabric.wire import (
    F_IMM, H_NOACK, H_TOKEN, H_WHOLE, HDR, MAGIC, MAX_CTRL_BODY, MAX_MESSAGE_BYTES, MAX_TABLE, MAX_WHOLE, PIECE_DT,
    SMALL_MESSAGE, ST_OK, T_ACK, T_NOTIFY, T_REQ, T_WRITE, TAIL, VECTOR_MIN, ack_frame, check_token, rx_head,
)

log = logging.getLogger(__name__)


class SocketFabric(Fabric):
    """One-sided writes as messages over authenticated sockets; the base of ``TcpFabric`` and ``IpcFabric``.

    Options: ``hostname`` to bind (default 127.0.0.1), ``port`` (0 = ephemeral), ``connections_per_peer``
    (sockets striped per endpoint, default 2..4 by core count), ``message_bytes`` (target payload bytes per wire
    message), ``connect_timeout`` (seconds), ``keepalive`` (seconds of silence before a vanished host is declared
    dead via TCP keepalive / TCP_USER_TIMEOUT, default 3), ``ack_timeout`` (seconds the oldest pending message may
    wait for its ack before the endpoint is failed, default 30: catches a peer process that hangs while its kernel
    keeps the TCP connection up), ``secret`` (shared secret of ``transport.auth``, at least 16 bytes; None:
    ``PXN_SECRET``, else the per-user secret file on a loopback ``hostname``; elsewhere ``insecure`` must be set),
    ``insecure`` (run without a secret when none is set; None: ``PXN_INSECURE``), ``handshake_timeout`` (seconds an
    incoming connection has to authenticate and say hello, default 5), ``guard_claims`` (the engine's mode: an
    incoming connection is taken only for a peer id announced by ``expect_peer``, and never replaces a live
    endpoint of that id unless announced again), ``max_peers_per_addr`` (live incoming endpoints per source
    address, default 256).

    ``landing``: how WRITE messages land at this target, a strategy object the fabric builds from itself
    (``landing(fabric)``, once its regions exist; tcp: ``transport.fabric.tcp_landing.TcpLanding``). It provides
    ``on_message`` (a WRITE whose table ``read_one`` read and checked, its payload still on the socket) and
    ``on_small_write`` (a WRITE of at most ``SMALL_MESSAGE`` bytes, read whole through the socket's look-ahead
    reader), and acknowledges through the fabric's ``send_ctrl`` / ``finish_message``. None (ipc): the fabric's
    own ``_on_message`` handles every message.
    """

    def __init__(self, hostname: str = "127.0.0.1", port: int = 0, connections_per_peer: Optional[int] = None,
                 message_bytes: int = 4 << 20, connect_timeout: float = 10.0, keepalive: float = 3.0,
                 ack_timeout: float = 30.0, secret=None, handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
                 guard_claims: bool = False, max_peers_per_addr: int = 256, insecure: Optional[bool] = None,
                 landing: Optional[Callable[["SocketFabric"], object]] = None):
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
        self.guard_claims = bool(guard_claims)
        self.max_peers_per_addr = int(max_peers_per_addr)
        self._closed = False
        self._lock = threading.Lock()  # guards ``_closed``
        self._cq = CompletionQueue()
        # per receiving thread: the ACK of a landed write whose RECV_IMM is being delivered, held so that an unacked
        # write its handler posts back to the same peer (a receiver's ack of the chunk) leaves in the same send
        self._held = threading.local()
        self._conns = Connections(self, hostname, port, connections_per_peer, connect_timeout, keepalive,
                                  ack_timeout, auth.resolve_secret(secret, hostname, insecure), handshake_timeout,
                                  guard_claims, max_peers_per_addr)
        self.hostname = hostname
        self.port = self._conns.port
        self._id = self._conns.owner
        book = self._book = RegionBook(self._id)
        # the book's table and checks under the names the ipc fabric's message path uses: no attribute hop per
        # message (the tcp landing strategy keeps its own)
        self._regions = book.regions
        self._validate_pieces = book.validate_pieces
        self._unpin = book.unpin
        self.landing = landing(self) if landing is not None else None

    def _start(self) -> None:
        """Start listening and watching: the last step of a fabric's construction, once all its parts exist."""
        self._conns.start()
        log.debug("%s fabric listening on %s", self.name, self._id)

    # --- Fabric API -----------------------------------------------------------------------------------------
    @property
    def local_id(self) -> str:
        return self._id

    @property
    def book(self) -> RegionBook:
        """The registered regions and their checks (``RegionBook``), shared with the fabric's sender and landing
        parts."""
        return self._book

    @property
    def closed(self) -> bool:
        """True once ``close`` began."""
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise FabricClosed(f"{self.name} fabric {self._id} is closed")

    def register(self, addr: int, length: int, device: int = DEVICE_HOST) -> MemoryRegion:
        self.check_open()
        mr = self._book.register(addr, length, device)
        self._on_register(mr)
        return mr

    def _on_register(self, mr: MemoryRegion) -> None:
        """Hook: ipc exports GPU regions."""

    def deregister(self, mr: MemoryRegion) -> None:
        self.check_open()
        self._book.deregister(mr)

    def descriptor(self) -> bytes:
        self.check_open()
        return json.dumps({"fabric": self.name, "id": self._id, "host": self.hostname, "port": self.port,
                           "message_bytes": self.message_bytes, **self._descriptor_extra()}).encode()

    def _descriptor_extra(self) -> dict:
        return {}

    def connect(self, peer_descriptor: bytes) -> Endpoint:
        return self._conns.connect(peer_descriptor)

    def check_peer(self, desc: dict) -> None:
        """Hook: ipc refuses peers on another host."""

    def endpoint(self, peer_id: str) -> Endpoint:
        self.check_open()
        return self._conns.endpoint(peer_id)

    def expect_peer(self, peer_id: str, ttl: float = 60.0) -> None:
        """Allow one incoming connection to take ``peer_id`` within ``ttl`` seconds, replacing a live endpoint
        of that id if there is one (with ``guard_claims``; the engine calls this for the rail ids a sender
        announced over its authenticated control connection)."""
        self._conns.expect_peer(peer_id, ttl)

    def admission_stats(self) -> dict:
        """Incoming connections: accepted, authenticated, refused by cause (``transport.auth.Gate.stats``), plus
        ``refused_claims`` (a peer id held by a live connection, or never announced)."""
        return self._conns.admission_stats()

    @property
    def gate(self) -> "auth.Gate":
        """The admission of incoming connections (``transport.auth.Gate``)."""
        return self._conns.gate

    @property
    def _all_eps(self) -> List[SocketEndpoint]:
        return self._conns.endpoints()

    def validate(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> List[MemoryRegion]:
        """The local checks of a post's plain writes (open fabric, live endpoint of this fabric, ranges, keys);
        returns each write's source region."""
        self.check_open()
        if not isinstance(ep, SocketEndpoint) or ep.fabric is not self:
            raise UnknownPeer(f"post_writes: {ep!r} is not an endpoint of {self.name} fabric {self._id}")
        ep.check_alive()
        if len(requests) > VECTOR_MIN:
            mrs = self._book.validate_many(requests)
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
            mrs.append(self._book.lookup_local(r))
        return mrs

    def validate_batch(self, b: WriteBatch) -> np.ndarray:
        """The local checks of a ``WriteBatch`` (``RegionBook.validate_batch``): each write's source device."""
        return self._book.validate_batch(b)

    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        """Check every request and batch, then hand their messages over (``_send``)."""
        requests = list(requests)
        batches = [r for r in requests if isinstance(r, WriteBatch)]
        if batches:
            requests = [r for r in requests if not isinstance(r, WriteBatch)]
        mrs = self.validate(ep, requests)
        devices = [self.validate_batch(b) for b in batches]  # every check before anything is posted
        msgs = write_messages(requests, mrs, self.message_target, len(ep.socks)) if requests else []
        for b, dev in zip(batches, devices):
            msgs.extend(batch_messages(b, dev, self.message_target, len(ep.socks)))
        if msgs:
            self._send(ep, msgs)

    def message_target(self, total: int, nsocks: int) -> int:
        """Payload bytes per message for a post of ``total`` bytes: a share per socket (each socket's sender thread
        streams its messages in parallel), at most ``message_bytes``."""
        return max(64 << 10, min(self.message_bytes, -(-total // nsocks)))

    def _send(self, ep: SocketEndpoint, msgs: List[OutMsg]) -> None:
        """Hand checked messages to the sockets' sender threads."""
        ep.enqueue(msgs)

    def transmit(self, ep: SocketEndpoint, s: Sock, msg: OutMsg) -> None:
        """Send one queued message on socket ``s`` (the sender thread of ``s``)."""
        raise NotImplementedError

    def poll(self, max_n: int = 64, timeout: float = 0.0) -> List[Completion]:
        self.check_open()
        return self._cq.take(max_n, timeout)

    def set_completion_handler(self, handler) -> None:
        self._cq.set_handler(handler)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._conns.close()
        self._cq.close()
        self._on_close()

    def _on_close(self) -> None:
        """Hook for subclasses."""

    def push_completions(self, comps: List[Completion]) -> None:
        if comps:
            self._cq.push(comps)

    def start_endpoint(self, ep: SocketEndpoint) -> None:
        """Serve the sockets of a new endpoint: here a receiver and a sender thread per socket."""
        for s in ep.socks:
            for fn, role in ((self._recv_loop, "recv"), (self._send_loop, "send")):
                t = threading.Thread(target=fn, args=(ep, s), daemon=True,
                                     name=f"pxn-{self.name}-{role}-{ep.peer_id}-{s.index}")
                s.threads.append(t)
                t.start()

    def stop_io(self) -> None:
        """Stop the threads that serve sockets beyond each socket's own (``Connections.close``, once every endpoint
        failed and before the sockets close); none here."""

    def _send_loop(self, ep: SocketEndpoint, s: Sock) -> None:
        try:
            while True:
                with s.cv:
                    while not s.ctrl and not s.data and not s.closed:
                        s.cv.wait()
                    if s.closed:
                        return
                # taken before the queues are read: the rest of a message that a thread began to send itself
                # (``send_now``) is at the head of ``ctrl`` by the time the lock is free
                with s.wire_lock:
                    with s.cv:
                        ctrl = list(s.ctrl)
                        s.ctrl.clear()
                        msg = s.data.popleft() if (not ctrl and s.data) else None
                    if ctrl:
                        send_ctrl_frames(s, ctrl)
                    if msg is not None:
                        self.transmit(ep, s, msg)
        except Exception as e:  # noqa: BLE001 — any send failure means the link is gone
            if ep.alive and not self._closed:
                log.debug("send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")

    def _recv_loop(self, ep: SocketEndpoint, s: Sock) -> None:
        """The receive thread of socket ``s``: one message after the other until the link fails."""
        st = self._receive_state(s)
        rx = st["rx"] = s.sock
        try:
            while True:
                self.read_one(ep, s, rx, st)
        except Exception as e:  # noqa: BLE001 — EOF, reset, or a malformed stream: the link is unusable
            if ep.alive and not self._closed:
                log.debug("receive on %s/%d ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")

    @staticmethod
    def _receive_state(s: Sock) -> dict:
        """A receive thread's buffers: piece tables, payload staging, the header."""
        hdr = bytearray(HDR.size)
        return {"table": bytearray(64 * 48), "stage": bytearray(1 << 20), "hdr": hdr, "hview": memoryview(hdr)}

    def read_one(self, ep: SocketEndpoint, s: Sock, rx, st: dict) -> None:
        """Read and handle one message from socket ``s`` (through ``rx``, its look-ahead reader or the bare socket);
        blocks until the whole message is read. Raises on EOF, a reset or a malformed stream. The header is read
        and its tag check begun here; the rest is the message type's (``_read_ack``, ``_read_data``,
        ``_read_other``)."""
        sess = s.sess
        mac = tag = None
        if rx is not s.sock:
            magic, typ, hflags, _, count, seq, blen = rx.unpack(HDR)
            if sess is not None:  # the header is checked with what its tag covers, before anything acts on it
                p = rx.pos - 48  # wire.rx_head, inline: this runs once per frame
                tag = rx.buf[p + 32:p + 48]
                if not (hflags & H_TOKEN and typ == T_ACK):  # an ack token: no hash, no sequence number
                    TAIL.pack_into(rx.buf, p + 32, sess.rx_n)  # consumed bytes: the tag's place, as when sealed
                    sess.rx_n += 1
                    mac = sess.rx_hash.copy()
                    mac.update(rx.view[p:p + 48])
        else:
            recv_exact(rx, st["hview"])
            magic, typ, hflags, _, count, seq, blen = HDR.unpack(st["hdr"])
            if sess is not None:
                if hflags & H_TOKEN and typ == T_ACK:
                    tag = bytes(st["hview"][32:48])
                else:
                    mac, tag = rx_head(sess, st["hdr"])
        if magic != MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        if typ == T_ACK:
            self._read_ack(ep, s, rx, st, count, seq, blen, mac, tag)
        elif typ in (T_WRITE, T_REQ, T_NOTIFY):
            self._read_data(ep, s, rx, st, typ, hflags, count, seq, blen, mac, tag)
        else:
            self._read_other(ep, s, rx, typ, count, seq, blen, mac, tag)

    @staticmethod
    def _read_ack(ep: SocketEndpoint, s: Sock, rx, st: dict, count: int, seq: int, blen: int, mac, tag) -> None:
        """An ACK (header read): its statuses read and checked (the tag, or the ack token ``tag`` when ``mac`` is
        None), then handed to the endpoint."""
        if count > MAX_TABLE or blen != count:
            raise ValueError(f"ack of {count} statuses in {blen} B (at most {MAX_TABLE})")
        if rx is not s.sock:  # the statuses are usually in the look-ahead buffer already
            body = bytes(rx.take(count, memoryview(st["stage"])))
        else:
            body = bytearray(count)
            recv_exact(rx, memoryview(body))
            body = bytes(body)
        sess = s.sess
        if sess is not None:
            if mac is None:
                check_token(sess, seq, tag, body)  # raises, naming the connection
            else:
                mac.update(body)
                if not compare_digest(mac.digest()[:16], tag):
                    sess.rx_end(mac, tag)  # raises, naming the connection
                sess.acks.pop(seq, None)  # a refused piece: no token comes for that WRITE
        ep.on_ack(seq, body)

    def _read_data(self, ep: SocketEndpoint, s: Sock, rx, st: dict, typ: int, hflags: int, count: int, seq: int,
                   blen: int, mac, tag) -> None:
        """A WRITE / REQ / NOTIFY (header read): its size checked, then a small WRITE handed whole to the landing
        strategy (``Landing.on_small_write``), any other message's table read and checked and the message handed
        to ``_on_message`` with its payload still on the socket."""
        if count > MAX_TABLE:
            raise ValueError(f"piece count {count} above {MAX_TABLE}")
        tb = count * PIECE_DT.itemsize
        if blen < tb:
            raise ValueError(f"body {blen} B shorter than its table {tb} B")
        whole = hflags & H_WHOLE and typ == T_WRITE and count == 1
        if blen - tb > (MAX_WHOLE if whole else ep.max_payload):
            raise ValueError(f"payload {blen - tb} B above the peer's message size {ep.max_payload} B")
        landing = self.landing
        if typ == T_WRITE and blen <= SMALL_MESSAGE and landing is not None:
            landing.on_small_write(ep, s, seq, count, tb, blen, st, hflags, (mac, tag) if s.sess else None)
            return
        if len(st["table"]) < tb:
            st["table"] = bytearray(tb)
        tview = memoryview(st["table"])[:tb]
        recv_exact(rx, tview)
        sess = s.sess
        if sess is not None:
            mac.update(tview)
            d = mac.digest()
            if not compare_digest(d[:16], tag):
                sess.rx_end(mac, tag)
            st["token"] = d[16:] if typ == T_WRITE and not hflags & H_NOACK else None
        table = np.frombuffer(st["table"], dtype=PIECE_DT, count=count).copy()
        if whole and blen - tb > ep.max_payload and not (
                table["addr"][0] == table["waddr"][0] and table["len"][0] == table["wlen"][0]):
            raise ValueError(f"a message of {blen - tb} B above the peer's message size is not one whole write")
        self._on_message(ep, s, typ, seq, table, blen - tb, st, ack=not hflags & H_NOACK)

    def _read_other(self, ep: SocketEndpoint, s: Sock, rx, typ: int, count: int, seq: int, blen: int, mac,
                    tag) -> None:
        """A message of a type only this fabric knows (``_OTHER_TYPES``; header read): its body read and checked,
        then handed to ``_on_other``."""
        if typ not in self._OTHER_TYPES:
            raise ValueError(f"{self.name} fabric got unexpected message type {typ}")
        if count > MAX_TABLE or blen > count + MAX_CTRL_BODY:
            raise ValueError(f"control message of {count} statuses in {blen} B is implausible")
        body = bytearray(blen)
        recv_exact(rx, memoryview(body))
        sess = s.sess
        if sess is not None:
            mac.update(body)
            if not compare_digest(mac.digest()[:16], tag):
                sess.rx_end(mac, tag)  # raises, naming the connection
        self._on_other(ep, s, typ, count, seq, bytes(body))

    _OTHER_TYPES: tuple = ()  # message types besides WRITE / REQ / ACK this fabric receives (ipc: GRANT, DONE)

    def _on_other(self, ep: SocketEndpoint, s: Sock, typ: int, count: int, seq: int, body: bytes) -> None:
        raise ValueError(f"{self.name} fabric got unexpected message type {typ}")

    def send_ctrl(self, ep: SocketEndpoint, s: Sock, payload: bytes) -> None:
        """Send a small control message (ack): at once when the socket is idle, else through its sender thread
        (the receiving thread that calls this never waits on a send)."""
        if not send_now(s, [payload]):
            ep.send_ctrl(s, payload)

    def _on_message(self, ep: SocketEndpoint, s: Sock, typ: int, seq: int, table: np.ndarray, payload: int,
                    st: dict, ack: bool = True) -> None:
        """Handle one WRITE / REQ / NOTIFY message whose table ``read_one`` read and checked (its ``payload``
        bytes still on the socket): the landing strategy's (``landing.on_message``) unless the fabric overrides
        this."""
        self.landing.on_message(ep, s, typ, seq, table, payload, st, ack)

    def take_held_ack(self):
        """The ACK this receiving thread holds while it delivers a landed write's RECV_IMM events
        (``finish_message`` with ``hold``), taken: (endpoint, socket, frame) for the caller to send along with an
        unacked write it posts, or None."""
        return self._held.__dict__.pop("ack", None)

    def finish_message(self, ep: SocketEndpoint, s: Sock, seq: int, table: np.ndarray, statuses,
                        ack: bool = True, hold: bool = False, token: Optional[bytes] = None) -> None:
        """Ack the sender (unless ``ack`` is False: it completed the message itself; with the WRITE's ack token
        ``token`` when every piece was placed, ``wire.ack_frame``), then release this message's RECV_IMM events
        in order. ``hold``: the ACK waits while the events are delivered, for an unacked write
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
            payload = ack_frame(seq, statuses, token)
            if hold and events:
                held = self._held.__dict__
                held["ack"] = (ep, s, payload)
                try:
                    ep.deliver_in_order(seq, events)
                finally:
                    if held.pop("ack", None) is not None:
                        self.send_ctrl(ep, s, payload)
                return
            self.send_ctrl(ep, s, payload)
        ep.deliver_in_order(seq, events)
