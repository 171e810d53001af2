"""The README is a user's guide: short, machines named as hardware, no measurement history (that is in
benchmarks/NOTES.md), every ``PXN_*`` variable the code reads in its configuration table, every figure it shows
committed beside the JSON it is drawn from."""
from __future__ import annotations

import json
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


# --- one truth: every number of a results table comes from the JSON named beside it, each shape once ------------
def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield float(x)


def _result_tables():
    """(JSON file, [row cells]) of every table in the README whose paragraph names a results JSON."""
    out = []
    for m in re.finditer(r"((?:^\|.*\n)+)", README, re.M):
        names = re.findall(r"benchmarks/results/([\w.-]+\.json)", README[:m.start()][-600:])
        if names:
            rows = [[c.strip() for c in row.strip().strip("|").split("|")] for row in m.group(1).splitlines()[2:]]
            out.append((names[-1], rows))
    return out


def _numbers(cell):
    return re.findall(r"(?<![\w.×])(\d+(?:\.\d+)?)(?![\w.])", cell.replace("`", ""))


def _shown_as(token, value, scales=(1, 1e3, 1e-3, 1e-6, 1e-9, 2.0 ** -20, 2.0 ** -10)):
    """Whether ``value`` (in some unit of ``scales``) rounds to ``token`` at the digits shown."""
    digits = len(token.split(".")[1]) if "." in token else 0
    return any(abs(value * s - float(token)) <= 0.5 * 10 ** -digits * 1.0001 for s in scales)


def test_every_table_number_is_in_its_json():
    tables = _result_tables()
    assert len(tables) >= 7
    for name, rows in tables:
        values = list(_leaves(json.loads((REPO / "benchmarks" / "results" / name).read_text())))
        for cells in rows:
            for cell in cells[1:]:
                for token in _numbers(cell):
                    assert any(_shown_as(token, v) for v in values), f"{name}: {cells[0]}: {token} is not in it"


def test_engine_tables_match_their_json_row_by_row():
    """The two tables of pxn's engine on the 2-core machine, cell by cell against their rows."""
    tables = dict((name, rows) for name, rows in _result_tables())
    bench = {r["shape"].split(" ")[0]: r for r in
             json.loads((REPO / "benchmarks" / "results" / "pxn-bench-cpu.json").read_text())["rows"]}
    for cells in tables["pxn-bench-cpu.json"]:
        r = bench[cells[0].split(" ")[0]]
        assert [int(cells[1]), float(cells[2]), float(cells[3]), float(cells[4])] == [
            r["pieces"], round(r["bytes"] / 1e6, 1), round(r["median_s"] * 1e3, 1), round(r["gbps"], len(cells[4]) - 2)]
    peers = {(r["system"], r["shape"]): r for r in
             json.loads((REPO / "benchmarks" / "results" / "peers-cpu.json").read_text())}
    keys = {"aux11": "aux11", "4096 × 64 B": "64Bx4096", "1024 × 64 KB": "64KBx1024", "78 × 2.25 MB": "2.25MBx78"}
    for cells in tables["peers-cpu.json"]:
        shape = keys[cells[0].split(" (")[0]]
        for system, cell in zip(("pxn", "mooncake", "nixl"), cells[1:]):
            assert _shown_as(cell, peers[(system, shape)]["ms"], scales=(1,)), (cells[0], system, cell)


_UNITS = {"B": 1, "KB": 1 << 10, "KiB": 1 << 10, "MB": 1 << 20, "MiB": 1 << 20}


def _shape_key(label):
    """(pieces, bytes per piece) of a row label such as "4096 × 64 B", "2.25 MB × 78", "78 × 2359296 B"."""
    m = re.search(r"(\d+) × (\d+(?:\.\d+)?) ?(B|KB|KiB|MB|MiB)\b", label)
    if m:
        return int(m[1]), round(float(m[2]) * _UNITS[m[3]])
    m = re.search(r"(\d+(?:\.\d+)?) ?(B|KB|KiB|MB|MiB) × (\d+)", label)
    if m:
        return int(m[3]), round(float(m[1]) * _UNITS[m[2]])
    return label


def test_each_shape_once_per_machine():
    """A shape measured on the 2-core machine appears in one table only (the same quantity three times, from
    three runs, read as three truths)."""
    seen = {}
    for name, rows in _result_tables():
        if not name.endswith("-cpu.json") or name.startswith("scale"):
            continue
        for cells in rows:
            key = _shape_key(cells[0])
            assert key not in seen, f"{cells[0]!r} in {name} and in {seen[key]}"
            seen[key] = name


def test_machines_named_as_what_they_are():
    for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        text = path.read_text(encoding="utf-8")
        assert "CPU box" not in text, f"{path.name}: say what the machine is (a 2-core machine without a GPU)"


def test_python_version_licence_and_where_next():
    required = re.search(r'python_requires=">=(\d+\.\d+)"', (REPO / "setup.py").read_text())[1]
    assert f"Python {required} or newer" in README
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert 'license="Apache-2.0"' in (REPO / "setup.py").read_text()
    assert "## Licence" in README and "(LICENSE)" in README
    where = README[README.index("## Where next"):]
    for link in re.findall(r"\]\(([^)#]+)", where[:where.index("\n## ")]):
        assert (REPO / link).exists(), link
    assert "troubleshooting" in where
