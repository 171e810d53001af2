"""Mooncake's ``mooncake.engine.TransferEngine`` Python API on top of pxn's relay engine.

Code written against Mooncake (``from mooncake.engine import TransferEngine``) can use
``from integration.mooncake import TransferEngine`` instead (docs/README-integration.md has a runnable example)::

    eng = TransferEngine()
    assert eng.initialize("10.0.0.5", "P2PHANDSHAKE", "rdma", "") == 0
    session = f"10.0.0.5:{eng.get_rpc_port()}"          # what peers pass as target_hostname
    eng.register_memory(ptr, nbytes)
    ret = eng.batch_transfer_sync_write(peer_session, local_ptrs, remote_ptrs, lengths)   # 0 or < 0
    ret = eng.batch_transfer_sync_read(peer_session, local_ptrs, remote_ptrs, lengths)    # 0 or < 0

The whole surface of Mooncake's binding is here: writes and reads (sync, batch, async, with an opcode, with a
notify), ``get_notifies``, managed buffers and ``write_bytes_to_buffer`` / ``read_bytes_from_buffer``,
``get_first_buffer_address``, the ``*_on_cuda`` calls (stream-ordered, through ``cudaLaunchHostFunc``),
``get_engine_ptr`` (0: pxn has no C++ engine), ``warmup_efa_segment`` (0), probes, topology. Metadata:
"P2PHANDSHAKE" (peers named "host:rpc_port"), an http metadata server "http://host:port/metadata" (Mooncake's
``mooncake_http_metadata_server`` or ``integration.metadata_server``; single node), or etcd
"etcd://host:port[,host:port...]" (or "host:port" without a scheme, as Mooncake reads it) with Mooncake's key
layout and a lease per entry (``_EtcdMetadata``); with a metadata server peers are named by their segment name.

This module is the ONE place in pxn that returns Mooncake-style ints instead of raising: every pxn exception is
mapped to a negative code (table below) and its cause is logged in one line through ``logging`` (logger
``integration.mooncake``), never swallowed silently and never raised into the caller. Codes reuse Mooncake's
values (``mooncake-transfer-engine/include/error.h``) where Mooncake has the cause; pxn-only causes use -5xx.
Where Mooncake's binding answers a case with a specific value, this one answers the same (measured against
``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 over tcp): the same range registered twice -7, a zero-length
registration -1, zero-length pieces moved as nothing (0), a second ``initialize`` 0 (a fresh engine replaces the
first), async submits and ``transfer_submit_write`` 0 when refused, ``send_probe`` -101 for a host name that does
not resolve.

=====================  =====  =========================================================================
name                   value  cause
=====================  =====  =========================================================================
ERR_INVALID_ARGUMENT     -1   malformed call: list lengths differ, length < 0, non-int entry, bad location or
                              opcode, unknown batch id, zero-length registration (``transport.InvalidTransfer``)
ERR_ADDRESS_NOT_REG.     -3   a local address outside this engine's registered memory, a peer address outside
                              every region the peer registered, unregistering an address never registered;
                              nothing was written
ERR_DEVICE_NOT_FOUND     -6   the fabric cannot run here (protocol "verbs" without a usable RDMA device,
                              ``device_name`` matches no usable NIC port: GID-less, down or absent)
                              (``FabricUnavailable``)
ERR_ADDRESS_OVERLAPPED   -7   ``register_memory`` of a range overlapping a registered one, or registered already
ERR_DNS                -101   ``send_probe``: the peer's host name does not resolve
ERR_SOCKET             -102   ``send_probe``: nothing answers at the peer's control port
ERR_METADATA           -200   unknown session: malformed "host:port", nobody listens there, handshake refused,
                              a segment name the metadata server does not know, the metadata server unreachable
                              (``UnknownSession``), an entry that is not a pxn engine's (``ForeignSegment``: a
                              Mooncake engine's segment); also a dead peer once the engine forgot it; nothing
                              written
ERR_ENDPOINT           -201   every rail to the peer failed (peer died, connections reset) (``PeerLost`` /
                              ``TransferError`` with per-rail ``causes``); part may have been written. The engine
                              then forgets the peer: a later call to the session handshakes again
ERR_CONTEXT            -202   not initialized yet, or closed (``FabricClosed``)
ERR_NOT_IMPLEMENTED    -303   a metadata server other than P2PHANDSHAKE / http / etcd (or etcd without etcd3gw
                              installed), a protocol pxn has no fabric for
ERR_REMOTE_REJECTED    -501   the receiver refused a chunk / write (e.g. the peer deregistered the region
                              after the sender learnt its list) (``RemoteRejected``); that part not written
ERR_TIMEOUT            -502   the batch did not finish in time (``TransferTimeout``); part may be written
ERR_TRANSFER           -503   any other ``TransferError`` / ``FabricError``
ERR_INTERNAL           -599   an unexpected exception (a bug): logged with its traceback
=====================  =====  =========================================================================

Differences from Mooncake, on purpose:

* P2P sessions: ``target_hostname`` is the pxn session id "host:port" (the peer engine's control port, = its
  ``get_rpc_port()``), exactly what sglang builds from ``get_rpc_port()``; "[v6addr]:port" is accepted too. The
  port is picked at bind time, inside ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` when set, as Mooncake's.
* protocols: "tcp" -> pxn fabric tcp; "rdma" -> verbs, or tcp with one warning line when no RDMA device is
  usable (as Mooncake); "verbs" (pxn) -> verbs or ERR_DEVICE_NOT_FOUND; "auto" (pxn) -> verbs when a device is
  usable, else tcp; "ipc" (pxn) -> same-host ipc. A truthy ``MC_FORCE_TCP`` ("1", "true", "yes", "on"; not "0",
  "false", "no", "off", "") forces tcp as in Mooncake, and ``PXN_FABRIC`` (tcp|ipc|verbs|auto), when set,
  overrides the protocol argument. The verbs rails are the usable ports of the discovered topology, or of the
  verbs device list where sysfs shows no RDMA port (as Mooncake lists devices with ``ibv_get_device_list``);
  ``device_name`` keeps only the ports it names.
* reads: the peer validates every source against the regions it registered and writes the pieces back with its
  own batch write (``transport.reads``), so a source outside the peer's memory fails the whole batch with
  nothing written (Mooncake's tcp transport also refuses it, -1).
* ``get_batch_transfer_status(batch_ids)`` blocks until every listed batch finished, as Mooncake's does
  (``transfer_engine_py.cpp``: it polls until all complete or one fails / times out, then frees the ids). pxn
  returns 0 when all succeeded, else the code of the first failed batch in list order; it waits for EVERY batch
  (Mooncake returns at the first failure while others may still write into the caller's buffers) and frees
  all the ids. The non-blocking pxn extension ``check_batch_transfer_status(batch_id)`` follows Mooncake's
  ``transfer_check_status`` codes: 1 done, 0 pending, negative failed (then the id is freed).
* checks Mooncake leaves out: a local source or destination outside registered memory is refused (-3; Mooncake's
  tcp transport reads it anyway), ``write_bytes_to_buffer`` / ``read_bytes_from_buffer`` only touch host memory
  inside a registered range (Mooncake copies blindly), ``free_managed_buffer`` of an address it did not
  allocate returns -1 (Mooncake 0).
* ``*_on_cuda``: a transfer that fails after the stream reached it is logged at ERROR and counted in
  ``stats()["cuda_transfers_failed"]``; Mooncake ends the process there.
* timeouts: ``timeout=`` given to the constructor (s), else Mooncake's rule: ``MC_TRANSFER_TIMEOUT`` seconds
  (default 30, at least 5) plus 1 ns per byte of the batch (1 GB/s), else ``PXN_TIMEOUT`` when that is set. Both
  are read at ``initialize``, as Mooncake reads its settings once at start.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import itertools
import json
import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from transport.config import EngineConfig
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, FabricUnavailable, ForeignSegment,
                              InvalidTransfer, PeerLost, PxnError, RegionOverlap, RemoteRejected, TransferError,
                              TransferTimeout, UnknownPeer)

log = logging.getLogger(__name__)

__all__ = ["TransferEngine", "TransferOpcode", "error_code", "error_name", "normalize_session",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_DEVICE_NOT_FOUND", "ERR_ADDRESS_OVERLAPPED",
           "ERR_DNS", "ERR_SOCKET", "ERR_METADATA", "TransferNotify", "Read", "Write", "force_tcp", "ERR_ENDPOINT", "ERR_CONTEXT", "ERR_NOT_IMPLEMENTED",
           "ERR_REMOTE_REJECTED", "ERR_TIMEOUT", "ERR_TRANSFER", "ERR_INTERNAL"]

# --- codes: Mooncake's values where Mooncake has the cause (include/error.h), -5xx for pxn-only causes --------
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_METADATA = -200
ERR_ENDPOINT = -201
ERR_CONTEXT = -202
ERR_NOT_IMPLEMENTED = -303
ERR_REMOTE_REJECTED = -501
ERR_TIMEOUT = -502
ERR_TRANSFER = -503
ERR_INTERNAL = -599

_NAMES = {v: k for k, v in globals().items() if k.startswith("ERR_") and isinstance(v, int)}


P2PHANDSHAKE = "P2PHANDSHAKE"
_PROTOCOLS = {"tcp": "tcp", "rdma": "verbs", "verbs": "verbs", "auto": "auto", "ipc": "ipc"}


class TransferOpcode:
    """Mooncake's opcode enum: ``TransferOpcode.Read`` (0) / ``.Write`` (1), plain ints here."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read     # mooncake.engine exports the enum's values at module level too
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's ``TransferNotify``: a (``name``, ``msg``) pair delivered to the peer after a transfer, read
    there with ``get_notifies()``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)


_FALSY = ("", "0", "false", "no", "off")


def force_tcp() -> bool:
    """``MC_FORCE_TCP`` is set to a truthy value ("1", "true", "yes", "on", any other text but "0", "false",
    "no", "off", case-insensitive). Mooncake's CI sets ``MC_FORCE_TCP=true``."""
    return os.environ.get("MC_FORCE_TCP", "").strip().lower() not in _FALSY


def error_name(code: int) -> str:
    """The symbolic name of a code returned here, e.g. ``error_name(-3) == "ERR_ADDRESS_NOT_REGISTERED"``."""
    return "OK" if code == 0 else _NAMES.get(code, f"ERR_{code}")


def error_code(exc: BaseException) -> int:
    """Map a pxn exception to its negative code (module docstring). Order matters: the narrowest class first
    (``UnknownSession`` is also an ``InvalidTransfer`` and an ``UnknownPeer``)."""
    if isinstance(exc, UnknownPeer):  # before InvalidTransfer: UnknownSession is both
        return ERR_METADATA
    if isinstance(exc, AddressNotRegistered):
        return ERR_ADDRESS_NOT_REGISTERED
    if isinstance(exc, RegionOverlap):
        return ERR_ADDRESS_OVERLAPPED
    if isinstance(exc, InvalidTransfer):
        return ERR_INVALID_ARGUMENT
    if isinstance(exc, TransferTimeout):
        return ERR_TIMEOUT
    if isinstance(exc, RemoteRejected):
        return ERR_REMOTE_REJECTED
    if isinstance(exc, FabricClosed):
        return ERR_CONTEXT
    if isinstance(exc, FabricUnavailable):
        return ERR_DEVICE_NOT_FOUND
    if isinstance(exc, PeerLost) or (isinstance(exc, TransferError) and exc.causes):
        return ERR_ENDPOINT
    if isinstance(exc, (TransferError, FabricError, PxnError)):
        return ERR_TRANSFER
    if isinstance(exc, (ValueError, TypeError)):
        return ERR_INVALID_ARGUMENT
    return ERR_INTERNAL


def _fail(what: str, exc: BaseException) -> int:
    """Log why ``what`` failed and return its code. Expected failures (pxn errors) log one line at WARNING;
    anything else is a bug and logs its traceback at ERROR."""
    code = error_code(exc)
    if code == ERR_INTERNAL:
        log.error("%s failed (%s): unexpected %s: %s", what, error_name(code), type(exc).__name__, exc,
                  exc_info=exc)
    else:
        log.warning("%s failed (%s=%d): %s: %s", what, error_name(code), code, type(exc).__name__, exc)
    return code


def normalize_session(target: str) -> str:
    """Mooncake / sglang write IPv6 peers as "[addr]:port" (sglang's ``NetworkAddress.to_host_port_str``); the
    pxn engine splits its session id at the last ':' and connects to the bare address. Returns "addr:port"."""
    if isinstance(target, str) and target.startswith("["):
        host, sep, port = target[1:].partition("]:")
        if sep:
            return f"{host}:{port}"
    return target


def _split_hostname(local_hostname: str) -> Tuple[str, Optional[str]]:
    """"host" | "host:port" | "[v6]:port" | bare IPv6 -> (host, port or None)."""
    s = (local_hostname or "").strip()
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if s.count(":") == 1:
        host, _, port = s.partition(":")
        return host, port
    return s, None  # a bare name, or a bare IPv6 address (several ':')


def _parse_location(location: str) -> Optional[int]:
    """Mooncake's ``location``: "cpu:<numa>" -> -1 (host), "cuda:<n>" -> n, "*" / "" -> None (detect)."""
    loc = (location or "*").strip().lower()
    if loc in ("*", ""):
        return None
    kind, _, idx = loc.partition(":")
    if kind == "cpu":
        return -1
    if kind in ("cuda", "gpu") and idx.isdigit():
        return int(idx)
    raise InvalidTransfer(f"location {location!r}: expected '*', 'cpu:<numa>' or 'cuda:<device>'")


# --- which device holds an address (Mooncake's location "*") -------------------------------------------------
class _CudaPointerAttributes(ctypes.Structure):
    # cudaPointerAttributes since CUDA 11: type (cudaMemoryType), device, devicePointer, hostPointer
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p)]


_cudart = None
_cudart_lock = threading.Lock()


def _load_cudart():
    """libcudart through ctypes, or None. torch wheels ship it under nvidia/cuda_runtime/lib."""
    global _cudart
    with _cudart_lock:
        if _cudart is not None:
            return _cudart or None
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
        found = ctypes.util.find_library("cudart")
        if found:
            names.insert(0, found)
        try:
            import nvidia.cuda_runtime as ncr  # noqa: F401 — the pip runtime next to a CUDA torch
            libdir = os.path.join(os.path.dirname(ncr.__file__), "lib")
            names = [os.path.join(libdir, f) for f in sorted(os.listdir(libdir)) if f.startswith("libcudart")] + names
        except Exception:  # noqa: BLE001 — not installed: try the system names
            pass
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p]
                lib.cudaPointerGetAttributes.restype = ctypes.c_int
                _cudart = lib
                return lib
            except (OSError, AttributeError):
                continue
        _cudart = False
        return None


def pointer_device(addr: int) -> int:
    """The CUDA device holding ``addr`` (device or managed memory), else -1 (host). Without a usable CUDA every
    address is host memory. Used for Mooncake's ``location="*"`` (sglang registers GPU KV and host aux buffers
    through the same call with no location)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return -1
    except ImportError:
        return -1
    try:
        from cuda.bindings import runtime as rt  # cuda-bindings, the pxn "cuda" extra
        err, attr = rt.cudaPointerGetAttributes(addr)
        if err != rt.cudaError_t.cudaSuccess:
            return -1
        kinds = (rt.cudaMemoryType.cudaMemoryTypeDevice, rt.cudaMemoryType.cudaMemoryTypeManaged)
        return int(attr.device) if attr.type in kinds else -1
    except ImportError:
        pass
    lib = _load_cudart()
    if lib is None:
        log.warning("cannot tell whether 0x%x is GPU memory (no cuda-bindings, no libcudart): registering it as "
                    "host memory; pass location='cuda:<n>' to say otherwise", addr)
        return -1
    attr = _CudaPointerAttributes()
    if lib.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(addr)) != 0:
        return -1
    return attr.device if attr.type in (2, 3) else -1  # cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3


def _filter_topology(topo, names: Sequence[str]):
    """A copy of ``topo`` where only the NIC ports named in ``names`` ("mlx5_0" or "mlx5_0:1") stay usable
    (Mooncake's ``device_name`` filter). Raises FabricUnavailable when none of them is usable."""
    from dataclasses import replace

    from transport.topology import Topology
    wanted = {n.strip() for n in names if n.strip()}
    ports = []
    for p in topo.ports:
        keep = p.name in wanted or p.key in wanted
        ports.append(p if keep else replace(p, usable=False, reason="disabled",
                                            detail="not in device_name filter"))
    if not any(p.usable for p in ports):
        why = [f"{p.key}: {p.reason}" + (f" ({p.detail})" if p.detail else "")
               for p in topo.ports if p.name in wanted or p.key in wanted]
        raise FabricUnavailable(f"device_name {','.join(sorted(wanted))!r} matches no usable NIC port ("
                                f"{'; '.join(why) or 'no such port'}; have "
                                f"{', '.join(p.key for p in topo.ports) or 'none'})")
    return Topology(topo.gpus, ports, topo.distances, topo.nvlink, topo.nvlink_source, topo.root, topo.name,
                    topo.notes)


def _verbs_topology(base):
    """``base`` (a sysfs topology with no NIC port) with the ports that verbs lists instead: one ``NicPort`` per
    device port, unusable with reason ``down`` (not ACTIVE) or ``no GID`` (no usable GID entry), as the verbs
    fabric judges them (``transport.fabric.verbs.port_table``, ``PXN_GID_INDEX`` included). No PCI place is
    known, so GPU-to-port distances are NODE. Raises FabricUnavailable when pyverbs or the device list is
    missing."""
    from transport.fabric.verbs import port_table
    from transport.topology import NicPort, Topology
    ports = [NicPort(name=st.device, port=st.port_num, pci="", state={"down": "1: DOWN", "unreadable": ""}.get(st.reason or "", "4: ACTIVE"),
                     link_layer={"eth": "Ethernet", "ib": "InfiniBand"}.get(st.link_layer, ""),
                     gid=st.reason != "no GID", usable=st.usable, reason=st.reason, detail=st.detail)
             for st in port_table()]
    distances = {(g.index, p.key): "NODE" for g in base.gpus for p in ports}
    return Topology(base.gpus, ports, distances, base.nvlink, base.nvlink_source, base.root, base.name,
                    list(base.notes) + ["NIC ports from the verbs device list (sysfs shows none)"])


# --- http metadata (Mooncake's protocol: GET / PUT / DELETE <url>?key=<key>) ------------------------------------
def _segment_key(name: str) -> str:
    # pxn's own prefix: Mooncake engines sharing the server never read a pxn entry as theirs
    return f"pxn/segment/{name}"


class _HttpMetadata:
    """Client of an http metadata server (``integration.metadata_server`` or Mooncake's)."""

    def __init__(self, url: str, timeout: float = 5.0, secret: Optional[bytes] = None):
        self.url = url
        self.timeout = timeout
        # changes are signed with it (``integration.metadata_server.sign``); a server without a secret ignores it
        self.secret = secret

    def _call(self, method: str, key: str, body: Optional[bytes] = None) -> Tuple[int, bytes]:
        import urllib.error
        import urllib.parse
        import urllib.request
        sep = "&" if "?" in self.url else "?"
        headers = {}
        if self.secret and method != "GET":
            from integration.metadata_server import AUTH_HEADER, sign
            headers[AUTH_HEADER] = sign(self.secret, method, key, body or b"")
        req = urllib.request.Request(f"{self.url}{sep}key={urllib.parse.quote(key, safe='')}", data=body,
                                     method=method, headers=headers)
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


def _etcd_endpoints(spec: str) -> List[Tuple[str, int]]:
    """"etcd://h1:p1,h2:p2" | "h:p" | "[v6]:p" | "h" (port 2379) -> [(host, port), ...]. Raises InvalidTransfer
    naming the bad endpoint."""
    body = spec[len("etcd://"):] if spec.startswith("etcd://") else spec
    out = []
    for item in body.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        host, port = _split_hostname(item)
        if port is None:
            port = str(ETCD_DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise InvalidTransfer(f"etcd endpoint {item!r} of {spec!r} is not 'host:port'")
        out.append((host, int(port)))
    if not out:
        raise InvalidTransfer(f"etcd metadata server {spec!r} names no endpoint")
    return out


def _metadata_ttl(value) -> float:
    """The lease TTL in seconds: ``value`` when given, else ``PXN_METADATA_TTL``, else the default. etcd grants
    whole seconds and raises very short TTLs to its own minimum (about 2 s with its default election timeout)."""
    if value is None:
        text = os.environ.get("PXN_METADATA_TTL", "")
        if not text:
            return METADATA_TTL_DEFAULT
        try:
            value = float(text)
        except ValueError:
            raise InvalidTransfer(f"environment variable PXN_METADATA_TTL={text!r} is not a number of seconds") \
                from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 3600:
        raise InvalidTransfer(f"metadata_ttl must be seconds in 1..3600, got {value!r}")
    return float(value)


class _EtcdMetadata:
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

    Each entry is put under a lease of ``ttl`` seconds that one daemon thread keeps alive (a keep-alive every
    ttl / 3); a killed engine's entry disappears within ``ttl`` of its last keep-alive. ``delete`` / ``close``
    revoke the lease: the entry goes at once, unless another engine has since published under the same name
    (the key then belongs to that engine's lease and stays).

    The key arguments are pxn's segment keys (``_segment_key``), as for ``_HttpMetadata``, so the callers are
    the same for both; this class maps them to Mooncake's layout. ``endpoints`` are tried in order; a
    connection failure moves to the next.
    """

    _PREFIX = _segment_key("")

    def __init__(self, spec: str, ttl: float = METADATA_TTL_DEFAULT, timeout: float = 5.0):
        import etcd3gw
        from etcd3gw import exceptions as etcd_errors
        self._etcd3gw, self._errors = etcd3gw, etcd_errors
        self.endpoints = _etcd_endpoints(spec)
        self.url = "etcd://" + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        self.ttl = float(ttl)
        cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "")
        self._root = "mooncake/" + (cluster if not cluster or cluster.endswith("/") else cluster + "/")
        self._clients = [etcd3gw.Etcd3Client(h, p, timeout=timeout) for h, p in self.endpoints]
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
                out = fn(self._clients[idx])
                self._current = idx
                return out
            except (errors.ConnectionFailedError, errors.ConnectionTimeoutError) as e:
                last = e
            except errors.Etcd3Exception as e:
                raise UnknownPeer(f"etcd {self.url} refused {what}: {type(e).__name__}: "
                                  f"{str(e)[:200] or getattr(e, 'detail_text', '')}") from None
        raise UnknownPeer(f"etcd {self.url} unreachable ({what}): {str(last)[:200]}")

    def _lease(self, client):
        return self._etcd3gw.Lease(self._lease_id, client)

    def put(self, key: str, value: dict) -> None:
        name = key[len(self._PREFIX):] if key.startswith(self._PREFIX) else key
        body = json.dumps({"name": name, "protocol": SEGMENT_PROTOCOL, SEGMENT_PROTOCOL: value,
                           "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        with self._lock:
            self._publish(self.key(key), body)
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


def _rpc_port() -> int:
    """The control port to bind: a free one inside ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` (Mooncake's names,
    also its ``MC_*_PRC_PORT`` spellings) when either is set, else 0 (any free port)."""
    lo_s = os.environ.get("MC_MIN_RPC_PORT") or os.environ.get("MC_MIN_PRC_PORT")
    hi_s = os.environ.get("MC_MAX_RPC_PORT") or os.environ.get("MC_MAX_PRC_PORT")
    if not lo_s and not hi_s:
        return 0
    try:
        lo, hi = int(lo_s or 15000), int(hi_s or 17000)
    except ValueError:
        raise InvalidTransfer(f"MC_MIN_RPC_PORT={lo_s!r} / MC_MAX_RPC_PORT={hi_s!r} are not ints") from None
    if not 1024 < lo <= hi < 65536:
        raise InvalidTransfer(f"rpc port range {lo}..{hi} is not inside 1025..65535")
    import random
    ports = list(range(lo, hi + 1))
    random.shuffle(ports)
    for p in ports[:500]:
        with socket.socket() as s:
            try:
                s.bind(("", p))
                return p
            except OSError:
                continue
    raise FabricError(f"no free control port in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT = {lo}..{hi}")


def _alloc_host(length: int):
    """Page-aligned, zeroed host memory of ``length`` bytes: (mmap, ctypes view, address)."""
    import mmap
    mm = mmap.mmap(-1, length)
    view = (ctypes.c_char * length).from_buffer(mm)
    return mm, view, ctypes.addressof(view)


def _free_host(mm, view) -> None:
    del view
    try:
        mm.close()
    except BufferError:  # a view is still alive elsewhere: the mapping goes with the last reference
        pass


class _Pending:
    __slots__ = ("handle", "deadline", "code")

    def __init__(self, handle, deadline: float, code: int = 0):
        self.handle = handle
        self.deadline = deadline
        self.code = code


class TransferEngine:
    """Mooncake's ``TransferEngine`` Python API over ``transport.TransferEngine`` (see the module docstring).

    Arguments (all optional; Mooncake's constructor takes none):
        timeout: seconds per batch; default Mooncake's rule (``MC_TRANSFER_TIMEOUT`` + 1 ns per byte).
        metadata_ttl: seconds an etcd entry outlives its engine's last keep-alive (etcd metadata mode only);
            default ``PXN_METADATA_TTL``, else 5.
        **engine_options: passed to ``transport.TransferEngine`` at ``initialize`` (``rails``,
            ``coalesce_bytes``, ``topology``, ...; see docs/README-engine.md).

    Every method is thread-safe; transfers from many threads run concurrently (the pxn engine is thread-safe).
    """

    def __init__(self, timeout: Optional[float] = None, metadata_ttl: Optional[float] = None, **engine_options):
        self._timeout = timeout
        self._metadata_ttl = metadata_ttl   # s; None: PXN_METADATA_TTL, else METADATA_TTL_DEFAULT (etcd mode)
        self._options = dict(engine_options)
        self._env: dict = {}  # the PXN_* settings (EngineConfig.environment), read at initialize
        self._base_timeout: Optional[float] = 30.0  # MC_TRANSFER_TIMEOUT's seconds (None: PXN_TIMEOUT's default)
        self._engine = None
        self._hostname: Optional[str] = None
        self._names: Tuple[str, ...] = ()        # the names this engine answers to (segment name, session id)
        self._metadata: Optional[_HttpMetadata] = None
        self._segment: Optional[str] = None      # the key this engine published under (http metadata mode)
        self._sessions: Dict[str, str] = {}      # segment name -> pxn session (http metadata mode)
        self._lock = threading.Lock()       # initialize / close / registration (batch all-or-nothing)
        self._batches: Dict[int, _Pending] = {}
        self._batch_lock = threading.Lock()
        self._batch_ids = itertools.count(1)
        self._order: List[int] = []              # region addresses in registration order (first buffer)
        self._managed: Dict[int, Tuple[object, object, int]] = {}   # addr -> (mmap, ctypes view, length)
        self._cuda_ids = itertools.count(1)
        self._launch_host_func = None            # test hook: (stream_ptr, fn) -> None; default cudaLaunchHostFunc

    # ======================================================================================================
    # initialization
    # ======================================================================================================
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Start the pxn engine.

        Arguments:
            local_hostname: "host", "host:port" or "[v6]:port": the address to listen on and advertise. With
                P2PHANDSHAKE the control port is picked at bind time (``get_rpc_port()``), inside
                ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` when those are set, as Mooncake does; with a metadata
                server the whole string is this engine's segment name, published there.
            metadata_server: "P2PHANDSHAKE" (peers are named "host:rpc_port"), an http metadata server
                "http://host:port/metadata" (Mooncake's ``mooncake_http_metadata_server`` or
                ``integration.metadata_server``), or etcd "etcd://host:port[,host:port...]" (a string without
                a scheme is etcd too, as in Mooncake); with a metadata server peers are named by their segment
                name.
            protocol: "rdma" (verbs; tcp with one warning line when no RDMA device is usable, as Mooncake) |
                "tcp" | "auto" | "ipc" | "verbs" (verbs, no fall back); a truthy ``MC_FORCE_TCP`` or
                ``PXN_FABRIC`` override it.
            device_name: comma-separated RDMA devices ("mlx5_0,mlx5_1") that may carry rails; "" = every
                usable port (pxn then relays each GPU's data to its nearest NIC over NVLink).
        Returns:
            0, or a negative code (ERR_NOT_IMPLEMENTED for an unsupported metadata server or protocol,
            ERR_METADATA when the metadata server cannot be reached, ERR_DEVICE_NOT_FOUND ...). A second call
            starts a fresh engine and closes the previous one (its registrations are dropped), as Mooncake's
            does; when the new one cannot start the previous one stays.
        """
        return self._initialize(local_hostname, metadata_server, protocol, device_name, None)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        """Mooncake's extended initialize: ``metadata_type`` "p2p" / "" (with "P2PHANDSHAKE"), "http" (with
        "host:port/metadata" or a full URL) or "etcd" (with "host:port[,host:port...]"). Returns as
        ``initialize``."""
        return self._initialize(local_hostname, metadata_server, protocol, device_name, metadata_type)

    def _initialize(self, local_hostname, metadata_server, protocol, device_name, metadata_type) -> int:
        server = (metadata_server or "").strip()
        mtype = (metadata_type or "").strip().lower()
        ttl = None
        if server == P2PHANDSHAKE or (mtype in ("p2p", "p2phandshake") and not server):
            url = None
        elif server.startswith(("http://", "https://")):
            url = server
        elif mtype in ("http", "https"):
            url = f"{mtype}://{server}"
        elif server and (server.startswith("etcd://") or mtype == "etcd" or (not mtype and "://" not in server)):
            # Mooncake reads a connection string without a scheme as etcd endpoints ("10.0.0.1:2379")
            url = server if server.startswith("etcd://") else f"etcd://{server}"
            import importlib.util
            if importlib.util.find_spec("etcd3gw") is None:
                log.error("initialize: metadata server %r needs the etcd client etcd3gw: pip install etcd3gw",
                          metadata_server)
                return ERR_NOT_IMPLEMENTED
            try:
                _etcd_endpoints(url)
                ttl = _metadata_ttl(self._metadata_ttl)
            except InvalidTransfer as e:
                log.error("initialize: %s", e)
                return ERR_INVALID_ARGUMENT
        else:
            log.error("initialize: metadata server %r (type %r) is not supported: pass %r, an http metadata "
                      "server 'http://host:port/metadata' (python -m integration.metadata_server) or etcd "
                      "'etcd://host:port[,host:port]'", metadata_server, metadata_type, P2PHANDSHAKE)
            return ERR_NOT_IMPLEMENTED
        proto = (protocol or "").strip().lower()
        if force_tcp():
            proto = "tcp"
        try:
            # the PXN_* settings the engine itself will read, parsed and checked the same way (EngineConfig)
            self._env = EngineConfig.environment()
            self._base_timeout = self._read_base_timeout()
        except ValueError as e:
            log.error("initialize: %s", e)
            return ERR_INVALID_ARGUMENT
        override = str(self._env.get("fabric", "")).strip().lower()
        if override:
            proto = override
        fabric = _PROTOCOLS.get(proto)
        if fabric is None:
            log.error("initialize: protocol %r has no pxn fabric (have %s)", protocol, sorted(_PROTOCOLS))
            return ERR_NOT_IMPLEMENTED
        host, port = _split_hostname(local_hostname)
        if not host:
            log.error("initialize: local_hostname %r names no host", local_hostname)
            return ERR_INVALID_ARGUMENT
        names = [n for n in (device_name or "").split(",") if n.strip()]
        if proto == "rdma":
            from transport.engine import TransferEngine as PxnEngine
            if PxnEngine._pick_fabric("auto") != "verbs":
                log.warning("initialize: protocol 'rdma' but no RDMA device is usable here: running on tcp, as "
                            "Mooncake does (pass 'verbs' to fail instead)")
                fabric = "tcp"
        with self._lock:
            try:
                if ttl is not None:
                    metadata = _EtcdMetadata(url, ttl)
                else:
                    metadata = _HttpMetadata(url) if url else None
                options = dict(self._options)
                if fabric in ("verbs", "auto") and "topology" not in options:
                    options["topology"] = self._topology(fabric, names)
                from transport.engine import TransferEngine as PxnEngine
                if "port" not in options:
                    options["port"] = _rpc_port()
                eng = PxnEngine(hostname=host, fabric=fabric, **options)
            except BaseException as e:  # noqa: BLE001 — mapped to a code and logged
                return _fail(f"initialize({local_hostname!r}, protocol={protocol!r} -> {fabric}, "
                             f"device_name={device_name!r})", e)
            segment = None
            if metadata is not None:
                metadata.secret = eng.credentials.key
                segment = (local_hostname or "").strip()
                try:
                    metadata.put(_segment_key(segment), {"session": eng.session_id, "engine_id": eng.engine_id,
                                                         "fabric": eng.fabric_name})
                except BaseException as e:  # noqa: BLE001
                    metadata.close()
                    eng.close()
                    return _fail(f"initialize: publishing segment {segment!r} at {url}", e)
            old, old_meta, old_segment = self._engine, self._metadata, self._segment
            if old is not None:
                log.warning("initialize: called again; the previous engine %s is closed and its registrations "
                            "dropped (as Mooncake does); now %s", old.session_id, eng.session_id)
            self._engine, self._metadata, self._segment = eng, metadata, segment
            self._hostname = host
            self._names = tuple(n for n in {eng.session_id, (local_hostname or "").strip(),
                                            normalize_session((local_hostname or "").strip())} if n)
            self._sessions = {}
            self._order = []
            managed, self._managed = self._managed, {}
        if old is not None:
            if old_meta is not None and old_segment is not None and old_segment != segment:
                old_meta.delete(_segment_key(old_segment))
            if old_meta is not None:
                old_meta.close()
            old.close()
            for mm, view, _ in managed.values():
                _free_host(mm, view)
        log.info("pxn Mooncake shim: session %s over %s (protocol %r%s)", eng.session_id, eng.fabric_name,
                 protocol, f", segment {segment!r} at {url}" if url else "")
        return 0

    @staticmethod
    def _topology(fabric: str, names: List[str]):
        """The machine's topology for verbs rails (None for tcp, or when auto finds no RDMA device)."""
        from transport.engine import TransferEngine as PxnEngine
        if fabric == "auto" and PxnEngine._pick_fabric("auto") != "verbs":
            if names:
                log.info("device_name %s ignored: no RDMA device usable, auto falls back to tcp", names)
            return None
        from transport.topology import TopologyError, discover
        try:
            topo = discover()
        except TopologyError as e:
            if names:
                raise FabricUnavailable(f"device_name {names}: cannot read this machine's topology: {e}") from e
            # without a filter the verbs fabric can still pick its device itself: worse routing, but working
            log.warning("topology discovery failed (%s); verbs rails without PXN routing", e)
            return None
        if not topo.ports:
            # sysfs shows no RDMA port (a container without /sys/class/infiniband, a verbs model) while verbs
            # may list some: Mooncake takes its devices from ibv_get_device_list, so the rails do too
            topo = _verbs_topology(topo)
            log.info("no RDMA port in sysfs; ports from the verbs device list: %s",
                     ", ".join(f"{p.key}{'' if p.usable else f' ({p.reason})'}" for p in topo.ports) or "none")
        return _filter_topology(topo, names) if names else topo

    def _eng(self):
        eng = self._engine
        if eng is None:
            raise FabricClosed("the transfer engine is not initialized: call initialize() first")
        return eng

    @property
    def pxn_engine(self):
        """The underlying ``transport.TransferEngine`` (None before ``initialize``)."""
        return self._engine

    def get_engine(self):
        """Mooncake returns its inner engine here (reused by Mooncake Store); pxn returns its own engine."""
        return self._engine

    def get_rpc_port(self) -> int:
        """The control port peers connect to (an int; 0 before ``initialize``)."""
        return self._engine.port if self._engine is not None else 0

    def get_session_id(self) -> str:
        """"host:port" that peers pass as ``target_hostname`` ("" before ``initialize``)."""
        return self._engine.session_id if self._engine is not None else ""

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """The machine's GPUs, NIC ports and distances as a JSON string (``pxn topo --json`` format), filtered by
        ``device_name`` like ``initialize``. On a machine whose sysfs cannot be read: ``{"error": ...}``."""
        try:
            from transport.topology import discover
            topo = discover()
            names = [n for n in (device_name or "").split(",") if n.strip()]
            if names:
                topo = _filter_topology(topo, names)
            return json.dumps(topo.to_json())
        except Exception as e:  # noqa: BLE001 — a string is the contract; the cause goes to the log and JSON
            log.warning("get_local_topology failed: %s: %s", type(e).__name__, e)
            return json.dumps({"error": f"{type(e).__name__}: {e}"})

    # ======================================================================================================
    # memory registration
    # ======================================================================================================
    def _register_one(self, eng, addr: int, length: int, location: str) -> None:
        dev = _parse_location(location)
        if isinstance(addr, bool) or not isinstance(addr, int) or isinstance(length, bool) \
                or not isinstance(length, int):
            raise InvalidTransfer(f"register: address {addr!r} and length {length!r} must be ints")
        if length > 0 and eng.find_region(addr, length) is not None:
            # Mooncake refuses a second registration of a range as an overlap (-7), the same range included
            raise RegionOverlap(f"register 0x{addr:x}+{length}: overlaps a registered region (registered "
                                  f"already)")
        if dev is None:
            dev = pointer_device(addr)
        eng.register(addr, length, device=dev)
        self._order.append(addr)

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``capacity`` bytes at ``buffer_addr`` as a source and as a destination for peers.

        Arguments: buffer_addr: address (int); capacity: bytes; location: "*" (detect GPU / host), "cpu:<numa>",
        "cuda:<n>". Returns 0 or a negative code, Mooncake's: ERR_ADDRESS_OVERLAPPED (-7) for a range
        overlapping a registered one, the same range registered twice included; ERR_INVALID_ARGUMENT (-1) for
        a length < 1.
        """
        try:
            with self._lock:
                self._register_one(self._eng(), buffer_addr, capacity, location)
            return 0
        except BaseException as e:  # noqa: BLE001
            return _fail(f"register_memory(0x{buffer_addr:x}, {capacity})" if isinstance(buffer_addr, int)
                         else f"register_memory({buffer_addr!r})", e)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Register several ranges, all or nothing: on a failure the ranges this call registered are
        deregistered again. Returns 0 or the negative code of the first failure."""
        try:
            addrs, caps = list(buffer_addresses), list(capacities)
            if len(addrs) != len(caps):
                raise InvalidTransfer(f"batch_register_memory: {len(addrs)} addresses but {len(caps)} capacities")
        except BaseException as e:  # noqa: BLE001
            return _fail("batch_register_memory", e)
        with self._lock:
            done = []
            try:
                eng = self._eng()
                for a, n in zip(addrs, caps):
                    self._register_one(eng, a, n, location)
                    done.append(a)
                return 0
            except BaseException as e:  # noqa: BLE001
                code = _fail(f"batch_register_memory (entry {len(done)} of {len(addrs)})", e)
                for a in done:  # roll back: a half-registered batch would look registered to sglang's retry
                    try:
                        self._engine.deregister(a)
                        self._order.remove(a)
                    except Exception as e2:  # noqa: BLE001
                        log.warning("batch_register_memory rollback: deregister 0x%x failed: %s", a, e2)
                return code

    def unregister_memory(self, buffer_addr: int) -> int:
        """Forget the range registered at ``buffer_addr``. Returns 0 or ERR_ADDRESS_NOT_REGISTERED / ..."""
        try:
            with self._lock:
                self._eng().deregister(buffer_addr)
                if buffer_addr in self._order:
                    self._order.remove(buffer_addr)
            return 0
        except BaseException as e:  # noqa: BLE001
            return _fail(f"unregister_memory({buffer_addr!r})", e)

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Forget several ranges. Every address is tried (teardown should free what it can); returns 0 or the
        code of the first failure."""
        first = 0
        for a in list(buffer_addresses):
            code = self.unregister_memory(a)
            if code and not first:
                first = code
        return first

    # --- managed buffers (host memory this object allocates and registers) --------------------------------
    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate ``length`` bytes of zeroed, page-aligned host memory and register it. Returns its address,
        or 0 on failure (cause logged), as Mooncake. Free it with ``free_managed_buffer``."""
        try:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise InvalidTransfer(f"allocate_managed_buffer: length {length!r} must be an int >= 1")
            mm, view, addr = _alloc_host(length)
            try:
                with self._lock:
                    self._register_one(self._eng(), addr, length, "cpu:0")
                    self._managed[addr] = (mm, view, length)
            except BaseException:
                _free_host(mm, view)
                raise
            return addr
        except BaseException as e:  # noqa: BLE001
            _fail(f"allocate_managed_buffer({length!r})", e)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Deregister and free a buffer from ``allocate_managed_buffer``. Returns 0, or ERR_INVALID_ARGUMENT
        (-1) for an address this object did not allocate (Mooncake returns 0 there and keeps the address)."""
        with self._lock:
            entry = self._managed.pop(buffer_addr, None)
            if entry is not None and self._engine is not None:
                try:
                    self._engine.deregister(buffer_addr)
                except PxnError as e:
                    log.warning("free_managed_buffer: deregister 0x%x: %s", buffer_addr, e)
                if buffer_addr in self._order:
                    self._order.remove(buffer_addr)
        if entry is None:
            log.warning("free_managed_buffer(%r, %r): not a managed buffer of this engine (%s)", buffer_addr,
                        length, error_name(ERR_INVALID_ARGUMENT))
            return ERR_INVALID_ARGUMENT
        _free_host(entry[0], entry[1])
        return 0

    def _host_range(self, addr, length: int, what: str):
        """Check that [addr, addr + length) is host memory inside one region registered here."""
        if isinstance(addr, bool) or not isinstance(addr, int) or isinstance(length, bool) \
                or not isinstance(length, int) or length < 0:
            raise InvalidTransfer(f"{what}: address {addr!r} and length {length!r} must be ints >= 0")
        if length == 0:
            return
        region = self._eng().find_region(addr, length)
        if region is None or not (region.addr <= addr and addr + length <= region.addr + region.length):
            raise AddressNotRegistered(f"{what}: 0x{addr:x} + {length} is not inside a region registered with this "
                                  f"engine")
        if region.device >= 0:
            raise InvalidTransfer(f"{what}: 0x{addr:x} is GPU memory (cuda:{region.device}); only host memory is "
                                  f"copied here")

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        """Copy the first ``length`` bytes of ``src`` to host memory at ``dest_address`` (inside a registered or
        managed buffer). Returns 0, or ERR_ADDRESS_NOT_REGISTERED / ERR_INVALID_ARGUMENT with nothing written
        (Mooncake copies without a check)."""
        try:
            data = bytes(src) if not isinstance(src, bytes) else src
            if isinstance(length, int) and not isinstance(length, bool) and length > len(data):
                raise InvalidTransfer(f"write_bytes_to_buffer: length {length} > the {len(data)} bytes given")
            self._host_range(dest_address, length, "write_bytes_to_buffer")
            if length:
                ctypes.memmove(dest_address, data, length)
            return 0
        except BaseException as e:  # noqa: BLE001
            return _fail("write_bytes_to_buffer", e)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of host memory at ``source_address`` (inside a registered or managed buffer), or
        b"" with the cause logged when the range is not."""
        try:
            self._host_range(source_address, length, "read_bytes_from_buffer")
            return ctypes.string_at(source_address, length) if length else b""
        except BaseException as e:  # noqa: BLE001
            _fail("read_bytes_from_buffer", e)
            return b""

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer registered by the engine named ``segment_name`` (this one, or a
        peer: its session "host:port" in P2P mode, its segment name with a metadata server). Returns 0 when it
        has none or cannot be reached (cause logged), as Mooncake. For a peer, pxn's "first" is its lowest
        registered address; for this engine, the first still registered in registration order."""
        try:
            eng = self._eng()
            if segment_name in self._names:
                regions = {r.addr for r in eng.regions()}
                for a in self._order:
                    if a in regions:
                        return a
                return min(regions) if regions else 0
            rep = self._query(segment_name, {"op": "regions"}, 5.0)
            addrs = [int(r["addr"]) for r in rep.get("regions", [])]
            return min(addrs) if addrs else 0
        except BaseException as e:  # noqa: BLE001
            _fail(f"get_first_buffer_address({segment_name!r})", e)
            return 0

    # ======================================================================================================
    # transfers
    # ======================================================================================================
    def _read_base_timeout(self) -> Optional[float]:
        """The seconds of Mooncake's timeout rule, from ``MC_TRANSFER_TIMEOUT`` (at least 5, default 30), or None
        when only ``PXN_TIMEOUT`` is set (the engine's own default applies). Read once, at ``initialize``: a
        small batch's own Python time is its latency, and an environment lookup per call is a measurable part."""
        mc = os.environ.get("MC_TRANSFER_TIMEOUT")
        if mc is None and "timeout" in self._env:
            return None  # the engine's own default: its EngineConfig took PXN_TIMEOUT
        try:
            return max(5, int(mc)) if mc is not None else 30
        except ValueError:
            log.warning("MC_TRANSFER_TIMEOUT=%r is not an int; using 30 s", mc)
            return 30

    def _batch_timeout(self, lengths) -> Optional[float]:
        if self._timeout is not None:
            return float(self._timeout)
        base = self._base_timeout
        if base is None:
            return None
        try:
            nbytes = int(sum(lengths))  # builtin sum: a C loop, far cheaper than an int() per item
        except (TypeError, ValueError):
            nbytes = 0  # not ints: the engine names the bad entry
        return base + max(nbytes, 0) / 1e9  # Mooncake: MC_TRANSFER_TIMEOUT s + 1 ns per byte

    def _session(self, target) -> str:
        """The pxn session of ``target``: itself ("host:port") in P2P mode, looked up at the metadata server
        otherwise (cached until a transfer to it fails). Raises UnknownSession."""
        if self._metadata is None:
            return normalize_session(target)
        from transport.engine import UnknownSession
        if not isinstance(target, str) or not target:
            raise UnknownSession(f"segment name must be a non-empty string, got {target!r}")
        session = self._sessions.get(target)
        if session is None:
            try:
                entry = self._metadata.get(_segment_key(target))
            except UnknownPeer as e:
                raise UnknownSession(str(e)) from None
            if entry is None:
                raise UnknownSession(f"segment {target!r} is not registered at metadata server "
                                     f"{self._metadata.url}")
            session = self._sessions[target] = entry["session"]
        return session

    def _forget(self, target, code: int) -> int:
        """After a failed call: drop the cached session of ``target`` when the failure says the peer is gone,
        so the next call looks it up again (the peer may have restarted elsewhere)."""
        if code in (ERR_METADATA, ERR_ENDPOINT) and isinstance(target, str):
            self._sessions.pop(target, None)
        return code

    @staticmethod
    def _nonempty(buffers, peers, lengths):
        """Drop zero-length pieces (Mooncake accepts them and moves nothing). Returns the three lists as given
        when none is zero-length (keeps the engine's fast path for int64 arrays)."""
        try:
            if lengths.__class__ in (list, tuple) and 0 not in lengths:
                return buffers, peers, lengths  # a list without a zero (numpy would find none either): as given
            import numpy as np
            ln = np.asarray(lengths)
            if ln.ndim != 1 or ln.dtype.kind not in "iu" or ln.size == 0 or ln.all():
                return buffers, peers, lengths
            b, p = np.asarray(buffers), np.asarray(peers)
            if b.shape != ln.shape or p.shape != ln.shape:
                return buffers, peers, lengths  # the engine names the mismatch
            keep = ln != 0
            return b[keep], p[keep], ln[keep]
        except (TypeError, ValueError):
            return buffers, peers, lengths

    def _prepare(self, opcode, target, buffers, peers, lengths) -> tuple:
        """What a batch call needs: (opcode, pxn engine, session, buffers, peer addresses, lengths without the
        empty pieces, timeout). Raises what the caller turns into a code."""
        op = _opcode(opcode)
        eng = self._eng()
        session = self._session(target)
        b, p, n = self._nonempty(buffers, peers, lengths)
        return op, eng, session, b, p, n, self._batch_timeout(n)

    def _sync(self, what: str, opcode, target, buffers, peers, lengths, notify=None) -> int:
        """One blocking batch: WRITE local -> peer, READ peer -> local; then the notify, if any."""
        try:
            op, eng, session, b, p, n, timeout = self._prepare(opcode, target, buffers, peers, lengths)
            if op == TransferOpcode.WRITE:
                eng.batch_write(session, b, p, n, timeout=timeout)
            else:
                eng.batch_read(session, b, p, n, timeout=timeout)
            if notify is not None:
                from transport.reads import send_notify
                send_notify(eng, session, getattr(notify, "name", ""), getattr(notify, "msg", ""))
            return 0
        except BaseException as e:  # noqa: BLE001
            return self._forget(target, _fail(f"{what} {target!r} ({_count(lengths)} pieces)", e))

    def _async(self, what: str, opcode, target, buffers, peers, lengths) -> int:
        """Submit one batch; its id (>= 1), or 0 when refused at submission (cause logged, nothing written)."""
        try:
            op, eng, session, b, p, n, timeout = self._prepare(opcode, target, buffers, peers, lengths)
            submit = eng.batch_write_async if op == TransferOpcode.WRITE else eng.batch_read_async
            h = submit(session, b, p, n, timeout=timeout)
        except BaseException as e:  # noqa: BLE001
            self._forget(target, _fail(f"{what} {target!r} ({_count(lengths)} pieces)", e))
            return 0
        bid = next(self._batch_ids)
        limit = timeout if timeout is not None else eng.default_timeout
        with self._batch_lock:
            self._batches[bid] = _Pending(h, time.monotonic() + limit)
        return bid

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Write ``length`` bytes from local ``buffer`` to ``peer_buffer_address`` at ``target_hostname``.
        Returns 0 once the bytes are at the peer, or a negative code. ``transport_hint`` is accepted for
        signature compatibility and ignored (Mooncake ignores it too outside TENT)."""
        return self._sync("transfer_sync_write to", TransferOpcode.WRITE, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        """Read ``length`` bytes from ``peer_buffer_address`` at ``target_hostname`` into local ``buffer``.
        Returns 0 once the bytes are here, or a negative code (nothing written on a bad address)."""
        return self._sync("transfer_sync_read from", TransferOpcode.READ, target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Write every ``lengths[i]`` bytes from ``buffers[i]`` to ``peer_buffer_addresses[i]`` at the peer.

        Arguments: target_hostname: the peer's session "host:port" (its segment name with a metadata server);
        buffers: local addresses inside registered memory; peer_buffer_addresses: addresses inside memory the
        peer registered; lengths: bytes (zero-length pieces are skipped, as Mooncake).
        Returns 0 when every byte is placed, else a negative code (module docstring); on ERR_INVALID_ARGUMENT,
        ERR_ADDRESS_NOT_REGISTERED and ERR_METADATA nothing was written.
        """
        eng = self._engine
        if eng is not None and self._metadata is None and lengths.__class__ is list and 0 not in lengths:
            # a list without empty pieces in P2P mode (sglang's aux batches): what ``_sync`` passes to the engine,
            # without its steps for the other cases (a small batch's own Python time is its latency)
            try:
                eng.batch_write(normalize_session(target_hostname), buffers, peer_buffer_addresses, lengths,
                                timeout=self._batch_timeout(lengths))
                return 0
            except BaseException as e:  # noqa: BLE001
                return self._forget(target_hostname, _fail(f"batch_transfer_sync_write to {target_hostname!r} "
                                                           f"({_count(lengths)} pieces)", e))
        return self._sync("batch_transfer_sync_write to", TransferOpcode.WRITE, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        """Read every ``lengths[i]`` bytes from ``peer_buffer_addresses[i]`` at the peer into local
        ``buffers[i]``; the peer gathers small pieces into coalesced chunks (``transport.reads``). Returns 0 or
        a negative code; on ERR_INVALID_ARGUMENT / ERR_ADDRESS_NOT_REGISTERED / ERR_METADATA nothing was
        written."""
        return self._sync("batch_transfer_sync_read from", TransferOpcode.READ, target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """Submit a batch write and return at once.

        Returns: a batch id >= 1 for ``get_batch_transfer_status`` / ``transfer_check_status``, or 0 when the
        batch was refused at submission (Mooncake's contract); the cause and its code are logged, and nothing
        was written.
        """
        return self._async("batch_transfer_async_write to", TransferOpcode.WRITE, target_hostname, buffers,
                           peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Submit a batch read and return at once: a batch id >= 1, or 0 when refused at submission (a local
        destination outside registered memory, unknown peer...; cause logged). A source outside the peer's
        memory fails the batch at ``get_batch_transfer_status``, with nothing written."""
        return self._async("batch_transfer_async_read from", TransferOpcode.READ, target_hostname, buffers,
                           peer_buffer_addresses, lengths)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int, opcode,
                      notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """One piece in the direction of ``opcode`` (``TransferOpcode.Read`` / ``.Write``); with ``notify``
        the peer finds (notify.name, notify.msg) in its ``get_notifies()`` once the bytes are placed.
        Returns 0 or a negative code (ERR_INVALID_ARGUMENT for an unknown opcode)."""
        return self._sync("transfer_sync with", opcode, target_hostname, [buffer], [peer_buffer_address],
                          [length], notify)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode,
                            notify: Optional[TransferNotify] = None, transport_hint: str = "") -> int:
        """A batch in the direction of ``opcode``, then ``notify`` (see ``transfer_sync``). 0 or < 0."""
        return self._sync("batch_transfer_sync with", opcode, target_hostname, buffers, peer_buffer_addresses,
                          lengths, notify)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int], opcode,
                             transport_hint: str = "") -> int:
        """Submit a batch in the direction of ``opcode``: a batch id >= 1, or 0 when refused (cause logged)."""
        return self._async("batch_transfer_async with", opcode, target_hostname, buffers, peer_buffer_addresses,
                           lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """One-piece ``batch_transfer_async_write``: a batch id >= 1, or 0 when submission failed (Mooncake's
        contract; the cause and its negative code are logged)."""
        return self._async("transfer_submit_write to", TransferOpcode.WRITE, target_hostname, [buffer],
                           [peer_buffer_address], [length])

    def get_notifies(self) -> List[TransferNotify]:
        """The notifies peers sent with ``transfer_sync`` / ``batch_transfer_sync`` since the last call, oldest
        first ([] before ``initialize``)."""
        if self._engine is None:
            return []
        from transport.reads import take_notifies
        return [TransferNotify(n, m) for n, m in take_notifies(self._engine)]

    def _finish(self, bid: int, p: _Pending, wait: Optional[float]) -> int:
        """Wait up to ``wait`` s (None: until the batch's deadline) for a batch; its code."""
        try:
            p.handle.wait(max(0.0, p.deadline - time.monotonic()) if wait is None else wait)
            return 0
        except BaseException as e:  # noqa: BLE001
            return _fail(f"batch {bid}", e)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for batches submitted with ``batch_transfer_async_write``, then free their ids.

        Blocks like Mooncake's (each batch until its own deadline). Returns 0 when all succeeded, else the code
        of the first failed batch in ``batch_ids`` order (ERR_INVALID_ARGUMENT for an unknown / already freed
        id). Unlike Mooncake it waits for every batch even after a failure, so on return no listed batch still
        writes into the caller's buffers.
        """
        first = 0
        for bid in list(batch_ids):
            with self._batch_lock:
                p = self._batches.pop(bid, None)
            if p is None:
                log.warning("get_batch_transfer_status: unknown or already freed batch id %r (%s)", bid,
                            error_name(ERR_INVALID_ARGUMENT))
                code = ERR_INVALID_ARGUMENT
            else:
                code = self._finish(bid, p, None)
            if code and not first:
                first = code
        return first

    def check_batch_transfer_status(self, batch_id: int) -> int:
        """Non-blocking status of one async batch (pxn extension, Mooncake's ``transfer_check_status`` codes).

        Returns: 1 done (id freed), 0 still in flight, a negative code when it failed or passed its deadline
        (id freed), ERR_INVALID_ARGUMENT for an unknown id.
        """
        with self._batch_lock:
            p = self._batches.get(batch_id)
        if p is None:
            log.warning("check_batch_transfer_status: unknown or already freed batch id %r", batch_id)
            return ERR_INVALID_ARGUMENT
        if not p.handle.done() and time.monotonic() < p.deadline:
            return 0
        code = self._finish(batch_id, p, 0.0)  # done, or past its deadline: wait(0) names the timeout
        with self._batch_lock:
            self._batches.pop(batch_id, None)
        return 1 if code == 0 else code

    def transfer_check_status(self, batch_id: int) -> int:
        """Mooncake's single-transfer poll: 1 done, 0 in flight, negative failed (see
        ``check_batch_transfer_status``)."""
        return self.check_batch_transfer_status(batch_id)

    # ======================================================================================================
    # liveness
    # ======================================================================================================
    def _query(self, peer_server_name: str, msg: dict, timeout: float) -> dict:
        """One request / reply with the peer's control listener on a fresh, authenticated connection (this
        engine's secret; ``PXN_SECRET`` before ``initialize``). Raises UnknownSession (bad name, not at the
        metadata server), OSError (nothing answers; ``socket.gaierror`` for DNS), ``AuthError`` (refused),
        ConnectionError / ValueError (a bad reply)."""
        from transport.control import UnknownSession, query
        target = normalize_session(self._session(peer_server_name))
        host, _, port_s = target.rpartition(":") if isinstance(target, str) else ("", "", "")
        if not host or not port_s.isdigit():
            raise UnknownSession(f"{peer_server_name!r} is not 'host:port'")
        eng = self._engine
        rep = query(target, msg, None if eng is None else eng.credentials, timeout)
        if not isinstance(rep, dict) or not rep.get("ok"):
            raise ValueError(f"peer answered {rep!r}")
        return rep

    def send_probe(self, peer_server_name: str, timeout: float = 2.0) -> int:
        """Cheap liveness probe: connect to the peer's control port and ask for its region list (one small
        request / reply on a fresh connection; no rail or handshake state is touched).

        Arguments: peer_server_name: "host:port" (a segment name with a metadata server); timeout: seconds.
        Returns: 0 when a pxn engine answered; ERR_METADATA for a malformed or unpublished name, ERR_DNS when
        the host name does not resolve, ERR_SOCKET when nothing answers, ERR_ENDPOINT when something answered
        but not as a pxn engine (or refused this engine's secret).
        """
        from transport.auth import AuthError
        from transport.control import UnknownSession
        try:
            self._query(peer_server_name, {"op": "regions"}, timeout)
            return 0
        except UnknownSession as e:
            log.warning("send_probe(%r): %s (%s)", peer_server_name, e, error_name(ERR_METADATA))
            return ERR_METADATA
        except socket.gaierror as e:
            log.info("send_probe(%r): cannot resolve: %s (%s)", peer_server_name, e, error_name(ERR_DNS))
            return ERR_DNS
        except AuthError as e:
            log.warning("send_probe(%r): refused: %s (%s)", peer_server_name, e, error_name(ERR_ENDPOINT))
            return ERR_ENDPOINT
        except OSError as e:
            log.info("send_probe(%r): %s (%s)", peer_server_name, e, error_name(ERR_SOCKET))
            return self._forget(peer_server_name, ERR_SOCKET)
        except (ConnectionError, ValueError) as e:
            log.warning("send_probe(%r): bad reply: %s (%s)", peer_server_name, e, error_name(ERR_ENDPOINT))
            return self._forget(peer_server_name, ERR_ENDPOINT)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Mooncake pre-connects EFA endpoints here; pxn has no EFA fabric and connects on first use: 0, as
        Mooncake returns when EFA is not in use."""
        return 0

    def get_engine_ptr(self) -> int:
        """Mooncake returns the address of its C++ engine, for C++ extensions (``mooncake.pg``, EP). pxn has no
        C++ engine: 0 (a null pointer such callers refuse), with one log line."""
        log.warning("get_engine_ptr: pxn has no C++ transfer engine to hand to Mooncake's C++ extensions; "
                    "returning 0")
        return 0

    # ======================================================================================================
    # stream-ordered transfers (*_on_cuda)
    # ======================================================================================================
    def transfer_write_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                               stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Write one piece once the work queued on CUDA stream ``stream_ptr`` before this call finished; work
        queued on the stream after it waits for the write. See ``batch_transfer_write_on_cuda``."""
        self._on_cuda(TransferOpcode.WRITE, target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Read one piece in stream order (see ``batch_transfer_write_on_cuda``)."""
        self._on_cuda(TransferOpcode.READ, target_hostname, [buffer], [peer_buffer_address], [length],
                      stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers: Sequence[int],
                                     peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                     stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Write a batch in the order of CUDA stream ``stream_ptr`` (a ``cudaStream_t`` as int, 0 = legacy
        default stream): it starts when the stream reaches this point and the stream's later work waits for it,
        as Mooncake's (a host function on the stream).

        Returns None, as Mooncake. Raises RuntimeError at the call, as Mooncake, when the peer is unknown or the
        lists differ in length, and when this process has no CUDA; a failure during the transfer is logged at
        ERROR (Mooncake ends the process there) and counted in ``stats()["cuda_transfers_failed"]``.
        """
        self._on_cuda(TransferOpcode.WRITE, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers: Sequence[int],
                                    peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                    stream_ptr: int = 0, transport_hint: str = "") -> None:
        """Read a batch in stream order (see ``batch_transfer_write_on_cuda``)."""
        self._on_cuda(TransferOpcode.READ, target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr)

    def _on_cuda(self, opcode, target, buffers, peers, lengths, stream_ptr) -> None:
        try:
            eng = self._eng()
            eng.open_session(self._session(target))  # as Mooncake's openSegment at the call: an unknown peer fails here
            b, p, n = list(buffers), list(peers), list(lengths)
            if not (len(b) == len(p) == len(n)):
                raise InvalidTransfer(f"buffers, peer_buffer_addresses and lengths have different sizes "
                                      f"({len(b)}, {len(p)}, {len(n)})")
        except BaseException as e:  # noqa: BLE001
            code = _fail(f"*_on_cuda to {target!r}", e)
            raise RuntimeError(f"pxn: stream-ordered transfer to {target!r} refused ({error_name(code)}): {e}") \
                from None
        launch = self._launch_host_func or _cuda_launch_host_func
        start, done = threading.Event(), threading.Event()
        jid = next(self._cuda_ids)
        what = "write to" if opcode == TransferOpcode.WRITE else "read from"

        def on_stream():      # runs on CUDA's callback thread: no CUDA call here, only the hand-off and the wait
            start.set()
            done.wait()

        def worker():
            start.wait()
            code = self._sync(f"stream-ordered {what}", opcode, target, b, p, n)
            if code:
                log.error("stream-ordered %s %r failed (%s); the stream continues without its data", what,
                          target, error_name(code))
                self._cuda_failed += 1
            done.set()

        try:
            launch(int(stream_ptr or 0), on_stream)
        except BaseException as e:  # noqa: BLE001
            raise RuntimeError(f"pxn: cannot queue the transfer on stream 0x{int(stream_ptr or 0):x}: {e}") from e
        threading.Thread(target=worker, name=f"pxn-on-cuda-{jid}", daemon=True).start()

    _cuda_failed = 0

    # ======================================================================================================
    # lifetime
    # ======================================================================================================
    def stats(self) -> dict:
        """The pxn engine's telemetry (docs/README-engine.md) plus ``cuda_transfers_failed``; {} before
        ``initialize``."""
        if self._engine is None:
            return {}
        return {**self._engine.stats(), "cuda_transfers_failed": self._cuda_failed}

    def close(self) -> None:
        """Stop the engine (threads, sockets, memory registrations), remove this engine's entry from the
        metadata server, free managed buffers. Idempotent; pending async batches fail."""
        with self._lock:
            eng, self._engine = self._engine, None
            meta, segment, self._metadata, self._segment = self._metadata, self._segment, None, None
            managed, self._managed = self._managed, {}
        if meta is not None and segment is not None:
            meta.delete(_segment_key(segment))
        if eng is not None:
            eng.close()
        for mm, view, _ in managed.values():
            _free_host(mm, view)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 — interpreter shutdown
            pass


def _count(lengths) -> str:
    try:
        return str(len(lengths))
    except TypeError:
        return "?"


def _opcode(opcode) -> int:
    """TransferOpcode.Read / .Write (or Mooncake's enum, or 0 / 1) -> 0 / 1; InvalidTransfer otherwise."""
    try:
        value = int(getattr(opcode, "value", opcode))
    except (TypeError, ValueError):
        value = -1
    if isinstance(opcode, bool) or value not in (TransferOpcode.READ, TransferOpcode.WRITE):
        raise InvalidTransfer(f"opcode {opcode!r}: expected TransferOpcode.Read (0) or TransferOpcode.Write (1)")
    return value


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _cuda_launch_host_func(stream_ptr: int, fn) -> None:
    """``cudaLaunchHostFunc(stream, fn)`` through libcudart; ``fn`` runs once the stream reaches it and the
    stream's later work waits for it to return. RuntimeError when there is no usable CUDA."""
    lib = _load_cudart()
    if lib is None:
        raise RuntimeError("no CUDA runtime in this process (stream-ordered transfers need one)")
    cb = _HOST_FN(lambda _data: fn())
    lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
    lib.cudaLaunchHostFunc.restype = ctypes.c_int
    err = lib.cudaLaunchHostFunc(ctypes.c_void_p(stream_ptr), cb, None)
    if err != 0:
        raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")
    # the C thunk must outlive its run on CUDA's thread; dropping it right after could free it while that thread
    # still returns through it, so the newest ones are kept (older ones finished long before, in stream order)
    _LIVE_CALLBACKS.append(cb)


_LIVE_CALLBACKS = collections.deque(maxlen=1 << 16)
