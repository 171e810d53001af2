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
On first use of a session the sender connects to it, sends its rail descriptors and the address / rkeys of a
small credit region (where the receiver writes acks and grants), and receives the peer's descriptors, its
landing pool (shared by every sender, lent as credits on demand: ``transport.receiver``) and the list of regions
the peer registered. Then each rail connects (fabric connect is symmetric). The region list is re-fetched when a
destination is not covered (the peer may have registered more since).

Reconnect: when every rail to a peer has failed (the peer process died or restarted, the link dropped), the
engine forgets that peer (rails, landing credits, credit region, region list, control socket); batches in
flight to it fail with every rail's cause, and the next batch to the same session id handshakes again from
scratch, with whatever engine listens at that host:port by then.

Code: this module holds the facade (construction, rails, registration, the batch API, telemetry, lifetime),
which owns and closes the parts and inherits none of them: the settings (``transport.config``), the peer
directory and failover (``transport.peers``), the control plane (``transport.control``: listener, handshake,
region refresh, and the ops registry that reads use), reads and notifies (``transport.reads``), and the data
path (``transport.pipeline``: submission and its routes, posts; with ``transport.inline``,
``transport.smallbatch``, ``transport.fills``, ``transport.completions`` and the batch records and accounting of
``transport.batches``).

Threads: one progress thread (``transport.progress``) for the receiver's landed chunks, the posts of units
re-dispatched after a failover and, on fabrics that deliver completions by callback (tcp, ipc), whose own threads
run the completion handlers, the failed completions (in order per rail) and the rails' watchdogs; on other
fabrics (verbs) one poll loop per rail. Per (relay device, rail) ring one copy thread that fills and posts; the
control plane's accept loop, selector and worker pools (``transport.control_server``: none per connection). The
fabrics own their socket threads. ``batch_write`` is
thread-safe.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import sys
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from transport.batches import BatchHandle, Batch, batch_timeout
from transport.completions import WATCHDOG_S
from transport.config import EngineConfig
from transport.control import ControlPlane
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, FabricUnavailable, InvalidTransfer,
                              RegionOverlap, UnknownSession)
from transport.fabric.base import DEVICE_HOST
from transport.fills import CREDIT_IDLE_S
from transport.peers import PeerDirectory, rail_local_gpus
from transport.pipeline import ROUTES, Pipeline
from transport.planner import COALESCED, DIRECT, RELAYED
from transport.progress import ProgressLoop
from transport.reads import Reads, batch_read, batch_read_async
from transport.receiver import Receiver
from transport.regions import Region, RegionTable
from transport.telemetry import Counters, LatencyWindow, Trace

log = logging.getLogger(__name__)

__all__ = ["TransferEngine", "UnknownSession", "BatchHandle"]


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


class TransferEngine:
    """Moves batches of pieces into a peer engine's registered memory (see the module docstring).

    Arguments (each falls back to a ``PXN_*`` environment variable, then to a default; read once into the frozen
    ``self.config``, a ``transport.config.EngineConfig``, which ``config=`` may also give whole):
        hostname: address to listen on and to advertise (default "127.0.0.1").
        port: TCP port of the control listener, i.e. the port in ``session_id`` (default 0: any free port). A
            fixed port lets a restarted process come back under the same session id, which senders reconnect to.
        fabric: "auto" (verbs when an RDMA device is usable, else tcp) | "tcp" | "ipc" | "verbs" | a name added
            through ``transport.fabric.register_fabric`` or a ``pxn.fabrics`` entry point (``PXN_FABRIC``).
        topology: a ``transport.topology.Topology`` (e.g. ``transport.topology.discover()``); its usable NIC
            ports become the rails and ``transport.routing.plan_routes`` says which rail is local to which GPU.
            None: a trivial topology, ``rails`` fabric instances, local to every device.
        rails: rail count for the trivial topology (``PXN_RAILS``, default 2).
        coalesce_bytes: pieces below this are coalesced into chunks (``PXN_COALESCE_BYTES``, default 64 KiB;
            0 on the ipc fabric, whose batched writes need no chunks: ``Fabric.config_defaults``).
        direct_pieces: a batch with at most this many small pieces of host memory on a device writes them direct
            instead of through a chunk (``PXN_DIRECT_PIECES``; default 0, tcp 64: ``Fabric.config_defaults``).
        relay_slot_bytes: relay / landing slot size = largest chunk and relayed piece (``PXN_RELAY_SLOT_BYTES``,
            default 4 MiB: on tcp, 64 KB pieces coalesce much faster into 4 MiB chunks than into 1 MiB ones).
        relay_slots: slots per lane (``PXN_RELAY_SLOTS``, default 8). lanes: lanes per ring (``PXN_LANES``, 2).
        landing_slots: credits (landing slots in use at once) one sender may hold per rail, as a sender and as a
            receiver (``PXN_LANDING_SLOTS``, default 16; at most the landing pool's slots).
        landing_bytes: the landing pool per receiving rail, shared by every sender (``PXN_LANDING_BYTES``, default
            32 MiB: eight 4 MiB slots, about a bandwidth-delay product of a 400 Gb/s rail with a 0.5 ms chunk
            turnaround; docs/README-engine.md, "Landing pool"). Slots are lent to senders as credits; a sender
            out of credits waits. Its slot size is ``relay_slot_bytes`` (capped by this budget).
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
            PCIe reaches.
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
        max_senders: senders connected to this engine at once (``PXN_MAX_SENDERS``, default 256); a hello beyond
            it is refused (a sender saying hello again keeps its place). Landing memory does not depend on it.
        handshake_timeout: seconds an incoming control or rail connection has to authenticate
            (``PXN_HANDSHAKE_TIMEOUT``, default 5).
        max_conns_per_addr: authenticated control connections per source address (``PXN_MAX_CONNS_PER_ADDR``,
            default 64); a tcp / ipc rail's live endpoints per source address follow it (at least 256). A
            connection beyond it is refused with ``transport.AdmissionRefused`` naming the variable (counted
            ``refused_per_addr``).
        max_pending, max_pending_per_addr: control connections still authenticating, in all and per source
            address (``PXN_MAX_PENDING``, default 128; ``PXN_MAX_PENDING_PER_ADDR``, default 32); a new one beyond
            either drops the oldest waiting (counted ``evicted_pending`` / ``evicted_pending_per_addr``).
        config: the settings as one ``EngineConfig`` instead of the keywords above: used as it is (no ``PXN_*``
            variable and no ``Fabric.config_defaults`` is read into it; ``EngineConfig.from_env(...)`` builds one
            that reads them). A setting keyword given beside it replaces that field (``config=base, rails=1``);
            its ``secret`` and ``insecure`` stand for ``secret=`` and ``insecure=``. ``hostname``, ``port``,
            ``topology``, ``landing_device`` and ``fabric_options`` are not settings and stay keywords.
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
                 direct_pieces: Optional[int] = None, insecure: Optional[bool] = None, landing_bytes=None,
                 max_pending: Optional[int] = None, max_pending_per_addr: Optional[int] = None,
                 config: Optional[EngineConfig] = None):
        self.hostname = hostname
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: any free port), got {port!r}")
        given = dict(
            fabric=fabric, rails=rails, coalesce_bytes=coalesce_bytes, direct_pieces=direct_pieces,
            relay_slot_bytes=relay_slot_bytes, relay_slots=relay_slots, lanes=lanes, landing_slots=landing_slots,
            landing_bytes=landing_bytes, stripe_bytes=stripe_bytes, relay=relay, timeout=timeout,
            trace_path=trace_path, switch_interval=switch_interval, loadstore=loadstore, forward_large=forward_large,
            max_senders=max_senders, handshake_timeout=handshake_timeout, max_conns_per_addr=max_conns_per_addr,
            max_pending=max_pending, max_pending_per_addr=max_pending_per_addr)
        environ = dict(os.environ)  # one reading of the environment for the settings and the secret
        cfg, fabric_cls = self._settings(config, given, environ)
        self.config = cfg
        if config is not None:  # the record's secret settings stand for the variables it replaces
            secret = cfg.secret if secret is None else secret
            insecure = cfg.insecure if insecure is None else insecure
        from transport.auth import resolve_secret
        self._secret = resolve_secret(secret, hostname, insecure, environ)
        self._init_state(cfg)
        routes, rail_specs, rail_gpu = self._plan_rails(topology, cfg)
        caps = fabric_cls.capabilities
        options = self._rail_options(fabric_cls, fabric_options, cfg)
        self.fabrics = []
        self._peers = PeerDirectory(threading.RLock(), routes, self._rail_keys)
        try:
            self._build_parts(caps, rail_specs, options, cfg)
            # relay rings (lanes x slots x slot bytes per device and rail, 64 MiB by default) are made by the
            # first relayed send (``Pipeline.ring``): an engine that only receives never holds one
            self._control = ControlPlane(hostname, port, self._peers, self._regions, self._region_gen, self.fabrics,
                                         self.receiver, self.counters, cfg, self.engine_id,
                                         landing_device=landing_device, rail_gpu=rail_gpu, secret=self._secret,
                                         handshake_timeout=cfg.handshake_timeout,
                                         max_conns_per_addr=cfg.max_conns_per_addr)
        except BaseException:
            self._teardown()
            raise
        self.port = self._control.port
        self.session_id = self._control.session_id = self._pipe.session_id = f"{hostname}:{self.port}"
        self._pipe.control = self._control
        self._reads = Reads(self, self._control, self._regions, self._check_open)
        self._threads.append(self._control.start())
        self._start_completions(caps)
        self._log_start(cfg)

    # ========================================================================================================
    # construction, by step
    # ========================================================================================================
    def _settings(self, config: Optional[EngineConfig], given: dict, environ: dict):
        """(the checked ``EngineConfig``, the fabric class); sets ``fabric_name`` ("auto" resolved).

        Without ``config``: the arguments in ``given`` (None: not given), then the ``PXN_*`` variables of
        ``environ``, then the fabric's ``config_defaults``, then the defaults. With ``config``: that record as
        it is (no variable and no fabric default is read into it), each argument given beside it replacing its
        field; the result is checked as a whole."""
        from transport.fabric import fabric_class
        if config is None:
            cfg = EngineConfig.from_env(environ, **given)
            self.fabric_name = self._pick_fabric(cfg.fabric)
            fabric_cls = fabric_class(self.fabric_name)
            if fabric_cls.config_defaults:
                # the fabric's own defaults (ipc: no coalescing, large relay slots); arguments and PXN_* variables
                # still win
                cfg = EngineConfig.from_env(environ, defaults=fabric_cls.config_defaults, **given)
            return cfg, fabric_cls
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a transport.config.EngineConfig, got {type(config).__name__}")
        overrides = {name: value for name, value in given.items() if value is not None}
        cfg = dataclasses.replace(config, **overrides) if overrides else config
        cfg.check()
        self.fabric_name = self._pick_fabric(cfg.fabric)
        return cfg, fabric_class(self.fabric_name)

    def _init_state(self, cfg: EngineConfig) -> None:
        """The process setting ``switch_interval`` and the engine's own records, before any part is built."""
        if cfg.switch_interval:
            # process-wide: how long a thread that released the GIL (socket / CUDA wait) may wait to get it
            # back while another thread runs Python; the default 5 ms stalls every hand-off of the pipeline
            sys.setswitchinterval(float(cfg.switch_interval))
        # Bumped by every deregister; same-host peers writing by load/store read it before each batch.
        from transport.fabric.region_counter import GenerationCounter
        self._region_gen = GenerationCounter()
        self.engine_id = secrets.randbits(63) | 1
        self.trace = Trace(cfg.trace_path) if cfg.trace_path else None
        self.counters = Counters()
        self.latency = LatencyWindow()
        self._closed = False
        self._regions = RegionTable()
        self._rail_stats = []
        self._threads: List[threading.Thread] = []

    def _plan_rails(self, topology, cfg: EngineConfig):
        """(routes, one fabric spec per rail, each rail's local GPU); sets ``_rail_keys``. A topology gives a rail
        per usable NIC port, routed by ``transport.routing.plan_routes``; None gives ``cfg.rails`` loopback rails,
        local to every device."""
        if topology is None:
            self._rail_keys = [f"rail{i}" for i in range(cfg.rails)]
            return None, [{} for _ in range(cfg.rails)], [None] * cfg.rails
        from transport.routing import plan_routes
        routes = plan_routes(topology)
        ports = list(topology.usable_ports())
        if not ports:
            raise FabricUnavailable("topology has no usable NIC port; pass topology=None for loopback rails")
        self._rail_keys = [p.key for p in ports]
        rail_gpu = rail_local_gpus(routes, self._rail_keys)
        _check_topology_gpus(routes)
        return routes, [{"device": p.name, "port_num": p.port} for p in ports], rail_gpu

    def _rail_options(self, fabric_cls, fabric_options: Optional[dict], cfg: EngineConfig) -> dict:
        """The keyword arguments every rail's fabric is built with: the class's ``engine_options`` under the
        caller's ``fabric_options``, the resolved secret, and what the class's capabilities ask for."""
        from transport.auth import Resolved
        options = {**fabric_cls.engine_options, **(fabric_options or {})}
        options["secret"] = Resolved(self._secret)  # resolved once here: the fabrics do not read PXN_SECRET again
        if fabric_cls.capabilities.authenticated_rails:
            # an incoming rail must have been announced by an authenticated control hello (receiver.accept_sender)
            options.setdefault("handshake_timeout", cfg.handshake_timeout)
            options.setdefault("guard_claims", True)
        from transport.fabric.socket_fabric import SocketFabric
        if issubclass(fabric_cls, SocketFabric):
            # one setting for the connections one address may hold: its engines' rails follow their control
            # connections (each sender engine holds one of each per rail)
            options.setdefault("max_peers_per_addr", max(256, cfg.max_conns_per_addr))
        return options

    def _build_parts(self, caps, rail_specs: List[dict], options: dict, cfg: EngineConfig) -> None:
        """The rails' fabrics, the progress loop, the receiver and the data path (``_teardown`` closes what was
        made when one fails)."""
        from transport.fabric import make_fabric
        for spec in rail_specs:
            opts = dict(options)
            if caps.nic_ports:
                opts.update(spec)  # the rail's NIC device and port
            self.fabrics.append(make_fabric(self.fabric_name, hostname=self.hostname, **opts))
        self._rail_stats = [Counters() for _ in self.fabrics]
        # the engine's one progress thread: landed chunks, failed completions, re-dispatched posts, watchdogs
        self._progress = ProgressLoop("pxn-progress")
        self.receiver = Receiver(self.fabrics, self._regions, cfg.landing_slots, cfg.relay_slot_bytes,
                                 self.counters, self.trace, max_senders=cfg.max_senders, progress=self._progress,
                                 landing_bytes=cfg.landing_bytes, secret=self._secret)
        self._pipe = Pipeline(cfg, caps, self.fabrics, self._regions, self._peers, self.receiver,
                              self._progress, self.counters, self._rail_stats, self.latency, self.trace,
                              self.engine_id)
        self._progress.every(CREDIT_IDLE_S, self._pipe.fills.return_idle_credits)

    def _start_completions(self, caps) -> None:
        """Completions handled in the fabric thread that sees them (one thread hand-off fewer per write and per
        chunk), failed ones in the progress loop, which also runs the watchdogs; else a poll loop per rail."""
        completions = self._pipe.completions
        if caps.completion_callback:
            for rail, fab in enumerate(self.fabrics):
                fab.set_completion_handler(functools.partial(completions.on_completions, rail))
            self._progress.every(WATCHDOG_S, completions.watchdogs)
            return
        for rail in range(len(self.fabrics)):
            t = threading.Thread(target=completions.poll_loop, args=(rail,), name=f"pxn-poll-rail{rail}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def _log_start(self, cfg: EngineConfig) -> None:
        if self._secret is None:
            # insecure=True / PXN_INSECURE=1: transport.auth warned once for the process; the ports go to INFO
            ports = [str(getattr(f, "port", "?")) for f in self.fabrics]
            log.info("pxn engine %s: no shared secret (insecure): any process that can reach %s may write into "
                     "this engine's registered memory through control port %d and %s rail port(s) %s",
                     self.session_id, self.hostname, self.port, self.fabric_name, ", ".join(ports))
        log.info("pxn engine %s: fabric %s, %d rail(s), coalesce < %d B, slots %d x %d x %d B",
                 self.session_id, self.fabric_name, len(self.fabrics), cfg.coalesce_bytes, cfg.lanes,
                 cfg.relay_slots, cfg.relay_slot_bytes)

    # ========================================================================================================
    # configuration helpers
    # ========================================================================================================
    @staticmethod
    def _pick_fabric(name: str) -> str:
        if name != "auto":
            return name  # EngineConfig.check took it from transport.fabric.FABRICS
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

    @property
    def default_timeout(self) -> float:
        """Seconds a batch may take when the call gives no ``timeout`` (``config.timeout``)."""
        return float(self.config.timeout)

    def _peer(self, session_id: str):
        """The connected peer record of ``session_id`` (handshaking first): diagnostics and tests."""
        return self._pipe.peer(session_id)

    @property
    def reads(self) -> Reads:
        """The engine's reads and notifies (``transport.reads``: the pooled control connections for reads, the
        async executor, the queue of notifies peers sent)."""
        return self._reads

    @property
    def data_path(self):
        """The engine's data path (``transport.pipeline.Pipeline``): its parts (``planner``, ``fills``,
        ``completions``, ``inflight``, ``rings()``) for diagnostics and tests."""
        return self._pipe

    def _check_open(self) -> None:
        if self._closed:
            raise FabricClosed(f"engine {getattr(self, 'session_id', '?')} is closed")

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

    def flush_gpu_writes(self) -> Dict[int, str]:
        """Make what peers wrote straight into this engine's GPU regions visible to GPU work launched from now on.

        A NIC writes GPU memory over PCIe, unordered with CUDA streams, and its completion does not promise that
        the GPU sees the bytes (GPUDirect RDMA). Chunks that land in pxn's landing slots are flushed by the
        receiver before they are read; pieces a peer wrote directly into registered GPU memory (large pieces) are
        read by the application, which calls this once it learns they are there and before it launches the work
        that reads them. ``get_notifies`` (the Mooncake API) does it before returning notifies. Fabrics whose
        own copies wrote the memory (ipc, tcp) need nothing. Returns {device: method} (``"cuda"``, ``"read"``,
        ``"none"``) for the GPUs flushed."""
        self._check_open()
        devices = sorted({r.device for r in self._regions.regions() if r.device >= 0})
        done: Dict[int, str] = {}
        for fab in self.fabrics:
            if fab.capabilities.gpu_write_flush:
                for dev in devices:
                    done[dev] = fab.flush_gpu_writes(dev)
        return done

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
            lengths: bytes per piece (>= 0). As in Mooncake, a zero-length piece is done by definition: it is
                dropped unchecked, and an empty batch (or one of zero-length pieces only) returns at once, once
                the session is known to answer.
            timeout: seconds > 0 (default: the engine's ``timeout``).
        Returns:
            None, once every byte is placed at the peer.
        Raises:
            InvalidTransfer (nothing written): a timeout that is not a number > 0, mismatched lists, bad length,
            unregistered source, destination outside the peer's regions; UnknownSession (nothing written);
            RemoteRejected: the peer refused a chunk or write; TransferTimeout; TransferError with ``causes`` when
            every rail failed.
        """
        # the default without the call; any other value is checked (``batch_timeout``)
        timeout = self.config.timeout if timeout is None else batch_timeout(timeout, self.config.timeout)
        pipe = self._pipe
        batch = pipe.submit(session_id, srcs, dsts, lengths)
        if batch is not None:
            pipe.wait(batch, timeout)

    def batch_write_async(self, session_id: str, srcs: Sequence[int], dsts: Sequence[int],
                          lengths: Sequence[int], timeout: Optional[float] = None) -> BatchHandle:
        """As ``batch_write`` but returns at once with a ``BatchHandle`` (``wait(timeout)``, ``done()``).
        Validation errors are raised here, before anything is posted. GPU sources: the load/store and inline
        paths queue their copies behind this thread's work on the sources' current stream and return; the posted
        path (chunks, posted relays, fabrics that read from other threads) first waits for that work."""
        timeout = batch_timeout(timeout, self.config.timeout)
        batch = self._pipe.submit(session_id, srcs, dsts, lengths, async_=True)
        if batch is None:
            batch = Batch(0, None, None, None, [], 0)
            batch.event.set()
        return BatchHandle(self._pipe, batch, timeout)

    def batch_read(self, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
                   lengths: Sequence[int], timeout: Optional[float] = None) -> None:
        """Read ``lengths[i]`` bytes from ``remote_srcs[i]`` in the peer's memory into local ``local_dsts[i]``.

        The peer gathers the pieces and writes them back with its own ``batch_write`` (small ones coalesced into
        chunks), see ``transport.reads``. Arguments: session_id: the peer's "host:port"; local_dsts: addresses
        inside regions registered here; remote_srcs: addresses inside regions the peer registered; lengths:
        bytes (>= 0; zero-length pieces and empty batches as in ``batch_write``); timeout: seconds (default: the
        engine's ``timeout``).
        Returns: None, once every byte is in local memory.
        Raises: InvalidTransfer (nothing written) for malformed lists, a local destination outside this
        engine's regions or a source outside the peer's; UnknownSession; TransferTimeout; TransferError.
        """
        batch_read(self, session_id, local_dsts, remote_srcs, lengths, timeout)

    def batch_read_async(self, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
                         lengths: Sequence[int], timeout: Optional[float] = None):
        """As ``batch_read`` but returns at once with a handle (``wait(timeout)``, ``done()``), like
        ``batch_write_async``. Argument errors and local destinations are checked here, before anything is sent."""
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
        cfg = self.config
        return _plain({
            "engine": {"session_id": self.session_id, "fabric": self.fabric_name, "rails": len(self.fabrics),
                       "coalesce_bytes": cfg.coalesce_bytes, "relay_slot_bytes": cfg.relay_slot_bytes,
                       "relay_slots": cfg.relay_slots, "lanes": cfg.lanes, "landing_slots": cfg.landing_slots,
                       "landing_bytes": cfg.landing_bytes, "stripe_bytes": cfg.stripe_bytes, "relay": cfg.relay},
            "batches": {"submitted": c.get("batches_submitted", 0), "ok": c.get("batches_ok", 0),
                        "failed": c.get("batches_failed", 0), "items": c.get("items", 0),
                        "bytes": c.get("bytes", 0), "latency": self.latency.summary()},
            "paths": paths,
            "routes": {k: c.get(f"route_{k}", 0) for k in ROUTES},
            "time_s": time_s,
            "rails": rails,
            "rings": {ring.name: ring.stats() for ring in self._pipe.rings()},
            "inflight": len(self._pipe.inflight),
            "receiver": receiver,
            "failover": {"rail_failures": c.get("rail_failures", 0), "redispatched_units": c.get("failovers", 0),
                         "peers_lost": c.get("peers_lost", 0), "reconnects": c.get("reconnects", 0),
                         "ctrl_reconnects": c.get("ctrl_reconnects", 0)},
            "credits": {"waits": c.get("credit_waits", 0), "wait_s": c.get("time_wait_credit_s", 0),
                        "requests": c.get("credit_requests", 0), "requests_failed": c.get("credit_requests_failed", 0),
                        "returned_idle": c.get("credits_returned_idle", 0), "defers": c.get("credit_defers", 0)},
            "handshake_s": c.get("handshake_s", 0),
            "security": self._security_stats(c),
        })

    def _security_stats(self, c: dict) -> dict:
        """Incoming connections refused (by cause) on the control port and each rail, and senders refused."""
        ctrl = self._control.gate.stats()
        rails = [st for st in (f.admission_stats() for f in self.fabrics) if st is not None]
        senders = {"refused_max_senders": c.get("senders_refused_max", 0),
                   "refused_rail_claims": c.get("senders_refused_claim", 0),
                   "refused_unproven": c.get("senders_refused_proof", 0),
                   "refused_chunk_mac": c.get("rx_chunks_forged", 0)}
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
        if sys.is_finalizing():
            # the interpreter is exiting (a holder's __del__ run by the last garbage collection): no thread can
            # start any more, and a fabric's close may start one (verbs' flush timers) and then wait for it
            # forever; the process's end releases the sockets and memory
            return
        self._control.close()
        self._reads.close()
        self._pipe.close()  # fails the batches in flight
        self._teardown()
        for t in self._threads:
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
        pipe = getattr(self, "_pipe", None)
        if pipe is not None:
            pipe.close_rings()
        peers = getattr(self, "_peers", None)
        if peers is not None:
            peers.close()
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
