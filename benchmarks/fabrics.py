"""Fabric benchmark, host memory, two processes: pxn tcp / pxn ipc vs Mooncake TransferEngine (tcp) and NIXL (UCX).

Run:  python benchmarks/fabrics.py [--repeats 7] [--rounds 3] [--out benchmarks/results/fabrics-cpu.json]
      [--systems pxn-tcp pxn-ipc mooncake-tcp nixl-ucx]

Each system gets a fresh target process (spawn) that registers a host buffer; this process writes into it.
gbps = payload bytes / median wall time of one batch call (build the batch, post it, wait for all of it), after
warm-up, pooled over ``rounds`` passes over all systems. A peer library that is missing or fails is skipped with a
logged reason, never a crash; so is a single shape a peer cannot do.
Benchmark-only dependencies: ``pip install mooncake-transfer-engine-non-cuda nixl`` and
``apt-get install -y --no-install-recommends libibverbs1``.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import multiprocessing as mp
import os
import tempfile
import platform
import statistics
import subprocess
import sys
import time
import traceback

# UCX's ib module segfaults at exit once Debian's ibverbs providers are installed; must precede any import.
os.environ.setdefault("UCX_MODULES", "^ib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

log = logging.getLogger("pxn.bench.fabrics")

# Large shapes first: Mooncake's tcp transport rejects a 4096-entry batch ("lane queue-full") and is unusable
# after that, so the shape it cannot do runs last.
SHAPES = [("64MB", 1, 64 << 20), ("2.25MBx78", 78, 2359296), ("4KBx1000", 1000, 4096), ("64Bx4096", 4096, 64)]
BUF = 192 << 20
SYSTEMS = ("pxn-tcp", "pxn-ipc", "mooncake-tcp", "nixl-ucx")


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


def _pxn_version() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        rev = ""
    try:
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "transport", "benchmarks/fabrics.py"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        dirty = ""
    return f"pxn@{rev or 'uncommitted'}{'+local-changes' if dirty else ''}"


# --- target processes ---------------------------------------------------------------------------------------
def _target(conn, system: str) -> None:
    os.environ.setdefault("UCX_MODULES", "^ib")
    logging.basicConfig(level=logging.WARNING)
    try:
        buf = np.zeros(BUF, dtype=np.uint8)
        addr = buf.ctypes.data
        keep = []
        if system.startswith("pxn-"):
            from transport.fabric import make_fabric
            fab = make_fabric(system[4:])
            mr = fab.register(addr, BUF)
            keep.append(fab)
            info = {"desc": fab.descriptor(), "addr": addr, "rkey": mr.rkey}
        elif system == "mooncake-tcp":
            from mooncake.engine import TransferEngine
            eng = TransferEngine()
            rc = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise RuntimeError(f"mooncake initialize returned {rc}")
            rc = eng.register_memory(addr, BUF)
            if rc != 0:
                raise RuntimeError(f"mooncake register_memory returned {rc}")
            keep.append(eng)
            info = {"target": "127.0.0.1:%d" % eng.get_rpc_port(), "addr": addr}
        elif system == "nixl-ucx":
            from nixl._api import nixl_agent, nixl_agent_config
            agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
            reg = agent.register_memory(agent.get_reg_descs([(addr, BUF, 0, "")], "DRAM"))
            keep += [agent, reg]
            info = {"meta": agent.get_agent_metadata(), "addr": addr}
        else:
            raise ValueError(f"unknown system {system!r}")
        conn.send(("ok", info))
    except BaseException as e:  # noqa: BLE001 — reported to the driver, which skips this system
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "hash":
            off, n = args
            conn.send(("ok", hashlib.sha256(memoryview(buf[off:off + n])).hexdigest()))
        elif cmd == "stop":
            conn.send(("ok", None))
            os._exit(0)  # peers' shutdown paths are not what we measure (and some crash at exit)


# --- initiators: each returns a callable(count, size) that performs one batch call ---------------------------
def _pxn_initiator(system, info, src):
    from transport.fabric import make_fabric
    from transport.fabric.base import WriteRequest
    fab = make_fabric(system[4:])
    mr = fab.register(src.ctypes.data, src.nbytes)
    ep = fab.connect(info["desc"])
    s0, d0, rkey, lkey = src.ctypes.data, info["addr"], info["rkey"], mr.lkey

    def batch(count, size):
        reqs = [WriteRequest(s0 + i * size, size, d0 + i * size, rkey, lkey, None, i) for i in range(count)]
        fab.post_writes(ep, reqs)
        got = 0
        while got < count:
            comps = fab.poll(4096, 10.0)
            if not comps:
                raise TimeoutError(f"{system}: no completion within 10 s")
            for c in comps:
                if c.error is not None:
                    raise c.error
            got += len(comps)
    return batch, fab.close


def _mooncake_initiator(info, src):
    from mooncake.engine import TransferEngine
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake initialize failed")
    if eng.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    s0, d0, target = src.ctypes.data, info["addr"], info["target"]

    def batch(count, size):
        rc = eng.batch_transfer_sync_write(target, [s0 + i * size for i in range(count)],
                                           [d0 + i * size for i in range(count)], [size] * count)
        if rc != 0:
            raise RuntimeError(f"mooncake batch_transfer_sync_write returned {rc}")
    return batch, lambda: None


def _nixl_initiator(info, src):
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    reg = agent.register_memory(agent.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    remote = agent.add_remote_agent(info["meta"])
    s0, d0 = src.ctypes.data, info["addr"]

    def batch(count, size):
        local = agent.get_xfer_descs([(s0 + i * size, size, 0) for i in range(count)], "DRAM")
        rem = agent.get_xfer_descs([(d0 + i * size, size, 0) for i in range(count)], "DRAM")
        h = agent.initialize_xfer("WRITE", local, rem, remote)
        state = agent.transfer(h)
        if state == "ERR":
            raise RuntimeError("nixl transfer returned ERR")
        deadline = time.monotonic() + 30
        while True:
            state = agent.check_xfer_state(h)
            if state == "DONE":
                break
            if state == "ERR" or time.monotonic() > deadline:
                raise RuntimeError(f"nixl transfer state {state}")
        agent.release_xfer_handle(h)
    return batch, lambda: (agent.deregister_memory(reg), agent.remove_remote_agent(remote))


def run_system(system: str, src: np.ndarray, repeats: int, warmup: int):
    """{shape: [seconds per batch call]} for one system (fresh target process), or raises with the reason it
    could not run. Shapes the system fails are left out (logged)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, system), daemon=True)
    proc.start()
    child.close()
    try:
        if not conn.poll(60):
            raise RuntimeError("target did not start within 60 s")
        status, info = conn.recv()
        if status != "ok":
            raise RuntimeError(f"target: {info}")
        if system.startswith("pxn-"):
            batch, close = _pxn_initiator(system, info, src)
        elif system == "mooncake-tcp":
            batch, close = _mooncake_initiator(info, src)
        else:
            batch, close = _nixl_initiator(info, src)
        out = {}
        for shape, count, size in SHAPES:
            try:
                for _ in range(warmup):
                    batch(count, size)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    batch(count, size)
                    times.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 — one shape a peer cannot do skips that row only
                log.warning("skipping %s %s: %s", system, shape, e)
                continue
            med = statistics.median(times)
            conn.send(("hash", 0, count * size))
            _, h = conn.recv()
            if h != hashlib.sha256(memoryview(src[:count * size])).hexdigest():
                raise RuntimeError(f"{system} {shape}: target bytes differ from the source")
            out[shape] = times
            log.info("%-12s %-10s %8.3f GB/s  median %.2f ms", system, shape, count * size / med / 1e9, med * 1e3)
        try:
            close()
        except Exception:  # noqa: BLE001
            log.debug("closing %s failed", system, exc_info=True)
        return out
    finally:
        try:
            conn.send(("stop",))
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed batch calls per shape and round")
    ap.add_argument("--rounds", type=int, default=3,
                    help="times the whole sequence of systems is run (fresh processes each time); the median is "
                         "taken over all rounds, so slow drifts of a shared 2-core machine hit every system alike")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--systems", nargs="*", default=list(SYSTEMS))
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pxn-fabrics-cpu.json"),
                    help="JSON path (default: a temporary file; the committed results are written only with --out)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    src = np.random.default_rng().integers(0, 256, BUF, dtype=np.uint8)
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "python": platform.python_version()}
    versions = {"pxn-tcp": _pxn_version(), "pxn-ipc": _pxn_version(),
                "mooncake-tcp": "mooncake-transfer-engine-non-cuda " + _version("mooncake-transfer-engine-non-cuda"),
                "nixl-ucx": "nixl " + _version("nixl") + " UCX_MODULES=" + os.environ.get("UCX_MODULES", "")}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    pooled = {}  # (system, shape) -> [seconds]
    for rnd in range(args.rounds):
        for system in args.systems:
            try:
                res = run_system(system, src, args.repeats, args.warmup)
            except Exception as e:  # noqa: BLE001 — a missing/broken peer skips its rows
                log.warning("skipping %s (round %d): %s", system, rnd + 1, e)
                log.debug("%s", traceback.format_exc())
                continue
            for shape, times in res.items():
                pooled.setdefault((system, shape), []).extend(times)
    rows = []
    sizes = {shape: count * size for shape, count, size in SHAPES}
    for system in args.systems:
        for shape, _, _ in SHAPES:
            times = pooled.get((system, shape))
            if not times:
                continue
            med = statistics.median(times)
            rows.append({"shape": shape, "system": system, "gbps": round(sizes[shape] / med / 1e9, 4),
                         "median_ms": round(med * 1e3, 3), "calls": len(times), "rounds": args.rounds,
                         "versions": versions[system], "date": date, "machine": machine})
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    log.info("wrote %d rows to %s", len(rows), args.out)
    from transport.plots import plot_fabrics
    plot_fabrics(rows, os.path.splitext(args.out)[0] + ".png")  # GB/s by shape beside the JSON (matplotlib)
    table = {(r["shape"], r["system"]): r["gbps"] for r in rows}
    systems = [s for s in args.systems if any(k[1] == s for k in table)]
    print(f"\nfabrics, host memory, 2 processes — {machine['platform']}, {machine['cores']} cores, {date}")
    print(f"{'shape':<11}" + "".join(f"{s:>14}" for s in systems) + "   (GB/s, median)")
    for shape, _, _ in SHAPES:
        print(f"{shape:<11}" + "".join(f"{table.get((shape, s), float('nan')):>14.3f}" for s in systems))
    for shape, base, other in (("64MB", "pxn-tcp", "mooncake-tcp"), ("2.25MBx78", "pxn-tcp", "mooncake-tcp"),
                               ("64MB", "pxn-ipc", "nixl-ucx")):
        if (shape, base) in table and (shape, other) in table:
            print(f"ratio {base}/{other} on {shape}: {table[(shape, base)] / table[(shape, other)]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
