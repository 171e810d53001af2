"""Event-ordered writes of the ipc fabric (capability ``event_ordered_writes``): a post's copies launched on a
stream of the source GPU that waits for the sources' producers, completed by one thread that waits for each post's
copy event in posting order.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Optional

import numpy as np

from transport.fabric.base import WriteBatch
from transport.fabric.endpoint import SocketEndpoint
from transport.fabric.messages import BatchRecord, OutMsg
from transport.fabric.wire import PIECE_DT, ST_FAILED

log = logging.getLogger(__name__)


def batch_message(b: WriteBatch) -> OutMsg:
    """A message without a table for batch ``b``, which the writer completes itself."""
    m = OutMsg(0)
    m.batch, m.final, m.pieces = BatchRecord(b), True, b.count
    return m


def failed_statuses(m: OutMsg, b: WriteBatch) -> bytes:
    """Give a table-less batch message the piece table its failed completion names a piece from."""
    m.table = np.zeros(b.count, dtype=PIECE_DT)
    ra, ln = b.remote_addr, b.length
    m.table["addr"], m.table["len"], m.table["waddr"], m.table["wlen"], m.table["rkey"] = ra, ln, ra, ln, b.rkey
    return bytes([ST_FAILED]) * b.count


class _Completer:
    """The thread that completes event-ordered posts: waits for each post's copy event in posting order, then
    acks its messages (success, or failure when the copy failed)."""

    def __init__(self, name: str, failed_statuses):
        import queue
        self._q = queue.SimpleQueue()
        self._failed_statuses = failed_statuses
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, ep, event, msgs, batches) -> None:
        self._q.put((ep, event, msgs, batches))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ep, event, msgs, batches = item
            try:
                event.synchronize()  # releases the GIL while it waits
                failed = False
            except Exception as e:  # noqa: BLE001 — a CUDA failure fails these batches, not the link
                log.error("ipc ordered GPU copy to %s failed: %s", ep.peer_id, e)
                failed = True
            for m, b in zip(msgs, batches):
                try:
                    ep.on_ack(m.seq, self._failed_statuses(m, b) if failed else bytes(b.count))
                except Exception:  # noqa: BLE001 — one bad completion must not stop the thread
                    log.exception("completing ipc message %d to %s failed", m.seq, ep.peer_id)

    def close(self) -> None:
        self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)



class OrderedPosts:
    """The ordered streams (one per source GPU) and the completer thread of one ipc fabric (``owner``: its id).
    ``copies``: the fabric's ``BoundCopies``; ``mapped(description, device)``: a peer allocation's pointer here."""

    def __init__(self, owner: str, copies, mapped):
        self._owner = owner
        self._copies = copies
        self._mapped = mapped
        self._lock = threading.Lock()
        self._streams: Dict[int, object] = {}  # GPU -> stream of event-ordered writes
        self._completer: Optional[_Completer] = None

    def post(self, ep: SocketEndpoint, batches, dev: int, reg: dict, after):
        """One launch for every checked batch, from GPU ``dev`` into the peer GPU region ``reg`` (whose current
        description holds them all), on ``dev``'s ordered stream after the CUDA events ``after``; the batches
        complete from the completer thread. Returns the copy's event, or None when the launch failed (the batches
        completed with the failure, ``after`` waited for)."""
        msgs = [batch_message(b) for b in batches]
        ep.enqueue(msgs, queue=False, local=[True] * len(msgs))
        if len(batches) == 1:
            la, ra, ln = batches[0].local_addr, batches[0].remote_addr, batches[0].length
        else:
            la, ra, ln = (np.concatenate([getattr(b, k) for b in batches]) for k in ("local_addr", "remote_addr",
                                                                                      "length"))
        try:
            shift = self._mapped(reg, dev) - reg["base"]
            stream = self._stream(dev)
            for event in after:
                stream.wait_event(event)
            copies = self._copies
            (done, _), = copies.finish([copies.copy(dev, la, ra, ln, stream=stream, dst_shift=shift)], wait=False,
                                       stream=stream)
        except Exception as e:  # noqa: BLE001 — a CUDA failure fails these batches, not the link
            log.error("ipc GPU copy of %d piece(s) to %s failed: %s", int(ln.size), ep.peer_id, e)
            for m, b in zip(msgs, batches):
                ep.on_ack(m.seq, failed_statuses(m, b))
            for event in after:  # the sources' producers may still run: the caller reuses them after this
                event.synchronize()
            return None
        self._completer_thread().put(ep, done, msgs, batches)
        return done

    def _stream(self, dev: int):
        stream = self._streams.get(dev)
        if stream is None:
            import torch
            with self._lock:
                stream = self._streams.get(dev)
                if stream is None:
                    stream = self._streams[dev] = torch.cuda.Stream(device=dev)
        return stream

    def _completer_thread(self) -> _Completer:
        c = self._completer
        if c is None:
            with self._lock:
                if self._completer is None:
                    self._completer = _Completer(f"pxn-ipc-complete-{self._owner}", failed_statuses)
                c = self._completer
        return c

    def close(self) -> None:
        if self._completer is not None:
            self._completer.close()
