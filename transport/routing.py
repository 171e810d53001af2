"""Routing: for every GPU an ordered list of rails (NIC port + the GPU that feeds it).

Rules, in priority order (see ``docs/README-topology.md``):

1. Only usable ports are rails (:attr:`NicPort.usable`; the topology says why the others are not).
2. A GPU's own PIX/PXB-local ports are *direct* rails (``relay_gpu == gpu``). A GPU without one reaches a port
   *through an NVLink peer* that is PIX/PXB-local to it (``relay_gpu`` = that peer). A NODE/SYS/PHB PCIe path
   is used only when no such relay exists (a *fallback* rail, logged and listed in :attr:`Routes.notes`).
3. Balance: the first rails are spread so that no usable port is the first rail of more than
   ``ceil(GPUs / usable ports)`` GPUs when the topology allows it; an over-full port costs less than falling
   back to a PCIe path, but more than relaying over NVLink instead of using a direct port.
4. Among relays: a relay GPU on the source GPU's NUMA node first, then PIX before PXB, then the nearest index.

The first rail is chosen by one minimum-cost assignment of GPUs to (port, k-th user) slots, so the result is
globally balanced and deterministic. After the first rail come the other ports the same feeding GPU reaches
locally (both ports of a dual-port card), then, for a GPU moved off its own port by balancing, its own direct
ports. ``hot_gpus`` get every other reachable port appended as relayed rails (PXN spreading).
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from transport.errors import RoutingError, TopologyError
from transport.topology import (CLASS_RANK, LOCAL_CLASSES, NicPort, Topology, discover, load_override,  # noqa
                                port_sort_key, synthetic)

# Re-exported so the engine needs one import: discover / load_override / synthetic build the Topology.
__all__ = ["Rail", "Routes", "RoutingError", "plan_routes", "DIRECT", "RELAY", "FALLBACK", "Topology", "NicPort",
           "TopologyError", "discover", "load_override", "synthetic"]

log = logging.getLogger(__name__)

DIRECT, RELAY, FALLBACK = "direct", "relay", "fallback"


@dataclass(frozen=True)
class Rail:
    """One way out of the machine for a GPU's data: the NIC port ``nic``/``port`` fed by ``relay_gpu`` (the
    GPU itself for a direct rail, else an NVLink peer); ``distance`` is the PCIe class between ``relay_gpu``
    and the port; ``kind`` is ``direct``, ``relay`` or ``fallback``."""

    nic: str
    port: int
    relay_gpu: int
    distance: str
    kind: str = DIRECT

    @property
    def key(self) -> str:
        return "%s:%d" % (self.nic, self.port)

    def to_json(self) -> dict:
        return {"nic": self.nic, "port": self.port, "relay_gpu": self.relay_gpu, "distance": self.distance,
                "kind": self.kind}


# Cost scale of the assignment (integers, so ties break the same way every run). Each tier dominates the next.
_C_FALLBACK = 10 ** 9      # + class rank * 10**8: a PCIe path across a host bridge / socket
_C_OVERCAP = 10 ** 6       # per GPU beyond ceil(GPUs / ports) on one port
_C_RELAY = 10 ** 5         # NVLink hop instead of a local port
_C_NUMA = 4 * 10 ** 4      # relay GPU on another NUMA node than the source GPU
_C_PXB = 10 ** 4           # PXB instead of PIX
_C_GPU_GAP = 100           # per index between source and relay GPU (nearest peer on ties)


def _hungarian(cost: List[List[int]]) -> List[int]:
    """Min-cost assignment of every row to a distinct column (rows <= columns); returns column per row."""
    n, m = len(cost), len(cost[0])
    INF = float("inf")
    u, v = [0] * (n + 1), [0] * (m + 1)
    p, way = [0] * (m + 1), [0] * (m + 1)
    for i in range(1, n + 1):
        p[0] = i
        j0 = 0
        minv = [INF] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], INF, 0
            row = cost[i0 - 1]
            for j in range(1, m + 1):
                if not used[j]:
                    cur = row[j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    out = [-1] * n
    for j in range(1, m + 1):
        if p[j]:
            out[p[j] - 1] = j - 1
    return out


class Routes:
    """Each GPU's ordered rails. Thread-safe: :meth:`pick_port` keeps a per-GPU round-robin counter."""

    def __init__(self, topology: Topology, rails: Dict[int, List[Rail]], cap: int, notes: Sequence[str] = (),
                 hot_gpus: Iterable[int] = ()):
        self.topology = topology
        self._rails = {g: list(r) for g, r in rails.items()}
        self.cap = cap
        self.notes: List[str] = list(notes)
        self.hot_gpus = tuple(sorted(set(hot_gpus)))
        self._lock = threading.Lock()
        self._rr: Dict[Tuple[int, Tuple[str, ...]], itertools.count] = {}

    @property
    def gpus(self) -> List[int]:
        return sorted(self._rails)

    def _check_gpu(self, gpu) -> int:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu not in self._rails:
            raise RoutingError("no route for GPU %r: this machine has GPUs %s" % (gpu, self.gpus))
        return gpu

    def rails(self, gpu: int) -> List[Rail]:
        """The GPU's rails, best first (a copy)."""
        return list(self._rails[self._check_gpu(gpu)])

    def first_rail(self, gpu: int) -> Rail:
        return self._rails[self._check_gpu(gpu)][0]

    def primary_rails(self, gpu: int) -> List[Rail]:
        """The first rail's group: the rails fed by the same GPU in the same way (a GPU's direct ports, both
        ports of a dual-port card; for a GPU that balancing moved onto a relay, that relay's ports), never
        the extra rails of a hot GPU. :meth:`pick_port` round-robins over these by default."""
        rails = self._rails[self._check_gpu(gpu)]
        head = rails[0]
        return [r for r in rails
                if r.kind == head.kind and (r.relay_gpu == head.relay_gpu or head.kind == FALLBACK)]

    def load(self) -> Dict[str, int]:
        """``"nic:port"`` -> number of GPUs whose first rail it is (usable ports only)."""
        out = {p.key: 0 for p in self.topology.usable_ports()}
        for g in self._rails:
            out[self._rails[g][0].key] += 1
        return out

    def pick_port(self, gpu: int, peer_preferred=None) -> Rail:
        """Exactly one valid local rail for one write from ``gpu``.

        ``peer_preferred`` is what the peer advertised: None, a NIC name (``"mlx5_3"``, ``"mlx5_3:1"``), a
        comma/space separated string of names, or a list of names (anything else in it is ignored). Rails
        of this GPU whose NIC has one of those names (same-named NIC = same rail of a rail-optimized fabric)
        are used in turn; otherwise the GPU's primary rails (its direct ports, both ports of a dual-port card)
        are used in turn. Never raises for what the peer sent.
        """
        rails = self._rails[self._check_gpu(gpu)]
        wanted = _preferred_names(peer_preferred)
        chosen: List[Rail] = []
        if wanted:
            for r in rails:
                if r.nic in wanted or r.key in wanted:
                    chosen.append(r)
        if not chosen:
            chosen = self.primary_rails(gpu)
        sig = (gpu, tuple(r.key for r in chosen))
        with self._lock:
            counter = self._rr.setdefault(sig, itertools.count())
            n = next(counter)
        return chosen[n % len(chosen)]

    def to_json(self) -> dict:
        return {"routes": [{"gpu": g, "rails": [r.to_json() for r in self._rails[g]]} for g in self.gpus],
                "cap": self.cap, "load": self.load(), "hot_gpus": list(self.hot_gpus), "notes": list(self.notes)}

    def __repr__(self) -> str:
        return "Routes(%s)" % ", ".join("GPU%d->%s" % (g, self._rails[g][0].key) for g in self.gpus)


def _preferred_names(value) -> frozenset:
    if value is None:
        return frozenset()
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        items = value.replace(",", " ").split()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = []
        for v in value:
            if isinstance(v, (bytes, bytearray)):
                v = v.decode("utf-8", "replace")
            if isinstance(v, str):
                items.extend(v.replace(",", " ").split())
            else:
                log.debug("ignoring non-string preferred NIC %r", v)
    else:
        log.debug("ignoring preferred NIC value of type %s", type(value).__name__)
        return frozenset()
    return frozenset(items)


def _local(topo: Topology, gpu: int, port: NicPort) -> bool:
    return topo.distances[(gpu, port.key)] in LOCAL_CLASSES


def _best_feeder(topo: Topology, g: int, port: NicPort) -> Tuple[int, int, str, str]:
    """(cost, feeding GPU, distance, kind) of the cheapest way for GPU ``g`` to reach ``port``."""
    gpus = {x.index: x for x in topo.gpus}
    d = topo.distances[(g, port.key)]
    if d in LOCAL_CLASSES:
        return (_C_PXB if d == "PXB" else 0), g, d, DIRECT
    best = None
    for r in topo.nvlink_peers(g):
        dr = topo.distances[(r, port.key)]
        if dr not in LOCAL_CLASSES:
            continue
        numa_g, numa_r = gpus[g].numa, gpus[r].numa
        cost = (_C_RELAY + (_C_NUMA if (numa_g >= 0 and numa_r >= 0 and numa_g != numa_r) else 0)
                + (_C_PXB if dr == "PXB" else 0) + _C_GPU_GAP * abs(g - r))
        if best is None or cost < best[0]:
            best = (cost, r, dr, RELAY)
    if best is not None:
        return best
    # No local way: the best PCIe class from the GPU itself or from an NVLink peer (itself wins ties).
    best = (_C_FALLBACK + CLASS_RANK[d] * 10 ** 8, g, d, FALLBACK)
    for r in topo.nvlink_peers(g):
        dr = topo.distances[(r, port.key)]
        cost = _C_FALLBACK + CLASS_RANK[dr] * 10 ** 8 + _C_GPU_GAP * abs(g - r) + 1
        if cost < best[0]:
            best = (cost, r, dr, FALLBACK)
    return best


def plan_routes(topology: Topology, hot_gpus: Iterable[int] = ()) -> Routes:
    """Plan every GPU's rails. Raises :class:`RoutingError` when the machine has GPUs but no usable port, or
    ``hot_gpus`` names a GPU it does not have. A machine without GPUs gets empty routes."""
    topo = topology
    hot = list(hot_gpus or ())
    n = len(topo.gpus)
    for h in hot:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n:
            raise RoutingError("hot GPU %r is not on this machine (GPUs 0..%d)" % (h, n - 1))
    if n == 0:
        return Routes(topo, {}, 0, ["no GPU: nothing to route"])
    ports = topo.usable_ports()
    if not ports:
        raise _no_port_error(topo, n)
    cap = math.ceil(n / len(ports))
    feeders = {(g.index, p.key): _best_feeder(topo, g.index, p) for g in topo.gpus for p in ports}
    # Columns: slot k (0-based) of every port; slot k beyond the cap costs more, so load spreads out.
    cols = [(pi, k) for pi in range(len(ports)) for k in range(n)]
    cost = [[feeders[(g.index, ports[pi].key)][0] + _C_OVERCAP * max(0, k + 1 - cap) + pi
             for (pi, k) in cols] for g in topo.gpus]
    assign = _hungarian(cost)
    notes: List[str] = []
    rails: Dict[int, List[Rail]] = {}
    for g in topo.gpus:
        first_port = ports[cols[assign[g.index]][0]]
        if feeders[(g.index, first_port.key)][3] == FALLBACK:
            rails[g.index] = _fallback_rails(topo, g.index, first_port, ports, feeders, notes)
        else:
            rails[g.index] = _local_rails(topo, g.index, first_port, ports, feeders, notes)
    load: Dict[str, int] = {p.key: 0 for p in ports}
    for g in rails:
        load[rails[g][0].key] += 1
    for p in ports:
        if load[p.key] > cap:
            notes.append("%s is the first rail of %d GPUs (more than ceil(%d GPUs / %d ports) = %d): no "
                         "other PIX/PXB-local port is in NVLink reach of them"
                         % (topo.label(p), load[p.key], n, len(ports), cap))
    for h in sorted(set(hot)):
        extra = _hot_rails(topo, h, rails[h], ports, feeders, load)
        rails[h].extend(extra)
        log.info("hot GPU%d: %d rails (%d extra relayed)", h, len(rails[h]), len(extra))
    routes = Routes(topo, rails, cap, notes, hot)
    log.info("routes: %r", routes)
    return routes


def _no_port_error(topo: Topology, n: int) -> RoutingError:
    """The error for a machine with ``n`` GPUs and no usable port: each reason with the ports it rules out."""
    why: Dict[str, List[str]] = {}
    for p in topo.ports:
        why.setdefault(p.reason or "?", []).append(topo.label(p))
    summary = "; ".join("%s: %s" % (r, ", ".join(ks) if len(ks) <= 4 else "%s ... (%d ports)"
                                    % (", ".join(ks[:3]), len(ks))) for r, ks in sorted(why.items()))
    return RoutingError("no usable NIC port for %d GPU(s): %s" % (n, summary if topo.ports else "no RDMA NIC found"))


def _fallback_rails(topo: Topology, g: int, first_port: NicPort, ports, feeders, notes: List[str]) -> List[Rail]:
    """Rails of GPU ``g`` whose first rail is a PCIe fallback: only ports as good as the first, since striping
    onto a worse PCIe class would slow every transfer."""
    _, feeder, dist, kind = feeders[(g, first_port.key)]
    out = [Rail(first_port.name, first_port.port, feeder, dist, kind)]
    for p in ports:
        c, f, d, k = feeders[(g, p.key)]
        if p is not first_port and d == dist:
            out.append(Rail(p.name, p.port, f, d, k))
    msg = ("GPU%d has no PIX/PXB NIC port and no NVLink peer with one: falling back to a %s PCIe "
           "path to %s" % (g, dist, topo.label(first_port)))
    log.warning(msg)
    notes.append(msg)
    return out


def _local_rails(topo: Topology, g: int, first_port: NicPort, ports, feeders, notes: List[str]) -> List[Rail]:
    """Rails of GPU ``g`` whose first rail is direct or relayed: the feeding GPU's other local ports, then, for a
    relayed GPU, its own local ports last as direct rails, never twice."""
    _, feeder, dist, kind = feeders[(g, first_port.key)]
    out = [Rail(first_port.name, first_port.port, feeder, dist, kind)]
    local = sorted((p for p in ports if p is not first_port and _local(topo, feeder, p)
                    and (kind == DIRECT or not _local(topo, g, p))),
                   key=lambda p: (CLASS_RANK[topo.distances[(feeder, p.key)]], port_sort_key(p)))
    for p in local:
        out.append(Rail(p.name, p.port, feeder, topo.distances[(feeder, p.key)], kind))
    if kind == RELAY:
        own = sorted((p for p in ports if _local(topo, g, p)),
                     key=lambda p: (CLASS_RANK[topo.distances[(g, p.key)]], port_sort_key(p)))
        if own:
            notes.append("GPU%d relays through GPU%d to %s to balance ports (its own: %s)"
                         % (g, feeder, topo.label(first_port), ", ".join(topo.label(p) for p in own)))
        for p in own:
            out.append(Rail(p.name, p.port, g, topo.distances[(g, p.key)], DIRECT))
    return out


def _hot_rails(topo: Topology, h: int, rails: List[Rail], ports, feeders, load: Dict[str, int]) -> List[Rail]:
    """The extra rails of hot GPU ``h`` (PXN spreading): every other port it reaches without a PCIe fallback,
    relay GPUs on its NUMA node first, then the least loaded ports, then the cheapest ways."""
    numa = {x.index: x.numa for x in topo.gpus}
    have = {r.key for r in rails}
    extra = []
    for p in ports:
        if p.key in have:
            continue
        c, f, d, k = feeders[(h, p.key)]
        if k == FALLBACK:
            continue
        cross = numa[h] >= 0 and numa[f] >= 0 and numa[h] != numa[f]
        extra.append(((cross, load[p.key], c, port_sort_key(p)), Rail(p.name, p.port, f, d, k)))
    return [r for _, r in sorted(extra, key=lambda t: t[0])]
