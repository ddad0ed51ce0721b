"""DeepSpeed's `checkpoint` block: its `writer` (FastPersist) chooses how checkpoint files are
written. `type` "fast" writes them through the async-I/O op (megatron/checkpoint/aio_writer.py) with
the `aio` block's handle settings and `io_buffer_size` bytes of staging buffers (two with
`io_buffer_double`); "python", the default without a writer, through buffered file writes.
`decoupled` writes them in the background, as `--async-save` does."""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from megatron.runtime.config.deepspeed_keys import CheckpointKeys, CheckpointWriterKeys
from megatron.runtime.config.schema_types import PositiveCount


def _lowercase(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value  # DeepSpeed reads FAST, fast or Fast alike


class CheckpointWriterConfig(CheckpointWriterKeys):
    type: Annotated[Literal["fast", "python", "mock"], BeforeValidator(_lowercase)] = "fast"  # DeepSpeed's default
    io_buffer_size: PositiveCount = 64 << 20
    io_buffer_double: bool = True
    decoupled: bool = False


class CheckpointConfig(CheckpointKeys):
    writer: CheckpointWriterConfig | None = None  # None: buffered writes, DeepSpeed's without a writer

    @property
    def fast_writer(self) -> bool:
        return self.writer is not None and self.writer.type == "fast"

    @property
    def decoupled(self) -> bool:
        return self.writer is not None and self.writer.decoupled
