"""RDMA verbs fabric over pyverbs (rdma-core v59 API): RC queue pairs, one-sided WRITE / WRITE_WITH_IMM.

Constructing it without pyverbs or without a usable port raises ``FabricUnavailable`` saying which is missing
and how to install it. In CI it runs on ``softverbs`` (a software model of pyverbs v59 and of RC semantics);
GPU memory runs on the model's GPUDirect mode (dma-buf MRs over CUDA memory); it has not run on an RDMA NIC.

* **Port and GID** (``verbs_ports``). The port is the one asked for (``device``, ``port_num``: a topology rail)
  or the first ACTIVE port with a usable GID. On RoCE the GID is, in order of preference, a RoCE v2 IPv4-mapped
  one (``::ffff:a.b.c.d``), any RoCE v2 one, any non-empty one; an all-zero entry (a port with no IP address) is
  never used. ``gid_index`` / ``PXN_GID_INDEX`` overrides the choice, as ``NCCL_IB_GID_INDEX`` does.
* **Memory.** Host memory by ``MR(pd, length, access, address=addr)``. GPU memory by dma-buf, else a peer-memory
  MR, and the ordering GPU memory needs on both sides: ``transport.fabric.verbs_gpu``. Writes from GPU memory
  never go inline. A receiver calls ``flush_gpu_writes(device)`` before GPU work reads what peers wrote there
  (capability ``gpu_write_flush``).
* **Threads and pyverbs objects.** Real pyverbs dies (SIGSEGV) on a call through a closed CQ, QP or MR. The
  progress thread owns every endpoint's CQ and QP: it polls them and is the only thread that destroys them
  (``VerbsEndpoint.destroy``, for endpoints ``_settle`` handed it); other threads post or move a QP to the error
  state under the endpoint's lock, only while it is not destroyed. ``close`` destroys what is left once the
  progress thread has ended, and leaves the context open (with a warning) if that thread did not end.
* **Work requests** are built once per QP and reused (``SendChain``): real pyverbs never frees them.
* **Connection.** One RC QP (and its own CQ) per peer. QP number, PSN, GID, LID and MTU travel over a TCP
  socket that first proves the shared secret (``transport.auth``) and then stays open as a liveness channel:
  its EOF fails the endpoint at once instead of after the QP's retries. The QPs are made, brought up and
  exchanged by ``verbs_qp.QpSetup``; one thread watches every channel (``verbs_endpoint.ChannelWatch``).
* **Posting.** One ``post_send`` chain per ``post_writes`` call (split only where the send queue is full), with
  selective signalling: only the last work request of a chain is signalled, and the completions of the others
  are derived from it, since an RC send queue completes in order. Writes up to the QP's ``max_inline_data``
  go with ``IBV_SEND_INLINE``. A ``WriteBatch`` is many work requests and one completion.
* **Errors follow RC.** The target's NIC checks rkeys and bounds: a refused write completes with
  ``IBV_WC_REM_ACCESS_ERR`` (``RegionError``) and moves both QPs to the error state. The work requests after it
  were not executed and complete with ``PeerLost`` naming the refused one; the endpoint is dead, both sides
  learn it, and ``connect`` makes a new QP pair (the engine re-sends the lost work on its other rails or on the
  new connection). No ACK within ``timeout`` x (``retry_cnt`` + 1) fails the endpoint the same way.
* Receives are pre-posted for WRITE_WITH_IMM (each consumes one; the progress thread posts it again).
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from transport import auth
from transport.errors import FabricClosed, FabricError, PeerLost, RegionError, UnknownPeer
from transport.fabric.base import (
    Capabilities, DEVICE_HOST, IMM_MAX, Completion, CompletionQueue, Endpoint, Fabric, MemoryRegion, Opcode, WriteBatch,
    WriteRequest, check_range,
)
from transport.fabric.verbs_endpoint import ChannelWatch, Posted, VerbsEndpoint, recv_json, send_json
from transport.fabric.verbs_gpu import DMABUF_MODULE, GpuFlush, register_gpu
from transport.fabric.verbs_qp import RECV_WR_ID, QpSetup
from transport.fabric.verbs_ports import (
    INSTALL_HINT, PortChoice, PortStatus, choose_port, gid_index_from_env, import_pyverbs, port_table, usable_port,
)

# the port names are re-exported: the engine, the Mooncake layer and the tests ask this module for them
__all__ = ["ACK_TIMEOUT_EXP", "DMABUF_MODULE", "INSTALL_HINT", "MAX_MESSAGE", "PortChoice", "PortStatus",
           "VerbsEndpoint", "VerbsFabric", "gid_index_from_env", "port_table", "usable_port"]

log = logging.getLogger(__name__)

MAX_MESSAGE = 0x7FFFFFFF
"""Largest write one work request carries here (bytes); longer pieces are refused with a ``ValueError``."""

ACK_TIMEOUT_EXP = 14
"""Default local ACK timeout exponent: 4.096 us x 2^14 = 67 ms per try; with ``retry_cnt`` 7 a peer that stopped
acknowledging fails the endpoint within about 0.5 s (the liveness socket usually tells sooner)."""


class VerbsFabric(Fabric):
    """pyverbs RC fabric. Options: ``device`` (RDMA device name) and ``port_num`` (default: the first ACTIVE port
    with a usable GID), ``gid_index`` (default ``PXN_GID_INDEX``, else chosen: see the module docstring),
    ``port`` (TCP port of the connection-exchange listener, 0 = ephemeral), ``max_send_wr`` / ``max_recv_wr``
    (queue depths per QP), ``max_inline`` (bytes asked for as the QP's ``max_inline_data``; the QP's answer is
    used), ``cq_batch`` (WCs per poll), ``connect_timeout`` (seconds for the connection exchange),
    ``ack_timeout`` (seconds without an ACK before a write fails: sets the QP's ``timeout`` and ``retry_cnt``),
    ``secret`` (``transport.auth``: the exchange proves it before any QP is made, and its messages carry the
    connection's tags; None: ``PXN_SECRET``, else the per-user secret file on loopback), ``insecure`` (run
    without a secret on another address: ``transport.auth.resolve_secret``), ``handshake_timeout`` and
    ``guard_claims`` (the engine's: see ``expect_peer``), ``gdr_flush`` (how writes into GPU memory are made
    visible to the GPU: ``"auto"``, ``"cuda"``, ``"read"`` or ``"none"``; see ``transport.fabric.verbs_gpu``)."""

    name = "verbs"
    capabilities = Capabilities(nic_ports=True, selective_signaling=True, write_batches=True, completion_callback=True,
                               authenticated_rails=True, refusal_fails_endpoint=True, gpu_write_flush=True)

    def __init__(self, hostname: str = "127.0.0.1", port: int = 0, device: Optional[str] = None,
                 port_num: Optional[int] = None, gid_index: Optional[int] = None, max_send_wr: int = 4096,
                 max_recv_wr: int = 1024, max_inline: int = 256, cq_batch: int = 64, connect_timeout: float = 10.0,
                 ack_timeout: Optional[float] = None, secret=None, handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
                 guard_claims: bool = False, insecure: Optional[bool] = None, gdr_flush: str = "auto"):
        for what, value in (("max_send_wr", max_send_wr), ("max_recv_wr", max_recv_wr), ("cq_batch", cq_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"verbs: {what} must be an int >= 1, got {value!r}")
        if isinstance(max_inline, bool) or not isinstance(max_inline, int) or max_inline < 0:
            raise ValueError(f"verbs: max_inline must be an int >= 0, got {max_inline!r}")
        if not connect_timeout > 0:
            raise ValueError(f"verbs: connect_timeout must be > 0 seconds, got {connect_timeout!r}")
        if ack_timeout is not None and not ack_timeout > 0:
            raise ValueError(f"verbs: ack_timeout must be > 0 seconds, got {ack_timeout!r}")
        self.gpu_flush = GpuFlush(self, gdr_flush)  # checks gdr_flush before anything is opened
        self._secret = auth.resolve_secret(secret, hostname, insecure)
        self.v = v = import_pyverbs()
        self.e = e = v["e"]
        if gid_index is None:
            gid_index = gid_index_from_env()
        self.port_choice = choice = choose_port(v, device, port_num, gid_index)
        self.device, self.port_num, self.gid_index, self.gid = choice.device, choice.port_num, choice.gid_index, \
            choice.gid
        self.max_send_wr, self.max_recv_wr, self.max_inline, self.cq_batch = max_send_wr, max_recv_wr, max_inline, \
            cq_batch
        self.connect_timeout = float(connect_timeout)
        self.timeout_exp, self.retry_cnt = _qp_timeout(ack_timeout)
        self.ctx = v["Context"](name=self.device)
        self.pd = v["PD"](self.ctx)
        self.access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        # 64 host bytes (LOCAL_WRITE) where receives and the GPUDirect flush READs put their bytes
        self.scratch_mr = v["MR"](self.pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
        self._qps = QpSetup(self)  # makes and connects the QPs
        self._lock = threading.RLock()
        self._built = threading.Condition(self._lock)  # _builders reached 0
        self._builders = 0  # threads inside _building()
        self._closed = False
        self._regions: Dict[int, tuple] = {}  # lkey -> (MemoryRegion, pyverbs MR, dmabuf fd or None)
        self._gpu_lkeys: set = set()  # lkeys of GPU regions: their writes never go inline
        self._eps: Dict[str, VerbsEndpoint] = {}
        self._live: List[VerbsEndpoint] = []  # endpoints whose CQ the progress thread polls
        self._retiring: "collections.deque[VerbsEndpoint]" = collections.deque()  # settled: to destroy
        self._claims = auth.RailClaims(guard_claims)
        self._connecting: Dict[str, threading.Lock] = {}  # peer id -> held while connecting to it
        self._watch = ChannelWatch(self._channel_lost, lambda: self._closed)  # every endpoint's liveness socket
        self._cq_out = CompletionQueue()
        self.counts = collections.Counter()  # what wire_counts() reports
        try:
            self._listener = socket.create_server((hostname, port))
        except OSError as ex:
            self._release_verbs()
            raise FabricError(f"verbs: cannot listen on {hostname}:{port}: {ex}") from ex
        self.hostname, self.port = hostname, self._listener.getsockname()[1]
        self._id = f"{hostname}:{self.port}"
        self.gate = auth.Gate(f"verbs {self._id}", self._incoming, handshake_timeout=handshake_timeout)
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True, name="pxn-verbs-accept"),
                         threading.Thread(target=self._progress_loop, daemon=True, name="pxn-verbs-progress"),
                         threading.Thread(target=self._watch_loop, daemon=True, name="pxn-verbs-watch")]
        for t in self._threads:
            t.start()
        log.info("verbs %s: %s port %d, GID index %d (%s), %s", self._id, self.device, self.port_num,
                 self.gid_index, self.gid, choice.link_layer)

    # --- registration ---------------------------------------------------------------------------------------
    @property
    def local_id(self) -> str:
        return self._id

    def check_open(self):
        if self._closed:
            raise FabricClosed(f"verbs fabric {self._id} is closed")

    def register(self, addr: int, length: int, device: int = DEVICE_HOST) -> MemoryRegion:
        self.check_open()
        check_range(addr, length, "register")
        if isinstance(device, bool) or not isinstance(device, int) or device < DEVICE_HOST:
            raise ValueError(f"device must be -1 (host) or a CUDA index, got {device!r}")
        fd = None
        try:
            with self._building():  # not while close releases the PD
                if device == DEVICE_HOST:
                    mr = self.v["MR"](self.pd, length, self.access, address=addr)
                else:
                    mr, fd = register_gpu(self.v, self.pd, addr, length, device, self.access, self.device)
        except FabricError:
            raise
        except Exception as ex:  # noqa: BLE001 — PyverbsRDMAError carries errno text
            raise FabricError(f"verbs: cannot register 0x{addr:x}+{length} on device {device} "
                              f"({self.device}): {ex}") from ex
        region = MemoryRegion(addr=addr, length=length, lkey=mr.lkey, rkey=mr.rkey, device=device)
        with self._lock:
            self._regions[mr.lkey] = (region, mr, fd)
            if device != DEVICE_HOST:
                self._gpu_lkeys.add(region.lkey)
        return region

    def deregister(self, mr: MemoryRegion) -> None:
        self.check_open()
        with self._lock:
            entry = self._regions.get(getattr(mr, "lkey", None))
            if entry is None or entry[0] != mr:
                raise RegionError(f"deregister: region {mr!r} is not registered with {self._id}")
            del self._regions[mr.lkey]
            self._gpu_lkeys.discard(mr.lkey)
        entry[1].close()
        if entry[2] is not None:
            os.close(entry[2])

    # --- connection -----------------------------------------------------------------------------------------
    def descriptor(self) -> bytes:
        self.check_open()
        return json.dumps({"fabric": "verbs", "id": self._id, "host": self.hostname, "port": self.port,
                           "gid": self.gid}).encode()

    @contextlib.contextmanager
    def _building(self):
        """Held by a thread that makes a QP pair (``_connect``, ``_incoming``) until the endpoint is registered (the
        progress thread owns it then), or registers memory: ``close`` waits for such threads before it releases
        the context, so none of them calls into a closed context or PD (SIGSEGV on real pyverbs)."""
        with self._lock:
            if self._closed:
                raise FabricClosed(f"verbs fabric {self._id} is closed")
            self._builders += 1
        try:
            yield
        finally:
            with self._lock:
                self._builders -= 1
                self._built.notify_all()

    def loopback_qp(self, access: int):
        """An RC QP connected to itself with a small CQ (``qp_access_flags`` ``access``): the GPUDirect flush READ's,
        owned and closed by ``verbs_gpu.GpuFlush`` (``QpSetup.loopback``)."""
        with self._building():
            return self._qps.loopback(access)

    def flush_gpu_writes(self, device: int) -> str:
        """Make peers' writes into cuda:``device`` memory, up to the completions seen so far, visible to that GPU
        (capability ``gpu_write_flush``); returns the method: ``"cuda"``, ``"read"`` or ``"none"``."""
        self.check_open()
        return self.gpu_flush.flush(device)

    def _register_ep(self, peer_id: str, qp, cq, inline: int, sock) -> VerbsEndpoint:
        ep = VerbsEndpoint(self, peer_id, qp, cq, sock)
        ep.max_inline = inline
        with self._lock:
            if self._closed:
                ep.destroy()
                raise FabricClosed(f"verbs fabric {self._id} closed while connecting to {peer_id}")
            old = self._eps.get(peer_id)
            self._eps[peer_id] = ep
            self._live.append(ep)
        if old is not None and old.alive:
            self.fail_endpoint(old, "replaced by a new connection from the same peer")
        self._watch.add(ep)
        return ep

    def connect(self, peer_descriptor: bytes) -> Endpoint:
        self.check_open()
        try:
            d = json.loads(bytes(peer_descriptor))
            peer_id, host, port = d["id"], d["host"], int(d["port"])
        except (ValueError, KeyError, TypeError) as ex:
            raise ValueError(f"connect: malformed verbs descriptor {bytes(peer_descriptor)[:100]!r}: {ex}") from ex
        with self._lock:
            gate = self._connecting.setdefault(peer_id, threading.Lock())
        with gate:  # one connection exchange per peer at a time: a second caller gets the first one's endpoint
            with self._lock:
                ep = self._eps.get(peer_id)
                if ep is not None and ep.alive and not ep.settled:  # settled: failing, its completions are out
                    return ep
            return self._connect(peer_id, host, port)

    def _connect(self, peer_id: str, host: str, port: int) -> VerbsEndpoint:
        sock = None
        with self._building():
            try:
                sock = socket.create_connection((host, port), timeout=self.connect_timeout)
                session = auth.client_handshake(sock, self._secret, self.name, self.connect_timeout)
                qp, cq, inline = self._qps.dial(sock, session)
                sock.settimeout(None)
            except (OSError, ConnectionError, ValueError, FabricError, auth.AuthError) as ex:
                if sock is not None:
                    sock.close()
                if isinstance(ex, FabricClosed):
                    raise
                raise PeerLost(f"verbs connect to {peer_id} ({host}:{port}) from {self.device} port "
                               f"{self.port_num} failed: {ex}") from ex
            return self._register_ep(peer_id, qp, cq, inline, sock)

    def _accept_loop(self) -> None:
        self.gate.serve(self._listener, lambda: self._closed)

    def admission_stats(self) -> dict:
        """Incoming connections by outcome (``transport.auth.Gate.stats``)."""
        return self.gate.stats()

    def expect_peer(self, peer_id: str, ttl: float = 60.0) -> None:
        """Allow one incoming connection to take ``peer_id`` within ``ttl`` seconds, replacing a live endpoint
        of that id if there is one (with ``guard_claims``; the engine calls this for the rail ids a sender
        announced over its authenticated control connection)."""
        self._claims.expect(peer_id, ttl)

    def _claim_refusal(self, peer_id: str) -> Optional[str]:
        with self._lock:
            old = self._eps.get(peer_id)
        return self._claims.refusal(peer_id, old is not None and old.alive)

    def _incoming(self, a: "auth.Admitted") -> None:
        """One incoming connection exchange (its own thread): authenticate first, then QP numbers."""
        sock = a.sock
        session = auth.server_handshake(sock, self._secret, self.name, a.deadline, a.established)
        sock.settimeout(max(0.1, a.deadline - time.monotonic()))
        peer = recv_json(sock, session)
        why = self._claim_refusal(str(peer.get("id")))
        if why is not None:
            log.warning("verbs %s: refused a connection from %s: %s", self._id, a.addr, why)
            send_json(sock, {"error": why}, session)
            return
        with self._building():
            qp, cq, inline = self._qps.answer(sock, session, peer)
            # no timeout from here on (the handshake's would fail an idle QP pair): the watch thread reads the
            # channel for as long as the QP lives
            sock.settimeout(None)
            self._register_ep(peer["id"], qp, cq, inline, sock)  # registered before "ready": symmetric connect
            a.sock = None  # the endpoint owns it now (the watch thread reads it)
        send_json(sock, {"ready": True}, session)

    def _watch_loop(self) -> None:
        """The watch thread: every endpoint's channel (``ChannelWatch.run``)."""
        self._watch.run()

    def _channel_lost(self, ep: VerbsEndpoint, cause: str) -> None:
        """The watch thread found ``ep``'s channel closed or failed (``ChannelWatch``): the QP is flushed only after
        an ACK timeout, so that a write the peer refused (which is why it closed the channel) completes with its
        own status rather than as a flush."""
        self.fail_endpoint(ep, cause, flush_after=self.ack_timeout_s)

    def fail_endpoint(self, ep: VerbsEndpoint, cause: str, flush_after: float = 0.0) -> None:
        """Mark ``ep`` dead and close its channel, so the peer fails its end too; move its QP to ERR now or after
        ``flush_after`` seconds (what it had posted flushes and the progress thread completes it from there)."""
        with ep.lock:
            if not ep.alive:
                return
            ep.alive, ep.cause = False, cause
            ep.room.notify_all()
        # a peer that closed with nothing in flight is routine; lost work is worth a warning
        log.log(logging.WARNING if ep.pending and not self._closed else logging.INFO,
                "verbs %s: endpoint %s (QP %d) failed: %s", self._id, ep.peer_id, ep.qp_num, cause)
        try:
            ep.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if flush_after > 0:
            timer = threading.Timer(flush_after, self._flush, args=(ep,))
            timer.daemon = True
            timer.start()
        else:
            self._flush(ep)

    def _flush(self, ep: VerbsEndpoint) -> None:
        with ep.lock:  # not while the progress thread destroys the QP (destroy takes this lock)
            if ep.settled or ep.destroyed:
                return
            try:
                attr = self.v["QPAttr"]()
                attr.qp_state = self.e.IBV_QPS_ERR
                ep.qp.modify(attr, self.e.IBV_QP_STATE)
            except Exception:  # noqa: BLE001 — PyverbsRDMAError: the device refused the transition
                log.debug("moving QP of %s to ERR failed", ep.peer_id, exc_info=True)
        # a device that never flushes (gone): complete what is left after a grace period
        timer = threading.Timer(3.0, self._settle, args=(ep, None, None))
        timer.daemon = True
        timer.start()

    def endpoint(self, peer_id: str) -> Endpoint:
        self.check_open()
        with self._lock:
            ep = self._eps.get(peer_id)
        if ep is None:
            raise UnknownPeer(f"verbs {self._id} has no endpoint for peer {peer_id!r}; connect first")
        return ep

    # --- data path ------------------------------------------------------------------------------------------
    def _local_region(self, lkey: int):
        entry = self._regions.get(lkey)
        return None if entry is None else entry[0]

    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        """Post ``requests`` (``WriteRequest`` and ``WriteBatch`` items) as one chain of work requests, only its
        last one signalled; a chain longer than the send queue has room for is posted in parts as room frees.
        Every item is checked before anything is posted (see ``Fabric.post_writes``)."""
        self.check_open()
        if not isinstance(ep, VerbsEndpoint) or ep.fabric is not self:
            raise UnknownPeer(f"post_writes: {ep!r} is not an endpoint of verbs fabric {self._id}")
        if not ep.alive:
            raise PeerLost(f"endpoint {ep.peer_id} is dead ({ep.cause}); reconnect first")
        items = list(requests)
        writes = 0
        for r in items:
            if isinstance(r, WriteBatch):
                check_batch(r, self._local_region, self._id)
                writes += r.count
            else:
                check_request(r, self._local_region)
                writes += 1
        with ep.post_lock:
            self._post_items(ep, items, writes)

    def _post_items(self, ep: VerbsEndpoint, items: list, writes: int) -> None:
        e = self.e
        inline = ep.max_inline
        on_gpu = self._gpu_lkeys  # the CPU cannot copy device memory into a WQE: never inline from there
        # one flat list of (local, length, remote, rkey, lkey, imm) in posting order, and the items' records
        flat = []
        records = []
        seq = ep.next_seq
        for r in items:
            if isinstance(r, WriteBatch):
                n = r.count
                rec = Posted(seq, seq + n - 1, r.wr_id, Opcode.WRITE, r.nbytes, None, True, r.remote_addr,
                              r.length)
                flat.extend(zip(r.local_addr.tolist(), r.length.tolist(), r.remote_addr.tolist(), r.rkey.tolist(),
                                r.lkey.tolist(), [None] * n))
                seq += n
            else:
                op = Opcode.WRITE if r.imm is None else Opcode.WRITE_WITH_IMM
                rec = Posted(seq, seq, r.wr_id, op, r.length, r.imm, r.signaled, r.remote_addr, None)
                flat.append((r.local_addr, r.length, r.remote_addr, r.rkey, r.lkey, r.imm))
                seq += 1
            records.append(rec)
        start = ep.next_seq
        done = 0
        queued = 0  # records[:queued] are in ep.pending
        while done < writes:
            with ep.lock:
                while ep.alive and ep.next_seq - 1 - ep.retired >= self.max_send_wr:
                    ep.room.wait(0.5)
                if not ep.alive or ep.settled:
                    raise PeerLost(f"endpoint {ep.peer_id} died while posting ({ep.cause or 'its QP failed'})")
                room = self.max_send_wr - (ep.next_seq - 1 - ep.retired)
            part = flat[done:done + room]
            first = start + done
            last = first + len(part) - 1
            wrs, sges = ep.chain.take(len(part))
            n_inline = n_imm = 0
            for k, (la, n, ra, rkey, lkey, imm) in enumerate(part):
                flags = 0
                if n <= inline and lkey not in on_gpu:
                    flags |= e.IBV_SEND_INLINE
                    n_inline += 1
                if k == len(part) - 1:
                    flags |= e.IBV_SEND_SIGNALED
                sge, wr = sges[k], wrs[k]
                sge.addr, sge.length, sge.lkey = la, n, lkey
                wr.wr_id = first + k
                wr.send_flags = flags
                wr.set_wr_rdma(rkey, ra)
                if imm is None:
                    wr.opcode = e.IBV_WR_RDMA_WRITE
                else:
                    wr.opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM
                    wr.imm_data = socket.htonl(imm)  # __be32: the bytes travel as they are
                    n_imm += 1
            failure = None
            with ep.lock:
                if not ep.alive or ep.settled:  # settled: nothing posted now would ever complete
                    raise PeerLost(f"endpoint {ep.peer_id} died while posting ({ep.cause or 'its QP failed'})")
                # the records go in before the post: the progress thread may see the completion at once
                while queued < len(records) and records[queued].first <= last:
                    ep.pending.append(records[queued])
                    queued += 1
                ep.next_seq = last + 1
                try:
                    ep.qp.post_send(wrs[0])
                except Exception as ex:  # noqa: BLE001 — ENOMEM / EINVAL
                    failure = ex
            if failure is not None:
                # a failed chain may be posted in part (up to the bad work request): the endpoint is failed and
                # what it holds completes from the flush, so that nothing is reported twice or never
                cause = f"ibv_post_send to {ep.peer_id} failed: {failure}"
                self.fail_endpoint(ep, cause)
                raise FabricError(cause) from failure
            self.counts["post_send"] += 1
            self.counts["work_requests"] += len(part)
            self.counts["signaled"] += 1
            self.counts["inline"] += n_inline
            self.counts["with_imm"] += n_imm
            done += len(part)

    def _progress_loop(self) -> None:
        """Polls every live endpoint's CQ, and destroys the endpoints ``_settle`` retired: the one thread that
        does either, so that no CQ is polled while or after it is destroyed."""
        idle = 0
        while not self._closed:
            self._destroy_retired()
            with self._lock:
                eps = list(self._live)
            busy = False
            for ep in eps:
                try:
                    n, wcs = ep.cq.poll(num_entries=self.cq_batch)
                except Exception as ex:  # noqa: BLE001 — PyverbsRDMAError: a CQ overrun (EIO) fails the endpoint
                    if ep.alive:
                        self.fail_endpoint(ep, f"polling its CQ failed: {ex}")
                    continue
                if n:
                    busy = True
                    self._on_wcs(ep, wcs)
            if busy:
                idle = 0
            else:
                idle += 1
                time.sleep(0 if idle < 100 else 0.0005)  # spin briefly, then back off to spare the CPU

    def _on_wcs(self, ep: VerbsEndpoint, wcs) -> None:
        e = self.e
        out: List[Completion] = []
        for wc in wcs:
            if wc.wr_id == RECV_WR_ID:
                if wc.status != e.IBV_WC_SUCCESS:
                    if ep.alive:  # a flushed receive: the QP went to error (the peer wrote outside our regions)
                        self.fail_endpoint(ep, f"its QP went to error (receive WC status {wc.status})")
                    continue
                if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                    out.append(Completion(0, Opcode.RECV_IMM, ep.peer_id, wc.byte_len, socket.ntohl(wc.imm_data)))
                    if ep.alive:
                        try:
                            ep.qp.post_recv(self._qps.recv_wr)
                        except Exception:  # noqa: BLE001 — the QP went to error meanwhile
                            log.debug("re-posting a receive to %s failed", ep.peer_id, exc_info=True)
                continue
            if wc.status == e.IBV_WC_SUCCESS:
                with ep.lock:
                    if ep.settled:
                        continue
                    ep.retired = max(ep.retired, wc.wr_id)
                    while ep.pending and ep.pending[0].last <= wc.wr_id:
                        rec = ep.pending.popleft()
                        if rec.signaled:
                            out.append(rec.completion(ep.peer_id))
                    ep.room.notify_all()
                continue
            # the completions so far go out first, then the failure's, in order
            self._settle(ep, wc.wr_id, wc.status, before=out)
            out = []
        if out:
            self._cq_out.push(out)

    def _settle(self, ep: VerbsEndpoint, seq: Optional[int], status: Optional[int], before=()) -> None:
        """The QP of ``ep`` failed at work request ``seq`` with WC ``status`` (None, None: the device never said,
        and the grace period is over). RC completes in order: everything before ``seq`` was placed; the item
        holding ``seq`` fails with ``status``'s error (``PeerLost`` naming the endpoint's cause for a flush:
        something else moved the QP to ERR); everything after was not executed (``PeerLost`` naming why). The
        endpoint is failed and its QP, CQ and channel are released. ``before``: completions to push ahead of these.

        The completions are pushed before the endpoint reads as dead: whoever sees it dead (the engine's watchdog)
        then finds its failure already handed over, with the work request's own status, rather than failing the
        rail with a bare "endpoint died" first. ``connect`` does not reuse a settled endpoint meanwhile, and
        nothing can be posted on it."""
        out: List[Completion] = []
        with ep.lock:
            settled, ep.settled = ep.settled, True
            first_error = None
            for rec in () if settled else ep.pending:
                if seq is not None and rec.last < seq:
                    if rec.signaled:
                        out.append(rec.completion(ep.peer_id))
                elif seq is not None and rec.first <= seq and first_error is None:
                    first_error = status_error(self, ep, rec, seq, status)
                    out.append(rec.completion(ep.peer_id, first_error))
                else:
                    why = first_error if first_error is not None else (ep.cause or "its QP went to error")
                    out.append(rec.completion(ep.peer_id, PeerLost(
                        f"wr_id={rec.wr_id} to {ep.peer_id} was not executed: the endpoint failed before it ({why})")))
            ep.pending.clear()
        out = list(before) + out
        if out:
            self._cq_out.push(out)
        if settled:
            return
        if ep.alive:
            self.fail_endpoint(ep, str(first_error) if first_error is not None else f"WC status {status}")
        self._watch.remove(ep)
        with self._lock:
            if ep in self._live:
                self._live.remove(ep)
            # the CQ goes with the QP (its leftover flushes are of no use now), destroyed by the progress thread
            self._retiring.append(ep)

    def _destroy_retired(self) -> None:
        while self._retiring:
            self._retiring.popleft().destroy()

    @property
    def ack_timeout_s(self) -> float:
        """Seconds from a write without an ACK to its failure: 4.096 us x 2^timeout x (retry_cnt + 1)."""
        return 4.096e-6 * (1 << self.timeout_exp) * (self.retry_cnt + 1)

    def set_completion_handler(self, handler) -> None:
        """Completions go to ``handler(list)`` in the progress thread as they arrive (``completion_callback``)."""
        self._cq_out.set_handler(handler)

    def poll(self, max_n: int = 64, timeout: float = 0.0) -> List[Completion]:
        self.check_open()
        return self._cq_out.take(max_n, timeout)

    def wire_counts(self) -> dict:
        """Totals since construction: ``post_send`` calls, work requests, signalled, inline and WRITE_WITH_IMM
        ones."""
        return {k: int(self.counts[k]) for k in ("post_send", "work_requests", "signaled", "inline", "with_imm")}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            eps = list(dict.fromkeys([*self._eps.values(), *self._live]))  # replaced endpoints too
            # threads making a QP pair finish (or fail) before the context goes
            self._built.wait_for(lambda: self._builders == 0, timeout=self.connect_timeout + 1.0)
            builders = self._builders
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the handshake thread
            self._listener.close()
        except OSError:
            pass
        for ep in eps:
            self.fail_endpoint(ep, "fabric closed")
        for t in self._threads:
            t.join(timeout=10.0)
        for ep in eps:
            self._settle(ep, None, None)
        self._watch.close()
        self._cq_out.close()
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck or builders:
            # a thread that may still call into these objects: leave them open rather than crash the process
            log.warning("verbs %s: closing without releasing the device context (%s still running)", self._id,
                        ", ".join(stuck) or f"{builders} connection set-ups")
            return
        self._destroy_retired()  # the progress thread has ended: this thread owns what it left
        self.gpu_flush.close()
        self._release_verbs()

    def _release_verbs(self) -> None:
        for region, mr, fd in list(self._regions.values()):
            try:
                mr.close()
            except Exception:  # noqa: BLE001
                pass
            if fd is not None:
                os.close(fd)
        self._regions.clear()
        for obj in (self.scratch_mr, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:  # noqa: BLE001
                pass


def check_request(r: WriteRequest, local_region) -> None:
    """Raises naming what is wrong with ``r``; ``local_region(lkey)``: the registered region of an lkey, or None."""
    check_range(r.local_addr, r.length, f"wr_id={r.wr_id} local")
    check_range(r.remote_addr, r.length, f"wr_id={r.wr_id} remote")
    if r.length > MAX_MESSAGE:
        raise ValueError(f"wr_id={r.wr_id}: {r.length} B exceeds a verbs message ({MAX_MESSAGE} B); split it")
    if isinstance(r.rkey, bool) or not isinstance(r.rkey, int) or not 0 <= r.rkey <= 0xFFFFFFFF:
        raise ValueError(f"wr_id={r.wr_id}: rkey must be a 32-bit unsigned int, got {r.rkey!r}")
    if r.imm is not None and (isinstance(r.imm, bool) or not isinstance(r.imm, int) or not 0 <= r.imm <= IMM_MAX):
        raise ValueError(f"wr_id={r.wr_id}: imm must be a 32-bit unsigned int, got {r.imm!r}")
    region = local_region(r.lkey)
    if region is None or not region.contains(r.local_addr, r.length):
        raise RegionError(f"wr_id={r.wr_id}: local range 0x{r.local_addr:x}+{r.length} is not inside the "
                          f"region of lkey 0x{r.lkey:x}")


def check_batch(b: WriteBatch, local_region, fabric_id: str) -> None:
    """Every write of ``b`` checked with array operations; raises naming the first bad write."""
    la, ln, ra, rk, lk = b.local_addr, b.length, b.remote_addr, b.rkey, b.lkey
    bad = np.flatnonzero((ln <= 0) | (ln > MAX_MESSAGE) | (la < 0) | (ra < 0) | (rk < 0) | (rk > 0xFFFFFFFF)
                         | (la > (1 << 63) - 1 - ln) | (ra > (1 << 63) - 1 - ln))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"WriteBatch wr_id={b.wr_id}: write {i} is malformed (local 0x{int(la[i]):x}, "
                         f"{int(ln[i])} B, remote 0x{int(ra[i]):x}, rkey {int(rk[i])})")
    for key in np.unique(lk).tolist():
        region = local_region(int(key))
        sel = np.flatnonzero(lk == key)
        if region is None:
            raise RegionError(f"WriteBatch wr_id={b.wr_id}: write {int(sel[0])}: lkey 0x{int(key):x} is not "
                              f"registered with {fabric_id}")
        out = sel[(la[sel] < region.addr) | (la[sel] + ln[sel] > region.addr + region.length)]
        if out.size:
            i = int(out[0])
            raise RegionError(f"WriteBatch wr_id={b.wr_id}: write {i}: local range 0x{int(la[i]):x}+"
                              f"{int(ln[i])} is not inside the region of lkey 0x{int(key):x}")


def status_error(fab: "VerbsFabric", ep: VerbsEndpoint, rec: Posted, seq: int, status: int) -> FabricError:
    """The error of work request ``seq`` (of ``rec``) that completed with WC ``status``."""
    e = fab.e
    what = rec.write_at(seq)
    if status == e.IBV_WC_REM_ACCESS_ERR:
        return RegionError(f"peer {ep.peer_id} refused {what}: rkey or range outside its registered regions "
                           f"(IBV_WC_REM_ACCESS_ERR)")
    if status == e.IBV_WC_LOC_PROT_ERR:
        return RegionError(f"{what} to {ep.peer_id}: the local range left its region (IBV_WC_LOC_PROT_ERR)")
    if status == e.IBV_WC_RETRY_EXC_ERR:
        return PeerLost(f"{what} to {ep.peer_id}: no ACK within {fab.ack_timeout_s:.3g} s "
                        f"(IBV_WC_RETRY_EXC_ERR: timeout {fab.timeout_exp}, retry_cnt {fab.retry_cnt})")
    if status == e.IBV_WC_WR_FLUSH_ERR:
        return PeerLost(f"{what} to {ep.peer_id} was flushed: the endpoint failed ({ep.cause or 'QP error'})")
    return PeerLost(f"{what} to {ep.peer_id} failed with WC status {status}")


def _qp_timeout(ack_timeout: Optional[float]):
    """(timeout exponent, retry_cnt) for a write to fail after about ``ack_timeout`` seconds without an ACK:
    4.096 us x 2^timeout x (retry_cnt + 1) >= ack_timeout, with retry_cnt 7 where the exponent allows (the
    default, None: ``ACK_TIMEOUT_EXP`` and 7)."""
    if ack_timeout is None:
        return ACK_TIMEOUT_EXP, 7
    per_try = ack_timeout / 8
    exp = max(1, min(31, int(np.ceil(np.log2(max(per_try, 4.096e-6) / 4.096e-6)))))
    return exp, 7
