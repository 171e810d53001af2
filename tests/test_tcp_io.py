"""The tcp fabric's I/O threads (``transport.fabric.tcp_io``): a fixed number per fabric whatever the number of
peers, and a reader's turn that never leaves read-ahead bytes behind."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from transport import auth
from transport.fabric.base import WriteRequest
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.tcp import TcpFabric
from transport.fabric.tcp_io import TcpIo, reader_state
from transport.fabric.wire import ROW, HDR, MAGIC, T_ACK, T_WRITE
from wait_helpers import wait_equal


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, sum(map(ord, request.node.name))])


def test_threads_do_not_grow_with_peers(rng):
    """Six sender fabrics connect to one target and write to it byte-exact: connecting a peer starts no thread on
    either side (each fabric has its fixed set from its construction)."""
    tgt = TcpFabric()
    senders = []
    try:
        dst = np.full(6 * 4096 + 64, 0xA5, dtype=np.uint8)
        mr_dst = tgt.register(dst.ctypes.data, dst.nbytes)
        src = np.frombuffer(rng.bytes(6 * 4096), dtype=np.uint8).copy()
        for i in range(6):
            f = TcpFabric()
            senders.append((f, f.register(src.ctypes.data, src.nbytes)))
        base = threading.active_count()
        for i, (f, mr) in enumerate(senders):
            ep = f.connect(tgt.descriptor())
            n = 1000 + 7 * i  # odd sizes, a distinct range per peer
            f.post_writes(ep, [WriteRequest(src.ctypes.data + 4096 * i, n, dst.ctypes.data + 4096 * i + 3,
                                            mr_dst.rkey, mr.lkey, wr_id=i)])
            comps = []
            end = time.monotonic() + 10
            while not comps and time.monotonic() < end:
                comps = f.poll(4, 0.1)
            assert [c.wr_id for c in comps] == [i] and comps[0].ok, comps
            # short-lived threads (a connection's authentication) go away on their own
            wait_equal(threading.active_count, base, f"the thread count after peer {i}", timeout=5)
        exp = np.full_like(dst, 0xA5)
        for i in range(6):
            n = 1000 + 7 * i
            exp[4096 * i + 3:4096 * i + 3 + n] = src[4096 * i:4096 * i + n]
        assert np.array_equal(dst, exp)
    finally:
        for f, _ in senders:
            f.close()
        tgt.close()


def _write_frame(seq: int, addr: int, payload: bytes, rkey: int) -> bytes:
    n = len(payload)
    return HDR.pack(MAGIC, T_WRITE, 0, 0, 1, seq, ROW.size + n) + ROW.pack(addr, n, addr, n, rkey, 0, 0, 0) + payload


def test_a_turn_that_ends_after_a_small_write_leaves_nothing_read_ahead(rng, monkeypatch):
    """A reader's turn of one message (``READ_TURN`` 1) ends right after a small write, with no spin for the next:
    a spin that caught the next message there would leave it read ahead in the socket's buffer, where no reader
    looks (the socket is only armed for bytes in the kernel), and its sender would wait for its ack for ever."""
    monkeypatch.setattr(TcpIo, "READ_TURN", 1)
    fab = TcpFabric(secret=auth.Resolved(None), recv_spin=0.5)  # frames fed straight to a reader: no handshake
    a, b = socket.socketpair()
    try:
        mem = np.full(4096, 0xA5, dtype=np.uint8)
        mr = fab.register(mem.ctypes.data, mem.nbytes)
        ep = SocketEndpoint(fab, "peer", [b])
        s = ep.socks[0]
        fab._io.add(ep)
        one, two = rng.bytes(100), rng.bytes(77)
        a.sendall(_write_frame(0, mem.ctypes.data + 5, one, mr.rkey))
        # the scenario: the second message comes after the readers took the first and their turn ended (no event
        # marks a turn's end; the first's ack comes back below)
        time.sleep(0.2)
        threading.Timer(0.05, a.sendall, (_write_frame(1, mem.ctypes.data + 300, two, mr.rkey),)).start()
        a.settimeout(5.0)
        acks = bytearray()
        while len(acks) < 2 * (HDR.size + 1):
            acks += a.recv(4096)
        seqs = [HDR.unpack_from(acks, k * (HDR.size + 1))[5] for k in range(2)]
        types = [HDR.unpack_from(acks, k * (HDR.size + 1))[1] for k in range(2)]
        assert seqs == [0, 1] and types == [T_ACK, T_ACK], (seqs, types)
        assert bytes(mem[5:105]) == one and bytes(mem[300:377]) == two
        assert (mem[:5] == 0xA5).all() and (mem[105:300] == 0xA5).all() and (mem[377:] == 0xA5).all()
        assert s.rx.pos == s.rx.end
    finally:
        fab.close()
        a.close()
        b.close()


def test_reader_state_sizes():
    """A reader's buffers: the look-ahead buffer holds a header and a small message; staging as asked."""
    st = reader_state(1 << 16)
    assert len(st["stage"]) == 1 << 16 and len(st["rxbuf"]) >= HDR.size + 1 and st["rx"] is None
