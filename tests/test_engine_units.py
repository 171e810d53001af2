"""Engine parts that need no fabric: planner, region tables, relay ring back-pressure, ack encoding, config."""
import threading
import time

import numpy as np
import pytest

from pxn_kernels.chunk import chunk_layout
from transport.config import EngineConfig
from transport.planner import COALESCED, DIRECT, RELAYED, Planner, RailChoice, chunk_splits
from transport.credits import ACK_FLAG, ack_imm, chunk_imm, decode_ack
from transport.regions import Region, RegionTable, locate_inside, span_region
from wait_helpers import wait_for

KB, MB = 1 << 10, 1 << 20


def _plan(lengths, devices=None, rails=2, local=True, relay="auto", coalesce=64 * KB, slot=1 * MB,
          stripe=16 * MB, load=None):
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    srcs = np.cumsum(np.concatenate(([0], lengths[:-1]))) + 4096
    dsts = srcs + (1 << 40)
    devices = np.full(n, -1, dtype=np.int64) if devices is None else np.asarray(devices, dtype=np.int64)
    rails_of = {d: [RailChoice(r, local, d if local else 7) for r in range(rails)] for d in np.unique(devices).tolist()}
    p = Planner(EngineConfig(coalesce_bytes=coalesce, relay_slot_bytes=slot, stripe_bytes=stripe, relay=relay))
    load = {} if load is None else load
    return p.plan(srcs, dsts, lengths, devices, rails_of, load), srcs, dsts, load


def _covered(units, srcs, dsts, lengths):
    """Every byte of every item covered exactly once; returns the per-item coverage."""
    cover = {}
    for u in units:
        if u.kind == COALESCED:
            for i in u.items.tolist():
                cover.setdefault(i, []).append((int(srcs[i]), int(lengths[i]), int(dsts[i])))
        else:
            assert sum(n for _, _, n in u.segments()) == u.nbytes
            for s, d, n in u.segments():
                i = int(np.searchsorted(srcs, s, side="right")) - 1
                cover.setdefault(i, []).append((s, n, d))
    for i, n in enumerate(lengths):
        pieces = sorted(cover[i])
        pos = int(srcs[i])
        for s, ln, d in pieces:
            assert s == pos and d - s == int(dsts[i]) - int(srcs[i])
            pos += ln
        assert pos == int(srcs[i]) + int(n)
    return cover


def test_planner_coalesces_small_and_sends_large_direct():
    lengths = [64, 64, 512, 8192, 2 * MB, 64 * KB - 1, 64 * KB]
    units, srcs, dsts, _ = _plan(lengths)
    kinds = sorted(u.kind for u in units)
    assert kinds.count(COALESCED) == 1 and kinds.count(DIRECT) == 2
    _covered(units, srcs, dsts, np.asarray(lengths))


def test_planner_chunks_fit_slot_and_keep_order():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 8193, size=3000)
    units, srcs, dsts, _ = _plan(lengths, slot=256 * KB)
    assert all(u.kind == COALESCED for u in units)
    seen = np.concatenate([u.items for u in units])
    assert np.array_equal(seen, np.arange(lengths.size))  # in order, each once
    for u in units:
        _, nbytes = chunk_layout(lengths[u.items])
        assert nbytes <= 256 * KB and nbytes == u.wire_bytes
    assert len(units) <= int(np.ceil(chunk_layout(lengths)[1] / (256 * KB))) + 1


def test_chunk_splits_refuses_piece_larger_than_chunk():
    with pytest.raises(ValueError, match="does not fit"):
        chunk_splits(np.array([10, 5000]), 1024)


def test_planner_balances_by_bytes_in_flight():
    units, *_, load = _plan([2359296] * 78, load={0: 50 * MB, 1: 0})
    per_rail = {0: 0, 1: 0}
    for u in units:
        per_rail[u.rail] += u.nbytes
    assert per_rail[1] > per_rail[0]  # rail 0 already had 50 MB in flight
    assert abs((per_rail[0] + 50 * MB) - per_rail[1]) <= 2359296


def test_planner_stripes_large_blocks_and_relays_on_remote_rails():
    units, srcs, dsts, _ = _plan([64 * MB], stripe=8 * MB)
    assert len(units) == 8 and {u.rail for u in units} == {0, 1}
    _covered(units, srcs, dsts, np.asarray([64 * MB]))
    units, srcs, dsts, _ = _plan([5 * MB + 3], devices=[0], local=False)
    assert all(u.kind == RELAYED and u.nbytes <= MB and u.relay_device == 7 for u in units)
    _covered(units, srcs, dsts, np.asarray([5 * MB + 3]))
    units, *_ = _plan([5 * MB], relay="always")
    assert all(u.kind == RELAYED for u in units)
    units, *_ = _plan([5 * MB], devices=[0], local=False, relay="never")
    assert all(u.kind == DIRECT for u in units)


def test_planner_rejects_bad_config():
    with pytest.raises(ValueError, match="relay"):
        Planner(EngineConfig(coalesce_bytes=64 * KB, relay_slot_bytes=MB, stripe_bytes=MB, relay="sometimes"))
    with pytest.raises(ValueError, match="cannot hold one piece of coalesce_bytes 1048576 B"):
        Planner(EngineConfig(coalesce_bytes=MB, relay_slot_bytes=MB, stripe_bytes=MB))


def test_planner_for_smaller_peer_slots_sends_what_cannot_fit_direct():
    # a peer whose landing slots (32 KiB) cannot hold one piece of this engine's coalesce_bytes (64 KiB): pieces
    # that fit one of its chunks are coalesced, larger ones go direct, and no chunk exceeds its slots
    p = Planner(EngineConfig(coalesce_bytes=64 * KB, relay_slot_bytes=MB, stripe_bytes=MB), chunk_bytes=32 * KB)
    assert 0 < p.coalesce_bytes < 32 * KB and p.chunk_bytes == 32 * KB
    lengths = np.asarray([64, 4096, p.coalesce_bytes - 1, p.coalesce_bytes, 48 * KB, 63 * KB], dtype=np.int64)
    srcs = np.cumsum(np.concatenate(([0], lengths[:-1]))) + 4096
    dsts = srcs + (1 << 40)
    devices = np.full(lengths.size, -1, dtype=np.int64)
    units = p.plan(srcs, dsts, lengths, devices, {-1: [RailChoice(0, True, -1)]}, {})
    coalesced = sorted(i for u in units if u.kind == COALESCED for i in u.items.tolist())
    assert coalesced == [0, 1, 2], units
    assert all(u.nbytes <= 32 * KB for u in units if u.kind == COALESCED)
    _covered(units, srcs, dsts, lengths)


def test_planner_turn_moves_with_each_plan_and_rewind_takes_it_back():
    """``Planner.turn`` (the tie rotation a caller choosing a rail alone follows) moves once per ``plan`` call and
    ``rewind`` takes the last move back; with equal loads the plan's unit starts on the rail of that turn."""
    p = Planner(EngineConfig(coalesce_bytes=64 * KB, relay_slot_bytes=MB, stripe_bytes=16 * MB))
    lengths = np.asarray([3 * KB + 5], dtype=np.int64)
    srcs, dsts = lengths + 4096, lengths + (1 << 40)
    choices = [RailChoice(r, True, -1) for r in range(3)]
    start = p.turn
    for k in range(1, 5):
        units = p.plan(srcs, dsts, lengths, None, {-1: choices}, {}, [-1])
        assert p.turn == start + k
        assert units[0].rail == p.turn % 3
    p.rewind()
    assert p.turn == start + 3


def test_region_table_lookups():
    t = RegionTable()
    t.add(Region(1000, 100))
    t.add(Region(5000, 10, 0))
    t.add(Region(2000, 1000))
    assert t.add(Region(1000, 100)) is not None  # same range again: fine
    with pytest.raises(ValueError, match="overlaps"):
        t.add(Region(1050, 100))
    assert t.find(1000, 100).addr == 1000 and t.find(1000, 101) is None and t.find(999, 1) is None
    addrs = np.array([1000, 1099, 1099, 2500, 4000, 5009, 5009, 0], dtype=np.int64)
    lens = np.array([100, 1, 2, 500, 1, 1, 2, 1], dtype=np.int64)
    idx, ok = t.locate(addrs, lens)
    assert ok.tolist() == [True, True, False, True, False, True, False, False]
    assert t.snapshot().devices[idx[5]] == 0
    t.remove(2000)
    assert t.find(2500) is None
    with pytest.raises(KeyError, match="0x7d0"):
        t.remove(2000)


def test_span_region_finds_the_one_region_or_none():
    t = RegionTable([Region(1000, 100), Region(2000, 1000, 0), Region(5000, 10)])
    snap = t.snapshot()

    def span(addrs, lens):
        a, n = np.array(addrs, dtype=np.int64), np.array(lens, dtype=np.int64)
        return span_region(snap, int(a.min()), int(a.max()), int((a + n).max()), int(n.max()))
    assert span([2000, 2500, 2999], [1, 500, 1]) == 1  # every piece in [2000, 3000)
    assert span([2000, 2999], [1, 2]) is None  # the last byte is past the region
    assert span([1000, 2000], [1, 1]) is None  # two regions: per-piece lookup needed
    assert span([999], [1]) is None and span([3000], [1]) is None and span([0], [1]) is None
    assert span([5000], [10]) == 2 and span([5000], [11]) is None
    # an end that wraps int64 must not hide: a huge length is refused, not looked up
    assert span_region(snap, 2000, 2000, -5, 1 << 63 - 1) is None
    assert span_region(RegionTable().snapshot(), 1, 1, 2, 1) is None


def test_imm_encoding_round_trips():
    assert not chunk_imm(65535, 1 << 20) & ACK_FLAG
    for slot, status in ((0, 0), (17, 1), (65535, 2)):
        imm = ack_imm(slot, status)
        assert imm & ACK_FLAG and decode_ack(imm) == (slot, status) and imm <= 0xFFFFFFFF


class _FakeFabric:
    def __init__(self):
        self.local_id = "fake"

    def register(self, addr, length, device=-1):
        from transport.fabric.base import MemoryRegion
        return MemoryRegion(addr, length, 1, 1, device)

    def deregister(self, mr):
        pass


def test_relay_ring_back_pressure_and_states():
    from transport.relay import RelayRing

    posted = []
    release_later = []
    lock = threading.Lock()

    class Att:
        def fail_local(self, e):
            raise AssertionError(e)

    def fill(a, slot):
        a.slot = slot
        return True

    rounds = []

    def post(atts, after=None):
        with lock:
            rounds.append(len(atts))
            posted.extend(atts)
            release_later.extend(atts)

    ring = RelayRing("test", _FakeFabric(), -1, lanes=2, slots=2, slot_bytes=4096, fill=fill, post=post)
    try:
        atts = [Att() for _ in range(10)]
        ring.enqueue_copy(atts)
        # the ring waits for a slot after 2 lanes x 2 slots (back-pressure), and posts nothing more
        wait_for(lambda: ring.stats()["waits_for_slot"] >= 1 and len(posted) == 4,
                 "the ring waiting for a slot with 4 writes posted")
        assert len(posted) == 4
        # the idle ring's first fill went out alone (nothing was on the wire), then a round of the free slots
        assert rounds == [1, 3], rounds
        assert ring.free_slots() == 0
        def release_posted():  # completions free slots; the ring continues
            with lock:
                done = list(release_later)
                release_later.clear()
            for a in done:
                ring.release(a.slot)
            return len(posted) == 10

        wait_for(release_posted, "all 10 writes posted as completions freed their slots")
        st = ring.stats()
        assert st["waits_for_slot"] >= 1
        assert sum(lane["counts"]["filling"] for lane in st["lanes"]) == 10
    finally:
        ring.close()


def test_size_parsing_and_env(monkeypatch):
    from transport.config import parse_size
    assert parse_size("64K") == 65536 and parse_size("1M") == MB and parse_size("8MiB") == 8 * MB
    assert parse_size(4096) == 4096


def test_planner_packs_small_relayed_pieces_into_one_slot():
    units, srcs, dsts, _ = _plan([100 * KB] * 30, relay="always", coalesce=0, rails=1)
    assert all(u.kind == RELAYED and u.nbytes <= MB for u in units)
    assert len(units) == 3  # 10 pieces of 100 KB per 1 MB slot
    _covered(units, srcs, dsts, np.asarray([100 * KB] * 30))


@pytest.mark.parametrize("total_kb", [1, 1023, 1024, 1025, 3000])
def test_planner_relayed_runs_one_slot_or_many(total_kb):
    """Relayed runs with and without the one-slot shortcut: a batch that fits one slot is one unit holding every
    piece in order (odd sizes, some of a few bytes); a larger one is cut into slot-sized runs of whole pieces;
    either way every byte is covered once. Two devices: the second device's pieces are a subset (no shortcut
    on the batch's own arrays)."""
    rng = np.random.default_rng()
    lengths = rng.integers(1, 2 * KB, size=4 * total_kb).astype(np.int64)
    lengths = lengths * (total_kb * KB) // int(lengths.sum()) + 1  # about total_kb KB, every piece >= 1 B
    for devices in (None, np.arange(lengths.size) % 2):
        units, srcs, dsts, _ = _plan(lengths, devices=devices, relay="always", coalesce=0, rails=1)
        assert all(u.kind == RELAYED and u.nbytes <= MB for u in units)
        _covered(units, srcs, dsts, lengths)
        per_device = [lengths] if devices is None else [lengths[devices == d] for d in (0, 1)]
        expect = sum(-(-int(part.sum()) // MB) for part in per_device)  # whole pieces only: at least this many
        assert len(units) >= expect
        if all(int(part.sum()) <= MB for part in per_device):
            assert len(units) == len(per_device)


def test_whole_batch_rail_agrees_with_plan():
    """``Planner.whole_batch_rail`` (decided from count, sum and extremes alone) names a rail only when ``plan``
    makes the batch one DIRECT unit of every piece in order, and names that unit's rail; it names one whenever
    ``plan`` does so and those figures decide it (it cannot count a batch's small pieces: with more pieces than
    ``direct_pieces``, some below ``coalesce_bytes``, it declines); ``plan`` given the smallest length too returns
    the same unit; ``relays_all`` holds exactly when every unit ``plan`` makes is RELAYED; when
    ``direct_runs_all`` holds, ``plan`` makes DIRECT runs whose arrays, joined in order, are the batch's. Random
    batches over coalescing, relay policy, rails, locality, host or GPU sources, loads and sizes around the
    thresholds (1 B pieces, pieces at the stripe size and one byte over)."""
    from suite_env import SEED
    rng = np.random.default_rng(SEED)
    runs_all = 0  # batches ``direct_runs_all`` named
    for trial in range(400):
        coalesce = int(rng.choice([0, 4 * KB, 64 * KB]))
        relay = str(rng.choice(["auto", "always", "never"]))
        rails, local, dev = int(rng.integers(1, 4)), bool(rng.integers(2)), int(rng.choice([-1, 0]))
        stripe = 1 * MB
        n = int(rng.choice([1, 2, 11, 64, 65, 300]))
        top = int(rng.choice([2, 8 * KB, 128 * KB, stripe, stripe + 1]))
        lengths = rng.integers(1, top + 1, size=n).astype(np.int64)
        if rng.integers(2):
            lengths[int(rng.integers(n))] = top  # the largest at the threshold itself
        srcs = np.cumsum(np.concatenate(([0], lengths[:-1]))) + 4096
        dsts = srcs + (1 << 40)
        choices = [RailChoice(r, local, dev if local else 7) for r in range(rails)]
        load = {r: int(rng.integers(0, 3 * MB)) for r in range(rails)} if rng.integers(2) else {}
        stats = (int(lengths.sum()), int(lengths.max()), int(lengths.min()))
        cfg = EngineConfig(coalesce_bytes=coalesce, relay_slot_bytes=2 * MB, stripe_bytes=stripe, relay=relay,
                           direct_pieces=64)
        reference = Planner(cfg)
        units = reference.plan(srcs, dsts, lengths, None, {dev: choices}, dict(load), [dev], None, None, stats[:2])
        probe = Planner(cfg)
        got = probe.whole_batch_rail(dev, choices, dict(load), n, stats[0], stats[2], stats[1])
        whole = (len(units) == 1 and units[0].kind == DIRECT and units[0].nbytes == stats[0]
                 and [tuple(x) for x in units[0].segments()] == list(zip(srcs.tolist(), dsts.tolist(),
                                                                        lengths.tolist())))
        case = (coalesce, relay, rails, local, dev, n, top, load)
        decided = not coalesce or stats[2] >= coalesce or n <= 64
        assert (got is not None) == whole if decided else got is None or whole, \
            (case, got, [(u.kind, u.rail, u.nbytes) for u in units])
        if got is not None:
            assert got.rail == units[0].rail, case
            short = Planner(cfg).plan(srcs, dsts, lengths, None, {dev: choices}, dict(load), [dev], None, None,
                                      stats)
            assert [(u.kind, u.rail, u.nbytes) for u in short] == [(DIRECT, got.rail, stats[0])], case
            assert [tuple(x) for x in short[0].segments()] == [tuple(x) for x in units[0].segments()], case
        assert probe.relays_all(choices, stats[2]) == all(u.kind == RELAYED for u in units), case
        if probe.direct_runs_all(choices, n, stats[2], stats[1]):
            runs_all += 1
            assert all(u.kind == DIRECT and u.runs is not None for u in units), (case, [u.kind for u in units])
            for k, arr in enumerate((srcs, dsts, lengths)):
                assert np.array_equal(np.concatenate([u.runs[k] for u in units]), arr), case
            assert sum(u.nbytes for u in units) == stats[0], case
            assert all(u.nbytes == int(u.runs[2].sum()) for u in units), case
    assert runs_all >= 20, runs_all


def test_locate_inside_agrees_with_locate():
    """The batch path's five-call lookup: the regions ``locate`` finds when every piece is inside one, None as
    soon as one piece is not (below every region, in a gap, one byte past an end, straddling two regions)."""
    rng = np.random.default_rng()
    t = RegionTable([Region(1000, 100), Region(2000, 1000, 0), Region(5000, 10), Region(5010, 90, 1)])
    snap = t.snapshot()
    inside = [(1000, 100), (1099, 1), (2000, 1), (2500, 500), (5000, 10), (5010, 1), (5099, 1)]
    outside = [(999, 1), (1099, 2), (1100, 1), (3000, 1), (2999, 2), (5009, 2), (5100, 1), (0, 1)]
    for trial in range(200):
        k = int(rng.integers(1, 12))
        pieces = [inside[i] for i in rng.integers(0, len(inside), size=k)]
        bad = trial % 2 == 1
        if bad:
            pieces.insert(int(rng.integers(0, k + 1)), outside[int(rng.integers(0, len(outside)))])
        a = np.array([p[0] for p in pieces], dtype=np.int64)
        n = np.array([p[1] for p in pieces], dtype=np.int64)
        got = locate_inside(snap, a, a + n)
        idx, ok = t.locate(a, n, snap)
        if bad:
            assert got is None and not ok.all(), pieces
        else:
            assert got is not None and ok.all() and got.tolist() == idx.tolist(), pieces
    assert locate_inside(RegionTable().snapshot(), np.array([1]), np.array([2])) is None


def _writer_for(snap, unmappable=()):
    from transport.fabric.loadstore import LoadStoreWriter
    w = LoadStoreWriter.__new__(LoadStoreWriter)
    mapped = np.array([-1 if (r.device < 0 or i in unmappable) else 0x10_0000_0000 * (i + 1)
                       for i, r in enumerate(snap.regions)], dtype=np.int64)
    # a different mapping per source device; -1 (not mappable) stays -1
    w._mapped_starts = lambda s, device: np.where(mapped < 0, -1, mapped + device * 0x1000)
    return w


def _canonical(host, groups):
    """(host pieces, {device: pieces}) as sorted (src, dst, length) triples: the split's content, not its order."""
    def triples(s, d, n):
        return sorted(zip(np.asarray(s).tolist(), np.asarray(d).tolist(), np.asarray(n).tolist()))
    return (triples(*host) if host is not None else []), {dev: triples(s, np.asarray(d) + shift, n)
                                                          for dev, s, d, n, shift in groups}


@pytest.mark.parametrize("runs", [1, 2, 5, 40])
def test_loadstore_split_by_runs_matches_piece_by_piece(runs):
    """The load/store writer's split of a multi-region batch: by runs of equal (source device, destination
    region) (views), or per piece (masks) for many runs; both give the same host part and GPU groups, each
    destination mapped into its region's mapping for the source device; host <-> GPU pieces and an unmappable
    peer GPU refuse the path (None)."""
    rng = np.random.default_rng()
    local = RegionTable([Region(1 << 30, 1 << 24, 0), Region(2 << 30, 1 << 24, 1), Region(3 << 30, 1 << 24)])
    remote = RegionTable([Region(5 << 30, 1 << 24, 0), Region(6 << 30, 1 << 24, 1), Region(7 << 30, 1 << 24)])
    lsnap, rsnap = local.snapshot(), remote.snapshot()
    kinds = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 2)]  # (local region, remote region): GPU->GPU or host->host
    sizes = rng.integers(1, 6, size=runs)
    parts = [kinds[int(rng.integers(0, len(kinds)))] for _ in range(runs)]
    li = np.concatenate([np.full(k, a) for k, (a, _) in zip(sizes, parts)]).astype(np.int64)
    ri = np.concatenate([np.full(k, b) for k, (_, b) in zip(sizes, parts)]).astype(np.int64)
    n = li.size
    lens = rng.integers(1, 5000, size=n).astype(np.int64)
    src = lsnap.starts_i64[li] + rng.permutation(1 << 20)[:n]  # distinct sources: the check below finds each
    dst = rsnap.starts_i64[ri] + rng.integers(0, 1 << 20, size=n)
    src_dev = lsnap.devices[li]
    w = _writer_for(rsnap)
    by_runs = w._classify(src, dst, lens, src_dev, ri, rsnap)
    by_pieces = w._classify_pieces(src, dst, lens, src_dev, ri, rsnap)
    assert _canonical(*by_runs) == _canonical(*by_pieces)
    host, groups = _canonical(*by_runs)
    gpu = li < 2
    assert len(host) == int((~gpu).sum()) and sum(len(v) for v in groups.values()) == int(gpu.sum())
    for dev, triples in groups.items():  # every GPU destination moved into the mapping for its source device
        for s_, d_, _ in triples:
            i = int(np.flatnonzero(src == s_)[0])
            assert d_ == dst[i] - rsnap.starts_i64[ri[i]] + 0x10_0000_0000 * (ri[i] + 1) + dev * 0x1000
    # one host -> GPU piece anywhere: not for this path, whichever version splits it
    j = int(rng.integers(0, n))
    ri_bad = ri.copy()
    ri_bad[j] = 0 if li[j] == 2 else 2
    dst_bad = rsnap.starts_i64[ri_bad] + 64
    for split in (w._classify, w._classify_pieces):
        assert split(src, dst_bad, lens, src_dev, ri_bad, rsnap) == (None, None)
    if gpu.any():
        w_unmapped = _writer_for(rsnap, unmappable=set(ri[gpu].tolist()))
        assert w_unmapped._classify(src, dst, lens, src_dev, ri, rsnap) == (None, None)


@pytest.mark.parametrize("layout", ["into_rows", "out_of_rows", "scattered", "odd_width", "unequal", "few",
                                    "not_multiple"])
def test_host_memmove_every_layout_byte_exact(layout):
    """The host copy of coalesced chunks (sender gather, receiver scatter): the paged fast paths (one numpy call
    into a run of rows, out of one, or between scattered rows) and the per-piece loop give the reference's bytes,
    and nothing outside the pieces is written."""
    from transport.packing import host_memmove
    rng = np.random.default_rng()
    width = {"odd_width": 63}.get(layout, 2048 if layout != "few" else 64)
    n = 5 if layout == "few" else 300
    src = np.frombuffer(rng.bytes(4 * n * width + 4096), dtype=np.uint8).copy()
    dst = np.full(4 * n * width + 4096, 0x5A, dtype=np.uint8)  # poisoned
    lens = np.full(n, width, dtype=np.int64)
    if layout == "unequal":
        lens = rng.integers(1, width, size=n).astype(np.int64)
    s_rows = rng.permutation(2 * n)[:n]
    d_rows = rng.permutation(3 * n)[:n]
    if layout == "into_rows":
        d_rows = np.arange(n)
    if layout == "out_of_rows":
        s_rows = np.arange(n)
    s_off = s_rows * width + 7  # unaligned bases
    d_off = d_rows * width + 3
    if layout == "not_multiple":
        s_off = s_off + (np.arange(n) % 2)  # every other source one byte off the row grid
    host_memmove(src.ctypes.data + s_off, dst.ctypes.data + d_off, lens)
    expect = np.full_like(dst, 0x5A)
    for so, do, k in zip(s_off.tolist(), d_off.tolist(), lens.tolist()):
        expect[do:do + k] = src[so:so + k]
    assert np.array_equal(dst, expect)


def test_planner_direct_runs_cover_every_piece_once_and_balance_bytes(seed):
    """Many large direct pieces go as one run per rail (few units), every byte once, rails within one piece."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64 * KB, 3 * MB, size=1000)
    units, srcs, dsts, load = _plan(lengths, rails=3, load={0: 5 * MB})
    assert all(u.kind == DIRECT for u in units) and len(units) <= 3, [u.kind for u in units]
    _covered(units, srcs, dsts, lengths)
    per_rail = [load.get(r, 0) for r in range(3)]
    assert max(per_rail) - min(per_rail) <= 2 * int(lengths.max()), (per_rail, seed)


def test_planner_forwards_large_pieces_through_landing_slots():
    """Receive-side PXN: a large piece whose destination GPU is not the peer's landing GPU on the chosen rail
    becomes chunk items (COALESCED with segs, none above a chunk's payload); one already on it goes direct."""
    lengths = np.asarray([3 * MB, 2 * MB + 5, 100], dtype=np.int64)
    srcs = np.cumsum(np.concatenate(([0], lengths[:-1]))) + 4096
    dsts = srcs + (1 << 40)
    p = Planner(EngineConfig(coalesce_bytes=64 * KB, relay_slot_bytes=4 * MB, stripe_bytes=16 * MB, relay="auto"))
    rails_of = {0: [RailChoice(0, True, 0)]}
    units = p.plan(srcs, dsts, lengths, np.zeros(3, dtype=np.int64), rails_of, {}, [0],
                   dst_devices=np.asarray([1, 0, 1]), forward={0: 0})
    fwd = [u for u in units if u.kind == COALESCED and u.items is None]
    assert [sg[2] for u in fwd for sg in u.segs] == [3 * MB]
    assert all(u.wire_bytes <= 4 * MB for u in fwd)
    assert sum(u.nbytes for u in units if u.kind == DIRECT) == 2 * MB + 5


def test_engine_config_precedence_and_errors():
    """Arguments first, then PXN_* variables, then defaults; a bad variable names itself and its value, a bad
    setting names the setting; nothing else is read from the environment later."""
    from transport.config import EngineConfig
    env = {"PXN_COALESCE_BYTES": "32K", "PXN_LANES": "3", "PXN_LOADSTORE": "0", "PXN_FORWARD_LARGE": "1"}
    cfg = EngineConfig.from_env(env, lanes=5)
    assert cfg.lanes == 5 and cfg.coalesce_bytes == 32 << 10 and cfg.loadstore is False and cfg.forward_large
    assert cfg.relay_slot_bytes == 4 << 20 and cfg.fabric == "auto"  # defaults
    assert EngineConfig.from_env({}, relay_slot_bytes="8MiB").relay_slot_bytes == 8 << 20
    with pytest.raises(ValueError, match=r"PXN_LANDING_SLOTS='many': not a valid int"):
        EngineConfig.from_env({"PXN_LANDING_SLOTS": "many"})
    with pytest.raises(ValueError, match=r"landing_slots must be <= 65535"):
        EngineConfig.from_env({}, landing_slots=70000)
    with pytest.raises(ValueError, match=r"relay must be 'auto', 'always' or 'never', got 'sometimes'"):
        EngineConfig.from_env({"PXN_RELAY": "sometimes"})
    with pytest.raises(ValueError, match=r"max_senders must be > 0, got 0"):
        EngineConfig.from_env({}, max_senders=0)
    with pytest.raises(TypeError, match="unknown setting"):
        EngineConfig.from_env({}, lane=2)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['chunks'\]"):
        EngineConfig.from_env({}, defaults={"chunks": 0})


def test_fabric_defaults_sit_between_variables_and_class_defaults():
    """A fabric's ``config_defaults`` (ipc: coalesce_bytes 0, one 64 MiB relay slot per lane, 2 landing slots, a
    128 MiB landing pool) replace the class default only: a PXN_* variable or an argument still wins."""
    from transport.config import EngineConfig
    from transport.fabric import fabric_class
    ipc = fabric_class("ipc").config_defaults
    assert ipc == {"coalesce_bytes": 0, "relay_slot_bytes": 64 << 20, "relay_slots": 1, "landing_slots": 2,
                   "landing_bytes": 128 << 20}
    tcp = fabric_class("tcp").config_defaults
    assert tcp == {"direct_pieces": 64}
    cfg = EngineConfig.from_env({}, defaults=ipc)
    assert (cfg.coalesce_bytes, cfg.relay_slot_bytes, cfg.relay_slots, cfg.landing_slots) == (0, 64 << 20, 1, 2)
    assert EngineConfig.from_env({"PXN_RELAY_SLOT_BYTES": "4M"}, defaults=ipc).relay_slot_bytes == 4 << 20
    assert EngineConfig.from_env({}).direct_pieces == 0
    assert EngineConfig.from_env({}, defaults=tcp).direct_pieces == 64
    assert EngineConfig.from_env({"PXN_DIRECT_PIECES": "0"}, defaults=tcp).direct_pieces == 0
    with pytest.raises(ValueError, match=r"direct_pieces must be an int >= 0, got -1"):
        EngineConfig.from_env({}, direct_pieces=-1)
    assert EngineConfig.from_env({"PXN_COALESCE_BYTES": "8K"}, defaults=ipc).coalesce_bytes == 8 << 10
    assert EngineConfig.from_env({"PXN_COALESCE_BYTES": "8K"}, defaults=ipc, coalesce_bytes=100).coalesce_bytes == 100
    assert EngineConfig.from_env({}).coalesce_bytes == 64 << 10


def test_planner_keeps_small_direct_batches_on_one_rail():
    """Direct pieces spread over rails only with at least MIN_RUN_BYTES per rail: a small batch is one run."""
    from transport.planner import MIN_RUN_BYTES
    for lengths, rails_used in (([64] * 11, 1), ([64 * KB] * 15, 1), ([64 * KB] * 40, 2),
                                ([MIN_RUN_BYTES] * 3, 3), ([2359296] * 78, 4)):
        units, srcs, dsts, _ = _plan(lengths, rails=4, coalesce=0)
        assert all(u.kind == DIRECT for u in units)
        assert len({u.rail for u in units}) == rails_used, (lengths[:1], len(lengths), [u.rail for u in units])
        _covered(units, srcs, dsts, np.asarray(lengths))


def test_distinct_matches_numpy_unique(seed):
    """``distinct`` (min/max first) gives ``np.unique``'s sorted values for one value, many values and none."""
    from transport.arrays import distinct
    rng = np.random.default_rng(seed)
    for a in (np.full(4096, 7, dtype=np.int64), rng.integers(-5, 5, size=1000), rng.integers(0, 1 << 40, size=3),
              np.empty(0, dtype=np.int64), np.array([-1], dtype=np.int64)):
        assert distinct(a) == np.unique(a).tolist(), a[:8]


def test_bound_copies_offer_a_binding_only_to_repeated_lengths():
    """``BoundCopies.repeated``: False the first time lengths are seen on a device (no plan made), True after;
    lengths differing in one piece, or another device, are new."""
    from transport.fabric.gpu_copy import BoundCopies
    bc = BoundCopies()
    aux = np.array([64, 64, 512, 8192, 64], dtype=np.int64)
    assert not bc.repeated(0, aux)
    assert bc.repeated(0, aux)
    other = aux.copy()
    other[2] = 513
    assert not bc.repeated(0, other) and not bc.repeated(1, aux)
    assert not bc.repeated(0, np.full(7, 64, dtype=np.int64)) and bc.repeated(0, np.full(7, 64, dtype=np.int64))
    assert not bc._plans  # nothing was planned or bound


def test_endpoint_failure_completes_a_pending_batch_message_without_a_table():
    """A batch the posting thread copies itself (ipc) is pending without a piece table while it copies: the
    endpoint failing meanwhile completes it with PeerLost naming its bytes, like any other message."""
    from transport.errors import PeerLost
    from transport.fabric import make_fabric
    from transport.fabric.base import WriteBatch
    from transport.fabric.messages import BatchRecord, OutMsg
    a, b = make_fabric("tcp"), make_fabric("tcp")
    try:
        ep = a.connect(b.descriptor())
        m = OutMsg(0)
        m.batch, m.final, m.pieces = BatchRecord(WriteBatch([4096, 8192], [8, 24], [0, 64], [3, 3], [4, 4],
                                                             wr_id=77)), True, 2
        ep.enqueue([m], queue=False, local=[True])
        ep.fail("test")
        comps = a.poll(8, timeout=5.0)
        assert [c.wr_id for c in comps] == [77]
        assert isinstance(comps[0].error, PeerLost) and "(2 piece(s), 32 B)" in str(comps[0].error)
    finally:
        a.close()
        b.close()


def test_progress_loop_runs_tasks_in_order_and_duties_between_them(caplog):
    """``ProgressLoop``: submitted tasks run in the order given, in its one thread, also after a task that raised
    (logged); a duty runs every period; a period that is not positive is refused, naming it; after ``close`` the
    thread is gone and nothing more runs."""
    from transport.progress import ProgressLoop
    loop = ProgressLoop("pxn-test-progress")
    ran, threads, ticks = [], set(), []
    done = threading.Event()

    def task(i):
        threads.add(threading.current_thread().name)
        ran.append(i)
        if i == 3:
            raise RuntimeError("task 3 fails")
        if i == 199:
            done.set()

    try:
        with pytest.raises(ValueError, match="period_s must be > 0, got 0"):
            loop.every(0, lambda: None)
        loop.every(0.02, lambda: ticks.append(time.monotonic()))
        for i in range(200):
            loop.submit(task, i)
        assert done.wait(5.0)
        assert ran == list(range(200)) and threads == {"pxn-test-progress"}
        assert any("task 3 fails" in r.getMessage() or "task 3 fails" in str(r.exc_info) for r in caplog.records)
        wait_for(lambda: len(ticks) >= 3, "3 ticks of the periodic task")
        assert all(b - a >= 0.015 for a, b in zip(ticks, ticks[1:])), ticks
    finally:
        loop.close()
    assert not loop.thread.is_alive()
    n = len(ticks)
    loop.submit(task, 500)
    time.sleep(0.1)  # the scenario: a window in which a task submitted after close would wrongly run (no event)
    assert 500 not in ran and len(ticks) == n


def test_redispatch_waits_for_a_dead_rails_queued_completion():
    """Rail 0 failed and its unit has no rail left; rail 1's endpoint reads dead while its failed completion waits
    in the progress loop. The batch must fail with rail 1's own cause (from that completion), not "endpoint
    died": the redispatch waits for the queued completions before it labels rail 1. Fails when it labels it
    at once."""
    from types import SimpleNamespace as NS
    from transport.errors import PeerLost
    from transport.peers import Failover

    class Comps:
        def __init__(self):
            self.pending, self.queue = {1}, []

        def deferring(self, rail):
            return rail in self.pending

        def after_deferred(self, fn, *args):
            self.queue.append((fn, args))

    peer = NS(session="peer:1", ready=True, rails=[])
    for rail, alive in ((0, False), (1, True)):
        peer.rails.append(NS(rail=rail, alive=alive, ep=NS(alive=False), usable=lambda: False,
                             cause=PeerLost("rail 0: connection reset by peer") if rail == 0 else None))
    failed, labelled, forgotten = [], [], []
    batch = NS(peer=peer, failed=False, id=7)
    comps = Comps()
    accounts = NS(fail=lambda b, e: (failed.append(e), setattr(b, "failed", True)))
    directory = NS(rail_choices=lambda device, p: [])
    fo = Failover(NS(closed=False), accounts, directory, [], None, None)
    fo.connect(comps, None)
    pipe = NS(completions=comps)

    def rail_failed(pr, cause):
        labelled.append((pr.rail, str(cause)))
        pr.alive, pr.cause = False, cause
    fo.rail_failed, fo.forget_peer = rail_failed, forgotten.append
    old = NS(batch=batch, unit=NS(device=-1))
    fo.redispatch(old)
    assert labelled == [] and failed == [] and len(pipe.completions.queue) == 1
    # the progress loop: rail 1's completion first (it fails the rail with its status), then the waiting unit
    rail_failed(peer.rails[1], PeerLost("rail 1: write failed: IBV_WC_RETRY_EXC_ERR"))
    pipe.completions.pending.clear()
    fn, args = pipe.completions.queue.pop()
    fn(*args)
    assert [r for r, _ in labelled] == [1] and "endpoint died" not in labelled[0][1]
    assert len(failed) == 1 and "IBV_WC_RETRY_EXC_ERR" in str(failed[0]) and "endpoint" not in str(failed[0])
    assert forgotten == [peer]
    # a rail whose completions never stop coming is labelled after REDISPATCH_WAITS waits
    peer.rails[1].alive, batch.failed, labelled[:] = True, False, []
    pipe.completions.pending = {1}
    fo.redispatch(old)
    while pipe.completions.queue:
        fn, args = pipe.completions.queue.pop()
        fn(*args)
    assert labelled == [(1, "rail 1 endpoint to peer:1 died")]
