"""Tensor parallelism as Megatron-LM does it: the weight of a linear layer or of the word embedding
is split over the ranks of a tensor-parallel group, each rank computes with its slice, and a few
autograd mappings move activations between the replicated and the split views. A column-parallel
linear (output features split) followed by a row-parallel one (input features split) needs one
all-reduce in the forward and one in the backward. Sequence parallelism also splits the activations
between those pairs along the sequence: the all-reduce becomes a reduce-scatter, and the
column-parallel linear all-gathers its input first.

Every function takes the group explicitly. Without a group, or with a 1-rank one, each mapping
returns its input and each layer holds the whole weight, so TP=1 costs nothing. Each layer is made
from the whole, initialised layer and keeps its slice (Megatron's CPU init, one layer at a time):
any TP size starts from exactly the weights TP=1 has.

Shapes: B batch, S sequence, H hidden, V vocab, tp tensor-parallel size; lower case is this rank's
slice: s = S / tp, v = V / tp, o = out_features / tp, i = in_features / tp.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron import comm
from megatron.parallel import all_reduce, is_parallel
from megatron.placement import place
from megatron.tensor_split import TensorParallelSplit, check_divisible, gather_list, partition_widths, shard, unshard

SEQUENCE_DIM = 1  # activations are [B, S, H]
LINEAR_FIX = "choose layer widths that are multiples of it, or a tensor-parallel size that divides them"


def tp_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's place in the tensor-parallel group and the group's size; (0, 1) without one."""
    if not is_parallel(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class TensorParallel:
    """What a model's modules need to know of tensor parallelism: the group, whether the
    activations between the tensor-parallel regions are split along the sequence, and the group
    over which each expert's hidden features are split (expert tensor parallelism)."""

    group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    expert_group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return tp_rank_and_size(self.group)[1]

    @property
    def enabled(self) -> bool:
        return self.size > 1


def sum_gradient_over(param: nn.Parameter, group: dist.ProcessGroup | None) -> None:
    """A parameter every rank holds whole but uses on its own share of the positions (a norm under
    sequence parallelism): each backward's gradient is summed over the group before it accumulates."""
    if is_parallel(group):
        param.register_hook(lambda grad: _sum(grad, -1, group))


# Collectives without autograd, each (x, dim, group) -> tensor, paired into mappings below.
def _identity(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    # A copy: the input may be a tensor autograd still holds (or an expanded gradient).
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group)
    return out


def _even_chunks(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> tuple[int, list[torch.Tensor]]:
    rank, size = tp_rank_and_size(group)
    check_divisible(
        x.shape[dim],
        size,
        f"dimension {dim} of a {tuple(x.shape)} activation",
        "choose a sequence length (under sequence parallelism) or a width that is a multiple of it",
    )
    return rank, [chunk.contiguous() for chunk in x.chunk(size, dim)]


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    rank, chunks = _even_chunks(x, dim, group)
    return chunks[rank]


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return torch.cat(gather_list(x, group), dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    rank, chunks = _even_chunks(x, dim, group)
    out = torch.empty_like(chunks[rank])
    comm.reduce_scatter(out, chunks, group=group)
    return out


Collective = Callable[[torch.Tensor, int, dist.ProcessGroup], torch.Tensor]


class _Mapping(torch.autograd.Function):
    """A collective in the forward and its adjoint in the backward, along `dim` over `group`."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, forward_op: Collective, backward_op: Collective, dim: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.backward_op, ctx.dim, ctx.group = backward_op, dim, group
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


def _map(
    x: torch.Tensor, forward_op: Collective, backward_op: Collective, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    if not is_parallel(group):
        return x
    return _Mapping.apply(x, forward_op, backward_op, dim, group)


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Replicated input of a tensor-parallel region: identity; the backward sums each rank's partial gradient."""
    return _map(x, _identity, _sum, -1, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of the ranks' partial results; the gradient of the (replicated) sum goes to each unchanged."""
    return _map(x, _sum, _identity, -1, group)


def gather_from_tp_region(x_BSo: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The ranks' slices of the last dim concatenated in rank order; the backward keeps this rank's slice."""
    return _map(x_BSo, _gather, _split, -1, group)


def scatter_to_tp_region(x_BSH: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of the last dim of a replicated tensor; the backward gathers the slices."""
    return _map(x_BSH, _split, _gather, -1, group)


def scatter_to_sequence_region(x_BSH: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's s = S / tp positions of a replicated [B, S, H]; the backward gathers them."""
    return _map(x_BSH, _split, _gather, SEQUENCE_DIM, group)


def gather_from_sequence_region(x_BsH: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from every rank's [B, s, H], in rank order. The backward reduce-scatters:
    the gathered tensor feeds a tensor-parallel region, so each rank's gradient of it is partial."""
    return _map(x_BsH, _gather, _reduce_scatter, SEQUENCE_DIM, group)


def gather_whole_sequence(x_BsH: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The whole sequence from every rank's [B, s, H] for work every rank repeats alike (random-LTD's
    choice of tokens); the backward keeps this rank's s positions of the (whole) gradient."""
    return _map(x_BsH, _gather, _split, SEQUENCE_DIM, group)


def reduce_scatter_to_sequence_region(x_BSH: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of the ranks' partial [B, S, H], of which this rank keeps its s positions; the backward gathers."""
    return _map(x_BSH, _reduce_scatter, _gather, SEQUENCE_DIM, group)


def mark_split(
    param: nn.Parameter, dim: int, group: dist.ProcessGroup | None, partition_sizes: Sequence[int] | None = None
) -> None:
    """Record on `param`, this rank's slice along `dim` over `group`, how it was split (nothing
    without a group of more than one rank)."""
    rank, size = tp_rank_and_size(group)
    if size > 1:
        parts = tuple(partition_sizes) if partition_sizes is not None and len(partition_sizes) > 1 else None
        place(param, tp_split=TensorParallelSplit(dim, parts, rank, size, group))


class _SequenceGatheredLinear(torch.autograd.Function):
    """gather_S(x) W^T + b that saves only this rank's x_BsH for backward and gathers it again there
    (Megatron-Core's way): one more all-gather per backward for 1/tp of the input's memory. Under
    autocast it computes as autocast's linear does, in the autocast dtype, and saves x in it."""

    @staticmethod
    def forward(
        ctx, x_BsH: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
    ) -> torch.Tensor:
        device = x_BsH.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.group, ctx.has_bias = group, bias is not None
        x_BsH, weight_, bias = (t if t is None or ctx.dtype is None else t.to(ctx.dtype) for t in (x_BsH, weight, bias))
        ctx.save_for_backward(x_BsH, weight)
        with torch.autocast(device, enabled=False):
            return F.linear(_gather(x_BsH, SEQUENCE_DIM, group), weight_, bias)

    @staticmethod
    def backward(ctx, grad_BSo: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_BsH, weight = ctx.saved_tensors
        weight = weight if ctx.dtype is None else weight.to(ctx.dtype)
        grad_BSo = grad_BSo.to(weight.dtype)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # each rank's gradient of the gathered input is partial: reduce-scatter it
            grad_x = _reduce_scatter(grad_BSo.matmul(weight), SEQUENCE_DIM, ctx.group)
        if ctx.needs_input_grad[1]:
            x_NH = _gather(x_BsH, SEQUENCE_DIM, ctx.group).flatten(0, -2)
            grad_weight = grad_BSo.flatten(0, -2).t().matmul(x_NH)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_BSo.flatten(0, -2).sum(0)
        return grad_x, grad_weight, grad_bias, None


def sequence_gathered_linear(
    x_BsH: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The column-parallel product of the whole sequence under sequence parallelism: this rank's
    [B, s, H] positions all-gathered along S, times this rank's rows of W: [B, S, o]."""
    if not is_parallel(group):
        return F.linear(x_BsH, weight, bias)
    return _SequenceGatheredLinear.apply(x_BsH, weight, bias, group)


def _slice_parameter(
    full: torch.Tensor | None, dim: int, group: dist.ProcessGroup | None, partition_sizes: Sequence[int] | None = None
) -> nn.Parameter | None:
    if full is None:
        return None
    rank, size = tp_rank_and_size(group)
    param = nn.Parameter(shard(full.detach(), dim, rank, size, partition_sizes), requires_grad=full.requires_grad)
    mark_split(param, dim, group, partition_sizes)
    return param


class ColumnParallelLinear(nn.Module):
    """x W^T + b with the rows of W (output features) split over the group. With `partition_sizes`
    the output is a concatenation of parts (q, k, v; or SwiGLU's gate and up) and each part is split
    on its own, so that rank r holds the r-th slice of every part, in order.

    Input: x_BSH, replicated; with sequence_parallel this rank's x_BsH, all-gathered along S here.
    Output: y_BSo, this rank's features of every part; with gather_output the whole y, in the
    original feature order.
    """

    def __init__(
        self,
        full: nn.Linear,
        group: dist.ProcessGroup | None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        partition_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        size = tp_rank_and_size(group)[1]
        self.partition_sizes = partition_widths(
            full.out_features, size, partition_sizes, "ColumnParallelLinear's out_features", LINEAR_FIX
        )
        self.weight = _slice_parameter(full.weight, 0, group, self.partition_sizes)
        self.bias = _slice_parameter(full.bias, 0, group, self.partition_sizes)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y_BSo = sequence_gathered_linear(x_BSH, self.weight, self.bias, self.group)
        else:
            y_BSo = F.linear(copy_to_tp_region(x_BSH, self.group), self.weight, self.bias)
        if not self.gather_output or not is_parallel(self.group):
            return y_BSo
        y_BSO = gather_from_tp_region(y_BSo, self.group)
        if len(self.partition_sizes) == 1:
            return y_BSO
        # The gather lays the features out rank by rank; put each part back together.
        return unshard(list(y_BSO.chunk(dist.get_world_size(self.group), -1)), -1, self.partition_sizes)


class RowParallelLinear(nn.Module):
    """x W^T + b with the columns of W (input features) split over the group; each rank's product is
    a partial sum, all-reduced (or, with sequence_parallel, reduce-scattered along S).

    Input: x_BSi, this rank's features (input_is_parallel), else x_BSI, replicated and split here.
    Output: y_BSH, replicated; with sequence_parallel this rank's y_BsH.
    """

    def __init__(
        self,
        full: nn.Linear,
        group: dist.ProcessGroup | None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        partition_widths(
            full.in_features, tp_rank_and_size(group)[1], None, "RowParallelLinear's in_features", LINEAR_FIX
        )
        self.weight = _slice_parameter(full.weight, 1, group)
        self.bias = full.bias  # whole on every rank, added once after the sum

    def forward(self, x_BSi: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x_BSi = scatter_to_tp_region(x_BSi, self.group)
        partial_BSH = F.linear(x_BSi, self.weight)
        if self.sequence_parallel:
            y_BSH = reduce_scatter_to_sequence_region(partial_BSH, self.group)
        else:
            y_BSH = reduce_from_tp_region(partial_BSH, self.group)
        if self.bias is None:
            return y_BSH
        # The bias goes in after the sum, or it would count tp times. Under sequence parallelism each
        # rank adds it to its own positions only: the copy's backward sums the bias gradient over the
        # group, so every rank holds the whole one.
        return y_BSH + (copy_to_tp_region(self.bias, self.group) if self.sequence_parallel else self.bias)


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the vocabulary split into tp equal ranges of rows; a rank gives zero rows
    for ids outside its range and the ranks' rows are summed (reduce-scattered along S with
    sequence_parallel). ids_BS -> x_BSH replicated, or this rank's x_BsH."""

    def __init__(self, full: nn.Embedding, group: dist.ProcessGroup | None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        rank, size = tp_rank_and_size(group)
        partition_widths(
            full.num_embeddings,
            size,
            None,
            "the vocabulary size",
            "pad the vocabulary to a multiple of it with --make-vocab-size-divisible-by",
        )
        self.vocab_start = rank * (full.num_embeddings // size)
        self.weight = _slice_parameter(full.weight, 0, group)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        if is_parallel(self.group):
            local_ids_BS = ids_BS - self.vocab_start
            outside_BS = (local_ids_BS < 0) | (local_ids_BS >= self.weight.shape[0])
            x_BSH = F.embedding(local_ids_BS.masked_fill(outside_BS, 0), self.weight)
            x_BSH = x_BSH.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        else:
            x_BSH = F.embedding(ids_BS, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(x_BSH, self.group)
        return reduce_from_tp_region(x_BSH, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits_BSv: torch.Tensor, labels_BS: torch.Tensor, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        rank, _ = tp_rank_and_size(group)
        logits_BSv32 = logits_BSv.float()
        max_BS = logits_BSv32.max(dim=-1).values
        if is_parallel(group):
            comm.all_reduce(max_BS, op=dist.ReduceOp.MAX, group=group)
        # Shifted by the global max, exp cannot overflow.
        shifted_BSv = logits_BSv32 - max_BS.unsqueeze(-1)
        vocab_slice = logits_BSv.shape[-1]
        local_labels_BS = labels_BS - rank * vocab_slice
        mine_BS = (local_labels_BS >= 0) & (local_labels_BS < vocab_slice)
        local_labels_BS = local_labels_BS.masked_fill(~mine_BS, 0)
        # Only the rank holding the label has its (shifted) logit; the others add zero.
        target_BS = shifted_BSv.gather(-1, local_labels_BS.unsqueeze(-1)).squeeze(-1).masked_fill(~mine_BS, 0.0)
        exp_BSv = shifted_BSv.exp_()
        sums_2BS = torch.stack([target_BS, exp_BSv.sum(dim=-1)])
        all_reduce(sums_2BS, group)  # one collective for both sums
        target_BS, sum_exp_BS = sums_2BS.unbind(0)
        softmax_BSv = exp_BSv.div_(sum_exp_BS.unsqueeze(-1))
        ctx.save_for_backward(softmax_BSv, local_labels_BS, mine_BS)
        ctx.logits_dtype = logits_BSv.dtype
        return sum_exp_BS.log() - target_BS

    @staticmethod
    def backward(ctx, grad_BS: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax_BSv, local_labels_BS, mine_BS = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(label); the one-hot lies on the rank holding the label.
        grad_BSv = softmax_BSv.scatter_add(
            -1, local_labels_BS.unsqueeze(-1), -mine_BS.unsqueeze(-1).to(softmax_BSv.dtype)
        )
        return (grad_BSv * grad_BS.unsqueeze(-1)).to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(
    logits_BSv: torch.Tensor, labels_BS: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Per-token cross-entropy [B, S] in fp32 of logits split over the vocabulary (rank r holds ids
    [r*v, (r+1)*v)), equal to F.cross_entropy(reduction="none") of the gathered logits without
    gathering them: two all-reduces of [B, S] values (the max, then the target logit and the sum of
    exps together). Every label must be a valid id; masking is the caller's loss mask."""
    return _VocabParallelCrossEntropy.apply(logits_BSv, labels_BS, group)
