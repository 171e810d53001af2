#!/usr/bin/env python3
"""pxn against its peers through the Mooncake-style API: pxn, Mooncake's transfer engine and NIXL side by side.

Setup (the same for every system): tcp on loopback, host memory, two processes per system (a target that registers
a destination buffer, an initiator that registers a source buffer and writes into the target), spawned fresh for
each system and round. The systems:

* ``pxn``       ``integration.mooncake.TransferEngine``: ``initialize(host, "P2PHANDSHAKE", "tcp", "")``,
                ``register_memory``, one ``batch_transfer_sync_write`` per batch (engine defaults);
* ``mooncake``  Mooncake's own ``mooncake.engine.TransferEngine`` (``mooncake-transfer-engine-non-cuda``), the same
                calls over its tcp transport. Its tcp transport refuses a batch of 4096 pieces unless
                ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` is raised: both of its processes get ``--mc-queue``
                (default 16384) unless that variable is already set; the value is recorded in its rows;
* ``nixl``      NIXL's Python agent over UCX, tcp only (``UCX_TLS=tcp``, ``UCX_MODULES=^ib``); one batch =
                ``get_xfer_descs`` for both sides (from prebuilt N x 3 arrays), ``initialize_xfer("WRITE")``,
                ``transfer``, polling ``check_xfer_state`` until DONE, ``release_xfer_handle``.

For every system the per-batch address / length lists (or arrays) are built once per shape, outside the timed
call; the timed call is what a sender runs per request.

Shapes: ``aux11`` (sglang's 11-piece aux batch, 64-8192 B), ``64Bx4096``, ``64KBx1024`` (65536 B pieces),
``2.25MBx78`` (78 x 2359296 B). Sources are packed back to back; destinations are written in reverse order with a
64 B gap after each piece, so a misplaced or overlong write shows.

Steady state: per shape, one first call (its time kept as ``first_call_ms``), warm-up calls (up to 20, at least 3,
for about ``--warmup-seconds``; NIXL's first transfers take milliseconds each), then timed calls until ``--calls``
calls or ``--seconds`` per shape, whichever comes first (at least ``--min-calls``), then one checked call
(destination poisoned with 0xA5, sources fresh random bytes per piece and round, the whole destination range,
gaps included, compared by SHA-256 with the expected image). ``--rounds`` passes over all systems (fresh processes
each time) pool their calls: ``ms`` is the median over all timed calls, ``ms_p10`` / ``ms_p90`` / ``ms_mean``
their spread and tail, ``ms_rounds`` each round's median.

Output: a JSON list of rows ``{system, shape, pieces, bytes, ms, gbps, byte_exact, ...}`` with machine, versions
and date, written to a temporary file unless ``--out`` names one (``benchmarks/results/peers-cpu.json``), a PNG
beside it (matplotlib), and a table on stdout. A system that cannot run here (not installed, fails to start, a
shape it refuses) gets rows whose ``error`` says why; the run goes on.

Run:  python3 benchmarks/peers.py [--systems pxn mooncake nixl] [--shapes ...] [--rounds 3] [--out PATH]
Benchmark-only dependencies: ``pip install mooncake-transfer-engine-non-cuda nixl`` and
``apt-get install -y --no-install-recommends libibverbs1`` (Mooncake's wheel links libibverbs).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

log = logging.getLogger("pxn.bench.peers")

AUX11 = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
SHAPES = {
    "aux11": AUX11,
    "64Bx4096": [64] * 4096,
    "64KBx1024": [65536] * 1024,
    "2.25MBx78": [2359296] * 78,
    "tiny3": [1, 63, 4096],  # for the smoke test: odd sizes, quick
}
DEFAULT_SHAPES = ["aux11", "64Bx4096", "64KBx1024", "2.25MBx78"]
SYSTEMS = ("pxn", "mooncake", "nixl")
GAP = 64          # bytes of poison after each destination piece
POISON = 0xA5
HOST = "127.0.0.1"


def layout(lengths):
    """(src offsets, dst offsets, src extent, dst extent) in bytes: sources back to back, destinations in reverse
    piece order with ``GAP`` bytes after each."""
    lens = np.asarray(lengths, dtype=np.int64)
    src = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    rev = lens[::-1] + GAP
    dst_rev = np.concatenate(([0], np.cumsum(rev)[:-1])).astype(np.int64)
    dst = dst_rev[::-1].copy()
    return src, dst, int(lens.sum()), int(rev.sum())


def extents(shapes):
    """Largest source and destination extents (bytes) over the shapes: the buffer sizes to register."""
    ls = [layout(SHAPES[s]) for s in shapes]
    return max(x[2] for x in ls), max(x[3] for x in ls)


def _env_for(system: str, mc_queue: int) -> dict:
    """Environment a system's processes need, set before the library is imported."""
    if system == "nixl":
        return {"UCX_TLS": "tcp", "UCX_MODULES": "^ib"}
    if system == "mooncake":
        env = {"GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "1")}  # no INFO lines from its engine
        queue = os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(mc_queue) if mc_queue > 0 else None)
        if queue is not None:
            env["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = queue
        return env
    return {}


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001 — not installed
        return "not installed"


def _pxn_version() -> str:
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "transport", "integration"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 — not a git checkout
        rev, dirty = "", ""
    return f"pxn@{rev or 'unknown'}{'+local-changes' if dirty else ''}"


# --- the two sides of each system ------------------------------------------------------------------------------
class _Side:
    """One system's endpoint in this process: registers ``buf`` and (initiator) writes batches."""

    def __init__(self, system: str, buf: np.ndarray, name: str):
        self.system, self.buf, self.addr = system, buf, buf.ctypes.data
        if system == "pxn":
            from integration.mooncake import TransferEngine
            self.eng = TransferEngine()
            self._mc_init()
        elif system == "mooncake":
            from mooncake.engine import TransferEngine
            self.eng = TransferEngine()
            self._mc_init()
        elif system == "nixl":
            from nixl._api import nixl_agent, nixl_agent_config
            self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
            self.reg = self.agent.register_memory(self.agent.get_reg_descs([(self.addr, buf.nbytes, 0, "")],
                                                                           "DRAM"))
            self.info = {"meta": self.agent.get_agent_metadata(), "addr": self.addr}
        else:
            raise ValueError(f"unknown system {system!r}")

    def _mc_init(self):
        rc = self.eng.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"initialize returned {rc}")
        rc = self.eng.register_memory(self.addr, self.buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self.info = {"target": f"{HOST}:{self.eng.get_rpc_port()}", "addr": self.addr}

    def batch_fn(self, peer: dict, lengths, src_off, dst_off):
        """A callable performing one batch write of ``lengths`` (everything per batch prebuilt here)."""
        if self.system in ("pxn", "mooncake"):
            target, eng = peer["target"], self.eng
            srcs = [int(x) for x in self.addr + src_off]
            dsts = [int(x) for x in peer["addr"] + dst_off]
            lens = [int(x) for x in lengths]

            def batch():
                rc = eng.batch_transfer_sync_write(target, srcs, dsts, lens)
                if rc != 0:
                    raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
            return batch
        agent = self.agent
        if not hasattr(self, "remote"):
            self.remote = agent.add_remote_agent(peer["meta"])
        remote = self.remote
        lens = np.asarray(lengths, dtype=np.int64)
        zeros = np.zeros_like(lens)
        local_arr = np.stack([self.addr + src_off, lens, zeros], axis=1)
        remote_arr = np.stack([peer["addr"] + dst_off, lens, zeros], axis=1)

        def batch():
            local = agent.get_xfer_descs(local_arr, "DRAM")
            rem = agent.get_xfer_descs(remote_arr, "DRAM")
            h = agent.initialize_xfer("WRITE", local, rem, remote)
            state = agent.transfer(h)
            deadline = time.monotonic() + 30.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError("nixl transfer not done within 30 s")
                state = agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer state {state}")
        return batch


def _target_main(conn, system: str, env: dict, size: int) -> None:
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING)
    try:
        buf = np.zeros(size, dtype=np.uint8)
        side = _Side(system, buf, "target")
        conn.send(("ok", side.info))
    except BaseException as e:  # noqa: BLE001 — reported; the driver records it in the rows
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd == "poison":
            buf[:args[0]] = POISON
            conn.send(("ok", None))
        elif cmd == "hash":
            conn.send(("ok", hashlib.sha256(memoryview(buf[:args[0]])).hexdigest()))
        elif cmd == "stop":
            conn.send(("ok", None))
            os._exit(0)  # peers' shutdown paths are not measured (and some crash at exit)


def _time_shape(batch, shape: str, args) -> dict:
    """Warm-up calls, then timed calls; seconds per call."""
    warm = 0
    t_end = time.perf_counter() + args.warmup_seconds
    while warm < (args.warmup if args.warmup is not None else 20) and \
            (warm < 3 or args.warmup is not None or time.perf_counter() < t_end):
        batch()
        warm += 1
    times = []
    t_end = time.perf_counter() + args.seconds
    while len(times) < args.calls and (len(times) < args.min_calls or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        batch()
        times.append(time.perf_counter() - t0)
    return {"warmup": warm, "times": times}


def _initiator_main(conn, tconn, system: str, env: dict, size: int, shapes, args, seed: int) -> None:
    """Starts its side (in parallel with the target's), sends ("ready",), receives the target's info, writes every
    shape into the target; sends ("shape", name, result) per shape, then ("done",)."""
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING)
    try:
        buf = np.zeros(size, dtype=np.uint8)
        side = _Side(system, buf, "initiator")
    except BaseException as e:  # noqa: BLE001
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    peer = conn.recv()
    rng = np.random.default_rng(seed)
    for shape in shapes:
        lengths = SHAPES[shape]
        src_off, dst_off, src_n, dst_n = layout(lengths)
        res = {"error": None}
        try:
            buf[:src_n] = rng.integers(0, 256, src_n, dtype=np.uint8)  # distinct random bytes in every piece
            batch = side.batch_fn(peer, lengths, src_off, dst_off)
            t0 = time.perf_counter()
            batch()
            res["first_call_ms"] = (time.perf_counter() - t0) * 1e3
            res.update(_time_shape(batch, shape, args))
            # byte-exact: poisoned destination, one call, the whole destination range against the expected image
            tconn.send(("poison", dst_n))
            tconn.recv()
            batch()
            img = np.full(dst_n, POISON, dtype=np.uint8)
            for s, d, n in zip(src_off.tolist(), dst_off.tolist(), lengths):
                img[d:d + n] = buf[s:s + n]
            tconn.send(("hash", dst_n))
            _, got = tconn.recv()
            res["byte_exact"] = got == hashlib.sha256(memoryview(img)).hexdigest()
        except BaseException as e:  # noqa: BLE001 — a shape this system cannot do: recorded, the next one runs
            res["error"] = f"{type(e).__name__}: {e}"
            log.debug("%s %s: %s", system, shape, traceback.format_exc())
        conn.send(("shape", shape, res))
    conn.send(("done",))
    conn.recv()
    os._exit(0)


def run_system(system: str, shapes, args, seed: int) -> dict:
    """{shape: result} for one system and round (fresh target and initiator processes); raises with the reason
    when the system cannot start. Shapes not reached before ``--system-timeout`` get an error."""
    ctx = mp.get_context("spawn")
    env = _env_for(system, args.mc_queue)
    size = max(extents(shapes))
    t_drv, t_child = ctx.Pipe()
    i_drv, i_child = ctx.Pipe()
    it_a, it_b = ctx.Pipe()  # initiator <-> target: poison and hash for the byte-exact check
    procs = []
    out = {}
    deadline = time.monotonic() + args.system_timeout
    try:
        # both sides start at once (each imports its library: seconds on a loaded 2-core box)
        target = ctx.Process(target=_target_main, args=(t_child, system, env, size), daemon=True)
        init = ctx.Process(target=_initiator_main, args=(i_child, it_a, system, env, size, shapes, args, seed),
                           daemon=True)
        for p in (target, init):
            p.start()
            procs.append(p)
        if not t_drv.poll(90):
            raise RuntimeError("target did not start within 90 s")
        status, info = t_drv.recv()
        if status != "ok":
            raise RuntimeError(f"target: {info}")
        if not i_drv.poll(90):
            raise RuntimeError("initiator did not start within 90 s")
        msg = i_drv.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"initiator: {msg[1]}")
        i_drv.send(info)
        # the target serves the initiator's check requests; this process relays them
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{system} did not finish within {args.system_timeout:.0f} s")
            if it_b.poll(0):
                t_drv.send(it_b.recv())
                it_b.send(t_drv.recv())
                continue
            if not i_drv.poll(min(0.05, left)):
                if not init.is_alive() and not i_drv.poll(0):
                    raise RuntimeError(f"initiator exited with code {init.exitcode}")
                continue
            msg = i_drv.recv()
            if msg[0] == "err":
                raise RuntimeError(f"initiator: {msg[1]}")
            if msg[0] == "shape":
                out[msg[1]] = msg[2]
                r = msg[2]
                if r["error"]:
                    log.warning("%-8s %-10s %s", system, msg[1], r["error"])
                else:
                    log.info("%-8s %-10s median %.3f ms over %d calls, byte_exact %s", system, msg[1],
                             statistics.median(r["times"]) * 1e3, len(r["times"]), r["byte_exact"])
            elif msg[0] == "done":
                i_drv.send(("bye",))
                return out
    except BaseException as e:  # noqa: BLE001 — shapes not done get the reason
        reason = f"{type(e).__name__}: {e}"
        for s in shapes:
            out.setdefault(s, {"error": reason})
        if not any(r.get("times") for r in out.values()):
            raise RuntimeError(reason) from e
        log.warning("%s: %s", system, reason)
        return out
    finally:
        try:
            t_drv.send(("stop",))
        except OSError:
            pass
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def summarize(system: str, shape: str, results, versions: dict, envs: dict, common: dict) -> dict:
    """One row from a system's results for one shape over all rounds."""
    lengths = SHAPES[shape]
    nbytes = int(sum(lengths))
    times = [t for r in results for t in r.get("times", [])]
    errors = sorted({r["error"] for r in results if r.get("error")})
    row = {"system": system, "shape": shape, "pieces": len(lengths), "bytes": nbytes,
           "ms": None, "gbps": None, "byte_exact": None}
    if times:
        q = np.quantile(np.asarray(times), [0.1, 0.9]) * 1e3
        med = statistics.median(times)
        checks = [r.get("byte_exact") for r in results if r.get("times")]
        row.update(ms=round(med * 1e3, 4), gbps=round(nbytes / med / 1e9, 4),
                   byte_exact=bool(checks) and all(c is True for c in checks),
                   ms_p10=round(float(q[0]), 4), ms_p90=round(float(q[1]), 4),
                   ms_mean=round(statistics.fmean(times) * 1e3, 4),
                   ms_rounds=[round(statistics.median(r["times"]) * 1e3, 4) for r in results if r.get("times")],
                   first_call_ms=[round(r["first_call_ms"], 3) for r in results if "first_call_ms" in r],
                   calls=len(times), warmup_calls=max(r.get("warmup", 0) for r in results))
    if errors:
        row["error"] = "; ".join(errors)
    row.update(rounds=len(results), version=versions[system], env=envs[system], **common)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3, help="passes over all systems, fresh processes each time")
    ap.add_argument("--calls", type=int, default=300, help="most timed calls per shape and round")
    ap.add_argument("--min-calls", type=int, default=10, help="fewest timed calls per shape and round")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per shape and round (soft)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up calls per shape (default: 20, or fewer when --warmup-seconds pass first, >= 3)")
    ap.add_argument("--warmup-seconds", type=float, default=1.0, help="warm-up seconds per shape (soft)")
    ap.add_argument("--mc-queue", type=int, default=16384,
                    help="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER for Mooncake's processes unless already set "
                         "(0: Mooncake's default, which refuses a batch of 4096 pieces)")
    ap.add_argument("--system-timeout", type=float, default=240.0, help="seconds per system and round")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file; the committed "
                                                "benchmarks/results/peers-cpu.json only with --out)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the source bytes (default: fresh each run)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = args.out or os.path.join(tempfile.gettempdir(), "pxn-peers-cpu.json")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "python": platform.python_version(),
               "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    versions = {"pxn": _pxn_version() + " (integration.mooncake, tcp fabric)",
                "mooncake": "mooncake-transfer-engine-non-cuda " + _version("mooncake-transfer-engine-non-cuda"),
                "nixl": "nixl " + _version("nixl") + " (UCX backend)"}
    envs = {s: _env_for(s, args.mc_queue) for s in SYSTEMS}
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    results = {}  # (system, shape) -> [per-round result]
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        order = args.systems[rnd % len(args.systems):] + args.systems[:rnd % len(args.systems)]
        for system in order:  # each round starts with another system: a slow drift of the box hits all alike
            try:
                res = run_system(system, args.shapes, args, seed + 1000 * rnd + SYSTEMS.index(system))
            except Exception as e:  # noqa: BLE001 — a system that cannot run here: its rows say why
                log.warning("%s cannot run (round %d): %s", system, rnd + 1, e)
                res = {s: {"error": str(e)} for s in args.shapes}
            for shape, r in res.items():
                results.setdefault((system, shape), []).append(r)
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    common = {"transport": "tcp, loopback", "memory": "host", "processes": 2, "date": date, "machine": machine}
    rows = [summarize(system, shape, results[(system, shape)], versions, envs, common)
            for shape in args.shapes for system in args.systems]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    if not args.no_plot:
        from transport.plots import plot_fabrics
        plot_fabrics(rows, os.path.splitext(out)[0] + ".png")  # GB/s by shape and system (matplotlib)
    print(f"\npeers through the Mooncake-style API: tcp loopback, host memory, 2 processes per system; "
          f"{machine['cores']} cores, load {machine['loadavg_start'][0]}-{machine['loadavg_end'][0]}, {date}")
    print(f"{'shape':<11}" + "".join(f"{s + ' ms':>16}" for s in args.systems) + "   (median per batch call)")
    for shape in args.shapes:
        cells = ""
        for system in args.systems:
            r = next(x for x in rows if x["system"] == system and x["shape"] == shape)
            cells += f"{r['ms']:>16.3f}" if r["ms"] is not None else f"{'error':>16}"
            if r["ms"] is not None and not r["byte_exact"]:
                cells = cells[:-1] + "!"
        print(f"{shape:<11}{cells}")
    bad = [f"{r['system']} {r['shape']}" for r in rows if r["ms"] is not None and not r["byte_exact"]]
    if bad:
        print("NOT byte-exact: " + ", ".join(bad))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
