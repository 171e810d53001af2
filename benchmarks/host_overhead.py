#!/usr/bin/env python3
"""Host time per call of the engine's same-host load/store path, on a CPU box (no GPU needed).

Why: on the H200 the sglang pair (78 KV blocks + the aux batch) misses its goal by host time, not bytes
(benchmarks/NOTES.md, section Engine: ~40-80 us of Python per pair where the goal leaves ~37 us), and that
host time can be measured without a GPU. Everything of that host time except the CUDA launch and the
synchronise is the same Python on any machine: argument checks, region lookups, classification, the host
pieces' ``process_vm_writev`` and the bookkeeping. This script times exactly that path with host memory on both
sides (ipc fabric, two processes), using piece counts of the sglang shapes and small pieces so that copying
bytes costs little next to the host work:

* ``aux``          the aux batch: 11 pieces, 64 B - 8 KB (sglang sends it as its own call);
* ``kv78``         78 pieces of 4 KiB: the KV call's piece count (host time does not depend on the size);
* ``kv78+aux``     the two as one batch (two regions on each side: the per-piece classification path);
* ``4096x64B``     4096 pieces of 64 B.

Each case: 300 warm-up calls, then ``--rounds`` rounds of ``--calls`` calls; the median round's mean per call is
reported, with the engine's own split (``stats()["time_s"]``: ``validate`` = argument checks and region lookups,
``loadstore`` = classification, host write and bookkeeping). Every case is verified byte for byte once.
Output: a JSON list of rows (a temporary file unless ``--out`` names one, e.g. ``benchmarks/results/host-overhead-cpu.json``) and a table.

Run:  python3 benchmarks/host_overhead.py [--calls 1000] [--rounds 7] [--out PATH]

``--message-path``: instead, the host time per ``batch_write`` of the engine's message path (ipc fabric with
``loadstore=False`` on both sides, host memory, numpy arrays as the caller's arguments): validation, plan, the
post, the ipc fabric's write by ``process_vm_writev`` and the completion, which on a GPU machine run the same
Python around a CUDA copy. Shapes of ``benchmarks/message_path.py``: ``aux11``, ``1024x64KB``,
``kv78x2.25MB``, ``4096x64B``, ``mix2000+8x2MB``. Per shape, verified byte for byte once, then ``--rounds``
rounds of ``--calls`` calls with the cross-memory copy replaced by a no-op (``python_us``: the host work the
GPU path also pays; median round, wall and caller-thread CPU time), and the same with the copy (``us``, fewer
calls for the large shapes). ``--profile DIR``: a cProfile of the caller over one more round per shape.

Run:  python3 benchmarks/host_overhead.py --message-path [--calls 300] [--rounds 7] [--shapes aux11,...]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from transport.bench_cli import AUX, LocalPeer  # noqa: E402
from transport.peer_process import POISON, Buffer, digest  # noqa: E402

KB, MB = 1 << 10, 1 << 20


def _case_offsets(rng, lengths: np.ndarray, room: int) -> np.ndarray:
    """Disjoint, shuffled, unaligned offsets for ``lengths`` inside ``room`` bytes."""
    gaps = rng.integers(1, 64, size=lengths.size)
    order = rng.permutation(lengths.size)
    offs = np.empty(lengths.size, dtype=np.int64)
    pos = 0
    for i in order.tolist():
        pos += int(gaps[i])
        offs[i] = pos
        pos += int(lengths[i])
    if pos > room:
        raise ValueError(f"case needs {pos} B, buffer has {room}")
    return offs


def _rounds(fn, args) -> list:
    """Seconds per call of ``fn``, one mean per round of ``args.calls`` calls, ``args.rounds`` rounds."""
    out = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        out.append((time.perf_counter() - t0) / args.calls)
    return out


def _classify_row(args, date: str) -> dict:
    """The load/store writer's split of a KV + aux batch whose KV side is GPU memory (78 GPU -> GPU pieces, then
    11 host -> host pieces): ``LoadStoreWriter._classify`` alone, on region snapshots shaped like the H200 run's
    (the peer's GPU mapping stubbed, since no GPU is needed to split a batch)."""
    import torch
    from transport.fabric.loadstore import LoadStoreWriter
    from transport.regions import Region, RegionTable
    blk, layers = 8650752, 78
    kv_l, aux_l, kv_r, aux_r = 0x7F0000000000, 0x550000000000, 0x7E0000000000, 0x560000000000
    local = RegionTable([Region(kv_l, 2 * layers * blk, 0), Region(aux_l, MB, -1)]).snapshot()
    remote = RegionTable([Region(kv_r, 2 * layers * blk, 0), Region(aux_r, MB, -1)]).snapshot()
    aux = np.array(AUX, dtype=np.int64)
    ao = np.concatenate([[0], np.cumsum(aux)[:-1]]).astype(np.int64)
    src = np.concatenate([kv_l + np.arange(layers, dtype=np.int64) * 2 * blk, aux_l + ao])
    dst = np.concatenate([kv_r + np.arange(layers, dtype=np.int64) * blk, aux_r + ao])
    ln = np.concatenate([np.full(layers, blk, dtype=np.int64), aux])
    src_dev = local.devices[np.searchsorted(local.starts_i64, src, side="right") - 1]
    dst_idx = np.searchsorted(remote.starts_i64, dst, side="right") - 1
    w = LoadStoreWriter.__new__(LoadStoreWriter)
    mapped = np.array([0x100000000000 if r.device >= 0 else -1 for r in remote.regions], dtype=np.int64)
    w._mapped_starts = lambda snap, device: mapped
    split = w._classify(src, dst, ln, src_dev, dst_idx, remote)
    if len(split) == 2:  # (host, GPU groups); a 4-tuple in versions before 2026-11-29's
        host, groups = split
        assert host is not None and host[2].size == aux.size and len(groups) == 1 and groups[0][3].size == layers

    def per_call(fn):
        for _ in range(300):
            fn()
        return float(np.median(_rounds(fn, args))) * 1e6

    row = {"case": "classify kv78(GPU)+aux(host)", "pieces": int(ln.size),
           "us_per_call": round(per_call(lambda: w._classify(src, dst, ln, src_dev, dst_idx, remote)), 2),
           "us_per_piece_version": round(per_call(
               lambda: w._classify_pieces(src, dst, ln, src_dev, dst_idx, remote)), 2)
           if hasattr(w, "_classify_pieces") else None,
           "machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "numpy": np.__version__, "torch": torch.__version__, "date": date}
    print(f"  {row['case']}: {row['us_per_call']:.1f} us per split ({row['us_per_piece_version']} us piece by "
          f"piece)", flush=True)
    return row


MESSAGE_PATH_BUFFER = 256 * MB


def message_path_shapes(rng) -> dict:
    """The shapes of ``benchmarks/message_path.py`` (lengths per piece)."""
    mix = rng.integers(1, 8193, size=2000).tolist() + [2 * MB] * 8
    return {"aux11": list(AUX), "1024x64KB": [64 * KB] * 1024, "kv78x2.25MB": [2359296] * 78,
            "4096x64B": [64] * 4096, "mix2000+8x2MB": mix}


def _timed_rounds(fn, calls: int, rounds: int) -> tuple:
    """(wall, caller-thread CPU) seconds per call of ``fn``: one mean per round of ``calls`` calls."""
    wall, cpu = [], []
    for _ in range(rounds):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        wall.append((t1 - t0) / calls / 1e9)
        cpu.append((c1 - c0) / calls / 1e9)
    return wall, cpu


def message_path(args) -> int:
    """The ``--message-path`` mode (see the module docstring)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from engine_helpers import disjoint_offsets
    from transport.engine import TransferEngine
    from transport.fabric import ipc

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % (1 << 31))
    print(f"message path, ipc loadstore=False, host memory; seed {seed}; {args.rounds} rounds x {args.calls} calls",
          flush=True)
    rng = np.random.default_rng(seed)
    shapes = message_path_shapes(rng)
    wanted = args.shapes.split(",") if args.shapes else list(shapes)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    size = MESSAGE_PATH_BUFFER
    rows = []
    real_copy = ipc.process_vm_write
    kw = {"fabric": "ipc", "loadstore": False, "rails": args.rails}
    with LocalPeer({"kv": (size, -1)}, **kw) as peer:
        src = Buffer(size, -1, random_seed=int(rng.integers(1 << 30)))
        with TransferEngine(**kw) as eng:
            eng.register(src.addr, size)
            for name in wanted:
                lengths = np.asarray(shapes[name], dtype=np.int64)
                s_off, d_off = disjoint_offsets(rng, lengths, size), disjoint_offsets(rng, lengths, size)
                s, d = (src.addr + s_off).astype(np.int64), (peer.addrs["kv"] + d_off).astype(np.int64)
                nbytes = int(lengths.sum())
                peer.call("poison")
                eng.batch_write(peer.session, s, d, lengths)
                img = np.full(size, POISON, dtype=np.uint8)
                host = src.host()
                for so, do, k in zip(s_off.tolist(), d_off.tolist(), lengths.tolist()):
                    img[do:do + k] = host[so:so + k]
                if peer.call("digest", name="kv") != digest(img):
                    raise SystemExit(f"{name}: the peer's buffer does not match the expected image")

                def call():
                    eng.batch_write(peer.session, s, d, lengths)
                copy_calls = max(3, min(args.calls, int(args.calls * 4 * MB // max(nbytes, 1))))
                for _ in range(min(copy_calls, 30)):
                    call()
                wall, cpu = _timed_rounds(call, copy_calls, args.rounds)
                ipc.process_vm_write = lambda *a, **k: None
                try:
                    for _ in range(100):
                        call()
                    before = eng.stats()["time_s"]
                    py_wall, py_cpu = _timed_rounds(call, args.calls, args.rounds)
                    after = eng.stats()["time_s"]
                    if args.profile:
                        import cProfile
                        import pstats
                        prof = cProfile.Profile()
                        prof.enable()
                        for _ in range(args.calls):
                            call()
                        prof.disable()
                        os.makedirs(args.profile, exist_ok=True)
                        with open(os.path.join(args.profile, f"profile-message-path-{name}.txt"), "w") as f:
                            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(45)
                finally:
                    ipc.process_vm_write = real_copy
                n_calls = args.rounds * args.calls
                split = {k: round((after.get(k, 0) - before.get(k, 0)) / n_calls * 1e6, 2)
                         for k in ("validate", "plan", "dispatch", "post", "wait")}
                row = {"case": name, "pieces": int(lengths.size), "bytes": nbytes,
                       "us": round(float(np.median(wall)) * 1e6, 2), "copy_calls": copy_calls,
                       "python_us": round(float(np.median(py_wall)) * 1e6, 2),
                       "python_cpu_us": round(float(np.median(py_cpu)) * 1e6, 2),
                       "python_us_best_round": round(min(py_wall) * 1e6, 2), "split_us": split,
                       "verified": "byte-exact", "fabric": "ipc", "loadstore": False, "rails": args.rails,
                       "memory": "host",
                       "seed": seed, "machine": platform.node(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "numpy": np.__version__, "date": date}
                rows.append(row)
                print(f"  {name:<14} {lengths.size:5d} pieces {row['us']:9.1f} us/call with the copy; host work "
                      f"{row['python_us']:7.1f} us wall, {row['python_cpu_us']:7.1f} us CPU (best round "
                      f"{row['python_us_best_round']:.1f}); split {split}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="calls per round (default 1000)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per case; the median round is reported")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pxn-host-overhead-cpu.json"),
                    help="JSON path (default: a temporary file; the committed results are written only with --out)")
    ap.add_argument("--message-path", action="store_true",
                    help="time the message path (ipc, loadstore=False) instead of the load/store path")
    ap.add_argument("--shapes", default=None, help="--message-path: comma-separated shape names (default all)")
    ap.add_argument("--rails", type=int, default=1,
                    help="--message-path: rails of both engines (1: as benchmarks/message_path.py's one-NIC topology)")
    ap.add_argument("--seed", type=int, default=None, help="--message-path: offsets' and data's seed")
    ap.add_argument("--profile", default=None, help="--message-path: write a cProfile of each shape to this folder")
    args = ap.parse_args(argv)
    if args.message_path:
        if args.out == ap.get_default("out"):
            args.out = os.path.join(tempfile.gettempdir(), "pxn-host-overhead-message-path-cpu.json")
        return message_path(args)
    from transport.fabric import loadstore
    from transport.engine import TransferEngine
    import torch

    rng = np.random.default_rng()
    size = 4 * MB
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    aux = np.array(AUX, dtype=np.int64)
    kv = np.full(78, 4 * KB, dtype=np.int64)
    rows = []
    print(f"same-host load/store path, host memory, ipc fabric; {args.rounds} rounds x {args.calls} calls",
          flush=True)
    with LocalPeer({"kv": (size, -1), "aux": (size, -1)}, fabric="ipc") as peer:
        src = {"kv": Buffer(size, -1, random_seed=int(rng.integers(1 << 30))),
               "aux": Buffer(size, -1, random_seed=int(rng.integers(1 << 30)))}
        with TransferEngine(fabric="ipc") as eng:
            for b in src.values():
                eng.register(b.addr, size)
            parts = {}
            for name, lens in (("aux", aux), ("kv", kv), ("small", np.full(4096, 64, dtype=np.int64))):
                buf = "aux" if name == "aux" else "kv"
                parts[name] = (buf, lens, _case_offsets(rng, lens, size // 2), _case_offsets(rng, lens, size // 2))
            cases = {"aux": ["aux"], "kv78": ["kv"], "kv78+aux": ["kv", "aux"], "4096x64B": ["small"]}
            for case, names in cases.items():
                s = np.concatenate([src[parts[n][0]].addr + parts[n][2] for n in names])
                d = np.concatenate([peer.addrs[parts[n][0]] + parts[n][3] for n in names])
                ln = np.concatenate([parts[n][1] for n in names])
                # byte-exact once: the peer's buffers against the expected images
                peer.call("poison")
                eng.batch_write(peer.session, s, d, ln)
                for buf in {parts[n][0] for n in names}:
                    img = np.full(size, POISON, dtype=np.uint8)
                    for n in names:
                        if parts[n][0] != buf:
                            continue
                        host = src[buf].host()
                        for so, do, k in zip(parts[n][2].tolist(), parts[n][3].tolist(), parts[n][1].tolist()):
                            img[do:do + k] = host[so:so + k]
                    if peer.call("digest", name=buf) != digest(img):
                        raise SystemExit(f"{case}: the peer's buffer {buf!r} does not match the expected image")
                for _ in range(300):
                    eng.batch_write(peer.session, s, d, ln)
                before = eng.stats()["time_s"]

                def call():
                    eng.batch_write(peer.session, s, d, ln)
                per_round = _rounds(call, args)
                after = eng.stats()["time_s"]
                n_calls = args.rounds * args.calls
                split = {k: round((after.get(k, 0) - before.get(k, 0)) / n_calls * 1e6, 2)
                         for k in ("validate", "loadstore")}
                us = float(np.median(per_round)) * 1e6
                # the same calls with the cross-memory write replaced by a no-op: the Python part alone, i.e.
                # what the KV call on a GPU spends besides its launch (the syscall's time moves with the kernel's
                # page pinning from run to run)
                real = loadstore.process_vm_write
                loadstore.process_vm_write = lambda *a, **k: None
                try:
                    py_rounds = _rounds(call, args)
                finally:
                    loadstore.process_vm_write = real
                row = {"case": case, "pieces": int(ln.size), "bytes": int(ln.sum()), "us_per_call": round(us, 2),
                       "us_best_round": round(min(per_round) * 1e6, 2), "split_us": split,
                       "python_us_per_call": round(float(np.median(py_rounds)) * 1e6, 2),
                       "verified": "byte-exact", "fabric": "ipc", "memory": "host", "machine": platform.node(),
                       "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                       "torch": torch.__version__, "date": date}
                rows.append(row)
                print(f"  {case:<10} {ln.size:5d} pieces {us:8.1f} us/call (best round "
                      f"{row['us_best_round']:.1f}; validate {split['validate']}, loadstore {split['loadstore']}); "
                      f"without the syscall {row['python_us_per_call']:.1f} us", flush=True)
    rows.append(_classify_row(args, date))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
