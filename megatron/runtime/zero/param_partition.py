"""ZeRO stage 3: parameters are partitioned too. Between uses a parameter holds no data (an empty
tensor); `gather_bucket` all-gathers a bucket's chunks from every rank into a fresh buffer and
makes the bucket's parameters views of it, `release_bucket` drops it again. Gradients are
reduce-scattered bucket by bucket as backward produces them and summed into this rank's fp32
`shard_grad`, so no rank ever holds a whole model's gradients either.

The fp32 master lives in a ShardStore: in host memory, or with NVMe parameter offload partly in a
swap file, in which case a gather first reads the chunk through one of the swapper's buffers.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron import comm
from megatron.runtime.swap.param_store import ParamSwapper, ShardStore
from megatron.runtime.swap.slots import IoSlot
from megatron.runtime.zero.buffer_pool import BufferPool
from megatron.runtime.zero.layout import Bucket, PartitionLayout
from megatron.runtime.zero.partition import Reduction


class _ReadWork:
    """A chunk's read from its swap file, waited for like a collective."""

    def __init__(self, slot: IoSlot) -> None:
        self.slot = slot

    def wait(self) -> None:
        self.slot.finish_read()


class ParamPartition(PartitionLayout):
    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group: dist.ProcessGroup | None,
        bucket_params: list[list[int]],
        swapper: ParamSwapper | None = None,
    ) -> None:
        super().__init__(params, names, group, bucket_params)
        spans = [self.chunk_span(bucket) for bucket in self.buckets]
        self.store = ShardStore(self.shard_numel, self.device, swapper, [(s.start, s.stop) for s in spans])
        self.shard = self.store.parameter()
        self.shard_grad = torch.zeros(self.shard_numel, dtype=torch.float32, device=self.device)
        self.shard.grad = self.shard_grad
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.pool = BufferPool()
        self.gathered: dict[Bucket, torch.Tensor] = {}  # the buffer each live bucket's parameters view
        self.copy_from_parameters()

    @torch.no_grad()
    def copy_from_parameters(self) -> None:
        """Take this rank's chunks of the (gathered) parameters as the fp32 master."""
        for bucket in self.buckets:
            full = self.bucket_values(bucket, [p.detach() for p in self.params])
            self.store.write(bucket.shard_start, full.view(self.size, -1)[self.rank])

    def ready_to_gather(self, bucket: Bucket) -> bool:
        """Whether a gather can start now: its chunk is in memory, or a swap buffer is free."""
        span = self.chunk_span(bucket)
        return self.store.in_memory(span.start, span.stop) or self.store.swapper.has_free_slot()

    @torch.no_grad()
    def gather_bucket(self, bucket: Bucket, async_op: bool) -> Reduction:
        """Start gathering a bucket; the returned finish step makes its parameters views of it.
        A swapped chunk is read first and all-gathered in the finish step."""
        span = self.chunk_span(bucket)
        if self.store.in_memory(span.start, span.stop):
            full, work = self._all_gather(self.store.memory[span], async_op)
            return work, lambda: self._attach(bucket, full)
        slot = self.store.swapper.claim()
        chunk = self.store.start_read(span.start, span.stop, slot)

        def gather_and_attach() -> None:
            full, _ = self._all_gather(chunk, async_op=False)
            self.store.swapper.release(slot)
            self._attach(bucket, full)

        return _ReadWork(slot), gather_and_attach

    def _all_gather(self, chunk: torch.Tensor, async_op: bool) -> tuple[torch.Tensor, Any]:
        full = self.pool.take(chunk.numel() * self.size, torch.float32, self.device)
        if self.size == 1:
            return full.copy_(chunk), None
        return full, comm.all_gather_into_tensor(full, chunk, group=self.group, async_op=async_op)

    def _attach(self, bucket: Bucket, full: torch.Tensor) -> None:
        values = full
        if self.dtype != torch.float32:  # round the fp32 master once, into a buffer of the model's dtype
            values = self.pool.take(full.numel(), self.dtype, self.device).copy_(full)
            self.pool.give(full)
        self.gathered[bucket] = values
        for index in bucket.params:
            start = self.param_offsets[index] - bucket.flat_start
            self.params[index].data = values[start : start + self.numels[index]].view(self.shapes[index])

    def release_bucket(self, bucket: Bucket) -> None:
        for index in bucket.params:
            self.params[index].data = self._empty
        self.pool.give(self.gathered.pop(bucket))

    reduce_bucket = PartitionLayout.reduce_and_free_gradients

    @torch.no_grad()
    def zero_gradients(self) -> None:
        self.shard_grad.zero_()
        self.shard.grad = self.shard_grad
