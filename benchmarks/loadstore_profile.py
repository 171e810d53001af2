#!/usr/bin/env python3
"""Host time of the engine's same-host load/store path, per call and under cProfile (needs one CUDA GPU).

Two processes on GPU 0 (ipc fabric): the sglang 8k KV call (78 x 4316928 B, GPU -> GPU), the aux call (11 host
pieces) and 4096 x 64 B, each 200 times timed, then 200 times under cProfile; prints the mean time per call and
the 22 functions with the most own time. Used for the profile in benchmarks/NOTES.md (section Engine; output of
device call 3 in results/logs/h200-loadstore-profile-call3.log).

Run: python3 benchmarks/loadstore_profile.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
LAYER = 4316928


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print("loadstore_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    from transport.bench_cli import LocalPeer
    from transport.engine import TransferEngine
    mb = 1 << 20
    kv = 78 * LAYER + mb
    with LocalPeer({"kv": (kv, 0), "aux": (mb, -1)}, fabric="ipc", rails=1) as peer, \
            TransferEngine(fabric="ipc", rails=1) as eng:
        src = torch.randint(0, 256, (kv,), dtype=torch.uint8, device="cuda:0")
        aux = np.zeros(mb, dtype=np.uint8)
        eng.register(src)
        eng.register(aux)
        layers = np.arange(78, dtype=np.int64)
        cases = {
            "kv 8k (78 x 4316928 B)": (src.data_ptr() + layers * LAYER, peer.addrs["kv"] + layers[::-1] * LAYER,
                                       np.full(78, LAYER, dtype=np.int64)),
            "aux (11 host pieces)": (aux.ctypes.data + np.arange(11, dtype=np.int64) * 9000,
                                     peer.addrs["aux"] + np.arange(11, dtype=np.int64) * 9000,
                                     np.array(AUX, dtype=np.int64)),
            "4096 x 64 B": (src.data_ptr() + np.arange(4096, dtype=np.int64) * 256,
                            peer.addrs["kv"] + np.arange(4096, dtype=np.int64) * 64, np.full(4096, 64, dtype=np.int64)),
        }
        for name, args in cases.items():
            for _ in range(20):
                eng.batch_write(peer.session, *args)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                eng.batch_write(peer.session, *args)
            print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.1f} us per call", flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                eng.batch_write(peer.session, *args)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
            print(out.getvalue()[-5000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
