"""The cutting of a socket fabric's posts into messages of about the fabric's message size (the records they
make, ``OutMsg`` and one per posted write or batch, are the endpoint's: ``transport.fabric.endpoint``).
"""
from __future__ import annotations

from typing import List

import numpy as np

from transport.fabric.base import WriteBatch
from transport.fabric.endpoint import BatchRecord, OutMsg, WrRecord
from transport.fabric.wire import F_IMM, MAX_TABLE, PIECE_DT, VECTOR_MIN

__all__ = ["BatchRecord", "OutMsg", "WrRecord", "batch_messages", "write_messages"]  # the records: re-exported


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
