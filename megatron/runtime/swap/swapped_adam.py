"""CPU Adam whose moments (exp_avg, exp_avg_sq) live in swap files on NVMe (ZeRO-Infinity's
optimizer offload). Each parameter (under ZeRO, a flat master shard) is cut into sub-groups of at
most `sub_group_size` elements; a sub-group's two moments are one file, `p<P>_s<S>.swp`. The step
walks the sub-groups in order through a ring of locked, aligned buffers: read the moments, run the
Adam kernel on them and the parameter's slice, write them back. With `pipeline_read` the read of
sub-group i+1 starts as soon as i has landed and runs during i's checksum check (slots.SwapFile)
and step; with `pipeline_write` the write of i-1 does too. Each buffer has its own read and write
handle, so waiting for one transfer never waits for another.
With NVMe parameter offload the fp32 master of a ZeRO-3 shard is swapped too (a ShardStore): its
sub-groups are cut at the store's resident boundary, and a swapped sub-group's values travel
with its moments through the same buffer.

The arithmetic is CPUAdam's (bit-identical to torch's fused AdamW on the same tensors): sub-group
boundaries fall on multiples of 1024 elements, so the kernel's rounding of each tensor's last few
elements happens only where it happens for the whole tensor.
"""

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron.errors import UserError
from megatron.runtime.config.schema import AioConfig, OffloadOptimizerConfig
from megatron.runtime.optim.cpu_adam import _TORCH_SCALAR_TAIL, CPUAdam
from megatron.runtime.swap.folder import SwapFolder
from megatron.runtime.swap.param_store import ShardStore
from megatron.runtime.swap.slots import ALIGN, IoSlot, SwapFile, align_up

WHAT = "optimizer state"


@dataclass(frozen=True)
class SubGroup:
    param_index: int
    lo: int
    hi: int
    file: SwapFile  # the two moments
    store: ShardStore | None  # where the parameter's values live when a ZeRO-3 master is swapped

    @property
    def swapped(self) -> bool:
        """The parameter's values [lo, hi) are in the store's swap file."""
        return self.store is not None and self.lo >= self.store.resident


def buffers_needed(offload: OffloadOptimizerConfig) -> int:
    return 1 + offload.pipeline_read + offload.pipeline_write


class SwappedAdam(CPUAdam):
    def __init__(
        self,
        params: Any,
        offload: OffloadOptimizerConfig,
        aio: AioConfig,
        sub_group_size: int,
        rank: int,
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
        self.sub_group_size = max(ALIGN, sub_group_size // ALIGN * ALIGN)
        self.sub_groups: dict[torch.Tensor, list[SubGroup]] = {}
        self.written: set[SwapFile] = set()  # files that hold moments (fast_init: the others read as zeros)
        self.slots: list[IoSlot] = []
        self.values_at = 0  # where a swapped sub-group's parameter values sit in a buffer
        self.folder: SwapFolder | None = None

    def prepare(self, stores: dict[torch.Tensor, ShardStore]) -> None:
        """Lay out the swap files for the parameters the groups hold now (ZeRO's shards; `stores`
        are those whose values are partly swapped too): check the disk's free space, make the
        buffers, and unless fast_init write zeros to every file."""
        params = [p for group in self.param_groups for p in group["params"]]
        self.folder = SwapFolder(self.offload.nvme_path, self.rank, "offload_optimizer")
        self.folder.check_space(2 * 4 * sum(p.numel() for p in params), WHAT)
        for index, param in enumerate(params):
            store = stores.get(param)
            bounds = self._bounds(param.numel(), store.resident if store is not None else param.numel())
            self.sub_groups[param] = [
                SubGroup(index, lo, hi, self.folder.file(f"p{index}_s{number}.swp", 8 * (hi - lo), WHAT), store)
                for number, (lo, hi) in enumerate(itertools.pairwise(bounds))
            ]
        sub_groups = [g for groups in self.sub_groups.values() for g in groups]
        largest = align_up(max((g.hi - g.lo for g in sub_groups), default=1))
        self.values_at = 2 * largest
        # a ring longer than the sub-groups would hold locked memory that never gets used
        ring = max(1, min(self.offload.buffer_count, len(sub_groups)))
        size = 3 * largest if stores else 2 * largest
        self.slots = [IoSlot(self.aio, size) for _ in range(ring)]
        if not self.offload.fast_init:
            zeros = self.slots[0].buffer
            zeros.zero_()
            for sub_group in sub_groups:
                self.slots[0].write(zeros[: 2 * (sub_group.hi - sub_group.lo)], sub_group.file)
                self.written.add(sub_group.file)

    def _bounds(self, numel: int, resident: int) -> list[int]:
        """Sub-group boundaries: every sub_group_size elements, restarting at the resident boundary
        (a multiple of 1024 whenever it falls inside the tensor)."""
        cuts = [*range(0, resident, self.sub_group_size), *range(resident, numel, self.sub_group_size)]
        return [*cuts, numel]

    def _start_read(self, slot: IoSlot, sub_group: SubGroup) -> None:
        slot.finish_write()  # the buffer may still be on its way out
        moments = slot.buffer[: 2 * (sub_group.hi - sub_group.lo)]
        if sub_group.file in self.written:
            slot.start_read(moments, sub_group.file)
        else:
            moments.zero_()
        if sub_group.swapped:
            slot.start_read(
                self._values(slot, sub_group), sub_group.store.file, sub_group.store.byte_offset(sub_group.lo)
            )

    def _values(self, slot: IoSlot, sub_group: SubGroup) -> torch.Tensor:
        """The buffer's room for a swapped sub-group's parameter values, whole 4 KiB blocks."""
        return slot.buffer[self.values_at : self.values_at + align_up(sub_group.hi - sub_group.lo)]

    def _values_address(self, param: torch.Tensor, slot: IoSlot, sub_group: SubGroup) -> int:
        if sub_group.swapped:
            return slot.buffer.data_ptr() + 4 * self.values_at
        values = sub_group.store.memory if sub_group.store is not None else param
        return values.data_ptr() + sub_group.lo * values.element_size()

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
            read_next = None
            if self.offload.pipeline_read and i + 1 < len(tasks):
                read_next = partial(self._start_read, self.slots[(i + 1) % ring], tasks[i + 1][2])
            slot.finish_read(before_check=read_next)
            numel = sub_group.hi - sub_group.lo
            element = param.element_size()
            self._extension.adam_step(
                [self._values_address(param, slot, sub_group)],
                [param.grad.data_ptr() + sub_group.lo * element],
                [slot.buffer.data_ptr()],
                [slot.buffer.data_ptr() + numel * element],
                [numel],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=step,
                bias_correction=bool(group["bias_correction"]),
                adamw_mode=bool(group["adamw_mode"]),
                num_threads=torch.get_num_threads(),
                tail_width=_TORCH_SCALAR_TAIL,
            )
            slot.start_write(slot.buffer[: 2 * numel], sub_group.file)
            if sub_group.swapped:
                slot.start_write(
                    self._values(slot, sub_group), sub_group.store.file, sub_group.store.byte_offset(sub_group.lo)
                )
            self.written.add(sub_group.file)
            if not self.offload.pipeline_write:
                slot.finish_write()
        for slot in self.slots:
            slot.finish_write()

    def full_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameter's state with its moments read back from the swap files (checkpoints)."""
        state = dict(self.state.get(param, {}))
        if "step" not in state:
            return state
        exp_avg, exp_avg_sq = torch.zeros(param.shape), torch.zeros(param.shape)
        slot = self.slots[0]
        for sub_group in self.sub_groups[param]:
            numel = sub_group.hi - sub_group.lo
            slot.finish_write()
            if sub_group.file in self.written:
                slot.start_read(slot.buffer[: 2 * numel], sub_group.file)
                slot.finish_read()
                exp_avg[sub_group.lo : sub_group.hi] = slot.buffer[:numel]
                exp_avg_sq[sub_group.lo : sub_group.hi] = slot.buffer[numel : 2 * numel]
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
                slot.buffer[:numel] = exp_avg[sub_group.lo : sub_group.hi]
                slot.buffer[numel : 2 * numel] = exp_avg_sq[sub_group.lo : sub_group.hi]
                slot.write(slot.buffer[: 2 * numel], sub_group.file)
                self.written.add(sub_group.file)
