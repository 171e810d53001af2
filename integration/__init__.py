"""Mooncake-compatible TransferEngine API and the sglang adapter.

* ``integration.mooncake.TransferEngine``: Mooncake's ``mooncake.engine.TransferEngine`` Python API (0 / negative
  int returns, codes in ``integration.mooncake``) over pxn's ``transport.TransferEngine``.
* ``integration.sglang.PxnMooncakeTransferEngine``: the surface of sglang's ``MooncakeTransferEngine`` wrapper;
  ``register_sglang_plugin`` is the ``sglang.srt.plugins`` entry point. See docs/README-integration.md.
"""
from integration.mooncake import TransferEngine, TransferOpcode, error_code, error_name  # noqa: F401
from integration.sglang import PxnMooncakeTransferEngine, register_sglang_plugin  # noqa: F401

MooncakeTransferEngine = TransferEngine  # an unambiguous name next to transport.TransferEngine

__all__ = ["TransferEngine", "MooncakeTransferEngine", "TransferOpcode", "error_code", "error_name",
           "PxnMooncakeTransferEngine", "register_sglang_plugin"]
