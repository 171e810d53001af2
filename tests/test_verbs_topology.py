"""The 8 x H800 field machine (``tests/data/h800_32port.json``) over the verbs fabric, on softverbs.

That machine has 32 RoCE ports; 4 are ACTIVE and only one of them (mlx5_24) has a GID. Here softverbs is given
exactly those ports (``SOFTVERBS_DEVICES`` built from the spec: ``gid`` for the one port with a GID, ``nogid``
for every other one, ``down`` where the spec says the port is down) and the topology is discovered from a
sysfs tree built from the same spec. The cases check that ``pxn topo`` and the verbs fabric agree on which
port is usable and why, that routing sends every GPU's data out through mlx5_24, and that an engine pair over
verbs with this topology writes byte-exact batches through that one port.

Not testable on the 2-core CPU box: GPU memory and the NVLink relay to GPU 6 (routing is checked, the engines
move host memory, which takes the rail directly).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine_helpers import EnginePeer, disjoint_offsets, write_and_check
from sysfs_builder import build_tree, load_spec
from transport import TransferEngine
from transport.errors import FabricUnavailable
from transport.fabric import make_fabric
from transport.routing import plan_routes
from transport.topology import discover

SPEC = "h800_32port.json"
MB = 1 << 20
AUX11 = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]   # sglang's aux metadata batch
PEER_BYTES = 16 * MB
SRC_BYTES = 16 * MB

pytestmark = pytest.mark.skipif(not os.environ.get("SOFTVERBS_DEVICES"),
                                reason="needs softverbs (../shared/softverbs) to model the H800's 32 RoCE ports; "
                                       "on real pyverbs the machine's own NICs are used, not these")


def spec_ports(spec: dict):
    """[(name, port, active, gid)] of the spec's NIC ports (its switch NICs and root-port NICs, 1 port each
    unless ``nic_defaults.ports`` says otherwise)."""
    names = [n for sw in spec.get("pcie_switches", []) for n in sw.get("nics", [])]
    names += [n if isinstance(n, str) else n["nic"] for n in spec.get("nics_on_root_ports", [])]
    defaults = spec.get("nic_defaults", {})
    out = []
    for name in names:
        for port in range(1, int(defaults.get("ports", 1)) + 1):
            f = {**defaults, **spec.get("nics_override", {}).get(name, {}),
                 **spec.get("nics_override", {}).get(f"{name}:{port}", {})}
            out.append((name, port, "ACTIVE" in f["state"], bool(f["gid"])))
    return out


def softverbs_devices(spec: dict) -> str:
    """``SOFTVERBS_DEVICES`` for the spec's ports: ``NAME:PORT:eth:gid|nogid[:down]``."""
    return ",".join(f"{n}:{p}:eth:{'gid' if gid else 'nogid'}{'' if active else ':down'}"
                    for n, p, active, gid in spec_ports(spec))


@pytest.fixture(scope="module")
def spec():
    return load_spec(SPEC)


@pytest.fixture(scope="module")
def h800(spec, tmp_path_factory):
    """(sysfs root, topology) of the H800, with softverbs set to its ports for the whole module (the spawned
    peer inherits the variable)."""
    root = tmp_path_factory.mktemp("h800")
    build_tree(root, spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOFTVERBS_DEVICES", softverbs_devices(spec))
        mp.delenv("PXN_GID_INDEX", raising=False)
        yield root, discover(str(root))


def test_the_device_list_is_the_machines(spec, h800):
    ports = spec_ports(spec)
    assert len(ports) == 32
    assert [(n, p) for n, p, _, gid in ports if gid] == [("mlx5_24", 1)]
    assert sorted(n for n, _, active, _ in ports if active) == ["mlx5_24", "mlx5_29", "mlx5_4", "mlx5_8"]
    entries = os.environ["SOFTVERBS_DEVICES"].split(",")
    assert len(entries) == 32 and sum(e.endswith(":gid") for e in entries) == 1
    assert "mlx5_24:1:eth:gid" in entries and "mlx5_4:1:eth:nogid" in entries and "mlx5_0:1:eth:nogid:down" in entries
    _, topo = h800
    assert sorted(p.key for p in topo.ports) == sorted(f"{n}:{p}" for n, p, _, _ in ports)


def test_pxn_topo_marks_every_gidless_port_unusable(spec, h800, capsys):
    """``pxn topo`` (screen and JSON) on the machine: mlx5_24 is the one usable port; every ACTIVE port that
    softverbs gives no GID says "no GID", every other one "down"."""
    from transport import topo_cli
    root, _ = h800
    assert topo_cli.main(["--sysfs", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    nics = {f"{n['name']}:{n['port']}": n for n in doc["nics"]}
    assert topo_cli.main(["--sysfs", str(root)]) == 0
    screen = capsys.readouterr().out.splitlines()
    assert "Usable: mlx5_24" in screen
    for name, port, active, gid in spec_ports(spec):
        n = nics[f"{name}:{port}"]
        if gid:
            assert (n["usable"], n["reason"], n["gid"]) == (True, None, True)
            continue
        want = "no GID" if active else "down"
        assert (n["usable"], n["reason"], n["gid"]) == (False, want, False), n
        row = [s for s in screen if s.split()[1:3] == [name, str(port)]]
        assert len(row) == 1 and row[0].endswith(f"NO: {want}"), row
        line = [s for s in screen if s.startswith(f"Unusable: {name}: ")]
        if active:   # the reason and its detail on a line of its own
            assert line == [f"Unusable: {name}: no GID ({n['detail']})"] and "GID 0 is all zero" in line[0], line
        else:
            assert line == [], line
    assert f"Down (state not ACTIVE or phys_state not LinkUp): 28 port(s): " in "\n".join(screen)


def test_routing_sends_everything_through_the_one_port(h800):
    _, topo = h800
    routes = plan_routes(topo)
    for g in range(8):
        rails = routes.rails(g)
        assert rails and {(r.nic, r.port) for r in rails} == {("mlx5_24", 1)}, (g, rails)
        assert rails[0].relay_gpu == 6, (g, rails[0])   # GPU 6 sits on mlx5_24's PCIe switch
    assert [p.key for p in topo.usable_ports()] == ["mlx5_24:1"]


def test_verbs_fabric_per_port_agrees_with_the_topology(spec, h800):
    """The verbs fabric built for each ACTIVE port (as the engine builds a rail: ``device``, ``port_num``) and
    for a down one: GID-less ports are refused with an error naming the device, the port and "no GID"; the one
    with a GID drives that port and a non-empty GID."""
    _, topo = h800
    checked = 0
    for name, port, active, gid in spec_ports(spec):
        if not active and name != "mlx5_0":
            continue
        if gid:
            f = make_fabric("verbs", device=name, port_num=port)
            try:
                assert (f.device, f.port_num) == (name, port)
                assert f.gid_index >= 0 and f.gid.replace(":", "").strip("0"), f.gid
                assert topo.port(name, port).usable
            finally:
                f.close()
        else:
            with pytest.raises(FabricUnavailable) as info:
                make_fabric("verbs", device=name, port_num=port)
            text = str(info.value)
            assert f"{name} port {port}" in text, text
            assert ("no GID" if active else "not ACTIVE") in text, text
            assert topo.port(name, port).reason == ("no GID" if active else "down")
        checked += 1
    assert checked == 5
    # with no port named, the fabric skips the 31 unusable ones and lands on the one the topology routes to
    f = make_fabric("verbs")
    try:
        assert (f.device, f.port_num) == ("mlx5_24", 1)
    finally:
        f.close()


# --- an engine pair over verbs with this topology ----------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(h800):
    _, topo = h800
    peer = EnginePeer(PEER_BYTES, fabric="verbs", topology=topo)
    sender = TransferEngine(fabric="verbs", topology=topo)
    try:
        yield sender, peer
    finally:
        sender.close()
        peer.close()


@pytest.fixture(scope="module")
def src(pair):
    from suite_env import SEED
    sender, _ = pair
    rng = np.random.default_rng([SEED, 24])
    buf = np.frombuffer(rng.bytes(SRC_BYTES), dtype=np.uint8).copy()
    sender.register(buf)
    return buf


CASES = ["aux11", "4096x64B", "1MB_pieces", "mixed"]


@pytest.mark.parametrize("case", CASES)
def test_engine_pair_writes_byte_exact_through_the_one_port(pair, src, case, seed):
    """Fresh random pieces at random disjoint offsets into the poisoned peer; its whole buffer (guards
    included) must equal the expected image; the rails on both sides are mlx5_24 port 1 only."""
    sender, peer = pair
    rng = np.random.default_rng([seed, CASES.index(case)])
    lengths = {"aux11": AUX11, "4096x64B": [64] * 4096, "1MB_pieces": [MB] * 3 + [MB - 7],
               "mixed": AUX11 + [64] * 500 + [MB + 13, 3 * MB]}[case]
    so = disjoint_offsets(rng, lengths, SRC_BYTES)
    do = disjoint_offsets(rng, lengths, PEER_BYTES)
    before = sender.fabrics[0].wire_counts()["work_requests"]
    write_and_check(sender, peer, src.ctypes.data, src, so, do, lengths, timeout=120)
    # the engine's rails are the topology's usable ports: one, mlx5_24, on the GID softverbs gives it
    assert [(f.device, f.port_num) for f in sender.fabrics] == [("mlx5_24", 1)]
    assert sender.fabrics[0].gid_index >= 0
    assert [r["key"] for r in sender.stats()["rails"]] == ["mlx5_24:1"]
    assert [r["key"] for r in peer.call("stats")["rails"]] == ["mlx5_24:1"]
    assert sender.fabrics[0].wire_counts()["work_requests"] > before   # the batch went out on that QP
