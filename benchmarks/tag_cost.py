#!/usr/bin/env python3
"""What the connection-bound tags cost per call, timed with and without them in one process, block by block.

Two engine pairs live side by side in this process for the whole run: one authenticated with a shared secret
(every tcp / ipc frame and control message tagged, as shipped) and one with ``insecure=True`` (the same code,
handshake only, no tags). Each receiver is a spawned process; each sender is in this one. For every shape the
two pairs take turns in blocks of ``k`` calls (about ``--block-ms`` each), the pair that goes first swapping every
block, ``--pairs`` pairs of blocks. A block pair's ratio (median call with tags / median call without) sees the
same machine state on both sides, so load from elsewhere and drift cancel; the row reports the median of the
ratios with a bootstrap 95 % interval over block pairs, and each arm's median call.

Each shape is written once per arm and checked byte for byte against a poisoned receiver before it is timed.
The sender's tag operations per call (frames and messages it hashed to seal or check them; an ACK that carries
its WRITE's ack token is compared, not hashed, and not counted; the receiver does as many) come from the
sessions' own counters. ``--same`` gives both arms the secret: an A/A run, whose ratio
should be 1 within its interval (a check of the method itself). The two pairs' memory is not alike in every way
(which pair's buffers were allocated first can show in a row of scattered pieces), so a claim rests on two runs,
``--first tags`` and ``--first no_tags``: what the tags cost shows in both, a pair's memory flips sign.

Shapes: ``--fabric tcp`` takes the default ``pxn bench`` shapes (host memory, as ``pxn bench`` on a machine
without a GPU); ``--fabric ipc`` the one-GPU message-path rows of ``benchmarks/message_path.py``
(``--topologies direct,loadstore``; GPU memory with ``--device 0``, host memory by default, where the ipc fabric
runs the same frames and tags without a GPU). ``--bench`` times ``pxn bench``'s own run instead: its shapes, each
buffer where ``pxn bench`` puts it (the KV buffer on GPU ``--device``, aux in host memory), its peer process and
its engines' defaults, with ``--fabric`` as pxn bench would choose it (``ipc`` on a GPU host, ``tcp`` without one).

    python3 benchmarks/tag_cost.py --fabric tcp                       # CPU box: the pxn bench shapes
    python3 benchmarks/tag_cost.py --fabric ipc --device 0            # one GPU: the message-path rows
    python3 benchmarks/tag_cost.py --fabric tcp --same                # A/A: both arms tagged, ratio ~1
    python3 benchmarks/tag_cost.py --bench --fabric ipc --device 0    # GPU host: pxn bench as it runs there
    python3 benchmarks/tag_cost.py --fabric tcp --shapes aux_metadata --pairs 200 --out tags.json

Without ``--out`` the JSON goes to a temporary file (its path is printed).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.append(p)

SECRET = "tag-cost-" + os.urandom(12).hex()
ARMS = ("tags", "no_tags")


def _tags_so_far() -> int:
    """Frames and control messages sealed plus checked by every session of this process so far."""
    from transport.auth import Session
    return sum(o.tx_n + o.rx_n for o in gc.get_objects() if isinstance(o, Session))


def tcp_shapes() -> dict:
    """``pxn bench``'s default shapes, host memory: name -> (src offsets, dst offsets, lengths)."""
    from transport.bench_cli import sglang_shapes
    return {s["name"].split(" ")[0]: (s["src"], s["dst"], s["len"]) for s in sglang_shapes(device=-1)}


def ipc_shapes(size: int, rng) -> dict:
    """The one-GPU message-path shapes, at disjoint random offsets."""
    from engine_helpers import disjoint_offsets
    from message_path import shapes as message_path_shapes
    out = {}
    for name, lengths in message_path_shapes(rng).items():
        out[name] = (disjoint_offsets(rng, lengths, size), disjoint_offsets(rng, lengths, size),
                     np.asarray(lengths, dtype=np.int64))
    return out


def _bootstrap(ratios: np.ndarray, rng, n: int = 4000) -> tuple:
    idx = rng.integers(0, ratios.size, size=(n, ratios.size))
    meds = np.median(ratios[idx], axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def time_row(pairs: dict, name: str, shape, args, rng) -> dict:
    """Check ``shape`` byte for byte on each arm, then time it in alternating blocks (see the module docstring)."""
    from engine_helpers import Expected
    s_off, d_off, lens = shape
    lens = np.asarray(lens, dtype=np.int64)
    row = {"shape": name, "pieces": int(lens.size), "bytes": int(lens.sum())}
    calls = {}
    for arm, (eng, peer, src, src_host) in pairs.items():
        srcs = (src + np.asarray(s_off)).astype(np.int64).tolist()
        dsts = (peer.base + np.asarray(d_off)).astype(np.int64).tolist()
        ln = lens.tolist()
        peer.poison()
        exp = Expected(peer.size)
        exp.apply(src_host, s_off, d_off, ln)
        eng.batch_write(peer.session, srcs, dsts, ln)
        peer.check(exp)
        calls[arm] = (eng, peer.session, srcs, dsts, ln)
    row["byte_exact"] = True
    row.update(alternate(calls, args, rng))
    return row


def alternate(calls: dict, args, rng, sync=None) -> dict:
    """Time ``calls`` (arm -> (engine, session, srcs, dsts, lengths)) in alternating blocks of calls (see the
    module docstring): the row's timing fields. ``sync`` (optional) runs before each timed call, outside it."""

    def one(arm) -> float:
        eng, session, srcs, dsts, ln = calls[arm]
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        eng.batch_write(session, srcs, dsts, ln)
        return time.perf_counter() - t0

    warm = [one(arm) for _ in range(3) for arm in ARMS]
    k = int(min(args.max_calls, max(args.min_calls, round(args.block_ms * 1e-3 / max(np.median(warm), 1e-6)))))
    tags0 = _tags_so_far()
    n_tags_calls = 0
    per_arm = {a: [] for a in ARMS}
    ratios = []
    t_end = time.monotonic() + args.seconds
    for b in range(args.pairs):
        order = ARMS if b % 2 == 0 else ARMS[::-1]
        med = {}
        for arm in order:
            ts = [one(arm) for _ in range(k)]
            per_arm[arm] += ts
            med[arm] = float(np.median(ts))
            if arm == "tags":
                n_tags_calls += k
        ratios.append(med["tags"] / med["no_tags"])
        if b + 1 >= args.min_pairs and time.monotonic() > t_end:
            break
    tag_ops = _tags_so_far() - tags0
    r = np.asarray(ratios)
    lo, hi = _bootstrap(r, rng)
    return dict(calls_per_block=k, block_pairs=int(r.size),
                ms={a: round(float(np.median(v)) * 1e3, 4) for a, v in per_arm.items()},
                ratio=round(float(np.median(r)), 4), ratio_ci95=[round(lo, 4), round(hi, 4)],
                sender_tag_ops_per_call=round(tag_ops / max(1, n_tags_calls) / (2 if args.same else 1), 2))


def bench_rows(args, rng) -> list:
    """``--bench``: ``pxn bench``'s own run, both arms side by side: its shapes, each buffer in the memory
    ``pxn bench`` puts it in (``--device``: the GPU of the KV buffer; aux stays in host memory), its receiving
    peer (``transport.bench_cli.LocalPeer``) and its engines' defaults (the machine's own topology), each shape
    checked byte for byte as ``pxn bench`` checks it before it is timed."""
    from transport import TransferEngine
    from transport.bench_cli import LocalPeer, buffer_sizes, expecteddigest, sglang_shapes
    from transport.peer_process import Buffer
    shapes = sglang_shapes(device=args.device)
    wanted = [s for s in args.shapes.split(",") if s]
    names = {s["name"].split(" ")[0] for s in shapes}
    if set(wanted) - names:
        raise SystemExit(f"unknown shape(s) {sorted(set(wanted) - names)}; pxn bench has {sorted(names)}")
    shapes = [s for s in shapes if not wanted or s["name"].split(" ")[0] in wanted]
    need = buffer_sizes(shapes)
    devs = {s["buffer"]: s["device"] for s in shapes}
    sync = None
    if args.device >= 0:
        import torch
        sync = torch.cuda.synchronize
    arms, rows = {}, []
    try:
        for arm in (ARMS if args.first == ARMS[0] else ARMS[::-1]):
            sec = {"secret": SECRET} if arm == "tags" or args.same else {"insecure": True}
            eng = TransferEngine(fabric=args.fabric, **sec)
            arms[arm] = [eng]
            arms[arm].append(LocalPeer({k: (v, devs[k]) for k, v in need.items()}, fabric=args.fabric, **sec))
            srcs = {k: Buffer(v, devs[k], random_seed=7 + i) for i, (k, v) in enumerate(sorted(need.items()))}
            for m in srcs.values():
                eng.register(m.addr, m.nbytes, device=m.device)
            arms[arm].append(srcs)
        for shape in shapes:
            name, buf = shape["name"].split(" ")[0], shape["buffer"]
            calls = {}
            for arm, (eng, peer, srcs) in arms.items():
                srcl = (srcs[buf].addr + shape["src"]).tolist()
                dstl = (peer.addrs[buf] + shape["dst"]).tolist()
                peer.call("poison")
                eng.batch_write(peer.session, srcl, dstl, shape["len"].tolist())
                if peer.call("digest", name=buf) != expecteddigest(srcs[buf].host(), need[buf], shape):
                    raise SystemExit(f"{name}: the {arm} arm's write is not byte-exact at the peer")
                calls[arm] = (eng, peer.session, srcl, dstl, shape["len"].tolist())
            row = {"shape": name, "pieces": int(shape["len"].size), "bytes": int(shape["len"].sum()),
                   "memory": "host" if shape["device"] < 0 else f"cuda:{shape['device']}", "byte_exact": True,
                   "topology": "pxn bench"}
            row.update(alternate(calls, args, rng, sync))
            rows.append(row)
            _print_row(args, row)
    finally:
        for eng, peer, *_ in arms.values():
            eng.close()
            peer.close()
    return rows


def _print_row(args, row: dict) -> None:
    print(f"{args.fabric} {row['topology']:9s} {row['shape']:16s} tags {row['ms']['tags']:10.4f} ms  no tags "
          f"{row['ms']['no_tags']:10.4f} ms  ratio {row['ratio']:.4f} [{row['ratio_ci95'][0]:.4f}, "
          f"{row['ratio_ci95'][1]:.4f}]  {row['block_pairs']} pairs x {row['calls_per_block']} calls  "
          f"sender tag ops/call {row['sender_tag_ops_per_call']}", flush=True)


def make_pairs(args, size: int):
    """arm -> (sender engine, receiving peer, source address, source bytes on the host, source buffer)."""
    from engine_helpers import EnginePeer
    from transport import TransferEngine
    kw = {"fabric": args.fabric}
    if args.fabric == "ipc":
        from transport.topology import synthetic
        kw.update(loadstore=args.topology == "loadstore", topology=synthetic(1, {max(args.device, 0): ["mlx5_0"]}))
    out = {}
    for arm in (ARMS if args.first == ARMS[0] else ARMS[::-1]):
        sec = {"secret": SECRET} if arm == "tags" or args.same else {"insecure": True}
        peer = EnginePeer(size, device=args.device, **kw, **sec)
        eng = TransferEngine(**kw, **sec)
        if args.device >= 0:
            import torch
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=f"cuda:{args.device}")
            eng.register(src)
            out[arm] = (eng, peer, src.data_ptr(), src.cpu().numpy(), src)
        else:
            src = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
            eng.register(src)
            out[arm] = (eng, peer, src.ctypes.data, src, src)
    return out


def machine() -> dict:
    from transport.bench_cli import _versions
    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(_versions(), numpy=np.__version__, date=now.strftime("%Y-%m-%d %H:%M UTC"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fabric", choices=("tcp", "ipc"), default="tcp")
    ap.add_argument("--device", type=int, default=-1, help="GPU of the data (e.g. 0); -1: host memory")
    ap.add_argument("--topologies", default="direct,loadstore", help="ipc only: direct (loadstore=False), loadstore")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all of the fabric's)")
    ap.add_argument("--pairs", type=int, default=400, help="most block pairs per shape")
    ap.add_argument("--min-pairs", type=int, default=12, help="fewest block pairs per shape")
    ap.add_argument("--seconds", type=float, default=10.0, help="time per shape after which no block pair starts "
                    "once --min-pairs are done")
    ap.add_argument("--block-ms", type=float, default=40.0, help="target length of one block (ms)")
    ap.add_argument("--min-calls", type=int, default=2)
    ap.add_argument("--max-calls", type=int, default=200)
    ap.add_argument("--first", choices=ARMS, default=ARMS[0], help="the arm whose engines and buffers are made "
                    "first (a pair's memory can differ from the other's: run both orders)")
    ap.add_argument("--same", action="store_true", help="both arms with the secret (A/A: the ratio should be 1)")
    ap.add_argument("--bench", action="store_true", help="pxn bench's own run (its shapes, memory, peer and "
                    "engine defaults; --device 0 puts the KV buffer on that GPU, as pxn bench does where CUDA is "
                    "available) instead of --fabric's rows")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args(argv)
    os.environ.pop("PXN_SECRET", None)  # the no-tags arm must not pick a secret up from the environment
    os.environ.pop("PXN_INSECURE", None)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    print(f"seed {seed}", file=sys.stderr)
    result = {"machine": machine(), "fabric": args.fabric, "seed": seed, "same": args.same, "first": args.first,
              "arms": {"tags": "secret= given: frames and control messages tagged",
                       "no_tags": "insecure=True: handshake only"},
              "bench": args.bench, "rows": []}
    topologies = [] if args.bench else args.topologies.split(",") if args.fabric == "ipc" else ["-"]
    if args.bench:
        result["rows"] = bench_rows(args, rng)
    for topo in topologies:
        args.topology = topo
        if args.fabric == "tcp":
            shapes = tcp_shapes()
            size = max(int((np.asarray(s) + np.asarray(n)).max()) for s, d, n in shapes.values())
            size = max(size, max(int((np.asarray(d) + np.asarray(n)).max()) for s, d, n in shapes.values()))
        else:
            size = 256 << 20
            shapes = ipc_shapes(size, np.random.default_rng(seed))
        wanted = [s for s in args.shapes.split(",") if s] or (
            list(shapes) if args.fabric == "tcp" else ["aux11", "4096x64B", "1024x64KB", "kv78x2.25MB"])
        unknown = sorted(set(wanted) - set(shapes))
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; this fabric has {sorted(shapes)}")
        pairs = make_pairs(args, size)
        try:
            for name in wanted:
                row = time_row({a: v[:4] for a, v in pairs.items()}, name, shapes[name], args, rng)
                row["topology"] = topo
                result["rows"].append(row)
                _print_row(args, row)
        finally:
            for eng, peer, *_ in pairs.values():
                eng.close()
                peer.close()
    out = args.out
    if out is None:
        fd, out = tempfile.mkstemp(suffix=".json", prefix="pxn-tag-cost-")
        os.close(fd)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
