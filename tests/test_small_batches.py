"""Small batches on tcp: the ``WriteRows`` path (``transport.smallbatch``), the tcp fabric's inline sends, its
look-ahead receive and its one-step placement of small WRITE messages.

End-to-end cases write fresh random bytes into a poisoned peer (another process) and compare its whole buffer,
guards included, with the expected image; unit cases drive the fabric pieces over socket pairs.
"""
import socket
import threading
import time

import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets, write_and_check
from fabric_helpers import wait_completions
from wait_helpers import wait_for
from transport import InvalidTransfer, TransferEngine
from transport.errors import RegionError
from transport.fabric import tcp as T
from transport.fabric import base as fabric_base
from transport.fabric import messages
from transport.fabric import sockets
from transport.fabric import wire
from transport.smallbatch import Signal

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
MB = 1 << 20


@pytest.fixture(scope="module")
def peer():
    p = EnginePeer(8 * MB, fabric="tcp")
    yield p
    p.close()


@pytest.fixture(scope="module")
def src():
    from suite_env import SEED
    rng = np.random.default_rng([SEED, 11])
    return np.frombuffer(rng.bytes(8 * MB), dtype=np.uint8).copy()


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _engine(src, **kw):
    eng = TransferEngine(fabric="tcp", **kw)
    eng.register(src)
    return eng


def _paths(eng):
    st = eng.stats()
    return st["paths"]["direct"]["units"], st["paths"]["coalesced"]["chunks"]



def _run_threads(work, jobs, join_s: float) -> list:
    """``work(*job)`` in a thread per job, joined (``join_s`` seconds each at most); the exceptions raised."""
    errors = []

    def run(*job):
        try:
            work(*job)
        except Exception as e:  # noqa: BLE001 — returned to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    return errors


def _aux_jobs(src, peer, exp, threads: int) -> list:
    """Per thread, the (srcs, dsts) lists of an aux batch in disjoint ranges of ``src`` and of the peer, applied
    to ``exp``."""
    jobs = []
    for t in range(threads):
        s_offs = np.arange(len(AUX)) * 9000 + t * 100_000
        d_offs = np.arange(len(AUX)) * 9000 + t * 120_000
        exp.apply(src, s_offs, d_offs, AUX)
        jobs.append(([src.ctypes.data + int(o) for o in s_offs], [peer.base + int(o) for o in d_offs]))
    return jobs

def test_aux_batch_goes_direct_and_lands_byte_exact(peer, src, rng):
    with _engine(src) as eng:
        assert eng.config.direct_pieces == 64
        for _ in range(5):  # destinations and sources move every time: nothing cached between batches
            write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, 4 * MB),
                            disjoint_offsets(rng, AUX, 4 * MB), AUX)
        direct, chunks = _paths(eng)
        assert direct == 5 and chunks == 0
        assert eng.stats()["batches"]["ok"] == 5


def test_chunk_path_without_direct_pieces_and_above_the_limit(peer, src, rng):
    with _engine(src, direct_pieces=0) as eng:
        write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, 4 * MB),
                        disjoint_offsets(rng, AUX, 4 * MB), AUX)
        assert _paths(eng) == (0, 1)
    lengths = [64] * 65  # one more than tcp's limit: a chunk
    with _engine(src) as eng:
        write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, lengths, 4 * MB),
                        disjoint_offsets(rng, lengths, 4 * MB), lengths)
        assert _paths(eng) == (0, 1)


def test_inputs_the_small_path_leaves_to_the_general_one(peer, src, rng):
    """Tuples take the small path; numpy ints, a piece of coalesce_bytes and sources in two regions do not; all
    land byte-exact."""
    other = np.frombuffer(rng.bytes(MB), dtype=np.uint8).copy()
    with _engine(src) as eng:
        eng.register(other)
        s_offs, d_offs = disjoint_offsets(rng, AUX, 4 * MB), disjoint_offsets(rng, AUX, 4 * MB)
        peer.poison()
        exp = Expected(peer.size)
        exp.apply(src, s_offs, d_offs, AUX)
        eng.batch_write(peer.session, tuple(src.ctypes.data + int(o) for o in s_offs),
                        tuple(peer.base + int(o) for o in d_offs), tuple(AUX))
        peer.check(exp)
        assert _paths(eng) == (1, 0)
        srcs = [np.int64(src.ctypes.data + int(o)) for o in s_offs]
        write_and_check(eng, peer, src.ctypes.data, src, s_offs, d_offs, AUX)  # ints: small path
        eng.batch_write(peer.session, srcs, [peer.base + int(o) for o in d_offs], AUX)  # numpy ints: general
        lengths = [64 << 10, 64]
        write_and_check(eng, peer, src.ctypes.data, src, [0, 1 << 20], [0, 1 << 20], lengths)
        # two source regions: the general path, which looks pieces up one by one
        peer.poison()
        exp = Expected(peer.size)
        exp.apply(src, [0], [0], [100])
        exp.apply(other, [0], [4096], [100])
        eng.batch_write(peer.session, [src.ctypes.data, other.ctypes.data], [peer.base, peer.base + 4096],
                        [100, 100])
        peer.check(exp)


def test_destination_outside_the_peer_writes_nothing(peer, src):
    with _engine(src) as eng:
        peer.poison()
        exp = Expected(peer.size)
        with pytest.raises(InvalidTransfer, match=r"dsts\[1\]"):
            eng.batch_write(peer.session, [src.ctypes.data, src.ctypes.data + 64],
                            [peer.base, peer.base + peer.size - 10], [64, 64])
        with pytest.raises(InvalidTransfer, match=r"srcs\[0\]"):
            eng.batch_write(peer.session, [src.ctypes.data + src.nbytes - 10], [peer.base], [64])
        with pytest.raises(InvalidTransfer, match=r"lengths\[0\]"):
            eng.batch_write(peer.session, [src.ctypes.data], [peer.base], [True])
        peer.check(exp)
        assert eng.stats()["batches"]["submitted"] == 0


def test_async_small_batches_complete_in_order(peer, src, rng):
    with _engine(src) as eng:
        peer.poison()
        exp = Expected(peer.size)
        handles = []
        for k in range(20):
            s_offs = disjoint_offsets(rng, AUX, MB) + (k % 4) * MB
            d_offs = np.arange(len(AUX)) * 16384 + k * 200_000
            exp.apply(src, s_offs, d_offs, AUX)
            handles.append(eng.batch_write_async(peer.session, [src.ctypes.data + int(o) for o in s_offs],
                                                 [peer.base + int(o) for o in d_offs], AUX))
        for h in handles:
            h.wait(30)
            assert h.done()
        peer.check(exp)
        # batches completed by their ack and those completed after an earlier one, counted alike
        st = eng.stats()
        assert st["batches"]["ok"] == 20 and st["paths"]["direct"]["units"] == 20 and not st["inflight"]


def test_small_batches_survive_a_dead_rail(peer, src, rng):
    """With rail 0's endpoint aborted, small batches go over the other rail (or fail rail 0 over) and land."""
    with _engine(src) as eng:
        write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, MB),
                        disjoint_offsets(rng, AUX, MB), AUX)
        eng.rail_endpoint(peer.session, 0).abort()
        for _ in range(6):
            write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, MB),
                            disjoint_offsets(rng, AUX, MB), AUX)
        assert eng.stats()["batches"]["ok"] == 7


def test_small_batches_from_threads(peer, src):
    """Eight threads, small batches into disjoint destinations: every byte where it belongs."""
    with _engine(src) as eng:
        peer.poison()
        exp = Expected(peer.size)
        jobs = _aux_jobs(src, peer, exp, 8)

        def run(srcs, dsts):
            for _ in range(30):
                eng.batch_write(peer.session, srcs, dsts, AUX)

        assert not _run_threads(run, jobs, 60)
        peer.check(exp)
        assert eng.stats()["batches"]["ok"] == 8 * 30 and not eng.stats()["inflight"]


# --- units ------------------------------------------------------------------------------------------------------
def test_signal_is_an_event_set_once():
    s = Signal()
    assert not s.is_set() and s.wait(0) is False and s.wait(0.01) is False
    got = []
    waiters = [threading.Thread(target=lambda: got.append(s.wait(5))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)  # the scenario: the waiters are (most likely) blocked when the setters run; no event says so
    setters = [threading.Thread(target=s.set) for _ in range(4)]  # several setters at once: no error
    for t in setters:
        t.start()
    for t in setters + waiters:
        t.join(5)
    assert got == [True] * 4 and s.is_set() and s.wait() and s.wait(0)


def test_write_rows_checks_name_the_bad_write():
    ok = fabric_base.WriteRows((10, 20), [1, 2], [30, 40], 5, 6)
    assert ok.local_span == (10, 22) and ok.remote_span == (30, 42) and ok.max_length == 2 and ok.nbytes == 3
    assert ok.count == 2 and isinstance(ok.local_addr, list)
    for args, what in [(([10, 20], [1, 0], [30, 40]), "write 1"), (([10, True], [1, 1], [30, 40]), "write 1"),
                       (([10, 20], [1, 1], [-1, 40]), "write 0"), (([10], [1 << 63], [0]), "write 0"),
                       (([10, 20], [1.0, 1], [30, 40]), "write 0")]:
        with pytest.raises(ValueError, match=what):
            fabric_base.WriteRows(*args, 5, 6)
    with pytest.raises(ValueError, match="one length"):
        fabric_base.WriteRows([1, 2], [1], [3], 5, 6)


@pytest.fixture
def fabric_pair():
    a, b = T.TcpFabric(secret=""), T.TcpFabric(secret="")
    yield a, b
    a.close()
    b.close()


def test_write_rows_on_the_fabric(fabric_pair):
    """A WriteRows post: byte-exact placement, a local range outside its region refused before anything is sent,
    a remote range outside the peer's region refused by the peer with nothing written there."""
    a, b = fabric_pair
    src = np.frombuffer(np.random.default_rng(5).bytes(1 << 16), dtype=np.uint8).copy()
    dst = np.full(3 << 16, 0xA5, dtype=np.uint8)
    lmr = a.register(src.ctypes.data, src.nbytes)
    rmr = b.register(dst.ctypes.data + (1 << 16), 1 << 16)  # the middle third; the rest is a guard
    ep = a.connect(b.descriptor())
    base = dst.ctypes.data + (1 << 16)
    lens = [7, 64, 1, 4000]
    s_offs, d_offs = [0, 100, 5000, 9000], [60000, 0, 333, 20000]
    a.post_writes(ep, [fabric_base.WriteRows([src.ctypes.data + o for o in s_offs], lens, [base + o for o in d_offs],
                                   rmr.rkey, lmr.lkey, wr_id=1)])
    (c,) = wait_completions(a, 1)
    assert c.wr_id == 1 and c.error is None and c.byte_len == sum(lens)
    exp = np.full_like(dst, 0xA5)
    for s_, d_, n in zip(s_offs, d_offs, lens):
        exp[(1 << 16) + d_:(1 << 16) + d_ + n] = src[s_:s_ + n]
    assert np.array_equal(dst, exp)
    with pytest.raises(RegionError, match="write 1: local range"):
        a.post_writes(ep, [fabric_base.WriteRows([src.ctypes.data, src.ctypes.data + src.nbytes - 4], [4, 8], [base, base + 8],
                                       rmr.rkey, lmr.lkey, wr_id=2)])
    a.post_writes(ep, [fabric_base.WriteRows([src.ctypes.data, src.ctypes.data + 8], [8, 8],
                                   [base + 100, base + (1 << 16) - 4], rmr.rkey, lmr.lkey, wr_id=3)])
    (c,) = wait_completions(a, 1)
    assert c.wr_id == 3 and isinstance(c.error, RegionError)
    # the refused write left the guard alone (the accepted one may land: each piece stands on its own)
    assert np.array_equal(dst[2 << 16:], exp[2 << 16:]) and np.array_equal(dst[:1 << 16], exp[:1 << 16])


def test_inline_send_of_a_full_socket_leaves_the_rest_first_in_line():
    """``send_now``: what the kernel does not take goes to the head of the control queue, and no later inline
    send overtakes it; the receiving end gets every byte in order."""
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s = sockets.Sock(a, 0)
        big = np.random.default_rng(1).bytes(1 << 20)
        assert sockets.send_now(s, [b"head", memoryview(big)])
        assert s.ctrl  # the kernel took part of it
        assert not sockets.send_now(s, [b"later"])  # must not overtake the rest
        s.ctrl.append(b"later")
        got = bytearray()

        def drain():
            while len(got) < 4 + len(big) + 5:
                chunk = b.recv(1 << 16)
                if not chunk:
                    break
                got.extend(chunk)

        t = threading.Thread(target=drain)
        t.start()
        sockets.send_buffers(a, list(s.ctrl))
        t.join(10)
        assert bytes(got) == b"head" + big + b"later"
    finally:
        a.close()
        b.close()


def test_look_ahead_receive_returns_the_stream_in_order():
    a, b = socket.socketpair()
    try:
        sizes = [1, 31, 4096, 5, 17000, 100, 60000, 2, 3000]  # small reads buffered, large ones direct
        data = np.random.default_rng(2).bytes(sum(sizes) + 50 * len(sizes))
        t = threading.Thread(target=lambda: [a.sendall(data[i:i + 777]) for i in range(0, len(data), 777)])
        t.start()
        rx = sockets.Rx(b, 4096)
        out = bytearray()
        stage = memoryview(bytearray(1 << 16))
        for n in sizes:
            view = memoryview(bytearray(n))
            sockets.recv_exact(rx, view)
            out += view
            out += rx.take(50, stage)
        t.join(10)
        assert bytes(out) == data
    finally:
        a.close()
        b.close()


def test_look_ahead_header_unpack_across_partial_receives(rng):
    """``Rx.unpack``: headers split over receives (down to one byte at a time), left partly in the buffer by the
    read before, and followed by bodies read through ``take`` and ``recv_exact``, all come back whole and in
    order."""
    a, b = socket.socketpair()
    try:
        n = 300
        bodies = [rng.bytes(int(k)) for k in rng.integers(0, 9000, n)]
        fields = [(wire.MAGIC, int(rng.integers(1, 9)), 0, 0, int(rng.integers(0, 1 << 32)), int(rng.integers(0, 1 << 63)),
                   len(body)) for body in bodies]
        data = b"".join(wire.HDR.pack(*f) + body for f, body in zip(fields, bodies))
        cuts = np.sort(rng.choice(len(data), size=4000, replace=False))  # many one-byte and short sends

        def send():
            pos = 0
            for c in cuts.tolist() + [len(data)]:
                a.sendall(data[pos:c])
                pos = c
        t = threading.Thread(target=send)
        t.start()
        rx = sockets.Rx(b, wire.HDR.size + 4096)
        stage = memoryview(bytearray(1 << 16))
        for i, (f, body) in enumerate(zip(fields, bodies)):
            assert rx.unpack(wire.HDR) == f, f"header {i}"
            if i % 2:
                assert bytes(rx.take(len(body), stage)) == body, f"body {i}"
            else:
                view = memoryview(bytearray(len(body)))
                sockets.recv_exact(rx, view)
                assert bytes(view) == body, f"body {i}"
        t.join(10)
    finally:
        a.close()
        b.close()


class _Pushed:
    """A stand-in fabric for ``TcpEndpoint.on_ack``: records what it pushes."""

    def __init__(self):
        self.pushed = []

    def push_completions(self, comps):
        self.pushed.extend(comps)


def _rows_message(wr_id: int, on_acked=None) -> "messages.OutMsg":
    req = fabric_base.WriteRows([0, 8], [8, 8], [100, 200], 5, 6, wr_id=wr_id)
    m = messages.OutMsg(0)
    m.rows = b"".join(wire.ROW.pack(r, k, r, k, 5, 0, 0, 0) for r, k in zip(req.remote_addr, req.length))
    m.pieces, m.batch, m.final, m.on_acked = 2, messages.BatchRecord(req), True, on_acked
    return m


def test_ack_completes_a_rows_message_by_its_callback_only_in_order():
    """``on_acked`` runs instead of a completion only for a message whose ack releases it alone with every piece
    placed; after an earlier message, with a refused piece, or when the callback declines, the completion is
    reported as for any message, in order."""
    sa, sb = socket.socketpair()
    fab = _Pushed()
    ep = T.TcpEndpoint(fab, "peer", [sa])
    called = []
    try:
        # a later rows message acked before an earlier one: both complete in order, as completions
        m1, m2 = _rows_message(1), _rows_message(2, on_acked=lambda: called.append(2) or True)
        for m in (m1, m2):
            ep.enqueue_one(m)
        ep.on_ack(m2.seq, bytes(2))
        assert not called and not fab.pushed
        ep.on_ack(m1.seq, bytes(2))
        assert not called and [c.wr_id for c in fab.pushed] == [1, 2] and all(c.error is None for c in fab.pushed)
        # alone and placed: the callback, no completion
        fab.pushed.clear()
        m3 = _rows_message(3, on_acked=lambda: called.append(3) or True)
        ep.enqueue_one(m3)
        ep.on_ack(m3.seq, bytes(2))
        assert called == [3] and not fab.pushed and not ep._pending
        # the callback declines: the completion goes out
        m4 = _rows_message(4, on_acked=lambda: called.append(4) and False)
        ep.enqueue_one(m4)
        ep.on_ack(m4.seq, bytes(2))
        assert called == [3, 4] and [c.wr_id for c in fab.pushed] == [4] and fab.pushed[0].error is None
        # a refused piece: no callback, the completion names the refused write
        fab.pushed.clear()
        m5 = _rows_message(5, on_acked=lambda: called.append(5) or True)
        ep.enqueue_one(m5)
        ep.on_ack(m5.seq, bytes([0, wire.ST_BOUNDS]))
        assert called == [3, 4] and len(fab.pushed) == 1
        assert isinstance(fab.pushed[0].error, RegionError) and "0xc8" in str(fab.pushed[0].error)
    finally:
        sa.close()
        sb.close()


@pytest.mark.slow
def test_small_batches_counted_when_they_complete_by_their_ack(peer, src, rng):
    """Batches completed straight from their ack (``Completions.rows_acked``) are counted as the completion path
    counts them: batch, path, latency and rail counters, nothing left in flight; every byte lands."""
    with _engine(src) as eng:
        n = 20
        for _ in range(n):
            write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, 4 * MB),
                            disjoint_offsets(rng, AUX, 4 * MB), AUX)
        st = eng.stats()
        assert st["batches"]["ok"] == n and st["paths"]["direct"]["units"] == n
        assert st["paths"]["direct"]["bytes"] == n * sum(AUX)
        assert st["batches"]["submitted"] == n and st["batches"]["latency"]["count"] == n
        assert sum(r.get("completions", 0) for r in st["rails"]) == n
        assert sum(r.get("bytes_completed", 0) for r in st["rails"]) == n * sum(AUX)
        assert sum(r.get("post_calls", 0) for r in st["rails"]) == n
        assert not st["inflight"] and all(not pr.inflight and pr.bytes_in_flight == 0
                                       for p in eng._peers.values() for pr in p.rails)


# --- a waiting caller reads its own ack ---------------------------------------------------------------------------
def _own_reads(eng):
    """Acks of small batches that the waiting callers of ``eng`` read themselves, over every rail's sockets."""
    return sum(s.own_reads for r in range(len(eng.fabrics)) for ep in eng.fabrics[r]._all_eps for s in ep.socks)


def _local_pair(src, size=4 * MB, **kw):
    """(sender, target engine, target buffer poisoned): both in this process, so that the target's fabric can be
    made to hold or drop its acks."""
    dst = np.full(size, 0xA5, dtype=np.uint8)
    tgt = TransferEngine(fabric="tcp")
    tgt.register(dst)
    return _engine(src, **kw), tgt, dst


def _aux_lists(rng, src, base, space):
    s_offs = disjoint_offsets(rng, AUX, MB)
    d_offs = disjoint_offsets(rng, AUX, space)
    return s_offs, d_offs, [src.ctypes.data + int(o) for o in s_offs], [base + int(o) for o in d_offs]


def _expect(dst_len, src, s_offs, d_offs, lengths=AUX):
    img = np.full(dst_len, 0xA5, dtype=np.uint8)
    for so, do, k in zip(s_offs, d_offs, lengths):
        img[int(do):int(do) + k] = src[int(so):int(so) + k]
    return img


@pytest.mark.slow
def test_waiting_callers_read_their_own_acks(peer, src, rng):
    """After the first batch on a socket (whose ack its receive thread still reads), sync small batches are
    completed by their callers reading the ack themselves, byte-exact; with ``own_acks`` off, never."""
    with _engine(src) as eng:
        for _ in range(12):
            write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, MB),
                            disjoint_offsets(rng, AUX, 4 * MB), AUX)
        assert _own_reads(eng) >= 12 - 2 * len(eng.fabrics) * eng.fabrics[0].connections_per_peer
        assert not any(s.reader.locked() for f in eng.fabrics for ep in f._all_eps for s in ep.socks)
        assert eng.stats()["batches"]["ok"] == 12 and not eng.stats()["inflight"]
    from transport.fabric.tcp import TcpFabric
    orig = TcpFabric.__init__

    def no_own(self, *a, **kw):
        kw["own_acks"] = False
        orig(self, *a, **kw)

    TcpFabric.__init__ = no_own
    try:
        with _engine(src) as eng:
            for _ in range(6):
                write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, MB),
                                disjoint_offsets(rng, AUX, 4 * MB), AUX)
            assert _own_reads(eng) == 0
    finally:
        TcpFabric.__init__ = orig


def test_odd_sizes_through_the_own_ack_path(peer, src, rng):
    """1 B, 63 B and unaligned pieces, many times over the same sockets (their callers read the acks)."""
    lengths = [1, 63, 7, 4097, 1, 65, 3]
    with _engine(src) as eng:
        for _ in range(10):
            write_and_check(eng, peer, src.ctypes.data + 1, src[1:], disjoint_offsets(rng, lengths, MB),
                            disjoint_offsets(rng, lengths, 4 * MB) + 3, lengths)
        assert _own_reads(eng) > 0


def test_a_spinning_caller_reads_its_acks_byte_exact(peer, src, rng, monkeypatch):
    """``ack_spin`` (and ``PXN_ACK_SPIN_US``, read at construction): the waiting caller polls its socket without
    sleeping first; the batches land byte-exact all the same; a spin outside [0, 1] s is refused."""
    with _engine(src, fabric_options={"ack_spin": 0.002}) as eng:
        assert all(f._spin == 0.002 for f in eng.fabrics)
        for _ in range(10):
            write_and_check(eng, peer, src.ctypes.data, src, disjoint_offsets(rng, AUX, MB),
                            disjoint_offsets(rng, AUX, 4 * MB), AUX)
        assert _own_reads(eng) > 0
    monkeypatch.setenv("PXN_ACK_SPIN_US", "250")
    f = T.TcpFabric()
    try:
        assert f._spin == 250e-6
    finally:
        f.close()
    with pytest.raises(ValueError, match="ack_spin"):
        T.TcpFabric(ack_spin=2.0)


def _delay_acks(tgt, seconds):
    """Every ack of ``tgt``'s fabrics leaves ``seconds`` late."""
    for f in tgt.fabrics:
        def send(ep, s, payload, orig=f.send_ctrl):
            time.sleep(seconds)  # the scenario: a slow acker
            orig(ep, s, payload)
        f.send_ctrl = send


def _spins(socks):
    """The receive spins of ``socks`` that ever spun."""
    return [s.spin for s in socks if s.spin is not None and s.spin.spins]


def test_slow_acks_turn_the_waiting_callers_spin_off(src, rng):
    """The target answers every small batch 20 ms late, far past the 150 us spin: after one miss more than a window
    allows, the waiting callers stop spinning (``AdaptiveSpin``) for the rest of the run; every batch lands
    byte-exact all the same."""
    from transport.fabric.spin import AdaptiveSpin
    eng, tgt, dst = _local_pair(src)
    try:
        base = dst.ctypes.data
        assert all(f.ack_spin.on and f.ack_spin.budget == T.SPIN for f in eng.fabrics)
        _delay_acks(tgt, 0.02)
        n = 30  # fewer than a window's spins (no window closes) and than the shortest pause: off until the end
        for _ in range(n):
            dst[:] = 0xA5
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
            assert np.array_equal(dst, _expect(len(dst), src, so, do))
        spins = [f.ack_spin for f in eng.fabrics]
        assert _own_reads(eng) > AdaptiveSpin.MISSES + 1
        # a caller descheduled past the delay (a busy machine) may find an ack while it spins: a hit, which adds a
        # spin without moving the switch-off (how many depends on the machine's load, so only their effect is
        # checked: with fewer spins than a window, only misses turn the spin off)
        hits = sum(sp.hits for sp in spins)
        assert sum(sp.spins for sp in spins) == sum(sp.offs for sp in spins) * (AdaptiveSpin.MISSES + 1) + hits
        assert sum(sp.offs for sp in spins) >= 1 and not all(sp.on for sp in spins)
        assert not eng.stats()["inflight"]
    finally:
        eng.close()
        tgt.close()


def test_a_receive_thread_stops_spinning_when_messages_come_far_apart(src, rng):
    """Small batches 3 ms apart: the target's receive thread, which spins for the next message after each one
    (``recv_spin``), misses every time and stops; the bytes land byte-exact."""
    from transport.fabric.spin import AdaptiveSpin
    eng, tgt, dst = _local_pair(src)
    try:
        base = dst.ctypes.data
        for _ in range(2 * (AdaptiveSpin.MISSES + 1)):
            time.sleep(0.003)  # the scenario: an idle gap between batches, so the ack spin misses
            dst[:] = 0xA5
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
            assert np.array_equal(dst, _expect(len(dst), src, so, do))
        spins = _spins([s for f in tgt.fabrics for ep in f._all_eps for s in ep.socks])
        assert spins and sum(sp.offs for sp in spins) >= 1, [sp.stats() for sp in spins]
        assert sum(sp.hits for sp in spins) <= 2, [sp.stats() for sp in spins]
    finally:
        eng.close()
        tgt.close()


def test_receive_threads_spin_only_after_small_writes(src, rng):
    """Large writes (chunks of 1 MB pieces) leave the target's receive threads blocking after each message; small
    batches make the one that received them spin for the next. Byte-exact either way."""
    eng, tgt, dst = _local_pair(src, size=8 * MB)
    try:
        base = dst.ctypes.data
        lengths = [MB] * 3
        for _ in range(5):
            dst[:] = 0xA5
            so, do = disjoint_offsets(rng, lengths, 4 * MB), disjoint_offsets(rng, lengths, 8 * MB)
            eng.batch_write(tgt.session_id, [src.ctypes.data + int(o) for o in so], [base + int(o) for o in do],
                            lengths)
            assert np.array_equal(dst, _expect(len(dst), src, so, do, lengths))
        socks = [s for f in tgt.fabrics for ep in f._all_eps for s in ep.socks]
        assert socks and not _spins(socks)
        for _ in range(5):
            dst[:] = 0xA5
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
            assert np.array_equal(dst, _expect(len(dst), src, so, do))
        assert _spins([s for f in tgt.fabrics for ep in f._all_eps for s in ep.socks])
    finally:
        eng.close()
        tgt.close()


def test_small_batches_keep_to_one_socket_until_it_is_busy(src, rng):
    """One sync small batch after another goes to one rail and one socket of it (where the peer's receive thread
    is awake from the last one); when that socket is busy sending, the batch waits for its sender thread and the
    next ones move to the next socket. Byte-exact throughout."""
    eng, tgt, dst = _local_pair(src)
    try:
        base = dst.ctypes.data
        n = 20

        def batch(wait=True):
            dst[:] = 0xA5
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            if wait:
                eng.batch_write(tgt.session_id, s_l, d_l, AUX)
            else:
                eng.batch_write_async(tgt.session_id, s_l, d_l, AUX).wait(30)
            assert np.array_equal(dst, _expect(len(dst), src, so, do))

        for _ in range(n):
            batch()
        posts = [r.get("post_calls", 0) for r in eng.stats()["rails"]]
        rail = int(np.argmax(posts))
        assert posts[rail] >= n - 1, posts  # the first batch (the handshake) may take the general path
        ep = eng.rail_endpoint(tgt.session_id, rail)
        reads = sorted(s.own_reads for s in ep.socks)
        # one socket serves them; a batch posted while that socket's receive thread holds its reader token (woken
        # by another message), or while a control frame holds the socket, goes to another socket -- each of the
        # two moves one batch, so at most 2 go elsewhere, where round-robin would spread them n / sockets each
        assert len(ep.socks) > 1 and reads[-1] >= n - 3 and sum(reads[:-1]) <= 2, reads
        first = ep._small
        sock = ep.socks[first]
        sock.wire_lock.acquire()  # the socket is busy sending: the next small message goes to its sender thread
        try:
            done = threading.Event()
            th = threading.Thread(target=lambda: (batch(wait=False), done.set()))
            th.start()
            time.sleep(0.2)  # the scenario: a window in which the batch must stay unsent (no event for "not yet")
            assert not done.is_set()
        finally:
            sock.wire_lock.release()
        th.join(30)
        assert done.is_set() and ep._small == (first + 1) % len(ep.socks)
        for _ in range(3):
            batch()
        assert not eng.stats()["inflight"]
    finally:
        eng.close()
        tgt.close()


def test_a_caller_waiting_for_its_ack_times_out_and_gives_the_socket_back(src, rng):
    """The target drops its acks: the caller that reads its own ack gives up at the batch timeout with
    TransferTimeout (not later), and the socket goes back to its receive thread."""
    from transport.errors import TransferTimeout
    eng, tgt, dst = _local_pair(src)
    try:
        base = dst.ctypes.data
        for _ in range(10):  # every socket shared and its callers reading
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
        before = _own_reads(eng)
        assert before > 0
        dropped = []
        for f in tgt.fabrics:
            f.send_ctrl = lambda ep, s, payload: dropped.append(payload)  # acks never leave the target
        so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            eng.batch_write(tgt.session_id, s_l, d_l, AUX, timeout=0.4)
        took = time.monotonic() - t0
        assert 0.35 < took < 2.0, took
        assert dropped  # the write was placed and its ack held back
        assert not any(s.reader.locked() for f in eng.fabrics for ep in f._all_eps for s in ep.socks)
        # the pieces did land (the target placed them before the ack it dropped)
        for o_s, o_d, k in zip(so, do, AUX):
            assert np.array_equal(dst[int(o_d):int(o_d) + k], src[int(o_s):int(o_s) + k])
    finally:
        eng.close()
        tgt.close()


def test_a_dead_endpoint_while_the_caller_reads_its_ack_fails_over(src, rng):
    """The target holds its acks back; meanwhile the sender's endpoint of that rail is aborted. The caller reading
    its own ack sees the link end, the batch fails over to the other rail and lands byte-exact, well before the
    timeout."""
    eng, tgt, dst = _local_pair(src)
    try:
        base = dst.ctypes.data
        for _ in range(10):
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
        assert _own_reads(eng) > 0
        held = threading.Event()
        originals = [f.send_ctrl for f in tgt.fabrics]

        def slow_ack(orig):
            def send(ep, s, payload):
                if not held.is_set():
                    held.set()
                    time.sleep(0.5)  # the first ack after the switch comes late: the caller is waiting for it
                orig(ep, s, payload)
            return send

        for f, orig in zip(tgt.fabrics, originals):
            f.send_ctrl = slow_ack(orig)
        dst[:] = 0xA5
        so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
        killer_done = threading.Event()
        aborted = []

        def reading_rails():  # the rails whose socket the caller reads, waiting for the held ack
            return [r for r in range(len(eng.fabrics))
                    if any(s.reader.locked() for s in eng.rail_endpoint(tgt.session_id, r).socks)]

        def kill():
            held.wait(5)
            for r in wait_for(reading_rails, "the caller reading a rail's socket for the held ack", timeout=5,
                              interval=0.002):
                aborted.append(r)
                eng.rail_endpoint(tgt.session_id, r).abort()
            killer_done.set()

        th = threading.Thread(target=kill)
        th.start()
        t0 = time.monotonic()
        eng.batch_write(tgt.session_id, s_l, d_l, AUX, timeout=20)
        took = time.monotonic() - t0
        th.join(10)
        assert killer_done.is_set() and aborted
        assert took < 10, took
        assert np.array_equal(dst, _expect(len(dst), src, so, do))
        assert not eng.stats()["inflight"]
        # and the engine goes on: more batches, byte-exact
        for _ in range(4):
            dst[:] = 0xA5
            so, do, s_l, d_l = _aux_lists(rng, src, base, 2 * MB)
            eng.batch_write(tgt.session_id, s_l, d_l, AUX)
            assert np.array_equal(dst, _expect(len(dst), src, so, do))
    finally:
        eng.close()
        tgt.close()


def test_sync_and_async_small_batches_from_threads(peer, src):
    """Six threads, each alternating sync batches (whose callers read acks, also other threads') and async ones
    (left to the receive threads) into disjoint destinations: every byte where it belongs, every batch counted."""
    with _engine(src) as eng:
        peer.poison()
        exp = Expected(peer.size)
        jobs = _aux_jobs(src, peer, exp, 6)

        def run(srcs, dsts):
            for i in range(40):
                if i % 3 == 1:
                    hs = [eng.batch_write_async(peer.session, srcs, dsts, AUX) for _ in range(3)]
                    eng.batch_write(peer.session, srcs, dsts, AUX)
                    for h in hs:
                        h.wait(30)
                else:
                    eng.batch_write(peer.session, srcs, dsts, AUX)

        assert not _run_threads(run, jobs, 120)
        peer.check(exp)
        n = 6 * (40 + 13 * 3)
        assert eng.stats()["batches"]["ok"] == n and not eng.stats()["inflight"]
        assert _own_reads(eng) > 0
