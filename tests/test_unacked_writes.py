"""Unacked writes on tcp (``WriteRequest.acked`` False, capability ``unacked_writes``): a small write the target
does not acknowledge, which a receiver uses for its ack of a chunk. Its bytes arrive exactly and its immediate in
order; it completes on neither side; a refused one writes nothing and leaves the link up. A landed write's ACK
and the unacked write its RECV_IMM handler posts back leave in one send.
"""
import logging
import threading

import numpy as np
import pytest

from transport.errors import RegionError
from transport.fabric import make_fabric
from transport.fabric import wire
from transport.fabric.base import GatherWrite, Opcode, WriteRequest
from fabric_helpers import poll_completions

POISON = 0xA5


@pytest.fixture
def pair():
    a, b = make_fabric("tcp"), make_fabric("tcp")
    try:
        yield a, b, a.connect(b.descriptor())
    finally:
        a.close()
        b.close()


def _unacked(local, n, remote, rkey, lkey, imm=None, wr_id=0):
    return WriteRequest(local, n, remote, rkey, lkey, imm=imm, wr_id=wr_id, signaled=False, acked=False)


def test_unacked_writes_are_byte_exact_in_order_and_complete_nowhere(pair):
    a, b, ep = pair
    assert a.capabilities.unacked_writes
    sizes = [1, 7, 63, 256, 4095, 4096]
    src = np.zeros(sum(sizes) + 16, dtype=np.uint8)
    dst = np.full(sum(sizes) + 64, POISON, dtype=np.uint8)
    mr_src, mr_dst = a.register(src.ctypes.data, src.nbytes), b.register(dst.ctypes.data, dst.nbytes)
    exp = dst.copy()
    reqs, pos = [], 0
    for i, k in enumerate(sizes):
        src[pos:pos + k] = i * 37 + 11  # a distinct value per write
        exp[pos + 5:pos + 5 + k] = i * 37 + 11
        reqs.append(_unacked(src.ctypes.data + pos, k, dst.ctypes.data + pos + 5, mr_dst.rkey, mr_src.lkey,
                             imm=100 + i, wr_id=i))
        pos += k
    for r in reqs:
        a.post_writes(ep, [r])
    src[:] = 0  # the bytes were taken at the post
    got = poll_completions(b, len(sizes))
    assert [(c.opcode, c.imm, c.byte_len) for c in got] == [(Opcode.RECV_IMM, 100 + i, k) for i, k in enumerate(sizes)]
    assert np.array_equal(dst, exp)
    # an acknowledged write after them completes alone; nothing of the unacked ones is pending or reported
    src[:4] = 9
    a.post_writes(ep, [WriteRequest(src.ctypes.data, 4, dst.ctypes.data, mr_dst.rkey, mr_src.lkey, wr_id=77)])
    assert [(c.wr_id, c.error) for c in poll_completions(a, 1)] == [(77, None)]
    assert a.poll(8, timeout=0.2) == []
    assert not ep._pending


def test_refused_unacked_write_writes_nothing_and_keeps_the_link(pair, caplog):
    a, b, ep = pair
    src = np.arange(256, dtype=np.uint8)
    dst = np.full(1024, POISON, dtype=np.uint8)
    mr_src, mr_dst = a.register(src.ctypes.data, src.nbytes), b.register(dst.ctypes.data, dst.nbytes)
    d = dst.ctypes.data
    with caplog.at_level(logging.WARNING, logger="transport.fabric.tcp_landing"):
        for remote, rkey in [(d + 1000, mr_dst.rkey),  # runs past the region
                             (d - 8, mr_dst.rkey),  # starts before it
                             (d, mr_dst.rkey ^ 0x5A5A)]:  # a key the target never gave out
            a.post_writes(ep, [_unacked(src.ctypes.data, 64, remote, rkey, mr_src.lkey, imm=5)])
        a.post_writes(ep, [WriteRequest(src.ctypes.data, 16, d, mr_dst.rkey, mr_src.lkey, imm=6, wr_id=1)])
        assert [(c.wr_id, c.error) for c in poll_completions(a, 1)] == [(1, None)]
        assert [(c.opcode, c.imm) for c in poll_completions(b, 1)] == [(Opcode.RECV_IMM, 6)]
    exp = np.full(1024, POISON, dtype=np.uint8)
    exp[:16] = src[:16]
    assert np.array_equal(dst, exp)
    assert b.poll(8, timeout=0.2) == [] and a.poll(8, timeout=0.1) == []
    refused = [r for r in caplog.records if "refused an unacked write" in r.getMessage()]
    assert len(refused) == 3  # one line each, naming the bad value (they travel on different sockets: any order)
    assert sum(f"rkey 0x{mr_dst.rkey ^ 0x5A5A:x}: rkey unknown" in r.getMessage() for r in refused) == 1
    assert sum(f"at 0x{d - 8:x}" in r.getMessage() for r in refused) == 1
    assert ep.alive


def test_unacked_write_with_a_bad_local_range_raises_and_sends_nothing(pair):
    a, b, ep = pair
    src = np.ones(256, dtype=np.uint8)
    stray = np.ones(64, dtype=np.uint8)
    dst = np.full(512, POISON, dtype=np.uint8)
    mr_src, mr_dst = a.register(src.ctypes.data, src.nbytes), b.register(dst.ctypes.data, dst.nbytes)
    for local, n, exc in [(src.ctypes.data + 200, 100, RegionError), (stray.ctypes.data, 8, RegionError),
                          (src.ctypes.data, 0, ValueError)]:
        with pytest.raises(exc):
            a.post_writes(ep, [_unacked(local, n, dst.ctypes.data, mr_dst.rkey, mr_src.lkey, imm=1)])
    assert b.poll(8, timeout=0.3) == []
    assert (dst == POISON).all()


def test_unacked_write_above_the_limit_goes_acknowledged(pair):
    a, b, ep = pair
    n = wire.UNACKED_MAX + 1
    src = (np.arange(n) % 251).astype(np.uint8)
    dst = np.full(n + 8, POISON, dtype=np.uint8)
    mr_src, mr_dst = a.register(src.ctypes.data, src.nbytes), b.register(dst.ctypes.data, dst.nbytes)
    a.post_writes(ep, [_unacked(src.ctypes.data, n, dst.ctypes.data + 8, mr_dst.rkey, mr_src.lkey, imm=3)])
    assert [(c.opcode, c.imm) for c in poll_completions(b, 1)] == [(Opcode.RECV_IMM, 3)]
    assert np.array_equal(dst[8:], src) and (dst[:8] == POISON).all()
    for _ in range(100):  # its ack arrives and releases it
        if not ep._pending:
            break
        threading.Event().wait(0.02)
    assert not ep._pending


def test_landed_write_ack_leaves_with_the_reply_its_handler_posts(pair, monkeypatch):
    """A landed write (landing handler) whose RECV_IMM handler, in the receiving thread, posts an unacked write
    back: the write's ACK goes out in that write's send, not on its own; the writer sees its completion, the
    reply's immediate and bytes."""
    a, b, ep = pair
    total = 100_000
    data = (np.arange(total) % 253).astype(np.uint8)
    landing = np.full(total, POISON, dtype=np.uint8)
    out = np.full(total, POISON, dtype=np.uint8)
    credit = np.full(64, POISON, dtype=np.uint8)
    reply = np.arange(64, dtype=np.uint8) + 1
    mr_data, mr_credit = a.register(data.ctypes.data, data.nbytes), a.register(credit.ctypes.data, credit.nbytes)
    mr_land = b.register(landing.ctypes.data, landing.nbytes)
    b.register(out.ctypes.data, out.nbytes)
    mr_reply = b.register(reply.ctypes.data, reply.nbytes)

    class Plan:
        dsts, lens, offs = [out.ctypes.data + 1], [total - 200], [100]

        def done(self):
            pass

    b.set_landing_handler(mr_land, lambda peer_id, addr, length, imm, read: (read(100), Plan())[1])
    back = b.endpoint(a.local_id)
    alone = []
    real = type(b).send_ctrl

    def send_ctrl(self, ep_, s, payload):
        if self is b and payload[4] == wire.T_ACK:
            alone.append(payload)
        return real(self, ep_, s, payload)

    monkeypatch.setattr(type(b), "send_ctrl", send_ctrl)

    def on_b(comps):
        for c in comps:
            if c.opcode == Opcode.RECV_IMM and c.imm == 42:
                b.post_writes(back, [_unacked(reply.ctypes.data, 24, credit.ctypes.data + 8, mr_credit.rkey,
                                              mr_reply.lkey, imm=7)])

    b.set_completion_handler(on_b)
    d0 = data.ctypes.data
    a.post_writes(ep, [GatherWrite(d0, total, landing.ctypes.data, mr_land.rkey, mr_data.lkey, imm=42, wr_id=3,
                                   gather=([d0 + 10], [d0 + 10], [5]))])
    got = poll_completions(a, 2)
    assert sorted((c.opcode.name, c.wr_id, c.imm) for c in got) == [("RECV_IMM", 0, 7), ("WRITE_WITH_IMM", 3, 42)]
    assert np.array_equal(out[1:total - 199], data[100:total - 100])
    assert (out[0] == POISON) and (out[total - 199:] == POISON).all()
    exp = np.full(64, POISON, dtype=np.uint8)
    exp[8:32] = reply[:24]
    assert np.array_equal(credit, exp)
    assert alone == []  # the ACK went with the reply
    assert not ep._pending and not back._pending
