"""What connection-bound authentication costs: ``pxn bench`` of two source trees run alternately in one session,
and the per-message price of the tags.

1. ``pxn bench --fabric tcp`` (the default sglang shapes) of the tree before (``--before DIR``, e.g. a worktree of
   the commit before the change) and of this tree, alternating ``--pairs`` times, so that load from elsewhere on
   the host hits both alike; per row the median ms/call of each and the ratio.
2. Small batches, where a per-message cost shows most: a sender engine and a receiver in a spawned process (tcp,
   host memory), 11 pieces of sglang's aux sizes per ``batch_write`` and a 256 x 4 KiB batch, median of
   ``--batches`` calls, each tree in its own interpreter, alternating like the bench.
3. The price of one tag: sealing a frame header with its piece table (``transport.fabric.wire.seal``) and checking
   it, for tables of 1, 16 and 256 rows; and a control message's tag.
4. What payload integrity on tcp (not built: the tag covers headers and tables only) would cost: keyed BLAKE2b
   over a payload, GB/s, against the tcp fabric's own loopback rate from the bench.

Usage::

    python benchmarks/auth_overhead.py --before /tmp/pxn-before --pairs 4 \
        --out benchmarks/results/auth-overhead-cpu.json

Without ``--out`` the JSON goes to a temporary file (its path is printed).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)


def run_bench(tree: str, fabric: str, extra) -> dict:
    """One ``pxn bench`` of ``tree``; adds ``cpu_s``: CPU seconds (user + system) of the bench and its peer
    process, which load from elsewhere on the host disturbs far less than wall time."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="pxn-bench-")
    os.close(fd)
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "transport.cli", "bench", "--fabric", fabric, "--json", path, *extra]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(path) as f:
        out = json.load(f)
    os.unlink(path)
    out["cpu_s"] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out


def rows_of(result: dict) -> dict:
    return {r["shape"]: r["median_s"] * 1e3 for r in result["rows"]}


_PROBE = r"""
import json, sys, time
import numpy as np
from transport import TransferEngine
from transport.bench_cli import LocalPeer
n = int(sys.argv[1])
peer = LocalPeer({"buf": (16 << 20, -1)}, fabric="tcp")
out = {}
try:
    with TransferEngine(fabric="tcp") as eng:
        src = np.frombuffer(np.random.default_rng(1).bytes(16 << 20), dtype=np.uint8).copy()
        eng.register(src)
        for name, lengths in (("aux11", [8, 64, 256, 1024, 4096, 16, 32, 128, 512, 2048, 2104]),
                              ("256x4KiB", [4096] * 256)):
            offs = np.cumsum([0] + lengths[:-1]).tolist()
            srcs = [src.ctypes.data + o for o in offs]
            dsts = [peer.addrs["buf"] + o for o in offs]
            for _ in range(50):
                eng.batch_write(peer.session, srcs, dsts, lengths)
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                eng.batch_write(peer.session, srcs, dsts, lengths)
                ts.append(time.perf_counter() - t0)
            out[name] = sorted(ts)[len(ts) // 2] * 1e6
finally:
    peer.close()
print(json.dumps(out))
"""


def small_batches(tree: str, n: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(n)], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tag_costs(n: int = 20000) -> dict:
    import numpy as np

    from transport import auth
    from transport.fabric import wire
    key = os.urandom(32)
    tx = auth.Session(key, True, b"b", "tcp")
    rx = auth.Session(key, False, b"b", "tcp")
    out = {}
    for rows in (1, 16, 256):
        table = np.zeros(rows, dtype=wire.PIECE_DT).tobytes()
        frame = wire.HDR.pack(wire.MAGIC, wire.T_WRITE, 0, 0, rows, 7, len(table) + 4096) + table
        k = n if rows < 256 else n // 10
        t0 = time.perf_counter()
        sealed = [wire.seal(tx, frame) for _ in range(k)]
        t1 = time.perf_counter()
        for f in sealed:  # checked in the order sealed, as a receiver does (in its own buffer)
            h, tag = wire.rx_head(rx, f)
            h.update(memoryview(f)[48:48 + len(table)])
            rx.rx_end(h, tag)
        t2 = time.perf_counter()
        out[f"write_frame_{rows}_rows"] = {"seal_us": (t1 - t0) / k * 1e6, "check_us": (t2 - t1) / k * 1e6}
    body = json.dumps({"op": "regions"}).encode()
    t0 = time.perf_counter()
    for _ in range(n):
        tag = tx.tag(b"\0\0\0\0", body)
    t1 = time.perf_counter()
    out["control_message_tag_us"] = (t1 - t0) / n * 1e6
    del tag
    return out


def payload_hash_rate(nbytes: int = 64 << 20, rounds: int = 5) -> dict:
    data = os.urandom(nbytes)
    key = os.urandom(32)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        hashlib.blake2b(data, key=key, digest_size=16).digest()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return {"blake2b_keyed_GBps": best, "bytes": nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="source tree of the code before the change")
    ap.add_argument("--pairs", type=int, default=4, help="alternating (before, after) runs (default 4)")
    ap.add_argument("--fabric", default="tcp")
    ap.add_argument("--batches", type=int, default=2000, help="timed small batches per probe (default 2000)")
    ap.add_argument("--probe-pairs", type=int, default=6, help="alternating small-batch probes (default 6)")
    ap.add_argument("--skip-bench", action="store_true", help="only the small-batch probe and the tag costs")
    ap.add_argument("--out", help="JSON output (default: a temporary file)")
    args = ap.parse_args(argv)
    probes = {"before": [], "after": []}
    for i in range(args.probe_pairs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for which in order:
            tree = os.path.abspath(args.before) if which == "before" else HERE
            probes[which].append(small_batches(tree, args.batches))
            print(f"probe {i + 1}/{args.probe_pairs} {which:6s} " +
                  "  ".join(f"{k}={v:.1f} us" for k, v in probes[which][-1].items()), flush=True)
    probe_table = []
    for name in probes["after"][0] if probes["after"] else []:
        b = statistics.median(p[name] for p in probes["before"])
        a = statistics.median(p[name] for p in probes["after"])
        probe_table.append({"batch": name, "before_us": b, "after_us": a, "change_pct": (a / b - 1) * 100})
        print(f"small batch {name}: median of medians {b:.1f} -> {a:.1f} us ({(a / b - 1) * 100:+.1f}%)")
    runs = {"before": [], "after": []}
    cpu = {"before": [], "after": []}
    for i in range(0 if args.skip_bench else args.pairs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")  # neither always runs first
        for which in order:
            tree = os.path.abspath(args.before) if which == "before" else HERE
            t0 = time.time()
            res = run_bench(tree, args.fabric, [])
            runs[which].append(rows_of(res))
            cpu[which].append(res["cpu_s"])
            print(f"pair {i + 1}/{args.pairs} {which:6s} {time.time() - t0:5.1f} s, cpu {res['cpu_s']:5.1f} s  " +
                  "  ".join(f"{k.split()[0]}={v:.2f}" for k, v in runs[which][-1].items()), flush=True)
    shapes = list(runs["after"][0]) if runs["after"] else []
    table = []
    for shape in shapes:
        b = statistics.median(r[shape] for r in runs["before"])
        a = statistics.median(r[shape] for r in runs["after"])
        table.append({"shape": shape, "before_ms": b, "after_ms": a, "change_pct": (a / b - 1) * 100})
    tot_b = sum(statistics.median(r[s] for r in runs["before"]) for s in shapes) or 1.0
    tot_a = sum(statistics.median(r[s] for r in runs["after"]) for s in shapes) or 1.0
    print(f"\n{'shape':36s} {'before ms':>10s} {'after ms':>10s} {'change':>8s}")
    for row in table:
        print(f"{row['shape']:36s} {row['before_ms']:10.2f} {row['after_ms']:10.2f} {row['change_pct']:+7.1f}%")
    print(f"{'sum of medians':36s} {tot_b:10.2f} {tot_a:10.2f} {(tot_a / tot_b - 1) * 100:+7.1f}%")
    if cpu["after"]:
        cb, ca = statistics.median(cpu["before"]), statistics.median(cpu["after"])
        print(f"CPU seconds per bench run (sender + peer), median: {cb:.2f} -> {ca:.2f} ({(ca / cb - 1) * 100:+.1f}%)")
    tags = tag_costs()
    rate = payload_hash_rate()
    print("\ntag costs (us):", json.dumps(tags, indent=1))
    print("payload hashing:", rate)
    import numpy
    def rev(tree):
        r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return r.stdout.strip() or "unknown"
    result = {"trees": {"before": rev(os.path.abspath(args.before)), "after": rev(HERE)},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "numpy": numpy.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "fabric": args.fabric, "pairs": args.pairs, "rows": table,
              "sum_of_medians_ms": {"before": tot_b, "after": tot_a, "change_pct": (tot_a / tot_b - 1) * 100},
              "runs": runs, "cpu_s": cpu, "small_batches": probe_table, "small_batch_runs": probes,
              "tag_costs_us": tags, "payload_hash": rate}
    out = args.out
    if out is None:
        fd, out = tempfile.mkstemp(suffix=".json", prefix="pxn-auth-overhead-")
        os.close(fd)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
