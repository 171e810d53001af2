"""What the sender of a socket fabric keeps of its posts: one record per posted write, per posted batch, and per
message on the wire (``OutMsg``), and the cutting of posts into messages of about the fabric's message size.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from transport.errors import RegionError
from transport.fabric.base import Completion, Opcode, WriteBatch, WriteRequest
from transport.fabric.wire import F_IMM, MAX_TABLE, PIECE_DT, STATUS_TEXT, VECTOR_MIN


class WrRecord:
    """Sender-side state of one posted write (possibly cut into several pieces)."""

    __slots__ = ("wr_id", "opcode", "length", "imm", "remote_addr", "rkey", "error", "signaled")

    def __init__(self, r: WriteRequest):
        self.wr_id = r.wr_id
        self.signaled = r.signaled
        self.opcode = Opcode.WRITE if r.imm is None else Opcode.WRITE_WITH_IMM
        self.length = r.length
        self.imm = r.imm
        self.remote_addr = r.remote_addr
        self.rkey = r.rkey
        self.error: Optional[BaseException] = None


class OutMsg:
    """One WRITE message on the wire: its pieces and where each piece's bytes come from."""

    __slots__ = ("seq", "table", "recs", "last", "src", "statuses", "done", "posted_at", "batch", "final", "src_arr",
                 "pieces", "rows", "bufs", "whole", "on_acked")

    def __init__(self, seq: int):
        self.seq = seq
        self.posted_at = 0.0
        self.table: Optional[np.ndarray] = None
        self.recs: List[WrRecord] = []  # per piece
        self.last: List[bool] = []  # per piece: is this the write's final piece
        self.src: List[tuple] = []  # per piece: (local_addr, length, device)
        self.statuses: Optional[bytes] = None
        self.done = False
        self.batch: Optional[BatchRecord] = None  # a message carrying (part of) a WriteBatch: recs/last unused
        self.final = False  # the batch's last message
        self.src_arr: Optional[np.ndarray] = None  # batch messages: ``src`` as int64 rows
        self.pieces = 0  # pieces of a message without a table (a batch the posting thread completes itself)
        self.rows: Optional[bytes] = None  # a WriteRows message: its table as wire bytes (``table`` stays None) ...
        self.bufs: Optional[list] = None  # ... and its payload as buffers of host memory, in order
        self.whole = False  # a GatherWrite: one whole write, ``table`` its one row and ``bufs`` its payload
        self.on_acked = None  # a WriteRows message: its request's ``on_acked``

    def source_array(self) -> np.ndarray:
        """``src`` as an int64 array of rows (local_addr, length, device)."""
        if self.src_arr is not None:
            return self.src_arr
        if not self.src:
            return np.empty((0, 3), dtype=np.int64)
        return np.array(self.src, dtype=np.int64).reshape(-1, 3)

    def sources(self) -> List[tuple]:
        """``src`` as (local_addr, length, device) tuples."""
        if self.src_arr is not None and not self.src:
            self.src = [tuple(r) for r in self.src_arr.tolist()]
        return self.src

    def completions(self, peer_id: str, cause: Optional[BaseException] = None) -> List[Completion]:
        """What this message completes once the peer acked it (``statuses`` set) or, with ``cause``, once it is
        lost: per write whose final piece it carries (unsignaled successes stay silent), or for a batch one
        completion, at its first failing message or its last."""
        st = self.statuses
        if self.batch is not None:
            b = self.batch
            if b.reported:
                return []
            if cause is not None and b.error is None:
                b.error = cause
            elif st is not None and b.error is None and st.count(0) != len(st):  # any(st) steps per byte
                arr = np.frombuffer(st, dtype=np.uint8)
                i = int(np.flatnonzero(arr)[0])
                t = self.table if self.table is not None else np.frombuffer(self.rows, dtype=PIECE_DT)
                b.error = RegionError(
                    f"peer {peer_id} refused write {int(t['wlen'][i])} B at 0x{int(t['waddr'][i]):x} rkey "
                    f"0x{int(t['rkey'][i]):x} of batch wr_id={b.wr_id}: {STATUS_TEXT.get(int(arr[i]), int(arr[i]))}")
            if b.error is None and not self.final:
                return []
            b.reported = True
            return [Completion(b.wr_id, Opcode.WRITE, peer_id, b.length, None, b.error)]
        out = []
        for i, (rec, last) in enumerate(zip(self.recs, self.last)):
            if rec.error is None:
                if cause is not None:
                    rec.error = cause
                elif st is not None and st[i]:
                    rec.error = RegionError(
                        f"peer {peer_id} refused wr_id={rec.wr_id}: {rec.length} B at 0x{rec.remote_addr:x} rkey "
                        f"0x{rec.rkey:x}: {STATUS_TEXT.get(st[i], st[i])}")
            if last and (rec.signaled or rec.error is not None):
                out.append(Completion(rec.wr_id, rec.opcode, peer_id, rec.length, rec.imm, rec.error))
        return out

    def __len__(self) -> int:
        return len(self.table) if self.table is not None else self.pieces

    @property
    def nbytes(self) -> int:
        """Payload bytes of the message (a message without a table carries its whole batch)."""
        return int(self.table["len"].sum()) if self.table is not None else self.batch.length


class BatchRecord:
    """Sender-side state of one posted ``WriteBatch`` (its messages share it)."""

    __slots__ = ("wr_id", "length", "error", "reported")

    def __init__(self, b: WriteBatch):
        self.wr_id = b.wr_id
        self.length = b.nbytes
        self.error: Optional[BaseException] = None
        self.reported = False


def batch_messages(b: WriteBatch, devices: np.ndarray, message_target, nsocks: int) -> List[OutMsg]:
    """The messages of one checked batch (``devices``: each write's source device): writes larger than a message
    cut into pieces, then runs of pieces of about ``message_target(bytes, nsocks)`` (the fabric's payload bytes
    per message), all in numpy."""
    la, ln, ra, rk = b.local_addr, b.length, b.remote_addr, b.rkey
    target = message_target(b.nbytes, nsocks)
    if int(ln.max()) > target:
        parts = -(-ln // target)
        which = np.repeat(np.arange(ln.size), parts)
        first_part = np.cumsum(parts) - parts
        off = (np.arange(which.size) - first_part[which]) * target
        plen = np.minimum(ln[which] - off, target)
        la, ra, rk, devices, wa, wl = la[which] + off, ra[which] + off, rk[which], devices[which], ra[which], \
            ln[which]
        ln = plen
    else:
        wa, wl = ra, ln
    cum = np.cumsum(ln)
    n = int(ln.size)
    msgs: List[OutMsg] = []
    rec = BatchRecord(b)
    start = 0
    while start < n:
        base = int(cum[start - 1]) if start else 0
        end = max(int(np.searchsorted(cum, base + target, side="right")), start + 1)
        end = min(end, start + MAX_TABLE, n)
        m = OutMsg(0)
        t = np.zeros(end - start, dtype=PIECE_DT)
        t["addr"], t["len"], t["waddr"], t["wlen"], t["rkey"] = (ra[start:end], ln[start:end], wa[start:end],
                                                                  wl[start:end], rk[start:end])
        m.table = t
        m.batch = rec
        m.src_arr = np.stack([la[start:end], ln[start:end], devices[start:end]], axis=1)
        msgs.append(m)
        start = end
    msgs[-1].final = True
    return msgs


def write_messages(requests, mrs, message_target, nsocks: int) -> List[OutMsg]:
    """Cut checked writes (``mrs``: the local region of each) into messages of about ``message_target(bytes,
    nsocks)`` bytes; a write spanning a boundary becomes several pieces."""
    total = sum(r.length for r in requests)
    target = message_target(total, nsocks)
    if len(requests) > VECTOR_MIN and all(r.length <= target for r in requests):
        return _whole_messages(requests, mrs, target)
    msgs: List[OutMsg] = []
    rows: List[tuple] = []
    cur = OutMsg(0)
    cur_bytes = 0

    def flush():
        nonlocal cur, rows, cur_bytes
        cur.table = np.array(rows, dtype=PIECE_DT)
        msgs.append(cur)
        cur, rows, cur_bytes = OutMsg(0), [], 0

    for r, mr in zip(requests, mrs):
        rec = WrRecord(r)
        flags = F_IMM if r.imm is not None else 0
        imm = r.imm or 0
        off = 0
        while off < r.length:
            room = target - cur_bytes
            if room <= 0 or len(rows) >= MAX_TABLE:
                flush()
                continue
            n = min(r.length - off, room)
            last = off + n == r.length
            rows.append((r.remote_addr + off, n, r.remote_addr, r.length, r.rkey,
                         flags if last else 0, imm, 0))
            cur.recs.append(rec)
            cur.last.append(last)
            cur.src.append((r.local_addr + off, n, mr.device))
            cur_bytes += n
            off += n
    if rows:
        flush()
    return msgs


def _whole_messages(requests, mrs, target: int) -> List[OutMsg]:
    """``write_messages`` for writes that each fit a message: whole writes, in order, a message closed once
    it holds ``target`` bytes or ``MAX_TABLE`` pieces; the table built by numpy, not row by row."""
    n = len(requests)
    la = np.fromiter((r.local_addr for r in requests), dtype=np.int64, count=n)
    ln = np.fromiter((r.length for r in requests), dtype=np.int64, count=n)
    ra = np.fromiter((r.remote_addr for r in requests), dtype=np.int64, count=n)
    # greedy: a message closes before the write that would take it past ``target`` (never above it: the
    # peer refuses a payload larger than the message size this fabric announced)
    bounds = [0]
    used = 0
    for i, k in enumerate(ln.tolist()):
        if used + k > target and i > bounds[-1]:
            bounds.append(i)
            used = 0
        used += k
    bounds.append(n)
    msgs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        for lo in range(a, b, MAX_TABLE):
            hi = min(b, lo + MAX_TABLE)
            m = OutMsg(0)
            part = requests[lo:hi]
            t = np.zeros(hi - lo, dtype=PIECE_DT)
            t["addr"] = t["waddr"] = ra[lo:hi]
            t["len"] = t["wlen"] = ln[lo:hi]
            t["rkey"] = [r.rkey for r in part]
            t["flags"] = [F_IMM if r.imm is not None else 0 for r in part]
            t["imm"] = [r.imm or 0 for r in part]
            m.table = t
            m.recs = [WrRecord(r) for r in part]
            m.last = [True] * (hi - lo)
            m.src = list(zip(la[lo:hi].tolist(), ln[lo:hi].tolist(), [mr.device for mr in mrs[lo:hi]]))
            msgs.append(m)
    return msgs
