"""Topology discovery: GPUs, RDMA NIC ports, their PCIe distance classes and NVLink reachability.

Everything is read from standard Linux sysfs files relative to a root directory (default ``/``), so a copied or
generated tree is read exactly like the live one (the files it reads):

* ``sys/bus/pci/devices/<BDF>`` -> symlink into ``sys/devices/pci<DOMAIN:BUS>/<bridge>/.../<BDF>``; each path
  component between the host bridge (``pciDDDD:BB``) and the device is a PCIe bridge / switch port.
* ``<pci dev>/{vendor,class,numa_node}``: GPUs are NVIDIA (``0x10de``) display / 3D controllers.
* ``sys/class/infiniband/<ibdev>/device`` (-> the NIC's PCI function), ``ports/<n>/{state,phys_state,
  link_layer,rate}``, ``ports/<n>/gids/0`` and ``device/net/<ifname>``.

Distance classes are those of ``nvidia-smi topo -m``, best first:

* ``PIX``  at most a single PCIe switch between the two devices
* ``PXB``  several PCIe switches / bridges, without crossing the host bridge
* ``PHB``  through the PCIe host bridge (same root complex)
* ``NODE`` across PCIe host bridges within one NUMA node
* ``SYS``  across NUMA nodes (the SMP interconnect)

A switch appears in sysfs as an upstream port followed by one downstream port per device, so when both
devices sit below the common bridge at odd depths the bridges are counted in (downstream, upstream) pairs, as
NCCL does; trees that model a switch as a single path component are counted component by component.

NVLink: from NVML (``pynvml`` / ``nvidia-ml-py``) or ``torch.cuda.can_device_access_peer`` when the root is the
live ``/`` and GPUs are visible; any other tree (generated, copied, or a live one whose GPUs cannot be queried)
is declared all-to-all between its GPUs, which an override's ``"nvlink"`` key can replace.

GPU index = rank of the GPU's PCI address in ascending order (what ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` gives).
A NIC port is one (ibdev, port number) pair; each port is its own rail, so a dual-port card (two PCI functions
or one ibdev with two ports) gives two rails.

The override / hand-written description format is documented in ``docs/README-topology.md`` and validated by
:func:`load_override`.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from transport.errors import TopologyError
log = logging.getLogger(__name__)

CLASSES: Tuple[str, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")
"""Distance classes, best (closest) first."""
CLASS_RANK: Dict[str, int] = {c: i for i, c in enumerate(CLASSES)}
LOCAL_CLASSES = frozenset({"PIX", "PXB"})
"""Classes at which a NIC counts as local to a GPU (no host bridge on the path)."""

VENDOR_NVIDIA = 0x10DE
_GPU_CLASSES = (0x0300, 0x0302)  # VGA-compatible and 3D controller; NVSwitch (0x0680) is not a GPU

_BDF_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_HOST_BRIDGE_RE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")

NVLINK_ALL = "all-to-all"


# --- data model ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gpu:
    """One GPU. ``index`` is the rank of ``pci`` among the machine's GPUs; ``numa`` is -1 when unknown;
    ``bridges`` are the PCI bridges from the host bridge ``host_bridge`` down to (excluding) the GPU."""

    index: int
    pci: str
    numa: int = -1
    host_bridge: Optional[str] = None
    bridges: Tuple[str, ...] = ()


@dataclass(frozen=True)
class NicPort:
    """One RDMA port (``name`` is the ibdev, ``port`` its 1-based port number): its link state as sysfs shows
    it, its rate in Gb/s, whether GID 0 is non-zero, its netdev, and whether routing may use it (``reason`` is
    a short code when not: ``down``, ``no GID``, ``no link``, ``disabled``)."""

    name: str
    port: int
    pci: str
    numa: int = -1
    state: str = ""
    phys_state: str = ""
    link_layer: str = ""
    rate: str = ""
    rate_gbps: Optional[float] = None
    gid: bool = False
    netdev: Optional[str] = None
    host_bridge: Optional[str] = None
    bridges: Tuple[str, ...] = ()
    usable: bool = True
    reason: Optional[str] = None
    detail: str = ""

    @property
    def key(self) -> str:
        """``"<ibdev>:<port>"``, unique per port."""
        return "%s:%d" % (self.name, self.port)


def _state_word(value: str) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; ``"ACTIVE"`` stays."""
    value = (value or "").strip()
    return value.split(":", 1)[1].strip() if ":" in value else value


def _parse_rate(value: str) -> Optional[float]:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); None when unparsable."""
    m = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb", value or "")
    return float(m.group(1)) if m else None


def port_verdict(state: str, phys_state: str, link_layer: str, gid: bool) -> Tuple[Optional[str], str]:
    """Why a port is unusable, as ``(reason, detail)``; ``(None, "")`` when it is usable.

    ``down``: state is not ACTIVE or phys_state is not LinkUp. ``no link``: the state or link layer cannot be
    read. ``no GID``: an Ethernet (RoCE) port whose GID 0 is all zero (no IP configured: RoCE cannot address it).
    """
    s, p, ll = _state_word(state), _state_word(phys_state), (link_layer or "").strip()
    if not s or not p:
        return "no link", "state %r / phys_state %r unreadable" % (state, phys_state)
    if s.upper() != "ACTIVE" or p.replace(" ", "").lower() != "linkup":
        return "down", "state %s, phys_state %s" % (s, p)
    if ll.lower() not in ("ethernet", "infiniband"):
        return "no link", "link layer %r unknown" % (link_layer,)
    if ll.lower() == "ethernet" and not gid:
        return "no GID", "ACTIVE/LinkUp Ethernet (RoCE) port but GID 0 is all zero (no IP address?)"
    return None, ""


def _pci_key(pci: str) -> Tuple[int, int, int, int]:
    m = _BDF_RE.match(pci)
    if not m:
        raise TopologyError("not a PCI address (DDDD:BB:DD.F): %r" % (pci,))
    return tuple(int(x, 16) for x in m.groups())  # type: ignore[return-value]


def _natural_key(text: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def port_sort_key(port: NicPort):
    return (_natural_key(port.name), port.port)


def _same_numa(a: int, b: int) -> bool:
    # -1 means the kernel does not know (single-socket boxes, VMs): never claim a cross-socket path then.
    return a < 0 or b < 0 or a == b


def pci_distance(a_host: Optional[str], a_bridges: Sequence[str], a_numa: int,
                 b_host: Optional[str], b_bridges: Sequence[str], b_numa: int) -> str:
    """Distance class between two PCI devices given their host bridges, bridge chains and NUMA nodes."""
    if a_host is None or b_host is None or a_host != b_host:
        return "NODE" if _same_numa(a_numa, b_numa) else "SYS"
    common = 0
    while common < min(len(a_bridges), len(b_bridges)) and a_bridges[common] == b_bridges[common]:
        common += 1
    if common == 0:
        return "PHB"
    ra, rb = len(a_bridges) - common, len(b_bridges) - common
    if ra % 2 == 1 and rb % 2 == 1:
        # Each device hangs off a downstream port; every further (upstream, downstream) pair is one switch.
        switches = 1 + (ra - 1) // 2 + (rb - 1) // 2
    else:
        switches = 1 + ra + rb
    return "PIX" if switches <= 1 else "PXB"


class Topology:
    """GPUs, NIC ports, the GPU x port distance classes and the NVLink graph of one machine.

    ``distances[(gpu_index, port_key)]`` is a class of :data:`CLASSES`; ``nvlink`` is a set of unordered GPU
    index pairs; ``nvlink_source`` says where that came from (``nvml``, ``torch``, ``assumed``, ``override``).
    """

    def __init__(self, gpus: Sequence[Gpu], ports: Sequence[NicPort],
                 distances: Mapping[Tuple[int, str], str], nvlink: Iterable[Tuple[int, int]],
                 nvlink_source: str = "assumed", root: Optional[str] = None, name: Optional[str] = None,
                 notes: Sequence[str] = ()):
        self.gpus: List[Gpu] = sorted(gpus, key=lambda g: g.index)
        if [g.index for g in self.gpus] != list(range(len(self.gpus))):
            raise TopologyError("GPU indices must be 0..%d, got %s"
                                % (len(self.gpus) - 1, [g.index for g in self.gpus]))
        self.ports: List[NicPort] = sorted(ports, key=port_sort_key)
        keys = [p.key for p in self.ports]
        if len(set(keys)) != len(keys):
            raise TopologyError("duplicate NIC port: %s" % sorted({k for k in keys if keys.count(k) > 1}))
        self.distances: Dict[Tuple[int, str], str] = {}
        for g in self.gpus:
            for p in self.ports:
                d = distances.get((g.index, p.key))
                if d is None:
                    d = "NODE" if _same_numa(g.numa, p.numa) else "SYS"
                if d not in CLASS_RANK:
                    raise TopologyError("distance GPU%d-%s: %r is not one of %s" % (g.index, p.key, d, CLASSES))
                self.distances[(g.index, p.key)] = d
        n = len(self.gpus)
        pairs = set()
        for a, b in nvlink:
            if not (0 <= a < n and 0 <= b < n):
                raise TopologyError("NVLink pair (%r, %r) names a GPU outside 0..%d" % (a, b, n - 1))
            if a != b:
                pairs.add((min(a, b), max(a, b)))
        self.nvlink = frozenset(pairs)
        self.nvlink_source = nvlink_source
        self.root = root
        self.name = name
        self.notes: List[str] = list(notes)

    # -- queries ---------------------------------------------------------------------------------------------
    def gpu(self, index: int) -> Gpu:
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            raise TopologyError("no GPU %r on this machine (it has %d)" % (index, len(self.gpus)))
        return self.gpus[index]

    def port(self, name: str, port: Optional[int] = None) -> NicPort:
        """The port ``name`` (``"mlx5_0"``, ``"mlx5_0:2"``) or ``(name, port)``; the lowest port when the
        number is not given."""
        if port is None and ":" in name:
            name, _, num = name.partition(":")
            port = int(num) if num.isdigit() else -1
        for p in self.ports:
            if p.name == name and (port is None or p.port == port):
                return p
        raise TopologyError("no NIC port %r%s on this machine" % (name, "" if port is None else ":%s" % port))

    def label(self, port: NicPort) -> str:
        """``mlx5_0`` for a single-port ibdev, ``mlx5_0:2`` when the ibdev has several ports."""
        multi = sum(1 for p in self.ports if p.name == port.name) > 1
        return port.key if multi else port.name

    def usable_ports(self) -> List[NicPort]:
        return [p for p in self.ports if p.usable]

    def distance(self, gpu: int, port: Union[str, NicPort]) -> str:
        key = port.key if isinstance(port, NicPort) else self.port(port).key
        return self.distances[(self.gpu(gpu).index, key)]

    def has_nvlink(self, a: int, b: int) -> bool:
        return a == b or (min(a, b), max(a, b)) in self.nvlink

    def nvlink_peers(self, gpu: int) -> List[int]:
        return [g.index for g in self.gpus if g.index != gpu and self.has_nvlink(gpu, g.index)]

    def nvlink_desc(self) -> str:
        n = len(self.gpus)
        full = n * (n - 1) // 2
        if n < 2:
            return "n/a"
        if len(self.nvlink) == full:
            return NVLINK_ALL
        if not self.nvlink:
            return "none"
        return "%d of %d GPU pairs" % (len(self.nvlink), full)

    def to_json(self) -> dict:
        """JSON-ready dict; the same shape is accepted back as a hand-written description (``gpus`` list)."""
        return {
            "name": self.name,
            "root": self.root,
            "nvlink": {"source": self.nvlink_source, "summary": self.nvlink_desc(),
                       "pairs": [list(p) for p in sorted(self.nvlink)]},
            "gpus": [{"index": g.index, "pci": g.pci, "numa": g.numa,
                      "nvlink": self.nvlink_peers(g.index),
                      "distances": {p.key: self.distances[(g.index, p.key)] for p in self.ports}}
                     for g in self.gpus],
            "nics": [{"name": p.name, "port": p.port, "pci": p.pci, "numa": p.numa, "state": p.state,
                      "phys_state": p.phys_state, "link_layer": p.link_layer, "rate": p.rate,
                      "rate_gbps": p.rate_gbps, "gid": p.gid, "netdev": p.netdev, "usable": p.usable,
                      "reason": p.reason, "detail": p.detail}
                     for p in self.ports],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        return "Topology(%d GPUs, %d NIC ports, %d usable, nvlink=%s)" % (
            len(self.gpus), len(self.ports), len(self.usable_ports()), self.nvlink_desc())


# --- sysfs reading ------------------------------------------------------------------------------------------
def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str, base: int = 0) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        log.warning("ignoring unparsable %s: %r", path, text)
        return None


def _resolve(root: str, path: str, _depth: int = 0) -> str:
    """``os.path.realpath`` inside ``root``: absolute symlink targets (from a copied tree) are re-rooted."""
    if _depth > 40:
        raise TopologyError("symlink loop under %s at %s" % (root, path))
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    cur = root
    for i, part in enumerate(parts):
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            target = os.readlink(nxt)
            if os.path.isabs(target):
                nxt = os.path.join(root, target.lstrip("/"))
            else:
                nxt = os.path.normpath(os.path.join(cur, target))
            if not (nxt + os.sep).startswith(root.rstrip(os.sep) + os.sep) and nxt != root:
                nxt = os.path.join(root, nxt.lstrip("/"))
            nxt = _resolve(root, nxt, _depth + 1)
        elif part == "..":
            nxt = os.path.dirname(cur)
        cur = nxt
    return cur


def _pci_location(root: str, devdir: str) -> Tuple[Optional[str], Tuple[str, ...]]:
    """(host bridge name, bridge BDFs from the host bridge down, excluding the device) of a resolved dir."""
    rel = os.path.relpath(devdir, root).split(os.sep)
    host_idx = None
    for i, comp in enumerate(rel):
        if _HOST_BRIDGE_RE.match(comp):
            host_idx = i
    if host_idx is None:
        return None, ()
    chain = [c.lower() for c in rel[host_idx + 1:] if _BDF_RE.match(c)]
    return rel[host_idx].lower(), tuple(chain[:-1])


def _gid_present(path: str) -> bool:
    text = _read(path)
    if not text:
        return False
    return any(ch not in "0:" for ch in text.strip())


def _port_netdev(root: str, ibdir: str, port: int, nports: int) -> Optional[str]:
    nd = _read(os.path.join(ibdir, "ports", str(port), "gid_attrs", "ndevs", "0"))
    if nd:
        return nd
    netdir = os.path.join(ibdir, "device", "net")
    try:
        names = sorted(os.listdir(_resolve(root, netdir)))
    except OSError:
        return None
    if not names:
        return None
    if len(names) == 1:
        return names[0]
    real = _resolve(root, netdir)
    for name in names:
        dev_port = _read_int(os.path.join(real, name, "dev_port"))
        if dev_port is not None and dev_port == port - 1:
            return name
    # Several netdevs and no dev_port files: assume the kernel's order follows the port numbers.
    return names[port - 1] if port - 1 < len(names) else None


def _class_code(pclass: int) -> int:
    """Base class + subclass (``0x0302``) of a PCI ``class`` value written as 24 bits (``0x030200``) or 16."""
    return pclass >> 8 if pclass > 0xFFFF else pclass


class _DeviceFinder:
    """Locates PCI functions inside ``sys/devices`` by walking it once, for trees whose ``sys/bus/pci/devices``
    entries or ibdev ``device`` entries are plain directories instead of symlinks."""

    def __init__(self, root: str):
        self.root = root
        self._pci: Optional[Dict[str, str]] = None
        self._ib: Dict[str, str] = {}

    def _walk(self) -> None:
        self._pci = {}
        base = os.path.join(self.root, "sys", "devices")
        for dirpath, dirnames, _ in os.walk(base):
            name = os.path.basename(dirpath)
            if _BDF_RE.match(name):
                self._pci.setdefault(name.lower(), dirpath)
            if name == "infiniband" and _BDF_RE.match(os.path.basename(os.path.dirname(dirpath))):
                for ib in dirnames:
                    self._ib.setdefault(ib, os.path.dirname(dirpath))

    def pci_dir(self, bdf: str) -> Optional[str]:
        if self._pci is None:
            self._walk()
        return self._pci.get(bdf.lower())  # type: ignore[union-attr]

    def ib_parent(self, ibdev: str) -> Optional[str]:
        if self._pci is None:
            self._walk()
        return self._ib.get(ibdev)


def _check_root(root: str) -> str:
    if not isinstance(root, (str, os.PathLike)) or not str(root):
        raise TopologyError("sysfs root must be a directory path, got %r" % (root,))
    root = os.path.abspath(os.fspath(root))
    if not os.path.exists(root):
        raise TopologyError("sysfs root %s does not exist" % root)
    if not os.path.isdir(root):
        raise TopologyError("sysfs root %s is not a directory" % root)
    if not os.access(root, os.R_OK | os.X_OK):
        raise TopologyError("sysfs root %s is not readable (permission denied)" % root)
    return root


def _listdir(path: str, what: str) -> List[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise TopologyError("cannot read %s %s: %s" % (what, path, e.strerror or e)) from None


def read_sysfs(root: str = "/") -> Tuple[List[Gpu], List[NicPort], List[str]]:
    """GPUs and NIC ports found under ``root`` (distances not yet computed), plus notes for the user."""
    root = _check_root(root)
    notes: List[str] = []
    pci_dir = os.path.join(root, "sys", "bus", "pci", "devices")
    ib_dir = os.path.join(root, "sys", "class", "infiniband")
    if root != "/" and not os.path.lexists(pci_dir) and not os.path.lexists(ib_dir):
        raise TopologyError("%s is not a sysfs tree: neither sys/bus/pci/devices nor sys/class/infiniband "
                            "exists under it" % root)
    finder = _DeviceFinder(root)
    gpus = _read_gpus(root, pci_dir, finder)
    ports: List[NicPort] = []
    for ibdev in _listdir(ib_dir, "InfiniBand class directory"):
        ports.extend(_read_ib_ports(root, ib_dir, ibdev, finder, notes))
    return gpus, ports, notes


def _read_gpus(root: str, pci_dir: str, finder: _DeviceFinder) -> List[Gpu]:
    """The NVIDIA GPUs among the PCI functions under ``pci_dir``, indexed in PCI address order."""
    gpu_found = []
    for bdf in _listdir(pci_dir, "PCI device directory"):
        if not _BDF_RE.match(bdf):
            continue
        dev = _resolve(root, os.path.join(pci_dir, bdf))
        vendor = _read_int(os.path.join(dev, "vendor"), 16)
        pclass = _read_int(os.path.join(dev, "class"), 16)
        if vendor != VENDOR_NVIDIA or pclass is None or _class_code(pclass) not in _GPU_CLASSES:
            continue
        numa = _read_int(os.path.join(dev, "numa_node"))
        host, bridges = _pci_location(root, dev)
        if host is None:
            dev = finder.pci_dir(bdf) or dev
            host, bridges = _pci_location(root, dev)
        gpu_found.append((bdf.lower(), -1 if numa is None else numa, host, bridges))
    gpu_found.sort(key=lambda t: _pci_key(t[0]))
    return [Gpu(i, pci, numa, host, bridges) for i, (pci, numa, host, bridges) in enumerate(gpu_found)]


def _read_ib_ports(root: str, ib_dir: str, ibdev: str, finder: _DeviceFinder, notes: List[str]) -> List[NicPort]:
    """The ports of RDMA device ``ibdev``; none (and a note) for a device that is not a PCI function."""
    ibdir = _resolve(root, os.path.join(ib_dir, ibdev))
    devlink = os.path.join(ibdir, "device")
    if not os.path.exists(devlink) and not os.path.islink(devlink):
        notes.append("%s has no PCI device (virtual RDMA device): skipped" % ibdev)
        return []
    dev = _resolve(root, devlink)
    pci = os.path.basename(dev).lower()
    if not _BDF_RE.match(pci) or _pci_location(root, dev)[0] is None:
        # Not a symlink into sys/devices (a hand-made tree): find the function that holds this ibdev.
        dev = finder.ib_parent(ibdev) or dev
        pci = os.path.basename(dev).lower()
    if not _BDF_RE.match(pci):
        notes.append("%s: device %s is not a PCI function: skipped" % (ibdev, pci))
        return []
    numa = _read_int(os.path.join(dev, "numa_node"))
    host, bridges = _pci_location(root, dev)
    port_nums = sorted(int(p) for p in _listdir(os.path.join(ibdir, "ports"), "ports directory") if p.isdigit())
    if not port_nums:
        notes.append("%s has no ports directory: skipped" % ibdev)
    ports = []
    for n in port_nums:
        pdir = os.path.join(ibdir, "ports", str(n))
        state = _read(os.path.join(pdir, "state")) or ""
        phys = _read(os.path.join(pdir, "phys_state")) or ""
        ll = _read(os.path.join(pdir, "link_layer")) or ""
        rate = _read(os.path.join(pdir, "rate")) or ""
        gid = _gid_present(os.path.join(pdir, "gids", "0"))
        reason, detail = port_verdict(state, phys, ll, gid)
        ports.append(NicPort(
            name=ibdev, port=n, pci=pci, numa=-1 if numa is None else numa, state=state,
            phys_state=phys, link_layer=ll, rate=rate, rate_gbps=_parse_rate(rate), gid=gid,
            netdev=_port_netdev(root, ibdir, n, len(port_nums)), host_bridge=host, bridges=bridges,
            usable=reason is None, reason=reason, detail=detail))
    return ports


def compute_distances(gpus: Sequence[Gpu], ports: Sequence[NicPort]) -> Dict[Tuple[int, str], str]:
    return {(g.index, p.key): pci_distance(g.host_bridge, g.bridges, g.numa, p.host_bridge, p.bridges, p.numa)
            for g in gpus for p in ports}


def _live_nvlink(gpus: Sequence[Gpu]) -> Optional[Tuple[set, str]]:
    """NVLink pairs of the live GPUs (indices of ``gpus``) from NVML, else torch peer access; None if neither
    can answer for every GPU."""
    by_pci = {g.pci: g.index for g in gpus}
    try:
        import pynvml  # type: ignore
        pynvml.nvmlInit()
        try:
            handles = {}
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = bus.decode() if isinstance(bus, bytes) else bus
                # NVML prints an 8-digit domain ("00000000:18:00.0"); sysfs uses 4.
                dom, rest = bus.lower().split(":", 1)
                pci = "%04x:%s" % (int(dom, 16), rest)
                if pci in by_pci:
                    handles[by_pci[pci]] = h
            if len(handles) == len(gpus):
                pairs = set()
                for a in handles:
                    for b in handles:
                        if a < b and pynvml.nvmlDeviceGetP2PStatus(
                                handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == \
                                pynvml.NVML_P2P_STATUS_OK:
                            pairs.add((a, b))
                return pairs, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML missing or failing is an expected case here, not an error
        log.debug("NVML NVLink query unavailable: %s", e)
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        idx = {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            pci = "%04x:%02x:%02x.0" % (getattr(props, "pci_domain_id", 0), getattr(props, "pci_bus_id", -1),
                                         getattr(props, "pci_device_id", 0))
            if pci in by_pci:
                idx[by_pci[pci]] = i
        if len(idx) != len(gpus):
            return None
        pairs = {(a, b) for a in idx for b in idx
                 if a < b and torch.cuda.can_device_access_peer(idx[a], idx[b])}
        return pairs, "torch"
    except Exception as e:
        log.debug("torch peer-access query unavailable: %s", e)
    return None


# --- overrides ----------------------------------------------------------------------------------------------
_NIC_FIELDS = {"name": str, "port": int, "pci": str, "numa": int, "state": str, "phys_state": str,
               "link_layer": str, "rate": str, "rate_gbps": (int, float, type(None)), "gid": bool,
               "netdev": (str, type(None)), "usable": bool, "reason": (str, type(None)), "detail": str}
_GPU_FIELDS = {"index": int, "pci": str, "numa": int, "nvlink": list, "distances": dict}
_TOP_FIELDS = {"name", "root", "nvlink", "gpus", "nics", "distances", "notes", "description"}
# Keys that `pxn topo --json` adds; accepted and ignored so its output can be edited and fed back.
_IGNORED_FIELDS = {"routes", "cap", "load", "hot_gpus", "message", "error", "expected", "gpu_rdma"}


@dataclass
class Override:
    """A validated override: ``describe`` is True when it describes the whole machine (``gpus`` list)."""

    source: str
    describe: bool
    data: dict = field(default_factory=dict)


def _fail(src: str, where: str, msg: str):
    raise TopologyError("override %s: %s: %s" % (src, where, msg))


def _check_fields(src, where, entry, fields, refusal):
    """``entry`` must be an object whose keys are in ``fields`` (key -> type), each value of its type."""
    _check_type(src, where, entry, dict)
    for k, v in entry.items():
        if k not in fields:
            _fail(src, "%s.%s" % (where, k), "%s; allowed: %s" % (refusal, sorted(fields)))
        _check_type(src, "%s.%s" % (where, k), v, fields[k])


def _check_type(src, where, value, typ):
    typs = typ if isinstance(typ, tuple) else (typ,)
    if isinstance(value, bool) and bool not in typs:
        ok = False
    else:
        ok = isinstance(value, typs)
    if not ok:
        names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
                 dict: "an object", type(None): "null"}
        want = " or ".join(names.get(t, t.__name__) for t in typs)
        _fail(src, where, "expected %s, got %s" % (want, json.dumps(value)))


def _check_class(src, where, value):
    if value not in CLASS_RANK:
        _fail(src, where, "distance class must be one of %s, got %r" % ("/".join(CLASSES), value))


def _check_nvlink(src, value, ngpus: Optional[int]):
    if isinstance(value, dict) and "pairs" in value:  # the shape to_json() writes
        value = value["pairs"]
    if value in (NVLINK_ALL, "none"):
        return value
    if isinstance(value, str):
        _fail(src, "nvlink", "expected \"all-to-all\", \"none\", a list of [a, b] GPU pairs or an object "
                             "{gpu: [peers]}, got %r" % value)
    pairs = []
    if isinstance(value, dict):
        for k, peers in value.items():
            if not str(k).isdigit():
                _fail(src, "nvlink.%s" % k, "key must be a GPU index, got %r" % k)
            _check_type(src, "nvlink.%s" % k, peers, list)
            for p in peers:
                _check_type(src, "nvlink.%s[]" % k, p, int)
                pairs.append((int(k), p))
    elif isinstance(value, list):
        for i, pair in enumerate(value):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int) and not isinstance(
                    x, bool) for x in pair)):
                _fail(src, "nvlink[%d]" % i, "expected a pair [a, b] of GPU indices, got %r" % (pair,))
            pairs.append((pair[0], pair[1]))
    else:
        _fail(src, "nvlink", "expected \"all-to-all\", \"none\" or a list of GPU pairs, got %r" % (value,))
    if ngpus is not None:
        for a, b in pairs:
            for x in (a, b):
                if not 0 <= x < ngpus:
                    _fail(src, "nvlink", "GPU %r is not in 0..%d" % (x, ngpus - 1))
    return pairs


def validate_override(data, source: str = "<dict>") -> Override:
    """Check an override / description dict and return it as an :class:`Override` (errors name the key)."""
    src = source
    if not isinstance(data, dict):
        _fail(src, "top level", "expected a JSON object, got %s" % type(data).__name__)
    if isinstance(data.get("gpus"), int) and "pcie_switches" in data:
        _fail(src, "gpus", "this is a topology spec for tests/sysfs_builder.py (gpus is a count), not an "
                           "override; build a sysfs tree from it and pass --sysfs instead")
    unknown = set(data) - _TOP_FIELDS - _IGNORED_FIELDS
    if unknown:
        _fail(src, "top level", "unknown key(s) %s; allowed: %s" % (sorted(unknown), sorted(_TOP_FIELDS)))
    describe = "gpus" in data
    ngpus = _check_description(src, data) if describe else _check_nic_patches(src, data)
    dist = data.get("distances", {})
    _check_type(src, "distances", dist, dict)
    for g, row in dist.items():
        if not str(g).isdigit():
            _fail(src, "distances.%s" % g, "key must be a GPU index, got %r" % g)
        if ngpus is not None and int(g) >= ngpus:
            _fail(src, "distances.%s" % g, "GPU %s is not in 0..%d" % (g, ngpus - 1))
        _check_type(src, "distances.%s" % g, row, dict)
        for nic, cls in row.items():
            _check_class(src, "distances.%s.%s" % (g, nic), cls)
    if "nvlink" in data:
        _check_nvlink(src, data["nvlink"], ngpus)
    return Override(source=src, describe=describe, data=data)


def _check_description(src: str, data: dict) -> int:
    """Check the ``gpus`` and ``nics`` lists of an override that describes a whole machine; returns the GPUs."""
    gpus = data["gpus"]
    _check_type(src, "gpus", gpus, list)
    ngpus = len(gpus)
    seen = set()
    for i, g in enumerate(gpus):
        where = "gpus[%d]" % i
        _check_fields(src, where, g, _GPU_FIELDS, "unknown key")
        if "pci" not in g:
            _fail(src, where, "missing \"pci\" (the GPU's PCI address, DDDD:BB:DD.F)")
        if not _BDF_RE.match(g["pci"]):
            _fail(src, where + ".pci", "not a PCI address DDDD:BB:DD.F: %r" % g["pci"])
        if g["pci"].lower() in seen:
            _fail(src, where + ".pci", "duplicate GPU PCI address %r" % g["pci"])
        seen.add(g["pci"].lower())
        for nic, cls in g.get("distances", {}).items():
            _check_class(src, "%s.distances.%s" % (where, nic), cls)
    order = sorted(range(ngpus), key=lambda i: _pci_key(gpus[i]["pci"]))
    for rank, i in enumerate(order):
        if "index" in gpus[i] and gpus[i]["index"] != rank:
            _fail(src, "gpus[%d].index" % i, "GPU index is the rank of its PCI address (%s -> %d), got %r"
                  % (gpus[i]["pci"], rank, gpus[i]["index"]))
    nics = data.get("nics", [])
    _check_type(src, "nics", nics, list)
    for i, n in enumerate(nics):
        where = "nics[%d]" % i
        _check_fields(src, where, n, _NIC_FIELDS, "unknown key")
        for req in ("name", "pci"):
            if req not in n:
                _fail(src, where, "missing %r" % req)
        if not _BDF_RE.match(n["pci"]):
            _fail(src, where + ".pci", "not a PCI address DDDD:BB:DD.F: %r" % n["pci"])
    return ngpus


def _check_nic_patches(src: str, data: dict) -> None:
    """Check the ``nics`` object of an override that patches discovered ports (GPUs come from sysfs: None)."""
    nics = data.get("nics", {})
    if isinstance(nics, list):
        _fail(src, "nics", "a list of NICs describes a whole machine and needs a \"gpus\" list too; to "
                           "patch discovered ports use an object {\"mlx5_0\": {\"usable\": false}}")
    _check_type(src, "nics", nics, dict)
    for name, patch in nics.items():
        where = "nics.%s" % name
        overridable = {k: t for k, t in _NIC_FIELDS.items() if k not in ("name", "port", "pci")}
        _check_fields(src, where, patch, overridable, "cannot override this key")


def load_override(path) -> Override:
    """Read and validate an override / machine description JSON file (schema: docs/README-topology.md)."""
    path = os.fspath(path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TopologyError("override %s: cannot read: %s" % (path, e.strerror or e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError("override %s: not valid JSON: %s at line %d column %d"
                            % (path, e.msg, e.lineno, e.colno)) from None
    return validate_override(data, path)


def _nvlink_pairs(value, n: int) -> set:
    if isinstance(value, dict) and "pairs" in value:
        value = value["pairs"]
    if value == NVLINK_ALL:
        return {(a, b) for a in range(n) for b in range(a + 1, n)}
    if value == "none":
        return set()
    if isinstance(value, dict):
        return {(int(k), p) for k, peers in value.items() for p in peers}
    return {tuple(p) for p in value}


def _match_ports(ports: Sequence[NicPort], name: str) -> List[NicPort]:
    if ":" in name:
        return [p for p in ports if p.key == name]
    return [p for p in ports if p.name == name]


def _apply_nic_fields(p: NicPort, fields: Mapping, src: str) -> NicPort:
    upd = {k: v for k, v in fields.items() if k in _NIC_FIELDS and k not in ("usable", "reason", "detail")}
    if "rate" in upd and "rate_gbps" not in upd:
        upd["rate_gbps"] = _parse_rate(upd["rate"])
    p = replace(p, **upd)
    reason, detail = port_verdict(p.state, p.phys_state, p.link_layer, p.gid)
    if fields.get("usable") is False:
        # A hand-disabled port keeps any physical reason; otherwise the override gives (or implies) one.
        reason = reason or fields.get("reason") or "disabled"
        detail = detail or fields.get("detail") or "disabled by override %s" % src
    elif fields.get("usable") is True and reason is not None:
        log.warning("override %s asks to use %s but it is unusable (%s: %s); keeping it unusable",
                    src, p.key, reason, detail)
    return replace(p, usable=reason is None, reason=reason, detail=detail)


def _describe(ov: Override) -> Topology:
    d = ov.data
    gl = sorted(d["gpus"], key=lambda g: _pci_key(g["pci"]))
    gpus = [Gpu(i, g["pci"].lower(), g.get("numa", -1)) for i, g in enumerate(gl)]
    ports = []
    for n in d.get("nics", []):
        base = NicPort(name=n["name"], port=n.get("port", 1), pci=n["pci"].lower(), numa=n.get("numa", -1),
                       state="ACTIVE", phys_state="LinkUp", link_layer="InfiniBand", gid=True)
        ports.append(_apply_nic_fields(base, n, ov.source))
    dist: Dict[Tuple[int, str], str] = {}
    byname = ports
    for i, g in enumerate(gl):
        for nic, cls in g.get("distances", {}).items():
            matched = _match_ports(byname, nic)
            if not matched:
                _fail(ov.source, "gpus[pci=%s].distances.%s" % (g["pci"], nic), "no such NIC in \"nics\"")
            for p in matched:
                dist[(i, p.key)] = cls
    _patch_distances(ov, dist, ports)
    nv = _nvlink_pairs(d.get("nvlink", NVLINK_ALL), len(gpus))
    return Topology(gpus, ports, dist, nv, nvlink_source="override" if "nvlink" in d else "assumed",
                    root=None, name=d.get("name"), notes=["machine described by %s" % ov.source])


def _patch_distances(ov: Override, dist: dict, ports: Sequence[NicPort]) -> None:
    for g, row in ov.data.get("distances", {}).items():
        for nic, cls in row.items():
            matched = _match_ports(ports, nic)
            if not matched:
                _fail(ov.source, "distances.%s.%s" % (g, nic), "no such NIC port on this machine")
            for p in matched:
                dist[(int(g), p.key)] = cls


def discover(root="/", override=None, live: Optional[bool] = None) -> Topology:
    """Discover the machine under sysfs ``root`` and apply ``override``.

    ``override`` is None, a path to a JSON file, a dict, or an :class:`Override`. An override with a ``gpus``
    list describes the whole machine and sysfs is not read. ``live`` (default: ``root == "/"``) allows asking
    NVML / torch for NVLink; otherwise NVLink is assumed all-to-all unless the override says otherwise.
    Raises :class:`TopologyError` (one line) for a missing / unreadable root or a bad override.
    """
    ov = override if override is None or isinstance(override, Override) else (
        validate_override(override) if isinstance(override, dict) else load_override(override))
    if ov is not None and ov.describe:
        topo = _describe(ov)
        log.info("topology from %s: %r", ov.source, topo)
        return topo
    root = _check_root(root)
    gpus, ports, notes = read_sysfs(root)
    if ov is not None:
        _patch_ports(ov, ports, len(gpus))
    dist = compute_distances(gpus, ports)
    if ov is not None:
        for g in ov.data.get("distances", {}):
            if int(g) >= len(gpus):
                _fail(ov.source, "distances.%s" % g, "GPU %s is not on this machine (%d GPUs)" % (g, len(gpus)))
        _patch_distances(ov, dist, ports)
    if live is None:
        live = root == "/"
    n = len(gpus)
    if ov is not None and "nvlink" in ov.data:
        nv, source = _nvlink_pairs(ov.data["nvlink"], n), "override"
    else:
        nv, source = _found_nvlink(gpus, live, notes)
    topo = Topology(gpus, ports, dist, nv, nvlink_source=source, root=root,
                    name=(ov.data.get("name") if ov else None), notes=notes)
    log.info("topology under %s: %r", root, topo)
    return topo


def _patch_ports(ov: Override, ports: List[NicPort], ngpus: int) -> None:
    """Apply an override's NIC patches to the discovered ``ports`` (in place) and check its NVLink pairs."""
    # GPUs are fixed by the tree; patches address NIC ports by name ("mlx5_0") or "mlx5_0:2".
    for name, patch in ov.data.get("nics", {}).items():
        matched = _match_ports(ports, name)
        if not matched:
            _fail(ov.source, "nics.%s" % name, "no such NIC port on this machine (have %s)"
                  % ", ".join(p.key for p in ports) if ports else "no such NIC port: no NIC found")
        for p in matched:
            ports[ports.index(p)] = _apply_nic_fields(p, patch, ov.source)
    if "nvlink" in ov.data:
        _check_nvlink(ov.source, ov.data["nvlink"], ngpus)


def _found_nvlink(gpus: Sequence[Gpu], live: bool, notes: List[str]) -> Tuple[set, str]:
    """(NVLink pairs, their source) without an override's: asked of NVML / torch when ``live``, else assumed."""
    n = len(gpus)
    found = _live_nvlink(gpus) if (live and n > 1) else None
    if found is not None:
        return found
    if live and n > 1:
        notes.append("NVLink could not be queried (no NVML / CUDA): assumed all-to-all; "
                     "set \"nvlink\" in an override if that is wrong")
    return {(a, b) for a in range(n) for b in range(a + 1, n)}, "assumed"


def synthetic(gpus: int, nic_gpus: Optional[Mapping[int, Union[str, Sequence[str]]]] = None,
              nvlink=NVLINK_ALL, numa: Optional[Mapping[int, int]] = None,
              link_layer: str = "Ethernet", rate_gbps: float = 100.0) -> Topology:
    """A made-up machine for tests and the engine on GPU-less / NIC-less hosts.

    ``gpus`` GPUs at PCI addresses ``0000:<0x10+i>:00.0``; ``nic_gpus`` maps a GPU index to the (loopback,
    ACTIVE, usable) NIC name(s) PIX-local to it, e.g. ``{0: ["mlx5_0"], 3: ["mlx5_1"]}``; every other GPU-NIC
    pair is NODE (SYS across ``numa`` nodes, a map GPU index -> NUMA node). ``nvlink`` as in an override.
    """
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise TopologyError("synthetic: gpus must be a count >= 0, got %r" % (gpus,))
    numa = dict(numa or {})
    glist = [Gpu(i, "0000:%02x:00.0" % (0x10 + i), numa.get(i, 0)) for i in range(gpus)]
    ports: List[NicPort] = []
    dist: Dict[Tuple[int, str], str] = {}
    for g, names in sorted((nic_gpus or {}).items()):
        if not isinstance(g, int) or not 0 <= g < gpus:
            raise TopologyError("synthetic: nic_gpus key %r is not a GPU in 0..%d" % (g, gpus - 1))
        for name in [names] if isinstance(names, str) else list(names):
            p = NicPort(name=name, port=1, pci="0000:%02x:00.%d" % (0x80 + len(ports) // 8, len(ports) % 8),
                        numa=numa.get(g, 0), state="4: ACTIVE", phys_state="5: LinkUp", link_layer=link_layer,
                        rate="%g Gb/sec" % rate_gbps, rate_gbps=rate_gbps, gid=True, netdev="lo")
            ports.append(p)
            dist[(g, p.key)] = "PIX"
    nv = _nvlink_pairs(_check_nvlink("synthetic", nvlink, gpus), gpus)
    return Topology(glist, ports, dist, nv, nvlink_source="synthetic", root=None, name="synthetic")
