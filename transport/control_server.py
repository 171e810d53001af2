"""Serving an engine's control connections with a fixed number of threads, whatever the number of peers.

Threads (per control listener, none per connection):

* the accept loop (``transport.auth.Gate.serve``, one thread): accepts, applies the caps on connections still
  authenticating, and hands each new connection (at most 8 ahead of the selector's passes: ``accept``) to
* the selector thread (one): it runs every connection's handshake without blocking (``auth.ServerHandshake``:
  it reads exactly the bytes the next step needs, so a stranger's bytes cost at most 72 bytes of buffer), ends
  a connection whose deadline (``Gate.handshake_timeout``) passed, and reads authenticated connections' requests
  into a per-connection buffer as the bytes arrive (a length field alone allocates nothing; a body above
  ``limit`` closes the connection). A slow or partial request therefore holds nothing but its own buffer. Once a
  request is complete the selector stops reading that connection and hands the request to
* the quick pool (``quick_workers`` threads, 4 by default, all started at the first request, so an engine that
  only sends has none and their number never follows the load; a hello may wait up to a second for a departing
  sender's port, so a few run side by side): it checks the request's tag under the
  connection's session key and sequence number (``auth.Session``; a wrong one closes the connection unanswered
  and counts ``refused_tag``), parses it and answers it. Ops in ``long_ops`` (those that wait on other engines,
  such as a read, which asks the engine it names and then writes into it) are passed on to
* the long pool (``long_workers`` threads, 4 by default, all started at the first such op). Ops in the quick pool
  never wait on another engine's control plane, so a long op waits only on quick ones elsewhere and the two pools cannot
  deadlock across engines.

The reply (length, JSON, tag) is built by the worker and written by the selector as the socket takes it; then
the connection's next request is read. So replies go out in order on their connection, one request at a time per
connection, and a peer that does not read its replies holds only their bytes. An authenticated connection has no
idle timeout (a sender keeps its control connection for region refreshes); it ends when the peer closes it, on a
bad request, or at ``close``.
"""
from __future__ import annotations

import collections
import json
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Dict, Optional

from transport import auth

log = logging.getLogger(__name__)

__all__ = ["ControlServer"]

_LEN = struct.Struct("<I")
_CHUNK = 1 << 16          # bytes read at once from a connection before its request's length is known
_TICK_S = 1.0             # longest the selector sleeps with no deadline due (seconds)
_AHEAD = 8                # connections the accept thread may hand over before the selector has looked at them


class _Conn:
    """One connection the selector watches: its gate record, handshake (until done), session, input buffer
    (at most one request plus one chunk) and reply still to write."""

    __slots__ = ("a", "sock", "hs", "sess", "inbuf", "out", "busy", "current", "registered")

    def __init__(self, a: "auth.Admitted"):
        self.a = a
        self.sock = a.sock
        self.hs: Optional[auth.ServerHandshake] = None
        self.sess: Optional[auth.Session] = None
        self.inbuf = bytearray()
        self.out = b""
        self.busy = False
        self.current: Optional[dict] = None
        self.registered = 0  # the selector events asked for (0: not registered)


class _Pool:
    """``n`` worker threads taking jobs from one queue, all started at the first job (so their number does not
    depend on the load); the queue holds at most one job per connection."""

    def __init__(self, n: int, name: str):
        self.n = n
        self.name = name
        self.q: "queue.SimpleQueue" = queue.SimpleQueue()
        self.threads = []
        self.lock = threading.Lock()
        self.closed = False

    def submit(self, fn, *args) -> bool:
        with self.lock:
            if self.closed:
                return False
            if not self.threads:
                for i in range(self.n):
                    t = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                    t.start()
                    self.threads.append(t)
        self.q.put((fn, args))
        return True

    def _work(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 — a job's own failure is reported by the job; keep the worker
                log.exception("%s: a control job failed", self.name)

    def close(self, timeout: float) -> None:
        with self.lock:
            self.closed = True
            threads = list(self.threads)
        for _ in threads:
            self.q.put(None)
        end = time.monotonic() + timeout
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, end - time.monotonic()))


class ControlServer:
    """The serving side of one control listener (see the module docstring).

    Arguments:
        name: for thread names and logs ("ctrl 127.0.0.1:4000").
        gate: the listener's ``auth.Gate``, made with ``on_accept=server.accept``; its caps, deadline and counters
            apply unchanged.
        secret: the shared secret (``auth.resolve_secret``; None: no authentication); purpose: "ctrl".
        answer: ``answer(current, request) -> reply`` runs on a worker for each parsed request; ``current`` is the
            connection's record (``{"binding", "addr", "owner", "sender"}``, kept across its requests).
        limit: largest request body (bytes).
        quick_workers, long_workers: threads of the two pools; long_ops: op names served on the long pool.
    """

    def __init__(self, name: str, gate: "auth.Gate", secret: Optional[bytes], purpose: str,
                 answer: Callable[[dict, dict], dict], limit: int, quick_workers: int = 4, long_workers: int = 4,
                 long_ops=("read",)):
        self.name = name
        self.gate = gate
        self.secret = secret
        self.purpose = purpose
        self.answer = answer
        self.limit = int(limit)
        self.long_ops = set(long_ops)
        self.closed = False
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._posts: "collections.deque" = collections.deque()  # (kind, conn, payload) from other threads
        self._conns: Dict[int, _Conn] = {}  # id(conn) -> conn, every connection not yet ended
        self._shaking: Dict[int, _Conn] = {}  # those of them still authenticating (their deadlines)
        # the accept thread's pace: connections handed over, taken by the selector, and taken before its last
        # completed pass (``accept``)
        self._pace = threading.Condition()
        self._handed = self._taken = self._looked_at = 0
        self.quick = _Pool(quick_workers, f"pxn-ctrl-op-{name}")
        self.long = _Pool(long_workers, f"pxn-ctrl-long-{name}")
        self.thread: Optional[threading.Thread] = None

    # --- lifetime -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=f"pxn-ctrl-sel-{self.name}", daemon=True)
        self.thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the selector (it ends every connection through the gate) and the pools; joins them."""
        self.closed = True
        self._wake()
        t = self.thread
        if t is None:
            self._shutdown()  # never started: only the selector and its wake-up pair to close
        elif t is not threading.current_thread():
            t.join(timeout)
        self.quick.close(timeout)
        self.long.close(timeout)

    def accept(self, a: "auth.Admitted") -> None:
        """``Gate(on_accept=)``: take a new connection over (on the accept thread).

        It waits while ``_AHEAD`` connections handed over have not yet been through one pass of the selector
        (woken for it at once). Without that pace, a flood of connections that send garbage and close is
        accepted faster than the selector refuses them, and the gate's cap on connections still authenticating
        pushes out the oldest, which may be a legitimate handshake in progress. With it, such a connection is
        refused within a pass or two of being accepted, and only peers that really are slow fill the cap."""
        with self._pace:
            while not self.closed and self._handed - self._looked_at >= _AHEAD:
                self._wake()
                self._pace.wait(_TICK_S)
            if self.closed:
                raise ConnectionAbortedError(f"{self.name} is closing")
            self._handed += 1
        self._post("new", _Conn(a), None)

    def _post(self, kind: str, conn: _Conn, payload) -> None:
        self._posts.append((kind, conn, payload))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (the pipe is full), or closed

    # --- the selector thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            fresh = False  # connections registered since the last pass: look at them at once (``accept``)
            while not self.closed:
                taken = self._taken  # connections registered before this pass: the pass looks at them
                for key, mask in self._sel.select(0 if fresh else self._timeout()):
                    conn = key.data
                    if conn is None:
                        self._drain_wake()
                        continue
                    try:
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if mask & selectors.EVENT_READ and conn.registered & selectors.EVENT_READ:
                            self._readable(conn)
                    except Exception as e:  # noqa: BLE001 — one connection's failure must not stop the others
                        self._end(conn, e)
                if taken != self._looked_at:
                    with self._pace:
                        self._looked_at = taken
                        self._pace.notify_all()
                self._take_posts()
                fresh = self._taken != taken
                self._expire()
        except Exception:  # noqa: BLE001 — a bug here; say so, then end every connection (peers reconnect)
            log.exception("%s: the control selector failed; closing its connections", self.name)
            self.closed = True
        finally:
            self._shutdown()

    def _timeout(self) -> float:
        now = time.monotonic()
        due = [c.a.deadline for c in self._shaking.values()]
        return max(0.0, min(due) - now) + 0.001 if due else _TICK_S

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _take_posts(self) -> None:
        while self._posts:
            kind, conn, payload = self._posts.popleft()
            try:
                if kind == "new":
                    self._taken += 1
                    self._open(conn)
                elif id(conn) not in self._conns:
                    continue  # ended meanwhile (the gate pushed it out, or close)
                elif kind == "reply":
                    conn.out = payload
                    self._flush(conn)
                else:  # "end": the worker found the request bad
                    self._end(conn, payload, quiet=True)
            except Exception as e:  # noqa: BLE001
                self._end(conn, e)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._shaking.values() if c.a.deadline <= now]:
            self._end(conn, socket.timeout(f"handshake deadline passed ({self.gate.handshake_timeout:.1f} s)"))

    def _open(self, conn: _Conn) -> None:
        if self.closed:
            self.gate.finish(conn.a, None)
            return
        sock = conn.sock
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.hs = auth.ServerHandshake(sock, self.secret, self.purpose, conn.a.established)
        self._conns[id(conn)] = self._shaking[id(conn)] = conn
        self._watch(conn, selectors.EVENT_READ)

    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.registered:
            return
        if not events:
            self._sel.unregister(conn.sock)
        elif not conn.registered:
            self._sel.register(conn.sock, events, conn)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.registered = events

    def _end(self, conn: _Conn, err: Optional[BaseException], quiet: bool = False) -> None:
        """Stop watching ``conn`` and report its end to the gate (which counts, releases and closes it)."""
        if self._conns.pop(id(conn), None) is None:
            return
        self._shaking.pop(id(conn), None)
        if conn.registered:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.registered = 0
        self.gate.finish(conn.a, None if quiet else err)

    def _readable(self, conn: _Conn) -> None:
        hs = conn.hs
        if hs is not None:
            want = hs.need - len(conn.inbuf)  # a stranger gets no more buffer than the handshake step needs
        elif len(conn.inbuf) < _LEN.size:
            want = _CHUNK
        else:
            want = self._frame_bytes(conn) - len(conn.inbuf)
        try:
            data = conn.sock.recv(max(1, min(want, _CHUNK)))  # recv(n) allocates n bytes, whatever arrived
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            if hs is not None:
                err = hs.closed_early() if hs.need == auth.MAC_BYTES else ConnectionError(
                    "connection closed during the handshake")
            else:
                err = None  # the peer closed its control connection
            self._end(conn, err)
            return
        conn.inbuf += data
        if hs is not None:
            if len(conn.inbuf) == hs.need:
                step, conn.inbuf = bytes(conn.inbuf), bytearray()
                sess = hs.step(step)
                if sess is not None:
                    conn.hs = None
                    del self._shaking[id(conn)]
                    conn.sess = sess
                    conn.current = {"binding": sess.binding, "addr": conn.a.addr, "owner": None, "sender": None}
            return
        self._next(conn)

    def _frame_bytes(self, conn: _Conn) -> int:
        """Bytes of the request at the head of the buffer (length, body, tag); ValueError above the limit."""
        (n,) = _LEN.unpack_from(conn.inbuf)
        if n > self.limit:
            raise ValueError(f"control message of {n} bytes is too large (at most {self.limit})")
        return _LEN.size + n + (auth.TAG_BYTES if conn.sess is not None and conn.sess.keyed else 0)

    def _next(self, conn: _Conn) -> None:
        """Hand the buffer's first request to the quick pool when it is whole; else keep reading."""
        if len(conn.inbuf) >= _LEN.size:
            try:
                total = self._frame_bytes(conn)
            except ValueError as e:
                log.warning("control connection from %s: %s; closing it", conn.a.addr, e)
                self._end(conn, None)
                return
            if len(conn.inbuf) >= total:
                frame = bytes(conn.inbuf[:total])
                del conn.inbuf[:total]
                conn.busy = True
                self._watch(conn, 0)
                if not self.quick.submit(self._request, conn, frame):
                    self._end(conn, None)
                return
        self._watch(conn, selectors.EVENT_READ)

    def _flush(self, conn: _Conn) -> None:
        if conn.out:
            try:
                k = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                k = 0
            except OSError:
                self._end(conn, None)
                return
            conn.out = conn.out[k:]
            if conn.out:
                self._watch(conn, selectors.EVENT_WRITE)
                return
        conn.busy = False
        self._next(conn)

    def _shutdown(self) -> None:
        with self._pace:
            self._pace.notify_all()  # an accept waiting for the pace sees ``closed``
        for conn in list(self._conns.values()):
            self._end(conn, None)
        while self._posts:
            kind, conn, _ = self._posts.popleft()
            if kind == "new":
                self.gate.finish(conn.a, None)
        self._sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()

    # --- the workers ----------------------------------------------------------------------------------------
    def _request(self, conn: _Conn, frame: bytes) -> None:
        """Quick pool: check the tag, parse, then answer here or pass the request on to the long pool."""
        head, sess = frame[:_LEN.size], conn.sess
        if sess is not None and sess.keyed:
            body, tag = frame[_LEN.size:-auth.TAG_BYTES], frame[-auth.TAG_BYTES:]
            try:
                sess.check(tag, head, body)  # before the body is parsed or acted on
            except auth.AuthError as e:
                self.gate.count("refused_tag")
                log.warning("control connection from %s: %s", conn.a.addr, e)
                self._post("end", conn, e)
                return
        else:
            body = frame[_LEN.size:]
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError(f"control message is a JSON {type(req).__name__}, not an object")
        except ValueError as e:
            log.warning("control connection from %s: %s; closing it", conn.a.addr, e)
            self._post("end", conn, e)
            return
        if req.get("op") in self.long_ops:
            if not self.long.submit(self._reply, conn, req):
                self._post("end", conn, None)
            return
        self._reply(conn, req)

    def _reply(self, conn: _Conn, req: dict) -> None:
        try:
            rep = self.answer(conn.current, req)
            body = json.dumps(rep).encode()
        except Exception as e:  # noqa: BLE001 — ``answer`` reports op failures itself; this is a broken reply
            log.exception("%s: answering %s from %s failed", self.name, req.get("op"), conn.a.addr)
            self._post("end", conn, e)
            return
        head = _LEN.pack(len(body))
        sess = conn.sess
        tag = sess.tag(head, body) if sess is not None and sess.keyed else b""
        self._post("reply", conn, head + body + tag)
