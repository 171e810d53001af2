#!/usr/bin/env python3
"""Reproduce the field chunk-size table on the fabric at hand: per-transfer size x relay slot size, relayed vs
direct, plus the coalesced path.

Field table (Mooncake PXN prototype, B300, 400G): rows = per-transfer size 64 KB .. 8 MB, columns = relay buffer
512 KB / 1 MB / 8 MB and direct. Here two local processes run pxn TransferEngines over ``--fabric`` (tcp by
default) with host memory; on a CPU box the "relay" is a host staging slot (copy into a registered slot, then
one write from it), so ``relayed / direct`` shows what the relay pipeline costs on this fabric.

Paths:
* ``direct``     every piece is one zero-copy write from its source (``relay="never"``);
* ``relayed``    every piece goes through relay slots of ``slot_bytes`` (``relay="always"``);
* ``coalesced``  pieces are gathered into chunks of up to ``slot_bytes`` (one write each), validated and
  scattered by the receiver (``coalesce_bytes = piece + 1``).

Each cell writes ``--total-mb`` MB as ``total / piece`` pieces in one batch, ``--repeat`` times after a warm-up,
and reports the median. Cells run one after another, tens of seconds apart, so on a box whose speed drifts the
ratio of two cells moves with it. The goal pair (coalesced 64 KB pieces through 8 MiB slots against direct 8 MB
pieces) is therefore measured again after the table: both engines open at once, ``--goal-rounds`` rounds of
``--goal-repeat`` calls each, the two paths back to back in every round (their order alternating), and the ratio
taken per round; the median of those ratios is the goal figure (row ``path: goal_pair``).

Output: a JSON list of rows ``{piece_bytes, slot_bytes, path, gbps, fabric, date, ...}`` in a temporary file unless
``--out`` names one (``benchmarks/results/relay-table-<fabric>.json``), and the table on stdout.

Run:  python3 benchmarks/relay_table.py [--fabric tcp] [--total-mb 128] [--repeat 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import tempfile
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transport.bench_cli import LocalPeer, measure  # noqa: E402
from transport.config import parse_size  # noqa: E402
from transport.fabric import FABRICS  # noqa: E402
from transport.peer_process import Buffer  # noqa: E402
from transport.engine import TransferEngine  # noqa: E402

KB, MB = 1 << 10, 1 << 20
PIECES = [64 * KB, 512 * KB, 1 * MB, 2 * MB, 4 * MB, 8 * MB]
SLOTS = [512 * KB, 1 * MB, 8 * MB]
CHUNK_OVERHEAD = 64 + 16 + 16


# engine options of the two cells the goal compares: a direct write per 8 MB piece (stripe_bytes above it: one
# write each), and 64 KB pieces gathered into 8 MiB chunks
DIRECT = {"relay": "never", "coalesce_bytes": 0, "stripe_bytes": 16 * MB}
GOAL_SLOT = 8 * MB


def _coalesced(piece: int, slot: int) -> dict:
    return {"relay": "never", "coalesce_bytes": piece + 1, "relay_slot_bytes": slot}


def _shape(piece: int, total: int) -> dict:
    """``total // piece`` pieces of ``piece`` bytes, written in reverse order at the peer."""
    n = total // piece
    offs = np.arange(n, dtype=np.int64) * piece
    return {"src": offs, "dst": offs[::-1].copy(), "len": np.full(n, piece, dtype=np.int64)}


def _label(n: int) -> str:
    return f"{n // MB}MB" if n >= MB else f"{n // KB}KB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fabric", default="tcp", choices=FABRICS.names())
    ap.add_argument("--total-mb", type=int, default=128, help="MB written per call (default 128)")
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per cell (median reported)")
    ap.add_argument("--rails", type=int, default=2)
    ap.add_argument("--goal-rounds", type=int, default=21,
                    help="rounds of the goal pair measured back to back after the table (0: none)")
    ap.add_argument("--goal-repeat", type=int, default=3, help="calls per path in each goal round (median)")
    ap.add_argument("--cell", metavar="PIECE,SLOT", default=None,
                    help="only the relayed cell of these sizes (e.g. 64K,512K; no goal pair), to time one cell with "
                         "a larger --repeat")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file; the committed "
                                                "benchmarks/results/relay-table-<fabric>.json only with --out)")
    args = ap.parse_args(argv)
    cell_sizes = None
    if args.cell:
        try:
            cell_sizes = tuple(parse_size(v) for v in args.cell.split(","))
        except ValueError:
            cell_sizes = ()
        if len(cell_sizes) != 2 or min(cell_sizes) < 1:
            ap.error(f"--cell {args.cell!r}: expected PIECE,SLOT as two positive sizes, e.g. 64K,512K")
    logging.basicConfig(level=logging.WARNING)
    out = args.out or os.path.join(tempfile.gettempdir(), f"pxn-relay-table-{args.fabric}.json")
    total = args.total_mb * MB
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    t_start = time.perf_counter()
    # loadstore off: on ipc the load/store path would bypass the relay machinery this table measures
    common = {"fabric": args.fabric, "rails": args.rails, "loadstore": False}
    print(f"relay table on {args.fabric}, {args.rails} rails, host memory, {args.total_mb} MB per call, "
          f"median of {args.repeat}", flush=True)
    with LocalPeer({"dst": (total, -1)}, **common) as peer:
        src = Buffer(total, -1, random_seed=11)

        def cell(engine_kwargs, piece, slot, path):
            with TransferEngine(**common, **engine_kwargs) as eng:
                eng.register(src.addr, total)
                n = total // piece
                r = measure(eng, peer.session, src.addr, peer.addrs["dst"], _shape(piece, total), args.repeat,
                            warmup=1)
                st = eng.stats()
            row = {"piece_bytes": piece, "slot_bytes": slot, "path": path, "gbps": round(r["gbps"], 4),
                   "gbps_best": round(r["gbps_best"], 4), "median_s": round(r["median_s"], 6), "pieces": n,
                   "fabric": args.fabric, "date": date,
                   "units": {k: v["units"] for k, v in st["paths"].items()},
                   "time_s": st["time_s"]}
            rows.append(row)
            print(f"  {path:<9} piece {_label(piece):>5} slot {_label(slot) if slot else '-':>5}: "
                  f"{r['gbps']:7.3f} GB/s", flush=True)
            return row

        if args.cell:
            piece, slot = cell_sizes
            cell({"relay": "always", "coalesce_bytes": 0, "relay_slot_bytes": slot}, piece, slot, "relayed")
        for piece in PIECES if not args.cell else ():
            cell(DIRECT, piece, None, "direct")
            for slot in SLOTS:
                cell({"relay": "always", "coalesce_bytes": 0, "relay_slot_bytes": slot}, piece, slot, "relayed")
            for slot in SLOTS:
                if piece + CHUNK_OVERHEAD + 16 <= slot:
                    cell(_coalesced(piece, slot), piece, slot, "coalesced")
        for r in rows:
            d = next((x for x in rows if x["path"] == "direct" and x["piece_bytes"] == r["piece_bytes"]), None)
            r["ratio_to_direct"] = round(r["gbps"] / d["gbps"], 4) if d else None
        if args.goal_rounds > 0 and not args.cell:
            rows.append(goal_pair(common, peer, src, total, args.goal_rounds, args.goal_repeat, args.fabric, date))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    if args.cell:
        print(f"wrote {out}")
        return 0
    from transport.plots import plot_relay_table
    plot_relay_table(rows, os.path.splitext(out)[0] + ".png")  # the heat map beside the JSON (matplotlib)

    def get(path, piece, slot):
        for r in rows:
            if r["path"] == path and r["piece_bytes"] == piece and r["slot_bytes"] == slot:
                return r["gbps"]
        return None

    cols = [("relayed", s) for s in SLOTS] + [("direct", None)] + [("coalesced", s) for s in SLOTS]
    head = "".join(f"{(p[:5] + ' ' + _label(s)) if s else 'direct':>14}" for p, s in cols)
    print()
    print(f"GB/s on {args.fabric} ({platform.node()}), rows = per-transfer size")
    print(f"{'size':>6}{head}")
    for piece in PIECES:
        cells = ""
        for p, s in cols:
            v = get(p, piece, s)
            cells += f"{v:14.3f}" if v is not None else f"{'-':>14}"
        print(f"{_label(piece):>6}{cells}")
    worst = min((r["ratio_to_direct"], r["piece_bytes"], r["slot_bytes"]) for r in rows if r["path"] == "relayed")
    d8 = get("direct", 8 * MB, None)
    c64 = max(v for v in (get("coalesced", 64 * KB, s) for s in SLOTS) if v is not None)
    print(f"\nworst relayed/direct: {worst[0]:.3f} (piece {_label(worst[1])}, slot {_label(worst[2])}); "
          f"goal >= 0.95")
    print(f"best coalesced 64KB / direct 8MB: {c64 / d8:.3f} (cells of the table)")
    goal = next((r for r in rows if r["path"] == "goal_pair"), None)
    if goal is not None:
        print(f"coalesced 64KB (8MB slots) / direct 8MB, {goal['rounds']} rounds back to back: median "
              f"{goal['ratio_median']:.3f} (rounds {min(goal['ratio_rounds']):.3f}-{max(goal['ratio_rounds']):.3f}); "
              f"goal >= 0.9")
    print(f"wrote {out} in {time.perf_counter() - t_start:.0f} s")
    return 0


def goal_pair(common: dict, peer, src, total: int, rounds: int, repeat: int, fabric: str, date: str) -> dict:
    """The goal's two cells measured back to back: a direct engine (8 MB pieces) and a coalescing one (64 KB
    pieces into 8 MiB chunks), both open, ``rounds`` rounds of ``repeat`` calls per path (the path that goes
    first alternates). Returns the ``goal_pair`` row: the coalesced path's median GB/s over rounds, the direct
    path's (``direct_gbps``), and each round's ratio of the two (``ratio_rounds``) with their median."""
    shapes = {"direct": _shape(8 * MB, total), "coalesced": _shape(64 * KB, total)}
    options = {"direct": DIRECT, "coalesced": _coalesced(64 * KB, GOAL_SLOT)}
    gbps = {"direct": [], "coalesced": []}
    ratios = []
    with TransferEngine(**common, **options["direct"]) as direct, \
            TransferEngine(**common, **options["coalesced"]) as coalesced:
        engines = {"direct": direct, "coalesced": coalesced}
        for name, eng in engines.items():
            eng.register(src.addr, total)
            measure(eng, peer.session, src.addr, peer.addrs["dst"], shapes[name], 1, warmup=1)
        for k in range(rounds):
            got = {}
            for name in (("direct", "coalesced") if k % 2 == 0 else ("coalesced", "direct")):
                got[name] = measure(engines[name], peer.session, src.addr, peer.addrs["dst"], shapes[name], repeat,
                                    warmup=0)["gbps"]
                gbps[name].append(got[name])
            ratios.append(got["coalesced"] / got["direct"])
        st = coalesced.stats()
    print(f"  goal pair, {rounds} rounds: coalesced 64KB / direct 8MB per round "
          + " ".join(f"{x:.3f}" for x in ratios), flush=True)
    return {"piece_bytes": 64 * KB, "slot_bytes": GOAL_SLOT, "path": "goal_pair", "fabric": fabric, "date": date,
            "gbps": round(float(np.median(gbps["coalesced"])), 4),
            "direct_gbps": round(float(np.median(gbps["direct"])), 4), "rounds": rounds, "calls_per_round": repeat,
            "ratio_rounds": [round(x, 4) for x in ratios], "ratio_median": round(float(np.median(ratios)), 4),
            "units": {k: v["units"] for k, v in st["paths"].items()}}


if __name__ == "__main__":
    sys.exit(main())
