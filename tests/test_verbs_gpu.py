"""KV cache in GPU memory over the verbs fabric, end to end, on softverbs' GPUDirect RDMA model (skipped without
CUDA or without verbs).

Two processes on one GPU: the sender's sources and the peer's destinations are CUDA memory, registered by dma-buf.
Small pieces go through relay chunks (a gather kernel fills a slot in GPU memory, the NIC reads it, the chunk lands
in the receiver's GPU landing slot, a scatter kernel places every piece); large pieces go direct. Each case runs in
the model's two modes for incoming writes into GPU memory:

* ``eager`` (``SOFTVERBS_GDR_FLUSH=eager``): writes are visible at once; pxn flushes its own way (``gdr_flush``
  "auto": ``cuFlushGPUDirectRDMAWrites`` where the GPU offers it, else an RDMA READ);
* ``strict``: writes stay invisible until the same NIC reads that GPU's memory, so pxn must flush with an RDMA
  READ (``gdr_flush="read"``) before the receiver reads a landed chunk, and the peer's application calls
  ``flush_gpu_writes`` before it reads the pieces written straight to their place.

By default the model's NIC reads a GPU source inside ``post_send``: a write posted before the kernel that fills its
slot has finished sends stale bytes. Every case compares the peer's whole buffer, guards included, with the
expected image (fresh random data, a distinct value in every piece).
"""
import os

import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets, write_and_check
from fabric_helpers import verbs_unavailable
from wait_helpers import wait_for
from transport import TransferEngine, TransferError

MB = 1 << 20
AUX = [64, 64, 64, 64, 512, 512, 64, 128, 64, 8192, 64]
SIZE = 256 * MB
SECRET = "verbs-gpu-test-secret"
FLUSH = {"eager": "auto", "strict": "read"}  # SOFTVERBS_GDR_FLUSH -> the fabric's gdr_flush


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


_WHY = verbs_unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(bool(_WHY), reason=f"verbs: {_WHY}")]

SHAPES = {
    "aux11": lambda rng: AUX,
    "odd_small": lambda rng: [1, 63, 1, 65, 4097] + rng.integers(1, 3000, 200).tolist(),
    "4096x64B": lambda rng: [64] * 4096,
    "1024x64KB": lambda rng: [64 << 10] * 1024,
    "78x2.25MB": lambda rng: [2359296] * 78,
    "mix2000+8x2MB": lambda rng: rng.integers(1, 8193, 2000).tolist() + [2 * MB] * 8,
}


@pytest.fixture(scope="module", params=list(FLUSH))
def mode(request):
    """The model's mode for NIC writes into GPU memory, for this process and the peer it spawns."""
    old = os.environ.get("SOFTVERBS_GDR_FLUSH")
    os.environ["SOFTVERBS_GDR_FLUSH"] = request.param
    yield request.param
    if old is None:
        os.environ.pop("SOFTVERBS_GDR_FLUSH", None)
    else:
        os.environ["SOFTVERBS_GDR_FLUSH"] = old


@pytest.fixture(scope="module")
def pair(mode):
    import torch
    from suite_env import SEED
    opts = {"gdr_flush": FLUSH[mode]}
    peer = EnginePeer(SIZE, device=0, fabric="verbs", rails=2, secret=SECRET, fabric_options=opts)
    eng = TransferEngine(fabric="verbs", rails=2, secret=SECRET, fabric_options=opts)
    g = torch.Generator(device="cuda:0").manual_seed(SEED)
    src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda:0", generator=g)
    eng.register(src)
    try:
        yield eng, peer, src, src.cpu().numpy()
    finally:
        eng.close()
        peer.close()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_kv_over_verbs_byte_exact(pair, mode, seed, shape):
    """Every sglang shape, GPU -> GPU over verbs: every byte where it belongs, nothing else, in both flush modes;
    small pieces went through chunks (no write from GPU memory inline), large ones direct."""
    eng, peer, src, src_host = pair
    rng = np.random.default_rng([seed, len(shape), sum(map(ord, shape))])
    lengths = SHAPES[shape](rng)
    before = eng.stats()
    write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, SIZE),
                    disjoint_offsets(rng, lengths, SIZE), lengths)
    after = eng.stats()
    chunks = after["paths"]["coalesced"]["chunks"] - before["paths"]["coalesced"]["chunks"]
    direct = after["paths"]["direct"]["units"] - before["paths"]["direct"]["units"]
    small = sum(1 for n in lengths if n < 64 << 10)
    assert (chunks > 0) == (small > 0), (shape, after["paths"])
    if small < len(lengths):
        assert direct > 0, (shape, after["paths"])
    assert all(r["wire"]["inline"] == 0 for r in after["rails"]), [r["wire"] for r in after["rails"]]
    rx = peer.call("stats")["receiver"]
    if chunks:
        flushes = {k: v for k, v in rx.items() if k.startswith("gpu_flush_") and k != "gpu_flush_s"}
        assert flushes, rx
        if mode == "strict":
            assert set(flushes) == {"gpu_flush_read"}, flushes
        assert rx.get("landing_devices") == [0], rx


def test_the_mooncake_api_over_rdma(mode, seed):
    """The Mooncake API with protocol "rdma", GPU buffers on both sides, as sglang calls it: one batch of aux and
    page pieces and a large layer block, with a notify; the target reads its buffer after ``get_notifies``
    returned the notify (which flushes the NIC's writes into its GPU first)."""
    import torch
    from engine_helpers import GUARD
    from integration.mooncake import TransferEngine as Mooncake
    from integration.mooncake import TransferNotify, TransferOpcode
    rng = np.random.default_rng([seed, 48])
    opts = {"secret": SECRET, "fabric_options": {"gdr_flush": FLUSH[mode]}}
    a, b = Mooncake(**opts), Mooncake(**opts)
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert a._engine.fabric_name == "verbs" and b._engine.fabric_name == "verbs"
        n = 16 * MB
        g = torch.Generator(device="cuda:0").manual_seed(seed)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0", generator=g)
        dst = torch.full((GUARD + n + GUARD,), 0x5C, dtype=torch.uint8, device="cuda:0")
        assert a.register_memory(src.data_ptr(), n) == 0
        assert b.register_memory(dst.data_ptr() + GUARD, n) == 0
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        lengths = AUX + rng.integers(1, 4097, 300).tolist() + [3 * MB + 5]
        so, do = disjoint_offsets(rng, lengths, n), disjoint_offsets(rng, lengths, n)
        rc = a.batch_transfer_sync(peer, [src.data_ptr() + int(o) for o in so],
                                   [dst.data_ptr() + GUARD + int(o) for o in do], lengths, TransferOpcode.Write,
                                   notify=TransferNotify("kv", "layer0"))
        assert rc == 0
        notes = wait_for(b.get_notifies, "the batch's notify at the peer", timeout=30, interval=0.01)
        assert [(x.name, x.msg) for x in notes] == [("kv", "layer0")]
        exp = np.full(GUARD + n + GUARD, 0x5C, dtype=np.uint8)
        src_host = src.cpu().numpy()
        for s_, d_, k in zip(so, do, lengths):
            exp[GUARD + d_:GUARD + d_ + k] = src_host[s_:s_ + k]
        torch.cuda.synchronize()
        got = dst.cpu().numpy()
        bad = np.flatnonzero(got != exp)
        assert not bad.size, f"{bad.size} bytes differ, first at offset {int(bad[0]) - GUARD}"
    finally:
        a.close()
        b.close()


def test_a_write_waits_for_the_kernel_that_fills_its_slot(pair, mode, seed, monkeypatch):
    """Each relay fill runs behind 20 ms of other GPU work on its lane: the posts wait for it (byte-exact). With
    that wait taken out (a mutation), the NIC reads the slot before its gather ran and the batch is wrong or
    fails: the test can tell."""
    import torch
    from transport.relay import RelayRing
    eng, peer, src, src_host = pair
    real_fill = {}

    def slow_fills(ring):
        if ring in real_fill or ring.device < 0:
            return
        real_fill[ring] = fill = ring._fill

        def late_fill(attempt, slot):
            with torch.cuda.stream(ring.stream(slot.lane)):
                torch.cuda._sleep(40_000_000)  # about 20 ms of clock cycles
            return fill(attempt, slot)
        ring._fill = late_fill

    rng = np.random.default_rng([seed, 7])
    lengths = [64] * 2048
    write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, SIZE),
                    disjoint_offsets(rng, lengths, SIZE), lengths)  # the rings exist now
    for ring in eng.data_path.rings():
        slow_fills(ring)
    assert real_fill, "no GPU relay ring"
    try:
        write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, SIZE),
                        disjoint_offsets(rng, lengths, SIZE), lengths)
        monkeypatch.setattr(RelayRing, "wait_for_fills", lambda self, lanes: None)
        with pytest.raises((AssertionError, TransferError)):
            write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, SIZE),
                            disjoint_offsets(rng, lengths, SIZE), lengths, timeout=30)
    finally:
        monkeypatch.undo()
        torch.cuda.synchronize()
        for ring, fill in real_fill.items():
            ring._fill = fill


def test_strict_mode_needs_the_flush(seed):
    """With the flush taken out (``gdr_flush="none"``) in strict mode, the receiver reads a landed chunk before
    the NIC's writes are visible: the chunk is refused or its pieces are wrong. The flush is what makes the
    strict cases pass."""
    import torch
    old = os.environ.get("SOFTVERBS_GDR_FLUSH")
    os.environ["SOFTVERBS_GDR_FLUSH"] = "strict"
    try:
        peer = EnginePeer(16 * MB, device=0, fabric="verbs", rails=1, secret=SECRET,
                          fabric_options={"gdr_flush": "none"})
        try:
            with TransferEngine(fabric="verbs", rails=1, secret=SECRET, timeout=30) as eng:
                src = torch.randint(0, 256, (16 * MB,), dtype=torch.uint8, device="cuda:0")
                eng.register(src)
                rng = np.random.default_rng([seed, 9])
                lengths = AUX * 8
                with pytest.raises((AssertionError, TransferError)):
                    write_and_check(eng, peer, src.data_ptr(), src.cpu().numpy(),
                                    disjoint_offsets(rng, lengths, 16 * MB), disjoint_offsets(rng, lengths, 16 * MB),
                                    lengths, timeout=30)
        finally:
            peer.close()
    finally:
        if old is None:
            os.environ.pop("SOFTVERBS_GDR_FLUSH", None)
        else:
            os.environ["SOFTVERBS_GDR_FLUSH"] = old
