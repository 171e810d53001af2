"""``pxn topo``: GPUs, NIC ports, distance classes and each GPU's rails, on one screen or as JSON.

Exit codes: 0 (shown; also a machine with no GPU and no NIC, which is said plainly), 2 (bad sysfs root or
override, a ``--hot`` GPU the machine does not have, or GPUs but no usable NIC port: one line on stderr, no
traceback).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from transport.routing import DIRECT, RELAY, Routes, RoutingError, plan_routes
from transport.topology import Topology, TopologyError, discover

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sysfs", metavar="ROOT", default="/",
                        help="directory holding sys/ (default /: this machine); a copied or generated tree "
                             "is read the same way")
    parser.add_argument("--override", metavar="FILE", default=None,
                        help="JSON that patches the discovered machine or describes one by hand "
                             "(schema: docs/README-topology.md)")
    parser.add_argument("--hot", metavar="GPU", type=int, action="append", default=[],
                        help="spread this GPU's traffic over other GPUs' NICs through NVLink (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the screen")
    parser.add_argument("-v", "--verbose", action="store_true", help="log discovery details to stderr")


def _matrix(topo: Topology) -> List[str]:
    gpus, ports = topo.gpus, topo.ports
    head = ["", *("GPU%d" % g.index for g in gpus), *("NIC%d" % i for i in range(len(ports))), "NUMA"]
    rows = [head]
    for g in gpus:
        row = ["GPU%d" % g.index]
        for h in gpus:
            row.append("X" if h.index == g.index else ("NV" if topo.has_nvlink(g.index, h.index) else "-"))
        row += [topo.distances[(g.index, p.key)] for p in ports]
        row.append(str(g.numa) if g.numa >= 0 else "?")
        rows.append(row)
    width = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return ["  ".join(cell.ljust(width[c]) for c, cell in enumerate(r)).rstrip() for r in rows]


def _screen(topo: Topology, routes: Optional[Routes], root: str) -> str:
    out: List[str] = []
    usable = topo.usable_ports()
    where = topo.root or "(described by override)"
    out.append("pxn topo: %s: %d GPU(s), %d NIC port(s), %d usable; NVLink: %s (%s)"
               % (where, len(topo.gpus), len(topo.ports), len(usable), topo.nvlink_desc(), topo.nvlink_source))
    out.append("")
    if topo.gpus or topo.ports:
        out.extend(_matrix(topo))
        out.append("")
        out.append("Legend: X = self, NV = NVLink, - = no NVLink; PIX = at most one PCIe switch, PXB = several "
                   "PCIe bridges, PHB = PCIe host bridge, NODE = across host bridges in a NUMA node, "
                   "SYS = across NUMA nodes")
    if topo.ports:
        out.extend(_ports_lines(topo, usable))
    if topo.gpus and topo.ports:
        out.extend(_gpu_rdma_lines(topo, root))
    if routes is not None and routes.gpus:
        out.extend(_routes_lines(topo, routes))
    notes = list(topo.notes) + (list(routes.notes) if routes is not None else [])
    for n in notes:
        out.append("Note: %s" % n)
    return "\n".join(out)


def _ports_lines(topo: Topology, usable) -> List[str]:
    """The screen's NIC port table, then which ports are usable and why the others are not."""
    out = ["", "NIC ports:"]
    rows = [["", "name", "port", "pci", "numa", "state", "phys_state", "link", "rate", "GID", "netdev",
             "usable"]]
    for i, p in enumerate(topo.ports):
        rows.append(["NIC%d" % i, p.name, str(p.port), p.pci, str(p.numa) if p.numa >= 0 else "?",
                     _word(p.state), _word(p.phys_state), p.link_layer or "?",
                     "%gG" % p.rate_gbps if p.rate_gbps else "?", "yes" if p.gid else "no",
                     p.netdev or "-", "yes" if p.usable else "NO: " + (p.reason or "?")])
    width = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out.extend("  " + "  ".join(c.ljust(width[k]) for k, c in enumerate(r)).rstrip() for r in rows)
    out.append("")
    out.append("Usable: %s" % (", ".join(topo.label(p) for p in usable) if usable else "none"))
    active = [p for p in topo.ports if not p.usable and p.reason != "down"]
    for p in active:
        out.append("Unusable: %s: %s (%s)" % (topo.label(p), p.reason, p.detail))
    down = [topo.label(p) for p in topo.ports if p.reason == "down"]
    if down:
        out.append("Down (state not ACTIVE or phys_state not LinkUp): %d port(s): %s" % (len(down), _short(down)))
    return out


def _gpu_rdma_lines(topo: Topology, root: str) -> List[str]:
    """The screen's GPUDirect section: one line per answer, with the GPUs it holds for."""
    out = ["", "GPU memory for RDMA (GPUDirect: how each GPU's memory can be registered with each NIC):"]
    said = {}  # the answer -> GPUs it holds for (GPUs alike are printed once)
    for g, rows in _gpu_rdma(topo, root):
        ok = sorted({how for _, can, how in rows if can})
        no = sorted({how for _, can, how in rows if not can})
        answer = "; ".join(
            ["%s with %s" % (how, _short([n for n, can, h in rows if can and h == how])) for how in ok]
            + ["NO with %s: %s" % (_short([n for n, can, h in rows if not can and h == why]), why)
               for why in no])
        said.setdefault(answer, []).append("GPU%d" % g.index)
    out.extend("  %s: %s" % (_short(gpus), answer) for answer, gpus in said.items())
    return out


def _routes_lines(topo: Topology, routes: Routes) -> List[str]:
    """The screen's routes: each GPU's rails, then the first-rail load."""
    out = ["", "Routes (first rail first; at most %d GPU(s) per port as first rail where possible):" % routes.cap]
    for g in routes.gpus:
        out.append("  GPU%d -> %s" % (g, "; ".join(_rail_text(topo, g, r) for r in routes.rails(g))))
    load = routes.load()
    out.append("First-rail load: %s" % ", ".join("%s=%d" % (topo.label(topo.port(k)), v)
                                                 for k, v in load.items() if v))
    return out


def _rail_text(topo: Topology, g: int, r) -> str:
    """One rail of GPU ``g`` as the screen says it, by its kind."""
    label = topo.label(topo.port(r.nic, r.port))
    if r.kind == DIRECT:
        return "%s direct (%s)" % (label, r.distance)
    if r.kind == RELAY:
        return "%s via GPU%d over NVLink (%s)" % (label, r.relay_gpu, r.distance)
    return "%s FALLBACK %s%s" % (label, r.distance, "" if r.relay_gpu == g else " via GPU%d" % r.relay_gpu)


def _gpu_rdma(topo: Topology, root: str):
    """Per GPU, per NIC device: (NIC label, whether its memory can be registered with it, how or why not)."""
    from transport.fabric.verbs_gpu import gpu_rdma_support
    out = []
    for g in topo.gpus:
        rows = []
        for p in topo.ports:
            can, how = gpu_rdma_support(pci=g.pci, sysfs_root=root, nic=p.name)
            rows.append((topo.label(p), can, how))
        out.append((g, rows))
    return out


def _word(state: str) -> str:
    return state.split(":", 1)[1].strip() if ":" in state else (state or "?")


def _short(keys: List[str]) -> str:
    return ", ".join(keys) if len(keys) <= 8 else "%s, ... %s" % (", ".join(keys[:6]), keys[-1])


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        # Warnings are already on the screen as "Note:" lines; -v adds the discovery log on stderr.
        logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.ERROR,
                            stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    root = getattr(args, "sysfs", "/") or "/"
    hot = getattr(args, "hot", None) or []
    bad = [h for h in hot if h < 0]
    if bad:
        print("pxn topo: error: --hot %d: GPU indices start at 0" % bad[0], file=sys.stderr)
        return 2
    try:
        topo = discover(root, override=getattr(args, "override", None))
    except TopologyError as e:
        print("pxn topo: error: %s" % e, file=sys.stderr)
        return 2
    missing = [h for h in hot if h >= len(topo.gpus)]
    if missing:
        print("pxn topo: error: --hot %d: no such GPU (%s)" % (
            missing[0], "GPUs 0..%d" % (len(topo.gpus) - 1) if topo.gpus else "no GPU found under %s"
            % (topo.root or root)), file=sys.stderr)
        return 2
    as_json = getattr(args, "json", False)
    if not topo.gpus and not topo.ports:
        msg = "no GPU and no RDMA NIC found under %s: nothing to route" % (topo.root or root)
        if as_json:
            doc = topo.to_json()
            doc.update({"routes": [], "message": msg})
            print(json.dumps(doc, indent=2))
        else:
            print("pxn topo: %s" % msg)
        return 0
    error = None
    routes = None
    try:
        routes = plan_routes(topo, hot_gpus=getattr(args, "hot", None) or ())
    except RoutingError as e:
        error = str(e)
    if as_json:
        print(json.dumps(_json_doc(topo, routes, error, root), indent=2))
    else:
        print(_screen(topo, routes, root))
        if not topo.gpus:
            print("No GPU found: nothing to route.")
    if error is not None:
        print("pxn topo: error: %s" % error, file=sys.stderr)
        return 2
    return 0


def _json_doc(topo: Topology, routes: Optional[Routes], error: Optional[str], root: str) -> dict:
    """``--json``'s document: the machine, GPUDirect per GPU and NIC, then the routes or the error."""
    doc = topo.to_json()
    if topo.ports:
        doc["gpu_rdma"] = [{"gpu": g.index, "nics": [{"nic": label, "registrable": can, "how": how}
                                                    for label, can, how in rows]}
                           for g, rows in _gpu_rdma(topo, root)]
    if routes is not None:
        doc.update(routes.to_json())
        doc["notes"] = list(topo.notes) + list(routes.notes)
    else:
        doc["routes"] = []
        doc["error"] = error
    if not topo.gpus:
        doc["message"] = "no GPU: nothing to route"
    return doc


def main(argv=None) -> int:
    """``python -m transport.topo_cli`` (same as ``pxn topo``)."""
    parser = argparse.ArgumentParser(prog="pxn topo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
