"""Batched GPU copies bound once and replayed: what the load/store writer and the ipc fabric's message path launch.

A batch of pieces (source, destination, length; device or UVA addresses, the destination possibly another
process's allocation mapped here through CUDA IPC) is one ``pxn_kernels.copy`` launch over int64 descriptors.
Why this module: each driver call costs host time and a kernel's first launch with new descriptor tensors far
more, while callers repeat the same piece lengths call after call (sglang's
per-layer blocks, its aux pieces). So:

* the work plan is cached by the lengths (``plan_for_lengths``, per device);
* the descriptors are written into a per-thread pinned host buffer and moved in one H2D copy into a device
  buffer that never moves (``_Staging``);
* from the second batch with a plan on a staging buffer, the H2D copy and the kernel are a CUDA graph replayed
  with one driver call (``_BoundCopy``); a first sighting launches without capturing anything, since a capture
  costs more than a launch and lengths that never repeat would pay it every time.

Every launch goes on the calling thread's current stream of the source GPU, ordered after whatever that thread
queued there (the sources' producers, in the caller's thread).
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
from typing import List, Optional, Tuple

import numpy as np

from transport.errors import TransferError
from transport.fabric.memory import MEMCPY_MAX

log = logging.getLogger(__name__)

_PLAN_CACHE = 64  # plans kept (sglang repeats the same piece lengths call after call)
_LAUNCHES_PER_PLAN = 8  # bound launches kept per plan (one per staging buffer)
_STAGING_PER_THREAD = 8  # staging buffers a thread keeps per device (batches it may have in flight at once)

_driver_lib = None
_serials = itertools.count(1)


def _driver():
    """The libcuda handle of ``pxn_kernels._libcuda``, imported on first use (pxn_kernels loads torch, which
    importing this module, as the ipc fabric does, must not), for the calls of the hot path (H2D copy, graph
    launch, stream synchronise)."""
    global _driver_lib
    if _driver_lib is None:
        from pxn_kernels._libcuda import driver
        _driver_lib = driver()
    return _driver_lib


def _check(err: int, call: str, doing: str) -> None:
    """``pxn_kernels._libcuda.check`` raising ``TransferError`` (imported only for a failure: see ``_driver``)."""
    if err:
        from pxn_kernels._libcuda import check
        check(err, call, doing, TransferError)


class Staging:
    """Pinned host + device int64 buffers for one thread's descriptors (src | dst | lengths)."""

    __slots__ = ("host", "host_np", "device_buf", "busy", "serial")

    def __init__(self, words: int, device):
        import torch
        cap = 1 << max(10, (words - 1).bit_length())
        self.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.device_buf = torch.empty(cap, dtype=torch.int64, device=device)
        self.busy = None  # the event of an async batch still reading these buffers
        self.serial = 0  # when it was last marked busy (``BoundCopies.finish``): the pool waits for the oldest


class _BoundCopy:
    """The H2D copy of one staging buffer's first ``3 n`` words and the copy kernel of ``plan`` over them.

    ``graph``: capture both in a CUDA graph, replayed with one driver call. The capture is thread-local (other
    threads' CUDA calls are not disturbed); if it fails, both calls are made one by one.
    """

    def __init__(self, device_index: int, staging: Staging, n: int, plan, graph: bool = True):
        import torch
        from pxn_kernels._batched_copy import PreparedCopy
        d = staging.device_buf
        self._copy_args = (d.data_ptr(), staging.host.data_ptr(), 3 * n * 8)
        self._kernel = PreparedCopy(d[0:n], d[n:2 * n], d[2 * n:3 * n], 0, 0, plan)
        self._keep = staging
        self._graph = None
        self._exec = None  # the graph's executable handle: launched on any stream with one driver call
        if not graph:
            return
        device = torch.device("cuda", device_index)
        try:
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    # One real run outside the capture (module load, lazy init) on the descriptors the caller
                    # has already staged: the device buffer holds stale or no descriptors before this copy, and
                    # a kernel run on those faults. The caller's own launch repeats it (same bytes, same place).
                    self._copy(side.cuda_stream)
                    self._kernel()
                    captured = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(captured, stream=side, capture_error_mode="thread_local"):
                        self._copy(side.cuda_stream)
                        self._kernel()
                torch.cuda.current_stream(device).wait_stream(side)
                side.synchronize()
            self._graph = captured
        except Exception as e:  # noqa: BLE001 — the two plain calls still work
            log.info("batched copy: graph capture failed (%s); copying and launching one by one", e)
            return
        try:
            self._exec = captured.raw_cuda_graph_exec() or None
        except (AttributeError, RuntimeError):  # an older torch: replay on the current stream
            self._exec = None

    def _copy(self, raw_stream) -> None:
        _check(_driver().cuMemcpyHtoDAsync_v2(*self._copy_args, raw_stream), "cuMemcpyHtoDAsync", "descriptor copy")

    def __call__(self, raw_stream, stream=None) -> None:
        """Enqueue the descriptor copy and the kernel on ``stream`` (a ``torch.cuda.Stream`` whose handle is
        ``raw_stream``), or on the current stream (``stream`` None, ``raw_stream`` its handle). A graph goes to the
        driver with the handle; otherwise the kernel's launch takes the current stream, which ``stream`` then
        becomes for the call (a stream context costs many times a driver call's host time: the hot path avoids
        it)."""
        if self._exec is not None:
            _check(_driver().cuGraphLaunch(self._exec, raw_stream), "cuGraphLaunch", "batched copy graph launch")
        elif stream is not None:
            import torch
            with torch.cuda.stream(stream):
                self._enqueue(raw_stream)
        else:
            self._enqueue(raw_stream)

    def _enqueue(self, raw_stream) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._copy(raw_stream)
            self._kernel()


def _key(device_index: int, lengths: np.ndarray, length_stats) -> tuple:
    n = int(lengths.size)
    total, lmin, lmax = length_stats or (int(lengths.sum()), int(lengths.min()), int(lengths.max()))
    return (device_index, n, total, lmin) if lmin == lmax else (device_index, n, total, lengths.tobytes())


Launched = Tuple[int, int, Optional[Staging]]
"""(device index, raw stream handle, staging buffer or None for copy-engine calls) of a copy not yet waited for."""


class Pending:
    """The device work of one batch (one CUDA event per source GPU, from ``BoundCopies.finish``): ``wait()``
    returns once every byte is in place, ``done()`` polls. Empty: the batch was complete when it was made."""

    __slots__ = ("_work",)

    def __init__(self, work=()):
        self._work = list(work)  # (event, staging) pairs

    @classmethod
    def joined(cls, pendings) -> "Pending":
        """One ``Pending`` for the work of several."""
        return cls([w for p in pendings for w in p._work])

    def done(self) -> bool:
        return all(event.query() for event, _ in self._work)

    def wait(self) -> None:
        for event, staging in self._work:
            event.synchronize()
            if staging is not None:  # None: copy-engine calls, no staging buffer
                staging.busy = None


class BoundCopies:
    """Batched copies on any local GPU, their plans cached by lengths and their launches bound per plan and
    staging buffer. Thread-safe; one staging buffer per thread and device."""

    def __init__(self):
        self._plans = collections.OrderedDict()
        self._sighted = collections.OrderedDict()  # lengths keys offered to ``repeated``
        self._lock = threading.Lock()
        self._local = threading.local()

    def repeated(self, device_index: int, lengths: np.ndarray, length_stats=None) -> bool:
        """True when a batch of these lengths was launched or offered here before on ``device_index``; else note
        them (no plan is made) and return False. For callers with a cheaper way for batches seen once: a few
        pieces as a copy-engine call each cost less than a first launch, but more than a bound one.
        ``length_stats``: (sum, min, max) of ``lengths`` when the caller has them."""
        return self._repeated(_key(device_index, lengths, length_stats))

    def _repeated(self, key: tuple) -> bool:
        with self._lock:
            if key in self._plans or key in self._sighted:
                return True
            self._sighted[key] = True
            while len(self._sighted) > 4 * _PLAN_CACHE:
                self._sighted.popitem(last=False)
        return False

    def copy(self, device_index: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
             length_stats=None, stream=None, dst_shift: int = 0) -> Launched:
        """Enqueue the copy of piece i (``lengths[i]`` bytes from ``src[i]`` to ``dst[i] + dst_shift``) on
        ``stream`` (a ``torch.cuda.Stream`` of ``device_index``), or on the calling thread's current stream of
        ``device_index``: one bound launch (``launch``) for many pieces or lengths seen before, else a
        ``cudaMemcpyAsync`` per piece (a few pieces of new lengths: a copy-engine call each costs less than a first
        launch). Returns what ``finish`` takes."""
        if lengths.size > MEMCPY_MAX:
            return self.launch(device_index, src, dst, lengths, length_stats, stream, dst_shift=dst_shift)
        key = _key(device_index, lengths, length_stats)  # once for the two lookups by lengths
        if self._repeated(key):
            return self.launch(device_index, src, dst, lengths, length_stats, stream, key, dst_shift)
        import torch
        from transport.fabric.memory import memcpy_async
        with torch.cuda.device(device_index):
            if stream is None:
                stream = torch.cuda.current_stream(device_index)
            for s_, d_, n_ in zip(src.tolist(), dst.tolist(), lengths.tolist()):
                memcpy_async(d_ + dst_shift, s_, n_, stream)
        return device_index, stream.cuda_stream, None

    def launch(self, device_index: int, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
               length_stats=None, stream=None, key: Optional[tuple] = None, dst_shift: int = 0) -> Launched:
        """Enqueue the copy of piece i (``lengths[i]`` bytes from ``src[i]`` to ``dst[i] + dst_shift``, addresses
        valid in ``device_index``'s context; int64 arrays the caller checked) on ``stream`` (a
        ``torch.cuda.Stream`` of ``device_index``) or, when None, on the calling thread's current stream of
        ``device_index``. ``dst_shift``: bytes added to every destination while the descriptors are staged (a
        peer region's offset into its mapping here), so the caller makes no shifted copy of ``dst``.
        ``length_stats``: (sum, min, max) of ``lengths`` when the caller has them; ``key``: their ``_key`` when the
        caller made it. Returns what ``finish`` takes: the staging buffer must not be reused before that stream
        passed the launch. Raises ``TransferError`` when the launch fails."""
        import torch
        device = torch.device("cuda", device_index)
        n = int(lengths.size)
        entry = self._plan(lengths, device, length_stats, key)
        st = self._staging(device, 3 * n)
        d = st.device_buf
        w = st.host_np
        # before binding: its first run reads them
        w[0:n], w[2 * n:3 * n] = src, lengths
        if dst_shift:
            np.add(dst, dst_shift, out=w[n:2 * n])
        else:
            w[n:2 * n] = dst
        # Bound once per (plan, staging buffer), keyed by the device buffer's address (what is bound keeps that
        # buffer alive, so the address is never reused); a plan's first batch launches unbound.
        launches = entry["launches"]
        launch = launches.get(d.data_ptr())
        if launch is None:
            if not entry["seen"]:
                entry["seen"] = True
                launch = _BoundCopy(device_index, st, n, entry["plan"], graph=False)
            else:
                with self._lock:
                    if len(launches) >= _LAUNCHES_PER_PLAN:
                        # async batches that overlap each get a fresh staging buffer: keep only the newest
                        # launches, so that the buffers of old ones can be freed
                        launches.pop(next(iter(launches)))
                    launch = launches.get(d.data_ptr()) or launches.setdefault(
                        d.data_ptr(), _BoundCopy(device_index, st, n, entry["plan"]))
        raw_stream = torch._C._cuda_getCurrentRawStream(device_index) if stream is None else stream.cuda_stream
        try:
            if torch.cuda.current_device() == device_index:
                launch(raw_stream, stream)
            else:  # the driver works in the calling thread's current context
                with torch.cuda.device(device):
                    launch(raw_stream, stream)
        except RuntimeError as e:  # a failed launch or graph replay
            raise TransferError(f"batched copy of {n} piece(s) on cuda:{device_index} failed: {e}", [e]) from e
        return device_index, raw_stream, st

    @staticmethod
    def finish(launched: List[Launched], wait: bool, stream=None) -> list:
        """Synchronise the launches' streams (``wait``; returns []), or record an event on each: (event,
        staging) pairs; ``stream``: the ``torch.cuda.Stream`` the launches went to, when not the current one.
        Raises ``TransferError`` naming the device when the copy failed."""
        import torch
        work = []
        for device_index, raw_stream, st in launched:
            if wait:
                # the default stream's handle (0) means the calling thread's current context: make the launch's
                # GPU current, or the wait is on another GPU's stream and returns before these bytes land
                if torch.cuda.current_device() == device_index:
                    _check(_driver().cuStreamSynchronize(raw_stream), "cuStreamSynchronize",
                           f"batched copy on cuda:{device_index}")
                else:
                    with torch.cuda.device(device_index):
                        _check(_driver().cuStreamSynchronize(raw_stream), "cuStreamSynchronize",
                               f"batched copy on cuda:{device_index}")
                continue
            try:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device_index) if stream is None else stream)
            except RuntimeError as e:
                raise TransferError(f"batched copy on cuda:{device_index}: {e}", [e]) from e
            if st is not None:
                st.busy = event
                st.serial = next(_serials)
            work.append((event, st))
        return work

    def _plan(self, lengths: np.ndarray, device, length_stats=None, key: Optional[tuple] = None) -> dict:
        """The kernel's work split for these lengths on the device, and the launches bound with it (one per
        staging buffer): cached by the lengths themselves (``key``: their ``_key``, when made already)."""
        from pxn_kernels._batched_copy import plan_for_lengths
        if key is None:
            key = _key(device.index, lengths, length_stats)
        with self._lock:
            entry = self._plans.get(key)
            if entry is not None:
                self._plans.move_to_end(key)
                return entry
        # the grid kernel for sglang's equal per-layer blocks, the range plan for anything else
        entry = {"plan": plan_for_lengths(lengths, device), "launches": {}, "seen": False}
        with self._lock:
            self._plans[key] = entry
            while len(self._plans) > _PLAN_CACHE:
                self._plans.popitem(last=False)
        return entry

    def _staging(self, device, words: int) -> Staging:
        """A staging buffer of this thread for ``device`` with room for ``words``: the first one no async batch
        still reads, else a new one while the thread has fewer than ``_STAGING_PER_THREAD``, else the oldest
        once its batch has read it. A pool, not one buffer: a thread that keeps several batches in flight (a
        relay ring) would otherwise allocate pinned memory, and bind a new graph, for every batch."""
        pools = getattr(self._local, "staging", None)
        if pools is None:
            pools = self._local.staging = {}
        pool = pools.setdefault(device.index, [])
        for i, st in enumerate(pool):
            if st.busy is not None:
                if not st.busy.query():
                    continue
                st.busy = None
            if st.host.numel() >= words:
                return st
            pool[i] = Staging(words, device)  # too small and idle: replace it (its bound launches age out)
            return pool[i]
        if len(pool) < _STAGING_PER_THREAD:
            pool.append(Staging(words, device))
            return pool[-1]
        # every buffer is in flight: wait for the oldest (back-pressure on a thread far ahead of its GPU) rather
        # than allocate, and bind a graph to, a buffer used once
        st = min(pool, key=lambda b: b.serial)
        st.busy.synchronize()
        st.busy = None
        if st.host.numel() < words:
            pool[pool.index(st)] = st = Staging(words, device)
        return st
