"""Engine end to end with GPU memory: two processes on one GPU, ipc fabric (skipped without CUDA)."""
import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets, spy_taken, write_and_check
from transport import TransferEngine

MB = 1 << 20
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("loadstore,coalesce,relay", [(False, None, None), (False, 64 << 10, None),
                                                       (False, None, "always"), (True, None, None)],
                         ids=["message-path", "message-path-chunks", "message-path-relayed", "loadstore"])
def test_gpu_kv_over_ipc(seed, loadstore, coalesce, relay):
    """GPU -> GPU pieces of every sglang kind, byte-exact with the peer's guards: on the message path as direct
    writes (the ipc fabric's default), through relay chunks and the receiver's scatter (``coalesce_bytes``
    set), or through relay slots (``relay="always"``: on one GPU the relay GPU is the data's own), or as one
    copy launch into the peer's IPC-mapped memory (load/store)."""
    import torch
    rng = np.random.default_rng(seed)
    size = 64 * MB
    peer = EnginePeer(size, device=0, fabric="ipc")
    try:
        # relayed: 4 MiB slots, one per lane, so that the 40 MB batch below wraps the ring seven times (each slot
        # refilled while the write of its previous fill may still be queued on the GPU)
        slots = {"relay_slot_bytes": 4 * MB, "relay_slots": 1} if relay == "always" else {}
        with TransferEngine(fabric="ipc", loadstore=loadstore, coalesce_bytes=coalesce, relay=relay,
                            **slots) as eng:
            g = torch.Generator(device="cuda:0").manual_seed(seed)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=g)
            eng.register(src)
            src_host = src.cpu().numpy()
            for lengths in ([2359296] * 8, [64] * 4096, [2048] * 2000, [1, 3, 63, 65],
                            rng.integers(1, 8193, size=500).tolist() + [2 * MB] * 3, [MB + 7] * 40):
                write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, size),
                                disjoint_offsets(rng, lengths, size), lengths)
            # async: the handle completes once the launch is done
            peer.poison()
            exp = Expected(size)
            exp.apply(src_host, [5], [7], [3 * MB])
            h = eng.batch_write_async(peer.session, [src.data_ptr() + 5], [peer.base + 7], [3 * MB])
            h.wait()
            assert h.done()
            peer.check(exp)
            st = eng.stats()
        if loadstore:
            assert st["paths"]["loadstore"]["units"] == 7 and st["paths"]["coalesced"]["chunks"] == 0
        elif relay == "always":
            assert st["paths"]["relayed"]["units"] >= 20 and st["paths"]["direct"]["units"] == 0, st["paths"]
            assert st["paths"]["coalesced"]["chunks"] == 0 and st["paths"]["loadstore"]["units"] == 0
        elif coalesce is None:
            assert st["paths"]["coalesced"]["chunks"] == 0 and st["paths"]["direct"]["units"] >= 7
            assert st["paths"]["loadstore"]["units"] == 0
        else:
            assert st["paths"]["coalesced"]["chunks"] >= 3 and any(k.startswith("cuda0/") for k in st["rings"])
            assert st["paths"]["loadstore"]["units"] == 0
    finally:
        peer.close()


@pytest.mark.parametrize("fabric,loadstore,coalesce,relay", [
    ("ipc", False, None, None), ("ipc", False, 64 << 10, None), ("ipc", False, None, "always"),
    ("ipc", True, None, None), ("tcp", False, None, None), ("verbs", False, None, None)],
    ids=["message-path", "message-path-chunks", "message-path-relayed", "loadstore", "tcp", "verbs"])
def test_gpu_sources_written_on_the_callers_stream(seed, fabric, loadstore, coalesce, relay):
    """Sources written on the caller's current stream just before the call, behind ~20 ms of other work there:
    every path reads them after that work (the new bytes land, never the stale ones before them), sync and
    async, for a batch whose sources lie in one registered region (inline writes) and in two (posted). On verbs
    (softverbs' GPUDirect model) the NIC reads a GPU source when the write is posted."""
    import torch
    if fabric == "verbs":
        from fabric_helpers import verbs_unavailable
        why = verbs_unavailable()
        if why:
            pytest.skip(f"verbs: {why}")
    rng = np.random.default_rng(seed)
    size = 16 * MB
    peer = EnginePeer(size, device=0, fabric=fabric)
    try:
        with TransferEngine(fabric=fabric, loadstore=loadstore, coalesce_bytes=coalesce, relay=relay) as eng:
            src = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda:0")  # stale bytes
            eng.register(src[:size // 2])
            eng.register(src[size // 2:])
            g = torch.Generator(device="cuda:0").manual_seed(seed)
            lengths = rng.integers(1, 8193, size=300).tolist() + [MB + 3] * 4 + [1, 63]
            for regions in (1, 2):
                for call in ("sync", "async"):
                    fresh = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=g)
                    fresh_host = fresh.cpu().numpy()
                    # two regions: every other piece in the second half, so that the batch spans both and no
                    # piece crosses from one registered region into the next
                    half = size // 2
                    so = disjoint_offsets(rng, lengths, half)
                    if regions == 2:
                        so[1::2] += half
                    do = disjoint_offsets(rng, lengths, size)
                    peer.poison()
                    exp = Expected(size)
                    exp.apply(fresh_host, so, do, lengths)
                    src.fill_(0xA5)
                    torch.cuda.synchronize()
                    torch.cuda._sleep(40_000_000)  # ~20 ms of the caller's stream before the sources are written
                    src.copy_(fresh)
                    srcs = [src.data_ptr() + int(o) for o in so]
                    dsts = [peer.base + int(o) for o in do]
                    if call == "sync":
                        eng.batch_write(peer.session, srcs, dsts, lengths)
                    else:
                        eng.batch_write_async(peer.session, srcs, dsts, lengths).wait()
                    try:
                        peer.check(exp)
                    except AssertionError as e:
                        raise AssertionError(f"sources in {regions} region(s), {call} call: {e}") from None
    finally:
        peer.close()


@pytest.mark.parametrize("rails,posted", [(1, False), (2, False), (2, True)], ids=["1-rail", "2-rails", "2-posted"])
def test_gpu_message_path_batches_over_many_regions(seed, monkeypatch, rails, posted):
    """sglang's layout: a KV buffer registered per layer on each side (8 layers), one batch naming a block and a
    small odd piece of every layer (1 B and 63 B among them, odd offsets). On the message path, once the rails
    know the peer's regions, sync and async, byte-exact in every peer region with the poison around the pieces
    intact: with one rail every batch is written inline by one launch that maps each piece into its own peer
    region's mapping (``IpcFabric.write_inline_regions``); with two rails the planner splits it into a run per
    rail, each written inline the same way; with that path turned off (``2-posted``: the path of a batch
    redispatched or declined inline), each rail's posted ``WriteBatch`` is copied by the posting thread the same
    way (``_post_batch_direct`` through ``_regions_target``), not as messages."""
    import torch
    from transport.fabric.ipc import IpcFabric
    from transport.peer_process import POISON, digest
    from transport.planner import Planner
    from transport.topology import synthetic
    if not posted:
        taken = spy_taken(monkeypatch, IpcFabric, "write_inline_regions")
    else:
        taken = []
        real = IpcFabric._regions_target

        def spy(self, *args, **kw):
            got = real(self, *args, **kw)
            taken.append(got is not None and got[2] is not None)  # copied by the poster, over several regions
            return got

        monkeypatch.setattr(IpcFabric, "_regions_target", spy)
        monkeypatch.setattr(Planner, "direct_runs_all", lambda self, *a, **kw: False)
    rng = np.random.default_rng(seed)
    layers, layer_bytes = 8, 4 * MB
    kw = {"fabric": "ipc", "loadstore": False,
          "topology": synthetic(1, {0: ["mlx5_0", "mlx5_1"][:rails]})}
    peer = EnginePeer(MB, device=0, **kw)
    try:
        extras = [peer.call("register_extra", size=layer_bytes, device=0) for _ in range(layers)]
        with TransferEngine(**kw) as eng:
            g = torch.Generator(device="cuda:0").manual_seed(seed)
            src = [torch.empty(layer_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(layers)]
            for t in src:
                eng.register(t)
            pieces = []  # (layer, src offset, dst offset, length)
            for k in range(layers):
                small = [1, 63, 100, 7, 4097, 2, 65, 1000][k]
                big = 2359296 + k
                pieces += [(k, 3 + k, 11 + 2 * k, big), (k, 3 * MB + k, 3 * MB + 5, small)]
            order = rng.permutation(len(pieces))
            pieces = [pieces[i] for i in order]
            srcs = np.array([src[k].data_ptr() + so for k, so, _, _ in pieces], dtype=np.int64)
            dsts = np.array([extras[k] + do for k, _, do, _ in pieces], dtype=np.int64)
            lens = np.array([n for _, _, _, n in pieces], dtype=np.int64)
            warm = 0
            while taken[-rails:] != [True] * rails:
                assert warm < 5 * rails, f"the rails did not learn the peer's regions: {taken}"
                eng.batch_write(peer.session, srcs, dsts, lens)
                warm += 1
            for asynchronous in (False, True):
                for t in src:
                    torch.randint(0, 256, (layer_bytes,), dtype=torch.uint8, device="cuda:0", generator=g, out=t)
                host = [t.cpu().numpy() for t in src]
                peer.poison()
                before = len(taken)
                if asynchronous:
                    eng.batch_write_async(peer.session, srcs, dsts, lens).wait()
                else:
                    eng.batch_write(peer.session, srcs, dsts, lens)
                assert taken[before:] == [True] * rails, taken  # one write (one run) per rail, each taken
                for k in range(layers):
                    img = np.full(layer_bytes, POISON, dtype=np.uint8)
                    for k_, so, do, n in pieces:
                        if k_ == k:
                            img[do:do + n] = host[k][so:so + n]
                    assert peer.call("extra_digest", addr=extras[k]) == digest(img), \
                        f"layer {k}'s peer region differs (async={asynchronous})"
            st = eng.stats()
        assert st["paths"]["direct"]["units"] == rails * (warm + 2) and st["paths"]["loadstore"]["units"] == 0, \
            st["paths"]
    finally:
        peer.close()


def test_gpu_loadstore_host_to_gpu_takes_message_path(seed):
    """Host -> GPU pieces are not for the load/store path: the message path stages them, byte-exact."""
    import torch
    rng = np.random.default_rng(seed)
    size = 16 * MB
    peer = EnginePeer(size, device=0, fabric="ipc")
    try:
        with TransferEngine(fabric="ipc") as eng:
            host_src = np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()
            eng.register(host_src)
            lengths = [64, 512, 8192, 1, 63]
            s = disjoint_offsets(rng, lengths, size)
            d = disjoint_offsets(rng, lengths, size)
            peer.poison()
            exp = Expected(size)
            exp.apply(host_src, s, d, lengths)
            eng.batch_write(peer.session, [host_src.ctypes.data + int(x) for x in s],
                            [peer.base + int(x) for x in d], lengths)  # host -> GPU: message path
            peer.check(exp)
            st = eng.stats()
        assert st["paths"]["loadstore"]["units"] == 0 and st["batches"]["ok"] == 1
    finally:
        peer.close()


def test_gpu_loadstore_one_batch_of_gpu_and_host_pieces(seed):
    """KV blocks (GPU -> GPU) and aux pieces (host -> host) in one batch: one load/store unit, the host pieces
    written while the device copies, both memories byte-exact (the GPU buffer with its guards)."""
    import torch
    from transport.peer_process import POISON, digest
    rng = np.random.default_rng(seed)
    size = 32 * MB
    peer = EnginePeer(size, device=0, fabric="ipc")
    try:
        host_dst = peer.call("register_extra", size=MB, device=-1)
        with TransferEngine(fabric="ipc") as eng:
            g = torch.Generator(device="cuda:0").manual_seed(seed)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=g)
            host_src = np.frombuffer(rng.bytes(MB), dtype=np.uint8).copy()
            eng.register(src)
            eng.register(host_src)
            kv = [2 * MB] * 8
            aux = [64, 64, 512, 8192, 1, 63]
            ks, kd = disjoint_offsets(rng, kv, size), disjoint_offsets(rng, kv, size)
            hs, hd = disjoint_offsets(rng, aux, MB), disjoint_offsets(rng, aux, MB)
            peer.poison()
            exp = Expected(size)
            exp.apply(src.cpu().numpy(), ks, kd, kv)
            host_img = np.full(MB, POISON, dtype=np.uint8)
            for s_, d_, n_ in zip(hs, hd, aux):
                host_img[d_:d_ + n_] = host_src[s_:s_ + n_]
            eng.batch_write(peer.session,
                            [src.data_ptr() + int(x) for x in ks] + [host_src.ctypes.data + int(x) for x in hs],
                            [peer.base + int(x) for x in kd] + [host_dst + int(x) for x in hd], kv + aux)
            peer.check(exp)
            assert peer.call("extra_digest", addr=host_dst) == digest(host_img)
            st = eng.stats()
        assert st["paths"]["loadstore"]["units"] == 1 and st["paths"]["coalesced"]["chunks"] == 0
    finally:
        peer.close()


@pytest.mark.parametrize("count", [3, 300], ids=["few-pieces", "many-pieces"])
def test_bound_copies_add_the_destination_shift_while_staging(seed, count):
    """``BoundCopies.copy(..., dst_shift=k)`` writes piece i at ``dst[i] + k`` and nowhere else, byte-exact into a
    poisoned buffer, through each of its ways: a few new lengths (a copy-engine call per piece), then a launch,
    then the launch bound in a graph, or for many pieces a launch at once, then bound; the caller's ``dst``
    array is left as it was."""
    import torch
    from transport.fabric.gpu_copy import BoundCopies
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, size=count).astype(np.int64)
    size = 8 * MB
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).cuda()
    src_offs = disjoint_offsets(rng, lengths.tolist(), size).astype(np.int64)
    dst_offs = disjoint_offsets(rng, lengths.tolist(), size // 2).astype(np.int64)
    copies = BoundCopies()
    for _ in range(3):  # later rounds find the lengths seen before
        out = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).cuda()
        expect = out.cpu().numpy().copy()
        shift = int(rng.integers(1, size // 2 - 1))
        base_dst = np.full(count, out.data_ptr(), dtype=np.int64) + dst_offs
        kept = base_dst.copy()
        host = src.cpu().numpy()
        for s, d, n in zip(src_offs.tolist(), dst_offs.tolist(), lengths.tolist()):
            expect[d + shift:d + shift + n] = host[s:s + n]
        copies.finish([copies.copy(0, src.data_ptr() + src_offs, base_dst, lengths, dst_shift=shift)], wait=True)
        assert np.array_equal(out.cpu().numpy(), expect)
        assert np.array_equal(base_dst, kept)
