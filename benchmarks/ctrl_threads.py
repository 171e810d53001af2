#!/usr/bin/env python3
"""Threads of a receiving engine against the number of connected senders, and a new peer's first transfer.

Setup: one receiving ``transport.TransferEngine`` (tcp, loopback, host memory, small landing and relay slots:
``SMALL``) in a spawned process; N sender engines in another (one per round), each connected and having written one
64-byte piece (so each holds a control connection and its rails to the receiver). For each N in ``--senders`` (default
1 8 32 64) the receiver reports its thread count (``threading.enumerate()``; ``ctrl_threads``: those of its control
plane, "ctrl" in the name), grouped by thread name (digits dropped), and ``--fresh`` more senders, one after
the other (each closed before the next), time their first ``batch_write`` of 64 bytes (``first_ms``: handshake,
rail connects, the write) and report the engine's own handshake time (``handshake_ms``: the control connection,
its authentication, the hello and its reply, the rail connects; ``stats()["handshake_s"]``). The destination is checked
byte-exact after every write. ``--rounds`` repeats the whole sweep with fresh processes; figures are medians.

Output: JSON (machine, versions, date, one row per N) to a temporary file unless ``--out`` names one, and a table
on stdout.

Run:  python3 benchmarks/ctrl_threads.py [--senders 1 8 32 64] [--rounds 3] [--fresh 5] [--out PATH]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

SLOT = 64  # bytes each sender writes
# small relay and landing slots: this measures threads and handshakes, and 64 engines with the default slots
# (4 MiB x 16 per sender per rail) do not fit in the box's memory
SMALL = {"relay_slot_bytes": 256 << 10, "relay_slots": 2, "landing_slots": 2}


def _receiver(conn, nbytes: int) -> None:
    from transport import TransferEngine
    eng = TransferEngine(fabric="tcp", max_conns_per_addr=1024, **SMALL)  # every sender comes from 127.0.0.1
    buf = np.zeros(nbytes, dtype=np.uint8)
    eng.register(buf)
    conn.send((eng.session_id, buf.ctypes.data))
    while True:
        cmd, arg = conn.recv()
        if cmd == "threads":
            time.sleep(0.3)  # let threads of connections just closed finish
            names = collections.Counter(re.sub(r"[\d:.]+", "#", t.name) for t in threading.enumerate())
            conn.send((threading.active_count(), dict(names)))
        elif cmd == "read":
            off, n = arg
            conn.send(bytes(buf[off:off + n]))
        else:
            eng.close()
            conn.send(None)
            return


def _sweep(counts, max_n: int, fresh_n: int) -> list:
    from transport import TransferEngine
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    slots = max_n + len(counts) * fresh_n + 1
    p = ctx.Process(target=_receiver, args=(child, slots * SLOT), daemon=True)
    p.start()
    session, base = parent.recv()
    senders = []
    rows = []
    slot = 0

    def write_one(eng) -> float:
        nonlocal slot
        src = np.frombuffer(os.urandom(SLOT), dtype=np.uint8).copy()
        eng.register(src)
        off = slot * SLOT
        slot += 1
        t0 = time.perf_counter()
        eng.batch_write(session, [src.ctypes.data], [base + off], [SLOT])
        dt = time.perf_counter() - t0
        parent.send(("read", (off, SLOT)))
        if parent.recv() != src.tobytes():
            raise SystemExit(f"byte mismatch at slot {slot - 1}")
        eng.__dict__.setdefault("_bench_bufs", []).append(src)
        return dt

    try:
        for n in counts:
            while len(senders) < n:
                eng = TransferEngine(fabric="tcp", **SMALL)
                senders.append(eng)
                write_one(eng)
            parent.send(("threads", None))
            total, names = parent.recv()
            firsts, shakes = [], []
            for _ in range(fresh_n):
                fresh = TransferEngine(fabric="tcp", **SMALL)
                firsts.append(write_one(fresh) * 1e3)
                shakes.append(fresh.stats()["handshake_s"] * 1e3)
                fresh.close()
            ctrl = sum(k for name, k in names.items() if "ctrl" in name)
            rows.append({"senders": n, "threads": total, "ctrl_threads": ctrl, "by_name": names,
                         "first_ms": statistics.median(firsts), "handshake_ms": statistics.median(shakes)})
    finally:
        for e in senders:
            e.close()
        parent.send(("close", None))
        parent.recv()
        p.join(10)
    return rows


def _round(conn, counts, max_n: int, fresh_n: int) -> None:
    conn.send(_sweep(counts, max_n, fresh_n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--senders", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh", type=int, default=5, help="new senders timed per N")
    ap.add_argument("--out")
    args = ap.parse_args()
    counts = sorted(set(args.senders))
    runs = []
    ctx = mp.get_context("spawn")
    for _ in range(args.rounds):  # each round in a fresh process: the senders of one never meet the next
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_round, args=(child, counts, counts[-1], args.fresh))
        p.start()
        runs.append(parent.recv())
        p.join(30)
    rows = []
    for i, n in enumerate(counts):
        rs = [r[i] for r in runs]
        rows.append({"senders": n, "threads": statistics.median(r["threads"] for r in rs),
                     "threads_rounds": [r["threads"] for r in rs],
                     "ctrl_threads": statistics.median(r["ctrl_threads"] for r in rs),
                     "first_ms": statistics.median(r["first_ms"] for r in rs),
                     "first_ms_rounds": [round(r["first_ms"], 2) for r in rs],
                     "handshake_ms": statistics.median(r["handshake_ms"] for r in rs),
                     "handshake_ms_rounds": [round(r["handshake_ms"], 2) for r in rs], "by_name": rs[0]["by_name"]})
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "rounds": args.rounds, "fresh": args.fresh, "engine_kwargs": SMALL, "rows": rows}
    out = args.out or tempfile.mkstemp(prefix="pxn-ctrl-threads-", suffix=".json")[1]
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'senders':>8} {'threads':>8} {'ctrl':>5} {'first ms':>9} {'hshake ms':>9}  threads by name (first round)")
    for r in rows:
        print(f"{r['senders']:>8} {r['threads']:>8} {r['ctrl_threads']:>5} {r['first_ms']:>9.2f} "
              f"{r['handshake_ms']:>9.2f}  {r['by_name']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
