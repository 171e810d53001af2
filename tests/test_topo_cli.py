"""``pxn topo``: the screen, the JSON, exit codes and one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import transport.cli as cli
from transport import topo_cli
from sysfs_builder import build_tree, load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def h800(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("h800")
    build_tree(root, "h800_32port.json")
    return root


def pxn(capsys, *argv):
    rc = topo_cli.main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def test_h800_json_routes_match_expected(h800, capsys):
    rc, out, err = pxn(capsys, "--sysfs", h800, "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    spec = load_spec("h800_32port.json")
    routes = {r["gpu"]: r["rails"] for r in doc["routes"]}
    assert sorted(routes) == list(range(8))
    for g, exp in spec["expected"]["routes"].items():
        first = routes[int(g)][0]
        assert (first["nic"], first["relay_gpu"]) == (exp["nic"], exp["relay_gpu"])
        assert first["distance"] == exp.get("distance", "PIX")  # the NIC-to-relay-GPU class
        assert first["port"] == 1
    nics = {n["name"]: n for n in doc["nics"]}
    assert [n for n in nics if nics[n]["usable"]] == ["mlx5_24"]
    for name, reason in spec["expected"]["unusable_active_nics"].items():
        assert (nics[name]["usable"], nics[name]["reason"]) == (False, reason)
    assert nics["mlx5_0"]["reason"] == "down" and nics["mlx5_24"]["reason"] is None
    for key in ("name", "port", "pci", "numa", "state", "link_layer", "usable", "reason"):
        assert key in nics["mlx5_24"]
    assert [(g["index"], g["numa"]) for g in doc["gpus"]] == [(i, 0) for i in range(8)]
    assert all("pci" in g for g in doc["gpus"])


def test_json_output_fed_back_as_override(h800, tmp_path, capsys):
    rc, out, _ = pxn(capsys, "--sysfs", h800, "--json")
    doc = json.loads(out)
    doc["nics"] = [n for n in doc["nics"] if n["name"] != "mlx5_0"]  # hand edits are the point
    for g in doc["gpus"]:
        g["distances"].pop("mlx5_0:1")
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(doc))
    rc2, out2, err2 = pxn(capsys, "--override", machine, "--json")
    assert (rc, rc2, err2) == (0, 0, "")
    again = json.loads(out2)
    assert again["routes"] == doc["routes"] and len(again["nics"]) == 31
    assert again["gpus"][0]["distances"] == doc["gpus"][0]["distances"]


def test_h800_screen(h800, capsys):
    rc, out, err = pxn(capsys, "--sysfs", h800)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "pxn topo: %s: 8 GPU(s), 32 NIC port(s), 1 usable; NVLink: all-to-all (assumed)" % h800
    gpu6 = next(line for line in lines if line.startswith("GPU6 "))
    cells = gpu6.split()
    assert cells[1:9] == ["NV"] * 6 + ["X", "NV"] and cells[9 + 24] == "PIX" and cells[-1] == "0"
    assert "Usable: mlx5_24" in lines
    for name in ("mlx5_4", "mlx5_8", "mlx5_29"):
        assert any(line.startswith("Unusable: %s: no GID" % name) for line in lines), name
    assert "  GPU6 -> mlx5_24 direct (PIX)" in lines
    for g in (0, 1, 2, 3, 4, 5, 7):
        assert "  GPU%d -> mlx5_24 via GPU6 over NVLink (PIX)" % g in lines
    assert any(line.startswith("Down (state not ACTIVE or phys_state not LinkUp): 28 port(s)") for line in lines)


def test_b300_screen_with_hot_gpu(tmp_path, capsys):
    build_tree(tmp_path, "b300_16nic.json")
    rc, out, _ = pxn(capsys, "--sysfs", tmp_path, "--hot", 0)
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("  GPU0 -> "))
    assert line.startswith("  GPU0 -> mlx5_0 direct (PIX); mlx5_1 direct (PIX); mlx5_3 via GPU1 over NVLink (PIX)")
    assert "  GPU7 -> mlx5_14 direct (PIX); mlx5_15 direct (PIX)" in out.splitlines()


def test_missing_root_exit_2_one_line(tmp_path, capsys):
    rc, out, err = pxn(capsys, "--sysfs", tmp_path / "nope")
    assert rc == 2 and out == ""
    assert err == "pxn topo: error: sysfs root %s does not exist\n" % (tmp_path / "nope")


def test_not_a_sysfs_tree_exit_2(tmp_path, capsys):
    rc, out, err = pxn(capsys, "--sysfs", tmp_path)
    assert rc == 2 and err.count("\n") == 1 and "is not a sysfs tree" in err


def test_malformed_override_exit_2_one_line(h800, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nics": {"mlx5_24": {"usable": "no"}}}')
    rc, out, err = pxn(capsys, "--sysfs", h800, "--override", bad)
    assert rc == 2 and out == ""
    assert err == ("pxn topo: error: override %s: nics.mlx5_24.usable: expected true or false, got \"no\"\n"
                   % bad)
    bad.write_text("{oops")
    rc, out, err = pxn(capsys, "--sysfs", h800, "--override", bad)
    assert rc == 2 and err.startswith("pxn topo: error: override %s: not valid JSON" % bad)
    assert err.count("\n") == 1


def test_no_usable_port_exit_2_but_shows_why(tmp_path, capsys):
    build_tree(tmp_path, "all_down.json")
    rc, out, err = pxn(capsys, "--sysfs", tmp_path)
    assert rc == 2
    assert err == "pxn topo: error: no usable NIC port for 2 GPU(s): down: mlx5_0; no GID: mlx5_1\n"
    assert "Usable: none" in out and "Unusable: mlx5_1: no GID" in out
    rc, out, err = pxn(capsys, "--sysfs", tmp_path, "--json")
    assert rc == 2 and json.loads(out)["routes"] == [] and "no usable NIC port" in json.loads(out)["error"]


def test_override_disables_the_only_port(h800, tmp_path, capsys):
    ov = tmp_path / "ov.json"
    ov.write_text(json.dumps({"nics": {"mlx5_24": {"usable": False, "reason": "reserved for storage"}}}))
    rc, out, err = pxn(capsys, "--sysfs", h800, "--override", ov)
    assert rc == 2 and "reserved for storage: mlx5_24" in err


def test_empty_machine_says_so_and_exits_0(tmp_path, capsys):
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    rc, out, err = pxn(capsys, "--sysfs", tmp_path)
    assert rc == 0 and err == ""
    assert out == "pxn topo: no GPU and no RDMA NIC found under %s: nothing to route\n" % tmp_path
    rc, out, _ = pxn(capsys, "--sysfs", tmp_path, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["gpus"] == [] and doc["nics"] == [] and doc["routes"] == []


def test_nics_but_no_gpu_exits_0(tmp_path, capsys):
    spec = {"gpus": 0, "nics_on_root_ports": ["mlx5_0"]}
    build_tree(tmp_path, spec)
    rc, out, err = pxn(capsys, "--sysfs", tmp_path)
    assert rc == 0 and "No GPU found: nothing to route." in out and "mlx5_0" in out


@pytest.mark.skipif(os.path.exists("/sys/class/infiniband") or os.path.exists("/proc/driver/nvidia"),
                    reason="this machine has a GPU or an RDMA NIC")
def test_this_machine_without_gpu_or_nic(capsys):
    rc, out, err = pxn(capsys)
    assert rc == 0
    assert out == "pxn topo: no GPU and no RDMA NIC found under /: nothing to route\n"


def test_dispatch_through_pxn_cli(h800, capsys, monkeypatch):
    # Only the topo subcommand: the dispatcher imports every subcommand module, and this test is about topo.
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"topo": cli.SUBCOMMANDS["topo"]})
    assert cli.main(["topo", "--sysfs", str(h800), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["routes"][6]["rails"][0]["relay_gpu"] == 6


def test_subprocess_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    proc = subprocess.run([sys.executable, "-m", "transport.topo_cli", "--sysfs", str(tmp_path), "--override",
                           str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1 and proc.stdout == ""


def test_subprocess_json(h800):
    proc = subprocess.run([sys.executable, "-m", "transport.topo_cli", "--sysfs", str(h800), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    assert {r["rails"][0]["nic"] for r in json.loads(proc.stdout)["routes"]} == {"mlx5_24"}
