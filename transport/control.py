"""The engine's control plane: control listener, handshake, region refresh, and their message framing.

A ``TransferEngine`` runs one small TCP listener (its port is in ``session_id``). Its connections are admitted by
``transport.auth.Gate`` (a deadline to authenticate, caps per source address, an accept loop that survives
running out of file descriptors) and served by ``transport.control_server.ControlServer``: one selector thread
watches them all and small worker pools answer, so the threads of a control plane do not grow with its peers.
The connection first proves the shared secret (``transport.auth``, bound to the connection's two ends); nothing
is read, allocated or answered before. Then it carries requests (4-byte length + JSON object ``{"op": ...}`` + a
16-byte tag under the connection's session key and sequence number, checked before the body is parsed), one at a
time, each answered on it in order, until the peer closes.
Ops are looked up in ``ControlPlane.ops`` (op name -> handler taking the request dict and returning the reply
dict), so other parts of pxn can add their own.

Built-in ops:

* ``hello``: a sender's first message. It names its rails, its credit region (``credit_slots`` entries per rail)
  and its chunk size (``slot_bytes``); the reply carries this engine's rail descriptors, the landing pool of each
  rail (address, rkey, ``landing_stride``), the credits the sender may hold (``landing_slots``), the largest
  chunk it may write (``landing_slot_bytes``, capped by the pool's slot size), a first grant of credits per rail
  (``landing_grants``: [[credit index, pool slot]], possibly none) and the region list.
* ``credits``: a connected sender returns credits it does not use and asks for more on one rail
  (``transport.credits.CreditDesk.request``).

  The hello reply gives the sender a key of its own (``sender_key``). A ``credits`` request naming a connected
  sender's engine id on another connection than that sender's hello, or a second hello naming it while its rails
  live, must carry ``proof`` (``transport.auth.claim_proof`` of that connection's binding under the key); else it
  is refused, so no other holder of the secret can return a sender's credits or take its place.
* ``regions``: the region list again (a sender re-fetches it when a destination is not covered).
* ``owns``: whether this engine opened the control connection with a given binding (``transport.reads`` asks it
  before it sends a read's bytes here).

A request body is at most ``MAX_REQUEST`` bytes and is received as it arrives (a length field alone allocates
nothing).

Session ids are "host:port" (IPv6: "[addr]:port"); anything else (empty host, a port outside 1..65535, a host
name that is not a valid DNS name) raises ``UnknownSession`` naming the value.

Sender side: ``ControlPlane.peer(session)`` returns the connected peer of a session, handshaking first when
there is none, and ``refresh_regions(peer)`` re-fetches its region list. Neither decides about failover: a
peer found dead, or a refresh that finds nobody (or a different engine) at the session, raises ``PeerGone``
(a ``PeerLost`` naming the peer) and the engine decides what to forget.

What the control plane is given (not the engine): the peer directory (``transport.peers.PeerDirectory``: the
sessions it handshakes with, and the record types it builds), this engine's region table and deregistration
counter, its fabrics, receiver (landing slots for a new sender), counters, configuration and id.
"""
from __future__ import annotations

import base64
import hmac
import ipaddress
import json
import logging
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from transport import auth
from transport.credits import ACK_BYTES
from transport.errors import FabricError, PeerGone, PeerLost, TransferError, UnknownSession
from transport.control_server import ControlServer
from transport.fabric.base import DEVICE_HOST
from transport.packing import HostBuffer
from transport.peers import close_ctrl_locked
from transport.regions import Region
from transport.telemetry import now_ns

log = logging.getLogger(__name__)

__all__ = ["ControlPlane", "UnknownSession", "PeerGone", "send_msg", "recv_msg", "parse_session", "query"]


_MSG = struct.Struct("<I")
MAX_MSG = 64 << 20
"""Largest control reply (bytes) a sender accepts (a long region list)."""
MAX_REQUEST = 1 << 20
"""Largest control request (bytes) the listener accepts."""


def send_msg(sock: socket.socket, obj: dict) -> None:
    """One control message: 4-byte little-endian length, the JSON body, then (on a connection authenticated with a
    secret, ``transport.auth.Session``) a 16-byte tag over the length and body under the connection's key and
    sequence number."""
    body = json.dumps(obj).encode()
    head = _MSG.pack(len(body))
    sess = auth.session_of(sock)
    if sess is not None and sess.keyed:
        sock.sendall(head + body + sess.tag(head, body))
    else:
        sock.sendall(head + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        k = sock.recv_into(view)
        if k == 0:
            raise ConnectionError("control connection closed")
        view = view[k:]
    return bytes(buf)


def _recv_growing(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, held only as they arrive: a length field alone costs no memory."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 16))
        if not chunk:
            raise ConnectionError("control connection closed")
        buf += chunk
    return bytes(buf)


def proof_on(sock: socket.socket, key: bytes) -> str:
    """``proof`` for a request on control connection ``sock`` that names this engine at a peer that gave it
    ``key`` (``transport.auth.claim_proof`` of the connection's binding, hex)."""
    return auth.claim_proof(key, auth.session_of(sock).binding).hex()


def recv_msg(sock: socket.socket, limit: int = MAX_MSG) -> dict:
    """One control message (a JSON object); a body above ``limit`` bytes raises ``ValueError``, a wrong tag
    ``transport.auth.SecretMismatch`` (the connection is then unusable: close it)."""
    head = _recv_exact(sock, 4)
    (n,) = _MSG.unpack(head)
    if n > limit:
        raise ValueError(f"control message of {n} bytes is too large (at most {limit})")
    body = _recv_exact(sock, n) if n <= 1 << 16 else _recv_growing(sock, n)
    sess = auth.session_of(sock)
    if sess is not None and sess.keyed:
        sess.check(_recv_exact(sock, auth.TAG_BYTES), head, body)  # before the body is parsed or acted on
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError(f"control message is a JSON {type(msg).__name__}, not an object")
    return msg


def parse_session(session) -> Tuple[str, int]:
    """(host, port) of a session id "host:port" / "[v6]:port"; UnknownSession naming the value otherwise."""
    if not isinstance(session, str) or ":" not in session:
        raise UnknownSession(f"session id must be 'host:port', got {session!r}")
    host, _, port_s = session.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_s.isascii() or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise UnknownSession(f"session id {session!r}: port {port_s!r} is not a number in 1..65535")
    try:
        ipaddress.ip_address(host)
        return host, int(port_s)
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    try:
        encoded = host.encode("idna")  # what the resolver would do; over-long labels raise UnicodeError here
    except UnicodeError as e:
        raise UnknownSession(f"session id {session!r}: host {host!r} is not a valid host name ({e})") from None
    if not host or len(encoded) > 253 or any(not 1 <= len(x) <= 63 for x in labels) or "\x00" in host:
        raise UnknownSession(f"session id {session!r}: host {host!r} is not a valid host name")
    return host, int(port_s)


def _close_listener(sock: socket.socket) -> None:
    # shutdown() wakes a thread blocked in accept() (close() alone does not, on Linux)
    for fn in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            fn()
        except OSError:
            pass


def query(session: str, msg: dict, secret=None, timeout: float = 2.0) -> dict:
    """One request / reply on a fresh, authenticated control connection to ``session`` (e.g. a liveness probe
    with ``{"op": "regions"}``). ``secret``: as ``TransferEngine(secret=)`` (None: ``PXN_SECRET``, else the
    per-user secret file for a loopback session; ``transport.auth.resolve_secret``).
    Raises UnknownSession (malformed id), OSError (nobody answers), ``transport.auth.AuthError`` (refused), or
    ConnectionError / ValueError (a bad reply)."""
    host, port = parse_session(session)
    key = auth.resolve_secret(secret, host)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(timeout)
        auth.client_handshake(s, key, "ctrl", timeout)
        send_msg(s, msg)
        return recv_msg(s)


class ControlPlane:
    """The control listener and the sender side of the handshake of one engine (see the module docstring).

    Arguments:
        hostname, port: where to listen (port 0: any free port).
        directory: the engine's ``transport.peers.PeerDirectory`` (its ``make_peer`` and ``make_rail`` build the
            records of a handshake).
        regions: the engine's ``RegionTable``; region_gen: its deregistration counter (``GenerationCounter``).
        fabrics: the engine's fabrics, one per rail; receiver: its ``Receiver``; counters: its ``Counters``.
        config: the engine's ``EngineConfig`` (landing slots, relay slot bytes, load/store, forward_large).
        engine_id: the engine's id; landing_device: where landing slots go (None: chosen per rail, see
            ``landing_devices``); rail_gpu: per rail, the GPU next to its NIC or None.
        secret, handshake_timeout, max_conns_per_addr: see ``transport.auth``; the caps on connections still
            authenticating are ``config.max_pending`` and ``config.max_pending_per_addr``.
    ``session_id`` is set by the owner once the listener is bound (``port``).
    Raises FabricError when the port cannot be bound.
    """

    def __init__(self, hostname: str, port: int, directory, regions, region_gen, fabrics: list, receiver,
                 counters, config, engine_id: int, landing_device: Optional[int] = None, rail_gpu=None,
                 secret: Optional[bytes] = None, handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
                 max_conns_per_addr: int = 64):
        self.hostname = hostname
        self.secret = secret
        self.handshake_timeout = float(handshake_timeout)
        self.directory = directory
        self.regions = regions
        self.region_gen = region_gen
        self.fabrics = fabrics
        self.receiver = receiver
        self.counters = counters
        self.config = config
        self.engine_id = engine_id
        self.landing_device = landing_device
        self.rail_gpu = list(rail_gpu) if rail_gpu is not None else [None] * len(fabrics)
        self.session_id = f"{hostname}:{port}"
        self.closed = False
        self.ops: Dict[str, Callable[[dict], dict]] = {"hello": self._op_hello, "regions": self._op_regions,
                                                       "credits": self._op_credits, "owns": self._op_owns}
        # the bindings (``transport.auth.Session.binding``) of the control connections this engine opened, while
        # they live: a peer asked to send a read's bytes to this engine asks first whether the request's
        # connection is one of them (``transport.reads``)
        self.own: "weakref.WeakValueDictionary[bytes, auth.Session]" = weakref.WeakValueDictionary()
        self._conn = threading.local()  # the connection the serving thread answers (``current``)
        self._claim_warned = -1e9  # time.monotonic() of the last WARNING about an unproven claim
        try:
            self.listener = socket.create_server((hostname, port), backlog=64)
        except OSError as e:
            raise FabricError(f"control listener: cannot listen on {hostname}:{port}: {e}") from e
        self.port = self.listener.getsockname()[1]
        name = f"ctrl {hostname}:{self.port}"
        self.server = ControlServer(name, None, secret, "ctrl", self._answer, MAX_REQUEST)
        self.gate = self.server.gate = auth.Gate(
            name, handshake_timeout=handshake_timeout, max_per_addr=max_conns_per_addr,
            max_pending=config.max_pending, max_pending_per_addr=config.max_pending_per_addr,
            on_accept=self.server.accept, variables={"max_per_addr": "PXN_MAX_CONNS_PER_ADDR",
                                                     "max_pending": "PXN_MAX_PENDING",
                                                     "max_pending_per_addr": "PXN_MAX_PENDING_PER_ADDR"})
        self._thread: Optional[threading.Thread] = None

    def start(self) -> threading.Thread:
        """Start the accept thread (returned, for the engine's join at close) and the selector thread; the worker
        pools start at their first request (``transport.control_server``). None of their numbers depends on the
        number of peers."""
        self.server.start()
        self._thread = threading.Thread(target=self._ctrl_loop, name=f"pxn-ctrl-{self.port}", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop accepting, end every control connection, stop the serving threads (joined, 2 s at most)."""
        self.closed = True
        _close_listener(self.listener)
        self.server.close()

    # ========================================================================================================
    # server side
    # ========================================================================================================
    def regions_wire(self) -> dict:
        """The region list a peer validates destinations against, with the deregistration counter read before
        it (a peer writing by load/store re-fetches the list when the counter moves past this value)."""
        gen = self.region_gen.wire()  # read before the list: a deregister in between shows as a newer value
        fab = self.fabrics[0]
        regions = []
        for r in self.regions.regions():
            d = {"addr": r.addr, "length": r.length, "device": r.device, "keys": [mr.rkey for mr in r.keys]}
            access = fab.access_info(r.keys[0])
            if access is not None:
                d["access"] = access
            regions.append(d)
        return {"regions": regions, **gen}

    def _ctrl_loop(self) -> None:
        self.gate.serve(self.listener, lambda: self.closed)

    def _answer(self, current: dict, req: dict) -> dict:
        """One request of an authenticated control connection (on a worker of ``self.server``): the op's reply,
        or ``{"ok": False, "error"}`` naming why not. ``current`` is the connection's record (``current()``)."""
        self._conn.current = current
        try:
            op = req.get("op")
            handler = self.ops.get(op) if isinstance(op, str) else None
            if handler is None:
                return {"ok": False, "error": f"unknown control op {op!r}"}
            return handler(req)
        except Exception as e:  # noqa: BLE001 — report to the peer, keep serving
            log.warning("control request %s failed: %s", req.get("op"), e)
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        finally:
            self._conn.current = None

    def _op_regions(self, req: dict) -> dict:
        # the engine id lets a sender whose control connection was re-opened tell a restarted peer (new id) from
        # the same one
        return {"ok": True, "engine_id": self.engine_id, **self.regions_wire()}

    def current(self) -> Optional[dict]:
        """The control connection whose request the calling thread answers: ``binding`` (its ``Session.binding``),
        ``addr`` (the peer's address) and ``owner`` (the session id that proved it opened the connection, once one
        did); None outside a request."""
        return getattr(self._conn, "current", None)

    def _op_owns(self, req: dict) -> dict:
        # a peer asks whether this engine opened the control connection with this binding (a read request came
        # on it naming this engine as where the bytes go)
        b = req.get("binding")
        try:
            owns = isinstance(b, str) and bytes.fromhex(b) in self.own
        except ValueError:
            owns = False
        return {"ok": True, "owns": owns, "engine_id": self.engine_id}

    def landing_devices(self) -> List[int]:
        """Per rail, where a new sender's landing slots go: ``landing_device`` when given; else, when this
        engine registered GPU memory, the GPU next to the rail's NIC (receive-side PXN: chunks land there and
        the receiver forwards them over NVLink to GPUs without a NIC) or, without a topology, the first GPU
        holding a registered region; host memory otherwise."""
        n = len(self.fabrics)
        if self.landing_device is not None:
            return [self.landing_device] * n
        devs = sorted({r.device for r in self.regions.regions() if r.device >= 0})
        if not devs:
            return [DEVICE_HOST] * n
        return [devs[0] if g is None else g for g in self.rail_gpu]

    def _op_credits(self, req: dict) -> dict:
        self._check_claim(req)
        return self.receiver.credit_desk.request(req)

    def _check_claim(self, req: dict) -> None:
        """A request naming the engine id of a connected sender speaks for it only on the connection of that
        sender's hello, or with ``proof`` of its key (see the module docstring). A hello naming a sender whose
        rails have died needs none: that sender lost them and says hello again. Raises ValueError (the
        requester's error reply) otherwise."""
        conn, engine_id = self.current(), req.get("engine_id")
        if conn is None or conn.get("sender") == engine_id:
            return
        claim = self.receiver.claim_key(engine_id)
        if claim is None or (req.get("op") == "hello" and claim[1]):
            # no live sender has that id (a hello is then a new sender; ``credits`` refuses it, naming the id), or
            # a hello from a sender whose rails died
            return
        proof = req.get("proof")
        try:
            ok = isinstance(proof, str) and hmac.compare_digest(
                bytes.fromhex(proof), auth.claim_proof(claim[0], conn["binding"]))
        except ValueError:
            ok = False
        if not ok:
            self.counters.add("senders_refused_proof")
            now = time.monotonic()
            loud = now - self._claim_warned > 5.0  # an insider's flood stays one WARNING per 5 s
            if loud:
                self._claim_warned = now
            log.log(logging.WARNING if loud else logging.DEBUG, "control connection from %s: %s naming connected "
                    "sender 0x%x without its proof; refused", conn["addr"], req.get("op"), engine_id)
            raise ValueError(f"{req.get('op')}: engine 0x{engine_id:x} is a connected sender, and this control "
                             f"connection did not prove it speaks for it ({'no' if proof is None else 'a wrong'} "
                             f"proof); refused")
        conn["sender"] = engine_id

    def _op_hello(self, req: dict) -> dict:
        self._check_claim(req)
        devices = self.landing_devices()
        landing = self.receiver.accept_sender(req, devices)
        current = self.current()
        if current is not None:
            current["sender"] = req["engine_id"]  # its later requests here speak for it without proof
        # receive-side PXN for large pieces (forward_large): rails whose landing slots sit on the GPU next to their
        # NIC (from the topology) ask the sender to send large pieces for other GPUs through them, and this
        # receiver forwards them over NVLink (chunks of small pieces land there and are forwarded in any case)
        fwd_large = self.config.forward_large and self.landing_device is None
        forward = [fwd_large and g is not None and d >= 0 for g, d in zip(self.rail_gpu, devices)]
        return {"ok": True, "engine_id": self.engine_id, "rail_ids": [f.local_id for f in self.fabrics],
                "rail_descs": [base64.b64encode(f.descriptor()).decode() for f in self.fabrics], "forward": forward,
                **self.regions_wire(), **landing}

    # ========================================================================================================
    # sender side
    # ========================================================================================================
    def peer(self, session_id: str):
        """The connected peer of ``session_id``, handshaking first when there is none (first use, or every rail
        of the previous connection failed). Raises UnknownSession naming why the handshake failed (the next call
        tries again; nothing is remembered but the reason, for the message), and ``PeerGone`` for a peer whose
        every endpoint died while nothing was in flight to notice (the engine forgets it and calls again)."""
        d = self.directory
        peer = d.peers.get(session_id) if isinstance(session_id, str) else None
        if peer is None:
            parse_session(session_id)  # a malformed id never reaches the resolver or the session table
        if peer is not None and peer.ready and not peer.retired:
            if peer.connected():
                return peer
            # the peer restarted while idle: the engine fails its rails (forgetting it), then asks again
            raise PeerGone(f"every rail endpoint to {session_id} died", peer)
        while True:
            with d.lock:
                peer = d.peers.get(session_id)
                if peer is None or peer.retired:
                    peer = d.peers[session_id] = d.make_peer(session_id)
            with peer.lock:
                if peer.ready:
                    return peer
                if d.peers.get(session_id) is not peer:
                    if peer.error is not None:
                        # another caller's handshake failed while this one waited for it: report that instead
                        # of queueing one more connect (up to 10 s each towards a host that drops packets)
                        raise UnknownSession(str(peer.error)) from peer.error
                    continue
                t0 = now_ns()
                try:
                    self._handshake(peer)
                except BaseException as e:
                    peer.error = e
                    with d.lock:
                        # no half-made peer stays behind: the next call starts over with a fresh one
                        if d.peers.get(session_id) is peer:
                            del d.peers[session_id]
                    raise
                self.counters.add("handshake_s", (now_ns() - t0) / 1e9)
                return peer

    def connect(self, session: str, timeout: float = 10.0) -> socket.socket:
        """A control connection to ``session``'s listener; UnknownSession naming why not."""
        host, port = parse_session(session)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except (OSError, UnicodeError) as e:
            lost = self.directory.lost.get(session)
            if lost:  # it was connected: the peer is gone, not a session that never answered
                raise PeerGone(f"peer {session} is gone: nobody answers at its session any more ({e}); its "
                               f"previous connection was lost: {lost}", None, e) from e
            raise UnknownSession(f"no pxn engine answers at session {session!r}: {e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sess = auth.client_handshake(sock, self.secret, "ctrl", timeout)
            self.own[sess.binding] = sess
        except auth.AdmissionRefused as e:
            sock.close()
            raise UnknownSession(f"session {session!r} refused this connection: {e}") from e
        except auth.AuthError as e:
            sock.close()
            raise UnknownSession(f"session {session!r} refused authentication: {e}") from e
        except (OSError, ConnectionError) as e:
            sock.close()
            raise UnknownSession(f"session {session!r}: authentication failed: {e} (a pxn engine of another "
                                 f"version, or something else, listens there)") from e
        return sock

    def _handshake(self, peer) -> None:
        cfg = self.config
        fabrics = self.fabrics
        sock = self.connect(peer.session)
        n = len(fabrics)
        credit = HostBuffer(n * cfg.landing_slots * ACK_BYTES)
        mrs = []
        try:
            for fab in fabrics:
                mrs.append(fab.register(credit.addr, credit.nbytes, DEVICE_HOST))
            rep = self._hello(sock, peer, credit, mrs)
            key = bytes.fromhex(rep["sender_key"])
            rails = self._connect_rails(peer, rep)
        except (OSError, ConnectionError, ValueError, KeyError, FabricError) as e:
            sock.close()
            for fab, mr in zip(fabrics, mrs):
                try:
                    fab.deregister(mr)
                except FabricError:
                    pass
            if isinstance(e, UnknownSession):
                raise
            raise UnknownSession(f"handshake with session {peer.session!r} failed: {e}") from e
        sock.settimeout(30.0)
        peer.ctrl = sock
        peer.credit = credit
        peer.credit_mrs = mrs
        peer.engine_id = int(rep["engine_id"])
        peer.claim_key = key
        peer.chunk_key = auth.chunk_key(self.secret, key)  # the MAC key of every chunk to this peer
        peer.proven_ctrl = sock
        peer.rails = rails
        peer.landing_device = int(rep.get("landing_device", DEVICE_HOST))
        fwd = rep.get("forward") or []
        devices = rep.get("landing_devices") or []
        peer.forward = {i: int(devices[i]) for i, f in enumerate(fwd) if f and i < len(devices)} or None
        peer.regions.replace_all(Region.from_wire(d) for d in rep["regions"])
        peer.loadstore = self._loadstore_writer(peer, rep)
        again = self._remember(peer, rails, key)
        peer.ready = True
        if again:
            self.counters.add("reconnects")
        log.log(logging.WARNING if again else logging.INFO, "engine %s %sconnected to %s over %d rail(s)",
                self.session_id, "re" if again else "", peer.session, n)

    def _hello(self, sock, peer, credit: HostBuffer, mrs) -> dict:
        """Send the peer this engine's hello (its rails, credit buffer, slots; the proof that it is the sender the
        peer may still hold) and return the peer's answer; UnknownSession when the peer refuses."""
        cfg = self.config
        hello = {"op": "hello", "engine_id": self.engine_id, "session": self.session_id,
                 "rail_ids": [f.local_id for f in self.fabrics],
                 "credit_addr": credit.addr, "credit_rkeys": [m.rkey for m in mrs],
                 "credit_slots": cfg.landing_slots, "slot_bytes": cfg.relay_slot_bytes}
        key = self.directory.claim_keys.get(peer.session)
        if key is not None:  # the peer may still hold this engine as a live sender: prove it is us
            hello["proof"] = proof_on(sock, key)
        send_msg(sock, hello)
        rep = recv_msg(sock)
        if not rep.get("ok"):
            raise UnknownSession(f"session {peer.session!r} refused the handshake: {rep.get('error')}")
        return rep

    def _connect_rails(self, peer, rep: dict) -> list:
        """Connect every rail to the peer as its answer ``rep`` describes (endpoints, landing slots, first grants)
        and give the peer a planner for its chunk size; returns the rails."""
        cfg = self.config
        n = len(self.fabrics)
        if len(rep["rail_ids"]) != n:
            raise UnknownSession(f"session {peer.session!r} has {len(rep['rail_ids'])} rails, this engine {n}")
        slots = min(int(rep["landing_slots"]), cfg.landing_slots)
        # the receiver decides the largest chunk (its landing pool's slot size, at most ours): a smaller one
        # cuts this engine's chunks to this peer
        chunk = int(rep["landing_slot_bytes"])
        if not 4096 <= chunk <= cfg.relay_slot_bytes:
            raise UnknownSession(f"session {peer.session!r} offers {chunk} B landing slots: need 4096 .. "
                                 f"{cfg.relay_slot_bytes} B (this engine's chunks)")
        stride = int(rep.get("landing_stride", chunk))
        grants = rep.get("landing_grants") or [[] for _ in range(n)]
        peer.planner = self._planner_for(chunk)
        rails = []
        for i, fab in enumerate(self.fabrics):
            ep = fab.connect(base64.b64decode(rep["rail_descs"][i]))
            pr = self.directory.make_rail(i, ep, rep["rail_ids"][i], int(rep["landing_addrs"][i]),
                                          int(rep["landing_rkeys"][i]), slots, chunk, peer)
            pr.stride = stride
            pr.grant([(int(k), int(p)) for k, p in grants[i]])
            rails.append(pr)
        return rails

    def _remember(self, peer, rails, key: bytes) -> bool:
        """Enter the connected peer's rails and claim key in the directory; True when it had been lost (a
        reconnect)."""
        d = self.directory
        with d.lock:
            for pr in rails:
                d.by_remote_rail[pr.remote_id] = (peer, pr)
            again = d.lost.pop(peer.session, None) is not None
            d.claim_keys.pop(peer.session, None)
            d.claim_keys[peer.session] = key
            while len(d.claim_keys) > 4096:  # the oldest peers' keys: a hello without proof then waits for rails
                d.claim_keys.pop(next(iter(d.claim_keys)))  # to die at the peer, as before it knew us
        return again

    def _planner_for(self, chunk_bytes: int):
        """A planner for a peer whose landing slots take chunks of at most ``chunk_bytes`` (its pool's slot size,
        smaller than ours), or None when ours fits. ValueError when such a chunk cannot hold one coalesced
        piece."""
        cfg = self.config
        if chunk_bytes >= cfg.relay_slot_bytes:
            return None
        from transport.planner import Planner
        return Planner(cfg, chunk_bytes)

    def _loadstore_writer(self, peer, rep: dict):
        """The rail-0 fabric's local writer for a same-host peer (``Fabric.local_writer``: the ipc fabric's
        load/store path), else None."""
        fab = self.fabrics[0]
        if not (self.config.loadstore and fab.capabilities.loadstore):
            return None
        return fab.local_writer(peer.rails[0].ep, rep)

    def refresh_regions(self, peer) -> None:
        """Fetch the peer's region list again over the control connection. The control connection alone can
        drop (an idle NAT / firewall timeout: unlike the rails it has no keepalive), so a failed request is
        retried once on a new connection. Raises ``PeerGone`` when nobody answers there any more or a different
        engine does (the peer restarted), TransferError naming the cause for other failures."""
        gone = None
        with peer.lock:
            try:
                rep = self.request(peer, {"op": "regions"})
            except (OSError, ConnectionError, ValueError, auth.AuthError) as first:
                self.close_ctrl_locked(peer)
                if peer.retired:
                    raise TransferError(f"cannot refresh the region list of {peer.session}: {first} (every rail "
                                        f"to it failed meanwhile)", [first]) from first
                try:
                    peer.ctrl = self.connect(peer.session)
                    peer.ctrl.settimeout(30.0)
                    rep = self.request(peer, {"op": "regions"})
                except (UnknownSession, PeerGone) as e:
                    gone = e
                except (OSError, ConnectionError, ValueError, auth.AuthError) as e:
                    self.close_ctrl_locked(peer)
                    raise TransferError(f"cannot refresh the region list of {peer.session}: {first}; again on a "
                                        f"new control connection: {e}", [first, e]) from e
                else:
                    self.counters.add("ctrl_reconnects")
            if gone is None and int(rep.get("engine_id", peer.engine_id)) != peer.engine_id:
                gone = PeerLost(f"a different engine (id 0x{int(rep['engine_id']):x}, was 0x{peer.engine_id:x}) "
                                f"answers at {peer.session} now: the peer restarted")
        if gone is not None:
            raise PeerGone(str(gone), peer, gone)
        peer.regions.replace_all(Region.from_wire(d) for d in rep["regions"])
        if peer.loadstore is not None:
            peer.loadstore.gen_seen = int(rep.get("region_gen", peer.loadstore.gen_seen))
        self.counters.add("region_refreshes")

    @staticmethod
    def request(peer, msg: dict) -> dict:
        """One request / reply on the peer's control connection (``peer.lock`` held)."""
        if peer.ctrl is None:
            raise ConnectionError("no control connection")
        send_msg(peer.ctrl, msg)
        rep = recv_msg(peer.ctrl)
        if not rep.get("ok"):
            raise ValueError(f"peer refused {msg.get('op')!r}: {rep.get('error')}")
        return rep

    close_ctrl_locked = staticmethod(close_ctrl_locked)
