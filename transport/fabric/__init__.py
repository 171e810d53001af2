"""Fabrics: one verbs-shaped interface (``base.Fabric``), three implementations (tcp, ipc, verbs).

``make_fabric(name, hostname="127.0.0.1", **options)`` builds one by name; implementations are imported lazily
so that importing this package never needs pyverbs or CUDA.
"""
from transport.fabric.base import (  # noqa: F401
    DEVICE_HOST, Capabilities, Completion, Endpoint, Fabric, MemoryRegion, Opcode, RemoteRegion, WriteRequest,
)

__all__ = ["DEVICE_HOST", "Capabilities", "Completion", "Endpoint", "Fabric", "MemoryRegion", "Opcode", "RemoteRegion",
           "WriteRequest", "FABRICS", "fabric_class", "make_fabric"]

FABRICS = ("tcp", "ipc", "verbs")


def fabric_class(name: str):
    """The implementation class of fabric ``name`` (imported on demand). ``ValueError`` for an unknown name."""
    if name == "tcp":
        from transport.fabric.tcp import TcpFabric
        return TcpFabric
    if name == "ipc":
        from transport.fabric.ipc import IpcFabric
        return IpcFabric
    if name == "verbs":
        from transport.fabric.verbs import VerbsFabric
        return VerbsFabric
    raise ValueError(f"unknown fabric {name!r}; expected one of {FABRICS}")


def make_fabric(name: str, hostname: str = "127.0.0.1", **options) -> Fabric:
    """Build the fabric called ``name`` ("tcp" | "ipc" | "verbs") bound to ``hostname``.

    ``options`` go to the implementation: tcp/ipc take ``port``, ``connections_per_peer``, ``message_bytes``,
    ``connect_timeout`` (s), ``keepalive`` (s); verbs takes ``device`` (RDMA device name), ``port_num``, ``gid_index``,
    ``port`` (TCP port of its connection-exchange listener), ``max_send_wr``, ``max_recv_wr``.
    Raises ``ValueError`` for an unknown name and ``FabricUnavailable`` when the fabric cannot run here.
    """
    return fabric_class(name)(hostname=hostname, **options)
