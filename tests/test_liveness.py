"""Peer liveness over tcp: a receiver that stops running for a while (starved of CPU, or stopped) is not declared
dead while batches to it still have time; one that is gone (SIGKILL) is found by the sockets' end, not by a timer.
Also: an engine that only receives holds no relay ring.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets
from fabric_helpers import wait_stopped
from wait_helpers import wait_for
from transport import TransferEngine, TransferError, TransferTimeout
from transport.fabric.connections import user_timeout_ms

MB = 1 << 20
PEER_BYTES = 64 * MB


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def test_user_timeout_follows_the_ack_timeout():
    """The kernel's give-up time on unacknowledged data (and on a zero window) is the fabric's ack timeout, never
    the 5 s it once was, and never below the keep-alive probing time."""
    assert user_timeout_ms(3.0, 30.0) == 30000
    assert user_timeout_ms(3.0, 1.5) == 5000
    assert user_timeout_ms(10.0, 4.0) == 12000


@pytest.mark.slow
def test_stopped_receiver_is_not_declared_dead(rng):
    """SIGSTOP the receiver for 6 s while 64 MiB batches stream to it (its window closes, as on a CPU-starved box),
    then SIGCONT: under a 30 s batch timeout no batch fails, and the last one lands byte-exact."""
    peer = EnginePeer(PEER_BYTES, fabric="tcp")
    src = np.frombuffer(rng.bytes(PEER_BYTES), dtype=np.uint8).copy()
    lengths = [4 * MB - 4096 * i for i in range(16)]
    try:
        with TransferEngine(fabric="tcp") as eng:
            eng.register(src)
            base = src.ctypes.data
            errors, done = [], []
            stop = threading.Event()
            first = threading.Event()

            def stream():
                while not stop.is_set():
                    so = disjoint_offsets(rng, lengths, PEER_BYTES)
                    do = disjoint_offsets(rng, lengths, PEER_BYTES)
                    try:
                        eng.batch_write(peer.session, [base + int(o) for o in so], [peer.base + int(o) for o in do],
                                        lengths, timeout=30.0)
                        done.append(time.monotonic())
                    except TransferError as e:
                        errors.append(e)
                        return
                    finally:
                        first.set()

            t = threading.Thread(target=stream, name="test-stream")
            t.start()
            try:
                assert first.wait(60)
                os.kill(peer.proc.pid, signal.SIGSTOP)
                wait_stopped(peer.proc.pid)
                stopped_at = time.monotonic()
                time.sleep(6.0)  # the scenario: the peer stays stopped for 6 s, longer than any liveness timeout
            finally:
                os.kill(peer.proc.pid, signal.SIGCONT)
            # batches go on after the stop: two more complete after it ended
            wait_for(lambda: errors or sum(d > stopped_at + 6.0 for d in done) >= 2,
                     "two batches completing after the stop ended (or an error)", timeout=60, interval=0.05)
            stop.set()
            t.join(60)
            assert not errors, errors
            assert sum(d > stopped_at + 6.0 for d in done) >= 2, done
            # and what lands is right: one more batch, checked against the peer's whole buffer
            peer.poison()
            exp = Expected(PEER_BYTES)
            so, do = disjoint_offsets(rng, lengths, PEER_BYTES), disjoint_offsets(rng, lengths, PEER_BYTES)
            exp.apply(src, so, do, lengths)
            eng.batch_write(peer.session, [base + int(o) for o in so], [peer.base + int(o) for o in do], lengths,
                            timeout=30.0)
            peer.check(exp)
            # the receiver only received: it made no relay ring (they are made by the first relayed send); the
            # sender's large pieces went direct, and its first coalesced batch makes its ring
            assert peer.call("stats")["rings"] == {}
            assert eng.stats()["rings"] == {}
            small = [64] * 500
            peer.poison()
            exp = Expected(PEER_BYTES)
            so, do = disjoint_offsets(rng, small, 1 * MB), disjoint_offsets(rng, small, PEER_BYTES)
            exp.apply(src, so, do, small)
            eng.batch_write(peer.session, [base + int(o) for o in so], [peer.base + int(o) for o in do], small,
                            timeout=30.0)
            peer.check(exp)
            rings = list(eng.stats()["rings"])   # the batch's one chunk went on one rail: that rail's ring
            assert len(rings) == 1 and rings[0] in ("host/rail0", "host/rail1"), rings
            assert peer.call("stats")["rings"] == {}
    finally:
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        peer.close()


@pytest.mark.slow
def test_killed_receiver_fails_the_batch_as_a_lost_peer(rng):
    """SIGKILL the receiver while a batch streams to it: the batch fails with the connection's end (its kernel
    closed the sockets), not by running out its 60 s timeout."""
    peer = EnginePeer(PEER_BYTES, fabric="tcp")
    src = np.frombuffer(rng.bytes(PEER_BYTES), dtype=np.uint8).copy()
    lengths = [4 * MB] * 16
    try:
        with TransferEngine(fabric="tcp") as eng:
            eng.register(src)
            base = src.ctypes.data
            so = disjoint_offsets(rng, lengths, PEER_BYTES)
            do = disjoint_offsets(rng, lengths, PEER_BYTES)
            srcs, dsts = [base + int(o) for o in so], [peer.base + int(o) for o in do]
            eng.batch_write(peer.session, srcs, dsts, lengths, timeout=60.0)  # connected, and known good
            # keep the receiver stopped while the batch is posted, so that it is surely in flight when it dies
            os.kill(peer.proc.pid, signal.SIGSTOP)
            wait_stopped(peer.proc.pid)
            batch = eng.batch_write_async(peer.session, srcs, dsts, lengths, timeout=60.0)
            time.sleep(0.5)  # the scenario: the batch is posted to a stopped receiver for 0.5 s before it dies
            os.kill(peer.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(TransferError) as got:
                batch.wait()
            took = time.monotonic() - t0
            print(f"batch failed {took:.3f} s after the SIGKILL: {got.value}")
            assert not isinstance(got.value, TransferTimeout), (took, got.value)
    finally:
        peer.close()
