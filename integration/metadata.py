"""Segment metadata: where a Mooncake segment name finds its pxn session.

Two clients with one interface (``put`` / ``get`` / ``delete`` / ``close`` on pxn segment keys): an http metadata
server (Mooncake's protocol, ``integration.metadata_server`` or Mooncake's own) and etcd in Mooncake's key layout.
``SegmentDirectory`` is what the Mooncake engine holds: its own published entry and the sessions it looked up.
"""
from __future__ import annotations

import hashlib
import hmac
import importlib.util
import json
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from integration.codes import log
from integration.hosts import P2PHANDSHAKE, split_hostname
from transport.config import EngineConfig
from transport.errors import (ConfigError, ForeignSegment, ForgedSegment, InvalidTransfer, UnknownPeer,
                              UnknownSession)

# --- http metadata (Mooncake's protocol: GET / PUT / DELETE <url>?key=<key>) ------------------------------------
def segment_key(name: str) -> str:
    # pxn's own prefix: Mooncake engines sharing the server never read a pxn entry as theirs
    return f"pxn/segment/{name}"


class HttpMetadata:
    """Client of an http metadata server (``integration.metadata_server`` or Mooncake's)."""

    def __init__(self, url: str, timeout: float = 5.0, secret: Optional[bytes] = None):
        self.url = url
        self.timeout = timeout
        # changes are signed with it (``integration.metadata_server.sign``); a server without a secret ignores it
        self.secret = secret
        self._version = 0

    def _next_version(self) -> int:
        """The version of this client's next PUT: the clock in ns, above every earlier one of this client (the
        server refuses a PUT not newer than the entry it holds)."""
        self._version = max(time.time_ns(), self._version + 1)
        return self._version

    def _challenge(self) -> Optional[str]:
        """A challenge of the server, to sign a change with; None from a server that issues none (Mooncake's, or
        pxn's without a secret: it takes changes unsigned)."""
        import urllib.parse
        url = urllib.parse.urlsplit(self.url)
        status, body = self._fetch("GET", urllib.parse.urlunsplit(url._replace(
            path=url.path.rstrip("/") + "/challenge", query="")), None, {})
        return body.decode("ascii", "replace") if status == 200 and len(body) <= 200 else None

    def _call(self, method: str, key: str, body: Optional[bytes] = None) -> Tuple[int, bytes]:
        import urllib.parse
        sep = "&" if "?" in self.url else "?"
        headers = {}
        if self.secret and method != "GET":
            from integration.metadata_server import AUTH_HEADER, sign
            challenge = self._challenge()
            if challenge is not None:
                headers[AUTH_HEADER] = sign(self.secret, method, key, body or b"", challenge,
                                            self._next_version() if method == "PUT" else 0)
        return self._fetch(method, f"{self.url}{sep}key={urllib.parse.quote(key, safe='')}", body, headers)

    def _fetch(self, method: str, url: str, body: Optional[bytes], headers: dict) -> Tuple[int, bytes]:
        import urllib.error
        import urllib.request
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise UnknownPeer(f"metadata server {self.url} unreachable: {reason}") from None

    def put(self, key: str, value: dict) -> None:
        status, body = self._call("PUT", key, json.dumps(value).encode())
        if status != 200:
            raise UnknownPeer(f"metadata server {self.url} refused PUT {key!r}: {status} {body[:200]!r}")

    def get(self, key: str) -> Optional[dict]:
        status, body = self._call("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise UnknownPeer(f"metadata server {self.url} answered GET {key!r} with {status} {body[:200]!r}")
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("session"), str):
            raise ForeignSegment(f"metadata entry {key!r} at {self.url} is not a pxn segment: {body[:200]!r}")
        return value

    def delete(self, key: str) -> None:
        try:
            self._call("DELETE", key)
        except UnknownPeer as e:
            log.info("removing %r from the metadata server: %s", key, e)

    def close(self) -> None:
        """Nothing held between calls (each request is its own connection)."""


# --- etcd metadata (Mooncake's key layout, entries held by a lease) ---------------------------------------------
ETCD_DEFAULT_PORT = 2379
METADATA_TTL_DEFAULT = 5.0   # s; a killed engine's entry is gone this long after its last keep-alive
SEGMENT_PROTOCOL = "pxn"  # the "protocol" of pxn's segment descriptor; Mooncake has no transport of this name


ETCD_OPTIONS = ("user", "password_file", "ca", "cert", "key")


def etcd_options(spec: str) -> Dict[str, str]:
    """The options in the query of an etcd connection string (``...?user=U&password_file=F&ca=F&cert=F&key=F``):
    etcd's own authentication (a user, its password in a file of this user with mode 0600) and TLS (the CA that
    signed etcd's certificate; a client certificate, with its key in ``key`` or in the same file). Raises
    InvalidTransfer naming an unknown or repeated option."""
    from urllib.parse import parse_qs
    query = spec.split("?", 1)[1] if "?" in spec else ""
    try:
        parsed = parse_qs(query, keep_blank_values=False, strict_parsing=bool(query))
    except ValueError:
        raise InvalidTransfer(f"etcd connection string {spec!r}: malformed options {query!r}") from None
    bad = sorted(k for k, v in parsed.items() if k not in ETCD_OPTIONS or len(v) != 1)
    if bad:
        raise InvalidTransfer(f"etcd connection string {spec!r}: unknown or repeated option(s) {bad} (known: "
                              f"{', '.join(ETCD_OPTIONS)})")
    return {k: v[0] for k, v in parsed.items()}


def etcd_endpoints(spec: str) -> List[Tuple[str, int]]:
    """"etcd://h1:p1,h2:p2" | "h:p" | "[v6]:p" | "h" (port 2379) -> [(host, port), ...] (options after "?": see
    ``etcd_options``). Raises InvalidTransfer naming the bad endpoint."""
    spec = spec.split("?", 1)[0]
    body = spec[len("etcd://"):] if spec.startswith("etcd://") else spec
    out = []
    for item in body.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        host, port = split_hostname(item)
        if port is None:
            port = str(ETCD_DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise InvalidTransfer(f"etcd endpoint {item!r} of {spec!r} is not 'host:port'")
        out.append((host, int(port)))
    if not out:
        raise InvalidTransfer(f"etcd metadata server {spec!r} names no endpoint")
    return out


def metadata_ttl(value) -> float:
    """The lease TTL in seconds: ``value`` when given, else ``PXN_METADATA_TTL``, else the default. etcd grants
    whole seconds and raises very short TTLs to its own minimum (about 2 s with its default election timeout)."""
    if value is None:
        try:
            value = EngineConfig.read(("metadata_ttl",)).get("metadata_ttl", METADATA_TTL_DEFAULT)
        except ConfigError as e:
            raise InvalidTransfer(str(e)) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 3600:
        raise InvalidTransfer(f"metadata_ttl must be seconds in 1..3600, got {value!r}")
    return float(value)


class EtcdMetadata:
    """Client of an etcd cluster (through its gRPC gateway, with ``etcd3gw``) holding segment entries in
    Mooncake's layout, so pxn and Mooncake engines sharing one etcd see each other's segments.

    Keys: Mooncake's ``TransferMetadata``: ``mooncake/<MC_METADATA_CLUSTER_ID>/ram/<segment name>`` (no cluster
    part when that variable is unset; a name holding '/' goes under ``mooncake/<cluster>/`` as is). The value
    is a Mooncake-shaped segment descriptor whose ``protocol`` is "pxn"::

        {"name": "10.0.0.5:12345", "protocol": "pxn", "timestamp": "...",
         "pxn": {"session": "10.0.0.5:40123", "engine_id": "...", "fabric": "tcp"}}

    A Mooncake engine opening that segment reads the descriptor, finds no transport for protocol "pxn" and
    fails its open (its log: "Unsupported segment descriptor"); it never reads pxn's fields as its own. pxn
    publishes no ``mooncake/rpc_meta/`` entry, so no Mooncake handshake is ever sent to a pxn control port.
    pxn reading an entry that is not pxn's (a Mooncake descriptor, or junk) raises ``ForeignSegment``.

    Entries are signed: with a secret (``secret``, set by ``SegmentDirectory.publish`` to the engine's), the
    "pxn" part carries ``mac``, HMAC-SHA256 of the secret over the etcd key and the rest of that part
    (``entry_mac``), and a reader with a secret refuses an entry without one or with a wrong one
    (``ForgedSegment``, naming the key): whoever may write to etcd but does not hold the secret cannot point a
    segment name elsewhere, nor move an entry to another name. An entry signed earlier for the same key can still
    be written back by whoever may write to etcd: keep them out with etcd's own authentication and TLS, which
    the connection string's query passes to every endpoint (``etcd_options``):
    ``etcd://h1:2379,h2:2379?user=pxn&password_file=/etc/pxn/etcd-pw&ca=/etc/pxn/etcd-ca.pem`` (and ``cert`` /
    ``key``: a client certificate). The password file is checked as the secret file is.

    Each entry is put under a lease of ``ttl`` seconds that one daemon thread keeps alive (a keep-alive every
    ttl / 3); a killed engine's entry disappears within ``ttl`` of its last keep-alive. ``delete`` / ``close``
    revoke the lease: the entry goes at once, unless another engine has since published under the same name
    (the key then belongs to that engine's lease and stays).

    The key arguments are pxn's segment keys (``segment_key``), as for ``HttpMetadata``, so the callers are
    the same for both; this class maps them to Mooncake's layout. ``endpoints`` are tried in order; a
    connection failure moves to the next.
    """

    _PREFIX = segment_key("")

    def __init__(self, spec: str, ttl: float = METADATA_TTL_DEFAULT, timeout: float = 5.0,
                 secret: Optional[bytes] = None):
        import etcd3gw
        from etcd3gw import exceptions as etcd_errors
        self._etcd3gw, self._errors = etcd3gw, etcd_errors
        self.endpoints = etcd_endpoints(spec)
        self.ttl = float(ttl)
        self.secret = secret
        opts = etcd_options(spec)
        user, ca_cert, cert, key = opts.get("user"), opts.get("ca"), opts.get("cert"), opts.get("key")
        password = _read_password(opts["password_file"]) if "password_file" in opts else None
        if (user is None) != (password is None):
            raise InvalidTransfer(f"etcd connection string {spec!r}: user and password_file go together")
        self._auth = None if user is None else {"name": user, "password": password}
        if key is not None and cert is None:
            raise InvalidTransfer(f"etcd connection string {spec!r}: a client key without its certificate (cert=)")
        scheme = "https" if ca_cert or cert else "http"
        self.url = "etcd://" + ",".join(
            f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "")
        self._root = "mooncake/" + (cluster if not cluster or cluster.endswith("/") else cluster + "/")
        self._clients = [etcd3gw.Etcd3Client(h, p, protocol=scheme, timeout=timeout,
                                             session=_tls_session(ca_cert, cert, key)) for h, p in self.endpoints]
        self._tokens: Dict[int, bool] = {}  # endpoint index -> holds an auth token
        self._current = 0
        self._lock = threading.Lock()        # lease, published entry, keep-alive thread
        self._lease_id: Optional[int] = None
        self._published: Optional[Tuple[str, str]] = None   # (etcd key, json) this engine holds
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def key(self, pxn_key: str) -> str:
        """The etcd key of a pxn segment key (Mooncake's ``getFullMetadataKey``)."""
        name = pxn_key[len(self._PREFIX):] if pxn_key.startswith(self._PREFIX) else pxn_key
        return self._root + (name if "/" in name else "ram/" + name)

    def _call(self, what: str, fn):
        """``fn(client)`` on the first endpoint that answers; raises UnknownPeer when none does or etcd refuses."""
        errors = self._errors
        n = len(self._clients)
        last = None
        for i in range(n):
            idx = (self._current + i) % n
            try:
                try:
                    out = fn(self._authenticated(idx))
                except errors.Etcd3Exception as e:
                    said = f"{e} {getattr(e, 'detail_text', '')}".lower()
                    if self._auth is None or not ("token" in said or "unauthorized" in said) or isinstance(
                            e, (errors.ConnectionFailedError, errors.ConnectionTimeoutError)):
                        raise
                    self._tokens.pop(idx, None)  # the token expired: authenticate again, once
                    out = fn(self._authenticated(idx))
                self._current = idx
                return out
            except (errors.ConnectionFailedError, errors.ConnectionTimeoutError) as e:
                last = e
            except errors.Etcd3Exception as e:
                raise UnknownPeer(f"etcd {self.url} refused {what}: {type(e).__name__}: "
                                  f"{str(e)[:200] or getattr(e, 'detail_text', '')}") from None
        raise UnknownPeer(f"etcd {self.url} unreachable ({what}): {str(last)[:200]}")

    def _authenticated(self, idx: int):
        """The client of endpoint ``idx``, holding an etcd auth token when a user is set (etcd's
        ``/v3/auth/authenticate``; the token goes in the ``Authorization`` header of every later call)."""
        client = self._clients[idx]
        if self._auth is not None and not self._tokens.get(idx):
            client.session.headers.pop("Authorization", None)
            token = client.post(client.get_url("/auth/authenticate"), json=self._auth)["token"]
            client.session.headers["Authorization"] = token
            self._tokens[idx] = True
        return client

    def _lease(self, client):
        return self._etcd3gw.Lease(self._lease_id, client)

    def put(self, key: str, value: dict) -> None:
        name = key[len(self._PREFIX):] if key.startswith(self._PREFIX) else key
        etcd_key = self.key(key)
        if self.secret:
            value = {k: v for k, v in value.items() if k != "mac"}
            value["mac"] = entry_mac(self.secret, etcd_key, value)
        body = json.dumps({"name": name, "protocol": SEGMENT_PROTOCOL, SEGMENT_PROTOCOL: value,
                           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        with self._lock:
            self._publish(etcd_key, body)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._keepalive, name="pxn-etcd-lease", daemon=True)
                self._thread.start()

    def _publish(self, etcd_key: str, body: str) -> None:
        """Grant a lease when none is held and put the entry under it (caller holds ``_lock``)."""
        if self._lease_id is None:
            ttl = max(1, int(-(-self.ttl // 1)))
            self._lease_id = self._call("a lease grant", lambda c: c.lease(ttl)).id
        self._call(f"PUT {etcd_key!r}", lambda c: c.put(etcd_key, body, lease=self._lease(c)))
        self._published = (etcd_key, body)

    def _keepalive(self) -> None:
        interval = self.ttl / 3
        failing = False
        while not self._stop.wait(interval):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    if self._lease_id is not None:
                        left = self._call("a lease keep-alive", lambda c: self._lease(c).refresh())
                        if left <= 0:
                            # the lease ran out (this process stalled, or etcd was unreachable, longer than
                            # ttl): the entry is gone with it, so it is published again under a fresh lease
                            log.warning("etcd lease of %r expired; publishing the entry again",
                                        self._published and self._published[0])
                            self._lease_id = None
                    if self._lease_id is None and self._published is not None:
                        self._publish(*self._published)
                if failing:
                    log.info("etcd %s answers keep-alives again", self.url)
                failing = False
            except UnknownPeer as e:
                if not failing:
                    log.warning("keeping the segment entry alive failed (retrying every %.1f s): %s", interval, e)
                failing = True
            except Exception as e:  # noqa: BLE001 — the thread must not die silently
                log.error("etcd keep-alive: unexpected %s: %s", type(e).__name__, e, exc_info=e)

    def get(self, key: str) -> Optional[dict]:
        etcd_key = self.key(key)
        values = self._call(f"GET {etcd_key!r}", lambda c: c.get(etcd_key))
        if not values:
            return None
        raw = values[0]
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ForeignSegment(f"etcd entry {etcd_key!r} at {self.url} is not a segment descriptor: {raw[:200]!r}")
        proto = value.get("protocol")
        inner = value.get(SEGMENT_PROTOCOL)
        if proto != SEGMENT_PROTOCOL:
            raise ForeignSegment(f"etcd entry {etcd_key!r} at {self.url} is not a pxn segment: protocol {proto!r} "
                                 f"(a Mooncake engine's segment; pxn cannot transfer to it): {raw[:200]!r}")
        if not isinstance(inner, dict) or not isinstance(inner.get("session"), str):
            raise ForeignSegment(f"etcd entry {etcd_key!r} at {self.url} is a malformed pxn segment: {raw[:200]!r}")
        if self.secret:
            mac = inner.pop("mac", None)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, entry_mac(self.secret, etcd_key, inner)):
                raise ForgedSegment(f"etcd entry {etcd_key!r} at {self.url} is "
                                    f"{'unsigned' if mac is None else 'signed with another secret'} (not written by "
                                    f"an engine holding this one's secret); refused: {raw[:200]!r}")
        return inner

    def delete(self, key: str) -> None:
        """Withdraw this engine's entry: revoke its lease (see the class docstring)."""
        self.close()

    def close(self) -> None:
        """Stop the keep-alive thread and revoke the lease (the entry goes with it). Idempotent."""
        self._stop.set()   # before the lock: a keep-alive in flight then ends without another round
        with self._lock:
            thread, self._thread = self._thread, None
            lease_id, self._lease_id = self._lease_id, None
            self._published = None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if lease_id is not None:
            try:
                self._call("a lease revoke", lambda c: self._etcd3gw.Lease(lease_id, c).revoke())
            except UnknownPeer as e:
                log.info("revoking the etcd lease (the entry expires within %.0f s): %s", self.ttl, e)



def entry_mac(secret: bytes, etcd_key: str, value: dict) -> str:
    """The MAC of a pxn segment entry: HMAC-SHA256 of the secret over the etcd key and the entry's "pxn" part
    (without its ``mac``) as canonical JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, f"pxn-etcd-1|{etcd_key}|{text}".encode(), hashlib.sha256).hexdigest()


def _tls_session(ca_cert: Optional[str], cert: Optional[str], key: Optional[str]):
    """A requests session for one etcd endpoint: checking etcd's certificate against ``ca_cert`` (when given) and
    showing the client certificate (when given). It ignores ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE``, which
    requests would otherwise put above a session's own CA (``trust_env`` off: no proxy from the environment)."""
    import requests
    session = requests.Session()
    if ca_cert:
        session.verify = ca_cert
        session.trust_env = False
    if cert:
        session.cert = (cert, key)
    return session


def _read_password(path: str) -> str:
    """The etcd password in ``path``, checked as the secret file is (a regular file of this user, mode 0600)."""
    from transport.auth import _open_secret_file
    fd = _open_secret_file(path)
    try:
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)


class NotSupported(Exception):
    """A metadata server this layer has no client for (the Mooncake engine answers ERR_NOT_IMPLEMENTED)."""


def choose_server(metadata_server: str, metadata_type: Optional[str],
                  ttl: Optional[float]) -> Tuple[Optional[str], Optional[float]]:
    """``initialize``'s metadata arguments -> (url, lease ttl): (None, None) for P2PHANDSHAKE, (http url, None),
    or ("etcd://...", ttl in s). Raises NotSupported (an unknown kind, or etcd without etcd3gw) or
    InvalidTransfer (a malformed etcd endpoint or ttl), each naming the argument."""
    server = (metadata_server or "").strip()
    mtype = (metadata_type or "").strip().lower()
    if server == P2PHANDSHAKE or (mtype in ("p2p", "p2phandshake") and not server):
        return None, None
    if server.startswith(("http://", "https://")):
        return server, None
    if mtype in ("http", "https"):
        return f"{mtype}://{server}", None
    if server and (server.startswith("etcd://") or mtype == "etcd" or (not mtype and "://" not in server)):
        # Mooncake reads a connection string without a scheme as etcd endpoints ("10.0.0.1:2379")
        url = server if server.startswith("etcd://") else f"etcd://{server}"
        if importlib.util.find_spec("etcd3gw") is None:
            raise NotSupported(f"metadata server {metadata_server!r} needs the etcd client etcd3gw: "
                               f"pip install etcd3gw")
        etcd_endpoints(url)
        etcd_options(url)
        return url, metadata_ttl(ttl)
    raise NotSupported(f"metadata server {metadata_server!r} (type {metadata_type!r}) is not supported: pass "
                       f"{P2PHANDSHAKE!r}, an http metadata server 'http://host:port/metadata' (python -m "
                       f"integration.metadata_server) or etcd 'etcd://host:port[,host:port]'")


class SegmentDirectory:
    """One engine's view of a metadata server: the entry it published under its segment name and the sessions
    of the peers it looked up (cached until a transfer to them fails)."""

    def __init__(self, url: str, ttl: Optional[float], segment: str, secret: Optional[bytes] = None):
        self.client = EtcdMetadata(url, ttl, secret=secret) if ttl is not None else HttpMetadata(url, secret=secret)
        self.url = url
        self.segment = segment
        self._sessions: Dict[str, str] = {}   # segment name -> pxn session

    def publish(self, eng) -> None:
        """Put this engine's entry under its segment name; changes are signed with the engine's secret."""
        self.client.secret = eng.credentials.key
        self.client.put(segment_key(self.segment), {"session": eng.session_id, "engine_id": eng.engine_id,
                                                    "fabric": eng.fabric_name})

    def resolve(self, target) -> str:
        """The pxn session of segment ``target``. Raises UnknownSession."""
        if not isinstance(target, str) or not target:
            raise UnknownSession(f"segment name must be a non-empty string, got {target!r}")
        session = self._sessions.get(target)
        if session is None:
            try:
                entry = self.client.get(segment_key(target))
            except UnknownPeer as e:
                raise UnknownSession(str(e)) from None
            if entry is None:
                raise UnknownSession(f"segment {target!r} is not registered at metadata server {self.client.url}")
            session = self._sessions[target] = entry["session"]
        return session

    def forget(self, target) -> None:
        """Drop the cached session of ``target`` (the peer may have restarted elsewhere)."""
        self._sessions.pop(target, None)

    def close(self, withdraw: bool = True) -> None:
        """Remove this engine's entry (unless ``withdraw`` is False: a newer engine published under the same
        name) and release the client."""
        if withdraw:
            self.client.delete(segment_key(self.segment))
        self.client.close()
