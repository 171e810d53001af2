"""What ``initialize`` is given, parsed: host names and sessions, ports, memory locations, protocols, and the NIC
ports that may carry rails (Mooncake's ``device_name``)."""
from __future__ import annotations

import os
import random
import socket
from typing import List, Optional, Sequence, Tuple

from integration.codes import log
from transport.errors import FabricError, FabricUnavailable, InvalidTransfer

P2PHANDSHAKE = "P2PHANDSHAKE"
PROTOCOLS = {"tcp": "tcp", "rdma": "verbs", "verbs": "verbs", "auto": "auto", "ipc": "ipc"}


FALSY = ("", "0", "false", "no", "off")


def force_tcp() -> bool:
    """``MC_FORCE_TCP`` is set to a truthy value ("1", "true", "yes", "on", any other text but "0", "false",
    "no", "off", case-insensitive). Mooncake's CI sets ``MC_FORCE_TCP=true``."""
    return os.environ.get("MC_FORCE_TCP", "").strip().lower() not in FALSY


def normalize_session(target: str) -> str:
    """Mooncake / sglang write IPv6 peers as "[addr]:port" (sglang's ``NetworkAddress.to_host_port_str``); the
    pxn engine splits its session id at the last ':' and connects to the bare address. Returns "addr:port"."""
    if isinstance(target, str) and target.startswith("["):
        host, sep, port = target[1:].partition("]:")
        if sep:
            return f"{host}:{port}"
    return target


def split_hostname(local_hostname: str) -> Tuple[str, Optional[str]]:
    """"host" | "host:port" | "[v6]:port" | bare IPv6 -> (host, port or None)."""
    s = (local_hostname or "").strip()
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if s.count(":") == 1:
        host, _, port = s.partition(":")
        return host, port
    return s, None  # a bare name, or a bare IPv6 address (several ':')


def parse_location(location: str) -> Optional[int]:
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



def rpc_port() -> int:
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

def filter_topology(topo, names: Sequence[str]):
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


def verbs_topology(base):
    """``base`` (a sysfs topology with no NIC port) with the ports that verbs lists instead: one ``NicPort`` per
    device port, unusable with reason ``down`` (not ACTIVE) or ``no GID`` (no usable GID entry), as the verbs
    fabric judges them (``transport.fabric.verbs.port_table``, ``PXN_GID_INDEX`` included). No PCI place is
    known, so GPU-to-port distances are NODE. Raises FabricUnavailable when pyverbs or the device list is
    missing."""
    from transport.fabric.verbs import port_table
    from transport.topology import NicPort, Topology
    states = {"down": "1: DOWN", "unreadable": ""}
    ports = [NicPort(name=st.device, port=st.port_num, pci="", state=states.get(st.reason or "", "4: ACTIVE"),
                     link_layer={"eth": "Ethernet", "ib": "InfiniBand"}.get(st.link_layer, ""),
                     gid=st.reason != "no GID", usable=st.usable, reason=st.reason, detail=st.detail)
             for st in port_table()]
    distances = {(g.index, p.key): "NODE" for g in base.gpus for p in ports}
    return Topology(base.gpus, ports, distances, base.nvlink, base.nvlink_source, base.root, base.name,
                    list(base.notes) + ["NIC ports from the verbs device list (sysfs shows none)"])


def verbs_usable() -> bool:
    """A verbs device with a usable port is here (the engine's fabric "auto" then picks verbs)."""
    from transport.fabric.verbs import usable_port
    try:
        usable_port()
    except FabricUnavailable:
        return False
    return True


def rails_topology(fabric: str, names: List[str]):
    """The machine's topology for verbs rails (None for tcp, or when auto finds no RDMA device)."""
    if fabric == "auto" and not verbs_usable():
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
        topo = verbs_topology(topo)
        log.info("no RDMA port in sysfs; ports from the verbs device list: %s",
                 ", ".join(f"{p.key}{'' if p.usable else f' ({p.reason})'}" for p in topo.ports) or "none")
    return filter_topology(topo, names) if names else topo

