#!/usr/bin/env python3
"""The engine end to end on one GPU: two processes, ipc fabric, GPU memory, sglang shapes.

For every shape: the peer's buffer is poisoned, the shape written once and verified byte for byte (digest of the
peer's whole buffer against the expected image), then timed ``--repeat`` times (wall time of the calls, Python
included, after a CUDA synchronize). Ratios, measured in the same run:

* sglang 64k: (78 x 8650752 B KV call + aux call) vs one contiguous D2D copy of the same bytes; goal >= 0.9
* sglang 8k:  (78 x 4316928 B + aux) vs one contiguous copy; goal >= 0.8
* 4096 x 64 B: end to end vs (one gather launch + one copy of the chunk); goal <= 2x

Writes JSON rows ``{shape, gbps, ratio, goal, ..., gpu, torch, triton, date}`` plus ``stats()`` of both engines
to ``--out`` (default: a temporary file), a PNG beside it (``transport.plots``, needs matplotlib), and prints
a table last.

Run (no installs needed beyond torch, triton, numpy, cuda-bindings):
    python3 benchmarks/engine_gpu.py --out $OUT/engine-h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KB, MB = 1 << 10, 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
POISON = 0x5A


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _median_time(fn, repeat: int, warmup: int = 2) -> list:
    import torch
    out = []
    for i in range(warmup + repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def profile_pack(torch, dev) -> dict:
    """Host + device time of the relay's GPU chunk pack and receiver scatter alone (one thread)."""
    import types
    from transport.packing import gpu_pack, gpu_scatter, scatter_words
    out = {}
    src = torch.randint(0, 256, (96 * MB,), dtype=torch.uint8, device=dev)
    slot_t = torch.empty(1 * MB, dtype=torch.uint8, device=dev)
    dst = torch.empty(96 * MB, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    slot = types.SimpleNamespace(tensor=slot_t, nbytes=MB, staging=None, lane=0,
                                 ring=types.SimpleNamespace(stream=lambda lane: stream))
    rng = np.random.default_rng(3)
    for name, n, ln in (("pack 504x2KiB", 504, 2048), ("pack 4096x64B", 4096, 64), ("pack aux11", 11, None)):
        lens = np.full(n, ln, dtype=np.int64) if ln else np.array(AUX, dtype=np.int64)
        srcs = src.data_ptr() + rng.permutation(n).astype(np.int64) * 8192
        dsts = dst.data_ptr() + rng.permutation(n).astype(np.int64) * 8192
        ts = []
        for i in range(30):
            t0 = time.perf_counter()
            nbytes = gpu_pack(slot, srcs, lens, dsts, i, 1)
            ts.append(time.perf_counter() - t0)
        out[name] = round(float(np.median(ts[5:])) * 1e3, 4)
        from pxn_kernels.chunk import parse_chunk
        table = parse_chunk(slot_t[:nbytes].cpu().numpy())
        pinned = torch.empty(scatter_words(n, dev, int(lens.sum())), dtype=torch.uint8, pin_memory=True)
        dev_buf = torch.empty_like(pinned, device=dev)
        ts = []
        for i in range(30):
            t0 = time.perf_counter()
            gpu_scatter(pinned, dev_buf, slot_t[:nbytes], table.offsets, table.dst_addrs.astype(np.int64),
                        table.lengths, stream)
            ts.append(time.perf_counter() - t0)
        out[name.replace("pack", "scatter")] = round(float(np.median(ts[5:])) * 1e3, 4)
        ok = all(torch.equal(dst[int(d) - dst.data_ptr():int(d) - dst.data_ptr() + int(n_)],
                             src[int(s_) - src.data_ptr():int(s_) - src.data_ptr() + int(n_)])
                 for s_, d, n_ in list(zip(srcs, dsts, lens))[:50])
        out[name + " roundtrip ok"] = bool(ok)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="pxn engine end to end on one GPU (ipc fabric)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pxn-engine-gpu.json"),
                    help="JSON path (default: a temporary file; the committed results are written only with --out)")
    ap.add_argument("--shapes", metavar="FILE", default=None,
                    help="sglang shapes JSON (default: $PXN_SHAPES, else the copy shipped in transport/data)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--fabric", default="ipc")
    ap.add_argument("--rails", type=int, default=1, help="rails (fabric instances); 1 on a single GPU")
    ap.add_argument("--message-mb", type=int, default=None,
                    help="fabric message size in MiB (tcp/ipc option message_bytes); default: the fabric's")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--lists", action="store_true", help="pass addresses as Python lists instead of int64 arrays")
    ap.add_argument("--loadstore", choices=("on", "off"), default="on",
                    help="ipc: write GPU->GPU and host->host batches by load/store from the caller's thread (on, the "
                         "default) or through the message path (off: fabric writes completed by the writer; chunks "
                         "and the receiver's scatter only where coalesce_bytes is set)")
    ap.add_argument("--switch-interval", type=float, default=0.0002,
                    help="PXN_SWITCH_INTERVAL for both engines (GIL hand-off; 0 = Python's default 5 ms)")
    ap.add_argument("--profile", action="store_true",
                    help="first time the relay's GPU pack and scatter alone (no engine threads)")
    ap.add_argument("--trace", default=None, help="Chrome trace of the sender engine")
    ap.add_argument("--log", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log.upper()), format="%(levelname)s %(name)s: %(message)s")

    if args.switch_interval:
        os.environ["PXN_SWITCH_INTERVAL"] = str(args.switch_interval)  # read by both engines (peer: inherited)
    import torch
    if not torch.cuda.is_available():
        print("engine_gpu: no CUDA device visible; this benchmark needs a GPU", file=sys.stderr)
        return 2
    import triton
    import pxn_kernels
    from transport.bench_cli import LocalPeer
    from transport.peer_process import digest as _digest
    from transport.engine import TransferEngine

    dev = torch.device("cuda:0")
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
            "fabric": args.fabric, "rails": args.rails, "date": _now(), "switch_interval": args.switch_interval}
    L = args.layers
    from transport.bench_cli import load_shapes
    recorded = load_shapes(args.shapes)
    mla = {k: recorded["mla"][f"mla_latent_{k}"] for k in ("1k", "8k", "64k")}
    aux = recorded["aux"]
    kv_bytes = L * mla["64k"] + 16 * MB
    print(f"engine_gpu: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, fabric {args.fabric}; "
          f"KV buffers {kv_bytes / 1e9:.2f} GB per side", flush=True)

    if args.profile:
        meta["profile"] = profile_pack(torch, dev)
        print(f"profile (ms per call, alone): {meta['profile']}", flush=True)

    rng = np.random.default_rng(5)
    shapes = []

    def add(name, kind, src, dst, lens, goal=None):
        shapes.append({"name": name, "buf": kind, "src": np.asarray(src, np.int64), "dst": np.asarray(dst, np.int64),
                       "len": np.asarray(lens, np.int64), "goal": goal})

    aux_off = np.cumsum([0] + aux[:-1]) * 2
    add("aux_metadata (host)", "aux", aux_off, aux_off + 16, aux)
    for k in ("1k", "8k", "64k"):
        add(f"mla_latent_{k} ({L}x{mla[k]})", "kv", np.arange(L) * mla[k], rng.permutation(L) * mla[k],
            np.full(L, mla[k]))
    n = 4096
    add("4096x64B", "kv", rng.permutation(n) * 256, rng.permutation(n) * 64, np.full(n, 64))
    n = 32768
    add(f"mha_pages ({n}x2KiB)", "kv", rng.permutation(n) * 2048, rng.permutation(n) * 2048, np.full(n, 2048))
    lens = np.concatenate([rng.integers(1, 8193, size=2000), np.full(8, 2 * MB)])
    rng.shuffle(lens)
    off = np.concatenate(([0], np.cumsum((lens + 15) // 16 * 16)[:-1]))
    add("mix 1B-8KB + 8x2MB", "kv", off, off, lens)

    rows = []
    engine_kwargs = {"fabric": args.fabric, "rails": args.rails, "loadstore": args.loadstore == "on"}
    meta["loadstore"] = args.loadstore
    meta["address_form"] = "list" if args.lists else "int64 ndarray"
    if args.message_mb:
        engine_kwargs["fabric_options"] = {"message_bytes": args.message_mb * MB}
        meta["message_bytes"] = args.message_mb * MB
    with LocalPeer({"kv": (kv_bytes, 0), "aux": (1 * MB, -1)}, **engine_kwargs) as peer, \
            TransferEngine(trace_path=args.trace, **engine_kwargs) as eng:
        g = torch.Generator(device=dev).manual_seed(1)
        src_kv = torch.randint(0, 256, (kv_bytes,), dtype=torch.uint8, device=dev, generator=g)
        src_aux = np.frombuffer(np.random.default_rng(2).bytes(1 * MB), dtype=np.uint8).copy()
        eng.register(src_kv)
        eng.register(src_aux)
        src_host = {"kv": None, "aux": src_aux}
        base = {"kv": src_kv.data_ptr(), "aux": src_aux.ctypes.data}
        size = {"kv": kv_bytes, "aux": 1 * MB}

        def call(shape):
            # int64 numpy arrays, the form a caller with thousands of addresses has them in (a Python list of
            # 4096 ints costs ~0.1 ms more per argument to convert; --lists measures that form)
            if args.lists:
                eng.batch_write(peer.session, (base[shape["buf"]] + shape["src"]).tolist(),
                                (peer.addrs[shape["buf"]] + shape["dst"]).tolist(), shape["len"].tolist())
            else:
                eng.batch_write(peer.session, base[shape["buf"]] + shape["src"], peer.addrs[shape["buf"]] + shape["dst"],
                                shape["len"])

        # --- baselines in this run ---------------------------------------------------------------------------
        scratch_a = torch.empty(L * mla["64k"] + 64 * KB, dtype=torch.uint8, device=dev)
        scratch_b = torch.empty_like(scratch_a)

        def copy_time(nbytes):
            return float(np.median(_median_time(lambda: scratch_b[:nbytes].copy_(scratch_a[:nbytes]),
                                                args.repeat)))

        def matches(shape) -> bool:
            """The peer's whole buffer of this shape equals poison + the shape's pieces (compared by digest)."""
            img = np.full(size[shape["buf"]], POISON, dtype=np.uint8)
            sh = src_host[shape["buf"]]
            for s, d, n_ in zip(shape["src"].tolist(), shape["dst"].tolist(), shape["len"].tolist()):
                img[d:d + n_] = sh[s:s + n_]
            return peer.call("digest", name=shape["buf"]) == _digest(img)

        for shape in shapes:
            row = {"shape": shape["name"], "pieces": int(shape["len"].size), "bytes": int(shape["len"].sum())}
            try:
                if not args.no_verify:
                    peer.call("poison")
                    call(shape)
                    torch.cuda.synchronize()
                    if shape["buf"] == "kv" and src_host["kv"] is None:
                        src_host["kv"] = src_kv.cpu().numpy()
                    row["verified"] = "byte-exact" if matches(shape) else "MISMATCH"
                before = eng.stats()["time_s"]
                times = _median_time(lambda: call(shape), args.repeat)
                after = eng.stats()["time_s"]
                t = float(np.median(times))
                row.update({"median_ms": round(t * 1e3, 4), "best_ms": round(min(times) * 1e3, 4),
                            "gbps": round(row["bytes"] / t / 1e9, 3),
                            "host_time_per_call_ms": {k: round((after.get(k, 0) - before.get(k, 0)) * 1e3
                                                               / (args.repeat + 2), 4) for k in after}})
            except Exception as e:  # noqa: BLE001 — keep measuring the other shapes
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            print(f"  {row['shape']:<34} {row.get('gbps', float('nan')):9.3f} GB/s  "
                  f"{row.get('median_ms', float('nan')):9.3f} ms  {row.get('verified', row.get('error', ''))}",
                  flush=True)

        # --- end-to-end ratios -----------------------------------------------------------------------------
        aux_shape = shapes[0]
        for k, goal in (("64k", 0.9), ("8k", 0.8), ("1k", None)):
            kv_shape = next(s for s in shapes if s["name"].startswith(f"mla_latent_{k} "))
            nbytes = int(kv_shape["len"].sum() + aux_shape["len"].sum())
            try:
                parts = []

                def pair():
                    t0 = time.perf_counter()
                    call(kv_shape)
                    t1 = time.perf_counter()
                    call(aux_shape)
                    parts.append((t1 - t0, time.perf_counter() - t1))

                times = _median_time(pair, args.repeat)
                t = float(np.median(times))
                tc = copy_time(nbytes)
                kv_part, aux_part = np.median(np.asarray(parts[-args.repeat:]), axis=0)
                rows.append({"shape": f"sglang {k}: {L}x{mla[k]} + aux", "bytes": nbytes, "median_ms": round(t * 1e3, 4),
                             "kv_call_ms": round(float(kv_part) * 1e3, 4), "aux_call_ms": round(float(aux_part) * 1e3, 4),
                             "gbps": round(nbytes / t / 1e9, 3), "copy_ms": round(tc * 1e3, 4),
                             "copy_gbps": round(nbytes / tc / 1e9, 3), "ratio": round(tc / t, 4),
                             "ratio_means": "contiguous D2D copy time / engine time (higher is better)",
                             "goal": goal, "pass": None if goal is None else tc / t >= goal})
            except Exception as e:  # noqa: BLE001
                rows.append({"shape": f"sglang {k}", "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
            # The same bytes as one batch_write (KV blocks + aux pieces): sglang issues two calls, but a caller
            # that batches them lets the engine write the host pieces while the device copies the blocks.
            try:
                one = {"src": [base["kv"] + kv_shape["src"], base["aux"] + aux_shape["src"]],
                       "dst": [peer.addrs["kv"] + kv_shape["dst"], peer.addrs["aux"] + aux_shape["dst"]],
                       "len": [kv_shape["len"], aux_shape["len"]]}
                srcs, dsts, lens = (np.concatenate(one[x]) for x in ("src", "dst", "len"))
                if not args.no_verify:
                    peer.call("poison")
                    eng.batch_write(peer.session, srcs, dsts, lens)
                    torch.cuda.synchronize()
                    images = {shape["buf"]: matches(shape) for shape in (kv_shape, aux_shape)}
                times = _median_time(lambda: eng.batch_write(peer.session, srcs, dsts, lens), args.repeat)
                t = float(np.median(times))
                tc = copy_time(nbytes)
                rows.append({"shape": f"sglang {k} as one batch", "bytes": nbytes, "median_ms": round(t * 1e3, 4),
                             "gbps": round(nbytes / t / 1e9, 3), "copy_ms": round(tc * 1e3, 4),
                             "ratio": round(tc / t, 4), "goal": None,
                             "ratio_means": "contiguous D2D copy time / one batch_write of KV + aux (not sglang's "
                                            "two calls: informative)",
                             **({} if args.no_verify else {"verified": "byte-exact" if all(images.values())
                                                           else f"MISMATCH {images}"})})
            except Exception as e:  # noqa: BLE001
                rows.append({"shape": f"sglang {k} as one batch", "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
        try:
            small = next(s for s in shapes if s["name"] == "4096x64B")
            n = int(small["len"].size)
            ptrs = torch.tensor((base["kv"] + small["src"]).tolist(), dtype=torch.int64, device=dev)
            lens_t = torch.tensor(small["len"].tolist(), dtype=torch.int64, device=dev)
            from pxn_kernels.chunk import chunk_layout
            offs, chunk_bytes = chunk_layout(small["len"])
            offs_t = torch.tensor(offs.tolist(), dtype=torch.int64, device=dev)
            plan = pxn_kernels.plan_batched_copy(lens_t)
            out = torch.empty(chunk_bytes, dtype=torch.uint8, device=dev)
            tg = float(np.median(_median_time(lambda: pxn_kernels.gather(ptrs, lens_t, out, offs_t, check=False,
                                                                         plan=plan), args.repeat)))
            tc = copy_time(chunk_bytes)
            t = float(np.median(_median_time(lambda: call(small), args.repeat)))
            rows.append({"shape": "4096x64B vs gather+copy", "bytes": int(small["len"].sum()),
                         "median_ms": round(t * 1e3, 4), "gather_ms": round(tg * 1e3, 4), "copy_ms": round(tc * 1e3, 4),
                         "ratio": round(t / (tg + tc), 4),
                         "ratio_means": "engine time / (one gather launch + one chunk copy) (lower is better)",
                         "goal": 2.0, "pass": t / (tg + tc) <= 2.0})
        except Exception as e:  # noqa: BLE001
            rows.append({"shape": "4096x64B vs gather+copy", "error": f"{type(e).__name__}: {e}"})
            traceback.print_exc()
        stats = eng.stats()
        peer_stats = peer.call("stats")

    for r in rows:
        r.update(meta)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rows": rows, "stats": stats, "peer_stats": peer_stats, **meta}, f, indent=1)
    print()
    print(f"{'shape':<40}{'MB':>10}{'ms':>10}{'GB/s':>10}{'ratio':>8}{'goal':>7}  result")
    for r in rows:
        res = r.get("error") or r.get("verified") or ("" if r.get("pass") is None else
                                                       ("PASS" if r["pass"] else "below goal"))
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        goal = f"{r['goal']}" if r.get("goal") is not None else "-"
        print(f"{r['shape']:<40}{r.get('bytes', 0) / 1e6:>10.2f}{r.get('median_ms', float('nan')):>10.3f}"
              f"{r.get('gbps', float('nan')):>10.2f}{ratio:>8}{goal:>7}  {res}")
    print(f"\nsender time_s: {json.dumps(stats['time_s'])}")
    print(f"wrote {args.out}")
    from transport import plots
    for png in plots.plot_any({"rows": rows, "stats": stats, "peer_stats": peer_stats, **meta},
                              os.path.splitext(args.out)[0] + ".png"):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
