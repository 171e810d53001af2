#!/usr/bin/env python3
"""Where the host time of a load/store batch goes (needs one CUDA GPU): the sglang 64k KV call, the aux call,
the two as a pair and as one batch, 40 calls each, with the writer's steps (_classify, _launch,
process_vm_write, _finish_launches) timed by wrapping them. Output of device calls 10 and 11 in
benchmarks/results/logs/h200-onebatch-call10.log.

Run: python3 benchmarks/loadstore_split.py
"""
import os, sys, time
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def main():
    import torch
    import transport.loadstore as L
    from transport.bench_cli import LocalPeer
    from transport.engine import TransferEngine
    acc = {}
    def wrap(obj, name):
        f = getattr(obj, name)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        setattr(obj, name, g)
    wrap(L, "process_vm_write")
    MB = 1 << 20
    layer = 8650752
    kv = 78 * layer + MB
    with LocalPeer({"kv": (kv, 0), "aux": (MB, -1)}, fabric="ipc", rails=1) as peer, \
            TransferEngine(fabric="ipc", rails=1) as eng:
        w0 = None
        src = torch.randint(0, 256, (kv,), dtype=torch.uint8, device="cuda:0")
        aux = np.zeros(MB, dtype=np.uint8)
        eng.register(src); eng.register(aux)
        lay = np.arange(78, dtype=np.int64)
        A = np.array([64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64], dtype=np.int64)
        ks, kd, kl = src.data_ptr() + lay * layer, peer.addrs["kv"] + lay[::-1].copy() * layer, np.full(78, layer, dtype=np.int64)
        as_, ad = aux.ctypes.data + np.arange(11, dtype=np.int64) * 9000, peer.addrs["aux"] + np.arange(11, dtype=np.int64) * 9000
        one = (np.concatenate([ks, as_]), np.concatenate([kd, ad]), np.concatenate([kl, A]))
        eng.batch_write(peer.session, ks, kd, kl)
        w = eng._peers[peer.session].loadstore
        wrap(w, "_launch"); wrap(w, "_finish_launches"); wrap(w, "_classify")
        for name, fn in (("kv", lambda: eng.batch_write(peer.session, ks, kd, kl)),
                         ("aux", lambda: eng.batch_write(peer.session, as_, ad, A)),
                         ("pair", lambda: (eng.batch_write(peer.session, ks, kd, kl), eng.batch_write(peer.session, as_, ad, A))),
                         ("one", lambda: eng.batch_write(peer.session, *one)),
                         ("kv", lambda: eng.batch_write(peer.session, ks, kd, kl)),
                         ("one", lambda: eng.batch_write(peer.session, *one))):
            for _ in range(5): fn()
            torch.cuda.synchronize(); acc.clear()
            ts = []
            for _ in range(40):
                t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
            print(f"{name:5s} median {np.median(ts)*1e6:8.1f} us  per call: " + "  ".join(f"{k} {v/40*1e6:.1f}" for k, v in acc.items()), flush=True)
if __name__ == "__main__":
    main()
