"""The socket fabrics' wire format: frame headers, piece tables, tags, status codes, and the bounds on every
length a peer announces.

Wire protocol (little-endian), per socket, in both directions:

* First the shared-secret challenge-response of ``transport.auth`` (nothing else is read or answered before it),
  then HELLO / HELLO_ACK (JSON body), so that the accepting side builds the symmetric endpoint. Each incoming
  connection authenticates in its own thread within ``handshake_timeout`` (``transport.auth.Gate``), so idle
  sockets cannot hold the listener, and the listener survives running out of file descriptors.
* Every frame after the handshake (HELLO included) carries in its header a 16-byte tag under the connection's
  session key (``transport.auth.Session``) over an implicit per-socket, per-direction sequence number, the header
  and the piece table (the whole body for ACK and control messages). A wrong tag fails the endpoint before anything
  is acted on. The payload is not covered: a piece lands only inside the range the checked table names. A relay
  chunk sent as a payload carries a MAC of its own over its header and item table (``pxn_kernels.chunk``), which
  the receiver checks before it places an item, so changed payload bytes cannot send the chunk's items elsewhere.
* WRITE: a 48-byte header (32 bytes of fields, the tag), a table of ``count`` 48-byte piece descriptors, then
  the pieces' payloads back to back. One message carries many writes (4 KB writes cost one table row, not one
  syscall each), and a large write is cut into pieces spread over the peer's sockets (striping). Every piece
  carries the bounds of its *whole* write, so all pieces of a write are accepted or refused together. A message
  with header flag ``H_WHOLE`` carries exactly one whole write (a ``GatherWrite``: a relay chunk sent from its
  header in the slot and its pieces' sources) and may exceed the sender's message size, up to ``MAX_WHOLE``.
* ACK: header + one status byte per piece; the sender reports completions only from acks, i.e. after the bytes
  are placed at the target. With tags, an ACK whose every status is OK carries header flag ``H_TOKEN`` and, in
  its tag field, the acked WRITE's ack token: the second half of the hash the receiver computed to check that
  WRITE's tag, which never travelled (``transport.auth``). Its sender kept the same 16 bytes when it sealed the
  WRITE (``Session.acks``) and compares: only a holder of the session key who checked that very WRITE (its
  sequence number on the socket, its header with the message number, its table) can produce them, so the ACK
  needs no hash of its own on either side and takes no sequence number. A token that does not match, or comes
  for a WRITE not pending, closes the connection like a wrong tag. Any other ACK (a piece refused, an ipc ACK)
  is tagged as every frame. A WRITE with header flag ``H_NOACK`` (an unacked write, ``WriteRequest.acked`` False:
  one small write, a receiver's ack of a chunk) is not acknowledged; its sender keeps no record of it.
* REQ / GRANT / DONE / NOTIFY: the ipc fabric's doorbell messages (``transport.fabric.ipc``).

Every length on the wire is bounded before anything is allocated for it: piece tables by ``MAX_TABLE``, a
message's payload by the sender's ``message_bytes`` (from its hello), acks by the pieces of the acked message,
HELLO bodies by ``MAX_HELLO``.
"""
from __future__ import annotations

import struct
from hmac import compare_digest
from typing import Dict

import numpy as np

from transport import auth

MAGIC = b"PXNT"
T_HELLO, T_HELLO_ACK, T_WRITE, T_ACK, T_REQ, T_GRANT, T_DONE, T_NOTIFY = 1, 2, 3, 4, 5, 6, 7, 8
# magic, type, flags, reserved, count, seq, body bytes (table/JSON + payload), then the 16-byte tag (packed as zeros;
# ``seal`` fills it at send time, when the frame's place in the socket's sequence is known)
HDR = struct.Struct("<4sBBHIQQ4x16x")
assert HDR.size == 48
_ACK_TOKEN = struct.Struct("<4sBBHIQQ4x16s")  # HDR with the ack token in its tag field
_TABLE_TYPES = frozenset((3, 5, 8))  # WRITE, REQ, NOTIFY: the tag covers the piece table, not what follows it
_TFCSB = struct.Struct("<4xBBxxIQQ")  # type, flags, count, sequence number, body bytes of a frame header
# What stands in a frame's tag field while its tag is computed: the frame's sequence number on the socket, 8 zero
# bytes. Put there on both sides, it makes the header, the sequence number and the table one contiguous range, so
# that a sender hashes each frame in one update and packs nothing else.
TAIL = struct.Struct("<Q8x")


def seal(sess, buf, own: bool = False):
    """``buf`` (one or more frames back to back, each header and what its tag covers inside it; the last one's payload
    may follow in other buffers) as a new bytearray with every frame's tag filled in, in order, under ``sess`` (None:
    ``buf`` as is). ``own``: a bytearray ``buf`` was built for this one send and is sealed in place, not copied (a
    many-piece table is tens of KiB to MiBs). Call it where the frames go out, under the socket's send lock: each tag
    takes the next sequence number. A tag is the first half of keyed BLAKE2b over the header with the frame's
    sequence number in its tag field (``TAIL``), then the covered bytes, which follow it: one contiguous range. A
    WRITE that asks for an ACK leaves the second half, its ack token, in ``sess.acks``; an ACK that carries a token
    (``H_TOKEN``) is left as it is and takes no sequence number."""
    if sess is None:
        return buf
    n = len(buf)
    typ, fl, count, seq, blen = _TFCSB.unpack_from(buf, 0)
    if 48 + (count * 48 if typ in _TABLE_TYPES else blen) == n:  # one frame and what its tag covers: the usual
        if fl & H_TOKEN and typ == T_ACK:
            return buf
        b = buf if own and type(buf) is bytearray else bytearray(buf)
        seal_frame(sess, b, seq if typ == T_WRITE and not fl & H_NOACK else -1)
        return b
    b = buf if own and type(buf) is bytearray else bytearray(buf)
    off = 0
    while off + 48 <= n:
        typ, fl, count, seq, blen = _TFCSB.unpack_from(b, off)
        end = off + 48 + (count * 48 if typ in _TABLE_TYPES else blen)
        if end > n:
            raise AssertionError(f"frame of type {typ} at {off}: its covered bytes end at {end}, past the buffer {n}")
        if not (fl & H_TOKEN and typ == T_ACK):
            seal_frame(sess, b if end == n and not off else memoryview(b)[off:end],
                       seq if typ == T_WRITE and not fl & H_NOACK else -1)
        off += 48 + blen
    return b


def seal_frame(sess, frame, ack_seq: int) -> None:
    """Tag one frame in place: ``frame`` is its header and what its tag covers (a bytearray built for this one send, or
    a writable view of one); its tag takes the next sequence number. ``ack_seq`` >= 0: the frame is the acknowledged
    WRITE numbered so, whose ack token goes to ``sess.acks``. ``seal`` calls it once it knows what the buffer holds;
    a small batch sent by its caller (``TcpPoster.post_rows``) calls it directly, without those steps: they were a
    fifth of the smallest call's tag cost (``benchmarks/NOTES.md``)."""
    TAIL.pack_into(frame, 32, sess.tx_n)
    sess.tx_n += 1
    h = sess.tx_hash.copy()
    h.update(frame)
    d = h.digest()
    frame[32:48] = d[:16]
    if ack_seq >= 0:
        sess.acks[ack_seq] = d[16:]


def ack_frame(seq: int, statuses, token) -> bytes:
    """The ACK of message ``seq`` with one status byte per piece: carrying ``token`` (the WRITE's ack token, from
    the receiver's check of its tag) when there is one and every piece was placed, else to be tagged when sent."""
    count = len(statuses)
    if token is not None and statuses.count(0) == count:
        return _ACK_TOKEN.pack(MAGIC, T_ACK, H_TOKEN, 0, count, seq, count, token) + bytes(statuses)
    return HDR.pack(MAGIC, T_ACK, 0, 0, count, seq, count) + bytes(statuses)


def check_token(sess, seq: int, token, statuses: bytes) -> None:
    """Accept an ACK with ``H_TOKEN`` for message ``seq``: its token must be the one kept when that WRITE was sealed
    and every status OK; raises SecretMismatch naming the connection otherwise (a forged, replayed or misdirected
    ACK)."""
    want = sess.acks.pop(seq, None)
    if want is None or not compare_digest(want, token) or statuses.count(0) != len(statuses):
        raise auth.SecretMismatch(
            f"{sess.purpose}: an ACK for message {seq} carries "
            f"{'a token for no WRITE pending here' if want is None else 'a wrong ack token or a refused piece'} "
            f"(injected, replayed or reordered); closing the connection")


def rx_head(sess, hdr: bytearray, p: int = 0):
    """Begin checking a received frame whose 48-byte header is ``hdr[p:p + 48]``, in a buffer of the receiver's
    own where those bytes are consumed: returns (the hash, to be updated with the covered bytes, and the tag it
    must give). The tag field is overwritten with the expected sequence number (``TAIL``), as it was sealed."""
    tag = hdr[p + 32:p + 48]
    TAIL.pack_into(hdr, p + 32, sess.rx_n)
    sess.rx_n += 1
    mac = sess.rx_hash.copy()
    mac.update(memoryview(hdr)[p:p + 48])
    return mac, tag


def frame_check(sess, hdr, body) -> None:
    """Check a whole received frame (``hdr`` 48 bytes, ``body`` what its tag covers); raises AuthError."""
    if sess is not None:
        mac, tag = rx_head(sess, bytearray(hdr[:48]))
        mac.update(body)
        sess.rx_end(mac, tag)


def keyed(sock):
    """The tagging session of a connected socket, None when its connection runs without a secret."""
    sess = auth.session_of(sock)
    return sess if sess is not None and sess.keyed else None


PIECE_DT = np.dtype([("addr", "<u8"), ("len", "<u8"), ("waddr", "<u8"), ("wlen", "<u8"),
                     ("rkey", "<u4"), ("flags", "<u4"), ("imm", "<u4"), ("wr", "<u4")])
assert PIECE_DT.itemsize == 48
F_IMM = 1
# header flag of a WRITE message that carries one whole write (a ``GatherWrite``, i.e. a relay chunk): its payload may
# exceed the sender's message size, up to MAX_WHOLE bytes, since it goes into one registered region (or is discarded
# through the fixed staging buffer) and nothing is allocated for it
H_WHOLE = 1
MAX_WHOLE = 64 << 20
# header flag of a WRITE message the target does not acknowledge (``WriteRequest.acked`` False): its sender keeps no
# pending record and reports no completion for it, so an ACK would only cost a send and a receive on each side
H_NOACK = 2
# header flag of an ACK whose tag field holds the acked WRITE's ack token (every piece placed; see the docstring)
H_TOKEN = 4
# payload bytes of an unacked write at most; larger ones go as acknowledged writes (the target receives unacked ones
# in one piece, as a small message)
UNACKED_MAX = 4096
ROW = struct.Struct("<QQQQIIII")  # one PIECE_DT row
assert ROW.size == PIECE_DT.itemsize

ST_OK, ST_BAD_RKEY, ST_BOUNDS, ST_FAILED = 0, 1, 2, 3
STATUS_TEXT = {ST_BAD_RKEY: "rkey unknown to the target", ST_BOUNDS: "range outside the target's region",
                ST_FAILED: "target failed to place the bytes"}

# Pieces under this size are received into a staging run and scattered by memmove: one recv per run instead of
# one syscall per 64 B piece.
SMALL_PIECE = 32 << 10
# A WRITE message of at most this many bytes (table and payload) is received in one piece into the staging buffer
# and placed from there (``TcpLanding.on_small_write``): one receive and no numpy call, where the bytes copied once more
# cost less than the steps saved.
SMALL_MESSAGE = 64 << 10
MAX_TABLE = 1 << 16  # pieces per message; a peer claiming more is broken or hostile
VECTOR_MIN = 16  # posts of more writes than this are checked and framed by numpy, not one write at a time
I64 = (1 << 63) - 1
MAX_HELLO = 1 << 16  # bytes of a HELLO body
MAX_MESSAGE_BYTES = 1 << 30  # largest message_bytes a peer may announce
MAX_CTRL_BODY = 1 << 20  # bytes of a control message body beyond its per-piece statuses (an ipc GRANT's JSON)


_TABLES: Dict[int, struct.Struct] = {}


def table_struct(count: int) -> struct.Struct:
    """A ``struct.Struct`` of ``count`` rows of PIECE_DT (cached: small messages have at most
    ``SMALL_MESSAGE // PIECE_DT.itemsize`` rows)."""
    t = _TABLES.get(count)
    if t is None:
        t = _TABLES[count] = struct.Struct("<" + "QQQQIIII" * count)
    return t
