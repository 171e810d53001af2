"""Engine end to end with GPU memory: two processes on one GPU, ipc fabric (skipped without CUDA)."""
import numpy as np
import pytest

from engine_helpers import EnginePeer, Expected, disjoint_offsets
from transport import TransferEngine

MB = 1 << 20
pytestmark = pytest.mark.gpu


def test_gpu_kv_and_host_aux_over_ipc(seed):
    import torch
    rng = np.random.default_rng(seed)
    size = 64 * MB
    peer = EnginePeer(size, device=0, fabric="ipc")
    try:
        with TransferEngine(fabric="ipc") as eng:
            g = torch.Generator(device="cuda:0").manual_seed(seed)
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0", generator=g)
            eng.register(src)
            src_host = src.cpu().numpy()
            for lengths in ([2359296] * 8, [64] * 4096, [2048] * 2000,
                            rng.integers(1, 8193, size=500).tolist() + [2 * MB] * 3):
                peer.poison()
                s = disjoint_offsets(rng, lengths, size)
                d = disjoint_offsets(rng, lengths, size)
                exp = Expected(size)
                exp.apply(src_host, s, d, lengths)
                eng.batch_write(peer.session, [src.data_ptr() + int(x) for x in s],
                                [peer.base + int(x) for x in d], lengths)
                peer.check(exp)
            st = eng.stats()
        assert st["paths"]["coalesced"]["chunks"] >= 3 and any(k.startswith("cuda0/") for k in st["rings"])
    finally:
        peer.close()
