"""Exception hierarchy of pxn's transport layer.

Every error names its cause and the offending value; callers catch the narrowest class they can act on.
``TransferError`` is what ``TransferEngine.batch_write`` raises; ``FabricError`` is what fabrics raise.
"""


class PxnError(Exception):
    """Root of every pxn exception."""


class ConfigError(PxnError, ValueError):
    """A setting is malformed or out of its range: a constructor argument, or a ``PXN_*`` environment variable
    (then the message names the variable and its value)."""


# --- fabric level -------------------------------------------------------------------------------------------
class FabricError(PxnError):
    """A fabric operation failed (connection, post, poll)."""


class FabricUnavailable(FabricError):
    """The fabric cannot run on this machine (missing library or device); the message says how to fix it."""


class FabricClosed(FabricError):
    """The fabric (or endpoint) was closed and cannot be used any more."""


class RegionError(FabricError):
    """An address range is not inside a registered memory region, or the rkey/lkey does not match."""


class UnknownPeer(FabricError):
    """An endpoint / session id that this fabric or engine never connected to."""


class ForeignSegment(UnknownPeer):
    """A metadata server holds an entry under the segment name, but not a pxn engine's: a Mooncake engine's
    segment descriptor (its ``protocol`` is Mooncake's, e.g. "rdma" or "tcp") or a malformed value. pxn cannot
    move data to it; the message names the key, the server and what the entry holds."""


class PeerLost(FabricError):
    """The peer's connection broke (process died, socket reset); its pending work fails with this cause."""


# --- engine level -------------------------------------------------------------------------------------------
class TransferError(PxnError):
    """A batch transfer failed. ``causes`` lists per-rail causes when several rails failed."""

    def __init__(self, message, causes=None):
        super().__init__(message)
        self.causes = list(causes or [])


class InvalidTransfer(TransferError, ValueError):
    """The batch itself is malformed (bad address, length, unregistered memory, destination outside the
    regions the peer advertised). Nothing of the batch was written."""


class TransferTimeout(TransferError, TimeoutError):
    """The batch did not complete within its timeout."""


class RemoteRejected(TransferError):
    """The receiver refused a chunk (failed validation); nothing of that chunk was written."""


class ChunkFormatError(PxnError, ValueError):
    """A relay chunk's header or item table is malformed (bad magic, version, count, offset, checksum...)."""
