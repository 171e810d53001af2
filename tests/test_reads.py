"""Reads (``TransferEngine.batch_read`` / ``batch_read_async``): two processes over tcp and over verbs (on
softverbs where no RDMA NIC exists), host memory.

The peer's registered buffer is filled with fresh random bytes (written there, then dumped back so the test
holds the truth byte for byte); each case reads pieces of it into a poisoned local buffer and compares the WHOLE
local buffer with the expected image, so a byte written anywhere else, or a piece read from the wrong place, is
caught.
"""
import threading

import numpy as np
import pytest

from engine_helpers import GUARD, EnginePeer, disjoint_offsets
from transport import InvalidTransfer, TransferEngine, UnknownSession
from transport.peer_process import POISON

MB = 1 << 20
PEER_BYTES = 8 * MB
LOCAL_BYTES = 8 * MB
LOCAL_POISON = 0x5A


@pytest.fixture(scope="module", params=["tcp", "verbs"])
def fabric(request):
    if request.param == "verbs":
        from fabric_helpers import verbs_unavailable
        why = verbs_unavailable()
        if why:
            pytest.skip(f"verbs: {why}")
    return request.param


@pytest.fixture(scope="module")
def peer(fabric):
    p = EnginePeer(PEER_BYTES, fabric=fabric)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reader(fabric):
    eng = TransferEngine(fabric=fabric)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def local(reader):
    buf = np.zeros(LOCAL_BYTES, dtype=np.uint8)
    reader.register(buf)
    return buf


@pytest.fixture(scope="module")
def truth(reader, local, peer):
    """The peer's registered bytes: random, written from here, then read back out of the peer process."""
    from suite_env import SEED
    rng = np.random.default_rng([SEED, 7])
    local[:] = np.frombuffer(rng.bytes(PEER_BYTES), dtype=np.uint8)
    reader.batch_write(peer.session, [local.ctypes.data], [peer.base], [PEER_BYTES])
    whole = np.frombuffer(peer.call("dump"), dtype=np.uint8)
    data = whole[GUARD:GUARD + PEER_BYTES].copy()
    assert np.array_equal(data, local[:PEER_BYTES]) and (whole[:GUARD] == POISON).all()
    return data


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _expect(truth, src_offs, dst_offs, lengths):
    exp = np.full(LOCAL_BYTES, LOCAL_POISON, dtype=np.uint8)
    for s, d, n in zip(src_offs, dst_offs, lengths):
        exp[d:d + n] = truth[s:s + n]
    return exp


def _check(local, exp):
    bad = np.nonzero(local != exp)[0]
    assert bad.size == 0, (f"local buffer differs in {bad.size} byte(s), first at offset {int(bad[0])} (got "
                           f"0x{local[bad[0]]:02x}, expected 0x{exp[bad[0]]:02x})")


def _read(reader, local, peer, src_offs, dst_offs, lengths, asynchronous=False):
    args = (peer.session, [local.ctypes.data + int(o) for o in dst_offs], [peer.base + int(o) for o in src_offs],
            [int(n) for n in lengths])
    if asynchronous:
        h = reader.batch_read_async(*args)
        h.wait()
        assert h.done()
    else:
        reader.batch_read(*args)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_many_odd_pieces_byte_exact(reader, local, peer, truth, rng, asynchronous):
    """1 B, 63 B, unaligned small pieces (gathered by the peer into chunks), plus direct-size pieces."""
    small = np.concatenate([[1, 63, 1, 63, 4097, 65535], rng.integers(1, 3000, 300)])
    large = np.array([64 << 10, 300001, 2 * MB + 3])
    lengths = rng.permutation(np.concatenate([small, large]))
    src_offs = disjoint_offsets(rng, lengths, PEER_BYTES)
    dst_offs = disjoint_offsets(rng, lengths, LOCAL_BYTES)
    local[:] = LOCAL_POISON
    before = peer.call("stats")["paths"]["coalesced"]["items"]
    _read(reader, local, peer, src_offs, dst_offs, lengths, asynchronous)
    _check(local, _expect(truth, src_offs, dst_offs, lengths))
    # the pull side of coalescing: the peer gathered the small pieces into chunks
    assert peer.call("stats")["paths"]["coalesced"]["items"] - before >= small.size


def test_concurrent_reads_from_threads(reader, local, peer, truth, rng):
    local[:] = LOCAL_POISON
    lengths = rng.integers(1, 5000, 400)
    src_offs = disjoint_offsets(rng, lengths, PEER_BYTES)
    dst_offs = disjoint_offsets(rng, lengths, LOCAL_BYTES)
    errors = []

    def work(part):
        try:
            _read(reader, local, peer, src_offs[part::4], dst_offs[part::4], lengths[part::4], part % 2 == 1)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    _check(local, _expect(truth, src_offs, dst_offs, lengths))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_source_outside_peer_regions_is_refused_and_nothing_written(reader, local, peer, truth, asynchronous):
    local[:] = LOCAL_POISON
    good = ([0, 4096], [0, 8192], [64, 4096 * 3])
    for bad_src, bad_len in ((PEER_BYTES - 10, 11), (-GUARD // 2, 8), (PEER_BYTES + 4096, 1)):
        src_offs, dst_offs, lengths = (good[0] + [bad_src], good[1] + [LOCAL_BYTES // 2], good[2] + [bad_len])
        with pytest.raises(InvalidTransfer, match=r"remote_srcs\[2\] = 0x[0-9a-f]+ \+ lengths\[2\] = "
                                                  rf"{bad_len} is outside every region session"):
            _read(reader, local, peer, src_offs, dst_offs, lengths, asynchronous)
    _check(local, np.full(LOCAL_BYTES, LOCAL_POISON, dtype=np.uint8))


def test_local_destination_outside_is_refused_before_asking(reader, local, peer, truth):
    local[:] = LOCAL_POISON
    before = peer.call("stats")["batches"]["submitted"]
    with pytest.raises(InvalidTransfer, match=r"local_dsts\[1\] = 0x[0-9a-f]+ \+ lengths\[1\] = 2 is not inside"):
        reader.batch_read(peer.session, [local.ctypes.data, local.ctypes.data + LOCAL_BYTES - 1],
                          [peer.base, peer.base + 100], [64, 2])
    with pytest.raises(InvalidTransfer, match=r"lengths\[0\] = -1: every length must be >= 0"):
        reader.batch_read(peer.session, [local.ctypes.data], [peer.base], [-1])
    with pytest.raises(InvalidTransfer, match="same length"):
        reader.batch_read_async(peer.session, [local.ctypes.data], [peer.base, peer.base], [1, 1])
    assert peer.call("stats")["batches"]["submitted"] == before  # the peer was never asked to write
    _check(local, np.full(LOCAL_BYTES, LOCAL_POISON, dtype=np.uint8))


def test_unknown_session_and_empty_read(reader, local, peer):
    with pytest.raises(UnknownSession):
        reader.batch_read("127.0.0.1:1", [local.ctypes.data], [0], [1])
    with pytest.raises(UnknownSession):
        reader.batch_read("no-port", [local.ctypes.data], [0], [1])
    reader.batch_read(peer.session, [], [], [])   # empty: nothing to do, the session answers
    with pytest.raises(UnknownSession):
        reader.batch_read("127.0.0.1:1", [], [], [])
