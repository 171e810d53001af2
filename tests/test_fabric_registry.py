"""The table of fabric names (``transport.fabric.FABRICS``): built-in names, ``register_fabric``, and fabrics a
distribution outside this tree adds through the ``pxn.fabrics`` entry points, used by the engine, the
configuration and ``pxn bench`` by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transport.config import EngineConfig
from transport.errors import ConfigError, FabricUnavailable
from transport.fabric import BUILT_IN, ENTRY_POINT_GROUP, FABRICS, FabricRegistry, fabric_class
from transport.fabric.tcp import TcpFabric

REPO = Path(__file__).resolve().parents[1]


class _Copy(TcpFabric):
    name = "copy"


@pytest.fixture
def table():
    """A table of its own (the process's ``FABRICS`` is left as it is), reading a group no distribution has."""
    return FabricRegistry(BUILT_IN, "pxn.fabrics.none-here")


def test_built_in_names_resolve_to_their_classes():
    assert FABRICS.names()[:3] == ("tcp", "ipc", "verbs")
    assert fabric_class("tcp") is TcpFabric
    assert fabric_class("ipc").__name__ == "IpcFabric"
    with pytest.raises(ValueError, match=r"unknown fabric 'rdma'; expected one of tcp, ipc, verbs"):
        fabric_class("rdma")
    with pytest.raises(ConfigError, match=r"fabric must be one of 'auto', 'tcp', 'ipc', 'verbs'.*got 'TCP'"):
        EngineConfig.from_env({}, fabric="TCP")


def test_register_a_class_and_a_path(table):
    table.register("copy", _Copy)
    table.register("copy", _Copy)  # the same target again: nothing changes
    assert "copy" in table and table["copy"] is _Copy
    table.register("by-path", f"{__name__}:_Copy")
    assert table["by-path"] is _Copy
    assert list(table) == ["tcp", "ipc", "verbs", "copy", "by-path"]


@pytest.mark.parametrize("name,target,error,words", [
    ("tcp", _Copy, ValueError, ["'tcp' is taken", "built-in transport.fabric.tcp:TcpFabric"]),
    ("auto", _Copy, ValueError, ["'auto'"]),
    ("", _Copy, ValueError, ["''"]),
    ("x", "no.colon.here", ValueError, ["'module:Class'", "'no.colon.here'"]),
    ("x", dict, TypeError, ["Fabric subclass", "dict"]),
])
def test_register_refuses_with_the_bad_value(table, name, target, error, words):
    with pytest.raises(error) as e:
        table.register(name, target)
    for w in words:
        assert w in str(e.value)
    assert list(table) == ["tcp", "ipc", "verbs"]


@pytest.mark.parametrize("path,words", [
    ("pxn_no_such_module_here:Fabric", ["ModuleNotFoundError", "pxn_no_such_module_here"]),
    ("transport.fabric.tcp:NoSuchClass", ["AttributeError", "NoSuchClass"]),
    ("transport.fabric.base:Opcode", ["not a transport.fabric.base.Fabric subclass"]),
])
def test_a_path_that_cannot_be_loaded_is_named_and_spoils_no_other_name(table, path, words):
    table.register("odd", path)
    for _ in range(2):  # not cached as a success, and still the same error
        with pytest.raises(FabricUnavailable) as e:
            table["odd"]
        for w in ["fabric 'odd'", path, *words]:
            assert w in str(e.value)
    assert table["tcp"] is TcpFabric


def test_entry_points_are_read_once_and_only_for_a_name_not_held(table, monkeypatch):
    import importlib.metadata as md
    calls = []
    monkeypatch.setattr(md, "entry_points", lambda **kw: calls.append(kw) or [])
    assert table["tcp"] is TcpFabric and "ipc" in table
    assert calls == []
    assert "nope" not in table and "nope2" not in table and list(table) == ["tcp", "ipc", "verbs"]
    assert calls == [{"group": "pxn.fabrics.none-here"}]


def test_unreadable_metadata_leaves_the_built_in_names(table, monkeypatch, caplog):
    import importlib.metadata as md

    def broken(**kw):
        raise OSError("a distribution's metadata cannot be read")
    monkeypatch.setattr(md, "entry_points", broken)
    assert "nope" not in table and table["tcp"] is TcpFabric
    assert "cannot read the pxn.fabrics.none-here entry points" in caplog.text


# --- a fabric from a distribution outside this tree ------------------------------------------------------------
@pytest.fixture
def plugin_dist(tmp_path):
    """A distribution installed nowhere but on ``PYTHONPATH``: a package whose fabric is tcp's class under the
    name "demo-net", one entry point whose module does not exist ("broken"), and one that names a built-in."""
    site = tmp_path / "site"
    pkg = site / "pxn_demo_net"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""\
        from transport.fabric.tcp import TcpFabric

        class DemoNetFabric(TcpFabric):
            name = "demo-net"
        """))
    info = site / "pxn_demo_net-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pxn-demo-net\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ndemo-net = pxn_demo_net:DemoNetFabric\n"
                                           "broken = pxn_demo_missing:Nothing\ntcp = pxn_demo_net:DemoNetFabric\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PXN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    return env


def _run(env, code, timeout=300):
    return subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_an_entry_point_fabric_moves_bytes_through_the_engine(plugin_dist, seed):
    code = textwrap.dedent(f"""\
        import logging
        logging.basicConfig(level=logging.WARNING)
        import numpy as np
        from transport.config import EngineConfig
        from transport.engine import TransferEngine
        from transport.errors import FabricUnavailable
        from transport.fabric import FABRICS, fabric_class
        from transport.fabric.tcp import TcpFabric

        assert fabric_class("tcp") is TcpFabric  # the entry point named "tcp" does not replace the built-in
        assert "demo-net" in FABRICS and fabric_class("demo-net").__name__ == "DemoNetFabric", list(FABRICS)
        try:
            fabric_class("broken")
            raise SystemExit("a broken entry point loaded")
        except FabricUnavailable as e:
            msg = str(e)
        assert "pxn.fabrics: broken = pxn_demo_missing:Nothing" in msg and "pxn-demo-net 1.0" in msg, msg
        assert "ModuleNotFoundError" in msg, msg
        assert EngineConfig.from_env({{"PXN_FABRIC": "demo-net"}}).fabric == "demo-net"
        rng = np.random.default_rng({seed})
        n = (1 << 20) + 4093
        with TransferEngine(fabric="demo-net", rails=2) as a, \\
                TransferEngine(config=EngineConfig(fabric="demo-net", rails=1), rails=2) as b:
            assert a.fabric_name == b.fabric_name == "demo-net" and b.rails == 2
            assert {{type(f).__name__ for f in a.fabrics + b.fabrics}} == {{"DemoNetFabric"}}
            src = rng.integers(0, 256, n, dtype=np.uint8)
            dst = np.full(n + 64, 0xA5, dtype=np.uint8)
            a.register(src)
            b.register(dst)
            lens = [1, 63, 4097, 70001, n - 1 - 63 - 4097 - 70001]
            offs = np.concatenate(([0], np.cumsum(lens)[:-1])).tolist()
            a.batch_write(b.session_id, [src.ctypes.data + o for o in offs],
                          [dst.ctypes.data + 17 + o for o in offs], lens)
            assert np.array_equal(dst[17:17 + n], src)
            assert (dst[:17] == 0xA5).all() and (dst[17 + n:] == 0xA5).all()
        try:
            TransferEngine(fabric="broken")
            raise SystemExit("an engine started on a broken entry point")
        except FabricUnavailable as e:
            assert "pxn_demo_missing" in str(e), e
        print("moved", n)
        """)
    p = _run(plugin_dist, code)
    assert p.returncode == 0 and "moved" in p.stdout, p.stdout + p.stderr
    assert "pxn.fabrics: tcp = pxn_demo_net:DemoNetFabric" in p.stderr and "ignored" in p.stderr, p.stderr


def test_pxn_bench_runs_an_entry_point_fabric(plugin_dist, tmp_path, seed):
    import random
    rnd = random.Random(seed)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": [1, 63, rnd.randint(2, 9000)]},
                                            "mla_latent_1k": {"length": 4096 + rnd.randint(1, 999)}}}))
    out_json = tmp_path / "run.json"

    def pxn(*argv, **env):
        p = subprocess.run([sys.executable, "-m", "transport.cli", *map(str, argv)], cwd=str(REPO),
                           env={**plugin_dist, **env}, capture_output=True, text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr

    rc, out, err = pxn("bench", "--quick", "--layers", 2, "--repeat", 1, "--shapes", shapes, "--json", out_json,
                       PXN_FABRIC="demo-net")
    assert rc == 0 and out.startswith("pxn bench: fabric demo-net (PXN_FABRIC),"), out + err
    doc = json.loads(out_json.read_text())
    assert doc["fabric"] == "demo-net" and {r["verified"] for r in doc["rows"]} == {"byte-exact"}
    rc, out, err = pxn("bench", "--fabric", "broken", "--shapes", shapes)
    # one line of error (beside the warning about the entry point that names "tcp"), naming the entry point
    lines = [line for line in err.strip().splitlines() if "ignored: the name is taken" not in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("pxn bench: error: fabric 'broken'"), err
    assert "pxn.fabrics: broken = pxn_demo_missing:Nothing" in lines[0] and "pxn_demo_missing" in lines[0], err
