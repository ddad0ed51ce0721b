"""Optimizer state in swap files on NVMe, moved by the async-I/O op (ZeRO-Infinity)."""
