"""The relay engine: one object that owns every resource of pxn's data path.

``TransferEngine`` moves batches of (src, dst, length) pieces from this process's registered memory into a
peer's registered memory (another ``TransferEngine``, named by its ``session_id``):

* small pieces (< ``coalesce_bytes``) are gathered into coalesced chunks (one fabric write each) that the
  peer's receiver validates and scatters (``transport.receiver``);
* large pieces go direct (zero copy, one WRITE from the source address) when the rail is local to their
  memory, else through relay slots on the rail's relay GPU (``transport.relay``);
* work is striped over the device's rails, balanced by bytes in flight (``transport.planner``);
* a rail that fails (connection lost, completion error) has its unfinished work re-sent on another rail of the
  same device; the batch fails only when every rail failed (``TransferError.causes`` lists each cause).

Handshake (``transport.control``): the engine runs a small TCP control listener (its port is in ``session_id``).
On first use of a session the sender connects to it, sends its rail descriptors and the address / rkeys of a small credit region
(where the receiver writes acks), and receives the peer's descriptors, its landing slots for this sender and
the list of regions the peer registered. Then each rail connects (fabric connect is symmetric). The region list
is re-fetched when a destination is not covered (the peer may have registered more since).

Reconnect: when every rail to a peer has failed (the peer process died or restarted, the link dropped), the
engine forgets that peer (rails, landing-slot credits, credit region, region list, control socket); batches in
flight to it fail with every rail's cause, and the next batch to the same session id handshakes again from
scratch, with whatever engine listens at that host:port by then.

Code: this module holds the facade (construction, rails, registration, the batch API, telemetry, lifetime);
the handshake and the peer directory are ``transport.control``, the settings ``transport.config``, and the data
path, from a batch's checks to its last completion and failover, ``transport.pipeline`` (``Pipeline``, which this
class composes).

Threads: one progress thread (``transport.progress``) for the receiver's landed chunks, the posts of units
re-dispatched after a failover and, on fabrics that deliver completions by callback (tcp, ipc), whose own threads
run the completion handlers, the failed completions (in order per rail) and the rails' watchdogs; on other
fabrics (verbs) one poll loop per rail. Per (relay device, rail) ring one copy thread that fills and posts; the
control listener (one thread per control connection). The fabrics own their socket threads. ``batch_write`` is
thread-safe.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
import socket
import sys
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from transport.config import EngineConfig, parse_size
from transport.control import ControlPlane, PeerGone, UnknownSession, recv_msg, send_msg
from transport.errors import (AddressNotRegistered, FabricError, FabricUnavailable, InvalidTransfer, PeerLost,
                              RegionOverlap, TransferError)
from transport.fabric.base import DEVICE_HOST
from transport.fabric.gpu_copy import BoundCopies
from transport.packing import HostBuffer
from transport.pipeline import WATCHDOG_S, BatchHandle, Pipeline, _Attempt, _Batch, batch_timeout
from transport.planner import COALESCED, DIRECT, RELAYED, Planner, RailChoice
from transport.progress import ProgressLoop
from transport.receiver import Receiver
from transport.regions import Region, RegionTable
from transport.relay import RelayRing
from transport.telemetry import Counters, LatencyWindow, Trace

log = logging.getLogger(__name__)

__all__ = ["TransferEngine", "UnknownSession", "BatchHandle"]


# the control framing, re-exported for callers that speak to an engine's control port (the Mooncake shim's probe)
_send_msg, _recv_msg = send_msg, recv_msg


_size = parse_size  # sizes like "64K" (kept under this name for callers of the engine module)


def _rail_local_gpus(routes, rail_keys: List[str]) -> List[Optional[int]]:
    """Per rail (NIC port key): the GPU whose direct rail it is, i.e. the GPU next to that NIC, or None."""
    local: Dict[str, int] = {}
    for g in routes.gpus:
        for r in routes.rails(g):
            if r.relay_gpu == g and r.kind == "direct":
                local.setdefault(r.key, g)
    return [local.get(k) for k in rail_keys]


def _check_topology_gpus(routes) -> None:
    """Refuse, at construction, a topology whose routes need a GPU this process cannot see or a relay pair
    without peer access: found later, either is an illegal address inside a kernel. On a host without CUDA the
    engine moves host memory only and never takes a GPU route, so there is nothing to check."""
    try:
        import torch
        if not torch.cuda.is_available():
            return
        visible = torch.cuda.device_count()
    except ImportError:
        return
    from pxn_kernels.peer_access import can_access_peer
    from transport.topology import TopologyError
    for g in routes.gpus:
        for r in routes.rails(g):
            for dev in (g, r.relay_gpu):
                if not 0 <= dev < visible:
                    raise TopologyError(f"topology routes GPU {g} through GPU {r.relay_gpu} (rail {r.key}), but "
                                        f"this process sees {visible} CUDA device(s): GPU {dev} is not visible "
                                        f"(CUDA_VISIBLE_DEVICES?)")
            if r.relay_gpu != g and not can_access_peer(r.relay_gpu, g):
                raise TopologyError(f"topology relays GPU {g}'s data through GPU {r.relay_gpu} (rail {r.key}), "
                                    f"but GPU {r.relay_gpu} cannot access GPU {g}'s memory (no peer access); "
                                    f"give a topology without this relay or connect the GPUs by NVLink")


class _PeerRail:
    """This engine's view of one rail to one peer: endpoint, landing-slot credits, work in flight."""

    def __init__(self, rail: int, ep, remote_id: str, landing_addr: int, landing_rkey: int, slots: int,
                 slot_bytes: int, peer: Optional["_Peer"] = None):
        self.rail = rail
        self.peer = peer  # the peer incarnation this rail belongs to (the one to forget when every rail is dead)
        self.ep = ep
        self.remote_id = remote_id
        self.landing_addr = landing_addr
        self.landing_rkey = landing_rkey
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.free_landing = list(range(slots))[::-1]
        self.landing_owner: Dict[int, _Attempt] = {}
        self.cv = threading.Condition()
        self.inflight: set = set()
        self.alive = True
        self.cause: Optional[BaseException] = None
        self.bytes_in_flight = 0

    def usable(self) -> bool:
        return self.alive and self.ep.alive


class _Peer:
    """One incarnation of a connection to a session: made at the handshake, forgotten (``retired``) when every
    rail failed. A later batch to the same session builds a new ``_Peer``; batches still holding this one fail
    with its rails' causes."""

    def __init__(self, session: str):
        self.session = session
        self.lock = threading.Lock()  # handshake and control socket
        self.ready = False
        self.retired = False
        self.lost_work = False  # a rail failed with work in flight (the forget is then worth a warning)
        self.error: Optional[BaseException] = None  # why its handshake failed (shared with callers that waited)
        self.engine_id = 0
        self.rails: List[_PeerRail] = []
        self.regions = RegionTable()
        self.ctrl: Optional[socket.socket] = None
        self.credit: Optional[HostBuffer] = None
        self.credit_mrs: List = []
        self.seq = itertools.count(1)
        self.landing_device = DEVICE_HOST
        self.forward: Optional[Dict[int, int]] = None  # rail -> the peer's landing GPU, where it forwards
        self.loadstore = None  # rail 0's local writer for a same-host peer (the ipc fabric's load/store path)

    def connected(self) -> bool:
        # a plain loop: called twice per batch, and any(<genexpr>) costs more (benchmarks/NOTES.md, "Engine")
        for pr in self.rails:
            if pr.alive and pr.ep.alive:
                return True
        return False


def _plain(value):
    """``value`` with every numpy scalar inside it as the Python number it holds, so that ``stats()`` compares,
    formats and serialises like plain data."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        items = [_plain(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if type(value) not in (int, float, str, bool, type(None)) and hasattr(value, "item"):
        return value.item()  # numpy scalar -> int / float / bool
    return value


class TransferEngine(Pipeline):
    """Moves batches of pieces into a peer engine's registered memory (see the module docstring).

    Arguments (each falls back to a ``PXN_*`` environment variable, then to a default; read once into the frozen
    ``self.config``, a ``transport.config.EngineConfig``):
        hostname: address to listen on and to advertise (default "127.0.0.1").
        port: TCP port of the control listener, i.e. the port in ``session_id`` (default 0: any free port). A
            fixed port lets a restarted process come back under the same session id, which senders reconnect to.
        fabric: "auto" (verbs when an RDMA device is usable, else tcp) | "tcp" | "ipc" | "verbs"
            (``PXN_FABRIC``).
        topology: a ``transport.topology.Topology`` (e.g. ``transport.topology.discover()``); its usable NIC
            ports become the rails and ``transport.routing.plan_routes`` says which rail is local to which GPU.
            None: a trivial topology, ``rails`` fabric instances, local to every device.
        rails: rail count for the trivial topology (``PXN_RAILS``, default 2).
        coalesce_bytes: pieces below this are coalesced into chunks (``PXN_COALESCE_BYTES``, default 64 KiB;
            0 on the ipc fabric, whose batched writes need no chunks: ``Fabric.config_defaults``).
        direct_pieces: a batch with at most this many small pieces of host memory on a device writes them direct
            instead of through a chunk (``PXN_DIRECT_PIECES``; default 0, tcp 64: ``Fabric.config_defaults``).
        relay_slot_bytes: relay / landing slot size = largest chunk and relayed piece (``PXN_RELAY_SLOT_BYTES``,
            default 4 MiB: on tcp, 64 KB pieces coalesce much faster into 4 MiB chunks than into 1 MiB ones;
            benchmarks/NOTES.md, "Engine").
        relay_slots: slots per lane (``PXN_RELAY_SLOTS``, default 8). lanes: lanes per ring (``PXN_LANES``, 2).
        landing_slots: landing slots per peer and rail = chunk credits (``PXN_LANDING_SLOTS``, default 16).
        stripe_bytes: direct pieces above this are split across rails (``PXN_STRIPE_BYTES``, default 16 MiB).
        relay: "auto" | "always" | "never" (``PXN_RELAY``): force large pieces through relay slots or direct.
        landing_device: device of landing slots (-1 host); None: the first CUDA device with a registered region
            at handshake time, else host.
        timeout: default batch timeout in seconds (``PXN_TIMEOUT``, default 120).
        trace_path: write a Chrome trace JSON there at close (``PXN_TRACE``).
        fabric_options: extra keyword arguments for ``make_fabric`` (tcp defaults to 2 connections per rail, ipc
            to 256 MiB messages).
        switch_interval: if set, ``sys.setswitchinterval`` for the whole process (``PXN_SWITCH_INTERVAL``), e.g.
            0.0002: the engine's threads hand work to each other, and the default 5 ms GIL interval can stall
            each hand-off while another thread runs Python.
        forward_large: receive-side PXN for large pieces too (``PXN_FORWARD_LARGE``, default off): with a
            topology, chunks of small pieces always land on the GPU next to the rail's NIC and are forwarded over
            NVLink; with this on, senders also send large pieces for this engine's other GPUs through those
            landing slots instead of writing them straight to their destination. Off by default because the
            receiver's Python work per forwarded chunk then bounds these pieces below what a NIC's write across
            PCIe reaches (benchmarks/NOTES.md, "The message path on two GPUs").
        loadstore: on the ipc fabric, write batches between GPU memories (and between host memories) straight
            from the caller's thread with one copy launch, skipping the message path (``PXN_LOADSTORE``,
            default on; see ``transport.fabric.loadstore``).
        secret: shared secret (str or bytes, at least 16 bytes) every control and rail connection proves by HMAC
            challenge-response, bound to the connection's two ends, before anything is allocated or answered; every
            later message carries a tag under a key derived from it (``PXN_SECRET``; ``transport.auth``). Both ends
            need the same one. Unset: on a loopback ``hostname`` the per-user secret file (``PXN_SECRET_FILE``,
            default ``~/.config/pxn/secret``, mode 0600), which every process of this user on this host shares;
            on any other address the engine refuses to start (``transport.auth.InsecureConfig``) unless
            ``insecure``. ``secret=''`` while ``PXN_SECRET`` is set is refused, never a silent override.
        insecure: allow running without a shared secret when none is set (``PXN_INSECURE=1``; default off): no
            authentication at all, one warning per process, and one at start naming the exposed host and ports.
        max_senders: senders this engine keeps landing slots for at once (``PXN_MAX_SENDERS``, default 256); a
            hello beyond it is refused (a sender saying hello again keeps its place).
        handshake_timeout: seconds an incoming control or rail connection has to authenticate
            (``PXN_HANDSHAKE_TIMEOUT``, default 5).
        max_conns_per_addr: authenticated control connections per source address (``PXN_MAX_CONNS_PER_ADDR``,
            default 64).
    """

    def __init__(self, hostname: str = "127.0.0.1", fabric: Optional[str] = None, topology=None,
                 rails: Optional[int] = None, port: int = 0, coalesce_bytes=None, relay_slot_bytes=None,
                 relay_slots: Optional[int] = None, lanes: Optional[int] = None,
                 landing_slots: Optional[int] = None, stripe_bytes=None, relay: Optional[str] = None,
                 landing_device: Optional[int] = None, timeout: Optional[float] = None,
                 trace_path: Optional[str] = None, fabric_options: Optional[dict] = None,
                 switch_interval: Optional[float] = None, loadstore: Optional[bool] = None, secret=None,
                 max_senders: Optional[int] = None, handshake_timeout: Optional[float] = None,
                 max_conns_per_addr: Optional[int] = None, forward_large: Optional[bool] = None,
                 direct_pieces: Optional[int] = None, insecure: Optional[bool] = None):
        self.hostname = hostname
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
        # arguments first, then PXN_* variables, then defaults: read once, checked as a whole (transport.config)
        given = dict(
            fabric=fabric, rails=rails, coalesce_bytes=coalesce_bytes, direct_pieces=direct_pieces,
            relay_slot_bytes=relay_slot_bytes,
            relay_slots=relay_slots, lanes=lanes, landing_slots=landing_slots, stripe_bytes=stripe_bytes,
            relay=relay, timeout=timeout, trace_path=trace_path, switch_interval=switch_interval,
            loadstore=loadstore, forward_large=forward_large, max_senders=max_senders,
            handshake_timeout=handshake_timeout, max_conns_per_addr=max_conns_per_addr)
        environ = dict(os.environ)  # one reading of the environment for both passes below
        cfg = EngineConfig.from_env(environ, **given)
        from transport.fabric import fabric_class, make_fabric
        self.fabric_name = self._pick_fabric(cfg.fabric)
        fabric_cls = fabric_class(self.fabric_name)
        if fabric_cls.config_defaults:
            # the fabric's own defaults (ipc: no coalescing, large relay slots); arguments and PXN_* variables
            # still win
            cfg = EngineConfig.from_env(environ, defaults=fabric_cls.config_defaults, **given)
        self.config = cfg
        from transport.auth import Resolved, resolve_secret
        self._secret = resolve_secret(secret, hostname, insecure, environ)
        self.max_senders = cfg.max_senders
        self.handshake_timeout = cfg.handshake_timeout
        max_conns_per_addr = cfg.max_conns_per_addr
        if cfg.switch_interval:
            # process-wide: how long a thread that released the GIL (socket / CUDA wait) may wait to get it
            # back while another thread runs Python; the default 5 ms stalls every hand-off of the pipeline
            sys.setswitchinterval(float(cfg.switch_interval))
        self.coalesce_bytes = cfg.coalesce_bytes
        self.slot_bytes = cfg.relay_slot_bytes
        self.relay_slots = cfg.relay_slots
        self.lanes = cfg.lanes
        self.landing_slots = cfg.landing_slots
        self.stripe_bytes = cfg.stripe_bytes
        self.relay_mode = cfg.relay
        self.default_timeout = float(cfg.timeout)
        self.landing_device = landing_device
        self.use_loadstore = cfg.loadstore
        self.forward_large = cfg.forward_large
        # Bumped by every deregister; same-host peers writing by load/store read it before each batch.
        from transport.fabric.region_counter import GenerationCounter
        self._region_gen = GenerationCounter()
        trace_path = cfg.trace_path
        self.direct_pieces = cfg.direct_pieces
        self.planner = Planner(self.coalesce_bytes, self.slot_bytes, self.stripe_bytes, self.slot_bytes,
                               self.relay_mode, self.direct_pieces)
        self.engine_id = secrets.randbits(63) | 1
        self.trace = Trace(trace_path) if trace_path else None
        self.counters = Counters()
        self.latency = LatencyWindow()
        self._closed = False
        self._lock = threading.RLock()  # attempt state, peers
        self._wr_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._inflight: Dict[int, _Attempt] = {}
        self._peers: Dict[str, _Peer] = {}
        self._by_remote_rail: Dict[str, Tuple[_Peer, _PeerRail]] = {}
        self._lost: Dict[str, str] = {}  # session -> why its last connection was forgotten (for error messages)
        self._regions = RegionTable()
        self._rings: Dict[Tuple[int, int], RelayRing] = {}
        self._relay_copies = BoundCopies()  # GPU relay fills: plans by lengths, bound launches, per ring thread
        self._rail_stats = []
        self._rail_gpu: List[Optional[int]] = []  # per rail: the GPU its NIC is local to (topology), else None

        # --- rails -------------------------------------------------------------------------------------------
        options = dict(fabric_options or {})
        self.routes = None
        rail_specs: List[dict] = []
        if topology is not None:
            from transport.routing import plan_routes
            self.routes = plan_routes(topology)
            ports = list(topology.usable_ports())
            if not ports:
                raise FabricUnavailable("topology has no usable NIC port; pass topology=None for loopback rails")
            self._rail_keys = [p.key for p in ports]
            rail_specs = [{"device": p.name, "port_num": p.port} for p in ports]
            self._rail_gpu = _rail_local_gpus(self.routes, self._rail_keys)
            _check_topology_gpus(self.routes)
        else:
            n = cfg.rails
            self._rail_keys = [f"rail{i}" for i in range(n)]
            self._rail_gpu = [None] * n
            rail_specs = [{} for _ in range(n)]
        options = {**fabric_cls.engine_options, **options}
        self._selective = fabric_cls.capabilities.selective_signaling
        self._batches = fabric_cls.capabilities.write_batches
        # a batch that goes whole as one direct unit, or relayed whole, is written by the caller's thread
        # (Fabric.write_inline; Pipeline._write_inline)
        self._inline = fabric_cls.capabilities.inline_writes
        self._spans_memo = {}  # Pipeline._region_spans: the regions of batches over several regions, by layout
        self._spans_lock = threading.Lock()
        # small batches as one WriteRows post, checked in Python (transport.smallbatch)
        self._rows = fabric_cls.capabilities.write_rows and self.direct_pieces > 0
        options["secret"] = Resolved(self._secret)  # resolved once here: the fabrics do not read PXN_SECRET again
        if fabric_cls.capabilities.authenticated_rails:
            # an incoming rail must have been announced by an authenticated control hello (receiver.accept_sender)
            options.setdefault("handshake_timeout", self.handshake_timeout)
            options.setdefault("guard_claims", True)
        self.fabrics = []
        try:
            for spec in rail_specs:
                opts = dict(options)
                if fabric_cls.capabilities.nic_ports:
                    opts.update(spec)  # the rail's NIC device and port
                self.fabrics.append(make_fabric(self.fabric_name, hostname=hostname, **opts))
            self._rail_stats = [Counters() for _ in self.fabrics]
            # the engine's one progress thread: landed chunks, failed completions, re-dispatched posts, watchdogs
            self._progress = ProgressLoop("pxn-progress")
            self.receiver = Receiver(self.fabrics, self._regions, self.landing_slots, self.slot_bytes,
                                     self.counters, self.trace, max_senders=self.max_senders, progress=self._progress)
            for rail in range(len(self.fabrics)):
                self._ring(DEVICE_HOST, rail)
            self._control = ControlPlane(self, hostname, port, _Peer, _PeerRail, secret=self._secret,
                                         handshake_timeout=self.handshake_timeout,
                                         max_conns_per_addr=max_conns_per_addr)
        except BaseException:
            self._teardown()
            raise
        self.port = self._control.port
        self.session_id = f"{hostname}:{self.port}"
        self._threads: List[threading.Thread] = [self._control.start()]
        # completions handled in the fabric thread that sees them (one thread hand-off fewer per write and per
        # chunk), failed ones in the progress loop, which also runs the watchdogs; else a poll loop per rail
        self._by_callback = fabric_cls.capabilities.completion_callback
        if self._by_callback:
            self._deferring = [0] * len(self.fabrics)  # per rail: lists queued in the progress loop, not handled
            self._defer_lock = threading.Lock()
            for rail, fab in enumerate(self.fabrics):
                fab.set_completion_handler(functools.partial(self._on_completions, rail))
            self._progress.every(WATCHDOG_S, self._watchdogs)
        else:
            for rail in range(len(self.fabrics)):
                t = threading.Thread(target=self._poll_loop, args=(rail,), name=f"pxn-poll-rail{rail}", daemon=True)
                t.start()
                self._threads.append(t)
        if self._secret is None:
            # insecure=True / PXN_INSECURE=1: transport.auth warned once for the process; the ports go to INFO
            ports = [str(getattr(f, "port", "?")) for f in self.fabrics]
            log.info("pxn engine %s: no shared secret (insecure): any process that can reach %s may write into "
                     "this engine's registered memory through control port %d and %s rail port(s) %s",
                     self.session_id, hostname, self.port, self.fabric_name, ", ".join(ports))
        log.info("pxn engine %s: fabric %s, %d rail(s), coalesce < %d B, slots %d x %d x %d B",
                 self.session_id, self.fabric_name, len(self.fabrics), self.coalesce_bytes, self.lanes,
                 self.relay_slots, self.slot_bytes)

    # ========================================================================================================
    # configuration helpers
    # ========================================================================================================
    @staticmethod
    def _pick_fabric(name: str) -> str:
        if name not in ("auto", "tcp", "ipc", "verbs"):
            raise ValueError(f"fabric must be 'auto', 'tcp', 'ipc' or 'verbs', got {name!r}")
        if name != "auto":
            return name
        from transport.fabric.verbs import usable_port
        try:
            usable_port()
        except FabricUnavailable as e:  # no pyverbs, no device, no port with a GID: tcp is the fallback
            log.info("fabric 'auto' is tcp: %s", e)
            return "tcp"
        return "verbs"

    @property
    def rails(self) -> int:
        return len(self.fabrics)

    def _rail_choices(self, device: int, peer: _Peer) -> List[RailChoice]:
        """Usable rails for data on ``device`` to ``peer``, best first."""
        out = []
        if self.routes is not None and device >= 0:
            for r in self.routes.rails(device):
                idx = self._rail_keys.index(r.key) if r.key in self._rail_keys else -1
                if idx >= 0 and peer.rails[idx].usable():
                    out.append(RailChoice(idx, r.relay_gpu == device, r.relay_gpu))
            return out
        for i, pr in enumerate(peer.rails):
            if pr.usable():
                out.append(RailChoice(i, True, device))
        return out

    def _ring(self, device: int, rail: int) -> RelayRing:
        key = (device, rail)
        ring = self._rings.get(key)
        if ring is None:
            with self._lock:
                ring = self._rings.get(key)
                if ring is None:
                    name = f"{'host' if device < 0 else f'cuda{device}'}/rail{rail}"
                    ring = RelayRing(name, self.fabrics[rail], device, self.lanes, self.relay_slots,
                                     self.slot_bytes, self._fill, self._post, self.trace)
                    self._rings[key] = ring
        return ring

    # ========================================================================================================
    # registration
    # ========================================================================================================
    @staticmethod
    def _describe(obj, length: Optional[int], device: Optional[int]) -> Tuple[int, int, int]:
        if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):  # torch tensor
            if not obj.is_contiguous():
                raise InvalidTransfer(f"register: tensor of shape {tuple(obj.shape)} is not contiguous")
            addr = obj.data_ptr()
            nbytes = obj.numel() * obj.element_size()
            dev = obj.device.index if obj.device.type == "cuda" else DEVICE_HOST
            if dev is None:
                dev = 0
            return addr, (nbytes if length is None else int(length)), dev
        if hasattr(obj, "__array_interface__"):  # numpy array
            addr = obj.__array_interface__["data"][0]
            return addr, (obj.nbytes if length is None else int(length)), DEVICE_HOST
        if isinstance(obj, bool) or not isinstance(obj, int):
            raise InvalidTransfer(f"register: expected a tensor, array or int address, got {type(obj).__name__}")
        if length is None:
            raise InvalidTransfer(f"register: a raw address 0x{obj:x} needs length=")
        return obj, int(length), DEVICE_HOST if device is None else int(device)

    def register(self, tensor_or_ptr, length: Optional[int] = None, device: Optional[int] = None) -> Region:
        """Register memory as a valid source (for this engine's writes) and destination (for peers' writes).

        Arguments:
            tensor_or_ptr: a contiguous torch tensor, a numpy array, or a raw address (int).
            length: bytes (required for a raw address; default: the whole tensor / array).
            device: for a raw address: -1 host (default) or the CUDA device index.
        Returns:
            the ``Region`` (addr, length, device, per-rail keys). Registering the same range again returns it.
        Raises:
            InvalidTransfer for a bad length / address / overlapping range; FabricError when a rail refuses.
        """
        self._check_open()
        addr, nbytes, dev = self._describe(tensor_or_ptr, length, device)
        if nbytes <= 0 or addr <= 0:
            raise InvalidTransfer(f"register: address 0x{addr:x} length {nbytes}: need a positive address and "
                                  f"length")
        existing = self._regions.find(addr, nbytes)
        if existing is not None and existing.addr == addr and existing.length == nbytes:
            return existing
        mrs = []
        try:
            for fab in self.fabrics:
                mrs.append(fab.register(addr, nbytes, dev))
            region = Region(addr, nbytes, dev, tuple(mrs))
            return self._regions.add(region)
        except ValueError as e:  # the region table refuses an overlapping range
            for fab, mr in zip(self.fabrics, mrs):
                fab.deregister(mr)
            raise RegionOverlap(f"register 0x{addr:x}+{nbytes}: {e}") from e
        except BaseException:
            for fab, mr in zip(self.fabrics, mrs):
                fab.deregister(mr)
            raise

    def deregister(self, tensor_or_ptr) -> None:
        """Forget a region (tensor, array, address, or the Region ``register`` returned); peers learn it at their
        next region refresh, and their writes into it are refused meanwhile. Unknown: ``InvalidTransfer``."""
        self._check_open()
        addr = tensor_or_ptr.addr if isinstance(tensor_or_ptr, Region) else \
            self._describe(tensor_or_ptr, 1, None)[0]
        try:
            region = self._regions.remove(addr)
        except KeyError as e:
            raise AddressNotRegistered(f"deregister: {e.args[0]}") from None
        self._region_gen.bump()
        for fab, mr in zip(self.fabrics, region.keys):
            try:
                fab.deregister(mr)
            except FabricError as e:
                log.warning("deregister 0x%x on %s: %s", addr, fab.local_id, e)

    def regions(self) -> List[Region]:
        """The regions registered here, by address."""
        return self._regions.regions()

    def find_region(self, addr: int, length: int) -> Optional[Region]:
        """The registered region that the ``length`` bytes at ``addr`` overlap, or None."""
        return self._regions.find(addr, length)

    def open_session(self, session_id: str) -> None:
        """Connect to ``session_id`` now (handshake and region exchange) unless connected already, as Mooncake's
        ``openSegment``. Raises ``UnknownSession`` naming why nobody answers there."""
        self._check_open()
        self._peer(session_id)

    @property
    def credentials(self):
        """The engine's resolved secret (``transport.auth.Resolved``; its repr hides the key), for clients that
        talk to peers on the engine's behalf (the Mooncake layer's metadata and RPC queries)."""
        from transport.auth import Resolved
        return Resolved(self._secret)

    # ========================================================================================================
    # handshake
    # ========================================================================================================
    def _landing_devices(self) -> List[int]:
        """Per rail, where a new sender's landing slots go: ``landing_device`` when given; else, when this
        engine registered GPU memory, the GPU next to the rail's NIC (receive-side PXN: chunks land there and
        the receiver forwards them over NVLink to GPUs without a NIC) or, without a topology, the first GPU
        holding a registered region; host memory otherwise."""
        if self.landing_device is not None:
            return [self.landing_device] * len(self.fabrics)
        devs = sorted({r.device for r in self._regions.regions() if r.device >= 0})
        if not devs:
            return [DEVICE_HOST] * len(self.fabrics)
        return [devs[0] if g is None else g for g in self._rail_gpu]

    # The control plane lives in transport.control; these are the engine's entry points to it. The control plane
    # reports a dead or replaced peer (PeerGone) and the engine decides: it forgets the peer (failover state).
    def _peer(self, session_id: str) -> _Peer:
        """The connected peer of ``session_id``, handshaking first when there is none. Raises UnknownSession
        naming why the handshake failed."""
        while True:
            try:
                return self._control.peer(session_id)
            except PeerGone as e:
                # every endpoint died while nothing was in flight to notice (the peer restarted while idle): fail
                # the rails now so the peer is forgotten, then handshake again
                self._fail_peer(e.peer, None)

    def _refresh_regions(self, peer: _Peer) -> None:
        """Fetch the peer's region list again; when nobody (or a different engine) answers at its session any
        more the peer is forgotten. Raises TransferError naming the cause."""
        try:
            self._control.refresh_regions(peer)
        except PeerGone as e:
            gone = e.cause or e
            self._fail_peer(peer, PeerLost(f"control connection to {peer.session}: {gone}"))
            raise TransferError(f"cannot refresh the region list of {peer.session}: {gone}; forgot the peer, the "
                                f"next batch to it handshakes again", [gone]) from None

    @staticmethod
    def _close_ctrl_locked(peer: _Peer) -> None:
        ControlPlane.close_ctrl_locked(peer)

    # ========================================================================================================
    # batch API
    # ========================================================================================================
    def batch_write(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int],
                    timeout: Optional[float] = None) -> None:
        """Write ``lengths[i]`` bytes from local ``srcs[i]`` to ``dsts[i]`` in the peer's memory, for every i.

        Arguments:
            session_id: the peer engine's ``session_id`` ("host:port").
            srcs: source addresses, each piece inside a region registered here (GPU or host). GPU sources are
                read after the work this thread queued on their GPU's current stream (a producer such as
                ``t.copy_(x)`` needs no synchronise before the call).
            dsts: destination addresses, each piece inside a region the peer registered.
            lengths: bytes per piece (>= 1).
            timeout: seconds > 0 (default: the engine's ``timeout``).
        Returns:
            None, once every byte is placed at the peer.
        Raises:
            InvalidTransfer (nothing written): a timeout that is not a number > 0, mismatched lists, bad length,
            unregistered source, destination outside the peer's regions; UnknownSession (nothing written); RemoteRejected: the peer refused a chunk
            or write; TransferTimeout; TransferError with ``causes`` when every rail failed.
        """
        timeout = batch_timeout(timeout, self.default_timeout)
        batch = self._submit(session_id, srcs, dsts, lengths)
        if batch is not None:
            self._wait(batch, timeout)

    def batch_write_async(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                          lengths: Sequence[int], timeout: Optional[float] = None) -> BatchHandle:
        """As ``batch_write`` but returns at once with a ``BatchHandle`` (``wait(timeout)``, ``done()``).
        Validation errors are raised here, before anything is posted. GPU sources: the load/store and inline
        paths queue their copies behind this thread's work on the sources' current stream and return; the posted
        path (chunks, posted relays, fabrics that read from other threads) first waits for that work."""
        timeout = batch_timeout(timeout, self.default_timeout)
        batch = self._submit(session_id, srcs, dsts, lengths, async_=True)
        if batch is None:
            batch = _Batch(0, None, None, None, [], 0)
            batch.event.set()
        return BatchHandle(self, batch, timeout)

    def batch_read(self, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
                   lengths: Sequence[int], timeout: Optional[float] = None) -> None:
        """Read ``lengths[i]`` bytes from ``remote_srcs[i]`` in the peer's memory into local ``local_dsts[i]``.

        The peer gathers the pieces and writes them back with its own ``batch_write`` (small ones coalesced into
        chunks), see ``transport.reads``. Arguments: session_id: the peer's "host:port"; local_dsts: addresses
        inside regions registered here; remote_srcs: addresses inside regions the peer registered; lengths:
        bytes (>= 1); timeout: seconds (default: the engine's ``timeout``).
        Returns: None, once every byte is in local memory.
        Raises: InvalidTransfer (nothing written) for malformed lists, a local destination outside this
        engine's regions or a source outside the peer's; UnknownSession; TransferTimeout; TransferError.
        """
        from transport.reads import batch_read
        batch_read(self, session_id, local_dsts, remote_srcs, lengths, timeout)

    def batch_read_async(self, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
                         lengths: Sequence[int], timeout: Optional[float] = None):
        """As ``batch_read`` but returns at once with a handle (``wait(timeout)``, ``done()``), like
        ``batch_write_async``. Argument errors and local destinations are checked here, before anything is sent."""
        from transport.reads import batch_read_async
        return batch_read_async(self, session_id, local_dsts, remote_srcs, lengths, timeout)

    def write_tensors(self, session_id: str, pairs: Iterable[Tuple[object, int]],
                      timeout: Optional[float] = None) -> None:
        """Write whole contiguous tensors: ``pairs`` of (src tensor inside a registered region, dst address)."""
        srcs, dsts, lengths = [], [], []
        for t, dst in pairs:
            if not t.is_contiguous():
                raise InvalidTransfer(f"write_tensors: tensor of shape {tuple(t.shape)} is not contiguous")
            srcs.append(t.data_ptr())
            dsts.append(int(dst))
            lengths.append(t.numel() * t.element_size())
        self.batch_write(session_id, srcs, dsts, lengths, timeout)

    def rail_endpoint(self, session_id: str, rail: int):
        """The fabric endpoint of ``rail`` to a connected peer (diagnostics, failover tests)."""
        peer = self._peer(session_id)
        return peer.rails[rail].ep

    # ========================================================================================================
    # telemetry
    # ========================================================================================================
    def stats(self) -> dict:
        """Where the time and bytes went: see docs/README-engine.md for every field."""
        c = self.counters.to_dict()
        rails = []
        for i, fab in enumerate(self.fabrics):
            d = self._rail_stats[i].to_dict()
            d.update({"rail": i, "key": self._rail_keys[i], "id": fab.local_id,
                      "peers_alive": sum(1 for p in list(self._peers.values())
                                         if p.ready and p.rails[i].usable())})
            wire = fab.wire_counts()
            if wire is not None:
                d["wire"] = wire
            rails.append(d)
        paths = {k: {"units": c.get(f"path_{k}_units", 0), "bytes": c.get(f"path_{k}_bytes", 0)}
                 for k in (DIRECT, RELAYED, COALESCED, "loadstore")}
        paths[COALESCED].update({"chunks": c.get("chunks", 0), "items": c.get("chunk_items", 0),
                                 "wire_bytes": c.get("chunk_wire_bytes", 0)})
        time_s = {k[len("time_"):-2]: v for k, v in c.items() if k.startswith("time_")}
        receiver = {k[3:]: v for k, v in c.items() if k.startswith("rx_")}
        receiver.update(self.receiver.stats())
        return _plain({
            "engine": {"session_id": self.session_id, "fabric": self.fabric_name, "rails": len(self.fabrics),
                       "coalesce_bytes": self.coalesce_bytes, "relay_slot_bytes": self.slot_bytes,
                       "relay_slots": self.relay_slots, "lanes": self.lanes, "landing_slots": self.landing_slots,
                       "stripe_bytes": self.stripe_bytes, "relay": self.relay_mode},
            "batches": {"submitted": c.get("batches_submitted", 0), "ok": c.get("batches_ok", 0),
                        "failed": c.get("batches_failed", 0), "items": c.get("items", 0),
                        "bytes": c.get("bytes", 0), "latency": self.latency.summary()},
            "paths": paths,
            "time_s": time_s,
            "rails": rails,
            "rings": {ring.name: ring.stats() for ring in list(self._rings.values())},
            "receiver": receiver,
            "failover": {"rail_failures": c.get("rail_failures", 0), "redispatched_units": c.get("failovers", 0),
                         "peers_lost": c.get("peers_lost", 0), "reconnects": c.get("reconnects", 0),
                         "ctrl_reconnects": c.get("ctrl_reconnects", 0)},
            "credits": {"waits": c.get("credit_waits", 0), "wait_s": c.get("time_wait_credit_s", 0)},
            "handshake_s": c.get("handshake_s", 0),
            "security": self._security_stats(c),
        })

    def _security_stats(self, c: dict) -> dict:
        """Incoming connections refused (by cause) on the control port and each rail, and senders refused."""
        ctrl = self._control.gate.stats()
        rails = [f.admission_stats() for f in self.fabrics if hasattr(f, "admission_stats")]
        senders = {"refused_max_senders": c.get("senders_refused_max", 0),
                   "refused_rail_claims": c.get("senders_refused_claim", 0)}
        refused = ctrl["refused"] + sum(r["refused"] for r in rails) + sum(senders.values())
        return {"authenticated": self._secret is not None, "refused": refused, "control": ctrl, "rails": rails,
                **senders}

    # ========================================================================================================
    # lifetime
    # ========================================================================================================
    def close(self) -> None:
        """Stop every thread, close the fabrics, release all memory; write the trace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._control.close()
        from transport.reads import close_state
        close_state(self)
        with self._lock:
            pending = list(self._inflight.values())
        for a in pending:
            self._fail_batch(a.batch, TransferError(f"engine {self.session_id} closed"))
        self._teardown()
        for t in getattr(self, "_threads", []):
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        if self.trace is not None:
            self.trace.write()

    def _teardown(self) -> None:
        progress = getattr(self, "_progress", None)
        if progress is not None:
            progress.close()  # first: the receiver's chunks are handled there
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            receiver.close()
        for ring in list(getattr(self, "_rings", {}).values()):
            ring.close()
        for peer in list(getattr(self, "_peers", {}).values()):
            if peer.loadstore is not None:
                peer.loadstore.close()
            if peer.ctrl is not None:
                try:
                    peer.ctrl.close()
                except OSError:
                    pass
        for fab in getattr(self, "fabrics", []):
            try:
                fab.close()
            except Exception:  # noqa: BLE001
                log.exception("closing fabric failed")
        gen = getattr(self, "_region_gen", None)
        if gen is not None:
            gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass
