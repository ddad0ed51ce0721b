"""Native ops: the async-I/O handle (aio.py) and DeepNVMe-style builders (op_builder.py)."""
