"""Build sysfs-shaped trees (``<root>/sys/...``) from a machine spec, for topology and routing tests.

The spec is the format of the field machines' specs (``tests/data/h800_32port.json``) plus a few optional
keys of our own:

``gpus``                 GPU count; spec GPU g gets the g-th lowest PCI address (the builder checks this).
``numa_nodes``           ``{"0": {"gpus": [0, 1]}, ...}``; a switch's NICs get its first GPU's node.
``pcie_switches``        ``[{"gpu": 0 | "gpus": [0, 1], "nics": [...], "numa": n, "host_bridge": "hbA",
                         "switches": [<nested switch>, ...]}]``; a nested switch hangs off a downstream port
                         of its parent (two switch levels -> PXB).
``gpus_on_root_ports``   ``[1, 3]`` or ``[{"gpu": 1, "host_bridge": "hbA"}]``: GPUs without a switch.
``nics_on_root_ports``   ``["mlx5_9"]`` or ``[{"nic": "mlx5_9", "numa": 1, "host_bridge": "hbA"}]``.
``host_bridge``          entities naming the same host bridge share one root complex (-> PHB between them);
                         by default every top-level entity gets its own (-> NODE / SYS between them).
``nic_defaults``         ``state``, ``phys_state``, ``link_layer``, ``rate``, ``gid`` (bool), ``netdev``,
                         ``ports`` (ports per ibdev, default 1).
``nics_override``        per NIC name (or ``"name:port"``) the fields above.
``dual_port_cards``      when present, a switch's NICs are paired as functions .0/.1 of one card.
``layout``               ``"switch-ports"`` (default: root port -> upstream port -> downstream port -> device,
                         as real sysfs shows it) or ``"flat"`` (a switch is a single path component).
``numa_unknown``         write ``-1`` to every ``numa_node`` file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

BRIDGE_CLASS = "0x060400"
GPU_CLASS = "0x030200"
IB_CLASS = "0x020700"
ETH_CLASS = "0x020000"

DATA_DIR = Path(__file__).resolve().parent / "data"


def load_spec(name: str) -> dict:
    """A spec by file name, from ``tests/data/<name>``."""
    p = DATA_DIR / name
    if not p.exists():
        raise FileNotFoundError("spec %s not found in %s" % (name, DATA_DIR))
    return json.loads(p.read_text())


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


class _Builder:
    def __init__(self, root: Path, spec: dict):
        self.root = Path(root)
        self.spec = spec
        self.devices = self.root / "sys" / "devices"
        self.next_bus = 0
        self.layout = spec.get("layout", "switch-ports")
        if self.layout not in ("switch-ports", "flat"):
            raise ValueError("spec layout %r: expected switch-ports or flat" % self.layout)
        self.gpu_numa: Dict[int, int] = {}
        for node, info in (spec.get("numa_nodes") or {}).items():
            for g in info.get("gpus", []):
                self.gpu_numa[int(g)] = int(node)
        self.gpu_pci: Dict[int, str] = {}
        self.nic_pci: Dict[str, str] = {}
        self.host_bridges: Dict[str, tuple] = {}  # key -> (dir, root bus, next root port number)
        self.gid_serial = 0

    def bus(self) -> int:
        b = self.next_bus
        self.next_bus += 1
        if b > 0xFF:
            raise ValueError("spec needs more than 256 PCI buses")
        return b

    def numa(self, value: int) -> str:
        return "-1" if self.spec.get("numa_unknown") else str(value)

    # -- PCI nodes -------------------------------------------------------------------------------------------
    def bridge(self, parent: Path, bdf: str) -> Path:
        d = parent / bdf
        _write(d / "vendor", "0x8086")
        _write(d / "class", BRIDGE_CLASS)
        return d

    def endpoint(self, parent: Path, bdf: str, vendor: str, pclass: str, numa: int) -> Path:
        d = parent / bdf
        _write(d / "vendor", vendor)
        _write(d / "class", pclass)
        _write(d / "numa_node", self.numa(numa))
        _link(self.root / "sys" / "bus" / "pci" / "devices" / bdf, d)
        return d

    def root_port(self, hb_key: Optional[str]) -> Path:
        """A new root port (in a new host bridge unless ``hb_key`` names an existing one); returns its dir and
        leaves ``self.next_bus`` at its secondary bus."""
        if hb_key is None or hb_key not in self.host_bridges:
            rb = self.bus()
            hb = self.devices / ("pci0000:%02x" % rb)
            hb.mkdir(parents=True, exist_ok=True)
            state = [hb, rb, 1]
            if hb_key is not None:
                self.host_bridges[hb_key] = state  # type: ignore[assignment]
        else:
            state = self.host_bridges[hb_key]  # type: ignore[assignment]
        hb, rb, num = state
        state[2] = num + 1
        return self.bridge(hb, "0000:%02x:%02x.0" % (rb, num))

    # -- devices ---------------------------------------------------------------------------------------------
    def nic_fields(self, name: str) -> dict:
        f = dict(self.spec.get("nic_defaults") or {})
        f.update((self.spec.get("nics_override") or {}).get(name, {}))
        return f

    def nic(self, parent: Path, bdf: str, name: str, numa: int) -> None:
        f = self.nic_fields(name)
        ll = f.get("link_layer", "InfiniBand")
        dev = self.endpoint(parent, bdf, "0x15b3", ETH_CLASS if ll == "Ethernet" else IB_CLASS, numa)
        self.nic_pci[name] = bdf
        ib = dev / "infiniband" / name
        _link(ib / "device", dev)
        _link(self.root / "sys" / "class" / "infiniband" / name, ib)
        nports = int(f.get("ports", 1))
        netdevs = []
        for port in range(1, nports + 1):
            pf = dict(f)
            pf.update((self.spec.get("nics_override") or {}).get("%s:%d" % (name, port), {}))
            pdir = ib / "ports" / str(port)
            _write(pdir / "state", pf.get("state", "4: ACTIVE"))
            _write(pdir / "phys_state", pf.get("phys_state", "5: LinkUp"))
            _write(pdir / "link_layer", pf.get("link_layer", "InfiniBand"))
            _write(pdir / "rate", pf.get("rate", "400 Gb/sec (4X NDR)"))
            self.gid_serial += 1
            gid = ("fe80:0000:0000:0000:0a00:00ff:fe%02x:%04x" % (self.gid_serial >> 16 & 0xFF,
                                                                   self.gid_serial & 0xFFFF)
                   if pf.get("gid", True) else "0000:0000:0000:0000:0000:0000:0000:0000")
            _write(pdir / "gids" / "0", gid)
            nd = pf.get("netdev")
            if nd:
                netdevs.append((nd, port))
        for nd, port in netdevs:
            _write(dev / "net" / nd / "dev_port", str(port - 1))

    # -- structure -------------------------------------------------------------------------------------------
    def switch(self, parent: Path, sw: dict, numa: int) -> None:
        """Populate a switch whose upstream side hangs below ``parent`` (a root / downstream port)."""
        gpus = [sw["gpu"]] if "gpu" in sw else list(sw.get("gpus", []))
        numa = sw.get("numa", self.gpu_numa.get(gpus[0], numa) if gpus else numa)
        nics = list(sw.get("nics", []))
        cards: List[List[str]] = ([nics[i:i + 2] for i in range(0, len(nics), 2)]
                                  if self.spec.get("dual_port_cards") else [[n] for n in nics])
        children = ([("gpu", g) for g in gpus] + [("card", c) for c in cards]
                    + [("switch", s) for s in sorted(sw.get("switches", []), key=_min_gpu)])
        if self.layout == "switch-ports":
            up = self.bridge(parent, "0000:%02x:00.0" % self.bus())
            internal = self.bus()
            for slot, (kind, item) in enumerate(children):
                down = self.bridge(up, "0000:%02x:%02x.0" % (internal, slot))
                self.place(down, kind, item, numa)
        else:
            sb = self.bus()
            sdir = self.bridge(parent, "0000:%02x:00.0" % sb)
            own = self.bus()
            for slot, (kind, item) in enumerate(children):
                if kind == "gpu":
                    self.endpoint(sdir, "0000:%02x:%02x.0" % (own, slot), "0x10de", GPU_CLASS,
                                  self.gpu_numa.get(item, 0))
                    self.gpu_pci[item] = "0000:%02x:%02x.0" % (own, slot)
                elif kind == "card":
                    for fn, name in enumerate(item):
                        self.nic(sdir, "0000:%02x:%02x.%d" % (own, slot, fn), name, numa)
                else:
                    self.switch(sdir, item, numa)

    def place(self, port: Path, kind: str, item, numa: int) -> None:
        """Put a GPU, a NIC card or a switch below a root / downstream port."""
        if kind == "switch":
            self.switch(port, item, numa)
            return
        bus = self.bus()
        if kind == "gpu":
            bdf = "0000:%02x:00.0" % bus
            self.endpoint(port, bdf, "0x10de", GPU_CLASS, self.gpu_numa.get(item, 0))
            self.gpu_pci[item] = bdf
        else:
            for fn, name in enumerate(item):
                self.nic(port, "0000:%02x:00.%d" % (bus, fn), name, numa)

    def build(self) -> dict:
        ents = []
        for sw in self.spec.get("pcie_switches", []):
            ents.append((_min_gpu(sw), "switch", sw, sw.get("host_bridge")))
        for g in self.spec.get("gpus_on_root_ports", []):
            item = g if isinstance(g, dict) else {"gpu": g}
            ents.append((item["gpu"], "gpu", item["gpu"], item.get("host_bridge")))
        for n in self.spec.get("nics_on_root_ports", []):
            item = n if isinstance(n, dict) else {"nic": n}
            ents.append((10 ** 6, "card", item, item.get("host_bridge")))
        ents.sort(key=lambda e: e[0])
        for _, kind, item, hb in ents:
            rp = self.root_port(hb)
            if kind == "card":
                numa = item.get("numa", 0)
                self.place(rp, "card", [item["nic"]], numa)
            elif kind == "gpu":
                self.place(rp, "gpu", item, self.gpu_numa.get(item, 0))
            else:
                self.switch(rp, item, 0)
        (self.root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        (self.root / "sys" / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        n = int(self.spec.get("gpus", len(self.gpu_pci)))
        if sorted(self.gpu_pci) != list(range(n)):
            raise ValueError("spec places GPUs %s, expected 0..%d" % (sorted(self.gpu_pci), n - 1))
        ranked = sorted(self.gpu_pci, key=lambda g: self.gpu_pci[g])
        if ranked != list(range(n)):
            raise ValueError("spec GPU order %s does not follow PCI address order" % ranked)
        return {"gpus": dict(self.gpu_pci), "nics": dict(self.nic_pci)}


def _min_gpu(sw: dict) -> int:
    gpus = ([sw["gpu"]] if "gpu" in sw else list(sw.get("gpus", [])))
    gpus += [_min_gpu(s) for s in sw.get("switches", [])]
    return min(gpus) if gpus else 10 ** 6


def build_tree(root: Union[str, Path], spec: Union[dict, str]) -> dict:
    """Write the sysfs tree of ``spec`` (a dict or a spec file name for :func:`load_spec`) under ``root``.
    Returns ``{"gpus": {index: pci}, "nics": {name: pci}}``."""
    if isinstance(spec, str):
        spec = load_spec(spec)
    return _Builder(Path(root), spec).build()
