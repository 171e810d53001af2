"""What each attack of a stranger costs a TransferEngine (tcp, host memory): memory, and how long a legitimate
new sender then needs to get in. Runs against whatever ``transport`` is importable from ``--root`` (so the same
script measures an older checkout), each attack against a fresh victim engine in its own process.

The stranger is plain Python speaking the tcp fabric's and the control port's framing without any secret; a
legitimate sender is a ``TransferEngine`` (both it and the victim read ``PXN_SECRET`` from the environment).

    python3 benchmarks/attack_costs.py                        # -> a temporary JSON file, path printed
    PXN_SECRET=$(python3 -c "import secrets; print(secrets.token_hex(16))") python3 benchmarks/attack_costs.py --out benchmarks/results/attack-costs-cpu.json
    python3 benchmarks/attack_costs.py --root /path/to/older/checkout --label before

Attacks (sizes scaled so that the old behaviour fits a small box; the cost grows linearly with them):
  hello        2 stranger hellos (4 MiB slots, 16 credits, 2 rails) on the control port
  ack          1 forged ACK header claiming 2^28 statuses on a rail socket
  ctrl_length  16 control connections announcing a 64 MiB message, then idle
  slowloris    3 idle sockets on each rail port
  fd           descriptor exhaustion: 60 idle connections per port against a victim with 24 spare descriptors,
               then the flood is closed
  rail_spoof   a stranger says hello on a rail with a connected sender's rail id; that sender's next 5 batches
               of 64 x 64 B (coalesced: acked by the victim's receiver over the endpoint of that rail id)
  garbage      2 s of random bytes at every port from 6 threads; the victim's pipe latency and batch latency
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import struct
import sys
import tempfile
import threading
import time


def _setup_path(root: str) -> None:
    if root not in sys.path:
        sys.path.insert(0, root)


MB = 1 << 20
SIZE = 4 * MB


def _victim_main(conn, root: str, nofile) -> None:
    _setup_path(root)
    import logging
    import resource

    import numpy as np
    logging.basicConfig(level=logging.CRITICAL)
    if nofile is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + nofile, hard))
    from transport.engine import TransferEngine
    eng = TransferEngine(fabric="tcp")
    mem = np.zeros(SIZE, dtype=np.uint8)
    eng.register(mem)
    conn.send({"session": eng.session_id, "base": mem.ctypes.data, "rails": [f.local_id for f in eng.fabrics]})
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd == "rss":
            with open("/proc/self/status") as f:
                conn.send(next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS")))
        elif cmd == "stats":
            conn.send(eng.stats())
        elif cmd == "close":
            eng.close()
            conn.send(None)
            break


class Victim:
    def __init__(self, root: str, nofile=None):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_victim_main, args=(child, root, nofile), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("victim did not start")
        r = self.conn.recv()
        self.session, self.base, self.rails = r["session"], r["base"], r["rails"]

    def call(self, cmd, timeout=30.0):
        t0 = time.monotonic()
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            return None, timeout
        return self.conn.recv(), time.monotonic() - t0

    def rss(self) -> int:
        return self.call("rss")[0]

    def close(self):
        try:
            self.call("close", 15)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def _addr(s: str):
    h, _, p = s.rpartition(":")
    return h, int(p)


def _hdr(typ, count, blen):
    return struct.pack("<4sBBHIQQ4x16x", b"PXNT", typ, 0, 0, count, 0, blen)  # the tag field left zero


def _rail_hello(peer_id: str) -> bytes:
    body = json.dumps({"id": peer_id, "conn": os.urandom(8).hex(), "index": 0, "n": 1,
                       "desc": {"fabric": "tcp", "id": peer_id, "host": "127.0.0.1", "port": 1}}).encode()
    return _hdr(1, 0, len(body)) + body


def _ctrl_msg(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("<I", len(body)) + body


def _first_batch(v: Victim, src, timeout: float = 15.0) -> dict:
    """A fresh legitimate sender's first batch (handshake included): seconds, or the error."""
    from transport.engine import TransferEngine
    t0 = time.monotonic()
    try:
        with TransferEngine(fabric="tcp", timeout=timeout) as eng:
            eng.register(src)
            eng.batch_write(v.session, [src.ctypes.data], [v.base], [4096], timeout=timeout)
        return {"ok": True, "s": round(time.monotonic() - t0, 4)}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "s": round(time.monotonic() - t0, 2), "error": f"{type(e).__name__}: {str(e)[:160]}"}


def _answer(s: socket.socket, timeout=3.0) -> int:
    s.settimeout(timeout)
    n = 0
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            n += len(b)
    except OSError:
        pass
    return n


def attack_hello(root, src):
    v = Victim(root)
    try:
        rss0 = v.rss()
        answered = []
        socks = []
        for i in range(2):
            s = socket.create_connection(_addr(v.session), timeout=5)
            s.sendall(_ctrl_msg({"op": "hello", "engine_id": 1000 + i, "session": f"evil:{i}",
                                 "rail_ids": [f"evil:{i}0", f"evil:{i}1"], "credit_addr": 4096,
                                 "credit_rkeys": [1, 2], "credit_slots": 16, "slot_bytes": 4 * MB}))
            answered.append(_answer(s, 3.0))
            socks.append(s)
        time.sleep(0.3)
        d = {"victim_rss_delta_mb": round((v.rss() - rss0) / MB, 1), "bytes_answered": answered}
        for s in socks:
            s.close()
        return d
    finally:
        v.close()


def attack_ack(root, src):
    v = Victim(root)
    try:
        rss0 = v.rss()
        s = socket.create_connection(_addr(v.rails[0]), timeout=5)
        s.sendall(_rail_hello("evil:9"))
        time.sleep(0.3)
        try:
            s.sendall(_hdr(4, 1 << 28, 1 << 28) + b"\0" * 64)
        except OSError:
            pass
        time.sleep(1.0)
        d = {"victim_rss_delta_mb": round((v.rss() - rss0) / MB, 1), "bytes_answered": _answer(s, 1.0)}
        s.close()
        return d
    finally:
        v.close()


def attack_ctrl_length(root, src):
    v = Victim(root)
    try:
        rss0 = v.rss()
        socks = [socket.create_connection(_addr(v.session), timeout=5) for _ in range(16)]
        for s in socks:
            s.sendall(struct.pack("<I", 64 * MB) + b"{" * 100)
        time.sleep(1.0)
        d = {"victim_rss_delta_mb": round((v.rss() - rss0) / MB, 1)}
        for s in socks:
            s.close()
        return d
    finally:
        v.close()


def attack_slowloris(root, src):
    v = Victim(root)
    try:
        base = _first_batch(v, src)
        idle = [socket.create_connection(_addr(r), timeout=5) for r in v.rails for _ in range(3)]
        time.sleep(0.2)
        d = {"first_batch_without": base, "first_batch_under_attack": _first_batch(v, src)}
        for s in idle:
            s.close()
        return d
    finally:
        v.close()


def attack_fd(root, src):
    v = Victim(root, nofile=24)
    flood = []
    try:
        base = _first_batch(v, src)
        for a in [v.session] + v.rails:
            for _ in range(60):
                try:
                    flood.append(socket.create_connection(_addr(a), timeout=0.5))
                except OSError:
                    break
        time.sleep(1.0)
        under = _first_batch(v, src, timeout=10)
        for s in flood:
            s.close()
        flood = []
        time.sleep(1.0)
        return {"first_batch_without": base, "first_batch_under_attack": under,
                "first_batch_after_flood": _first_batch(v, src, timeout=10)}
    finally:
        for s in flood:
            s.close()
        v.close()


def attack_rail_spoof(root, src):
    from transport.engine import TransferEngine
    v = Victim(root)
    try:
        with TransferEngine(fabric="tcp", timeout=15) as eng:
            eng.register(src)
            eng.batch_write(v.session, [src.ctypes.data], [v.base], [64])
            s = socket.create_connection(_addr(v.rails[0]), timeout=5)
            s.sendall(_rail_hello(eng.fabrics[0].local_id))
            answered = _answer(s, 1.0)
            t0 = time.monotonic()
            out = {"bytes_answered": answered}
            try:
                b = src.ctypes.data
                for _ in range(5):  # small pieces: a coalesced chunk, acked by the victim's receiver
                    eng.batch_write(v.session, [b + 64 * i for i in range(64)], [v.base + 64 * i for i in range(64)],
                                    [64] * 64, timeout=15)
                out["next_5_batches"] = {"ok": True, "s": round(time.monotonic() - t0, 3)}
            except Exception as e:  # noqa: BLE001
                out["next_5_batches"] = {"ok": False, "s": round(time.monotonic() - t0, 2),
                                         "error": f"{type(e).__name__}: {str(e)[:160]}"}
            s.close()
            return out
    finally:
        v.close()


def attack_garbage(root, src):
    import numpy as np
    from transport.engine import TransferEngine
    v = Victim(root)
    stop = threading.Event()

    def spray(addr, seed):
        r = np.random.default_rng(seed)
        while not stop.is_set():
            try:
                with socket.create_connection(_addr(addr), timeout=1) as s:
                    s.sendall(r.bytes(int(r.integers(1, 4096))))
            except OSError:
                pass

    try:
        threads = [threading.Thread(target=spray, args=(a, i), daemon=True)
                   for i, a in enumerate([v.session] + v.rails) for _ in range(2)]
        for t in threads:
            t.start()
        pipe, lat, errors = [], [], []
        with TransferEngine(fabric="tcp", timeout=15) as eng:
            eng.register(src)
            t_end = time.monotonic() + 2.0
            while time.monotonic() < t_end:
                pipe.append(v.call("stats", 30)[1])
                t0 = time.monotonic()
                try:
                    eng.batch_write(v.session, [src.ctypes.data], [v.base], [100_000], timeout=15)
                    lat.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"{type(e).__name__}: {str(e)[:120]}")
        stop.set()
        for t in threads:
            t.join(5)
        return {"victim_pipe_max_s": round(max(pipe), 3), "batches_ok": len(lat),
                "batch_max_s": round(max(lat), 3) if lat else None, "batch_errors": errors[:3],
                "after_flood": _first_batch(v, src)}
    finally:
        stop.set()
        v.close()


ATTACKS = {"hello": attack_hello, "ack": attack_ack, "ctrl_length": attack_ctrl_length,
           "slowloris": attack_slowloris, "fd": attack_fd, "rail_spoof": attack_rail_spoof,
           "garbage": attack_garbage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="checkout whose transport package is attacked (default: this one)")
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. 'before')")
    ap.add_argument("--only", default="", help="comma-separated attacks (default: all)")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    _setup_path(root)
    import logging

    import numpy as np
    logging.basicConfig(level=logging.CRITICAL)
    src = np.frombuffer(os.urandom(1 * MB), dtype=np.uint8).copy()
    import subprocess
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    result = {"benchmark": "attack_costs", "label": args.label, "commit": commit,
              "secret_set": bool(os.environ.get("PXN_SECRET")),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"node": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
              "versions": {"python": platform.python_version(), "numpy": np.__version__}, "attacks": {}}
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    for name in names:
        t0 = time.monotonic()
        try:
            r = ATTACKS[name](root, src)
        except Exception as e:  # noqa: BLE001 — one attack's failure is a result too
            r = {"error": f"{type(e).__name__}: {e}"}
        r["wall_s"] = round(time.monotonic() - t0, 1)
        result["attacks"][name] = r
        print(f"{name}: {json.dumps(r)}", flush=True)
    out = args.out or tempfile.mkstemp(prefix="pxn-attack-costs-", suffix=".json")[1]
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
