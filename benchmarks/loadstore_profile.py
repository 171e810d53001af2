#!/usr/bin/env python3
"""Host time of the engine's same-host load/store path (needs one CUDA GPU; two processes on GPU 0, ipc).

Two modes over the same engine pair and buffers:

* ``--profile`` (default): the sglang 8k KV call (78 x 4316928 B, GPU -> GPU), the aux call (11 host pieces)
  and 4096 x 64 B, each 200 times timed, then 200 times under cProfile (the 22 functions with the most own
  time). Output on the H200 (run 3): results/logs/h200-loadstore-profile-run3.log.
* ``--split``: the sglang 64k KV call, the aux call, the two as a pair and as one batch, 40 calls each, with
  the writer's steps (``_classify``, the bound copies' ``launch``, ``process_vm_write``, ``finish``) timed by wrapping
  them. Output on the H200 (runs 10 and 11): results/logs/h200-onebatch-run10.log.

Run: python3 benchmarks/loadstore_profile.py [--split]
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
MB = 1 << 20


def profile(eng, session, cases) -> None:
    import torch
    for name, args in cases.items():
        for _ in range(20):
            eng.batch_write(session, *args)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            eng.batch_write(session, *args)
        print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            eng.batch_write(session, *args)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
        print(out.getvalue()[-5000:], flush=True)


def split(eng, session, kv, aux) -> None:
    """Median time per call and the mean time per call of each wrapped step of the writer."""
    import torch
    import transport.fabric.loadstore as loadstore
    spent = {}

    def wrap(obj, name):
        inner = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        setattr(obj, name, timed)

    eng.batch_write(session, *kv)  # connects: the writer exists from here on
    writer = eng._peers[session].loadstore
    wrap(loadstore, "process_vm_write")
    wrap(writer, "_classify")
    for step in ("launch", "finish"):
        wrap(writer._copies, step)
    one = tuple(np.concatenate([a, b]) for a, b in zip(kv, aux))
    calls = (("kv", lambda: eng.batch_write(session, *kv)), ("aux", lambda: eng.batch_write(session, *aux)),
             ("pair", lambda: (eng.batch_write(session, *kv), eng.batch_write(session, *aux))),
             ("one", lambda: eng.batch_write(session, *one)))
    for name, fn in calls + calls[0:1] + calls[3:4]:  # kv and one again: the run's drift
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        spent.clear()
        times = []
        for _ in range(40):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        steps = "  ".join(f"{k} {v / 40 * 1e6:.1f}" for k, v in spent.items())
        print(f"{name:5s} median {np.median(times) * 1e6:8.1f} us  per call: {steps}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", action="store_true", help="time the writer's steps instead of cProfile")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("loadstore_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    from transport.bench_cli import LocalPeer
    from transport.engine import TransferEngine
    layer = 8650752 if args.split else 4316928
    kv_bytes = 78 * layer + MB
    with LocalPeer({"kv": (kv_bytes, 0), "aux": (MB, -1)}, fabric="ipc", rails=1) as peer, \
            TransferEngine(fabric="ipc", rails=1) as eng:
        src = torch.randint(0, 256, (kv_bytes,), dtype=torch.uint8, device="cuda:0")
        host = np.zeros(MB, dtype=np.uint8)
        eng.register(src)
        eng.register(host)
        layers = np.arange(78, dtype=np.int64)
        kv = (src.data_ptr() + layers * layer, peer.addrs["kv"] + layers[::-1] * layer,
              np.full(78, layer, dtype=np.int64))
        aux = (host.ctypes.data + np.arange(11, dtype=np.int64) * 9000,
               peer.addrs["aux"] + np.arange(11, dtype=np.int64) * 9000, np.array(AUX, dtype=np.int64))
        if args.split:
            split(eng, peer.session, kv, aux)
        else:
            small = (src.data_ptr() + np.arange(4096, dtype=np.int64) * 256,
                     peer.addrs["kv"] + np.arange(4096, dtype=np.int64) * 64, np.full(4096, 64, dtype=np.int64))
            profile(eng, peer.session, {f"kv 8k (78 x {layer} B)": kv, "aux (11 host pieces)": aux,
                                        "4096 x 64 B": small})
    return 0


if __name__ == "__main__":
    sys.exit(main())
