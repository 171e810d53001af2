"""Attacks on what decides where bytes go, on credits, on metadata, on the secret file and on boolean settings.

Each test replays one attack end to end and checks the victim's memory byte for byte: the chunk whose item table
is changed after its frame was sealed (a redirect into another tenant's region), a stalled sender that keeps its
landing slots, a captured metadata change replayed after a restart, a forged etcd entry, a FIFO at the secret
file's path, and a typo in a boolean variable.
"""
import json
import os
import struct
import zlib

import numpy as np
import pytest

import pxn_kernels.chunk as chunk_format
from transport import TransferEngine, TransferError
from fabric_helpers import wait_stopped
from wait_helpers import wait_for

MB = 1 << 20
SECRET = "test-secret-" + os.urandom(8).hex()


def _retabled(buf, shift: int):
    """Move every item of the chunk whose header and table are ``buf`` ``shift`` bytes further, and fix the unkeyed
    checksum, as anyone who can change bytes on the way can."""
    n = int(buf[16:20].view(np.uint32)[0])
    end = chunk_format.HEADER_BYTES + chunk_format.ENTRY_BYTES * n
    table = buf[chunk_format.HEADER_BYTES:end].view(chunk_format._ENTRY_DTYPE)
    table["dst_addr"] = (table["dst_addr"].astype(np.int64) + shift).astype(np.uint64)
    buf[40:44] = 0
    buf[40:44] = np.frombuffer(struct.pack("<I", zlib.crc32(buf[:end])), dtype=np.uint8)


@pytest.mark.parametrize("rails", [1, 2])
def test_a_chunk_table_changed_on_the_way_redirects_nothing(monkeypatch, seed, rails):
    """The chunk's table travels as payload, outside the frame tag: an injector changes every ``dst_addr`` of one
    chunk to the same offset in another tenant's region (and fixes the CRC). The receiver refuses the chunk before
    placing a byte and aborts the rail; the batch still completes byte-exact (failover), the other region keeps its
    poison, and the refusal is counted. With one rail the batch fails as it does when that rail breaks, and the
    next batch handshakes again and completes."""
    rng = np.random.default_rng(seed)
    n, piece = 256, 64
    with TransferEngine(fabric="tcp", secret=SECRET, rails=rails) as rx, \
            TransferEngine(fabric="tcp", secret=SECRET, rails=rails) as tx:
        mine = np.full(4 * MB, 0xA5, dtype=np.uint8)
        tenant = np.full(4 * MB, 0x5A, dtype=np.uint8)
        rx.register(mine)
        rx.register(tenant)
        src = np.frombuffer(rng.bytes(n * piece * 2), dtype=np.uint8).copy()
        tx.register(src)
        offs = rng.permutation(4 * MB // piece)[:n] * piece
        srcs = [src.ctypes.data + 2 * piece * i for i in range(n)]
        dsts = [mine.ctypes.data + int(o) for o in offs]
        tx.batch_write(rx.session_id, srcs[:1], dsts[:1], [piece])  # handshake, untouched
        real = chunk_format.build_header_table
        changed = []

        def tamper(*args, **kw):
            out = real(*args, **kw)
            if not changed:
                changed.append(args[2])
                _retabled(out[0], tenant.ctypes.data - mine.ctypes.data)
            return out

        monkeypatch.setattr(chunk_format, "build_header_table", tamper)
        if rails == 1:
            with pytest.raises(TransferError, match="every rail failed"):
                tx.batch_write(rx.session_id, srcs, dsts, [piece] * n)
            assert not np.any(tenant != 0x5A), "bytes of the changed chunk landed in the other tenant's region"
            tx.batch_write(rx.session_id, srcs, dsts, [piece] * n)
        else:
            tx.batch_write(rx.session_id, srcs, dsts, [piece] * n)
        assert changed, "no chunk was built: the batch did not take the coalesced route"
        assert not np.any(tenant != 0x5A), "bytes of the changed chunk landed in the other tenant's region"
        want = np.full(4 * MB, 0xA5, dtype=np.uint8)
        for i, o in enumerate(offs):
            want[o:o + piece] = src[2 * piece * i:2 * piece * i + piece]
        assert np.array_equal(mine, want)
        assert rx.stats()["security"]["refused_chunk_mac"] >= 1


def test_chunk_mac_refuses_a_changed_table_a_missing_mac_and_a_replayed_sequence_number(seed):
    """``parse_chunk`` / ``parse_chunk_rows`` with the sender's key: a good chunk passes, one with a changed table
    (checksum fixed), one without a MAC and one checked under another key do not; the receiver's sender state takes
    each sequence number once."""
    from transport.errors import ChunkAuthError
    from transport.receiver import SEQ_WINDOW, SenderState
    rng = np.random.default_rng(seed)
    key, other = rng.bytes(32), rng.bytes(32)
    lens = rng.integers(1, 300, 7)
    dsts = rng.integers(1 << 20, 1 << 40, 7).astype(np.uint64)
    head, _, nbytes = chunk_format.build_header_table(dsts, lens, 9, 77, key=key)
    good = chunk_format.parse_chunk(head.copy(), nbytes, key=key)
    assert good.seq == 9 and np.array_equal(good.dst_addrs, dsts)
    assert chunk_format.parse_chunk_rows(memoryview(head.copy()), nbytes, key)[0] == 9
    changed = head.copy()
    _retabled(changed, 4 * MB)
    plain = chunk_format.build_header_table(dsts, lens, 9, 77)[0].copy()
    _retabled(plain, 4 * MB)
    chunk_format.parse_chunk(plain, nbytes)  # without a secret, the checksum alone cannot tell
    for bad, k in ((changed, key), (head.copy(), other),
                   (chunk_format.build_header_table(dsts, lens, 9, 77)[0], key)):
        with pytest.raises(ChunkAuthError):
            chunk_format.parse_chunk(bad, nbytes, key=k)
        assert chunk_format.parse_chunk_rows(memoryview(bad), nbytes, k) is None
    st = SenderState(1, "s", ["r"], 1, [1], 1, 4096, [-1])
    assert st.fresh(5) and st.fresh(3) and st.fresh(SEQ_WINDOW + 6)
    assert not st.fresh(5) and not st.fresh(3) and not st.fresh(4)  # seen, or too far below the highest


@pytest.mark.parametrize("variable", ["PXN_INSECURE", "PXN_LOADSTORE", "PXN_FORWARD_LARGE", "PXN_SGLANG_PLUGIN"])
@pytest.mark.parametrize("value", ["maybe", "2", "ture", "of"])
def test_a_typo_in_a_switch_is_refused_naming_it(monkeypatch, variable, value):
    """A boolean variable takes only its documented values: a typo neither turns authentication off nor anything
    else on; it is refused, naming the variable and the value, by every reader of it."""
    from transport.config import EngineConfig, parse_flag
    from transport.errors import ConfigError
    monkeypatch.setenv(variable, value)
    monkeypatch.delenv("PXN_SECRET", raising=False)
    with pytest.raises(ConfigError) as e:
        if variable == "PXN_SGLANG_PLUGIN":
            parse_flag(variable, True)
        else:
            EngineConfig.from_env()
    assert variable in str(e.value) and repr(value) in str(e.value)
    if variable == "PXN_INSECURE":
        from transport.auth import resolve_secret
        from integration.metadata_server import MetadataServer
        with pytest.raises(ConfigError, match=f"{variable}='{value}'"):
            resolve_secret(None, "10.1.2.3")
        with pytest.raises(ConfigError, match=f"{variable}='{value}'"):
            TransferEngine(fabric="tcp", hostname="127.0.0.1")
        with pytest.raises(ConfigError, match=f"{variable}='{value}'"):
            MetadataServer(host="127.0.0.1", port=0)


@pytest.mark.parametrize("value, want", [("1", True), ("Yes", True), (" on ", True), ("TRUE", True), ("0", False),
                                         ("off", False), ("No", False), ("false", False), ("", None)])
def test_documented_switch_values(monkeypatch, value, want):
    from transport.config import EngineConfig, parse_flag
    monkeypatch.setenv("PXN_FORWARD_LARGE", value)
    assert EngineConfig.from_env().forward_large is (False if want is None else want)
    monkeypatch.setenv("PXN_SGLANG_PLUGIN", value)
    assert parse_flag("PXN_SGLANG_PLUGIN", True) is (True if want is None else want)


def _load_in_thread(path: str, timeout: float = 10.0):
    """``_load_secret_file(path)`` in a thread: what it raised, or a hang (a FIFO opened for reading without
    O_NONBLOCK blocks until a writer comes)."""
    import threading
    from transport import auth
    got = {}

    def run():
        try:
            got["value"] = auth._load_secret_file(path)
        except BaseException as e:  # noqa: BLE001 — handed to the test
            got["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        with open(path, "wb"):  # let the hung open return (a writer appears, closes at once)
            pass
        t.join(5.0)
        pytest.fail(f"loading the secret file {path} hung for {timeout} s")
    return got.get("error"), got.get("value")


def test_secret_file_that_is_a_fifo_is_refused_at_once(monkeypatch, tmp_path):
    """A FIFO at ``PXN_SECRET_FILE`` must not hang an engine's start: refused at once, naming the path."""
    from transport import auth
    d = tmp_path / "pxn"
    d.mkdir(mode=0o700)
    fifo = d / "secret"
    os.mkfifo(fifo, 0o600)
    err, _ = _load_in_thread(str(fifo))
    assert isinstance(err, auth.InsecureConfig) and "not a regular file" in str(err) and str(fifo) in str(err)


@pytest.mark.parametrize("case", ["symlink", "mode 0644", "mode 0640", "mode 0700", "directory"])
def test_secret_file_other_than_a_0600_regular_file_is_refused(tmp_path, case):
    from transport import auth
    d = tmp_path / "pxn"
    d.mkdir(mode=0o700)
    path = d / "secret"
    real = d / "real"
    real.write_text("b" * 64)
    real.chmod(0o600)
    if case == "symlink":
        path.symlink_to(real)
    elif case == "directory":
        path.mkdir(mode=0o700)
    else:
        path.write_text("c" * 64)
        path.chmod(int(case.split()[1], 8))
    err, _ = _load_in_thread(str(path))
    assert isinstance(err, auth.InsecureConfig) and str(path) in str(err)
    err, value = _load_in_thread(str(real))
    assert err is None and value == b"b" * 64


def _http(url: str, method: str, body=None, headers=None):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _capturing(client):
    """Record every request ``client`` (an ``HttpMetadata``) sends: what someone on the path would capture."""
    sent = []
    fetch = client._fetch

    def record(method, url, body, headers):
        sent.append((method, url, body, dict(headers)))
        return fetch(method, url, body, headers)
    client._fetch = record
    return sent


def test_a_captured_metadata_change_is_refused_after_a_restart_and_on_another_server():
    """An entry goes v1 -> v2; the signed PUT of v1, captured, is replayed on the same server, on a second server with
    the same secret, and on the first one restarted on its port (where v2 was published again): refused (403) every
    time, and the entry stays v2. A fresh, signed PUT of an older version is refused too (409)."""
    from integration.metadata import HttpMetadata
    from integration.metadata_server import AUTH_HEADER, MetadataServer, sign
    key = "pxn/segment/prefill-0"
    v1, v2 = {"session": "10.0.0.1:1111"}, {"session": "10.0.0.2:2222"}
    with MetadataServer("127.0.0.1", 0, secret=SECRET) as first, MetadataServer("127.0.0.1", 0, secret=SECRET) as other:
        client = HttpMetadata(first.url, secret=SECRET.encode())
        sent = _capturing(client)
        client.put(key, v1)
        _, url1, body1, headers1 = [s for s in sent if s[0] == "PUT"][-1]
        client.put(key, v2)
        assert client.get(key) == v2
        assert _http(url1, "PUT", body1, headers1)[0] == 403
        assert client.get(key) == v2
        assert _http(url1.replace(str(first.port), str(other.port)), "PUT", body1, headers1)[0] == 403
        assert other.keys() == []
        port = first.port
        first.close()
        with MetadataServer("127.0.0.1", port, secret=SECRET) as again:
            client.put(key, v2)
            assert _http(url1, "PUT", body1, headers1)[0] == 403
            assert client.get(key) == v2
            # a signed change, on a fresh challenge, of an older version than the stored one
            old = json.dumps(v1).encode()
            challenge = _http(again.url + "/challenge", "GET")[1].decode()
            status, text = _http(url1, "PUT", old, {AUTH_HEADER: sign(SECRET.encode(), "PUT", key, old, challenge, 1)})
            assert status == 409 and b"not newer" in text
            assert client.get(key) == v2 and again.keys() == [key]


def test_the_metadata_server_uses_the_per_user_secret_on_loopback_by_default(monkeypatch, tmp_path):
    """Started with no secret and not told to be insecure, the server on loopback takes the per-user secret file, as
    engines do: an unsigned PUT or DELETE from any local process is refused; a client holding that file's secret
    gets in; ``insecure=True`` runs Mooncake's open protocol."""
    from integration.metadata import HttpMetadata
    from integration.metadata_server import MetadataServer
    from transport.auth import resolve_secret
    monkeypatch.delenv("PXN_SECRET", raising=False)
    monkeypatch.delenv("PXN_INSECURE", raising=False)
    monkeypatch.setenv("PXN_SECRET_FILE", str(tmp_path / "pxn" / "secret"))
    with MetadataServer("127.0.0.1", 0) as srv:
        assert srv.authenticated
        url = srv.url + "?key=pxn/segment/a"
        assert _http(url, "PUT", b'{"session": "evil:1"}')[0] == 403
        assert srv.keys() == []
        HttpMetadata(srv.url, secret=resolve_secret(None, "127.0.0.1")).put("pxn/segment/a", {"session": "h:1"})
        assert _http(url, "DELETE")[0] == 403 and srv.keys() == ["pxn/segment/a"]
    with MetadataServer("127.0.0.1", 0, insecure=True) as srv:
        assert not srv.authenticated
        assert _http(srv.url + "?key=k", "PUT", b"{}")[0] == 200


# --- etcd ------------------------------------------------------------------------------------------------------
def _etcd(tmp_path, tls=None):
    pytest.importorskip("etcd3gw")
    from etcd_helpers import EtcdServer, EtcdUnavailable
    try:
        return EtcdServer.start(str(tmp_path), tls=tls)
    except EtcdUnavailable as e:
        pytest.skip(str(e))


def test_a_forged_etcd_entry_is_refused_naming_its_key(tmp_path, monkeypatch):
    """Someone who may write to etcd but does not hold the secret replaces a published entry with one pointing at
    their own session, or copies a signed entry to another segment name: a reader with the secret refuses both
    (``ForgedSegment``, naming the key) and still reads the genuine entry."""
    import etcd3gw
    from integration.metadata import EtcdMetadata
    from transport.errors import ForgedSegment
    monkeypatch.delenv("MC_METADATA_CLUSTER_ID", raising=False)
    etcd = _etcd(tmp_path)
    writer = reader = None
    try:
        writer = EtcdMetadata(etcd.url, ttl=30, secret=SECRET.encode())
        reader = EtcdMetadata(etcd.url, secret=SECRET.encode())
        writer.put("pxn/segment/prefill-0", {"session": "127.0.0.1:1111", "engine_id": 7, "fabric": "tcp"})
        assert reader.get("pxn/segment/prefill-0")["session"] == "127.0.0.1:1111"
        raw = etcd3gw.Etcd3Client("127.0.0.1", etcd.port)
        genuine = raw.get("mooncake/ram/prefill-0")[0]
        raw.put("mooncake/ram/prefill-1", genuine)  # a signed entry under another name
        with pytest.raises(ForgedSegment, match="mooncake/ram/prefill-1"):
            reader.get("pxn/segment/prefill-1")
        forged = json.loads(genuine)
        forged["pxn"]["session"] = "10.6.6.6:6666"
        raw.put("mooncake/ram/prefill-0", json.dumps(forged))
        with pytest.raises(ForgedSegment, match="mooncake/ram/prefill-0.*signed with another secret"):
            reader.get("pxn/segment/prefill-0")
        del forged["pxn"]["mac"]
        raw.put("mooncake/ram/prefill-0", json.dumps(forged))
        with pytest.raises(ForgedSegment, match="mooncake/ram/prefill-0.*unsigned"):
            reader.get("pxn/segment/prefill-0")
    finally:
        for c in (writer, reader):
            if c is not None:
                c.close()
        etcd.stop()


def _etcdctl(etcd, *args):
    import shutil
    import subprocess
    exe = shutil.which("etcdctl") or os.path.join(os.path.dirname(os.sys.executable), "etcdctl")
    subprocess.run([exe, "--endpoints", etcd.client_url, *args], check=True, capture_output=True, timeout=30)


def test_etcd_authentication_is_passed_through(tmp_path, monkeypatch):
    """etcd with its own authentication on: a client without credentials is refused by etcd (an error naming the
    server), one with ``user`` and ``password_file`` in the connection string publishes and reads its signed entry,
    also after its token went stale."""
    from integration.metadata import EtcdMetadata
    from transport.errors import UnknownPeer
    monkeypatch.delenv("MC_METADATA_CLUSTER_ID", raising=False)
    etcd = _etcd(tmp_path)
    client = None
    try:
        _etcdctl(etcd, "user", "add", "root", "--new-user-password=root-pw-0123")
        _etcdctl(etcd, "role", "add", "root")
        _etcdctl(etcd, "user", "grant-role", "root", "root")
        _etcdctl(etcd, "user", "add", "pxn", "--new-user-password=pxn-pw-0123")
        _etcdctl(etcd, "role", "add", "pxn")
        _etcdctl(etcd, "role", "grant-permission", "pxn", "--prefix=true", "readwrite", "mooncake/")
        _etcdctl(etcd, "user", "grant-role", "pxn", "pxn")
        _etcdctl(etcd, "auth", "enable")
        anonymous = EtcdMetadata(etcd.url, ttl=30, secret=SECRET.encode())
        with pytest.raises(UnknownPeer, match="etcd"):
            anonymous.put("pxn/segment/a", {"session": "127.0.0.1:1"})
        anonymous.close()
        pw = tmp_path / "etcd-password"
        pw.write_text("pxn-pw-0123\n")
        pw.chmod(0o600)
        client = EtcdMetadata(f"{etcd.url}?user=pxn&password_file={pw}", ttl=30, secret=SECRET.encode())
        client.put("pxn/segment/a", {"session": "127.0.0.1:1"})
        assert client.get("pxn/segment/a")["session"] == "127.0.0.1:1"
        client._clients[0].session.headers["Authorization"] = "expired-token"  # a token etcd no longer knows
        assert client.get("pxn/segment/a")["session"] == "127.0.0.1:1"
    finally:
        if client is not None:
            client.close()
        etcd.stop()


def test_etcd_tls_is_passed_through(tmp_path, monkeypatch):
    """etcd serving https only: ``ca`` in the connection string makes the client speak TLS and check etcd's
    certificate; a client without it cannot reach etcd."""
    import shutil
    import subprocess
    from integration.metadata import EtcdMetadata
    from transport.errors import UnknownPeer
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make certificates")
    monkeypatch.delenv("MC_METADATA_CLUSTER_ID", raising=False)
    d = tmp_path

    def ssl_cmd(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60, cwd=d)
    ssl_cmd("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=pxn-test-ca")
    ssl_cmd("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl_cmd("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "srv.pem", "-days", "1", "-extfile", "san.ext")
    etcd = _etcd(tmp_path, tls=(str(d / "srv.pem"), str(d / "srv.key"), str(d / "ca.pem")))
    client = None
    try:
        plain = EtcdMetadata(etcd.url, timeout=2.0)
        with pytest.raises(UnknownPeer):
            plain.get("pxn/segment/a")
        client = EtcdMetadata(f"{etcd.url}?ca={d / 'ca.pem'}", ttl=30, secret=SECRET.encode())
        client.put("pxn/segment/a", {"session": "127.0.0.1:2"})
        assert client.get("pxn/segment/a")["session"] == "127.0.0.1:2"
    finally:
        if client is not None:
            client.close()
        etcd.stop()


# --- credits are leases ------------------------------------------------------------------------------------------
PIECES, PIECE = 32768, 64  # a batch of small pieces: several chunks, each taking a landing credit


def _looping_sender(session: str, secret: str, done, stop, errors) -> None:
    """A sender in its own process writing batches of small pieces to ``session`` until ``stop`` is set; ``done``
    counts the batches that completed, ``errors`` those that failed (its rails aborted while it was stopped)."""
    import logging
    import time
    logging.basicConfig(level=logging.ERROR)
    rng = np.random.default_rng(os.getpid())
    with TransferEngine(fabric="tcp", secret=secret, rails=2) as eng:
        src = np.frombuffer(rng.bytes(PIECES * PIECE * 2), dtype=np.uint8).copy()
        eng.register(src)
        base = int(session.rsplit("@", 1)[1])
        session = session.rsplit("@", 1)[0]
        srcs = [src.ctypes.data + 2 * PIECE * i for i in range(PIECES)]
        dsts = [base + PIECE * i for i in range(PIECES)]
        while not stop.is_set():
            try:
                eng.batch_write(session, srcs, dsts, [PIECE] * PIECES, timeout=60)
                done.value += 1
            except Exception:  # noqa: BLE001 — counted: the test checks that it recovers
                errors.value += 1
                time.sleep(0.1)  # the scenario: a sender that retries at its own pace after a failure


def _pool_free(rx) -> int:
    """Free slots of the receiver's fullest landing pool."""
    return min(p["free"] for p in rx.stats()["receiver"]["landing_pools"])


@pytest.mark.slow
def test_a_stopped_sender_does_not_keep_its_landing_slots(seed):
    """A sender stopped (SIGSTOP) while it holds most of a receiver's landing slots on both rails: another sender's
    batches still all complete (the stopped one's leases run out while it waits, its rails to the receiver are
    aborted and its slots go back), and the stopped sender, resumed, asks again and completes batches."""
    import multiprocessing
    import signal
    import time
    from transport.credits import LEASE_S
    rng = np.random.default_rng(seed)
    chunk = 128 << 10
    ctx = multiprocessing.get_context("spawn")
    with TransferEngine(fabric="tcp", secret=SECRET, rails=2, relay_slot_bytes=chunk, landing_bytes=8 * chunk) as rx:
        dst = np.zeros(2 * PIECES * PIECE, dtype=np.uint8)
        rx.register(dst)
        done, errors, stop = ctx.Value("i", 0), ctx.Value("i", 0), ctx.Event()
        proc = ctx.Process(target=_looping_sender, args=(f"{rx.session_id}@{dst.ctypes.data}", SECRET, done, stop, errors),
                           daemon=True)
        proc.start()
        try:
            wait_for(lambda: done.value >= 3 or not proc.is_alive(), "3 batches of the looping sender", timeout=120,
                     interval=0.05)
            assert done.value >= 3, "the looping sender did not get going"
            nslots = rx.stats()["receiver"]["landing_pools"][0]["slots"]
            for _ in range(200):  # stop it while it holds slots on every rail
                os.kill(proc.pid, signal.SIGSTOP)
                wait_stopped(proc.pid)
                if _pool_free(rx) <= 1:
                    break
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(0.01 * rng.random())  # the scenario: it runs a random moment before the next stop
            else:
                pytest.fail("never caught the sender holding all but one slot of a pool")
            with TransferEngine(fabric="tcp", secret=SECRET, rails=2, relay_slot_bytes=chunk) as other:
                src = np.frombuffer(rng.bytes(PIECES * PIECE), dtype=np.uint8).copy()
                other.register(src)
                base = dst.ctypes.data + PIECES * PIECE
                took = []
                for i in range(10):
                    t0 = time.monotonic()
                    other.batch_write(rx.session_id, [src.ctypes.data + PIECE * j for j in range(PIECES)],
                                      [base + PIECE * j for j in range(PIECES)], [PIECE] * PIECES,
                                      timeout=3 * LEASE_S + 10)
                    took.append(time.monotonic() - t0)
                    assert bytes(dst[PIECES * PIECE:]) == bytes(src)
                    dst[PIECES * PIECE:] = 0
                print(f"other sender's batches while one is stopped: {['%.3f' % t for t in took]} s")
            assert rx.counters.get("rx_leases_expired") >= 1
            before = done.value
            os.kill(proc.pid, signal.SIGCONT)
            wait_for(lambda: done.value >= before + 2, "the resumed sender completing 2 batches again", timeout=60,
                     interval=0.05)
        finally:
            stop.set()
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.join(30)
            if proc.is_alive():
                proc.kill()
