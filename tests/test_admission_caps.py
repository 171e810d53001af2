"""Refusals name their cause: the per-address cap on authenticated connections, the caps on connections still
authenticating and the receiver's sender limit each give their own error and counter, naming the ``PXN_*``
variable that raises them; none is reported as a secret mismatch.
"""
import socket
import threading
import time

import pytest

from transport import TransferEngine, UnknownSession, auth
from transport.errors import AdmissionRefused, OverAddressCap, SecretMismatch
from wait_helpers import wait_equal

SECRET = "admission-caps-test-secret-0123"


def test_the_connection_over_the_per_address_cap_is_told_so():
    """With PXN_MAX_CONNS_PER_ADDR's cap at 2, the third engine from one address is refused naming that variable
    (it was told "different PXN_SECRET values"), and the receiver counts it as ``refused_per_addr``."""
    with TransferEngine(fabric="tcp", secret=SECRET, max_conns_per_addr=2) as rx:
        senders = [TransferEngine(fabric="tcp", secret=SECRET) for _ in range(3)]
        try:
            for eng in senders[:2]:
                eng.open_session(rx.session_id)
            with pytest.raises(UnknownSession) as got:
                senders[2].open_session(rx.session_id)
            text = str(got.value)
            assert "PXN_MAX_CONNS_PER_ADDR" in text and "PXN_SECRET" not in text, text
            assert isinstance(got.value.__cause__, AdmissionRefused) and got.value.__cause__.cap == "per_addr"
            ctrl = rx.stats()["security"]["control"]
            assert ctrl["refused_per_addr"] == 1 and ctrl["refused_auth"] == 0, ctrl
        finally:
            for eng in senders:
                eng.close()


class _Listener:
    """A listener running ``serve(sock)`` on each accepted connection, in a thread."""

    def __init__(self, serve):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.sock.getsockname()
        self.errors = []

        def run():
            conn, _ = self.sock.accept()
            with conn:
                try:
                    serve(conn)
                except Exception as e:  # noqa: BLE001 — the test reads it
                    self.errors.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self):
        self.thread.join(10)
        self.sock.close()


def test_a_handshake_the_listener_drops_names_the_pending_caps():
    def drop_after_preamble(conn):
        auth.recv_exact(conn, auth._PREAMBLE.size, time.monotonic() + 5)   # then it lets the connection go

    lst = _Listener(drop_after_preamble)
    try:
        with socket.create_connection(lst.addr, timeout=5) as s:
            with pytest.raises(AdmissionRefused, match="PXN_MAX_PENDING_PER_ADDR") as got:
                auth.client_handshake(s, SECRET.encode(), "ctrl", 5)
        assert got.value.cap == "pending" and not isinstance(got.value, SecretMismatch)
    finally:
        lst.close()


def test_the_listeners_per_address_verdict_reaches_the_client():
    def over_cap():
        raise OverAddressCap("127.0.0.1 already has 64 connections being served")

    lst = _Listener(lambda conn: auth.server_handshake(conn, SECRET.encode(), "ctrl", time.monotonic() + 5,
                                                       over_cap))
    try:
        with socket.create_connection(lst.addr, timeout=5) as s:
            with pytest.raises(AdmissionRefused, match="PXN_MAX_CONNS_PER_ADDR on the peer") as got:
                auth.client_handshake(s, SECRET.encode(), "ctrl", 5)
        assert got.value.cap == "per_addr"
    finally:
        lst.close()
    assert len(lst.errors) == 1 and isinstance(lst.errors[0], OverAddressCap)


def test_evictions_are_counted_by_cap():
    """Connections that never authenticate: beyond PXN_MAX_PENDING_PER_ADDR from one address the oldest goes
    (``evicted_pending_per_addr``); beyond PXN_MAX_PENDING in all, too (``evicted_pending``); and the engine's
    own peers still connect afterwards."""
    with TransferEngine(fabric="tcp", secret=SECRET, max_pending_per_addr=2, max_pending=3,
                        handshake_timeout=30) as rx:
        host, port = rx.session_id.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        try:
            ctrl = lambda: rx.stats()["security"]["control"]  # noqa: E731
            wait_equal(lambda: ctrl()["evicted_pending_per_addr"], 1, "the receiver's evicted_pending_per_addr")
            assert ctrl()["evicted_pending"] == 0 and ctrl()["evicted"] == 1
            assert idle[0].recv(1) == b""                  # the oldest was let go
        finally:
            for s in idle:
                s.close()
        with TransferEngine(fabric="tcp", secret=SECRET) as tx:
            tx.open_session(rx.session_id)


def test_a_receiver_full_of_senders_names_pxn_max_senders():
    with TransferEngine(fabric="tcp", secret=SECRET, max_senders=1) as rx, \
            TransferEngine(fabric="tcp", secret=SECRET) as a, TransferEngine(fabric="tcp", secret=SECRET) as b:
        a.open_session(rx.session_id)
        with pytest.raises(UnknownSession, match="PXN_MAX_SENDERS raises it"):
            b.open_session(rx.session_id)
        assert rx.stats()["security"]["refused_max_senders"] == 1
