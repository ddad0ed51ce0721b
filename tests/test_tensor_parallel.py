"""Tensor (and sequence) parallelism equals the serial layers: each parallel layer is made from an
nn.Linear or nn.Embedding built from the same seed as the reference, and on every rank the forward
output, the input gradient and the rank's slice of each weight gradient match the reference's (and
F.cross_entropy's). All cases run in one spawn of the gloo world per size.

Each case is a pair: a rank function (group -> this rank's tensors) and a serial reference (the full
tensors), with a layout that says which slice of the reference each rank holds.
"""

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron.errors import ConfigError
from megatron.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    sequence_gathered_linear,
    sum_gradient_over,
    tp_rank_and_size,
    vocab_parallel_cross_entropy,
)
from megatron.model.transformer import init_linear_, init_normal_, swiglu
from megatron.placement import tensor_parallel_split
from megatron.tensor_split import shard, unshard
from tests.dist_utils import run_distributed

B, S, H, F_, V = 2, 4, 8, 16, 16  # F_ ffn hidden (F is torch.nn.functional)
QKV = [8, 4, 4]  # query, key and value widths of a GQA-like fused projection: uneven parts
SEED, STD = 1234, 0.3  # keeps every activation O(1), so the tolerance below means something

Tensors = dict[str, torch.Tensor]
Group = dist.ProcessGroup | None
Layout = dict[str, tuple[int, list[int] | None] | None]  # key -> (dim, parts) of the slice, None if whole


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """Data from its own generator, so the global RNG is left to the layers' init."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _full_linear(in_features: int, out_features: int) -> nn.Linear:
    """nn.Linear initialised as the model does (normal weight), from the global RNG, then given a
    non-zero bias: it shows the bias is sliced with the weight, or added once after the reduction."""
    linear = nn.Linear(in_features, out_features)
    init_linear_(linear, STD)
    with torch.no_grad():
        linear.bias.copy_(torch.linspace(-1.0, 1.0, out_features))
    return linear


def _full_embedding() -> nn.Embedding:
    embedding = nn.Embedding(V, H)
    init_normal_(embedding.weight, STD)
    return embedding


def _check_split(param: torch.Tensor, group: Group, dim: int, parts: list[int] | None = None) -> None:
    """A sliced parameter records its split once the group has more than one rank."""
    split, (rank, size) = tensor_parallel_split(param), tp_rank_and_size(group)
    expected = (dim, None if parts is None else tuple(parts), rank, size) if size > 1 else None
    got = None if split is None else (split.dim, split.partition_sizes, split.rank, split.size)
    assert got == expected, (got, expected)


def _check_whole_bias(layer: RowParallelLinear, full: nn.Linear) -> None:
    """RowParallelLinear's bias is the full layer's own, whole and unsplit on every rank."""
    assert layer.bias is full.bias and tensor_parallel_split(layer.bias) is None


def _grads(prefix: str, layer: nn.Module) -> Tensors:
    return {f"{prefix}w_grad": layer.weight.grad, f"{prefix}b_grad": layer.bias.grad}


# --- column-parallel linear ---------------------------------------------------------------------


def _column(group: Group, gather_output: bool, parts: list[int] | None) -> Tensors:
    rank, size = tp_rank_and_size(group)
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(_full_linear(H, sum(QKV)), group, gather_output=gather_output, partition_sizes=parts)
    _check_split(layer.weight, group, 0, parts)
    _check_split(layer.bias, group, 0, parts)
    x_BSH = _randn(B, S, H, seed=1).requires_grad_()
    y = layer(x_BSH)
    grad_BSO = _randn(B, S, sum(QKV), seed=2)
    y.backward(grad_BSO if gather_output else shard(grad_BSO, -1, rank, size, parts))
    return {"out": y, "x_grad": x_BSH.grad, **_grads("", layer)}


def _column_reference(gather_output: bool, parts: list[int] | None) -> Tensors:
    torch.manual_seed(SEED)
    linear = _full_linear(H, sum(QKV))
    x_BSH = _randn(B, S, H, seed=1).requires_grad_()
    y_BSO = linear(x_BSH)
    y_BSO.backward(_randn(B, S, sum(QKV), seed=2))
    return {"out": y_BSO, "x_grad": x_BSH.grad, "w_grad": linear.weight.grad, "b_grad": linear.bias.grad}


def _column_layout(gather_output: bool, parts: list[int] | None) -> Layout:
    return {"out": None if gather_output else (-1, parts), "x_grad": None, "w_grad": (0, parts), "b_grad": (0, parts)}


# --- row-parallel linear ------------------------------------------------------------------------


def _row(group: Group, input_is_parallel: bool) -> Tensors:
    rank, size = tp_rank_and_size(group)
    torch.manual_seed(SEED)
    full = _full_linear(F_, H)
    layer = RowParallelLinear(full, group, input_is_parallel=input_is_parallel)
    _check_split(layer.weight, group, 1)
    _check_whole_bias(layer, full)
    x_BSF = _randn(B, S, F_, seed=3)
    x_BSF = (shard(x_BSF, -1, rank, size) if input_is_parallel else x_BSF).requires_grad_()
    y_BSH = layer(x_BSF)
    y_BSH.backward(_randn(B, S, H, seed=4))
    return {"out": y_BSH, "x_grad": x_BSF.grad, **_grads("", layer)}


def _row_reference(input_is_parallel: bool) -> Tensors:
    torch.manual_seed(SEED)
    linear = _full_linear(F_, H)
    x_BSF = _randn(B, S, F_, seed=3).requires_grad_()
    y_BSH = linear(x_BSF)
    y_BSH.backward(_randn(B, S, H, seed=4))
    return {"out": y_BSH, "x_grad": x_BSF.grad, "w_grad": linear.weight.grad, "b_grad": linear.bias.grad}


def _row_layout(input_is_parallel: bool) -> Layout:
    return {"out": None, "x_grad": (-1, None) if input_is_parallel else None, "w_grad": (1, None), "b_grad": None}


# --- SwiGLU MLP: column ([gate; up] parts) -> row, optionally sequence parallel ------------------


def _full_mlp() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(SEED)
    return _full_linear(H, 2 * F_), _full_linear(F_, H)


def _mlp(group: Group, sequence_parallel: bool) -> Tensors:
    rank, size = tp_rank_and_size(group)
    full1, full2 = _full_mlp()
    fc1 = ColumnParallelLinear(full1, group, sequence_parallel=sequence_parallel, partition_sizes=[F_, F_])
    fc2 = RowParallelLinear(full2, group, sequence_parallel=sequence_parallel)
    _check_split(fc1.weight, group, 0, [F_, F_])
    _check_split(fc2.weight, group, 1)
    _check_whole_bias(fc2, full2)
    x_BSH = _randn(B, S, H, seed=5).requires_grad_()
    grad_BSH = _randn(B, S, H, seed=6)
    if sequence_parallel:
        y_BsH = fc2(swiglu(fc1(scatter_to_sequence_region(x_BSH, group))))
        # Backward from this rank's positions; the output is gathered only to compare it.
        y_BsH.backward(shard(grad_BSH, 1, rank, size))
        y_BSH = gather_from_sequence_region(y_BsH.detach(), group)
    else:
        y_BSH = fc2(swiglu(fc1(x_BSH)))
        y_BSH.backward(grad_BSH)
    return {"out": y_BSH, "x_grad": x_BSH.grad, **_grads("fc1_", fc1), **_grads("fc2_", fc2)}


def _mlp_reference(sequence_parallel: bool) -> Tensors:
    fc1, fc2 = _full_mlp()
    x_BSH = _randn(B, S, H, seed=5).requires_grad_()
    y_BSH = fc2(swiglu(fc1(x_BSH)))
    y_BSH.backward(_randn(B, S, H, seed=6))
    return {"out": y_BSH, "x_grad": x_BSH.grad, **_grads("fc1_", fc1), **_grads("fc2_", fc2)}


def _mlp_layout(sequence_parallel: bool) -> Layout:
    return {
        "out": None,
        "x_grad": None,
        "fc1_w_grad": (0, [F_, F_]),
        "fc1_b_grad": (0, [F_, F_]),
        "fc2_w_grad": (1, None),
        "fc2_b_grad": None,
    }


# --- a norm under sequence parallelism: whole weight, each rank's positions, summed gradient -----


def _norm(group: Group) -> Tensors:
    rank, size = tp_rank_and_size(group)
    norm = nn.LayerNorm(H)
    for param in norm.parameters():
        sum_gradient_over(param, group)
        assert tensor_parallel_split(param) is None
    x_BsH = shard(_randn(B, S, H, seed=10), 1, rank, size).requires_grad_()
    y_BsH = norm(x_BsH)
    # Two backwards: the sum happens in each, before the gradient accumulates.
    for seed in (11, 12):
        y_BsH.backward(shard(_randn(B, S, H, seed=seed), 1, rank, size), retain_graph=True)
    return {"out": y_BsH, "x_grad": x_BsH.grad, **_grads("", norm)}


def _norm_reference() -> Tensors:
    norm = nn.LayerNorm(H)
    x_BSH = _randn(B, S, H, seed=10).requires_grad_()
    y_BSH = norm(x_BSH)
    for seed in (11, 12):
        y_BSH.backward(_randn(B, S, H, seed=seed), retain_graph=True)
    return {"out": y_BSH, "x_grad": x_BSH.grad, **_grads("", norm)}


# --- vocabulary-parallel embedding and cross-entropy -------------------------------------------


def _ids_BS() -> torch.Tensor:
    return (torch.arange(B * S).view(B, S) * 5 + 3) % V  # ids in every rank's range, for tp up to 4


def _embedding(group: Group, sequence_parallel: bool) -> Tensors:
    rank, size = tp_rank_and_size(group)
    torch.manual_seed(SEED)
    embedding = VocabParallelEmbedding(_full_embedding(), group, sequence_parallel=sequence_parallel)
    _check_split(embedding.weight, group, 0)
    x = embedding(_ids_BS())
    grad_BSH = _randn(B, S, H, seed=7)
    x.backward(shard(grad_BSH, 1, rank, size) if sequence_parallel else grad_BSH)
    x_BSH = gather_from_sequence_region(x.detach(), group) if sequence_parallel else x
    return {"out": x_BSH, "w_grad": embedding.weight.grad}


def _embedding_reference(sequence_parallel: bool) -> Tensors:
    torch.manual_seed(SEED)
    embedding = _full_embedding()
    x_BSH = embedding(_ids_BS())
    x_BSH.backward(_randn(B, S, H, seed=7))
    return {"out": x_BSH, "w_grad": embedding.weight.grad}


def _logits_BSV() -> torch.Tensor:
    logits_BSV = 3.0 * _randn(B, S, V, seed=8)
    logits_BSV[0, 0, 5] = 80.0  # exp would overflow without the max shift
    return logits_BSV


def _cross_entropy(group: Group) -> Tensors:
    rank, size = tp_rank_and_size(group)
    logits_BSv = shard(_logits_BSV(), -1, rank, size).requires_grad_()
    losses_BS = vocab_parallel_cross_entropy(logits_BSv, _ids_BS(), group)
    losses_BS.backward(_randn(B, S, seed=9))
    return {"out": losses_BS, "logits_grad": logits_BSv.grad}


def _cross_entropy_reference() -> Tensors:
    logits_BSV = _logits_BSV().requires_grad_()
    losses_BS = F.cross_entropy(logits_BSV.view(-1, V), _ids_BS().view(-1), reduction="none").view(B, S)
    losses_BS.backward(_randn(B, S, seed=9))
    return {"out": losses_BS, "logits_grad": logits_BSV.grad}


# --- the mappings alone: each rank feeds its own input and output gradient ---------------------

MAPPINGS = {
    "copy": copy_to_tp_region,
    "reduce": reduce_from_tp_region,
    "gather": gather_from_tp_region,
    "scatter": scatter_to_tp_region,
    "seq_scatter": scatter_to_sequence_region,
    "seq_gather": gather_from_sequence_region,
    "seq_reduce_scatter": reduce_scatter_to_sequence_region,
}


def _mapping_inputs(name: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s input and output gradient for mapping `name`."""
    out_shape = {
        "gather": (B, S, H * size),
        "scatter": (B, S, H // size),
        "seq_scatter": (B, S // size, H),
        "seq_gather": (B, S * size, H),
        "seq_reduce_scatter": (B, S // size, H),
    }.get(name, (B, S, H))
    return _randn(B, S, H, seed=100 + rank), _randn(*out_shape, seed=200 + rank)


def _mappings(group: Group) -> Tensors:
    rank, size = tp_rank_and_size(group)
    results = {}
    for name, mapping in MAPPINGS.items():
        x, grad = _mapping_inputs(name, rank, size)
        x.requires_grad_()
        y = mapping(x, group)
        y.backward(grad)
        results |= {f"{name}_out": y, f"{name}_x_grad": x.grad}
    return results


def _expected_mapping(name: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What mapping `name` gives rank `rank`: its output and its input's gradient, from every rank's data."""
    xs, grads = zip(*(_mapping_inputs(name, r, size) for r in range(size)))

    def mine(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(size, dim)[rank]

    match name:
        case "copy":
            return xs[rank], sum(grads)
        case "reduce":
            return sum(xs), grads[rank]
        case "gather":
            return torch.cat(xs, -1), mine(grads[rank], -1)
        case "scatter":
            return mine(xs[rank], -1), torch.cat(grads, -1)
        case "seq_scatter":
            return mine(xs[rank], 1), torch.cat(grads, 1)
        case "seq_gather":
            return torch.cat(xs, 1), mine(sum(grads), 1)
        case "seq_reduce_scatter":
            return mine(sum(xs), 1), torch.cat(grads, 1)
    raise KeyError(name)


# --- the cases, run together in one world per size ---------------------------------------------

CASES: dict[str, tuple[Callable[[Group], Tensors], Callable[[], Tensors], Layout]] = {
    **{
        f"column_gather{int(g)}_parts{int(p is not None)}": (
            functools.partial(_column, gather_output=g, parts=p),
            functools.partial(_column_reference, g, p),
            _column_layout(g, p),
        )
        for g in (False, True)
        for p in (None, QKV)
    },
    **{
        f"row_parallel_input{int(i)}": (
            functools.partial(_row, input_is_parallel=i),
            functools.partial(_row_reference, i),
            _row_layout(i),
        )
        for i in (False, True)
    },
    **{
        f"mlp_sp{int(sp)}": (
            functools.partial(_mlp, sequence_parallel=sp),
            functools.partial(_mlp_reference, sp),
            _mlp_layout(sp),
        )
        for sp in (False, True)
    },
    **{
        f"embedding_sp{int(sp)}": (
            functools.partial(_embedding, sequence_parallel=sp),
            functools.partial(_embedding_reference, sp),
            {"out": None, "w_grad": (0, None)},
        )
        for sp in (False, True)
    },
    "norm_sum_gradient": (
        _norm,
        _norm_reference,
        {"out": (1, None), "x_grad": (1, None), "w_grad": None, "b_grad": None},
    ),
    "cross_entropy": (_cross_entropy, _cross_entropy_reference, {"out": None, "logits_grad": (-1, None)}),
}


def _run_cases(group: Group) -> Tensors:
    return {f"{case}.{key}": value for case, (run, _, _) in CASES.items() for key, value in run(group).items()}


def _all_cases(world_size: int) -> Tensors:
    group = dist.new_group(list(range(world_size)))
    record = TensorParallel(group, sequence_parallel=True)
    assert (record.size, record.enabled) == (world_size, True)
    results = _run_cases(group) | {f"mappings.{key}": value for key, value in _mappings(group).items()}
    _check_layer_errors(group)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def ranks(request) -> tuple[int, list[Tensors]]:
    """Every rank's results for tp = 1 (in this process, no group), 2 and 4 (gloo processes)."""
    tp = request.param
    if tp == 1:
        return tp, [_run_cases(None)]
    return tp, run_distributed(_all_cases, tp, tp)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_parallel_layer_equals_serial(ranks, case):
    tp, results = ranks
    _, reference, layout = CASES[case]
    full = reference()
    for rank, result in enumerate(results):
        for key, where in layout.items():
            expected = full[key] if where is None else shard(full[key], where[0], rank, tp, where[1])
            _close(result[f"{case}.{key}"], expected)


def test_mappings_move_values_and_gradients(ranks):
    tp, results = ranks
    if tp == 1:
        x = torch.randn(B, S, H, requires_grad=True)
        assert all(mapping(x, None) is x for mapping in MAPPINGS.values())  # TP=1: no copy, no graph node
        return
    for rank, result in enumerate(results):
        for name in MAPPINGS:
            out, x_grad = _expected_mapping(name, rank, tp)
            _close(result[f"mappings.{name}_out"], out)
            _close(result[f"mappings.{name}_x_grad"], x_grad)


# --- pure functions and errors ------------------------------------------------------------------


def test_without_a_group_tensor_parallelism_is_off():
    record = TensorParallel()
    assert (record.group, record.size, record.enabled, record.sequence_parallel) == (None, 1, False, False)


def test_shard_takes_each_parts_slice_and_unshard_inverts_it():
    full = torch.arange(16 * 3).view(16, 3)
    assert torch.equal(shard(full, 0, 1, 2), full[8:])
    # parts q 8, k 4, v 4 over 2 ranks: rank 1 holds q[4:8], k[2:4], v[2:4]
    assert torch.equal(shard(full, 0, 1, 2, QKV), torch.cat([full[4:8], full[10:12], full[14:16]]))
    wide = torch.arange(4 * 12).view(4, 12)
    for tensor, dim, parts in [(full, 0, None), (full, 0, QKV), (wide, 1, None), (wide, -1, [8, 4])]:
        for size in (1, 2, 4):
            pieces = [shard(tensor, dim, rank, size, parts) for rank in range(size)]
            assert torch.equal(unshard(pieces, dim, parts), tensor)
    assert shard(full, 0, 0, 1).data_ptr() != full.data_ptr()  # a parameter of its own, not a view


def test_sizes_that_do_not_split_evenly_are_config_errors():
    with pytest.raises(
        ConfigError, match=r"dimension 0 of a \(10, 3\) tensor \(10\) is not divisible by the tensor-parallel size 4"
    ):
        shard(torch.zeros(10, 3), 0, 0, 4)
    with pytest.raises(
        ConfigError, match=r"part 1 of dimension 0 .* \[6, 3, 3\] \(3\) is not divisible by the tensor-parallel size 2"
    ):
        shard(torch.zeros(12, 3), 0, 0, 2, [6, 3, 3])
    with pytest.raises(ConfigError, match=r"partition sizes \[8, 4\] .* add up to 12, not 16"):
        unshard([torch.zeros(8), torch.zeros(8)], 0, [8, 4])


def _check_layer_errors(group: dist.ProcessGroup) -> None:
    """Layers name the size that does not split (run on the ranks: the size comes from the group)."""
    size = dist.get_world_size(group)
    odd = 2 * size + 1
    with pytest.raises(
        ConfigError,
        match=rf"ColumnParallelLinear's out_features \({odd}\) is not divisible by the tensor-parallel size {size}",
    ):
        ColumnParallelLinear(nn.Linear(H, odd), group)
    with pytest.raises(
        ConfigError, match=rf"part 1 of ColumnParallelLinear's out_features \[{2 * size}, {odd}, {odd}\]"
    ):
        ColumnParallelLinear(nn.Linear(H, 2 * size + 2 * odd), group, partition_sizes=[2 * size, odd, odd])
    with pytest.raises(
        ConfigError, match=r"partition sizes \[8, 4\] of ColumnParallelLinear's out_features add up to 12, not 16"
    ):
        ColumnParallelLinear(nn.Linear(H, 16), group, partition_sizes=[8, 4])
    with pytest.raises(ConfigError, match=rf"RowParallelLinear's in_features \({odd}\) is not divisible"):
        RowParallelLinear(nn.Linear(odd, H), group)
    with pytest.raises(ConfigError, match=rf"the vocabulary size \({odd}\) .* --make-vocab-size-divisible-by"):
        VocabParallelEmbedding(nn.Embedding(odd, H), group)
    with pytest.raises(ConfigError, match=r"dimension 1 of a \(2, 3, 8\) activation \(3\) is not divisible"):
        scatter_to_sequence_region(torch.zeros(B, 3, H), group)


# --- the column-parallel product under sequence parallelism saves only this rank's positions ----


def _saved_numel(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """fn's output and the elements autograd saved for its backward."""
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = fn()
    return out, sum(saved)


def _gathered_linear() -> Tensors:
    group = dist.group.WORLD
    rank, size = tp_rank_and_size(group)
    out: Tensors = {}
    for dtype in (None, torch.bfloat16):  # fp32, and under bf16 autocast as autocast's linear computes
        for way, product in (
            ("fused", lambda x, w, b: sequence_gathered_linear(x, w, b, group)),
            ("composed", lambda x, w, b: F.linear(gather_from_sequence_region(x, group), w, b)),
        ):
            x_BsH = _randn(B, S // size, H, seed=300 + rank).requires_grad_()
            w_oH, b_o = (_randn(F_, H, seed=301).requires_grad_(), _randn(F_, seed=302).requires_grad_())
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y_BSo, saved = _saved_numel(functools.partial(product, x_BsH, w_oH, b_o))
            y_BSo.float().backward(_randn(B, S, F_, seed=303))
            key = f"{way}/{dtype}"
            out.update(
                {
                    f"{key}/out": y_BSo.float(),
                    f"{key}/x_grad": x_BsH.grad,
                    f"{key}/w_grad": w_oH.grad,
                    f"{key}/b_grad": b_o.grad,
                    f"{key}/saved": torch.tensor(saved),
                }
            )
    return out


def test_sequence_gathered_linear_equals_gather_then_linear_and_saves_a_tp_th_of_the_input():
    for rank, result in enumerate(run_distributed(_gathered_linear, 2)):
        for dtype in (None, torch.bfloat16):
            for name in ("out", "x_grad", "w_grad", "b_grad"):
                torch.testing.assert_close(
                    result[f"fused/{dtype}/{name}"],
                    result[f"composed/{dtype}/{name}"],
                    msg=f"rank {rank} {dtype} {name}",
                )
            # the composition saves the gathered [B, S, H] input; the fused product this rank's [B, S/2, H]
            saved_input = {"fused": B * S // 2 * H, "composed": B * S * H}
            assert (result[f"composed/{dtype}/saved"] - result[f"fused/{dtype}/saved"]).item() == saved_input[
                "composed"
            ] - saved_input["fused"], (rank, dtype)
