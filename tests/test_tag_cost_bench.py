"""Smoke test of ``benchmarks/tag_cost.py`` (a benchmark, not a test of the tags): one tiny run writes a byte-exact
row with both arms timed, and the tagged arm's sender hashes one frame per aux call (its WRITE; the ACK carries
the WRITE's ack token, compared without a hash), where the untagged arm would count none."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "tag_cost.py"


@pytest.mark.slow
def test_tiny_run_writes_a_byte_exact_row_with_one_tag_op_per_aux_call(tmp_path, seed):
    out = tmp_path / "tags.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--fabric", "tcp", "--shapes", "aux_metadata", "--pairs", "4",
                        "--min-pairs", "2", "--seconds", "0.1", "--block-ms", "2", "--seed", str(seed),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["shape"] == "aux_metadata" and row["byte_exact"] and row["pieces"] == 11
    assert row["block_pairs"] >= 2 and set(row["ms"]) == {"tags", "no_tags"} and row["ratio"] > 0
    assert row["sender_tag_ops_per_call"] == 1.0, row
    assert res["seed"] == seed and res["machine"]["python"]


def test_bench_mode_times_pxn_bench_shapes_in_their_own_memory(tmp_path, seed):
    """``--bench``: pxn bench's own peer and shapes (here aux in host memory and the 4096-piece row), each written
    byte-exact by both arms before it is timed, the row naming its memory."""
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--bench", "--fabric", "tcp", "--shapes", "aux_metadata,4096x64B",
                        "--pairs", "3", "--min-pairs", "2", "--seconds", "0.1", "--block-ms", "2", "--seed", str(seed),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["bench"] is True
    rows = {r["shape"]: r for r in res["rows"]}
    assert set(rows) == {"aux_metadata", "4096x64B"}
    assert rows["aux_metadata"]["pieces"] == 11 and rows["4096x64B"]["pieces"] == 4096
    for r in rows.values():
        assert r["byte_exact"] and r["memory"] == "host" and r["block_pairs"] >= 2 and r["ratio"] > 0, r
    assert rows["aux_metadata"]["sender_tag_ops_per_call"] == 1.0, rows["aux_metadata"]
