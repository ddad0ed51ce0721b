"""What each ZeRO stage does around forward, backward and the optimizer step.

Stage 1 partitions the fp32 master weights and optimizer state; as DeepSpeed's does, it reduces
the gradients bucket by bucket during the backward of the last micro-batch of an accumulation, as
buckets fill (in the background with `overlap_comm`), and keeps the whole gradients for
accumulation. Stage 2 partitions the gradients too: every backward reduce-scatters each bucket as
soon as it is complete and frees it. Stage 3 partitions the parameters as well, gathering them per
module (megatron/runtime/zero/gatherer.py).
Dense parameters are partitioned over the data-parallel group, experts over their
expert-data-parallel group; a group of one rank needs no gathering, so its parameters stay whole,
unless NVMe parameter offload moves their master into swap files (then stage 3 frees them between
uses on one rank too).
"""

import itertools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron.checkpoint.tensors import ShardedReader
from megatron.parallel import all_reduce
from megatron.placement import COPY, SLICE, WHOLE, expert_ids, gradient_kind, tensor_parallel_split
from megatron.runtime.config.schema import AioConfig, ZeroConfig
from megatron.runtime.swap.param_store import ParamSwapper, ShardStore
from megatron.runtime.zero.checkpoint import load_partition_state, partition_state_entries
from megatron.runtime.zero.gatherer import ParameterGatherer
from megatron.runtime.zero.layout import PartitionLayout, buckets_by_size
from megatron.runtime.zero.param_partition import ParamPartition
from megatron.runtime.zero.partition import FlatPartition
from megatron.runtime.zero.reducer import BucketReducer
from megatron.timers import timed


def buckets_by_module(params: list[nn.Parameter], owner: dict[nn.Parameter, nn.Module]) -> list[list[int]]:
    """Runs of consecutive parameters owned by one module: what stage 3 gathers at once."""
    buckets: list[list[int]] = []
    for index, param in enumerate(params):
        if not buckets or owner[param] is not owner[params[buckets[-1][-1]]]:
            buckets.append([])
        buckets[-1].append(index)
    return buckets


class ZeroRuntime:
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        dense_group: dist.ProcessGroup | None,
        expert_group: dist.ProcessGroup | None,
        aio: AioConfig,
        rank: int,
        tp_rank: int = 0,
        expert_tp_rank: int = 0,
        reduce_in_backward: bool = True,
    ) -> None:
        """Partition each optimizer group's dense and expert parameters, and point the optimizer
        at the shards instead. The optimizer object and its groups stay the same (an LR schedule
        already holds them); each group now holds one shard per class."""
        self.stage = config.stage
        self.tp_rank, self.expert_tp_rank = tp_rank, expert_tp_rank
        # False: stage 1 reduces at the step instead, after the engine summed the gradients of
        # parameters shared between pipeline stages
        self.reduce_in_backward = reduce_in_backward
        self.optimizer = optimizer
        self.dense_group, self.expert_group = dense_group, expert_group
        offload_param = config.offload_param
        self.swapper = (
            ParamSwapper(offload_param, aio, rank) if self.stage == 3 and offload_param.device == "nvme" else None
        )
        names = {p: n for n, p in module.named_parameters()}
        owner: dict[nn.Parameter, nn.Module] = {}  # a tied parameter belongs to its first module
        for child in module.modules():
            for param in child._parameters.values():
                if param is not None:
                    owner.setdefault(param, child)
        self.partitions: list[PartitionLayout] = []
        for group in optimizer.param_groups:
            shards = []
            # one partition per class, so that a shard's gradients are all of one kind for the norm
            for (is_expert, comm), kind in itertools.product(
                ((False, dense_group), (True, expert_group)), (WHOLE, SLICE, COPY)
            ):
                params = [
                    p for p in group["params"] if (expert_ids(p) is not None) == is_expert and gradient_kind(p) == kind
                ]
                if not params:
                    continue
                param_names = [names[p] for p in params]
                grouped = comm is not None and dist.get_world_size(comm) > 1
                if self.stage == 3 and (grouped or self.swapper is not None):
                    part: PartitionLayout = ParamPartition(
                        params, param_names, comm, buckets_by_module(params, owner), self.swapper
                    )
                else:
                    part = FlatPartition(
                        params,
                        param_names,
                        comm,
                        buckets_by_size([p.numel() for p in params], config.bucket_numel),
                        reduce_scatter=config.reduce_scatter,
                        partition_gradients=self.stage >= 2,
                    )
                self.partitions.append(part)
                shards.append(part.shard)
            group["params"] = shards
        optimizer.state.clear()
        position = {p: i for i, p in enumerate(module.parameters())}
        flat = [p for p in self.partitions if isinstance(p, FlatPartition)]
        partitioned = [p for p in self.partitions if isinstance(p, ParamPartition)]
        overlap = {"async_op": config.overlaps_communication, "max_inflight_numel": config.reduce_bucket_size}
        self.flat_reducer = BucketReducer(flat, position, **overlap) if flat else None
        self.gatherer = ParameterGatherer(module, partitioned, config) if partitioned else None
        self.param_reducer = (
            BucketReducer(partitioned, position, **overlap, on_ready=self.gatherer.bucket_done) if partitioned else None
        )
        if self.param_reducer is not None:
            self.param_reducer.armed = True
        if self.swapper is not None and rank == 0:
            print(self.swapper.summary(), flush=True)

    def swapped_stores(self) -> dict[torch.Tensor, ShardStore]:
        """The master shards whose values are partly in swap files, by the optimizer's tensor."""
        return {p.shard: p.store for p in self.partitions if isinstance(p, ParamPartition) and p.store.swapped}

    def before_backward(self, boundary: bool) -> None:
        """Stage 1 reduces during the backward that ends an accumulation; stages 2 and 3 during every one."""
        if self.flat_reducer is not None:
            self.flat_reducer.armed = (boundary and self.reduce_in_backward) or self.stage >= 2
        if self.gatherer is not None:
            self.gatherer.before_backward()

    def after_backward(self) -> None:
        if self.flat_reducer is not None and self.stage >= 2:
            self.flat_reducer.flush()
        if self.param_reducer is not None:
            self.param_reducer.flush()
            self.gatherer.after_backward()

    def reduce_gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Finish every bucket's reduction; return this rank's (dense, expert) gradient shards."""
        if self.flat_reducer is not None and self.stage == 1:  # stages 2 and 3 reduced after backward
            self.flat_reducer.armed = False
            self.flat_reducer.flush()
        return (
            [p.shard.grad for p in self.partitions if not p.is_expert],
            [p.shard.grad for p in self.partitions if p.is_expert],
        )

    def after_step(self) -> None:
        """Bring the updated shards back into the model's parameters."""
        with timed("params-all-gather"):
            for part in self.partitions:
                if isinstance(part, FlatPartition):
                    part.gather_parameters()
        if self.gatherer is not None:
            self.gatherer.end_step()

    def zero_gradients(self) -> None:
        for part in self.partitions:
            part.zero_gradients()

    def forward_context(self) -> Any:
        """Where the model's forward runs: stage 3 keeps autograd from holding freed parameters."""
        return self.gatherer.saving_views() if self.gatherer is not None else nullcontext()

    @contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Every parameter whole while the block runs (checkpoint save and load)."""
        if self.gatherer is None:
            yield
            return
        with self.gatherer.gathered():
            yield

    def copy_from_parameters(self) -> None:
        """Take the master shards from the model's (whole) parameters, after a load."""
        for part in self.partitions:
            part.copy_from_parameters()

    def gradient_kinds(self) -> tuple[list[str], list[str]]:
        kinds = {
            is_expert: [gradient_kind(p.params[0]) for p in self.partitions if p.is_expert == is_expert]
            for is_expert in (False, True)
        }
        return kinds[False], kinds[True]

    def sum_square_norms(self, dense_sq: torch.Tensor, expert_sq: torch.Tensor) -> None:
        """Each rank's shards are disjoint parts of the gradients: sum over the partitioning groups."""
        all_reduce(dense_sq, self.dense_group)
        all_reduce(expert_sq, self.expert_group)

    def optimizer_state(self, owns_dense: bool, owns_experts: bool) -> dict[str, torch.Tensor]:
        """Every rank owns a slice of the optimizer state, whatever it owns of the model; the state of
        parameters every (expert-)tensor-parallel rank holds whole is written by the first of them
        (experts are partitioned over their expert-data-parallel group, which spans the dense layers'
        tensor-parallel ranks but not the experts' own)."""
        written = [
            p
            for p in self.partitions
            if tensor_parallel_split(p.params[0]) is not None
            or (self.expert_tp_rank if p.is_expert else self.tp_rank) == 0
        ]
        return partition_state_entries(self.optimizer, written)

    def load_optimizer_state(self, reader: ShardedReader, saved_groups: list[dict[str, Any]]) -> None:
        load_partition_state(self.optimizer, self.partitions, reader, saved_groups)
