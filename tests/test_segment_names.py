"""One segment name, one owner, on pxn's http metadata server (the etcd cases are in tests/test_etcd_metadata.py).

Two engines initialized under one name (the natural ``initialize("127.0.0.1", ...)`` twice on one host): the
second is refused with ERR_METADATA and a log line naming the holder; lookups keep reaching the first, whose bytes
arrive byte-exact; the refused engine's close removes nothing. A caller that asks to take the name over gets it,
and the first engine's close then leaves the new holder's entry. A killed engine's entry (nothing answers at its
session) is taken over by the next engine of that name. On the wire: a PUT or DELETE carrying ``X-Pxn-Owner``
never touches another owner's value; without the header the server speaks Mooncake's protocol unchanged.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from integration import mooncake as mc
from integration.metadata import segment_key
from integration.metadata_server import AUTH_HEADER, OWNER_HEADER, TAKE_OVER_HEADER, MetadataServer, sign
from integration.mooncake import TransferEngine as MooncakeEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = segment_key("127.0.0.1")


@pytest.fixture
def server():
    with MetadataServer("127.0.0.1", 0) as srv:
        yield srv


def _entry(srv) -> dict:
    with urllib.request.urlopen(f"{srv.url}?key={KEY}", timeout=5) as r:
        return json.loads(r.read())


def _send(srv, method: str, key: str, body: bytes = b"", headers=None, url=None):
    req = urllib.request.Request(url or f"{srv.url}?key={key}", data=body if method == "PUT" else None,
                                 method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _write_by_name(sender, name: str, target_buf: np.ndarray, rng) -> None:
    """Write fresh bytes by segment name into ``target_buf`` (registered by the engine holding ``name``) and
    check them byte-exact, the untouched rest still poison."""
    n = target_buf.nbytes
    target_buf[:] = 0xA5
    src = rng.integers(0, 256, n, dtype=np.uint8)
    assert sender.register_memory(src.ctypes.data, n) == 0
    try:
        assert sender.transfer_sync_write(name, src.ctypes.data + 1, target_buf.ctypes.data + 3, n - 10) == 0
        assert np.array_equal(target_buf[3:n - 7], src[1:n - 9])
        assert (target_buf[:3] == 0xA5).all() and (target_buf[n - 7:] == 0xA5).all()
    finally:
        sender.unregister_memory(src.ctypes.data)


def test_second_engine_under_a_live_name_is_refused(server, caplog, seed):
    rng = np.random.default_rng(seed)
    first, second, sender = MooncakeEngine(), MooncakeEngine(), MooncakeEngine()
    buf = np.full(65_537, 0xA5, dtype=np.uint8)
    try:
        assert first.initialize("127.0.0.1", server.url, "tcp", "") == 0
        assert first.register_memory(buf.ctypes.data, buf.nbytes) == 0
        with caplog.at_level(logging.WARNING, logger="integration.mooncake"):
            assert second.initialize("127.0.0.1", server.url, "tcp", "") == mc.ERR_METADATA
        assert "held by another engine" in caplog.text and first.get_session_id() in caplog.text
        assert "take_over_segment" in caplog.text
        assert second.pxn_engine is None
        assert _entry(server)["session"] == first.get_session_id()
        assert sender.initialize("127.0.0.1:1", server.url, "tcp", "") == 0
        _write_by_name(sender, "127.0.0.1", buf, rng)       # the name still leads to the first engine
        second.close()
        assert _entry(server)["session"] == first.get_session_id()
    finally:
        for e in (first, second, sender):
            e.close()
    assert server.keys() == []


def test_take_over_replaces_the_holder_and_its_close_keeps_the_new_entry(server, caplog, seed):
    rng = np.random.default_rng(seed)
    first, heir, sender = MooncakeEngine(), MooncakeEngine(take_over_segment=True), MooncakeEngine()
    buf = np.full(4099, 0xA5, dtype=np.uint8)
    try:
        assert first.initialize("127.0.0.1", server.url, "tcp", "") == 0
        assert heir.initialize("127.0.0.1", server.url, "tcp", "") == 0
        assert heir.register_memory(buf.ctypes.data, buf.nbytes) == 0
        assert _entry(server)["session"] == heir.get_session_id()
        with caplog.at_level(logging.INFO, logger="integration.mooncake"):
            first.close()
        assert "not removing segment '127.0.0.1'" in caplog.text
        assert _entry(server)["session"] == heir.get_session_id()
        assert sender.initialize("127.0.0.1:1", server.url, "tcp", "") == 0
        _write_by_name(sender, "127.0.0.1", buf, rng)
        assert heir.initialize("127.0.0.1", server.url, "tcp", "") == 0   # its own name again: replaces itself
        assert _entry(server)["session"] == heir.get_session_id()
    finally:
        for e in (first, heir, sender):
            e.close()
    assert server.keys() == []


TARGET = r"""
import sys
from integration.mooncake import TransferEngine
eng = TransferEngine()
print("rc", eng.initialize(sys.argv[2], sys.argv[1], "tcp", ""), eng.get_session_id(), flush=True)
sys.stdin.readline()
"""


def test_a_killed_engines_name_is_taken_over(server, caplog):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", TARGET, server.url, "127.0.0.1"], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        word, rc, session = proc.stdout.readline().split()
        assert (word, rc) == ("rc", "0") and _entry(server)["session"] == session
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert _entry(server)["session"] == session        # the http server has no lease: the dead entry stays
    with MooncakeEngine() as eng, caplog.at_level(logging.WARNING, logger="integration.mooncake"):
        assert eng.initialize("127.0.0.1", server.url, "tcp", "") == 0
        assert "no longer answers" in caplog.text and session in caplog.text
        assert _entry(server)["session"] == eng.get_session_id()
    assert server.keys() == []


SECRET = b"segment-names-wire-test-secret"


class _Wire:
    """Requests to a metadata server as a client sends them: signed (with a fresh challenge and a rising version)
    when the server has a secret, plain when it speaks Mooncake's open protocol."""

    def __init__(self, srv, secret):
        self.srv, self.secret, self.version = srv, secret, 0

    def auth(self, method: str, key: str, body: bytes, headers) -> dict:
        if self.secret is None:
            return {}
        self.version += 1
        challenge = _send(self.srv, "GET", "x", headers={}, url=self.srv.url + "/challenge")[1].decode()
        return {AUTH_HEADER: sign(self.secret, method, key, body, challenge, self.version,
                                  headers.get(OWNER_HEADER), headers.get(TAKE_OVER_HEADER) == "1")}

    def __call__(self, method: str, key: str, body: bytes = b"", headers=None):
        headers = dict(headers or {})
        if method != "GET":
            headers.update(self.auth(method, key, body, headers))
        return _send(self.srv, method, key, body, headers)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["signed", "insecure"])
def test_owner_headers_on_the_wire(secret):
    with MetadataServer("127.0.0.1", 0, secret=secret, insecure=secret is None) as server:
        send = _Wire(server, secret)
        a, b = {OWNER_HEADER: "11"}, {OWNER_HEADER: "22"}
        assert send("PUT", "pxn/x", b'{"v": 1}', a)[0] == 200
        assert send("PUT", "pxn/x", b'{"v": 2}', b) == (409, b'{"v": 1}')    # the holder's value back
        assert send("PUT", "pxn/x", b'{"v": 3}', a)[0] == 200                 # its owner may replace it
        assert send("DELETE", "pxn/x", headers=b)[0] == 409
        assert send("GET", "pxn/x") == (200, b'{"v": 3}')
        assert send("PUT", "pxn/x", b'{"v": 4}', {**b, TAKE_OVER_HEADER: "1"})[0] == 200
        assert send("DELETE", "pxn/x", headers=a)[0] == 409                   # no longer a's
        assert send("DELETE", "pxn/x", headers=b)[0] == 200
        # without the header: Mooncake's protocol, last writer wins, anyone deletes
        assert send("PUT", "mc/y", b"1")[0] == 200
        assert send("PUT", "mc/y", b"2")[0] == 200
        assert send("PUT", "mc/y", b"3", a)[0] == 409   # an owner never overwrites an unowned value unasked
        assert send("DELETE", "mc/y")[0] == 200
        assert server.keys() == [] and server.stored_bytes() == 0


def test_owner_headers_are_signed():
    """A signed change whose owner headers were changed after signing (one stripped, one added, another owner's
    id put in) is refused with 403 and changes nothing: whoever relays a request cannot turn an engine's own
    DELETE or PUT against another engine's entry."""
    with MetadataServer("127.0.0.1", 0, secret=SECRET) as server:
        send = _Wire(server, SECRET)
        a, b = {OWNER_HEADER: "11"}, {OWNER_HEADER: "22"}
        assert send("PUT", "pxn/x", b'{"v": 1}', a)[0] == 200
        cases = [("DELETE", b"", b, {}),                                      # owner header stripped
                 ("DELETE", b"", b, a),                                       # another owner's id put in
                 ("PUT", b'{"v": 2}', b, {**b, TAKE_OVER_HEADER: "1"}),       # take-over added
                 ("PUT", b'{"v": 2}', {}, b)]                                 # owner added to an unowned PUT
        for method, body, signed_for, sent in cases:
            auth = send.auth(method, "pxn/x", body, signed_for)
            assert _send(server, method, "pxn/x", body, {**sent, **auth})[0] == 403, (method, signed_for, sent)
            assert send("GET", "pxn/x") == (200, b'{"v": 1}')
        assert send("DELETE", "pxn/x", headers=a)[0] == 200                   # signed as sent: accepted
        assert server.keys() == []


def test_a_stale_version_is_not_a_taken_name():
    """The server answers 409 both for another owner's entry (with that entry) and for a signed PUT whose version
    is not above the stored one (with a text saying so): the client names the holder only for the first."""
    from integration.metadata import HttpMetadata
    from transport.errors import SegmentNameTaken, UnknownPeer
    with MetadataServer("127.0.0.1", 0, secret=SECRET) as server:
        mine = {"session": "127.0.0.1:1", "engine_id": 11, "fabric": "tcp"}
        first, second = HttpMetadata(server.url, secret=SECRET), HttpMetadata(server.url, secret=SECRET)
        first.put("pxn/x", mine)
        with pytest.raises(SegmentNameTaken, match="127.0.0.1:1"):
            second.put("pxn/x", {**mine, "session": "127.0.0.1:2", "engine_id": 22})
        first._next_version = lambda: 1   # its clock went back: a version below the stored one
        with pytest.raises(UnknownPeer, match="not newer than the stored version") as info:
            first.put("pxn/x", {**mine, "fabric": "ipc"})
        assert not isinstance(info.value, SegmentNameTaken)
        assert json.loads(urllib.request.urlopen(f"{server.url}?key=pxn/x", timeout=5).read()) == mine
