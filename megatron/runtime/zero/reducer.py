"""Bucketed gradient reduction during backward.

A hook on every partitioned parameter counts the gradients that backward has finished; when all
of a bucket's parameters have theirs, the bucket is ready. Ready buckets are reduced in one fixed
order per process group (the reverse of the parameters' order, roughly the order backward finishes
them), never in the order they happen to fill: every rank then issues the same collectives in the
same sequence even when some parameter gets no gradient on one rank. With `async_op` the
collectives run while backward goes on (gloo and NCCL progress them in the background), at most
`max_inflight_numel` elements of them at once (their buffers are alive until they finish);
`flush` launches what is left and waits for all of them.
"""

import weakref
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from megatron.runtime.zero.layout import Bucket, PartitionLayout


class _Queue:
    """The buckets of one process group in launch order, and how far launching has got."""

    def __init__(self, order: list[tuple[PartitionLayout, Bucket]]) -> None:
        self.order = order
        self.launched = 0


class BucketReducer:
    def __init__(
        self,
        partitions: list[PartitionLayout],
        position: dict[nn.Parameter, int],
        async_op: bool,
        max_inflight_numel: int,
        on_ready: Callable[[PartitionLayout, Bucket], None] | None = None,
    ) -> None:
        """`position` orders parameters as the model lists them; `on_ready` is told of each bucket
        whose gradients are complete, before it is reduced."""
        self.async_op = async_op
        self.max_inflight_numel = max_inflight_numel
        self.on_ready = on_ready
        self.armed = False
        self.pending: deque[tuple[torch.distributed.Work, Callable[[], None] | None, int]] = deque()
        self.inflight_numel = 0
        self.bucket_of: dict[nn.Parameter, tuple[PartitionLayout, Bucket]] = {}
        by_group: dict[int, list[tuple[PartitionLayout, Bucket]]] = {}
        for part in partitions:
            for bucket in part.buckets:
                by_group.setdefault(id(part.group), []).append((part, bucket))
                for index in bucket.params:
                    self.bucket_of[part.params[index]] = (part, bucket)
        first = {
            key: min(position[key[0].params[i]] for i in key[1].params) for keys in by_group.values() for key in keys
        }
        self.queues = [_Queue(sorted(keys, key=lambda key: -first[key])) for keys in by_group.values()]
        self.queue_of = {id(key[1]): queue for queue in self.queues for key in queue.order}
        self.missing: dict[int, int] = {}
        self.ready: set[int] = set()
        self._reset()
        # the hooks live inside the tensors, where Python's garbage collector cannot see them: a hook
        # holding the reducer would keep it, its partitions and their buffers alive for ever
        reducer = weakref.ref(self)

        def grad_done(param: nn.Parameter) -> None:
            if (alive := reducer()) is not None:
                alive._grad_done(param)

        self.hooks = [p.register_post_accumulate_grad_hook(grad_done) for p in self.bucket_of]

    def _reset(self) -> None:
        self.missing = {id(bucket): len(bucket.params) for queue in self.queues for _, bucket in queue.order}
        self.ready = set()
        for queue in self.queues:
            queue.launched = 0

    def _grad_done(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        part, bucket = self.bucket_of[param]
        self.missing[id(bucket)] -= 1
        if self.missing[id(bucket)] == 0:
            self._mark_ready(part, bucket)
            self._launch(self.queue_of[id(bucket)], only_ready=True)

    def _mark_ready(self, part: PartitionLayout, bucket: Bucket) -> None:
        self.ready.add(id(bucket))
        if self.on_ready is not None:
            self.on_ready(part, bucket)

    def _launch(self, queue: _Queue, only_ready: bool) -> None:
        while queue.launched < len(queue.order):
            part, bucket = queue.order[queue.launched]
            if id(bucket) not in self.ready:
                if only_ready:
                    return
                self._mark_ready(part, bucket)
            work, finish = part.reduce_bucket(bucket, self.async_op)
            queue.launched += 1
            if work is not None and self.async_op:
                numel = bucket.chunk * part.size
                self.pending.append((work, finish, numel))
                self.inflight_numel += numel
                self._complete(block=False)
            elif finish is not None:
                finish()

    def _complete(self, block: bool) -> None:
        """Finish collectives in launch order: those already done, then (`block`, or while over
        the in-flight limit) by waiting."""
        while self.pending:
            work, finish, numel = self.pending[0]
            if not (block or self.inflight_numel > self.max_inflight_numel or work.is_completed()):
                return
            work.wait()
            if finish is not None:
                finish()
            self.pending.popleft()
            self.inflight_numel -= numel

    def flush(self) -> None:
        """Reduce every bucket not reduced yet (in order) and wait until all are done."""
        for queue in self.queues:
            self._launch(queue, only_ready=False)
        self._complete(block=True)
        self._reset()
