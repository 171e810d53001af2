"""A process's region counter, and a same-host peer's reader of it.

An engine bumps its ``GenerationCounter`` on every ``deregister``. A same-host peer that writes into its memory
without asking first (the load/store path, ``transport.fabric.loadstore``; the ipc fabric's writes that skip a
GRANT round trip) reads the counter before each batch and fetches the region descriptions again when it moved,
so nothing is written into a region after its ``deregister`` returned.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading

from transport.errors import PeerLost
from transport.fabric.procmem import process_vm_read

log = logging.getLogger(__name__)

_I64 = struct.Struct("<q")


class GenerationCounter:
    """The receiving engine's deregistration counter, in an 8-byte shared-memory file (``memfd``): a same-host
    sender maps it read-only through ``/proc/<pid>/fd/<fd>`` and reads it with a plain memory load before every
    batch (a ``process_vm_readv`` per batch costs far more host time, a system call each; senders that cannot
    open the file fall back to it, at the address ``wire()`` gives). Without memfd (non-Linux) it lives in
    ordinary memory."""

    def __init__(self):
        self._fd = -1
        try:
            self._fd = os.memfd_create("pxn-region-gen", 0)
            os.ftruncate(self._fd, 8)
            self._buf = mmap.mmap(self._fd, 8)
        except (AttributeError, OSError):
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1
            self._buf = bytearray(8)
        view = (ctypes.c_char * 8).from_buffer(self._buf)
        self._addr = ctypes.addressof(view)
        del view  # a live export would keep the mmap from closing
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return _I64.unpack_from(self._buf, 0)[0]

    def bump(self) -> None:
        with self._lock:
            _I64.pack_into(self._buf, 0, self.value + 1)

    def wire(self) -> dict:
        return {"region_gen": self.value, "region_gen_addr": self._addr, "region_gen_fd": self._fd,
                "pid": os.getpid()}

    def close(self) -> None:
        if self._fd >= 0:
            self._buf.close()
            os.close(self._fd)
            self._fd = -1


class CounterReader:
    """Reads a peer's ``GenerationCounter``: mapped when its memfd can be opened, else by process_vm_readv."""

    def __init__(self, pid: int, fd: int, addr: int):
        self.pid, self.addr = pid, addr
        self._map = None
        if fd >= 0:
            try:
                f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
                try:
                    self._map = mmap.mmap(f, 8, prot=mmap.PROT_READ)
                finally:
                    os.close(f)
            except OSError as e:
                log.info("peer pid %d's region counter cannot be mapped (%s); reading it per batch instead",
                         pid, e)

    def read(self) -> int:
        if self._map is not None:
            return _I64.unpack_from(self._map, 0)[0]
        try:
            raw = process_vm_read(self.pid, self.addr, 8)
        except OSError as e:
            raise PeerLost(f"same-host peer pid {self.pid} cannot be read: {e}") from e
        return int.from_bytes(raw, "little", signed=True)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
