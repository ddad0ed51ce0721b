"""ZeRO stages 1 and 2: the model's parameters stay whole, as views of a flat buffer in the
bucket layout (megatron/runtime/zero/layout.py), so the all-gather of updated shards writes
straight into them. Under stage 1 the gradients are views of a second flat buffer that autograd
accumulates into, reduced bucket by bucket into this rank's chunk of `shard_grad` at the end of an
accumulation; under stage 2 (`partition_gradients`) no whole-model gradient buffer exists: each
bucket's gradients are reduce-scattered as soon as backward has finished them, every micro-batch,
added to `shard_grad` and freed.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron import comm
from megatron.runtime.zero.layout import Bucket, PartitionLayout

Reduction = tuple[dist.Work | None, Callable[[], None] | None]


class FlatPartition(PartitionLayout):
    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group: dist.ProcessGroup | None,
        bucket_params: list[list[int]],
        reduce_scatter: bool = True,
        partition_gradients: bool = False,
    ) -> None:
        super().__init__(params, names, group, bucket_params)
        self.reduce_scatter = reduce_scatter
        # padding stays zero in both buffers: nothing views it
        self.flat_params = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.param_views = self._views(self.flat_params)
        # on one rank in fp32 the layouts coincide: the master is the model's parameters and the
        # reduced gradient is the model's gradient, so a group of one costs no extra memory
        self.grads_are_shard = self.size == 1 and self.dtype == torch.float32
        self.partition_gradients = partition_gradients and not self.grads_are_shard
        self.flat_grads = None if self.partition_gradients else torch.zeros_like(self.flat_params)
        self.grad_views = [] if self.flat_grads is None else self._views(self.flat_grads)
        self.shard = nn.Parameter(self.flat_params) if self.grads_are_shard else self.new_shard()
        self.shard_grad = self.flat_grads if self.grads_are_shard else torch.zeros_like(self.shard)
        self.copy_from_parameters()

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + n].view(s) for o, n, s in zip(self.param_offsets, self.numels, self.shapes)]

    @torch.no_grad()
    def _attach_parameters(self, keep_values: bool) -> None:
        """Make every parameter a view of flat_params again (the same nn.Parameter object: the
        optimizer, the schedule and checkpoints key on it). A parameter whose .data was replaced
        since (say, by a load that assigns) brings its values along when `keep_values`."""
        for param, view in zip(self.params, self.param_views):
            if param.data_ptr() != view.data_ptr():
                if keep_values:
                    view.copy_(param.detach())
                param.data = view

    @torch.no_grad()
    def _attach_gradients(self) -> None:
        """Point each .grad at its view of flat_grads. A .grad set to None since the last step
        means no gradient (its view was zeroed at the step); one replaced by a new tensor carries
        the gradient, copied in."""
        for param, view in zip(self.params, self.grad_views):
            grad = param.grad
            if grad is None or grad.data_ptr() != view.data_ptr():
                if grad is not None:
                    view.copy_(grad)
                param.grad = view

    @torch.no_grad()
    def copy_from_parameters(self) -> None:
        """Take this rank's chunks of the model's parameters as the fp32 master (at the start and
        after a checkpoint wrote new weights into the model)."""
        self._attach_parameters(keep_values=True)
        self._attach_gradients()
        for bucket in self.buckets:
            span = self.bucket_span(bucket)
            self.shard[self.chunk_span(bucket)] = self.flat_params[span].view(self.size, -1)[self.rank]
        self.shard.grad = self.shard_grad

    @torch.no_grad()
    def reduce_bucket(self, bucket: Bucket, async_op: bool) -> Reduction:
        """Sum one bucket's gradients over the group into this rank's chunk of shard_grad:
        reduce-scatter, or (reduce_scatter off) all-reduce in place and take the chunk."""
        if self.partition_gradients:
            return self.reduce_and_free_gradients(bucket, async_op)
        self._attach_gradients()
        full, slot = self.flat_grads[self.bucket_span(bucket)], self.shard_grad[self.chunk_span(bucket)]
        if self.grads_are_shard:
            return None, None
        if self.size == 1:
            return None, lambda: slot.copy_(full)
        if not self.reduce_scatter:
            work = comm.all_reduce(full, group=self.group, async_op=async_op)
            return work, lambda: slot.copy_(full.view(self.size, -1)[self.rank])
        if slot.dtype == full.dtype:
            return comm.reduce_scatter_tensor(slot, full, group=self.group, async_op=async_op), None
        received = torch.empty(bucket.chunk, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter_tensor(received, full, group=self.group, async_op=async_op)
        return work, lambda: slot.copy_(received)

    @torch.no_grad()
    def zero_gradients(self) -> None:
        """Clear the gradients for the next accumulation, keeping the model's views (the engine
        calls this after each step, whether or not the optimizer stepped)."""
        if self.partition_gradients:  # reductions add into shard_grad
            self.shard_grad.zero_()
        else:
            self.flat_grads.zero_()  # the next reduction overwrites every chunk of shard_grad
            self._attach_gradients()
        self.shard.grad = self.shard_grad

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Write every rank's updated chunks into flat_params, and so into the model's parameters."""
        self._attach_parameters(keep_values=False)  # every value is overwritten below
        for bucket in self.buckets:
            full, chunk = self.flat_params[self.bucket_span(bucket)], self.shard.detach()[self.chunk_span(bucket)]
            if self.grads_are_shard:
                continue  # the optimizer updated the parameters themselves
            if self.size == 1:
                full.copy_(chunk)
            elif full.dtype == chunk.dtype:
                comm.all_gather_into_tensor(full, chunk, group=self.group)
            else:  # a low-precision model: gather the fp32 master, then round once
                gathered = torch.empty(full.numel(), dtype=chunk.dtype, device=chunk.device)
                comm.all_gather_into_tensor(gathered, chunk, group=self.group)
                full.copy_(gathered)
