"""A small HTTP metadata server speaking Mooncake's http metadata protocol, so no Mooncake install is needed.

Protocol (the one of Mooncake's ``mooncake_http_metadata_server``): one path, ``/metadata``, with the key in the
query string ``?key=<key>``:

* ``PUT /metadata?key=K`` with any body stores the body under K (200); a second PUT of a key containing
  ``rpc_meta`` is refused with 400, as Mooncake's server does;
* ``GET /metadata?key=K`` returns the stored body (200) or 404;
* ``DELETE /metadata?key=K`` removes it (200) or 404;
* no ``key``: 400.

One name, one owner (pxn's extension; Mooncake's clients send neither header and see its protocol unchanged): a
PUT carrying ``X-Pxn-Owner: <owner>`` over a key that holds another owner's value (or a value stored without an
owner) is refused with 409 and that value as the body, unless it also carries ``X-Pxn-Take-Over: 1``; a DELETE
carrying ``X-Pxn-Owner`` removes the key only when that owner stored it (409 otherwise). pxn engines send their
engine id as the owner, so an engine never replaces nor removes another's entry unasked. The owner is checked
before a signed PUT's version (below), whose 409 says so in text, not with a stored value.

Values are opaque bytes: pxn engines and Mooncake engines can share one server (pxn keeps its entries under keys
starting with ``pxn/``). Start it from a shell with ``python -m integration.metadata_server --port 8080`` or in a
program::

    from integration.metadata_server import MetadataServer
    with MetadataServer("127.0.0.1", 0) as srv:      # port 0: any free port
        url = srv.url                                # "http://127.0.0.1:<port>/metadata"

Who may change what. Whoever can write an entry can redirect a new sender's KV writes (a segment name resolves
to the session it names), so:

* The secret is the engines' one (``transport.auth.resolve_secret``): ``secret=`` / ``PXN_SECRET`` (at least 16
  bytes), else, on a loopback address, the per-user secret file that engines on loopback use too. Every request that
  changes state (PUT, POST, DELETE) first fetches a challenge (``GET /metadata/challenge``: the time, a random part
  and a MAC under a key this server instance drew at its start) and carries ``X-Pxn-Auth: <challenge>:<version>:<hex
  HMAC-SHA256(secret, "pxn-meta-3|" method "|" key "|" challenge "|" version "|" take-over "|" owner "|" SHA-256 of
  the body)>`` (``sign``; take-over "1" or "0", owner "=" and the ``X-Pxn-Owner`` value or "-" without one: the
  owner headers cannot be stripped nor added). A request without it, with a wrong one, with a challenge this
  instance did not issue (another server with the same secret, or this one before a restart), more than ``MAX_SKEW``
  seconds old or used before is refused with 403 before anything is stored, so a captured change is worth nothing
  anywhere. A PUT's ``version`` must be above the stored entry's (409 otherwise): an entry never goes back to an
  older one. pxn's Mooncake layer signs with its engine's secret. GETs stay open.
* Without a secret only when told to be insecure (``insecure=True`` / ``PXN_INSECURE=1`` / ``--insecure``): the
  server then speaks Mooncake's protocol unchanged (Mooncake's own clients keep working), and any local process
  may change any entry; a non-loopback address without a secret refuses to start otherwise.

Bounds: a request body of at most ``max_body`` bytes (413 before it is read), a key of at most 1024 bytes, at most
``max_keys`` keys and ``max_bytes`` stored bytes in all (507 beyond). Threads are bounded: one selector thread
accepts connections and receives each request until it is whole (line, headers, body), and only then hands it to
a pool of ``workers`` threads, one request per connection (every reply says ``Connection: close``). A connection
whose request is not whole within ``idle_timeout`` seconds is closed; beyond ``max_waiting`` connections or
``max_buffered`` bytes of requests still arriving, the oldest are dropped. So idle or slow sockets cost a
descriptor and their bytes, never a thread, and cannot make a legitimate request wait.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import hmac
import io
import logging
import os
import re
import secrets as _secrets
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from typing import Dict, Optional
from urllib.parse import parse_qs, urlsplit

from transport.errors import MetadataRequestRefused

log = logging.getLogger(__name__)

__all__ = ["MetadataServer", "main", "sign", "AUTH_HEADER", "CHALLENGE_PATH", "OWNER_HEADER", "TAKE_OVER_HEADER"]

AUTH_HEADER = "X-Pxn-Auth"
OWNER_HEADER = "X-Pxn-Owner"
TAKE_OVER_HEADER = "X-Pxn-Take-Over"
MAX_SKEW = 60.0
"""Seconds a signed request stays valid (clock difference between client and server included)."""
MAX_KEY = 1024  # bytes of a key
CHALLENGE_PATH = "/metadata/challenge"
_MAX_HEAD = 64 << 10  # bytes of a request line and headers
_CONTENT_LENGTH = re.compile(rb"(?im)^content-length:[ \t]*([0-9]{1,12})[ \t]*\r?$")


def sign(secret: bytes, method: str, key: str, body: bytes, challenge: str, version: int = 0,
         owner: Optional[str] = None, take_over: bool = False) -> str:
    """The ``X-Pxn-Auth`` value proving ``secret`` for one request (``method`` "PUT" / "DELETE", ``key``, ``body``
    bytes) to the server that issued ``challenge`` (the body of ``GET /metadata/challenge``); ``version``: the
    entry's version, above the one stored (a PUT; any int for a DELETE); ``owner`` / ``take_over``: the
    request's ``X-Pxn-Owner`` (None: no such header) and whether it carries ``X-Pxn-Take-Over: 1``."""
    version = int(version)
    return f"{challenge}:{version}:{_mac(secret, method, key, challenge, version, body, owner, take_over)}"


def _mac(secret: bytes, method: str, key: str, challenge: str, version: int, body: bytes, owner: Optional[str],
         take_over: bool) -> str:
    # the owner comes last before the body's fixed-size hash (it may hold any character); "-": no owner header,
    # "=" + owner: one (so an empty owner differs from none)
    msg = "|".join(("pxn-meta-3", method.upper(), key, challenge, str(version), "1" if take_over else "0",
                    "-" if owner is None else "=" + owner)).encode() + b"|" + hashlib.sha256(body).digest()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # through logging, not stderr
        log.debug("%s - %s", self.address_string(), fmt % args)

    def setup(self):
        super().setup()
        # the selector thread received the request (headers and a body within the cap) before handing it over:
        # it is read from there; only a body above the cap would need the socket, and it is refused unread
        self.rfile = io.BufferedReader(_Prefixed(self.prefix, self.connection, time.monotonic() + 1.0))

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # one request per connection: a worker never waits for a next one
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _key(self) -> Optional[str]:
        url = urlsplit(self.path)
        if url.path.rstrip("/") != "/metadata":
            self._reply(404, b"unknown path")
            return None
        key = parse_qs(url.query).get("key", [""])[0].strip()
        if not key:
            self._reply(400, b"metadata key is required")
            return None
        if len(key.encode()) > MAX_KEY:
            self._reply(400, b"metadata key too long")
            return None
        return key

    def _body(self, n: int) -> bytes:
        """``n`` bytes of body, received as they arrive (a Content-Length alone allocates nothing)."""
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.rfile.read1(min(n - len(buf), 1 << 16))
            except socket.timeout:
                raise MetadataRequestRefused(408, "request body not received in time") from None
            if not chunk:
                raise MetadataRequestRefused(400, "request body shorter than its Content-Length")
            buf += chunk
        return bytes(buf)

    def do_GET(self):  # noqa: N802 — http.server's naming
        if urlsplit(self.path).path.rstrip("/") == CHALLENGE_PATH:
            self._reply(200, self.server.challenge().encode())
            return
        key = self._key()
        if key is None:
            return
        with self.server.lock:
            value = self.server.store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value)

    def do_PUT(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        srv = self.server
        try:
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0:
                raise MetadataRequestRefused(400, "bad Content-Length")
            if n > srv.max_body:
                raise MetadataRequestRefused(413, f"body of {n} B above the server's {srv.max_body} B")
            with srv.lock:
                old = srv.store.get(key)
                self._room(key, n, old)
            body = self._body(n)
            version = self._check_auth("PUT", key, body)
            owner = self.headers.get(OWNER_HEADER)
            with srv.lock:
                old = srv.store.get(key)
                if "rpc_meta" in key and old is not None:
                    raise MetadataRequestRefused(400, "Duplicate rpc_meta key not allowed")
                if (owner is not None and old is not None and srv.owners.get(key) != owner
                        and self.headers.get(TAKE_OVER_HEADER) != "1"):
                    held = old   # another owner's entry: refused, and sent back so the caller can name it
                else:
                    held = None
                    stored = srv.versions.get(key)
                    if version is not None and stored is not None and version <= stored:
                        raise MetadataRequestRefused(409, f"version {version} of {key!r} is not newer than the "
                                                          f"stored version {stored}")
                    self._room(key, n, old)
                    srv.store[key] = body
                    srv.total += n - (len(old) if old is not None else 0)
                    if version is not None:
                        srv.versions[key] = version
                    if owner is None:
                        srv.owners.pop(key, None)
                    else:
                        srv.owners[key] = owner
        except MetadataRequestRefused as e:
            self._refuse(e)
            return
        if held is not None:
            self._reply(409, held)
            return
        self._reply(200, b"metadata updated")

    do_POST = do_PUT

    def do_DELETE(self):  # noqa: N802
        key = self._key()
        if key is None:
            return
        try:
            self._check_auth("DELETE", key, b"")
        except MetadataRequestRefused as e:
            self._refuse(e)
            return
        owner = self.headers.get(OWNER_HEADER)
        srv = self.server
        with srv.lock:
            if owner is not None and key in srv.store and srv.owners.get(key) != owner:
                old, status = None, 409   # another owner's entry stays
            else:
                old = srv.store.pop(key, None)
                srv.owners.pop(key, None)
                srv.versions.pop(key, None)
                status = 200 if old is not None else 404
                if old is not None:
                    srv.total -= len(old)
        self._reply(status, {200: b"metadata deleted", 404: b"metadata not found",
                             409: b"metadata held by another owner"}[status])

    def _room(self, key: str, n: int, old: Optional[bytes]) -> None:
        srv = self.server
        if old is None and len(srv.store) >= srv.max_keys:
            raise MetadataRequestRefused(507, f"the server holds {srv.max_keys} keys already")
        if srv.total - (len(old) if old is not None else 0) + n > srv.max_bytes:
            raise MetadataRequestRefused(507, f"the server holds {srv.total} B; {n} B more would pass its "
                                              f"{srv.max_bytes} B")

    def _check_auth(self, method: str, key: str, body: bytes) -> Optional[int]:
        """The signed version of a change (None: the server has no secret); raises MetadataRequestRefused (403)
        for a missing or wrong proof, a challenge this instance did not issue, a stale or used one."""
        srv = self.server
        if srv.secret is None:
            return None
        value = self.headers.get(AUTH_HEADER) or ""
        parts = value.split(":")
        if len(parts) != 3 or len(parts[0]) > 200:
            raise MetadataRequestRefused(403, "wrong or missing secret")
        challenge, version, mac = parts
        try:
            version = int(version)
        except ValueError:
            raise MetadataRequestRefused(403, "wrong or missing secret") from None
        owner, take_over = self.headers.get(OWNER_HEADER), self.headers.get(TAKE_OVER_HEADER) == "1"
        if not hmac.compare_digest(mac.encode(), _mac(srv.secret, method, key, challenge, version, body, owner,
                                                      take_over).encode()):
            raise MetadataRequestRefused(403, "wrong or missing secret")
        why = srv.spend(challenge)
        if why is not None:
            raise MetadataRequestRefused(403, f"wrong or missing secret ({why})")
        return version

    def _refuse(self, e: MetadataRequestRefused) -> None:
        if e.status == 403:
            self.server.warn_refused(self.client_address, f"{self.command} {self.path[:200]}: {e.text}")
        self._reply(e.status, e.text.encode())


class _Prefixed(io.RawIOBase):
    """What the selector thread received of a request (``prefix``), then the socket, with one deadline
    (time.monotonic()) for anything read from it."""

    def __init__(self, prefix: bytes, sock: socket.socket, deadline: float):
        self.prefix = memoryview(prefix)
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if len(self.prefix):
            n = min(len(b), len(self.prefix))
            b[:n] = self.prefix[:n]
            self.prefix = self.prefix[n:]
            return n
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("request not received within the idle timeout")
        self.sock.settimeout(left)
        return self.sock.recv_into(b)


class _Server:
    """The listener, its selector thread and the worker pool (see the module docstring)."""

    def __init__(self, host: str, port: int, secret: Optional[bytes], workers: int, idle_timeout: float,
                 max_body: int, max_bytes: int, max_keys: int, max_waiting: int, max_buffered: int):
        self.secret = secret
        self.idle_timeout = float(idle_timeout)
        self.max_body, self.max_bytes, self.max_keys, self.max_waiting = max_body, max_bytes, max_keys, max_waiting
        self.store: Dict[str, bytes] = {}
        self.versions: Dict[str, int] = {}  # key -> version of its signed entry (servers with a secret)
        self.owners: Dict[str, str] = {}   # key -> the X-Pxn-Owner that stored it (keys stored with one)
        self._instance = os.urandom(32)  # signs this instance's challenges: no other server, nor a restart, has it
        self.total = 0
        self.lock = threading.Lock()
        self._nonces: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self._last_warn = 0.0
        self._quiet = 0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=128)
        self.listener.setblocking(False)
        self.server_address = self.listener.getsockname()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pxn-metadata-worker")
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._waiting: "collections.OrderedDict[socket.socket, tuple]" = collections.OrderedDict()
        self._buffered = 0  # bytes of requests still arriving, in all
        self.max_buffered = max_buffered
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closed = False

    # --- challenges and the replay cache ------------------------------------------------------------------------
    def challenge(self) -> str:
        """A fresh challenge: the time, a random part and their MAC under this instance's key (nothing is kept: a
        flood of challenge requests fills nothing)."""
        body = f"{int(time.time())}.{_secrets.token_hex(16)}"
        return f"{body}.{hmac.new(self._instance, body.encode(), hashlib.sha256).hexdigest()[:32]}"

    def spend(self, challenge: str) -> Optional[str]:
        """None when ``challenge`` was issued by this instance within ``MAX_SKEW`` and is used for the first time
        (it is then spent); else why not."""
        parts = challenge.split(".")
        if len(parts) != 3:
            return "no challenge of this server"
        ts, rand, tag = parts
        want = hmac.new(self._instance, f"{ts}.{rand}".encode(), hashlib.sha256).hexdigest()[:32]
        if not hmac.compare_digest(tag.encode(), want.encode()):
            return "a challenge this server did not issue: another server's, or from before a restart"
        try:
            age = time.time() - int(ts)
        except ValueError:
            return "no challenge of this server"
        if not -1 <= age <= MAX_SKEW:
            return "challenge too old"
        if not self.fresh(challenge):
            return "request replayed"
        return None

    def fresh(self, nonce: str) -> bool:
        """True the first time ``nonce`` is seen within ``MAX_SKEW`` (a bounded cache: a signed request is valid
        for that long only, so older nonces need not be kept)."""
        now = time.monotonic()
        with self.lock:
            while self._nonces and next(iter(self._nonces.values())) < now:
                self._nonces.popitem(last=False)
            if nonce in self._nonces:
                return False
            if len(self._nonces) >= 1 << 20:  # a million signed requests within a minute: only from a key holder
                self._nonces.popitem(last=False)
            self._nonces[nonce] = now + 2 * MAX_SKEW
            return True

    def warn_refused(self, addr, what: str) -> None:
        now = time.monotonic()
        with self.lock:
            loud = now - self._last_warn > 5.0
            if loud:
                self._last_warn, quiet, self._quiet = now, self._quiet, 0
            else:
                self._quiet += 1
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if loud:
            log.warning("metadata server: refused %s: %s%s", peer, what,
                        f"; {quiet} more refusal(s) since the last such line" if quiet else "")
        else:
            log.debug("metadata server: refused %s: %s", peer, what)

    # --- the selector thread ----------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self._closed:
            now = time.monotonic()
            for key, _ in self._sel.select(timeout=min(1.0, self.idle_timeout / 2)):
                if key.data == "wake":
                    try:
                        self._wake_r.recv(64)
                    except OSError:
                        pass
                elif key.fileobj is self.listener:
                    self._accept(now)
                else:
                    self._receive(key.fileobj)
            # sockets that sent nothing for idle_timeout are dropped (they never held a thread)
            while self._waiting:
                sock, (addr, t0, _) = next(iter(self._waiting.items()))
                if now - t0 < self.idle_timeout:
                    break
                self._drop(sock)

    def _receive(self, sock) -> None:
        """Take what arrived on a waiting connection; hand the request to a worker once it is whole (headers,
        and a body of at most ``max_body``; a larger one is refused by the worker without being read)."""
        addr, t0, buf = self._waiting[sock]
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        buf += data
        self._buffered += len(data)
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                self._drop(sock)
            else:
                self._shed()
            return
        m = _CONTENT_LENGTH.search(bytes(buf[:end]))
        n = int(m.group(1)) if m else 0
        if n <= self.max_body and len(buf) < end + 4 + n:
            self._shed()
            return
        self._waiting.pop(sock)
        self._buffered -= len(buf)
        self._sel.unregister(sock)
        sock.setblocking(True)
        try:
            self.pool.submit(self._handle, sock, addr, bytes(buf))
        except RuntimeError:  # shutting down
            _close(sock)

    def _shed(self) -> None:
        # requests still arriving hold at most max_buffered bytes in all: the oldest go first
        while self._buffered > self.max_buffered and self._waiting:
            self._drop(next(iter(self._waiting)))

    def _accept(self, now: float) -> None:
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: shed the oldest idle socket, keep listening
                log.warning("metadata server: accept failed (%s)", e)
                if self._waiting:
                    self._drop(next(iter(self._waiting)))
                return
            if len(self._waiting) >= self.max_waiting:
                self._drop(next(iter(self._waiting)))
            sock.setblocking(False)
            self._waiting[sock] = (addr, now, bytearray())
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _drop(self, sock) -> None:
        got = self._waiting.pop(sock, None)
        if got is not None:
            self._buffered -= len(got[2])
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        _close(sock)

    def _handle(self, sock: socket.socket, addr, prefix: bytes) -> None:
        try:
            h = _Handler.__new__(_Handler)
            h.prefix = prefix
            _Handler.__init__(h, sock, addr, self)
        except Exception as e:  # noqa: BLE001 — a broken client must not take the server down
            log.debug("metadata server: request from %s failed: %s", addr, e)
        finally:
            try:
                sock.shutdown(socket.SHUT_WR)  # the reply goes out before the close (no reset over unread bytes)
            except OSError:
                pass
            _close(sock)

    def shutdown(self) -> None:
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def server_close(self) -> None:
        for sock in list(self._waiting):
            self._drop(sock)
        for s in (self.listener, self._wake_r, self._wake_w):
            _close(s)
        self._sel.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _close(sock) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _resolve(secret, host: str, insecure: Optional[bool]) -> Optional[bytes]:
    """The server's secret as the engines resolve theirs (``transport.auth.resolve_secret``): ``secret=``, else
    ``PXN_SECRET``, else on loopback the per-user secret file; None only when insecure."""
    from transport.auth import resolve_secret
    key = resolve_secret(secret, host, insecure)
    if key is None:
        log.warning("metadata server on %s without a shared secret (insecure): anyone who reaches it may change "
                    "or delete any entry", host)
    return key


class MetadataServer:
    """The server on ``host``:``port`` (0: any free port), served from a background thread.

    Arguments (sizes in bytes, times in seconds):
        secret: shared secret proven by every PUT / POST / DELETE (str or bytes, at least 16 bytes; None:
            ``PXN_SECRET``, else on a loopback ``host`` the per-user secret file, as engines use).
        insecure: run without a secret when none is set (None: ``PXN_INSECURE``): Mooncake's open protocol.
        workers: threads serving requests (default 8).
        idle_timeout: a connection must send its request within this (default 10).
        max_body: largest request body (default 4 MiB); max_bytes: stored bytes in all (default 256 MiB);
        max_keys: keys in all (default 10,000); max_waiting: idle connections kept (default 1024);
        max_buffered: bytes of requests still arriving, in all (default 64 MiB; the oldest are dropped beyond).

    ``url`` is what engines pass as ``metadata_server`` to ``initialize``. ``close()`` stops it (idempotent).
    Raises ``transport.auth.InsecureConfig`` (a ValueError) for a missing or short secret where one is needed.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8080, secret=None, insecure: Optional[bool] = None,
                 workers: int = 8, idle_timeout: float = 10.0, max_body: int = 4 << 20, max_bytes: int = 256 << 20,
                 max_keys: int = 10000, max_waiting: int = 1024, max_buffered: int = 64 << 20):
        key = _resolve(secret, host, insecure)
        self._srv = _Server(host, port, key, workers, idle_timeout, max_body, max_bytes, max_keys, max_waiting,
                            max_buffered)
        self.host = host
        self.port = self._srv.server_address[1]
        self.authenticated = key is not None
        self._thread = threading.Thread(target=self._srv.serve_forever, name=f"pxn-metadata-{self.port}",
                                        daemon=True)
        self._thread.start()
        log.info("metadata server on %s (%s)", self.url,
                 "changes need the shared secret" if key else "Mooncake's open protocol")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metadata"

    def keys(self):
        """The keys stored now (diagnostics, tests)."""
        with self._srv.lock:
            return sorted(self._srv.store)

    def stored_bytes(self) -> int:
        """Bytes of all values stored now."""
        with self._srv.lock:
            return self._srv.total

    def close(self) -> None:
        if self._thread is not None:
            self._srv.shutdown()
            self._thread.join(timeout=5)
            self._srv.server_close()
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m integration.metadata_server",
                                 description="HTTP metadata server compatible with Mooncake's (GET/PUT/DELETE "
                                             "/metadata?key=...). The shared secret comes from PXN_SECRET or "
                                             "--secret-file (never the command line).")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    ap.add_argument("--secret-file", help="file holding the shared secret (default: PXN_SECRET)")
    ap.add_argument("--insecure", action="store_true", help="run without a secret when none is set (Mooncake's open "
                                                            "protocol: any process that reaches it may change entries)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        secret = None
        if args.secret_file:
            from transport.auth import open_secret_file
            fd = open_secret_file(args.secret_file)  # a symlink, FIFO, or a file others may read: refused
            try:
                secret = os.read(fd, 4096).strip()
            finally:
                os.close(fd)
        srv = MetadataServer(args.host, args.port, secret=secret, insecure=args.insecure or None)
    except ValueError as e:
        print(f"metadata server: {e}", flush=True)
        return 2
    print(f"metadata server listening on {srv.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
