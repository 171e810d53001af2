"""The Mooncake layer shortens the interpreter's switch interval at ``initialize`` (``integration.mooncake.
SWITCH_INTERVAL``) unless the caller chose one: Mooncake's engine threads never wait for Python, pxn's do, and a
caller thread that keeps running Python otherwise makes each hand-off between them wait up to CPython's 5 ms."""
import sys
import threading

import numpy as np
import pytest

from integration.mooncake import SWITCH_INTERVAL, TransferEngine

AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]


@pytest.fixture
def restore_interval(monkeypatch):
    monkeypatch.delenv("PXN_SWITCH_INTERVAL", raising=False)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(old)


def _started(**kw) -> TransferEngine:
    eng = TransferEngine(**kw)
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return eng


@pytest.mark.parametrize("given,env,want", [({}, None, SWITCH_INTERVAL), ({"switch_interval": 0.001}, None, 0.001),
                                            ({}, "0.002", 0.002)])
def test_initialize_sets_the_interval_unless_the_caller_chose_one(restore_interval, monkeypatch, given, env, want):
    if env is not None:
        monkeypatch.setenv("PXN_SWITCH_INTERVAL", env)
    eng = _started(**given)
    try:
        assert sys.getswitchinterval() == pytest.approx(want)
    finally:
        eng.close()


def test_small_batches_finish_while_a_caller_thread_spins(restore_interval, seed):
    """A thread spinning in Python beside the engines, at the interval initialize set: 60 aux batches (11 pieces at
    odd addresses, poison around them) all complete byte-exact. No timing is asserted (a busy machine decides
    those); the interval itself is what the code controls, and it must be the one initialize set while the batches
    run."""
    rng = np.random.default_rng(seed)
    a, b = _started(), _started()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    try:
        src = np.frombuffer(rng.bytes(1 << 16), dtype=np.uint8).copy()
        dst = np.full(1 << 16, 0xAB, dtype=np.uint8)
        assert a.register_memory(src.ctypes.data, src.nbytes) == 0
        assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        offs = (np.cumsum([0] + AUX[:-1]) * 3 + 1).tolist()  # odd addresses, a gap after each piece
        srcs = [src.ctypes.data + o for o in offs]
        dsts = [dst.ctypes.data + o + 7 for o in offs]
        spinner.start()
        for i in range(60):
            assert a.batch_transfer_sync_write(peer, srcs, dsts, AUX) == 0, f"batch {i} failed"
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL)
        want = np.full(1 << 16, 0xAB, dtype=np.uint8)
        for o, n in zip(offs, AUX):
            want[o + 7:o + 7 + n] = src[o:o + n]
        assert np.array_equal(dst, want)
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join(5)
        a.close()
        b.close()
