"""Where a ZeRO-3 fp32 master shard keeps its values (ZeRO-Infinity's parameter offload).

A `ShardStore` holds elements [0, resident) of one partition's shard in host memory and the rest
in a swap file, element i at byte 4 * (i - resident + 1024): the first 4 KiB block stays unused,
because the aio op takes a write at offset 0 as a new file and cuts it there. `resident` comes from the rank's budget
`offload_param.max_in_cpu`, spent on the partitions in the order they are made (the same on every
rank of a group, so every rank swaps the same buckets) and rounded down to whole 4 KiB blocks, so
that every transfer starts on an aligned file offset. Without a swapper (no NVMe offload) the
whole shard is resident.

A piece [lo, hi) is read into a locked buffer laid out from align_down(lo), so that the file part
lands on an aligned buffer address too. The `ParamSwapper` of a rank owns the folder and the
`buffer_count` buffers that gathers read through, made on first use at the size of the largest
piece any store reads.
"""

from collections.abc import Iterable

import torch
from torch import nn

from megatron.errors import ConfigError
from megatron.runtime.config.schema import AioConfig, OffloadParamConfig
from megatron.runtime.swap.folder import SwapFolder
from megatron.runtime.swap.slots import ALIGN, IoSlot, SwapFile, align_down, align_up

WHAT = "parameter partitions"


def window_numel(lo: int, hi: int) -> int:
    """Elements of the aligned window that holds [lo, hi)."""
    return align_up(hi) - align_down(lo)


class ParamSwapper:
    """One rank's parameter swapping: host-memory budget, swap folder and read buffers."""

    def __init__(self, offload: OffloadParamConfig, aio: AioConfig, rank: int) -> None:
        self.offload, self.aio, self.rank = offload, aio, rank
        self.budget = offload.max_in_cpu
        self.folder: SwapFolder | None = None
        self.files = 0
        self.slot_numel = 0
        self.slots: list[IoSlot] = []
        self.free: list[IoSlot] = []
        self.resident_numel = self.swapped_numel = 0

    def take_resident(self, numel: int) -> int:
        """How many leading elements of a shard of `numel` stay in host memory."""
        keep = numel if numel <= self.budget else align_down(self.budget)
        self.budget -= keep
        self.resident_numel += keep
        self.swapped_numel += numel - keep
        return keep

    def new_file(self, numel: int) -> SwapFile:
        """A swap file of `numel` fp32 elements that reads as zeros until written."""
        if self.folder is None:
            self.folder = SwapFolder(self.offload.nvme_path, self.rank, "offload_param")
        self.folder.check_space(4 * numel, WHAT)
        swap_file = self.folder.file(f"params{self.files}.swp", 4 * numel, WHAT)
        self.files += 1
        with open(swap_file.path, "wb") as file:
            file.truncate(4 * numel)
        return swap_file

    def need_window(self, numel: int) -> None:
        """A store will read pieces of up to `numel` elements through the buffers."""
        if numel > self.offload.buffer_size:
            raise ConfigError(
                f"offload_param.buffer_size {self.offload.buffer_size:,} is smaller than a parameter piece this rank "
                f"reads ({numel:,} elements); set buffer_size to at least {numel:,}"
            )
        if numel > self.slot_numel:  # buffers made for smaller pieces are made again on the next claim
            self.slot_numel = numel
            self.slots, self.free = [], []

    def has_free_slot(self) -> bool:
        return bool(self.free) or not self.slots

    def claim(self) -> IoSlot:
        """A free buffer; the caller makes sure one is (has_free_slot), by finishing reads in flight."""
        if not self.slots:
            self.slots = [IoSlot(self.aio, self.slot_numel) for _ in range(self.offload.buffer_count)]
            self.free = list(self.slots)
        if not self.free:
            raise RuntimeError("every parameter swap buffer is in use; finish a read before starting another")
        return self.free.pop()

    def release(self, slot: IoSlot) -> None:
        self.free.append(slot)

    def summary(self) -> str:
        where = self.folder.path if self.folder is not None else "(none needed)"
        return (
            f" > offload_param: {self.swapped_numel:,} master elements of rank {self.rank} in swap files under "
            f"{where}, {self.resident_numel:,} in host memory (max_in_cpu {self.offload.max_in_cpu:,})"
        )


class ShardStore:
    def __init__(
        self,
        numel: int,
        device: torch.device,
        swapper: ParamSwapper | None,
        pieces: Iterable[tuple[int, int]],
    ) -> None:
        """A zeroed master of `numel` elements; `pieces` are the [lo, hi) ranges gathers will read."""
        self.numel, self.swapper = numel, swapper
        self.resident = numel if swapper is None else swapper.take_resident(numel)
        self.memory = torch.zeros(self.resident, dtype=torch.float32, device=device)
        swapped = swapper is not None and self.resident < numel
        self.file = swapper.new_file(ALIGN + align_up(numel) - self.resident) if swapped else None
        if self.file is not None:
            for lo, hi in pieces:
                if hi > self.resident:
                    swapper.need_window(window_numel(lo, hi))

    @property
    def swapped(self) -> bool:
        return self.file is not None

    def parameter(self) -> nn.Parameter:
        """What the optimizer holds: the master itself, or, when part of it is in a file, a
        stand-in of its shape that holds no values (SwappedAdam reads and writes them here)."""
        if not self.swapped:
            return nn.Parameter(self.memory)
        return nn.Parameter(self.memory.new_zeros(1).expand(self.numel))

    def in_memory(self, lo: int, hi: int) -> bool:
        return hi <= self.resident

    def byte_offset(self, lo: int) -> int:
        """Where swapped element `lo` (>= resident) starts in the file."""
        return 4 * (ALIGN + lo - self.resident)

    def _file_part(self, lo: int, hi: int, slot: IoSlot) -> tuple[torch.Tensor, int]:
        """The buffer's room for the file's whole blocks under [lo, hi) (the buffer laid out from
        align_down(lo)), and their byte offset in the file."""
        base = align_down(lo)
        file_lo = max(base, self.resident)
        return slot.buffer[file_lo - base : align_up(hi) - base], self.byte_offset(file_lo)

    def start_read(self, lo: int, hi: int, slot: IoSlot) -> torch.Tensor:
        """Start bringing [lo, hi) into `slot`; returns the view that holds them once the slot's
        read has finished."""
        base = align_down(lo)
        if lo < self.resident:
            slot.buffer[lo - base : self.resident - base] = self.memory[lo:]
        blocks, byte_offset = self._file_part(lo, hi, slot)
        slot.start_read(blocks, self.file, byte_offset)
        return slot.buffer[lo - base : hi - base]

    @torch.no_grad()
    def write(self, lo: int, values: torch.Tensor) -> None:
        """Store `values` at [lo, lo + numel); the file part is read first so that the rest of its
        edge blocks survive."""
        hi = lo + values.numel()
        split = min(hi, self.resident)
        if lo < split:
            self.memory[lo:split] = values[: split - lo]
        if hi <= self.resident:
            return
        slot = self.swapper.claim()
        try:
            window = self.start_read(lo, hi, slot)
            slot.finish_read()
            window.copy_(values)
            blocks, byte_offset = self._file_part(lo, hi, slot)
            slot.start_write(blocks, self.file, byte_offset)
            slot.finish_write()
        finally:
            self.swapper.release(slot)
