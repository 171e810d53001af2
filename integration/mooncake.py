"""Mooncake's ``mooncake.engine.TransferEngine`` Python API on top of pxn's relay engine.

Code written against Mooncake (``from mooncake.engine import TransferEngine``) can use
``from integration.mooncake import TransferEngine`` instead::

    eng = TransferEngine()
    assert eng.initialize("10.0.0.5", "P2PHANDSHAKE", "rdma", "") == 0
    session = f"10.0.0.5:{eng.get_rpc_port()}"          # what peers pass as target_hostname
    eng.register_memory(ptr, nbytes)
    ret = eng.batch_transfer_sync_write(peer_session, local_ptrs, remote_ptrs, lengths)   # 0 or < 0

This module is the ONE place in pxn that returns Mooncake-style ints instead of raising: every pxn exception is
mapped to a distinct negative code (table below) and its cause is logged through ``logging`` (logger
``integration.mooncake``), never swallowed silently. Codes that have a Mooncake equivalent reuse Mooncake's
value (``mooncake-transfer-engine/include/error.h``); pxn-only causes use the -5xx range.

=====================  =====  =========================================================================
name                   value  cause
=====================  =====  =========================================================================
ERR_INVALID_ARGUMENT     -1   malformed call: list lengths differ, length < 1, non-int entry, bad location,
                              unknown batch id (``transport.InvalidTransfer``)
ERR_ADDRESS_NOT_REG.     -3   a source outside this engine's registered memory, a destination outside every
                              region the peer registered, unregistering an address never registered;
                              nothing was written
ERR_DEVICE_NOT_FOUND     -6   the fabric cannot run here (protocol "rdma" without a usable RDMA device,
                              ``device_name`` matches no NIC) (``FabricUnavailable``)
ERR_ADDRESS_OVERLAPPED   -7   ``register_memory`` of a range overlapping a registered one
ERR_SOCKET             -102   ``send_probe``: nothing answers at the peer's control port
ERR_METADATA           -200   unknown session: malformed "host:port", nobody listens there, handshake refused
                              (``UnknownSession``), also a dead peer once the engine forgot it; nothing written
ERR_ENDPOINT           -201   every rail to the peer failed (peer died, connections reset) (``PeerLost`` /
                              ``TransferError`` with per-rail ``causes``); part may have been written. The engine
                              then forgets the peer: a later call to the session handshakes again
ERR_CONTEXT            -202   not initialized yet, or closed (``FabricClosed``)
ERR_NOT_IMPLEMENTED    -303   a metadata server other than P2PHANDSHAKE, a protocol pxn has no fabric for
ERR_REMOTE_REJECTED    -501   the receiver refused a chunk / write (e.g. the peer deregistered the region
                              after the sender learnt its list) (``RemoteRejected``); that part not written
ERR_TIMEOUT            -502   the batch did not finish in time (``TransferTimeout``); part may be written
ERR_TRANSFER           -503   any other ``TransferError`` / ``FabricError``
ERR_INTERNAL           -599   an unexpected exception (a bug): logged with its traceback
=====================  =====  =========================================================================

Differences from Mooncake, on purpose:

* ``target_hostname`` is the pxn session id "host:port" (the peer engine's control port, = its
  ``get_rpc_port()``), exactly what sglang builds from ``get_rpc_port()``; "[v6addr]:port" is accepted too.
  There is no metadata server: ``initialize`` accepts only "P2PHANDSHAKE" (what sglang passes).
* protocols: "tcp" -> pxn fabric tcp; "rdma" -> verbs (fails with ERR_DEVICE_NOT_FOUND when no RDMA device is
  usable: a silent fall back to TCP would hide a 10x slowdown); "auto" (a pxn extension) -> verbs when a device
  is usable, else tcp; "ipc" (pxn extension) -> same-host ipc. ``MC_FORCE_TCP=1`` forces tcp as in Mooncake,
  and ``PXN_FABRIC`` (tcp|ipc|verbs|auto), when set, overrides the protocol argument.
* ``get_batch_transfer_status(batch_ids)`` blocks until every listed batch finished, as Mooncake's does
  (``transfer_engine_py.cpp``: it polls until all complete or one fails / times out, then frees the ids). pxn
  returns 0 when all succeeded, else the code of the first failed batch in list order; it waits for EVERY batch
  (Mooncake returns at the first failure while others may still write into the caller's buffers) and frees
  all the ids. The non-blocking pxn extension ``check_batch_transfer_status(batch_id)`` follows Mooncake's
  ``transfer_check_status`` codes: 1 done, 0 pending, negative failed (then the id is freed).
* ``batch_transfer_async_write`` returns a batch id >= 1, or 0 when submission failed (Mooncake's contract,
  "Batch ID ... or 0 on failure"); the cause and its negative code are logged.
* timeouts: ``timeout=`` given to the constructor (s), else Mooncake's rule: ``MC_TRANSFER_TIMEOUT`` seconds
  (default 30, at least 5) plus 1 ns per byte of the batch (1 GB/s), else ``PXN_TIMEOUT`` when that is set.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import json
import logging
import os
import re
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from transport.errors import (FabricClosed, FabricError, FabricUnavailable, InvalidTransfer, PeerLost, PxnError,
                              RemoteRejected, TransferError, TransferTimeout, UnknownPeer)

log = logging.getLogger(__name__)

__all__ = ["TransferEngine", "TransferOpcode", "error_code", "error_name", "normalize_session",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_DEVICE_NOT_FOUND", "ERR_ADDRESS_OVERLAPPED",
           "ERR_SOCKET", "ERR_METADATA", "ERR_ENDPOINT", "ERR_CONTEXT", "ERR_NOT_IMPLEMENTED",
           "ERR_REMOTE_REJECTED", "ERR_TIMEOUT", "ERR_TRANSFER", "ERR_INTERNAL"]

# --- codes: Mooncake's values where Mooncake has the cause (include/error.h), -5xx for pxn-only causes --------
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
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

# InvalidTransfer covers both "malformed call" and "address not registered"; the engine's messages name which
# (transport/engine.py _submit / _keys and RegionTable). Matching text couples us to those messages, so the
# integration tests assert the exact code for both cases: a reworded message fails a test, not a deployment.
_NOT_REGISTERED = re.compile(r"not inside a region|outside every region|was deregistered|no longer advertised|"
                             r"no registered region")
_OVERLAP = re.compile(r"overlaps")

P2PHANDSHAKE = "P2PHANDSHAKE"
_PROTOCOLS = {"tcp": "tcp", "rdma": "verbs", "verbs": "verbs", "auto": "auto", "ipc": "ipc"}


class TransferOpcode:
    """Mooncake's opcode enum (``TransferOpcode.Read`` / ``.Write``); pxn only writes."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


def error_name(code: int) -> str:
    """The symbolic name of a code returned here, e.g. ``error_name(-3) == "ERR_ADDRESS_NOT_REGISTERED"``."""
    return "OK" if code == 0 else _NAMES.get(code, f"ERR_{code}")


def error_code(exc: BaseException) -> int:
    """Map a pxn exception to its negative code (module docstring). Order matters: the narrowest class first
    (``UnknownSession`` is also an ``InvalidTransfer`` and an ``UnknownPeer``)."""
    from transport.engine import UnknownSession  # the engine module is heavy; loaded when first needed
    if isinstance(exc, UnknownSession) or isinstance(exc, UnknownPeer):
        return ERR_METADATA
    if isinstance(exc, InvalidTransfer):
        text = str(exc)
        if _NOT_REGISTERED.search(text):
            return ERR_ADDRESS_NOT_REGISTERED
        if _OVERLAP.search(text):
            return ERR_ADDRESS_OVERLAPPED
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
        raise FabricUnavailable(f"device_name {','.join(sorted(wanted))!r} matches no usable NIC port (have "
                                f"{', '.join(p.key for p in topo.ports) or 'none'})")
    return Topology(topo.gpus, ports, topo.distances, topo.nvlink, topo.nvlink_source, topo.root, topo.name,
                    topo.notes)


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
        **engine_options: passed to ``transport.TransferEngine`` at ``initialize`` (``rails``,
            ``coalesce_bytes``, ``topology``, ...; see docs/README-engine.md).

    Every method is thread-safe; transfers from many threads run concurrently (the pxn engine is thread-safe).
    """

    def __init__(self, timeout: Optional[float] = None, **engine_options):
        self._timeout = timeout
        self._options = dict(engine_options)
        self._engine = None
        self._hostname: Optional[str] = None
        self._lock = threading.Lock()       # initialize / close / registration (batch all-or-nothing)
        self._batches: Dict[int, _Pending] = {}
        self._batch_lock = threading.Lock()
        self._batch_ids = itertools.count(1)

    # ======================================================================================================
    # initialization
    # ======================================================================================================
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        """Start the pxn engine.

        Arguments:
            local_hostname: address to listen on and advertise: "host", "host:port" or "[v6]:port". A port is
                ignored (the engine picks a free control port; ``get_rpc_port()`` reports it, as Mooncake's
                P2PHANDSHAKE mode does).
            metadata_server: must be "P2PHANDSHAKE" (pxn has no metadata server).
            protocol: "rdma" (verbs) | "tcp" | "auto" | "ipc"; ``MC_FORCE_TCP=1`` / ``PXN_FABRIC`` override it.
            device_name: comma-separated RDMA devices ("mlx5_0,mlx5_1") that may carry rails; "" = every
                usable port (pxn then relays each GPU's data to its nearest NIC over NVLink).
        Returns:
            0, or a negative code (ERR_CONTEXT already initialized, ERR_NOT_IMPLEMENTED, ERR_DEVICE_NOT_FOUND ...).
        """
        with self._lock:
            if self._engine is not None:
                log.warning("initialize: already initialized as %s; create another TransferEngine for a second "
                            "endpoint", self._engine.session_id)
                return ERR_CONTEXT
            if (metadata_server or "").strip() != P2PHANDSHAKE:
                log.error("initialize: metadata server %r is not supported; pxn peers exchange everything at a "
                          "direct handshake: pass %r", metadata_server, P2PHANDSHAKE)
                return ERR_NOT_IMPLEMENTED
            proto = (protocol or "").strip().lower()
            if os.environ.get("MC_FORCE_TCP") == "1":
                proto = "tcp"
            override = os.environ.get("PXN_FABRIC", "").strip().lower()
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
            if port:
                log.info("initialize: port %s of %r is ignored; the pxn control port is chosen at bind time "
                         "(get_rpc_port())", port, local_hostname)
            try:
                options = dict(self._options)
                names = [n for n in (device_name or "").split(",") if n.strip()]
                if fabric in ("verbs", "auto") and "topology" not in options:
                    options["topology"] = self._topology(fabric, names)
                from transport.engine import TransferEngine as PxnEngine
                self._engine = PxnEngine(hostname=host, fabric=fabric, **options)
            except BaseException as e:  # noqa: BLE001 — mapped to a code and logged
                return _fail(f"initialize({local_hostname!r}, protocol={protocol!r} -> {fabric}, "
                             f"device_name={device_name!r})", e)
            self._hostname = host
            log.info("pxn Mooncake shim: session %s over %s (protocol %r)", self._engine.session_id,
                     self._engine.fabric_name, protocol)
            return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        """Mooncake's extended initialize; ``metadata_type`` must be "p2p" or "" with P2PHANDSHAKE."""
        if (metadata_type or "").strip().lower() not in ("", "p2p", "p2phandshake"):
            log.error("initialize_ext: metadata type %r is not supported (pxn has no metadata server)",
                      metadata_type)
            return ERR_NOT_IMPLEMENTED
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

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
        if dev is None:
            dev = pointer_device(addr)
        eng.register(addr, length, device=dev)

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``capacity`` bytes at ``buffer_addr`` as a source and as a destination for peers.

        Arguments: buffer_addr: address (int); capacity: bytes; location: "*" (detect GPU / host), "cpu:<numa>",
        "cuda:<n>". Registering the same range again succeeds. Returns 0 or a negative code
        (ERR_ADDRESS_OVERLAPPED for a range overlapping another, ERR_INVALID_ARGUMENT for length < 1).
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
                before = {r.addr for r in eng.regions()}
                for a, n in zip(addrs, caps):
                    self._register_one(eng, a, n, location)
                    if a not in before:
                        done.append(a)
                return 0
            except BaseException as e:  # noqa: BLE001
                code = _fail(f"batch_register_memory (entry {len(done)} of {len(addrs)})", e)
                for a in done:  # roll back: a half-registered batch would look registered to sglang's retry
                    try:
                        self._engine.deregister(a)
                    except Exception as e2:  # noqa: BLE001
                        log.warning("batch_register_memory rollback: deregister 0x%x failed: %s", a, e2)
                return code

    def unregister_memory(self, buffer_addr: int) -> int:
        """Forget the range registered at ``buffer_addr``. Returns 0 or ERR_ADDRESS_NOT_REGISTERED / ..."""
        try:
            with self._lock:
                self._eng().deregister(buffer_addr)
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

    # ======================================================================================================
    # transfers
    # ======================================================================================================
    def _batch_timeout(self, lengths) -> Optional[float]:
        if self._timeout is not None:
            return float(self._timeout)
        mc = os.environ.get("MC_TRANSFER_TIMEOUT")
        if mc is None and os.environ.get("PXN_TIMEOUT"):
            return None  # the engine's own default, read from PXN_TIMEOUT
        try:
            base = max(5, int(mc)) if mc is not None else 30
        except ValueError:
            log.warning("MC_TRANSFER_TIMEOUT=%r is not an int; using 30 s", mc)
            base = 30
        try:
            nbytes = int(sum(lengths))  # builtin sum: a C loop, ~1 ms for 262144 pieces (an int() per item: 20)
        except (TypeError, ValueError):
            nbytes = 0  # not ints: the engine names the bad entry
        return base + max(nbytes, 0) / 1e9  # Mooncake: MC_TRANSFER_TIMEOUT s + 1 ns per byte

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        """Write ``length`` bytes from local ``buffer`` to ``peer_buffer_address`` at ``target_hostname``
        ("host:port"). Returns 0 once the bytes are at the peer, or a negative code. ``transport_hint`` is
        accepted for signature compatibility and ignored (Mooncake ignores it too outside TENT)."""
        return self.batch_transfer_sync_write(target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        """Write every ``lengths[i]`` bytes from ``buffers[i]`` to ``peer_buffer_addresses[i]`` at the peer.

        Arguments: target_hostname: the peer's session "host:port"; buffers: local addresses inside registered
        memory; peer_buffer_addresses: addresses inside memory the peer registered; lengths: bytes (>= 1).
        Returns 0 when every byte is placed, else a negative code (module docstring); on ERR_INVALID_ARGUMENT,
        ERR_ADDRESS_NOT_REGISTERED and ERR_METADATA nothing was written.
        """
        try:
            self._eng().batch_write(normalize_session(target_hostname), buffers, peer_buffer_addresses, lengths,
                                    timeout=self._batch_timeout(lengths))
            return 0
        except BaseException as e:  # noqa: BLE001
            return _fail(f"batch_transfer_sync_write to {target_hostname!r} ({_count(lengths)} pieces)", e)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """Submit a batch write and return at once.

        Returns: a batch id >= 1 for ``get_batch_transfer_status`` / ``check_batch_transfer_status``, or 0 when
        the batch was refused at submission (Mooncake's contract); the cause and its code are logged, and
        nothing was written.
        """
        try:
            timeout = self._batch_timeout(lengths)
            h = self._eng().batch_write_async(normalize_session(target_hostname), buffers, peer_buffer_addresses,
                                              lengths, timeout=timeout)
        except BaseException as e:  # noqa: BLE001
            _fail(f"batch_transfer_async_write to {target_hostname!r} ({_count(lengths)} pieces)", e)
            return 0
        bid = next(self._batch_ids)
        limit = timeout if timeout is not None else self._engine.default_timeout
        with self._batch_lock:
            self._batches[bid] = _Pending(h, time.monotonic() + limit)
        return bid

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """One-piece ``batch_transfer_async_write``. Mooncake returns a negative value on failure here, so this
        returns the negative code (not 0) when submission fails."""
        try:
            timeout = self._batch_timeout([length])
            h = self._eng().batch_write_async(normalize_session(target_hostname), [buffer], [peer_buffer_address],
                                              [length], timeout=timeout)
        except BaseException as e:  # noqa: BLE001
            return _fail(f"transfer_submit_write to {target_hostname!r}", e)
        bid = next(self._batch_ids)
        limit = timeout if timeout is not None else self._engine.default_timeout
        with self._batch_lock:
            self._batches[bid] = _Pending(h, time.monotonic() + limit)
        return bid

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
    def send_probe(self, peer_server_name: str, timeout: float = 2.0) -> int:
        """Cheap liveness probe: connect to the peer's control port and ask for its region list (one small
        request / reply on a fresh connection; no rail or handshake state is touched).

        Arguments: peer_server_name: "host:port"; timeout: seconds for connect + reply.
        Returns: 0 when a pxn engine answered; ERR_METADATA for a malformed name, ERR_SOCKET when nothing
        answers, ERR_ENDPOINT when something answered but not as a pxn engine.
        """
        from transport.auth import AuthError
        from transport.control import UnknownSession, query
        target = normalize_session(peer_server_name)
        host, _, port_s = target.rpartition(":") if isinstance(target, str) else ("", "", "")
        if not host or not port_s.isdigit():
            log.warning("send_probe(%r): not 'host:port' (%s)", peer_server_name, error_name(ERR_METADATA))
            return ERR_METADATA
        try:
            # authenticated like every control connection, with this engine's secret (PXN_SECRET before init)
            eng = self._engine
            rep = query(target, {"op": "regions"}, None if eng is None else (eng._secret or ""), timeout)
        except UnknownSession as e:
            log.warning("send_probe(%r): %s (%s)", peer_server_name, e, error_name(ERR_METADATA))
            return ERR_METADATA
        except AuthError as e:
            log.warning("send_probe(%r): refused: %s (%s)", peer_server_name, e, error_name(ERR_ENDPOINT))
            return ERR_ENDPOINT
        except OSError as e:
            log.info("send_probe(%r): %s (%s)", peer_server_name, e, error_name(ERR_SOCKET))
            return ERR_SOCKET
        except (ConnectionError, ValueError) as e:
            log.warning("send_probe(%r): bad reply: %s (%s)", peer_server_name, e, error_name(ERR_ENDPOINT))
            return ERR_ENDPOINT
        if not isinstance(rep, dict) or not rep.get("ok"):
            log.warning("send_probe(%r): peer answered %r (%s)", peer_server_name, rep, error_name(ERR_ENDPOINT))
            return ERR_ENDPOINT
        return 0

    # ======================================================================================================
    # lifetime
    # ======================================================================================================
    def stats(self) -> dict:
        """The pxn engine's telemetry (docs/README-engine.md); {} before ``initialize``."""
        return self._engine.stats() if self._engine is not None else {}

    def close(self) -> None:
        """Stop the engine (threads, sockets, memory registrations). Idempotent; pending async batches fail."""
        with self._lock:
            eng, self._engine = self._engine, None
        if eng is not None:
            eng.close()

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
