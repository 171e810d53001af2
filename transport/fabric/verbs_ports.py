"""Which RDMA port and GID the verbs fabric drives, and the table ``pxn topo`` and the Mooncake layer show.

Separate from the fabric so that a port can be judged without building one: ``usable_port`` answers "would a
``VerbsFabric`` start here, and on which port" and ``port_table`` lists every port with the reason it is or is
not usable. ``PXN_GID_INDEX`` (``gid_index_from_env``) overrides the GID choice, as ``NCCL_IB_GID_INDEX`` does.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterator, List, Optional

from transport.config import EngineConfig
from transport.errors import FabricUnavailable, VerbsPortError

INSTALL_HINT = ("install pyverbs with the rdma-core libraries of its own version: rdma-core v59 (a distribution's "
                "v59 packages, or built from source at tag v59.0) and `pip install \"cython==3.0.12\" "
                "\"scikit-build-core>=0.10\" setuptools_scm && pip install --no-build-isolation pyverbs==59.0`; or "
                "a distribution's python3-pyverbs (Debian/Ubuntu: `apt-get install -y rdma-core libibverbs-dev "
                "python3-pyverbs`), which before v55 registers GPU memory only through nvidia_peermem "
                "(docs/README-fabrics.md, 'Installing RDMA')")


def gid_index_from_env(environ=None) -> Optional[int]:
    """``PXN_GID_INDEX`` (``EngineConfig.gid_index``) as an int, None when unset. ``ConfigError`` (a
    ``ValueError``) naming the variable and value otherwise."""
    return EngineConfig.read(("gid_index",), environ).get("gid_index")


def import_pyverbs():
    try:
        try:
            import pyverbs.libibverbs_enums as e  # v59: the enums module's name
        except ImportError:
            import pyverbs.enums as e  # up to v58
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR
    except ImportError as ex:
        raise FabricUnavailable(f"verbs fabric: pyverbs is not importable ({ex}); {INSTALL_HINT}") from ex
    return dict(e=e, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
                get_device_list=get_device_list, MR=MR, PD=PD, QP=QP, QPAttr=QPAttr, QPCap=QPCap,
                QPInitAttr=QPInitAttr, SGE=SGE, RecvWR=RecvWR, SendWR=SendWR)

# ---- port and GID choice ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PortChoice:
    """The port a fabric drives: device name, port number, GID index and GID (text), link layer (``"eth"`` or
    ``"ib"``), LID and active MTU (the verbs enum value)."""

    device: str
    port_num: int
    gid_index: int
    gid: str
    link_layer: str
    lid: int
    mtu: int


def _gid_bytes(gid) -> bytes:
    return ipaddress.IPv6Address(str(gid)).packed


def _gid_rank(raw: bytes, roce_v2: bool) -> int:
    """3: RoCE v2 IPv4-mapped; 2: RoCE v2; 1: any other non-empty GID; 0: empty."""
    if raw == bytes(16):
        return 0
    if roce_v2 and raw[:12] == bytes(10) + b"\xff\xff":
        return 3
    return 2 if roce_v2 else 1


def choose_gid(ctx, e, device: str, port_num: int, gid_index: Optional[int]):
    """(GID index, GID text) of ``device`` port ``port_num``, or raise ``VerbsPortError`` saying why there is
    none. ``gid_index`` given: that entry, which must not be empty. Else the best entry by ``_gid_rank``, the
    lowest index among equals (an InfiniBand port: index 0, its port GID)."""
    attr = ctx.query_port(port_num)
    eth = attr.link_layer == e.IBV_LINK_LAYER_ETHERNET
    if gid_index is not None:
        try:
            gid = ctx.query_gid(port_num, gid_index)
        except Exception as ex:  # noqa: BLE001 — PyverbsRDMAError: the index is past the table
            raise VerbsPortError(f"verbs: {device} port {port_num} has no GID index {gid_index} "
                                 f"(table of {attr.gid_tbl_len}): {ex}") from ex
        if _gid_bytes(gid) == bytes(16):
            raise VerbsPortError(f"verbs: {device} port {port_num} GID index {gid_index} (PXN_GID_INDEX / "
                                 f"gid_index) is empty: the port has no address there")
        return gid_index, str(gid)
    if not eth:
        gid = ctx.query_gid(port_num, 0)
        if _gid_bytes(gid) == bytes(16):
            raise VerbsPortError(f"verbs: {device} port {port_num} (InfiniBand) has an empty GID 0")
        return 0, str(gid)
    best = (0, -1, "")
    for index in range(attr.gid_tbl_len):
        try:
            gid = ctx.query_gid(port_num, index)
        except Exception:  # noqa: BLE001 — past the populated part of the table
            break
        raw = _gid_bytes(gid)
        if raw == bytes(16):
            continue
        try:
            v2 = ctx.query_gid_type(port_num, index) == e.IBV_GID_TYPE_SYSFS_ROCE_V2
        except Exception:  # noqa: BLE001 — no type known: rank it as v1
            v2 = False
        rank = _gid_rank(raw, v2)
        if rank > best[0]:
            best = (rank, index, str(gid))
            if rank == 3:
                break
    if best[0] == 0:
        raise VerbsPortError(f"verbs: {device} port {port_num} is a RoCE port with no GID (every entry of its "
                             f"table of {attr.gid_tbl_len} is empty: no IP address on its netdev)")
    return best[1], best[2]


@dataclass(frozen=True)
class PortStatus:
    """One port of one RDMA device as the fabric judges it: ``choice`` when it can drive it, else ``reason``
    (``"down"``: not ACTIVE; ``"no GID"``: no usable GID entry; ``"unreadable"``: the query failed) and
    ``detail``. ``link_layer``: ``"eth"`` or ``"ib"`` (``""`` when unreadable)."""

    device: str
    port_num: int
    link_layer: str
    choice: Optional[PortChoice]
    reason: Optional[str] = None
    detail: str = ""

    @property
    def usable(self) -> bool:
        return self.choice is not None


def _device_names(v) -> List[str]:
    try:
        devices = v["get_device_list"]()
    except Exception as ex:  # noqa: BLE001 — pyverbs raises PyverbsRDMAError('Failed to get devices list')
        raise FabricUnavailable(f"verbs fabric: no RDMA device ({ex}); this machine needs an RDMA NIC (or "
                                f"rxe/siw soft-RoCE) with its kernel driver and rdma-core providers") from ex
    return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in devices]


def scan_ports(v, device: Optional[str] = None, port_num: Optional[int] = None,
               gid_index: Optional[int] = None) -> Iterator[PortStatus]:
    """Every port of every RDMA device (or of ``device``; or only ``port_num``), in device-list order, each
    judged as ``choose_port`` would. Raises ``FabricUnavailable`` when there is no device, or no ``device``."""
    e = v["e"]
    names = _device_names(v)
    if not names:
        raise FabricUnavailable("verbs fabric: no RDMA device found (ibv_get_device_list is empty)")
    if device is not None and device not in names:
        raise FabricUnavailable(f"verbs fabric: RDMA device {device!r} not found; present: {names}")
    for name in ([device] if device is not None else names):
        ctx = v["Context"](name=name)
        try:
            ports = [port_num] if port_num is not None else range(1, ctx.query_device().phys_port_cnt + 1)
            for p in ports:
                try:
                    attr = ctx.query_port(p)
                except Exception as ex:  # noqa: BLE001
                    yield PortStatus(name, p, "", None, "unreadable", f"{name} port {p}: {ex}")
                    continue
                ll = "eth" if attr.link_layer == e.IBV_LINK_LAYER_ETHERNET else "ib"
                if attr.state != e.IBV_PORT_ACTIVE:
                    yield PortStatus(name, p, ll, None, "down", f"{name} port {p}: state {attr.state}, not ACTIVE")
                    continue
                try:
                    index, gid = choose_gid(ctx, e, name, p, gid_index)
                except VerbsPortError as ex:
                    yield PortStatus(name, p, ll, None, "no GID", str(ex).replace("verbs: ", ""))
                    continue
                yield PortStatus(name, p, ll, PortChoice(name, p, index, gid, ll, int(attr.lid),
                                                         int(attr.active_mtu)))
        finally:
            ctx.close()


def choose_port(v, device: Optional[str], port_num: Optional[int], gid_index: Optional[int]) -> PortChoice:
    """The port to drive: ``device`` / ``port_num`` when given (else the first that works), skipping ports that
    are not ACTIVE or have no usable GID. Raises ``VerbsPortError`` listing every port tried and why."""
    skipped = []
    for st in scan_ports(v, device, port_num, gid_index):
        if st.usable:
            return st.choice
        skipped.append(st.detail)
    raise VerbsPortError("verbs fabric: no usable RDMA port (" + "; ".join(skipped) + ")")


def port_table() -> List[PortStatus]:
    """``scan_ports`` of every device with ``PXN_GID_INDEX``: what ``pxn topo`` and the Mooncake layer show where
    sysfs lists no RDMA port. Raises ``FabricUnavailable`` without pyverbs or devices."""
    return list(scan_ports(import_pyverbs(), gid_index=gid_index_from_env()))


def usable_port(device: Optional[str] = None, port_num: Optional[int] = None) -> PortChoice:
    """The port a ``VerbsFabric`` made with these arguments (and ``PXN_GID_INDEX``) would drive. Raises
    ``FabricUnavailable`` saying why there is none: no pyverbs, no device, no ACTIVE port with a usable GID."""
    return choose_port(import_pyverbs(), device, port_num, gid_index_from_env())
