"""Memory registration for the Mooncake engine: registered ranges in registration order (Mooncake's "first
buffer"), the host buffers it allocates itself (managed buffers) and the checked host copies into them."""
from __future__ import annotations

import ctypes
import mmap
from typing import Dict, List, Sequence, Tuple

from integration.codes import ERR_INVALID_ARGUMENT, error_name, fail, log
from integration.cuda import pointer_device
from integration.hosts import parse_location
from transport.errors import AddressNotRegistered, FabricClosed, InvalidTransfer, PxnError, RegionOverlap


def alloc_host(length: int):
    """Page-aligned, zeroed host memory of ``length`` bytes: (mmap, ctypes view, address)."""
    mm = mmap.mmap(-1, length)
    view = (ctypes.c_char * length).from_buffer(mm)
    return mm, view, ctypes.addressof(view)


def free_host(mm, view) -> None:
    del view
    try:
        mm.close()
    except BufferError:  # a view is still alive elsewhere: the mapping goes with the last reference
        pass


def free_all(managed: list) -> None:
    """Free managed buffers that ``Registrations.reset`` handed back."""
    for mm, view, _ in managed:
        free_host(mm, view)


class Registrations:
    """The registration calls of Mooncake's API, against the pxn engine that ``reset`` last gave (None before
    ``initialize`` and after ``close``). ``lock`` is the Mooncake engine's: a registration never interleaves with
    a restart of the engine, and a batch registration is all or nothing. Every call returns Mooncake's value and
    logs the cause of a failure."""

    def __init__(self, lock):
        self._lock = lock
        self._engine = None
        self._order: List[int] = []                                 # region addresses in registration order
        self._managed: Dict[int, Tuple[object, object, int]] = {}   # addr -> (mmap, ctypes view, length)

    def _eng(self):
        eng = self._engine
        if eng is None:
            raise FabricClosed("the transfer engine is not initialized: call initialize() first")
        return eng

    def reset(self, engine) -> list:
        """Register with ``engine`` (None: none) from now on and forget every registration made with the one
        before. The caller holds the lock, and frees the returned managed buffers with ``free_all`` once the
        engine before is closed."""
        self._engine = engine
        managed, self._managed, self._order = self._managed, {}, []
        return list(managed.values())

    def _register_one(self, eng, addr: int, length: int, location: str) -> None:
        dev = parse_location(location)
        if isinstance(addr, bool) or not isinstance(addr, int) or isinstance(length, bool) \
                or not isinstance(length, int):
            raise InvalidTransfer(f"register: address {addr!r} and length {length!r} must be ints")
        if length > 0 and eng.find_region(addr, length) is not None:
            # Mooncake refuses a second registration of a range as an overlap (-7), the same range included
            raise RegionOverlap(f"register 0x{addr:x}+{length}: overlaps a registered region (registered already)")
        if dev is None:
            dev = pointer_device(addr)
        eng.register(addr, length, device=dev)
        self._order.append(addr)

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            with self._lock:
                self._register_one(self._eng(), buffer_addr, capacity, location)
            return 0
        except BaseException as e:  # noqa: BLE001
            return fail(f"register_memory(0x{buffer_addr:x}, {capacity})" if isinstance(buffer_addr, int)
                        else f"register_memory({buffer_addr!r})", e)

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        try:
            addrs, caps = list(buffer_addresses), list(capacities)
            if len(addrs) != len(caps):
                raise InvalidTransfer(f"batch_register_memory: {len(addrs)} addresses but {len(caps)} capacities")
        except BaseException as e:  # noqa: BLE001
            return fail("batch_register_memory", e)
        with self._lock:
            done = []
            try:
                eng = self._eng()
                for a, n in zip(addrs, caps):
                    self._register_one(eng, a, n, location)
                    done.append(a)
                return 0
            except BaseException as e:  # noqa: BLE001
                code = fail(f"batch_register_memory (entry {len(done)} of {len(addrs)})", e)
                for a in done:  # roll back: a half-registered batch would look registered to sglang's retry
                    try:
                        eng.deregister(a)
                        self._order.remove(a)
                    except Exception as e2:  # noqa: BLE001
                        log.warning("batch_register_memory rollback: deregister 0x%x failed: %s", a, e2)
                return code

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            with self._lock:
                self._eng().deregister(buffer_addr)
                if buffer_addr in self._order:
                    self._order.remove(buffer_addr)
            return 0
        except BaseException as e:  # noqa: BLE001
            return fail(f"unregister_memory({buffer_addr!r})", e)

    def allocate_managed_buffer(self, length: int) -> int:
        try:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise InvalidTransfer(f"allocate_managed_buffer: length {length!r} must be an int >= 1")
            mm, view, addr = alloc_host(length)
            try:
                with self._lock:
                    self._register_one(self._eng(), addr, length, "cpu:0")
                    self._managed[addr] = (mm, view, length)
            except BaseException:
                free_host(mm, view)
                raise
            return addr
        except BaseException as e:  # noqa: BLE001
            fail(f"allocate_managed_buffer({length!r})", e)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        with self._lock:
            entry = self._managed.pop(buffer_addr, None)
            eng = self._engine
            if entry is not None and eng is not None:
                try:
                    eng.deregister(buffer_addr)
                except PxnError as e:
                    log.warning("free_managed_buffer: deregister 0x%x: %s", buffer_addr, e)
                if buffer_addr in self._order:
                    self._order.remove(buffer_addr)
        if entry is None:
            log.warning("free_managed_buffer(%r, %r): not a managed buffer of this engine (%s)", buffer_addr,
                        length, error_name(ERR_INVALID_ARGUMENT))
            return ERR_INVALID_ARGUMENT
        free_host(entry[0], entry[1])
        return 0

    def _host_range(self, addr, length: int, what: str) -> None:
        """Check that [addr, addr + length) is host memory inside one region registered here."""
        if isinstance(addr, bool) or not isinstance(addr, int) or isinstance(length, bool) \
                or not isinstance(length, int) or length < 0:
            raise InvalidTransfer(f"{what}: address {addr!r} and length {length!r} must be ints >= 0")
        if length == 0:
            return
        region = self._eng().find_region(addr, length)
        if region is None or not (region.addr <= addr and addr + length <= region.addr + region.length):
            raise AddressNotRegistered(f"{what}: 0x{addr:x} + {length} is not inside a region registered with "
                                       f"this engine")
        if region.device >= 0:
            raise InvalidTransfer(f"{what}: 0x{addr:x} is GPU memory (cuda:{region.device}); only host memory is "
                                  f"copied here")

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        try:
            data = bytes(src) if not isinstance(src, bytes) else src
            if isinstance(length, int) and not isinstance(length, bool) and length > len(data):
                raise InvalidTransfer(f"write_bytes_to_buffer: length {length} > the {len(data)} bytes given")
            self._host_range(dest_address, length, "write_bytes_to_buffer")
            if length:
                ctypes.memmove(dest_address, data, length)
            return 0
        except BaseException as e:  # noqa: BLE001
            return fail("write_bytes_to_buffer", e)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        try:
            self._host_range(source_address, length, "read_bytes_from_buffer")
            return ctypes.string_at(source_address, length) if length else b""
        except BaseException as e:  # noqa: BLE001
            fail("read_bytes_from_buffer", e)
            return b""

    def first_address(self, eng) -> int:
        """The first of this engine's regions still registered, in registration order (0: none)."""
        regions = {r.addr for r in eng.regions()}
        for a in self._order:
            if a in regions:
                return a
        return min(regions) if regions else 0
