"""The benchmark plots: ``benchmarks/plots.py`` writes to a temporary folder unless told ``--out`` and covers
every committed figure; the kernels' x labels do not overlap; a peer that failed a shape is marked; the README's
relay table is the committed JSON's (the heat map is drawn from the same cells)."""
from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from pathlib import Path

import pytest

from transport import plots

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def _script():
    spec = importlib.util.spec_from_file_location("pxn_plots_script", REPO / "benchmarks" / "plots.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_relay_sentence_is_the_committed_json():
    """The README's sentence on the relay table gives the range of ``ratio_to_direct`` of the relayed cells of
    ``relay-table-tcp.json`` (the file the heat map is drawn from), beside the heat map itself."""
    rows = json.loads((RESULTS / "relay-table-tcp.json").read_text())
    ratios = [r["ratio_to_direct"] for r in rows if r["path"] == "relayed"]
    readme = (REPO / "README.md").read_text()
    at = readme.index("relay-table-tcp.json")
    said = readme[at:at + 600]
    assert f"{min(ratios):.2f} to {max(ratios):.2f} of direct writes" in said, said
    assert "relay-table-tcp.png" in said


def test_relay_table_cells():
    rows = [{"piece_bytes": 65536, "slot_bytes": None, "path": "direct", "gbps": 3.0},
            {"piece_bytes": 65536, "slot_bytes": 1 << 20, "path": "relayed", "gbps": 1.25},
            {"piece_bytes": 1 << 20, "slot_bytes": 1 << 20, "path": "relayed", "gbps": 2.5},
            {"piece_bytes": 65536, "slot_bytes": 1 << 19, "path": "coalesced", "gbps": 9.0},
            {"piece_bytes": 65536, "slot_bytes": 1 << 23, "path": "coalesced", "gbps": 4.0},
            {"piece_bytes": 65536, "slot_bytes": 1 << 23, "path": "goal_pair", "gbps": 99.0}]
    assert plots.relay_table_markdown(rows).splitlines() == [
        "| piece | relayed (1 MB slot) | direct | coalesced (8 MB slot) |", "|---|---|---|---|",
        "| 64 KB | 1.25 | 3.00 | 4.00 |", "| 1 MB | 2.50 | – | – |"]


@pytest.fixture
def matplotlib_or_skip():
    return pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_default_run_writes_to_a_temporary_folder_and_covers_every_figure(matplotlib_or_skip, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*.png")}
    assert _script().main([]) == 0
    out = capsys.readouterr().out
    folder = Path(re.search(r"plots: writing into (\S+)", out)[1])
    assert folder.parent == tmp_path
    drawn = {p.name for p in folder.glob("*.png")}
    assert set(before) <= drawn, f"committed figures not drawn: {set(before) - drawn}"
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS.glob("*.png")} == before  # tracked PNGs untouched


def test_out_folder(matplotlib_or_skip, tmp_path, capsys):
    assert _script().main([str(RESULTS / "peers-cpu.json"), "--out", str(tmp_path / "figs")]) == 0
    assert (tmp_path / "figs" / "peers-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert _script().main([str(RESULTS / "peers-cpu.json"), "--out", str(a_file)]) == 2


def _drawn(monkeypatch):
    """Keep the figure ``_save`` gets (drawn, before it is closed)."""
    figs = []
    real = plots._save

    def keep(fig, path):
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        fig.xlabel_boxes = [[t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
                            for ax in fig.axes]
        figs.append(fig)
        return real(fig, path)
    monkeypatch.setattr(plots, "_save", keep)
    return figs


def test_kernel_plot_x_labels_do_not_overlap(matplotlib_or_skip, monkeypatch, tmp_path):
    figs = _drawn(monkeypatch)
    doc = json.loads((RESULTS / "kernels-h200.json").read_text())
    assert plots.plot_any(doc, str(tmp_path / "k.png"))
    for boxes in figs[0].xlabel_boxes:
        assert len(boxes) >= 9
        for a, b in zip(boxes, boxes[1:]):
            assert not a.overlaps(b), (a, b)


def test_fabrics_plot_marks_a_failed_peer(matplotlib_or_skip, monkeypatch, tmp_path):
    """fabrics-cpu.json has no mooncake-tcp figure for 64Bx4096 (it returned -1): the plot says so there."""
    figs = _drawn(monkeypatch)
    rows = json.loads((RESULTS / "fabrics-cpu.json").read_text())
    assert plots.plot_any(rows, str(tmp_path / "f.png"))
    texts = [t.get_text() for t in figs[0].axes[0].texts]
    assert sum("failed" in t for t in texts) == 1, texts
    rows = [dict(r, gbps=None, error="planted") if r["system"] == "nixl-ucx" and r["shape"] == "64MB" else r
            for r in rows]
    assert plots.plot_any(rows, str(tmp_path / "g.png"))
    assert sum("failed" in t.get_text() for t in figs[1].axes[0].texts) == 2
