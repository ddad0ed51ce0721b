"""The MoE layer: sort dispatch against a per-token loop, and expert parallelism against EP=1."""

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.model.moe import MoEConfig, MoELayer, experts
from megatron.model.moe.experts import GroupedExperts
from megatron.model.moe.grouped_gemm import _LoopedGroupedLinear, grouped_linear
from megatron.model.transformer import swiglu as swiglu_mlp
from megatron.parallel import build_parallel_grid
from megatron.placement import expert_ids
from tests.dist_utils import run_distributed

H, FFN = 16, 32


def make_layer(
    num_experts: int,
    config: MoEConfig,
    ep_group=None,
    residual: bool = False,
    swiglu: bool = False,
    bias: bool = True,
) -> MoELayer:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, H)) if residual else None
    return MoELayer(
        H,
        FFN,
        num_experts,
        config,
        init_std=0.2,
        output_init_std=0.1,
        ep_group=ep_group,
        residual_mlp=mlp,
        swiglu=swiglu,
        bias=bias,
    )


def reference_expert(x_H: torch.Tensor, e: GroupedExperts, i: int) -> torch.Tensor:
    """Expert i on one token, with the dense MLP's own SwiGLU where the experts have it."""
    hidden = x_H @ e.w1[i] + (0 if e.b1 is None else e.b1[i])
    return (swiglu_mlp(hidden) if e.swiglu else F.gelu(hidden)) @ e.w2[i] + (0 if e.b2 is None else e.b2[i])


def loop_reference(layer: MoELayer, x_BSH: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token from the router's decisions."""
    x_TH = x_BSH.reshape(-1, H)
    gating, _ = layer.router(x_TH)
    e = layer.experts
    rows = []
    for t in range(x_TH.shape[0]):
        out = torch.zeros(H)
        for choice in range(gating.expert_ids.shape[1]):
            if gating.positions[t, choice] >= 0:
                i = int(gating.expert_ids[t, choice])
                out = out + gating.gates[t, choice] * reference_expert(x_TH[t], e, i)
        if layer.residual_mlp is not None:
            mix = F.softmax(layer.coefficient(x_TH[t]), dim=-1)
            out = out * mix[0] + layer.residual_mlp(x_TH[t]) * mix[1]
        rows.append(out)
    return torch.stack(rows).view_as(x_BSH)


@pytest.mark.parametrize(
    "k, drop, residual, drop_policy, swiglu, bias",
    [
        (1, True, False, "probs", False, True),
        (2, True, False, "probs", False, True),
        (3, False, False, "probs", False, True),
        (2, True, True, "probs", False, True),
        (3, True, False, "probs", False, True),
        (3, True, False, "position", False, True),
        (2, False, False, "probs", True, False),
        (1, True, False, "probs", True, True),
    ],
)
def test_sort_dispatch_equals_per_token_loop(k, drop, residual, drop_policy, swiglu, bias):
    config = MoEConfig(
        topk=k,
        drop_tokens=drop,
        use_rts=False,
        sample_second_expert=False,
        min_capacity=1,
        use_residual=residual,
        drop_policy=drop_policy,
    )
    layer = make_layer(6, config, residual=residual, swiglu=swiglu, bias=bias)
    x = torch.randn(3, 10, H, requires_grad=True)
    grad = torch.randn(3, 10, H)
    out = layer(x).hidden_BSH
    (out * grad).sum().backward()
    if drop:
        assert (layer.router(x.reshape(-1, H))[0].positions < 0).any(), "the case should drop some tokens"
    fast = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    reference = loop_reference(layer, x)
    (reference * grad).sum().backward()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    for a, b in zip(fast, [x.grad] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_looped_grouped_gemm_equals_grouped_mm():
    x = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(4, 8, 5, requires_grad=True)
    counts = torch.tensor([3, 0, 12, 5])
    grad = torch.randn(20, 5)
    grouped_linear(x, w, torch.zeros(4, 5), counts).backward(grad)
    expected = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    _LoopedGroupedLinear.apply(x, w, counts.tolist()).backward(grad)
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])
    assert torch.count_nonzero(w.grad[1]) == 0


@pytest.mark.parametrize(
    "gather, onednn, swiglu, bias",
    [
        (True, True, False, True),
        (False, True, False, True),
        (True, False, False, True),
        (True, True, True, False),
        (False, False, True, True),
        (True, True, False, False),
    ],
)
def test_cpu_expert_loop_equals_grouped_gemm(monkeypatch, gather, onednn, swiglu, bias):
    """The CPU path (one expert at a time; rows gathered from tokens or given; oneDNN's GEMMs or
    torch's; GELU or SwiGLU; with biases or without) against the grouped GEMM of other devices
    and the dense MLP's SwiGLU, with an expert that gets no rows and the last expert's padded rows
    past the end."""
    if not onednn:
        monkeypatch.setattr(experts, "onednn_linear_runs", lambda device_type, dtype: False)
    torch.manual_seed(0)
    layer = GroupedExperts(4, [0, 1, 2, 3], H, FFN, init_std=0.2, output_init_std=0.1, swiglu=swiglu, bias=bias)
    assert layer.w1.shape == (4, H, 2 * FFN if swiglu else FFN) and (layer.b1 is None) == (layer.b2 is None) == (
        not bias
    )
    with torch.no_grad():
        for b in (layer.b1, layer.b2) if bias else ():
            b.normal_()
    counts = torch.tensor([40, 0, 5, 33])  # padded to 40, 0, 5, 34 rows
    x_TH = torch.randn(50, H, requires_grad=True)
    token_N = torch.randint(0, 50, (78,))
    grad = torch.randn(78, H)
    rows = x_TH if gather else x_TH.index_select(0, token_N)
    layer(rows, counts, token_N if gather else None).backward(grad)
    fast = [x_TH.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x_TH.grad = None
    layer.zero_grad()
    rows_NH = x_TH.index_select(0, token_N)
    hidden = grouped_linear(rows_NH, layer.w1, layer.b1, counts)
    grouped_linear(swiglu_mlp(hidden) if swiglu else F.gelu(hidden), layer.w2, layer.b2, counts).backward(grad)
    for got, want in zip(fast, [x_TH.grad] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(fast[1][1]) == 0  # w1 of the expert without rows


def test_cpu_expert_backward_frees_each_experts_activations_once_done(monkeypatch):
    """By the time an expert's weight gradients are taken, the experts before it have let go of
    their saved pre-activations; a second backward through the same forward says why it cannot run."""
    torch.manual_seed(0)
    layer = GroupedExperts(4, [0, 1, 2, 3], H, FFN, init_std=0.2, output_init_std=0.1)
    counts = torch.tensor([6, 0, 5, 7])
    out = layer(torch.randn(18, H, requires_grad=True), counts)
    saved = [weakref.ref(h) for h in out.grad_fn.h_pW]
    alive_at_each_call = []
    real = experts.weight_gradient

    def recording(*args):
        alive_at_each_call.append([ref() is not None for ref in saved])
        real(*args)

    monkeypatch.setattr(experts, "weight_gradient", recording)
    out.backward(torch.randn(18, H), retain_graph=True)
    # two calls per expert with rows (w2, then w1), while the loop holds that expert's own block
    T, F_ = True, False
    assert alive_at_each_call == [[T, T, T, T]] * 2 + [[F_, F_, T, T]] * 2 + [[F_, F_, F_, T]] * 2
    assert [ref() for ref in saved] == [None] * 4
    with pytest.raises(RuntimeError, match="backward ran twice through one forward"):
        out.backward(torch.randn(18, H))


def test_expert_gradient_buffers_are_reused_but_never_under_a_live_gradient():
    layer = make_layer(4, MoEConfig(use_rts=False))
    x, grad = torch.randn(2, 12, H), torch.randn(2, 12, H)

    def backward() -> None:
        output = layer(x)
        out, loss = output.hidden_BSH, output.router_loss
        ((out * grad).sum() + loss).backward()

    backward()
    once, address = layer.experts.w1.grad.clone(), layer.experts.w1.grad.data_ptr()
    layer.zero_grad(set_to_none=True)
    backward()
    assert layer.experts.w1.grad.data_ptr() == address  # the freed gradient's buffer came back
    backward()  # accumulates into .grad, which holds the buffer: this step's gradient goes elsewhere
    torch.testing.assert_close(layer.experts.w1.grad, 2 * once)
    held = layer.experts.w1.grad
    layer.zero_grad(set_to_none=True)
    backward()
    torch.testing.assert_close(held, 2 * once)  # a gradient someone still holds is left alone
    torch.testing.assert_close(layer.experts.w1.grad, once)


def test_frozen_experts_take_no_gradient_buffers():
    layer = make_layer(4, MoEConfig(use_rts=False))
    layer.experts.requires_grad_(False)
    x = torch.randn(2, 12, H, requires_grad=True)
    output = layer(x)
    out, loss = output.hidden_BSH, output.router_loss
    (out.sum() + loss).backward()
    assert x.grad is not None and layer.experts.w1.grad is None and layer.router.weight.grad is not None
    assert not layer.experts.grad_buffers._cache


def test_layer_runs_under_bf16_autocast():
    layer = make_layer(4, MoEConfig(topk=2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = layer(torch.randn(2, 8, H))
        out, loss = output.hidden_BSH, output.router_loss
    assert out.dtype == torch.float32 and loss.dtype == torch.float32 and torch.isfinite(out).all()


def _ep_versus_full(
    num_experts: int, ep_size: int, k: int, drop: bool, route_all_to_first: bool
) -> dict[str, torch.Tensor]:
    """On every rank: the EP layer and a full EP=1 copy on this rank's own tokens."""
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    config = MoEConfig(topk=k, drop_tokens=drop, use_rts=False, sample_second_expert=False, min_capacity=1)
    ep_layer = make_layer(num_experts, config, ep_group=grid.ep_group)
    full = make_layer(num_experts, config)
    torch.manual_seed(100 + grid.rank)
    x = torch.randn(2, 12, H)
    if route_all_to_first:  # every token picks expert 0: the other ranks' experts receive nothing
        x = x.abs()
        for layer in (ep_layer, full):
            with torch.no_grad():
                layer.router.weight.zero_()
                layer.router.weight[0] = 1.0
    grad = torch.randn(2, 12, H)
    results = {}
    for name, layer in (("ep", ep_layer), ("full", full)):
        output = layer(x)
        out, loss = output.hidden_BSH, output.router_loss
        ((out * grad).sum() + loss).backward()
        results[f"{name}_out"] = out.detach()
        results[f"{name}_loss"] = loss.detach()
        results[f"{name}_router_grad"] = layer.router.weight.grad
    local = list(expert_ids(ep_layer.experts.w1))
    for param in ("w1", "b1", "w2", "b2"):
        full_grad = getattr(full.experts, param).grad.clone()
        dist.all_reduce(full_grad, group=grid.ep_group)  # an expert's gradient sums its EP group's tokens
        results[f"full_{param}_grad"] = full_grad[local]
        results[f"ep_{param}_grad"] = getattr(ep_layer.experts, param).grad
    return results


@pytest.mark.parametrize("world, k, drop", [(2, 1, True), (2, 2, False), (4, 2, True)])
def test_expert_parallel_equals_single_rank(world, k, drop):
    for rank, result in enumerate(run_distributed(_ep_versus_full, world, 8, world, k, drop, False)):
        for name in ("out", "loss", "router_grad", "w1_grad", "b1_grad", "w2_grad", "b2_grad"):
            torch.testing.assert_close(
                result[f"ep_{name}"], result[f"full_{name}"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}"
            )


def test_ranks_whose_experts_receive_no_tokens_do_not_hang():
    results = run_distributed(_ep_versus_full, 2, 4, 2, 1, False, True)
    torch.testing.assert_close(results[0]["ep_out"], results[0]["full_out"])
    assert torch.count_nonzero(results[1]["ep_w1_grad"]) == 0  # rank 1 holds experts 2 and 3
    assert torch.count_nonzero(results[0]["ep_w1_grad"][0]) > 0


def test_router_loss_is_weighted_aux_plus_z_loss():
    x = torch.randn(2, 8, H)
    plain = make_layer(4, MoEConfig(aux_loss_coeff=0.5, use_rts=False))
    with_z = make_layer(4, MoEConfig(aux_loss_coeff=0.5, z_loss_coeff=0.1, use_rts=False))
    plain_loss, z_loss = plain(x).router_loss, with_z(x).router_loss
    gating, logits = plain.router(x.reshape(-1, H))
    torch.testing.assert_close(plain_loss, 0.5 * gating.l_aux)
    torch.testing.assert_close(z_loss - plain_loss, 0.1 * torch.logsumexp(logits, dim=-1).square().mean())


def test_expert_biases_get_no_weight_decay_and_expert_matrices_do():
    from megatron.runtime.config.schema import RuntimeConfig
    from megatron.runtime.optimizer_factory import build_optimizer

    layer = make_layer(4, MoEConfig())
    optimizer = build_optimizer(layer, RuntimeConfig(optimizer={"params": {"weight_decay": 0.1}}))
    decay = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    e = layer.experts
    assert {id(e.w1), id(e.w2), id(layer.router.weight)} <= decay
    assert not {id(e.b1), id(e.b2)} & decay
