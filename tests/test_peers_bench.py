"""Smoke test of ``benchmarks/peers.py`` (a benchmark, not a test of the peers): its layout leaves a poisoned gap
after every destination piece, and a pxn-only run of one tiny shape writes a byte-exact row."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "peers.py"


def _peers():
    spec = importlib.util.spec_from_file_location("pxn_bench_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_layout_reverses_destinations_with_a_gap_after_each(seed):
    peers = _peers()
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 5000, int(rng.integers(1, 40)))]
    src, dst, src_n, dst_n = peers.layout(lengths)
    lens = np.asarray(lengths)
    assert src_n == lens.sum() and dst_n == lens.sum() + peers.GAP * len(lengths)
    assert np.array_equal(src, np.concatenate(([0], np.cumsum(lens)[:-1])))  # sources back to back
    order = np.argsort(dst)
    assert np.array_equal(order, np.arange(len(lengths))[::-1])  # destinations in reverse piece order
    ends = dst[order] + lens[order]
    assert np.array_equal(dst[order][1:] - ends[:-1], np.full(len(lengths) - 1, peers.GAP))
    assert ends[-1] + peers.GAP == dst_n


def test_pxn_only_run_writes_a_byte_exact_row(tmp_path, seed):
    out = tmp_path / "peers.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--systems", "pxn", "--shapes", "tiny3", "--rounds", "1",
                        "--calls", "5", "--min-calls", "3", "--seconds", "0.1", "--warmup", "1", "--no-plot",
                        "--seed", str(seed), "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads(out.read_text())
    assert row["system"] == "pxn" and row["shape"] == "tiny3" and row["pieces"] == 3 and row["bytes"] == 4160
    assert row["byte_exact"] is True and "error" not in row, row
    assert row["ms"] > 0 and row["calls"] >= 3 and row["gbps"] > 0
    assert row["machine"]["cores"] and row["date"] and row["version"].startswith("pxn@")
