"""Every code block of README.md and docs/*.md is checked, so the documentation keeps running as written.

Blocks are picked up from the Markdown at collection time (a new block in any of these files is a new test),
and what happens to one is said by its fence's info string:

``python`` / ``py``           a complete program: run in a fresh interpreter, in an empty directory, with this
                              checkout importable and nothing else set up (no ``TRITON_INTERPRET``); exit 0
``python gpu``                the same, skipped without CUDA
``python needs=MOD[,MOD]``    the same, skipped when a module pxn does not install is missing (e.g. sglang)
``python fragment``           not a program (an excerpt of setup.py, a signature): parsed for syntax only
``json``                      must parse
anything else                 (``console``, ``bash``, plain text, program output) is not checked
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


class Block(NamedTuple):
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    flags: List[str]
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def markdown_files() -> List[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_blocks(path: Path) -> List[Block]:
    """Fenced code blocks of one Markdown file (CommonMark fences, indented ones inside list items too)."""
    out: List[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        body, j = [], i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) \
                    and not close["info"].strip():
                break
            text = lines[j]
            body.append(text[min(indent, len(text) - len(text.lstrip())):])
            j += 1
        words = info.split()
        out.append(Block(path, i + 1, words[0].lower() if words else "", words[1:], "\n".join(body) + "\n"))
        i = j + 1
    return out


def checked_blocks():
    params = []
    for path in markdown_files():
        for b in code_blocks(path):
            if b.lang in ("python", "py", "json"):
                params.append(pytest.param(b, id=b.id))
    return params


def _needs(block: Block) -> List[str]:
    mods: List[str] = []
    for flag in block.flags:
        if flag.startswith("needs="):
            mods += [m for m in flag[len("needs="):].split(",") if m]
    return mods


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.parametrize("block", checked_blocks())
def test_doc_block(block: Block, tmp_path):
    where = f"{block.id} ({' '.join([block.lang, *block.flags])})"
    if block.lang == "json":
        json.loads(block.code)
        return
    known = {"gpu", "fragment"}
    unknown = [f for f in block.flags if f not in known and not f.startswith("needs=")]
    assert not unknown, f"{where}: unknown tag(s) {unknown}; use gpu, fragment or needs=MODULE"
    ast.parse(block.code, filename=block.id)
    if "fragment" in block.flags:
        return
    if "gpu" in block.flags and not _has_cuda():
        pytest.skip("needs a CUDA GPU (none visible)")
    missing = [m for m in _needs(block) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed)")
    script = tmp_path / "snippet.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PXN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (f"{where} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                                  f"\n--- stderr\n{proc.stderr[-3000:]}")


def test_collector_reads_fences(tmp_path):
    """The collector itself: tags, indented fences in list items, longer closing fences, unclosed blocks."""
    md = tmp_path / "x.md"
    md.write_text("text\n```python gpu\nprint(1)\n```\n* item\n\n  ```console\n  $ make\n  ```\n"
                  "````json\n{\"a\": \"```\"}\n```\n````\n~~~python needs=sglang,foo\nx = 1\n~~~\n```python\nopen\n")
    blocks = code_blocks(md)
    assert [(b.line, b.lang, b.flags) for b in blocks] == [
        (2, "python", ["gpu"]), (7, "console", []), (10, "json", []), (14, "python", ["needs=sglang,foo"]),
        (17, "python", [])]
    assert blocks[1].code == "$ make\n"
    assert blocks[2].code == "{\"a\": \"```\"}\n```\n"
    assert _needs(blocks[3]) == ["sglang", "foo"]

