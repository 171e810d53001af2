"""End-to-end engine tests: two processes, tcp fabric, host memory (the CI acceptance cases).

Every case writes fresh random data (seeded by suite_env.SEED) into a poisoned peer buffer and compares the
peer's WHOLE buffer (guards included) with the expected image, so stray writes anywhere are caught.
"""
import collections
import hashlib
import json
import os
import re
import threading
import time

import numpy as np
import pytest

from engine_helpers import GUARD, EnginePeer, Expected, disjoint_offsets, spy_taken, write_and_check
from wait_helpers import wait_equal, wait_for
from transport import (InvalidTransfer, PeerGone, RemoteRejected, TransferEngine, TransferError, TransferTimeout,
                       UnknownSession)

MB = 1 << 20
SHAPES_FILE = os.path.join(os.path.dirname(__file__), "..", "transport", "data", "sglang_shapes.json")
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
BLOCK_1K = 2359296
PEER_BYTES = 78 * BLOCK_1K + 8 * MB
SRC_BYTES = PEER_BYTES


@pytest.fixture(scope="module")
def peer():
    p = EnginePeer(PEER_BYTES, fabric="tcp")
    yield p
    p.close()


@pytest.fixture(scope="module")
def sender():
    eng = TransferEngine(fabric="tcp")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def src(sender):
    from suite_env import SEED
    rng = np.random.default_rng(SEED)
    buf = np.frombuffer(rng.bytes(SRC_BYTES), dtype=np.uint8).copy()
    sender.register(buf)
    return buf


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def run_case(sender, peer, src, src_offs, dst_offs, lengths, timeout=120.0):
    """Poison the peer, write, compare its whole buffer with the expected image."""
    write_and_check(sender, peer, src.ctypes.data, src, src_offs, dst_offs, lengths, timeout)


# --- the sglang shapes ---------------------------------------------------------------------------------------
def test_shapes_file_matches():
    """The packaged sglang shapes are the field file (its digest) and agree with the shapes these tests use."""
    with open(SHAPES_FILE, "rb") as f:
        raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == "58895113ad6e3e78bf14fb11eb007fc09c38cb78baa5834365793df162e49987"
    shapes = json.loads(raw)
    assert shapes["calls"]["aux_metadata"]["lengths"] == AUX
    assert shapes["calls"]["mla_latent_1k"]["length"] == BLOCK_1K


def test_aux_batch(sender, peer, src, rng):
    src_offs = disjoint_offsets(rng, AUX, 1 << 20)
    dst_offs = disjoint_offsets(rng, AUX, 1 << 20)
    run_case(sender, peer, src, src_offs, dst_offs, AUX)


def test_78_blocks_1k(sender, peer, src, rng):
    lengths = [BLOCK_1K] * 78
    src_offs = np.arange(78) * BLOCK_1K
    dst_offs = rng.permutation(78) * BLOCK_1K  # layers land in a shuffled order
    t0 = time.perf_counter()
    run_case(sender, peer, src, src_offs, dst_offs, lengths)
    assert time.perf_counter() - t0 < 60


def test_78_blocks_then_aux_like_sglang(sender, peer, src, rng):
    """sglang sends the KV blocks, then the aux batch, as two calls into the same peer."""
    peer.poison()
    exp = Expected(peer.size)
    kv_dst = np.arange(20) * BLOCK_1K
    exp.apply(src, kv_dst, kv_dst, [BLOCK_1K] * 20)
    aux_dst = 20 * BLOCK_1K + disjoint_offsets(rng, AUX, 1 << 20)
    aux_src = 40 * BLOCK_1K + disjoint_offsets(rng, AUX, 1 << 20)
    exp.apply(src, aux_src, aux_dst, AUX)
    b = src.ctypes.data
    sender.batch_write(peer.session, [b + int(o) for o in kv_dst], [peer.base + int(o) for o in kv_dst],
                       [BLOCK_1K] * 20)
    sender.batch_write(peer.session, [b + int(o) for o in aux_src], [peer.base + int(o) for o in aux_dst], AUX)
    peer.check(exp)


def test_4096_x_64B(sender, peer, src, rng):
    lengths = [64] * 4096
    run_case(sender, peer, src, disjoint_offsets(rng, lengths, 4 * MB), disjoint_offsets(rng, lengths, 4 * MB),
             lengths)
    st = sender.stats()
    assert st["paths"]["coalesced"]["chunks"] >= 1


def test_random_mix_with_2MB_blocks(sender, peer, src, rng):
    small = rng.integers(1, 8193, size=1500).tolist()
    lengths = small + [2 * MB] * 6
    order = rng.permutation(len(lengths))
    lengths = [lengths[i] for i in order]
    space = 24 * MB
    run_case(sender, peer, src, disjoint_offsets(rng, lengths, space), disjoint_offsets(rng, lengths, space),
             lengths)


def test_page_scattered_mha(sender, peer, src, rng):
    """Llama-3-8B MHA shape: 2 KiB per token, pages scattered on both sides (K and V of a few layers)."""
    n = 8192
    lengths = [2048] * n
    src_offs = rng.permutation(n) * 2048  # page-granular scatter on both sides
    dst_offs = rng.permutation(n) * 2048 + 4096
    run_case(sender, peer, src, src_offs, dst_offs, lengths)


def test_unaligned_pieces_and_odd_sizes(sender, peer, src, rng):
    lengths = [1, 3, 15, 17, 65535, 65536, 65537, 1 * MB + 3, 7]
    run_case(sender, peer, src, disjoint_offsets(rng, lengths, 8 * MB) + 1, disjoint_offsets(rng, lengths, 8 * MB) + 3,
             lengths)


def test_relayed_path_through_host_slots(peer, src, rng):
    """relay="always": every large piece is copied into a relay slot first (the PXN path), byte-exact."""
    with TransferEngine(fabric="tcp", relay="always", relay_slot_bytes=512 * 1024, relay_slots=2) as eng:
        eng.register(src)
        lengths = rng.integers(64 * 1024, 3 * MB, size=40).tolist() + [64] * 100
        run_case(eng, peer, src, disjoint_offsets(rng, lengths, 150 * MB), disjoint_offsets(rng, lengths, peer.size),
                 lengths)
        st = eng.stats()
    assert st["paths"]["relayed"]["bytes"] == sum(x for x in lengths if x >= 64 * 1024)
    assert st["paths"]["direct"]["units"] == 0


def test_larger_coalesce_than_the_peers_landing_slots(src, rng):
    """A sender that coalesces pieces up to 2 MiB into 4 MiB chunks, to a peer whose landing slots are 1 MiB: the
    handshake succeeds, the pieces that fit the peer's chunks are coalesced, larger ones go direct, byte-exact."""
    small = EnginePeer(64 * MB, fabric="tcp", relay_slot_bytes=MB)
    try:
        with TransferEngine(fabric="tcp", coalesce_bytes=2 * MB + 1, relay_slot_bytes=4 * MB) as eng:
            eng.register(src)
            lengths = [1, 63, 4096] + rng.integers(64, 64 * 1024, size=300).tolist() \
                + rng.integers(MB - 256, 2 * MB, size=6).tolist() + [2 * MB]
            run_case(eng, small, src, disjoint_offsets(rng, lengths, 150 * MB),
                     disjoint_offsets(rng, lengths, small.size), lengths)
            st = eng.stats()
    finally:
        small.close()
    assert st["paths"]["coalesced"]["units"] >= 1 and st["paths"]["direct"]["units"] >= 1, st["paths"]


# --- invalid destinations and bad input: named errors, nothing written --------------------------------------
def test_destination_outside_registered_memory_writes_nothing(sender, peer, src, rng):
    peer.poison()
    b = src.ctypes.data
    # valid small + large pieces, and one piece that runs 1 byte past the end of the registered region
    srcs = [b, b + 4096, b + 8 * MB]
    dsts = [peer.base, peer.base + 4096, peer.base + peer.size - 100]
    lens = [64, 3 * MB, 101]
    with pytest.raises(InvalidTransfer, match=r"dsts\[2\].*outside"):
        sender.batch_write(peer.session, srcs, dsts, lens)
    # entirely outside (in the guard below the region)
    with pytest.raises(InvalidTransfer, match="outside"):
        sender.batch_write(peer.session, [b, b + 64], [peer.base, peer.base - GUARD // 2], [64, 64])
    time.sleep(0.2)  # the scenario: a window in which a wrongly sent piece would land (a write that must never
    # happen has no event to wait on)
    peer.check(Expected(peer.size))  # all poison: not even the batch's valid pieces were written


@pytest.mark.parametrize("case", ["mismatched", "negative", "unregistered_src", "src_past_region", "not_int"])
def test_bad_input_raises_named_errors(sender, peer, src, case):
    peer.poison()
    b = src.ctypes.data
    args = {
        "mismatched": ([b, b + 64], [peer.base], [64, 64]),
        "negative": ([b], [peer.base], [-5]),
        "unregistered_src": ([b - (64 * MB)], [peer.base], [64]),
        "src_past_region": ([b + SRC_BYTES - 10], [peer.base], [64]),
        "not_int": ([b], [float(peer.base)], [64]),
    }[case]
    with pytest.raises(InvalidTransfer) as info:
        sender.batch_write(peer.session, *args)
    assert str(info.value)
    peer.check(Expected(peer.size))


@pytest.mark.parametrize("fabric", ["tcp", "ipc-loadstore", "ipc-message"])
def test_unequal_pieces_ending_at_both_regions_last_byte(peer, ipc_peer, src, rng, fabric):
    """The last-starting piece is short and a long one ends at each region's last byte, so the largest start plus
    the longest length lies past both regions while every piece is inside: accepted and byte-exact on each path
    (the validation's wide span must give way to the pieces' own); the same batch one byte longer is refused,
    naming the piece, with nothing written."""
    target = peer if fabric == "tcp" else ipc_peer
    kwargs = {"fabric": "tcp"} if fabric == "tcp" else {"fabric": "ipc", "loadstore": fabric == "ipc-loadstore"}
    long_ = int(rng.integers(1000, 5000))
    lengths = [long_, 7, 50]
    src_offs = np.array([SRC_BYTES - 50 - long_, 3 * long_, SRC_BYTES - 50], dtype=np.int64)
    dst_offs = np.array([target.size - 50 - long_, 5 * long_, target.size - 50], dtype=np.int64)
    with TransferEngine(**kwargs) as eng:
        eng.register(src)
        run_case(eng, target, src, src_offs, dst_offs, lengths)
        target.poison()
        b = src.ctypes.data
        with pytest.raises(InvalidTransfer, match=r"dsts\[2\] = .* \+ lengths\[2\] = 51 is outside"):
            eng.batch_write(target.session, (b + src_offs - 1).tolist(), (target.base + dst_offs).tolist(),
                            [long_, 7, 51])
    time.sleep(0.1)  # the scenario: a window in which a wrongly sent piece would land (no event for "never")
    target.check(Expected(target.size))


def test_unknown_session(sender, src):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    b = src.ctypes.data
    with pytest.raises(UnknownSession, match=str(port)):
        sender.batch_write(f"127.0.0.1:{port}", [b], [b], [64])
    with pytest.raises(UnknownSession):
        sender.batch_write("no-port-here", [b], [b], [64])


def test_empty_batch_is_a_no_op(sender, peer):
    sender.batch_write(peer.session, [], [], [])


# --- the receiver's own checks --------------------------------------------------------------------------------
def test_receiver_rejects_chunk_into_deregistered_region(sender, peer, src):
    """The sender's region list is stale (the peer deregistered after the sender learnt it): the receiver's
    validation must refuse the chunk, fail the batch with RemoteRejected, and write nothing."""
    peer.poison()
    extra = peer.call("register_extra", size=1 * MB)
    b = src.ctypes.data
    sender.batch_write(peer.session, [b], [extra], [64])  # refreshes the sender's view of the peer's regions
    peer.call("poison")
    clean = peer.call("extra_digest", addr=extra)
    peer.call("deregister", addr=extra)
    with pytest.raises(RemoteRejected, match="outside every region"):
        sender.batch_write(peer.session, [b + i * 128 for i in range(100)], [extra + i * 64 for i in range(100)],
                           [64] * 100)
    assert peer.call("extra_digest", addr=extra) == clean
    with pytest.raises(RemoteRejected):  # a large (direct) write is refused by the fabric's rkey check
        sender.batch_write(peer.session, [b], [extra], [512 * 1024])
    assert peer.call("extra_digest", addr=extra) == clean
    peer.check(Expected(peer.size))
    assert peer.call("stats")["receiver"]["rejected"] >= 1


def test_source_deregistered_between_validation_and_post_fails_and_writes_nothing(peer, rng, monkeypatch):
    """A source buffer deregistered (by another thread) after the batch was validated but before its direct
    writes are built: the batch fails naming the source, and nothing reaches the peer."""
    own = np.frombuffer(rng.bytes(4 * MB), dtype=np.uint8).copy()
    with TransferEngine(fabric="tcp", coalesce_bytes=0, relay="never") as eng:
        eng.register(own)
        eng.batch_write(peer.session, [own.ctypes.data], [peer.base], [64])  # handshake first
        peer.poison()
        real_plan = eng.data_path.planner.plan

        def plan_then_deregister(*args, **kwargs):
            units = real_plan(*args, **kwargs)
            eng.deregister(own.ctypes.data)
            return units

        monkeypatch.setattr(eng.data_path.planner, "plan", plan_then_deregister)
        with pytest.raises(InvalidTransfer, match="deregistered during the transfer"):
            eng.batch_write(peer.session, [own.ctypes.data + i * 65536 for i in range(3)],
                            [peer.base + i * 65536 for i in range(3)], [65536, 1, 4097])
    peer.check(Expected(peer.size))


@pytest.mark.parametrize("refusal", ["region", "local", "link"])
def test_post_refused_by_the_fabric(peer, rng, monkeypatch, refusal):
    """The fabric refuses a post: a region error fails the batch as RemoteRejected, a local check (ValueError) as
    InvalidTransfer, both writing nothing; a broken link fails the rail over and the batch completes on the other."""
    from transport.errors import RegionError
    own = np.frombuffer(rng.bytes(4 * MB), dtype=np.uint8).copy()
    with TransferEngine(fabric="tcp", rails=2, coalesce_bytes=0, relay="never") as eng:
        eng.register(own)
        eng.batch_write(peer.session, [own.ctypes.data], [peer.base], [64])  # handshake first
        peer.poison()
        fab = eng.fabrics[0]
        real_post = fab.post_writes
        raised = []

        def refuse(ep, requests):
            if not raised:
                raised.append(refusal)
                raise {"region": RegionError("rkey 0x1 unknown"), "local": ValueError("lkey 0x2 unknown"),
                       "link": OSError(104, "connection reset")}[refusal]
            return real_post(ep, requests)

        monkeypatch.setattr(fab, "post_writes", refuse)
        lengths = [65536, 70000, 1 << 20]
        srcs = [own.ctypes.data + i * (1 << 20) + 7 for i in range(3)]
        dsts = [peer.base + i * (2 << 20) + 3 for i in range(3)]
        if refusal == "link":
            exp = Expected(peer.size)
            exp.apply(own, [s - own.ctypes.data for s in srcs], [d - peer.base for d in dsts], lengths)
            eng.batch_write(peer.session, srcs, dsts, lengths)
            assert raised and eng.stats()["failover"]["rail_failures"] >= 1
            peer.check(exp)
            return
        want, text = (RemoteRejected, "post refused: rkey") if refusal == "region" else \
            (InvalidTransfer, "post refused locally: lkey")
        with pytest.raises(want, match=text):
            eng.batch_write(peer.session, srcs, dsts, lengths)
    peer.check(Expected(peer.size))


def test_region_list_refreshes_when_peer_registers_more(sender, peer, src):
    extra = peer.call("register_extra", size=2 * MB)
    b = src.ctypes.data
    sender.batch_write(peer.session, [b, b + 4096], [extra, extra + MB], [100, MB])
    assert sender.stats()["time_s"].get("validate", 0) > 0


# --- concurrency --------------------------------------------------------------------------------------------
def test_8_threads_x_50_batches(sender, peer, src, rng):
    peer.poison()
    exp = Expected(peer.size)
    threads, errors = [], []
    per_thread = peer.size // 8
    plans = []
    for t in range(8):
        batches = []
        space = per_thread // 50
        for k in range(50):
            n = int(rng.integers(1, 25))
            lens = rng.integers(1, 8193, size=n).tolist()
            if k % 5 == 0:
                lens.append(int(rng.integers(65536, 256 * 1024)))
            base = t * per_thread + k * space
            d = base + disjoint_offsets(rng, lens, space)
            s = disjoint_offsets(rng, lens, SRC_BYTES // 8) + t * (SRC_BYTES // 8)
            exp.apply(src, s, d, lens)
            batches.append((s, d, lens))
        plans.append(batches)
    b = src.ctypes.data

    def worker(batches):
        try:
            for s, d, lens in batches:
                sender.batch_write(peer.session, [b + int(x) for x in s], [peer.base + int(x) for x in d], lens,
                                   timeout=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    for batches in plans:
        th = threading.Thread(target=worker, args=(batches,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]
    peer.check(exp)


def test_async_handles(sender, peer, src, rng):
    peer.poison()
    exp = Expected(peer.size)
    b = src.ctypes.data
    handles = []
    for k in range(6):
        lens = [4096] * 50 + [300 * 1024]
        d = k * 4 * MB + disjoint_offsets(rng, lens, 4 * MB)
        s = disjoint_offsets(rng, lens, 16 * MB)
        exp.apply(src, s, d, lens)
        handles.append(sender.batch_write_async(peer.session, [b + int(x) for x in s],
                                                [peer.base + int(x) for x in d], lens))
    for h in handles:
        h.wait(60)
        assert h.done()
    peer.check(exp)


# --- failover -----------------------------------------------------------------------------------------------
def _thread_kinds() -> collections.Counter:
    """pxn threads of this process by kind: ``pxn-``, the next word and its dash (``pxn-copy-``, ``pxn-receiver``)."""
    return collections.Counter(re.match(r"pxn-[a-z]*-?", t.name).group(0) for t in threading.enumerate()
                               if t.name.startswith("pxn-"))


def test_rail_killed_mid_batch_fails_over(peer, src, rng):
    """A rail aborted mid-batch: its units are re-dispatched on the other, the batch lands whole. Also the threads
    a two-rail tcp engine runs: one progress thread (the receiver's chunks, and for both rails, since tcp reports
    completions by callback, the failed ones and the watchdogs), one control listener, and one copy thread per
    relay ring once the ring exists (no second thread per ring; rings are made by the first relayed send, so none
    before the coalesced batch); none more after the failover."""
    peer.poison()
    threads_before = _thread_kinds()
    with TransferEngine(fabric="tcp", rails=2) as eng:
        b = src.ctypes.data
        eng.register(src)
        eng.batch_write(peer.session, [b], [peer.base], [64])  # handshake
        n = 60
        lens = [BLOCK_1K] * n + [4096] * 2000
        s = disjoint_offsets(rng, lens, SRC_BYTES)
        d = disjoint_offsets(rng, lens, peer.size)
        exp = Expected(peer.size)
        exp.apply(src, [0], [0], [64])
        exp.apply(src, s, d, lens)
        ep = eng.rail_endpoint(peer.session, 0)
        before = eng.stats()["rails"][0].get("bytes_posted", 0)

        def killer():
            # abort as soon as rail 0 has posted part of this batch (its direct pieces complete together, as one
            # unit, so waiting for a completion could find the batch done): it is mid-batch then
            try:
                wait_for(lambda: eng.stats()["rails"][0].get("bytes_posted", 0) > before,
                         "rail 0 posting part of the batch", timeout=30, interval=0.0005)
            finally:
                ep.abort()

        engine_kinds = ("pxn-copy-", "pxn-progress", "pxn-poll-", "pxn-receiver", "pxn-ctrl-", "pxn-redispatch",
                        "pxn-submit-")
        mine = _thread_kinds() - threads_before
        # the control plane: its accept loop and its selector (its worker pools start at the first request in)
        expected = {"pxn-progress": 1, "pxn-ctrl-": 2}
        assert {k: mine[k] for k in engine_kinds if mine[k]} == expected, mine
        assert eng.stats()["rings"] == {}
        th = threading.Thread(target=killer)
        th.start()
        eng.batch_write(peer.session, [b + int(x) for x in s], [peer.base + int(x) for x in d], lens, timeout=90)
        th.join()
        st = eng.stats()
        assert st["failover"]["rail_failures"] == 1
        assert st["failover"]["redispatched_units"] >= 1, st["failover"]
        mine = _thread_kinds() - threads_before
        assert 1 <= len(st["rings"]) <= 2, st["rings"]
        expected["pxn-copy-"] = len(st["rings"])
        assert {k: mine[k] for k in engine_kinds if mine[k]} == expected, mine
        peer.check(exp)
        # the surviving rail keeps working
        eng.batch_write(peer.session, [b], [peer.base + 5], [3 * MB])


def _abort_all_rails_mid_batch(eng, session, rails, src_offs, dsts, lens, base):
    """Submit a batch, abort every rail as soon as rail 0 posted part of it; return the batch's error."""
    before = eng.stats()["rails"][0].get("bytes_posted", 0)
    eps = [eng.rail_endpoint(session, r) for r in range(rails)]
    h = eng.batch_write_async(session, [base + int(x) for x in src_offs], dsts, lens, timeout=60)
    wait_for(lambda: eng.stats()["rails"][0].get("bytes_posted", 0) > before, "rail 0 posting part of the batch",
             timeout=30, interval=0.0005)
    for ep in eps:
        ep.abort()
    with pytest.raises(TransferError) as info:
        h.wait(60)
    return info.value


def _wait_until_quiet(peer, timeout: float = 20.0) -> None:
    """Wait until the peer's buffer stops changing. A failed batch's bytes may still land after the failure is
    reported (the receiver finishes messages it had already taken off the dead connections, as an RDMA NIC may
    complete writes of a QP that went to error), so a test that poisons and rewrites must let them drain."""
    deadline = time.time() + timeout
    last = peer.call("digest")
    while time.time() < deadline:
        time.sleep(0.2)  # the scenario: "quiet" is no change over this window (late bytes have no event)
        now = peer.call("digest")
        if now == last:
            return
        last = now
    raise AssertionError(f"peer buffer still changing {timeout} s after the batch failed")


def test_all_rails_dead_fails_with_every_cause_then_reconnects(peer, src, rng):
    """Every rail dies mid-batch (a network blip; the peer process lives on): the batch fails with one cause
    per rail, the engine forgets the peer, and the next batch to the same session id handshakes again and is
    byte-exact."""
    with TransferEngine(fabric="tcp", rails=2) as eng:
        eng.register(src)
        b = src.ctypes.data
        eng.batch_write(peer.session, [b], [peer.base], [64])
        lens = [BLOCK_1K] * 60 + [4096] * 2000
        s = disjoint_offsets(rng, lens, SRC_BYTES)
        d = [peer.base + int(x) for x in disjoint_offsets(rng, lens, peer.size)]
        err = _abort_all_rails_mid_batch(eng, peer.session, 2, s, d, lens, b)
        assert not isinstance(err, TransferTimeout), err
        assert len(err.causes) == 2, err
        assert "rail 0" in str(err) and "rail 1" in str(err)
        st = eng.stats()["failover"]
        assert st["peers_lost"] == 1 and st["reconnects"] == 0, st
        _wait_until_quiet(peer)
        lengths = [64] * 300 + [BLOCK_1K] * 3 + [100000]
        run_case(eng, peer, src, disjoint_offsets(rng, lengths, 32 * MB), disjoint_offsets(rng, lengths, 32 * MB),
                 lengths, timeout=30)
        st = eng.stats()
        assert st["failover"]["reconnects"] == 1, st["failover"]
        assert all(r["peers_alive"] == 1 for r in st["rails"]), st["rails"]


def test_reconnect_survives_receiver_sweep_while_rails_connect(peer, src, rng, monkeypatch):
    """After every rail died, the re-handshake's rails connect slowly (longer than the receiver's sweep period):
    the receiver must keep the sender's new landing slots meanwhile although its old endpoints are dead."""
    from transport.receiver import SWEEP_S
    with TransferEngine(fabric="tcp", rails=2) as eng:
        eng.register(src)
        b = src.ctypes.data
        eng.batch_write(peer.session, [b], [peer.base], [64])
        for rail in range(2):
            eng.rail_endpoint(peer.session, rail).abort()
        wait_equal(lambda: eng.stats()["failover"]["peers_lost"], 1, "peers lost", timeout=5)
        # the scenario needs the peer to have seen its ends of the old rails die; the receiver exposes no count of
        # dead endpoints to wait on, so this is a grace period
        time.sleep(0.2)
        connect = eng.fabrics[0].connect

        def slow_connect(desc):
            time.sleep(2.2 * SWEEP_S)  # the scenario: at least one sweep of the receiver runs before the rails connect
            return connect(desc)

        monkeypatch.setattr(eng.fabrics[0], "connect", slow_connect)
        lengths = [64] * 200 + [8192] * 20
        run_case(eng, peer, src, disjoint_offsets(rng, lengths, 8 * MB), disjoint_offsets(rng, lengths, 8 * MB),
                 lengths, timeout=30)
        assert eng.stats()["failover"]["reconnects"] == 1


def test_control_connection_drop_is_reopened(peer, src):
    """Only the control connection dies (e.g. an idle-timeout on a firewall; the rails keep their keepalive): the
    next region refresh re-opens it, the rails are kept, the batch succeeds."""
    import socket
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        b = src.ctypes.data
        eng.batch_write(peer.session, [b], [peer.base], [64])
        eng._peers[peer.session].ctrl.shutdown(socket.SHUT_RDWR)
        extra = peer.call("register_extra", size=1 * MB)  # not in the sender's list: forces a refresh
        eng.batch_write(peer.session, [b, b + 4096], [extra, extra + 4096], [64, 512 * 1024])
        st = eng.stats()["failover"]
        assert st["ctrl_reconnects"] == 1 and st["peers_lost"] == 0 and st["reconnects"] == 0, st


def _pxn_threads_but_copies() -> int:
    """pxn's threads less the relay rings' copy threads (one per ring, made by a ring's first relayed send)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("pxn-") and not t.name.startswith("pxn-copy-"))


def _copy_threads() -> int:
    """The relay rings' copy threads of this process (every engine's)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("pxn-copy-"))


def _tcp_sockets() -> int:
    """TCP sockets open in this process (spawning a peer adds a unix socket and pipes, which are not counted)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for row in rows if row.split()[9] in mine)
    return n


def test_restarted_peer_on_same_port_is_reached_again(peer, src, rng):
    """The decode process dies mid-stream and a NEW one starts on the same control port (same session id): in
    between, batches fail with PeerGone naming the loss (again and again, no poisoning); then the same
    session id reaches the new process byte-exact, and nothing of the old connection is left (threads, sockets).
    Meanwhile another peer's batches from the same engine keep succeeding, byte-exact."""
    victim = EnginePeer(64 * MB, fabric="tcp")
    session = victim.session
    port = int(session.rpartition(":")[2])
    reborn = None
    stop, errors, rounds = threading.Event(), [], [0]
    try:
        with TransferEngine(fabric="tcp") as eng:
            eng.register(src)
            b = src.ctypes.data
            run_case(eng, victim, src, [0], [0], [64])  # handshake
            # the bystander: one batch to the other peer, written again and again until the end
            peer.poison()
            by_lens = [64] * 200 + [BLOCK_1K] * 2
            by_src, by_dst = disjoint_offsets(rng, by_lens, 16 * MB), disjoint_offsets(rng, by_lens, 16 * MB)
            by_exp = Expected(peer.size)
            by_exp.apply(src, by_src, by_dst, by_lens)
            eng.batch_write(peer.session, [b + int(x) for x in by_src], [peer.base + int(x) for x in by_dst],
                            by_lens)

            def bystander():
                try:
                    while not stop.is_set():
                        eng.batch_write(peer.session, [b + int(x) for x in by_src],
                                        [peer.base + int(x) for x in by_dst], by_lens, timeout=30)
                        rounds[0] += 1
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            by = threading.Thread(target=bystander)
            threads, socks = _pxn_threads_but_copies(), _tcp_sockets()
            # copy threads of other engines in this process (the module's sender, once a test relayed through it)
            others = _copy_threads() - len(eng.stats()["rings"])
            by.start()
            lens = [BLOCK_1K] * 20 + [4096] * 2000
            srcs = [b + (i * 65536) % (SRC_BYTES - BLOCK_1K) for i in range(len(lens))]
            dsts = [victim.base + i * BLOCK_1K for i in range(20)] + [victim.base + 50 * MB + i * 4096
                                                                      for i in range(2000)]
            h = eng.batch_write_async(session, srcs, dsts, lens, timeout=60)
            time.sleep(0.005)  # the scenario: the peer dies a few ms into the batch (its 8 MB are still under way)
            victim.proc.kill()
            victim.proc.join(10)
            with pytest.raises(TransferError) as info:
                h.wait(60)
            assert not isinstance(info.value, TransferTimeout), info.value
            for _ in range(2):  # nobody listens at the session now: the same named error every time
                with pytest.raises(PeerGone, match=f"peer {session} is gone: nobody answers at its session.*"
                                                   f"previous connection was lost"):
                    eng.batch_write(session, [b], [victim.base], [64], timeout=10)
            reborn = EnginePeer(64 * MB, fabric="tcp", port=port)
            assert reborn.session == session
            lengths = AUX + [BLOCK_1K] * 4 + [64] * 500
            run_case(eng, reborn, src, disjoint_offsets(rng, lengths, 32 * MB),
                     disjoint_offsets(rng, lengths, 60 * MB), lengths)
            stop.set()
            by.join(60)
            assert not errors and rounds[0] >= 1, (errors, rounds)
            peer.check(by_exp)
            st = eng.stats()["failover"]
            assert st["peers_lost"] == 1 and st["reconnects"] == 1, st
            # the old connection's threads and sockets are gone: same count as with one connected peer before (and
            # one copy thread per relay ring, whichever rings the batches made meanwhile)
            # threads and sockets of a dead peer go away asynchronously
            wait_equal(_pxn_threads_but_copies, threads, "pxn threads but the copy threads", timeout=5)
            assert _copy_threads() - others == len(eng.stats()["rings"]) >= 1
            wait_equal(_tcp_sockets, socks, "tcp sockets of this process", timeout=5)
    finally:
        stop.set()
        victim.close()
        if reborn is not None:
            reborn.close()


# --- telemetry ----------------------------------------------------------------------------------------------
def test_stats_and_trace(peer, src, tmp_path, rng):
    trace = tmp_path / "trace.json"
    with TransferEngine(fabric="tcp", trace_path=str(trace)) as eng:
        eng.register(src)
        b = src.ctypes.data
        for _ in range(3):
            lens = [64] * 500 + [BLOCK_1K] * 4
            eng.batch_write(peer.session, [b + int(x) for x in disjoint_offsets(rng, lens, 32 * MB)],
                            [peer.base + int(x) for x in disjoint_offsets(rng, lens, 32 * MB)], lens)

        def posted_and_completed():
            # a chunk's post is counted by the ring's copy thread after its post call returns, and the batch may
            # complete before that thread runs again (a busy machine): the rail counters follow within a moment
            st = eng.stats()
            rails = st["rails"]
            if sum(r.get("writes_posted", 0) for r in rails) >= 12 + 3 and \
                    sum(r.get("bytes_completed", 0) for r in rails) >= 12 * BLOCK_1K:
                return st
            return None
        st = wait_for(posted_and_completed, "12 direct writes and 3 chunks counted as posted, 12 blocks completed")
    assert st["batches"]["ok"] == 3 and st["batches"]["failed"] == 0
    lat = st["batches"]["latency"]
    assert lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"]
    # direct pieces of one batch and rail form one unit (one post, one completion), written one piece each
    assert st["paths"]["coalesced"]["chunks"] >= 3 and st["paths"]["direct"]["units"] >= 3
    ring = st["rings"]["host/rail0"]
    assert ring["lanes"][0]["counts"]["filling"] + ring["lanes"][1]["counts"]["filling"] >= 1
    for key in ("validate", "plan", "dispatch", "wait", "fill"):
        assert key in st["time_s"], st["time_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert any(n.startswith("batch ") for n in names) and "post" in names and "gather" in names


def test_timeout_is_named(peer, src):
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        b = src.ctypes.data
        with pytest.raises(TransferTimeout):
            eng.batch_write(peer.session, [b], [peer.base], [64 * MB], timeout=1e-4)


# --- the same engine over the ipc fabric (same host, host memory) -------------------------------------------
@pytest.fixture(scope="module")
def ipc_peer():
    try:
        peer = EnginePeer(64 * MB, fabric="ipc")
    except RuntimeError as e:
        pytest.skip(f"ipc fabric unavailable here: {e}")
    yield peer
    peer.close()


@pytest.mark.parametrize("coalesce", [None, 64 << 10], ids=["fabric-default", "chunks"])
def test_ipc_fabric_end_to_end_message_path(src, rng, ipc_peer, coalesce):
    """loadstore=False, the ipc message path: by the fabric's default every piece is a direct write (no chunks);
    with ``coalesce_bytes`` set, coalesced chunks + receiver scatter + direct writes."""
    with TransferEngine(fabric="ipc", loadstore=False, coalesce_bytes=coalesce) as eng:
        assert eng.config.coalesce_bytes == (0 if coalesce is None else coalesce)
        eng.register(src)
        lengths = AUX + [BLOCK_1K] * 20 + [64] * 4096 + rng.integers(1, 8193, size=300).tolist()
        run_case(eng, ipc_peer, src, disjoint_offsets(rng, lengths, 100 * MB),
                 disjoint_offsets(rng, lengths, 64 * MB), lengths)
        st = eng.stats()
    if coalesce is None:
        assert st["paths"]["coalesced"]["chunks"] == 0
        assert st["paths"]["direct"]["bytes"] == sum(lengths)
    else:
        assert st["paths"]["coalesced"]["chunks"] >= 1 and st["paths"]["direct"]["bytes"] >= 20 * BLOCK_1K
        assert sum(r.get("writes_posted", 0) for r in st["rails"]) >= 20 + 1
    assert st["paths"]["loadstore"]["units"] == 0


def test_ipc_message_path_batches_of_arrays_are_written_by_the_poster(src, rng, ipc_peer, monkeypatch):
    """loadstore=False with numpy arrays: once a GRANT has described the peer's region, each batch of host memory
    is checked against that description, copied and completed by the calling thread, byte-exact, fresh offsets
    every round: a batch that goes whole as one unit through ``IpcFabric.write_inline``, with the extremes of the
    validation, one cut between rails as a run per rail through ``write_inline`` too (each with its own lengths'
    extremes and the batch's address spans), or, while a rail has not had the region described, as posted
    batches (``IpcFabric._post_batch_direct``). After the peer
    deregisters a region, its kept description is stale (the counter moved): ``write_inline`` declines, the batch
    goes to the peer, is refused and writes nothing; the next batches into the live region land, and the direct
    path resumes. ``taken`` holds (copied by the caller, with the validation's extremes) per call. Where the
    module's peer retired the rails' descriptions (see ``PEER_SETTLES``), two more batches are written, each
    byte-exact, before the check that the last two were taken by the caller."""
    from transport.fabric.ipc import IpcFabric
    taken, runs = [], []
    pieces = [0]  # the piece count of the batch being written
    real_post, real_inline = IpcFabric._post_batch_direct, IpcFabric.write_inline

    def check_bounds(bounds, la, ln, ra, nbytes, exact=True):
        # the engine's lengths must be those of the arrays it writes; its address extremes those of the arrays
        # (a whole batch: the smallest starts, and ends between the largest end and the largest start plus the
        # longest length) or spans that hold every write (a run of the batch's pieces posted on one rail)
        assert (bounds.len_min, bounds.len_max) == (ln.min(), ln.max()), bounds
        got = (la.min(), (la + ln).max(), ra.min(), (ra + ln).max())
        if exact:
            assert (bounds.local_min, bounds.remote_min) == (got[0], got[2]), bounds
            assert got[1] <= bounds.local_end <= la.max() + ln.max(), (bounds, got)
            assert got[3] <= bounds.remote_end <= ra.max() + ln.max(), (bounds, got)
        else:
            assert bounds.local_min <= got[0] and got[1] <= bounds.local_end, (bounds, got)
            assert bounds.remote_min <= got[2] and got[3] <= bounds.remote_end, (bounds, got)
        assert nbytes == int(ln.sum())

    def spy_post(self, ep, b, devices):
        if b.bounds is not None:
            check_bounds(b.bounds, b.local_addr, b.length, b.remote_addr, b.nbytes, exact=False)
            assert {*b.rkey.tolist()} == {b.bounds.rkey} and {*b.lkey.tolist()} == {b.bounds.lkey}
        got = real_post(self, ep, b, devices)
        taken.append((got, b.bounds is not None))
        return got

    def spy_inline(self, ep, la, ra, ln, bounds, nbytes, wait=True, stream=None):
        whole = ln.size == pieces[0]
        check_bounds(bounds, la, ln, ra, nbytes, exact=whole)
        got = real_inline(self, ep, la, ra, ln, bounds, nbytes, wait, stream)
        if got is not None:  # declined: the posted path's call is the one to record
            taken.append((True, True))
            if not whole:
                runs.append(int(ln.size))
        return got

    monkeypatch.setattr(IpcFabric, "_post_batch_direct", spy_post)
    monkeypatch.setattr(IpcFabric, "write_inline", spy_inline)
    b = src.ctypes.data
    # the last shape small enough for one rail: one unit of the whole batch, which carries the bounds (larger
    # batches are cut between the two rails)
    shapes = [AUX, [BLOCK_1K] * 20, rng.integers(1, 8193, size=500).tolist() + [2 * MB] * 2, [64] * 4096]

    def write_arrays(eng, lengths):
        s_off = disjoint_offsets(rng, lengths, 100 * MB)
        d_off = disjoint_offsets(rng, lengths, 64 * MB)
        ipc_peer.poison()
        exp = Expected(ipc_peer.size)
        exp.apply(src, s_off, d_off, lengths)
        pieces[0] = len(lengths)
        eng.batch_write(ipc_peer.session, (b + s_off).astype(np.int64), (ipc_peer.base + d_off).astype(np.int64),
                        np.asarray(lengths, dtype=np.int64))
        ipc_peer.check(exp)

    def settle(write):
        """Write twice more, at most PEER_SETTLES times, while the last two batches were not both taken by the
        caller: the module's peer may have retired the rails' descriptions once (see ``PEER_SETTLES``)."""
        for _ in range(PEER_SETTLES):
            if taken[-2:] == [(True, True)] * 2:
                return
            write()
            write()

    with TransferEngine(fabric="ipc", loadstore=False) as eng:
        eng.register(src)
        for lengths in shapes:
            for _ in range(2):
                write_arrays(eng, lengths)
        settle(lambda: write_arrays(eng, shapes[-1]))
        assert taken[-2:] == [(True, True)] * 2, taken
        # batches of several MB, cut between the two rails once both know the region: a run per rail
        assert len(runs) >= 2, runs
        pieces[0] = 10
        extra = ipc_peer.call("register_extra", size=1 * MB)
        dsts = np.array([extra + i * 100 for i in range(10)], dtype=np.int64)
        srcs, lens = b + 1000 * np.arange(10, dtype=np.int64), np.full(10, 64, dtype=np.int64)
        for _ in range(4):  # the first on each rail learns the region's description, the next writes by it
            eng.batch_write(ipc_peer.session, srcs, dsts, lens)
        settle(lambda: eng.batch_write(ipc_peer.session, srcs, dsts, lens))
        assert taken[-2:] == [(True, True)] * 2, taken
        ipc_peer.call("poison")
        clean = ipc_peer.call("extra_digest", addr=extra)
        ipc_peer.call("deregister", addr=extra)
        with pytest.raises(RemoteRejected):
            eng.batch_write(ipc_peer.session, srcs, dsts, lens)
        assert taken[-1][0] is False
        assert ipc_peer.call("extra_digest", addr=extra) == clean
        for _ in range(4):  # small batches alternate between the rails, each learning the region again
            write_arrays(eng, AUX)
        settle(lambda: write_arrays(eng, AUX))
        assert taken[-2:] == [(True, True)] * 2, taken


PEER_SETTLES = 3
"""Tries of a round that checks the rails' writes are taken by the caller. The module's peer forgets an earlier
test's engine in its own time, deregistering what it kept for it; that retires this engine's descriptions of the
peer's regions once (a batch then goes as messages, byte-exact, and its GRANT describes them again)."""


def _spy_inline(monkeypatch, name: str = "write_inline") -> list:
    """A list that gets, per ``IpcFabric.<name>`` call, whether the fabric took the writes (True) or declined
    them (False)."""
    from transport.fabric.ipc import IpcFabric
    return spy_taken(monkeypatch, IpcFabric, name)


def _teach_rails(eng, peer, src_addr: int, inline: list) -> int:
    """One-byte batches until two in a row were written inline: batches alternate between the two rails, and a
    rail writes inline once a posted batch has described the peer's region to it. Returns how many it took."""
    warm = 0
    while inline[-2:] != [True, True]:
        assert warm < 20, f"the rails did not learn the peer's region: {inline}"
        eng.batch_write(peer.session, [src_addr], [peer.base], [1])
        warm += 1
    return warm


def test_ipc_message_path_async_batches_are_written_inline(src, rng, ipc_peer, monkeypatch):
    """loadstore=False, host memory, several ``batch_write_async`` batches in flight at once into disjoint
    ranges, each of fresh lengths (1 B and 63 B pieces among them): once both rails know the peer's region, every
    one is written inline by the caller (counted as direct units), its handle done, the peer's whole buffer
    byte-exact; a batch counts as ok only once waited for. A round in which the module's peer retired the rails'
    descriptions (see ``PEER_SETTLES``) is byte-exact too and is tried again."""
    inline = _spy_inline(monkeypatch)
    with TransferEngine(fabric="ipc", loadstore=False) as eng:
        eng.register(src)
        b = src.ctypes.data
        _teach_rails(eng, ipc_peer, b, inline)
        for attempt in range(PEER_SETTLES):
            ipc_peer.poison()
            exp = Expected(ipc_peer.size)
            shapes = [[1, 63, 65], AUX, rng.integers(1, 8193, 200).tolist(), [65536 + 7] * 20]
            region = 64 * MB // len(shapes)
            before = eng.stats()
            handles = []
            for k, lengths in enumerate(shapes):
                s_off = disjoint_offsets(rng, lengths, 100 * MB)
                d_off = k * region + disjoint_offsets(rng, lengths, region)
                exp.apply(src, s_off, d_off, lengths)
                handles.append(eng.batch_write_async(ipc_peer.session, (b + s_off).astype(np.int64),
                                                     (ipc_peer.base + d_off).astype(np.int64),
                                                     np.asarray(lengths, dtype=np.int64)))
            ok_before = eng.stats()["batches"]["ok"]
            for h in handles:
                h.wait()
                assert h.done()
            st = eng.stats()
            ipc_peer.check(exp)
            if inline[-len(shapes):] == [True] * len(shapes):
                break
        assert inline[-len(shapes):] == [True] * len(shapes), inline
        ok = before["batches"]["ok"]
        assert ok_before == ok and st["batches"]["ok"] == ok + len(shapes), (ok, ok_before, st["batches"])
        direct = st["paths"]["direct"]["units"] - before["paths"]["direct"]["units"]
        assert direct == len(shapes) and st["paths"]["loadstore"]["units"] == 0, st["paths"]


def test_ipc_message_path_batches_over_many_regions_are_written_inline(rng, ipc_peer, monkeypatch):
    """sglang registers each aux buffer and each layer's KV buffer on its own, so one call names a region per
    piece on both sides. loadstore=False, host memory, a source and a peer region per piece (odd sizes among
    them, unaligned offsets): once the rails know the peer's regions, every batch is written inline by the
    caller (``write_inline_regions``), sync and async, byte-exact in every peer region, counted as a direct unit.
    Once the peer deregisters one of its regions, a batch naming it is not written inline and is refused
    (RemoteRejected) with nothing in that region; the regions still registered keep taking batches inline. A round
    in which the module's peer retired the rails' descriptions (see ``PEER_SETTLES``) is byte-exact too and is
    tried again."""
    from transport.peer_process import POISON, digest
    inline = _spy_inline(monkeypatch, "write_inline_regions")
    lengths = [64, 64, 512, 8192, 1, 63, 128, 64, 4096 + 7, 64, 2]
    with TransferEngine(fabric="ipc", loadstore=False) as eng:
        bufs = []
        for n in lengths:
            buf = np.frombuffer(rng.bytes(n + 32), dtype=np.uint8).copy()
            eng.register(buf)
            bufs.append(buf)
        extras = [ipc_peer.call("register_extra", size=n + 32, device=-1) for n in lengths]
        s_off = rng.integers(0, 32, len(lengths))
        d_off = rng.integers(0, 32, len(lengths))
        srcs = np.array([b.ctypes.data + int(o) for b, o in zip(bufs, s_off)], dtype=np.int64)
        dsts = np.array([a + int(o) for a, o in zip(extras, d_off)], dtype=np.int64)
        ln = np.asarray(lengths, dtype=np.int64)

        def expected(k: int) -> str:
            img = np.full(lengths[k] + 32, POISON, dtype=np.uint8)
            img[d_off[k]:d_off[k] + lengths[k]] = bufs[k][s_off[k]:s_off[k] + lengths[k]]
            return digest(img)

        warm = 0
        while inline[-2:] != [True, True]:  # each rail learns the peer's regions from one posted batch
            assert warm < 20, f"the rails did not learn the peer's regions: {inline}"
            eng.batch_write(ipc_peer.session, srcs, dsts, ln)
            warm += 1
        for asynchronous in (False, True, False):
            for attempt in range(PEER_SETTLES):
                for b in bufs:
                    b[:] = np.frombuffer(rng.bytes(b.size), dtype=np.uint8)  # fresh bytes every round
                ipc_peer.poison()
                units = eng.stats()["paths"]["direct"]["units"]
                if asynchronous:
                    h = eng.batch_write_async(ipc_peer.session, srcs, dsts, ln)
                    h.wait()
                    assert h.done()
                else:
                    eng.batch_write(ipc_peer.session, srcs, dsts, ln)
                for k, a in enumerate(extras):
                    assert ipc_peer.call("extra_digest", addr=a) == expected(k), \
                        f"piece {k} ({lengths[k]} B, async={asynchronous}) differs"
                if inline[-1] is True:
                    break
            assert inline[-1] is True, inline
            st = eng.stats()
            assert st["paths"]["direct"]["units"] == units + 1 and st["paths"]["loadstore"]["units"] == 0, \
                st["paths"]
        # the peer deregisters the region of piece 3: the caller's inline write declines (the peer's
        # deregistration counter moved), and the posted batch is refused there; nothing lands in that region
        ipc_peer.call("deregister", addr=extras[3])
        ipc_peer.poison()
        with pytest.raises(RemoteRejected):
            eng.batch_write(ipc_peer.session, srcs, dsts, ln)
        assert inline[-1] is False, inline
        clean = digest(np.full(lengths[3] + 32, POISON, dtype=np.uint8))
        assert ipc_peer.call("extra_digest", addr=extras[3]) == clean, "a deregistered region was written"
        keep = [k for k in range(len(lengths)) if k != 3]
        relearn = 0
        while inline[-2:] != [True, True]:  # each rail learns the peer's regions again after the deregistration
            assert relearn < 20, f"the rails did not learn the peer's regions again: {inline}"
            eng.batch_write(ipc_peer.session, srcs[keep], dsts[keep], ln[keep])
            relearn += 1
        for k in keep:
            assert ipc_peer.call("extra_digest", addr=extras[k]) == expected(k), f"piece {k} differs"


def write_sync_or_async(eng, session: str, srcs, dsts, lengths, asynchronous: bool) -> None:
    """One ``batch_write``, or one ``batch_write_async`` waited for."""
    if asynchronous:
        eng.batch_write_async(session, srcs, dsts, lengths).wait()
    else:
        eng.batch_write(session, srcs, dsts, lengths)


@pytest.mark.parametrize("runs_inline", [True, False], ids=["inline-runs", "posted"])
def test_ipc_batches_over_many_regions_split_between_rails_are_copied_by_the_caller(rng, ipc_peer, monkeypatch,
                                                                                    runs_inline):
    """A batch with a region per piece on both sides (sglang's region per layer) that the planner splits between
    two rails: a run of pieces per rail. Once the rails know the peer's regions, the ipc fabric copies each run
    from the calling thread rather than as messages: through ``write_inline_regions`` (``inline-runs``, the
    engine's path), or, with that path turned off, as one posted ``WriteBatch`` per rail through
    ``_post_batch_direct`` and ``_regions_target`` (``posted``: the path of a batch redispatched or declined
    inline). Byte-exact in every peer region, fresh data each round, odd sizes (1 B, 63 B, 4097 B) at odd offsets
    among 48-96 KB pieces, sync and async. Once the peer deregisters one of its regions, a batch naming it is not
    copied that way, is refused (RemoteRejected), and nothing lands in that region."""
    from transport.fabric.ipc import IpcFabric
    from transport.peer_process import POISON, digest
    from transport.planner import Planner
    found = []
    if runs_inline:
        real_inline = IpcFabric.write_inline_regions

        def spy(self, ep, la, ra, ln, spans, nbytes, wait=True, stream=None):
            got = real_inline(self, ep, la, ra, ln, spans, nbytes, wait, stream)
            found.append(got is not None and ln.size < len(lengths))  # taken, a run of the batch
            return got

        monkeypatch.setattr(IpcFabric, "write_inline_regions", spy)
    else:
        real = IpcFabric._regions_target

        def spy(self, *args, **kw):
            got = real(self, *args, **kw)
            found.append(got is not None and got[2] is not None)  # taken, over several regions
            return got

        monkeypatch.setattr(IpcFabric, "_regions_target", spy)
        monkeypatch.setattr(Planner, "direct_runs_all", lambda self, *a, **kw: False)
    lengths = [1, 63, 4097] + rng.integers(48 << 10, 96 << 10, 45).tolist()
    rng.shuffle(lengths)
    assert sum(lengths) >= 2 * MB  # split between the two rails
    with TransferEngine(fabric="ipc", loadstore=False, rails=2) as eng:
        bufs = []
        for n in lengths:
            buf = np.frombuffer(rng.bytes(n + 32), dtype=np.uint8).copy()
            eng.register(buf)
            bufs.append(buf)
        extras = [ipc_peer.call("register_extra", size=n + 32, device=-1) for n in lengths]
        s_off = rng.integers(0, 32, len(lengths))
        d_off = rng.integers(0, 32, len(lengths))
        srcs = np.array([b.ctypes.data + int(o) for b, o in zip(bufs, s_off)], dtype=np.int64)
        dsts = np.array([a + int(o) for a, o in zip(extras, d_off)], dtype=np.int64)
        ln = np.asarray(lengths, dtype=np.int64)

        def expected(k: int) -> str:
            img = np.full(lengths[k] + 32, POISON, dtype=np.uint8)
            img[d_off[k]:d_off[k] + lengths[k]] = bufs[k][s_off[k]:s_off[k] + lengths[k]]
            return digest(img)

        warm = 0
        while found[-2:] != [True, True]:  # each rail learns the peer's regions from one batch as messages
            assert warm < 20, f"the rails did not learn the peer's regions: {found}"
            eng.batch_write(ipc_peer.session, srcs, dsts, ln)
            warm += 1
        for asynchronous in (False, True, False):
            for attempt in range(PEER_SETTLES):
                for b in bufs:
                    b[:] = np.frombuffer(rng.bytes(b.size), dtype=np.uint8)
                ipc_peer.poison()
                del found[:]
                write_sync_or_async(eng, ipc_peer.session, srcs, dsts, ln, asynchronous)
                for k, a in enumerate(extras):
                    assert ipc_peer.call("extra_digest", addr=a) == expected(k), \
                        f"piece {k} ({lengths[k]} B, async={asynchronous}) differs"
                if found == [True, True]:
                    break
            assert found == [True, True], f"not copied by the caller on both rails: {found}"
        ipc_peer.call("deregister", addr=extras[3])
        ipc_peer.poison()
        del found[:]
        with pytest.raises(RemoteRejected):
            eng.batch_write(ipc_peer.session, srcs, dsts, ln)
        assert True not in found, found
        clean = digest(np.full(lengths[3] + 32, POISON, dtype=np.uint8))
        assert ipc_peer.call("extra_digest", addr=extras[3]) == clean, "a deregistered region was written"


def test_ipc_posted_runs_of_a_one_region_batch_carry_bounds(rng, ipc_peer, monkeypatch):
    """A batch inside one region on each side that the planner splits between two rails is posted as one
    ``WriteBatch`` per rail. Each carries ``WriteBounds``: its own lengths' extremes and the batch's address spans,
    so the ipc fabric checks those instead of reducing its arrays, and copies it from the posting thread. Pieces of
    odd sizes (1 B, 63 B, 4097 B, up to 600 KB) at odd offsets, one piece larger than the stripe size (so some
    writes are parts of a piece); fresh data each round, sync and async, byte-exact with nothing else written.
    A batch reaching one byte past the peer's region is refused with nothing written."""
    from transport.fabric.ipc import IpcFabric
    seen, learned = [], set()
    real = IpcFabric._direct_target

    def spy(self, ep, batches, devices):
        got = real(self, ep, batches, devices)
        seen.extend((b.bounds, got is not None, b.length.copy()) for b in batches)
        if got is not None:
            learned.add(id(self))  # this rail's fabric has the peer's region described
        return got

    monkeypatch.setattr(IpcFabric, "_direct_target", spy)
    lengths = [1, 63, 4097, 3 * MB + 5] + rng.integers(1, 600 << 10, 20).tolist()
    rng.shuffle(lengths)
    size = sum(lengths) + 64 * len(lengths) + 4096
    own = np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()
    with TransferEngine(fabric="ipc", loadstore=False, rails=2, stripe_bytes=MB) as eng:
        eng.register(own)
        src_offs = disjoint_offsets(rng, lengths, size)
        dst_offs = disjoint_offsets(rng, lengths, ipc_peer.size)
        srcs = [own.ctypes.data + int(o) for o in src_offs]
        dsts = [ipc_peer.base + int(o) for o in dst_offs]
        for _ in range(20):  # each rail learns the peer's region from one post as messages
            eng.batch_write(ipc_peer.session, srcs, dsts, lengths)
            if len(learned) == 2:
                break
        assert len(learned) == 2, f"the rails did not both learn the peer's region: {len(learned)}"
        for asynchronous in (False, True, False):
            for attempt in range(PEER_SETTLES):
                own[:] = np.frombuffer(rng.bytes(size), dtype=np.uint8)
                ipc_peer.poison()
                del seen[:]
                write_sync_or_async(eng, ipc_peer.session, srcs, dsts, lengths, asynchronous)
                exp = Expected(ipc_peer.size)
                exp.apply(own, src_offs, dst_offs, lengths)
                ipc_peer.check(exp)
                if all(got for _, got, _ in seen):
                    break
            assert len(seen) >= 2, f"the batch was not split between the rails: {len(seen)} post(s)"
            for bounds, taken, ln in seen:
                assert bounds is not None and taken, (bounds, taken)
                assert (bounds.len_min, bounds.len_max) == (int(ln.min()), int(ln.max())), bounds
            assert sum(int(ln.size) for _, _, ln in seen) > len(lengths), "no write was part of a piece"
        ipc_peer.poison()
        with pytest.raises(InvalidTransfer):
            eng.batch_write(ipc_peer.session, srcs + [own.ctypes.data], dsts + [ipc_peer.base + ipc_peer.size - 8],
                            lengths + [9])
        ipc_peer.check(Expected(ipc_peer.size))


def test_ipc_message_path_relayed_batches_are_written_inline(src, rng, ipc_peer, monkeypatch):
    """relay="always" on ipc with loadstore=False, host memory, 1 MiB relay slots: once the rails know the peer's
    region, a batch the planner relays whole goes through the relay ring's slots with each slot written inline
    by the caller (``IpcFabric.write_inline`` from the slot), synchronous and asynchronous, byte-exact: fresh
    offsets, 1 B and 63 B pieces, a shape of many pieces per slot and one of pieces larger than a slot (cut
    into slot-sized parts). Every unit is counted as relayed, none as direct. A round in which the module's peer
    retired the rails' descriptions (see ``PEER_SETTLES``) is byte-exact too and is tried again."""
    inline = _spy_inline(monkeypatch)
    with TransferEngine(fabric="ipc", loadstore=False, relay="always", relay_slot_bytes=1 * MB, relay_slots=2) as eng:
        eng.register(src)
        b = src.ctypes.data
        warm = _teach_rails(eng, ipc_peer, b, inline)
        shapes = [[1, 63, 65], AUX, rng.integers(1, 8193, 600).tolist(), [5 * MB // 2 + 3] * 3]
        rounds = 0
        for asynchronous in (False, True):
            for attempt in range(PEER_SETTLES):
                ipc_peer.poison()
                exp = Expected(ipc_peer.size)
                region = 64 * MB // len(shapes)
                handles, before = [], len(inline)
                for k, lengths in enumerate(shapes):
                    s_off = disjoint_offsets(rng, lengths, 100 * MB)
                    d_off = k * region + disjoint_offsets(rng, lengths, region)
                    exp.apply(src, s_off, d_off, lengths)
                    args = (ipc_peer.session, (b + s_off).astype(np.int64),
                            (ipc_peer.base + d_off).astype(np.int64), np.asarray(lengths, dtype=np.int64))
                    if asynchronous:
                        handles.append(eng.batch_write_async(*args))
                    else:
                        eng.batch_write(*args)
                for h in handles:
                    h.wait()
                rounds += 1
                ipc_peer.check(exp)
                # every unit inline, but for one decline per rail where the peer's counter moved since the rail
                # learnt its region (the posted unit then learns it again); a round in which the module's peer
                # retired the rails' descriptions (see PEER_SETTLES) declines more, is byte-exact, and is tried again
                taken = inline[before:]
                held = len(taken) >= len(shapes) + 2 and taken.count(False) <= 2 and all(taken[-len(shapes):])
                if held:
                    break
            assert held, taken
        st = eng.stats()
    assert st["paths"]["direct"]["units"] == 0 and st["paths"]["relayed"]["units"] >= warm + 2 * (len(shapes) + 2)
    assert st["batches"]["ok"] == warm + rounds * len(shapes) and st["paths"]["loadstore"]["units"] == 0


@pytest.mark.parametrize("relay", ["auto", "always"])
def test_ipc_inline_write_failure_posts_the_batch_instead(src, rng, ipc_peer, monkeypatch, relay):
    """An inline write that fails (here: the fabric raises on every second call, in the middle of a relayed batch's
    units too) leaves the batch to the posted path: it still lands byte-exact, counted once as ok, and the next
    batches go inline again."""
    from transport.errors import FabricError
    from transport.fabric.ipc import IpcFabric
    inline = _spy_inline(monkeypatch)
    spied = IpcFabric.write_inline
    calls = []

    def flaky(self, *args, **kw):
        calls.append(1)
        if len(calls) % 2 == 0:
            raise FabricError("injected: the inline write failed")
        return spied(self, *args, **kw)

    with TransferEngine(fabric="ipc", loadstore=False, relay=relay, relay_slot_bytes=1 * MB, relay_slots=2) as eng:
        eng.register(src)
        b = src.ctypes.data
        warm = _teach_rails(eng, ipc_peer, b, inline)
        monkeypatch.setattr(IpcFabric, "write_inline", flaky)
        shapes = [AUX, rng.integers(1, 8193, 300).tolist(), [5 * MB // 2 + 3] * 3]
        for lengths in shapes:
            s_off, d_off = disjoint_offsets(rng, lengths, 100 * MB), disjoint_offsets(rng, lengths, 64 * MB)
            run_case(eng, ipc_peer, src, s_off, d_off, lengths)
        st = eng.stats()
    assert len(calls) >= 2, calls  # one went inline, the next failed and was posted
    assert st["batches"]["ok"] == warm + len(shapes) and st["batches"]["failed"] == 0, st["batches"]


def test_ipc_loadstore_path_is_byte_exact(src, rng, ipc_peer):
    """The default on ipc: the whole batch by cross-memory attach from the caller's thread, no chunks."""
    with TransferEngine(fabric="ipc") as eng:
        eng.register(src)
        for lengths in (AUX, [1, 3, 63, 65], [BLOCK_1K] * 20 + [64] * 4096 + rng.integers(1, 8193, 300).tolist()):
            run_case(eng, ipc_peer, src, disjoint_offsets(rng, lengths, 100 * MB),
                     disjoint_offsets(rng, lengths, 64 * MB), lengths)
        h = eng.batch_write_async(ipc_peer.session, [src.ctypes.data], [ipc_peer.base], [4096])
        h.wait()
        assert h.done()
        st = eng.stats()
    assert st["paths"]["loadstore"]["units"] == 4 and st["batches"]["ok"] == 4
    assert st["paths"]["coalesced"]["chunks"] == 0 and st["paths"]["direct"]["units"] == 0
    assert "loadstore" in st["time_s"] and st["batches"]["latency"]["p50_ms"] > 0


def test_ipc_loadstore_rejects_outside_and_writes_nothing(src, ipc_peer):
    ipc_peer.poison()
    b = src.ctypes.data
    with TransferEngine(fabric="ipc") as eng:
        eng.register(src)
        with pytest.raises(InvalidTransfer, match="outside every region"):
            eng.batch_write(ipc_peer.session, [b, b + 64], [ipc_peer.base, ipc_peer.base + ipc_peer.size - 10],
                            [64, 64])
    ipc_peer.check(Expected(ipc_peer.size))


def test_ipc_loadstore_never_writes_a_region_deregistered_before_the_batch(src, ipc_peer):
    """The sender learnt a region, the peer deregistered it: the next batch must see the peer's deregistration
    counter move, re-fetch the list, refuse the batch, and write nothing (the region's memory stays allocated
    in the peer, so a stale write would land)."""
    b = src.ctypes.data
    with TransferEngine(fabric="ipc") as eng:
        eng.register(src)
        extra = ipc_peer.call("register_extra", size=1 * MB)
        eng.batch_write(ipc_peer.session, [b], [extra], [64])  # learns the region
        assert eng._peers[ipc_peer.session].loadstore._counter._map is not None  # the counter is mapped (memfd)
        ipc_peer.call("poison")
        clean = ipc_peer.call("extra_digest", addr=extra)
        ipc_peer.call("deregister", addr=extra)
        with pytest.raises(InvalidTransfer, match="outside every region"):
            eng.batch_write(ipc_peer.session, [b + i * 128 for i in range(10)], [extra + i * 64 for i in range(10)],
                            [64] * 10)
        assert ipc_peer.call("extra_digest", addr=extra) == clean
        assert eng.stats()["paths"]["loadstore"]["units"] == 1


def test_peer_process_killed_mid_batch_fails_with_every_rail_cause(src):
    """The receiver dies mid-batch: no rail survives, so the batch fails (it must not hang) with one cause per
    rail; the engine stays usable for other peers."""
    victim = EnginePeer(200 * MB, fabric="tcp")
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        b = src.ctypes.data
        eng.batch_write(victim.session, [b], [victim.base], [64])
        lens = [BLOCK_1K] * 78 + [4096] * 3000
        srcs = [b + (i * 65536) % (SRC_BYTES - BLOCK_1K) for i in range(len(lens))]
        dsts = [victim.base + i * BLOCK_1K for i in range(78)] + [victim.base + 185 * MB + i * 4096
                                                                   for i in range(3000)]
        h = eng.batch_write_async(victim.session, srcs, dsts, lens, timeout=60)
        time.sleep(0.005)  # the scenario: the peer dies a few ms into the batch (its 12 MB are still under way)
        victim.proc.kill()
        t0 = time.time()
        with pytest.raises(PeerGone) as info:
            h.wait(60)
        assert time.time() - t0 < 30
        assert len(info.value.causes) == 2, info.value
        assert "rail 0" in str(info.value) and "rail 1" in str(info.value)
    victim.proc.join(5)


# --- routing from a topology ------------------------------------------------------------------------------------
def test_topology_rails_and_relay_choice(src, rng):
    """With a topology, NIC ports become rails and routing decides locality: GPU 1 has no NIC of its own, so its
    data must be relayed through GPU 0's slots; host memory uses every rail directly. The host transfer runs."""
    from transport.topology import synthetic
    topo = synthetic(2, {0: ["mlx5_0"]})
    peer = EnginePeer(16 * MB, fabric="tcp", rails=1)
    try:
        with TransferEngine(fabric="tcp", topology=topo) as eng:
            assert eng.rails == 1 and eng.stats()["rails"][0]["key"] == "mlx5_0:1"
            eng.register(src)
            lengths = [64] * 100 + [3 * MB]
            run_case(eng, peer, src, disjoint_offsets(rng, lengths, 32 * MB), disjoint_offsets(rng, lengths, 16 * MB),
                     lengths)
            p = eng.data_path.peer(peer.session)
            assert eng._peers.rail_choices(0, p)[0].local and eng._peers.rail_choices(0, p)[0].relay_device == 0
            c1 = eng._peers.rail_choices(1, p)[0]
            assert not c1.local and c1.relay_device == 0 and c1.rail == 0
            assert eng._peers.rail_choices(-1, p)[0].local
    finally:
        peer.close()


def test_receiver_releases_landing_of_departed_sender(peer, src):
    before = peer.call("stats")["receiver"]
    with TransferEngine(fabric="tcp") as eng:
        eng.register(src)
        eng.batch_write(peer.session, [src.ctypes.data], [peer.base], [64])
        assert peer.call("stats")["receiver"]["senders"] >= 1
    wait_for(lambda: peer.call("stats")["receiver"].get("senders_released", 0) > before.get("senders_released", 0),
             "the peer's receiver releasing the departed sender", timeout=10, interval=0.05)
