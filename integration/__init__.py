"""Mooncake-compatible TransferEngine API and the sglang adapter."""
