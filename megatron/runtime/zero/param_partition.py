"""ZeRO stage 3: parameters are partitioned too. Between uses a parameter holds no data (an empty
tensor); `gather_bucket` all-gathers a bucket's chunks from every rank into a fresh buffer and
makes the bucket's parameters views of it, `release_bucket` drops it again. Gradients are
reduce-scattered bucket by bucket as backward produces them and summed into this rank's fp32
`shard_grad`, so no rank ever holds a whole model's gradients either.
"""

import torch
import torch.distributed as dist
from torch import nn

from megatron.runtime.zero.layout import Bucket, PartitionLayout
from megatron.runtime.zero.partition import Reduction


class ParamPartition(PartitionLayout):
    def __init__(
        self, params: list[nn.Parameter], names: list[str], group: dist.ProcessGroup | None,
        bucket_params: list[list[int]],
    ) -> None:
        super().__init__(params, names, group, bucket_params)
        self.shard = self.new_shard()
        self.shard_grad = torch.zeros_like(self.shard)
        self.shard.grad = self.shard_grad
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.copy_from_parameters()

    @torch.no_grad()
    def copy_from_parameters(self) -> None:
        """Take this rank's chunks of the (gathered) parameters as the fp32 master."""
        for bucket in self.buckets:
            full = self.bucket_values(bucket, [p.detach() for p in self.params])
            self.shard[self.chunk_span(bucket)] = full.view(self.size, -1)[self.rank]

    @torch.no_grad()
    def gather_bucket(self, bucket: Bucket, async_op: bool) -> Reduction:
        """Start gathering a bucket; the returned finish step makes its parameters views of it."""
        chunk = self.shard.detach()[self.chunk_span(bucket)]
        full = torch.empty(bucket.chunk * self.size, dtype=torch.float32, device=self.device)
        work = dist.all_gather_single(full, chunk, group=self.group, async_op=async_op)

        def attach() -> None:
            values = full if self.dtype == torch.float32 else full.to(self.dtype)
            for index in bucket.params:
                start = self.param_offsets[index] - bucket.flat_start
                self.params[index].data = values[start:start + self.numels[index]].view(self.shapes[index])
        return work, attach

    def release_bucket(self, bucket: Bucket) -> None:
        for index in bucket.params:
            self.params[index].data = self._empty

    reduce_bucket = PartitionLayout.reduce_and_free_gradients

    @torch.no_grad()
    def zero_gradients(self) -> None:
        self.shard_grad.zero_()
        self.shard.grad = self.shard_grad
