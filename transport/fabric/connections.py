"""The connection set of a socket fabric: its listener, the admission of incoming connections (authentication,
HELLO, the gathering of an endpoint's sockets, claims on peer ids), outgoing connects, the live endpoints, and the
watchdog that fails an endpoint whose oldest message waits too long for its ack.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from typing import Dict, List, Optional

from transport import auth
from transport.errors import FabricClosed, FabricError, PeerLost, UnknownPeer
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.sockets import recv_exact
from transport.fabric.wire import (HDR, MAGIC, MAX_HELLO, MAX_MESSAGE_BYTES, T_HELLO, T_HELLO_ACK, frame_check, keyed,
                                   seal)

log = logging.getLogger(__name__)


class Connections:
    """The endpoints of ``fabric`` and how they come about. Options as the fabric's (``SocketFabric``)."""

    def __init__(self, fabric, hostname: str, port: int, connections_per_peer: int, connect_timeout: float,
                 keepalive: float, ack_timeout: float, secret, handshake_timeout: float, guard_claims: bool,
                 max_peers_per_addr: int):
        self.fabric = fabric
        self.connections_per_peer = connections_per_peer
        self.connect_timeout = float(connect_timeout)
        self.keepalive = float(keepalive)
        self.ack_timeout = float(ack_timeout)
        self._secret = secret
        self.guard_claims = bool(guard_claims)
        self.max_peers_per_addr = int(max_peers_per_addr)
        self._claims = auth.RailClaims(self.guard_claims)
        self._groups: Dict[str, dict] = {}  # connection id -> sockets of one incoming endpoint, still gathering
        self._group_cv = threading.Condition()
        self._lock = threading.RLock()
        self._endpoints: Dict[str, SocketEndpoint] = {}
        self._all_eps: List[SocketEndpoint] = []
        self.closed = False
        self._stop = threading.Event()
        name = fabric.name
        try:
            self._listener = socket.create_server((hostname, port), backlog=128)
        except OSError as e:
            raise FabricError(f"{name}: cannot listen on {hostname}:{port}: {e}") from e
        self.hostname = hostname
        self.port = self._listener.getsockname()[1]
        self.owner = f"{hostname}:{self.port}"
        self.gate = auth.Gate(f"{name} {self.owner}", self._incoming, handshake_timeout=handshake_timeout)
        for key in ("refused_hello", "refused_claims"):  # authenticated, then refused: a bad hello, a claimed id
            self.gate.count(key, 0)

    def start(self) -> None:
        """Start the listener and the watchdog threads."""
        name = self.fabric.name
        self._listen_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"pxn-{name}-listen-{self.port}")
        self._listen_thread.start()
        self._watchdog = threading.Thread(target=self._watchdog_loop, daemon=True,
                                          name=f"pxn-{name}-watchdog-{self.port}")
        self._watchdog.start()

    def endpoints(self) -> List[SocketEndpoint]:
        """Every endpoint whose threads may still run (live ones, and dead ones not yet reaped)."""
        with self._lock:
            return list(self._all_eps)

    def close(self) -> None:
        """Stop listening, fail every endpoint and wait (a few seconds at most) for their threads."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
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
        self.fabric.stop_io()  # before the sockets close: no thread is left that reads or sends on them
        for ep in eps:
            ep.close_sockets()
        self._listen_thread.join(timeout=2.0)
        self._watchdog.join(timeout=2.0)

    def connect(self, peer_descriptor: bytes) -> SocketEndpoint:
        """The endpoint to the peer of ``peer_descriptor`` (its fabric's ``descriptor()``): the live one, else a new
        connection of ``connections_per_peer`` sockets. PeerLost when it cannot be made."""
        self.fabric.check_open()
        try:
            d = json.loads(bytes(peer_descriptor))
            peer_id, host, port = d["id"], d["host"], int(d["port"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"connect: malformed peer descriptor {bytes(peer_descriptor)[:100]!r}: {e}") from e
        if d.get("fabric") != self.fabric.name:
            raise ValueError(f"connect: descriptor is for fabric {d.get('fabric')!r}, this is {self.fabric.name!r}")
        self.fabric.check_peer(d)
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
                auth.client_handshake(s, self._secret, self.fabric.name, self.connect_timeout)
                hello = json.dumps({"id": self.owner, "conn": conn_id, "index": i, "n": n,
                                    "desc": json.loads(self.fabric.descriptor())}).encode()
                s.sendall(seal(keyed(s), HDR.pack(MAGIC, T_HELLO, 0, 0, 0, 0, len(hello)) + hello))
            for s in socks:
                hdr = bytearray(HDR.size)
                recv_exact(s, memoryview(hdr))
                magic, typ, _, _, status, _, blen = HDR.unpack(hdr)
                if blen > MAX_HELLO:
                    raise FabricError(f"connect to {peer_id}: HELLO_ACK of {blen} B is implausible")
                body = bytearray(blen)
                recv_exact(s, memoryview(body))
                frame_check(keyed(s), hdr, body)
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

    def _make_endpoint(self, peer_id: str, socks: List[socket.socket], desc: dict) -> SocketEndpoint:
        ep = SocketEndpoint(self.fabric, peer_id, socks)
        ep.peer_desc = desc
        try:
            ep.max_payload = max(64 << 10, min(MAX_MESSAGE_BYTES, int(desc.get("message_bytes", MAX_MESSAGE_BYTES))))
        except (TypeError, ValueError):
            pass
        with self._lock:
            if self.closed:
                ep.close_sockets()
                raise FabricClosed(f"{self.fabric.name} fabric {self.owner} closed during connect")
            old = self._endpoints.get(peer_id)
            if old is not None and old.alive:
                # Simultaneous connects: keep both working, newest answers endpoint(peer_id).
                log.info("%s: second connection to %s; both stay usable", self.owner, peer_id)
            self._endpoints[peer_id] = ep
            # forget dead endpoints whose threads are gone (their sockets were only shut down so far)
            keep = []
            for old_ep in self._all_eps:
                if old_ep.alive or old_ep.busy():
                    keep.append(old_ep)
                else:
                    old_ep.close_sockets()
            self._all_eps = keep + [ep]
        ep.start()
        return ep

    def endpoint(self, peer_id: str) -> SocketEndpoint:
        with self._lock:
            ep = self._endpoints.get(peer_id)
        if ep is None:
            raise UnknownPeer(f"{self.owner} has no endpoint for peer {peer_id!r}; connect first")
        return ep

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
        self.gate.serve(self._listener, lambda: self.closed)

    def _refuse(self, s: socket.socket, why: str) -> None:
        try:
            msg = why.encode()[:1024]
            s.sendall(seal(keyed(s), HDR.pack(MAGIC, T_HELLO_ACK, 0, 0, 1, 0, len(msg)) + msg))
        except OSError:
            pass

    def _incoming(self, a: "auth.Admitted") -> None:
        """One incoming socket (its own thread, ``transport.auth.Gate``): authenticate, read its HELLO, wait
        until every socket of its endpoint arrived, then build the endpoint (the last one to arrive does)."""
        s = a.sock
        self._tune(s)
        auth.server_handshake(s, self._secret, self.fabric.name, a.deadline, a.established)
        hello = self._read_hello(a)
        if hello is None:
            return
        conn, idx, n, peer_id, desc = hello
        entry = self._join_group(a, conn, idx, n, peer_id)
        if entry is None:  # refused, or another socket of the group built (or gave up on) the endpoint
            return
        error = self._build_endpoint(a, peer_id, [entry["socks"][i] for i in range(n)], desc)
        with self._group_cv:
            entry["done"], entry["error"] = True, error
            self._group_cv.notify_all()
        if error is not None:
            self._refuse(s, error)

    def _read_hello(self, a: "auth.Admitted") -> Optional[tuple]:
        """The HELLO of an authenticated incoming socket, checked: (connection, index, sockets, peer id,
        descriptor); None when it was refused (counted, answered, logged)."""
        s = a.sock
        hdr = auth.recv_exact(s, HDR.size, a.deadline)
        magic, typ, _, _, _, _, blen = HDR.unpack(hdr)
        try:
            if magic != MAGIC or typ != T_HELLO or blen > MAX_HELLO:
                raise ValueError(f"bad hello header {hdr!r}")
            body = auth.recv_exact(s, blen, a.deadline)
            frame_check(keyed(s), hdr, body)  # before the hello is parsed or acted on
            hello = json.loads(body)
            conn, idx, n = str(hello["conn"]), int(hello["index"]), int(hello["n"])
            peer_id, desc = hello["id"], hello["desc"]
            if not isinstance(peer_id, str) or not isinstance(desc, dict) or len(conn) > 64:
                raise ValueError(f"bad hello fields id={peer_id!r}")
            if not 1 <= n <= 64 or not 0 <= idx < n:
                raise ValueError(f"bad hello index {idx} of {n}")
            self.fabric.check_peer(desc)
        except Exception as e:  # noqa: BLE001 — a broken client must not kill anything
            log.warning("%s: refused connection from %s: %s", self.owner, a.addr, e)
            self.gate.count("refused_hello")
            self._refuse(s, str(e))
            return None
        return conn, idx, n, peer_id, desc

    def _join_group(self, a: "auth.Admitted", conn: str, idx: int, n: int, peer_id: str) -> Optional[dict]:
        """Add socket ``idx`` of connection ``conn`` to its group. Returns the group when this socket is the last
        to arrive (its thread builds the endpoint); else None once the group is done (this socket went to the
        endpoint, or was refused with the group's error) or this socket was refused outright."""
        s = a.sock
        with self._group_cv:
            entry = self._groups.get(conn)
            if entry is None:
                if len(self._groups) >= 4 * self.gate.max_pending:
                    self.gate.count("refused_hello")
                    self._refuse(s, "too many connections gathering")
                    return None
                entry = self._groups[conn] = {"socks": {}, "id": peer_id, "n": n, "done": False, "error": None}
            if entry["id"] != peer_id or entry["n"] != n or idx in entry["socks"]:
                self.gate.count("refused_hello")
                self._refuse(s, f"hello does not match connection {conn}")
                return None
            entry["socks"][idx] = s
            if len(entry["socks"]) == n:
                del self._groups[conn]
                return entry
            while not entry["done"] and not self.closed:
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
            return None

    def _build_endpoint(self, a: "auth.Admitted", peer_id: str, socks: List[socket.socket],
                        desc: dict) -> Optional[str]:
        """Admit the endpoint of a complete group of sockets: its claim to ``peer_id`` and its source address's
        count checked, the endpoint made and every socket's HELLO_ACK sent. Returns why it was refused, or None."""
        host = a.host
        with self._lock:
            error = self._claim_locked(peer_id)
            if error is None and host is not None and sum(
                    1 for ep in self._endpoints.values()
                    if ep.alive and getattr(ep, "remote_host", None) == host) >= self.max_peers_per_addr:
                error = (f"{host} already has {self.max_peers_per_addr} endpoints (max_peers_per_addr; an engine "
                         f"raises it with PXN_MAX_CONNS_PER_ADDR)")
                self.gate.count("refused_peers_per_addr")
            elif error is not None:
                self.gate.count("refused_claims")
        if error is not None:
            log.warning("%s: refused connection from %s: %s", self.owner, a.addr, error)
            return error
        for sk in socks:
            # Blocking before the endpoint's receive threads start: a recv entered while the handshake
            # timeout was still set kept it, and an idle rail then died after the timeout
            sk.settimeout(None)
        try:
            ep = self._make_endpoint(peer_id, socks, desc)
        except FabricClosed as e:
            return str(e)
        ep.remote_host = host
        for sk in socks:
            try:
                sk.sendall(seal(keyed(sk), HDR.pack(MAGIC, T_HELLO_ACK, 0, 0, 0, 0, 0)))
            except OSError as e:
                ep.fail(f"handshake: {e}")
                break
        a.sock = None
        return None

    def _watchdog_loop(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                eps = list(self._all_eps)
            for ep in eps:
                oldest = ep.oldest_pending()
                if oldest is not None and now - oldest.posted_at > self.ack_timeout:
                    ep.fail(f"message {oldest.seq} unacknowledged for {self.ack_timeout:g} s")

    def _tune(self, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A peer host that vanishes (no FIN/RST) is detected by keepalive when idle and TCP_USER_TIMEOUT when
        # data is unacknowledged, so pending work fails within ``ack_timeout`` instead of ~15 minutes. The user
        # timeout is never shorter than ``ack_timeout``: the kernel also counts a zero receive window against it
        # (a peer process starved of CPU, or stopped, reads nothing while its kernel keeps acknowledging), and a
        # fixed 5 s killed healthy peers on a loaded box. A process that dies is seen at once (its kernel closes
        # the sockets), whatever this timeout; a live peer's kernel answers keep-alive probes.
        k = max(1, int(self.keepalive))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", k), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3),
                         ("TCP_USER_TIMEOUT", user_timeout_ms(self.keepalive, self.ack_timeout))):
            if hasattr(socket, opt):
                try:
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
                except OSError:
                    pass


def user_timeout_ms(keepalive: float, ack_timeout: float) -> int:
    """``TCP_USER_TIMEOUT`` (ms) of a rail socket: the fabric's ``ack_timeout`` (how long a peer may leave a message
    unacknowledged before the endpoint fails, default 30 s), and at least ``keepalive`` + 2 s."""
    return int(max(ack_timeout, keepalive + 2.0) * 1000)
