"""ZeRO stage 3: gather parameters just before they are used, free them after.

Every module that owns partitioned parameters gets a `_parameters` dict that gathers a parameter's
bucket when the parameter is read through the module (`self.weight`), wherever that read happens,
so a weight tied into another module's forward is gathered too without telling anyone. The bucket
is claimed by the innermost module whose forward is running and freed when that forward returns.
Backward needs the parameters again: the outputs of each module that read partitioned parameters
pass through an autograd function whose backward gathers them first; they are freed as soon as
backward has finished their gradients (the reducer says so). The order of gathers in the first
forward and backward is recorded; afterwards each gather starts the next ones in that order in
the background (`stage3_prefetch_bucket_size` elements in flight, `stage3_max_live_parameters`
gathered at most). Buckets of at most `stage3_param_persistence_threshold` elements stay gathered.
Autograd would keep a freed bucket's memory alive through what ops save for backward (F.linear
saves `weight.t()`, a view of the gathered buffer): during forward, `saving_views()` makes autograd
save such a view as (bucket, shape, strides, offset) instead, and gathers the bucket again to
rebuild it when backward needs it, as DeepSpeed's stage-3 linear saves the parameter, not its data.
With NVMe parameter offload a swapped chunk is read through one of `offload_param.buffer_count`
buffers before it is gathered: a prefetch waits for a free buffer, and a gather that needs one now
finishes the oldest gather in flight to get it. The buckets' residency and the gatherer's phase
are the state machines of megatron/runtime/zero/residency.py.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from megatron.runtime.config.schema import ZeroConfig
from megatron.runtime.zero.layout import Bucket, PartitionLayout
from megatron.runtime.zero.param_partition import ParamPartition
from megatron.runtime.zero.residency import BucketEvent, GathererPhase, Residency, ResidencyLedger, StepEvent
from megatron.timers import timed


@dataclass(frozen=True, eq=False)
class _SavedView:
    """A tensor autograd saved that views a gathered bucket, kept without its memory."""

    unit: "_Unit"
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Frame:
    """One running module forward: the buckets it read, and those it will free on return."""

    used: list["_Unit"] = field(default_factory=list)
    claimed: list["_Unit"] = field(default_factory=list)


@dataclass(eq=False)
class _Unit:
    part: ParamPartition
    bucket: Bucket
    persistent: bool
    pending: Any = None
    owner: _Frame | None = None

    @property
    def numel(self) -> int:
        return self.bucket.chunk * self.part.size


class _GatheringParameters(dict):
    """A module's `_parameters`: reading a partitioned parameter gathers it first."""

    def __init__(self, parameters: dict[str, nn.Parameter | None], gatherer: "ParameterGatherer") -> None:
        super().__init__(parameters)
        self.gatherer = gatherer

    def __getitem__(self, name: str) -> nn.Parameter | None:
        param = super().__getitem__(name)
        self.gatherer.use(param)
        return param


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward gathers the module's parameters."""

    @staticmethod
    def forward(
        ctx: Any, gatherer: "ParameterGatherer", units: list[_Unit], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.gatherer, ctx.units = gatherer, units
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        for unit in ctx.units:
            ctx.gatherer.ensure(unit)
        return (None, None, *grads)


class ParameterGatherer:
    def __init__(self, module: nn.Module, partitions: list[ParamPartition], config: ZeroConfig) -> None:
        self.prefetch_numel = config.stage3_prefetch_bucket_size
        self.max_live_numel = config.stage3_max_live_parameters
        self.units: list[_Unit] = []
        self.unit_of: dict[nn.Parameter, _Unit] = {}
        self.ledger = ResidencyLedger()
        for part in partitions:
            for bucket in part.buckets:
                unit = _Unit(part, bucket, persistent=bucket.numel <= config.stage3_param_persistence_threshold)
                self.units.append(unit)
                self.ledger.add(unit, unit.numel)
                self.unit_of.update({part.params[i]: unit for i in bucket.params})
        self.unit_of_storage: dict[int, _Unit] = {}  # live buckets by their buffer's address
        self.phase = GathererPhase()
        self.frames: list[_Frame] = []
        self.trace: list[_Unit] = []
        self.positions: dict[int, list[int]] = {}
        self.cursor = 0
        for child in module.modules():
            if any(p in self.unit_of for p in child._parameters.values()):
                child._parameters = _GatheringParameters(child._parameters, self)
            child.register_forward_pre_hook(self._enter)
            child.register_forward_hook(self._exit)
        self.end_step()

    def use(self, param: nn.Parameter | None) -> None:
        """A module read `param`: gather its bucket, and note who uses it and who frees it."""
        unit = self.unit_of.get(param) if param is not None else None
        if unit is None:
            return
        self.ensure(unit)
        if self.frames:
            frame = self.frames[-1]
            if unit not in frame.used:
                frame.used.append(unit)
            if not self.phase.in_backward and not unit.persistent and unit.owner is None:
                unit.owner = frame
                frame.claimed.append(unit)

    def ensure(self, unit: _Unit) -> None:
        """Make a bucket's parameters usable, waiting for it if it is on its way."""
        self._gather_now(unit)
        self._follow_trace(unit)

    def state(self, unit: _Unit) -> Residency:
        return self.ledger.state[unit]

    @property
    def peak_live_numel(self) -> int:
        return self.ledger.peak_live_numel

    def _gather_now(self, unit: _Unit) -> None:
        with timed("params-all-gather"):  # the time the compute waits for its parameters
            if self.state(unit) is Residency.FREE:
                self._start(unit, async_op=False)
            if self.state(unit) is Residency.GATHERING:
                self._finish(unit)

    def _start(self, unit: _Unit, async_op: bool) -> None:
        while not unit.part.ready_to_gather(unit.bucket):
            self._finish(self.ledger.gathering[0])
        unit.pending = unit.part.gather_bucket(unit.bucket, async_op)
        self.ledger.record(unit, BucketEvent.GATHER_STARTED)

    def _finish(self, unit: _Unit) -> None:
        work, attach = unit.pending
        if work is not None:
            work.wait()
        attach()
        unit.pending = None
        self.ledger.record(unit, BucketEvent.GATHER_FINISHED)
        self.unit_of_storage[self._storage(unit)] = unit

    def _release(self, unit: _Unit) -> None:
        if self.state(unit) is Residency.GATHERING:  # a collective must complete before its buffer goes
            self._finish(unit)
        if self.state(unit) is Residency.LIVE:
            del self.unit_of_storage[self._storage(unit)]
            unit.part.release_bucket(unit.bucket)
            self.ledger.record(unit, BucketEvent.RELEASED)
        unit.owner = None

    @staticmethod
    def _storage(unit: _Unit) -> int:
        """The address of the buffer a live bucket's parameters view."""
        return unit.part.gathered[unit.bucket].data_ptr()

    def saving_views(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The forward context in which saved views of gathered buckets do not hold their memory."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _SavedView:
        if isinstance(tensor, nn.Parameter) or tensor.layout != torch.strided:
            return tensor  # a parameter itself gets its data back before its module's backward
        unit = self.unit_of_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None or unit.persistent:
            return tensor
        return _SavedView(unit, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved: torch.Tensor | _SavedView) -> torch.Tensor:
        if not isinstance(saved, _SavedView):
            return saved
        self._gather_now(saved.unit)  # usually live already: its module's backward gathered it
        return saved.unit.part.gathered[saved.unit.bucket].as_strided(saved.size, saved.stride, saved.offset)

    def _follow_trace(self, unit: _Unit) -> None:
        """Record the order of use in the first step; later, start gathering what comes next."""
        if self.phase.recording:
            self.trace.append(unit)
            return
        positions = self.positions.get(id(unit))
        if not positions:
            return
        here = next((p for p in positions if p >= self.cursor), positions[0])
        self.cursor = here + 1
        ledger = self.ledger
        for upcoming in self.trace[here + 1 :]:
            if ledger.inflight_numel >= self.prefetch_numel:
                break
            if self.state(upcoming) is not Residency.FREE:
                continue
            if ledger.live_numel + upcoming.numel > self.max_live_numel or not upcoming.part.ready_to_gather(
                upcoming.bucket
            ):
                break
            self._start(upcoming, async_op=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.frames.append(_Frame())

    def _exit(self, module: nn.Module, args: Any, output: Any) -> Any:
        frame = self.frames.pop()
        if not self.phase.in_backward:
            for unit in frame.claimed:
                if unit.owner is frame:
                    self._release(unit)
        if not self.frames and not torch.is_grad_enabled():  # no backward follows: drop prefetches
            self._release_all()
        if not frame.used or not torch.is_grad_enabled():
            return output
        leaves, spec = pytree.tree_flatten(output)
        slots = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
        if not slots:
            return output
        wrapped = _GatherBeforeBackward.apply(self, frame.used, *(leaves[i] for i in slots))
        for i, tensor in zip(slots, wrapped):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def bucket_done(self, part: PartitionLayout, bucket: Bucket) -> None:
        """Backward has finished this bucket's gradients: its parameters are not needed again."""
        unit = self.unit_of[part.params[bucket.params[0]]]
        if not unit.persistent:
            self._release(unit)

    def _release_all(self) -> None:
        for unit in self.units:
            if not unit.persistent:
                self._release(unit)

    def before_backward(self) -> None:
        self.phase.record(StepEvent.BACKWARD_STARTED)

    def after_backward(self) -> None:
        """Free what backward left gathered; the first backward ends the recorded trace."""
        self._release_all()
        if self.phase.record(StepEvent.BACKWARD_FINISHED):
            for position, unit in enumerate(self.trace):
                self.positions.setdefault(id(unit), []).append(position)
        self.cursor = 0

    def end_step(self) -> None:
        """The shards changed: free everything and gather the persistent buckets afresh."""
        for unit in self.units:
            self._release(unit)
        for unit in self.units:
            if unit.persistent:
                self._gather_now(unit)
        self.frames.clear()  # a forward that raised never popped its frame
        self.cursor = 0

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """All parameters whole for the duration (checkpoints), freed afterwards."""
        for unit in self.units:
            self._gather_now(unit)
        try:
            yield
        finally:
            self._release_all()
