"""Same-host IPC fabric: the writer copies straight into the target process's memory.

Why cross-memory attach for host memory: a region is *arbitrary* memory the target already owns (a torch tensor,
a numpy array), and existing anonymous memory cannot be re-exported as shared memory after the fact. Linux's
``process_vm_writev`` (the mechanism of UCX's ``cma`` transport) copies from our address space into another
process's in one kernel copy, for any address, batched as iovec lists (1024 per call). It needs ptrace
permission over the target: same user, and with Yama ``ptrace_scope=1`` the target must allow us, which every
``IpcFabric`` does at start (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``); ``connect`` probes it and raises
``FabricUnavailable`` with the fix when it is denied (``ptrace_scope`` 2/3, seccomp, different user).

GPU memory: the target exports its regions with CUDA IPC handles (``cudaIpcGetMemHandle`` of the allocation base
from ``cuMemGetAddressRange``); the writer opens each handle once (``cudaIpcOpenMemHandle``, lazy peer access) and
copies device to device (over NVLink between GPUs) on the posting thread's current stream: per source GPU one
``pxn_kernels.copy`` launch per message, bound once per piece lengths and replayed (``transport.fabric.gpu_copy``),
or one ``cudaMemcpyAsync`` per piece for a few pieces; then it synchronises that stream before reporting.

The doorbell is the socket fabrics' message protocol (``transport.fabric.socket_fabric``) without payload (several
sockets per peer, so large writes run as parallel copies): REQ (piece table) -> the target validates every piece
against its own regions, pins them (``deregister`` waits) and answers GRANT (per-piece status + what it describes
of the regions involved, which the writer checks bounds against again) -> the writer copies the granted pieces ->
DONE (per-piece status) -> the target unpins, delivers RECV_IMM in order and ACKs -> sender completions. The target
only describes regions it registered, and only pieces it accepted are ever copied.

Once a GRANT has described the regions a message needs, the writer keeps those descriptions, tagged with the
target's deregistration counter (an 8-byte memfd in the target, mapped read-only by the writer, bumped by every
``deregister``). While the counter has not moved, a message skips REQ / GRANT: the posting thread checks every
piece against the kept descriptions, copies, synchronises and completes the message itself, as an RDMA NIC
completes a write once its bytes are placed. A message without an immediate is not announced at all (it takes a
key outside the peer's sequence); one with an immediate is followed by a one-way NOTIFY (piece table + statuses),
and the target checks the pieces again against its own regions before it delivers RECV_IMM, in sequence order.
No hand-off to a sender thread and no ack to wait for. A post of ``WriteBatch``es (the engine's direct runs) into
one described region, from one local GPU into peer GPU memory or from host memory into peer host memory, skips the
piece table as well: checked on the batch's extremes (the engine's ``WriteBounds`` when it carries them, else
reductions of its arrays), copied (a bound batched-copy launch, or ``process_vm_writev`` of its arrays) and
completed by the posting thread. As for an RDMA write or the load/store path, a write racing
a ``deregister`` of its own destination is the caller's error (the GRANT path pins regions; this one cannot).
The posting thread copies a post's messages one after the other, so a post is one message (``message_bytes``),
not one per socket.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import time
from typing import Dict, List, Optional

import numpy as np

from transport.arrays import distinct
from transport.errors import FabricError, FabricUnavailable
from transport.fabric.base import (DEVICE_HOST, Capabilities, MemoryRegion, RegionSpans, WriteBatch,
                                   WriteBounds)
from transport.fabric.gpu_copy import BoundCopies, Pending
from transport.fabric.memory import cuda_stream, cuda_tensor, raw_view
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.ipc_ordered import OrderedPosts, batch_message, failed_statuses
from transport.fabric.ipc_peers import PeerRegions
from transport.fabric.messages import OutMsg, batch_messages
from transport.fabric.procmem import allow_peer_writes, process_vm_read, process_vm_write
from transport.fabric.region_counter import GenerationCounter
from transport.fabric.socket_fabric import SocketFabric
from transport.fabric.sockets import Sock, recv_exact
from transport.fabric.wire import (HDR, I64, MAGIC, ST_BOUNDS, ST_FAILED, ST_OK, T_DONE, T_GRANT, T_NOTIFY, T_REQ,
                                   VECTOR_MIN, seal)

log = logging.getLogger(__name__)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class IpcFabric(SocketFabric):
    """Same-host one-sided writes by direct copies (cross-memory attach for host memory, CUDA IPC for GPU).

    Options as ``SocketFabric`` (``connections_per_peer`` = parallel copy workers per peer, default
    min(4, cores); ``message_bytes`` default 16 MiB), and ``grant_timeout`` (seconds a writer waits for a GRANT).

    Its parts: the shared socket-message layer it builds on (``SocketFabric``), what its writer knows of the
    peers' regions (``PeerRegions``), its event-ordered posts (``OrderedPosts``).
    """

    name = "ipc"
    capabilities = Capabilities(selective_signaling=True, loadstore=True, completion_callback=True,
                               authenticated_rails=True, write_batches=True, event_ordered_writes=True,
                               inline_writes=True)
    # an ipc message is a doorbell round trip (REQ/GRANT/DONE/ACK), not payload: fewer, larger messages make large
    # calls far faster
    engine_options = {"message_bytes": 256 << 20}
    # No coalescing: a post of many pieces is already one batched-copy launch from the sources straight into the
    # target's memory, completed at the writer. A chunk would add a gather, a landing slot, the target's scatter
    # and its ack to the same bytes.
    # Relay slots of 64 MiB, one per lane: a relayed unit costs a fixed amount of host time (fill launch, post,
    # completion) whatever its size, and this wire moves 4 MiB far faster than that; the fewer the units, the
    # closer a relayed batch gets to its copies' speed.
    # Ring memory: 2 x 64 MiB (the default: 64 MiB). The landing pool holds two of these slots, 128 MiB per rail
    # shared by every sender: with 32 MiB a sender cuts its chunks to the pool's smaller slot and plans with a
    # planner of its own, and the one-GPU load/store rows measured 10-30 % slower that way (benchmarks/NOTES.md,
    # "The landing pool on one H200").
    config_defaults = {"coalesce_bytes": 0, "relay_slot_bytes": 64 << 20, "relay_slots": 1, "landing_slots": 2,
                       "landing_bytes": 128 << 20}


    def __init__(self, hostname: str = "127.0.0.1", port: int = 0, connections_per_peer: int = None,
                 message_bytes: int = 16 << 20, grant_timeout: float = 30.0, **kw):
        if connections_per_peer is None:
            connections_per_peer = max(2, min(4, os.cpu_count() or 2))
        super().__init__(hostname, port, connections_per_peer=connections_per_peer, message_bytes=message_bytes,
                         **kw)
        self.grant_timeout = float(grant_timeout)
        self.bound_copies = BoundCopies()  # GPU copies of the message path and of load/store writers
        self._pid = os.getpid()
        allow_peer_writes()
        # A random token at a known address: a connecting peer reads it back through process_vm_readv, which
        # proves both the ptrace permission and that the pid in our descriptor really is this process.
        self._probe_token = os.urandom(32)
        self._probe = ctypes.create_string_buffer(self._probe_token, 32)
        self._exports: Dict[int, dict] = {}
        # Bumped by every deregister. A writer that holds a peer's region descriptions (from an earlier GRANT)
        # and finds this counter unmoved copies at once and sends one NOTIFY instead of a REQ / GRANT round trip.
        self._gen = GenerationCounter()
        self._peers = PeerRegions(self._regions, self._gen)
        self._ordered = OrderedPosts(self._id, self.bound_copies, self._peers.mapped)
        self._start()

    def _descriptor_extra(self) -> dict:
        gen = self._gen.wire()
        return {"pid": self._pid, "boot": _boot_id(), "pidns": _pid_ns(), "probe": ctypes.addressof(self._probe),
                "token": self._probe_token.hex(), "gen_addr": gen["region_gen_addr"], "gen_fd": gen["region_gen_fd"]}

    def check_peer(self, d: dict) -> None:
        try:
            pid, boot, pidns, probe = int(d["pid"]), d["boot"], int(d["pidns"]), int(d["probe"])
            token = bytes.fromhex(d["token"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ipc: peer descriptor lacks pid/boot/pidns/probe/token: {e}") from e
        if boot != _boot_id() or pidns != _pid_ns():
            raise FabricUnavailable(f"ipc: peer {d.get('id')} is on another host or pid namespace "
                                    f"(boot {boot} / pidns {pidns}); use the tcp or verbs fabric")
        try:
            seen = process_vm_read(pid, probe, len(token))
        except OSError as e:
            raise FabricUnavailable(
                f"ipc: cannot access peer pid {pid} by cross-memory attach ({e}); it needs the same user and "
                f"ptrace permission (kernel.yama.ptrace_scope <= 1, no seccomp filter blocking "
                f"process_vm_readv/writev, or CAP_SYS_PTRACE); use the tcp fabric otherwise") from e
        if seen != token:
            raise FabricUnavailable(f"ipc: pid {pid} does not hold peer {d.get('id')}'s token: the descriptor does "
                                    f"not describe a live ipc fabric of this host")

    def _on_register(self, mr: MemoryRegion) -> None:
        if mr.device >= 0:
            try:
                self._exports[mr.rkey] = self._peers.cuda_api().export(mr.addr, mr.length, mr.device)
            except Exception:
                self._book.drop(mr)
                raise

    def deregister(self, mr: MemoryRegion) -> None:
        super().deregister(mr)
        self._exports.pop(mr.rkey, None)
        self._gen.bump()  # after the region is gone: a writer that read the old value still holds GRANT pins

    def access_info(self, mr: MemoryRegion) -> dict:
        """The region as ``_describe`` gives it (pid; for GPU memory the CUDA IPC handle): a same-host peer maps
        it once and then writes with its own loads/stores (``transport.fabric.loadstore``)."""
        return self._describe(mr)

    def local_writer(self, ep: SocketEndpoint, peer_info: dict):
        """A ``transport.fabric.loadstore.LoadStoreWriter`` into the process behind ``ep``, when its engine
        advertised its region counter in ``peer_info`` (its control hello: ``region_gen_addr``, ``region_gen``,
        ``region_gen_fd``, ``pid``) and that pid is the one this endpoint verified at connect; else None."""
        if "region_gen_addr" not in peer_info:
            return None
        if int(peer_info.get("pid", -1)) != self.peer_pid(ep):
            log.warning("peer %s: control pid %s differs from the ipc endpoint's %s; no load/store path",
                        ep.peer_id, peer_info.get("pid"), self.peer_pid(ep))
            return None
        from transport.fabric.loadstore import LoadStoreWriter  # it imports this module
        return LoadStoreWriter(self, ep, int(peer_info["region_gen_addr"]), int(peer_info.get("region_gen", 0)),
                               int(peer_info.get("region_gen_fd", -1)))

    def peer_pid(self, ep: SocketEndpoint) -> int:
        """The peer's pid, as verified at connect (it read back the token at the address its descriptor named)."""
        return int(ep.peer_desc["pid"])

    def map_gpu(self, access: dict, device: int) -> int:
        """Device pointer, valid in ``device``'s context, of the start of the peer allocation ``access``
        describes (``access["base"]``): opened once, cached until close."""
        return self._peers.mapped(access, device)

    def local_device(self, uuid: str) -> int:
        """This process's index of the GPU with ``uuid``; FabricError when it is not visible here."""
        return self._peers.local_index(uuid)

    def _describe(self, mr: MemoryRegion) -> dict:
        d = {"addr": mr.addr, "length": mr.length, "device": mr.device, "pid": self._pid}
        if mr.device >= 0:
            d.update(self._exports[mr.rkey])
        return d

    # --- target side ----------------------------------------------------------------------------------------
    def send_ctrl(self, ep: SocketEndpoint, s: Sock, payload: bytes) -> None:
        # Sent from the receiver thread itself: ipc messages are small, and a sender thread may be parked
        # waiting for a grant, so queueing behind it could deadlock two peers writing to each other.
        with s.send_lock:
            s.sock.sendall(seal(s.sess, payload))

    def _on_message(self, ep, s, typ, seq, table, payload, st, ack: bool = True) -> None:
        if typ == T_NOTIFY:
            self._on_notify(ep, s, seq, table, payload)
            return
        if typ != T_REQ or payload:
            raise ValueError(f"ipc fabric got message type {typ} with {payload} B payload")
        statuses, regions, pinned = self._validate_pieces(table)
        info = {}
        for mr in regions:
            if mr is not None and mr.rkey not in info:
                info[mr.rkey] = self._describe(mr)
        s.granted[seq] = (table, statuses, pinned)
        body = bytes(statuses) + json.dumps({str(k): v for k, v in info.items()}).encode()
        try:
            self.send_ctrl(ep, s, HDR.pack(MAGIC, T_GRANT, 0, 0, len(statuses), seq, len(body)) + body)
        except OSError:
            self._release(s, seq)
            raise

    def _on_notify(self, ep, s, seq: int, table, payload: int) -> None:
        """A writer copied without asking (its descriptions of our regions were current) and completed the message
        itself: check the pieces again against our regions, so that no RECV_IMM is delivered for a piece outside
        them, then deliver RECV_IMM in order as after a DONE. No ack: the writer waits for none."""
        if payload != len(table):
            raise ValueError(f"NOTIFY carries {payload} statuses for {len(table)} pieces")
        body = bytearray(payload)
        recv_exact(s.sock, memoryview(body))
        statuses, _, pinned = self._validate_pieces(table)
        self._unpin(pinned)
        for i, b in enumerate(body):
            if b and not statuses[i]:
                statuses[i] = b
            elif statuses[i] and not b:
                # cannot happen unless the writer's descriptions were stale: name it loudly
                log.error("ipc: writer %s copied piece %d (0x%x+%d) outside every region registered here",
                          ep.peer_id, i, int(table["addr"][i]), int(table["len"][i]))
        self.finish_message(ep, s, seq, table, statuses, ack=False)

    def _release(self, s: Sock, seq: int):
        g = s.granted.pop(seq, None)
        if g is not None:
            self._unpin(g[2])
        return g

    _OTHER_TYPES = (T_GRANT, T_DONE)

    def _on_other(self, ep, s, typ, count, seq, body) -> None:
        if typ == T_GRANT:
            with s.grant_cv:
                s.grants[seq] = (body[:count], body[count:])
                s.grant_cv.notify_all()
        elif typ == T_DONE:
            g = self._release(s, seq)
            if g is None:
                raise ValueError(f"DONE for unknown message {seq}")
            table, statuses, _ = g
            if len(body) != len(statuses):
                raise ValueError(f"DONE carries {len(body)} statuses for {len(statuses)} pieces")
            for i, b in enumerate(body):
                if b and not statuses[i]:
                    statuses[i] = b
            self.finish_message(ep, s, seq, table, statuses)
        else:
            raise ValueError(f"ipc fabric got unexpected message type {typ}")

    def _recv_loop(self, ep, s) -> None:
        try:
            super()._recv_loop(ep, s)
        finally:
            # a writer that died between GRANT and DONE must not keep our regions pinned
            for seq in list(s.granted):
                self._release(s, seq)

    # --- writer side ----------------------------------------------------------------------------------------
    def post_writes(self, ep: SocketEndpoint, requests) -> None:
        """As tcp's, but a post of ``WriteBatch`` items alone goes batch by batch through ``_post_batch_direct``
        (checked, copied and completed by this thread from the batch's own arrays) while the batches qualify; the
        rest become messages as on tcp. All checks come first: nothing is copied when one batch is bad."""
        requests = list(requests)
        if not requests or not all(isinstance(r, WriteBatch) for r in requests):
            super().post_writes(ep, requests)
            return
        self.validate(ep, [])
        self._post_checked_batches(ep, requests, [self.validate_batch(b) for b in requests])

    def validate_batch(self, b: WriteBatch) -> np.ndarray:
        """tcp's checks of a ``WriteBatch``. A batch that carries ``bounds`` (the engine's extremes of these same
        arrays, and its one key on each side) gets the same checks on those extremes, without reducing its arrays
        again; when they do not pass, the batch loses its bounds (nothing later relies on them) and tcp's checks
        of the arrays name the write at fault."""
        bd = getattr(b, "bounds", None)
        if bd is not None:
            mr = self._bounded_local(bd)
            if mr is not None:
                return np.full(b.count, mr.device, dtype=np.int64)
            b.bounds = None
        return super().validate_batch(b)

    def _bounded_local(self, bd: WriteBounds) -> Optional[MemoryRegion]:
        """The local region of ``bd.lkey`` when the extremes ``bd`` pass tcp's checks of a batch's arrays (lengths
        >= 1, addresses and ends inside 63 bits, a 32-bit rkey, every source inside that region); else None."""
        mr = self._regions.get(bd.lkey)
        if (mr is not None and bd.len_min > 0 and bd.local_min >= 0 and bd.remote_min >= 0
                and bd.local_end <= I64 and bd.remote_end <= I64 and 0 <= bd.rkey <= 0xFFFFFFFF
                and mr.addr <= bd.local_min and bd.local_end <= mr.addr + mr.length):
            return mr
        return None

    def write_inline(self, ep: SocketEndpoint, local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray,
                     bounds: WriteBounds, nbytes: int, wait: bool = True, stream=None) -> Optional[Pending]:
        """Capability ``inline_writes`` (see ``Fabric.write_inline``): the pieces are copied by the calling thread,
        as ``_post_batch_direct`` copies a posted batch, when every one goes from one local GPU into one peer GPU
        region, or from host memory into one peer host region, whose kept description is current (the peer
        deregistered nothing since a GRANT described it) and contains them all. Anything else, or a closed
        fabric or dead endpoint, returns None with nothing written: the message path's GRANT round trip, and its
        naming of a bad piece, stay with ``post_writes``. Host memory is written before this returns; a GPU copy
        is waited for when ``wait``. Raises ``FabricError`` (the endpoint failed: the target process is gone) or
        ``TransferError`` (the device copy failed)."""
        if self._closed or not isinstance(ep, SocketEndpoint) or ep.fabric is not self or not ep.alive:
            return None
        mr = self._bounded_local(bounds)
        if mr is None:
            return None
        reg = self._peers.bounded_target(ep, bounds, mr.device)
        if reg is None:
            return None
        if mr.device == DEVICE_HOST:
            return self._write_host(ep, local_addr, remote_addr, length, nbytes)
        return Pending(self._copy_to_gpu(mr.device, reg, local_addr, remote_addr, length,
                                         (nbytes, bounds.len_min, bounds.len_max), wait, stream))

    def write_inline_regions(self, ep: SocketEndpoint, local_addr: np.ndarray, remote_addr: np.ndarray,
                             length: np.ndarray, spans: RegionSpans, nbytes: int, wait: bool = True,
                             stream=None) -> Optional[Pending]:
        """Capability ``inline_writes`` for a batch over several regions (see ``Fabric.write_inline_regions``):
        as ``write_inline`` when every local region of ``spans`` is registered here and covers its span, on one
        device, and every peer region's kept description is current, on the same side (host or GPU), and covers
        its span. A GPU copy maps each piece into its peer region's mapping here: one launch for the batch."""
        if self._closed or not isinstance(ep, SocketEndpoint) or ep.fabric is not self or not ep.alive:
            return None
        if not (spans.len_min > 0 and spans.local_min >= 0 and spans.remote_min >= 0 and spans.local_end <= I64
                and spans.remote_end <= I64):
            return None
        checked = self._peers.checked_spans(ep, spans)
        if checked is None:
            return None
        dev, shift = checked
        if dev == DEVICE_HOST:
            return self._write_host(ep, local_addr, remote_addr, length, nbytes)
        stats = (nbytes, spans.len_min, spans.len_max)
        if spans.remote_index is None:  # one peer region: one shift, added while the descriptors are staged
            return Pending(self._copy_mapped(dev, local_addr, remote_addr, length, stats, wait, stream, shift))
        return Pending(self._copy_mapped(dev, local_addr, remote_addr + shift[spans.remote_index], length, stats,
                                         wait, stream))

    def _write_host(self, ep: SocketEndpoint, local_addr, remote_addr, length, nbytes: int) -> Pending:
        """The inline write of checked host pieces: one ``process_vm_writev`` into the peer process."""
        try:
            process_vm_write(int(ep.peer_desc["pid"]), local_addr, remote_addr, length, total=nbytes)
        except OSError as e:
            ep.fail(f"send failed: {e}")  # as on the message path: the target process is unreachable
            raise FabricError(f"ipc write to {ep.peer_id} failed: {e}") from e
        return Pending()

    def _copy_to_gpu(self, dev: int, reg: dict, local_addr, remote_addr, length, length_stats=None,
                     wait: bool = True, stream=None) -> list:
        """Copy piece i from ``local_addr[i]`` on GPU ``dev`` to ``remote_addr[i]`` in the peer GPU region ``reg``
        (opened here on ``dev``) on ``stream`` (a ``torch.cuda.Stream`` of ``dev``; default: the calling thread's
        current stream of ``dev``), and wait for it, or not (``wait``: then the work ``BoundCopies.finish``
        returns). ``length_stats``: (sum, min, max) of ``length`` when known."""
        return self._copy_mapped(dev, local_addr, remote_addr, length, length_stats, wait, stream,
                                 self._peers.mapped(reg, dev) - reg["base"])

    def _copy_mapped(self, dev: int, local_addr, dst, length, length_stats, wait: bool, stream,
                     dst_shift: int = 0) -> list:
        """``_copy_to_gpu`` with the destinations translated into their mappings on ``dev`` (``dst``, or ``dst``
        plus ``dst_shift`` bytes each)."""
        copies = self.bound_copies
        return copies.finish([copies.copy(dev, local_addr, dst, length, length_stats, stream, dst_shift)],
                             wait=wait, stream=stream)

    def _post_checked_batches(self, ep: SocketEndpoint, batches, devices) -> None:
        """Post checked ``WriteBatch``es (``devices``: each write's source device, from ``validate_batch``) batch
        by batch through ``_post_batch_direct`` while they qualify, the rest as messages."""
        for i, (b, dev) in enumerate(zip(batches, devices)):
            if not self._post_batch_direct(ep, b, dev):
                self._send(ep, [m for b_, d_ in zip(batches[i:], devices[i:])
                                for m in batch_messages(b_, d_, self.message_target, len(ep.socks))])
                return

    def post_writes_after(self, ep: SocketEndpoint, requests, after):
        """``post_writes``, ordered on the GPU after the CUDA events ``after`` (the sources' producers) instead of
        after a host wait (capability ``event_ordered_writes``). A post of ``WriteBatch`` items from one local GPU
        into one described peer GPU region is launched on a stream of that GPU that waits for ``after``, and
        completes from the fabric's completer thread once the copy has run; the return value is an event after
        which the sources may be overwritten (the writes have read them). Anything else waits for ``after`` on
        the host, posts as ``post_writes`` and returns None (the sources are free at completion). Checks come
        first, as in ``post_writes``: nothing is posted when a request is bad."""
        requests = list(requests)
        if not requests or not all(isinstance(r, WriteBatch) for r in requests):
            return super().post_writes_after(ep, requests, after)
        self.validate(ep, [])
        devices = [self.validate_batch(b) for b in requests]
        target = self._direct_target(ep, requests, devices)
        if target is not None and target[0] != DEVICE_HOST:  # host memory: no GPU stream to order on
            return self._ordered.post(ep, requests, target[0], target[1], after)
        for event in after:
            event.synchronize()
        self._post_checked_batches(ep, requests, devices)  # checked above
        return None

    def _direct_target(self, ep: SocketEndpoint, batches, devices):
        """(source device, the peer's region description) when every write of ``batches`` goes from one local
        GPU into one peer GPU region, or from host memory into one peer host region, whose description is current
        and contains it; else None."""
        # one batch with bounds (checked by ``validate_batch``): its one rkey, source device and remote extremes
        # without reducing its arrays
        bd = getattr(batches[0], "bounds", None) if len(batches) == 1 else None
        if bd is not None:
            dev = int(devices[0][0])  # one local region holds every source: one device
            reg = self._peers.bounded_target(ep, bd, dev)
            return None if reg is None else (dev, reg)
        keys = distinct(batches[0].rkey) if len(batches) == 1 else distinct(np.concatenate([b.rkey for b in batches]))
        if len(keys) != 1:
            return None
        info, _ = self._peers.current_info(ep, None, keys)
        if info is None:
            return None
        reg = info[keys[0]]
        src_devs = distinct(devices[0]) if len(devices) == 1 else distinct(np.concatenate(devices))
        if len(src_devs) != 1 or (src_devs[0] == DEVICE_HOST) != (reg["device"] == DEVICE_HOST):
            return None
        lo, hi = reg["addr"], reg["addr"] + reg["length"]
        for b in batches:
            if int(b.remote_addr.min()) < lo or int((b.remote_addr + b.length).max()) > hi:
                return None
        return src_devs[0], reg

    def _regions_target(self, ep: SocketEndpoint, b: WriteBatch, devices: np.ndarray):
        """(source device, the peer's descriptions of the batch's regions by position, each piece's position in
        them, the layout's cache of each piece's shift into its region's mapping by source GPU) when every write
        of the checked batch ``b`` goes from one local device into peer regions on the same side (host or GPU)
        whose descriptions are current and each contains its pieces; else None. For one region the position and
        the cache are None, and for host memory the cache. ``devices``: each write's source device
        (``validate_batch``)."""
        src_devs = distinct(devices)
        if len(src_devs) != 1:
            return None
        dev = src_devs[0]
        rk = b.rkey
        layout = None
        if rk.size > 1 and rk.dtype == np.int64:
            lkey = (ep.peer_id, rk.tobytes())
            layout = self._peers.target_layouts.get(lkey)
            if layout is not None:
                reader = self._peers.gen_reader(ep)
                if reader is None or layout[0] != (reader.read(), self._peers.changes):
                    layout = None
        if layout is None:
            keys = distinct(rk)
            changes = self._peers.changes  # before the descriptions are read: a GRANT after them retires the entry
            info, gen = self._peers.current_info(ep, None, keys)
            if info is None:
                return None
            regs = [info[key] for key in keys]
            if len(keys) == 1:
                _, lo, hi, on_host = self._peers.remembered(("bounds",), regs, self._peers.bounds_of)
                if not (on_host.all() if dev == DEVICE_HOST else not on_host.any()):
                    return None
                ok = lo[0] <= int(b.remote_addr.min()) and int((b.remote_addr + b.length).max()) <= hi[0]
                return (dev, regs, None, None) if ok else None
            layout = self._peers.remember_target(ep, rk, keys, regs, (gen, changes))
        _, regs, k, lo, hi, on_host, shifts = layout
        if not (on_host if dev == DEVICE_HOST else on_host is False):
            return None  # regions on both sides of the host / GPU line, or on the other side than the sources
        ra = b.remote_addr
        if not ((lo <= ra) & (ra + b.length <= hi)).all():
            return None
        return dev, regs, k, (None if dev == DEVICE_HOST else shifts)

    def _post_batch_direct(self, ep: SocketEndpoint, b: WriteBatch, devices: np.ndarray) -> bool:
        """Copy and complete a checked batch here when every piece goes from one local GPU into peer GPU regions,
        or from host memory into peer host regions, whose descriptions are current and contain their pieces;
        False (nothing done) otherwise, for the message path (which names the piece at fault, and handles the
        mixed cases and the GRANT round trip).

        Why: a batch's piece table, and its checks one message field at a time, cost more host time than the
        copy of most batches; here the checks are the extremes of the batch's arrays against the region, as
        ``_copy`` makes them piece by piece."""
        if b.bounds is not None:
            target = self._direct_target(ep, [b], [devices])
            if target is None:
                return False
            dev, reg = target
            regs, k = [reg], None
        else:  # a batch over several peer regions (sglang's region per layer) has no bounds: per piece
            target = self._regions_target(ep, b, devices)
            if target is None:
                return False
            dev, regs, k, shifts = target
        m = batch_message(b)
        ep.enqueue([m], queue=False, local=[True])  # completes in posting order with the endpoint's other work
        statuses = bytes(b.count)
        if dev == DEVICE_HOST:
            try:
                # the pid was verified at connect (token read back), not taken from a GRANT
                process_vm_write(int(ep.peer_desc["pid"]), b.local_addr, b.remote_addr, b.length, total=b.nbytes)
            except OSError as e:
                # as a failed copy on the message path: the link is unusable (ESRCH: the target process is gone);
                # fail() completes this batch with PeerLost, so it fails over
                log.debug("ipc direct host write to %s failed", ep.peer_id, exc_info=True)
                ep.fail(f"send failed: {e}")
                return True
            ep.on_ack(m.seq, statuses)
            return True
        bd = b.bounds
        try:
            if k is None:
                self._copy_to_gpu(dev, regs[0], b.local_addr, b.remote_addr, b.length,
                                  None if bd is None else (b.nbytes, bd.len_min, bd.len_max))
            else:
                shift = shifts.get(dev)
                if shift is None:  # each piece's shift into its region's mapping here: once per layout and GPU
                    shift = shifts[dev] = self._peers.shifts_on(regs, dev)[k]
                self._copy_mapped(dev, b.local_addr, b.remote_addr + shift, b.length, None, True, None)
        except Exception as e:  # noqa: BLE001 — a CUDA failure fails this batch, not the link
            log.error("ipc GPU copy of %d piece(s) to %s failed: %s", b.count, ep.peer_id, e)
            statuses = failed_statuses(m, b)
        ep.on_ack(m.seq, statuses)
        return True

    def _send(self, ep: SocketEndpoint, msgs: List[OutMsg]) -> None:
        """When the peer's descriptions of every region involved are current, the copies and their NOTIFYs run in
        the posting thread (no hand-off to a socket's sender thread, no GRANT round trip); else the messages
        queue for the sender threads as on tcp."""
        infos = [self._peers.current_info(ep, m.table)[0] for m in msgs]
        if any(info is None for info in infos):
            ep.enqueue(msgs)
            return
        local = [not m.table["flags"].any() for m in msgs]
        for m, s, info in zip(msgs, ep.enqueue(msgs, queue=False, local=local), infos):
            if not ep.alive:
                return  # fail() completed the rest with PeerLost
            try:
                self._notify(ep, s, m, info)
            except Exception as e:  # noqa: BLE001 — as in the sender thread: the link is unusable
                log.debug("inline send on %s/%d failed", ep.peer_id, s.index, exc_info=True)
                ep.fail(f"send failed: {e}")
                return

    def message_target(self, total: int, nsocks: int) -> int:
        # Once the peer's regions are described, every message of a post is copied by the posting thread, one
        # after the other: cutting a post per socket would only add a launch and a synchronise per message.
        return max(64 << 10, self.message_bytes)

    def _notify(self, ep: SocketEndpoint, s: Sock, msg: OutMsg, info: dict) -> None:
        """One message instead of REQ / GRANT / DONE: copy now (the same bounds checks against the peer's own
        descriptions, ``info``, as after a GRANT), then tell the peer what landed."""
        table = msg.table
        statuses = bytearray(len(table))
        self._copy_checked(ep, s, msg, statuses, info)
        # Like an RDMA write, which the writer's own NIC completes once the bytes are placed, the message completes
        # here, its copies synchronised: the target's recheck would only repeat the check just made against the
        # same current descriptions. Without an immediate the target has nothing to deliver and is not told at all
        # (``enqueue`` gave the message a key outside its sequence); with one, NOTIFY carries the piece table for
        # the target's RECV_IMM and is not acked.
        if msg.seq >= 0:
            tb = table.tobytes()
            with s.send_lock:
                s.sock.sendall(seal(s.sess, HDR.pack(MAGIC, T_NOTIFY, 0, 0, len(table), msg.seq,
                                                      len(tb) + len(statuses)) + tb + bytes(statuses)))
        ep.on_ack(msg.seq, bytes(statuses))

    def transmit(self, ep: SocketEndpoint, s: Sock, msg: OutMsg) -> None:
        table = msg.table
        info, gen = self._peers.current_info(ep, table)
        if info is not None:
            self._notify(ep, s, msg, info)
            return
        tb = table.tobytes()
        with s.send_lock:
            s.sock.sendall(seal(s.sess, HDR.pack(MAGIC, T_REQ, 0, 0, len(table), msg.seq, len(tb)) + tb))
        deadline = time.monotonic() + self.grant_timeout
        with s.grant_cv:
            while msg.seq not in s.grants:
                if not ep.alive:
                    return  # fail() already completed this message with PeerLost
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no GRANT for message {msg.seq} within {self.grant_timeout} s")
                s.grant_cv.wait(0.5)
            st_bytes, info_json = s.grants.pop(msg.seq)
        statuses = bytearray(st_bytes)
        info = {int(k): v for k, v in json.loads(info_json or b"{}").items()}
        if gen is not None and info:
            # described while pinned, at counter value >= gen: valid for as long as the counter stays at gen
            self._peers.record_grant(ep, info, gen)
        self._copy_checked(ep, s, msg, statuses, info)
        with s.send_lock:
            s.sock.sendall(seal(s.sess, HDR.pack(MAGIC, T_DONE, 0, 0, len(statuses), msg.seq, len(statuses))
                                 + bytes(statuses)))

    def _copy_checked(self, ep: SocketEndpoint, s: Sock, msg: OutMsg, statuses: bytearray, info: dict) -> None:
        try:
            self._copy(ep, s, msg, statuses, info)
        except OSError as e:
            if e.errno in (3,):  # ESRCH: the target process is gone
                raise ConnectionError(f"peer process gone: {e}") from e
            raise

    def _copy(self, ep: SocketEndpoint, s: Sock, msg: OutMsg, statuses: bytearray, info: dict) -> None:
        """Copy the pieces of ``msg`` that are ``ST_OK`` in ``statuses``, after checking each against the region
        the target described for its rkey (``info``); a piece outside it becomes ``ST_BOUNDS``. Whole-array numpy:
        a Python step per piece would be a large share of a post of many pieces."""
        t = msg.table
        n = len(t)
        pid = int(ep.peer_desc["pid"])  # verified at connect (token read back), not taken from the GRANT
        if n <= VECTOR_MIN:
            self._copy_few(ep, s, msg, statuses, info, pid)
            return
        st = np.frombuffer(statuses, dtype=np.uint8)  # a writable view: updates land in ``statuses``
        addr, ln = t["addr"].astype(np.int64), t["len"].astype(np.int64)
        waddr, wlen, rkey = t["waddr"].astype(np.int64), t["wlen"].astype(np.int64), t["rkey"].astype(np.int64)
        keys = distinct(rkey)
        regs = [info.get(k) for k in keys]
        known, lo, hi, on_host = self._peers.remembered(("bounds",), regs, self._peers.bounds_of)
        k = np.searchsorted(np.asarray(keys, dtype=np.int64), rkey) if len(keys) > 1 else np.zeros(n, np.int64)
        # defense in depth: the target granted it, and what it described must contain it too
        inside = (known[k] & (lo[k] <= waddr) & (waddr + wlen <= hi[k]) & (waddr <= addr)
                  & (addr + ln <= waddr + wlen))
        ok = st == ST_OK
        st[ok & ~inside] = ST_BOUNDS
        ok &= inside
        src = msg.source_array()
        s_addr, s_dev = src[:, 0], src[:, 2]
        to_host = ok & on_host[k]
        pvm = to_host & (s_dev == DEVICE_HOST)
        if pvm.any():
            process_vm_write(pid, s_addr[pvm], addr[pvm], ln[pvm])
        for i in np.nonzero(to_host & (s_dev != DEVICE_HOST))[0].tolist():  # GPU source -> remote host memory
            host = cuda_tensor(int(s_addr[i]), int(ln[i]), int(s_dev[i])).cpu()
            process_vm_write(pid, [host.data_ptr()], [int(addr[i])], [int(ln[i])])
        to_gpu = ok & ~on_host[k]
        if to_gpu.any():
            try:
                self._copy_gpu(s, np.nonzero(to_gpu)[0], s_addr, s_dev, addr, ln, k, regs)
            except Exception as e:  # noqa: BLE001 — a CUDA failure fails these pieces, not the link
                log.error("ipc GPU copy of %d piece(s) to %s failed: %s", int(to_gpu.sum()), ep.peer_id, e)
                st[to_gpu] = ST_FAILED

    def _copy_few(self, ep: SocketEndpoint, s: Sock, msg: OutMsg, statuses: bytearray, info: dict, pid: int) -> None:
        """``_copy`` for a message of a few pieces (an ack, a chunk): one Python step per piece costs less than the
        two dozen numpy calls of the whole-array path."""
        t = msg.table
        addrs, lens, waddrs, wlens, rkeys = (t[k].tolist() for k in ("addr", "len", "waddr", "wlen", "rkey"))
        pvm = ([], [], [])
        gpu = []
        for i, (src_addr, _, src_dev) in enumerate(msg.sources()):
            if statuses[i] != ST_OK:
                continue
            reg = info.get(rkeys[i])
            # defense in depth: the target granted it, and what it described must contain it too
            if reg is None or not (reg["addr"] <= waddrs[i] and waddrs[i] + wlens[i] <= reg["addr"] + reg["length"]
                                   and waddrs[i] <= addrs[i] and addrs[i] + lens[i] <= waddrs[i] + wlens[i]):
                statuses[i] = ST_BOUNDS
                continue
            if reg["device"] != DEVICE_HOST:
                gpu.append(i)
            elif src_dev == DEVICE_HOST:
                pvm[0].append(src_addr)
                pvm[1].append(addrs[i])
                pvm[2].append(lens[i])
            else:  # GPU source -> remote host memory
                host = cuda_tensor(src_addr, lens[i], src_dev).cpu()
                process_vm_write(pid, [host.data_ptr()], [addrs[i]], [lens[i]])
        if pvm[2]:
            process_vm_write(pid, *pvm)
        if gpu:
            keys = sorted({rkeys[i] for i in gpu})
            src = msg.source_array()
            idx = np.asarray(gpu, dtype=np.int64)
            k = np.searchsorted(np.asarray(keys, dtype=np.int64), t["rkey"].astype(np.int64))
            try:
                self._copy_gpu(s, idx, src[:, 0], src[:, 2], t["addr"].astype(np.int64), t["len"].astype(np.int64),
                               k, [info[key] for key in keys])
            except Exception as e:  # noqa: BLE001 — a CUDA failure fails these pieces, not the link
                log.error("ipc GPU copy of %d piece(s) to %s failed: %s", len(gpu), ep.peer_id, e)
                for i in gpu:
                    statuses[i] = ST_FAILED

    def _copy_gpu(self, s: Sock, idx: np.ndarray, s_addr, s_dev, addr, ln, k, regs) -> None:
        """Copy pieces ``idx`` into the target's GPU memory through its IPC-mapped allocations (``k``: each piece's
        index into ``regs``, the target's descriptions): per source GPU, on the posting thread's current stream
        (from the caller's thread: after whatever the caller queued there), one batched-copy launch for every
        piece, large ones included (it runs at a contiguous copy's speed, over NVLink between GPUs), bound once
        per lengths and replayed (``BoundCopies``), or a ``cudaMemcpyAsync`` per piece for a few pieces whose
        lengths were not seen before (a chunk, a relay slot); then one synchronise per source GPU."""
        import torch
        dst_dev_of = [self._peers.local_index(r["uuid"]) if r is not None and r["device"] != DEVICE_HOST else -1
                      for r in regs]
        launched = []
        try:
            for dev in distinct(s_dev[idx]):
                sel = idx[s_dev[idx] == dev]
                if dev == DEVICE_HOST:  # host source -> remote GPU: rare (host staging of a GPU-less sender)
                    for i in sel.tolist():
                        r = regs[k[i]]
                        dst = self._peers.mapped(r, dst_dev_of[k[i]]) + (int(addr[i]) - r["base"])
                        stream = cuda_stream(s.tx_cache, dst_dev_of[k[i]])
                        with torch.cuda.device(dst_dev_of[k[i]]), torch.cuda.stream(stream):
                            host = torch.frombuffer(raw_view(int(s_addr[i]), int(ln[i]), writable=True),
                                                    dtype=torch.uint8)
                            cuda_tensor(dst, int(ln[i]), dst_dev_of[k[i]]).copy_(host)
                        stream.synchronize()
                    continue
                # the target's allocations mapped in the source GPU's context: it pushes (over NVLink between GPUs)
                ks = k[sel]
                shift = self._peers.remembered(("shift", dev), regs, lambda rs: self._peers.shifts_on(rs, dev))
                dst = addr[sel] + shift[ks]
                launched.append(self.bound_copies.copy(dev, s_addr[sel], dst, ln[sel]))
        finally:
            self.bound_copies.finish(launched, wait=True)

    def _on_close(self) -> None:
        self._ordered.close()
        self._gen.close()
        self._peers.close()
