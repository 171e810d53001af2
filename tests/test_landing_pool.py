"""The shared landing pool (transport.receiver): many senders into one receiver, one sender into many receivers,
landing memory that does not grow with senders, credits of a dead sender, the cap on a hello's slot size, and the
routes to a peer whose pool slots are smaller than our chunks (one planner for all of them).

On the 2-core CPU box: tcp on loopback, host memory, one rail and one tcp connection per rail per engine; per
sender, aux11, 4096 x 64 B, 1024 x 64 KB and the 2000-piece mix (2000 pieces of 1..8192 B + 8 x 2 MB), 89 MB;
the receiver's pool is 4 slots of 1 MiB, so 64 senders wait for credits nearly all the time (the fan-in holds
about 12 GB of host memory at its peak, both sides together).
"""
import os
import signal
import statistics
import time

import numpy as np
import pytest

from suite_env import SEED
from transport import TransferEngine
from transport.control import query
from transport.peer_process import POISON, PeerProcess, digest
from wait_helpers import wait_for

MB = 1 << 20
AUX11 = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
SLOT = 1 << 20
POOL = 4 * SLOT
REGION = 96 * MB  # receiver bytes per sender
GAP = 64  # poison between destination pieces
FAIR_ROUNDS = 12


def _engine(**kw):
    opts = dict(fabric="tcp", rails=1, relay_slot_bytes=SLOT, fabric_options={"connections_per_peer": 1},
                handshake_timeout=30.0, timeout=300.0)
    opts.update(kw)
    return TransferEngine(**opts)


def _plan(seed: int, idx: int):
    """Sender ``idx``'s source bytes and batches [(name, src offsets, dst offsets, lengths)] (dst offsets inside
    its ``REGION``), the same in the sender's process and in the test's."""
    rng = np.random.default_rng([seed, idx])
    shapes = [("aux11", AUX11), ("64Bx4096", [64] * 4096), ("64KBx1024", [65536] * 1024),
              ("mix2000", rng.integers(1, 8193, 2000).tolist() + [2 * MB] * 8)]
    total = sum(sum(lens) for _, lens in shapes)
    src = np.frombuffer(rng.bytes(total), dtype=np.uint8).copy()
    batches, s_pos, d_pos = [], 0, 0
    for name, lens in shapes:
        lens = np.asarray(lens, dtype=np.int64)
        s_offs = s_pos + np.cumsum(lens) - lens
        s_pos += int(lens.sum())
        order = rng.permutation(lens.size)  # destinations in shuffled order, a gap after each
        d_offs = np.empty_like(lens)
        for i in order:
            d_offs[i] = d_pos
            d_pos += int(lens[i]) + GAP
        batches.append((name, s_offs, d_offs, lens))
    assert d_pos <= REGION, d_pos
    return src, batches


def _expected(seed: int, idx: int) -> np.ndarray:
    src, batches = _plan(seed, idx)
    img = np.full(REGION, POISON, dtype=np.uint8)
    for _, so, do, ln in batches:
        for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist()):
            img[d:d + n] = src[s:s + n]
    return img


def _senders_main(conn, seed: int, first: int, count: int, session: str, base: int, fair_rounds: int):
    """A process of ``count`` sender engines (ids ``first`` ..). Command ``run``: each writes its batches into its
    region, all engines at once. Command ``fair``: ``fair_rounds`` more 4096 x 64 B batches (over the same bytes),
    all engines at once; returns per engine its batch times (s) of those rounds. The test starts ``fair`` in every
    process only when all have finished ``run``, so that the rounds timed compete with each other and not with
    another sender's 1 MiB chunks of its larger batches."""
    import threading
    from transport.peer_process import serve

    state = {}

    def start():
        state["engines"] = [_engine() for _ in range(count)]
        state["plans"] = [None] * count
        return {}

    def run_one(i, eng, errors, barrier):
        try:
            src, batches = _plan(seed, first + i)
            eng.register(src.ctypes.data, src.nbytes)
            dst0 = base + (first + i) * REGION
            barrier.wait()
            for _, so, do, ln in batches:
                eng.batch_write(session, (src.ctypes.data + so).tolist(), (dst0 + do).tolist(), ln.tolist())
            _, so, do, ln = batches[1]
            state["plans"][i] = (src, (src.ctypes.data + so).tolist(), (dst0 + do).tolist(), ln.tolist())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(f"sender {first + i}: {type(e).__name__}: {e}")

    def fair_one(i, eng, times, errors, barrier):
        try:
            _, s_l, d_l, l_l = state["plans"][i]
            barrier.wait()
            for _ in range(fair_rounds):
                t0 = time.perf_counter()
                eng.batch_write(session, s_l, d_l, l_l)
                times.append(time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(f"sender {first + i}: {type(e).__name__}: {e}")

    def handle(cmd, kw):
        if cmd not in ("run", "fair"):
            raise ValueError(cmd)
        engines = state["engines"]
        times = [[] for _ in engines]
        errors = []
        barrier = threading.Barrier(len(engines))
        threads = [threading.Thread(target=run_one, args=(i, e, errors, barrier)) if cmd == "run" else
                   threading.Thread(target=fair_one, args=(i, e, times[i], errors, barrier))
                   for i, e in enumerate(engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"times": times, "errors": errors, "credit_waits": [e.stats()["credits"]["waits"] for e in engines]}

    def close():
        for e in state["engines"]:
            e.close()

    serve(conn, start, handle, close)


def _pool_stats(eng):
    return eng.receiver.stats()["landing_pools"]


@pytest.mark.slow
def test_fan_in_64_senders_in_8_processes():
    """64 sender engines in 8 processes write mixed batches into one receiver whose pool has 4 slots: every
    byte lands where it belongs (poison between and around), the receiver's landing memory is what it was with one
    sender, and no sender's p99 batch time of the chunked rounds exceeds 3x the median sender's."""
    procs_n, per = 8, 8
    n = procs_n * per
    rx = _engine(landing_bytes=POOL)
    mem = np.full(n * REGION, POISON, dtype=np.uint8)
    procs = []
    try:
        rx.register(mem.ctypes.data, mem.nbytes)
        # one sender first: the landing memory it costs
        one = PeerProcess(_senders_main, (SEED, 0, 1, rx.session_id, mem.ctypes.data, 0), name="pxn-sender-1")
        try:
            out = one.call("run", timeout=300)
            assert not out["errors"], out["errors"]
        finally:
            one.close()
        landing_one = rx.receiver.landing_bytes_registered()
        assert landing_one == POOL
        assert np.array_equal(mem[:REGION], _expected(SEED, 0))
        mem[:REGION] = POISON
        for p in range(procs_n):
            procs.append(PeerProcess(_senders_main, (SEED, p * per, per, rx.session_id, mem.ctypes.data,
                                                     FAIR_ROUNDS), name=f"pxn-senders-{p}"))
        outs = []
        for cmd in ("run", "fair"):  # every process ends its large batches before any times its rounds
            for p in procs:
                p._conn.send((cmd, {}))
            outs = []
            for p in procs:
                assert p._conn.poll(600), f"{p.name} did not finish {cmd}"
                msg = p._conn.recv()
                assert msg["ok"], msg.get("error")
                outs.append(msg["value"])
            errors = [e for o in outs for e in o["errors"]]
            assert not errors, errors[:5]
        assert rx.stats()["receiver"]["senders"] >= n
        assert rx.receiver.landing_bytes_registered() == landing_one  # the same with 64 senders as with one
        for i in range(n):
            got = mem[i * REGION:(i + 1) * REGION]
            exp = _expected(SEED, i)
            if not np.array_equal(got, exp):
                bad = np.nonzero(got != exp)[0]
                raise AssertionError(f"sender {i}: {bad.size} wrong byte(s), first at {int(bad[0])}")
        times = [t for o in outs for t in o["times"]]
        p99 = [float(np.percentile(t, 99)) for t in times]
        med = statistics.median(statistics.median(t) for t in times)
        r = rx.stats()["receiver"]
        print(f"fan-in: median sender's median {med * 1e3:.1f} ms, worst p99 {max(p99) * 1e3:.1f} ms, "
              f"grants {r.get('grants')}, credit requests {r.get('credit_requests')}, sender credit waits "
              f"{sum(w for o in outs for w in o['credit_waits'])}")
        assert max(p99) <= 3 * med, (max(p99), med)
    finally:
        for p in procs:
            p.close()
        rx.close()


@pytest.mark.slow
def test_fan_out_one_sender_into_32_receivers():
    """One sender writes the mixed batches into 32 receivers (one region each), byte-exact."""
    n = 32
    rxs, mems = [], []
    tx = _engine()
    try:
        src, batches = _plan(SEED, 1000)
        tx.register(src.ctypes.data, src.nbytes)
        for _ in range(n):
            rx = _engine(landing_bytes=POOL)
            mem = np.full(REGION, POISON, dtype=np.uint8)
            rx.register(mem.ctypes.data, mem.nbytes)
            rxs.append(rx)
            mems.append(mem)
        handles = []
        for _, so, do, ln in batches:
            for rx, mem in zip(rxs, mems):
                handles.append(tx.batch_write_async(rx.session_id, (src.ctypes.data + so).tolist(),
                                                    (mem.ctypes.data + do).tolist(), ln.tolist()))
        for h in handles:
            h.wait()
        exp = _expected(SEED, 1000)
        for i, mem in enumerate(mems):
            assert np.array_equal(mem, exp), f"receiver {i}"
            assert rxs[i].receiver.landing_bytes_registered() == POOL
    finally:
        tx.close()
        for rx in rxs:
            rx.close()


def _streamer_main(conn, session: str, base: int, nbytes: int):
    """A sender that writes chunked batches without end (until killed)."""
    import threading
    from transport.peer_process import serve
    state = {}

    def start():
        eng = state["eng"] = _engine()
        src = state["src"] = np.frombuffer(os.urandom(nbytes), dtype=np.uint8).copy()
        eng.register(src.ctypes.data, nbytes)

        def loop():
            lens = [64] * (nbytes // 128)
            s_l = [src.ctypes.data + 128 * i for i in range(len(lens))]
            d_l = [base + 128 * i for i in range(len(lens))]
            while True:
                eng.batch_write(session, s_l, d_l, lens)

        threading.Thread(target=loop, daemon=True).start()
        return {"pid": os.getpid()}

    serve(conn, start, lambda cmd, kw: None, lambda: None)


@pytest.mark.slow
def test_dead_sender_credits_come_back():
    """A sender killed while it streams chunks held credits; within the liveness sweep they are all back in the
    pool, and a new sender writes byte-exact."""
    rx = _engine(landing_bytes=POOL)
    mem = np.full(4 * MB, POISON, dtype=np.uint8)
    rx.register(mem.ctypes.data, mem.nbytes)
    proc = None
    try:
        proc = PeerProcess(_streamer_main, (rx.session_id, mem.ctypes.data, 2 * MB), name="pxn-streamer")
        wait_for(lambda: sum(p["slots"] - p["free"] for p in _pool_stats(rx)), "the streamer holding a credit",
                 timeout=60)
        os.kill(proc.ready["pid"], signal.SIGKILL)
        proc.proc.join(10)
        # the sweep runs every second; a killed peer's sockets end at once
        wait_for(lambda: all(p["free"] == p["slots"] and not p["waiting"] for p in _pool_stats(rx)),
                 "every landing slot free and nobody waiting after the kill", timeout=10, interval=0.05)
        tx = _engine()
        try:
            src = np.frombuffer(os.urandom(1 * MB), dtype=np.uint8).copy()
            tx.register(src.ctypes.data, src.nbytes)
            lens = [64] * 4096
            tx.batch_write(rx.session_id, [src.ctypes.data + 64 * i for i in range(4096)],
                           [mem.ctypes.data + 2 * MB + 64 * i for i in range(4096)], lens)
            assert np.array_equal(mem[2 * MB:2 * MB + 4096 * 64], src[:4096 * 64])
        finally:
            tx.close()
    finally:
        if proc is not None:
            proc.close()
        rx.close()


def test_hello_with_huge_slot_size_costs_no_more_than_the_cap():
    """A hello announcing 64 MB slots (the most a hello may say) and 65535 credits gets slots of the pool's size, at
    most the pool's slot count of credits, and costs no landing memory beyond the pool (registered once, at the
    first hello)."""
    rx = _engine(landing_bytes=POOL)
    try:
        rep = None
        sizes = []
        for i in range(3):
            # an authenticated control connection (the engine's own secret), as a sender's
            rep = query(rx.session_id, {"op": "hello", "engine_id": 1000 + i, "session": f"huge:{i}",
                                        "rail_ids": [f"127.0.0.1:{60000 + i}"], "credit_addr": 4096,
                                        "credit_rkeys": [1], "credit_slots": 0xFFFF, "slot_bytes": 64 * MB},
                        timeout=10)
            assert rep["ok"], rep
            sizes.append(rx.receiver.landing_bytes_registered())
        assert rep["landing_slot_bytes"] == SLOT and rep["landing_slots"] == POOL // SLOT
        assert sizes == [POOL] * 3
        # grants of a hello fit the pool: nothing beyond its slots is ever lent
        pools = _pool_stats(rx)
        assert all(0 <= p["free"] <= p["slots"] == POOL // SLOT for p in pools)
    finally:
        rx.close()


def test_peer_with_smaller_pool_slots_keeps_its_batches_inline_after_warm_up(seed):
    """A receiver whose pool slots are smaller than the sender's chunks (ipc: 64 MiB relay slots, a 32 MiB pool)
    gives the sender a planner of its own for that peer. Every route to the peer plans with it: a batch over a
    region per piece goes inline on the rails the planner picks (both when it splits the batch) once each rail
    learned the peer's regions, batch after batch, never declined (the inline and posted routes pick the same
    rails, so what the posted route taught a rail is what the inline route asks of it). Byte-exact, poison around
    every piece."""
    from engine_helpers import EnginePeer, spy_taken
    from transport.fabric.ipc import IpcFabric
    try:
        peer = EnginePeer(MB, fabric="ipc", landing_bytes=32 << 20)
    except RuntimeError as e:
        pytest.skip(f"ipc fabric unavailable here: {e}")
    rng = np.random.default_rng(seed)
    with pytest.MonkeyPatch.context() as mp:
        taken = spy_taken(mp, IpcFabric, "write_inline_regions")
        try:
            lengths = [1, 63, 4097] + rng.integers(48 << 10, 96 << 10, 29).tolist()
            rng.shuffle(lengths)
            with TransferEngine(fabric="ipc", loadstore=False, rails=2) as eng:
                bufs = [np.frombuffer(rng.bytes(n + 32), dtype=np.uint8).copy() for n in lengths]
                for b in bufs:
                    eng.register(b)
                extras = [peer.call("register_extra", size=n + 32, device=-1) for n in lengths]
                offs = rng.integers(0, 32, (2, len(lengths)))
                srcs = np.array([b.ctypes.data + int(o) for b, o in zip(bufs, offs[0])], dtype=np.int64)
                dsts = np.array([a + int(o) for a, o in zip(extras, offs[1])], dtype=np.int64)
                ln = np.asarray(lengths, dtype=np.int64)
                warm = 0
                while taken[-2:] != [True, True]:
                    assert warm < 10, f"the rails did not learn the peer's regions: {taken}"
                    eng.batch_write(peer.session, srcs, dsts, ln)
                    warm += 1
                assert eng._peer(peer.session).planner is not None  # the peer's own planner is in use
                for round_ in range(4):
                    for b in bufs:
                        b[:] = np.frombuffer(rng.bytes(b.size), dtype=np.uint8)
                    peer.poison()
                    before = len(taken)
                    eng.batch_write(peer.session, srcs, dsts, ln)
                    # inline on the rails the planner picked: both when it splits the batch, one when the rails'
                    # load at that moment sends it whole; never a decline
                    new = taken[before:]
                    assert new and all(new), f"round {round_}: an inline write declined: {taken}"
                    for k, a in enumerate(extras):
                        img = np.full(lengths[k] + 32, POISON, dtype=np.uint8)
                        img[offs[1][k]:offs[1][k] + lengths[k]] = bufs[k][offs[0][k]:offs[0][k] + lengths[k]]
                        assert peer.call("extra_digest", addr=a) == digest(img), f"piece {k} differs"
        finally:
            peer.close()


def test_notifies_are_bounded_in_bytes(monkeypatch, seed):
    """Notifies queue per engine up to a byte budget counted in UTF-8 bytes plus a cost per entry: multi-byte
    text counts for its bytes, not its characters, and the oldest go first, the newest is always kept."""
    from transport import reads
    monkeypatch.setattr(reads, "_MAX_NOTIFY_BYTES", 64 << 10)
    rng = np.random.default_rng(seed)
    with _engine() as eng:
        sent = []
        for i in range(64):
            msg = "€" * int(rng.integers(1000, 3000))  # 3 bytes each in UTF-8
            sent.append((f"n{i}", msg))
            assert reads.serve_op(eng, {"op": "notify", "name": f"n{i}", "msg": msg}) == {"ok": True}
        got = reads.take_notifies(eng)
    assert got == sent[-len(got):] and got[-1] == sent[-1]
    held = sum(len(n.encode()) + len(m.encode()) + reads._NOTIFY_ENTRY_BYTES for n, m in got)
    assert held <= 64 << 10 < held + len(sent[-len(got) - 1][1].encode()) + 200


def test_chunks_beyond_a_senders_credits_are_not_queued():
    """The receiver queues at most one chunk per credit a sender may hold (``SenderState.queue_cap``): a sender
    whose chunks exceed that has nothing more queued for it, and the excess is counted."""
    rx, tx = _engine(landing_bytes=POOL), _engine()
    try:
        mem = np.zeros(MB, dtype=np.uint8)
        src = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
        rx.register(mem.ctypes.data, mem.nbytes)
        tx.register(src.ctypes.data, src.nbytes)
        tx.batch_write(rx.session_id, [src.ctypes.data + 64 * i for i in range(64)],
                       [mem.ctypes.data + 128 * i for i in range(64)], [64] * 64)
        st = next(iter(rx.receiver._senders.values()))
        assert st.queue_cap == st.slots * len(st.rail_ids) >= 1
        st.chunks_queued = st.queue_cap  # as if that many chunks waited for the progress loop
        before = rx.stats()["receiver"].get("chunks_over_credits", 0)
        rx.receiver.on_chunk(0, st.rail_ids[0], 0, 4096)
        assert rx.stats()["receiver"].get("chunks_over_credits", 0) == before + 1
        assert st.chunks_queued == st.queue_cap
        st.chunks_queued = 0
    finally:
        tx.close()
        rx.close()


def test_idle_credits_go_back_and_come_again():
    """A sender's credits unused for ``CREDIT_IDLE_S`` go back to the receiver's pool (every slot free there); its
    next chunked batches ask again and land byte-exact."""
    from transport.fills import CREDIT_IDLE_S
    rx, tx = _engine(landing_bytes=POOL), _engine()
    try:
        mem = np.full(2 * MB, POISON, dtype=np.uint8)
        src = np.frombuffer(os.urandom(MB), dtype=np.uint8).copy()
        rx.register(mem.ctypes.data, mem.nbytes)
        tx.register(src.ctypes.data, src.nbytes)
        s_l = [src.ctypes.data + 128 * i for i in range(4096)]
        d_l = [mem.ctypes.data + 256 * i + 7 for i in range(4096)]
        lens = [64] * 4096
        tx.batch_write(rx.session_id, s_l, d_l, lens)
        wait_for(lambda: tx.stats()["credits"]["returned_idle"], "credits returned for idleness",
                 timeout=20 * CREDIT_IDLE_S + 5, interval=CREDIT_IDLE_S / 10)
        assert all(p["free"] == p["slots"] for p in _pool_stats(rx)), _pool_stats(rx)
        for round_ in range(2):
            src[:] = np.frombuffer(os.urandom(MB), dtype=np.uint8)
            asked = tx.stats()["credits"]["requests"]
            tx.batch_write(rx.session_id, s_l, d_l, lens)
            exp = np.full(2 * MB, POISON, dtype=np.uint8)
            for i in range(4096):
                exp[256 * i + 7:256 * i + 71] = src[128 * i:128 * i + 64]
            assert np.array_equal(mem, exp), f"round {round_}"
            if round_ == 0:  # it held no credit: it asked the receiver again
                assert tx.stats()["credits"]["requests"] > asked
    finally:
        tx.close()
        rx.close()
