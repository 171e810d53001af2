"""TCP fabric: one-sided writes over real sockets, the fallback for machines without RDMA and the CI stand-in.

``TcpFabric`` is the shared socket-message layer (``transport.fabric.socket_fabric``: regions, connections, the
receive loop's message reading; the wire format in ``transport.fabric.wire``) with tcp's sender side
(``transport.fabric.tcp_posting``), target side (``transport.fabric.tcp_landing``) and I/O threads
(``transport.fabric.tcp_io``).

Threads: a fixed number per fabric, whatever the number of peers: ``io_threads`` readers sharing one epoll set of
every socket (a readable socket is read by one of them at a time), as many senders serving a queue of sockets
with something to send, the listener and the watchdog (and a short-lived thread per incoming connection while
it authenticates). Posting threads send a small message themselves when its socket is idle (``send_now``), and a
caller waiting for its small batch reads the ack itself (``await_rows``), taking the socket from the readers for
that while.
"""
from __future__ import annotations

import select
from typing import Optional, Sequence

from transport import auth
from transport.config import EngineConfig
from transport.fabric.base import Capabilities, Endpoint, MemoryRegion, WriteRequest, WriteRows
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.messages import OutMsg
from transport.fabric.sockets import Sock
from transport.fabric.socket_fabric import SocketFabric, log
from transport.fabric.spin import AdaptiveSpin
from transport.fabric.tcp_io import TcpIo
from transport.fabric.tcp_landing import TcpLanding
from transport.fabric.tcp_posting import TcpPoster

# seconds a thread reads its socket without sleeping before it blocks, at most (``AdaptiveSpin`` keeps it on only
# while it pays): a waiting caller for its small batch's ack (``ack_spin``), a reader thread for the next message
# (``recv_spin``)
SPIN = 150e-6

# the endpoint class under the name tcp's users know it by
TcpEndpoint = SocketEndpoint


class TcpFabric(SocketFabric):
    """One-sided writes over TCP sockets.

    Options as ``SocketFabric`` (``message_bytes`` default 4 MiB: big enough to amortise the per-message Python
    cost, small enough to spread one 64 MB write over every socket), and: ``own_acks`` (default True: a thread that
    posted a small ``WriteRows`` with ``read_ack`` may read its ack from the socket itself, ``await_rows``; False:
    only the reader threads read), ``ack_spin`` (seconds such a thread keeps reading its socket without sleeping
    before it blocks in ``poll``, at most; default ``PXN_ACK_SPIN_US`` or ``SPIN``; 0: block at once),
    ``recv_spin`` (the same for a reader thread on the socket where it placed and acknowledged a small write,
    waiting for the next message; default ``PXN_RECV_SPIN_US`` or ``SPIN``), ``io_threads`` (reader threads, and
    as many sender threads, for all the fabric's sockets: ``tcp_io.TcpIo``; default ``connections_per_peer``,
    at least 2, at most 16). A spin saves the waiting thread's
    wake-up and the peer's cost of waking it where a core is free meanwhile, and costs the peer its core where none
    is: each is an ``AdaptiveSpin``, on only while what it waits for comes within it and the waiting thread gets a
    core whenever it wants one.

    Its parts: the shared socket-message layer it builds on (``SocketFabric``: regions, connections, the reading
    of a message), its I/O threads (``TcpIo``, owned), its sender side (``TcpPoster``, owned), and its target side
    (``TcpLanding``, the landing strategy it gives ``SocketFabric``: it runs once per message on the reading thread
    and acknowledges through ``send_ctrl`` / ``finish_message``).
    """

    name = "tcp"
    capabilities = Capabilities(selective_signaling=True, completion_callback=True, authenticated_rails=True,
                               write_batches=True, write_rows=True, gather_writes=True, landing_handlers=True,
                               unacked_writes=True)
    # 2 sockets per rail: enough to overlap send and receive, few threads on small CI boxes
    engine_options = {"connections_per_peer": 2}
    # a chunk whose pieces average at least this many bytes is sent as a GatherWrite and placed as it arrives; below
    # it the Python step per piece (a buffer on each side) costs more than the gather and scatter copies it saves,
    # so such chunks are copied into the slot and scattered from it
    gather_min_bytes = 16 << 10
    # a few small pieces go as rows of one message (placed by the receiving thread) rather than in a chunk, whose
    # gather, landing slot and ack each add a thread hand-off; many pieces still pay off as a chunk, whose table
    # the receiver checks and scatters in whole-array steps
    config_defaults = {"direct_pieces": 64}

    def __init__(self, hostname: str = "127.0.0.1", port: int = 0, connections_per_peer: Optional[int] = None,
                 message_bytes: int = 4 << 20, connect_timeout: float = 10.0, keepalive: float = 3.0,
                 ack_timeout: float = 30.0, secret=None, handshake_timeout: float = auth.HANDSHAKE_TIMEOUT,
                 guard_claims: bool = False, max_peers_per_addr: int = 256, own_acks: bool = True,
                 ack_spin: Optional[float] = None, recv_spin: Optional[float] = None,
                 insecure: Optional[bool] = None, io_threads: Optional[int] = None):
        spins = []
        given = EngineConfig.read(("ack_spin", "recv_spin"))  # the variables when no argument is given
        for name, v in (("ack_spin", ack_spin), ("recv_spin", recv_spin)):
            if v is None:
                v = given.get(name, SPIN)
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"{name} must be seconds in [0, 1], got {v!r}")
            spins.append(float(v))
        self._spin, self._recv_spin = spins
        if io_threads is None:
            io_threads = min(16, max(2, connections_per_peer or 2))
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= 64:
            raise ValueError(f"io_threads must be an int in 1..64, got {io_threads!r}")
        super().__init__(hostname, port, connections_per_peer=connections_per_peer, message_bytes=message_bytes,
                         connect_timeout=connect_timeout, keepalive=keepalive, ack_timeout=ack_timeout, secret=secret,
                         handshake_timeout=handshake_timeout, guard_claims=guard_claims,
                         max_peers_per_addr=max_peers_per_addr, insecure=insecure, landing=TcpLanding)
        # a caller waiting for a small batch it posted reads the ack itself (``await_rows``); False: the reader
        # threads read every message
        self._poster = TcpPoster(self, self.book, bool(own_acks) and hasattr(select, "epoll"), self._spin)
        # the poster's own method, bound on the instance: a post reaches it without a hop through this class
        # (``post_writes`` below says what it does)
        self.post_writes = self._poster.post_writes
        self._io = TcpIo(self, io_threads, self.ack_timeout, self._recv_spin)
        self._io.start(str(self.port))
        self._start()

    def post_writes(self, ep: Endpoint, requests: Sequence[WriteRequest]) -> None:
        """Check every request and batch, then send or queue their messages (``TcpPoster.post_writes``; a lone
        ``WriteRows``, the small batch whose Python steps are its latency, straight to ``TcpPoster.post_rows``)."""
        if len(requests) == 1 and type(requests[0]) is WriteRows:
            self._poster.post_rows(ep, requests[0])
        else:
            self._poster.post_writes(ep, requests)

    def await_rows(self, b: WriteRows, deadline: float) -> None:
        """For the thread that posted ``b`` with ``read_ack``: read its ack itself (``TcpPoster.await_rows``)."""
        self._poster.await_rows(b, deadline)

    def transmit(self, ep: SocketEndpoint, s: Sock, msg: OutMsg) -> None:
        """Send queued message ``msg`` on socket ``s`` (its sender thread; ``TcpPoster.transmit``)."""
        self._poster.transmit(ep, s, msg)

    @property
    def ack_spin(self) -> AdaptiveSpin:
        """The spin of a caller waiting for its small batch's ack (``ack_spin``; ``TcpPoster.ack_spin``)."""
        return self._poster.ack_spin

    def set_landing_handler(self, mr: MemoryRegion, handler) -> None:
        """Capability ``landing_handlers``: let ``handler`` place writes with an immediate into the host region
        ``mr`` (a receiver's landing slots) straight into their final destinations.

        For such a write, checked as any write (rkey, whole write inside ``mr``) and carried whole in one message,
        the receiving thread calls ``handler(peer_id, addr, length, imm, read)`` before placing anything;
        ``read(n)`` receives the write's next ``n`` bytes into ``mr`` at their own place and returns a view of
        them (a chunk's header and table). The handler returns None (the rest of the write lands in ``mr`` as
        usual) or a plan: ``dsts``, ``lens``, ``offs`` (lists of ints: byte ``offs[i]`` of the write onwards,
        ``lens[i]`` bytes, go to host address ``dsts[i]``, which the handler vouches for; offsets ascending, past
        what it read, without overlap, inside the write) and ``done()``, called once every byte is placed. Bytes
        of the write outside the plan land in ``mr``. The RECV_IMM of the write follows as for any write."""
        self._book.set_landing_handler(mr, handler)

    def start_endpoint(self, ep: SocketEndpoint) -> None:
        """Serve a new endpoint's sockets with the fabric's I/O threads (``TcpIo.add``)."""
        self._io.add(ep)

    def stop_io(self) -> None:
        self._io.stop()

    def _recv_loop(self, ep: SocketEndpoint, s: Sock) -> None:
        """Read socket ``s`` on this thread, one message after the other, until the link fails (a test's or a
        fuzzer's stand-in for the reader threads, on an endpoint they do not serve)."""
        st = self._poster.caller_state(s)
        try:
            while True:
                self.read_one(ep, s, st["rx"], st)
        except Exception as e:  # noqa: BLE001 — EOF, reset, or a malformed stream: the link is unusable
            if ep.alive and not self._closed:
                log.debug("receive on %s/%d ended", ep.peer_id, s.index, exc_info=True)
            ep.fail(f"receive failed: {e}")
