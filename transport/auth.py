"""Who may talk to an engine: shared-secret authentication bound to the connection, per-message MACs, and the
admission of incoming connections.

Authentication. Every control connection and every rail connection (tcp, ipc, the verbs connection exchange)
starts with a challenge-response, before the accepting side reads anything else, allocates anything or answers
anything:

1. the connecting side sends ``PREAMBLE``: magic ``PXNA``, version, flags (bit 0: it has a secret) and a fresh
   32-byte nonce ``nc``;
2. the accepting side answers with its own flags, a fresh nonce ``ns`` and
   ``HMAC-SHA256(secret, "pxn-auth-4 server" | purpose | nc | ns | client address | server address)``, which
   proves it knows the secret too;
3. the connecting side checks that proof and sends the same MAC under the label ``"client"``;
4. the accepting side checks it (constant-time compare) and sends one verdict byte (0: accepted).

Both nonces are fresh per connection, so a recorded handshake is worth nothing on a new connection, and the two
proofs carry different labels, so one side's proof cannot be reflected as the other's. ``purpose`` names the
listener kind ("ctrl", "tcp", "ipc", "verbs"): a proof for one kind of port is not one for another. Each side
puts the connection's two ends (ip and port) into the proofs *as it sees them*: a process in the middle that
relays a handshake between two connections of its own sees two different pairs of ends, so the proofs do not
check out and the handshake fails at once (this also means pxn does not work through NAT or a TCP proxy).

Session keys. Both sides then derive a key from the secret, both nonces and both ends' addresses, and from it
one keyed BLAKE2b of 32-byte output per direction (``Session``). Every later message on the connection carries a
16-byte tag, the first half of that hash over an implicit sequence number (one per direction, counted by both
sides) and what the message says: a control message (``transport.control``) its whole body, a tcp / ipc frame its
header and piece table. A frame's payload is not covered. When it is a relay chunk, its header and item table
(which say where each item goes) carry a MAC of their own under ``chunk_key``, checked by the receiver on every
fabric before any byte is placed (``pxn_kernels.chunk``, ``transport.receiver``). So bytes injected into a payload
can corrupt that write's bytes where its checked tables send them, but cannot send them anywhere else. A message
injected, replayed, dropped or reordered on the connection breaks the sequence of tags and closes it. The second
half of a tcp WRITE's hash never travels with it: the receiver, which computed it to check the tag, sends it back as
the write's ACK when every piece was placed (an *ack token*, ``transport.fabric.wire``), so that an ACK costs
neither side a hash of its own; nobody without the session key can produce it.

With no secret (``insecure=True`` / ``PXN_INSECURE=1``) the exchange still runs (flags 0, empty proofs) and
accepts; a secret on one side only is refused by both, with a message saying so. Nothing is MAC'd then.

Which secret (``resolve_secret``): ``secret=``, else ``PXN_SECRET``; at least 16 bytes. An empty ``secret=``
never overrides a set ``PXN_SECRET`` (ValueError). With neither: a listener on a loopback address uses the
per-user secret file (``PXN_SECRET_FILE``, default ``~/.config/pxn/secret``, created on first use with mode
0600 in a directory of mode 0700): every process of this user on this host reads the same random secret, and no
other user can; the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and refused at once, before a byte is read,
unless ``fstat`` shows a regular file of this user with mode 0600 (a symlink, FIFO or device never hangs or fools
a start). A listener on any other address refuses to start unless ``insecure=True`` / ``PXN_INSECURE=1`` (then
warns once per process; ``PXN_INSECURE`` takes 1/true/yes/on or 0/false/no/off, anything else is refused).

Admission (``Gate``). An accepting listener hands each connection to its own thread, or to its owner's selector
thread (``on_accept``: the engine's control listener, where one thread watches every connection), with a
deadline to authenticate (``handshake_timeout``), so an idle or slow connection holds nothing but itself. Connections
still authenticating are capped per source address and in all: a new one pushes the oldest waiting one out, so idle
sockets (slowloris) cannot lock out a real peer, which authenticates within a round trip. Authenticated connections
being served are capped per address. The accept loop survives running out of file descriptors
(``EMFILE`` / ``ENFILE``): it drops the oldest unauthenticated connection, backs off, logs, and keeps listening.
A connection refused for its proof is logged at WARNING, naming the peer address and "wrong or missing secret"
(at most one such line per listener every 5 s, with the count of those left out).
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets as _secrets
import socket
import stat
import struct
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional

from transport.config import EngineConfig
from transport.errors import (AdmissionRefused, AuthError, InsecureConfig, OverAddressCap, RefusalCounted,
                              SecretMismatch)
log = logging.getLogger(__name__)

__all__ = ["AuthError", "SecretMismatch", "AdmissionRefused", "InsecureConfig", "Resolved", "Session", "resolve_secret",
           "session_of", "client_handshake", "server_handshake", "Gate", "Admitted", "secret_file", "MIN_SECRET_BYTES"]

MAGIC = b"PXNA"
VERSION = 4
NONCE_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
"""Bytes of the tag every message after the handshake carries (the first half of a keyed BLAKE2b's output)."""
DIGEST_BYTES = 32
"""Output bytes of a session's keyed BLAKE2b: the tag, then the ack token (see the module docstring)."""
MIN_SECRET_BYTES = 16
"""Shortest shared secret accepted (bytes)."""
F_SECRET = 1
_PREAMBLE = struct.Struct("<4sBB2x32s")  # magic, version, flags, nonce
_CHALLENGE = struct.Struct("<4sBB2x32s32s")  # magic, version, flags, nonce, server proof
_ZERO_MAC = bytes(MAC_BYTES)
_SEQ = struct.Struct("<Q")
VERDICT_OK = 0
VERDICT_REFUSED = 1
VERDICT_OVER_CAP = 2  # the proof checked out, but the listener's per-address cap is full (``OverAddressCap``)

HANDSHAKE_TIMEOUT = 5.0
"""Default seconds an incoming connection has to authenticate (and, on a rail, to say hello)."""


class Resolved:
    """A secret already resolved by ``resolve_secret`` (``key``: bytes, or None for no authentication): handed
    from an engine to its fabrics, so that they neither read the environment again nor apply its rules twice."""

    __slots__ = ("key",)

    def __init__(self, key: Optional[bytes]):
        self.key = key

    def __repr__(self):
        return f"Resolved({'<secret>' if self.key else None})"


_WARNED_INSECURE = False
_FILE_SECRETS: Dict[str, bytes] = {}
_FILE_LOCK = threading.Lock()


def _is_loopback(host) -> bool:
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(str(host).strip("[]")).is_loopback
    except ValueError:
        return False


def secret_file(environ=None) -> str:
    """Path of the per-user secret file: ``PXN_SECRET_FILE``, else ``$XDG_CONFIG_HOME/pxn/secret`` (default
    ``~/.config/pxn/secret``)."""
    env = os.environ if environ is None else environ
    path = EngineConfig.read(("secret_file",), env).get("secret_file")
    if path:
        return os.path.abspath(os.path.expanduser(path))
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "pxn", "secret")


def open_secret_file(path: str) -> int:
    """A descriptor of the secret file ``path``, checked before a byte is read: opened with ``O_NOFOLLOW |
    O_NONBLOCK`` (a symlink is refused, and a FIFO or device opens at once instead of hanging the start), then
    ``fstat``: anything but a regular file of this user with mode 0600 raises InsecureConfig at once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InsecureConfig(f"secret file {path} is a symbolic link; point PXN_SECRET_FILE at the file "
                                 f"itself") from None
        raise InsecureConfig(f"secret file {path} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InsecureConfig(f"secret file {path} is not a regular file (mode {stat.filemode(st.st_mode)}); "
                                 f"set PXN_SECRET_FILE to a file of your own")
        if st.st_uid != os.getuid():
            raise InsecureConfig(f"secret file {path} belongs to uid {st.st_uid}, not to this user "
                                 f"({os.getuid()}); set PXN_SECRET_FILE to a file of your own")
        if st.st_mode & 0o777 != 0o600:
            raise InsecureConfig(f"secret file {path} has mode {st.st_mode & 0o777:o}, not 600"
                                 f"{': other users may read it' if st.st_mode & 0o077 else ''}; chmod 600 it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _load_secret_file(path: str) -> bytes:
    """The secret in ``path``, created (32 random bytes, hex, mode 0600, directory 0700) when missing. Raises
    InsecureConfig at once when it is a symlink, not a regular file (a FIFO must not hang the start), not this
    user's, not of mode 0600, or too short (``open_secret_file``)."""
    with _FILE_LOCK:
        got = _FILE_SECRETS.get(path)
        if got is not None:
            return got
        d = os.path.dirname(path)
        os.makedirs(d, mode=0o700, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            pass
        else:
            # several processes may start at once: the one that created the file writes it; the others wait
            # below for its content
            with os.fdopen(fd, "w") as f:
                f.write(_secrets.token_hex(32) + "\n")
        deadline = time.monotonic() + 2.0
        while True:
            fd = open_secret_file(path)
            try:
                data = os.read(fd, 4096).strip()
            finally:
                os.close(fd)
            if len(data) >= MIN_SECRET_BYTES or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if len(data) < MIN_SECRET_BYTES:
            raise InsecureConfig(f"secret file {path} holds {len(data)} bytes, fewer than {MIN_SECRET_BYTES}")
        _FILE_SECRETS[path] = data
        return data


def resolve_secret(secret=None, host=None, insecure: Optional[bool] = None, environ=None) -> Optional[bytes]:
    """The shared secret as bytes, or None for no authentication (see the module docstring).

    Arguments:
        secret: str / bytes given by the caller (None: not given; ``Resolved``: already resolved, returned as is).
        host: the address this side listens on (None: not a listener, or unknown): without a secret, a loopback
            one uses the per-user secret file, any other refuses unless insecure.
        insecure: allow running without a secret (None: ``PXN_INSECURE``).
        environ: the environment (default ``os.environ``).
    Raises InsecureConfig (a ValueError) naming the setting: a secret shorter than 16 bytes, ``secret=''`` while
    ``PXN_SECRET`` is set, a non-loopback listener without a secret, an unusable secret file."""
    global _WARNED_INSECURE
    if isinstance(secret, Resolved):
        return secret.key
    env = os.environ if environ is None else environ
    given = EngineConfig.read(("secret", "insecure"), env)
    if secret is not None:
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, (bytes, bytearray)):
            raise ValueError(f"secret must be a str or bytes, got {type(secret).__name__}")
        secret = bytes(secret)
        if not secret:
            if given.get("secret"):
                raise InsecureConfig("secret='' would override PXN_SECRET; pass the same secret, or leave secret= "
                                     "unset (to run without one: insecure=True / PXN_INSECURE=1, and no PXN_SECRET)")
            secret = None
    where = "secret="
    if secret is None and given.get("secret"):
        secret, where = given["secret"].encode(), "PXN_SECRET"
    if secret is not None:
        if len(secret) < MIN_SECRET_BYTES:
            raise InsecureConfig(f"{where}: a shared secret of {len(secret)} bytes is too short (at least "
                                 f"{MIN_SECRET_BYTES}; e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
        return secret
    if insecure is None:
        insecure = given.get("insecure", False)
    if insecure:
        if not _WARNED_INSECURE:
            _WARNED_INSECURE = True
            log.warning("pxn: running without a shared secret (insecure=True / PXN_INSECURE=1): any process that "
                        "can reach this process's ports may write into and read its registered memory")
        return None
    if _is_loopback(host):
        return _load_secret_file(secret_file(env))
    raise InsecureConfig(f"a pxn listener on {host!r} (not a loopback address) needs a shared secret: set secret= "
                         f"or PXN_SECRET (at least {MIN_SECRET_BYTES} bytes, the same on every host), or pass "
                         f"insecure=True / PXN_INSECURE=1 to run without one")


def _mac(secret: bytes, role: bytes, purpose: str, nc: bytes, ns: bytes, ends: bytes) -> bytes:
    label = b"pxn-auth-%d " % VERSION  # a new version's proofs never verify under an old one
    return hmac.new(secret, label + role + b"|" + purpose.encode() + b"|" + nc + ns + b"|" + ends,
                    hashlib.sha256).digest()


def _addr_text(addr) -> str:
    host, port = (addr[0], addr[1]) if isinstance(addr, tuple) else (str(addr), 0)
    if isinstance(host, str) and host.startswith("::ffff:"):  # a v4 peer on a dual-stack socket
        host = host[7:]
    return f"{host}|{port}"


def _ends(sock: socket.socket, client_side: bool) -> bytes:
    """The connection's two ends as this side sees them, client end first."""
    try:
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:
        local = remote = ""
    if isinstance(local, (bytes, str)) and not isinstance(local, tuple):  # unix socket: no addresses
        return b"unix"
    c, s = (local, remote) if client_side else (remote, local)
    return (_addr_text(c) + "/" + _addr_text(s)).encode()


class Session:
    """What an authenticated connection keeps: a tag per message in each direction, each over an implicit
    sequence number (``tag`` for what this side sends, ``check`` / ``rx_begin`` + ``rx_end`` for what it
    receives); ``acks``, the ack tokens of the WRITEs this side sent and the peer has not acknowledged yet
    (message sequence number -> 16 bytes, kept by ``transport.fabric.wire``); and ``binding``, a value both ends
    of this connection (and nobody else's) share, by which an engine can ask a peer whether it opened a given
    connection (``transport.reads``).

    ``tx_hash`` / ``rx_hash``: the keyed BLAKE2b states of each direction (None without a secret), for a framing
    that numbers and tags its frames itself (``transport.fabric.wire``: one contiguous hash update per frame, where
    ``tag`` / ``rx_begin`` would add a step). Read them, ``copy()`` and update the copy; never update them in
    place, and take ``tx_n`` / ``rx_n`` for each frame as ``tag`` / ``rx_begin`` do."""

    __slots__ = ("tx_hash", "rx_hash", "tx_n", "rx_n", "acks", "binding", "purpose", "__weakref__")

    def __init__(self, key: Optional[bytes], client: bool, binding: bytes, purpose: str):
        self.binding = binding
        self.purpose = purpose
        self.tx_n = 0
        self.rx_n = 0
        self.acks: Dict[int, bytes] = {}
        if key is None:
            self.tx_hash = self.rx_hash = None
            return
        c2s = hashlib.blake2b(b"c2s", key=key, digest_size=32).digest()
        s2c = hashlib.blake2b(b"s2c", key=key, digest_size=32).digest()
        self.tx_hash = hashlib.blake2b(key=c2s if client else s2c, digest_size=DIGEST_BYTES)
        self.rx_hash = hashlib.blake2b(key=s2c if client else c2s, digest_size=DIGEST_BYTES)

    @property
    def keyed(self) -> bool:
        """False without a secret: nothing is tagged (``tag`` returns zeros, checks pass)."""
        return self.tx_hash is not None

    def tag(self, *parts) -> bytes:
        """The tag of the next message this side sends (its sequence number is taken now: send in this order)."""
        h = self.tx_hash
        if h is None:
            return bytes(TAG_BYTES)
        h = h.copy()
        h.update(_SEQ.pack(self.tx_n))
        self.tx_n += 1
        for p in parts:
            h.update(p)
        return h.digest()[:TAG_BYTES]

    def rx_begin(self, *parts):
        """Start checking the next received message: returns a hash to ``update`` with the rest and hand to
        ``rx_end`` (None without a secret)."""
        h = self.rx_hash
        if h is None:
            return None
        h = h.copy()
        h.update(_SEQ.pack(self.rx_n))
        self.rx_n += 1
        for p in parts:
            h.update(p)
        return h

    def rx_end(self, h, tag) -> None:
        """Raise SecretMismatch unless ``tag`` is the one ``h`` expects."""
        if h is not None and not hmac.compare_digest(h.digest()[:TAG_BYTES], bytes(tag)):
            raise SecretMismatch(f"{self.purpose}: message {self.rx_n - 1} on this connection carries a wrong tag "
                                 f"(injected, replayed or reordered); closing the connection")

    def check(self, tag, *parts) -> None:
        """``rx_end(rx_begin(*parts), tag)``."""
        self.rx_end(self.rx_begin(*parts), tag)


_SESSIONS: "weakref.WeakKeyDictionary[socket.socket, Session]" = weakref.WeakKeyDictionary()


def session_of(sock) -> Optional[Session]:
    """The ``Session`` of an authenticated socket (None: not authenticated through this module)."""
    try:
        return _SESSIONS.get(sock)
    except TypeError:
        return None


def claim_proof(key: bytes, binding: bytes) -> bytes:
    """Proof that the sender of a control request on the connection with ``binding`` (``Session.binding``) holds
    ``key``, the key a receiver gave that sender in its hello reply (``transport.control``: a ``credits`` request,
    or a second hello, naming a connected sender's engine id on another connection than its hello's must carry
    it). Keyed BLAKE2b of the binding, 16 bytes: a proof seen on one connection is worth nothing on another."""
    return hashlib.blake2b(b"pxn-claim-1|" + binding, key=key, digest_size=16).digest()


def chunk_key(secret: Optional[bytes], sender_key: bytes) -> Optional[bytes]:
    """The key of the MAC every relay chunk from a sender to a receiver carries over its header and item table
    (``pxn_kernels.chunk``): HMAC-SHA256 of the shared secret over the key the receiver gave that sender in its
    hello reply (fresh per hello). Both ends derive it; it never travels, so whoever read the hello reply off the
    network still cannot make a chunk's table check. None without a secret (nothing is MAC'd)."""
    if secret is None:
        return None
    return hmac.new(secret, b"pxn-chunk-1|" + sender_key, hashlib.sha256).digest()


def _start_session(sock, secret, client: bool, purpose: str, nc: bytes, ns: bytes, ends: bytes) -> Session:
    key = None
    if secret:
        key = hmac.new(secret, b"pxn-session-2|" + purpose.encode() + b"|" + nc + ns + b"|" + ends,
                       hashlib.sha256).digest()
    binding = hashlib.blake2b(b"pxn-binding-2|" + purpose.encode() + b"|" + nc + ns + b"|" + ends,
                              digest_size=16).digest()
    sess = Session(key, client, binding, purpose)
    _SESSIONS[sock] = sess
    return sess


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


def client_handshake(sock: socket.socket, secret: Optional[bytes], purpose: str, timeout: float) -> Session:
    """Authenticate a connection this side opened (see the module docstring) and return its ``Session`` (also
    found later by ``session_of(sock)``). Raises AuthError naming why (OSError / ConnectionError for a broken
    connection)."""
    deadline = time.monotonic() + timeout
    nc = _secrets.token_bytes(NONCE_BYTES)
    sock.sendall(_PREAMBLE.pack(MAGIC, VERSION, F_SECRET if secret else 0, nc))
    try:
        challenge = recv_exact(sock, _CHALLENGE.size, deadline)
    except ConnectionError:
        raise _dropped(purpose, "before its challenge") from None
    magic, version, flags, ns, proof = _CHALLENGE.unpack(challenge)
    if magic != MAGIC or version != VERSION:
        raise AuthError(f"{purpose}: the peer is not a pxn listener of this version (answered {magic!r} "
                        f"v{version})")
    ends = _ends(sock, True)
    theirs = bool(flags & F_SECRET)
    if theirs != bool(secret):
        _send_quietly(sock, _ZERO_MAC)  # the listener then logs why it refused
        raise SecretMismatch(f"{purpose}: the peer {'requires' if theirs else 'has no'} shared secret and this "
                             f"side {'has none' if theirs else 'has one'}; set the same PXN_SECRET (or secret=) on "
                             f"both sides")
    mine = _ZERO_MAC
    if secret:
        if not hmac.compare_digest(proof, _mac(secret, b"server", purpose, nc, ns, ends)):
            _send_quietly(sock, _ZERO_MAC)
            raise SecretMismatch(f"{purpose}: the peer's proof does not match this side's secret (different "
                                 f"PXN_SECRET values, or a relayed / translated connection)")
        mine = _mac(secret, b"client", purpose, nc, ns, ends)
    sock.sendall(mine)
    try:
        verdict = recv_exact(sock, 1, deadline)[0]
    except ConnectionError:
        raise _dropped(purpose, "before its verdict") from None
    if verdict == VERDICT_OVER_CAP:
        raise AdmissionRefused(f"{purpose}: the peer accepted this side's proof but refused the connection: it "
                               f"already serves as many connections from this side's address as it allows per "
                               f"address (PXN_MAX_CONNS_PER_ADDR on the peer, default 64, raises it)", "per_addr")
    if verdict != VERDICT_OK:
        raise SecretMismatch(f"{purpose}: the peer refused this side's proof (different PXN_SECRET values)")
    return _start_session(sock, secret, True, purpose, nc, ns, ends)


def _dropped(purpose: str, when: str) -> AdmissionRefused:
    """The listener closed a connection in the middle of its handshake (``when``): what that means."""
    caps = ("PXN_MAX_PENDING_PER_ADDR from one address, default 32; PXN_MAX_PENDING in all, default 128"
            if purpose == "ctrl" else "32 from one address, 128 in all")
    return AdmissionRefused(f"{purpose}: the peer closed the connection {when}: it drops the oldest connection "
                            f"still authenticating when too many wait ({caps}: many engines connecting at once), "
                            f"or this handshake outlived its PXN_HANDSHAKE_TIMEOUT (a starved host), or it is not a "
                            f"pxn listener", "pending")


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


class ServerHandshake:
    """The accepting side's handshake in steps, for a caller that reads the bytes itself (a selector thread that
    watches many connections, ``transport.control``): ``need`` is how many bytes the next step takes; ``step``
    with exactly that many bytes either sends the challenge (after the preamble; returns None) or checks the
    peer's proof, runs ``admit`` and sends the verdict (returns the ``Session``). Raises as ``server_handshake``.
    The two sends are 72 and 1 bytes on a fresh connection: they fit its send buffer, so they do not block."""

    __slots__ = ("sock", "secret", "purpose", "admit", "need", "_nc", "_ns", "_flags", "_ends")

    def __init__(self, sock: socket.socket, secret: Optional[bytes], purpose: str,
                 admit: Optional[Callable[[], None]] = None):
        self.sock = sock
        self.secret = secret
        self.purpose = purpose
        self.admit = admit
        self.need = _PREAMBLE.size
        self._nc = None  # the peer's nonce, once its preamble came

    def step(self, data: bytes) -> Optional[Session]:
        if self._nc is None:
            magic, version, flags, nc = _PREAMBLE.unpack(data)
            if magic != MAGIC or version != VERSION:
                raise AuthError(f"{self.purpose}: not a pxn handshake (first bytes {magic!r} v{version})")
            self._ends = _ends(self.sock, False)
            self._nc, self._flags = nc, flags
            self._ns = ns = _secrets.token_bytes(NONCE_BYTES)
            secret, purpose = self.secret, self.purpose
            proof = _mac(secret, b"server", purpose, nc, ns, self._ends) if secret else _ZERO_MAC
            self.sock.sendall(_CHALLENGE.pack(MAGIC, VERSION, F_SECRET if secret else 0, ns, proof))
            self.need = MAC_BYTES
            return None
        return self._verdict(data)

    def closed_early(self) -> SecretMismatch:
        """What an EOF after the challenge means (the error to raise)."""
        return SecretMismatch(f"{self.purpose}: the peer closed the connection after the challenge (it does not "
                              f"know the shared secret, has another one, or does not speak pxn-auth-{VERSION})")

    def _verdict(self, theirs: bytes) -> Session:
        sock, secret, purpose, flags = self.sock, self.secret, self.purpose, self._flags
        if bool(flags & F_SECRET) != bool(secret):
            _send_quietly(sock, bytes([VERDICT_REFUSED]))
            raise SecretMismatch(f"{purpose}: the peer {'has a' if flags & F_SECRET else 'has no'} shared secret, "
                                 f"this side {'none' if not secret else 'one'}")
        if secret and not hmac.compare_digest(theirs, _mac(secret, b"client", purpose, self._nc, self._ns,
                                                           self._ends)):
            _send_quietly(sock, bytes([VERDICT_REFUSED]))
            raise SecretMismatch(f"{purpose}: wrong proof (the peer does not know the shared secret, or the "
                                 f"connection is relayed)")
        sess = _start_session(sock, secret, False, purpose, self._nc, self._ns, self._ends)
        if self.admit is not None:
            try:
                self.admit()
            except AuthError as e:
                sock.sendall(bytes([VERDICT_OVER_CAP if isinstance(e, OverAddressCap) else VERDICT_REFUSED]))
                raise
        sock.sendall(bytes([VERDICT_OK]))
        return sess


def server_handshake(sock: socket.socket, secret: Optional[bytes], purpose: str, deadline: float,
                     admit: Optional[Callable[[], None]] = None) -> Session:
    """Authenticate a connection this side accepted, before ``deadline`` (time.monotonic()), and return its
    ``Session``. ``admit`` runs once the proof checked out and before the verdict goes out
    (``Admitted.established``: the peer acts on the verdict at once, so it must already count as authenticated);
    an AuthError from it refuses. Raises AuthError (SecretMismatch for a proof that does not check out; the
    caller refuses the connection: closes it, answers nothing else)."""
    hs = ServerHandshake(sock, secret, purpose, admit)
    hs.step(recv_exact(sock, hs.need, deadline))
    try:
        theirs = recv_exact(sock, hs.need, deadline)
    except ConnectionError:
        raise hs.closed_early() from None
    return hs.step(theirs)


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
        variables: the ``PXN_*`` variable behind each cap, for the refusals' messages and log lines: keys
            "max_per_addr", "max_pending", "max_pending_per_addr" (the control port's; a rail's caps have none).
        on_accept: instead of ``handler``: ``on_accept(admitted)`` is called on the accept thread and must not
            wait on any peer (it may wait briefly for its owner to keep pace: accepting no faster than the owner
            looks at what it accepted is what keeps the caps above for slow peers); it takes the connection over
            (no thread is started for it: the owner watches many connections from one thread,
            ``transport.control``), enforces ``admitted.deadline`` itself and reports the connection's end, with
            the exception that ended it or None, to ``finish`` (which counts, logs, releases the caps and closes
            the socket as a handler's return would). An exception from
            ``on_accept`` itself (the owner is closing) ends the connection at once.
        Pushing a waiting connection out (the caps above, or out of descriptors) only shuts it down: whoever
        holds it (its thread, or the owner's selector) sees the end and closes it.
    """

    def __init__(self, name: str, handler: Optional[Callable[[Admitted], None]] = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, max_pending: int = 128, max_pending_per_addr: int = 32,
                 max_per_addr: int = 64, on_accept: Optional[Callable[[Admitted], None]] = None,
                 variables: Optional[Dict[str, str]] = None):
        if (handler is None) == (on_accept is None):
            raise ValueError(f"Gate {name!r}: give exactly one of handler= and on_accept=")
        self.name = name
        self.handler = handler
        self.on_accept = on_accept
        self.handshake_timeout = float(handshake_timeout)
        self.max_pending = max_pending
        self.max_pending_per_addr = max_pending_per_addr
        self.max_per_addr = max_per_addr
        self.variables = dict(variables or {})
        self._lock = threading.Lock()
        self._pending: Dict[int, Admitted] = {}  # id -> waiting connection, oldest first (dict order)
        self._pending_by_host: Dict[str, int] = {}
        self._served_by_host: Dict[str, int] = {}
        # ``evicted`` sums its causes: the per-address and the total cap on connections still authenticating, and
        # running out of descriptors
        self._counts = {"accepted": 0, "authenticated": 0, "refused_auth": 0, "handshake_timeouts": 0,
                        "evicted": 0, "evicted_pending_per_addr": 0, "evicted_pending": 0, "evicted_out_of_fds": 0,
                        "refused_per_addr": 0, "accept_errors": 0}
        self._last_warn = 0.0
        self._last_refusal = 0.0
        self._refusals_quiet = 0  # refusals for the proof not logged at WARNING since the last one that was
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

    def cap_text(self, cap: str) -> str:
        """``cap`` ("max_per_addr", ...) and its value, with the variable that raises it where there is one."""
        var = self.variables.get(cap)
        return f"{cap}={getattr(self, cap)}" + (f", raised by {var}" if var else "")

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

    def _refused_proof(self, a: Admitted, e: BaseException) -> None:
        """Say why a peer was refused, at WARNING with its address, at most once per 5 s per listener (a flood of
        strangers must not flood the log); the lines left out are counted into the next one."""
        now = time.monotonic()
        with self._lock:
            loud = now - self._last_refusal > 5.0
            if loud:
                self._last_refusal = now
                quiet, self._refusals_quiet = self._refusals_quiet, 0
            else:
                self._refusals_quiet += 1
        if loud:
            log.warning("%s: refused %s: wrong or missing secret (%s)%s", self.name, _peer_text(a.addr), e,
                        f"; {quiet} more refusal(s) for the secret since the last such line" if quiet else "")
        else:
            log.debug("%s: refused %s: wrong or missing secret (%s)", self.name, _peer_text(a.addr), e)

    def _admit(self, sock: socket.socket, addr) -> None:
        a = Admitted(self, sock, addr, self.handshake_timeout)
        victims: List[Admitted] = []
        cap = None
        with self._lock:
            self._counts["accepted"] += 1
            if self._pending_by_host.get(a.host, 0) >= self.max_pending_per_addr:
                victims.append(next(p for p in self._pending.values() if p.host == a.host))
                cap = "max_pending_per_addr"
            elif len(self._pending) >= self.max_pending:
                victims.append(next(iter(self._pending.values())))
                cap = "max_pending"
            for v in victims:
                self._unpend_locked(v)
                self._counts["evicted"] += 1
                self._counts["evicted_" + cap[len("max_"):]] += 1
            self._pending[id(a)] = a
            self._pending_by_host[a.host] = self._pending_by_host.get(a.host, 0) + 1
        for v in victims:
            self._warn("%s: dropped %s, the oldest connection still authenticating, for %s (%s)", self.name,
                       _peer_text(v.addr), _peer_text(addr), self.cap_text(cap))
            _shutdown(v.sock)  # its thread (or its owner's selector) wakes with an error and closes it
        if self.on_accept is not None:
            try:
                self.on_accept(a)
            except Exception as e:  # noqa: BLE001 — the owner is closing: end this one, keep the loop's contract
                log.debug("%s: not taking %s: %s", self.name, addr, e)
                self.finish(a, None)
            return
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
            g._counts["evicted_out_of_fds"] += 1
        v = best
        # only shut down: whoever holds it (its thread, or the owner's selector) closes it. Closing a socket another
        # thread may still be about to use lets the next accept reuse the descriptor number under that thread (it
        # would read the new peer's bytes)
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
                raise RefusalCounted(f"{self.name}: connection from {a.addr} was dropped while authenticating")
            self._unpend_locked(a)
            if self._served_by_host.get(a.host, 0) >= self.max_per_addr:
                self._counts["refused_per_addr"] += 1
                a.host = None  # not counted as served
                raise OverAddressCap(f"{self.name}: {a.addr[0] if isinstance(a.addr, tuple) else a.addr} already has "
                                     f"{self.max_per_addr} connections being served ({self.cap_text('max_per_addr')})")
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
        err = None
        try:
            self.handler(a)
        except Exception as e:  # noqa: BLE001 — a broken peer must not take anything else down (``finish``)
            err = e
        self.finish(a, err)

    def finish(self, a: Admitted, err: Optional[BaseException] = None) -> None:
        """The end of connection ``a``: count and log ``err`` (what ended it; None: the peer closed, or the owner
        did), release its place under the caps, close its socket unless ``a.sock`` was set to None (handed on).
        Called once per connection: by its thread when the handler returns, or by the owner (``on_accept``)."""
        sock = a.sock
        try:
            if err is None:
                pass
            elif isinstance(err, OverAddressCap):
                self._warn("%s: refused %s: %s", self.name, _peer_text(a.addr), err)
            elif isinstance(err, RefusalCounted):
                log.info("%s: refused %s: %s", self.name, a.addr, err)
            elif isinstance(err, SecretMismatch):
                self.count("refused_auth")
                self._refused_proof(a, err)
            elif isinstance(err, AuthError):
                self.count("refused_auth")
                log.info("%s: refused %s: %s", self.name, a.addr, err)
            elif isinstance(err, socket.timeout):
                if a.pending:
                    self.count("handshake_timeouts")
                log.info("%s: %s did not authenticate within %.1f s", self.name, a.addr, self.handshake_timeout)
            elif isinstance(err, (OSError, ConnectionError, ValueError)):
                if a.pending:
                    self.count("refused_auth")
                log.info("%s: connection from %s ended: %s", self.name, a.addr, err)
            else:
                log.error("%s: serving %s failed", self.name, a.addr, exc_info=err)
        finally:
            self._release(a)
            if a.sock is not None:
                _close(sock)


def _peer_text(addr) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return str(addr)


class RailClaims:
    """Rail ids that authenticated control hellos announced (a fabric's ``expect_peer``), each good for one
    incoming rail connection within its ttl. Off (``enabled`` False: a fabric not made by an engine), every id is
    taken. Thread-safe."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)
        self._until: Dict[str, float] = {}  # peer id -> until when an incoming connection may take it
        self._lock = threading.Lock()

    def expect(self, peer_id: str, ttl: float) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, t in self._until.items() if t < now]:
                del self._until[k]
            self._until[peer_id] = now + ttl

    def refusal(self, peer_id: str, held_alive: bool) -> Optional[str]:
        """Why an incoming connection may not take ``peer_id`` (None: it may); consumes its announcement.
        ``held_alive``: a live endpoint of that id exists here."""
        if not self.enabled:
            return None
        with self._lock:
            until = self._until.pop(peer_id, None)
        if until is not None and until >= time.monotonic():
            return None
        if held_alive:
            return f"peer id {peer_id!r} is held by a live connection"
        return f"peer id {peer_id!r} was not announced by an authenticated control hello"


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
