"""``mooncake.engine`` for the conformance suite: pxn's ``integration.mooncake`` under Mooncake's module name."""
from integration.mooncake import Read, TransferEngine, TransferNotify, TransferOpcode, Write  # noqa: F401
