"""Moving index arrays between host and GPU for the checked entries, with buffers that are kept and reused.

Host arrays (``gather(numpy, ...)`` on a GPU ``out``): the arrays are written into a pinned host buffer and moved in
one ``cuMemcpyHtoDAsync`` into a device buffer that the kernel then reads. Allocating both per call
(``torch.empty(pin_memory=True)`` and ``.to(device)``) cost more host time than the checks, where a ctypes driver
call costs little. So each GPU has an ``UploadPool`` of such buffer pairs (``_Slot``):

* a slot is taken by one thread at a time (under the pool's lock), filled, copied and launched from, then
  returned with a driver event recorded on the stream after the launch;
* a returned slot is handed out again only once that event has completed: the copy that read its pinned half
  and the kernel that read its device half have both run, whichever stream the next call uses;
* the oldest returned slot is tried first; when it is still in flight a new slot is made, up to
  ``max_slots`` per GPU, after which the caller waits for the oldest (a thread far ahead of its GPU);
* a slot too small for a batch is grown (new buffers) only when it is idle.

Small uploads (up to ``SMALL_UPLOAD_BYTES``) skip the slots and their events: the arrays go through a pageable host
buffer of the calling thread, from which ``cuMemcpyHtoDAsync`` returns only once the driver has staged the bytes (so
it may be rewritten at once), into a device buffer of that thread and stream. The next upload into that device
buffer is a copy on the same stream, which runs after every kernel queued there before it, so it never rewrites
descriptors a launch has still to read; another thread or stream has buffers of its own. This saves the event query
and record of a slot, which cost about as much as the copy itself. Larger uploads keep the pinned slots: staging a
large pageable copy may make the driver wait for the stream.

Device tensors (``gather(cuda int64 tensors, ...)``, checked) of more than ``_device_checks.MAX_PIECES``
pieces, or a batch the summary kernel found a fault in or left open: the checks need the values on the host, so
``read_to_host`` copies the tensors into a per-thread pinned buffer on the current stream (one
``cuMemcpyDtoHAsync`` of the span that holds them when they lie close together, else one each) and synchronises
that stream once; no ``torch.stack``, no pageable buffer.

Every driver call goes to the calling thread's current context, so callers make the tensors' GPU current
first (``on_device``). During CUDA graph capture the pool is not used (a captured copy would keep reading a
buffer that later calls rewrite): ``upload`` returns None and the caller moves the arrays the allocating way.
The backend (driver calls, buffer allocation) is one object, so the pool's reuse rules can be tested without a
GPU (tests/test_kernel_checks.py).
"""
from __future__ import annotations

import collections
import ctypes
import threading
from typing import List, Optional, Sequence

import numpy as np
import torch

from pxn_kernels._libcuda import check, driver

_NOT_READY = 600  # CUDA_ERROR_NOT_READY (cuEventQuery)
_MIN_WORDS = 1 << 10  # smallest slot: 8 KiB, room for 3 x 341 descriptors
SMALL_UPLOAD_BYTES = 64 << 10  # uploads up to this size go through the stream-ordered buffers (3 x 2730 pieces)
_STREAMS_PER_THREAD = 64
_PAGE_SHIFT = 12  # 4 KiB: no GPU maps memory in smaller pages (read_span)

_tls = threading.local()


def _capacity(words: int) -> int:
    """Words of a buffer made for ``words``: the next power of two, at least ``_MIN_WORDS`` (so that buffers
    grow seldom as batches grow)."""
    return max(_MIN_WORDS, 1 << (words - 1).bit_length())


def on_device(index: int) -> bool:
    """Whether the calling thread's current CUDA context is GPU ``index``'s, so that driver calls for that GPU
    may be made now. False: the caller makes it current (``torch.cuda.device``) and asks again. The first time
    a thread asks, a thread that has made no CUDA call yet gets the primary context made current (the runtime
    does that lazily, and the driver calls here would find no context)."""
    if torch._C._cuda_getDevice() != index:
        return False
    ready = getattr(_tls, "contexts", None)
    if ready is None:
        ready = _tls.contexts = set()
    if index not in ready:
        lib = driver()
        ctx = ctypes.c_void_p()
        check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            check(lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})")
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), f"cuDevicePrimaryCtxRetain({index})")
            check(lib.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent({index})")
        ready.add(index)
    return True


class CudaBackend:
    """What ``UploadPool`` needs from CUDA, for one GPU (driver calls through ctypes, buffers from torch)."""

    def __init__(self, index: int):
        self.index = index
        self.lib = driver()

    def buffers(self, words: int):
        """(pinned host int64 tensor, device int64 tensor), ``words`` each."""
        return (torch.empty(words, dtype=torch.int64, pin_memory=True),
                torch.empty(words, dtype=torch.int64, device=torch.device("cuda", self.index)))

    def stream_buffers(self, words: int):
        """(pageable host int64 numpy array, device int64 tensor), ``words`` each, for one thread and stream. The
        device tensor is allocated on the calling thread's current stream (the one it will be used on), so that
        when it is freed the caching allocator hands its memory out again only in that stream's order."""
        return (np.empty(words, dtype=np.int64),
                torch.empty(words, dtype=torch.int64, device=torch.device("cuda", self.index)))

    def event(self):
        ev = ctypes.c_void_p()
        check(self.lib.cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return ev

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` (the current stream of the calling thread's current GPU, as ``UploadPool.upload``
        requires) is being captured into a CUDA graph: torch's own test of its current stream, a C++ call
        instead of a ctypes one."""
        return torch._C._cuda_isCurrentStreamCapturing()

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        check(self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync", "index upload")

    def record(self, event, stream: int) -> None:
        check(self.lib.cuEventRecord(event, stream), "cuEventRecord")

    def done(self, event) -> bool:
        err = self.lib.cuEventQuery(event)
        if err == _NOT_READY:
            return False
        check(err, "cuEventQuery")
        return True

    def wait(self, event) -> None:
        check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")


class _Slot:
    """One pinned host buffer and one device buffer of ``words`` int64 each, and the event after their last
    use (``pending``: recorded and not yet seen complete)."""

    __slots__ = ("words", "host", "host_np", "host_ptr", "dev", "dev_ptr", "event", "pending", "views")

    def __init__(self, backend, words: int):
        self.event = backend.event()
        self.pending = False
        self._alloc(backend, words)

    def _alloc(self, backend, words: int) -> None:
        self.words = words
        self.host, self.dev = backend.buffers(words)
        self.host_np = self.host.numpy()
        self.host_ptr = self.host.data_ptr()
        self.dev_ptr = self.dev.data_ptr()
        self.views = {}  # (n, k) -> k device views of n words (the same tensors each time: launches stay bound)

    def device_views(self, n: int, k: int):
        got = self.views.get((n, k))
        if got is None:
            if len(self.views) >= 16:
                self.views.clear()
            d = self.dev
            got = self.views[(n, k)] = tuple(d[j * n:(j + 1) * n] for j in range(k))
        return got


class _StreamBuffer:
    """One thread's pageable host buffer and device buffer for one stream (small uploads), ``words`` int64 each."""

    __slots__ = ("words", "host_np", "host_ptr", "dev", "dev_ptr", "views")

    def __init__(self, backend, words: int):
        self.words = words
        self.host_np, self.dev = backend.stream_buffers(words)
        self.host_ptr = self.host_np.ctypes.data
        self.dev_ptr = self.dev.data_ptr()
        self.views = {}

    device_views = _Slot.device_views


class Upload:
    """One upload in flight: the slot it used (None for a small upload, which returns nothing), the device
    views of the arrays, the stream it went on."""

    __slots__ = ("slot", "views", "stream")

    def __init__(self, slot: _Slot, views, stream: int):
        self.slot, self.views, self.stream = slot, views, stream


class UploadPool:
    """Reused pinned + device buffer pairs of one GPU (see the module docstring for the reuse rules)."""

    def __init__(self, backend, max_slots: int = 16, small_bytes: int = 0):
        self.backend = backend
        self.max_slots = max_slots
        self.small_bytes = small_bytes  # uploads up to this size take the stream-ordered buffers (0: never)
        self._local = threading.local()  # per thread: stream -> _StreamBuffer
        self._free = collections.deque()  # returned slots, oldest first
        self._made = 0
        self._lock = threading.Lock()
        self._lost: List[_Slot] = []  # slots whose event could not be recorded: kept alive, never reused

    def _acquire(self, words: int) -> _Slot:
        backend = self.backend
        slot, wait = None, False
        with self._lock:
            if self._free:
                head = self._free[0]
                if not head.pending or backend.done(head.event):
                    slot = self._free.popleft()
                elif self._made >= self.max_slots:
                    slot, wait = self._free.popleft(), True
            if slot is None:
                self._made += 1
        if slot is None:
            try:
                return _Slot(backend, _capacity(words))
            except BaseException:
                with self._lock:
                    self._made -= 1
                raise
        if wait:
            try:
                backend.wait(slot.event)
            except BaseException:
                with self._lock:
                    self._lost.append(slot)
                raise
        slot.pending = False
        if slot.words < words:  # idle (its event completed): its old buffers may be freed
            slot._alloc(backend, _capacity(words))
        return slot

    def upload(self, arrays: Sequence[np.ndarray], stream: int) -> Optional[Upload]:
        """Copy the int64 arrays (``n`` items each) into a slot, or up to ``small_bytes`` into the calling
        thread's buffers for ``stream``, and enqueue their move to the GPU on ``stream`` (the raw handle of the
        current stream of the calling thread's current GPU). Returns the ``Upload`` whose ``views`` (device int64
        tensors, in order) the caller launches from and then hands to ``release`` -- always, also when its
        launch fails. None when ``stream`` is being captured into a CUDA graph (the caller uploads another way)."""
        if self.backend.capturing(stream):
            return None
        n, k = int(arrays[0].size), len(arrays)
        if 8 * k * n <= self.small_bytes:
            return self._upload_small(arrays, n, k, stream)
        slot = self._acquire(k * n)
        try:
            np.concatenate(arrays, out=slot.host_np[:k * n])  # one numpy call for the k arrays
            self.backend.copy(slot.dev_ptr, slot.host_ptr, 8 * k * n, stream)
        except BaseException:
            try:
                self.release(Upload(slot, None, stream))
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            raise
        return Upload(slot, slot.device_views(n, k), stream)

    def _upload_small(self, arrays, n: int, k: int, stream: int) -> Upload:
        """``upload`` through the calling thread's buffers for ``stream`` (see the module docstring)."""
        buffers = self._local.__dict__.get("buffers")
        if buffers is None:
            buffers = self._local.buffers = {}
        buf = buffers.get(stream)
        if buf is None or buf.words < k * n:
            if buf is None and len(buffers) >= _STREAMS_PER_THREAD:
                buffers.clear()  # a thread cycling through many streams; each buffer is freed in its stream's order
            buf = buffers[stream] = _StreamBuffer(self.backend, _capacity(k * n))
        np.concatenate(arrays, out=buf.host_np[:k * n])
        self.backend.copy(buf.dev_ptr, buf.host_ptr, 8 * k * n, stream)
        return Upload(None, buf.device_views(n, k), stream)

    def release(self, upload: Upload) -> None:
        """Return the slot once the reads of it are enqueued: an event on its stream marks when they are done.
        A small upload has no slot: nothing to do."""
        slot = upload.slot
        if slot is None:
            return
        try:
            self.backend.record(slot.event, upload.stream)
        except BaseException:
            with self._lock:
                self._lost.append(slot)
            raise
        slot.pending = True
        with self._lock:
            self._free.append(slot)


_pools = {}
_pools_lock = threading.Lock()


def pool(index: int) -> UploadPool:
    """The upload pool of GPU ``index`` (made on first use)."""
    found = _pools.get(index)
    if found is None:
        with _pools_lock:
            found = _pools.get(index)
            if found is None:
                found = _pools[index] = UploadPool(CudaBackend(index), small_bytes=SMALL_UPLOAD_BYTES)
    return found


def read_span(ptrs: Sequence[int], nbytes: int) -> Optional[tuple]:
    """``(lowest address, bytes)`` of one read that covers ``nbytes`` at each of ``ptrs`` (device addresses, in
    any order, overlaps allowed), when every byte between them lies in a 4 KiB page that also holds a byte of one
    of them; else None. Such a byte is mapped: GPU memory is mapped in whole pages of at least 4 KiB. Tensors
    allocated one after another (the caching allocator rounds small ones up to 512 B) or rows of one stacked
    tensor qualify; tensors further apart are read one by one rather than reading memory that may not exist."""
    order = sorted(ptrs)
    lo = order[0]
    end = lo + nbytes
    for p in order[1:]:
        if (p - lo) & 7 or (p >> _PAGE_SHIFT) - ((end - 1) >> _PAGE_SHIFT) > 1:
            return None
        end = max(end, p + nbytes)
    return lo, end - lo


def read_to_host(tensors: Sequence[torch.Tensor], index: int) -> Optional[List[np.ndarray]]:
    """Host copies of contiguous int64 CUDA tensors of GPU ``index`` (one length, > 0), read on the current
    stream after the work queued there, which is waited for. The arrays are views of the calling thread's
    pinned buffer, valid until the thread's next read. None when a tensor is not contiguous (the caller reads
    another way). The calling thread's current context must be GPU ``index``'s (``on_device``).

    Tensors close together (``read_span``) are read in one ``cuMemcpyDtoHAsync`` of the span that holds them,
    others with one each: each small copy adds its own latency on the GPU before the synchronisation returns."""
    n = tensors[0].numel()
    for t in tensors:
        if not t.is_contiguous():
            return None
    k = len(tensors)
    ptrs = [t.data_ptr() for t in tensors]
    span = read_span(ptrs, 8 * n)
    words = k * n if span is None else span[1] // 8
    bufs = getattr(_tls, "read", None)
    if bufs is None:
        bufs = _tls.read = {}
    entry = bufs.get(index)
    if entry is None or entry[1].size < words:
        host = torch.empty(_capacity(words), dtype=torch.int64, pin_memory=True)
        entry = bufs[index] = (host, host.numpy(), host.data_ptr())
    _host, buf, ptr = entry
    lib = driver()
    stream = torch._C._cuda_getCurrentRawStream(index)
    if span is not None:
        lo, size = span
        check(lib.cuMemcpyDtoHAsync_v2(ptr, lo, size, stream), "cuMemcpyDtoHAsync", "index read")
        starts = [(p - lo) // 8 for p in ptrs]
    else:
        for j, p in enumerate(ptrs):
            check(lib.cuMemcpyDtoHAsync_v2(ptr + 8 * j * n, p, 8 * n, stream), "cuMemcpyDtoHAsync", "index read")
        starts = range(0, k * n, n)
    check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize", "index read")
    return [buf[j:j + n] for j in starts]
