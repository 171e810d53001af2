"""A dead peer is one error everywhere: ``PeerGone`` (a ``TransferError``) from batches, reads and later calls on
the tcp and ipc fabrics, ``ERR_ENDPOINT`` from every Mooncake-API call, one log line per death (not one per
rail and endpoint), and no traceback from the Mooncake API."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from engine_helpers import EnginePeer
from transport.engine import TransferEngine
from transport.errors import PeerGone, PeerLost, TransferError, TransferTimeout, UnknownSession

MB = 1 << 20
SRC_BYTES = 8 * MB


@pytest.fixture(scope="module")
def src():
    return np.frombuffer(np.random.default_rng(5).bytes(SRC_BYTES), dtype=np.uint8).copy()


def test_peer_gone_is_a_transfer_error():
    e = PeerGone("peer x is gone", None, OSError("refused"))
    assert isinstance(e, TransferError) and isinstance(e, PeerLost) and e.causes == [e.cause]
    assert PeerGone("y", causes=[PeerLost("a"), PeerLost("b")]).causes[1].args == ("b",)


@pytest.mark.parametrize("fabric", ["tcp", "ipc"])
def test_dead_peer_raises_peer_gone_every_time(src, fabric):
    victim = EnginePeer(4 * MB, fabric=fabric)
    try:
        with TransferEngine(fabric=fabric) as eng:
            eng.register(src.ctypes.data, SRC_BYTES)
            b = src.ctypes.data
            eng.batch_write(victim.session, [b], [victim.base], [64])  # connected
            victim.proc.kill()
            victim.proc.join(10)
            for n in (64, 3 * MB, 64):  # at once (the death maybe not noticed yet), then after it was forgotten
                with pytest.raises(PeerGone, match=victim.session.replace(".", r"\.")):
                    eng.batch_write(victim.session, [b], [victim.base], [n], timeout=30)
            with pytest.raises(PeerGone):
                eng.batch_write_async(victim.session, [b], [victim.base], [64], timeout=30).wait(30)
            local = np.zeros(4096, dtype=np.uint8)
            eng.register(local.ctypes.data, local.nbytes)
            with pytest.raises(PeerGone):
                eng.batch_read(victim.session, [local.ctypes.data], [victim.base], [64], timeout=30)
            # a session that never answered stays an unknown session
            with pytest.raises(UnknownSession):
                eng.batch_write("127.0.0.1:1", [b], [victim.base], [64])
    finally:
        victim.close()


def test_death_mid_batch_is_peer_gone_with_every_rail_cause_and_one_log_line(src, caplog):
    victim = EnginePeer(64 * MB, fabric="tcp")
    try:
        with TransferEngine(fabric="tcp") as eng:
            eng.register(src.ctypes.data, SRC_BYTES)
            b = src.ctypes.data
            eng.batch_write(victim.session, [b], [victim.base], [64])
            lens = [4096] * 4000
            srcs = [b + (i * 65536) % (SRC_BYTES - 4096) for i in range(len(lens))]
            dsts = [victim.base + i * 4096 for i in range(len(lens))]
            with caplog.at_level(logging.INFO):
                h = eng.batch_write_async(victim.session, srcs, dsts, lens, timeout=60)
                time.sleep(0.005)  # the scenario: the peer dies a few ms into the batch (16 MB still under way)
                victim.proc.kill()
                with pytest.raises(TransferError) as info:
                    h.wait(60)
                assert not isinstance(info.value, TransferTimeout), info.value
                if not isinstance(info.value, PeerGone):  # it finished before the kill: nothing to check
                    pytest.skip("the batch completed before the peer died")
                assert len(info.value.causes) == eng.rails, info.value
                with pytest.raises(PeerGone):
                    eng.batch_write(victim.session, [b], [victim.base], [64], timeout=30)
            loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(loud) == 1, [r.getMessage() for r in loud]
            assert victim.session in loud[0].getMessage() and not loud[0].exc_info
    finally:
        victim.close()


def test_mooncake_api_dead_peer_is_one_code_without_traceback(src, caplog):
    from integration import mooncake as mc
    victim = EnginePeer(4 * MB, fabric="tcp")
    sender = mc.TransferEngine()
    try:
        assert sender.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert sender.register_memory(src.ctypes.data, SRC_BYTES) == 0
        b = src.ctypes.data
        assert sender.transfer_sync_write(victim.session, b, victim.base, 64) == 0
        assert sender.get_first_buffer_address(victim.session) == victim.base
        victim.proc.kill()
        victim.proc.join(10)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert sender.batch_transfer_sync_write(victim.session, [b, b + MB], [victim.base, victim.base + MB],
                                                        [64, 2 * MB]) == mc.ERR_ENDPOINT
            assert sender.transfer_sync_read(victim.session, b, victim.base, 64) == mc.ERR_ENDPOINT
            bid = sender.batch_transfer_async_write(victim.session, [b], [victim.base], [64])
            assert bid == 0 or sender.get_batch_transfer_status([bid]) == mc.ERR_ENDPOINT
            assert sender.get_first_buffer_address(victim.session) == 0
        assert caplog.records, "each refusal logs its cause"
        for r in caplog.records:
            assert r.exc_info is None and "unexpected" not in r.getMessage(), r.getMessage()
            assert r.levelno == logging.WARNING and len(r.getMessage().splitlines()) == 1, r.getMessage()
    finally:
        sender.close()
        victim.close()
