"""The whole engine over the verbs fabric: two processes, host memory, on softverbs where no RDMA NIC exists.

softverbs models pyverbs v59 and RC semantics (the target's NIC checks rkeys and bounds, a refused write moves
both QPs to the error state, a lost link exceeds the retry count). conftest puts it on the path with a GID-less
port listed first. Every case writes fresh random data into a poisoned peer buffer and compares the peer's whole
buffer (guards included) with the expected image. GPU memory cannot be registered on the model (dma-buf is not
modelled); those cases are the GPU suite's.
"""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine_helpers import Expected, EnginePeer, disjoint_offsets, write_and_check
from fabric_helpers import verbs_unavailable
from wait_helpers import wait_for
from transport import RemoteRejected, TransferEngine, TransferError
from transport.errors import FabricUnavailable

MB = 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
PEER_BYTES = 96 * MB
SECRET = "verbs-engine-test-secret"

_WHY = verbs_unavailable()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"verbs: {_WHY}")


@pytest.fixture(scope="module")
def peer():
    p = EnginePeer(PEER_BYTES, fabric="verbs", rails=2, secret=SECRET)
    yield p
    p.close()


@pytest.fixture(scope="module")
def sender():
    eng = TransferEngine(fabric="verbs", rails=2, secret=SECRET)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def src(sender):
    from suite_env import SEED
    buf = np.frombuffer(np.random.default_rng([SEED, 33]).bytes(PEER_BYTES), dtype=np.uint8).copy()
    sender.register(buf)
    return buf


@pytest.fixture
def rng(seed, request):
    return np.random.default_rng([seed, abs(hash(request.node.name)) % (1 << 31)])


def _case(sender, peer, src, rng, lengths):
    lengths = np.asarray(lengths, dtype=np.int64)
    write_and_check(sender, peer, src.ctypes.data, src, disjoint_offsets(rng, lengths, src.size),
                    disjoint_offsets(rng, lengths, peer.size), lengths)


def test_fabric_drives_a_port_with_a_gid(sender):
    """The first device listed has no GID: every rail runs on a port that has one, on its best GID."""
    for fab in sender.fabrics:
        assert fab.gid != "0000:0000:0000:0000:0000:0000:0000:0000" and fab.device != "mlx5_0", fab.port_choice


@pytest.mark.parametrize("shape", ["aux11", "odd_small", "4096x64B", "1024x64KB", "mix", "large"])
def test_shapes_byte_exact(sender, peer, src, rng, shape):
    """Coalesced chunks (small pieces: aux11, 1 B / 63 B / unaligned, 4096 x 64 B), direct chains (64 KB and
    multi-MB pieces, striped over both rails) and a mix of both: every byte where it belongs, nothing else."""
    lengths = {"aux11": AUX,
               "odd_small": np.concatenate([[1, 63, 1, 63, 4097], rng.integers(1, 3000, 200)]),
               "4096x64B": [64] * 4096,
               "1024x64KB": [64 << 10] * 1024,
               "mix": np.concatenate([rng.integers(1, 8193, 500), [2 * MB + 3] * 4, [1, 63]]),
               "large": [2359296] * 12 + [17 * MB + 5]}[shape]
    _case(sender, peer, src, rng, lengths)


def test_every_wire_write_is_one_work_request_per_chunk(sender, peer, src, rng):
    """aux11 goes as one WRITE_WITH_IMM in one post_send with one signalled work request; 1024 x 64 KB as one chain
    per rail, each with one signalled work request."""
    def wire():
        w = [r["wire"] for r in sender.stats()["rails"]]
        return {k: sum(x[k] for x in w) for k in w[0]}

    _case(sender, peer, src, rng, AUX)  # connected
    before = wire()
    _case(sender, peer, src, rng, AUX)
    d = {k: v - before[k] for k, v in wire().items()}
    assert d == {"post_send": 1, "work_requests": 1, "signaled": 1, "inline": 0, "with_imm": 1}, d
    before = wire()
    _case(sender, peer, src, rng, [64 << 10] * 1024)
    d = {k: v - before[k] for k, v in wire().items()}
    assert d["work_requests"] == 1024 and d["post_send"] == d["signaled"] <= 2 and d["with_imm"] == 0, d


def test_stray_pieces_refused_by_the_receiver_and_by_the_nic(sender, peer, src):
    """The peer deregistered a region the sender still believes in: small pieces into it are refused by the
    receiver's validation of the chunk, a large one by the target NIC's rkey check (IBV_WC_REM_ACCESS_ERR, which
    also fails the rail's QP pair); nothing is written, and the next batch reconnects and lands byte-exact."""
    peer.poison()
    extra = peer.call("register_extra", size=1 * MB)
    b = src.ctypes.data
    sender.batch_write(peer.session, [b], [extra], [64])  # the sender learns the region
    peer.call("poison")
    clean = peer.call("extra_digest", addr=extra)
    peer.call("deregister", addr=extra)
    with pytest.raises(RemoteRejected, match="outside every region"):
        sender.batch_write(peer.session, [b + i * 128 for i in range(100)], [extra + i * 64 for i in range(100)],
                           [64] * 100)
    with pytest.raises((RemoteRejected, TransferError)):
        sender.batch_write(peer.session, [b], [extra], [512 * 1024])
    assert peer.call("extra_digest", addr=extra) == clean
    peer.check(Expected(peer.size))
    lengths = AUX + [3 * MB] * 3
    exp = Expected(peer.size)
    offs = [i * 4 * MB for i in range(len(lengths))]
    exp.apply(src, offs, offs, lengths)
    sender.batch_write(peer.session, [b + o for o in offs], [peer.base + o for o in offs], lengths)
    peer.check(exp)


def test_failover_between_two_rails(peer, src, rng):
    """Rail 0's QP is failed in the middle of a batch: its unfinished work goes to rail 1 and the batch lands
    byte-exact; the surviving rail keeps working."""
    with TransferEngine(fabric="verbs", rails=2, secret=SECRET) as eng:
        eng.register(src)
        b = src.ctypes.data
        eng.batch_write(peer.session, [b], [peer.base], [64])  # connected
        peer.poison()
        lens = [2359296] * 20 + [4096] * 1000
        s = disjoint_offsets(rng, lens, src.size)
        d = disjoint_offsets(rng, lens, peer.size)
        exp = Expected(peer.size)
        exp.apply(src, s, d, lens)
        before = eng.stats()["rails"][0].get("bytes_posted", 0)
        h = eng.batch_write_async(peer.session, [b + int(x) for x in s], [peer.base + int(x) for x in d], lens,
                                  timeout=60)
        wait_for(lambda: eng.stats()["rails"][0].get("bytes_posted", 0) > before, "rail 0 posting part of the batch",
                 timeout=30, interval=0.0005)
        eng.rail_endpoint(peer.session, 0).abort()
        h.wait(60)
        st = eng.stats()
        assert st["failover"]["rail_failures"] >= 1, st["failover"]
        peer.check(exp)
        peer.poison()
        exp = Expected(peer.size)
        exp.apply(src, [0], [5], [3 * MB])
        eng.batch_write(peer.session, [b], [peer.base + 5], [3 * MB])
        peer.check(exp)


def test_peer_killed_mid_batch_fails_in_bounded_time_then_a_new_peer_works(src, rng):
    """SIGKILL of the receiving process while a batch is in flight: the batch fails with a TransferError (not a
    timeout) within seconds; a new peer on the same session port is written byte-exact."""
    victim = EnginePeer(64 * MB, fabric="verbs", rails=2, secret=SECRET)
    reborn = None
    try:
        with TransferEngine(fabric="verbs", rails=2, secret=SECRET) as eng:
            eng.register(src)
            b = src.ctypes.data
            session, port = victim.session, int(victim.session.rsplit(":", 1)[1])
            eng.batch_write(session, [b], [victim.base], [64])
            lens = [2359296] * 20 + [4096] * 2000
            srcs = [b + (i * 65536) % (src.size - 2359296) for i in range(len(lens))]
            dsts = [victim.base + i * 2359296 for i in range(20)] + [victim.base + 50 * MB + i * 4096
                                                                     for i in range(2000)]
            h = eng.batch_write_async(session, srcs, dsts, lens, timeout=60)
            time.sleep(0.005)  # the scenario: the peer dies a few ms into the batch (its 55 MB are still under way)
            t0 = time.monotonic()
            victim.proc.kill()
            victim.proc.join(10)
            with pytest.raises(TransferError) as info:
                h.wait(60)
            assert time.monotonic() - t0 < 20, "the batch took too long to fail"
            assert "timeout" not in type(info.value).__name__.lower(), info.value
            reborn = EnginePeer(64 * MB, fabric="verbs", rails=2, secret=SECRET, port=port)
            lengths = AUX + [2359296] * 4 + [64] * 500
            write_and_check(eng, reborn, b, src, disjoint_offsets(rng, lengths, 32 * MB),
                            disjoint_offsets(rng, lengths, 60 * MB), lengths)
    finally:
        victim.close()
        if reborn is not None:
            reborn.close()


_FAULT_SCRIPT = textwrap.dedent("""
    import os, sys, time, json
    sys.path[:0] = [os.path.join(sys.argv[1], "tests"), sys.argv[1]]
    import numpy as np
    from engine_helpers import EnginePeer, Expected
    from transport import TransferEngine, TransferError

    def main():
        MB = 1 << 20
        out = {}
        rng = np.random.default_rng(int(sys.argv[2]))
        src = rng.integers(0, 256, 16 * MB, dtype=np.uint8)
        # the peer process runs without the fault: only this process's link drops
        faults = os.environ.pop("SOFTVERBS_FAULTS")
        peer = EnginePeer(32 * MB, fabric="verbs", rails=1, secret="verbs-fault-test-secret")
        os.environ["SOFTVERBS_FAULTS"] = faults
        try:
            with TransferEngine(fabric="verbs", rails=1, secret="verbs-fault-test-secret", timeout=60) as eng:
                eng.register(src)
                b = src.ctypes.data
                lens = [1 * MB] * 6
                exp = Expected(peer.size)
                exp.apply(src, [i * MB for i in range(6)], [i * 2 * MB for i in range(6)], lens)
                t0 = time.monotonic()
                try:
                    eng.batch_write(peer.session, [b + i * MB for i in range(6)],
                                    [peer.base + i * 2 * MB for i in range(6)], lens)
                    out["first"] = "ok"
                except TransferError as e:
                    out["first"] = type(e).__name__ + ": " + str(e)
                out["first_s"] = time.monotonic() - t0
                t0 = time.monotonic()
                try:  # the model's link stays down: the next batch connects anew and fails the same way
                    eng.batch_write(peer.session, [b], [peer.base], [MB])
                    out["second"] = "ok"
                except TransferError as e:
                    out["second"] = type(e).__name__ + ": " + str(e)
                out["second_s"] = time.monotonic() - t0
                out["stats"] = eng.stats()["failover"]
        finally:
            peer.close()
        print(json.dumps(out))

    if __name__ == "__main__":
        main()
""")


def _run_fault(tmp_path, faults: str, seed: int) -> dict:
    import json
    script = tmp_path / "fault.py"
    script.write_text(_FAULT_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SOFTVERBS_FAULTS=faults)
    p = subprocess.run([sys.executable, str(script), root, str(seed)], env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_link_lost_mid_batch_fails_it_within_the_retry_time(tmp_path, seed):
    """SOFTVERBS_FAULTS=drop_after_writes=3: this process's link drops every packet after three RDMA writes, in
    the middle of a six-write batch. The QP exceeds its retry count (4.096 us x 2^timeout x (retry_cnt + 1)) and
    the batch fails with PeerGone (a TransferError) naming it, within seconds, not at the batch timeout (60 s).
    The model's link stays down for the process, so the next batch, on a new connection, fails the same way and
    as fast."""
    out = _run_fault(tmp_path, "drop_after_writes=3", seed)
    for k in ("first", "second"):
        assert out[k].startswith("PeerGone") and "IBV_WC_RETRY_EXC_ERR" in out[k], out
        assert out[f"{k}_s"] < 15, out


def test_slow_completions_cause_no_spurious_timeout(tmp_path, seed):
    """SOFTVERBS_FAULTS=completion_delay_ms=200: every send completion of this process arrives 200 ms late; the
    batch still succeeds, with no rail failure."""
    out = _run_fault(tmp_path, "completion_delay_ms=200", seed)
    assert out["first"] == "ok" and out["stats"]["rail_failures"] == 0, out


def test_gid_index_override_and_refusals(monkeypatch):
    """PXN_GID_INDEX picks the GID entry; an empty entry or a GID-less port is refused naming device, port and
    index; a malformed value names the variable."""
    from transport.fabric.verbs import VerbsFabric
    monkeypatch.setenv("PXN_GID_INDEX", "0")
    with VerbsFabric(device="mlx5_1") as fab:
        assert fab.gid_index == 0
    monkeypatch.setenv("PXN_GID_INDEX", "7")
    with pytest.raises(FabricUnavailable, match=r"mlx5_1 port 1 GID index 7 .* is empty"):
        VerbsFabric(device="mlx5_1")
    monkeypatch.setenv("PXN_GID_INDEX", "one")
    with pytest.raises(ValueError, match="PXN_GID_INDEX='one'"):
        VerbsFabric(device="mlx5_1")
    monkeypatch.delenv("PXN_GID_INDEX")
    with pytest.raises(FabricUnavailable, match=r"mlx5_0 port 1 is a RoCE port with no GID"):
        VerbsFabric(device="mlx5_0")
    with VerbsFabric() as fab:  # the GID-less port listed first is skipped
        assert fab.device == "mlx5_1" and fab.gid_index == 1  # RoCE v2 preferred over v1 (index 0)


def test_qp_transition_errors_name_device_port_gid_and_state():
    """A QP that cannot reach RTR (here: a source GID index that is empty, as if the port lost its address after
    the fabric chose it) fails the connect with an error naming device, port, GID index and the state."""
    from transport.errors import PeerLost
    from transport.fabric.verbs import VerbsFabric
    with VerbsFabric(device="mlx5_1") as a, VerbsFabric(device="mlx5_1") as b:
        a.gid_index = 9
        with pytest.raises(PeerLost, match=r"mlx5_1 port 1 GID index 9 .*could not go to RTR"):
            a.connect(b.descriptor())


def test_dmabuf_module_path_is_pyverbs_v59s():
    """The dma-buf MR class is imported from where pyverbs keeps it since rdma-core v55, and registration checks the
    fd first, as the kernel's dma_buf_get does: fd -1 is EBADF (NCCL's probe relies on that)."""
    import errno
    import importlib
    from transport.fabric.verbs import DMABUF_MODULE
    mod = importlib.import_module(DMABUF_MODULE)
    assert DMABUF_MODULE == "pyverbs.providers.mlx5.mlx5dv_dmabuf" and hasattr(mod, "Mlx5DmaBufMR")
    from transport.fabric.verbs_ports import import_pyverbs
    v = import_pyverbs()
    ctx = v["Context"](name="mlx5_1")
    pd = v["PD"](ctx)
    try:
        with pytest.raises(Exception) as err:
            mod.Mlx5DmaBufMR(pd, offset=0, length=4096, iova=0, fd=-1, access=0)
        assert getattr(err.value, "error_code", None) == errno.EBADF, repr(err.value)
    finally:
        pd.close()
        ctx.close()


def test_threads_do_not_grow_with_endpoints():
    """A verbs fabric runs three threads of its own (accept, progress, one watcher of every liveness channel),
    however many peers it is connected to; each connection is usable both ways."""
    import threading
    from transport.fabric.verbs import VerbsFabric

    def mine(fab):
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("pxn-verbs") and t.is_alive()
                      and getattr(t, "_target", None) is not None and getattr(t._target, "__self__", None) is fab)

    with VerbsFabric(secret=SECRET) as hub:
        peers = [VerbsFabric(secret=SECRET) for _ in range(6)]
        try:
            for p in peers:
                hub.connect(p.descriptor())
            assert mine(hub) == ["pxn-verbs-accept", "pxn-verbs-progress", "pxn-verbs-watch"], mine(hub)
            assert all(p.endpoint(hub.local_id).alive for p in peers)
        finally:
            for p in peers:
                p.close()
        wait_for(lambda: not any(hub.endpoint(p.local_id).alive for p in peers), "the closed peers reading dead",
                 timeout=10, interval=0.05)


def test_guarded_listener_takes_only_announced_rail_ids():
    """With ``guard_claims`` (as an engine makes its rails) a connection is taken only for a rail id an
    authenticated control hello announced (``expect_peer``), once; others are refused and make no QP."""
    from transport.errors import PeerLost, UnknownPeer
    from transport.fabric.verbs import VerbsFabric
    with VerbsFabric(secret=SECRET, guard_claims=True) as target, VerbsFabric(secret=SECRET) as sender:
        with pytest.raises(PeerLost, match="not announced"):
            sender.connect(target.descriptor())
        with pytest.raises(UnknownPeer):
            target.endpoint(sender.local_id)
        target.expect_peer(sender.local_id, ttl=10)
        ep = sender.connect(target.descriptor())
        assert ep.alive and target.endpoint(sender.local_id).alive



def test_a_failed_qp_hands_over_its_completions_before_its_endpoint_reads_dead(seed, monkeypatch):
    """A write whose local key is bad when it executes (IBV_WC_LOC_PROT_ERR; the fabric's own post-time check is
    bypassed here to get one) fails its QP. The failed completion reaches the completion handler, with the
    write's own status, while the endpoint still reads alive, and from that moment the endpoint is done with:
    nothing more can be posted on it, and a ``connect`` builds a new QP pair instead of returning it. The engine
    relies on this order: its watchdog fails a rail whose endpoint reads dead, and would otherwise fail the
    batch as a bare "endpoint died" before the completion naming the write's status is handled. Fails when
    the endpoint reads dead before its completions go, or is handed out or posted to again while they do."""
    import threading
    from transport.errors import PeerLost, RegionError
    from transport.fabric.base import WriteRequest
    from transport.fabric import verbs as verbs_module
    from transport.fabric.verbs import VerbsFabric
    rng = np.random.default_rng([seed, 77])
    src = rng.integers(0, 256, 8192 + int(rng.integers(1, 4096)), dtype=np.uint8)
    dst = np.zeros(src.size, dtype=np.uint8)
    got, at_handover, release, seen = [], [], threading.Event(), threading.Event()
    with VerbsFabric(secret=SECRET) as a, VerbsFabric(secret=SECRET) as b:
        smr = a.register(src.ctypes.data, src.nbytes)
        dmr = b.register(dst.ctypes.data, dst.nbytes)
        old = a.connect(b.descriptor())

        def handler(comps):
            for c in comps:
                got.append(c)
                if c.error is not None:
                    at_handover.append(old.alive)
                    seen.set()
                    release.wait(30)  # the failure stays in hand while the main thread looks at the endpoint

        a.set_completion_handler(handler)
        with monkeypatch.context() as m:
            m.setattr(verbs_module, "check_request", lambda r, local_region: None)
            a.post_writes(old, [WriteRequest(src.ctypes.data, src.nbytes, dst.ctypes.data, dmr.rkey,
                                             smr.lkey ^ 0x5A5A, wr_id=41)])
        try:
            assert seen.wait(30), got
            assert at_handover == [True], "the endpoint read dead before its failed completion was handed over"
            with pytest.raises(PeerLost, match="died while posting"):
                a.post_writes(old, [WriteRequest(src.ctypes.data, 8, dst.ctypes.data, dmr.rkey, smr.lkey,
                                                 wr_id=42)])
            new = a.connect(b.descriptor())
        finally:
            release.set()
        assert [c.wr_id for c in got] == [41] and isinstance(got[0].error, RegionError), got
        assert "IBV_WC_LOC_PROT_ERR" in str(got[0].error), got
        assert new is not old and new.alive and not old.alive, (new, old)
        assert not dst.any(), "the refused write placed bytes"
        a.post_writes(new, [WriteRequest(src.ctypes.data, src.nbytes, dst.ctypes.data, dmr.rkey, smr.lkey,
                                         wr_id=43)])
        wait_for(lambda: len(got) >= 2, "the second write's completion", timeout=30, interval=0.01)
        assert [c.wr_id for c in got[1:]] == [43] and got[1].error is None, got
        assert bytes(dst) == bytes(src)
