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
layout and a lease per entry (``integration.metadata``); with a metadata server peers are named by their segment
name.

This layer (this module and the parts it is built from: ``integration.codes``, ``hosts``, ``cuda``, ``metadata``,
``buffers``, ``transfers``) is the ONE place in pxn that returns Mooncake-style ints instead of raising: every pxn
exception is mapped to a negative code (table below) and its cause is logged in one line through ``logging``
(logger ``integration.mooncake``), never swallowed silently and never raised into the caller. Codes reuse Mooncake's
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
                              a segment name the metadata server does not know, the metadata server unreachable,
                              timed out or refusing (``UnknownSession``, ``MetadataUnavailable``), ``initialize``
                              under a name a live engine holds (``SegmentNameTaken``), an entry that is not a pxn
                              engine's (``ForeignSegment``: a Mooncake engine's segment); nothing written
ERR_ENDPOINT           -201   a dead peer (``PeerGone``, on every fabric): every rail to it failed (peer died,
                              connections reset; part may have been written), and every later call while nobody
                              answers at its session (nothing written); also a query such as
                              ``get_first_buffer_address`` whose connection is refused or reset. The engine forgets
                              the dead peer: a call once a new engine answers at the session handshakes again
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

import json
import socket
import threading
from typing import List, Optional, Sequence

from integration.buffers import Registrations, free_all
from integration.codes import (ERR_ADDRESS_NOT_REGISTERED, ERR_ADDRESS_OVERLAPPED, ERR_CONTEXT,  # noqa: F401
                               ERR_DEVICE_NOT_FOUND, ERR_DNS, ERR_ENDPOINT, ERR_INTERNAL, ERR_INVALID_ARGUMENT,
                               ERR_METADATA, ERR_NOT_IMPLEMENTED, ERR_REMOTE_REJECTED, ERR_SOCKET, ERR_TIMEOUT,
                               ERR_TRANSFER, Read, TransferNotify, TransferOpcode, Write, error_code, error_name,
                               fail, log)
from integration.cuda import pointer_device  # noqa: F401 — part of this module's names
from integration.hosts import (PROTOCOLS, filter_topology, force_tcp, normalize_session, rails_topology, rpc_port,
                               split_hostname, verbs_usable)
from integration.metadata import NotSupported, SegmentDirectory, choose_server
from integration.transfers import AsyncBatches, TransferCalls, read_base_timeout
from transport.config import EngineConfig
from transport.errors import AuthError, InvalidTransfer, UnknownSession

__all__ = ["TransferEngine", "TransferOpcode", "error_code", "error_name", "normalize_session",
           "ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_DEVICE_NOT_FOUND", "ERR_ADDRESS_OVERLAPPED",
           "ERR_DNS", "ERR_SOCKET", "ERR_METADATA", "TransferNotify", "Read", "Write", "force_tcp", "ERR_ENDPOINT",
           "ERR_CONTEXT", "ERR_NOT_IMPLEMENTED", "ERR_REMOTE_REJECTED", "ERR_TIMEOUT", "ERR_TRANSFER",
           "ERR_INTERNAL"]


SWITCH_INTERVAL = 0.0005
"""Seconds: the interpreter's switch interval ``initialize`` sets for the process unless the caller chose one
(``switch_interval=`` or ``PXN_SWITCH_INTERVAL``). Mooncake's engine threads never wait for the interpreter; pxn's
do, and with CPython's default of 5 ms a caller thread that keeps running Python (a scheduler loop, or a script
spinning in ``while True: pass``, as Mooncake's own test target does) makes each hand-off between pxn's threads
wait up to 5 ms (benchmarks/NOTES.md, "A caller that keeps running Python")."""


def _fabric_for(protocol, env: dict):
    """(the protocol asked for, the pxn fabric for it or None): Mooncake's ``protocol``, unless ``MC_FORCE_TCP``
    or ``PXN_FABRIC`` (``env``) says otherwise."""
    proto = (protocol or "").strip().lower()
    if force_tcp():
        proto = "tcp"
    override = str(env.get("fabric", "")).strip().lower()
    if override:
        proto = override
    return proto, PROTOCOLS.get(proto)


def _close_previous(old, old_directory, directory, segment: str) -> None:
    """Close the engine a second ``initialize`` replaced (``old``, None if none) and its directory entry, which
    stays when the new engine published under the same name."""
    if old is not None:
        if old_directory is not None:
            old_directory.close(withdraw=directory is None or old_directory.segment != segment)
        old.close()


class TransferEngine(TransferCalls):
    """Mooncake's ``TransferEngine`` Python API over ``transport.TransferEngine`` (see the module docstring).

    Arguments (all optional; Mooncake's constructor takes none):
        timeout: seconds per batch; default Mooncake's rule (``MC_TRANSFER_TIMEOUT`` + 1 ns per byte).
        metadata_ttl: seconds an etcd entry outlives its engine's last keep-alive (etcd metadata mode only);
            default ``PXN_METADATA_TTL``, else 5.
        take_over_segment: with a metadata server, publish under the segment name even when another live engine
            holds it (that engine is then no longer found by the name). Default False: ``initialize`` then
            fails with ERR_METADATA and a log line naming the holder. A dead engine's entry (nothing answers at
            its session) is taken over either way.
        **engine_options: passed to ``transport.TransferEngine`` at ``initialize`` (``rails``,
            ``coalesce_bytes``, ``topology``, ...; see docs/README-engine.md).

    Every method is thread-safe; transfers from many threads run concurrently (the pxn engine is thread-safe).

    Composition: the registration calls delegate to a ``Registrations`` part and the async batch status to an
    ``AsyncBatches`` part, each owning its state; a metadata server's names live in a ``SegmentDirectory``. The
    transfer calls come from the ``TransferCalls`` mixin instead, so that a batch reaches the pxn engine without
    an extra call layer.
    """

    def __init__(self, timeout: Optional[float] = None, metadata_ttl: Optional[float] = None,
                 take_over_segment: bool = False, **engine_options):
        self._timeout = timeout
        self._metadata_ttl = metadata_ttl   # s; None: PXN_METADATA_TTL, else METADATA_TTL_DEFAULT (etcd mode)
        self._take_over = bool(take_over_segment)
        self._options = dict(engine_options)
        self._base_timeout: Optional[float] = 30.0  # MC_TRANSFER_TIMEOUT's seconds (None: PXN_TIMEOUT's default)
        self._engine = None
        self._names: tuple = ()                  # the names this engine answers to (segment name, session id)
        self._directory: Optional[SegmentDirectory] = None   # None: P2PHANDSHAKE
        self._lock = threading.Lock()            # initialize / close / registration (batch all-or-nothing)
        self._buffers = Registrations(self._lock)
        self._batches = AsyncBatches()
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
                server the whole string is this engine's segment name, published there; a name another live
                engine holds fails with ERR_METADATA naming the holder (two engines initialized as "127.0.0.1"
                on one host: the second is refused; give each its own "host:port"), unless the constructor's
                ``take_over_segment``.
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
        try:
            url, ttl = choose_server(metadata_server, metadata_type, self._metadata_ttl)
        except NotSupported as e:
            log.error("initialize: %s", e)
            return ERR_NOT_IMPLEMENTED
        except InvalidTransfer as e:
            log.error("initialize: %s", e)
            return ERR_INVALID_ARGUMENT
        try:
            # the PXN_* settings the engine itself will read, parsed and checked the same way (EngineConfig)
            env = EngineConfig.environment()
            base_timeout = read_base_timeout(env)
        except ValueError as e:
            log.error("initialize: %s", e)
            return ERR_INVALID_ARGUMENT
        proto, fabric = _fabric_for(protocol, env)
        if fabric is None:
            log.error("initialize: protocol %r has no pxn fabric (have %s)", protocol, sorted(PROTOCOLS))
            return ERR_NOT_IMPLEMENTED
        host, _ = split_hostname(local_hostname)
        if not host:
            log.error("initialize: local_hostname %r names no host", local_hostname)
            return ERR_INVALID_ARGUMENT
        names = [n for n in (device_name or "").split(",") if n.strip()]
        if proto == "rdma" and not verbs_usable():
            log.warning("initialize: protocol 'rdma' but no RDMA device is usable here: running on tcp, as "
                        "Mooncake does (pass 'verbs' to fail instead)")
            fabric = "tcp"
        segment = (local_hostname or "").strip()
        with self._lock:
            try:
                directory = SegmentDirectory(url, ttl, segment) if url else None
                eng = self._new_engine(host, fabric, names, env)
            except BaseException as e:  # noqa: BLE001 — mapped to a code and logged
                return fail(f"initialize({local_hostname!r}, protocol={protocol!r} -> {fabric}, "
                            f"device_name={device_name!r})", e)
            if directory is not None:
                # this object's previous engine may hold the name: the new one replaces it (Mooncake's second
                # initialize), as does a caller that asked to take the name over
                mine = self._directory is not None and (self._directory.url, self._directory.segment) == (url, segment)
                try:
                    directory.publish(eng, take_over=self._take_over or mine)
                except BaseException as e:  # noqa: BLE001
                    directory.close(withdraw=False)
                    eng.close()
                    return fail(f"initialize: publishing segment {segment!r} at {url}", e)
            old, old_directory = self._engine, self._directory
            if old is not None:
                log.warning("initialize: called again; the previous engine %s is closed and its registrations "
                            "dropped (as Mooncake does); now %s", old.session_id, eng.session_id)
            self._engine, self._directory, self._base_timeout = eng, directory, base_timeout
            self._names = tuple(n for n in {eng.session_id, segment, normalize_session(segment)} if n)
            managed = self._buffers.reset(eng)
        _close_previous(old, old_directory, directory, segment)
        free_all(managed)
        log.info("pxn Mooncake shim: session %s over %s (protocol %r%s)", eng.session_id, eng.fabric_name,
                 protocol, f", segment {segment!r} at {url}" if url else "")
        return 0

    def _new_engine(self, host: str, fabric: str, names: List[str], env: dict):
        """A pxn engine on ``fabric`` with this object's options, and the rails of the NICs ``names`` (verbs),
        Mooncake's switch interval and RPC port unless set otherwise."""
        options = dict(self._options)
        if fabric in ("verbs", "auto") and "topology" not in options:
            options["topology"] = rails_topology(fabric, names)
        from transport.engine import TransferEngine as PxnEngine
        if "switch_interval" not in options and "switch_interval" not in env:
            options["switch_interval"] = SWITCH_INTERVAL
        if "port" not in options:
            options["port"] = rpc_port()
        return PxnEngine(hostname=host, fabric=fabric, **options)

    # ======================================================================================================
    # the engine and the machine
    # ======================================================================================================
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
                topo = filter_topology(topo, names)
            return json.dumps(topo.to_json())
        except Exception as e:  # noqa: BLE001 — a string is the contract; the cause goes to the log and JSON
            log.warning("get_local_topology failed: %s: %s", type(e).__name__, e)
            return json.dumps({"error": f"{type(e).__name__}: {e}"})

    # ======================================================================================================
    # memory registration (the ``Registrations`` part)
    # ======================================================================================================
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``capacity`` bytes at ``buffer_addr`` as a source and as a destination for peers.

        Arguments: buffer_addr: address (int); capacity: bytes; location: "*" (detect GPU / host), "cpu:<numa>",
        "cuda:<n>". Returns 0 or a negative code, Mooncake's: ERR_ADDRESS_OVERLAPPED (-7) for a range
        overlapping a registered one, the same range registered twice included; ERR_INVALID_ARGUMENT (-1) for
        a length < 1.
        """
        return self._buffers.register_memory(buffer_addr, capacity, location)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        """Register several ranges, all or nothing: on a failure the ranges this call registered are
        deregistered again. Returns 0 or the negative code of the first failure."""
        return self._buffers.batch_register_memory(buffer_addresses, capacities, location)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Forget the range registered at ``buffer_addr``. Returns 0 or ERR_ADDRESS_NOT_REGISTERED / ..."""
        return self._buffers.unregister_memory(buffer_addr)

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Forget several ranges. Every address is tried (teardown should free what it can); returns 0 or the
        code of the first failure."""
        first = 0
        for a in list(buffer_addresses):
            code = self._buffers.unregister_memory(a)
            if code and not first:
                first = code
        return first

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate ``length`` bytes of zeroed, page-aligned host memory and register it. Returns its address,
        or 0 on failure (cause logged), as Mooncake. Free it with ``free_managed_buffer``."""
        return self._buffers.allocate_managed_buffer(length)

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Deregister and free a buffer from ``allocate_managed_buffer``. Returns 0, or ERR_INVALID_ARGUMENT
        (-1) for an address this object did not allocate (Mooncake returns 0 there and keeps the address)."""
        return self._buffers.free_managed_buffer(buffer_addr, length)

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        """Copy the first ``length`` bytes of ``src`` to host memory at ``dest_address`` (inside a registered or
        managed buffer). Returns 0, or ERR_ADDRESS_NOT_REGISTERED / ERR_INVALID_ARGUMENT with nothing written
        (Mooncake copies without a check)."""
        return self._buffers.write_bytes_to_buffer(dest_address, src, length)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of host memory at ``source_address`` (inside a registered or managed buffer), or
        b"" with the cause logged when the range is not."""
        return self._buffers.read_bytes_from_buffer(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer registered by the engine named ``segment_name`` (this one, or a
        peer: its session "host:port" in P2P mode, its segment name with a metadata server). Returns 0 when it
        has none or cannot be reached (cause logged), as Mooncake. For a peer, pxn's "first" is its lowest
        registered address; for this engine, the first still registered in registration order."""
        try:
            eng = self._eng()
            if segment_name in self._names:
                return self._buffers.first_address(eng)
            rep = self._query(segment_name, {"op": "regions"}, 5.0)
            addrs = [int(r["addr"]) for r in rep.get("regions", [])]
            return min(addrs) if addrs else 0
        except BaseException as e:  # noqa: BLE001
            fail(f"get_first_buffer_address({segment_name!r})", e)
            return 0

    # ======================================================================================================
    # notifies and async status (the ``AsyncBatches`` part)
    # ======================================================================================================
    def get_notifies(self) -> List[TransferNotify]:
        """The notifies peers sent with ``transfer_sync`` / ``batch_transfer_sync`` since the last call, oldest
        first ([] before ``initialize``)."""
        if self._engine is None:
            return []
        from transport.reads import take_notifies
        return [TransferNotify(n, m) for n, m in take_notifies(self._engine)]

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for batches submitted with ``batch_transfer_async_write``, then free their ids.

        Blocks like Mooncake's (each batch until its own deadline). Returns 0 when all succeeded, else the code
        of the first failed batch in ``batch_ids`` order (ERR_INVALID_ARGUMENT for an unknown / already freed
        id). Unlike Mooncake it waits for every batch even after a failure, so on return no listed batch still
        writes into the caller's buffers.
        """
        return self._batches.wait_all(batch_ids)

    def check_batch_transfer_status(self, batch_id: int) -> int:
        """Non-blocking status of one async batch (pxn extension, Mooncake's ``transfer_check_status`` codes).

        Returns: 1 done (id freed), 0 still in flight, a negative code when it failed or passed its deadline
        (id freed), ERR_INVALID_ARGUMENT for an unknown id.
        """
        return self._batches.check(batch_id)

    def transfer_check_status(self, batch_id: int) -> int:
        """Mooncake's single-transfer poll: 1 done, 0 in flight, negative failed (see
        ``check_batch_transfer_status``)."""
        return self._batches.check(batch_id)

    # ======================================================================================================
    # liveness
    # ======================================================================================================
    def _query(self, peer_server_name: str, msg: dict, timeout: float) -> dict:
        """One request / reply with the peer's control listener on a fresh, authenticated connection (this
        engine's secret; ``PXN_SECRET`` before ``initialize``). Raises UnknownSession (bad name, not at the
        metadata server), OSError (nothing answers; ``socket.gaierror`` for DNS), ``AuthError`` (refused),
        ConnectionError / ValueError (a bad reply)."""
        from transport.control import query
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
            directory, self._directory = self._directory, None
            managed = self._buffers.reset(None)
        if directory is not None:
            directory.close()
        if eng is not None:
            eng.close()
        free_all(managed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 — interpreter shutdown
            pass

