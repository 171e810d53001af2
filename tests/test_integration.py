"""Integration layer tests: the Mooncake-compatible API and the sglang adapter, two processes over tcp.

The receiving side runs in a spawned process with the SAME API as the sender (a Mooncake-shim receiver for the
Mooncake tests, an sglang-adapter receiver registering a KV region and an aux region through ``batch_register``
for the sglang tests). Its buffer is ``GUARD + size + GUARD`` bytes, poisoned, only the middle registered; every
case writes fresh random data (suite_env.SEED) and compares the peer's WHOLE buffer, guards included, with the
expected image, so a missing, misplaced or stray byte anywhere fails the case.
"""
from __future__ import annotations

import importlib.machinery
import inspect
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from engine_helpers import GUARD, POISON, Expected, GuardedPeer, _digest, disjoint_offsets, serve
from wait_helpers import wait_for

from integration import hosts
from integration import mooncake as mc
from integration.mooncake import TransferEngine as MooncakeEngine
from integration.sglang import PxnMooncakeTransferEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MB = 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]   # sglang's aux metadata batch (bytes per piece)
BLOCK_1K = 2359296                                        # MLA latent of 1K tokens of one layer (bytes)
PEER_BYTES = 48 * MB
SRC_BYTES = 48 * MB


# ============================================================================================================
# the receiving process
# ============================================================================================================
def _peer_main(conn, kind: str, size: int, log_level: int, port: int = 0) -> None:
    logging.basicConfig(level=log_level, format="peer %(levelname)s %(name)s: %(message)s")
    state = {"extras": {}}

    def start():
        mem = state["mem"] = np.full(GUARD + size + GUARD, POISON, dtype=np.uint8)
        base = mem.ctypes.data + GUARD
        half = size // 2
        if kind == "mooncake":
            eng = MooncakeEngine(port=port)
            ret = eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if ret != 0:
                raise RuntimeError(f"initialize returned {ret}")
            ret = eng.register_memory(base, size)
            shim = eng
        else:  # sglang adapter on the decode side: KV region + aux region in one batch_register, as conn.py does
            eng = PxnMooncakeTransferEngine("127.0.0.1", gpu_id=0, ib_device=None, protocol="tcp", port=port)
            ret = eng.batch_register([base, base + half], [half, size - half])
            shim = eng.engine
        state["eng"], state["shim"] = eng, shim
        if ret != 0:
            raise RuntimeError(f"registration returned {ret}")
        return {"session": eng.get_session_id(), "base": base}

    def handle(cmd, kw):
        mem, shim, extras = state["mem"], state["shim"], state["extras"]
        if cmd == "poison":
            mem.fill(POISON)
            return None
        if cmd == "digest":
            return _digest(mem)
        if cmd == "dump":
            return mem.tobytes()
        if cmd == "register_extra":
            x = np.full(kw["size"], POISON, dtype=np.uint8)
            rc = shim.register_memory(x.ctypes.data, x.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_memory returned {rc}")
            extras[x.ctypes.data] = x
            return x.ctypes.data
        if cmd == "unregister":
            return shim.unregister_memory(kw["addr"])
        if cmd == "extra_digest":
            return _digest(extras[kw["addr"]])
        raise ValueError(f"unknown command {cmd!r}")

    serve(conn, start, handle, lambda: state["eng"].close())


class Peer(GuardedPeer):
    """A receiving engine (``kind`` "mooncake" or "sglang") in a spawned process; ``size`` registered bytes at
    ``base`` (for "sglang": two regions, ``[base, base + size/2)`` and ``[base + size/2, base + size)``).
    ``port``: its control port (0: any free one), to restart a peer under the same session id."""

    def __init__(self, kind: str, size: int, port: int = 0):
        super().__init__(_peer_main, (kind, size, logging.WARNING, port), f"pxn-integration-peer-{kind}", size)


# ============================================================================================================
# fixtures
# ============================================================================================================
@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # these change which fabric initialize() picks; the cases below say what they want
    for name in ("PXN_FABRIC", "MC_FORCE_TCP", "MOONCAKE_PROTOCOL", "MC_TRANSFER_TIMEOUT", "PXN_SGLANG_PLUGIN",
                 "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", "MC_MIN_PRC_PORT", "MC_MAX_PRC_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def mc_peer():
    p = Peer("mooncake", PEER_BYTES)
    yield p
    p.close()


@pytest.fixture(scope="module")
def sgl_peer():
    p = Peer("sglang", PEER_BYTES)
    yield p
    p.close()


@pytest.fixture(scope="module")
def src():
    from suite_env import SEED
    rng = np.random.default_rng([SEED, 7])
    return np.frombuffer(rng.bytes(SRC_BYTES), dtype=np.uint8).copy()


@pytest.fixture(scope="module")
def mc_sender(src):
    eng = MooncakeEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert eng.register_memory(src.ctypes.data, src.nbytes) == 0
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def sgl_sender(src):
    eng = PxnMooncakeTransferEngine("127.0.0.1", gpu_id=0, ib_device=None, protocol="tcp")
    # prefill registers KV (first half of src) and aux (second half) as sglang does: one batch_register
    half = SRC_BYTES // 2
    assert eng.batch_register([src.ctypes.data, src.ctypes.data + half], [half, SRC_BYTES - half]) == 0
    yield eng
    eng.close()


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _addrs(base: int, offs):
    return [base + int(o) for o in offs]


# ============================================================================================================
# Mooncake API: byte-exact round trips
# ============================================================================================================
def test_mooncake_aux_batch(mc_sender, mc_peer, src, rng):
    mc_peer.poison()
    s = disjoint_offsets(rng, AUX, 1 * MB)
    d = disjoint_offsets(rng, AUX, 1 * MB)
    exp = Expected(mc_peer.size)
    exp.apply(src, s, d, AUX)
    ret = mc_sender.batch_transfer_sync_write(mc_peer.session, _addrs(src.ctypes.data, s),
                                              _addrs(mc_peer.base, d), AUX)
    assert ret == 0
    mc_peer.check(exp)


def test_mooncake_large_pieces(mc_sender, mc_peer, src, rng):
    """KV-block-sized pieces (direct path), mid-size and odd sizes, in a shuffled layout on both sides."""
    lengths = [BLOCK_1K] * 12 + rng.integers(64 * 1024, 1 * MB, size=8).tolist() + [65535, 65536, 65537, 1, 7]
    lengths = [lengths[i] for i in rng.permutation(len(lengths))]
    mc_peer.poison()
    s = disjoint_offsets(rng, lengths, SRC_BYTES)
    d = disjoint_offsets(rng, lengths, mc_peer.size)
    exp = Expected(mc_peer.size)
    exp.apply(src, s, d, lengths)
    assert mc_sender.batch_transfer_sync_write(mc_peer.session, _addrs(src.ctypes.data, s),
                                               _addrs(mc_peer.base, d), lengths) == 0
    mc_peer.check(exp)


def test_mooncake_single_and_async(mc_sender, mc_peer, src, rng):
    mc_peer.poison()
    exp = Expected(mc_peer.size)
    b = src.ctypes.data
    # one piece, sync
    assert mc_sender.transfer_sync_write(mc_peer.session, b + 12345, mc_peer.base + 3, 5000) == 0
    exp.apply(src, [12345], [3], [5000])
    # three async batches into disjoint 8 MB windows, waited together
    ids = []
    for k in range(3):
        lens = AUX + [300 * 1024, BLOCK_1K]
        s = disjoint_offsets(rng, lens, 16 * MB)
        d = (k + 1) * 8 * MB + disjoint_offsets(rng, lens, 8 * MB)
        exp.apply(src, s, d, lens)
        bid = mc_sender.batch_transfer_async_write(mc_peer.session, _addrs(b, s), _addrs(mc_peer.base, d), lens)
        assert bid >= 1
        ids.append(bid)
    assert len(set(ids)) == 3
    assert mc_sender.get_batch_transfer_status(ids) == 0
    mc_peer.check(exp)
    # the ids were freed by get_batch_transfer_status
    assert mc_sender.get_batch_transfer_status([ids[0]]) == mc.ERR_INVALID_ARGUMENT
    # non-blocking poll: 1 once done (then freed), like Mooncake's transfer_check_status
    bid = mc_sender.transfer_submit_write(mc_peer.session, b, mc_peer.base + 40 * MB, 64)
    exp.apply(src, [0], [40 * MB], [64])
    st = wait_for(lambda: mc_sender.transfer_check_status(bid), "transfer_check_status leaving 0", timeout=30,
                  interval=0.001)
    assert st == 1
    assert mc_sender.check_batch_transfer_status(bid) == mc.ERR_INVALID_ARGUMENT
    mc_peer.check(exp)


def test_mooncake_async_failure_codes(mc_sender, mc_peer, src):
    mc_peer.poison()
    b = src.ctypes.data
    # refused at submission (destination not registered at the peer): Mooncake's "0 on failure"
    assert mc_sender.batch_transfer_async_write(mc_peer.session, [b], [mc_peer.base - 4096], [64]) == 0
    # refused at submission by the one-piece variant: 0 too (Mooncake's transfer_submit_write returns a batch id,
    # 0 on failure), the cause logged
    assert mc_sender.transfer_submit_write(mc_peer.session, b, mc_peer.base + mc_peer.size, 64) == 0
    assert mc_sender.transfer_submit_write("unreachable_peer:9", 0, 0, 16) == 0
    mc_peer.check(Expected(mc_peer.size))


# ============================================================================================================
# sglang adapter: byte-exact round trips, sglang's call pattern
# ============================================================================================================
def test_sglang_kv_then_aux(sgl_sender, sgl_peer, src, rng):
    """As conn.py: the KV blocks of a request (into the peer's KV region), then its aux batch (aux region)."""
    sgl_peer.poison()
    exp = Expected(sgl_peer.size)
    half = sgl_peer.size // 2
    b = src.ctypes.data
    kv_len = [BLOCK_1K] * 8 + [64 * 1024] * 16 + [2048] * 64
    kv_s = disjoint_offsets(rng, kv_len, SRC_BYTES // 2)
    kv_d = disjoint_offsets(rng, kv_len, half)
    exp.apply(src, kv_s, kv_d, kv_len)
    assert sgl_sender.batch_transfer_sync(sgl_peer.session, _addrs(b, kv_s), _addrs(sgl_peer.base, kv_d),
                                          kv_len) == 0
    aux_s = SRC_BYTES // 2 + disjoint_offsets(rng, AUX, 1 * MB)
    aux_d = half + disjoint_offsets(rng, AUX, 1 * MB)
    exp.apply(src, aux_s, aux_d, AUX)
    assert sgl_sender.batch_transfer_sync(sgl_peer.session, _addrs(b, aux_s), _addrs(sgl_peer.base, aux_d),
                                          AUX) == 0
    assert sgl_sender.transfer_sync(sgl_peer.session, b + 99, sgl_peer.base + half + 2 * MB, 777) == 0
    exp.apply(src, [99], [half + 2 * MB], [777])
    sgl_peer.check(exp)


def test_sglang_4_threads_at_once(sgl_sender, sgl_peer, src, rng):
    """sglang's transfer workers call batch_transfer_sync concurrently: 4 threads x 10 batches (aux batches,
    KV-like pages and a large block each), each thread into its own window; every call returns 0 and the whole
    peer buffer is exact."""
    sgl_peer.poison()
    exp = Expected(sgl_peer.size)
    b = src.ctypes.data
    n_threads, n_batches = 4, 10
    window = sgl_peer.size // 2 // n_threads          # inside the KV region
    per_batch = window // n_batches
    plans = []
    for t in range(n_threads):
        batches = []
        for k in range(n_batches):
            lens = list(AUX) if k % 3 == 0 else rng.integers(1, 8193, size=int(rng.integers(2, 31))).tolist()
            if k % 4 == 1:
                lens.append(int(rng.integers(128 * 1024, per_batch // 2)))
            d = t * window + k * per_batch + disjoint_offsets(rng, lens, per_batch)
            s = disjoint_offsets(rng, lens, SRC_BYTES // 2)
            exp.apply(src, s, d, lens)
            batches.append((_addrs(b, s), _addrs(sgl_peer.base, d), lens))
        plans.append(batches)
    results = [[] for _ in range(n_threads)]
    errors = []
    start = threading.Barrier(n_threads)

    def worker(t):
        try:
            start.wait(30)
            for s, d, lens in plans[t]:
                results[t].append(sgl_sender.batch_transfer_sync(sgl_peer.session, s, d, lens))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert results == [[0] * n_batches] * n_threads
    sgl_peer.check(exp)


def test_sglang_session_id_port_is_int(sgl_sender, sgl_peer):
    sid = sgl_sender.get_session_id()
    host, port = sid.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert int(port) == sgl_sender.engine.get_rpc_port() > 0
    # conn.py shards by the sum of the decode sessions' ports
    assert sum(int(s.rsplit(":", 1)[1]) for s in (sid, sgl_peer.session)) > 0


def test_sglang_register_one_buffer(sgl_sender, sgl_peer, src, rng):
    extra = np.frombuffer(rng.bytes(8192), dtype=np.uint8).copy()
    sgl_sender.register(extra.ctypes.data, extra.nbytes)
    sgl_peer.poison()
    exp = Expected(sgl_peer.size)
    assert sgl_sender.transfer_sync(sgl_peer.session, extra.ctypes.data + 100, sgl_peer.base + 10, 5000) == 0
    exp.apply(extra, [100], [10], [5000])
    sgl_peer.check(exp)
    sgl_sender.deregister(extra.ctypes.data)
    # the source is no longer registered: refused, nothing written
    assert sgl_sender.transfer_sync(sgl_peer.session, extra.ctypes.data, sgl_peer.base, 64) == \
        mc.ERR_ADDRESS_NOT_REGISTERED
    with pytest.raises(RuntimeError):
        sgl_sender.deregister(extra.ctypes.data)
    with pytest.raises(RuntimeError):  # overlaps the registered src range
        sgl_sender.register(src.ctypes.data + 64, 128)
    sgl_peer.check(exp)


def test_sglang_send_probe(sgl_sender, sgl_peer, mc_peer):
    assert sgl_sender.send_probe(sgl_peer.session) == 0
    assert sgl_sender.send_probe(mc_peer.session) == 0
    assert sgl_sender.send_probe(f"127.0.0.1:{_dead_port()}") < 0
    assert sgl_sender.send_probe("no-port-here") < 0
    # something listening that is not a pxn engine: not alive as a peer
    srv = socket.create_server(("127.0.0.1", 0))
    th = threading.Thread(target=lambda: srv.accept()[0].close(), daemon=True)
    th.start()
    try:
        assert sgl_sender.send_probe(f"127.0.0.1:{srv.getsockname()[1]}") < 0
    finally:
        srv.close()


def test_sglang_adapter_matches_sglang_signatures():
    """Parameter names and order of sglang 0.5.23's MooncakeTransferEngine (device_communicators/
    mooncake_transfer_engine.py): conn.py calls some of them with keywords."""
    expected = {
        "__init__": ["self", "hostname", "gpu_id", "ib_device"],
        "register": ["self", "ptr", "length"],
        "deregister": ["self", "ptr"],
        "batch_register": ["self", "ptrs", "lengths"],
        "batch_deregister": ["self", "ptrs"],
        "initialize": ["self", "hostname", "device_name"],
        "transfer_sync": ["self", "session_id", "buffer", "peer_buffer_address", "length"],
        "batch_transfer_sync": ["self", "session_id", "buffers", "peer_buffer_addresses", "lengths"],
        "get_session_id": ["self"],
        "send_probe": ["self", "peer_session_id"],
        "get_engine": ["self"],
        "get_ib_device": ["self"],
    }
    for name, params in expected.items():
        sig = inspect.signature(getattr(PxnMooncakeTransferEngine, name))
        positional = [p.name for p in sig.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert positional == params, (name, positional)
    init = inspect.signature(PxnMooncakeTransferEngine.__init__).parameters
    assert init["gpu_id"].default is None and init["ib_device"].default is None


# ============================================================================================================
# failures: negative ints, nothing written
# ============================================================================================================
def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("api", ["mooncake", "sglang"])
def test_destination_outside_peer_memory(api, mc_sender, sgl_sender, mc_peer, sgl_peer, src):
    peer = mc_peer if api == "mooncake" else sgl_peer
    call = mc_sender.batch_transfer_sync_write if api == "mooncake" else sgl_sender.batch_transfer_sync
    peer.poison()
    b = src.ctypes.data
    # valid small and large pieces, then one that runs 1 byte past the registered end
    srcs = [b, b + 4096, b + 8 * MB]
    dsts = [peer.base, peer.base + 4096, peer.base + peer.size - 100]
    ret = call(peer.session, srcs, dsts, [64, 3 * MB, 101])
    assert ret < 0 and ret == mc.ERR_ADDRESS_NOT_REGISTERED
    # entirely outside (in the guard below the region)
    assert call(peer.session, [b, b + 64], [peer.base, peer.base - GUARD // 2], [64, 64]) == \
        mc.ERR_ADDRESS_NOT_REGISTERED
    # the source is not registered here
    assert call(peer.session, [b - 64 * MB], [peer.base], [64]) == mc.ERR_ADDRESS_NOT_REGISTERED
    # malformed batches
    assert call(peer.session, [b, b + 64], [peer.base], [64, 64]) == mc.ERR_INVALID_ARGUMENT
    assert call(peer.session, [b], [peer.base], [-1]) == mc.ERR_INVALID_ARGUMENT
    # a zero-length piece moves nothing and is no error, as in Mooncake; with it a bad piece still fails all
    assert call(peer.session, [b], [peer.base], [0]) == 0
    assert call(peer.session, [b, b], [peer.base, peer.base - 4096], [0, 64]) == mc.ERR_ADDRESS_NOT_REGISTERED
    time.sleep(0.2)  # the scenario: a window in which a wrongly sent piece would land (no event for "never")
    peer.check(Expected(peer.size))  # all poison: not even the valid pieces were written


def test_sglang_piece_across_its_two_regions_is_refused(sgl_sender, sgl_peer, src):
    """The sglang peer registered two adjacent regions: a piece straddling them is inside no single region."""
    sgl_peer.poison()
    half = sgl_peer.size // 2
    assert sgl_sender.batch_transfer_sync(sgl_peer.session, [src.ctypes.data], [sgl_peer.base + half - 32],
                                          [64]) == mc.ERR_ADDRESS_NOT_REGISTERED
    sgl_peer.check(Expected(sgl_peer.size))


@pytest.mark.parametrize("api", ["mooncake", "sglang"])
def test_unknown_session(api, mc_sender, sgl_sender, src):
    b = src.ctypes.data
    call = mc_sender.batch_transfer_sync_write if api == "mooncake" else sgl_sender.batch_transfer_sync
    port = _dead_port()
    assert call(f"127.0.0.1:{port}", [b], [b], [64]) == mc.ERR_METADATA
    assert call("no-port-here", [b], [b], [64]) < 0
    assert call(f"[::1]:{port}", [b], [b], [64]) < 0


def test_remote_rejected_when_peer_deregistered(mc_sender, mc_peer, src):
    """The sender's view of the peer's regions is stale: the receiver refuses -> ERR_REMOTE_REJECTED, and
    nothing is written into the deregistered buffer."""
    extra = mc_peer.call("register_extra", size=1 * MB)
    b = src.ctypes.data
    assert mc_sender.transfer_sync_write(mc_peer.session, b, extra, 64) == 0  # the sender learns the region
    mc_peer.poison()
    clean = mc_peer.call("extra_digest", addr=extra)
    assert mc_peer.call("unregister", addr=extra) == 0
    assert mc_peer.call("unregister", addr=extra) == mc.ERR_ADDRESS_NOT_REGISTERED
    ret = mc_sender.batch_transfer_sync_write(mc_peer.session, [b + i * 128 for i in range(100)],
                                              [extra + i * 64 for i in range(100)], [64] * 100)
    assert ret == mc.ERR_REMOTE_REJECTED
    assert mc_peer.call("extra_digest", addr=extra) == clean
    mc_peer.check(Expected(mc_peer.size))


def test_peer_death_is_an_endpoint_error(mc_sender, src):
    """The decode process dies: sync and async writes to it fail instead of hanging -- ERR_ENDPOINT, while the
    engine still holds the dead connection and once it forgot it and nobody answers at the session -- and the
    probe reports it dead."""
    victim = Peer("mooncake", 8 * MB)
    try:
        b = src.ctypes.data
        assert mc_sender.transfer_sync_write(victim.session, b, victim.base, 64) == 0  # handshake done
        assert mc_sender.send_probe(victim.session) == 0
        victim.proc.kill()
        victim.proc.join(10)
        t0 = time.monotonic()
        dead = (mc.ERR_ENDPOINT,)
        assert mc_sender.batch_transfer_sync_write(victim.session, [b, b + MB], [victim.base, victim.base + MB],
                                                   [64, 2 * MB]) in dead
        bid = mc_sender.batch_transfer_async_write(victim.session, [b], [victim.base], [3 * MB])
        assert bid == 0 or mc_sender.get_batch_transfer_status([bid]) in dead
        assert time.monotonic() - t0 < 20
        assert mc_sender.send_probe(victim.session) < 0
    finally:
        victim.close()


@pytest.mark.slow
def test_sglang_recovers_when_decode_restarts_on_same_port(sgl_sender, src):
    """sglang's recovery flow: a transfer to a decode process that died fails (< 0) and keeps failing while
    nothing listens (send_probe < 0 too); a NEW decode process comes up on the same port, i.e. the same session
    id: send_probe returns 0 and batch_transfer_sync to that session id succeeds, byte-exact."""
    victim = Peer("sglang", 8 * MB)
    session = victim.session
    reborn = None
    try:
        b = src.ctypes.data
        assert sgl_sender.transfer_sync(session, b, victim.base, 64) == 0
        victim.proc.kill()
        victim.proc.join(10)
        assert sgl_sender.batch_transfer_sync(session, [b, b + MB], [victim.base, victim.base + MB],
                                              [64, 2 * MB]) == mc.ERR_ENDPOINT
        assert sgl_sender.send_probe(session) < 0
        assert sgl_sender.batch_transfer_sync(session, [b], [victim.base], [64]) == mc.ERR_ENDPOINT
        reborn = Peer("sglang", 8 * MB, port=int(session.rpartition(":")[2]))
        assert reborn.session == session
        assert sgl_sender.send_probe(session) == 0
        reborn.poison()
        exp = Expected(reborn.size)
        half = reborn.size // 2
        s_off = [0] + [4 * MB + 4096 * i for i in range(len(AUX))]          # KV block, then aux pieces
        d_off = [0] + [half + 4096 * i for i in range(len(AUX))]            # KV region, then aux region
        lens = [BLOCK_1K] + AUX
        exp.apply(src, s_off, d_off, lens)
        assert sgl_sender.batch_transfer_sync(session, _addrs(b, s_off), _addrs(reborn.base, d_off), lens) == 0
        reborn.check(exp)
    finally:
        victim.close()
        if reborn is not None:
            reborn.close()


def test_timeout_code(mc_peer, src):
    with MooncakeEngine(timeout=1e-4) as eng:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.register_memory(src.ctypes.data, src.nbytes) == 0
        assert eng.batch_transfer_sync_write(mc_peer.session, [src.ctypes.data], [mc_peer.base],
                                             [32 * MB]) == mc.ERR_TIMEOUT


# ============================================================================================================
# initialization, registration, codes
# ============================================================================================================
def test_initialize_codes(caplog):
    eng = MooncakeEngine()
    try:
        assert eng.get_rpc_port() == 0 and eng.get_session_id() == ""
        assert eng.batch_transfer_sync_write("127.0.0.1:1", [1], [1], [1]) == mc.ERR_CONTEXT
        assert eng.register_memory(4096, 4096) == mc.ERR_CONTEXT
        with caplog.at_level(logging.ERROR, logger="integration.mooncake"):
            assert eng.initialize("127.0.0.1", "redis://10.0.0.1:6379", "tcp", "") == mc.ERR_NOT_IMPLEMENTED
        assert "P2PHANDSHAKE" in caplog.text  # the cause is logged, not swallowed
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == mc.ERR_NOT_IMPLEMENTED
        assert eng.initialize("127.0.0.1:4242", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.get_session_id() == f"127.0.0.1:{eng.get_rpc_port()}"
        first = eng.pxn_engine
        buf = np.zeros(4096, dtype=np.uint8)
        assert eng.register_memory(buf.ctypes.data, 4096) == 0
        # a second initialize starts a fresh engine and drops the first (and its registrations), as Mooncake's
        with caplog.at_level(logging.WARNING, logger="integration.mooncake"):
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert "called again" in caplog.text
        assert eng.pxn_engine is not first and first._closed and eng.pxn_engine.regions() == []
        assert eng.get_session_id() == f"127.0.0.1:{eng.get_rpc_port()}"
        # a failing second initialize keeps the running engine
        second = eng.pxn_engine
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") == mc.ERR_NOT_IMPLEMENTED
        assert eng.pxn_engine is second and not second._closed
        assert isinstance(json.loads(eng.get_local_topology()), dict)
    finally:
        eng.close()
    assert eng.get_rpc_port() == 0


def test_initialize_reads_the_engine_configuration(monkeypatch, caplog):
    """The Mooncake layer takes PXN_FABRIC / PXN_TIMEOUT from the engine's own EngineConfig: a malformed PXN_*
    value is an error code naming the variable, not an exception, and nothing is started."""
    monkeypatch.setenv("PXN_RELAY_SLOTS", "many")
    eng = MooncakeEngine()
    try:
        with caplog.at_level(logging.ERROR, logger="integration.mooncake"):
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == mc.ERR_INVALID_ARGUMENT
        assert "PXN_RELAY_SLOTS='many'" in caplog.text
        assert eng.pxn_engine is None and eng.get_rpc_port() == 0
        monkeypatch.delenv("PXN_RELAY_SLOTS")
        monkeypatch.setenv("PXN_FABRIC", "ipc")
        monkeypatch.setenv("PXN_TIMEOUT", "7")
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert eng.pxn_engine.fabric_name == "ipc" and eng.pxn_engine.default_timeout == 7.0
        assert eng._batch_timeout([1 << 30]) is None  # the engine's PXN_TIMEOUT, not Mooncake's rule
    finally:
        eng.close()


def test_rdma_without_device_fails_cleanly(monkeypatch, caplog):
    from transport.engine import TransferEngine as PxnEngine
    if os.environ.get("SOFTVERBS_DEVICES"):
        # softverbs (read at each call): RoCE ports with no GID and one that is down, as on a machine whose
        # NICs have no IP address; none is usable
        monkeypatch.setenv("SOFTVERBS_DEVICES", "mlx5_0:1:eth:nogid,mlx5_1:1:eth:nogid,mlx5_2:1:eth:gid:down")
    if PxnEngine._pick_fabric("auto") == "verbs":
        pytest.skip("an RDMA device is usable here")
    # "rdma" starts on tcp with one warning line, as Mooncake does; pxn's "verbs" refuses instead
    with caplog.at_level(logging.WARNING, logger="integration.mooncake"), MooncakeEngine() as eng:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert eng.pxn_engine.fabric_name == "tcp"
    warned = [r.getMessage() for r in caplog.records if "no RDMA device is usable" in r.getMessage()]
    assert len(warned) == 1 and "running on tcp" in warned[0], caplog.text
    with MooncakeEngine() as eng:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "verbs", "") == mc.ERR_DEVICE_NOT_FOUND
    with MooncakeEngine() as eng:  # "auto" falls back to tcp
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "auto", "") == 0
        assert eng.pxn_engine.fabric_name == "tcp"
    for value in ("1", "true", "TRUE", "yes", "on"):  # as Mooncake: forces tcp whatever the protocol says
        monkeypatch.setenv("MC_FORCE_TCP", value)
        with MooncakeEngine() as eng:
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "verbs", "") == 0, value
            assert eng.pxn_engine.fabric_name == "tcp"
    for value in ("0", "false", "no", "off", ""):
        monkeypatch.setenv("MC_FORCE_TCP", value)
        with MooncakeEngine() as eng:
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "verbs", "") == mc.ERR_DEVICE_NOT_FOUND, value
    monkeypatch.delenv("MC_FORCE_TCP")
    eng = PxnMooncakeTransferEngine("127.0.0.1", gpu_id=0)  # MOONCAKE_PROTOCOL unset -> "rdma" -> tcp here
    try:
        assert eng.get_engine().fabric_name == "tcp"
    finally:
        eng.close()


def test_rdma_picks_verbs_and_device_name_picks_the_port(monkeypatch, caplog, rng):
    """protocol "rdma" runs on the verbs fabric where a device is usable; ``device_name`` picks the device, as
    Mooncake's filter does; a named device that is GID-less, down or absent fails with ERR_DEVICE_NOT_FOUND and
    a log line naming the port and why. Two engines then move bytes over the chosen port."""
    if not os.environ.get("SOFTVERBS_DEVICES"):
        pytest.skip("needs softverbs (a device list set per case); real NICs are not chosen by name in CI")
    monkeypatch.setenv("SOFTVERBS_DEVICES", "mlx5_0:1:eth:nogid,mlx5_1:1:eth:gid,mlx5_2:1:eth:gid,"
                                            "mlx5_3:1:eth:gid:down")
    for names, want in (("", {"mlx5_1", "mlx5_2"}), ("mlx5_2", {"mlx5_2"}), ("mlx5_1:1", {"mlx5_1"}),
                        ("mlx5_0,mlx5_2", {"mlx5_2"})):
        with MooncakeEngine() as eng:
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", names) == 0, names
            pxe = eng.pxn_engine
            assert pxe.fabric_name == "verbs", names
            assert {f.device for f in pxe.fabrics} == want and all(f.port_num == 1 for f in pxe.fabrics), names
    for names, why in (("mlx5_0", "mlx5_0:1: no GID"), ("mlx5_3", "mlx5_3:1: down"), ("mlx5_9", "no such port")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="integration.mooncake"), MooncakeEngine() as eng:
            assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", names) == mc.ERR_DEVICE_NOT_FOUND, names
            assert eng.pxn_engine is None
        assert why in caplog.text and "ERR_DEVICE_NOT_FOUND" in caplog.text, caplog.text
    src = np.frombuffer(rng.bytes(1 << 20), dtype=np.uint8).copy()
    dst = np.full(1 << 20, POISON, dtype=np.uint8)
    with MooncakeEngine() as a, MooncakeEngine() as b:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_2") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_2") == 0
        assert a.register_memory(src.ctypes.data, src.size) == 0
        assert b.register_memory(dst.ctypes.data, dst.size) == 0
        lengths = [64] * 11 + [4096, 300_001]
        offs = disjoint_offsets(rng, lengths, dst.size)
        soffs = disjoint_offsets(rng, lengths, src.size)
        assert a.batch_transfer_sync_write(b.get_session_id(), [src.ctypes.data + int(o) for o in soffs],
                                           [dst.ctypes.data + int(o) for o in offs], lengths) == 0
        assert a.pxn_engine.fabric_name == "verbs"
        assert a.pxn_engine.stats()["rails"][0]["key"] == "mlx5_2:1"
    want = np.full(dst.size, POISON, dtype=np.uint8)
    for s, d, n in zip(soffs, offs, lengths):
        want[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, want)


def test_batch_register_is_all_or_nothing():
    bufs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    with MooncakeEngine() as eng:
        assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        a0, a1, a2 = (x.ctypes.data for x in bufs)
        assert eng.register_memory(a2, 4096) == 0
        # the third entry overlaps the range registered above: the first two must be rolled back
        assert eng.batch_register_memory([a0, a1, a2 + 16], [4096, 4096, 64]) == mc.ERR_ADDRESS_OVERLAPPED
        assert sorted(r.addr for r in eng.pxn_engine.regions()) == [a2]
        assert eng.batch_register_memory([a0, a1], [4096]) == mc.ERR_INVALID_ARGUMENT
        assert eng.batch_register_memory([a0, a1], [4096, 0]) == mc.ERR_INVALID_ARGUMENT
        assert eng.batch_register_memory([a0, a1], [4096, 4096]) == 0
        assert eng.register_memory(a0, 4096) == mc.ERR_ADDRESS_OVERLAPPED  # the same range again: Mooncake's -7
        assert eng.register_memory(a0, 4096, "cuda:x") == mc.ERR_INVALID_ARGUMENT
        assert eng.register_memory(a0, 0) == mc.ERR_INVALID_ARGUMENT  # zero length: Mooncake's -1
        assert sorted(r.addr for r in eng.pxn_engine.regions()) == sorted([a0, a1, a2])
        # unregister: every address is tried, the first failure is returned
        assert eng.batch_unregister_memory([a0, 12345, a1]) == mc.ERR_ADDRESS_NOT_REGISTERED
        assert sorted(r.addr for r in eng.pxn_engine.regions()) == [a2]


def test_error_code_mapping():
    from transport.engine import UnknownSession
    from transport.errors import (AddressNotRegistered, FabricClosed, FabricUnavailable, InvalidTransfer, PeerLost,
                                  RegionOverlap, RemoteRejected, TransferError, TransferTimeout)
    cases = [
        (InvalidTransfer("lengths[0] = -1: every length must be >= 0"), mc.ERR_INVALID_ARGUMENT),
        (AddressNotRegistered("dsts[2] = 0x10 + lengths[2] = 1 is outside every region session x registered"),
         mc.ERR_ADDRESS_NOT_REGISTERED),
        (RegionOverlap("register 0x10+4: overlaps a registered region"), mc.ERR_ADDRESS_OVERLAPPED),
        # the class decides, not the words: a plain InvalidTransfer is a bad argument whatever it says
        (InvalidTransfer("dsts[0] is outside every region; it overlaps"), mc.ERR_INVALID_ARGUMENT),
        (UnknownSession("no pxn engine answers"), mc.ERR_METADATA),
        (TransferTimeout("late"), mc.ERR_TIMEOUT),
        (RemoteRejected("refused"), mc.ERR_REMOTE_REJECTED),
        (TransferError("every rail failed", [PeerLost("a"), PeerLost("b")]), mc.ERR_ENDPOINT),
        (PeerLost("gone"), mc.ERR_ENDPOINT),
        (FabricClosed("closed"), mc.ERR_CONTEXT),
        (FabricUnavailable("no device"), mc.ERR_DEVICE_NOT_FOUND),
        (TransferError("other"), mc.ERR_TRANSFER),
        (RuntimeError("bug"), mc.ERR_INTERNAL),
    ]
    codes = [mc.error_code(e) for e, _ in cases]
    assert codes == [c for _, c in cases]
    assert all(c < 0 for c in codes)
    named = {mc.error_name(c) for c in set(codes)}
    assert len(named) == len(set(codes)) and not any(n.startswith("ERR_-") for n in named)


def test_normalize_session_and_hostnames():
    assert mc.normalize_session("[::1]:5000") == "::1:5000"
    assert mc.normalize_session("10.0.0.1:5000") == "10.0.0.1:5000"
    assert hosts.split_hostname("10.0.0.1:17000") == ("10.0.0.1", "17000")
    assert hosts.split_hostname("[fe80::1]:17000") == ("fe80::1", "17000")
    assert hosts.split_hostname("fe80::1") == ("fe80::1", None)
    assert hosts.split_hostname("node-3") == ("node-3", None)


def test_ib_device_forms(tmp_path):
    from integration.sglang import get_ib_devices_for_gpu
    assert get_ib_devices_for_gpu(None, 0) is None
    assert get_ib_devices_for_gpu("mlx5_0,mlx5_1", 3) == "mlx5_0,mlx5_1"
    assert get_ib_devices_for_gpu('{"0": "mlx5_0", "1": "mlx5_1, mlx5_2"}', 1) == "mlx5_1, mlx5_2"
    f = tmp_path / "ib.json"
    f.write_text(json.dumps({"2": "mlx5_4"}))
    assert get_ib_devices_for_gpu(str(f), 2) == "mlx5_4"
    with pytest.raises(ValueError):
        get_ib_devices_for_gpu(str(f), 0)


def test_device_name_filters_topology():
    from transport.errors import FabricUnavailable
    from transport.topology import Gpu, NicPort, Topology
    topo = Topology([Gpu(0, "0000:01:00.0")],
                    [NicPort("mlx5_0", 1, "0000:02:00.0"), NicPort("mlx5_1", 1, "0000:03:00.0")], {}, [])
    only = hosts.filter_topology(topo, ["mlx5_1"])
    assert [p.key for p in only.usable_ports()] == ["mlx5_1:1"]
    assert [p.key for p in hosts.filter_topology(topo, ["mlx5_0:1", "mlx5_1"]).usable_ports()] == \
        ["mlx5_0:1", "mlx5_1:1"]
    with pytest.raises(FabricUnavailable, match="mlx5_9"):
        hosts.filter_topology(topo, ["mlx5_9"])


def test_pointer_device_of_host_memory():
    x = np.zeros(64, dtype=np.uint8)
    assert mc.pointer_device(x.ctypes.data) == -1


# ============================================================================================================
# the rest of Mooncake's binding: reads, opcodes, notifies, managed buffers, http metadata, stream order
# ============================================================================================================
@pytest.fixture(scope="module")
def landing(mc_sender):
    """A local buffer registered with mc_sender, where reads land."""
    buf = np.zeros(4 * MB, dtype=np.uint8)
    assert mc_sender.register_memory(buf.ctypes.data, buf.nbytes) == 0
    return buf


def test_mooncake_reads_and_opcodes(mc_sender, mc_peer, src, landing, rng):
    """Write distinct random pieces to the peer, read them back through every read call, byte-exact; the
    rest of the landing buffer keeps its poison."""
    lengths = np.concatenate([[1, 63, 4097], rng.integers(1, 2000, 60), [200000]])
    src_offs = disjoint_offsets(rng, lengths, SRC_BYTES)
    peer_offs = disjoint_offsets(rng, lengths, PEER_BYTES)
    back_offs = disjoint_offsets(rng, lengths, landing.nbytes)
    peers = _addrs(mc_peer.base, peer_offs)
    assert mc_sender.batch_transfer_sync_write(mc_peer.session, _addrs(src.ctypes.data, src_offs), peers,
                                               lengths.tolist()) == 0
    expected = np.full(landing.nbytes, 0xC3, dtype=np.uint8)
    for s_, b_, n in zip(src_offs, back_offs, lengths):
        expected[b_:b_ + n] = src[s_:s_ + n]
    backs = _addrs(landing.ctypes.data, back_offs)
    R, W = mc.TransferOpcode.Read, mc.TransferOpcode.Write

    def poisoned():
        landing[:] = 0xC3
        return True

    for call in (lambda: mc_sender.batch_transfer_sync_read(mc_peer.session, backs, peers, lengths.tolist()),
                 lambda: mc_sender.batch_transfer_sync(mc_peer.session, backs, peers, lengths.tolist(), R),
                 lambda: mc_sender.get_batch_transfer_status(
                     [mc_sender.batch_transfer_async_read(mc_peer.session, backs, peers, lengths.tolist())]),
                 lambda: mc_sender.get_batch_transfer_status(
                     [mc_sender.batch_transfer_async(mc_peer.session, backs, peers, lengths.tolist(), R)])):
        assert poisoned() and call() == 0
        assert np.array_equal(landing, expected)
    assert poisoned() and all(mc_sender.transfer_sync_read(mc_peer.session, b_, p_, int(n)) == 0
                              for b_, p_, n in zip(backs[:5], peers[:5], lengths[:5]))
    assert np.array_equal(landing[back_offs[0]:back_offs[0] + 1], expected[back_offs[0]:back_offs[0] + 1])
    # a WRITE through the opcode form lands like batch_transfer_sync_write
    assert mc_sender.transfer_sync(mc_peer.session, src.ctypes.data, mc_peer.base, 63, W) == 0
    assert mc_sender.transfer_sync(mc_peer.session, src.ctypes.data, mc_peer.base, 63, 7) == \
        mc.ERR_INVALID_ARGUMENT


def test_mooncake_read_of_bad_addresses_writes_nothing(mc_sender, mc_peer, landing, caplog):
    landing[:] = 0xC3
    b = landing.ctypes.data
    with caplog.at_level(logging.WARNING, logger="integration.mooncake"):
        # a source past the end of the peer's region: refused by the peer, nothing written here
        assert mc_sender.batch_transfer_sync_read(mc_peer.session, [b, b + 100], [mc_peer.base,
                                                  mc_peer.base + mc_peer.size - 5], [64, 6]) == \
            mc.ERR_ADDRESS_NOT_REGISTERED
    assert "remote_srcs[1]" in caplog.text and len([r for r in caplog.records if "remote_srcs" in r.message]) == 1
    # a local destination outside registered memory: refused here
    assert mc_sender.transfer_sync_read(mc_peer.session, b + landing.nbytes - 1, mc_peer.base, 2) == \
        mc.ERR_ADDRESS_NOT_REGISTERED
    assert mc_sender.batch_transfer_async_read(mc_peer.session, [b + landing.nbytes], [mc_peer.base], [1]) == 0
    # refused by the peer after submission: the batch fails at its status
    bid = mc_sender.batch_transfer_async_read(mc_peer.session, [b], [mc_peer.base - 64], [8])
    assert bid >= 1 and mc_sender.get_batch_transfer_status([bid]) == mc.ERR_ADDRESS_NOT_REGISTERED
    assert mc_sender.transfer_sync_read("127.0.0.1:1", b, 0, 8) == mc.ERR_METADATA
    assert (landing == 0xC3).all()


@pytest.fixture
def pair():
    """Two shim engines in this process, each with a 64 KiB registered buffer."""
    engines, bufs = [], []
    for _ in range(2):
        e = MooncakeEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = np.zeros(64 << 10, dtype=np.uint8)
        assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
        engines.append(e)
        bufs.append(buf)
    yield engines, bufs
    for e in engines:
        e.close()


def test_notifies(pair):
    (a, b), (abuf, bbuf) = pair
    abuf[:8] = np.arange(1, 9, dtype=np.uint8)
    n = mc.TransferNotify("kv", "req-17 done")
    assert a.transfer_sync(b.get_session_id(), abuf.ctypes.data, bbuf.ctypes.data, 8, mc.TransferOpcode.Write,
                           n) == 0
    assert bytes(bbuf[:8]) == bytes(range(1, 9))
    assert a.batch_transfer_sync(b.get_session_id(), [abuf.ctypes.data], [bbuf.ctypes.data + 8], [4],
                                 mc.TransferOpcode.Read, mc.TransferNotify("r", "2")) == 0
    got = b.get_notifies()
    assert [(x.name, x.msg) for x in got] == [("kv", "req-17 done"), ("r", "2")]
    assert b.get_notifies() == [] and a.get_notifies() == []


def test_managed_buffers_bytes_and_first_buffer_address(pair):
    (a, b), (abuf, bbuf) = pair
    assert a.get_first_buffer_address(a.get_session_id()) == abuf.ctypes.data
    assert a.get_first_buffer_address(b.get_session_id()) == bbuf.ctypes.data   # asked of the peer
    assert a.get_first_buffer_address("127.0.0.1:1") == 0
    m = a.allocate_managed_buffer(10000)
    assert m != 0 and m % 4096 == 0
    assert a.get_first_buffer_address(a.get_session_id()) == abuf.ctypes.data   # the first registered stays first
    assert a.write_bytes_to_buffer(m, b"hello pxn", 9) == 0
    assert a.read_bytes_from_buffer(m, 9) == b"hello pxn"
    assert a.transfer_sync_write(b.get_session_id(), m, bbuf.ctypes.data + 100, 9) == 0
    assert bytes(bbuf[100:109]) == b"hello pxn"
    # outside every registered range, or more than given: refused, nothing copied
    assert a.write_bytes_to_buffer(m + 9995, b"0123456789", 10) == mc.ERR_ADDRESS_NOT_REGISTERED
    assert a.write_bytes_to_buffer(m, b"ab", 3) == mc.ERR_INVALID_ARGUMENT
    assert a.read_bytes_from_buffer(m + 9999, 2) == b""
    assert a.read_bytes_from_buffer(m + 9990, 10) == bytes(10)
    assert a.free_managed_buffer(m, 10000) == 0
    assert a.free_managed_buffer(m, 10000) == mc.ERR_INVALID_ARGUMENT
    assert a.write_bytes_to_buffer(m, b"x", 1) == mc.ERR_ADDRESS_NOT_REGISTERED   # freed: no longer registered
    assert a.allocate_managed_buffer(0) == 0
    assert a.warmup_efa_segment(b.get_session_id()) == 0 and a.get_engine_ptr() == 0


def test_http_metadata_mode_with_pxns_server():
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    from integration.metadata_server import MetadataServer
    with MetadataServer("127.0.0.1", 0) as srv:
        a, b = MooncakeEngine(), MooncakeEngine()
        try:
            assert a.initialize("127.0.0.1:12347", srv.url, "tcp", "") == 0
            assert b.initialize_ext("127.0.0.1:12345", srv.url[len("http://"):], "tcp", "", "http") == 0
            assert srv.keys() == ["pxn/segment/127.0.0.1:12345", "pxn/segment/127.0.0.1:12347"]
            abuf, bbuf = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
            abuf[:] = np.arange(4096) % 251
            assert a.register_memory(abuf.ctypes.data, 4096) == 0 and b.register_memory(bbuf.ctypes.data, 4096) == 0
            # peers are named by segment name; addresses come from the peer as in Mooncake's tests
            dst = a.get_first_buffer_address("127.0.0.1:12345")
            assert dst == bbuf.ctypes.data and a.get_first_buffer_address("127.0.0.1:12347") == abuf.ctypes.data
            assert a.transfer_sync_write("127.0.0.1:12345", abuf.ctypes.data, dst, 4096) == 0
            assert np.array_equal(abuf, bbuf)
            abuf[:] = 0
            assert a.transfer_sync_read("127.0.0.1:12345", abuf.ctypes.data, dst + 1, 100) == 0
            assert np.array_equal(abuf[:100], bbuf[1:101]) and not abuf[100:].any()
            assert a.send_probe("127.0.0.1:12345") == 0
            # a name nobody published: Mooncake's answers
            assert a.send_probe("unreachable_peer:9") == mc.ERR_METADATA
            assert a.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]) == 0
            assert a.transfer_submit_write("unreachable_peer:9", 0, 0, 16) == 0
            assert a.transfer_sync_write("unreachable_peer:9", abuf.ctypes.data, 0, 16) == mc.ERR_METADATA
        finally:
            a.close()
            b.close()
        assert srv.keys() == []   # close() removes the engine's entry
        # changes need the secret (the per-user one on loopback, as the engines used above)
        with pytest.raises(HTTPError) as e:
            urlopen(Request(f"{srv.url}?key=k", data=b"{}", method="PUT"), timeout=5)
        assert e.value.code == 403
    with MetadataServer("127.0.0.1", 0, insecure=True) as srv:
        # told to be insecure, the server speaks Mooncake's open protocol
        with pytest.raises(HTTPError) as e:
            urlopen(f"http://127.0.0.1:{srv.port}/metadata", timeout=5)
        assert e.value.code == 400
        put = Request(f"{srv.url}?key=mooncake/rpc_meta/x", data=b"{}", method="PUT")
        assert urlopen(put, timeout=5).status == 200
        with pytest.raises(HTTPError) as e:
            urlopen(Request(f"{srv.url}?key=mooncake/rpc_meta/x", data=b"{}", method="PUT"), timeout=5)
        assert e.value.code == 400
        assert urlopen(f"{srv.url}?key=mooncake/rpc_meta/x", timeout=5).read() == b"{}"
        assert urlopen(Request(f"{srv.url}?key=mooncake/rpc_meta/x", method="DELETE"), timeout=5).status == 200
        with pytest.raises(HTTPError) as e:
            urlopen(f"{srv.url}?key=mooncake/rpc_meta/x", timeout=5)
        assert e.value.code == 404
    with MooncakeEngine() as c:   # the server is gone: initialize says so
        assert c.initialize("127.0.0.1:1", srv.url, "tcp", "") == mc.ERR_METADATA
        assert c.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == mc.ERR_NOT_IMPLEMENTED


def test_rpc_port_range(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        free = busy + 1 if busy < 65535 else busy - 1
        monkeypatch.setenv("MC_MIN_RPC_PORT", str(min(busy, free)))
        monkeypatch.setenv("MC_MAX_RPC_PORT", str(max(busy, free)))
        with MooncakeEngine() as e:
            ret = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            assert ret == 0 and e.get_rpc_port() == free   # the one port of the range that is free
    monkeypatch.setenv("MC_MIN_RPC_PORT", "99999")
    with MooncakeEngine() as e:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == mc.ERR_INVALID_ARGUMENT


def test_on_cuda_calls_run_in_stream_order(pair):
    """A stand-in stream: the transfer starts only when the stream reaches the host function, and the host
    function returns (letting the stream's later work run) only once the bytes are placed."""
    (a, b), (abuf, bbuf) = pair
    queued = []
    a._launch_host_func = lambda stream, fn: queued.append((stream, fn))
    abuf[:16] = 7
    assert a.batch_transfer_write_on_cuda(b.get_session_id(), [abuf.ctypes.data], [bbuf.ctypes.data], [16],
                                          0x1234) is None
    time.sleep(0.2)  # the scenario: a window in which a transfer started before the stream says would land
    assert len(queued) == 1 and queued[0][0] == 0x1234 and not bbuf[:16].any()   # not before the stream says
    queued[0][1]()   # the stream reaches the host function: it returns once the write is done
    assert (bbuf[:16] == 7).all()
    bbuf[32:40] = 9
    a.transfer_read_on_cuda(b.get_session_id(), abuf.ctypes.data + 100, bbuf.ctypes.data + 32, 8, 0)
    queued[1][1]()
    assert (abuf[100:108] == 9).all()
    with pytest.raises(RuntimeError, match="refused"):   # as Mooncake: an unknown peer raises at the call
        a.transfer_write_on_cuda("127.0.0.1:1", abuf.ctypes.data, 0, 8)
    with pytest.raises(RuntimeError, match="refused"):
        a.batch_transfer_read_on_cuda(b.get_session_id(), [1, 2], [3], [4])
    a._launch_host_func = None
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="stream"):
            a.transfer_write_on_cuda(b.get_session_id(), abuf.ctypes.data, bbuf.ctypes.data, 8)


@pytest.mark.gpu
def test_on_cuda_waits_for_earlier_stream_work_and_holds_later_work(pair):
    """On a real stream: a write queued behind a ~0.5 s GPU sleep starts only after it; an event recorded after
    the write completes only once the bytes are at the peer."""
    import torch
    (a, b), (abuf, bbuf) = pair
    abuf[:64] = 3
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(1e9))      # ~0.5 s of GPU cycles ahead of the transfer
    a.transfer_write_on_cuda(b.get_session_id(), abuf.ctypes.data, bbuf.ctypes.data, 64, stream.cuda_stream)
    after = torch.cuda.Event()
    after.record(stream)
    time.sleep(0.05)  # the scenario: 50 ms into the GPU's ~0.5 s sleep, the transfer must not have run
    assert not bbuf[:64].any()           # the stream has not reached the transfer yet
    after.synchronize()
    assert (bbuf[:64] == 3).all()        # work after the transfer ran only once the bytes were placed
    assert a.stats()["cuda_transfers_failed"] == 0


# ============================================================================================================
# the sglang plugin hook, against a stand-in of sglang's HookRegistry
# ============================================================================================================
def _fake_module(name: str, monkeypatch, **attrs):
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


@pytest.mark.parametrize("which,mooncake", [(0, False), (1, False), (0, True)])
def test_plugin_hooks_the_kv_managers_and_guards_the_shared_engine(monkeypatch, which, mooncake):
    """The KV managers' init_engine is always replaced; sglang's shared engine class only when Mooncake is not
    installed (then by a stand-in that names pxn and the feature using it)."""
    from integration import sglang as sgl
    calls = []

    class HookType:
        REPLACE = "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type):
            calls.append((target, hook, hook_type))

    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        _fake_module(name, monkeypatch)
    _fake_module("sglang.srt.plugins.hook_registry", monkeypatch, HookRegistry=HookRegistry, HookType=HookType)
    target = sgl.SGLANG_TARGETS[which]
    parts = target.rsplit(".", 1)[0].split(".")
    for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules or not name.startswith("sglang.srt.plugins"):
            _fake_module(name, monkeypatch)
    if which == 1:  # the older location only: the new one must not be found
        monkeypatch.delitem(sys.modules, sgl.SGLANG_TARGETS[0].rsplit(".", 1)[0], raising=False)
    if mooncake:
        _fake_module("mooncake", monkeypatch)
        _fake_module("mooncake.engine", monkeypatch, TransferEngine=object)
    else:
        monkeypatch.setitem(sys.modules, "mooncake", None)
    assert sgl.register_sglang_plugin() == sgl.KV_MANAGER_TARGET
    expected = [(sgl.KV_MANAGER_TARGET, sgl._kv_manager_init_engine, "replace")]
    if not mooncake:
        expected.append((target, sgl.MooncakeEngineUnavailable, "replace"))
    assert calls == expected
    monkeypatch.setenv("PXN_SGLANG_PLUGIN", "0")
    assert sgl.register_sglang_plugin() is None
    assert len(calls) == len(expected)


def test_stand_in_names_pxn_and_the_feature():
    from integration.sglang import MooncakeEngineUnavailable, PxnFeatureUnavailable
    stand_in = MooncakeEngineUnavailable("127.0.0.1", gpu_id=0, ib_device=None)   # constructing it is harmless
    g = {"__name__": "sglang.srt.elastic_ep.expert_backup_client", "eng": stand_in}
    with pytest.raises(PxnFeatureUnavailable, match=r"elastic EP expert backup needs Mooncake.*pxn replaces only"):
        exec("eng.engine.register_memory(1, 2)", g)
    g["__name__"] = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
    with pytest.raises(PxnFeatureUnavailable, match=r"HiCache's Mooncake store.*get_ib_device"):
        exec("eng.get_ib_device()", g)


# ============================================================================================================
# the sglang plugin against sglang's real hook registry (sglang's source on PYTHONPATH; skipped without it)
# ============================================================================================================
_SGLANG_SCRIPT = r'''
import json, os, sys, types
mode = sys.argv[1]
if mode == "without":
    sys.modules["mooncake"] = None          # Mooncake not installed: "import mooncake.engine" fails
else:                                        # a stand-in Mooncake wheel, recording what uses it
    mc = types.ModuleType("mooncake"); mce = types.ModuleType("mooncake.engine")
    class TransferEngine:
        def initialize(self, *a): return 0
        def get_rpc_port(self): return 4242
        def register_memory(self, ptr, n): return 0
        def get_engine(self): return InnerTransferEngine()
    class InnerTransferEngine:
        pass
    mce.TransferEngine = TransferEngine; mc.engine = mce
    sys.modules["mooncake"] = mc; sys.modules["mooncake.engine"] = mce
from sglang.srt.plugins.hook_registry import HookRegistry
from integration.sglang import (KV_MANAGER_TARGET, MooncakeEngineUnavailable, PxnFeatureUnavailable,
                                PxnMooncakeTransferEngine, register_sglang_plugin)
HookRegistry.reset()
assert register_sglang_plugin() == KV_MANAGER_TARGET
HookRegistry.apply_hooks()
out = {}
# sglang builds its one shared engine at start-up (bootstrap.maybe_init_shared_mooncake_transfer_engine)
import sglang.srt.distributed.device_communicators.mooncake_transfer_engine as mte
shared = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
out["shared"] = type(shared).__name__
out["shared_inner"] = type(getattr(shared, "__dict__", {}).get("engine")).__name__
# the KV managers' engine, through the real MooncakeKVManager.init_engine (hooked)
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
mgr = types.SimpleNamespace(kv_args=types.SimpleNamespace(gpu_id=0, ib_device=None))
MooncakeKVManager.init_engine(mgr)
out["kv"] = type(mgr.engine).__name__
out["kv_fabric"] = mgr.engine.get_engine().fabric_name
mgr2 = types.SimpleNamespace(kv_args=mgr.kv_args)
MooncakeKVManager.init_engine(mgr2)
out["kv_shared_between_managers"] = mgr2.engine is mgr.engine
# expert backup, through sglang's own code (ExpertBackupClient.start_transfer_client)
import torch
from sglang.srt.elastic_ep.expert_backup_client import ExpertBackupClient
client = types.SimpleNamespace(_get_model=lambda: torch.nn.Linear(2, 2), use_backup=True)
try:
    ExpertBackupClient.start_transfer_client(client)
    out["expert_backup"] = "ok:" + type(client.transfer_engine.engine).__name__
except PxnFeatureUnavailable as e:
    out["expert_backup"] = "error:" + str(e)
except Exception as e:
    out["expert_backup"] = "other:" + type(e).__name__ + ": " + str(e)
# HiCache's Mooncake store reuse check (mooncake_store.py), run as code of that module
code = "eng = get_mooncake_transfer_engine()\nib = eng.get_ib_device()\nte = eng.get_engine()"
from sglang.srt.distributed.parallel_state import get_mooncake_transfer_engine
g = {"__name__": "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store",
     "get_mooncake_transfer_engine": get_mooncake_transfer_engine}
try:
    exec(compile(code, "mooncake_store.py", "exec"), g)
    out["hicache"] = "ok:" + type(g["te"]).__name__
except PxnFeatureUnavailable as e:
    out["hicache"] = "error:" + str(e)
mgr.engine.close()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
'''


def _sglang_available() -> str:
    import importlib.util
    try:
        if importlib.util.find_spec("sglang") is None:
            return "sglang is not importable (put sglang 0.5.23's wheel source on PYTHONPATH)"
    except (ImportError, ValueError) as e:
        return f"sglang is not importable: {e}"
    r = subprocess.run([sys.executable, "-c", "import sglang.srt.disaggregation.mooncake.conn, "
                        "sglang.srt.elastic_ep.expert_backup_client"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    return "" if r.returncode == 0 else \
        f"sglang's disaggregation code does not import here: {r.stdout.strip().splitlines()[-1:]}"


@pytest.mark.parametrize("mooncake", ["with", "without"])
def test_sglang_plugin_replaces_only_the_kv_managers_engine(mooncake):
    """sglang's own HookRegistry, MooncakeKVManager.init_engine, shared-engine builder and expert-backup client:
    the KV managers get pxn; the shared engine stays Mooncake's when Mooncake is installed; without Mooncake the
    other features get an error naming pxn and themselves (not a pybind cast failure)."""
    why = _sglang_available()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               MOONCAKE_PROTOCOL="rdma")  # sglang's default: verbs where a device is usable, else tcp
    r = subprocess.run([sys.executable, "-c", _SGLANG_SCRIPT, mooncake], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300, env=env)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, r.stdout[-4000:]
    out = json.loads(line[-1][len("RESULT "):])
    assert out["kv"] == "PxnMooncakeTransferEngine" and out["kv_shared_between_managers"], out
    from transport.engine import TransferEngine as PxnEngine
    assert out["kv_fabric"] == PxnEngine._pick_fabric("auto")  # "rdma": verbs where a device is usable (softverbs)
    if mooncake == "with":
        assert out["shared"] == "MooncakeTransferEngine" and out["shared_inner"] == "TransferEngine", out
        assert out["expert_backup"] == "ok:TransferEngine", out   # Mooncake's engine, not pxn's
        assert out["hicache"] == "ok:InnerTransferEngine", out
    else:
        assert out["shared"] == "MooncakeEngineUnavailable", out
        for key, feature in (("expert_backup", "elastic EP expert backup"), ("hicache", "HiCache's Mooncake store")):
            assert out[key].startswith("error:") and feature in out[key] and "pxn" in out[key], out
