"""CPU Adam whose moments (exp_avg, exp_avg_sq) live in swap files on NVMe (ZeRO-Infinity's
optimizer offload). Each parameter (under ZeRO, a flat master shard) is cut into sub-groups of at
most `sub_group_size` elements; a sub-group's two moments are one file, `p<P>_s<S>.swp`. The step
walks the sub-groups in order through a ring of locked, aligned buffers: read the moments, run the
Adam kernel on them and the parameter's slice, write them back. With `pipeline_read` the read of
sub-group i+1 runs during the step of i; with `pipeline_write` the write of i-1 does too. Each
buffer has its own read and write handle, so waiting for one transfer never waits for another.

The arithmetic is CPUAdam's (bit-identical to torch's fused AdamW on the same tensors): sub-group
boundaries fall on multiples of 1024 elements, so the kernel's rounding of each tensor's last few
elements happens only where it happens for the whole tensor.
"""

from dataclasses import dataclass
from typing import Any

import torch

from megatron.errors import UserError
from megatron.ops.aio import aio_handle
from megatron.runtime.config import AioConfig, OffloadOptimizerConfig
from megatron.runtime.optim.cpu_adam import _TORCH_SCALAR_TAIL, CPUAdam
from megatron.runtime.swap.folder import SwapFolder

SUB_GROUP_ALIGN = 1024  # elements: 4 KiB of fp32, O_DIRECT's alignment


class SwapError(UserError):
    """Reading or writing swapped optimizer state failed (a disk error, a full disk)."""


def swap_failed(error: OSError) -> SwapError:
    return SwapError(f"swapping optimizer state failed ({error}); training stopped and the last checkpoint is "
                     "intact; check the swap disk and its free space")


@dataclass(frozen=True)
class SubGroup:
    param_index: int
    lo: int
    hi: int
    file: str


class _Slot:
    """One locked buffer with its own read and write handles."""

    def __init__(self, aio: AioConfig, numel: int) -> None:
        settings = aio.model_dump()
        self.reader, self.writer = aio_handle(**settings), aio_handle(**settings)
        self.buffer = self.reader.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float32))
        self.reading = self.writing = False

    def finish_read(self) -> None:
        if self.reading:
            self.reading = False
            self.reader.wait()

    def finish_write(self) -> None:
        if self.writing:
            self.writing = False
            self.writer.wait()


def buffers_needed(offload: OffloadOptimizerConfig) -> int:
    return 1 + offload.pipeline_read + offload.pipeline_write


class SwappedAdam(CPUAdam):
    def __init__(
        self, params: Any, offload: OffloadOptimizerConfig, aio: AioConfig, sub_group_size: int, rank: int,
        **adam: Any,
    ) -> None:
        super().__init__(params, **adam)
        needed = buffers_needed(offload)
        if offload.buffer_count < needed:
            raise UserError(
                f"offload_optimizer.buffer_count {offload.buffer_count} is too few for pipeline_read="
                f"{offload.pipeline_read} and pipeline_write={offload.pipeline_write}; set it to at least {needed}"
            )
        self.offload, self.aio, self.rank = offload, aio, rank
        self.sub_group_size = max(SUB_GROUP_ALIGN, sub_group_size // SUB_GROUP_ALIGN * SUB_GROUP_ALIGN)
        self.sub_groups: dict[torch.Tensor, list[SubGroup]] = {}
        self.written: set[str] = set()  # files that hold moments (fast_init: the others read as zeros)
        self.slots: list[_Slot] = []
        self.folder: SwapFolder | None = None

    def prepare(self) -> None:
        """Lay out the swap files for the parameters the groups hold now (ZeRO's shards): check the
        disk's free space, make the buffers, and unless fast_init write zeros to every file."""
        params = [p for group in self.param_groups for p in group["params"]]
        state_bytes = 2 * 4 * sum(p.numel() for p in params)
        self.folder = SwapFolder(self.offload.nvme_path, self.rank, state_bytes)
        for index, param in enumerate(params):
            self.sub_groups[param] = [
                SubGroup(index, lo, min(lo + self.sub_group_size, param.numel()), self.folder.file(f"p{index}_s{lo // self.sub_group_size}.swp"))
                for lo in range(0, param.numel(), self.sub_group_size)
            ]
        sub_groups = [g for groups in self.sub_groups.values() for g in groups]
        largest = max((g.hi - g.lo for g in sub_groups), default=1)
        # a ring longer than the sub-groups would hold locked memory that never gets used
        ring = max(1, min(self.offload.buffer_count, len(sub_groups)))
        self.slots = [_Slot(self.aio, 2 * largest) for _ in range(ring)]
        if not self.offload.fast_init:
            zeros = self.slots[0].buffer
            zeros.zero_()
            for sub_group in sub_groups:
                self._io(self.slots[0].writer.sync_pwrite, zeros[:2 * (sub_group.hi - sub_group.lo)], sub_group.file)
                self.written.add(sub_group.file)

    @staticmethod
    def _io(transfer: Any, tensor: torch.Tensor, path: str) -> None:
        try:
            transfer(tensor, path)
        except OSError as error:
            raise swap_failed(error) from None

    def _start_read(self, slot: _Slot, sub_group: SubGroup) -> None:
        slot.finish_write()  # the buffer may still be on its way out
        moments = slot.buffer[:2 * (sub_group.hi - sub_group.lo)]
        if sub_group.file in self.written:
            self._io(slot.reader.async_pread, moments, sub_group.file)
            slot.reading = True
        else:
            moments.zero_()

    def _finish(self, slot: _Slot, read: bool) -> None:
        try:
            slot.finish_read() if read else slot.finish_write()
        except OSError as error:
            raise swap_failed(error) from None

    @torch.no_grad()
    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        tasks: list[tuple[torch.Tensor, float, SubGroup]] = []
        for param in params:
            state = self.state[param]
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            state["step"] += 1
            tasks += [(param, float(state["step"]), g) for g in self.sub_groups[param]]
        beta1, beta2 = group["betas"]
        ring = len(self.slots)
        for i, (param, step, sub_group) in enumerate(tasks):
            slot = self.slots[i % ring]
            if i == 0 or not self.offload.pipeline_read:
                self._start_read(slot, sub_group)
            self._finish(slot, read=True)
            if self.offload.pipeline_read and i + 1 < len(tasks):
                self._start_read(self.slots[(i + 1) % ring], tasks[i + 1][2])
            numel = sub_group.hi - sub_group.lo
            element = param.element_size()
            self._extension.adam_step(
                [param.data_ptr() + sub_group.lo * element], [param.grad.data_ptr() + sub_group.lo * element],
                [slot.buffer.data_ptr()], [slot.buffer.data_ptr() + numel * element], [numel],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), step=step, bias_correction=bool(group["bias_correction"]),
                adamw_mode=bool(group["adamw_mode"]), num_threads=torch.get_num_threads(), tail_width=_TORCH_SCALAR_TAIL,
            )
            self._io(slot.writer.async_pwrite, slot.buffer[:2 * numel], sub_group.file)
            slot.writing = True
            self.written.add(sub_group.file)
            if not self.offload.pipeline_write:
                self._finish(slot, read=False)
        for slot in self.slots:
            self._finish(slot, read=False)

    def full_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter's state with its moments read back from the swap files (checkpoints)."""
        state = dict(self.state.get(param, {}))
        if "step" not in state:
            return state
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        slot = self.slots[0]
        for sub_group in self.sub_groups[param]:
            numel = sub_group.hi - sub_group.lo
            self._start_read(slot, sub_group)
            self._finish(slot, read=True)
            exp_avg[sub_group.lo:sub_group.hi] = slot.buffer[:numel]
            exp_avg_sq[sub_group.lo:sub_group.hi] = slot.buffer[numel:2 * numel]
        return {**state, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does, then move the moments out to the swap files."""
        super().load_state_dict(state_dict)
        slot = self.slots[0]
        for param, groups in self.sub_groups.items():
            state = self.state.get(param, {})
            if "exp_avg" not in state:
                continue
            exp_avg, exp_avg_sq = state.pop("exp_avg").reshape(-1), state.pop("exp_avg_sq").reshape(-1)
            for sub_group in groups:
                numel = sub_group.hi - sub_group.lo
                slot.finish_write()
                slot.buffer[:numel] = exp_avg[sub_group.lo:sub_group.hi]
                slot.buffer[numel:2 * numel] = exp_avg_sq[sub_group.lo:sub_group.hi]
                self._io(slot.writer.sync_pwrite, slot.buffer[:2 * numel], sub_group.file)
                self.written.add(sub_group.file)
