"""pxn transport: topology, routing, fabrics, relay engine and receiver."""
from transport.errors import *  # noqa: F401,F403

__version__ = "0.1.0"  # setup.py reads it from here


def __getattr__(name):
    # The engine pulls in numpy, the fabrics and pxn_kernels; load it on first use so that ``import transport``
    # (e.g. for ``pxn topo``) stays light.
    if name in ("TransferEngine", "UnknownSession", "BatchHandle"):
        from transport import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'transport' has no attribute {name!r}")
