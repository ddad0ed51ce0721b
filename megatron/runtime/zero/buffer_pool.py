"""Freed stage-3 gather buffers, kept for the next gather of the same size.

On the CPU a fresh tensor of tens of MiB pays a page fault for every 4 KiB each time it is made
(64 MiB: 24 ms here, against 8 ms to copy it), and stage 3 makes one per bucket per gather. A
buffer goes back to the pool only when nothing else views it any more (torch's storage use count;
where torch lacks that function nothing is pooled), and at most `per_size` buffers of one size
wait, so the pool holds about one working set. CUDA has its caching allocator for this.
"""

import torch

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    def __init__(self, per_size: int = 2) -> None:
        self.per_size = per_size
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of `numel` elements, uninitialised: a freed one if one waits, else a new one."""
        waiting = self.free.get((numel, dtype)) if device.type == "cpu" else None
        return waiting.pop() if waiting else torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep a buffer its user is done with, unless some other tensor still views it."""
        if buffer.device.type != "cpu" or _storage_use_count is None:
            return
        if _storage_use_count(buffer.untyped_storage()._cdata) > 2:  # the buffer and this lookup
            return
        waiting = self.free.setdefault((buffer.numel(), buffer.dtype), [])
        if len(waiting) < self.per_size:
            waiting.append(buffer)
