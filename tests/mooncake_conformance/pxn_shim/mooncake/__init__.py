"""A stand-in ``mooncake`` package whose ``mooncake.engine`` is pxn's Mooncake-compatible API, so Mooncake's own
tests run unchanged against pxn. Put this directory (``pxn_shim``) first on ``PYTHONPATH``; test use only."""
