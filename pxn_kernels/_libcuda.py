"""libcuda through ctypes: the one handle, the prototypes of the driver calls pxn makes, and their error check.

Why ctypes: a ctypes driver call costs less host time than a cuda-bindings or torch call, and the hot paths (a
kernel launch, a descriptor upload, a graph launch) make one per batch. Why one handle: argument types are set per
handle, so every user shares one set of prototypes here instead of each loading the library with its own.

The library is loaded on the first ``driver()`` call, never at import: pxn imports (and its CPU paths run) on
machines without a GPU driver.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Type

from pxn_kernels.errors import CudaDriverError

_LIBRARY = "libcuda.so.1"

_vp, _int, _uint, _size, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_uint64

# argument types of each driver call pxn makes; every one returns a CUresult (int)
_PROTOTYPES = {
    # function, grid x/y/z, block x/y/z, shared bytes, stream, kernel params, extra
    "cuLaunchKernel": [_vp, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _vp, _vp, _vp],
    "cuGraphLaunch": [_vp, _vp],
    "cuMemcpyHtoDAsync_v2": [_u64, _vp, _size, _vp],
    "cuMemcpyDtoHAsync_v2": [_vp, _u64, _size, _vp],
    "cuStreamSynchronize": [_vp],
    "cuStreamIsCapturing": [_vp, ctypes.POINTER(_int)],
    "cuEventCreate": [ctypes.POINTER(_vp), _uint],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventSynchronize": [_vp],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxSetCurrent": [_vp],
    "cuDeviceGet": [ctypes.POINTER(_int), _int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _int],
    "cuGetErrorName": [_int, ctypes.POINTER(ctypes.c_char_p)],
}

_lib = None


def driver():
    """The libcuda handle with every prototype of ``_PROTOTYPES`` set, loaded on first use. Raises OSError (from
    ctypes, naming the library) where there is no driver."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(_LIBRARY)
        for name, argtypes in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        _lib = lib  # published complete: two threads racing here each load a full handle, one is kept
    return _lib


def error_name(code: int) -> Optional[str]:
    """The driver's name of CUresult ``code`` (``CUDA_ERROR_...``); None for a code it does not know, or where
    no driver can be loaded (a code from a stand-in driver)."""
    try:
        lib = driver()
    except OSError:
        return None
    name = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))  # leaves NULL for an unknown code
    return name.value.decode() if name.value else None


def check(code: int, call: str, doing: str = "", error: Optional[Type[Exception]] = None) -> None:
    """Raise when ``code``, the CUresult of driver call ``call``, is not CUDA_SUCCESS: a ``CudaDriverError``
    whose message names ``doing`` (what the call was for, when given), the call, and the code's name and
    number; or, with ``error``, that exception type with the same message, caused by the ``CudaDriverError``."""
    if not code:
        return
    name = error_name(code)
    result = f"{name} ({code})" if name else f"CUresult {code}"
    message = f"{doing}: {call} failed: {result}" if doing else f"{call} failed: {result}"
    failure = CudaDriverError(message, call, code, name)
    if error is None:
        raise failure
    raise error(message) from failure
