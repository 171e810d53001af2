"""Exception hierarchy of pxn's transport layer.

Every error names its cause and the offending value; callers catch the narrowest class they can act on.
``TransferError`` is what ``TransferEngine.batch_write`` raises; ``FabricError`` is what fabrics raise.
"""
from typing import Optional

from pxn_kernels.errors import (ChunkAuthError, ChunkFormatError, CudaDriverError, PeerAccessError,  # noqa: F401
                               PxnError)


class ConfigError(PxnError, ValueError):
    """A setting is malformed or out of its range: a constructor argument, or a ``PXN_*`` environment variable
    (then the message names the variable and its value)."""


class TopologyError(PxnError, ValueError):
    """The machine description cannot be read or is invalid (missing sysfs root, malformed override, no usable
    NIC port where one is needed). The message is one line naming the offending path or value."""


class RoutingError(TopologyError):
    """No route can be planned (no usable NIC port) or a routing query names an unknown GPU."""


class ShapesError(PxnError, ValueError):
    """A shapes file is missing, not JSON, or lacks a field ``pxn bench`` needs; the message names file and field."""


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


class ForgedSegment(ForeignSegment):
    """A pxn segment entry in etcd whose MAC does not check under this engine's secret (or that carries none):
    written by someone who does not hold the secret. The message names the key and the server."""


class PeerLost(FabricError):
    """The peer's connection broke (process died, socket reset); its pending work fails with this cause."""


class VerbsPortError(FabricUnavailable):
    """No usable port / GID on the RDMA device(s): the message names each port and why it was skipped."""


# --- authentication -----------------------------------------------------------------------------------------
class AuthError(FabricError):
    """A connection failed authentication: wrong or missing secret, not a pxn peer, or no answer in time."""


class SecretMismatch(AuthError):
    """The peer's proof did not check out: it has another secret, none, or the connection is relayed."""


class RefusalCounted(AuthError):
    """A refusal the gate counted already (evicted, or over the per-address cap)."""


class OverAddressCap(RefusalCounted):
    """A listener's cap on authenticated connections from one source address is full (the control port's:
    ``PXN_MAX_CONNS_PER_ADDR``); raised on the listener's side, where it is counted ``refused_per_addr``."""


class AdmissionRefused(AuthError):
    """The peer's listener did not admit this connection for a cap of its own, not for the secret: ``cap`` is
    "per_addr" (it proved the secret, but the listener already serves as many connections from this side's
    address as it allows: ``PXN_MAX_CONNS_PER_ADDR`` on the peer) or "pending" (the listener closed it while it
    authenticated: the oldest waiting connection goes when ``PXN_MAX_PENDING_PER_ADDR`` from one address or
    ``PXN_MAX_PENDING`` in all are waiting, or the handshake took longer than ``PXN_HANDSHAKE_TIMEOUT``). The
    message names the variable to raise on the peer."""

    def __init__(self, message: str, cap: str):
        super().__init__(message)
        self.cap = cap


class InsecureConfig(ConfigError):
    """A listener would run without a shared secret where that is not allowed, or the secret given is unusable
    (too short, an empty one over a set ``PXN_SECRET``). The message names the setting."""


# --- engine level -------------------------------------------------------------------------------------------
class TransferError(PxnError):
    """A batch transfer failed. ``causes`` lists per-rail causes when several rails failed."""

    def __init__(self, message, causes=None):
        super().__init__(message)
        self.causes = list(causes or [])


class InvalidTransfer(TransferError, ValueError):
    """The batch itself is malformed (bad address, length, unregistered memory, destination outside the
    regions the peer advertised). Nothing of the batch was written."""


class AddressNotRegistered(InvalidTransfer):
    """A piece's source or destination is not inside a region registered (or advertised by the peer), or its
    region was deregistered while the batch ran. Mooncake's ``ERR_ADDRESS_NOT_REGISTERED``."""


class RegionOverlap(InvalidTransfer):
    """A range to register overlaps a region already registered. Mooncake's ``ERR_ADDRESS_OVERLAPPED``."""


class UnknownSession(InvalidTransfer, UnknownPeer):
    """The session id is malformed or nobody answers at it (no engine listens there). Nothing was written."""


class TransferTimeout(TransferError, TimeoutError):
    """The batch did not complete within its timeout."""


class RemoteRejected(TransferError):
    """The receiver refused a chunk (failed validation); nothing of that chunk was written."""


class PeerGone(PeerLost, TransferError):
    """A connected peer is dead (every rail endpoint died, or nobody answers at its session any more) or replaced
    (a different engine answers there). What a batch, a read or a region refresh to it raises on every fabric,
    and the Mooncake API's ``ERR_ENDPOINT``. ``peer`` is the engine's record of it (None once forgotten: the
    engine forgets a dead peer, and the next call to its session handshakes again); ``causes`` the per-rail
    causes where several rails died."""

    def __init__(self, message: str, peer=None, cause: Optional[BaseException] = None, causes=None):
        TransferError.__init__(self, message, causes if causes is not None else [cause] if cause else [])
        self.peer = peer
        self.cause = cause


# --- integration ---------------------------------------------------------------------------------------------
class MetadataRequestRefused(PxnError):
    """The metadata server refuses an HTTP request: ``status`` is the HTTP status to answer, ``text`` the reason
    sent in the body."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status
        self.text = text


class SegmentNameTaken(UnknownPeer):
    """A metadata server holds the segment name for another engine that is alive (its entry names a session
    where an engine answers). ``holder`` is that engine's entry (``session``, ``engine_id``, ``fabric``); the
    message names it, the server and how to proceed (a name of its own, or taking the name over)."""

    def __init__(self, message: str, holder: Optional[dict] = None):
        super().__init__(message)
        self.holder = dict(holder or {})


class MetadataUnavailable(UnknownPeer):
    """The metadata server (etcd) cannot serve a request. ``kind`` says what happened: "unreachable" (nothing
    accepts a connection at the endpoint), "timed out" (no answer in time: a stopped or overloaded server) or
    "refused" (it answered with an error); the message names the endpoint(s), the request and the cause."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class PxnFeatureUnavailable(PxnError, RuntimeError):
    """An sglang feature other than KV disaggregation asked for sglang's shared Mooncake engine while Mooncake is
    not installed: pxn serves only the KV transfer of prefill / decode disaggregation."""
