"""Relay chunks on tcp without the host copies: the sender's gather on the wire (``GatherWrite``) and the
receiver's placement of a chunk's items as they arrive (``TcpFabric.set_landing_handler``, ``Receiver._plan_landed``).

Fabric tests run two tcp fabrics in this process; engine tests a receiving engine in a spawned process, whose whole
buffer (guards included) is compared with the expected image. Every piece carries its own byte values, sizes
include 1 B, 63 B and unaligned addresses, and destinations start poisoned.
"""
import threading

import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets
from fabric_helpers import poll_completions
from transport import RemoteRejected, TransferEngine
from transport.errors import RegionError
from transport.fabric import make_fabric
from transport.fabric.base import GatherWrite, Opcode, WriteRequest
from wait_helpers import wait_for

POISON = 0xA5
MB = 1 << 20


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


@pytest.fixture
def pair():
    """Two tcp fabrics, the writer with small messages (4 KiB), so a gather write above the target's usual
    message bound (64 KiB) must travel as one whole write."""
    a, b = make_fabric("tcp", message_bytes=4096), make_fabric("tcp")
    try:
        yield a, b, a.connect(b.descriptor())
    finally:
        a.close()
        b.close()


def _gather_layout(rng, total: int, sizes):
    """Ascending, non-overlapping ranges (offset, length) of ``sizes`` inside ``total`` bytes, random gaps."""
    sizes = list(sizes)
    slack = total - sum(sizes)
    gaps = rng.multinomial(slack, np.ones(len(sizes) + 1) / (len(sizes) + 1))
    out, pos = [], 0
    for g, k in zip(gaps, sizes):
        pos += int(g)
        out.append((pos, k))
        pos += k
    return out


@pytest.mark.parametrize("total", [8000, 200_000], ids=["small-message", "whole-write-above-message-size"])
def test_gather_write_is_byte_exact(pair, rng, total):
    a, b, ep = pair
    sizes = [1, 63, 17, 4096, 1, 65, 1000] + ([70_000, 33_333] if total > 100_000 else [])
    slot = np.frombuffer(rng.bytes(total), dtype=np.uint8).copy()
    src = np.zeros(sum(sizes) + 64 * len(sizes), dtype=np.uint8)
    dst = np.full(total + 8192, POISON, dtype=np.uint8)
    mr_slot, mr_src = a.register(slot.ctypes.data, slot.nbytes), a.register(src.ctypes.data, src.nbytes)
    mr_dst = b.register(dst.ctypes.data, dst.nbytes)
    layout = _gather_layout(rng, total, sizes)
    expected = slot.copy()
    srcs, locs, lens = [], [], []
    pos = 3  # unaligned sources, in shuffled order
    spots = {}
    for i in rng.permutation(len(layout)).tolist():
        spots[i] = pos
        pos += layout[i][1] + 5
    for i in range(len(layout)):
        o, k = layout[i]
        s_off = spots[i]
        src[s_off:s_off + k] = (i * 37 + 11) % 251 + np.arange(k) % 3  # a distinct value per piece
        expected[o:o + k] = src[s_off:s_off + k]
        srcs.append(src.ctypes.data + s_off)
        locs.append(slot.ctypes.data + o)
        lens.append(k)
    w = GatherWrite(slot.ctypes.data, total, dst.ctypes.data + 4097, mr_dst.rkey, mr_slot.lkey, imm=9, wr_id=5,
                    gather=(np.array(srcs), np.array(locs), np.array(lens)))
    a.post_writes(ep, [w])
    assert [(c.wr_id, c.error) for c in poll_completions(a, 1)] == [(5, None)]
    rimm = [c for c in poll_completions(b, 1) if c.opcode == Opcode.RECV_IMM]
    assert [(c.imm, c.byte_len) for c in rimm] == [(9, total)]
    assert np.array_equal(dst[4097:4097 + total], expected)
    assert (dst[:4097] == POISON).all() and (dst[4097 + total:] == POISON).all()
    del mr_src


def test_gather_write_with_runs_of_adjacent_sources_is_byte_exact(pair, rng):
    """Pieces whose sources follow each other in memory and whose ranges follow each other in the write go as one
    buffer; a gap in the write (the slot's own bytes) or a jump in the sources starts a new one. Every mix of the
    two, including a run that ends at the write's end, arrives byte-exact."""
    a, b, ep = pair
    # (offset in the write, length, source offset): a run of three, a source jump, a write gap, adjacent sources
    # across a write gap, a jump back, and a last run that ends at the write's end
    pieces = [(64, 100, 0), (164, 1, 100), (165, 4000, 101), (4165, 7, 9000), (4200, 63, 9007), (4263, 500, 9070),
              (5000, 10, 9570), (5010, 20, 50), (5030, 3000, 70)]
    total = 8030
    slot = np.frombuffer(rng.bytes(total), dtype=np.uint8).copy()
    src = np.zeros(12_000, dtype=np.uint8)
    dst = np.full(total + 64, POISON, dtype=np.uint8)
    mr_slot = a.register(slot.ctypes.data, slot.nbytes)
    a.register(src.ctypes.data, src.nbytes)
    mr_dst = b.register(dst.ctypes.data, dst.nbytes)
    expected = slot.copy()
    for i, (o, k, so) in enumerate(pieces):
        src[so:so + k] = (i * 29 + 3) % 251 + np.arange(k) % 2  # a distinct value per piece
    for o, k, so in pieces:  # later pieces may share source bytes with earlier ones: fill first, then read
        expected[o:o + k] = src[so:so + k]
    s0, l0 = src.ctypes.data, slot.ctypes.data
    w = GatherWrite(l0, total, dst.ctypes.data + 5, mr_dst.rkey, mr_slot.lkey, imm=4, wr_id=6,
                    gather=(np.array([s0 + so for _, _, so in pieces]), np.array([l0 + o for o, _, _ in pieces]),
                            np.array([k for _, k, _ in pieces])))
    a.post_writes(ep, [w])
    assert [(c.wr_id, c.error) for c in poll_completions(a, 1)] == [(6, None)]
    assert [(c.imm, c.byte_len) for c in poll_completions(b, 1)] == [(4, total)]
    assert np.array_equal(dst[5:5 + total], expected)
    assert (dst[:5] == POISON).all() and (dst[5 + total:] == POISON).all()


def test_gather_write_bad_input_raises_and_sends_nothing(pair, rng):
    a, b, ep = pair
    slot = np.zeros(8192, dtype=np.uint8)
    src = np.ones(8192, dtype=np.uint8)
    stray = np.ones(4096, dtype=np.uint8)  # never registered
    dst = np.full(8192, POISON, dtype=np.uint8)
    mr_slot = a.register(slot.ctypes.data, slot.nbytes)
    a.register(src.ctypes.data, src.nbytes)
    mr_dst = b.register(dst.ctypes.data, dst.nbytes)
    s, l0 = src.ctypes.data, slot.ctypes.data

    def gw(srcs, locs, lens):
        return GatherWrite(l0, 4096, dst.ctypes.data, mr_dst.rkey, mr_slot.lkey, imm=1,
                           gather=(np.array(srcs), np.array(locs), np.array(lens)))

    bad = [
        (ValueError, gw([s, s + 100], [l0 + 10, l0 + 20], [20, 5])),  # overlapping ranges
        (ValueError, gw([s, s + 100], [l0 + 200, l0 + 20], [5, 5])),  # not ascending
        (ValueError, gw([s], [l0 + 4090], [10])),  # past the write's end
        (ValueError, gw([s], [l0 - 1], [4])),  # before its start
        (ValueError, gw([s], [l0], [0])),  # empty range
        (RegionError, gw([stray.ctypes.data], [l0], [64])),  # source outside every registered region
        (RegionError, gw([s + 8000], [l0], [500])),  # source runs past its region
    ]
    for exc, w in bad:
        with pytest.raises(exc):
            a.post_writes(ep, [WriteRequest(l0, 64, dst.ctypes.data, mr_dst.rkey, mr_slot.lkey), w])
    assert a.poll(8, timeout=0.3) == [] and b.poll(8, timeout=0.1) == []
    assert (dst == POISON).all()


class _Plan:
    def __init__(self, dsts, lens, offs):
        self.dsts, self.lens, self.offs = dsts, lens, offs
        self.placed = threading.Event()

    def done(self):
        self.placed.set()


@pytest.mark.parametrize("case", ["plan", "gapless", "none", "raises", "bad-plan", "empty", "past-end", "overlap",
                                  "gapless-overlap"])
def test_landing_handler(pair, rng, case):
    """The target's landing handler reads the write's first bytes into the landing region and names where byte
    ranges of it go: those arrive there, the rest in the landing region ("gapless": ranges that follow each other
    to the write's end, as a chunk of 16-byte multiples has them, so nothing after the read lands in the landing
    region). Without a plan (None, an exception, a plan that overlaps what it read, an empty one, one past the
    write's end, ranges that overlap, also where every other range follows its predecessor) the write lands whole,
    no destination byte changes and the link stays up."""
    a, b, ep = pair
    total = 150_001
    data = np.frombuffer(rng.bytes(total), dtype=np.uint8).copy()
    landing = np.full(total + 100, POISON, dtype=np.uint8)
    out = np.full(total + 100, POISON, dtype=np.uint8)
    mr_data = a.register(data.ctypes.data, data.nbytes)
    mr_land = b.register(landing.ctypes.data, landing.nbytes)
    b.register(out.ctypes.data, out.nbytes)
    ranges = [(100, 1), (101, 63), (200, 70_000), (80_001, 5), (90_000, 60_001)]  # (offset in write, length)
    dests = [out.ctypes.data + d for d in (7, 99, 1003, 90_001, 71_000)]
    if case.startswith("gapless"):
        ranges = [(100, 1), (101, 63), (164, 70_000), (70_164, 5), (70_169, 79_832)]
        dests = [out.ctypes.data + d for d in (7, 70_100, 30, 70_170, 70_200)]
    plans = []

    def handler(peer_id, addr, length, imm, read):
        assert (addr, length, imm) == (landing.ctypes.data + 3, total, 42)
        head = bytes(read(100))
        assert head == data[:100].tobytes()
        if case == "raises":
            raise RuntimeError("handler bug")
        if case == "none":
            return None
        offs, lens, dsts = [o for o, _ in ranges], [k for _, k in ranges], list(dests)
        if case == "bad-plan":
            offs[0] = 50  # inside what it read
        elif case == "empty":
            offs, lens, dsts = [], [], []
        elif case == "past-end":
            lens[-1] = total - offs[-1] + 1
        elif case == "overlap":
            offs[3] = offs[2] + lens[2] - 1
        elif case == "gapless-overlap":
            lens[2] += 1  # reaches one byte into the next range, which starts where it ended before
        plans.append(_Plan(dsts, lens, offs))
        return plans[-1]

    b.set_landing_handler(mr_land, handler)
    # one whole write (a plain write above the writer's 4 KiB messages would be cut into pieces, which land as
    # usual): a gather write whose one gathered range is its own bytes
    d0 = data.ctypes.data
    a.post_writes(ep, [GatherWrite(d0, total, landing.ctypes.data + 3, mr_land.rkey, mr_data.lkey, imm=42, wr_id=3,
                                   gather=([d0 + 10], [d0 + 10], [5]))])
    assert [(c.wr_id, c.error) for c in poll_completions(a, 1)] == [(3, None)]
    assert [(c.opcode, c.imm) for c in poll_completions(b, 1)] == [(Opcode.RECV_IMM, 42)]
    exp_land = np.full_like(landing, POISON)
    exp_land[3:3 + total] = data
    exp_out = np.full_like(out, POISON)
    if case in ("plan", "gapless"):
        assert plans[0].placed.is_set()
        for (o, k), d in zip(ranges, dests):
            exp_out[d - out.ctypes.data:d - out.ctypes.data + k] = data[o:o + k]
            exp_land[3 + o:3 + o + k] = POISON  # received straight into its destination
    assert np.array_equal(out, exp_out)
    assert np.array_equal(landing, exp_land)


def test_landing_handler_needs_a_registered_host_region(pair):
    a, b, ep = pair
    buf = np.zeros(4096, dtype=np.uint8)
    mr = b.register(buf.ctypes.data, buf.nbytes)
    b.deregister(mr)
    with pytest.raises(RegionError):
        b.set_landing_handler(mr, lambda *a: None)


# --- through the engine: coalesced chunks on tcp --------------------------------------------------------------
@pytest.fixture(scope="module")
def peer():
    p = EnginePeer(16 * MB, fabric="tcp")
    yield p
    p.close()


@pytest.fixture(scope="module")
def sender():
    with TransferEngine(fabric="tcp", direct_pieces=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def src(sender):
    buf = np.zeros(16 * MB, dtype=np.uint8)
    sender.register(buf)
    return buf


def _placed(peer) -> int:
    return peer.call("stats")["receiver"].get("placed_chunks", 0)


def _placed_since(peer, before: int) -> int:
    """Chunks the peer placed since it had placed ``before``, waiting up to 5 s for one: the receiver counts a
    placed chunk just after it sent the ack that completed the sender's batch."""
    wait_for(lambda: _placed(peer) != before, "a chunk placed as it arrived", timeout=5, interval=0.01)
    return _placed(peer) - before


@pytest.mark.parametrize("sizes", [[1, 63, 7, 40_000, 65_535, 3, 50_001, 30_000, 100_000] * 40, [(64 << 10) - 1] * 200,
                                   [64 << 10] * 150 + [16_384, 48_000, 100_000] * 20, [2048] * 3000],
                         ids=["odd", "64K", "64K-aligned", "pages"])
def test_coalesced_chunks_are_placed_as_they_arrive_byte_exact(sender, peer, src, rng, sizes):
    """Chunks above tcp's small-message size whose pieces average at least ``gather_min_bytes``: sent from the
    pieces' sources and each item received straight into its destination; chunks of smaller pieces (2 KiB pages)
    are gathered and scattered as before. Either way the peer's whole buffer, guards included, matches the
    expected image."""
    n = len(sizes)
    src_offs = disjoint_offsets(rng, sizes, src.size - 64, align=1) + 1  # unaligned sources
    dst_offs = disjoint_offsets(rng, sizes, peer.size - 64, align=1) + 3
    for i, (o, k) in enumerate(zip(src_offs, sizes)):
        src[o:o + k] = (i * 131 + 7) % 256  # a distinct value per piece
    peer.poison()
    exp = Expected(peer.size)
    exp.apply(src, src_offs, dst_offs, sizes)
    before = _placed(peer)
    b = src.ctypes.data
    sender.batch_write(peer.session, [b + int(o) for o in src_offs], [peer.base + int(o) for o in dst_offs],
                       [int(k) for k in sizes])
    peer.check(exp)
    st = sender.stats()["paths"]["coalesced"]
    assert st["chunks"] >= 1
    if sizes[0] == 2048:
        assert _placed(peer) == before
    else:
        assert _placed_since(peer, before) > 0, "no chunk was placed as it arrived"
    assert n == len(sizes)
    # a gather chunk's write is silent on tcp (its ack completes it): nothing of it is left in flight, and its
    # bytes are counted as completed all the same
    assert not sender.stats()["inflight"]
    rails = sender.stats()["rails"]
    assert sum(r.get("bytes_completed", 0) for r in rails) >= sum(sizes)


def test_bad_chunk_is_rejected_and_writes_nothing(sender, peer, src, monkeypatch):
    """A chunk whose table is malformed (an item's payload offset not 16-byte aligned; pieces large enough for the
    placement path), sealed by its sender (its MAC checks), is refused before any destination byte is written: the
    batch fails with RemoteRejected and the peer's buffer stays poisoned."""
    import pxn_kernels.chunk as chunk
    real = chunk.build_header_table

    def corrupt(*args, **kw):
        buf, offsets, nbytes = real(*args, **kw)
        n = int(buf[16:20].view(np.uint32)[0])
        buf[chunk.HEADER_BYTES + 12] += 1  # item 0's payload offset, off its 16-byte alignment
        if kw.get("key") is not None:  # sealed again: the table is the sender's own mistake, not a forgery
            buf[44:60] = np.frombuffer(chunk.chunk_mac(kw["key"], memoryview(buf[:chunk.HEADER_BYTES + 16 * n])),
                                       dtype=np.uint8)
        else:
            buf[40] ^= 0xFF  # the checksum
        return buf, offsets, nbytes

    src[:] = 0x3C
    peer.poison()
    monkeypatch.setattr(chunk, "build_header_table", corrupt)
    before = _placed(peer)
    b = src.ctypes.data
    with pytest.raises(RemoteRejected, match="aligned|checksum"):
        sender.batch_write(peer.session, [b + i * 20_000 for i in range(100)],
                           [peer.base + 7 + i * 20_000 for i in range(100)], [19_999] * 100)
    monkeypatch.setattr(chunk, "build_header_table", real)
    peer.check(Expected(peer.size))
    assert _placed(peer) == before


def test_chunks_over_two_regions_are_placed_and_into_a_deregistered_one_refused(sender, peer, src):
    """Chunks of pieces large enough to be placed as they arrive, whose destinations lie in two of the peer's
    regions (no one region holds them all: the receiver's one-region check gives way to the lookup per item) are
    placed byte-exact; chunks into a region the peer deregistered since the sender learnt it are refused whole,
    with the reason, and write nothing there or anywhere else."""
    from transport.peer_process import digest
    n, k = 60, 20_000
    extra = peer.call("register_extra", size=n * k)
    b = src.ctypes.data
    for i in range(2 * n):
        src[i * k:(i + 1) * k] = (i * 37 + 11) % 256
    sender.batch_write(peer.session, [b], [extra], [64])  # the sender learns the extra region
    peer.poison()
    before = _placed(peer)
    # piece i alternates: the peer's buffer, then the extra region (in reverse order there)
    dsts = [peer.base + 5 + (i // 2) * k if i % 2 == 0 else extra + (n - 1 - i // 2) * k for i in range(2 * n)]
    sender.batch_write(peer.session, [b + i * k for i in range(2 * n)], dsts, [k] * (2 * n))
    assert _placed_since(peer, before) > 0, "no chunk was placed as it arrived"
    exp = Expected(peer.size)
    exp.apply(src, [i * k for i in range(0, 2 * n, 2)], [5 + (i // 2) * k for i in range(0, 2 * n, 2)],
              [k] * n)
    peer.check(exp)
    img = np.empty(n * k, dtype=np.uint8)
    for i in range(1, 2 * n, 2):
        o = (n - 1 - i // 2) * k
        img[o:o + k] = src[i * k:(i + 1) * k]
    assert peer.call("extra_digest", addr=extra) == digest(img)
    # the extra region goes away; the sender's list still has it
    peer.call("poison")
    clean = peer.call("extra_digest", addr=extra)
    peer.call("deregister", addr=extra)
    before = _placed(peer)
    with pytest.raises(RemoteRejected, match="outside every region"):
        sender.batch_write(peer.session, [b + i * k for i in range(n)], [extra + i * k for i in range(n)], [k] * n)
    assert _placed(peer) == before
    assert peer.call("extra_digest", addr=extra) == clean
    peer.check(Expected(peer.size))
