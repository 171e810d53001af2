"""The Mooncake layer's vocabulary: its return codes (the table in ``integration.mooncake``), the mapping of pxn
exceptions to them, and Mooncake's opcode and notify types."""
from __future__ import annotations

import logging

from transport.errors import (AddressNotRegistered, FabricClosed, FabricError, FabricUnavailable, InvalidTransfer,
                              PeerLost, PxnError, RegionOverlap, RemoteRejected, TransferError, TransferTimeout,
                              UnknownPeer)

# the whole Mooncake layer logs under the one name its documentation gives
log = logging.getLogger("integration.mooncake")

# --- codes: Mooncake's values where Mooncake has the cause (include/error.h), -5xx for pxn-only causes --------
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_METADATA = -200
ERR_ENDPOINT = -201
ERR_CONTEXT = -202
ERR_NOT_IMPLEMENTED = -303
ERR_REMOTE_REJECTED = -501
ERR_TIMEOUT = -502
ERR_TRANSFER = -503
ERR_INTERNAL = -599

_NAMES = {v: k for k, v in globals().items() if k.startswith("ERR_") and isinstance(v, int)}


class TransferOpcode:
    """Mooncake's opcode enum: ``TransferOpcode.Read`` (0) / ``.Write`` (1), plain ints here."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


Read = TransferOpcode.Read     # mooncake.engine exports the enum's values at module level too
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's ``TransferNotify``: a (``name``, ``msg``) pair delivered to the peer after a transfer, read
    there with ``get_notifies()``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)


def error_name(code: int) -> str:
    """The symbolic name of a code returned here, e.g. ``error_name(-3) == "ERR_ADDRESS_NOT_REGISTERED"``."""
    return "OK" if code == 0 else _NAMES.get(code, f"ERR_{code}")


# narrowest class first: ``UnknownSession`` is an ``UnknownPeer`` and an ``InvalidTransfer``, and the typed
# subclasses of ``InvalidTransfer`` carry their own codes
_CODE_BY_TYPE = (
    (UnknownPeer, ERR_METADATA),
    (AddressNotRegistered, ERR_ADDRESS_NOT_REGISTERED),
    (RegionOverlap, ERR_ADDRESS_OVERLAPPED),
    (InvalidTransfer, ERR_INVALID_ARGUMENT),
    (TransferTimeout, ERR_TIMEOUT),
    (RemoteRejected, ERR_REMOTE_REJECTED),
    (FabricClosed, ERR_CONTEXT),
    (FabricUnavailable, ERR_DEVICE_NOT_FOUND),
    (PeerLost, ERR_ENDPOINT),
)


def error_code(exc: BaseException) -> int:
    """Map a pxn exception to its negative code (the table in ``integration.mooncake``): the first class of
    ``_CODE_BY_TYPE`` it is an instance of; a ``TransferError`` caused by lost peers is ``ERR_ENDPOINT``, any
    other pxn error ``ERR_TRANSFER``, a ``ValueError`` / ``TypeError`` ``ERR_INVALID_ARGUMENT``, anything else
    ``ERR_INTERNAL``."""
    for cls, code in _CODE_BY_TYPE:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, TransferError) and exc.causes:
        return ERR_ENDPOINT
    if isinstance(exc, (TransferError, FabricError, PxnError)):
        return ERR_TRANSFER
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ERR_ENDPOINT  # a peer's socket refused, reset or silent (e.g. a query to a dead peer)
    if isinstance(exc, (ValueError, TypeError)):
        return ERR_INVALID_ARGUMENT
    return ERR_INTERNAL


def fail(what: str, exc: BaseException) -> int:
    """Log why ``what`` failed and return its code. Expected failures (pxn errors) log one line at WARNING;
    anything else is a bug and logs its traceback at ERROR."""
    code = error_code(exc)
    if code == ERR_INTERNAL:
        log.error("%s failed (%s): unexpected %s: %s", what, error_name(code), type(exc).__name__, exc,
                  exc_info=exc)
    else:
        log.warning("%s failed (%s=%d): %s: %s", what, error_name(code), code, type(exc).__name__, exc)
    return code


def count_pieces(lengths) -> str:
    """How many pieces a call names, for its log line ("?" when ``lengths`` has no length)."""
    try:
        return str(len(lengths))
    except TypeError:
        return "?"


def parse_opcode(opcode) -> int:
    """TransferOpcode.Read / .Write (or Mooncake's enum, or 0 / 1) -> 0 / 1; InvalidTransfer otherwise."""
    try:
        value = int(getattr(opcode, "value", opcode))
    except (TypeError, ValueError):
        value = -1
    if isinstance(opcode, bool) or value not in (TransferOpcode.READ, TransferOpcode.WRITE):
        raise InvalidTransfer(f"opcode {opcode!r}: expected TransferOpcode.Read (0) or TransferOpcode.Write (1)")
    return value

