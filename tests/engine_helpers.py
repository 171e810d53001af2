"""Helpers for the engine tests: a receiving TransferEngine in a separate (spawned) process.

The peer allocates ``GUARD + size + GUARD`` bytes (host, or GPU with ``device >= 0``), poisons all of it and
registers only the middle, so a test proves that nothing outside the written ranges changed -- guards included --
by comparing a hash of the peer's whole buffer with the hash of the expected buffer built in the test process
(``Expected``). On a mismatch the peer sends the buffer back and the test names the first wrong byte.
"""
from __future__ import annotations

import logging
import os
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from transport.peer_process import POISON, Buffer, PeerProcess, serve  # noqa: E402
from transport.peer_process import digest as _digest  # noqa: E402

GUARD = 1 << 20


def _peer_main(conn, size: int, device: int, engine_kwargs: dict, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="peer %(levelname)s %(name)s: %(message)s")
    state = {"extras": {}}

    def start():
        from transport import TransferEngine
        engine = state["engine"] = TransferEngine(**engine_kwargs)
        mem = state["mem"] = Buffer(GUARD + size + GUARD, device)
        engine.register(mem.addr + GUARD, size, device=device)
        return {"session": engine.session_id, "base": mem.addr + GUARD}

    def handle(cmd, kw):
        engine, mem, extras = state["engine"], state["mem"], state["extras"]
        if cmd == "poison":
            for x in [mem, *extras.values()]:
                x.fill(kw.get("value", POISON))
            return None
        if cmd in ("digest", "dump") and device >= 0:
            # what a receiving application does before it reads GPU memory peers wrote (GPUDirect RDMA)
            engine.flush_gpu_writes()
            import torch
            torch.cuda.synchronize(device)
        if cmd == "digest":
            return _digest(mem.host())
        if cmd == "dump":
            return mem.host().tobytes()
        if cmd == "register_extra":
            dev = kw.get("device", device)
            x = Buffer(kw["size"], dev)
            engine.register(x.addr, kw["size"], device=dev)
            extras[x.addr] = x
            return x.addr
        if cmd == "deregister":
            engine.deregister(kw["addr"])
            return None
        if cmd == "extra_digest":
            return _digest(extras[kw["addr"]].host())
        if cmd == "stats":
            return engine.stats()
        raise ValueError(f"unknown command {cmd!r}")

    serve(conn, start, handle, lambda: state["engine"].close())


class GuardedPeer(PeerProcess):
    """A peer process whose ready message names ``session`` and ``base``, with poison / check commands."""

    def __init__(self, target, args, name: str, size: int):
        super().__init__(target, args, name=name)
        self.size = size
        self.session = self.ready["session"]
        self.base = self.ready["base"]

    def poison(self) -> None:
        self.call("poison")

    def check(self, expected: "Expected") -> None:
        """Assert the peer's whole buffer (guards included) equals ``expected``; name the first wrong byte."""
        if self.call("digest") == expected.digest():
            return
        data = np.frombuffer(self.call("dump"), dtype=np.uint8)
        bad = np.nonzero(data != expected.full)[0]
        first = int(bad[0])
        raise AssertionError(f"peer buffer differs in {bad.size} byte(s); first at offset {first - GUARD} from "
                             f"the registered base (got 0x{data[first]:02x}, expected "
                             f"0x{expected.full[first]:02x}); last at {int(bad[-1]) - GUARD}")


class EnginePeer(GuardedPeer):
    """A receiving engine in a spawned process with ``size`` registered bytes at ``base`` (between guards)."""

    def __init__(self, size: int, device: int = -1, log_level: int = logging.WARNING, **engine_kwargs):
        self.device = device
        super().__init__(_peer_main, (size, device, engine_kwargs, log_level), "pxn-test-peer", size)


class Expected:
    """The peer buffer as it must look: poison everywhere, written pieces where they were written."""

    def __init__(self, size: int):
        self.full = np.full(GUARD + size + GUARD, POISON, dtype=np.uint8)
        self.view = self.full[GUARD:GUARD + size]

    def apply(self, src: np.ndarray, src_offsets, dst_offsets, lengths) -> None:
        for s, d, n in zip(src_offsets, dst_offsets, lengths):
            self.view[d:d + n] = src[s:s + n]

    def digest(self) -> str:
        return _digest(self.full)


def write_and_check(sender, peer: GuardedPeer, src_addr: int, src_host: np.ndarray, src_offs, dst_offs, lengths,
                    timeout=None) -> None:
    """Poison the peer, write piece i (``lengths[i]`` bytes) from ``src_addr + src_offs[i]`` to
    ``peer.base + dst_offs[i]``, and compare the peer's whole buffer (guards included) with the expected image
    built from ``src_host``, the source bytes as a host array."""
    peer.poison()
    exp = Expected(peer.size)
    exp.apply(src_host, src_offs, dst_offs, lengths)
    sender.batch_write(peer.session, [src_addr + int(o) for o in src_offs], [peer.base + int(o) for o in dst_offs],
                       [int(n) for n in lengths], timeout=timeout)
    peer.check(exp)


def disjoint_offsets(rng: np.random.Generator, lengths, space: int, align: int = 1) -> np.ndarray:
    """Random non-overlapping offsets for pieces of ``lengths`` inside ``space`` bytes (shuffled order, random
    gaps), each a multiple of ``align``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = (lengths + align - 1) // align * align
    slack = space - int(padded.sum())
    if slack < 0:
        raise ValueError(f"{int(padded.sum())} B of pieces do not fit {space} B")
    order = rng.permutation(lengths.size)
    gaps = rng.multinomial(slack // align, np.ones(lengths.size + 1) / (lengths.size + 1))[:-1] * align
    offs = np.empty(lengths.size, dtype=np.int64)
    pos = 0
    for k, i in enumerate(order):
        pos += int(gaps[k])
        offs[i] = pos
        pos += int(padded[i])
    return offs


def spy_taken(monkeypatch, cls, name: str) -> list:
    """Replace method ``name`` of ``cls`` (an inline write: ``IpcFabric.write_inline`` / ``write_inline_regions``)
    by a spy; the returned list gets, per call, whether the fabric took the writes (True) or declined (False)."""
    taken = []
    real = getattr(cls, name)

    def spy(self, *args, **kw):
        got = real(self, *args, **kw)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(cls, name, spy)
    return taken
