#!/usr/bin/env python3
"""Render PNG plots from benchmark JSON: each ``FILE.json`` (default: every JSON in benchmarks/results/ of a kind
that has a plot) gets ``FILE.png`` in a new temporary folder, or in ``--out DIR``. Needs matplotlib
(``pip install -e ".[bench]"``).

    python3 benchmarks/plots.py                                   # every committed result, into a temp folder
    python3 benchmarks/plots.py --out benchmarks/results          # redraw the committed PNGs
    python3 benchmarks/plots.py /tmp/pxn-bench.json --out /tmp    # any pxn bench / kernels / fabrics / relay JSON
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transport import plots  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", help="benchmark JSON files (default: every one in benchmarks/results/)")
    ap.add_argument("--out", metavar="DIR", help="write the PNGs here (default: a new temporary folder)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if plots._pyplot() is None:
        print("plots: matplotlib is not installed (pip install -e \".[bench]\"): nothing drawn", file=sys.stderr)
        return 2
    files = args.json or sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    docs = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                docs.append((path, json.load(f)))
        except (OSError, ValueError) as e:
            print(f"plots: cannot read {path}: {e}", file=sys.stderr)
            return 2
    out_dir = args.out or tempfile.mkdtemp(prefix="pxn-plots-")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        print(f"plots: --out {out_dir} is not a directory", file=sys.stderr)
        return 2
    print(f"plots: writing into {out_dir}")
    written = 0
    for path, doc in docs:
        out = plots.plot_any(doc, os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png"))
        for p in out:
            print(f"wrote {p}")
        written += len(out)
        if not out and args.json:  # asked for by name: say why nothing came of it
            print(f"plots: {path}: no plot for this kind of result", file=sys.stderr)
    return 0 if written else 2


if __name__ == "__main__":
    sys.exit(main())
