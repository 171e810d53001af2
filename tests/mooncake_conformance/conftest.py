# A package, so this conftest imports as mooncake_conformance.conftest and never shadows tests/conftest.py.
# Mooncake's vendored scripts are run as separate processes by test_conformance.py, never imported by pytest
# (the initiator's name matches pytest's *_test.py pattern).
collect_ignore = ["transfer_engine_target.py", "transfer_engine_initiator_test.py", "pxn_shim"]
