"""The sockets of the socket fabrics (tcp, ipc): exact and scattered receives, gathered sends, the look-ahead
reader (``Rx``), one socket of an endpoint with its sender queue (``Sock``), and the inline send of a small message
by the thread that has it (``send_now``).
"""
from __future__ import annotations

import collections
import select
import socket
import struct
import threading
from typing import Dict, List, Optional

from transport.fabric.spin import AdaptiveSpin
from transport.fabric.wire import keyed, seal, seal_frame

_EPOLLIN = getattr(select, "EPOLLIN", 1)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOF raises ``ConnectionError``."""
    while len(view):
        n = sock.recv_into(view, len(view), socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        view = view[n:]


def recv_views(rx, views: List[memoryview]) -> None:
    """Fill every view of ``views`` in order from ``rx`` (a socket, or an ``Rx`` whose look-ahead bytes go first):
    scattered receives (``recvmsg_into``, up to 1000 buffers a call) instead of one call per view."""
    i, n = 0, len(views)
    while i < n and isinstance(rx, Rx) and rx.end > rx.pos:  # bytes already read ahead
        recv_exact(rx, views[i])
        i += 1
    sock = rx.sock if isinstance(rx, Rx) else rx
    while i < n:
        batch = views[i:i + 1000]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise ConnectionError("connection closed by peer")
        if got == sum(map(len, batch)):  # the usual case: every view filled (one C loop, not a step per view)
            i += len(batch)
            continue
        for v in batch:  # a short receive (a signal, a huge batch): finish the view it stopped in, go on after it
            if got >= len(v):
                got -= len(v)
                i += 1
                continue
            recv_exact(sock, v[got:])
            i += 1
            break


def send_buffers(sock: socket.socket, bufs: List) -> None:
    """Send every buffer in order with gathered ``sendmsg`` calls (at most IOV_MAX buffers per call)."""
    i = 0
    while i < len(bufs):
        batch = bufs[i:i + 1000]
        sent = sock.sendmsg(batch)
        total = sum(len(b) for b in batch)
        if sent == total:
            i += len(batch)
            continue
        # Partial send (signal / tiny buffers): skip what went out and continue from inside the buffer.
        for j, b in enumerate(batch):
            if sent >= len(b):
                sent -= len(b)
                continue
            bufs = [memoryview(b)[sent:]] + batch[j + 1:] + bufs[i + len(batch):]
            i = 0
            break


class Rx:
    """A socket read through a look-ahead buffer: a header read takes whatever the kernel holds (a small message
    that arrived in one piece: one receive for its header and body instead of one per field); every other read
    goes straight into its destination once the buffered bytes are used up: a large payload read ahead in
    buffer-sized steps would be copied twice, through the buffer. Offers ``recv_into`` as a socket does, for
    ``recv_exact``."""

    __slots__ = ("sock", "buf", "view", "pos", "end")
    AHEAD = 32  # reads of at most this many bytes (a message header) fill the buffer; longer ones skip it

    def __init__(self, sock: socket.socket, size: int):
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.pos = self.end = 0

    def attach(self, buf: bytearray, view: memoryview) -> None:
        """Read through ``buf`` (``view`` its memoryview) from now on: the buffer of the thread that reads the socket
        this turn (tcp's readers, ``transport.fabric.tcp_io``), so that a socket owns none. Only while nothing is
        read ahead, as at the end of every turn; else the buffer in use stays."""
        if self.pos == self.end:
            self.buf, self.view = buf, view
            self.pos = self.end = 0

    def recv_into(self, view, nbytes: int = 0, flags: int = 0) -> int:
        n = nbytes or len(view)
        have = self.end - self.pos
        if have:
            k = have if have < n else n
            view[:k] = self.view[self.pos:self.pos + k]
            self.pos += k
            return k
        if n > self.AHEAD:
            return self.sock.recv_into(view, n, flags)
        got = self.sock.recv_into(self.buf)
        k = got if got < n else n
        view[:k] = self.view[:k]
        self.pos, self.end = k, got
        return k

    def ready(self) -> bool:
        """True when a message's first bytes are here: in the buffer, or taken from the socket by one receive that
        does not wait. Raises ConnectionError at EOF."""
        if self.end > self.pos:
            return True
        try:
            got = self.sock.recv_into(self.buf, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        if got == 0:
            raise ConnectionError("connection closed by peer")
        self.pos, self.end = 0, got
        return True

    def unpack(self, st: struct.Struct) -> tuple:
        """The next ``st.size`` bytes (a message header) unpacked by ``st``, read from the look-ahead buffer, which
        one receive of whatever the kernel holds refills when it runs short: no copy out of the buffer."""
        pos, size = self.pos, st.size
        if self.end - pos < size:
            have = self.end - pos
            if have:
                self.buf[:have] = self.buf[pos:self.end]
            pos = 0
            while have < size:
                got = self.sock.recv_into(self.view[have:])
                if got == 0:
                    raise ConnectionError("connection closed by peer")
                have += got
            self.end = have
        self.pos = pos + size
        return st.unpack_from(self.buf, pos)

    def take(self, n: int, stage: memoryview) -> memoryview:
        """The next ``n`` bytes: a view into the buffer when they are all there (valid until the next read), else
        read into ``stage``."""
        if self.end - self.pos >= n:
            self.pos += n
            return self.view[self.pos - n:self.pos]
        recv_exact(self, stage[:n])
        return stage[:n]


class Sock:
    """One socket of an endpoint with its sender queue. Queued work is announced by ``wake()`` (under ``cv``): by
    default it wakes the socket's own sender thread (ipc); the tcp fabric's I/O threads (``tcp_io.TcpIo``) put the
    socket in their send queue instead."""

    def __init__(self, sock: socket.socket, index: int):
        self.sock = sock
        self.index = index
        self.cv = threading.Condition()
        self.ctrl: collections.deque = collections.deque()  # small control messages, sent first
        self.data: collections.deque = collections.deque()  # OutMsg
        self.closed = False
        self.threads: List[threading.Thread] = []
        self.wake = self.cv.notify  # called under ``cv`` once a message was queued
        # tcp's I/O threads (``tcp_io.TcpIo``): served by them; in their send queue; out of their epoll set for good
        self.pooled = self.queued = self.dropped = False
        self.rx: Optional[Rx] = None  # tcp: the look-ahead reader, with the reading thread's buffer for its turn
        # ipc uses these to hand a GRANT from the receiver thread to the waiting sender thread
        self.grant_cv = threading.Condition()
        self.grants: Dict[int, tuple] = {}
        self.send_lock = threading.Lock()  # ipc sends small messages from several threads
        # tcp: held while one message's bytes go out, by the sender thread or by a thread that sends a small message
        # itself while no other is sending (``send_now``), so that two messages never interleave
        self.wire_lock = threading.Lock()
        self.granted: Dict[int, tuple] = {}  # ipc target: seq -> (table, statuses, pinned) until DONE
        self.tx_cache: dict = {}  # sender thread's pinned / device staging buffers and CUDA streams
        # tcp, shared reading: whoever holds ``reader`` reads the socket (a reader thread for a turn, or a caller
        # reading its own ack, ``TcpPoster.await_rows``); ``poller`` is the ``TcpIo`` whose epoll set holds the
        # socket (None once it left it)
        self.reader = threading.Lock()
        self.poller = None
        self.fd = sock.fileno()
        self.sess = keyed(sock)  # the connection's tags (None without a secret)
        self.own_reads = 0  # acks of small batches their waiting callers read themselves (counted under ``reader``)
        self.spin: Optional[AdaptiveSpin] = None  # the readers' spin after a small write here (``recv_spin``)

    def busy(self) -> bool:
        """A thread may still use the socket: its own thread runs, or tcp's I/O threads still hold it (in their
        epoll set, or queued to send); its file descriptor must stay open meanwhile."""
        if self.pooled:
            return not self.dropped or self.queued
        return any(t.is_alive() for t in self.threads)


def send_ctrl_frames(s: Sock, ctrl: List) -> None:
    """Send the control frames taken from ``s.ctrl`` (the caller holds ``s.wire_lock``): new frames get their tags
    now; a memoryview continues a frame that ``send_now`` began."""
    sess = s.sess
    if sess is not None:
        ctrl = [c if type(c) is memoryview else seal(sess, c) for c in ctrl]
    send_buffers(s.sock, ctrl)


def send_now(s: Sock, bufs: List, write_seq: int = -1) -> bool:
    """Send ``bufs`` (one message) from this thread when no other thread is sending on the socket and the
    kernel takes at least its first byte without waiting; what it does not take goes to the head of the
    socket's queue, for the sender thread to send before anything else. False: nothing was sent (the socket
    is busy or full; queue the message). Never blocks: receiving threads send their acks this way.
    ``write_seq`` >= 0: ``bufs[0]`` is a bytearray holding one acknowledged WRITE numbered so, built for this
    send, and is tagged in place (``wire.seal_frame``).

    Why: handing a small message to the sender thread costs a thread wake-up on each side of the wire, more
    than the message's own send; the sender thread stays for large messages and for a socket that is full."""
    if not s.wire_lock.acquire(blocking=False):
        return False
    try:
        # anything queued for control may be the rest of a message sent in part: it goes first
        if s.closed or s.ctrl:
            return False
        sess = s.sess
        if sess is not None:
            # the tag takes the socket's next sequence number: only once the bytes are sure to go out now
            tx_n = sess.tx_n
            if write_seq < 0:
                bufs = [seal(sess, bufs[0]), *bufs[1:]]
            else:
                seal_frame(sess, bufs[0], write_seq)
        try:
            sent = s.sock.sendmsg(bufs, (), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if sess is not None:
                sess.tx_n = tx_n  # nothing went out: the message is queued and sealed again when sent
            return False
        rest = []
        for i, b in enumerate(bufs):
            n = len(b)
            if sent < n:
                # memoryviews: the sender thread sends them as the rest of a sealed message, not new ones
                rest = [memoryview(b)[sent:]] + [memoryview(x) for x in bufs[i + 1:]]
                break
            sent -= n
        if rest:
            with s.cv:
                s.ctrl.extendleft(reversed(rest))
                s.wake()
        return True
    finally:
        s.wire_lock.release()
