"""Property-based fuzz of what pxn reads from the wire: relay chunks (``parse_chunk``) and tcp fabric frames.

Properties checked on every case:

* ``parse_chunk``: any byte string either raises ``ChunkFormatError`` or yields a table whose every item lies
  inside the chunk's payload (aligned, no overlap, no 64-bit wrap, inside the bytes that landed). Nothing else
  escapes.
* tcp frames: a frame (header, piece table, payload; valid, mutated or random) fed to the fabric's receive loop
  over a socket pair never raises out of it, never touches a byte outside the pieces it accepted (the region's
  guards and every unaccepted range stay poisoned), and every piece the oracle refuses (unknown rkey, write
  outside the region, piece outside its write, zero length) gets a non-zero status in the ack: each refusal is
  counted. A complete message's accepted pieces land byte-exact.

The test suite runs a few thousand cases (``tests/test_security.py``); this script runs many more and writes
JSON (machine, versions, date, cases, failures, seconds)::

    python3 benchmarks/fuzz_wire.py --cases 100000            # -> a temporary file, path printed
    python3 benchmarks/fuzz_wire.py --cases 100000 --out benchmarks/results/fuzz-wire-cpu.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import struct
import sys
import tempfile
import time
import zlib

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pxn_kernels.chunk import (ENTRY_BYTES, HEADER_BYTES, PAYLOAD_ALIGN, build_header_table,  # noqa: E402
                               parse_chunk)
from transport.errors import ChunkFormatError  # noqa: E402
from transport import auth  # noqa: E402
from transport.fabric import tcp as T  # noqa: E402
from transport.fabric import wire  # noqa: E402

POISON = 0x5A
GUARD = 4096
REGION = 64 << 10


# ============================================================================================================
# parse_chunk
# ============================================================================================================
def check_chunk(data: bytes, available) -> str:
    """One parse_chunk case; returns "refused" or "accepted", raises AssertionError on a broken property."""
    try:
        t = parse_chunk(data, available_bytes=available)
    except ChunkFormatError:
        return "refused"
    landed = len(data) if available is None else available
    assert t.payload_offset <= t.chunk_bytes <= landed, (t.payload_offset, t.chunk_bytes, landed)
    if t.item_count:
        assert int(t.lengths.min()) >= 1
        assert int(t.offsets.min()) >= t.payload_offset
        assert (t.offsets % PAYLOAD_ALIGN == 0).all()
        ends = t.offsets + t.lengths
        assert int(ends.max()) <= t.chunk_bytes
        order = np.argsort(t.offsets, kind="stable")
        assert (ends[order][:-1] <= t.offsets[order][1:]).all()
        assert all(int(d) + int(n) <= 1 << 64 for d, n in zip(t.dst_addrs.tolist(), t.lengths.tolist()))
    return "accepted"


@st.composite
def chunks(draw):
    """A valid chunk, then mutated: random bytes written over it, fields forced, the checksum redone or not."""
    n = draw(st.integers(0, 12))
    lengths = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    dsts = draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=n, max_size=n))
    head, offs, total = build_header_table(dsts, lengths, draw(st.integers(0, (1 << 64) - 1)),
                                           draw(st.integers(0, (1 << 64) - 1)))
    buf = bytearray(total)
    buf[:head.size] = head.tobytes()
    kind = draw(st.sampled_from(["valid", "bytes", "field", "random"]))
    if kind == "random":
        buf = bytearray(draw(st.binary(min_size=0, max_size=600)))
    elif kind == "bytes":
        for _ in range(draw(st.integers(1, 6))):
            if buf:
                i = draw(st.integers(0, len(buf) - 1))
                buf[i] = draw(st.integers(0, 255))
    elif kind == "field":
        # header fields and table entries set to edge values; the checksum redone so deeper checks run
        off, size = draw(st.sampled_from([(4, 2), (6, 2), (16, 4), (20, 4), (24, 4), (28, 4)]
                                         + [(HEADER_BYTES + ENTRY_BYTES * i + o, s) for i in range(n)
                                            for o, s in ((0, 8), (8, 4), (12, 4))]))
        edge = draw(st.sampled_from([0, 1, 15, 16, 63, 64, 65, (1 << (8 * size)) - 1, (1 << (8 * size - 1)),
                                     draw(st.integers(0, (1 << (8 * size)) - 1))]))
        if off + size <= len(buf):
            buf[off:off + size] = edge.to_bytes(size, "little")
    if kind != "random" and len(buf) >= HEADER_BYTES and draw(st.booleans()):
        count = struct.unpack_from("<I", buf, 16)[0]
        end = HEADER_BYTES + ENTRY_BYTES * count
        if end <= len(buf):
            scratch = bytearray(buf[:end])
            scratch[40:44] = b"\0\0\0\0"
            struct.pack_into("<I", buf, 40, zlib.crc32(scratch))
    available = draw(st.one_of(st.none(), st.integers(0, len(buf) + 64)))
    return bytes(buf), available


# ============================================================================================================
# tcp frames
# ============================================================================================================
class WireHarness:
    """A tcp fabric with one poisoned, registered region between guards; ``run(frame)`` feeds one frame to its
    receive loop and checks the properties of the module docstring. Counts in ``self.counts``."""

    def __init__(self):
        logging.getLogger("transport").setLevel(logging.ERROR)
        self.fab = T.TcpFabric(secret=auth.Resolved(None))  # frames fed straight to the receive loop: no handshake
        self.mem = np.full(GUARD + REGION + GUARD, POISON, dtype=np.uint8)
        self.base = self.mem.ctypes.data + GUARD
        self.mr = self.fab.register(self.base, REGION)
        self.counts = {"cases": 0, "pieces_refused": 0, "pieces_accepted": 0, "links_failed": 0, "acked": 0, "unacked": 0}

    def close(self) -> None:
        self.fab.close()

    def expected_status(self, row) -> bool:
        addr, ln, waddr, wlen, rkey = (int(row[k]) for k in ("addr", "len", "waddr", "wlen", "rkey"))
        return (rkey == self.mr.rkey and ln >= 1 and self.mr.contains(waddr, wlen) and waddr <= addr
                and addr + ln <= waddr + wlen)

    def run(self, frame: bytes) -> None:
        self.mem.fill(POISON)
        a, b = socket.socketpair()
        try:
            ep = T.TcpEndpoint(self.fab, "fuzz", [b])
            ep.max_payload = 1 << 20
            a.settimeout(5.0)
            a.sendall(frame)
            a.shutdown(socket.SHUT_WR)
            self.fab._recv_loop(ep, ep.socks[0])  # returns once the frame is consumed or refused
            acks = self._acks(a, ep.socks[0])
        finally:
            a.close()
            b.close()
        self.counts["cases"] += 1
        if not ep.alive:
            self.counts["links_failed"] += 1
        self._check(frame, acks)

    @staticmethod
    def _acks(a: socket.socket, s) -> list:
        """The acks the receive loop sent, in order: those it wrote to the socket itself (read at ``a``), then
        those it queued for the socket's sender thread (none runs here)."""
        a.setblocking(False)
        data = bytearray()
        try:
            while True:
                got = a.recv(1 << 16)
                if not got:
                    break
                data += got
        except BlockingIOError:
            pass
        for part in s.ctrl:
            data += part
        acks, pos = [], 0
        while pos + wire.HDR.size <= len(data):
            count = wire.HDR.unpack_from(data, pos)[4]
            acks.append(bytes(data[pos:pos + wire.HDR.size + count]))
            pos += wire.HDR.size + count
        return acks

    def _check(self, frame: bytes, acks) -> None:
        """Replay the protocol on ``frame`` (messages back to back) and compare with what the fabric did."""
        may_change = np.zeros(self.mem.size, dtype=bool)
        exp = np.full(self.mem.size, POISON, dtype=np.uint8)
        pos, n_acked, n_complete = 0, 0, 0
        while pos + wire.HDR.size <= len(frame):
            magic, typ, hflags, _, count, _, blen = wire.HDR.unpack_from(frame, pos)
            if magic != wire.MAGIC or typ != wire.T_WRITE or count > wire.MAX_TABLE:
                break  # the link fails here (or an ACK / other type: never a write)
            tb = count * wire.PIECE_DT.itemsize
            start = pos + wire.HDR.size
            if blen < tb or blen - tb > 1 << 20 or start + tb > len(frame):
                break
            table = np.frombuffer(frame, dtype=wire.PIECE_DT, count=count, offset=start)
            if sum(int(x) for x in table["len"]) != blen - tb:
                break
            ok = [self.expected_status(r) for r in table]
            off = start + tb
            for r, good in zip(table, ok):
                addr, ln = int(r["addr"]), int(r["len"])
                if good:
                    lo = addr - self.base + GUARD
                    may_change[lo:lo + ln] = True
                    exp[lo:lo + ln] = np.frombuffer(frame[off:off + ln].ljust(ln, bytes([POISON])), np.uint8)
                off += ln
            if off > len(frame):
                break  # truncated payload: accepted pieces may hold part of it, nothing is acked
            n_complete += 1
            self.counts["pieces_refused"] += sum(1 for g in ok if not g)
            self.counts["pieces_accepted"] += sum(1 for g in ok if g)
            pos = off
            if hflags & wire.H_NOACK:  # an unacked write: its pieces land (or are refused) and nothing answers
                self.counts["unacked"] += 1
                continue
            assert n_acked < len(acks), "a complete WRITE message was not acked"
            statuses = acks[n_acked][wire.HDR.size:]
            assert len(statuses) == count, (len(statuses), count)
            for i, good in enumerate(ok):
                assert (statuses[i] == wire.ST_OK) == good, (i, statuses[i], table[i])
            n_acked += 1
        assert len(acks) == n_acked, f"{len(acks)} acks for {n_acked} complete messages"
        self.counts["acked"] += n_acked
        stray = np.nonzero((self.mem != POISON) & ~may_change)[0]
        assert stray.size == 0, f"{stray.size} byte(s) changed outside accepted pieces, first at {int(stray[0])}"
        if n_complete and pos == len(frame):  # every message complete: the accepted pieces landed byte-exact
            bad = np.nonzero(self.mem != exp)[0]
            assert bad.size == 0, f"{bad.size} byte(s) differ from the accepted pieces, first at {int(bad[0])}"


@st.composite
def frames(draw, base: int, rkey: int):
    """A WRITE frame aimed at (and around) the region, a frame of another type, or random bytes."""
    kind = draw(st.sampled_from(["write"] * 6 + ["ack", "other", "random"]))
    if kind == "random":
        return draw(st.binary(min_size=0, max_size=400))
    near = st.one_of(st.integers(base, base + REGION - 4096), st.integers(base, base + REGION - 4096),
                     st.integers(base - GUARD, base + REGION + GUARD), st.integers(0, (1 << 64) - 1),
                     st.sampled_from([base, base + REGION - 1, base + REGION, base - 1, (1 << 64) - 1]))
    small = st.one_of(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 4096),
                      st.sampled_from([0, 1, REGION, REGION + 1, (1 << 64) - 1]))
    if kind == "write":
        n = draw(st.integers(0, 6))
        rows, payload = [], b""
        for _ in range(n):
            addr = draw(near)
            ln = draw(small)
            if draw(st.booleans()):  # a plausible write: the piece is the whole write
                waddr, wlen = addr, ln
            else:
                waddr, wlen = draw(near), draw(small)
            rows.append((addr % (1 << 64), ln % (1 << 64), waddr % (1 << 64), wlen % (1 << 64),
                         draw(st.sampled_from([rkey] * 4 + [0, rkey ^ 1, draw(st.integers(0, (1 << 32) - 1))])),
                         draw(st.integers(0, 3)), draw(st.integers(0, (1 << 32) - 1)), 0))
        table = np.array(rows, dtype=wire.PIECE_DT).tobytes()
        lens = sum(r[1] for r in rows)
        body_len = lens if lens <= 64 << 10 else draw(st.integers(0, 64 << 10))
        payload = draw(st.binary(min_size=min(body_len, 64), max_size=min(body_len, 64)))
        payload = (payload * (body_len // max(1, len(payload)) + 1))[:body_len] if payload else bytes(body_len)
        count = n if draw(st.integers(0, 3)) else draw(st.sampled_from([n + 1, max(0, n - 1), wire.MAX_TABLE + 1,
                                                                         (1 << 32) - 1]))
        blen = len(table) + lens if draw(st.integers(0, 3)) else draw(st.sampled_from(
            [len(table) + body_len, 0, (1 << 64) - 1, draw(st.integers(0, (1 << 64) - 1))]))
        blen %= 1 << 64
        hflags = draw(st.sampled_from([0, 0, 0, wire.H_NOACK]))  # an unacked write now and then: no ACK expected
        frame = wire.HDR.pack(wire.MAGIC, wire.T_WRITE, hflags, 0, count, draw(st.integers(0, 3)), blen) + table + payload
    else:
        typ = wire.T_ACK if kind == "ack" else draw(st.integers(0, 255))
        count = draw(st.sampled_from([0, 1, 8, wire.MAX_TABLE, wire.MAX_TABLE + 1, (1 << 32) - 1]))
        blen = draw(st.sampled_from([count, 0, count + 1, (1 << 24) + 1, (1 << 64) - 1]))
        frame = wire.HDR.pack(wire.MAGIC, typ, 0, 0, count, draw(st.integers(0, 3)), blen) \
            + draw(st.binary(max_size=64))
    if draw(st.integers(0, 19)) == 0:  # a corrupted header byte
        i = draw(st.integers(0, min(len(frame), wire.HDR.size) - 1))
        frame = frame[:i] + bytes([draw(st.integers(0, 255))]) + frame[i + 1:]
    if draw(st.integers(0, 9)) == 0:  # truncated
        frame = frame[:draw(st.integers(0, len(frame)))]
    return frame


# ============================================================================================================
# runners (the tests call these with a small count)
# ============================================================================================================
def fuzz_chunks(cases: int, seed=None) -> dict:
    counts = {"cases": 0, "refused": 0, "accepted": 0}

    @settings(max_examples=cases, database=None, deadline=None, derandomize=seed is None,
              suppress_health_check=list(HealthCheck))
    @given(chunks())
    def run(case):
        data, available = case
        counts[check_chunk(data, available)] += 1
        counts["cases"] += 1

    if seed is not None:
        run = __import__("hypothesis").seed(seed)(run)
    run()
    return counts


def fuzz_frames(cases: int, seed=None) -> dict:
    h = WireHarness()
    try:
        @settings(max_examples=cases, database=None, deadline=None, derandomize=seed is None,
                  suppress_health_check=list(HealthCheck))
        @given(frames(h.base, h.mr.rkey))
        def run(frame):
            h.run(frame)

        if seed is not None:
            run = __import__("hypothesis").seed(seed)(run)
        run()
        return dict(h.counts)
    finally:
        h.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100_000, help="cases per target (default 100000)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a fresh one)")
    ap.add_argument("--out", default=None, help="JSON path (default: a temporary file)")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    import hypothesis
    result = {"benchmark": "fuzz_wire", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"node": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
              "versions": {"python": platform.python_version(), "numpy": np.__version__,
                           "hypothesis": hypothesis.__version__},
              "seed": seed, "targets": {}}
    for name, fn in (("parse_chunk", fuzz_chunks), ("tcp_frames", fuzz_frames)):
        t0 = time.perf_counter()
        counts = fn(args.cases, seed)
        counts["seconds"] = round(time.perf_counter() - t0, 1)
        counts["failures"] = 0  # a failure raises (hypothesis prints the shrunk case) and no JSON is written
        result["targets"][name] = counts
        print(f"{name}: {counts}", flush=True)
    out = args.out or tempfile.mkstemp(prefix="pxn-fuzz-wire-", suffix=".json")[1]
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
