"""CUDA through ctypes, for the two things the Mooncake layer asks of it: which device holds an address
(Mooncake's location "*") and a host function queued on a stream (the ``*_on_cuda`` calls)."""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import threading

from integration.codes import log

class _CudaPointerAttributes(ctypes.Structure):
    # cudaPointerAttributes since CUDA 11: type (cudaMemoryType), device, devicePointer, hostPointer
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p)]


_cudart = None
_cudart_lock = threading.Lock()


def load_cudart():
    """libcudart through ctypes, or None. torch wheels ship it under nvidia/cuda_runtime/lib."""
    global _cudart
    with _cudart_lock:
        if _cudart is not None:
            return _cudart or None
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
        found = ctypes.util.find_library("cudart")
        if found:
            names.insert(0, found)
        try:
            import nvidia.cuda_runtime as ncr  # noqa: F401 — the pip runtime next to a CUDA torch
            libdir = os.path.join(os.path.dirname(ncr.__file__), "lib")
            names = [os.path.join(libdir, f) for f in sorted(os.listdir(libdir)) if f.startswith("libcudart")] + names
        except Exception:  # noqa: BLE001 — not installed: try the system names
            pass
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_CudaPointerAttributes), ctypes.c_void_p]
                lib.cudaPointerGetAttributes.restype = ctypes.c_int
                _cudart = lib
                return lib
            except (OSError, AttributeError):
                continue
        _cudart = False
        return None


def pointer_device(addr: int) -> int:
    """The CUDA device holding ``addr`` (device or managed memory), else -1 (host). Without a usable CUDA every
    address is host memory. Used for Mooncake's ``location="*"`` (sglang registers GPU KV and host aux buffers
    through the same call with no location)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return -1
    except ImportError:
        return -1
    try:
        from cuda.bindings import runtime as rt  # cuda-bindings, the pxn "cuda" extra
        err, attr = rt.cudaPointerGetAttributes(addr)
        if err != rt.cudaError_t.cudaSuccess:
            return -1
        kinds = (rt.cudaMemoryType.cudaMemoryTypeDevice, rt.cudaMemoryType.cudaMemoryTypeManaged)
        return int(attr.device) if attr.type in kinds else -1
    except ImportError:
        pass
    lib = load_cudart()
    if lib is None:
        log.warning("cannot tell whether 0x%x is GPU memory (no cuda-bindings, no libcudart): registering it as "
                    "host memory; pass location='cuda:<n>' to say otherwise", addr)
        return -1
    attr = _CudaPointerAttributes()
    if lib.cudaPointerGetAttributes(ctypes.byref(attr), ctypes.c_void_p(addr)) != 0:
        return -1
    return attr.device if attr.type in (2, 3) else -1  # cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3



_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def launch_host_func(stream_ptr: int, fn) -> None:
    """``cudaLaunchHostFunc(stream, fn)`` through libcudart; ``fn`` runs once the stream reaches it and the
    stream's later work waits for it to return. RuntimeError when there is no usable CUDA."""
    lib = load_cudart()
    if lib is None:
        raise RuntimeError("no CUDA runtime in this process (stream-ordered transfers need one)")
    cb = _HOST_FN(lambda _data: fn())
    lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
    lib.cudaLaunchHostFunc.restype = ctypes.c_int
    err = lib.cudaLaunchHostFunc(ctypes.c_void_p(stream_ptr), cb, None)
    if err != 0:
        raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {err}")
    # the C thunk must outlive its run on CUDA's thread; dropping it right after could free it while that thread
    # still returns through it, so the newest ones are kept (older ones finished long before, in stream order)
    _LIVE_CALLBACKS.append(cb)


_LIVE_CALLBACKS = collections.deque(maxlen=1 << 16)


def run_in_stream_order(stream_ptr: int, job, name: str, launch=None) -> None:
    """Run ``job()`` on a thread of its own once CUDA stream ``stream_ptr`` (0: the legacy default stream)
    reaches this point; the stream's later work waits until ``job`` returns. ``launch(stream_ptr, fn)`` queues
    ``fn`` on the stream (default ``launch_host_func``). Raises RuntimeError when it cannot be queued; ``job``
    then never runs."""
    start, done = threading.Event(), threading.Event()

    def on_stream():      # runs on CUDA's callback thread: no CUDA call here, only the hand-off and the wait
        start.set()
        done.wait()

    def worker():
        start.wait()
        try:
            job()
        finally:
            done.set()

    try:
        (launch or launch_host_func)(int(stream_ptr or 0), on_stream)
    except BaseException as e:  # noqa: BLE001
        raise RuntimeError(f"pxn: cannot queue the transfer on stream 0x{int(stream_ptr or 0):x}: {e}") from e
    threading.Thread(target=worker, name=name, daemon=True).start()
