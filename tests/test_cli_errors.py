"""The ``pxn`` command line never prints a traceback: bad input, a missing fabric, a closed pipe each give one
line on stderr and exit status 2. Also ``pxn bench`` end to end on small shapes (``--shapes``), its JSON,
its plot and its progress lines."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transport import bench_cli, plots

REPO = Path(__file__).resolve().parents[1]


def pxn(*argv, timeout=120):
    """Run ``pxn`` as a user would (a fresh interpreter); returns (exit status, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "transport.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return p.returncode, p.stdout, p.stderr


def assert_one_line_error(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("option", ["--repeat", "--layers", "--rails"])
@pytest.mark.parametrize("value", [0, -3])
def test_bench_rejects_counts_below_one(option, value):
    rc, out, err = pxn("bench", option, value)
    assert_one_line_error(rc, err, option, str(value))
    assert "starting the peer" not in out  # refused before anything starts


def test_bench_unknown_option_is_one_line_with_a_hint():
    rc, out, err = pxn("bench", "--bogus")
    assert err == "pxn bench: error: unrecognized arguments: --bogus (pxn bench --help lists the options)\n"
    assert rc == 2 and out == ""


@pytest.mark.parametrize("argv,words", [
    (["topo", "--bogus"], ["pxn topo: error: unrecognized arguments: --bogus", "pxn topo --help"]),
    (["bench", "--rails", "x"], ["pxn bench: error: --rails: invalid int value: 'x'", "pxn bench --help"]),
    (["bench", "--fabric", "rdma"], ["pxn bench: error: --fabric: invalid choice: 'rdma'", "pxn bench --help"]),
    (["frob"], ["pxn: error:", "'frob'", "pxn --help"]),
    ([], ["pxn: error:", "command", "pxn --help"]),
])
def test_argparse_refusals_are_one_line_with_a_hint(argv, words):
    rc, out, err = pxn(*argv)
    assert_one_line_error(rc, err, *words)
    assert not err.startswith("usage:") and out == ""


def test_bench_verbs_without_rdma_one_line_no_peer_traceback():
    pytest.importorskip("transport.fabric.verbs")
    try:
        import pyverbs  # noqa: F401
        pytest.skip("pyverbs is importable here; this case is about a machine without it")
    except ImportError:
        pass
    rc, out, err = pxn("bench", "--fabric", "verbs")
    assert_one_line_error(rc, err, "pxn bench: error:", "pyverbs")
    assert "FabricUnavailable" not in err and "unexpected" not in err


@pytest.mark.slow
def test_bench_missing_or_bad_shapes_file(tmp_path):
    rc, _, err = pxn("bench", "--shapes", tmp_path / "absent.json")
    assert_one_line_error(rc, err, "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"calls": {"aux_metadata": {"lengths": [64, 0]}}}')
    rc, _, err = pxn("bench", "--shapes", bad)
    assert_one_line_error(rc, err, "bad.json", ">= 1")
    bad.write_text("{not json")
    rc, _, err = pxn("bench", "--shapes", bad)
    assert_one_line_error(rc, err, "bad.json")


def test_topo_into_a_closed_pipe(tmp_path):
    from sysfs_builder import build_tree
    build_tree(tmp_path / "root", "h800_32port.json")  # a screen of several KB
    p = subprocess.Popen([sys.executable, "-m", "transport.cli", "topo", "--sysfs", str(tmp_path / "root")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    p.stdout.close()  # like `pxn topo | head -0`: the reader is gone before the first write
    err = p.stderr.read().decode()
    rc = p.wait(timeout=60)
    assert_one_line_error(rc, err, "broken pipe")


def test_unexpected_error_is_one_line(monkeypatch, capsys):
    import transport.cli as cli

    def boom(args):
        raise ZeroDivisionError("planted\nsecond line")
    monkeypatch.setattr(bench_cli, "run", boom)
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ZeroDivisionError: planted" in err and "--traceback" in err
    with pytest.raises(ZeroDivisionError):
        cli.main(["--traceback", "bench"])


def test_packaged_shapes_are_the_default(monkeypatch):
    monkeypatch.delenv("PXN_SHAPES", raising=False)
    shapes = bench_cli.load_shapes()
    assert Path(shapes["path"]) == REPO / "transport" / "data" / "sglang_shapes.json"
    assert shapes["aux"] == [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
    assert shapes["mla"] == {"mla_latent_1k": 2359296, "mla_latent_8k": 4316928, "mla_latent_64k": 8650752}
    assert bench_cli.AUX == shapes["aux"]


def test_progress_only_after_a_few_seconds():
    quiet, loud = io.StringIO(), io.StringIO()
    assert not bench_cli.Progress(after_s=3600, stream=quiet).note("shape 1 of 7")
    assert bench_cli.Progress(after_s=0, stream=loud).note("shape 2 of 7: x")
    assert quiet.getvalue() == ""
    assert loud.getvalue().startswith("pxn bench: shape 2 of 7: x (") and "s elapsed)" in loud.getvalue()


def test_bench_end_to_end_with_own_shapes(tmp_path, seed):
    """A small shapes file: the aux call's lengths come from it (odd sizes), every shape is byte-exact, the JSON
    says so, and the PNG is written beside it when matplotlib is there."""
    import random
    rnd = random.Random(seed)
    aux = [1, 63, rnd.randint(2, 9000), 4096, 7]
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"calls": {"aux_metadata": {"lengths": aux},
                                            "mla_latent_1k": {"length": 4096 + rnd.randint(1, 999)}}}))
    out = tmp_path / "bench.json"
    rc, stdout, err = pxn("bench", "--fabric", "tcp", "--quick", "--layers", 3, "--repeat", 1,
                          "--shapes", shapes, "--json", out, timeout=300)
    assert rc == 0, stdout + err
    assert "Traceback" not in err
    doc = json.loads(out.read_text())
    assert doc["shapes_file"] == "shapes.json"
    assert [r["verified"] for r in doc["rows"]] == ["byte-exact"] * len(doc["rows"])
    first = doc["rows"][0]
    assert first["pieces"] == len(aux) and first["bytes"] == sum(aux)
    assert any(r["shape"].startswith("mla_latent_1k (3x") for r in doc["rows"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "bench.png").exists()
    else:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_of_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = REPO / "benchmarks" / "results"
    for name in ("pxn-bench-cpu", "kernels-h200", "fabrics-cpu", "relay-table-tcp"):
        doc = json.loads((results / f"{name}.json").read_text())
        written = plots.plot_any(doc, str(tmp_path / f"{name}.png"))
        assert written == [str(tmp_path / f"{name}.png")], name
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert plots.plot_any({"something": "else"}, str(tmp_path / "x.png")) == []


def test_plots_without_matplotlib_log_one_line(monkeypatch, tmp_path, caplog):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("planted: no matplotlib")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(plots, "_warned", False)
    doc = json.loads((REPO / "benchmarks" / "results" / "pxn-bench-cpu.json").read_text())
    with caplog.at_level("WARNING", logger="transport.plots"):
        assert plots.plot_bench(doc, str(tmp_path / "a.png")) == []
        assert plots.plot_bench(doc, str(tmp_path / "b.png")) == []
    assert len(caplog.records) == 1 and "matplotlib" in caplog.records[0].getMessage()
    assert list(tmp_path.iterdir()) == []


def test_batch_breakdown_per_batch():
    stats = {"batches": {"submitted": 4}, "time_s": {"wait": 0.4, "fill": 0.2}}
    peer = {"receiver": {"scatter_s": 0.08, "chunks": 3}}
    assert plots.batch_breakdown(stats, peer) == pytest.approx(
        {"sender wait": 100.0, "sender fill": 50.0, "receiver scatter": 20.0})
