"""The verbs fabric's endpoint (one RC QP and the TCP channel that watches its peer) and the messages of the
connection exchange over that channel."""
from __future__ import annotations

import collections
import json
import selectors
import socket
import struct
import threading
from typing import Optional

from transport import auth
from transport.fabric.base import Completion, Endpoint, Fabric


# ---- the liveness channel's messages ----------------------------------------------------------------------------
def send_json(sock: socket.socket, obj, session: Optional["auth.Session"]) -> None:
    """One message of the connection exchange: length, JSON, and (with a secret) the tag of the connection's
    session over both, so that QP numbers and GIDs come only from the authenticated peer."""
    data = json.dumps(obj).encode()
    head = struct.pack("<I", len(data))
    tag = session.tag(head, data) if session is not None and session.keyed else b""
    sock.sendall(head + data + tag)


def recv_json(sock: socket.socket, session: Optional["auth.Session"]):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed during the verbs handshake")
            buf += chunk
        return buf
    head = exact(4)
    (n,) = struct.unpack("<I", head)
    if n > 1 << 16:
        raise ValueError(f"handshake message of {n} B is implausible")
    data = exact(n)
    if session is not None and session.keyed:
        session.check(exact(auth.TAG_BYTES), head, data)  # AuthError before anything in it is used
    return json.loads(data)


# ---- the channels' watch -----------------------------------------------------------------------------------------
class ChannelWatch:
    """The endpoints' TCP channels carry nothing after the exchange; EOF on one means the peer process is gone or
    failed its end of the QP pair. One thread (``run``, until ``closed()`` or ``close``) watches every channel
    added and, when one ends, stops watching it and calls ``on_lost(endpoint, cause)``."""

    def __init__(self, on_lost, closed):
        self._sel = selectors.DefaultSelector()
        self._on_lost = on_lost
        self._closed = closed

    def add(self, ep: "VerbsEndpoint") -> None:
        self._sel.register(ep.sock, selectors.EVENT_READ, ep)

    def remove(self, ep: "VerbsEndpoint") -> None:
        try:
            self._sel.unregister(ep.sock)
        except (KeyError, ValueError, OSError):
            pass

    def close(self) -> None:
        self._sel.close()

    def run(self) -> None:
        while not self._closed():
            try:
                events = self._sel.select(timeout=0.2)
            except (OSError, ValueError):  # the selector was closed
                return
            for key, _ in events:
                ep = key.data
                cause = None
                try:
                    while True:
                        data = ep.sock.recv(4096, socket.MSG_DONTWAIT)
                        if not data:
                            cause = "peer closed its channel"
                            break
                except BlockingIOError:
                    pass
                except OSError as ex:
                    cause = f"its channel to the peer failed ({ex})"
                if cause is not None:
                    self.remove(ep)
                    self._on_lost(ep, cause)


# ---- endpoints ---------------------------------------------------------------------------------------------------
class Posted:
    """What one ``post_writes`` item became: work requests ``first``..``last`` (sequence numbers of the
    endpoint), and what to complete when they are done. ``remote`` / ``lengths``: the remote addresses and
    lengths of a batch's writes (to name the refused one)."""

    __slots__ = ("first", "last", "wr_id", "opcode", "nbytes", "imm", "signaled", "remote", "lengths")

    def __init__(self, first, last, wr_id, opcode, nbytes, imm, signaled, remote, lengths):
        self.first, self.last, self.wr_id, self.opcode = first, last, wr_id, opcode
        self.nbytes, self.imm, self.signaled, self.remote, self.lengths = nbytes, imm, signaled, remote, lengths

    def completion(self, peer_id: str, error=None) -> Completion:
        return Completion(self.wr_id, self.opcode, peer_id, self.nbytes, self.imm, error)

    def write_at(self, seq: int) -> str:
        i = seq - self.first
        if self.lengths is None:
            return f"wr_id={self.wr_id} ({self.nbytes} B to 0x{self.remote:x})"
        return (f"write {i} of batch wr_id={self.wr_id} ({int(self.lengths[i])} B to "
                f"0x{int(self.remote[i]):x})")


class SendChain:
    """Work-request objects of one QP, built once and reused: real pyverbs frees neither ``SendWR`` nor ``SGE``
    (64 B each), so building them per write leaks. ``wrs[i]`` is the i-th from the end of one linked chain whose
    last work request ends it, each pointing at its own ``SGE`` (``sg_list``: the WR reads the SGE's fields at
    post time); a chain of ``k`` starts at ``wrs[k - 1]``. ``ibv_post_send`` copies what it needs before it
    returns, so the objects are rewritten for the next post (the endpoint's ``post_lock`` serialises posts)."""

    __slots__ = ("v", "wrs", "sges")

    def __init__(self, v: dict):
        self.v = v
        self.wrs: list = []
        self.sges: list = []

    def take(self, k: int):
        """The last ``k`` work requests of the chain, in posting order (their SGEs alongside), growing it once."""
        SGE, SendWR = self.v["SGE"], self.v["SendWR"]
        while len(self.wrs) < k:
            sge = SGE(0, 0, 0)
            wr = SendWR(num_sge=1, sg=[sge])
            wr.sg_list = sge
            if self.wrs:
                wr.next_wr = self.wrs[-1]
            self.wrs.append(wr)
            self.sges.append(sge)
        return self.wrs[k - 1::-1], self.sges[k - 1::-1]


class VerbsEndpoint(Endpoint):
    """One RC QP (with its own CQ) to a peer, and the TCP channel that watches that the peer lives.

    Who may touch the QP and CQ: the fabric's progress thread polls the CQ and is the only thread that destroys
    them (``destroyed``, set under ``lock``); a thread that posts or moves the QP to the error state does so under
    ``lock`` and only while ``destroyed`` is false. So no pyverbs object is used after its ``close()``: on real
    pyverbs that dereferences a NULL handle (SIGSEGV)."""

    alive: bool = True  # ``Endpoint.alive`` as a plain attribute (set in ``__init__``, cleared on failure)

    def __init__(self, fabric: Fabric, peer_id: str, qp, cq, sock: socket.socket):
        self.fabric, self.peer_id, self.qp, self.cq, self.sock = fabric, peer_id, qp, cq, sock
        self.qp_num = qp.qp_num
        # True until the QP failed (``VerbsFabric.fail_endpoint``): a plain attribute, read per post and completion
        self.alive = True
        self.cause: Optional[str] = None
        self.lock = threading.Lock()  # the fields below
        self.post_lock = threading.Lock()  # one poster at a time: sequence order is posting order
        self.room = threading.Condition(self.lock)
        self.next_seq = 1
        self.retired = 0  # every work request up to this sequence number has completed
        self.pending: "collections.deque[Posted]" = collections.deque()
        self.settled = False  # the QP's outcome is known: pending work was completed or failed
        self.destroyed = False  # QP, CQ and channel closed (by the progress thread)
        self.chain = SendChain(fabric.v)
        self.max_inline = 0

    def abort(self) -> None:
        """Move the QP to the error state (its posted work flushes as ``PeerLost``) and drop the TCP channel."""
        self.fabric.fail_endpoint(self, "aborted locally")

    def destroy(self) -> None:
        """Close the QP, CQ and channel (the progress thread, or ``close`` once that thread has ended)."""
        with self.lock:
            if self.destroyed:
                return
            self.destroyed = True
            for obj in (self.qp, self.cq, self.sock):
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 — a socket closed twice, a QP whose context went first
                    pass

    def __repr__(self):
        return f"VerbsEndpoint({self.peer_id}, qp {self.qp_num}, {'alive' if self.alive else self.cause})"
