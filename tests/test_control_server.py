"""The control listener's threads do not follow its peers (``transport.control_server``): one selector thread and
fixed pools serve every control connection; requests are answered in order per connection; a stalled request or
handshake holds up nobody else."""
import json
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from transport import TransferEngine, auth
from transport.control import recv_msg, send_msg
from wait_helpers import wait_equal

SECRET = "ctrl-server-" + os.urandom(8).hex()


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _ctrl_threads(eng) -> list:
    """Names of the live threads of ``eng``'s control plane (its listener's name is in each)."""
    tag = f"ctrl {eng.session_id}"
    return sorted(t.name for t in threading.enumerate()
                  if tag in t.name or t.name == f"pxn-ctrl-{eng.port}")


def _connect(eng) -> socket.socket:
    host, port = eng.session_id.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    auth.client_handshake(s, SECRET.encode(), "ctrl", 10)
    return s


def _write(sender, receiver, dst_addr: int, rng) -> bytes:
    data = rng.integers(0, 256, 77, dtype=np.uint8)
    sender.register(data)
    sender.batch_write(receiver.session_id, [data.ctypes.data], [dst_addr], [data.size])
    sender.__dict__.setdefault("_held", []).append(data)
    return data.tobytes()


def test_receiver_threads_do_not_grow_with_senders(rng):
    """1 and then 16 connected senders, each having written: the receiver's control plane has the same threads.
    (Before, each control connection had a thread of its own for its whole life: 1 + 16.)"""
    with TransferEngine(fabric="tcp", secret=SECRET) as rx:
        landing = np.zeros(17 * 128, dtype=np.uint8)
        rx.register(landing)
        senders = []
        try:
            counts = {}
            for n in (1, 16):
                while len(senders) < n:
                    tx = TransferEngine(fabric="tcp", secret=SECRET)
                    senders.append(tx)
                    i = len(senders) - 1
                    want = _write(tx, rx, landing.ctypes.data + i * 128, rng)
                    assert landing[i * 128:i * 128 + 77].tobytes() == want
                wait_equal(lambda: rx.stats()["security"]["control"]["served"], n, "control connections served")
                counts[n] = _ctrl_threads(rx)
            assert counts[16] == counts[1], counts
            assert len(counts[1]) <= 6, counts[1]  # the accept loop, the selector, the quick pool
        finally:
            for tx in senders:
                tx.close()
        # the senders' connections ended: nothing is served any more, and the threads are the same
        wait_equal(lambda: rx.stats()["security"]["control"]["served"], 0, "control connections served", timeout=5)
        assert _ctrl_threads(rx) == counts[1]
    assert _ctrl_threads(rx) == []  # close joined them all


def test_pipelined_requests_are_answered_in_order():
    """Three requests sent at once on one connection: three replies, in order, each with its own tag."""
    with TransferEngine(fabric="tcp", secret=SECRET) as rx:
        with _connect(rx) as s:
            sess = auth.session_of(s)
            frames = b""
            for msg in ({"op": "regions"}, {"op": "no-such-op"}, {"op": "owns", "binding": "00"}):
                body = json.dumps(msg).encode()
                head = struct.pack("<I", len(body))
                frames += head + body + sess.tag(head, body)
            s.sendall(frames)
            first, second, third = recv_msg(s), recv_msg(s), recv_msg(s)
    assert first["ok"] and "regions" in first and first["engine_id"] == rx.engine_id
    assert not second["ok"] and "no-such-op" in second["error"]
    assert third["ok"] and third["owns"] is False


def test_stalled_requests_and_handshakes_hold_up_nobody():
    """More stalled connections than the control plane has threads (half a request each after authenticating,
    or half a handshake preamble): a new peer still authenticates and is answered at once."""
    with TransferEngine(fabric="tcp", secret=SECRET) as rx:
        host, port = rx.session_id.rsplit(":", 1)
        stalled = []
        try:
            for i in range(12):
                s = _connect(rx)
                s.sendall(struct.pack("<I", 1000) + b'{"op": "regions", "pad": "')  # never finished
                stalled.append(s)
                h = socket.create_connection((host, int(port)), timeout=10)
                h.sendall(auth.MAGIC)  # a preamble's first bytes, never the rest
                stalled.append(h)
            t0 = time.monotonic()
            with _connect(rx) as s:
                send_msg(s, {"op": "regions"})
                rep = recv_msg(s)
            assert rep["ok"] and time.monotonic() - t0 < 2.0
            assert len(_ctrl_threads(rx)) <= 6, _ctrl_threads(rx)
        finally:
            for s in stalled:
                s.close()


def test_garbage_flood_pushes_out_no_handshake(rng):
    """Threads connect, send random bytes and close, as fast as they can, while a peer authenticates again and
    again: the selector refuses the garbage as fast as it is accepted, so the cap on connections still
    authenticating never pushes one out, and every legitimate handshake is answered. (Before, the accept thread
    ran ahead of the selector: hundreds of evictions a second, a legitimate handshake among them now and then.)"""
    with TransferEngine(fabric="tcp", secret=SECRET) as rx:
        host, port = rx.session_id.rsplit(":", 1)
        stop = threading.Event()
        sent = [0]

        def spray(seed):
            r = np.random.default_rng(seed)
            while not stop.is_set():
                try:
                    with socket.create_connection((host, int(port)), timeout=2) as s:
                        s.sendall(r.bytes(int(r.integers(1, 4096))))
                        sent[0] += 1
                except OSError:
                    pass

        threads = [threading.Thread(target=spray, args=(int(rng.integers(1 << 30)),), daemon=True)
                   for _ in range(4)]
        for t in threads:
            t.start()
        answered = 0
        try:
            t_end = time.monotonic() + 2.0
            while time.monotonic() < t_end:
                with _connect(rx) as s:
                    send_msg(s, {"op": "regions"})
                    assert recv_msg(s)["ok"]
                answered += 1
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
        ctrl = rx.stats()["security"]["control"]
    assert sent[0] > 100 and answered > 0, (sent[0], answered)
    assert ctrl["evicted"] == 0, ctrl


def test_bad_tag_after_good_requests_closes_only_that_connection():
    """A connection whose second request carries a wrong tag is closed unanswered and counted; another
    connection goes on being served."""
    with TransferEngine(fabric="tcp", secret=SECRET) as rx:
        before = rx.stats()["security"]["control"].get("refused_tag", 0)
        with _connect(rx) as good, _connect(rx) as bad:
            send_msg(bad, {"op": "regions"})
            assert recv_msg(bad)["ok"]
            body = json.dumps({"op": "regions"}).encode()
            bad.sendall(struct.pack("<I", len(body)) + body + bytes(auth.TAG_BYTES))
            bad.settimeout(5)
            assert bad.recv(1) == b""
            send_msg(good, {"op": "regions"})
            assert recv_msg(good)["ok"]
        assert rx.stats()["security"]["control"]["refused_tag"] == before + 1


@pytest.mark.parametrize("n", [24])
def test_concurrent_reads_from_many_connections(rng, n):
    """Reads (served on the long pool, which asks the initiator and writes into it) from ``n`` threads of one
    initiator, all byte-exact."""
    with TransferEngine(fabric="tcp", secret=SECRET) as peer, TransferEngine(fabric="tcp", secret=SECRET) as me:
        src = rng.integers(0, 256, n * 1000 + 13, dtype=np.uint8)
        peer.register(src)
        dst = np.full(src.size, 0xA5, dtype=np.uint8)
        me.register(dst)
        errors = []

        def one(i):
            try:
                me.batch_read(peer.session_id, [dst.ctypes.data + i * 1000], [src.ctypes.data + i * 1000],
                              [1000 + (13 if i == n - 1 else 0)])
            except Exception as e:  # noqa: BLE001 — reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert dst.tobytes() == src.tobytes()
        assert len(_ctrl_threads(peer)) <= 10, _ctrl_threads(peer)  # plus the long pool, started by the reads
