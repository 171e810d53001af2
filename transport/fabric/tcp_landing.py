"""The target side of the tcp fabric: a received WRITE message's pieces placed into registered memory (straight
into host regions, staged for GPU ones, small messages from one receive), a landing handler's plan for a whole
write followed, and the ack sent.

The target validates every piece (rkey known, whole write inside that region) before placing anything; a refused
piece's payload is read and discarded, so nothing outside a registered region is ever written. Host pieces are
received straight into the destination (``recv_into`` a memoryview on the raw address, no extra copy); GPU pieces
land in a host staging buffer and are copied to the device by torch. A whole write with an immediate into a region
with a landing handler (``set_landing_handler``: a receiver's landing slots) is read as far as the handler asks
(a chunk's header and table), and the byte ranges the handler then names go straight to their destinations.
"""
from __future__ import annotations

import ctypes
import logging
import socket
from hmac import compare_digest
from itertools import islice, repeat
from operator import add, eq, le, sub
from typing import Dict

import numpy as np

from transport.fabric.base import DEVICE_HOST, Completion, MemoryRegion, Opcode
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.memory import (BIG_GPU_PIECE, cuda_stream, device_scratch, gpu_batch_copy, memcpy_async,
                                     pinned_buffer, raw_view)
from transport.fabric.sockets import Sock, recv_exact, recv_views
from transport.fabric.wire import (F_IMM, H_NOACK, SMALL_PIECE, ST_FAILED, ST_OK, STATUS_TEXT, T_WRITE, ack_frame,
                                   table_struct)

log = logging.getLogger(__name__)


class TcpLanding:
    """How WRITE messages land at a tcp target: the landing strategy a ``TcpFabric`` gives its ``SocketFabric``
    (``SocketFabric.landing``). It runs on the reading threads, once per message: ``on_small_write`` for a WRITE
    read whole through the look-ahead reader, ``on_message`` for any other WRITE (its payload still on the
    socket). It places into the fabric's registered regions (its ``RegionBook``, whose tables it binds once: no
    attribute hop per message) and acknowledges through the fabric (``send_ctrl`` / ``finish_message``, looked up
    per message: a test may wrap them on the fabric)."""

    def __init__(self, fabric):
        self._fab = fabric
        self._id = fabric.local_id
        book = self._book = fabric.book
        self._regions = book.regions
        self._host_views = book.host_views
        self._region_lock = book.region_lock
        self._validate_pieces = book.validate_pieces
        self._validate_lists = book.validate_lists
        self._unpin = book.unpin

    def on_message(self, ep: SocketEndpoint, s: Sock, typ: int, seq: int, table: np.ndarray, payload: int,
                    st: dict, ack: bool = True) -> None:
        """Receive one WRITE message (table read, payload still on the socket) and put its accepted pieces in
        place; ``ack`` False for an unacked write (header flag ``H_NOACK``), whose sender waits for no ACK."""
        if typ != T_WRITE:
            raise ValueError(f"tcp fabric got message type {typ}")
        lens = table["len"].tolist()
        if sum(lens) != payload:
            raise ValueError(f"payload {payload} B does not match the table's {sum(lens)} B")
        statuses, regions, pinned = self._validate_pieces(table)
        landed = False
        try:
            mr = regions[0] if len(lens) == 1 else None
            handler = self._book.landing.get(mr.rkey) if mr is not None and self._book.landing else None
            if handler is not None:
                addr, _, waddr, wlen, _, flags, imm, _ = table[0].tolist()  # ints: one call, not one per field
            if handler is not None and flags & F_IMM and addr == waddr and lens[0] == wlen:
                self._place_landed(ep, st.get("rx", s.sock), handler, mr, addr, lens[0], imm, st)
                landed = True
            else:
                self._place(st.get("rx", s.sock), table, lens, statuses, regions, st)
        finally:
            self._unpin(pinned)
        self._fab.finish_message(ep, s, seq, table, statuses, ack=ack, hold=landed and ack,
                                  token=st.pop("token", None))

    def _place_landed(self, ep: SocketEndpoint, sock, handler, mr: MemoryRegion, addr: int, length: int, imm: int,
                      st: dict) -> None:
        """Receive one whole write with an immediate into a region with a landing handler
        (``set_landing_handler``): the handler reads what it needs and may name destinations for byte ranges of
        the write, which are then received straight there; everything else lands in ``mr``. Runs with ``mr``
        pinned (checked by ``_validate_pieces``)."""
        ent = self._host_views.get(mr.rkey)
        own = ent[1] if ent is not None and ent[0] is mr else raw_view(mr.addr, mr.length, writable=True)
        base = mr.addr
        pos = addr
        end = addr + length

        def read(n: int) -> memoryview:
            nonlocal pos
            n = max(0, min(int(n), end - pos))
            v = own[pos - base:pos - base + n]
            recv_exact(sock, v)
            pos += n
            return v

        plan = None
        try:
            plan = handler(ep.peer_id, addr, length, imm, read)
            if plan is not None:
                dsts, lens, offs = plan.dsts, plan.lens, plan.offs
                # an empty plan is bad too: the span of its ranges (``RegionBook.pin_span``) has no ends
                ok = len(dsts) == len(lens) == len(offs) >= 1
                if ok:
                    # every range of at least one byte, after what was read and after the range before it, and
                    # inside the write: builtin reductions (C loops), where a Python step per range cost more
                    ends = list(map(add, offs, lens))
                    ok = min(lens) >= 1 and offs[0] >= pos - addr and ends[-1] <= length \
                        and all(map(le, ends, islice(offs, 1, None)))
                if not ok:
                    log.warning("%s: landing handler gave a bad plan for a write of %d B; landing it whole", self._id,
                                length)
                    plan = None
        except Exception:  # noqa: BLE001 — a handler bug must not break the link: the write lands as usual
            log.exception("%s: landing handler failed; landing the write whole", self._id)
            plan = None
        if plan is not None:
            pinned = self._book.pin_span(dsts, lens)
            try:
                dview = pinned[1] if pinned is not None else None
                views = []
                if dview is not None and offs[0] + addr == pos and all(map(eq, ends, islice(offs, 1, None))):
                    # the ranges follow each other in the write (no padding, nothing for the slot): one view of
                    # the region per range, made by C loops
                    starts = list(map(sub, dsts, repeat(pinned[2], len(dsts))))
                    views = list(map(dview.__getitem__, map(slice, starts, map(add, starts, lens))))
                    pos = ends[-1] + addr
                else:
                    for d, k, o in zip(dsts, lens, offs):
                        o += addr
                        if o > pos:
                            views.append(own[pos - base:o - base])
                        if dview is not None:
                            d -= pinned[2]
                            views.append(dview[d:d + k])
                        else:
                            views.append(raw_view(d, k, writable=True))
                        pos = o + k
                recv_views(sock, views)
            finally:
                if pinned is not None:
                    self._unpin((pinned[0],))
        if pos < end:
            recv_exact(sock, own[pos - base:end - base])
        if plan is not None:
            plan.done()

    def on_small_write(self, ep: SocketEndpoint, s: Sock, seq: int, count: int, tb: int, blen: int,
                       st: dict, hflags: int = 0, mac=None) -> None:
        """``on_message`` for a WRITE message of at most ``SMALL_MESSAGE`` bytes: table and payload taken in one
        receive, the table read by one ``struct`` call, every accepted piece copied to its place from there. The
        checks are ``_validate_pieces``'s, before anything is placed; a table of whole writes into one host region
        (what a ``WriteRows`` post sends) is checked by its extremes and placed here, any other piece by piece
        (``_place_pieces``). ``mac``: (the hash begun on the header, the tag it must give), or None."""
        view = st["rx"].take(blen, memoryview(st["stage"]))
        token = None
        if mac is not None:  # the header and table checked before the table is read
            mac[0].update(view[:tb])
            d = mac[0].digest()
            if not compare_digest(d[:16], mac[1]):
                s.sess.rx_end(*mac)
            token = d[16:]
        cols = table_struct(count).unpack_from(view)
        addrs, lens, waddrs, wlens = cols[0::8], cols[1::8], cols[2::8], cols[3::8]
        rkeys, flags = cols[4::8], cols[5::8]
        if sum(lens) != blen - tb:
            raise ValueError(f"payload {blen - tb} B does not match the table's {sum(lens)} B")
        statuses = None
        if count and addrs == waddrs and lens == wlens and rkeys.count(rkeys[0]) == count and min(lens) > 0:
            rk = rkeys[0]
            lo, hi = min(addrs), max(map(add, addrs, lens))
            with self._region_lock:
                ent = self._host_views.get(rk)
                mr = self._regions.get(rk)
                if ent is not None and ent[0] is mr and lo >= mr.addr and hi <= mr.addr + mr.length:
                    # placed while holding the lock instead of pinning the region: ``deregister`` waits for this
                    # lock before it returns, and the copies of at most SMALL_MESSAGE bytes never block
                    statuses = bytearray(count)
                    dst, base = ent[1], mr.addr
                    off = tb
                    for a, k in zip(addrs, lens):
                        a -= base
                        dst[a:a + k] = view[off:off + k]
                        off += k
            if statuses is not None:
                view.release()
        if statuses is None:
            statuses = self._place_pieces(view, tb, blen, addrs, lens, waddrs, wlens, rkeys, st)
        events = []
        if any(flags):
            imms = cols[6::8]
            for i, f in enumerate(flags):
                if f & F_IMM and statuses[i] == ST_OK:
                    events.append(Completion(0, Opcode.RECV_IMM, ep.peer_id, wlens[i], imms[i]))
        if not hflags & H_NOACK:
            self._fab.send_ctrl(ep, s, ack_frame(seq, statuses, token))
            st["small"] = True  # the reader may spin for the next one (``recv_spin``)
        elif statuses.count(0) != count:
            i = next(i for i, v in enumerate(statuses) if v)
            log.warning("%s: refused an unacked write from %s: %d B at 0x%x rkey 0x%x: %s", self._id, ep.peer_id,
                        wlens[i], waddrs[i], rkeys[i], STATUS_TEXT.get(statuses[i], statuses[i]))
        ep.deliver_in_order(seq, events)

    def _place_pieces(self, view: memoryview, tb: int, blen: int, addrs, lens, waddrs, wlens, rkeys,
                      st: dict) -> bytearray:
        """Every piece checked on its own (``_validate_lists``) and each accepted one placed from ``view`` (host
        regions copied, GPU ones staged through pinned memory); returns the statuses and releases ``view``."""
        statuses, regions, pinned = self._validate_lists(addrs, lens, waddrs, wlens, rkeys)
        try:
            off = tb
            gpu = []
            views = self._host_views
            for i, mr in enumerate(regions):
                k = lens[i]
                if mr is not None:
                    ent = views.get(mr.rkey)
                    if ent is not None and ent[0] is mr:  # the view of this very region (checked above)
                        a = addrs[i] - mr.addr
                        ent[1][a:a + k] = view[off:off + k]
                    elif mr.device == DEVICE_HOST:  # deregistered meanwhile: still pinned, deregister waits
                        raw_view(addrs[i], k, writable=True)[:] = view[off:off + k]
                    else:
                        gpu.append((i, off - tb, k))
                off += k
            if gpu:  # GPU regions: staged through pinned memory, as ``_place`` does
                payload = blen - tb
                host = pinned_buffer(st, payload)
                raw_view(host.data_ptr(), payload, writable=True)[:] = view[tb:blen]
                self._place_gpu(host, gpu, addrs, regions, statuses, st)
        finally:
            view.release()
            self._unpin(pinned)
        return statuses

    def _place(self, sock: socket.socket, table, lens, statuses, regions, st: dict) -> None:
        """Read the message payload from ``sock`` and put each accepted piece at its address."""
        addrs = table["addr"].tolist()
        n = len(lens)
        i = 0
        gpu_pieces = []
        while i < n:
            ln = lens[i]
            mr = regions[i]
            if ln >= SMALL_PIECE and mr is not None and mr.device == DEVICE_HOST:
                recv_exact(sock, raw_view(addrs[i], ln, writable=True))  # zero copy: straight to its place
                i += 1
                continue
            if ln >= SMALL_PIECE and mr is None:
                self._discard(sock, ln, st)
                i += 1
                continue
            # a run of small pieces (or a GPU piece): one recv into staging, then scatter
            j, run = i, 0
            while j < n and (lens[j] < SMALL_PIECE or (regions[j] is not None and regions[j].device >= 0)) \
                    and (run == 0 or run + lens[j] <= (8 << 20)):
                run += lens[j]
                j += 1
            if any(regions[k] is not None and regions[k].device >= 0 for k in range(i, j)):
                stage = pinned_buffer(st, run)  # pinned: the H2D copies run async on the copy engine
                base = stage.data_ptr()
                recv_exact(sock, raw_view(base, run, writable=True))
            else:
                if len(st["stage"]) < run:
                    st["stage"] = bytearray(run)
                stage = st["stage"]
                recv_exact(sock, memoryview(stage)[:run])
                base = ctypes.addressof(ctypes.c_char.from_buffer(stage))
            off = 0
            for k in range(i, j):
                mr = regions[k]
                if mr is not None:
                    if mr.device == DEVICE_HOST:
                        ctypes.memmove(addrs[k], base + off, lens[k])
                    else:
                        gpu_pieces.append((k, off, lens[k]))
                off += lens[k]
            if gpu_pieces:
                self._place_gpu(stage, gpu_pieces, addrs, regions, statuses, st)
                gpu_pieces = []
            i = j

    def _discard(self, sock: socket.socket, n: int, st: dict) -> None:
        stage = memoryview(st["stage"])
        while n:
            k = min(n, len(stage))
            recv_exact(sock, stage[:k])
            n -= k

    def _place_gpu(self, host, pieces, addrs, regions, statuses, st: dict) -> None:
        """Copy GPU pieces from the pinned staging tensor ``host`` (offsets increasing) to their devices: big
        pieces one H2D copy each, small ones one H2D of their span into device scratch + one scatter launch."""
        import torch
        by_dev: Dict[int, list] = {}
        for k, off, ln in pieces:
            by_dev.setdefault(regions[k].device, []).append((k, off, ln))
        for dev, items in by_dev.items():
            stream = cuda_stream(st, dev)
            try:
                with torch.cuda.device(dev), torch.cuda.stream(stream):
                    small = [it for it in items if it[2] < BIG_GPU_PIECE]
                    for k, off, ln in items:
                        if ln >= BIG_GPU_PIECE:
                            memcpy_async(addrs[k], host.data_ptr() + off, ln, stream)
                    if small:
                        lo, hi = small[0][1], small[-1][1] + small[-1][2]
                        scratch = device_scratch(st, dev, hi - lo)
                        scratch[:hi - lo].copy_(host[lo:hi], non_blocking=True)
                        sp = scratch.data_ptr() - lo
                        gpu_batch_copy([sp + off for _, off, _ in small], [addrs[k] for k, _, _ in small],
                                       [ln for _, _, ln in small], dev)
                # the staging buffers are reused next and the ack promises placed bytes: wait for the copies
                stream.synchronize()
            except Exception as e:  # noqa: BLE001
                log.error("placing %d piece(s) on cuda:%d failed: %s", len(items), dev, e)
                for k, _, _ in items:
                    statuses[k] = ST_FAILED
