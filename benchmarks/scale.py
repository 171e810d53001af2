#!/usr/bin/env python3
"""How a receiving engine's cost grows with the number of peers writing into it.

Setup: tcp on loopback, host memory, one rail. One receiving engine in its own process (engine defaults but
``rails=1``: a 32 MiB landing pool of 4 MiB slots); N sender engines (N = 1, 8, 32, 64, 128 by default) spread
over up to 8 sender processes, each engine with small relay rings (one lane of two 1 MiB slots, one tcp
connection per rail) so that 128 of them fit the machine. Per N, fresh processes:

1. the N senders connect one after the other; each one's first batch (aux11: 11 pieces, 64-8192 B) is timed from
   the call to its return: handshake, region exchange, rail connects and the write (``ttfb_ms``: median and max
   over the N);
2. N - 1 senders then write 4096 x 64 B batches (chunks through the landing pool) back to back while the last
   one times aux11 batches (``aux11_ms_p50`` / ``aux11_ms_p99`` under the load of the other N - 1); the loaded
   senders' chunked batch times (each one's first left out: it asks for credits from idle) give
   ``load_ms_p50`` (median sender's median), ``load_ms_p50_worst`` (worst sender's median),
   ``load_ms_p99_worst`` (worst sender's p99) and batches per sender (min, max): the pool's fairness;
3. the receiver's figures with all N connected, after the load: ``rss_mib`` (VmRSS), ``landing_bytes`` (every
   landing pool), ``threads`` (its OS threads), ``fds`` (open file descriptors);
   ``dest_rss_mib``: the resident part of the receiver's destination buffer (1 MiB per sender: the user's memory,
   faulted in by the senders' writes), ``rss_pxn_mib`` = ``rss_mib`` - ``dest_rss_mib``;
   ``per_peer_kib`` = (``rss_pxn_mib`` at N - at N=1) / (N - 1).

Byte-exactness is the tests' job (tests/test_landing_pool.py); the last aux11 write of every sender is checked
here too (``byte_exact``).

Output: JSON (machine, versions, date, rows) to a temporary file unless ``--out`` names one, a PNG beside it
(``transport.plots.plot_scale``, which ``benchmarks/plots.py`` also draws from the JSON), a table on stdout.

Run:  python3 benchmarks/scale.py [--peers 1 8 32 64 128] [--load-seconds 3] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

AUX11 = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
REGION = 1 << 20  # receiver bytes per sender
LOAD = [64] * 4096
SENDER_OPTS = dict(fabric="tcp", rails=1, relay_slot_bytes=1 << 20, relay_slots=2, lanes=1,
                   fabric_options={"connections_per_peer": 1}, handshake_timeout=60.0, timeout=600.0)
RX_OPTS = dict(fabric="tcp", rails=1, handshake_timeout=60.0, max_senders=1024, max_conns_per_addr=1024)


def _proc_figures(pid: int) -> dict:
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return {"rss_bytes": rss, "threads": len(os.listdir(f"/proc/{pid}/task")),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _resident(addr: int, nbytes: int) -> int:
    """Resident bytes of the mappings of this process that overlap [addr, addr + nbytes) (/proc/self/smaps): the
    receiver's destination buffer is one anonymous mapping of its own, so this is the part of it the senders'
    writes have faulted in -- the user's KV memory, not pxn's."""
    total, overlap = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlap = lo < addr + nbytes and addr < hi
            elif overlap and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _receiver_main(conn, n: int) -> None:
    from transport import TransferEngine
    eng = TransferEngine(**RX_OPTS)
    mem = np.zeros(max(n, 1) * REGION, dtype=np.uint8)
    eng.register(mem.ctypes.data, mem.nbytes)
    conn.send({"session": eng.session_id, "base": mem.ctypes.data})
    while True:
        cmd, arg = conn.recv()
        if cmd == "figures":
            st = eng.stats()["receiver"]
            conn.send({**_proc_figures(os.getpid()), "landing_bytes": st["landing_bytes"],
                       "dest_rss_bytes": _resident(mem.ctypes.data, mem.nbytes),
                       "senders": st["senders"], "grants": st.get("grants", 0),
                       "credit_requests": st.get("credit_requests", 0)})
        elif cmd == "read":
            off, length = arg
            conn.send(mem[off:off + length].tobytes())
        elif cmd == "close":
            eng.close()
            conn.send(None)
            return


def _sender_main(conn, first: int, count: int, session: str, base: int) -> None:
    """``count`` sender engines (indices first ..). Commands: connect i (time its first aux11), load (every
    engine but the measuring one streams LOAD batches until stopped), measure (aux11 times of one engine)."""
    from transport import TransferEngine
    engines, srcs = [], []
    rng = np.random.default_rng(first)
    for i in range(count):
        e = TransferEngine(**SENDER_OPTS)
        src = np.frombuffer(rng.bytes(REGION), dtype=np.uint8).copy()
        e.register(src.ctypes.data, src.nbytes)
        engines.append(e)
        srcs.append(src)
    aux_offs = np.cumsum([0] + [n + 64 for n in AUX11[:-1]])

    def aux_lists(i):
        s = srcs[i].ctypes.data
        d = base + (first + i) * REGION
        return ([s + int(o) for o in aux_offs], [d + int(o) for o in aux_offs], AUX11)

    def load_lists(i):
        s = srcs[i].ctypes.data + 65536
        d = base + (first + i) * REGION + 65536
        return ([s + 64 * k for k in range(len(LOAD))], [d + 64 * k for k in range(len(LOAD))], LOAD)

    stop = threading.Event()
    times = {}
    threads = []
    conn.send("ready")
    while True:
        cmd, arg = conn.recv()
        if cmd == "connect":
            i = arg - first
            t0 = time.perf_counter()
            engines[i].batch_write(session, *aux_lists(i))
            conn.send(time.perf_counter() - t0)
        elif cmd == "load":
            skip = arg  # the measuring engine's global index, or -1
            stop.clear()

            def run(i):
                lists = load_lists(i)
                out = times.setdefault(i, [])
                while not stop.is_set():
                    t0 = time.perf_counter()
                    engines[i].batch_write(session, *lists)
                    out.append(time.perf_counter() - t0)

            for i in range(count):
                if first + i != skip:
                    t = threading.Thread(target=run, args=(i,), daemon=True)
                    t.start()
                    threads.append(t)
            conn.send(None)
        elif cmd == "measure":
            i, seconds = arg[0] - first, arg[1]
            lists = aux_lists(i)
            out = []
            end = time.perf_counter() + seconds
            while time.perf_counter() < end or len(out) < 20:
                t0 = time.perf_counter()
                engines[i].batch_write(session, *lists)
                out.append(time.perf_counter() - t0)
            conn.send(out)
        elif cmd == "stop":
            stop.set()
            for t in threads:
                t.join()
            threads.clear()
            conn.send({str(first + i): v for i, v in times.items()})
            times.clear()
        elif cmd == "expected":
            i = arg - first
            s_l, d_l, lens = aux_lists(i)
            conn.send([(d - base, srcs[i][s - srcs[i].ctypes.data:s - srcs[i].ctypes.data + n].tobytes())
                       for s, d, n in zip(s_l, d_l, lens)])
        elif cmd == "close":
            for e in engines:
                e.close()
            conn.send(None)
            return


def _call(conn, cmd, arg=None, timeout=900):
    conn.send((cmd, arg))
    if not conn.poll(timeout):
        raise RuntimeError(f"no answer to {cmd!r} within {timeout} s")
    return conn.recv()


def run_n(n: int, load_seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    rx_conn, child = ctx.Pipe()
    rx = ctx.Process(target=_receiver_main, args=(child, n), daemon=True)
    rx.start()
    info = rx_conn.recv()
    base_fig = _call(rx_conn, "figures")
    nproc = min(8, n)
    per = [n // nproc + (1 if p < n % nproc else 0) for p in range(nproc)]
    procs, conns, owner = [], [], {}
    first = 0
    for p in range(nproc):
        c, child = ctx.Pipe()
        pr = ctx.Process(target=_sender_main, args=(child, first, per[p], info["session"], info["base"]),
                         daemon=True)
        pr.start()
        procs.append(pr)
        conns.append(c)
        for i in range(first, first + per[p]):
            owner[i] = c
        first += per[p]
    for c in conns:
        assert c.recv() == "ready"
    try:
        ttfb = [_call(owner[i], "connect", i) for i in range(n)]
        connected_fig = _call(rx_conn, "figures")
        measuring = n - 1
        for c in conns:
            _call(c, "load", measuring)
        time.sleep(min(1.0, load_seconds / 3))  # the load settles
        aux = _call(owner[measuring], "measure", (measuring, load_seconds))
        load_times = {}
        for c in conns:
            load_times.update(_call(c, "stop"))
        fig = _call(rx_conn, "figures")
        exact = True
        for i in sorted({0, n // 2, n - 1}):
            for off, data in _call(owner[i], "expected", i):
                got = _call(rx_conn, "read", (off, len(data)))
                exact &= got == data
        # each sender's first loaded batch asks for credits from idle: left out, as a warm-up
        loaded = [v[1:] for v in load_times.values() if len(v) > 1]
        meds = [statistics.median(v) for v in loaded]
        p99s = [float(np.percentile(v, 99)) for v in loaded]
        counts = [len(v) for v in load_times.values()]
        return {
            "peers": n, "sender_processes": nproc,
            "ttfb_ms_median": round(statistics.median(ttfb) * 1e3, 2), "ttfb_ms_max": round(max(ttfb) * 1e3, 2),
            "aux11_ms_p50": round(float(np.percentile(aux, 50)) * 1e3, 3),
            "aux11_ms_p99": round(float(np.percentile(aux, 99)) * 1e3, 3), "aux11_calls": len(aux),
            "load_ms_p50": round(statistics.median(meds) * 1e3, 2) if meds else None,
            "load_ms_p99_worst": round(max(p99s) * 1e3, 2) if p99s else None,
            "load_ms_p50_worst": round(max(meds) * 1e3, 2) if meds else None,
            "load_batches": sum(counts), "load_batches_per_sender_min": min(counts, default=0),
            "load_batches_per_sender_max": max(counts, default=0),
            "rss_mib": round(fig["rss_bytes"] / 2**20, 1), "rss_idle_mib": round(base_fig["rss_bytes"] / 2**20, 1),
            "rss_connected_mib": round(connected_fig["rss_bytes"] / 2**20, 1),
            "dest_rss_mib": round(fig["dest_rss_bytes"] / 2**20, 1),
            "rss_pxn_mib": round((fig["rss_bytes"] - fig["dest_rss_bytes"]) / 2**20, 1),
            "landing_bytes": fig["landing_bytes"], "threads": fig["threads"], "threads_idle": base_fig["threads"],
            "fds": fig["fds"], "fds_idle": base_fig["fds"], "senders": fig["senders"],
            "grants": fig["grants"], "credit_requests": fig["credit_requests"], "byte_exact": bool(exact),
        }
    finally:
        for c in conns:
            try:
                _call(c, "close", timeout=120)
            except Exception:  # noqa: BLE001 - killed below
                pass
        try:
            _call(rx_conn, "close", timeout=120)
        except Exception:  # noqa: BLE001
            pass
        for p in procs + [rx]:
            p.join(10)
            if p.is_alive():
                p.kill()


def _pxn_version() -> str:
    try:
        from importlib.metadata import version
        return version("pxn")
    except Exception:  # noqa: BLE001 - not installed: the source tree alone
        return "source tree"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--load-seconds", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args(argv)
    rows = []
    for n in args.peers:
        t0 = time.time()
        row = run_n(n, args.load_seconds)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    one = next((r for r in rows if r["peers"] == 1), None)
    for r in rows:
        r["per_peer_kib"] = (round((r["rss_pxn_mib"] - one["rss_pxn_mib"]) * 1024 / (r["peers"] - 1), 1)
                             if one is not None and r["peers"] > 1 else None)
        r["threads_per_peer"] = (round((r["threads"] - one["threads"]) / (r["peers"] - 1), 2)
                                 if one is not None and r["peers"] > 1 else None)
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-scale-"), "scale.json")
    doc = {"benchmark": "scale", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "numpy": np.__version__, "pxn": _pxn_version()},
           "setup": {"fabric": "tcp (loopback)", "rails": 1, "receiver": RX_OPTS, "sender": SENDER_OPTS,
                     "load": "4096 x 64 B batches back to back by N - 1 senders", "probe": "aux11"},
           "rows": rows}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    png = os.path.splitext(out)[0] + ".png"
    from transport import plots  # the same drawing as benchmarks/plots.py makes from the JSON
    if not plots.plot_scale(doc, png):
        png = "no PNG (matplotlib is not installed)"
    print(f"{'N':>4} {'ttfb ms':>8} {'aux11 p50/p99 ms':>17} {'load p50/p99w ms':>17} {'RSS-dst':>8} "
          f"{'KiB/peer':>8} {'landing':>9} {'thr':>5} {'fds':>5} exact")
    for r in rows:
        print(f"{r['peers']:>4} {r['ttfb_ms_median']:>8} {r['aux11_ms_p50']:>8}/{r['aux11_ms_p99']:<8} "
              f"{r['load_ms_p50']!s:>8}/{r['load_ms_p99_worst']!s:<8} {r['rss_pxn_mib']:>8} {r['per_peer_kib']!s:>8} "
              f"{r['landing_bytes']:>9} {r['threads']:>5} {r['fds']:>5} {r['byte_exact']}")
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
