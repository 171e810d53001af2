#!/usr/bin/env python3
"""Render PNG plots from benchmark JSON: each ``FILE.json`` given (default: the committed results the README
shows) gets ``FILE.png`` beside it. Needs matplotlib (``pip install -e ".[bench]"``).

    python3 benchmarks/plots.py                                   # the README's figures
    python3 benchmarks/plots.py /tmp/pxn-bench.json               # any pxn bench / kernels / fabrics / relay JSON
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transport import plots  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
README_FIGURES = ["pxn-bench-cpu.json", "kernels-h200.json", "fabrics-cpu.json", "relay-table-tcp.json"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", help="benchmark JSON files (default: the README's figures)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    files = args.json or [os.path.join(RESULTS, f) for f in README_FIGURES]
    written = 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            print(f"plots: cannot read {path}: {e}", file=sys.stderr)
            return 2
        out = plots.plot_any(doc, os.path.splitext(path)[0] + ".png")
        for p in out:
            print(f"wrote {os.path.relpath(p)}")
        written += len(out)
        if not out and plots._pyplot() is not None:
            print(f"plots: {path}: no plot for this kind of result", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
