"""PXN on a machine with two GPUs: peer access owned by the library, sender-side relay, receiver-side forward.

Every test needs two CUDA devices and skips with that reason otherwise. Data: fresh random bytes per run (the
``seed`` fixture), a distinct value in every piece, destinations poisoned first, the peer's whole buffer (guards
included) compared with the expected image.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from engine_helpers import EnginePeer, disjoint_offsets, write_and_check

MB = 1 << 20
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


two_gpus = pytest.mark.skipif(_gpus() < 2, reason=f"needs 2 CUDA GPUs ({_gpus()} visible)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pieces(rng, n, lo, hi, space):
    lengths = rng.integers(lo, hi + 1, size=n).tolist()
    return lengths, disjoint_offsets(rng, lengths, space), disjoint_offsets(rng, lengths, space)


@two_gpus
def test_kernels_read_and_write_a_peer_gpu_without_manual_peer_access(seed):
    """A fresh process (nothing enabled peer access before): gather from GPU 1 into GPU 0, scatter from GPU 0 into
    GPU 1, copy GPU 1 -> GPU 1 launched on GPU 0; byte-exact, and pxn enabled exactly the pairs it needed."""
    script = textwrap.dedent(f"""
        import sys, numpy as np, torch
        sys.path.insert(0, {ROOT!r})
        import pxn_kernels
        from pxn_kernels import peer_access
        from engine_helpers import disjoint_offsets
        rng = np.random.default_rng({seed})
        size = 8 << 20
        lengths = np.concatenate([rng.integers(1, 8193, 300), [1, 63, 65, 3 << 20]]).astype(np.int64)
        so, do = disjoint_offsets(rng, lengths, size), disjoint_offsets(rng, lengths, size)
        g1 = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).to("cuda:1")
        out = torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda:0")
        t = lambda a: torch.tensor(np.asarray(a, dtype=np.int64), device="cuda:0")
        pxn_kernels.gather(t(so + g1.data_ptr()), t(lengths), out, t(do))
        torch.cuda.synchronize(0)
        host, exp = g1.cpu().numpy(), np.full(size, 0xA5, np.uint8)
        for s, d, n in zip(so, do, lengths):
            exp[d:d + n] = host[s:s + n]
        assert np.array_equal(out.cpu().numpy(), exp), "gather from the peer GPU"
        dst1 = torch.full((size,), 0x5A, dtype=torch.uint8, device="cuda:1")
        src0 = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).to("cuda:0")
        pxn_kernels.scatter(src0, t(so), t(do + dst1.data_ptr()), t(lengths))
        torch.cuda.synchronize(0)
        host, exp = src0.cpu().numpy(), np.full(size, 0x5A, np.uint8)
        for s, d, n in zip(so, do, lengths):
            exp[d:d + n] = host[s:s + n]
        assert np.array_equal(dst1.cpu().numpy(), exp), "scatter into the peer GPU"
        dst1.fill_(0x33)
        pxn_kernels.copy(t(so + g1.data_ptr()), t(do + dst1.data_ptr()), t(lengths))
        torch.cuda.synchronize(0)
        host, exp = g1.cpu().numpy(), np.full(size, 0x33, np.uint8)
        for s, d, n in zip(so, do, lengths):
            exp[d:d + n] = host[s:s + n]
        assert np.array_equal(dst1.cpu().numpy(), exp), "copy between two peer pointers"
        print("pairs", peer_access.enabled_pairs())
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"seed {seed}\n{r.stdout}\n{r.stderr}"
    assert "pairs [(0, 1)]" in r.stdout, r.stdout


@two_gpus
def test_kernels_take_the_staged_path_for_a_pair_without_peer_access(seed):
    """With the pair forced peer-less, a checked gather / scatter copies piece by piece through the driver
    (no kernel reads the peer pointer), byte-exact."""
    import torch
    import pxn_kernels
    from pxn_kernels.peer_access import peer_access_disabled
    rng = np.random.default_rng(seed)
    size = 4 * MB
    lengths, so, do = _pieces(rng, 200, 1, 4096, size)
    src1 = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8)).to("cuda:1")
    out = torch.full((size,), 0xC3, dtype=torch.uint8, device="cuda:0")
    t = lambda a: torch.tensor(np.asarray(a, dtype=np.int64), device="cuda:0")  # noqa: E731
    with peer_access_disabled((0, 1)):
        pxn_kernels.gather(t(np.asarray(so) + src1.data_ptr()), t(lengths), out, t(do))
        torch.cuda.synchronize(0)
    host, exp = src1.cpu().numpy(), np.full(size, 0xC3, np.uint8)
    for s, d, n in zip(so, do, lengths):
        exp[d:d + n] = host[s:s + n]
    assert np.array_equal(out.cpu().numpy(), exp), f"seed {seed}"


@two_gpus
def test_engine_refuses_a_relay_pair_without_peer_access_and_an_invisible_gpu():
    from pxn_kernels.peer_access import peer_access_disabled
    from transport import TransferEngine
    from transport.topology import TopologyError, synthetic
    with peer_access_disabled((0, 1)):
        with pytest.raises(TopologyError, match=r"GPU 0 cannot access GPU 1"):
            TransferEngine(fabric="tcp", topology=synthetic(2, {0: ["mlx5_0"]}))
    with pytest.raises(TopologyError, match=r"GPU 3 is not visible"):
        TransferEngine(fabric="tcp", topology=synthetic(4, {3: ["mlx5_0"]}))


# (sender's NIC GPU, receiver's NIC GPU): data on GPU 1 at both ends
CASES = {"direct": (1, 1), "pxn_send": (0, 1), "pxn_recv": (1, 0), "pxn_both": (0, 0)}


@two_gpus
@pytest.mark.parametrize("fabric", ["ipc", "ipc-chunks", "tcp"])
@pytest.mark.parametrize("case", list(CASES))
def test_relay_and_forward_between_two_processes(seed, fabric, case):
    """Sender data on GPU 1, receiver memory on GPU 1; the one NIC of each side sits next to GPU 1 (direct) or
    GPU 0 (PXN: the sender relays through GPU 0, the receiver lands on GPU 0 and forwards over NVLink).
    Small and large pieces, byte-exact with the peer's guards, on the ipc message path (``loadstore=False``;
    by the fabric's default without chunks, and with chunks of small pieces as on tcp) and tcp."""
    import torch
    from transport import TransferEngine
    from transport.topology import synthetic
    send_nic, recv_nic = CASES[case]
    rng = np.random.default_rng(seed)
    size = 64 * MB
    extra = {"loadstore": False} if fabric.startswith("ipc") else {}
    if fabric == "ipc-chunks":
        fabric, extra["coalesce_bytes"] = "ipc", 64 << 10
    peer = EnginePeer(size, device=1, fabric=fabric, topology=synthetic(2, {recv_nic: ["mlx5_0"]}),
                      forward_large=True, **extra)
    try:
        with TransferEngine(fabric=fabric, topology=synthetic(2, {send_nic: ["mlx5_0"]}), **extra) as eng:
            g = torch.Generator(device="cuda:1").manual_seed(seed)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:1", generator=g)
            eng.register(src)
            src_host = src.cpu().numpy()
            shapes = ([2359296] * 8, [64] * 4096, [1, 3, 63, 65],
                      rng.integers(1, 8193, size=500).tolist() + [2 * MB] * 3, [9 * MB])
            for lengths in shapes:
                write_and_check(eng, peer, src.data_ptr(), src_host, disjoint_offsets(rng, lengths, size),
                                disjoint_offsets(rng, lengths, size), lengths)
            st = eng.stats()
            rx = peer.call("stats")["receiver"]  # before the sender closes: the receiver then frees its slots
    finally:
        peer.close()
    if send_nic == 0:  # every unit went through a relay ring on GPU 0
        assert any(k.startswith("cuda0/") for k in st["rings"]) and st["paths"]["direct"]["units"] == 0, st
    if recv_nic == 0:
        assert rx["landing_devices"] == [0], rx
        assert rx.get("forwarded", 0) > 9 * MB, rx
    else:
        assert rx.get("forwarded", 0) == 0, rx
