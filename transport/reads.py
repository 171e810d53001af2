"""Reads (pull transfers) and notifies for ``transport.TransferEngine``.

``TransferEngine.batch_read(session, local_dsts, remote_srcs, lengths)`` copies ``lengths[i]`` bytes from
``remote_srcs[i]`` in the peer's registered memory to ``local_dsts[i]`` in this engine's registered memory. It is
built on the write path rather than beside it:

1. the initiator checks every local destination against the regions it registered (all-or-nothing: one bad
   piece and nothing is asked for);
2. it sends one control request ``{"op": "read", "session": <its own session id>, "srcs", "dsts", "lengths",
   "timeout"}`` (the three arrays as base64 of little-endian int64) to the peer's control port;
3. the peer checks every source against the regions IT registered (bounds-checked, all-or-nothing) and that the
   session named is the engine that asked: before the first read on a control connection it asks the engine at
   that session, over its own authenticated connection (op ``owns``), whether it opened the connection the
   request came in on (``transport.auth.Session.binding``), and refuses with ``RemoteRejected`` otherwise (a
   read naming a third engine, or any other host:port, writes nothing). Then it runs an ordinary
   ``batch_write`` back into the initiator's session. So every fabric carries reads, and small remote
   pieces are gathered by the peer into coalesced chunks, one fabric write per chunk (the pull side of
   coalescing); large ones go direct or PXN-relayed exactly as writes do;
4. the peer replies ``{"ok": true}`` once every byte is placed at the initiator, else ``{"ok": false, "type":
   <exception class>, "error": <message naming the bad value>}``; the initiator raises that as a typed
   exception (``InvalidTransfer`` for a source outside the peer's regions: nothing was written).

Reads are idempotent for the initiator's memory (the same bytes land at the same place), so a request on a pooled
control connection that turns out to be dead is sent once more on a fresh connection.

Notifies (Mooncake's ``TransferNotify``): ``send_notify`` delivers a (name, message) pair to the peer's queue
(op "notify"), ``take_notifies`` drains this engine's queue in arrival order.

Requests run on their own control connections (a small per-session pool), never on the connection the write
path uses for region refreshes, so a long read does not hold that one up. The peer answers reads on its control
plane's long pool (``transport.control_server``, 4 threads): concurrent reads from one initiator proceed in
parallel there, up to that many at once; more wait their turn.
"""
from __future__ import annotations

import base64
import logging
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from transport.auth import AuthError
from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, InvalidTransfer, PeerGone, PeerLost,
                              RemoteRejected, TransferError, TransferTimeout, UnknownSession)
from transport.arrays import as_arrays
from transport.batches import batch_timeout
from transport.control import recv_msg, send_msg
from transport.regions import first_bad

log = logging.getLogger(__name__)

__all__ = ["Reads", "ReadHandle", "batch_read", "batch_read_async", "serve_op", "send_notify", "take_notifies",
           "CONTROL_OPS"]

CONTROL_OPS = ("read", "notify")   # the control ops this module serves (registered in ControlPlane.ops)
_POOL_IDLE = 8                     # idle read connections kept per session
_REPLY_MARGIN_S = 10.0             # extra wait for the peer's reply beyond the batch timeout (seconds)
_MAX_NOTIFIES = 1 << 16            # queued notifies kept per engine; the oldest are dropped beyond this
_MAX_NOTIFY_BYTES = 64 << 20       # bytes of queued notifies per engine (``_notify_bytes``), likewise
_NOTIFY_ENTRY_BYTES = 200          # what a queued notify costs beyond its text: the tuple and two str objects


# --- wire encoding of the address arrays ----------------------------------------------------------------------
def _pack(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i8").tobytes()).decode()


def _unpack(name: str, text) -> np.ndarray:
    if not isinstance(text, str):
        raise InvalidTransfer(f"read request: {name} must be base64 text, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise InvalidTransfer(f"read request: {name} is not base64: {e}") from None
    if len(raw) % 8:
        raise InvalidTransfer(f"read request: {name} holds {len(raw)} bytes, not a whole number of int64")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


# --- per-engine state ----------------------------------------------------------------------------------------
class Reads:
    """Pooled control connections for reads, the async executor and the notify queue of one engine, which owns
    it; it serves the ops ``CONTROL_OPS`` on the engine's control plane (``ControlPlane.ops``).

    Arguments: engine: the owning ``TransferEngine`` (a read is served by its ``batch_write``); control: its
    ``ControlPlane`` (connections to peers, the connection a request came in on); regions: its ``RegionTable``
    (the local side of a read, the sources of one served); check_open: raises ``FabricClosed`` once the engine
    closed."""

    def __init__(self, engine, control, regions, check_open):
        self.engine = engine
        self.control = control
        self.regions = regions
        self.check_open = check_open
        self.lock = threading.Lock()
        self.idle: Dict[str, List[socket.socket]] = {}
        self.executor: Optional[ThreadPoolExecutor] = None
        self.notifies: List[Tuple[str, str]] = []
        self.notify_bytes = 0  # ``_notify_bytes`` summed over ``notifies``
        self.closed = False
        for op in CONTROL_OPS:
            control.ops[op] = self.serve

    def serve(self, req: dict) -> dict:
        """A control op of ``CONTROL_OPS`` (only ever reached on an authenticated connection)."""
        return serve_op(self.engine, req)

    def take(self, session: str) -> Tuple[socket.socket, bool]:
        """A control connection to ``session`` and whether it came from the pool (may be stale)."""
        with self.lock:
            if self.closed:
                raise FabricClosed(f"engine {self.engine.session_id} is closed")
            socks = self.idle.get(session)
            if socks:
                return socks.pop(), True
        return self.control.connect(session), False  # authenticated like every control connection

    def give_back(self, session: str, sock: socket.socket) -> None:
        with self.lock:
            socks = self.idle.setdefault(session, [])
            if not self.closed and len(socks) < _POOL_IDLE:
                socks.append(sock)
                return
        _close(sock)

    def submit(self, fn, *args) -> Future:
        with self.lock:
            if self.closed:
                raise FabricClosed(f"engine {self.engine.session_id} is closed")
            if self.executor is None:
                self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pxn-read")
            return self.executor.submit(fn, *args)

    def close(self) -> None:
        """Close the pooled connections and the executor (called by ``TransferEngine.close``)."""
        with self.lock:
            self.closed = True
            socks = [s for lst in self.idle.values() for s in lst]
            self.idle.clear()
            ex, self.executor = self.executor, None
        for s in socks:
            _close(s)
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


# --- initiator -----------------------------------------------------------------------------------------------
class ReadHandle:
    """What ``batch_read_async`` returns: ``wait(timeout)`` raises the read's error, ``done()`` polls."""

    def __init__(self, future: Optional[Future], timeout: float, nbytes: int):
        self._future = future
        self._timeout = timeout
        self._nbytes = nbytes

    def done(self) -> bool:
        """True once the read finished (successfully or not)."""
        return self._future is None or self._future.done()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the read. Arguments: timeout in seconds (default: the one given at submission plus the
        reply margin). Raises the read's ``TransferError`` (``TransferTimeout`` when it did not finish in time)."""
        if self._future is None:
            return
        limit = batch_timeout(timeout, self._timeout + _REPLY_MARGIN_S, poll=True)
        try:
            self._future.result(limit)
        except FutureTimeout:
            raise TransferTimeout(f"read of {self._nbytes} B did not finish within {limit} s") from None

    @property
    def nbytes(self) -> int:
        return self._nbytes


def _validate(engine, session_id, local_dsts, remote_srcs, lengths):
    """Argument and local-destination checks (all-or-nothing). Returns (dst, src, ln) int64 arrays."""
    engine.reads.check_open()
    dst, src, ln = as_arrays(("local_dsts", local_dsts), ("remote_srcs", remote_srcs), ("lengths", lengths))
    if not isinstance(session_id, str) or session_id.count(":") < 1:
        raise UnknownSession(f"session id must be 'host:port', got {session_id!r}")
    if ln.size and int(ln.min()) == 0:  # zero-length pieces are done by definition, as in Mooncake
        keep = ln != 0
        dst, src, ln = dst[keep], src[keep], ln[keep]
    if ln.size == 0:
        return dst, src, ln
    _check_inside(engine, "local_dsts", dst, ln, "is not inside a region registered with this engine; nothing was "
                                                 "read", also=(("remote_srcs", src),))
    return dst, src, ln


def _check_inside(engine, name: str, addrs: np.ndarray, ln: np.ndarray, outside: str, also=()) -> None:
    """Every length >= 1 (zero-length pieces are gone by now), every address (``addrs``, then each of ``also``:
    (name, array) pairs) >= 0, every piece of ``addrs`` inside a region this engine registered; else
    ``InvalidTransfer`` naming the first bad piece (``outside``: how a piece outside every region is told)."""
    if int(ln.min()) < 1:
        i = int(np.argmin(ln))
        raise InvalidTransfer(f"lengths[{i}] = {int(ln[i])}: every length must be >= 0")
    for label, arr in ((name, addrs), *also):
        if int(arr.min()) < 0:
            i = int(np.argmin(arr))
            raise InvalidTransfer(f"{label}[{i}] = {int(arr[i])} is negative")
    _, ok = engine.reads.regions.locate(addrs, ln)
    if not ok.all():
        i = first_bad(ok)
        raise AddressNotRegistered(f"{name}[{i}] = 0x{int(addrs[i]):x} + lengths[{i}] = {int(ln[i])} {outside}")


def _request(engine, session_id: str, msg: dict, timeout: float) -> dict:
    """One request / reply on a pooled control connection to ``session_id``; a dead pooled connection is
    replaced once. Raises UnknownSession when nobody answers, TransferTimeout, PeerGone (the connection broke, or
    nobody answers where a peer was connected)."""
    st = engine.reads
    for attempt in (0, 1):
        sock, pooled = st.take(session_id)
        try:
            sock.settimeout(timeout)
            send_msg(sock, msg)
            rep = recv_msg(sock)
        except socket.timeout:
            _close(sock)
            raise TransferTimeout(f"{msg.get('op')} request to {session_id}: no reply within {timeout:.1f} s")
        except (OSError, ConnectionError, ValueError, AuthError) as e:
            _close(sock)
            if pooled and attempt == 0:
                continue  # the pooled connection died while idle (peer restarted): once more on a fresh one
            raise PeerGone(f"{msg.get('op')} request to {session_id}: control connection failed: {e}", None,
                           e) from e
        st.give_back(session_id, sock)
        return rep
    raise AssertionError("unreachable")


_REMOTE_TYPES = {cls.__name__: cls for cls in (InvalidTransfer, AddressNotRegistered, RemoteRejected, TransferTimeout,
                                               PeerLost)}


def _raise_remote(session_id: str, rep: dict) -> None:
    kind = rep.get("type")
    text = f"peer {session_id}: {rep.get('error')}"
    if kind == "UnknownSession":
        # the peer could not open the write path back to this engine (address not reachable from there)
        raise TransferError(f"{text} (the peer cannot connect back to this engine to deliver the read)")
    raise _REMOTE_TYPES.get(kind, TransferError)(text)


def _run(engine, session_id: str, dst, src, ln, timeout: float) -> None:
    msg = {"op": "read", "session": engine.session_id, "engine_id": engine.engine_id, "srcs": _pack(src),
           "dsts": _pack(dst), "lengths": _pack(ln), "timeout": timeout}
    rep = _request(engine, session_id, msg, timeout + _REPLY_MARGIN_S)
    if not rep.get("ok"):
        engine.counters.add_many((("reads_submitted", 1), ("reads_failed", 1)))
        _raise_remote(session_id, rep)
    engine.counters.add_many((("reads_submitted", 1), ("reads_ok", 1), ("read_items", int(ln.size)),
                 ("read_bytes", int(ln.sum()))))


def batch_read(engine, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
               lengths: Sequence[int], timeout: Optional[float] = None) -> None:
    """See ``TransferEngine.batch_read``."""
    limit = batch_timeout(timeout, engine.config.timeout)
    dst, src, ln = _validate(engine, session_id, local_dsts, remote_srcs, lengths)
    if ln.size == 0:
        _request(engine, session_id, {"op": "regions"}, limit)  # an unknown session is an error even here
        return
    _run(engine, session_id, dst, src, ln, limit)


def batch_read_async(engine, session_id: str, local_dsts: Sequence[int], remote_srcs: Sequence[int],
                     lengths: Sequence[int], timeout: Optional[float] = None) -> ReadHandle:
    """See ``TransferEngine.batch_read_async``."""
    limit = batch_timeout(timeout, engine.config.timeout)
    dst, src, ln = _validate(engine, session_id, local_dsts, remote_srcs, lengths)
    if ln.size == 0:
        _request(engine, session_id, {"op": "regions"}, limit)
        return ReadHandle(None, limit, 0)
    return ReadHandle(engine.reads.submit(_run, engine, session_id, dst, src, ln, limit), limit, int(ln.sum()))


def send_notify(engine, session_id: str, name: str, msg: str, timeout: float = 10.0) -> None:
    """Append (``name``, ``msg``) to the notify queue of the engine at ``session_id`` (Mooncake's
    ``TransferNotify``); returns once the peer queued it. Raises UnknownSession / PeerLost / TransferError."""
    engine.reads.check_open()
    if not isinstance(session_id, str) or session_id.count(":") < 1:
        raise UnknownSession(f"session id must be 'host:port', got {session_id!r}")
    rep = _request(engine, session_id, {"op": "notify", "name": str(name), "msg": str(msg)}, timeout)
    if not rep.get("ok"):
        _raise_remote(session_id, rep)


def take_notifies(engine) -> List[Tuple[str, str]]:
    """The (name, msg) pairs peers sent to this engine since the last call, oldest first; where there are any,
    after ``engine.flush_gpu_writes()``, so that GPU memory the peer wrote is visible to what reads it next."""
    st = engine.reads
    with st.lock:
        out, st.notifies = st.notifies, []
        st.notify_bytes = 0
    if out:
        # a notify says the peer's writes completed: GPU memory they went to straight is read next (GPUDirect)
        engine.flush_gpu_writes()
    return out


# --- the peer's side -----------------------------------------------------------------------------------------
def _notify_bytes(item: Tuple[str, str]) -> int:
    """Bytes a queued notify is counted for: its name and message as UTF-8 plus a fixed cost per entry (a str of
    non-ASCII text may take up to 4 bytes per character in memory, as in UTF-8)."""
    return len(item[0].encode("utf-8", "surrogatepass")) + len(item[1].encode("utf-8", "surrogatepass")) \
        + _NOTIFY_ENTRY_BYTES


def serve_op(engine, req: dict) -> dict:
    """Serve one control request of ``CONTROL_OPS`` (``TransferEngine._serve`` calls this on the control
    connection's thread). Never raises: failures are replied with the exception's class name and message."""
    op = req.get("op")
    try:
        if op == "notify":
            st = engine.reads
            with st.lock:
                item = (str(req.get("name", "")), str(req.get("msg", "")))
                st.notifies.append(item)
                st.notify_bytes += _notify_bytes(item)
                drop = 0
                while len(st.notifies) - drop > _MAX_NOTIFIES or (st.notify_bytes > _MAX_NOTIFY_BYTES
                                                                  and len(st.notifies) - drop > 1):
                    st.notify_bytes -= _notify_bytes(st.notifies[drop])
                    drop += 1
                if drop:
                    del st.notifies[:drop]
            return {"ok": True}
        return _serve_read(engine, req)
    except Exception as e:  # noqa: BLE001 — the requester raises it as a typed exception
        level = logging.INFO if isinstance(e, InvalidTransfer) else logging.WARNING
        log.log(level, "engine %s: %s request from %s refused: %s: %s", engine.session_id, op,
                req.get("session"), type(e).__name__, e)
        return {"ok": False, "type": type(e).__name__, "error": str(e)}


def _serve_read(engine, req: dict) -> dict:
    session = req.get("session")
    if not isinstance(session, str) or session.count(":") < 1:
        raise InvalidTransfer(f"read request: session {session!r} is not 'host:port'")
    src = _unpack("srcs", req.get("srcs"))
    dst = _unpack("dsts", req.get("dsts"))
    ln = _unpack("lengths", req.get("lengths"))
    if not (src.size == dst.size == ln.size) or src.size == 0:
        raise InvalidTransfer(f"read request: {src.size} sources, {dst.size} destinations, {ln.size} lengths")
    _check_inside(engine, "remote_srcs", src, ln, f"is outside every region session {engine.session_id} "
                                                  f"registered; nothing was written")
    timeout = req.get("timeout")
    timeout = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None
    _check_asker(engine, session, timeout)
    engine.batch_write(session, src, dst, ln, timeout=timeout)
    return {"ok": True}


def _check_asker(engine, session: str, timeout: Optional[float]) -> None:
    """The bytes of a read go to the engine that asked, on the connection the request came in on, and nowhere
    else: before the first read on a control connection is served, the engine at the ``session`` the request
    names is asked (over a control connection of this engine's own, authenticated) whether it opened that
    connection (its ``Session.binding``, which only the two ends of the connection know). Once it said yes, the
    connection's later reads naming the same session need no question. Raises ``RemoteRejected`` (nothing
    written, nothing connected beyond that question) when it says no or cannot be asked."""
    conn = engine.reads.control.current()
    if conn is None:
        raise RemoteRejected("read request outside a control connection")
    if conn["owner"] == session:
        return
    try:
        rep = _request(engine, session, {"op": "owns", "binding": conn["binding"].hex()},
                       min(timeout or 10.0, 10.0))
    except (TransferError, FabricError) as e:
        raise RemoteRejected(f"read request names session {session!r}, which could not be asked whether it sent "
                             f"the request: {e}; nothing was written") from None
    if not rep.get("ok") or rep.get("owns") is not True:
        log.warning("engine %s: a read request from %s names session %s, which did not send it; refused",
                    engine.session_id, conn["addr"], session)
        raise RemoteRejected(f"read request names session {session!r}, which did not send it (the bytes of a "
                             f"read go only to the engine that asks); nothing was written")
    conn["owner"] = session
