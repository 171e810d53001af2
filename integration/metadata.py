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
from transport.errors import (ConfigError, ForeignSegment, ForgedSegment, InvalidTransfer, MetadataUnavailable,
                              SegmentNameTaken, UnknownPeer, UnknownSession)

# --- http metadata (Mooncake's protocol: GET / PUT / DELETE <url>?key=<key>) ------------------------------------
def segment_key(name: str) -> str:
    # pxn's own prefix: Mooncake engines sharing the server never read a pxn entry as theirs
    return f"pxn/segment/{name}"


def _name_of(key: str) -> str:
    prefix = segment_key("")
    return key[len(prefix):] if key.startswith(prefix) else key


def held_by(key: str, holder: dict, where: str) -> SegmentNameTaken:
    """The error for segment ``key`` held by the engine whose entry is ``holder`` at server ``where``."""
    return SegmentNameTaken(f"segment name {_name_of(key)!r} is held by another engine (session "
                            f"{holder.get('session')!r}, engine id {holder.get('engine_id')}) at {where}", holder)


class HttpMetadata:
    """Client of an http metadata server (``integration.metadata_server`` or Mooncake's)."""

    def __init__(self, url: str, timeout: float = 5.0, secret: Optional[bytes] = None):
        self.url = url
        self.timeout = timeout
        # changes are signed with it (``integration.metadata_server.sign``); a server without a secret ignores it
        self.secret = secret
        self._version = 0
        self._owner: Optional[str] = None   # the engine id this client published its entry as

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

    def _call(self, method: str, key: str, body: Optional[bytes] = None,
              extra: Optional[Dict[str, str]] = None) -> Tuple[int, bytes]:
        import urllib.parse
        sep = "&" if "?" in self.url else "?"
        headers = dict(extra or {})
        if self.secret and method != "GET":
            from integration.metadata_server import AUTH_HEADER, OWNER_HEADER, TAKE_OVER_HEADER, sign
            challenge = self._challenge()
            if challenge is not None:   # the owner headers are signed too: nobody can strip or add them
                headers[AUTH_HEADER] = sign(self.secret, method, key, body or b"", challenge,
                                            self._next_version() if method == "PUT" else 0,
                                            headers.get(OWNER_HEADER), headers.get(TAKE_OVER_HEADER) == "1")
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

    def put(self, key: str, value: dict, take_over: bool = False) -> None:
        """Publish ``value`` (a pxn entry) under ``key`` as its owner (``value["engine_id"]``). Raises
        SegmentNameTaken when another engine's entry is there, unless ``take_over``.

        pxn's server checks the owner and stores atomically (``X-Pxn-Owner``: a PUT over another owner's entry
        is refused with 409 and that entry). Mooncake's own server ignores the header, so the entry is also read
        first: there a race between two engines publishing the same name at once is not caught."""
        from integration.metadata_server import OWNER_HEADER, TAKE_OVER_HEADER
        owner = str(value.get("engine_id", ""))
        if not take_over:
            held = self._entry(key)
            if held is not None and str(held.get("engine_id", "")) != owner:
                raise held_by(key, held, f"metadata server {self.url}")
        extra = {OWNER_HEADER: owner}
        if take_over:
            extra[TAKE_OVER_HEADER] = "1"
        status, body = self._call("PUT", key, json.dumps(value).encode(), extra)
        if status == 409 and b"not newer than the stored version" not in body:   # (else: a stale version)
            raise held_by(key, self._parse(key, body, lenient=True) or {}, f"metadata server {self.url}")
        if status != 200:
            raise UnknownPeer(f"metadata server {self.url} refused PUT {key!r}: {status} {body[:200]!r}")
        self._owner = owner

    def _entry(self, key: str) -> Optional[dict]:
        """The entry under ``key`` as far as it tells an owner (None: none, or not pxn's)."""
        try:
            return self.get(key)
        except ForeignSegment:
            return None

    def _parse(self, key: str, body: bytes, lenient: bool = False) -> Optional[dict]:
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("session"), str):
            if lenient:
                return None
            raise ForeignSegment(f"metadata entry {key!r} at {self.url} is not a pxn segment: {body[:200]!r}")
        return value

    def get(self, key: str) -> Optional[dict]:
        status, body = self._call("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise UnknownPeer(f"metadata server {self.url} answered GET {key!r} with {status} {body[:200]!r}")
        return self._parse(key, body)

    def delete(self, key: str) -> None:
        """Remove this client's own entry under ``key``: nothing when another engine has published there since
        (pxn's server checks the owner; with Mooncake's the entry is read first)."""
        from integration.metadata_server import OWNER_HEADER
        owner, self._owner = self._owner, None
        if owner is None:
            return
        try:
            held = self._entry(key)
            if held is None or str(held.get("engine_id", "")) != owner:
                log.info("not removing segment %r from %s: %s", _name_of(key), self.url,
                         "it is gone already" if held is None else
                         f"engine {held.get('engine_id')} at {held.get('session')} holds it now")
                return
            status, _ = self._call("DELETE", key, None, {OWNER_HEADER: owner})
            if status == 409:
                log.info("not removing segment %r from %s: another engine published it meanwhile",
                         _name_of(key), self.url)
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
        self.timeout = float(timeout)
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
        """``fn(client)`` on the first endpoint that answers. Raises MetadataUnavailable naming what happened at
        each endpoint: "unreachable" (no connection), "timed out" (no answer within the timeout: a stopped or
        overloaded etcd) or "refused" (etcd answered with an error)."""
        errors = self._errors
        n = len(self._clients)
        failed = []   # (kind, endpoint, cause) per endpoint tried
        for i in range(n):
            idx = (self._current + i) % n
            endpoint = self._endpoint_text(idx)
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
            except errors.ConnectionTimeoutError as e:
                failed.append(("timed out", endpoint, f"no answer within {self.timeout:g} s ({_cause(e)})"))
            except errors.ConnectionFailedError as e:
                failed.append(("unreachable", endpoint, _cause(e)))
            except errors.Etcd3Exception as e:
                raise MetadataUnavailable(f"etcd at {endpoint} refused {what}: {type(e).__name__}: {_cause(e)}",
                                          "refused") from None
        kinds = {k for k, _, _ in failed}
        kind = kinds.pop() if len(kinds) == 1 else "unreachable"
        text = "; ".join(f"{ep}: {k}, {cause}" for k, ep, cause in failed)
        raise MetadataUnavailable(f"etcd {kind} ({what}): {text}", kind)

    def _endpoint_text(self, idx: int) -> str:
        h, p = self.endpoints[idx]
        return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"

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

    def put(self, key: str, value: dict, take_over: bool = False) -> None:
        """Publish ``value`` under ``key`` on this client's lease. Raises SegmentNameTaken when the key holds
        another lease's entry (a live engine's: a dead one's goes with its lease), unless ``take_over``."""
        name = key[len(self._PREFIX):] if key.startswith(self._PREFIX) else key
        etcd_key = self.key(key)
        if self.secret:
            value = {k: v for k, v in value.items() if k != "mac"}
            value["mac"] = entry_mac(self.secret, etcd_key, value)
        body = json.dumps({"name": name, "protocol": SEGMENT_PROTOCOL, SEGMENT_PROTOCOL: value,
                           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        with self._lock:
            self._publish(etcd_key, body, take_over)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._keepalive, name="pxn-etcd-lease", daemon=True)
                self._thread.start()

    def _publish(self, etcd_key: str, body: str, take_over: bool = False) -> None:
        """Grant a lease when none is held and put the entry under it (caller holds ``_lock``): in one etcd
        transaction that creates the key only when it is absent, else reads it. An entry on this client's own
        lease is replaced; another lease's entry raises SegmentNameTaken, unless ``take_over``."""
        if self._lease_id is None:
            ttl = max(1, int(-(-self.ttl // 1)))
            self._lease_id = self._call("a lease grant", lambda c: c.lease(ttl)).id
        lease_id = self._lease_id
        for _ in range(3):   # a key deleted between the transaction's compare and its read: try again
            if take_over:
                break
            created, held = self._call(f"a create of {etcd_key!r}", lambda c: _create(c, etcd_key, body, lease_id))
            if created:
                break
            if held is not None:
                if int(held.get("lease", 0) or 0) != lease_id:
                    raise held_by(etcd_key, _holder(held), f"etcd {self.url} (key {etcd_key!r})")
                take_over = True   # this client's own entry: replace it
        else:
            raise MetadataUnavailable(f"etcd {self.url}: key {etcd_key!r} kept changing while it was published",
                                      "refused")
        if take_over:
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
                        try:
                            self._publish(*self._published)
                        except SegmentNameTaken as e:
                            # while this engine's lease had run out, another engine published the name: it is
                            # that engine's now, and this one stays unpublished rather than take it back
                            log.error("etcd: %s, published while this engine's lease had run out; this engine is "
                                      "no longer reachable by that name", e)
                            self._published = None
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
        """Withdraw this engine's entry: revoke its lease (see the class docstring). Only keys on this lease go:
        an entry another engine published since (a take-over) is on that engine's lease and stays."""
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
    from transport.auth import open_secret_file
    fd = open_secret_file(path)
    try:
        return os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)


def _cause(e: BaseException) -> str:
    """What an etcd3gw error says: its ``detail_text`` (its ``str`` is empty), cut to the socket error where
    the http client wrapped one (``[Errno 111] Connection refused``), and its reason."""
    import re
    text = str(getattr(e, "detail_text", "") or e or type(e).__name__)
    m = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if m:
        text = m.group(0).strip()
    elif "timed out" in text.lower():
        text = "read timed out"
    reason = e.args[0] if e.args and isinstance(e.args[0], str) else ""
    return (f"{text[:200]} ({reason})" if reason else text[:200]) or type(e).__name__


def _create(client, key: str, body: str, lease_id: int) -> Tuple[bool, Optional[dict]]:
    """One etcd transaction: put ``key`` on lease ``lease_id`` if no such key exists, else read it. Returns
    (created, the key's record as etcd gives it, with "value" decoded, or None)."""
    import base64
    k = base64.b64encode(key.encode()).decode()
    txn = {"compare": [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
           "success": [{"request_put": {"key": k, "value": base64.b64encode(body.encode()).decode(),
                                        "lease": lease_id}}],
           "failure": [{"request_range": {"key": k}}]}
    result = client.transaction(txn)
    if result.get("succeeded"):
        return True, None
    for r in result.get("responses", []):
        kvs = r.get("response_range", {}).get("kvs") or []
        if kvs:
            kv = dict(kvs[0])
            kv["value"] = base64.b64decode(kv.get("value", "")).decode(errors="replace")
            return False, kv
    return False, None   # gone between the compare and the read: the caller tries again or reports


def _holder(kv: Optional[dict]) -> dict:
    """The pxn entry inside an etcd record (``_create``), or what can be said of a foreign one."""
    if kv is None:
        return {}
    try:
        value = json.loads(kv.get("value", ""))
    except ValueError:
        value = None
    inner = value.get(SEGMENT_PROTOCOL) if isinstance(value, dict) else None
    if isinstance(inner, dict):
        return {k: v for k, v in inner.items() if k != "mac"}
    proto = value.get("protocol") if isinstance(value, dict) else None
    return {"session": None, "engine_id": f"none: a {proto!r} entry, not pxn's" if proto else "none: not pxn's"}


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


def holder_alive(holder: dict, eng) -> bool:
    """Whether an engine answers at the session of entry ``holder`` (one region query with ``eng``'s
    credentials, 2 s). Only a refused connection (nothing listens at that port) or an engine of another id
    answering there counts as dead: a timeout or any other answer may be a live engine on a busy host."""
    from transport.control import query
    session = holder.get("session")
    if not isinstance(session, str) or ":" not in session:
        return True   # not a pxn engine's entry: never taken over unasked
    try:
        rep = query(session, {"op": "regions"}, eng.credentials, 2.0)
    except ConnectionRefusedError:
        return False
    except Exception:  # noqa: BLE001 — unsure: count it as alive, the caller refuses and names the holder
        return True
    engine_id = rep.get("engine_id") if isinstance(rep, dict) else None
    return engine_id is None or str(engine_id) == str(holder.get("engine_id"))


class SegmentDirectory:
    """One engine's view of a metadata server: the entry it published under its segment name and the sessions
    of the peers it looked up (cached until a transfer to them fails)."""

    def __init__(self, url: str, ttl: Optional[float], segment: str, secret: Optional[bytes] = None):
        self.client = EtcdMetadata(url, ttl, secret=secret) if ttl is not None else HttpMetadata(url, secret=secret)
        self.url = url
        self.segment = segment
        self._sessions: Dict[str, str] = {}   # segment name -> pxn session

    def publish(self, eng, take_over: bool = False) -> None:
        """Put this engine's entry under its segment name; changes are signed with the engine's secret.

        One name, one owner: when another engine's entry holds the name, its session is asked whether an engine
        still listens there (``holder_alive``). A dead engine's entry is taken over, with a warning; a live
        one's raises SegmentNameTaken naming it, unless ``take_over`` (the caller asked to replace it)."""
        self.client.secret = eng.credentials.key
        key = segment_key(self.segment)
        entry = {"session": eng.session_id, "engine_id": eng.engine_id, "fabric": eng.fabric_name}
        try:
            self.client.put(key, entry, take_over=take_over)
            return
        except SegmentNameTaken as e:
            holder = e.holder
            if holder_alive(holder, eng):
                raise SegmentNameTaken(
                    f"{e}; it answers there, so this engine is not published under that name. Give each engine "
                    f"a name of its own (Mooncake names a segment by the local_hostname given to initialize, "
                    f"'host:port' in its examples: on one host, a distinct port per engine), or construct the "
                    f"engine with take_over_segment=True to replace the holder", holder) from None
            log.warning("segment %r: taking the name over from engine %s, whose session %s no longer answers "
                        "(a dead engine's entry)", self.segment, holder.get("engine_id"), holder.get("session"))
        self.client.put(key, entry, take_over=True)

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
                where = (f"etcd {self.client.url} (key {self.client.key(segment_key(target))!r})"
                         if isinstance(self.client, EtcdMetadata) else f"metadata server {self.client.url}")
                raise UnknownSession(f"segment {target!r} is not registered at {where}: no engine published that "
                                     f"name, or its entry expired with its engine")
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
