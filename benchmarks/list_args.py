#!/usr/bin/env python3
"""One batch given as lists, tuples, int64 arrays or CPU tensors: what each costs, through the native API and the
Mooncake API, and which route the engine took for it.

Setup: two processes, each an ``integration.mooncake.TransferEngine`` started as sglang starts it
(``initialize(host, "P2PHANDSHAKE", protocol, "")``, one registered buffer of ``--buffer-mib``); the sender writes
into the target. Every variant uses the same sender engine and connection:

* ``native-list`` / ``native-tuple`` / ``native-array`` / ``native-tensor``: the pxn engine's ``batch_write``
  (``mc._engine``) with the batch's three columns as lists, tuples, int64 numpy arrays or CPU int64 tensors;
* ``mooncake-list`` / ``mooncake-array``: ``batch_transfer_sync_write`` with lists (what sglang passes) or
  int64 arrays.

Per round, every variant is timed in turn (``--calls`` calls each, after ``--warmup``), in an order rotated each
round so that none always runs first; ``ms`` is the median over all rounds' calls, ``ms_p10`` / ``ms_p90`` the
spread, ``ms_rounds`` each round's median. Each variant's last call writes fresh random source bytes into a
poisoned destination and the whole destination range is compared with the expected image (``byte_exact``).
``route`` is what the engine's ``stats()["routes"]`` counted during the variant's calls (absent on trees without
route counters).

``--trees name=PATH,...`` runs the whole measurement once per tree per round, each in a fresh process with that
tree first on ``PYTHONPATH``, alternating (before/after in one run); default: this checkout only.

Shapes: ``aux11`` (sglang's 11-piece aux batch, 64-8192 B), ``4096x64B``, ``1024x64KB``.

``--conversions`` times, without engines, what converting one list of ints to an int64 array costs per candidate
(``np.asarray``, ``np.array(dtype=int64)``, ``np.fromiter``, ``array.array``, ``struct``, ``as_array``): the floor
``transport.arrays`` works against.

Output: JSON rows ``{tree, variant, shape, ms, ...}`` with machine, versions and date, written to a temporary file
unless ``--out`` names one, and a table on stdout.

    python3 benchmarks/list_args.py                                   # tcp, host memory
    python3 benchmarks/list_args.py --protocol ipc --device 0 --loadstore off --out $OUT/list-args-ipc.json
    python3 benchmarks/list_args.py --conversions --sizes 11,4096
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = "127.0.0.1"
POISON = 0xA5
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
SHAPES = {"aux11": AUX, "4096x64B": [64] * 4096, "1024x64KB": [65536] * 1024}
VARIANTS = ("native-list", "native-tuple", "native-array", "native-tensor", "mooncake-list", "mooncake-array")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _git_rev(path: str) -> str:
    try:
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+local-changes" if dirty else "")


def _engine_options(args) -> dict:
    opts = {}
    if args.loadstore != "default":
        opts["loadstore"] = args.loadstore == "on"
    return opts


def _alloc(size: int, device: int):
    """(address, host view or None, tensor or None) of a zeroed buffer of ``size`` bytes on ``device``."""
    if device < 0:
        buf = np.zeros(size, dtype=np.uint8)
        return buf.ctypes.data, buf, None
    import torch
    t = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{device}")
    return t.data_ptr(), None, t


def _target_main(conn, protocol: str, device: int, size: int, options: dict) -> None:
    import hashlib
    from integration.mooncake import TransferEngine
    eng = TransferEngine(**options)
    if eng.initialize(HOST, "P2PHANDSHAKE", protocol, "") != 0:
        conn.send(("err", "initialize failed"))
        return
    addr, host, tensor = _alloc(size, device)
    if eng.register_memory(addr, size) != 0:
        conn.send(("err", "register_memory failed"))
        return
    conn.send(("ok", {"target": f"{HOST}:{eng.get_rpc_port()}", "addr": addr}))
    while True:
        try:
            cmd, *a = conn.recv()
        except EOFError:
            os._exit(0)
        if cmd == "poison":
            if tensor is not None:
                tensor[:a[0]].fill_(POISON)
                __import__("torch").cuda.synchronize(device)
            else:
                host[:a[0]] = POISON
            conn.send(None)
        elif cmd == "hash":
            data = tensor[:a[0]].cpu().numpy() if tensor is not None else host[:a[0]]
            conn.send(hashlib.sha256(memoryview(np.ascontiguousarray(data))).hexdigest())
        else:
            conn.send(None)
            os._exit(0)


def _columns(kind: str, srcs: list, dsts: list, lens: list):
    if kind == "list":
        return list(srcs), list(dsts), list(lens)
    if kind == "tuple":
        return tuple(srcs), tuple(dsts), tuple(lens)
    arrays = tuple(np.asarray(c, dtype=np.int64) for c in (srcs, dsts, lens))
    if kind == "array":
        return arrays
    import torch
    return tuple(torch.from_numpy(a) for a in arrays)


def _routes(eng) -> dict:
    return dict(eng.stats().get("routes") or {})


def measure(args) -> list:
    """Every variant and shape on one pair of engines of the tree this process imports; the rows."""
    import hashlib
    from integration.mooncake import TransferEngine
    ctx = mp.get_context("spawn")
    size = args.buffer_mib << 20
    options = _engine_options(args)
    drv, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, args.protocol, args.device, size, options), daemon=True)
    proc.start()
    addr, host, tensor = _alloc(size, args.device)
    if args.plain:  # a plain pxn engine as the sender: no Mooncake layer, the interpreter's own switch interval
        from transport import TransferEngine as PxnEngine
        mc = None
        eng = PxnEngine(fabric=args.protocol, **options)
        eng.register(addr, size)
    else:
        mc = TransferEngine(**options)
        if mc.initialize(HOST, "P2PHANDSHAKE", args.protocol, "") != 0:
            raise RuntimeError("initialize failed")
        if mc.register_memory(addr, size) != 0:
            raise RuntimeError("register_memory failed")
        eng = mc._engine
    if not drv.poll(120):
        raise RuntimeError("target did not start within 120 s")
    status, info = drv.recv()
    if status != "ok":
        raise RuntimeError(f"target: {info}")
    target = info["target"]
    rng = np.random.default_rng(args.seed)
    rows = []
    for shape in args.shapes:
        lengths = SHAPES[shape]
        n = len(lengths)
        src_off = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        gaps = np.asarray(lengths, dtype=np.int64) + 64  # a 64 B gap after each piece: an overlong write shows
        dst_off = np.concatenate([[0], np.cumsum(gaps[::-1])[:-1]]).astype(np.int64)[::-1].copy()
        dst_n = int(gaps.sum())
        srcs = [addr + int(o) for o in src_off]
        dsts = [info["addr"] + int(o) for o in dst_off]
        for variant in args.variants:
            api, kind = variant.split("-")
            s, d, ln = _columns(kind, srcs, dsts, lengths)
            if api == "native":
                def call(s=s, d=d, ln=ln):
                    eng.batch_write(target, s, d, ln)
            else:
                def call(s=s, d=d, ln=ln):
                    rc = mc.batch_transfer_sync_write(target, s, d, ln)
                    if rc != 0:
                        raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
            for _ in range(args.warmup):
                call()
            before = _routes(eng)
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            after = _routes(eng)
            route = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            # byte-exact: fresh source bytes, a poisoned destination, one call, the whole range compared
            fresh = rng.integers(0, 256, int(src_off[-1]) + lengths[-1], dtype=np.uint8)
            if tensor is not None:
                tensor[:fresh.size].copy_(__import__("torch").from_numpy(fresh))
                __import__("torch").cuda.synchronize(args.device)
            else:
                host[:fresh.size] = fresh
            drv.send(("poison", dst_n))
            drv.recv()
            call()
            img = np.full(dst_n, POISON, dtype=np.uint8)
            for so, do, k in zip(src_off.tolist(), dst_off.tolist(), lengths):
                img[do:do + k] = fresh[so:so + k]
            drv.send(("hash", dst_n))
            exact = drv.recv() == hashlib.sha256(memoryview(img)).hexdigest()
            rows.append({"variant": variant, "shape": shape, "pieces": n, "bytes": int(sum(lengths)),
                         "times_ms": [round(t * 1e3, 4) for t in times], "route": route, "byte_exact": exact})
    drv.send(("stop",))
    (mc or eng).close()
    return rows


def conversions(args) -> list:
    """What converting and checking one list of ints costs here, per candidate (no engines): the floor of
    ``transport.arrays.as_array`` for lists. Entries: random non-negative ints below 2**40 (addresses), fresh per
    size. Best of ``--repeat`` timings of ``--number`` calls, in microseconds per call."""
    import array
    import random
    import struct
    import timeit
    from transport.arrays import as_array
    rows = []
    for n in args.sizes:
        values = [random.randrange(1 << 40) for _ in range(n)]
        packer = struct.Struct(f"{n}q")

        def pack_into(v=values):
            out = np.empty(n, dtype=np.int64)
            packer.pack_into(out, 0, *v)
            return out
        cands = {
            "np.asarray (infers the type)": lambda v=values: np.asarray(v),
            "np.array(dtype=int64) (no type check)": lambda v=values: np.array(v, dtype=np.int64),
            "np.fromiter(int64) (no type check)": lambda v=values: np.fromiter(v, np.int64, n),
            "array.array('q')": lambda v=values: array.array("q", v),
            "struct pack_into (checks ints)": pack_into,
            "type check alone: {*map(type, l)}": lambda v=values: {*map(type, v)},
            "min and max of the list": lambda v=values: (min(v), max(v)),
            "ndarray.tolist (the way back)": lambda a=np.asarray(values, dtype=np.int64): a.tolist(),
            "as_array (this tree)": lambda v=values: as_array("x", v),
        }
        number = max(1, args.number // max(1, n // 64))
        for name, fn in cands.items():
            best = min(timeit.repeat(fn, number=number, repeat=args.repeat)) / number
            rows.append({"entries": n, "candidate": name, "us": round(best * 1e6, 3),
                         "ns_per_entry": round(best * 1e9 / n, 2)})
    return rows


def _child(args) -> None:
    rows = measure(args)
    with open(args.child, "w") as f:
        json.dump(rows, f)


def _run_tree(path: str, argv: list, rotate: int) -> list:
    """One measurement in a fresh process importing the tree at ``path``; its rows."""
    fd, out = tempfile.mkstemp(prefix="pxn-list-args-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                 .split(os.pathsep) if p]))
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", out, "--rotate", str(rotate)]
    subprocess.run(cmd, env=env, check=True, cwd=path)
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    return rows


def _versions(trees: dict) -> dict:
    v = {"python": platform.python_version(), "numpy": np.__version__,
         "trees": {name: _git_rev(path) for name, path in trees.items()}}
    try:
        import torch
        v["torch"] = torch.__version__
    except ImportError:
        pass
    return v


def _intpack_build() -> str:
    """How this tree's lists are converted: the C extension reading ints from their digits
    (``_intpack.READS_DIGITS``), the extension through the C API, or ``struct`` where it is not built."""
    try:
        from transport import _intpack
    except ImportError:
        return "not built (struct)"
    return "reads digits" if getattr(_intpack, "READS_DIGITS", 0) else "C API (PyLong_AsLongLongAndOverflow)"


def _machine(device: int) -> dict:
    m = {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor() or None}
    if device >= 0:
        import torch
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocol", default="tcp", help="initialize's protocol: tcp (default) or ipc")
    p.add_argument("--device", type=int, default=-1, help="-1 host memory (default), else the GPU of both buffers")
    p.add_argument("--loadstore", choices=("default", "on", "off"), default="default",
                   help="ipc only: the load/store route for a same-host peer (off: the message path)")
    p.add_argument("--shapes", default="aux11", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--calls", type=int, default=300, help="timed calls per variant, shape and round")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--buffer-mib", type=int, default=512, help="bytes each side registers (MiB)")
    p.add_argument("--trees", default="", help="name=PATH,... checkouts measured alternately (default: this one)")
    p.add_argument("--plain", action="store_true",
                   help="the sender is a plain transport.TransferEngine (native variants only), not the Mooncake API's")
    p.add_argument("--seed", type=int, default=51)
    p.add_argument("--out", help="JSON output (default: a temporary file)")
    p.add_argument("--note", default="", help="a line kept in the output (e.g. the machine's description)")
    p.add_argument("--conversions", action="store_true",
                   help="time only the list conversions (no engines): the floor of converting a list of ints")
    p.add_argument("--sizes", default="11,4096", help="--conversions: entries per list, comma-separated")
    p.add_argument("--number", type=int, default=20000, help="--conversions: calls per timing of 64 entries")
    p.add_argument("--repeat", type=int, default=7, help="--conversions: timings per candidate (best kept)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rotate", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}")
    if args.plain:
        args.variants = [v for v in args.variants if v.startswith("native-")]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")
    if args.conversions:
        sys.path.append(ROOT)  # appended: a PYTHONPATH naming another checkout takes precedence
        args.sizes = [int(n) for n in args.sizes.split(",") if n]
        rows = conversions(args)
        import transport.arrays
        tree = os.path.dirname(os.path.dirname(os.path.abspath(transport.arrays.__file__)))
        doc = {"benchmark": "list_args --conversions", "date": _now(), "note": args.note, "machine": _machine(-1),
               "versions": _versions({"transport.arrays": tree}), "intpack": _intpack_build(), "rows": rows}
        out = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-list-args-"), "conversions.json")
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        for r in rows:
            print(f"{r['entries']:6d}  {r['candidate']:40s} {r['us']:10.2f} us  {r['ns_per_entry']:8.2f} ns/entry")
        print(f"transport._intpack: {doc['intpack']}")
        print(f"written to {out}")
        return 0
    if args.child:
        k = args.rotate % len(args.variants)
        args.variants = args.variants[k:] + args.variants[:k]
        _child(args)
        return 0
    trees = dict(t.split("=", 1) for t in args.trees.split(",") if t) or {"this": ROOT}
    trees = {name: os.path.abspath(path) for name, path in trees.items()}
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    skip = {"--trees", "--out", "--note", "--rounds"}
    child_argv, i = [], 0
    while i < len(passthrough):
        a = passthrough[i]
        name = a.split("=", 1)[0]
        if name in skip:
            i += 1 if "=" in a else 2
            continue
        child_argv.append(a)
        i += 1
    pooled: dict = {}
    started = _now()
    for r in range(args.rounds):
        order = list(trees.items())
        if r % 2:
            order.reverse()  # alternate which tree runs first
        for name, path in order:
            for row in _run_tree(path, child_argv, r):
                key = (name, row["shape"], row["variant"])
                acc = pooled.setdefault(key, {"times": [], "rounds": [], "byte_exact": True, "route": {},
                                              "pieces": row["pieces"], "bytes": row["bytes"]})
                acc["times"] += row["times_ms"]
                acc["rounds"].append(round(statistics.median(row["times_ms"]), 4))
                acc["byte_exact"] &= row["byte_exact"]
                for k, v in row["route"].items():
                    acc["route"][k] = acc["route"].get(k, 0) + v
    rows = []
    for (name, shape, variant), acc in pooled.items():
        t = sorted(acc["times"])
        q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
        rows.append({"tree": name, "shape": shape, "variant": variant, "pieces": acc["pieces"], "bytes": acc["bytes"],
                     "calls": len(t), "ms": round(statistics.median(t), 4), "ms_p10": q(0.1), "ms_p90": q(0.9),
                     "ms_rounds": acc["rounds"], "route": acc["route"], "byte_exact": acc["byte_exact"]})
    doc = {"benchmark": "list_args", "started": started, "finished": _now(), "note": args.note,
           "protocol": args.protocol, "device": args.device, "loadstore": args.loadstore,
           "machine": _machine(args.device), "versions": _versions(trees), "calls": args.calls,
           "rounds": args.rounds, "buffer_mib": args.buffer_mib, "rows": rows}
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="pxn-list-args-"), "list-args.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'tree':8s} {'shape':10s} {'variant':15s} {'ms':>8s} {'p10':>8s} {'p90':>8s}  exact  route  rounds")
    for r in rows:
        print(f"{r['tree']:8s} {r['shape']:10s} {r['variant']:15s} {r['ms']:8.4f} {r['ms_p10']:8.4f} "
              f"{r['ms_p90']:8.4f}  {str(r['byte_exact']):5s}  {r['route']}  {r['ms_rounds']}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
