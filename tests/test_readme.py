"""The README is a user's guide: short, machines named as hardware, no measurement history (that is in
benchmarks/NOTES.md), every ``PXN_*`` variable the code reads in its configuration table, every figure it shows
committed beside the JSON it is drawn from."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _code_files():
    for folder in ("transport", "pxn_kernels", "integration", "benchmarks"):
        yield from (REPO / folder).rglob("*.py")
    yield REPO / "tests" / "conftest.py"


def test_short():
    # a user's guide of about 250 lines, plus the tables a cluster operator needs: the wire, security, the memory
    # budget per peer and per engine
    assert len(README.splitlines()) <= 310


def test_no_lab_notebook():
    assert "nvidia-h200" not in README  # machines are named as hardware ("one H200", "two H200s, NV18")
    assert not re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d", README), "UTC timestamps belong in NOTES"
    hashes = re.findall(r"(?<![\w/.#-])[0-9a-f]{7,40}(?![\w-])", README)
    assert [h for h in hashes if re.search(r"[a-f]", h) and re.search(r"\d", h)] == []
    assert "pip configuration" not in README and "wheel index" not in README
    for text in ((REPO / "setup.py").read_text(), (REPO / "benchmarks" / "NOTES.md").read_text()):
        assert "design card" not in text and "the brief" not in text
        assert "nvidia-h200" not in text


def test_every_pxn_variable_is_in_the_configuration_table():
    table = README[README.index("## Configuration"):]
    table = table[:table.index("\n## ")]
    rows = set(re.findall(r"^\| `(PXN_[A-Z_]+)` \|", table, re.M))
    read = set()
    for path in _code_files():
        read |= set(re.findall(r"\bPXN_[A-Z][A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")))
    assert read - rows == set(), f"read by the code, missing from the README's table: {sorted(read - rows)}"


def test_figures_and_their_json_are_committed():
    figures = re.findall(r"!\[[^\]]*\]\((benchmarks/results/[\w.-]+\.png)\)", README)
    assert len(figures) >= 6
    for png in figures:
        assert (REPO / png).is_file(), png
        assert (REPO / png).with_suffix(".json").is_file(), png
        assert png[:-4] + ".json" in README, f"{png}: the README names the JSON it is drawn from"
