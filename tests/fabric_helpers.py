"""Process helpers for the fabric conformance suite: a target fabric living in a separate (spawned) process.

The target allocates ``GUARD + REGION + GUARD`` bytes, fills all of it with a poison pattern, and registers only
the middle part, so a test can prove that refused writes touched nothing anywhere (guards included). The test
process drives it through a ``multiprocessing`` pipe with small commands.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

GUARD = 1 << 20
POISON = 0xA5
log = logging.getLogger(__name__)


class Buffer:
    """``size`` bytes of host memory (numpy) or GPU memory (torch) with a raw address."""

    def __init__(self, size: int, device: int = -1):
        self.size, self.device = size, device
        if device < 0:
            self.arr = np.empty(size, dtype=np.uint8)
            self.addr = self.arr.ctypes.data
        else:
            import torch
            self.arr = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
            self.addr = self.arr.data_ptr()

    def fill(self, value: int) -> None:
        self.arr.fill(value) if self.device < 0 else self.arr.fill_(value)

    def write(self, off: int, data: np.ndarray) -> None:
        if self.device < 0:
            self.arr[off:off + len(data)] = data
        else:
            import torch
            self.arr[off:off + len(data)].copy_(torch.from_numpy(data))
            torch.cuda.synchronize(self.device)

    def read(self, off: int, n: int) -> np.ndarray:
        if self.device < 0:
            return self.arr[off:off + n]
        return self.arr[off:off + n].cpu().numpy()


def verbs_unavailable() -> str:
    """Why the verbs fabric cannot run here ('' when it can): no pyverbs (nor softverbs, see conftest), or no
    usable RDMA port."""
    from transport.errors import FabricUnavailable
    from transport.fabric.verbs import usable_port
    try:
        usable_port()
    except FabricUnavailable as e:
        return str(e)
    return ""


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a))).hexdigest()


def _completion_tuple(c):
    return (c.wr_id, int(c.opcode), c.peer_id, c.byte_len, c.imm,
            None if c.error is None else (type(c.error).__name__, str(c.error)))


def _target_main(conn, fabric_name: str, options: dict, region_bytes: int, device: int) -> None:
    logging.basicConfig(level=os.environ.get("PXN_TEST_LOG", "WARNING"))
    from transport.fabric import make_fabric
    from transport.fabric.base import WriteRequest
    try:
        fab = make_fabric(fabric_name, **options)
        buf = Buffer(GUARD + region_bytes + GUARD, device)
        buf.fill(POISON)
        mr = fab.register(buf.addr + GUARD, region_bytes, device)
        small = Buffer(4096, device)
        small.fill(POISON)
        mr2 = fab.register(small.addr, 4096, device)
        conn.send(("ok", {"desc": fab.descriptor(), "id": fab.local_id, "addr": mr.addr, "length": mr.length,
                          "rkey": mr.rkey, "buf_addr": buf.addr, "buf_len": buf.size,
                          "small_addr": mr2.addr, "small_rkey": mr2.rkey, "pid": os.getpid()}))
    except BaseException as e:  # report construction failures (FabricUnavailable...) to the test
        conn.send(("err", (type(e).__name__, str(e))))
        return
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                os._exit(args[0])  # die abruptly: no close, sockets reset by the kernel
            elif cmd == "close":
                fab.close()
                conn.send(("ok", None))
                break
            elif cmd == "connect":
                fab.connect(args[0])
                conn.send(("ok", None))
            elif cmd == "poll":
                max_n, timeout = args
                conn.send(("ok", [_completion_tuple(c) for c in fab.poll(max_n, timeout)]))
            elif cmd == "poison":
                buf.fill(POISON)
                small.fill(POISON)
                conn.send(("ok", None))
            elif cmd == "hash":  # offset relative to the registered region
                off, n = args
                conn.send(("ok", digest(buf.read(GUARD + off, n))))
            elif cmd == "untouched":
                # every byte of the whole buffer outside the allowed (region-relative) ranges still poison?
                allowed = sorted((GUARD + o, GUARD + o + n) for o, n in args[0])
                data = buf.read(0, buf.size)
                mask = np.ones(buf.size, dtype=bool)
                for a, b in allowed:
                    mask[a:b] = False
                bad = np.nonzero(mask & (data != POISON))[0]
                bad2 = np.nonzero(small.read(0, 4096) != POISON)[0]
                conn.send(("ok", (int(bad[0]) - GUARD if len(bad) else None, len(bad), len(bad2))))
            elif cmd == "fill":  # fill region range with given bytes (for write-back tests)
                off, data = args
                buf.write(GUARD + off, data)
                conn.send(("ok", None))
            elif cmd == "writeback":  # post writes of our region bytes to the peer's region, via endpoint(peer)
                peer_id, items = args
                ep = fab.endpoint(peer_id)
                fab.post_writes(ep, [WriteRequest(mr.addr + lo, n, ra, rk, mr.lkey, imm, wr)
                                     for lo, n, ra, rk, imm, wr in items])
                got, deadline = [], time.monotonic() + 20
                while len(got) < len(items) and time.monotonic() < deadline:
                    got += [c for c in fab.poll(256, 0.5) if c.opcode != 3]
                conn.send(("ok", [_completion_tuple(c) for c in got]))
            elif cmd == "deregister_small":
                fab.deregister(mr2)
                conn.send(("ok", None))
            else:
                conn.send(("err", ("ValueError", f"unknown command {cmd!r}")))
        except BaseException as e:  # noqa: BLE001
            conn.send(("err", (type(e).__name__, f"{e}\n{traceback.format_exc()}")))


class RemoteError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class Target:
    """A fabric in a spawned process with one registered region (``region_bytes``) between poison guards."""

    def __init__(self, fabric_name: str, region_bytes: int, device: int = -1, options: dict = None,
                 start_timeout: float = 60.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_target_main, args=(child, fabric_name, options or {}, region_bytes, device),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout):
            self.proc.kill()
            raise RuntimeError(f"target process for {fabric_name} did not start within {start_timeout} s")
        status, info = self.conn.recv()
        if status != "ok":
            self.proc.join(5)
            raise RemoteError(*info)
        self.info = info
        self.desc, self.id, self.addr, self.length, self.rkey = (info[k] for k in ("desc", "id", "addr", "length",
                                                                                     "rkey"))

    def call(self, *cmd, timeout: float = 60.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"target did not answer {cmd[0]!r} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RemoteError(*value)
        return value

    def kill(self) -> None:
        """Kill the process hard (SIGKILL): its sockets are reset by the kernel, as when a host process dies."""
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=10)
            except Exception:  # noqa: BLE001 — best effort, then kill
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.conn.close()

    def poll_until(self, n: int, timeout: float = 20.0, opcode: int = None):
        """Target-side completions until ``n`` arrived (RECV_IMM ones when ``opcode`` is 3)."""
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            got += [c for c in self.call("poll", 4096, 0.2) if opcode is None or c[1] == opcode]
        return got


def wait_completions(fab, n: int, timeout: float = 30.0, sender_only: bool = True):
    """Poll ``fab`` until ``n`` (sender) completions arrived or ``timeout`` seconds passed."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        got += [c for c in fab.poll(4096, min(left, 0.5)) if not sender_only or int(c.opcode) != 3]
    return got


def poll_completions(fab, n: int, timeout: float = 20.0):
    """At least ``n`` completions of ``fab`` (every kind), each poll waiting up to ``timeout`` seconds for one;
    fails naming how many of ``n`` came when a poll returns none."""
    out = []
    while len(out) < n:
        got = fab.poll(64, timeout=timeout)
        assert got, f"timed out with {len(out)} of {n} completions"
        out.extend(got)
    return out


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (state T in /proc), so that nothing posted afterwards is
    answered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not stop within {timeout} s after SIGSTOP")
