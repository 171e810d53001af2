"""One conformance suite for every fabric (tcp, same-host ipc on host and GPU memory, verbs).

The writer is this process; the target lives in a separate spawned process (``fabric_helpers.Target``) with its
registered region between poison guards. Data is fresh random bytes every run (seed in the report header).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from fabric_helpers import Buffer, RemoteError, Target, digest, wait_completions, wait_stopped
from wait_helpers import wait_for
from transport.errors import FabricClosed, FabricUnavailable, PeerLost, RegionError, UnknownPeer
from transport.fabric import make_fabric
from transport.fabric.base import Opcode, RegionSpans, WriteBatch, WriteBounds, WriteRequest

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

REGION = 80 << 20
SIZES = [1, 63, 4096, 65536 + 7, 1 << 20, (8 << 20) + 5, 64 << 20]

CASES = [
    pytest.param(("tcp", -1), id="tcp"),
    pytest.param(("tcp", 0), id="tcp-gpu", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="tcp-gpu needs a CUDA GPU")]),
    pytest.param(("ipc", -1), id="ipc-host"),
    pytest.param(("ipc", 0), id="ipc-gpu", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="ipc-gpu needs a CUDA GPU")]),
    pytest.param(("verbs", -1), id="verbs"),
]


def _seed():
    return int(os.environ.get("PXN_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")


class Case:
    def __init__(self, name: str, device: int):
        self.name, self.device = name, device
        try:
            self.fab = make_fabric(name)
        except FabricUnavailable as e:
            pytest.skip(f"{name}: {e}")
        try:
            self.target = Target(name, REGION, device)
        except RemoteError as e:
            self.fab.close()
            if e.kind == "FabricUnavailable":
                pytest.skip(f"{name} target: {e.message}")
            raise
        self.src = Buffer(REGION, device)
        self.mr = self.fab.register(self.src.addr, REGION, device)
        self._ep = self.fab.connect(self.target.desc)
        self.rng = np.random.default_rng(_seed())
        # RC semantics: a refused write fails its endpoint (both QPs go to the error state), and the fabric
        # connects anew; tcp and ipc keep an endpoint through a refusal
        self.rc = self.fab.capabilities.refusal_fails_endpoint

    @property
    def ep(self):
        """The endpoint to the module's target, connected anew where an earlier test failed it on purpose."""
        if not self._ep.alive:
            self._ep = self.fab.connect(self.target.desc)
        return self._ep

    @ep.setter
    def ep(self, value):
        self._ep = value

    def fresh(self, n: int) -> np.ndarray:
        """Random source bytes for the first ``n`` bytes of the source buffer (returned for comparison)."""
        data = self.rng.integers(0, 256, n, dtype=np.uint8)
        self.src.write(0, data)
        return data

    def req(self, src_off, n, dst_off, imm=None, wr_id=0, rkey=None):
        return WriteRequest(self.src.addr + src_off, n, self.target.addr + dst_off,
                            self.target.rkey if rkey is None else rkey, self.mr.lkey, imm, wr_id)

    def close(self):
        self.target.close()
        self.fab.close()


@pytest.fixture(scope="module", params=CASES)
def case(request):
    name, device = request.param
    c = Case(name, device)
    yield c
    c.close()


def _ok(comps):
    bad = [c for c in comps if not c.ok]
    assert not bad, bad[:3]


def test_sizes_byte_exact(case):
    case.target.call("poison")
    data = case.fresh(sum(SIZES) + 64)
    reqs, src_off, dst_off, written = [], 0, 3, []
    for i, n in enumerate(SIZES):
        reqs.append(case.req(src_off, n, dst_off, wr_id=i))
        written.append((src_off, n, dst_off))
        src_off += n + 1
        dst_off += n + 5  # odd offsets: no alignment assumptions
    for r in reqs:  # one post per size, then all completions
        case.fab.post_writes(case.ep, [r])
    comps = wait_completions(case.fab, len(reqs))
    assert [c.wr_id for c in comps] == list(range(len(SIZES)))
    _ok(comps)
    for c, n in zip(comps, SIZES):
        assert c.opcode == Opcode.WRITE and c.byte_len == n and c.peer_id == case.target.id
    for s, n, d in written:
        assert case.target.call("hash", d, n) == digest(data[s:s + n]), f"{n} B write differs"
    bad, nbad, nsmall = case.target.call("untouched", [(d, n) for _, n, d in written])
    assert nbad == 0 and nsmall == 0, f"bytes outside the written ranges changed (first at region+{bad})"


def test_imm_delivery_and_order(case):
    case.target.call("poll", 4096, 0.0)  # drain
    data = case.fresh(300 * 64)
    posts = [list(range(i, i + 75)) for i in range(0, 300, 75)]
    for p in posts:
        case.fab.post_writes(case.ep, [case.req(64 * i, 64, 64 * i, imm=(i * 7919) & 0xFFFFFFFF
                                                if i % 3 else None, wr_id=i) for i in p])
    comps = wait_completions(case.fab, 300)
    _ok(comps)
    assert [c.wr_id for c in comps] == list(range(300)), "sender completions out of posting order"
    assert all(c.opcode == (Opcode.WRITE_WITH_IMM if c.wr_id % 3 else Opcode.WRITE) for c in comps)
    imms = case.target.poll_until(200, opcode=int(Opcode.RECV_IMM))
    assert [c[4] for c in imms] == [(i * 7919) & 0xFFFFFFFF for i in range(300) if i % 3]
    assert all(c[3] == 64 and c[2] == case.fab.local_id and c[5] is None for c in imms)
    assert case.target.call("hash", 0, 300 * 64) == digest(data)


def test_many_writes_per_post_scattered(case):
    n = 4096
    data = case.fresh(n * 64)
    perm = case.rng.permutation(n)
    case.fab.post_writes(case.ep, [case.req(64 * i, 64, 64 * int(perm[i]), wr_id=i) for i in range(n)])
    comps = wait_completions(case.fab, n)
    _ok(comps)
    assert len(comps) == n
    expect = np.empty_like(data)
    expect.reshape(n, 64)[perm] = data.reshape(n, 64)
    assert case.target.call("hash", 0, n * 64) == digest(expect)


def test_unsignaled_writes_complete_silently_but_errors_still_complete(case):
    """Selective signaling: only the signaled write of a run completes on success, after every silent one before
    it has landed; a silent write that is refused still completes with its error. A fabric without the
    capability completes every write, which the engine also handles."""
    selective = case.fab.capabilities.selective_signaling
    n = 300
    data = case.fresh(n * 97)
    reqs = [case.req(97 * i, 97, 97 * i + 3, wr_id=100 + i) for i in range(n)]
    for r in reqs[:-1]:
        r.signaled = False
    case.fab.post_writes(case.ep, reqs)
    comps = wait_completions(case.fab, 1 if selective else n)
    _ok(comps)
    assert comps[-1].wr_id == 100 + n - 1
    assert case.target.call("hash", 3, n * 97) == digest(data)
    if selective:
        assert not case.fab.poll(16, timeout=0.2), "a silent write completed on success"
        t = case.target
        bad = WriteRequest(case.src.addr, 64, t.addr - 64, t.rkey, case.mr.lkey, None, 900, signaled=False)
        case.fab.post_writes(case.ep, [bad, case.req(0, 64, 5000, wr_id=901)])
        comps = wait_completions(case.fab, 2)
        assert [c.wr_id for c in comps] == [900, 901]
        assert isinstance(comps[0].error, RegionError)
        if case.rc:  # the refusal failed the endpoint: the write after it was not executed, and says which one
            assert isinstance(comps[1].error, PeerLost) and "wr_id=900" in str(comps[1].error), comps[1]
        else:
            assert comps[1].ok


def _batches(case):
    if not case.fab.capabilities.write_batches:
        pytest.skip(f"{case.name} does not declare write_batches")


def test_write_batch_byte_exact_one_completion(case):
    """A WriteBatch: thousands of scattered writes of odd sizes (1 B, 63 B, up to pieces larger than a message)
    land byte-exact, nothing else changes, and exactly one completion reports it, after a plain write posted
    before it and with the batch's total length."""
    _batches(case)
    t = case.target
    t.call("poison")
    lens = np.concatenate([case.rng.integers(1, 9000, 3000), [1, 63, 3 << 20, 17 << 20]]).astype(np.int64)
    case.rng.shuffle(lens)
    total = int(lens.sum())
    data = case.fresh(total + 4096)
    src_off = np.cumsum(lens) - lens  # packed sources, destinations shuffled with odd gaps
    slots = case.rng.permutation(lens.size)
    gaps = case.rng.integers(1, 40, lens.size)
    dst_start = np.cumsum(lens[slots] + gaps[slots]) - lens[slots]
    dst_off = np.empty_like(dst_start)
    dst_off[slots] = dst_start
    assert int(dst_off.max() + lens.max()) < REGION
    case.fab.post_writes(case.ep, [case.req(total, 3, 0, wr_id=40),
                                   WriteBatch(case.src.addr + src_off, lens, t.addr + 7 + dst_off,
                                              np.full(lens.size, t.rkey), np.full(lens.size, case.mr.lkey),
                                              wr_id=41)])
    comps = wait_completions(case.fab, 2)
    _ok(comps)
    assert [c.wr_id for c in comps] == [40, 41]
    assert comps[1].opcode == Opcode.WRITE and comps[1].byte_len == total
    assert not case.fab.poll(16, timeout=0.2), "a batch completed more than once"
    # every piece byte-exact, nothing outside the written ranges touched
    for i in case.rng.choice(lens.size, 64, replace=False).tolist() + [int(np.argmax(lens))]:
        s, n, d = int(src_off[i]), int(lens[i]), 7 + int(dst_off[i])
        assert t.call("hash", d, n) == digest(data[s:s + n]), f"batch write {i} ({n} B) differs"
    written = [(0, 3)] + [(7 + int(d), int(n)) for d, n in zip(dst_off, lens)]
    bad, nbad, nsmall = t.call("untouched", written)
    assert nbad == 0 and nsmall == 0, f"bytes outside the batch's writes changed (first at region+{bad})"


def test_write_batch_refused_piece_fails_it_once(case):
    """One write of a batch outside the target's region: the batch completes once, with a RegionError naming
    it; a bad local range raises before anything is posted."""
    _batches(case)
    t = case.target
    t.call("poison")
    case.fresh(64 * 100)
    lens = np.full(100, 64, dtype=np.int64)
    dst = t.addr + 64 * np.arange(100, dtype=np.int64)
    dst[37] = t.addr + REGION - 10  # crosses the end
    keys = np.full(100, t.rkey), np.full(100, case.mr.lkey)
    case.fab.post_writes(case.ep, [WriteBatch(case.src.addr + 64 * np.arange(100), lens, dst, *keys, wr_id=7)])
    (c,) = wait_completions(case.fab, 1)
    assert c.wr_id == 7 and isinstance(c.error, RegionError), c
    assert f"0x{t.addr + REGION - 10:x}" in str(c.error)
    assert not case.fab.poll(16, timeout=0.2), "a failed batch completed twice"
    bad_local = WriteBatch(case.src.addr + 64 * np.arange(100), lens, t.addr + 64 * np.arange(100), *keys, wr_id=8)
    bad_local.local_addr[99] = case.src.addr + REGION - 1
    with pytest.raises(RegionError, match="write 99"):
        case.fab.post_writes(case.ep, [case.req(0, 64, 0, wr_id=9), bad_local])
    assert not case.fab.poll(16, timeout=0.2), "a refused post wrote something"
    bad_at, nbad, nsmall = t.call("untouched", [(64 * i, 64) for i in range(100) if i != 37])
    assert nbad == 0 and nsmall == 0, f"a refused write changed memory (first at region+{bad_at})"
    with pytest.raises(ValueError, match="local_addr has 2 items but length has 1"):
        WriteBatch([1, 2], [3], [4, 5], [1, 1], [1, 1])


def test_write_batch_of_one_write(case):
    """A WriteBatch of one write (the engine's direct unit of one large piece) of an odd size over several
    messages: byte-exact, one completion with its length, nothing around it touched. One whose local range leaves
    the local region, or whose rkey is not 32-bit, raises naming the write before anything is sent; one whose
    remote range leaves the target's region completes once with a RegionError naming its address."""
    _batches(case)
    t = case.target
    t.call("poison")
    n = (9 << 20) + int(case.rng.integers(1, 4096))
    data = case.fresh(n)
    dst = 5 + int(case.rng.integers(0, 4096))

    def one(la, ra, rkey, wr_id):
        return WriteBatch(np.array([la]), np.array([n]), np.array([ra]), np.array([rkey]), np.array([case.mr.lkey]),
                          wr_id=wr_id)

    case.fab.post_writes(case.ep, [one(case.src.addr, t.addr + dst, t.rkey, 50)])
    (c,) = wait_completions(case.fab, 1)
    assert c.ok and c.wr_id == 50 and c.byte_len == n, c
    assert t.call("hash", dst, n) == digest(data)
    with pytest.raises(RegionError, match=f"write 0: local range 0x{case.src.addr + REGION - n + 1:x}"):
        case.fab.post_writes(case.ep, [one(case.src.addr + REGION - n + 1, t.addr + dst, t.rkey, 51)])
    with pytest.raises(ValueError, match="write 0 .*rkey 4294967296"):
        case.fab.post_writes(case.ep, [one(case.src.addr, t.addr + dst, 1 << 32, 52)])
    assert not case.fab.poll(16, timeout=0.2), "a refused post completed"
    bad, nbad, nsmall = t.call("untouched", [(dst, n)])
    assert nbad == 0 and nsmall == 0, f"bytes outside the write changed (first at region+{bad})"
    case.fab.post_writes(case.ep, [one(case.src.addr, t.addr + REGION - n + 1, t.rkey, 53)])
    (c,) = wait_completions(case.fab, 1)
    assert c.wr_id == 53 and isinstance(c.error, RegionError), c
    assert f"0x{t.addr + REGION - n + 1:x}" in str(c.error)


def _bounded_batch(case, src_off, lens, dst_off, wr_id):
    """A WriteBatch with its ``bounds``: the true extremes of its arrays, as the engine gives them."""
    t = case.target
    la, ra = case.src.addr + src_off, t.addr + dst_off
    bounds = WriteBounds(int(lens.min()), int(lens.max()), int(la.min()), int((la + lens).max()), int(ra.min()),
                         int((ra + lens).max()), t.rkey, case.mr.lkey)
    return WriteBatch(la, lens, ra, np.full(lens.size, t.rkey), np.full(lens.size, case.mr.lkey), wr_id=wr_id,
                      nbytes=int(lens.sum()), bounds=bounds)


def _described_odd_pieces(case, wr_id: int, count: int, src_start: int):
    """Poison the target, describe its region to the writer (one 1-byte post, ``wr_id``, at its last byte), and lay
    out ``count`` + 4 fresh source pieces of 1 B – 9 KB (1, 63, 64 and 65 among them) back to back from source
    offset ``src_start``: (lengths, total bytes, the source bytes, source offsets)."""
    case.target.call("poison")
    case.fab.post_writes(case.ep, [case.req(0, 1, REGION - 1, wr_id=wr_id)])
    _ok(wait_completions(case.fab, 1))
    lens = np.concatenate([[1, 63, 64, 65], case.rng.integers(1, 9000, count)]).astype(np.int64)
    case.rng.shuffle(lens)
    total = int(lens.sum())
    data = case.fresh(total + 4096)
    return lens, total, data, np.cumsum(lens) - lens + src_start


def test_write_batch_with_bounds_alone_after_warm_up(case):
    """A WriteBatch posted alone with its ``bounds`` once the target's region is known to the writer (on ipc: the
    kept description, so the posting thread writes it): byte-exact, fresh data, odd sizes and offsets, every
    piece its own bytes; one completion. A batch whose (true) bounds reach past the target's region completes
    once with a RegionError naming that write and nothing of it written (the others land, as in any refused
    batch); one whose local range leaves the local region raises, naming the write, before anything is posted."""
    _batches(case)
    t = case.target
    lens, total, data, src_off = _described_odd_pieces(case, 70, 700, 3)
    slots = case.rng.permutation(lens.size)
    gaps = case.rng.integers(1, 40, lens.size)
    dst_start = np.cumsum(lens[slots] + gaps[slots]) - lens[slots]
    dst_off = np.empty_like(dst_start)
    dst_off[slots] = dst_start
    for wr_id in (71, 72):  # twice: on ipc the first may still ask the target, the second is written here
        case.fab.post_writes(case.ep, [_bounded_batch(case, src_off, lens, dst_off, wr_id)])
        (c,) = wait_completions(case.fab, 1)
        assert c.ok and c.wr_id == wr_id and c.byte_len == total, c
    for i in range(lens.size):
        s, n, d = int(src_off[i]), int(lens[i]), int(dst_off[i])
        assert t.call("hash", d, n) == digest(data[s:s + n]), f"batch write {i} ({n} B at target+{d}) differs"
    written = [(REGION - 1, 1)] + [(int(d), int(n)) for d, n in zip(dst_off, lens)]
    bad, nbad, nsmall = t.call("untouched", written)
    assert nbad == 0 and nsmall == 0, f"bytes outside the batch's writes changed (first at region+{bad})"
    t.call("poison")
    lens = np.full(50, 64, dtype=np.int64)
    dst_off = 64 * np.arange(50, dtype=np.int64)
    dst_off[31] = REGION - 10  # crosses the end of the target's region
    case.fab.post_writes(case.ep, [_bounded_batch(case, 64 * np.arange(50, dtype=np.int64), lens, dst_off, 73)])
    (c,) = wait_completions(case.fab, 1)
    assert c.wr_id == 73 and isinstance(c.error, RegionError), c
    assert f"0x{t.addr + REGION - 10:x}" in str(c.error)
    src_off = 64 * np.arange(50, dtype=np.int64)
    src_off[44] = REGION - 1  # leaves the local region
    with pytest.raises(RegionError, match="write 44"):
        case.fab.post_writes(case.ep, [_bounded_batch(case, src_off, lens, 64 * np.arange(50, dtype=np.int64), 74)])
    assert not case.fab.poll(16, timeout=0.2), "a refused post completed"
    bad_at, nbad, nsmall = t.call("untouched", [(64 * i, 64) for i in range(50) if i != 31])
    assert nbad == 0 and nsmall == 0, f"a refused write changed memory (first at region+{bad_at})"


def _assert_untouched(t, written, what: str) -> None:
    """Nothing of the target's region changed outside ``written`` ((offset, length) pairs) by ``what``."""
    bad_at, nbad, nsmall = t.call("untouched", written)
    assert nbad == 0 and nsmall == 0, f"{what} changed memory outside its ranges (first at region+{bad_at})"


def _check_inline_landed(case, pending, wait: bool, data, src_off, lens, dst_off, written) -> None:
    """An inline write's ``Pending`` (waited for here when not ``wait``): done, no completion left behind, every
    piece's bytes at the target, nothing outside ``written`` changed."""
    t = case.target
    if not wait:
        pending.wait()
    assert pending.done()
    assert not case.fab.poll(16, timeout=0.05), "an inline write left a completion behind"
    for i in range(lens.size):
        s_, n, d = int(src_off[i]), int(lens[i]), int(dst_off[i])
        assert t.call("hash", d, n) == digest(data[s_:s_ + n]), \
            f"inline write {i} ({n} B at target+{d}, wait={wait}) differs"
    _assert_untouched(t, written, "the writes")


def test_inline_write_places_every_byte_or_declines_writing_nothing(case):
    """``write_inline``: a fabric without ``inline_writes`` declines (None) and writes nothing. One with it, once
    the target's region is known to the writer: a ``Pending`` that, waited for, means every piece is placed,
    byte-exact, fresh data, odd sizes (1 B, 63 B) at odd offsets, no completion to poll; the same without the
    wait, then ``wait()``; a batch whose (true) extremes reach past the target's region, or that names a local
    key that is not registered, is declined with nothing written."""
    t = case.target
    lens, total, data, src_off = _described_odd_pieces(case, 80, 300, 5)
    gaps = case.rng.integers(1, 40, lens.size)
    dst_off = np.cumsum(lens + gaps) - lens + 3
    batch = _bounded_batch(case, src_off, lens, dst_off, 0)
    args = (batch.local_addr, batch.remote_addr, batch.length, batch.bounds, total)
    if not case.fab.capabilities.inline_writes:
        assert case.fab.write_inline(case.ep, *args) is None
        _assert_untouched(t, [(REGION - 1, 1)], "a declined write")
        return
    written = [(REGION - 1, 1)] + [(int(d), int(n)) for d, n in zip(dst_off, lens)]
    for wait in (True, False):
        if not wait:
            t.call("poison")
            data = case.fresh(total + 4096)
        for _ in range(2):  # on ipc the first post above may still have asked the target: one decline allowed
            pending = case.fab.write_inline(case.ep, *args, wait=wait)
            if pending is not None:
                break
        else:
            pytest.fail(f"{case.name}: write_inline declined a batch inside the described region twice")
        # the first round also finds the byte the describing post wrote; the second follows a poison
        _check_inline_landed(case, pending, wait, data, src_off, lens, dst_off, written if wait else written[1:])
    t.call("poison")
    lens = np.full(20, 64, dtype=np.int64)
    dst_off = 64 * np.arange(20, dtype=np.int64)
    dst_off[7] = REGION - 10  # crosses the end of the target's region
    past = _bounded_batch(case, 64 * np.arange(20, dtype=np.int64), lens, dst_off, 0)
    assert case.fab.write_inline(case.ep, past.local_addr, past.remote_addr, past.length, past.bounds, 1280) is None
    unknown = past.bounds._replace(remote_end=past.bounds.remote_min + 64, lkey=past.bounds.lkey ^ 0x5A5A)
    assert case.fab.write_inline(case.ep, past.local_addr, past.remote_addr, past.length, unknown, 1280) is None
    _assert_untouched(t, [], "a declined write")


def test_inline_write_over_regions_places_every_byte_or_declines_writing_nothing(case):
    """``write_inline_regions``: the pieces of one batch named by region on each side (``RegionSpans``): here two
    spans of the target's region, the pieces alternating between them, and the local region twice, so that each
    piece's peer region position (``remote_index``) is used. A fabric without ``inline_writes`` declines and
    writes nothing; one with it places every piece, byte-exact, fresh data, odd sizes at odd offsets, waited for
    or not. Declined with nothing written: a span that reaches past the target's region, an unknown rkey, a
    local span outside the local region, an unknown lkey."""
    t = case.target
    lens, total, data, src_off = _described_odd_pieces(case, 81, 200, 11)
    half = REGION // 2
    gaps = case.rng.integers(1, 40, lens.size)
    dst_off = np.cumsum(lens + gaps) - lens + 5
    dst_off[1::2] += half  # every other piece in the second span
    where = np.zeros(lens.size, dtype=np.int64)
    where[1::2] = 1
    la, ra = case.src.addr + src_off, t.addr + dst_off
    lkey = case.mr.lkey
    spans = RegionSpans(int(lens.min()), int(lens.max()), int(la.min()), int((la + lens).max()), int(ra.min()),
                        int((ra + lens).max()), ((lkey, case.src.addr, case.src.addr + half),
                                                 (lkey, case.src.addr, case.src.addr + REGION)),
                        ((t.rkey, t.addr, t.addr + half), (t.rkey, t.addr + half, t.addr + REGION)), where)
    if not case.fab.capabilities.inline_writes:
        assert case.fab.write_inline_regions(case.ep, la, ra, lens, spans, total) is None
        _assert_untouched(t, [(REGION - 1, 1)], "a declined write")
        return
    written = [(REGION - 1, 1)] + [(int(d), int(n)) for d, n in zip(dst_off, lens)]
    for wait in (True, False):
        if not wait:
            t.call("poison")
            data = case.fresh(total + 4096)
        pending = case.fab.write_inline_regions(case.ep, la, ra, lens, spans, total, wait=wait)
        assert pending is not None, f"{case.name}: write_inline_regions declined pieces inside described regions"
        _check_inline_landed(case, pending, wait, data, src_off, lens, dst_off, written if wait else written[1:])
    t.call("poison")
    refused = [
        spans._replace(remote=((t.rkey, t.addr, t.addr + half), (t.rkey, t.addr + half, t.addr + REGION + 1))),
        spans._replace(remote=((t.rkey, t.addr, t.addr + half), (t.rkey ^ 0x5A5A, t.addr + half, t.addr + REGION))),
        spans._replace(local=((lkey, case.src.addr - 1, case.src.addr + half),)),
        spans._replace(local=((lkey ^ 0x5A5A, case.src.addr, case.src.addr + REGION),)),
    ]
    for bad in refused:
        assert case.fab.write_inline_regions(case.ep, la, ra, lens, bad, total) is None, bad
    _assert_untouched(t, [], "a declined write")


def test_inline_write_over_regions_is_checked_again_after_a_local_deregistration(case):
    """A fabric may remember its checks of a batch layout over several regions (ipc does, for the same
    ``RegionSpans.local`` / ``remote`` tuples, which the engine passes again for a layout it saw before). The
    same spans written three times, fresh data each time, byte-exact; then the writer deregisters one of the
    local regions the spans name: the same spans are declined, with nothing written. Pieces alternate between
    the fabric's source region and a second local region, and between two spans of the target's region. A fabric
    without ``inline_writes`` declines every round, writing nothing."""
    inline = case.fab.capabilities.inline_writes
    t = case.target
    lens, total, data, src_off = _described_odd_pieces(case, 82, 40, 7)
    other = Buffer(total + 4096, case.device)
    other_mr = case.fab.register(other.addr, other.size, case.device)
    half = REGION // 2
    dst_off = np.cumsum(lens + case.rng.integers(1, 40, lens.size)) - lens + 9
    dst_off[1::2] += half
    where = np.zeros(lens.size, dtype=np.int64)
    where[1::2] = 1
    la = case.src.addr + src_off
    la[1::2] = other.addr + src_off[1::2]  # every other piece from the second local region (same offsets)
    ra = t.addr + dst_off
    lkey = case.mr.lkey
    spans = RegionSpans(int(lens.min()), int(lens.max()), int(la.min()), int((la + lens).max()), int(ra.min()),
                        int((ra + lens).max()), ((lkey, case.src.addr, case.src.addr + REGION),
                                                 (other_mr.lkey, other.addr, other.addr + other.size)),
                        ((t.rkey, t.addr, t.addr + half), (t.rkey, t.addr + half, t.addr + REGION)), where)
    written = [(int(d), int(n)) for d, n in zip(dst_off, lens)]
    try:
        for round_ in range(3):
            t.call("poison")
            data = case.fresh(total + 4096)
            other.write(0, data)  # the second region holds the same bytes at the same offsets
            pending = case.fab.write_inline_regions(case.ep, la, ra, lens, spans, total)
            if not inline:
                assert pending is None, f"{case.name} took an inline write without the capability"
                _assert_untouched(t, [], "a declined write")
                continue
            assert pending is not None, f"{case.name}: round {round_} declined pieces inside described regions"
            _check_inline_landed(case, pending, True, data, src_off, lens, dst_off, written)
        case.fab.deregister(other_mr)
        other_mr = None
        t.call("poison")
        assert case.fab.write_inline_regions(case.ep, la, ra, lens, spans, total) is None, \
            "the remembered layout was written after one of its local regions was deregistered"
        _assert_untouched(t, [], "a declined write")
    finally:
        if other_mr is not None:
            case.fab.deregister(other_mr)


def test_write_batch_over_local_regions_is_checked_again_after_a_local_deregistration(case):
    """A fabric may remember what it derived from a batch's lkeys when they name several local regions (tcp and
    ipc do, by the lkey array's bytes). A WriteBatch with its pieces alternating between the fabric's source region
    and a second local region, posted three times with fresh data: byte-exact each time. Then the second region is
    deregistered: the same batch is refused at the post (RegionError naming that lkey), nothing posted or written;
    and the same memory registered again one byte short of the last piece read from it is refused naming that
    piece."""
    _batches(case)
    t = case.target
    lens, total, data, src_off = _described_odd_pieces(case, 83, 40, 5)
    other = Buffer(total + 4096, case.device)
    other_mr = case.fab.register(other.addr, other.size, case.device)
    la = case.src.addr + src_off
    la[1::2] = other.addr + src_off[1::2]  # every other piece from the second local region (same offsets)
    dst_off = np.cumsum(lens + case.rng.integers(1, 40, lens.size)) - lens + 11
    lkeys = np.full(lens.size, case.mr.lkey, dtype=np.int64)
    written = [(int(d), int(n)) for d, n in zip(dst_off, lens)]

    def batch(wr_id):
        return WriteBatch(la.copy(), lens, t.addr + dst_off, np.full(lens.size, t.rkey), lkeys.copy(), wr_id=wr_id)

    try:
        lkeys[1::2] = other_mr.lkey
        for round_ in range(3):
            t.call("poison")
            data = case.fresh(total + 4096)
            other.write(0, data)  # the second region holds the same bytes at the same offsets
            case.fab.post_writes(case.ep, [batch(90 + round_)])
            (c,) = wait_completions(case.fab, 1)
            assert c.ok and c.wr_id == 90 + round_, c
            for i in case.rng.choice(lens.size, 16, replace=False).tolist():
                s, n = int(src_off[i]), int(lens[i])
                assert t.call("hash", int(dst_off[i]), n) == digest(data[s:s + n]), \
                    f"round {round_}: piece {i} ({n} B) differs"
            _assert_untouched(t, written, f"round {round_}")
        case.fab.deregister(other_mr)
        gone, other_mr = other_mr.lkey, None
        t.call("poison")
        with pytest.raises(RegionError, match=f"lkey 0x{gone:x}"):
            case.fab.post_writes(case.ep, [batch(94)])
        assert not case.fab.poll(16, timeout=0.2), "a refused post completed"
        _assert_untouched(t, [], "a refused post")
        # the same memory registered again, one byte short of the last piece read from it: that piece is named
        last = int(np.flatnonzero(la >= other.addr)[-1])
        other_mr = case.fab.register(other.addr, int(src_off[last] + lens[last]) - 1, case.device)
        lkeys[1::2] = other_mr.lkey
        with pytest.raises(RegionError, match=f"write {last}: local range"):
            case.fab.post_writes(case.ep, [batch(95)])
        assert not case.fab.poll(16, timeout=0.2), "a refused post completed"
        _assert_untouched(t, [], "a refused post")
    finally:
        if other_mr is not None:
            case.fab.deregister(other_mr)


def test_writes_after_events_follow_producer_and_free_sources_after_reuse_event(case):
    """``post_writes_after``: the writes carry the bytes the producer behind ``after`` wrote (a slow GPU
    producer: a fabric that read the sources before it finished would carry the poison), and an overwrite of
    the sources queued after the returned event never reaches the target. Host memory: no events, the same
    call. Each fabric twice: a batch (ordered on the GPU where the fabric can) and plain writes (host wait)."""
    t = case.target
    lens = np.concatenate([[1, 63], case.rng.integers(1, 70000, 40), [(2 << 20) + 3]]).astype(np.int64)
    src_off = np.cumsum(lens) - lens + 5  # unaligned
    dst_off = np.cumsum(lens + 11) - lens + 3
    total = int(lens.sum())
    keys = np.full(lens.size, t.rkey), np.full(lens.size, case.mr.lkey)
    for as_batch, wr_id in ((True, 61), (False, 62)):
        if as_batch and not case.fab.capabilities.write_batches:
            continue
        t.call("poison")
        data = case.rng.integers(0, 256, total, dtype=np.uint8)
        case.src.fill(0xA5)  # the poison the producer replaces
        # warm the peer's region description, so that an ipc writer may take its GPU-ordered path
        case.fab.post_writes(case.ep, [case.req(0, 1, int(dst_off[-1] + lens[-1] + 64), wr_id=60)])
        _ok(wait_completions(case.fab, 1))
        after = []
        if case.device >= 0:
            import torch
            producer = torch.cuda.Stream(case.device)
            staged = torch.from_numpy(data).to(f"cuda:{case.device}")
            producer.wait_stream(torch.cuda.current_stream(case.device))
            with torch.cuda.stream(producer):
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the bytes arrive
                for o, n, k in zip((src_off - 5).tolist(), lens.tolist(), src_off.tolist()):
                    case.src.arr[k:k + n].copy_(staged[o:o + n])
                event = torch.cuda.Event()
                event.record(producer)
            after = [event]
        else:
            for o, n, k in zip((src_off - 5).tolist(), lens.tolist(), src_off.tolist()):
                case.src.arr[k:k + n] = data[o:o + n]
        if as_batch:
            reqs = [WriteBatch(case.src.addr + src_off, lens, t.addr + dst_off, *keys, wr_id=wr_id)]
        else:
            reqs = [case.req(int(s_), int(n_), int(d_), wr_id=wr_id + 1000 * i)
                    for i, (s_, n_, d_) in enumerate(zip(src_off, lens, dst_off))]
        reusable = case.fab.post_writes_after(case.ep, reqs, after)
        if reusable is not None:
            import torch
            assert case.fab.capabilities.event_ordered_writes
            overwrite = torch.cuda.Stream(case.device)
            overwrite.wait_event(reusable)
            with torch.cuda.stream(overwrite):
                case.src.arr.fill_(0x5A)  # after the writes read the sources: must not reach the target
        comps = wait_completions(case.fab, len(reqs))
        _ok(comps)
        for i in range(lens.size):
            o = int(src_off[i]) - 5
            n, d = int(lens[i]), int(dst_off[i])
            assert t.call("hash", d, n) == digest(data[o:o + n]), \
                f"{'batch' if as_batch else 'plain'} write {i} ({n} B at target+{d}) is not the producer's bytes"
        if case.device >= 0:
            import torch
            torch.cuda.synchronize(case.device)


def test_concurrent_posters(case):
    threads, per, size = 4, 40, 5000
    data = case.fresh(threads * per * size)
    errors = []

    def poster(t):
        try:
            for k in range(0, per, 8):
                case.fab.post_writes(case.ep, [case.req((t * per + i) * size, size, (t * per + i) * size,
                                                        wr_id=t * 1000 + i) for i in range(k, k + 8)])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=poster, args=(t,)) for t in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    comps = wait_completions(case.fab, threads * per)
    _ok(comps)
    assert sorted(c.wr_id for c in comps) == sorted(t * 1000 + i for t in range(threads) for i in range(per))
    assert case.target.call("hash", 0, len(data)) == digest(data)


def _post_until_settled(case, reqs):
    """Post ``reqs`` and wait for all of them. On a fabric where a refusal fails the endpoint (RC), the writes
    after a refused one complete with ``PeerLost`` naming it, as not executed; they are posted again on the
    endpoint connected anew, until each has its own outcome. Returns the final completions in posting order."""
    final = {}
    left = list(reqs)
    for _ in range(len(reqs)):
        case.fab.post_writes(case.ep, left)
        comps = wait_completions(case.fab, len(left))
        assert sorted(c.wr_id for c in comps) == sorted(r.wr_id for r in left), comps
        again = []
        for r, c in zip(left, sorted(comps, key=lambda c: [x.wr_id for x in left].index(c.wr_id))):
            if case.rc and isinstance(c.error, PeerLost) and "was not executed" in str(c.error):
                again.append(r)
            else:
                final[c.wr_id] = c
        if not again:
            break
        assert len(again) < len(left), "nothing settled in a round"
        left = again
    return [final[r.wr_id] for r in reqs]


def test_refused_writes_write_nothing(case):
    case.target.call("poison")
    case.fresh(REGION)
    t = case.target
    bad = [
        case.req(0, 4096, 0, rkey=(t.rkey ^ 0x5A5A5A5A) or 1, wr_id=1),  # wrong rkey
        WriteRequest(case.src.addr, 4096, t.addr - 100, t.rkey, case.mr.lkey, None, 2),  # starts before
        case.req(0, 4096, REGION - 100, wr_id=3),  # crosses the end
        case.req(0, 64, REGION + 10, wr_id=4),  # entirely after
        case.req(0, REGION, 1, wr_id=5, imm=9),  # whole region + 1: striped pieces must all be refused
        WriteRequest(case.src.addr, 100, t.info["small_addr"], t.rkey, case.mr.lkey, None, 6),  # other region
    ]
    comps = _post_until_settled(case, bad + [case.req(0, 128, 1000, wr_id=7)])
    assert [c.wr_id for c in comps] == [1, 2, 3, 4, 5, 6, 7]
    for c in comps[:-1]:
        assert isinstance(c.error, RegionError), c
        assert hex(t.rkey)[2:] in str(c.error) or "rkey" in str(c.error)
    assert comps[-1].ok
    bad_at, nbad, nsmall = t.call("untouched", [(1000, 128)])
    assert nbad == 0 and nsmall == 0, f"a refused write changed memory (first at region+{bad_at})"
    assert not [c for c in t.call("poll", 100, 0.2) if c[1] == int(Opcode.RECV_IMM)], "IMM of a refused write"


def test_deregistered_region_refused(case):
    # a fresh target, since deregistering changes its state
    t = case.target
    t.call("poison")
    case.fresh(64)
    small_rkey = t.info["small_rkey"]
    t.call("deregister_small")
    case.fab.post_writes(case.ep, [WriteRequest(case.src.addr, 64, t.info["small_addr"], small_rkey,
                                                case.mr.lkey, None, 11)])
    (c,) = wait_completions(case.fab, 1)
    assert isinstance(c.error, RegionError)
    assert t.call("untouched", [])[1:] == (0, 0)


def test_symmetric_write_back(case):
    """After we connected, the target has endpoint(our id) and can write into our registered memory."""
    assert case.ep.alive  # connected anew where an earlier test failed the endpoint: the target holds it too
    data = case.rng.integers(0, 256, 10000, dtype=np.uint8)
    case.target.call("fill", 0, data)
    case.src.fill(0)
    got = case.target.call("writeback", case.fab.local_id,
                           [(0, 10000, case.src.addr + 5, case.mr.rkey, 77, 1), (0, 10, case.src.addr, 0xDEAD, None, 2)])
    assert [g[0] for g in got] == [1, 2]
    assert got[0][5] is None and got[1][5][0] == "RegionError"
    assert digest(case.src.read(5, 10000)) == digest(data)
    assert not case.src.read(0, 5).any() and not case.src.read(10005, 100).any()
    imm = wait_completions(case.fab, 1, sender_only=False)
    assert imm and imm[0].opcode == Opcode.RECV_IMM and imm[0].imm == 77 and imm[0].peer_id == case.target.id


def test_bad_input_named_exceptions(case):
    f, ep, t = case.fab, case.ep, case.target
    t.call("poison")
    ok = case.req(0, 64, 0)
    cases = [
        (WriteRequest(case.src.addr + REGION, 64, t.addr, t.rkey, case.mr.lkey), RegionError),  # outside lkey
        (WriteRequest(case.src.addr, 64, t.addr, t.rkey, case.mr.lkey ^ 0xFFFF), RegionError),  # unknown lkey
        (case.req(0, 0, 0), ValueError),
        (case.req(0, -5, 0), ValueError),
        (WriteRequest(case.src.addr, 100, (1 << 64) - 10, t.rkey, case.mr.lkey), ValueError),  # overflow
        (case.req(0, 64, 0, imm=1 << 32), ValueError),
    ]
    for bad, exc in cases:
        with pytest.raises(exc) as ei:
            f.post_writes(ep, [ok, bad])  # the valid one must not be posted either
        assert str(ei.value)
        # the same inside a post of many writes (checked in bulk), anywhere in it
        for where in (0, 20, 40):
            many = [case.req(64 * i, 64, 64 * i) for i in range(40)]
            many.insert(where, bad)
            with pytest.raises(exc):
                f.post_writes(ep, many)
    with pytest.raises(ValueError):
        f.post_writes(ep, [case.req(64 * i, 64, 64 * i) for i in range(30)] + [case.req(0, True, 0)])
    assert wait_completions(f, 1, timeout=0.3) == []
    assert t.call("untouched", [])[1:] == (0, 0)
    with pytest.raises(ValueError):
        f.register(case.src.addr, 0)
    with pytest.raises(ValueError):
        f.register((1 << 64) - 8, 64)
    with pytest.raises(UnknownPeer):
        f.endpoint("10.255.255.1:1")
    with pytest.raises(RegionError):
        f.deregister(type(case.mr)(case.src.addr, 64, 123, 123, case.device))


def test_closed_fabric(case):
    f = make_fabric(case.name)
    buf = Buffer(4096, case.device)
    mr = f.register(buf.addr, 4096, case.device)
    ep = f.connect(case.target.desc)
    f.close()
    f.close()  # idempotent
    for call in (lambda: f.register(buf.addr, 64, case.device), lambda: f.poll(1),
                 lambda: f.post_writes(ep, [WriteRequest(buf.addr, 64, case.target.addr, case.target.rkey, mr.lkey)]),
                 lambda: f.connect(case.target.desc), lambda: f.descriptor(), lambda: f.deregister(mr)):
        with pytest.raises(FabricClosed):
            call()


def test_abort_then_reconnect(case):
    ep = case.fab.connect(case.target.desc)
    assert ep.alive
    ep.abort()
    assert not ep.alive
    with pytest.raises(PeerLost):
        case.fab.post_writes(ep, [case.req(0, 64, 0)])
    ep2 = case.fab.connect(case.target.desc)
    assert ep2.alive and ep2 is not ep
    case.ep = ep2
    data = case.fresh(1000)
    case.fab.post_writes(ep2, [case.req(0, 1000, 0, wr_id=5)])
    comps = wait_completions(case.fab, 1)
    _ok(comps)
    assert case.target.call("hash", 0, 1000) == digest(data)


def test_peer_death_fails_pending_in_bounded_time(case):
    """A target killed mid-stream fails its pending work with PeerLost within seconds; the other endpoint
    (the module's target) keeps working."""
    dying = Target(case.name, 64 << 20, case.device)
    try:
        ep = case.fab.connect(dying.desc)
        n, size = 64, 4 << 20
        case.fresh(n * size // 4)
        reqs = [WriteRequest(case.src.addr + (i % 4) * size, size, dying.addr + (i % 16) * size, dying.rkey,
                             case.mr.lkey, None, 100 + i) for i in range(n)]
        case.fab.post_writes(ep, reqs)
        dying.kill()
        t0 = time.monotonic()
        comps = wait_completions(case.fab, n, timeout=10)
        elapsed = time.monotonic() - t0
        assert sorted(c.wr_id for c in comps) == [100 + i for i in range(n)]
        assert elapsed < 8, f"pending work took {elapsed:.1f} s to fail"
        for c in comps:
            assert c.ok or isinstance(c.error, PeerLost), c
        assert any(isinstance(c.error, PeerLost) for c in comps), "the peer died after the stream finished"
        wait_for(lambda: not ep.alive, "the endpoint reading dead", timeout=5)
        with pytest.raises(PeerLost):
            case.fab.post_writes(ep, [reqs[0]])
    finally:
        dying.close()
    data = case.fresh(4096)
    case.fab.post_writes(case.ep, [case.req(0, 4096, 0, wr_id=1)])
    comps = wait_completions(case.fab, 1)
    _ok(comps)
    assert case.target.call("hash", 0, 4096) == digest(data)


def test_unregistered_target_addresses_never_written_by_huge_stream(case):
    """Many refused large writes interleaved with valid ones: valid land, refused touch nothing."""
    t = case.target
    t.call("poison")
    data = case.fresh(8 << 20)
    reqs = []
    for i in range(8):
        reqs.append(case.req(i << 20, 1 << 20, i << 20, wr_id=2 * i))
        reqs.append(case.req(0, 2 << 20, REGION - (1 << 20), wr_id=2 * i + 1))
    comps = _post_until_settled(case, reqs)
    assert [c.ok for c in comps] == [True, False] * 8
    assert all(isinstance(c.error, RegionError) for c in comps[1::2]), comps
    assert t.call("hash", 0, 8 << 20) == digest(data)
    assert t.call("untouched", [(0, 8 << 20)])[1:] == (0, 0)


def test_hung_peer_fails_after_ack_timeout(case):
    """A peer process that stops answering (SIGSTOP: its kernel keeps TCP up) fails pending work with PeerLost
    after the ack timeout, not never."""
    if case.name not in ("tcp", "ipc"):
        pytest.skip("tcp/ipc acknowledge in software; on RC the NIC of a stopped process still acknowledges, so a "
                    "lost link is the verbs case (tests/test_verbs.py, SOFTVERBS_FAULTS)")
    fab = make_fabric(case.name, ack_timeout=1.5)
    hung = Target(case.name, 1 << 20, case.device)
    try:
        buf = Buffer(4096, case.device)
        mr = fab.register(buf.addr, 4096, case.device)
        ep = fab.connect(hung.desc)
        os.kill(hung.proc.pid, signal.SIGSTOP)
        wait_stopped(hung.proc.pid, timeout=5.0)  # the signal is asynchronous: a loaded box may run the target a while longer
        fab.post_writes(ep, [WriteRequest(buf.addr, 4096, hung.addr, hung.rkey, mr.lkey, None, 9)])
        t0 = time.monotonic()
        comps = wait_completions(fab, 1, timeout=8)
        assert len(comps) == 1 and isinstance(comps[0].error, PeerLost), comps
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(hung.proc.pid, signal.SIGCONT)
        hung.close()
        fab.close()


def test_idle_connection_outlives_the_handshake_timeout(case):
    """A connection with no traffic for longer than ``connect_timeout`` and ``handshake_timeout`` stays up on both
    sides (an accepting side that left its handshake timeout on the sockets its threads block on killed idle
    rails: tcp's receive threads once, verbs' liveness channel once)."""
    fab = make_fabric(case.name, connect_timeout=0.5)
    target = Target(case.name, 1 << 20, case.device, options={"connect_timeout": 0.5, "handshake_timeout": 0.5})
    try:
        buf = Buffer(4096, case.device)
        data = np.random.default_rng(_seed()).integers(0, 256, 4096, dtype=np.uint8)
        buf.write(0, data)
        mr = fab.register(buf.addr, 4096, case.device)
        ep = fab.connect(target.desc)
        time.sleep(2.0)  # the scenario: an idle connection outlives 4x its connect and handshake timeouts
        assert ep.alive
        fab.post_writes(ep, [WriteRequest(buf.addr, 4096, target.addr + 5, target.rkey, mr.lkey, None, 1)])
        _ok(wait_completions(fab, 1, timeout=10))
        assert target.call("hash", 5, 4096) == digest(data)
    finally:
        target.close()
        fab.close()


def test_ipc_refuses_forged_descriptor(case):
    """An ipc descriptor whose pid/token do not match a live fabric is refused before anything is written."""
    if case.name != "ipc":
        pytest.skip("ipc only")
    import json
    d = json.loads(case.target.desc)
    for forged in ({**d, "token": "00" * 32}, {**d, "pid": os.getpid()}, {**d, "boot": "another-host"}):
        f = make_fabric("ipc")
        try:
            with pytest.raises(FabricUnavailable):
                f.connect(json.dumps(forged).encode())
        finally:
            f.close()


def test_local_writer_only_where_declared_and_for_the_verified_process(case):
    """``Fabric.local_writer``: None on a fabric without the ``loadstore`` capability; on ipc, None for a hello
    without a region counter or naming another pid than the one the endpoint verified, else a writer whose
    ``stale()`` follows the peer's counter (here a word of the target's host region, read by
    ``process_vm_readv``: the fallback for a counter whose memfd cannot be opened)."""
    pid = os.getpid()  # never the target's
    hello = {"region_gen_addr": case.target.addr, "region_gen": 0, "region_gen_fd": -1, "pid": pid}
    if not case.fab.capabilities.loadstore:
        assert case.fab.local_writer(case.ep, hello) is None
        return
    true_pid = case.fab.peer_pid(case.ep)
    assert true_pid != pid
    assert case.fab.local_writer(case.ep, {"pid": true_pid}) is None  # no counter advertised
    assert case.fab.local_writer(case.ep, hello) is None  # a pid the endpoint did not verify
    if case.device >= 0:
        return  # the counter word below must be host memory
    value = int(case.rng.integers(1, 1 << 62))
    case.src.write(0, np.frombuffer(value.to_bytes(8, "little"), dtype=np.uint8))
    case.fab.post_writes(case.ep, [case.req(0, 8, 0, wr_id=1)])
    _ok(wait_completions(case.fab, 1))
    writer = case.fab.local_writer(case.ep, {**hello, "pid": true_pid, "region_gen": value})
    try:
        assert writer is not None and writer.pid == true_pid
        assert not writer.stale()
        case.src.write(0, np.frombuffer((value + 1).to_bytes(8, "little"), dtype=np.uint8))
        case.fab.post_writes(case.ep, [case.req(0, 8, 0, wr_id=2)])
        _ok(wait_completions(case.fab, 1))
        assert writer.stale()
    finally:
        writer.close()
