"""The 1F1B pipeline schedule (PipeDream-Flush, Megatron's default) over the micro-batches of one
global batch, for any model split into stages.

Stage r of P first runs P - r - 1 forwards (warm-up), then alternates one forward and one backward,
then runs the backwards left (cool-down); at most P - r micro-batches' activations are alive on a
stage. Activations go to the next stage and gradients to the previous one by point-to-point sends,
paired with the matching receive in one batch so that neighbours never wait on each other.

The `pipeline-bubble` timer holds the receives that no compute of this stage can hide: the warm-up's
and the first steady forward's inputs, and the cool-down's gradients (the waits for the stages
before and after; on the first and last stage some of them are empty).
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron import comm
from megatron.timers import timed

# forward(micro-batch index, input from the previous stage or None) -> what to send on (None on
# the last stage) and what backward needs; backward(that, gradient from the next stage or None) ->
# the gradient of the input (None on the first stage)
ForwardStep = Callable[[int, torch.Tensor | None], tuple[torch.Tensor | None, object]]
BackwardStep = Callable[[object, torch.Tensor | None], torch.Tensor | None]


@dataclass(frozen=True)
class StageLinks:
    """A stage's neighbours (global ranks, None at the ends) and the shape of what passes between stages."""

    prev_rank: int | None
    next_rank: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def _exchange(self, send: torch.Tensor | None, to: int | None, receive_from: int | None) -> torch.Tensor | None:
        ops, received = [], None
        if send is not None and to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().to(self.dtype).contiguous(), to))
        if receive_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, receive_from))
        for work in comm.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return received

    def recv_forward(self) -> torch.Tensor | None:
        with timed("forward-recv"):
            received = self._exchange(None, None, self.prev_rank)
        return None if received is None else received.requires_grad_()

    def send_forward(self, activation: torch.Tensor | None) -> None:
        with timed("forward-send"):
            self._exchange(activation, self.next_rank, None)

    def send_forward_recv_backward(self, activation: torch.Tensor | None) -> torch.Tensor | None:
        with timed("forward-send-backward-recv"):
            return self._exchange(activation, self.next_rank, self.next_rank)

    def send_backward(self, grad: torch.Tensor | None) -> None:
        with timed("backward-send"):
            self._exchange(grad, self.prev_rank, None)

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        with timed("backward-send-forward-recv"):
            received = self._exchange(grad, self.prev_rank, self.prev_rank)
        return None if received is None else received.requires_grad_()

    def recv_backward(self) -> torch.Tensor | None:
        with timed("backward-recv"):
            return self._exchange(None, None, self.next_rank)


def one_forward_one_backward(
    num_microbatches: int, stage: int, num_stages: int, links: StageLinks, forward: ForwardStep, backward: BackwardStep
) -> None:
    """Run every micro-batch's forward and backward on this stage in 1F1B order."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    in_flight: deque[object] = deque()
    for index in range(warmup):
        with timed("pipeline-bubble"):
            received = links.recv_forward()
        output, saved = forward(index, received)
        links.send_forward(output)
        in_flight.append(saved)
    steady = num_microbatches - warmup
    with timed("pipeline-bubble"):
        received = links.recv_forward() if steady else None
    for index in range(steady):
        output, saved = forward(warmup + index, received)
        grad_output = links.send_forward_recv_backward(output)
        in_flight.append(saved)
        grad_input = backward(in_flight.popleft(), grad_output)
        if index == steady - 1:
            links.send_backward(grad_input)
        else:
            received = links.send_backward_recv_forward(grad_input)
    for _ in range(warmup):
        with timed("pipeline-bubble"):
            grad_output = links.recv_backward()
        links.send_backward(backward(in_flight.popleft(), grad_output))


def forward_only(num_microbatches: int, links: StageLinks, forward: ForwardStep) -> None:
    """Every micro-batch's forward on this stage, in order (evaluation)."""
    for index in range(num_microbatches):
        output, _ = forward(index, links.recv_forward())
        links.send_forward(output)
