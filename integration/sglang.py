"""sglang adapter: a drop-in for sglang's ``MooncakeTransferEngine`` wrapper, moving KV cache with pxn.

Surface matched (signatures and return conventions, method by method) from sglang 0.5.23's wheel,
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py`` (class ``MooncakeTransferEngine``;
before 0.5.2x it lived at ``sglang/srt/disaggregation/mooncake/transfer_engine.py``), and its callers in
``sglang/srt/disaggregation/mooncake/conn.py`` (``MooncakeKVManager``). No sglang code is copied here.

What sglang calls, and what this adapter does:

==========================================================  ===========================================================
sglang call (conn.py)                                       here
==========================================================  ===========================================================
``MooncakeTransferEngine(hostname, gpu_id, ib_device)``     starts a pxn engine on ``hostname`` (protocol from
                                                            ``MOONCAKE_PROTOCOL``, default "rdma"; see below)
``batch_register(ptrs, lengths) -> int``                    registers KV (GPU) and aux (host) buffers; 0 or < 0
``batch_deregister(ptrs) -> int``                           0 or < 0
``register(ptr, length)`` / ``deregister(ptr)`` -> None     one buffer; raise ``RuntimeError`` on failure, as sglang's
``batch_transfer_sync(session_id, buffers,                  one pxn batch (small pieces coalesced, large ones direct
peer_buffer_addresses, lengths) -> int``                    or PXN-relayed); 0, or < 0 with the cause logged
``transfer_sync(session_id, buffer, peer_addr, length)``    one piece; 0 or < 0
``get_session_id() -> "host:port"``                         the pxn control port: an int, sglang sums it to shard
``send_probe(peer_session_id) -> int``                      connects to the peer's control port; 0 when alive
``get_engine()``, ``get_ib_device()``                       the pxn engine; the device filter in use
==========================================================  ===========================================================

sglang's prefill side calls ``batch_transfer_sync`` from its transfer thread pools (``SGLANG_DISAGGREGATION_
THREAD_POOL_SIZE``, ~4 workers per queue) at once: every method here is thread-safe, and concurrent batches
proceed in parallel inside the pxn engine.

Protocol: ``MOONCAKE_PROTOCOL`` as in sglang ("rdma" default -> pxn verbs fabric, or tcp with one warning line
when no RDMA device is usable, as Mooncake; "tcp"; pxn also accepts "auto"), a truthy ``MC_FORCE_TCP`` forces
tcp, ``PXN_FABRIC`` overrides both. ``ib_device`` (sglang's ``--disaggregation-ib-device``: "mlx5_0,mlx5_1", a
JSON map ``{"0": "mlx5_0"}`` or a path to such a JSON file) restricts the NICs pxn may use; leave it unset to let
pxn route every GPU over all usable NICs, relaying through an NVLink peer where the NIC is not local to the GPU.

How to plug it into sglang (without editing sglang):

1. Plugin (sglang >= 0.5 with ``sglang.srt.plugins``): install pxn with the entry point
   ``sglang.srt.plugins: pxn = integration.sglang:register_sglang_plugin``. sglang's ``load_plugins()`` runs it in
   every process; it registers a REPLACE hook (``HookRegistry``) on
   ``sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.init_engine``, so the KV disaggregation managers
   (prefill and decode) move KV pages and aux rows with one pxn engine per process (``shared_kv_engine``).
   sglang's shared ``MooncakeTransferEngine`` is left to its other users (HiCache's Mooncake store, elastic EP,
   expert backup, encoder disaggregation): Mooncake's engine when Mooncake is installed; when it is not, the
   class is replaced by ``MooncakeEngineUnavailable``, which lets sglang start and makes any of those features
   fail with ``PxnFeatureUnavailable`` naming pxn and the feature. ``SGLANG_PLUGINS=pxn`` limits sglang to this
   plugin; ``PXN_SGLANG_PLUGIN=0`` makes it a no-op.
2. Manager subclass (as sglang's Ascend backend does): ``pxn_kv_manager_class()`` returns a subclass of
   ``MooncakeKVManager`` whose ``init_engine()`` builds this adapter; hook it in with a REPLACE on
   ``sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager``.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import threading
from typing import Dict, List, Optional, Union

from integration.codes import error_name
from integration.hosts import force_tcp
from integration.mooncake import TransferEngine as MooncakeCompatEngine
from transport.errors import PxnFeatureUnavailable

log = logging.getLogger(__name__)

__all__ = ["PxnMooncakeTransferEngine", "register_sglang_plugin", "pxn_kv_manager_class",
           "get_ib_devices_for_gpu", "SGLANG_TARGETS", "KV_MANAGER_TARGET", "MooncakeEngineUnavailable",
           "PxnFeatureUnavailable", "shared_kv_engine"]

# Where sglang defines MooncakeTransferEngine: 0.5.23 first, then the older 0.5.x location.
SGLANG_TARGETS = (
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine",
    "sglang.srt.disaggregation.mooncake.transfer_engine.MooncakeTransferEngine",
)


def _parse_ib_config(ib_device: Optional[str]) -> Optional[Union[str, Dict[int, str]]]:
    """sglang's ``--disaggregation-ib-device`` forms: None/"" -> None; "mlx5_0,mlx5_1" -> that string; a JSON
    object ``{"0": "mlx5_0", ...}`` or the path of a .json file holding one -> {gpu: devices}."""
    if ib_device is None or not str(ib_device).strip():
        return None
    s = str(ib_device).strip()
    if not (s.endswith(".json") or s.startswith("{")):
        return s
    if s.endswith(".json"):
        with open(s, "r", encoding="utf-8") as f:
            mapping = json.load(f)
    else:
        mapping = json.loads(s)
    if not isinstance(mapping, dict) or not mapping:
        raise ValueError(f"ib_device {ib_device!r}: expected a non-empty mapping GPU id -> device list")
    out: Dict[int, str] = {}
    for k, v in mapping.items():
        if not str(k).isdigit() or not isinstance(v, str):
            raise ValueError(f"ib_device {ib_device!r}: keys must be GPU ids and values device strings")
        out[int(k)] = v.strip()
    return out


def get_ib_devices_for_gpu(ib_device: Optional[str], gpu_id: int) -> Optional[str]:
    """The comma-separated RDMA devices for ``gpu_id`` under sglang's ``ib_device`` forms (None: no filter).
    Raises ValueError when a per-GPU mapping has no entry for ``gpu_id`` (as sglang does)."""
    cfg = _parse_ib_config(ib_device)
    if cfg is None or isinstance(cfg, str):
        return cfg
    if gpu_id not in cfg:
        raise ValueError(f"no IB devices configured for GPU {gpu_id}; the mapping has GPUs {sorted(cfg)}")
    return cfg[gpu_id]


class PxnMooncakeTransferEngine:
    """sglang's ``MooncakeTransferEngine`` surface, backed by pxn (see the module docstring).

    Arguments:
        hostname: this host's address as peers reach it (sglang passes ``get_local_ip_auto()``).
        gpu_id: the GPU this engine serves (selects the ``ib_device`` entry of a per-GPU mapping; default 0).
        ib_device: RDMA device filter in sglang's forms (module docstring); None = every usable NIC.
        protocol: keyword-only pxn extension; default ``MOONCAKE_PROTOCOL`` or "rdma", as sglang.
        timeout: keyword-only, seconds per batch (default Mooncake's rule, see ``integration.mooncake``).
        **engine_options: keyword-only, forwarded to ``transport.TransferEngine`` (``rails``, ...).
    Raises:
        RuntimeError when the engine cannot start (as sglang's wrapper does); the cause is logged.
    """

    def __init__(self, hostname: str, gpu_id: Optional[int] = None, ib_device: Optional[str] = None, *,
                 protocol: Optional[str] = None, timeout: Optional[float] = None, **engine_options):
        self.engine = MooncakeCompatEngine(timeout=timeout, **engine_options)
        self.hostname = hostname
        self.gpu_id = gpu_id if gpu_id is not None else 0
        self._protocol = protocol
        # as sglang: with MC_FORCE_TCP=1 the RDMA device selection is irrelevant
        self.ib_device = "" if force_tcp() else get_ib_devices_for_gpu(ib_device, self.gpu_id)
        self.initialize(hostname=self.hostname, device_name=self.ib_device)
        # "host:port" (IPv6 bracketed, as sglang's NetworkAddress.to_host_port_str): the port is a plain int,
        # which sglang's conn.py sums over a request's decode sessions to pick a transfer queue
        host = f"[{hostname}]" if ":" in hostname else hostname
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._closed = False
        self._close_lock = threading.Lock()

    def initialize(self, hostname: str, device_name: Optional[str]) -> None:
        """Start the pxn engine (sglang's wrapper calls this from ``__init__``). Raises RuntimeError."""
        protocol = self._protocol or os.environ.get("MOONCAKE_PROTOCOL") or "rdma"
        ret = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol,
                                     device_name if device_name is not None else "")
        if ret != 0:
            log.error("pxn transfer engine initialization failed on %s (protocol %r, devices %r): %s (%d)",
                      hostname, protocol, device_name, error_name(ret), ret)
            raise RuntimeError(f"pxn transfer engine initialization failed ({error_name(ret)}={ret})")

    # --- registration -------------------------------------------------------------------------------------
    def register(self, ptr, length) -> None:
        """Register one buffer (GPU or host, detected). Raises RuntimeError on failure, as sglang's wrapper."""
        ret = self.engine.register_memory(ptr, length)
        if ret != 0:
            raise RuntimeError(f"pxn memory registration failed (ret={ret}, {error_name(ret)})")

    def deregister(self, ptr) -> None:
        """Deregister one buffer. Raises RuntimeError on failure, as sglang's wrapper."""
        ret = self.engine.unregister_memory(ptr)
        if ret != 0:
            raise RuntimeError(f"pxn memory deregistration failed (ret={ret}, {error_name(ret)})")

    def batch_register(self, ptrs: List[int], lengths: List[int]) -> int:
        """Register several buffers, all or nothing. Returns 0 or a negative code (cause logged)."""
        return self.engine.batch_register_memory(ptrs, lengths)

    def batch_deregister(self, ptrs: List[int]) -> int:
        """Deregister several buffers (each tried). Returns 0 or the first negative code."""
        return self.engine.batch_unregister_memory(ptrs)

    # --- transfers ----------------------------------------------------------------------------------------
    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        """Write ``length`` bytes from ``buffer`` to ``peer_buffer_address`` at ``session_id``. 0 or < 0."""
        return self.engine.transfer_sync_write(session_id, buffer, peer_buffer_address, length)

    def batch_transfer_sync(self, session_id: str, buffers: List[int], peer_buffer_addresses: List[int],
                            lengths: List[int]) -> int:
        """Write every piece ``buffers[i] -> peer_buffer_addresses[i]`` (``lengths[i]`` bytes) at the decode
        peer ``session_id`` ("host:port"); returns once all are placed.

        Returns: 0, or a negative code (``integration.mooncake`` table) with the cause logged; sglang counts any
        value < 0 as a failed session. Thread-safe: sglang's transfer workers call this concurrently.
        """
        return self.engine.batch_transfer_sync_write(session_id, buffers, peer_buffer_addresses, lengths)

    # --- identity / liveness ------------------------------------------------------------------------------
    def get_session_id(self) -> str:
        """"host:port" that decode peers send to prefill (the port: pxn's control port, an int)."""
        return self.session_id

    def send_probe(self, peer_session_id: str) -> int:
        """Cheap liveness probe of a peer (sglang un-blacklists a failed session when this returns 0). A fresh
        control connection, independent of transfer state: 0 means an engine answers at that session now, and the
        next ``batch_transfer_sync`` to it handshakes again if every rail of the old connection had failed."""
        return self.engine.send_probe(peer_session_id)

    def get_engine(self):
        """The pxn ``transport.TransferEngine`` (sglang's wrapper returns Mooncake's inner engine here)."""
        return self.engine.get_engine()

    def get_ib_device(self):
        """The RDMA device filter in use ("" / None: every usable NIC)."""
        return self.ib_device

    def close(self) -> None:
        """Stop the pxn engine. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.engine.close()


# ============================================================================================================
# plugging into sglang
# ============================================================================================================
# The KV managers' engine: one pxn engine per process, shared by every MooncakeKVManager in it (sglang shares its
# one Mooncake engine between them the same way).
KV_MANAGER_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.init_engine"

_shared: Optional[PxnMooncakeTransferEngine] = None
_shared_lock = threading.Lock()


def shared_kv_engine(gpu_id: Optional[int] = None, ib_device: Optional[str] = None) -> PxnMooncakeTransferEngine:
    """The process's pxn engine for sglang's KV disaggregation managers, started on first use on this host's
    address (sglang's ``get_local_ip_auto()``). Raises RuntimeError when it cannot start (cause logged)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            from sglang.srt.utils.network import get_local_ip_auto
            _shared = PxnMooncakeTransferEngine(get_local_ip_auto(), gpu_id=gpu_id, ib_device=ib_device)
        return _shared


def _kv_manager_init_engine(self) -> None:
    """REPLACE of ``MooncakeKVManager.init_engine``: the manager moves KV pages and aux rows with pxn."""
    args = getattr(self, "kv_args", None)
    self.engine = shared_kv_engine(getattr(args, "gpu_id", None), getattr(args, "ib_device", None))


# which sglang feature uses the shared engine, by the module asking (for the error message)
_FEATURES = (
    ("sglang.srt.mem_cache", "HiCache's Mooncake store"),
    ("sglang.srt.elastic_ep", "elastic EP expert backup"),
    ("sglang.srt.distributed.device_communicators.mooncake_transfer_engine", "elastic EP (mooncake.pg)"),
    ("sglang.srt.disaggregation.encoder", "encoder disaggregation"),
    ("sglang.multimodal_gen", "multimodal disaggregation"),
)


def _calling_feature() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod != __name__:
            for prefix, feature in _FEATURES:
                if mod.startswith(prefix):
                    return feature
            if mod.startswith("sglang"):
                return f"sglang's {mod}"
        frame = frame.f_back
    return "a user of sglang's shared Mooncake engine"


class MooncakeEngineUnavailable:
    """Stands in for sglang's shared ``MooncakeTransferEngine`` when Mooncake is not installed and pxn serves
    the KV disaggregation managers: constructing it is harmless (sglang builds the shared engine at start-up
    whenever disaggregation uses Mooncake), and any use of it raises ``PxnFeatureUnavailable`` naming pxn and
    the feature that asked, instead of a failed import or a pybind cast deep inside that feature."""

    def __init__(self, hostname: str = "", gpu_id: Optional[int] = None, ib_device: Optional[str] = None, **_):
        self.hostname = hostname
        self.gpu_id = gpu_id
        self._ib_device = ib_device

    def _refuse(self, name: str):
        feature = _calling_feature()
        msg = (f"{feature} needs Mooncake's transfer engine (sglang's shared MooncakeTransferEngine.{name}), "
               f"but Mooncake is not installed: pxn replaces only the KV-cache transfer of prefill/decode "
               f"disaggregation. Install mooncake-transfer-engine to run {feature} next to pxn, or turn it off")
        log.error("%s", msg)
        raise PxnFeatureUnavailable(msg)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse(name)

    @property
    def engine(self):
        self._refuse("engine")


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 — missing, or its native library does not load (libibverbs)
        return False


def _module_exists(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


def register_sglang_plugin() -> Optional[str]:
    """Entry point of the ``sglang.srt.plugins`` group: give sglang's KV disaggregation managers a pxn engine.

    Registers a REPLACE hook (sglang's ``HookRegistry``) on ``MooncakeKVManager.init_engine``, so prefill and
    decode KV managers use ``shared_kv_engine()``. The other users of sglang's shared engine (HiCache's
    Mooncake store, elastic EP, expert backup, encoder disaggregation) keep Mooncake's engine when Mooncake is
    installed; when it is not, sglang's ``MooncakeTransferEngine`` class is replaced by
    ``MooncakeEngineUnavailable`` so that sglang starts, and those features get an error naming pxn and
    themselves. Returns the dotted target of the KV hook (None when disabled). ``PXN_SGLANG_PLUGIN=0``
    disables it; a value other than 1, true, yes, on, 0, false, no, off raises ``ConfigError`` naming it.
    """
    from transport.config import parse_flag
    if not parse_flag("PXN_SGLANG_PLUGIN", True):
        log.info("pxn sglang plugin disabled by PXN_SGLANG_PLUGIN")
        return None
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(KV_MANAGER_TARGET, _kv_manager_init_engine, HookType.REPLACE)
    if _mooncake_importable():
        log.info("pxn: sglang's KV disaggregation managers use pxn; the shared engine stays Mooncake's")
    else:
        for target in SGLANG_TARGETS:
            if _module_exists(target.rsplit(".", 1)[0]):
                HookRegistry.register(target, MooncakeEngineUnavailable, HookType.REPLACE)
                log.info("pxn: sglang's KV disaggregation managers use pxn; Mooncake is not installed, so %s "
                         "refuses its other users with a named error", target)
                break
    return KV_MANAGER_TARGET


def pxn_kv_manager_class():
    """A ``MooncakeKVManager`` subclass whose ``init_engine()`` builds a ``PxnMooncakeTransferEngine`` per
    manager (the pattern of sglang's Ascend backend), for deployments that replace the manager class rather than
    the engine class. Imports sglang, so call it only inside an sglang process."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.utils.network import get_local_ip_auto

    class PxnKVManager(MooncakeKVManager):
        def init_engine(self):
            self.engine = PxnMooncakeTransferEngine(hostname=get_local_ip_auto(), gpu_id=self.kv_args.gpu_id,
                                                    ib_device=self.kv_args.ib_device)

    return PxnKVManager
