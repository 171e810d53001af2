"""Exceptions of pxn's kernel layer, and ``PxnError``, the root of every pxn exception.

They live on the lowest floor so that the kernels raise them without importing the transport layer;
``transport.errors`` re-exports them with the rest of the vocabulary.
"""
from typing import Optional


class PxnError(Exception):
    """Root of every pxn exception."""


class ChunkFormatError(PxnError, ValueError):
    """A relay chunk's header or item table is malformed (bad magic, version, count, offset, checksum...)."""


class ChunkAuthError(ChunkFormatError):
    """A relay chunk's header and item table do not carry a good MAC under its sender's chunk key: changed on the
    way, or written by someone else. The receiver fails the rail it came on, as for a frame with a wrong tag."""


class CudaDriverError(PxnError, RuntimeError):
    """A libcuda call returned an error: ``call`` (the driver function), ``code`` (its CUresult) and ``name``
    (the driver's name for the code, None when it has none)."""

    def __init__(self, message: str, call: str = "", code: int = 0, name: Optional[str] = None):
        super().__init__(message)
        self.call, self.code, self.name = call, code, name


class PeerAccessError(PxnError, RuntimeError):
    """Two GPUs cannot reach each other's memory directly (no peer access); the message names both."""

    def __init__(self, device: int, peer: int, why: str = "cudaDeviceCanAccessPeer is 0"):
        super().__init__(f"GPU {device} cannot access GPU {peer}'s memory directly ({why}); use a staged copy or a "
                         f"route that does not need this pair")
        self.device = device
        self.peer = peer
