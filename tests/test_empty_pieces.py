"""Empty batches and zero-length pieces mean one thing in the engine and in the Mooncake API, as in Mooncake:
a zero-length piece is done by definition (Mooncake's tcp transport completes it without a round trip; its
batch status of a batch without tasks is COMPLETED), so it is dropped unchecked and the rest of the batch moves;
an empty batch returns at once once the session answers; a negative length is refused with nothing written;
registering zero bytes is refused."""
from __future__ import annotations

import numpy as np
import pytest

from transport.engine import TransferEngine
from transport.errors import InvalidTransfer, UnknownSession

POISON = 0x5A
SIZE = 1 << 16


@pytest.fixture(scope="module")
def engines():
    with TransferEngine(fabric="tcp", rails=1) as a, TransferEngine(fabric="tcp", rails=1) as b:
        src = np.frombuffer(np.random.default_rng(11).bytes(SIZE), dtype=np.uint8).copy()
        dst = np.full(SIZE, POISON, dtype=np.uint8)
        a.register(src.ctypes.data, SIZE)
        b.register(dst.ctypes.data, SIZE)
        yield a, b, src, dst


def _pieces(rng, zero_at):
    """Pieces of odd lengths at distinct offsets, with zero-length ones at ``zero_at`` (their addresses are
    poisoned too: out of every region, as Mooncake never looks at them)."""
    n = 9
    lengths = rng.integers(1, 700, size=n)
    offs = np.arange(n) * 1024 + rng.integers(0, 200, size=n)
    srcs, dsts = offs.copy(), rng.permutation(n) * 1024 + 7
    lengths[list(zero_at)] = 0
    return srcs, dsts, lengths


def _expected(src, srcs, dsts, lengths):
    img = np.full(SIZE, POISON, dtype=np.uint8)
    for s, d, n in zip(srcs, dsts, lengths):
        img[d:d + n] = src[s:s + n]
    return img


@pytest.mark.parametrize("how", ["sync", "async", "list", "array"])
def test_zero_length_pieces_are_dropped_and_the_rest_moves(engines, seed, how):
    a, b, src, dst = engines
    rng = np.random.default_rng(seed)
    srcs, dsts, lengths = _pieces(rng, zero_at=(0, 4, 8))
    dst.fill(POISON)
    s = src.ctypes.data + srcs
    d = dst.ctypes.data + dsts
    s[4], d[8] = -1, 1  # a zero-length piece's addresses are not looked at
    args = (b.session_id, s.tolist(), d.tolist(), lengths.tolist()) if how != "array" else \
        (b.session_id, s, d, lengths)
    if how == "async":
        a.batch_write_async(*args).wait(30)
    else:
        a.batch_write(*args)
    assert (dst == _expected(src, srcs, dsts, lengths)).all()


def test_zero_length_read_pieces_are_dropped(engines, seed):
    a, b, src, dst = engines
    rng = np.random.default_rng(seed)
    srcs, dsts, lengths = _pieces(rng, zero_at=(2,))
    dst.fill(POISON)
    # b reads from a's src into its dst
    b.batch_read(a.session_id, (dst.ctypes.data + dsts).tolist(), (src.ctypes.data + srcs).tolist(),
                 lengths.tolist())
    assert (dst == _expected(src, srcs, dsts, lengths)).all()


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0]])
def test_empty_batches_return_at_once_and_write_nothing(engines, lengths):
    a, b, src, dst = engines
    dst.fill(POISON)
    n = len(lengths)
    a.batch_write(b.session_id, [src.ctypes.data] * n, [dst.ctypes.data] * n, lengths)
    assert a.batch_write_async(b.session_id, [src.ctypes.data] * n, [dst.ctypes.data] * n, lengths).wait(5) \
        is None
    b.batch_read(a.session_id, [dst.ctypes.data] * n, [src.ctypes.data] * n, lengths)
    assert (dst == POISON).all()
    # the session is still checked: an empty batch to nobody is an unknown session
    with pytest.raises(UnknownSession):
        a.batch_write("127.0.0.1:1", [src.ctypes.data] * n, [0] * n, lengths)


def test_negative_length_is_refused_with_nothing_written(engines):
    a, b, src, dst = engines
    dst.fill(POISON)
    with pytest.raises(InvalidTransfer, match=r"lengths\[1\] = -3: every length must be >= 0"):
        a.batch_write(b.session_id, [src.ctypes.data, src.ctypes.data], [dst.ctypes.data, dst.ctypes.data + 99],
                      [64, -3])
    with pytest.raises(InvalidTransfer, match=r"lengths\[0\] = -1: every length must be >= 0"):
        b.batch_read(a.session_id, [dst.ctypes.data], [src.ctypes.data], [-1])
    assert (dst == POISON).all()


def test_the_mooncake_api_answers_the_same(seed):
    from integration import mooncake as mc
    rng = np.random.default_rng(seed)
    sender, receiver = mc.TransferEngine(), mc.TransferEngine()
    try:
        assert sender.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = np.frombuffer(rng.bytes(SIZE), dtype=np.uint8).copy()
        dst = np.full(SIZE, POISON, dtype=np.uint8)
        assert sender.register_memory(src.ctypes.data, SIZE) == 0
        assert receiver.register_memory(dst.ctypes.data, SIZE) == 0
        assert receiver.register_memory(dst.ctypes.data, 0) == mc.ERR_INVALID_ARGUMENT  # as Mooncake: -1
        session = f"127.0.0.1:{receiver.get_rpc_port()}"
        srcs, dsts, lengths = _pieces(rng, zero_at=(1, 5))
        s, d = (src.ctypes.data + srcs).tolist(), (dst.ctypes.data + dsts).tolist()
        assert sender.batch_transfer_sync_write(session, s, d, lengths.tolist()) == 0
        assert (dst == _expected(src, srcs, dsts, lengths)).all()
        dst.fill(POISON)
        for call in (sender.batch_transfer_sync_write, sender.batch_transfer_sync_read):
            assert call(session, [], [], []) == 0
            assert call(session, [src.ctypes.data], [dst.ctypes.data], [0]) == 0
            assert call(session, [src.ctypes.data], [dst.ctypes.data], [-1]) == mc.ERR_INVALID_ARGUMENT
        assert sender.transfer_sync_write(session, src.ctypes.data, dst.ctypes.data, 0) == 0
        assert (dst == POISON).all()
    finally:
        sender.close()
        receiver.close()
