"""Routing on generated machines: exact routes for the shared hosts and our own shapes, invariants on random
machines, port picking for a peer's preferred NICs (the two-NIC field bug), hot-GPU spreading."""
from __future__ import annotations

import json
import math
import random
import threading
from collections import Counter
from pathlib import Path

import pytest

from transport.routing import (DIRECT, FALLBACK, RELAY, Rail, Routes, RoutingError, plan_routes)
from transport.topology import LOCAL_CLASSES, discover, synthetic
from sysfs_builder import build_tree, load_spec


def routes_of(tmp_path: Path, spec, override=None, hot=(), **changes) -> Routes:
    if isinstance(spec, str):
        spec = load_spec(spec)
    root = tmp_path / ("root%d" % len(list(tmp_path.glob("root*"))))
    build_tree(root, dict(spec, **changes))
    return plan_routes(discover(root, override=override), hot_gpus=hot)


def brief(routes: Routes, gpu: int):
    return [(r.nic, r.relay_gpu, r.distance, r.kind) for r in routes.rails(gpu)]


# --- the two field machines ---------------------------------------------------------------------------------
def test_h800_matches_expected_block(tmp_path):
    spec = load_spec("h800_32port.json")
    routes = routes_of(tmp_path, spec)
    for g, exp in spec["expected"]["routes"].items():
        first = routes.rails(int(g))[0]
        assert (first.nic, first.relay_gpu) == (exp["nic"], exp["relay_gpu"]), g
        if "distance" in exp:
            assert first.distance == exp["distance"]
        assert len(routes.rails(int(g))) == 1
    assert brief(routes, 6) == [("mlx5_24", 6, "PIX", DIRECT)]
    assert brief(routes, 0) == [("mlx5_24", 6, "PIX", RELAY)]
    topo = routes.topology
    assert [p.name for p in topo.usable_ports()] == spec["expected"]["usable_nics"]
    for name, reason in spec["expected"]["unusable_active_nics"].items():
        assert topo.port(name).reason == reason
    assert routes.load() == {"mlx5_24:1": 8} and routes.cap == 8 and routes.notes == []


def test_b300_first_rails_are_own_two_ports_direct_pix(tmp_path):
    spec = load_spec("b300_16nic.json")
    routes = routes_of(tmp_path, spec)
    for g, exp in spec["expected"]["routes"].items():
        rails = routes.rails(int(g))
        assert [r.nic for r in rails] == exp["direct_nics"]
        assert all(r.relay_gpu == int(g) and r.distance == exp["distance"] == "PIX" and r.kind == DIRECT
                   for r in rails)
    assert set(routes.load().values()) == {0, 1}  # one first rail per GPU, each on its own card


def test_b300_hot_gpu_spreads_over_other_gpus_nics(tmp_path):
    routes = routes_of(tmp_path, "b300_16nic.json", hot=[0])
    rails = routes.rails(0)
    assert [(r.nic, r.kind) for r in rails[:2]] == [("mlx5_0", DIRECT), ("mlx5_1", DIRECT)]
    extra = rails[2:]
    assert len(extra) == 14 and {r.nic for r in extra} == {"mlx5_%d" % i for i in range(2, 16)}
    assert all(r.kind == RELAY and r.distance == "PIX" and r.relay_gpu == int(r.nic.split("_")[1]) // 2
               for r in extra)
    # Same NUMA node first (GPUs 1-3), and second ports (nobody's first rail) before first ports.
    assert [r.nic for r in extra[:6]] == ["mlx5_3", "mlx5_5", "mlx5_7", "mlx5_2", "mlx5_4", "mlx5_6"]
    assert all(r.relay_gpu >= 4 for r in extra[6:])
    assert brief(routes, 1) == [("mlx5_2", 1, "PIX", DIRECT), ("mlx5_3", 1, "PIX", DIRECT)]
    assert routes.hot_gpus == (0,)


# --- our own shapes ------------------------------------------------------------------------------------------
def test_nicless_socket_relays_over_nvlink_never_sys(tmp_path):
    routes = routes_of(tmp_path, "two_numa_nicless.json")
    for g in range(4):
        assert brief(routes, g) == [("mlx5_%d" % g, g, "PIX", DIRECT)]
    relayed = {g: brief(routes, g) for g in range(4, 8)}
    assert relayed == {4: [("mlx5_3", 3, "PIX", RELAY)], 5: [("mlx5_2", 2, "PIX", RELAY)],
                       6: [("mlx5_1", 1, "PIX", RELAY)], 7: [("mlx5_0", 0, "PIX", RELAY)]}
    assert set(routes.load().values()) == {2} and routes.cap == 2


def test_relay_prefers_same_numa_node(tmp_path):
    # Sockets interleave GPU indices, so the nearest index is always on the other socket.
    spec = {"gpus": 8, "numa_nodes": {"0": {"gpus": [0, 2, 4, 6]}, "1": {"gpus": [1, 3, 5, 7]}},
            "pcie_switches": [{"gpu": 0, "nics": ["mlx5_0"]}, {"gpu": 1, "nics": ["mlx5_1"]}],
            "gpus_on_root_ports": [2, 3, 4, 5, 6, 7]}
    routes = routes_of(tmp_path, spec)
    for g in (2, 4, 6):
        assert brief(routes, g) == [("mlx5_0", 0, "PIX", RELAY)]
    for g in (3, 5, 7):
        assert brief(routes, g) == [("mlx5_1", 1, "PIX", RELAY)]
    assert routes.topology.port("mlx5_1").numa == 1


def test_down_port_unused_and_its_gpu_relays(tmp_path):
    routes = routes_of(tmp_path, "pairs_one_down.json")
    assert brief(routes, 2) == [("mlx5_1", 1, "PIX", RELAY)]
    assert all(r.nic != "mlx5_2" for g in routes.gpus for r in routes.rails(g))
    assert routes.load() == {"mlx5_0:1": 1, "mlx5_1:1": 2, "mlx5_3:1": 1} and routes.cap == 2


def test_crowded_switch_is_balanced_through_a_relay(tmp_path):
    routes = routes_of(tmp_path, "crowded_switch.json")
    assert brief(routes, 0) == [("mlx5_0", 0, "PIX", DIRECT)]
    assert brief(routes, 1) == [("mlx5_0", 1, "PIX", DIRECT)]
    assert brief(routes, 2) == [("mlx5_1", 3, "PIX", RELAY), ("mlx5_0", 2, "PIX", DIRECT)]
    assert brief(routes, 3) == [("mlx5_1", 3, "PIX", DIRECT)]
    assert routes.load() == {"mlx5_0:1": 2, "mlx5_1:1": 2}
    assert routes.notes == ["GPU2 relays through GPU3 to mlx5_1 to balance ports (its own: mlx5_0)"]
    # Per-write picks follow the balanced plan, unless the peer names the GPU's own port.
    assert {(routes.pick_port(2).nic, routes.pick_port(2).relay_gpu) for _ in range(3)} == {("mlx5_1", 3)}
    assert routes.pick_port(2, ["mlx5_0"]).relay_gpu == 2


def test_pxb_is_direct_and_phb_gpu_relays_rather_than_crossing_the_host_bridge(tmp_path):
    routes = routes_of(tmp_path, "pxb_phb_mixed.json")
    assert brief(routes, 0) == [("mlx5_0", 0, "PXB", DIRECT)]
    assert brief(routes, 1) == [("mlx5_0", 0, "PXB", RELAY)]
    assert brief(routes, 2) == [("mlx5_2", 2, "PIX", DIRECT)]
    assert brief(routes, 3) == [("mlx5_2", 3, "PIX", DIRECT)]


def test_without_nvlink_falls_back_to_best_pcie_and_says_so(tmp_path):
    routes = routes_of(tmp_path, "pxb_phb_mixed.json", override={"nvlink": "none"})
    assert brief(routes, 1) == [("mlx5_1", 1, "PHB", FALLBACK)]
    assert any("GPU1 has no PIX/PXB NIC port and no NVLink peer with one: falling back to a PHB PCIe path "
               "to mlx5_1" == n for n in routes.notes)
    assert brief(routes, 0) == [("mlx5_0", 0, "PXB", DIRECT)]


def test_partial_nvlink_relays_only_through_linked_peers(tmp_path):
    # GPU1 is NVLinked to GPU0 only; GPU0's port is its one way out even though GPU3's is idle.
    routes = routes_of(tmp_path, "two_numa_nicless.json", override={"nvlink": {"4": [0], "5": [1], "6": [1],
                                                                               "7": [1]}})
    assert brief(routes, 4) == [("mlx5_0", 0, "PIX", RELAY)]
    assert {brief(routes, g)[0][:2] for g in (5, 6, 7)} == {("mlx5_1", 1)}
    assert routes.load()["mlx5_1:1"] == 4
    assert any(n.startswith("mlx5_1 is the first rail of 4 GPUs") for n in routes.notes)


def test_no_usable_port_is_one_clear_error(tmp_path):
    with pytest.raises(RoutingError) as info:
        routes_of(tmp_path, "all_down.json")
    assert str(info.value) == "no usable NIC port for 2 GPU(s): down: mlx5_0; no GID: mlx5_1"


def test_gpus_without_any_nic_is_an_error_and_no_gpu_is_empty_routes():
    with pytest.raises(RoutingError, match="no usable NIC port for 2 GPU\\(s\\): no RDMA NIC found"):
        plan_routes(synthetic(gpus=2))
    assert plan_routes(synthetic(gpus=0)).gpus == []


def test_dual_port_ibdev_gives_two_rails(tmp_path):
    routes = routes_of(tmp_path, "link_layers.json")
    assert [(r.nic, r.port, r.kind) for r in routes.rails(1)] == [("mlx5_dual", 1, DIRECT), ("mlx5_dual", 2, DIRECT)]
    assert brief(routes, 0) == [("ib_nogid", 0, "PIX", DIRECT)]


def test_synthetic_routes():
    routes = plan_routes(synthetic(gpus=4, nic_gpus={0: ["mlx5_0"], 3: ["mlx5_1"]}))
    assert brief(routes, 0) == [("mlx5_0", 0, "PIX", DIRECT)]
    assert brief(routes, 1) == [("mlx5_0", 0, "PIX", RELAY)]
    assert brief(routes, 2) == [("mlx5_1", 3, "PIX", RELAY)]
    assert brief(routes, 3) == [("mlx5_1", 3, "PIX", DIRECT)]


def test_bad_queries_name_the_value():
    routes = plan_routes(synthetic(gpus=2, nic_gpus={0: "mlx5_0"}))
    with pytest.raises(RoutingError, match=r"no route for GPU 5: this machine has GPUs \[0, 1\]"):
        routes.rails(5)
    with pytest.raises(RoutingError, match="hot GPU 9 is not on this machine"):
        plan_routes(routes.topology, hot_gpus=[9])


# --- pick_port -----------------------------------------------------------------------------------------------
@pytest.fixture
def b300(tmp_path):
    return routes_of(tmp_path, "b300_16nic.json", hot=[3])


def test_pick_port_two_preferred_local_nics_alternates_and_never_crashes(b300):
    picks = [b300.pick_port(0, ["mlx5_0", "mlx5_1"]) for _ in range(6)]
    assert all(isinstance(p, Rail) for p in picks)
    assert [p.nic for p in picks] == ["mlx5_0", "mlx5_1"] * 3
    assert all(p.relay_gpu == 0 and p.kind == DIRECT for p in picks)


def test_pick_port_peer_nics_not_local_uses_own_direct_rails(b300):
    picks = [b300.pick_port(2, ["mlx5_8", "mlx5_9"]) for _ in range(4)]
    assert [p.nic for p in picks] == ["mlx5_4", "mlx5_5"] * 2
    assert [b300.pick_port(5).nic for _ in range(3)] == ["mlx5_10", "mlx5_11", "mlx5_10"]


def test_pick_port_same_named_nic(b300):
    assert {b300.pick_port(0, "mlx5_1").nic for _ in range(4)} == {"mlx5_1"}
    assert {b300.pick_port(0, ["mlx5_1:1"]).nic for _ in range(4)} == {"mlx5_1"}
    assert {b300.pick_port(0, "mlx5_9,mlx5_0").nic for _ in range(4)} == {"mlx5_0"}


@pytest.mark.parametrize("garbage", [[], "", [None, 3, {"x": 1}], 42, ["mlx5_0", None], b"mlx5_1",
                                     ("mlx5_77", "mlx5_78"), [["mlx5_0"]]])
def test_pick_port_tolerates_whatever_the_peer_sends(b300, garbage):
    rail = b300.pick_port(0, garbage)
    assert rail in b300.rails(0) and rail.kind == DIRECT


def test_pick_port_hot_gpu_may_use_a_relayed_rail_the_peer_prefers(b300):
    rail = b300.pick_port(3, ["mlx5_12"])
    assert (rail.nic, rail.relay_gpu, rail.kind) == ("mlx5_12", 6, RELAY)
    assert {b300.pick_port(3).nic for _ in range(4)} == {"mlx5_6", "mlx5_7"}  # extras only when asked


def test_pick_port_relayed_gpu_without_direct_rail(tmp_path):
    routes = routes_of(tmp_path, "h800_32port.json")
    for prefs in (None, ["mlx5_0", "mlx5_1"], ["mlx5_24"], "mlx5_4"):
        rail = routes.pick_port(3, prefs)
        assert (rail.nic, rail.relay_gpu) == ("mlx5_24", 6)


def test_pick_port_is_thread_safe_and_round_robin(b300):
    got = []
    lock = threading.Lock()

    def worker():
        mine = [b300.pick_port(4, ["mlx5_8", "mlx5_9"]).nic for _ in range(500)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(got) == {"mlx5_8": 1000, "mlx5_9": 1000}


# --- invariants on random machines ---------------------------------------------------------------------------
def random_spec(rng: random.Random) -> dict:
    n = rng.randint(2, 8)
    gpus = list(range(n))
    switches, on_root, nic_id = [], [], 0
    overrides = {}
    i = 0
    while i < n:
        size = rng.choice([1, 1, 2, 3])
        members = gpus[i:i + size]
        i += size
        if rng.random() < 0.3:
            on_root.extend(members)
            continue
        nics = []
        for _ in range(rng.choice([0, 1, 1, 2])):
            name = "mlx5_%d" % nic_id
            nic_id += 1
            nics.append(name)
            roll = rng.random()
            if roll < 0.15:
                overrides[name] = {"state": "1: DOWN", "phys_state": "3: Disabled"}
            elif roll < 0.25:
                overrides[name] = {"link_layer": "Ethernet", "gid": False}
        sw = {"gpus": members, "nics": nics}
        if rng.random() < 0.3:  # a second switch level below
            sw = {"gpus": [], "nics": nics, "switches": [{"gpus": members, "nics": []}]}
        switches.append(sw)
    spec = {"gpus": n, "numa_nodes": {"0": {"gpus": gpus[: n // 2]}, "1": {"gpus": gpus[n // 2:]}},
            "pcie_switches": switches, "gpus_on_root_ports": on_root, "nics_override": overrides,
            "layout": rng.choice(["switch-ports", "flat"])}
    if rng.random() < 0.5:  # a NIC on its own root port: reachable only across a host bridge
        spec["nics_on_root_ports"] = [{"nic": "mlx5_%d" % nic_id, "numa": rng.choice([0, 1])}]
    return spec


@pytest.mark.parametrize("seed", range(40))
def test_random_machines_route_by_the_rules(tmp_path, seed):
    rng = random.Random(seed)
    spec = random_spec(rng)
    root = tmp_path / "root"
    build_tree(root, spec)
    topo = discover(root)
    locally_reachable = [p for p in topo.usable_ports()
                         if any(topo.distances[(g.index, p.key)] in LOCAL_CLASSES for g in topo.gpus)]
    if not topo.usable_ports():
        with pytest.raises(RoutingError):
            plan_routes(topo)
        return
    routes = plan_routes(topo, hot_gpus=[0])
    usable = {p.key for p in topo.usable_ports()}
    for g in routes.gpus:
        rails = routes.rails(g)
        assert rails and len({r.key for r in rails}) == len(rails), (seed, g, rails)
        for r in rails:
            assert r.key in usable
            assert r.distance == topo.distances[(r.relay_gpu, r.key)]
            assert topo.has_nvlink(g, r.relay_gpu)
            assert (r.kind == DIRECT) == (r.relay_gpu == g and r.distance in LOCAL_CLASSES)
        own = [p.key for p in topo.usable_ports() if topo.distances[(g, p.key)] in LOCAL_CLASSES]
        assert set(own) <= {r.key for r in rails if r.kind == DIRECT}
        if locally_reachable:
            # all-to-all NVLink: never a PCIe path across a host bridge while a relay to a local port exists
            assert all(r.kind != FALLBACK and r.distance in LOCAL_CLASSES for r in rails), (seed, g, rails)
        else:
            assert rails[0].kind == FALLBACK
        for _ in range(3):
            assert routes.pick_port(g, rng.choice([None, ["mlx5_0", "mlx5_1"], "mlx5_2", [7]])) in rails
    if locally_reachable:
        assert max(routes.load().values()) <= math.ceil(len(topo.gpus) / len(locally_reachable)), seed
        if len(locally_reachable) == len(usable):
            assert max(routes.load().values()) <= routes.cap
    json.dumps(routes.to_json())


def test_all_ports_usable_h800_spreads_one_gpu_per_port(tmp_path):
    spec = dict(load_spec("h800_32port.json"), nics_override={})
    spec["nic_defaults"] = dict(spec["nic_defaults"], state="4: ACTIVE", phys_state="5: LinkUp", gid=True)
    routes = routes_of(tmp_path, spec)
    assert routes.cap == 1 and max(routes.load().values()) == 1
    for g in (0, 2, 4, 6):
        assert [r.kind for r in routes.rails(g)] == [DIRECT] * 8
    for g in (1, 3, 5, 7):
        rails = routes.rails(g)
        assert len(rails) == 8 and {r.kind for r in rails} == {RELAY} and len({r.relay_gpu for r in rails}) == 1
        assert rails[0].relay_gpu in (g - 1, g + 1)  # the nearest switch GPU


def test_routes_json_shape():
    routes = plan_routes(synthetic(gpus=2, nic_gpus={1: ["mlx5_0"]}))
    assert routes.to_json()["routes"] == [
        {"gpu": 0, "rails": [{"nic": "mlx5_0", "port": 1, "relay_gpu": 1, "distance": "PIX", "kind": "relay"}]},
        {"gpu": 1, "rails": [{"nic": "mlx5_0", "port": 1, "relay_gpu": 1, "distance": "PIX", "kind": "direct"}]}]


def test_planning_is_fast_for_a_large_box():
    import time
    nic_gpus = {g: ["mlx5_%d" % (2 * g), "mlx5_%d" % (2 * g + 1)] for g in range(0, 16, 2)}
    t0 = time.perf_counter()
    routes = plan_routes(synthetic(gpus=16, nic_gpus=nic_gpus))
    assert time.perf_counter() - t0 < 5.0
    assert max(routes.load().values()) == 1
