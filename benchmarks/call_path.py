#!/usr/bin/env python3
"""The caller's path through the library for one ``batch_write`` of one large piece: which files it runs in, how
often it changes file, and how often it comes back to a file it left.

Setup: two tcp engines in two processes (this one sends; a spawned one registers the target buffer), host memory.
One warm-up ``batch_write`` of one ``--piece-mib`` piece (handshake, first-use state), then one more such call
traced with ``sys.setprofile`` in the calling thread only (the engine's own threads are not traced: what they do
is not on the caller's path). A library event is a call or return of Python code in ``transport/``,
``integration/`` or ``pxn_kernels/`` (C functions and other code are skipped, so a numpy call does not break a run
of one file). Reported:

* ``files``: the library files the call ran in, in order of first use, with their event counts;
* ``switches``: consecutive library events in different files;
* ``returns``: switches into a file the path had already left before.

The written bytes are checked at the end (the peer's buffer against the source), so a path that skips the write
cannot report a short path.

Output: a table on stdout and JSON (with machine, versions, date) written to a temporary file unless ``--out``
names one.

    python3 benchmarks/call_path.py
    python3 benchmarks/call_path.py --piece-mib 8 --out call-path.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile

import numpy as np

LIBRARY = ("transport", "integration", "pxn_kernels")


def _target(conn, nbytes: int) -> None:
    """The receiving engine: registers ``nbytes`` of host memory, sends (session, address), then answers a
    ``digest`` request with the buffer's bytes and exits on ``stop``."""
    from transport import TransferEngine
    eng = TransferEngine(fabric="tcp")
    buf = np.zeros(nbytes, dtype=np.uint8)
    eng.register(buf.ctypes.data, nbytes)
    conn.send((eng.session_id, buf.ctypes.data))
    while True:
        cmd = conn.recv()
        if cmd == "bytes":
            conn.send(buf.tobytes())
        else:
            break
    eng.close()


def _library_file(path: str, root: str):
    """``path`` relative to ``root`` (the tree ``transport`` was imported from) when it lies in one of the library
    packages, else None."""
    rel = os.path.relpath(path, root)
    return rel if rel.split(os.sep, 1)[0] in LIBRARY else None


def trace_call(fn) -> list:
    """Run ``fn()`` with a profile hook in this thread; (library file, function) of each Python call / return
    event."""
    import transport
    root = os.path.dirname(os.path.dirname(os.path.abspath(transport.__file__)))
    events = []
    known = {}

    def hook(frame, event, arg):
        if event not in ("call", "return"):
            return
        path = frame.f_code.co_filename
        rel = known.get(path, 0)
        if rel == 0:
            rel = known[path] = _library_file(path, root)
        if rel is not None:
            events.append((rel, frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return events


def summarize(events: list) -> dict:
    """Files (first use order, event counts), switches and returns of a list of per-event (file, function);
    ``runs``: each stretch of consecutive events in one file, as "file function" of its first event."""
    counts: dict = {}
    switches = returns = 0
    left: set = set()
    prev = None
    runs = []
    for f, fn in events:
        counts[f] = counts.get(f, 0) + 1
        if f != prev:
            runs.append(f"{f} {fn}")
        if prev is not None and f != prev:
            switches += 1
            if f in left:
                returns += 1
            left.add(prev)
        prev = f
    return {"files": counts, "n_files": len(counts), "switches": switches, "returns": returns, "events": len(events),
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--piece-mib", type=int, default=8, help="size of the one piece (MiB)")
    ap.add_argument("--out", help="JSON output path (default: a temporary file)")
    ap.add_argument("--runs", action="store_true", help="also print the path's runs (file, first function)")
    args = ap.parse_args()
    nbytes = args.piece_mib << 20

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, nbytes), daemon=True)
    proc.start()
    session, base = here.recv()
    from transport import TransferEngine
    eng = TransferEngine(fabric="tcp")
    try:
        src = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)
        eng.register(src.ctypes.data, nbytes)
        eng.batch_write(session, [src.ctypes.data], [base], [nbytes])  # warm-up: handshake, first-use state
        src[:] = np.random.default_rng().integers(0, 256, nbytes, dtype=np.uint8)
        events = trace_call(lambda: eng.batch_write(session, [src.ctypes.data], [base], [nbytes]))
        here.send("bytes")
        byte_exact = here.recv() == src.tobytes()
        routes = eng.stats()["routes"]
    finally:
        here.send("stop")
        proc.join(10)
        eng.close()
    result = summarize(events)
    result.update({"piece_bytes": nbytes, "byte_exact": byte_exact, "routes": routes,
                   "machine": platform.node(), "python": platform.python_version(), "numpy": np.__version__,
                   "date": datetime.date.today().isoformat()})
    print(f"one batch_write of one {args.piece_mib} MiB piece (tcp, host memory), caller's thread:")
    for f, n in result["files"].items():
        print(f"  {n:6d}  {f}")
    if args.runs:
        print("runs:")
        for r in result["runs"]:
            print(f"  {r}")
    print(f"files {result['n_files']}, switches {result['switches']}, returns {result['returns']}, "
          f"events {result['events']}, byte_exact {byte_exact}")
    out = args.out
    if out is None:
        fd, out = tempfile.mkstemp(prefix="call-path-", suffix=".json")
        os.close(fd)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    return 0 if byte_exact else 1


if __name__ == "__main__":
    sys.exit(main())
