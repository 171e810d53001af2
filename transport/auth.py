"""Who may talk to an engine: shared-secret authentication and the admission of incoming connections.

Authentication. Every control connection and every rail connection (tcp, ipc, the verbs connection exchange)
starts with a challenge-response, before the accepting side reads anything else, allocates anything or answers
anything:

1. the connecting side sends ``PREAMBLE``: magic ``PXNA``, version, flags (bit 0: it has a secret) and a fresh
   32-byte nonce ``nc``;
2. the accepting side answers with its own flags, a fresh nonce ``ns`` and
   ``HMAC-SHA256(secret, "pxn-auth-1 server" | purpose | nc | ns)``, which proves it knows the secret too;
3. the connecting side checks that proof and sends ``HMAC-SHA256(secret, "pxn-auth-1 client" | purpose | nc | ns)``;
4. the accepting side checks it (constant-time compare) and sends one verdict byte (0: accepted).

Both nonces are fresh per connection, so a recorded handshake is worth nothing on a new connection, and the two
proofs carry different labels, so one side's proof cannot be reflected as the other's. ``purpose`` names the
listener kind ("ctrl", "tcp", "ipc", "verbs"): a proof for one kind of port is not one for another. With no
secret on either side the exchange still runs (flags 0, empty proofs) and accepts; a secret on one side only
is refused by both, with a message saying so. The secret comes from ``secret=`` or ``PXN_SECRET``; both sides
of a connection must read the same value.

Admission (``Gate``). An accepting listener hands each connection to its own thread with a deadline to
authenticate (``handshake_timeout``), so an idle or slow connection holds nothing but itself. Connections still
authenticating are capped per source address and in all: a new one pushes the oldest waiting one out, so idle
sockets (slowloris) cannot lock out a real peer, which authenticates within a round trip. Authenticated
connections being served are capped per address. The accept loop survives running out of file descriptors
(``EMFILE`` / ``ENFILE``): it drops the oldest unauthenticated connection, backs off, logs, and keeps listening.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets as _secrets
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional

from transport.errors import FabricError

log = logging.getLogger(__name__)

__all__ = ["AuthError", "resolve_secret", "client_handshake", "server_handshake", "Gate", "Admitted"]

MAGIC = b"PXNA"
VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
F_SECRET = 1
_PREAMBLE = struct.Struct("<4sBB2x32s")  # magic, version, flags, nonce
_CHALLENGE = struct.Struct("<4sBB2x32s32s")  # magic, version, flags, nonce, server proof
_ZERO_MAC = bytes(MAC_BYTES)
VERDICT_OK = 0
VERDICT_REFUSED = 1

HANDSHAKE_TIMEOUT = 5.0
"""Default seconds an incoming connection has to authenticate (and, on a rail, to say hello)."""


class AuthError(FabricError):
    """A connection failed authentication: wrong or missing secret, not a pxn peer, or no answer in time."""


def resolve_secret(secret=None) -> Optional[bytes]:
    """The shared secret as bytes: ``secret`` (str or bytes) when given, else ``PXN_SECRET``; None when neither
    is set or it is empty (no authentication). ``secret=""`` turns authentication off whatever the env says."""
    if secret is None:
        secret = os.environ.get("PXN_SECRET", "")
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"secret must be a str or bytes, got {type(secret).__name__}")
    return bytes(secret) or None


def _mac(secret: bytes, role: bytes, purpose: str, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(secret, b"pxn-auth-1 " + role + b"|" + purpose.encode() + b"|" + nc + ns,
                    hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float]) -> bytes:
    """``n`` bytes from ``sock``, all of them before ``deadline`` (time.monotonic(); None: the socket's own
    timeout). EOF raises ConnectionError; the deadline ``socket.timeout``."""
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("handshake deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view)
        if k == 0:
            raise ConnectionError("connection closed during the handshake")
        view = view[k:]
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: Optional[bytes], purpose: str, timeout: float) -> None:
    """Authenticate a connection this side opened (see the module docstring). Raises AuthError naming why
    (OSError / ConnectionError for a broken connection)."""
    deadline = time.monotonic() + timeout
    nc = _secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_PREAMBLE.pack(MAGIC, VERSION, F_SECRET if secret else 0, nc))
    magic, version, flags, ns, proof = _CHALLENGE.unpack(recv_exact(sock, _CHALLENGE.size, deadline))
    if magic != MAGIC or version != VERSION:
        raise AuthError(f"{purpose}: the peer is not a pxn listener of this version (answered {magic!r} "
                        f"v{version})")
    theirs = bool(flags & F_SECRET)
    if theirs != bool(secret):
        raise AuthError(f"{purpose}: the peer {'requires' if theirs else 'has no'} shared secret and this side "
                        f"{'has none' if theirs else 'has one'}; set the same PXN_SECRET (or secret=) on both sides")
    mine = _ZERO_MAC
    if secret:
        if not hmac.compare_digest(proof, _mac(secret, b"server", purpose, nc, ns)):
            raise AuthError(f"{purpose}: the peer's proof does not match this side's secret (different "
                            f"PXN_SECRET values)")
        mine = _mac(secret, b"client", purpose, nc, ns)
    sock.sendall(mine)
    verdict = recv_exact(sock, 1, deadline)[0]
    if verdict != VERDICT_OK:
        raise AuthError(f"{purpose}: the peer refused this side's proof (different PXN_SECRET values)")


def server_handshake(sock: socket.socket, secret: Optional[bytes], purpose: str, deadline: float,
                     admit: Optional[Callable[[], None]] = None) -> None:
    """Authenticate a connection this side accepted, before ``deadline`` (time.monotonic()). ``admit`` runs
    once the proof checked out and before the verdict goes out (``Admitted.established``: the peer acts on the
    verdict at once, so it must already count as authenticated); an AuthError from it refuses. Raises AuthError
    (the caller refuses the connection: closes it, answers nothing else)."""
    magic, version, flags, nc = _PREAMBLE.unpack(recv_exact(sock, _PREAMBLE.size, deadline))
    if magic != MAGIC or version != VERSION:
        raise AuthError(f"{purpose}: not a pxn handshake (first bytes {magic!r} v{version})")
    ns = _secrets.token_bytes(NONCE_BYTES)
    proof = _mac(secret, b"server", purpose, nc, ns) if secret else _ZERO_MAC
    sock.sendall(_CHALLENGE.pack(MAGIC, VERSION, F_SECRET if secret else 0, ns, proof))
    theirs = recv_exact(sock, MAC_BYTES, deadline)
    if bool(flags & F_SECRET) != bool(secret):
        sock.sendall(bytes([VERDICT_REFUSED]))
        raise AuthError(f"{purpose}: the peer {'has a' if flags & F_SECRET else 'has no'} shared secret, this "
                        f"side {'none' if not secret else 'one'}")
    if secret and not hmac.compare_digest(theirs, _mac(secret, b"client", purpose, nc, ns)):
        sock.sendall(bytes([VERDICT_REFUSED]))
        raise AuthError(f"{purpose}: wrong proof (the peer does not know the shared secret)")
    if admit is not None:
        try:
            admit()
        except AuthError:
            sock.sendall(bytes([VERDICT_REFUSED]))
            raise
    sock.sendall(bytes([VERDICT_OK]))


class _Counted(AuthError):
    """A refusal the gate counted already (evicted, or over the per-address cap)."""


# ============================================================================================================
# admission
# ============================================================================================================
_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_GATES: "weakref.WeakSet[Gate]" = weakref.WeakSet()  # every gate of the process: descriptors are shared


class Admitted:
    """One accepted connection inside a ``Gate``: ``sock``, ``addr`` (host, port), ``deadline`` to authenticate
    (time.monotonic()). The handler calls ``established()`` once the peer authenticated."""

    __slots__ = ("sock", "addr", "host", "deadline", "t0", "pending", "gate")

    def __init__(self, gate: "Gate", sock: socket.socket, addr, timeout: float):
        self.gate = gate
        self.sock = sock
        self.addr = addr
        self.host = addr[0] if isinstance(addr, tuple) else str(addr)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout
        self.pending = True

    def established(self) -> None:
        """The peer authenticated: it stops counting as waiting. Raises AuthError when its address already has
        ``max_per_addr`` authenticated connections being served."""
        self.gate._establish(self)


class Gate:
    """Admission for one listener (see the module docstring).

    Arguments:
        name: for logs ("ctrl 127.0.0.1:4000", "tcp 127.0.0.1:4001").
        handler: ``handler(admitted)`` runs in the connection's own thread; it authenticates, calls
            ``admitted.established()`` and serves. The gate closes the socket when it returns, unless the handler
            set ``admitted.sock = None`` (it handed the socket on).
        handshake_timeout: seconds a connection has to authenticate.
        max_pending, max_pending_per_addr: connections still authenticating, in all and per source address; a
            new one beyond either cap pushes the oldest waiting one (of that address, or in all) out.
        max_per_addr: authenticated connections being served (handler still running) per source address.
    """

    def __init__(self, name: str, handler: Callable[[Admitted], None], handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 max_pending: int = 128, max_pending_per_addr: int = 32, max_per_addr: int = 64):
        self.name = name
        self.handler = handler
        self.handshake_timeout = float(handshake_timeout)
        self.max_pending = max_pending
        self.max_pending_per_addr = max_pending_per_addr
        self.max_per_addr = max_per_addr
        self._lock = threading.Lock()
        self._pending: Dict[int, Admitted] = {}  # id -> waiting connection, oldest first (dict order)
        self._pending_by_host: Dict[str, int] = {}
        self._served_by_host: Dict[str, int] = {}
        self._counts = {"accepted": 0, "authenticated": 0, "refused_auth": 0, "handshake_timeouts": 0,
                        "evicted": 0, "refused_per_addr": 0, "accept_errors": 0}
        self._last_warn = 0.0
        _GATES.add(self)

    # --- telemetry ------------------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def stats(self) -> dict:
        """Counters (connections accepted / authenticated / refused by cause) and connections waiting now."""
        with self._lock:
            d = dict(self._counts)
            d["pending"] = len(self._pending)
            d["served"] = sum(self._served_by_host.values())
        d["refused"] = d["handshake_timeouts"] + d["evicted"] + sum(v for k, v in d.items() if k.startswith("refused"))
        return d

    # --- accept loop ----------------------------------------------------------------------------------------
    def serve(self, listener: socket.socket, closed: Callable[[], bool]) -> None:
        """Accept until ``closed()`` (the listener is shut down by the owner to wake this loop)."""
        backoff = 0.005
        while not closed():
            try:
                sock, addr = listener.accept()
            except OSError as e:
                if closed():
                    return
                self.count("accept_errors")
                shed = self._shed_oldest() if e.errno in _OUT_OF_FDS else False
                self._warn("%s: accept failed (%s); %s", self.name, e,
                           "dropped the oldest unauthenticated connection" if shed
                           else f"backing off {backoff * 1e3:.0f} ms")
                if shed:
                    time.sleep(0.002)  # its thread closes it (freeing the descriptor) as soon as it wakes
                else:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 0.1)
                continue
            backoff = 0.005
            self._admit(sock, addr)

    def _warn(self, fmt: str, *args) -> None:
        now = time.monotonic()
        level = logging.WARNING if now - self._last_warn > 5.0 else logging.DEBUG
        if level == logging.WARNING:
            self._last_warn = now
        log.log(level, fmt, *args)

    def _admit(self, sock: socket.socket, addr) -> None:
        a = Admitted(self, sock, addr, self.handshake_timeout)
        victims: List[Admitted] = []
        with self._lock:
            self._counts["accepted"] += 1
            if self._pending_by_host.get(a.host, 0) >= self.max_pending_per_addr:
                victims.append(next(p for p in self._pending.values() if p.host == a.host))
            elif len(self._pending) >= self.max_pending:
                victims.append(next(iter(self._pending.values())))
            for v in victims:
                self._unpend_locked(v)
                self._counts["evicted"] += 1
            self._pending[id(a)] = a
            self._pending_by_host[a.host] = self._pending_by_host.get(a.host, 0) + 1
        for v in victims:
            _shutdown(v.sock)  # its thread wakes with an error and closes it
        try:
            threading.Thread(target=self._run, args=(a,), daemon=True, name=f"pxn-accept-{self.name}").start()
        except RuntimeError as e:  # no thread to be had: refuse this one, keep listening
            self.count("accept_errors")
            self._warn("%s: cannot start a thread for %s (%s); refused it", self.name, addr, e)
            self._release(a)
            _close(sock)

    def _shed_oldest(self) -> bool:
        """Out of descriptors: drop the oldest unauthenticated connection of any gate of this process (the
        descriptors are shared: the control listener's waiting strangers can starve a rail listener)."""
        best = None
        for g in list(_GATES):
            with g._lock:
                first = next(iter(g._pending.values()), None)
            if first is not None and (best is None or first.t0 < best.t0):
                best = first
        if best is None:
            return False
        g = best.gate
        with g._lock:
            if not best.pending:
                return True  # gone meanwhile: its descriptor is free or about to be
            g._unpend_locked(best)
            g._counts["evicted"] += 1
        v = best
        # only shut down: its own thread closes it. Closing a socket another thread may still be about to use
        # lets the next accept reuse the descriptor number under that thread (it would read the new peer's bytes)
        _shutdown(v.sock)
        return True

    def _unpend_locked(self, a: Admitted) -> None:
        if self._pending.pop(id(a), None) is not None:
            n = self._pending_by_host.get(a.host, 1) - 1
            if n <= 0:
                self._pending_by_host.pop(a.host, None)
            else:
                self._pending_by_host[a.host] = n
        a.pending = False

    def _establish(self, a: Admitted) -> None:
        with self._lock:
            if not a.pending:
                raise _Counted(f"{self.name}: connection from {a.addr} was dropped while authenticating")
            self._unpend_locked(a)
            if self._served_by_host.get(a.host, 0) >= self.max_per_addr:
                self._counts["refused_per_addr"] += 1
                a.host = None  # not counted as served
                raise _Counted(f"{self.name}: {a.addr[0] if isinstance(a.addr, tuple) else a.addr} already has "
                                f"{self.max_per_addr} connections")
            self._served_by_host[a.host] = self._served_by_host.get(a.host, 0) + 1
            self._counts["authenticated"] += 1

    def _release(self, a: Admitted) -> None:
        with self._lock:
            if a.pending:
                self._unpend_locked(a)
            elif a.host is not None:
                n = self._served_by_host.get(a.host, 1) - 1
                if n <= 0:
                    self._served_by_host.pop(a.host, None)
                else:
                    self._served_by_host[a.host] = n
            a.host = None

    def _run(self, a: Admitted) -> None:
        sock = a.sock
        try:
            self.handler(a)
        except _Counted as e:
            log.info("%s: refused %s: %s", self.name, a.addr, e)
        except AuthError as e:
            self.count("refused_auth")
            log.info("%s: refused %s: %s", self.name, a.addr, e)
        except socket.timeout:
            if a.pending:
                self.count("handshake_timeouts")
            log.info("%s: %s did not authenticate within %.1f s", self.name, a.addr, self.handshake_timeout)
        except (OSError, ConnectionError, ValueError) as e:
            if a.pending:
                self.count("refused_auth")
            log.info("%s: connection from %s ended: %s", self.name, a.addr, e)
        except Exception:  # noqa: BLE001 — a broken peer must not take anything else down
            log.exception("%s: serving %s failed", self.name, a.addr)
        finally:
            self._release(a)
            if a.sock is not None:
                _close(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
