"""The relay chunk wire format: ``[header 64 B | item table 16 B × n | payload, items at 16-B aligned offsets]``.

A chunk carries many small pieces in one fabric write. The sender builds header + table on the host
(``build_header_table``), then one gather launch (``pxn_kernels.pack_chunk``) copies header+table and every
piece into the relay slot. The receiver parses and validates everything it reads from the wire
(``parse_chunk``) before it scatters anything: the bytes are untrusted until then.

Header (little-endian, 64 bytes)::

    off size field
      0   4  magic            b"PXN1"
      4   2  version          1
      6   2  flags            reserved, 0
      8   8  seq              sender's sequence number for this (sender, receiver) pair
     16   4  item_count       n
     20   4  table_offset     64
     24   4  payload_offset   align16(64 + 16 n)
     28   4  chunk_bytes      payload_offset + payload bytes (items at 16-B aligned offsets)
     32   8  sender_id        sender's 64-bit id
     40   4  checksum         CRC-32 of header (with this field zero) + item table; zero with ``F_KEYED``
     44  16  mac              with flag ``F_KEYED``: HMAC-SHA256 under the sender's chunk key of the header (bytes
                              0..40 and 60..64) and the item table, its first 16 bytes; else zero
     60   4  reserved, 0

Flags: ``F_KEYED`` (bit 0). Without a secret the checksum catches a chunk that was not (or not wholly) written.
With one, the MAC replaces it: only the MAC says who wrote the chunk. A receiver holding a chunk key for the
sender (``key=`` of ``parse_chunk``) refuses a chunk without ``F_KEYED`` or whose MAC does not check
(``ChunkAuthError``) before it reads the table: the header and the table decide where every byte goes, and the
fabric's own tags do not cover them (they travel as the payload of a write). HMAC-SHA256 rather than keyed
BLAKE2b: with the CPU's SHA instructions it hashes a 4096-item table (64 KiB) in about half the time.

Item table entry (16 bytes)::

      0   8  dst_addr         destination address at the receiver
      8   4  length           bytes (>= 1)
     12   4  offset           payload byte offset from the chunk start (16-B aligned)
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
import hmac
from hmac import compare_digest
from itertools import islice, repeat
from operator import add, and_, le
from typing import Optional, Sequence, Union

import numpy as np

from pxn_kernels.errors import ChunkAuthError, ChunkFormatError

MAGIC = b"PXN1"
VERSION = 1
HEADER_BYTES = 64
ENTRY_BYTES = 16
PAYLOAD_ALIGN = 16
MAX_CHUNK_BYTES = (1 << 32) - 1  # offsets and lengths are u32
F_KEYED = 1  # header flag: the chunk carries a MAC (bytes 44..60)
MAC_BYTES = 16
_MAC_AT, _MAC_END = 44, 60

_HEADER = struct.Struct("<4sHHQIIIIQI20x")
assert _HEADER.size == HEADER_BYTES
_ENTRY_DTYPE = np.dtype([("dst_addr", "<u8"), ("length", "<u4"), ("offset", "<u4")])
assert _ENTRY_DTYPE.itemsize == ENTRY_BYTES


def align_up(value: int, alignment: int = PAYLOAD_ALIGN) -> int:
    return (value + alignment - 1) // alignment * alignment


def payload_offset_for(item_count: int) -> int:
    """Byte offset of the payload in a chunk of ``item_count`` items."""
    return align_up(HEADER_BYTES + ENTRY_BYTES * item_count)


def chunk_layout(lengths: Sequence[int]):
    """Offsets of each item's payload (from the chunk start) and the chunk's total size in bytes.

    Returns ``(item_offsets: np.ndarray[int64], chunk_bytes: int)``.
    """
    lengths_np = np.asarray(lengths, dtype=np.int64)
    if lengths_np.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths_np.shape}")
    if lengths_np.size and int(lengths_np.min()) < 1:
        bad = int(np.argmin(lengths_np))
        raise ValueError(f"lengths[{bad}] = {int(lengths_np[bad])}: chunk items must be >= 1 byte")
    padded = (lengths_np + (PAYLOAD_ALIGN - 1)) & ~np.int64(PAYLOAD_ALIGN - 1)
    start = payload_offset_for(lengths_np.size)
    item_offsets = start + np.concatenate(([0], np.cumsum(padded)[:-1])).astype(np.int64) if lengths_np.size \
        else np.zeros(0, dtype=np.int64)
    chunk_bytes = start + int(padded.sum())
    if chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk of {chunk_bytes} bytes exceeds the u32 limit {MAX_CHUNK_BYTES}")
    return item_offsets, chunk_bytes


def chunk_bytes_for(lengths: Sequence[int]) -> int:
    """Total chunk size in bytes for items of these lengths."""
    return chunk_layout(lengths)[1]


def chunk_mac(key: bytes, head_table) -> bytes:
    """The MAC of a chunk whose header and item table are ``head_table`` (bytes-like, exactly that long): keyed
    BLAKE2b-128 over them without the checksum and MAC fields (bytes 40..60)."""
    base = _MAC_BASES.get(key)
    if base is None:
        if len(_MAC_BASES) >= 1024:
            _MAC_BASES.clear()
        base = _MAC_BASES[key] = hmac.new(key, digestmod="sha256")  # the key's pads hashed once, copied per chunk
    h = base.copy()
    h.update(head_table[:40])
    h.update(head_table[_MAC_END:])
    return h.digest()[:MAC_BYTES]


_MAC_BASES: dict = {}


def build_header_table(dst_addrs: Sequence[int], lengths: Sequence[int], seq: int, sender_id: int,
                       flags: int = 0, out: Optional[np.ndarray] = None, key: Optional[bytes] = None):
    """Header + item table of a chunk, as uint8 bytes, with its checksum.

    Arguments:
        dst_addrs: destination address of each item at the receiver.
        lengths: bytes of each item (>= 1).
        seq: sequence number (u64). sender_id: sender id (u64). flags: u16, reserved.
        out: optional uint8 array of at least ``payload_offset_for(n)`` bytes to write into (e.g. a pinned
            staging buffer's numpy view), avoiding an allocation on the hot path.
        key: the chunk key this sender holds for the receiver (``transport.auth.chunk_key``): the chunk carries
            ``F_KEYED`` and the MAC of its header and table. None: no MAC (a receiver without a secret).
    Returns:
        ``(header_table: np.ndarray[uint8] of payload_offset_for(n) bytes, item_offsets, chunk_bytes)``.
    """
    dst_np = np.asarray(dst_addrs, dtype=np.uint64)
    lengths_np = np.asarray(lengths, dtype=np.int64)
    if dst_np.shape != lengths_np.shape:
        raise ValueError(f"dst_addrs has {dst_np.size} entries but lengths has {lengths_np.size}")
    item_offsets, chunk_bytes = chunk_layout(lengths_np)
    n = lengths_np.size
    table_end = payload_offset_for(n)
    if out is None:
        out = np.zeros(table_end, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.size < table_end:
        raise ValueError(f"out must be uint8 with >= {table_end} bytes, got {out.dtype} of {out.size}")
    buf = out[:table_end]
    buf[HEADER_BYTES + ENTRY_BYTES * n:] = 0
    table = buf[HEADER_BYTES:HEADER_BYTES + ENTRY_BYTES * n].view(_ENTRY_DTYPE)
    table["dst_addr"] = dst_np
    table["length"] = lengths_np
    table["offset"] = item_offsets
    if key is not None:
        flags |= F_KEYED
    header = _HEADER.pack(MAGIC, VERSION, flags, seq, n, HEADER_BYTES, table_end, chunk_bytes, sender_id, 0)
    buf[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    if key is not None:  # the MAC replaces the checksum (left zero)
        buf[_MAC_AT:_MAC_END] = np.frombuffer(chunk_mac(key, memoryview(buf[:HEADER_BYTES + ENTRY_BYTES * n])),
                                              dtype=np.uint8)
    else:
        checksum = zlib.crc32(buf[:HEADER_BYTES + ENTRY_BYTES * n])
        buf[40:44] = np.frombuffer(struct.pack("<I", checksum), dtype=np.uint8)
    return buf, item_offsets, chunk_bytes


@dataclass
class ChunkTable:
    """A validated chunk's header fields and item table (numpy arrays, one entry per item)."""

    seq: int
    sender_id: int
    flags: int
    chunk_bytes: int
    payload_offset: int
    dst_addrs: np.ndarray  # uint64
    lengths: np.ndarray  # int64
    offsets: np.ndarray  # int64, from the chunk start

    @property
    def item_count(self) -> int:
        return int(self.lengths.size)


BufferLike = Union[bytes, bytearray, memoryview, np.ndarray]


def _check_mac(key: Optional[bytes], flags: int, head_table) -> None:
    """Raise ChunkAuthError unless the chunk whose header and table are ``head_table`` carries a good MAC."""
    if key is None:
        raise ChunkAuthError(f"chunk with a MAC (flags 0x{flags:x}) for a receiver that holds no chunk key")
    if not flags & F_KEYED:
        raise ChunkAuthError(f"chunk without a MAC (flags 0x{flags:x}) from a sender that holds a chunk key")
    got = bytes(head_table[_MAC_AT:_MAC_END])
    want = chunk_mac(key, head_table)
    if not compare_digest(got, want):
        raise ChunkAuthError(f"chunk MAC {got.hex()} does not check under the sender's chunk key: its header or "
                             f"item table was changed after it was sealed")


def parse_chunk(data: BufferLike, available_bytes: Optional[int] = None, key: Optional[bytes] = None) -> ChunkTable:
    """Parse and validate a chunk's header and table (the payload is not read).

    Arguments:
        data: the chunk's first bytes (at least header + table), host memory.
        available_bytes: how many bytes actually landed (the slot / write length); the chunk must fit in it.
        key: the sender's chunk key: the MAC is checked right after the header's counts and before the table is
            read (None: no MAC is asked for).
    Returns:
        a ``ChunkTable``.
    Raises:
        ``ChunkFormatError`` naming the malformed field and its value; ``ChunkAuthError`` (a subclass) for a
        missing or wrong MAC.
    """
    view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8) if not isinstance(data, np.ndarray) \
        else data.reshape(-1).view(np.uint8)
    landed = int(view.size if available_bytes is None else available_bytes)
    if view.size < HEADER_BYTES:
        raise ChunkFormatError(f"chunk of {view.size} bytes is shorter than its {HEADER_BYTES}-byte header")
    (magic, version, flags, seq, count, table_offset, payload_offset, chunk_bytes, sender_id,
     checksum) = _HEADER.unpack(view[:HEADER_BYTES].tobytes())
    table_end = _check_header(magic, version, table_offset, payload_offset, chunk_bytes, count, landed, view.size)
    if key is not None or flags & F_KEYED:
        _check_mac(key, flags, memoryview(view[:table_end]))
    else:
        scratch = view[:table_end].copy()
        scratch[40:44] = 0
        if zlib.crc32(scratch) != checksum:
            raise ChunkFormatError(f"checksum mismatch: header says 0x{checksum:08x}, "
                                   f"computed 0x{zlib.crc32(scratch):08x}")
    table = view[HEADER_BYTES:table_end].view(_ENTRY_DTYPE)
    lengths = table["length"].astype(np.int64)
    offsets = table["offset"].astype(np.int64)
    dst = table["dst_addr"].copy()
    if count:
        _check_items(lengths, offsets, dst, payload_offset, chunk_bytes)
    return ChunkTable(seq=seq, sender_id=sender_id, flags=flags, chunk_bytes=chunk_bytes,
                      payload_offset=payload_offset, dst_addrs=dst, lengths=lengths, offsets=offsets)


def _check_header(magic, version, table_offset, payload_offset, chunk_bytes, count, landed, size) -> int:
    """``parse_chunk``'s checks of the header's fields against each other and the ``landed`` bytes (``size`` of
    them given); returns where the item table ends."""
    if magic != MAGIC:
        raise ChunkFormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ChunkFormatError(f"unsupported chunk version {version}, expected {VERSION}")
    if table_offset != HEADER_BYTES:
        raise ChunkFormatError(f"table_offset {table_offset}, expected {HEADER_BYTES}")
    table_end = HEADER_BYTES + ENTRY_BYTES * count
    if payload_offset != align_up(table_end):
        raise ChunkFormatError(f"payload_offset {payload_offset} does not match item_count {count} "
                               f"(expected {align_up(table_end)})")
    if chunk_bytes < payload_offset or chunk_bytes > landed:
        raise ChunkFormatError(f"chunk_bytes {chunk_bytes} outside [{payload_offset}, {landed}] "
                               f"(header+table .. bytes that landed)")
    if size < table_end:
        raise ChunkFormatError(f"item table needs {table_end} bytes, only {size} given")
    return table_end


def _check_items(lengths: np.ndarray, offsets: np.ndarray, dst: np.ndarray, payload_offset: int,
                 chunk_bytes: int) -> None:
    """``parse_chunk``'s checks of a non-empty item table: positive lengths, aligned payloads inside the chunk,
    destinations that do not wrap, payloads that do not overlap."""
    if int(lengths.min()) < 1:
        bad = int(np.argmin(lengths))
        raise ChunkFormatError(f"item {bad}: length {int(lengths[bad])} < 1")
    misaligned = np.nonzero(offsets % PAYLOAD_ALIGN)[0]
    if misaligned.size:
        bad = int(misaligned[0])
        raise ChunkFormatError(f"item {bad}: payload offset {int(offsets[bad])} not 16-byte aligned")
    ends = offsets + lengths
    below = np.nonzero(offsets < payload_offset)[0]
    if below.size:
        bad = int(below[0])
        raise ChunkFormatError(f"item {bad}: payload offset {int(offsets[bad])} inside header/table "
                               f"(payload starts at {payload_offset})")
    beyond = np.nonzero(ends > chunk_bytes)[0]
    if beyond.size:
        bad = int(beyond[0])
        raise ChunkFormatError(f"item {bad}: payload [{int(offsets[bad])}, {int(ends[bad])}) runs past "
                               f"chunk_bytes {chunk_bytes}")
    overflow = np.nonzero(dst > np.uint64((1 << 64) - 1) - lengths.astype(np.uint64))[0]
    if overflow.size:
        bad = int(overflow[0])
        raise ChunkFormatError(f"item {bad}: dst 0x{int(dst[bad]):x} + length {int(lengths[bad])} "
                               f"overflows 64 bits")
    # items in payload order (what every sender writes) need no sort to show that none overlaps
    if lengths.size > 1 and not bool((offsets[1:] >= ends[:-1]).all()):
        order = np.argsort(offsets, kind="stable")
        overlap = np.nonzero(ends[order][:-1] > offsets[order][1:])[0]
        if overlap.size:
            bad = int(order[overlap[0] + 1])
            raise ChunkFormatError(f"item {bad}: payload offset {int(offsets[bad])} overlaps the previous item")


_U64_MAX = (1 << 64) - 1
ROWS_MAX_ITEMS = 1024
"""Most items ``parse_chunk_rows`` reads; larger tables are left to ``parse_chunk``."""
_ROWS_STRUCTS: dict = {}


def _rows_struct(count: int) -> struct.Struct:
    s = _ROWS_STRUCTS.get(count)
    if s is None:
        if len(_ROWS_STRUCTS) >= 64:
            _ROWS_STRUCTS.clear()
        s = _ROWS_STRUCTS[count] = struct.Struct("<" + "QII" * count)
    return s


def parse_chunk_rows(data: memoryview, available_bytes: int, key: Optional[bytes] = None) -> Optional[tuple]:
    """``parse_chunk``'s checks, every one of them, for the usual chunk: at least one and at most
    ``ROWS_MAX_ITEMS`` items, in payload order. The table is read by one ``struct`` call and checked by builtin
    reductions over its columns (C loops over ints), not by numpy calls of a few µs each: this runs once per chunk
    in the receiving thread, with its caches cold from the payload just received.

    Arguments:
        data: the chunk's first bytes (at least header + table), a bytes-like object of host memory.
        available_bytes: how many bytes landed (the write's length); the chunk must fit in it.
        key: the sender's chunk key (as ``parse_chunk``): a chunk without a good MAC gives None.
    Returns:
        ``(seq, sender_id, chunk_bytes, dst_addrs, lengths, offsets, dst_lo, dst_hi)``: the item columns as tuples
        of ints (items in payload order) and the span of the destinations, ``[dst_lo, dst_hi)``; or None when
        the chunk is malformed, empty, too large for this path or not in payload order. Then ``parse_chunk``
        decides: it names what is wrong, or returns the table of a good chunk this path does not take.
    """
    if len(data) < HEADER_BYTES:
        return None
    (magic, version, flags, seq, count, table_offset, payload_offset, chunk_bytes, sender_id,
     checksum) = _HEADER.unpack_from(data)
    table_end = HEADER_BYTES + ENTRY_BYTES * count
    if magic != MAGIC or version != VERSION or table_offset != HEADER_BYTES or not 1 <= count <= ROWS_MAX_ITEMS \
            or payload_offset != align_up(table_end) or not payload_offset <= chunk_bytes <= available_bytes \
            or len(data) < table_end:
        return None
    if key is not None:  # the MAC (instead of the checksum)
        if not (flags & F_KEYED and compare_digest(bytes(data[_MAC_AT:_MAC_END]), chunk_mac(key, data[:table_end]))):
            return None
    # the checksum of header (its checksum field zero) and table, as parse_chunk computes it on a copy
    elif flags & F_KEYED or zlib.crc32(data[44:table_end], zlib.crc32(b"\0\0\0\0", zlib.crc32(data[:40]))) != checksum:
        return None
    rows = _rows_struct(count).unpack_from(data, HEADER_BYTES)
    dsts, lens, offs = rows[0::3], rows[1::3], rows[2::3]
    ends = list(map(add, offs, lens))
    if min(lens) < 1 or any(map(and_, offs, repeat(15, count))) or offs[0] < payload_offset \
            or ends[-1] > chunk_bytes or not all(map(le, ends, islice(offs, 1, None))):
        return None  # (items in payload order: the first offset is the lowest, the last end the highest)
    dst_hi = max(map(add, dsts, lens))
    if dst_hi > _U64_MAX:
        return None
    return seq, sender_id, chunk_bytes, dsts, lens, offs, min(dsts), dst_hi
