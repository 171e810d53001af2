"""The sender side of the tcp fabric: posts of writes, batches, rows (``WriteRows``), gather writes and unacked
writes made into messages; a small message sent by the posting thread itself when its socket is idle, the rest by
the sockets' sender threads; GPU sources staged through pinned memory; and the ack of a small batch read by the
thread that waits for it (``await_rows``).

Ordering: messages of one endpoint carry a sequence number across all its sockets; the sender releases
completions and the target releases RECV_IMM events in sequence order, so a RECV_IMM means that every write
posted before it on that endpoint has landed, as on an RDMA RC queue pair.
"""
from __future__ import annotations

import logging
import select
import threading
import time
from typing import Dict, List, Sequence

import numpy as np

from transport.errors import RegionError, UnknownPeer
from transport.fabric.base import DEVICE_HOST, Endpoint, GatherWrite, MemoryRegion, WriteBatch, WriteRequest, WriteRows
from transport.fabric.endpoint import BatchRecord, OutMsg, SocketEndpoint, WrRecord
from transport.fabric.memory import (BIG_GPU_PIECE, cuda_stream, device_scratch, gpu_batch_copy, memcpy_async,
                                     pinned_buffer, raw_view)
from transport.fabric.messages import batch_messages, write_messages
from transport.fabric.region_book import RegionBook
from transport.fabric.sockets import Rx, Sock, send_buffers, send_now
from transport.fabric.spin import AdaptiveSpin
from transport.fabric.tcp_io import reader_state
from transport.fabric.wire import (F_IMM, H_NOACK, H_WHOLE, HDR, I64, MAGIC, MAX_TABLE, PIECE_DT, ROW, SMALL_MESSAGE,
                                   T_WRITE, UNACKED_MAX, seal)

log = logging.getLogger(__name__)

_HEAD = bytearray(48)  # a WRITE header's place: ``post_rows`` frames into ``_HEAD + rows``, a new bytearray

# A post of one message at most this large (pieces, bytes on the wire) is sent by the posting thread itself when
# its socket is idle; larger ones go to the sender threads, which stream them over every socket in parallel.
INLINE_PIECES = 256
INLINE_BYTES = 64 << 10


class TcpPoster:
    """The sender side of one ``TcpFabric``: it checks posts against the fabric's regions (``SocketFabric.validate``,
    its ``RegionBook``), makes their messages, sends a small one itself or queues them on the endpoint
    (``SocketEndpoint.enqueue``) for the sender threads, whose sends it also frames (``transmit``), and reads the
    ack of a small batch for the thread that waits for it (``await_rows``). It owns the spin of those waits.

    ``own_acks``: a waiting caller may read its ack itself; ``ack_spin``: seconds such a caller reads without
    sleeping, at most (see ``TcpFabric``). The fabric's tables and checks are bound here once: a post reaches them
    without a hop through the fabric."""

    def __init__(self, fabric, book: RegionBook, own_acks: bool, ack_spin: float):
        self._fab = fabric
        self._id = fabric.local_id
        self.message_bytes = fabric.message_bytes
        # the region tables a post reads, bound once: no hop through the fabric per post
        self._book = book
        self._regions = book.regions
        self._host_views = book.host_views
        # unacked writes need the receiving side of ``TcpLanding.on_small_write``, which every tcp peer has
        self._unacked = fabric.capabilities.unacked_writes
        self._own_acks = own_acks
        # one for every caller of this fabric: the acks come from peers whose pace is the host's and the network's,
        # the same for each caller
        self.ack_spin = AdaptiveSpin(ack_spin)
        self._caller = threading.local()  # a caller's reading state (``caller_state``)

    def caller_state(self, s: Sock) -> dict:
        """The reading state of this thread (not a reader thread: a caller that reads its own ack), set up for
        socket ``s``: its look-ahead reader with this thread's buffer."""
        st = self._caller.__dict__.get("st")
        if st is None:
            st = self._caller.st = reader_state(SMALL_MESSAGE)
        rx = s.rx
        if rx is None:
            rx = s.rx = Rx(s.sock, 0)
        rx.attach(st["rxbuf"], st["rxview"])
        st["rx"] = rx
        return st

    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        if len(requests) == 1 and self._post_alone(ep, requests[0]):
            return
        requests = list(requests)
        batches = [r for r in requests if isinstance(r, WriteBatch)]
        if batches:
            requests = [r for r in requests if not isinstance(r, WriteBatch)]
        fab = self._fab
        mrs = fab.validate(ep, requests)
        devices = [fab.validate_batch(b) for b in batches]  # every check before anything is posted
        gathers = [self._check_gather(r, mr) for r, mr in zip(requests, mrs) if type(r) is GatherWrite]
        if gathers:
            msgs = []
            plain, plain_mrs = [], []
            for r, mr in zip(requests, mrs):  # posting order kept: plain runs between the gather writes
                if type(r) is GatherWrite:
                    if plain:
                        msgs.extend(write_messages(plain, plain_mrs, fab.message_target, len(ep.socks)))
                        plain, plain_mrs = [], []
                    msgs.append(self._build_gather(r, mr, gathers.pop(0)))
                else:
                    plain.append(r)
                    plain_mrs.append(mr)
            if plain:
                msgs.extend(write_messages(plain, plain_mrs, fab.message_target, len(ep.socks)))
        else:
            msgs = write_messages(requests, mrs, fab.message_target, len(ep.socks)) if requests else []
        for b, dev in zip(batches, devices):
            msgs.extend(batch_messages(b, dev, fab.message_target, len(ep.socks)))
        if msgs:
            self.send(ep, msgs)

    def _post_alone(self, ep: Endpoint, r: WriteRequest) -> bool:
        """Post a request posted alone that has a route of its own: a ``WriteRows`` (``post_rows``), an unacked
        write (``_post_unacked``), a ``WriteBatch`` of one write (``_post_one_write``). False: nothing posted, the
        general path takes it."""
        cls = type(r)
        if cls is WriteRows:
            self.post_rows(ep, r)
            return True
        if cls is WriteRequest:
            return not r.acked and not r.signaled and self._unacked and self._post_unacked(ep, r)
        return cls is WriteBatch and r.length.size == 1 and self._post_one_write(ep, r)

    def _post_one_write(self, ep: Endpoint, b: WriteBatch) -> bool:
        """Post a ``WriteBatch`` of one write (a large piece, the engine's direct unit of one piece): the checks of
        ``validate`` and ``validate_batch`` on its five values (a live endpoint of this fabric, lengths, addresses
        and ends inside 63 bits, a 32-bit rkey, the whole local range inside the region of its lkey), then its
        messages made here: the write cut into parts of about the fabric's share per socket (``message_target``),
        one part per message. False, with nothing sent, when a check fails: the general path checks the batch
        again and names what is wrong."""
        mr = self._regions.get(int(b.lkey[0]))
        if mr is None or not isinstance(ep, SocketEndpoint) or ep.fabric is not self._fab or not ep.alive:
            return False
        la, ln, ra, rk = int(b.local_addr[0]), int(b.length[0]), int(b.remote_addr[0]), int(b.rkey[0])
        if not (ln >= 1 and mr.addr <= la and la + ln <= min(mr.addr + mr.length, I64) and 0 <= ra <= I64 - ln
                and 0 <= rk <= 0xFFFFFFFF):
            return False  # (a local range inside a region cannot be negative nor wrap: the region's bounds hold it)
        target = max(64 << 10, min(self.message_bytes, -(-ln // len(ep.socks))))  # ``message_target``
        off = np.arange(0, ln, target, dtype=np.int64)
        part = np.minimum(ln - off, target)
        table = np.zeros(off.size, dtype=PIECE_DT)
        table["addr"], table["len"], table["waddr"], table["wlen"], table["rkey"] = ra + off, part, ra, ln, rk
        src = np.empty((off.size, 3), dtype=np.int64)
        src[:, 0], src[:, 1], src[:, 2] = la + off, part, mr.device
        rec = BatchRecord(b)
        msgs = []
        for i in range(off.size):
            m = OutMsg(0)
            m.table, m.src_arr, m.batch = table[i:i + 1], src[i:i + 1], rec
            msgs.append(m)
        m.final = True
        if len(msgs) > 1:
            ep.enqueue(msgs)  # what ``send`` does with more than one message, without the call
        else:
            self.send(ep, msgs)
        return True

    def _post_unacked(self, ep: Endpoint, r: WriteRequest) -> bool:
        """Post one unacked write (``WriteRequest.acked`` False) as a message with ``H_NOACK``: its bytes copied
        into the message now, a sequence number but no pending record, sent by this thread when the socket is idle
        (else queued as a control message). With the ACK of a landed write held by this thread (``finish_message``)
        and ``ep`` that write's endpoint, both leave in one send on its socket. False: not posted (larger than
        ``UNACKED_MAX`` or not host memory); post it as an acknowledged write."""
        if not isinstance(r.length, int) or r.length > UNACKED_MAX:
            return False
        mr, = self._fab.validate(ep, [r])
        if mr.device != DEVICE_HOST:
            return False
        body = ROW.pack(r.remote_addr, r.length, r.remote_addr, r.length, r.rkey,
                         0 if r.imm is None else F_IMM, r.imm or 0, 0) + raw_view(r.local_addr, r.length).tobytes()
        held = self._fab.take_held_ack()
        if held is not None and held[0] is not ep:  # another endpoint's ACK: it goes out on its own, first
            self._fab.send_ctrl(*held)
            held = None
        s, seq = ep.reserve(held[1] if held is not None else None)
        wire = HDR.pack(MAGIC, T_WRITE, H_NOACK, 0, 1, seq, len(body)) + body
        if held is not None:
            wire = held[2] + wire
        try:
            if send_now(s, [wire]):
                return True
        except OSError as e:  # as in the sender thread: the link is unusable, pending work fails over
            log.debug("inline send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")
            return True
        ep.send_ctrl(s, wire)
        return True

    def _check_gather(self, r: GatherWrite, mr: MemoryRegion) -> tuple:
        """The local checks of a ``GatherWrite`` beyond ``validate``'s (which checked its own range): the gather
        arrays well formed, the replaced ranges ascending, without overlap and inside the write, every source inside
        a host region registered here. Returns (sources, replaced addresses, lengths) as lists and the source
        region's view when one region holds every source (else None)."""
        if mr.device != DEVICE_HOST or len(r.gather) != 3:
            raise ValueError(f"wr_id={r.wr_id}: a gather write goes from host memory and needs (sources, local "
                             f"addresses, lengths)")
        try:
            src, loc, ln = (np.asarray(v, dtype=np.int64) for v in r.gather)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"wr_id={r.wr_id}: gather arrays: {e}") from e
        n = ln.size
        if not (n >= 1 and src.shape == loc.shape == ln.shape == (n,)):
            raise ValueError(f"wr_id={r.wr_id}: gather arrays of sizes {src.size}, {loc.size}, {n}: need one size >= 1")
        ends = loc + ln
        if int(ln.min()) < 1 or int(loc[0]) < r.local_addr or int(ends[-1]) > r.local_addr + r.length or \
                int(src.min()) < 0 or int(src.max()) > I64 - int(ln.max()) or \
                (n > 1 and bool((loc[1:] < ends[:-1]).any())):
            raise ValueError(f"wr_id={r.wr_id}: gather ranges must have lengths >= 1 and lie in ascending order, "
                             f"without overlap, inside the write's local range 0x{r.local_addr:x}+{r.length}")
        lo, hi = int(src.min()), int((src + ln).max())
        with self._book.lock:
            hosts = [self._host_views[k] for k, m in self._regions.items() if m.device == DEVICE_HOST]
        for m, view in hosts:
            if m.addr <= lo and hi <= m.addr + m.length:
                return src, loc, ln, (m.addr, view)
        src_l, ln_l = src.tolist(), ln.tolist()
        for i, (a, k) in enumerate(zip(src_l, ln_l)):
            if not any(m.contains(a, k) for m, _ in hosts):
                raise RegionError(f"wr_id={r.wr_id}: gather source {i} 0x{a:x}+{k} lies outside every host region "
                                  f"registered with {self._id}")
        return src, loc, ln, None

    def _build_gather(self, r: GatherWrite, mr: MemoryRegion, checked: tuple) -> OutMsg:
        """One message for a checked ``GatherWrite``: one whole-write row, the payload as buffers in order (the
        write's own bytes between the gathered ranges, each gathered range from its source)."""
        src, loc, ln, region = checked
        flags = F_IMM if r.imm is not None else 0
        m = OutMsg(0)
        m.table = np.array([(r.remote_addr, r.length, r.remote_addr, r.length, r.rkey, flags, r.imm or 0, 0)],
                           dtype=PIECE_DT)
        m.recs = [WrRecord(r)]
        m.last = [True]
        m.whole = True
        own = self._host_views[mr.rkey][1]
        bufs = []
        pos, end = r.local_addr, r.local_addr + r.length
        if region is not None:
            sbase, sview = region
            # runs of pieces whose sources follow each other in memory and whose ranges follow each other in the
            # write go as one buffer: found by numpy, so that the loop below takes a step per run, not per piece
            ends = loc + ln
            start = np.empty(ln.size, dtype=bool)
            start[0] = True
            np.not_equal(loc[1:], ends[:-1], out=start[1:])
            start[1:] |= src[1:] != src[:-1] + ln[:-1]
            first = np.flatnonzero(start)
            last = np.append(first[1:], ln.size) - 1
            for a, l, e in zip(src[first].tolist(), loc[first].tolist(), ends[last].tolist()):
                if l > pos:
                    bufs.append(own[pos - mr.addr:l - mr.addr])
                a -= sbase
                bufs.append(sview[a:a + e - l])
                pos = e
        else:
            for a, l, k in zip(src.tolist(), loc.tolist(), ln.tolist()):
                if l > pos:
                    bufs.append(own[pos - mr.addr:l - mr.addr])
                bufs.append(raw_view(a, k))
                pos = l + k
        if pos < end:
            bufs.append(own[pos - mr.addr:end - mr.addr])
        m.bufs = bufs
        return m

    def post_rows(self, ep: Endpoint, b: WriteRows) -> None:
        """Post a ``WriteRows``: the checks of ``validate_batch`` in Python (``_rows_sources``), then one message (up
        to ``MAX_TABLE`` writes and ``message_bytes``; more go through the numpy path). A message of host sources
        small enough for an inline send is registered, framed and sent here in one step (what ``send``,
        ``enqueue``, ``_wire_buffers`` and ``send_now`` do for it), since its Python steps are its latency."""
        fab = self._fab
        if not isinstance(ep, SocketEndpoint) or ep.fabric is not fab:
            fab.check_open()
            raise UnknownPeer(f"post_writes: {ep!r} is not an endpoint of {fab.name} fabric {self._id}")
        ln, ra, rk = b.length, b.remote_addr, b.rkey
        n = len(ln)
        nbytes = b.nbytes
        if n > MAX_TABLE or nbytes > self.message_bytes:
            arrays = [np.asarray(v, dtype=np.int64) for v in (b.local_addr, ln, ra)]
            self.post_writes(ep, [WriteBatch(*arrays, np.full(n, rk, dtype=np.int64),
                                             np.full(n, b.lkey, dtype=np.int64), wr_id=b.wr_id)])
            return
        mr, bufs = self._rows_sources(ep, b)
        pack = ROW.pack
        m = OutMsg(0)
        rows = m.rows = b"".join([pack(r, k, r, k, rk, 0, 0, 0) for r, k in zip(ra, ln)])
        m.pieces = n
        m.batch = BatchRecord(b)
        m.final = True
        m.on_acked = b.on_acked
        if mr.device != DEVICE_HOST:  # GPU sources: staged through pinned memory by the sender (``_source_buffers``)
            m.table = np.frombuffer(m.rows, dtype=PIECE_DT)
            m.rows = None
            m.src = [(a, k, mr.device) for a, k in zip(b.local_addr, ln)]
            self.send(ep, [m])
            return
        m.bufs = bufs
        if n > INLINE_PIECES or nbytes > INLINE_BYTES:
            ep.enqueue([m])
            return
        s = ep.enqueue_one(m, b.read_ack)
        head = _HEAD + rows  # a bytearray of its own: tagged in place (``send_now``)
        HDR.pack_into(head, 0, MAGIC, T_WRITE, 0, 0, n, m.seq, len(rows) + nbytes)
        wire = [head, *bufs]
        poller = s.poller
        if b.read_ack and poller is not None and self._own_acks and s.reader.acquire(False):
            # the ack will be read by this thread (``await_rows``): taken before the send, so that the reader
            # threads, kept off the socket meanwhile, never see it
            if poller.disarm(s):
                b.reader = (ep, s, m)
            else:  # the socket left the readers' set: its endpoint failed
                s.reader.release()
        try:
            self._send_inline(ep, s, m, wire, m.seq)
        except BaseException:
            self.await_rows(b, 0.0)
            raise

    def _rows_sources(self, ep: SocketEndpoint, b: WriteRows) -> tuple:
        """The local side of a ``WriteRows`` of one message, checked: a live endpoint of an open fabric, 32-bit
        keys, every source inside the region of ``lkey`` (by the writes' extremes). Returns that region and, for a
        host region, the sources as slices of one view of it (the one kept since registration, else one of the
        span: a view per piece costs a ctypes call each), pieces that follow each other in memory as one buffer
        (None for a GPU region)."""
        if not ep.alive:  # a closed fabric failed every endpoint: its error first
            self._fab.check_open()
            ep.check_alive()
        rk, lk = b.rkey, b.lkey
        if rk.__class__ is not int or lk.__class__ is not int or not (0 <= rk <= 0xFFFFFFFF and 0 <= lk <= 0xFFFFFFFF):
            for name, v in (("rkey", rk), ("lkey", lk)):
                if v.__class__ is not int or not 0 <= v <= 0xFFFFFFFF:
                    raise ValueError(f"batch wr_id={b.wr_id}: {name} {v!r} is not a 32-bit unsigned int")
        mr = self._regions.get(lk)
        if mr is None:
            raise RegionError(f"batch wr_id={b.wr_id}: lkey 0x{lk:x} is not a region registered with {self._id}")
        la, ln = b.local_addr, b.length
        first, end = b.local_span  # the writes' own checks: WriteRows
        base = mr.addr
        if first < base or end > base + mr.length:
            i = next(i for i, (a, k) in enumerate(zip(la, ln)) if a < mr.addr or a + k > mr.addr + mr.length)
            raise RegionError(f"batch wr_id={b.wr_id}, write {i}: local range 0x{la[i]:x}+{ln[i]} lies outside the "
                              f"region of lkey 0x{lk:x} (0x{mr.addr:x}+{mr.length})")
        if mr.device != DEVICE_HOST:
            return mr, None
        ent = self._host_views.get(lk)
        if ent is not None and ent[0] is mr:
            span = ent[1]
        else:
            span, base = raw_view(first, end - first), first
        bufs = []
        start = end = -1
        for a, k in zip(la, ln):
            if a != end:
                if end > start:
                    bufs.append(span[start - base:end - base])
                start = a
            end = a + k
        bufs.append(span[start - base:end - base])
        return mr, bufs

    def await_rows(self, b: WriteRows, deadline: float) -> None:
        """For the thread that posted ``b`` with ``read_ack`` and got its socket (``b.reader`` set): read that
        socket -- every message on it, whoever it is for -- until ``b``'s ack is handled, the endpoint failed or
        ``time.monotonic()`` passes ``deadline``, then hand the socket back to the reader threads. The ack
        completes ``b`` as a reader thread would have (``on_acked`` or a completion). A read that fails (EOF,
        reset, a malformed stream) fails the endpoint, as in the reader threads. No-op when ``b.reader`` is None."""
        held = b.reader
        if held is None:
            return
        b.reader = None
        ep, s, m = held
        st = {}
        try:
            st = self.caller_state(s)
            read_one = self._fab.read_one
            rx = st["rx"]
            wait = st.get("wait")
            if wait is None or st.get("wait_fd") != s.fd:
                wait = st["wait"] = select.poll()  # this thread's wait for readability, with a timeout
                wait.register(s.fd, select.POLLIN)
                st["wait_fd"] = s.fd
            spin = self.ack_spin
            spin_until = spin.until(time.monotonic())
            spun = spin_until > 0.0  # reported to ``spin`` once: a hit when the ack is in before the spin ends
            while not m.done and ep.alive:
                if rx.pos == rx.end:
                    now = time.monotonic()
                    if now < spin_until:
                        if not rx.ready():
                            continue
                    else:
                        if spun:
                            spun = False
                            spin.done(False)
                        left = deadline - now
                        if left <= 0:
                            break
                        if not wait.poll(left * 1000.0 + 1.0) or not rx.ready():
                            continue
                read_one(ep, s, rx, st)
            if spun:
                spin.done(m.done)
            if m.done:
                s.own_reads += 1
            # what the last receive took beyond the ack (another message, whole or in part) is read here: the
            # reader threads are woken by bytes still in the socket, never by bytes already in the buffer
            while ep.alive and rx.pos < rx.end:
                read_one(ep, s, rx, st)
        except Exception as e:  # noqa: BLE001 — as in the reader threads: the link is unusable
            if ep.alive and not self._fab.closed:
                log.debug("receive on %s/%d by a waiting caller ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")
        finally:
            st["rx"] = None
            s.reader.release()
            # armed after the token is free: a reader woken meanwhile that found it taken left the socket to us
            poller = s.poller
            if poller is not None:
                poller.rearm(ep, s)

    def send(self, ep: SocketEndpoint, msgs: List[OutMsg]) -> None:
        """Hand checked messages over: to the sockets' sender threads, except a post of one small message, which
        this thread sends itself when its socket is idle (``send_now``)."""
        m = msgs[0] if len(msgs) == 1 else None
        # GPU sources are staged through the socket's buffers, which its sender thread owns
        if m is None or len(m) > INLINE_PIECES or m.nbytes > INLINE_BYTES or (
                m.bufs is None and any(d != DEVICE_HOST for _, _, d in m.sources())):
            ep.enqueue(msgs)
            return
        s, = ep.enqueue(msgs, queue=False)
        self._send_inline(ep, s, m, self._wire_buffers(s, m))

    def _send_inline(self, ep: SocketEndpoint, s: Sock, m: OutMsg, buffers, write_seq: int = -1) -> None:
        """Send message ``m`` (already numbered on socket ``s``) from the posting thread when the socket is free,
        else hand it to the socket's sender thread, behind what it holds. ``write_seq``: as ``send_now``'s."""
        try:
            if send_now(s, buffers, write_seq):
                return
        except OSError as e:  # as in the sender thread: the link is unusable, pending work fails over
            log.debug("inline send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"send failed: {e}")
            return
        ep.small_busy(s)
        with s.cv:
            s.data.append(m)
            s.wake()

    def _wire_buffers(self, s: Sock, msg: OutMsg) -> List:
        """A WRITE message as buffers to send in order: header and table (one bytearray, which ``transmit`` seals
        in place), then each piece's source bytes."""
        if msg.rows is not None:
            rows = msg.rows
            head = bytearray(48 + len(rows))
            HDR.pack_into(head, 0, MAGIC, T_WRITE, 0, 0, msg.pieces, msg.seq, len(rows) + msg.batch.length)
            head[48:] = rows
            return [head] + msg.bufs
        table = msg.table
        if not table.flags.c_contiguous:
            table = np.ascontiguousarray(table)
        head = bytearray(48 + table.nbytes)
        head[48:] = memoryview(table).cast("B")
        if msg.whole:
            HDR.pack_into(head, 0, MAGIC, T_WRITE, H_WHOLE, 0, 1, msg.seq, table.nbytes + int(table["len"][0]))
            return [head] + msg.bufs
        HDR.pack_into(head, 0, MAGIC, T_WRITE, 0, 0, len(table), msg.seq, table.nbytes + int(table["len"].sum()))
        return [head] + self._source_buffers(s, msg)

    def _source_buffers(self, s: Sock, msg: OutMsg) -> List:
        srcs = msg.sources()
        gpu = [(i, a, n, d) for i, (a, n, d) in enumerate(srcs) if d != DEVICE_HOST]
        if not gpu:
            return [raw_view(a, n) for a, n, _ in srcs]
        # GPU sources: the socket cannot read device memory, so pack them into pinned host memory first
        # (big pieces: one D2H each; small ones: one gather launch on the device, then one D2H).
        import torch
        total = sum(n for _, _, n, _ in gpu)
        host = pinned_buffer(s.tx_cache, total)
        hbase = host.data_ptr()
        where, off = {}, 0
        by_dev: Dict[int, list] = {}
        for i, a, n, d in gpu:
            where[i] = off
            by_dev.setdefault(d, []).append((off, a, n))
            off += n
        for dev, items in by_dev.items():
            stream = cuda_stream(s.tx_cache, dev)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                small = [it for it in items if it[2] < BIG_GPU_PIECE]
                for o, a, n in items:
                    if n >= BIG_GPU_PIECE:
                        memcpy_async(hbase + o, a, n, stream)
                if small:
                    lo, hi = small[0][0], small[-1][0] + small[-1][2]
                    scratch = device_scratch(s.tx_cache, dev, hi - lo)
                    sp = scratch.data_ptr() - lo
                    gpu_batch_copy([a for _, a, _ in small], [sp + o for o, _, _ in small],
                                   [n for _, _, n in small], dev)
                    host[lo:hi].copy_(scratch[:hi - lo], non_blocking=True)
            stream.synchronize()
        return [raw_view(hbase + where[i], n) if d != DEVICE_HOST else raw_view(a, n)
                for i, (a, n, d) in enumerate(srcs)]

    def transmit(self, ep: SocketEndpoint, s: Sock, msg: OutMsg) -> None:
        """Send queued message ``msg`` on socket ``s`` (its sender thread), its first frame tagged now."""
        bufs = self._wire_buffers(s, msg)
        if s.sess is not None:
            bufs[0] = seal(s.sess, bufs[0], own=True)
        send_buffers(s.sock, bufs)
