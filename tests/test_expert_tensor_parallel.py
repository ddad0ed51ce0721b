"""Expert tensor parallelism in the MoE layer: with every expert's hidden features split over an
expert-tensor-parallel group (alone, and inside expert parallelism), each rank's output and input
gradient equal those of the whole layer on its own tokens, each rank's expert gradients are its
slices of the whole experts' gradients summed over every rank's tokens, and the experts start as
slices of exactly the whole experts."""

import pytest
import torch
import torch.distributed as dist

from megatron.errors import ConfigError
from megatron.model.moe.config import MoEConfig
from megatron.model.moe.layer import MoELayer
from megatron.placement import tensor_parallel_split
from tests.dist_utils import run_distributed

H, F, E, TOKENS = 8, 12, 4, 10


def _layer(swiglu: bool, bias: bool, ep_group=None, expert_tp_group=None) -> MoELayer:
    torch.manual_seed(0)
    config = MoEConfig(topk=2, drop_tokens=False, sample_second_expert=False)
    return MoELayer(
        H,
        F,
        E,
        config,
        init_std=0.02,
        output_init_std=0.01,
        ep_group=ep_group,
        swiglu=swiglu,
        bias=bias,
        expert_tp_group=expert_tp_group,
    )


def _run(layer: MoELayer, x_TH: torch.Tensor, grad_TH: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x_TH = x_TH.clone().requires_grad_()
    output = layer(x_TH.unsqueeze(0))
    out, loss = output.hidden_BSH, output.router_loss
    (out.squeeze(0) * grad_TH).sum().add(loss).backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out.detach().squeeze(0), {"x": x_TH.grad, **grads}


def _groups(ep_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup]:
    """Expert-tp groups of 2 consecutive ranks, expert-parallel groups strided by 2 (as the rank grid lays them)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    etp = [dist.new_group(list(range(start, start + 2))) for start in range(0, world, 2)]
    ep = [dist.new_group(list(range(offset, world, 2))) for offset in range(2)] if ep_size > 1 else [None, None]
    return ep[rank % 2], etp[rank // 2]


def _on_rank(swiglu: bool, bias: bool, ep_size: int, all_to_one: bool) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    ep_group, etp_group = _groups(ep_size)
    torch.manual_seed(100 + rank)
    x_TH, grad_TH = torch.randn(TOKENS + rank, H), torch.randn(TOKENS + rank, H)
    whole = _layer(swiglu, bias)
    if all_to_one:  # every token picks experts 0 and 1: the other ranks' experts get no rows
        with torch.no_grad():
            whole.router.weight.zero_()
            whole.router.weight[:2] = 1.0
    want_out, want = _run(whole, x_TH, grad_TH)
    for name, _ in whole.named_parameters():  # the whole experts' gradients over every rank's tokens
        if name.startswith("experts."):
            dist.all_reduce(want[name])
    split = _layer(swiglu, bias, ep_group, etp_group)
    split.router.load_state_dict(whole.router.state_dict())
    got = {f"init/{name}": p.detach().clone() for name, p in split.experts.named_parameters()}
    got_out, got_grads = _run(split, x_TH, grad_TH)
    out = {
        "out": got_out,
        "want/out": want_out,
        **got,
        **{f"grad/{n}": g for n, g in got_grads.items()},
        **{f"want/grad/{n}": g for n, g in want.items() if not n.startswith("experts.")},
    }
    local = E // (ep_size or 1)
    first = (dist.get_rank(ep_group) if ep_group is not None else 0) * local
    for name, param in split.experts.named_parameters():  # this rank's experts, and its slices of them
        whole_param = getattr(whole.experts, name.split(".")[-1])
        piece = tensor_parallel_split(param)
        expected_init, expected_grad = (
            whole_param.detach()[first : first + local],
            want[f"experts.{name}"][first : first + local],
        )
        if piece is not None:
            expected_init, expected_grad = piece.slice_of(expected_init), piece.slice_of(expected_grad)
        out[f"want/init/{name}"], out[f"want/grad/experts.{name}"] = expected_init.clone(), expected_grad.clone()
    return out


@pytest.mark.parametrize(
    "world, ep_size, swiglu, bias, all_to_one",
    [
        (2, 1, False, True, False),
        (2, 1, True, False, False),
        (2, 1, True, True, True),
        (4, 2, True, True, False),
        (4, 2, False, True, True),
    ],
)
def test_split_experts_compute_what_the_whole_experts_compute(world, ep_size, swiglu, bias, all_to_one) -> None:
    for rank, result in enumerate(run_distributed(_on_rank, world, swiglu, bias, ep_size, all_to_one)):
        names = [name[len("want/") :] for name in result if name.startswith("want/")]
        assert {"out", "grad/x", "grad/experts.w1", "grad/experts.w2", "grad/router.weight", "init/w1"} <= set(names)
        for name in names:
            torch.testing.assert_close(
                result[name], result[f"want/{name}"], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}"
            )


def _shapes_on_rank() -> dict[str, torch.Tensor]:
    layer = _layer(True, True, expert_tp_group=dist.group.WORLD)
    return {name: torch.tensor(p.shape) for name, p in layer.experts.named_parameters()}


def test_split_experts_hold_their_share_of_the_features() -> None:
    whole = {name: tuple(p.shape) for name, p in _layer(True, True).experts.named_parameters()}
    assert whole == {"w1": (E, H, 2 * F), "b1": (E, 2 * F), "w2": (E, F, H), "b2": (E, H)}
    for result in run_distributed(_shapes_on_rank, 2):  # each SwiGLU half split, the output bias whole
        assert {name: tuple(t.tolist()) for name, t in result.items()} == {
            "w1": (E, H, F),
            "b1": (E, F),
            "w2": (E, F // 2, H),
            "b2": (E, H),
        }


def test_expert_hidden_size_that_the_group_does_not_divide_stops_with_one_sentence(monkeypatch) -> None:
    monkeypatch.setattr("megatron.model.moe.experts.tp_rank_and_size", lambda group: (0, 8))
    with pytest.raises(
        ConfigError, match="experts' hidden size 12 .* not divisible by --expert-tensor-parallel-size 8"
    ):
        MoELayer(H, F, E, MoEConfig(topk=2), 0.02, 0.01, expert_tp_group=object())
