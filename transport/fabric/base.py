"""The verbs-shaped fabric interface every pxn fabric implements (tcp, ipc, verbs).

The engine only ever talks to this interface, so the same engine code runs over RDMA verbs in production, over
TCP sockets on machines without RDMA (and in CI), and over CUDA IPC / shared memory between processes of one
host. One conformance suite (``tests/test_fabric_conformance.py``) runs against every implementation.

Model (the one of RDMA RC queue pairs):

* ``register(addr, length, device)`` pins / exposes memory and returns a ``MemoryRegion`` with an ``lkey`` (used
  by local posts) and an ``rkey`` (given to peers, who quote it in writes targeting the region).
* ``descriptor()`` is opaque bytes that a peer passes to ``connect()``; connecting is symmetric: after A connects
  to B, B also holds an endpoint for A (``endpoint(peer_id)``), so B can write back (credits, acks).
* ``post_writes(ep, requests)`` posts many one-sided WRITE / WRITE_WITH_IMM work requests with one doorbell.
  The target side performs a write only after checking that ``[remote_addr, remote_addr + length)`` lies inside
  one region it registered and that ``rkey`` is that region's; otherwise nothing is written and the sender's
  completion carries a ``RegionError``.
* ``poll(max_n, timeout)`` returns completions in batches: sender completions (opcode WRITE / WRITE_WITH_IMM,
  once the bytes are placed at the target) and target-side RECV_IMM events (one per WRITE_WITH_IMM received,
  after its bytes are placed), in posting order per endpoint.
* A peer that dies fails its pending work requests with ``PeerLost`` within a bounded time (a few seconds) and
  affects nothing else. ``close()`` releases everything; later calls raise ``FabricClosed``.

Addresses are raw integers (host virtual addresses or CUDA UVA device addresses). Lengths are bytes.
"""
from __future__ import annotations

import abc
import collections
import enum
import threading
from dataclasses import dataclass
from operator import add
from typing import Iterable, List, NamedTuple, Optional, Sequence

import numpy as _np

_I64 = (1 << 63) - 1
_INT = {int}

_ndarray, _INT64 = _np.ndarray, _np.dtype(_np.int64)

DEVICE_HOST = -1
"""``device`` value meaning host (CPU) memory; a CUDA device index otherwise."""

IMM_MAX = 0xFFFFFFFF
"""Immediate data is 32 bits, as in RDMA."""


class Opcode(enum.IntEnum):
    WRITE = 1
    WRITE_WITH_IMM = 2
    RECV_IMM = 3  # target side: a WRITE_WITH_IMM from a peer has landed


@dataclass(frozen=True)
class MemoryRegion:
    """A registered range of memory. ``device`` is ``DEVICE_HOST`` (-1) or a CUDA device index."""

    addr: int
    length: int
    lkey: int
    rkey: int
    device: int = DEVICE_HOST

    def contains(self, addr: int, length: int) -> bool:
        """True when ``[addr, addr + length)`` lies inside this region (length >= 1)."""
        return length >= 1 and addr >= self.addr and addr + length <= self.addr + self.length


@dataclass(frozen=True)
class RemoteRegion:
    """What a peer advertises of one of its regions (exchanged by the engine's handshake)."""

    addr: int
    length: int
    rkey: int
    device: int = DEVICE_HOST

    def contains(self, addr: int, length: int) -> bool:
        return length >= 1 and addr >= self.addr and addr + length <= self.addr + self.length


@dataclass
class WriteRequest:
    """One one-sided write: ``length`` bytes from local ``local_addr`` (inside the region of ``lkey``) to the
    peer's ``remote_addr`` (inside its region of ``rkey``). ``imm`` set means WRITE_WITH_IMM (32-bit value)."""

    local_addr: int
    length: int
    remote_addr: int
    rkey: int
    lkey: int
    imm: Optional[int] = None
    wr_id: int = 0
    signaled: bool = True
    """False: no completion on success (errors still complete), as an unsignaled RDMA work request; honoured by
    fabrics that declare ``selective_signaling``, which complete an endpoint's writes in posting order."""
    acked: bool = True
    """False, with ``signaled`` False (fabrics with the ``unacked_writes`` capability; others ignore it): a small
    write the target does not acknowledge. Its bytes are read at the post (the local range may change as soon as
    ``post_writes`` returns); it completes on neither side, and a write the target refuses is dropped there with a
    log line, so the caller must learn of a lost write otherwise (a receiver's ack to a sender, whose loss the
    sender's timeouts catch). A fabric may still send it as an acknowledged write."""


@dataclass
class GatherWrite(WriteRequest):
    """A ``WriteRequest`` some of whose byte ranges come from elsewhere (fabrics with the ``gather_writes``
    capability): the peer receives exactly the bytes a plain write of ``length`` bytes from ``local_addr`` would
    bring, except that ``gather[2][i]`` bytes at local address ``gather[1][i]`` (inside the write's range) are read
    from ``gather[0][i]`` instead (a host address inside a region registered with the fabric). ``gather``: three
    int64 arrays (sources, replaced local addresses in ascending order without overlap, lengths >= 1). A relay
    chunk of host pieces is sent this way: its header and table from the slot, each piece from its source, with no
    gather copy into the slot. The sources must stay unchanged until the write completes, as a write's own."""

    gather: tuple = ()


class WriteBounds(NamedTuple):
    """The extremes of a ``WriteBatch``'s arrays and its one key on each side, as the poster found them while
    checking those same arrays (the engine's validation): smallest and largest length, smallest local address
    and largest local end (address + length), the same for the remote side, and the rkey and lkey of every
    write. A fabric checks these against its regions instead of reducing the arrays again (each reduction is a
    numpy call of host time per batch); a batch without them is checked from its arrays. Only code that has just
    reduced the same arrays, or arrays these writes lie inside, sets them: the lengths exactly (equal extreme
    lengths mean equal lengths), the local and remote ones exactly or as spans that hold every local and every
    remote piece (a relayed unit, or a run of a batch's pieces on one rail, carries its batch's spans)."""

    len_min: int
    len_max: int
    local_min: int
    local_end: int
    remote_min: int
    remote_end: int
    rkey: int
    lkey: int


class RegionSpans(NamedTuple):
    """What ``Fabric.write_inline_regions`` checks a batch spread over several registered regions against, as
    the poster found it while checking the batch's arrays (the engine's validation placed every piece inside one
    local and one peer region): the batch's smallest and largest length, smallest local address and largest
    local end, the same for the remote side; ``local``: ``(lkey, start, end)`` of each local region holding a
    piece; ``remote``: ``(rkey, start, end)`` of each peer region holding one, as the poster knows them;
    ``remote_index``: for each piece, the position of its peer region in ``remote`` (int64 array), or None when
    ``remote`` has one entry. Every piece lies inside its regions: a fabric checks the regions, not the pieces."""

    len_min: int
    len_max: int
    local_min: int
    local_end: int
    remote_min: int
    remote_end: int
    local: tuple
    remote: tuple
    remote_index: Optional[_np.ndarray]


class WriteBatch:
    """Many plain writes that complete as one work request (fabrics with the ``write_batches`` capability):
    write i is ``length[i]`` bytes from local ``local_addr[i]`` (inside the region of ``lkey[i]``) to the peer's
    ``remote_addr[i]`` (inside its region of ``rkey[i]``). Arguments are int64 arrays of one size (numpy), so
    that thousands of writes cost a few array operations instead of an object each.

    Exactly one completion (``wr_id``, opcode WRITE, ``byte_len`` the total) reports the batch: success once every
    write has been placed, else the first error, naming the write. Nothing of a batch with a bad local range is
    posted. No immediates: a batch is the zero-copy body of a transfer, not a chunk.

    ``nbytes``: the sum of ``length`` when the caller has it; ``bounds``: a ``WriteBounds`` of the arrays, for
    fabrics that can use it (ipc), or None."""

    __slots__ = ("local_addr", "length", "remote_addr", "rkey", "lkey", "wr_id", "signaled", "nbytes", "bounds")

    def __init__(self, local_addr, length, remote_addr, rkey, lkey, wr_id: int = 0, nbytes: Optional[int] = None,
                 bounds: Optional[WriteBounds] = None):
        cols = (local_addr, length, remote_addr, rkey, lkey)
        n = length.size if length.__class__ is _ndarray else -1
        if n > 0 and all(v.__class__ is _ndarray and v.dtype is _INT64 and v.ndim == 1 and v.size == n for v in cols):
            # the engine's case: int64 arrays already, nothing to convert
            self.local_addr, self.length, self.remote_addr, self.rkey, self.lkey = cols
        else:
            cols = [_np.asarray(v) for v in cols]
            n = cols[1].size
            for name, v in zip(("local_addr", "length", "remote_addr", "rkey", "lkey"), cols):
                if v.ndim != 1 or v.dtype.kind not in "iu":
                    raise ValueError(f"WriteBatch: {name} must be a 1-D integer array, got {v.dtype} "
                                     f"{tuple(v.shape)}")
                if v.size != n:
                    raise ValueError(f"WriteBatch: {name} has {v.size} items but length has {n}")
            if n == 0:
                raise ValueError("WriteBatch: no writes")
            self.local_addr, self.length, self.remote_addr, self.rkey, self.lkey = (
                v.astype(_np.int64, copy=False) for v in cols)
        self.wr_id = wr_id
        self.signaled = True  # the batch always completes once
        self.nbytes = int(self.length.sum()) if nbytes is None else nbytes
        self.bounds = bounds

    @property
    def count(self) -> int:
        """Number of writes."""
        return int(self.length.size)

    @property
    def imm(self):
        return None

    def __repr__(self):
        return f"WriteBatch(wr_id={self.wr_id}, writes={self.count}, bytes={self.nbytes})"


class WriteRows(WriteBatch):
    """A ``WriteBatch`` of a few writes from one local region (``lkey``) into one remote region (``rkey``), held as
    lists of ints: the fabric checks and frames it in a few Python steps, where a few numpy calls on arrays
    of a dozen items cost more than the message's own send. Posted only to fabrics with the ``write_rows``
    capability; it completes as one work request, like any ``WriteBatch``.

    Arguments: local_addr, length, remote_addr: sequences of ints, one entry per write (copied); rkey, lkey: one
    int each. The values are checked here, once (ints, lengths >= 1, addresses >= 0, ends within 63 bits: else
    ``ValueError`` naming the first bad write), and their extremes kept: ``local_span`` and ``remote_span``
    (lowest address, highest end) and ``max_length``, which the poster and the fabric check against regions.

    ``on_acked``: None, or a callable the fabric calls, instead of reporting a ``Completion``, when the peer placed
    every write and no message posted earlier on the endpoint is still waiting for its ack (the callable may
    return False: the completion is reported after all).

    ``read_ack``: the posting thread will wait for this request right after posting it and may read its ack itself
    (fabrics with ``own_acks``). When the fabric lets it, ``reader`` is set by the post: that thread then must call
    the fabric's ``await_rows`` once (it reads until the ack is in, the endpoint failed or the deadline passed, and
    gives the socket back to its receive thread)."""

    __slots__ = ("local_span", "remote_span", "max_length", "on_acked", "read_ack", "reader")

    def __init__(self, local_addr: Sequence[int], length: Sequence[int], remote_addr: Sequence[int], rkey: int,
                 lkey: int, wr_id: int = 0):
        la, ln, ra = list(local_addr), list(length), list(remote_addr)
        n = len(ln)
        if not n or len(la) != n or len(ra) != n:
            raise ValueError(f"WriteRows: local_addr, length and remote_addr need one length >= 1, got "
                             f"{len(la)}, {n}, {len(ra)}")
        # builtins over the lists (C loops); the loop below only names what they found wrong
        ok = {*map(type, la), *map(type, ln), *map(type, ra)} == _INT
        if ok:
            lo, rlo = min(la), min(ra)
            self.local_span = (lo, max(map(add, la, ln)))
            self.remote_span = (rlo, max(map(add, ra, ln)))
            ok = min(ln) > 0 and lo >= 0 and rlo >= 0 and self.local_span[1] <= _I64 and self.remote_span[1] <= _I64
        if not ok:
            for i, (a, k, r) in enumerate(zip(la, ln, ra)):
                if not (a.__class__ is int and k.__class__ is int and r.__class__ is int and k > 0 and a >= 0
                        and r >= 0 and a <= _I64 - k and r <= _I64 - k):
                    raise ValueError(f"WriteRows write {i} (local {a!r}, {k!r} B, remote {r!r}): lengths must be "
                                     f"positive ints and addresses non-negative ints whose ranges fit 63 bits")
        self.local_addr, self.length, self.remote_addr = la, ln, ra
        self.max_length = max(ln)
        self.rkey, self.lkey = rkey, lkey
        self.wr_id = wr_id
        self.signaled = True
        self.nbytes = sum(ln)
        self.on_acked = None
        self.read_ack = False
        self.reader = None

    @property
    def count(self) -> int:
        return len(self.length)

    def __repr__(self):
        return f"WriteRows(wr_id={self.wr_id}, writes={self.count}, bytes={self.nbytes})"


@dataclass(frozen=True)
class Completion:
    """A finished work request (sender side) or a received immediate (target side, ``opcode == RECV_IMM``).

    ``error`` is None on success, else the exception naming the cause (``RegionError``, ``PeerLost``, ...).
    ``peer_id`` names the endpoint the completion belongs to. ``byte_len`` is the write's length.
    """

    wr_id: int
    opcode: Opcode
    peer_id: str
    byte_len: int = 0
    imm: Optional[int] = None
    error: Optional[BaseException] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Endpoint(abc.ABC):
    """A connection to one peer (possibly several sockets / queue pairs striped underneath)."""

    peer_id: str

    @abc.abstractmethod
    def abort(self) -> None:
        """Break the connection abruptly, as a dead link would (used by failover tests); pending work on it
        completes with ``PeerLost``."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the connection is known to be broken or closed."""



@dataclass(frozen=True)
class Capabilities:
    """What a fabric class declares the engine may rely on beyond the ``Fabric`` interface, so that the engine never
    branches on a fabric's name. Every field is False unless the fabric says otherwise."""

    selective_signaling: bool = False
    """``WriteRequest.signaled=False`` writes complete silently on success; an endpoint's completions come in posting
    order."""
    loadstore: bool = False
    """``access_info`` lets a same-host peer map regions and write with its own loads and stores; ``local_writer``
    gives the writer that does it."""
    nic_ports: bool = False
    """Each instance drives one NIC port: the engine passes a topology rail's ``device`` and ``port_num``."""
    completion_callback: bool = False
    """``set_completion_handler`` delivers completions from the fabric's own thread."""
    authenticated_rails: bool = False
    """Rail connections prove the engine's secret and must have been announced by an authenticated control hello:
    the engine passes ``handshake_timeout`` and ``guard_claims``."""
    gather_writes: bool = False
    """``post_writes`` also takes ``GatherWrite`` items."""
    landing_handlers: bool = False
    """``set_landing_handler``: a region's writes are placed where a handler says as they arrive."""
    write_batches: bool = False
    """``post_writes`` also takes ``WriteBatch`` items: many writes as arrays, one completion."""
    write_rows: bool = False
    """``post_writes`` also takes ``WriteRows`` items (fixed-width rows by index arrays)."""
    unacked_writes: bool = False
    """Unsignaled small writes need no per-write acknowledgement from the peer (``WriteRequest.acked=False``)."""
    refusal_fails_endpoint: bool = False
    """RC semantics: a write the target refuses fails its endpoint, whose later work completes with ``PeerLost``
    as not executed; ``connect`` makes a new one."""
    event_ordered_writes: bool = False
    """``post_writes_after`` orders writes from GPU memory after CUDA events on the GPU, with no host wait, and says
    when their sources may be reused."""
    inline_writes: bool = False
    """``write_inline`` writes a checked batch from the calling thread."""
    gpu_write_flush: bool = False
    """Writes a peer made into GPU memory become visible to that GPU's work only after ``flush_gpu_writes(device)``
    (GPUDirect RDMA: the NIC writes over PCIe, unordered with CUDA streams); the receiver flushes before it reads
    a landed chunk, and ``TransferEngine.flush_gpu_writes`` does it for data written straight to its place."""


class Fabric(abc.ABC):
    """Base of every fabric. Thread-safe: posts and polls may come from different threads."""

    name: str = "abstract"
    engine_options: dict = {}
    """Options the engine gives this fabric unless its caller gives others (``fabric_options``)."""
    config_defaults: dict = {}
    """Engine settings (``transport.config.EngineConfig`` fields) whose default this fabric changes; a
    constructor argument or ``PXN_*`` variable still wins."""
    gather_min_bytes: int = 0
    """Fabrics with ``"gather_writes"``: the engine sends a chunk as a ``GatherWrite`` only when its pieces average
    at least this many bytes (below, copying them into the slot costs less than a gather entry per piece)."""
    capabilities: Capabilities = Capabilities()
    """What the engine may rely on beyond the interface above (a ``Capabilities``), so that it never branches on
    a fabric's name."""

    @property
    @abc.abstractmethod
    def local_id(self) -> str:
        """This fabric instance's id, as peers see it in ``Completion.peer_id`` (e.g. ``"127.0.0.1:40123"``)."""

    @abc.abstractmethod
    def register(self, addr: int, length: int, device: int = DEVICE_HOST) -> MemoryRegion:
        """Register ``length`` bytes at ``addr`` on ``device`` (-1 host). Raises ``ValueError`` for a zero /
        negative length or an overflowing range, ``FabricError`` when the memory cannot be registered."""

    @abc.abstractmethod
    def deregister(self, mr: MemoryRegion) -> None:
        """Forget a region; later writes quoting its rkey are refused. Unknown region: ``RegionError``."""

    @abc.abstractmethod
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to ``connect``."""

    @abc.abstractmethod
    def connect(self, peer_descriptor: bytes) -> Endpoint:
        """Connect to a peer (idempotent: the same endpoint comes back for the same peer)."""

    @abc.abstractmethod
    def endpoint(self, peer_id: str) -> Endpoint:
        """The endpoint for a peer that connected (either direction). Unknown: ``UnknownPeer``."""

    @abc.abstractmethod
    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        """Post many writes with one doorbell (fabrics with ``write_batches``: ``WriteBatch`` items too). Local
        checks happen before anything is posted: a local range outside the region of its lkey, a zero / negative
        length, or an overflowing address raise at once (``RegionError`` / ``ValueError``) and none of the
        requests is posted. A dead endpoint raises ``PeerLost``; a closed fabric ``FabricClosed``."""

    def post_writes_after(self, ep: Endpoint, requests: Sequence[WriteRequest], after: Sequence) -> Optional[object]:
        """``post_writes`` for writes whose sources are still being produced on the GPU: ``after`` holds CUDA
        events (torch) recorded after their producers. Returns a CUDA event after which the sources may be
        overwritten, or None: they may be once the writes complete. This default waits for ``after`` on the
        host, then posts; fabrics with ``event_ordered_writes`` order the writes on the GPU instead."""
        for event in after:
            event.synchronize()
        self.post_writes(ep, requests)
        return None

    def write_inline(self, ep: Endpoint, local_addr, remote_addr, length, bounds: WriteBounds, nbytes: int,
                     wait: bool = True, stream=None):
        """Capability ``inline_writes``: write piece i (``length[i]`` bytes from local ``local_addr[i]`` to the
        peer's ``remote_addr[i]``; int64 arrays whose extremes and one key on each side are ``bounds``, and whose
        lengths sum to ``nbytes``) from the calling thread: no request, completion or poller, for a caller that
        would only wait for the completion. Returns None, with nothing written, when the fabric does not take
        these writes this way (the caller posts them instead); else a ``Pending`` (``transport.fabric.gpu_copy``)
        whose ``wait()`` returns once every byte is placed, already waited for when ``wait``. Raises a
        ``FabricError`` or ``TransferError`` when the writes were not all made; the caller may post them again
        (a write is idempotent). ``stream``: a ``torch.cuda.Stream`` of the sources' GPU that a device copy goes
        on, ordered after what is queued there (default: the calling thread's current stream of that GPU). This
        default takes nothing."""
        return None

    def write_inline_regions(self, ep: Endpoint, local_addr, remote_addr, length, spans: RegionSpans, nbytes: int,
                             wait: bool = True, stream=None):
        """``write_inline`` for a batch whose pieces lie in several registered regions on either side (sglang
        registers each layer's KV buffer and each aux buffer on its own, so one call spans many): ``spans`` gives
        the regions instead of one key each side. The same returns and errors. This default takes nothing."""
        return None

    @abc.abstractmethod
    def poll(self, max_n: int = 64, timeout: float = 0.0) -> List[Completion]:
        """Up to ``max_n`` completions; waits up to ``timeout`` seconds for the first one."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, handles, registrations. Idempotent."""

    def flush_gpu_writes(self, device: int) -> str:
        """Fabrics with ``gpu_write_flush``: make the writes peers made into cuda:``device`` memory, up to the
        completions seen so far, visible to that GPU; returns the method used. This default has nothing to flush:
        the fabric's own copies wrote that memory in stream order."""
        return "none"

    def set_completion_handler(self, handler) -> None:
        """Fabrics with the ``completion_callback`` capability: call ``handler(completions)`` from the fabric's own
        progress thread as completions arrive, instead of keeping them for ``poll`` (saves a thread hand-off per
        completion). ``handler`` must not block and must not post on this fabric."""
        raise NotImplementedError(f"{self.name} fabric does not deliver completions by callback")

    def set_landing_handler(self, mr: MemoryRegion, handler) -> None:
        """Fabrics with the ``landing_handlers`` capability: let ``handler`` place writes with an immediate into the
        host region ``mr`` (a receiver's landing slots) straight into their final destinations, before the rest
        lands in ``mr`` (see ``TcpFabric.set_landing_handler`` for the handler's contract). This default refuses:
        without the capability every byte of such a write lands in ``mr``."""
        raise NotImplementedError(f"{self.name} fabric does not place landed writes by handler")

    def await_rows(self, b: WriteRows, deadline: float) -> None:
        """Fabrics with the ``write_rows`` capability whose posts may hand the posting thread the socket the ack
        comes on (``b.reader`` set after ``post_writes`` of a ``WriteRows`` with ``read_ack``): read until ``b``'s
        ack is handled, the endpoint failed or ``time.monotonic()`` passes ``deadline``, then hand the socket
        back. This default does nothing: such a fabric never sets ``b.reader``, and the ack arrives as a
        completion."""
        return None

    def expect_peer(self, peer_id: str, ttl: float = 60.0) -> None:
        """Fabrics with ``authenticated_rails``: allow one incoming rail connection to take ``peer_id`` within
        ``ttl`` seconds (replacing a live endpoint of that id, with ``guard_claims``); the receiver calls this for
        the rail ids a sender announced over its authenticated control connection. This default does nothing: a
        fabric without admission control takes any connection."""
        return None

    def admission_stats(self) -> Optional[dict]:
        """Incoming rail connections of fabrics that authenticate them (``authenticated_rails``): accepted,
        refused by cause, with a ``refused`` total (``transport.auth.Gate.stats``); None (the default) for a
        fabric that admits no connections of its own."""
        return None

    def access_info(self, mr: MemoryRegion) -> Optional[dict]:
        """What a peer of this host needs to load/store ``mr`` directly (``local_writer``), or None when this
        fabric offers no such access (the default: tcp, verbs). JSON-serialisable."""
        return None

    def local_writer(self, ep: Endpoint, peer_info: dict):
        """Fabrics with the ``loadstore`` capability: an object whose ``write`` moves a checked batch into the
        process behind ``ep`` (a peer on this host) from the calling thread, with no message; ``peer_info`` is
        what that peer's engine sent in its control hello. None when this peer cannot be written that way (the
        default)."""
        return None

    def wire_counts(self) -> Optional[dict]:
        """What this fabric put on the wire since it was made, for fabrics that count it (verbs: ``post_send``
        calls, work requests, signalled and inline ones, WRITE_WITH_IMM ones), else None (the default)."""
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CompletionQueue:
    """Completions waiting for ``Fabric.poll``: progress threads ``push``, ``take`` waits for the first one.

    Shared by the fabrics so that batching, the wait and the wake-up at close behave the same in all of them.
    """

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._handler = None

    def set_handler(self, handler) -> None:
        """From now on ``push`` hands completions to ``handler(list)`` in the pushing thread instead of queueing
        them (``Fabric.set_completion_handler``)."""
        self._handler = handler

    def push(self, completions: Iterable[Completion]) -> None:
        handler = self._handler
        if handler is not None:
            handler(list(completions))
            return
        with self._cv:
            self._items.extend(completions)
            self._cv.notify_all()

    def take(self, max_n: int, timeout: float) -> List[Completion]:
        """Up to ``max_n`` completions; waits up to ``timeout`` seconds for the first unless closed."""
        out: List[Completion] = []
        with self._cv:
            if not self._items and timeout > 0:
                self._cv.wait_for(lambda: self._items or self._closed, timeout=timeout)
            while self._items and len(out) < max_n:
                out.append(self._items.popleft())
        return out

    def close(self) -> None:
        """Wake every waiter; later ``take`` calls return what is left without waiting."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def check_range(addr: int, length: int, what: str = "range") -> None:
    """Raise ``ValueError`` naming the value for a non-positive length or a range that overflows 64 bits."""
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"{what}: length must be a positive int, got {length!r}")
    if isinstance(addr, bool) or not isinstance(addr, int) or addr < 0:
        raise ValueError(f"{what}: address must be a non-negative int, got {addr!r}")
    if addr + length > 1 << 64:
        raise ValueError(f"{what}: address 0x{addr:x} + length {length} overflows 64 bits")
