"""Topology discovery from generated sysfs trees: devices, port states and reasons, distance classes, overrides."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import transport.topology as topology
from transport.topology import (Topology, TopologyError, discover, load_override, pci_distance, synthetic,
                                validate_override)
from sysfs_builder import build_tree, load_spec


def tree(tmp_path: Path, spec, **changes) -> Path:
    if isinstance(spec, str):
        spec = load_spec(spec)
    spec = dict(spec, **changes)
    root = tmp_path / "root"
    build_tree(root, spec)
    return root


def dist_row(topo: Topology, gpu: int) -> dict:
    return {topo.label(p): topo.distances[(gpu, p.key)] for p in topo.ports}


# --- the two field machines ---------------------------------------------------------------------------------
FIELD_SPEC_SHA256 = {  # the field machines' specs as received; the copies in tests/data must stay these bytes
    "h800_32port.json": "031ca8f30131bff84d3627e98702902ad07b2b8a6e28f4f1af90b9eb374ba96b",
    "b300_16nic.json": "b150765899deab79fa038712894b7a74e72765cca81f0b3ffd4712123afee713",
}


def test_embedded_specs_are_the_field_files():
    for name, digest in FIELD_SPEC_SHA256.items():
        raw = (Path(__file__).parent / "data" / name).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == digest, name
        assert load_spec(name) == json.loads(raw), name


def test_h800_devices_states_and_reasons(tmp_path):
    topo = discover(tree(tmp_path, "h800_32port.json"))
    assert len(topo.gpus) == 8 and len(topo.ports) == 32
    assert [g.index for g in topo.gpus] == list(range(8))
    assert [g.pci for g in topo.gpus] == sorted(g.pci for g in topo.gpus)
    assert topo.nvlink_source == "assumed" and topo.nvlink_desc() == "all-to-all"
    reasons = {p.name: p.reason for p in topo.ports}
    assert [p.name for p in topo.usable_ports()] == ["mlx5_24"]
    assert {n: r for n, r in reasons.items() if r not in (None, "down")} == {
        "mlx5_4": "no GID", "mlx5_8": "no GID", "mlx5_29": "no GID"}
    assert sum(1 for r in reasons.values() if r == "down") == 28
    p24 = topo.port("mlx5_24")
    assert (p24.netdev, p24.gid, p24.link_layer, p24.rate_gbps, p24.numa) == ("eth0", True, "Ethernet", 200.0, 0)
    assert p24.state == "4: ACTIVE" and p24.phys_state == "5: LinkUp"
    assert topo.port("mlx5_4").netdev is None and topo.port("mlx5_4").gid is False
    assert "GID 0 is all zero" in topo.port("mlx5_8").detail
    assert topo.port("mlx5_0").detail == "state DOWN, phys_state Disabled"


def test_h800_distance_classes(tmp_path):
    topo = discover(tree(tmp_path, "h800_32port.json"))
    for sw_gpu, first in ((0, 0), (2, 8), (4, 16), (6, 24)):
        row = dist_row(topo, sw_gpu)
        local = {"mlx5_%d" % i for i in range(first, first + 8)}
        assert {n for n, d in row.items() if d == "PIX"} == local
        assert {d for n, d in row.items() if n not in local} == {"NODE"}
    for odd in (1, 3, 5, 7):  # root-port GPUs: a different host bridge from every NIC, same NUMA node
        assert set(dist_row(topo, odd).values()) == {"NODE"}


def test_b300_distances_numa_and_dual_functions(tmp_path):
    topo = discover(tree(tmp_path, "b300_16nic.json"))
    assert [g.numa for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    for g in range(8):
        row = dist_row(topo, g)
        own = {"mlx5_%d" % (2 * g), "mlx5_%d" % (2 * g + 1)}
        assert {n for n, d in row.items() if d == "PIX"} == own
        for n, d in row.items():
            if n not in own:
                other_gpu = int(n.split("_")[1]) // 2
                assert d == ("NODE" if (other_gpu < 4) == (g < 4) else "SYS"), (g, n, d)
    a, b = topo.port("mlx5_0"), topo.port("mlx5_1")
    assert a.pci.endswith(".0") and b.pci.endswith(".1") and a.pci[:-2] == b.pci[:-2]
    assert all(p.usable and p.link_layer == "InfiniBand" and p.rate_gbps == 400.0 for p in topo.ports)


# --- distance classes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("a, b, expected", [
    # switch as upstream + downstream ports (real sysfs)
    (("h0", ["rp", "up", "dA"], 0), ("h0", ["rp", "up", "dB"], 0), "PIX"),
    (("h0", ["rp", "up", "dA", "up2", "dC"], 0), ("h0", ["rp", "up", "dB"], 0), "PXB"),
    (("h0", ["rp", "up", "dA", "up2", "dC"], 0), ("h0", ["rp", "up", "dB", "up3", "dD"], 0), "PXB"),
    # switch as one path component (flat trees)
    (("h0", ["rp", "sw"], 0), ("h0", ["rp", "sw"], 0), "PIX"),
    (("h0", ["rp", "sw", "sw2"], 0), ("h0", ["rp", "sw"], 0), "PXB"),
    # host bridge, NUMA
    (("h0", ["rp1"], 0), ("h0", ["rp2", "up", "d"], 0), "PHB"),
    (("h0", ["rp1"], 0), ("h1", ["rp2", "up", "d"], 0), "NODE"),
    (("h0", ["rp1"], 0), ("h1", ["rp2"], 1), "SYS"),
    (("h0", ["rp1"], -1), ("h1", ["rp2"], 1), "NODE"),
    ((None, [], 0), (None, [], 0), "NODE"),
])
def test_pci_distance(a, b, expected):
    assert pci_distance(a[0], a[1], a[2], b[0], b[1], b[2]) == expected
    assert pci_distance(b[0], b[1], b[2], a[0], a[1], a[2]) == expected


@pytest.mark.parametrize("layout", ["switch-ports", "flat"])
def test_pxb_phb_sys_tree(tmp_path, layout):
    topo = discover(tree(tmp_path, "pxb_phb_mixed.json", layout=layout))
    assert dist_row(topo, 0) == {"mlx5_0": "PXB", "mlx5_1": "NODE", "mlx5_2": "NODE", "mlx5_3": "SYS"}
    assert dist_row(topo, 1) == {"mlx5_0": "NODE", "mlx5_1": "PHB", "mlx5_2": "NODE", "mlx5_3": "SYS"}
    assert dist_row(topo, 2) == dist_row(topo, 3) == {"mlx5_0": "NODE", "mlx5_1": "NODE", "mlx5_2": "PIX",
                                                      "mlx5_3": "SYS"}
    assert topo.port("mlx5_3").numa == 1


def test_h800_flat_layout_same_classes(tmp_path):
    a = discover(tree(tmp_path / "a", "h800_32port.json"))
    b = discover(tree(tmp_path / "b", "h800_32port.json", layout="flat"))
    assert a.distances == b.distances


def test_unknown_numa_never_sys(tmp_path):
    topo = discover(tree(tmp_path, "b300_16nic.json", numa_unknown=True))
    assert {g.numa for g in topo.gpus} == {-1}
    assert set(dist_row(topo, 0).values()) == {"PIX", "NODE"}


# --- ports: link layers, GIDs, states, dual-port ibdevs -------------------------------------------------------
def test_link_layers_and_dual_port_ibdev(tmp_path):
    topo = discover(tree(tmp_path, "link_layers.json"))
    got = {p.key: (p.usable, p.reason) for p in topo.ports}
    assert got == {"ib_nogid:1": (True, None), "roce_nogid:1": (False, "no GID"),
                   "training:1": (False, "down"), "mlx5_dual:1": (True, None), "mlx5_dual:2": (True, None)}
    assert topo.port("training").detail == "state INIT, phys_state Phy Test"
    d1, d2 = topo.port("mlx5_dual", 1), topo.port("mlx5_dual", 2)
    assert (d1.netdev, d2.netdev) == ("ens2", "ens3")
    assert (d1.rate_gbps, d2.rate_gbps) == (400.0, 200.0)
    assert d1.pci == d2.pci
    assert topo.label(d2) == "mlx5_dual:2" and topo.label(topo.port("ib_nogid")) == "ib_nogid"


@pytest.mark.parametrize("state, phys, ll, gid, expected", [
    ("4: ACTIVE", "5: LinkUp", "InfiniBand", False, None),
    ("4: ACTIVE", "5: LinkUp", "Ethernet", True, None),
    ("4: ACTIVE", "5: LinkUp", "Ethernet", False, "no GID"),
    ("1: DOWN", "5: LinkUp", "Ethernet", True, "down"),
    ("4: ACTIVE", "3: Disabled", "InfiniBand", True, "down"),
    ("1: DOWN", "3: Disabled", "Ethernet", False, "down"),
    ("", "5: LinkUp", "InfiniBand", True, "no link"),
    ("4: ACTIVE", "5: LinkUp", "", True, "no link"),
    ("ACTIVE", "LinkUp", "InfiniBand", True, None),
])
def test_port_verdict(state, phys, ll, gid, expected):
    assert topology.port_verdict(state, phys, ll, gid)[0] == expected


def test_netdev_from_gid_attrs_and_unreadable_state(tmp_path):
    root = tree(tmp_path, "pairs_one_down.json")
    ports = root / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (ports / "gid_attrs" / "ndevs").mkdir(parents=True)
    (ports / "gid_attrs" / "ndevs" / "0").write_text("bond0\n")
    (root / "sys" / "class" / "infiniband" / "mlx5_3" / "ports" / "1" / "state").unlink()
    topo = discover(root)
    assert topo.port("mlx5_0").netdev == "bond0"
    assert topo.port("mlx5_1").netdev == "eth1"
    assert (topo.port("mlx5_3").usable, topo.port("mlx5_3").reason) == (False, "no link")


def test_nvswitch_and_other_vendors_are_not_gpus(tmp_path):
    root = tree(tmp_path, "pairs_one_down.json")
    hb = root / "sys" / "devices" / "pci0000:f0"
    for bdf, vendor, cls in (("0000:f1:00.0", "0x10de", "0x068000"), ("0000:f2:00.0", "0x1af4", "0x030200")):
        d = hb / "0000:f0:01.0" / bdf
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        os.symlink(os.path.relpath(d, root / "sys" / "bus" / "pci" / "devices"),
                   root / "sys" / "bus" / "pci" / "devices" / bdf)
    assert len(discover(root).gpus) == 4


def test_gpu_index_is_pci_rank_not_listing_order(tmp_path):
    ov = {"gpus": [{"pci": "0000:c1:00.0", "numa": 1}, {"pci": "0000:1a:00.0"}, {"pci": "0001:05:00.0"}],
          "nics": []}
    topo = discover(override=ov)
    assert [g.pci for g in topo.gpus] == ["0000:1a:00.0", "0000:c1:00.0", "0001:05:00.0"]
    assert topo.gpus[1].numa == 1


def test_absolute_symlinks_of_a_copied_tree_are_rerooted(tmp_path):
    root = tree(tmp_path, "pairs_one_down.json")
    pci = root / "sys" / "bus" / "pci" / "devices"
    for link in pci.iterdir():
        target = os.path.normpath(os.path.join(pci, os.readlink(link)))
        link.unlink()
        os.symlink("/" + os.path.relpath(target, root), link)  # as `cp -P` of absolute links would give
    ib = root / "sys" / "class" / "infiniband"
    for link in ib.iterdir():
        target = os.path.normpath(os.path.join(ib, os.readlink(link)))
        link.unlink()
        os.symlink("/" + os.path.relpath(target, root), link)
    topo = discover(root)
    assert len(topo.gpus) == 4 and dist_row(topo, 2)["mlx5_2"] == "PIX"


# --- errors --------------------------------------------------------------------------------------------------
def test_missing_root(tmp_path):
    with pytest.raises(TopologyError, match=r"^sysfs root .*nope does not exist$"):
        discover(tmp_path / "nope")


def test_root_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(TopologyError, match="is not a directory"):
        discover(tmp_path / "f")


def test_root_without_sysfs(tmp_path):
    with pytest.raises(TopologyError, match="is not a sysfs tree"):
        discover(tmp_path)


def test_unreadable_root(tmp_path, monkeypatch):
    monkeypatch.setattr(topology.os, "access", lambda path, mode: False)
    with pytest.raises(TopologyError, match="not readable"):
        discover(tree(tmp_path, "pairs_one_down.json"))


def test_unreadable_pci_directory(tmp_path):
    root = tmp_path / "r"
    (root / "sys" / "bus" / "pci").mkdir(parents=True)
    (root / "sys" / "bus" / "pci" / "devices").write_text("not a dir")
    with pytest.raises(TopologyError, match="cannot read PCI device directory"):
        discover(root)


def test_empty_tree_is_an_empty_machine(tmp_path):
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    topo = discover(tmp_path)
    assert topo.gpus == [] and topo.ports == []


# --- overrides -----------------------------------------------------------------------------------------------
def write(tmp_path, obj, name="ov.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_override_patches_ports_nvlink_and_distances(tmp_path):
    root = tree(tmp_path, "pairs_one_down.json")
    ov = write(tmp_path, {"nics": {"mlx5_0": {"usable": False, "reason": "reserved"},
                                   "mlx5_2": {"state": "ACTIVE", "phys_state": "LinkUp"}},
                          "nvlink": [[0, 1], [2, 3]], "distances": {"1": {"mlx5_3": "PXB"}}})
    topo = discover(root, override=ov)
    assert (topo.port("mlx5_0").usable, topo.port("mlx5_0").reason) == (False, "reserved")
    assert topo.port("mlx5_2").usable
    assert topo.nvlink == {(0, 1), (2, 3)} and topo.nvlink_source == "override"
    assert topo.distance(1, "mlx5_3") == "PXB"


def test_override_cannot_revive_a_down_port(tmp_path):
    topo = discover(tree(tmp_path, "pairs_one_down.json"), override={"nics": {"mlx5_2": {"usable": True}}})
    assert topo.port("mlx5_2").reason == "down"


def test_override_describes_a_machine_and_round_trips(tmp_path):
    topo = discover(tree(tmp_path, "b300_16nic.json"))
    doc = topo.to_json()
    again = discover(override=write(tmp_path, doc))
    assert again.distances == topo.distances
    assert [(p.key, p.usable, p.numa, p.pci) for p in again.ports] == \
        [(p.key, p.usable, p.numa, p.pci) for p in topo.ports]
    assert again.nvlink == topo.nvlink


def test_described_machine_defaults(tmp_path):
    ov = {"gpus": [{"pci": "0000:10:00.0", "numa": 0, "distances": {"mlx5_0": "PIX"}},
                   {"pci": "0000:90:00.0", "numa": 1}],
          "nics": [{"name": "mlx5_0", "pci": "0000:11:00.0", "numa": 0},
                   {"name": "mlx5_1", "pci": "0000:91:00.0", "numa": 1, "link_layer": "Ethernet", "gid": False}],
          "nvlink": "none"}
    topo = discover(override=ov)
    assert dist_row(topo, 0) == {"mlx5_0": "PIX", "mlx5_1": "SYS"}
    assert dist_row(topo, 1) == {"mlx5_0": "SYS", "mlx5_1": "NODE"}
    assert topo.port("mlx5_1").reason == "no GID" and topo.nvlink == frozenset()


@pytest.mark.parametrize("content, message", [
    ("{\"nics\": {", "not valid JSON: Expecting"),
    ("[1, 2]", "top level: expected a JSON object, got list"),
    ({"nvlink": "some"}, "nvlink: expected \"all-to-all\""),
    ({"nvlink": [[0, 1, 2]]}, "nvlink[0]: expected a pair [a, b] of GPU indices, got [0, 1, 2]"),
    ({"nics": {"mlx5_0": {"gid": "yes"}}}, "nics.mlx5_0.gid: expected true or false, got \"yes\""),
    ({"nics": {"mlx5_0": {"pci": "0000:01:00.0"}}}, "nics.mlx5_0.pci: cannot override this key"),
    ({"nics": [{"name": "mlx5_0", "pci": "0000:01:00.0"}]}, "nics: a list of NICs describes a whole machine"),
    ({"distances": {"0": {"mlx5_0": "CLOSE"}}}, "distances.0.mlx5_0: distance class must be one of "
                                                "PIX/PXB/PHB/NODE/SYS, got 'CLOSE'"),
    ({"gpus": [{"numa": 0}]}, "gpus[0]: missing \"pci\""),
    ({"gpus": [{"pci": "18:00.0"}]}, "gpus[0].pci: not a PCI address DDDD:BB:DD.F: '18:00.0'"),
    ({"gpus": [{"pci": "0000:20:00.0", "index": 1}, {"pci": "0000:30:00.0"}]},
     "gpus[0].index: GPU index is the rank of its PCI address (0000:20:00.0 -> 0), got 1"),
    ({"gpus": [{"pci": "0000:20:00.0"}], "nics": [{"name": "x", "pci": "0000:21:00.0", "port": "1"}]},
     "nics[0].port: expected an integer, got \"1\""),
    ({"gpus": [{"pci": "0000:20:00.0"}], "nvlink": [[0, 3]]}, "nvlink: GPU 3 is not in 0..0"),
    ({"colour": "red"}, "top level: unknown key(s) ['colour']"),
    ({"gpus": 8, "pcie_switches": []}, "gpus: this is a topology spec for tests/sysfs_builder.py"),
])
def test_malformed_override(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(TopologyError) as info:
        load_override(path)
    text = str(info.value)
    assert text.startswith("override %s: " % path)
    assert message in text
    assert "\n" not in text


def test_override_missing_file(tmp_path):
    with pytest.raises(TopologyError, match=r"override .*missing\.json: cannot read: No such file"):
        discover(tmp_path, override=tmp_path / "missing.json")


def test_override_names_unknown_port(tmp_path):
    with pytest.raises(TopologyError, match=r"nics\.mlx5_9: no such NIC port on this machine \(have mlx5_0:1"):
        discover(tree(tmp_path, "pairs_one_down.json"), override={"nics": {"mlx5_9": {"usable": False}}})


def test_override_nvlink_gpu_out_of_range(tmp_path):
    with pytest.raises(TopologyError, match=r"nvlink: GPU 9 is not in 0\.\.3"):
        discover(tree(tmp_path, "pairs_one_down.json"), override={"nvlink": [[0, 9]]})


# --- NVLink sources, synthetic machines ----------------------------------------------------------------------
def test_live_nvlink_used_when_live(tmp_path, monkeypatch):
    root = tree(tmp_path, "pairs_one_down.json")
    monkeypatch.setattr(topology, "_live_nvlink", lambda gpus: ({(0, 1)}, "nvml"))
    topo = discover(root, live=True)
    assert topo.nvlink == {(0, 1)} and topo.nvlink_source == "nvml"
    assert discover(root).nvlink_source == "assumed"  # a tree that is not "/" is never queried


def test_live_without_nvml_assumes_all_to_all_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "_live_nvlink", lambda gpus: None)
    topo = discover(tree(tmp_path, "pairs_one_down.json"), live=True)
    assert topo.nvlink_desc() == "all-to-all" and any("assumed all-to-all" in n for n in topo.notes)


def test_live_nvlink_without_gpu_runtime_returns_none():
    gpus = [topology.Gpu(0, "0000:10:00.0"), topology.Gpu(1, "0000:11:00.0")]
    assert topology._live_nvlink(gpus) is None  # no NVML, CPU torch: no answer rather than a guess


def test_synthetic():
    topo = synthetic(gpus=4, nic_gpus={0: ["mlx5_0"], 3: "mlx5_1"})
    assert [p.name for p in topo.usable_ports()] == ["mlx5_0", "mlx5_1"]
    assert dist_row(topo, 0) == {"mlx5_0": "PIX", "mlx5_1": "NODE"}
    assert dist_row(topo, 3) == {"mlx5_0": "NODE", "mlx5_1": "PIX"}
    assert topo.nvlink_desc() == "all-to-all"
    with pytest.raises(TopologyError, match="nic_gpus key 7"):
        synthetic(gpus=2, nic_gpus={7: ["x"]})
    with pytest.raises(TopologyError, match="gpus must be a count"):
        synthetic(gpus=-1)


def test_validate_override_accepts_to_json_nvlink_shape():
    ov = validate_override({"gpus": [{"pci": "0000:01:00.0"}, {"pci": "0000:02:00.0"}],
                            "nvlink": {"source": "nvml", "pairs": [[0, 1]]}})
    assert discover(override=ov).nvlink == {(0, 1)}


def test_json_is_serializable(tmp_path):
    doc = discover(tree(tmp_path, "h800_32port.json")).to_json()
    json.dumps(doc)
    assert doc["gpus"][6]["distances"]["mlx5_24:1"] == "PIX"
    nic = [n for n in doc["nics"] if n["name"] == "mlx5_29"][0]
    assert (nic["usable"], nic["reason"], nic["state"]) == (False, "no GID", "4: ACTIVE")


def test_hand_made_tree_with_plain_directories(tmp_path):
    """A tree whose bus / class entries are copies, not symlinks: devices are found inside sys/devices."""
    root = tree(tmp_path, "pairs_one_down.json")
    for entry in list((root / "sys" / "bus" / "pci" / "devices").iterdir()) + \
            list((root / "sys" / "class" / "infiniband").iterdir()):
        real = entry.resolve()
        entry.unlink()
        shutil.copytree(real, entry, symlinks=False, ignore=shutil.ignore_patterns("infiniband"))
        if (entry / "device").is_symlink():
            dev = (entry / "device").resolve()
            (entry / "device").unlink()
            shutil.copytree(dev, entry / "device", symlinks=True)
    (root / "sys" / "bus" / "pci" / "devices" / "0000:03:00.0" / "class").write_text("0x0302\n")
    topo = discover(root)
    assert len(topo.gpus) == 4 and len(topo.ports) == 4
    assert [dist_row(topo, g)["mlx5_%d" % g] for g in range(4)] == ["PIX"] * 4
    assert topo.port("mlx5_2").reason == "down"
