"""The Mooncake layer shortens the interpreter's switch interval at ``initialize`` (``integration.mooncake.
SWITCH_INTERVAL``) unless the caller chose one: Mooncake's engine threads never wait for Python, pxn's do, and a
caller thread that keeps running Python otherwise makes each hand-off between them wait up to CPython's 5 ms."""
import sys
import threading
import time

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


def test_small_batches_keep_going_while_a_caller_thread_spins(restore_interval, seed):
    """A thread spinning in Python beside the engines: aux batches (11 pieces at odd addresses, byte-exact, poison
    around them) take less than half as long as with CPython's 5 ms interval, where each hand-off between pxn's
    threads waits for the spinning thread's slice (there about 20 ms a batch, here about 2 ms, on the CPU box)."""
    rng = np.random.default_rng(seed)
    a, b = _started(), _started()
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
        medians = {}
        for interval in ("as initialize left it", 0.005):
            if interval == 0.005:
                sys.setswitchinterval(interval)  # CPython's default, which the process had before initialize
            times = []
            for _ in range(60):
                t0 = time.perf_counter()
                assert a.batch_transfer_sync_write(peer, srcs, dsts, AUX) == 0
                times.append(time.perf_counter() - t0)
            medians[interval] = float(np.median(times[10:]))
        want = np.full(1 << 16, 0xAB, dtype=np.uint8)
        for o, n in zip(offs, AUX):
            want[o + 7:o + 7 + n] = src[o:o + n]
        assert np.array_equal(dst, want)
        assert medians["as initialize left it"] < medians[0.005] / 2, medians
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join(5)
        a.close()
        b.close()
