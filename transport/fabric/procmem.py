"""Another process's memory, by cross-memory attach: ``process_vm_writev`` / ``process_vm_readv`` batched as iovec
lists, and the ptrace permission a same-user peer needs to use them on this process.

The ipc fabric's message path, its load/store writers (``transport.fabric.loadstore``) and the region counter's
fallback reader (``transport.fabric.region_counter``) all copy this way; this module imports none of them.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
IOV_BATCH = 1024  # IOV_MAX


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_pvw = _libc.process_vm_writev
# iovec arrays are passed as plain addresses (of numpy buffers): a pointer cast per call would add host time
_pvw.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong)
_pvw.restype = ctypes.c_ssize_t
_pvr = _libc.process_vm_readv
_pvr.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                 ctypes.c_ulong)
_pvr.restype = ctypes.c_ssize_t


def process_vm_read(pid: int, remote: int, n: int) -> bytes:
    """Read ``n`` bytes at ``remote`` in process ``pid`` (used only to authenticate a peer: reading never
    modifies it). Raises ``OSError``."""
    buf = ctypes.create_string_buffer(n)
    liov, riov = _Iovec(ctypes.addressof(buf), n), _Iovec(remote, n)
    got = _pvr(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
    if got != n:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err) if got < 0 else f'{got} of {n} B'}")
    return buf.raw


def _int64(values) -> np.ndarray:
    # user-space addresses and lengths fit int64 (47-57 bit address spaces); int64 arrays pass unconverted
    if type(values) is np.ndarray and values.dtype == np.int64:
        return values
    return np.asarray(values, dtype=np.uint64).astype(np.int64)


_iov_local = threading.local()


def _iov_buffer():
    """This thread's iovec buffer (local | remote, IOV_BATCH pairs each) and its address: allocating one and
    asking numpy for its address per call is a noticeable share of a same-host batch of a few small pieces."""
    got = getattr(_iov_local, "iov", None)
    if got is None:
        buf = np.empty((2, IOV_BATCH, 2), dtype=np.int64)
        got = _iov_local.iov = (buf, buf.ctypes.data)
    return got


def process_vm_write(pid: int, local, remote, lengths, total: Optional[int] = None) -> None:
    """Copy ``lengths[i]`` bytes from our ``local[i]`` to process ``pid``'s ``remote[i]`` (batched syscalls).

    Arguments are sequences or int64 arrays; ``total``: ``sum(lengths)`` when the caller knows it (saves a
    reduction per call on the same-host hot path). Raises ``OSError`` (errno set: EPERM, ESRCH for a gone
    process, EFAULT for a bad remote range)."""
    local, remote, lengths = _int64(local), _int64(remote), _int64(lengths)
    n = int(lengths.size)
    iov, base = _iov_buffer()
    i = 0
    while i < n:
        k = min(IOV_BATCH, n - i)
        # Both iovec arrays (base, len pairs) in one numpy buffer, filled by slices: a Python loop per piece costs
        # far more.
        iov[0, :k, 0], iov[0, :k, 1] = local[i:i + k], lengths[i:i + k]
        iov[1, :k, 0], iov[1, :k, 1] = remote[i:i + k], lengths[i:i + k]
        want = total if (total is not None and k == n) else int(lengths[i:i + k].sum())
        got = _pvw(pid, base, k, base + 16 * IOV_BATCH, k, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_writev to pid {pid}: {os.strerror(err)}")
        if got == want:
            i += k
            continue
        # Partial transfer: it stops at an iovec boundary or inside one; continue from there.
        if got == 0:
            raise OSError(0, f"process_vm_writev to pid {pid} made no progress at 0x{int(remote[i]):x}")
        done = np.cumsum(lengths[i:i + k])
        j = int(np.searchsorted(done, got, side="right"))  # first piece not completely written
        part = got - (int(done[j - 1]) if j else 0)
        local, remote, lengths = local.copy(), remote.copy(), lengths.copy()
        local[i + j] += part
        remote[i + j] += part
        lengths[i + j] -= part
        total = None  # describes the batch as it was
        i += j


def allow_peer_writes() -> None:
    """Let same-user peers read and write this process's memory under Yama ``ptrace_scope=1`` (no-op, EINVAL,
    without Yama)."""
    _libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
