"""Megatron-Core's routing options (--moe-router-*): each against its formula worked out token by
token in plain Python, against the Hugging Face routers it stands for, the expert bias in training
(EP=2 equal to EP=1, skipped steps, checkpoints), the balancing losses, the refusals and the flags."""

import math

import pytest
import torch
from transformers import Glm4MoeConfig, MixtralConfig, Qwen2MoeConfig
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from megatron.config.flags import parse_args
from megatron.errors import ConfigError, TrainingStopped
from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe.expert_bias import update_expert_biases
from megatron.model.moe.router import Router, topk_gating
from megatron.model.moe.scoring import score_topk
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.placement import expert_ids
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import poisoned_forward, tiny_config, write_corpus

H = 16
SINGLE = single_process_grid(torch.device("cpu"))


def softmax(values):
    m = max(values)
    ex = [math.exp(v - m) for v in values]
    return [v / sum(ex) for v in ex]


def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


def best(values, among, n):
    return sorted(among, key=lambda e: -values[e])[:n]


def naive_route(
    row, k, score="softmax", pre_softmax=False, bias=None, groups=None, group_topk=None, scale=None, norm=True
):
    """One token's {expert: gate} by Megatron-Core's topk_routing_with_score_function and group_limited_topk."""
    num_experts = len(row)
    if score == "softmax":
        choice = softmax(row) if pre_softmax else list(row)
    else:
        scores = [sigmoid(v) for v in row]
        choice = [s + (bias[e] if bias is not None else 0.0) for e, s in enumerate(scores)]
    allowed = range(num_experts)
    if group_topk:
        size = num_experts // groups
        group_score = [
            sum(sorted(choice[g * size : (g + 1) * size], reverse=True)[: k // group_topk]) for g in range(groups)
        ]
        kept_groups = best(group_score, range(groups), group_topk)
        allowed = [e for e in range(num_experts) if e // size in kept_groups]
    chosen = best(choice, allowed, k)
    if score == "softmax":
        gates = [choice[e] for e in chosen] if pre_softmax else softmax([row[e] for e in chosen])
    else:
        gates = [scores[e] for e in chosen]
        if k > 1 and norm:
            gates = [g / (sum(gates) + 1e-20) for g in gates]
    return {e: g * (scale or 1.0) for e, g in zip(chosen, gates)}


def as_dicts(expert_SK, gates_SK):
    return [dict(zip(e.tolist(), g.tolist())) for e, g in zip(expert_SK, gates_SK)]


def assert_routes_equal(ours, expected, tol=1e-6):
    """Per token the same experts with the same gates (in any order)."""
    assert len(ours) == len(expected)
    for token, (a, b) in enumerate(zip(ours, expected)):
        assert set(a) == set(b), (token, a, b)
        for e in a:
            assert a[e] == pytest.approx(b[e], rel=tol, abs=tol), (token, e, a, b)


# ---------------------------------------------------------------- each option against its formula

HAND_LOGITS = [
    [5.0, -5.0, 3.0, 2.9, 0.0, 0.0, 0.0, 0.0],  # best single expert 0, best pair of experts 2 and 3
    [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
    [-1.0, 2.0, -3.0, 0.5, 1.5, -0.4, 0.0, 1.0],
    [2.0, 2.5, -1.0, -1.0, 1.0, 3.0, -2.0, 0.2],
]
CASES = [
    dict(k=2, score="softmax"),
    dict(k=3, score="softmax"),
    dict(k=1, score="softmax", pre_softmax=True),
    dict(k=3, score="softmax", pre_softmax=True),
    dict(k=2, score="softmax", scale=2.5),
    dict(k=2, score="softmax", groups=4, group_topk=1),
    dict(k=4, score="softmax", pre_softmax=True, groups=4, group_topk=2, scale=1.5),
    dict(k=1, score="sigmoid"),
    dict(k=3, score="sigmoid"),
    dict(k=3, score="sigmoid", norm=False),
    dict(k=2, score="sigmoid", bias=[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0]),
    dict(k=4, score="sigmoid", bias=[0.1, -0.2, 0.0, 0.3, 0.0, -0.1, 0.2, 0.0], groups=4, group_topk=2, scale=2.5),
    dict(k=2, score="sigmoid", groups=2, group_topk=1),
]


def config_for(k, score, pre_softmax=False, bias=None, groups=None, group_topk=None, scale=None, norm=True, **more):
    return MoEConfig(
        topk=k,
        router_score_function=score,
        router_pre_softmax=pre_softmax,
        router_enable_expert_bias=bias is not None,
        router_num_groups=groups,
        router_group_topk=group_topk,
        router_topk_scaling_factor=scale,
        router_norm_topk_prob=norm,
        **more,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "bias"))
def test_score_topk_follows_megatron_cores_formulas(case):
    torch.manual_seed(0)
    bias = case.get("bias")
    for logits in (torch.tensor(HAND_LOGITS), torch.randn(40, 8) * 2):
        gates_SK, expert_SK = score_topk(logits, config_for(**case), None if bias is None else torch.tensor(bias))
        expected = [naive_route(row, **case) for row in logits.double().tolist()]
        assert_routes_equal(as_dicts(expert_SK, gates_SK), expected)


def test_group_limited_routing_passes_over_a_lone_best_expert():
    gates_SK, expert_SK = score_topk(
        torch.tensor(HAND_LOGITS[:1]), config_for(k=2, score="softmax", groups=4, group_topk=1), None
    )
    assert expert_SK[0].tolist() == [2, 3]  # group {2, 3} scores 5.9, group {0, 1} only 0
    torch.testing.assert_close(gates_SK[0], torch.softmax(torch.tensor([3.0, 2.9]), 0))
    _, plain_SK = score_topk(torch.tensor(HAND_LOGITS[:1]), config_for(k=2, score="softmax"), None)
    assert 0 in plain_SK[0].tolist()


def test_expert_bias_changes_the_choice_but_not_the_gates():
    torch.manual_seed(1)
    logits = torch.randn(64, 8)
    config = config_for(k=2, score="sigmoid", bias=[0.0] * 8)
    bias = torch.zeros(8)
    bias[5] = 2.0  # beats any sigmoid difference: every token takes expert 5
    gates_SK, expert_SK = score_topk(logits, config, bias)
    assert (expert_SK == 5).any(dim=1).all()
    plain_gates_SK, plain_SK = score_topk(logits, config, torch.zeros(8))
    assert not (plain_SK == 5).any(dim=1).all()
    scores = torch.sigmoid(logits)
    chosen = scores.gather(1, expert_SK)
    torch.testing.assert_close(gates_SK, chosen / chosen.sum(1, keepdim=True))  # gates of the unbiased scores
    unchanged = (torch.sort(plain_SK, 1).values == torch.sort(expert_SK, 1).values).all(1)
    assert unchanged.any()
    torch.testing.assert_close(gates_SK[unchanged].sort(1).values, plain_gates_SK[unchanged].sort(1).values)


def naive_capacity(routes, num_experts, cap, policy):
    """Megatron-Core's capacity after the choice: per expert the `cap` choices of highest gate (earlier
    tokens first among equals) or of the earliest tokens; kept gates as they were."""
    kept = set()
    for e in range(num_experts):
        takers = [(t, g) for t, route in enumerate(routes) for x, g in route.items() if x == e]
        if policy == "probs":
            takers = sorted(takers, key=lambda tg: (-tg[1], tg[0]))
        kept |= {(t, e) for t, _ in takers[:cap]}
    return kept


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_applies_after_the_choice_without_renormalising(policy):
    torch.manual_seed(2)
    logits_SE = torch.randn(30, 4)
    logits_SE[:, 1] += 1.5  # expert 1 overfull
    config = MoEConfig(
        topk=2, router_score_function="softmax", train_capacity_factor=0.5, min_capacity=1, drop_policy=policy
    )
    router = Router(4, 4, config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    gating, _ = router(logits_SE)  # identity weight: the logits are the inputs
    gates = gating.gates.detach()
    routes = [naive_route(row, 2) for row in logits_SE.double().tolist()]
    kept = naive_capacity(routes, 4, math.ceil(30 / 4 * 0.5 * 2), policy)  # DeepSpeed's capacity: 8
    assert len(kept) < 60
    for t in range(30):
        for choice in range(2):
            e = int(gating.expert_ids[t, choice])
            expected = routes[t][e] if (t, e) in kept else 0.0
            assert float(gates[t, choice]) == pytest.approx(expected, abs=1e-6)
            assert (int(gating.positions[t, choice]) >= 0) == ((t, e) in kept)
    for e in range(4):  # kept choices take slots 0..n-1 in token order
        slots = gating.positions[(gating.expert_ids == e) & (gating.positions >= 0)]
        assert slots.tolist() == list(range(len(slots)))
    assert gating.tokens_per_expert.tolist() == [sum(e in r for r in routes) for e in range(4)]  # before dropping


def test_deepspeed_gating_is_untouched_without_the_new_flags():
    torch.manual_seed(3)
    x = torch.randn(40, H)
    for config in (
        MoEConfig(topk=1, use_rts=False),
        MoEConfig(topk=2, sample_second_expert=False),
        MoEConfig(topk=3, drop_policy="position", train_capacity_factor=0.7),
    ):
        assert not config.megatron_core_routing
        router = Router(H, 8, config).eval()
        gating, logits = router(x)
        expected = topk_gating(
            logits, config.topk, config.eval_capacity_factor, config.min_capacity, drop_policy=config.drop_policy
        )
        for ours, theirs in zip(gating, expected):
            assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- the Hugging Face routers


def routed(router, x):
    gating, _ = router(x)
    assert (gating.positions >= 0).all()
    return as_dicts(gating.expert_ids, gating.gates)


def hf_routes(hf_router, x):
    _, gates, experts = hf_router(x)
    return as_dicts(experts, gates.float())


def our_router(num_experts, **options):
    torch.manual_seed(4)
    return Router(H, num_experts, MoEConfig(drop_tokens=False, **options)).eval()


def with_weights(hf_router, router):
    with torch.no_grad():
        hf_router.weight.copy_(router.weight)
        if router.expert_bias is not None:
            hf_router.e_score_correction_bias.copy_(router.expert_bias)
    return hf_router.eval()


@pytest.mark.parametrize("k, norm", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_qwen2_moe_router(k, norm):
    """norm_topk_prob True: softmax over the top-k logits; False: --moe-router-pre-softmax, or at k = 1
    DeepSpeed's top-1 gating as well."""
    options = dict(router_score_function="softmax") if norm else dict(router_pre_softmax=True)
    router = our_router(8, topk=k, **options)
    hf = with_weights(
        Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=H, num_experts=8, num_experts_per_tok=k, norm_topk_prob=norm)),
        router,
    )
    x = torch.randn(64, H)
    assert_routes_equal(routed(router, x), hf_routes(hf, x))
    if k == 1:
        assert_routes_equal(routed(our_router(8, topk=1), x), hf_routes(hf, x))


@pytest.mark.parametrize("k", [2, 4])
def test_mixtral_router(k):
    router = our_router(8, topk=k, router_score_function="softmax")
    hf = with_weights(
        MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=k)), router
    )
    x = torch.randn(64, H) * 3
    assert_routes_equal(routed(router, x), hf_routes(hf, x))


SIGMOID_ROUTERS = [
    # (HF class, config class, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    (Glm4MoeTopkRouter, Glm4MoeConfig, 4, 1, 1, True, 1.0),
    (Glm4MoeTopkRouter, Glm4MoeConfig, 4, 4, 2, True, 2.5),
    (Glm4MoeTopkRouter, Glm4MoeConfig, 3, 1, 1, False, 1.8),
    (DeepseekV3TopkRouter, DeepseekV3Config, 4, 4, 2, True, 2.5),
    (DeepseekV3TopkRouter, DeepseekV3Config, 2, 8, 1, True, 1.0),
    (DeepseekV3TopkRouter, DeepseekV3Config, 4, 2, 2, False, 1.0),
    (DeepseekV3TopkRouter, DeepseekV3Config, 1, 1, 1, False, 1.0),
]


@pytest.mark.parametrize("hf_class, config_class, k, n_group, topk_group, norm, scale", SIGMOID_ROUTERS)
def test_glm4_moe_and_deepseek_v3_routers(hf_class, config_class, k, n_group, topk_group, norm, scale):
    groups = dict(router_num_groups=n_group, router_group_topk=topk_group) if n_group > 1 else {}
    router = our_router(
        16,
        topk=k,
        router_score_function="sigmoid",
        router_enable_expert_bias=True,
        router_norm_topk_prob=norm,
        router_topk_scaling_factor=None if scale == 1.0 else scale,
        **groups,
    )
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(16) * 0.05)
    hf_config = config_class(
        hidden_size=H,
        n_routed_experts=16,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    hf = with_weights(hf_class(hf_config), router)
    x = torch.randn(64, H)
    assert_routes_equal(routed(router, x), hf_routes(hf, x))


# ---------------------------------------------------------------- balancing losses


def naive_switch_loss(rows, k):
    """Megatron-Core's switch_load_balancing_loss_func: E / (k T^2) sum_e (sum_t p_te) x (choices of e)."""
    probs = [softmax(r) for r in rows]
    num_tokens, num_experts = len(rows), len(rows[0])
    counts = [0] * num_experts
    for p in probs:
        for e in best(p, range(num_experts), k):
            counts[e] += 1
    return num_experts / (k * num_tokens**2) * sum(sum(p[e] for p in probs) * counts[e] for e in range(num_experts))


def naive_sequence_loss(rows, k, num_sequences, score="softmax"):
    """Megatron-Core's sequence_load_balancing_loss_func, one sequence at a time."""
    probs = (
        [softmax(r) for r in rows]
        if score == "softmax"
        else [[sigmoid(v) / (sum(map(sigmoid, r)) + 1e-20) for v in r] for r in rows]
    )
    length, num_experts = len(rows) // num_sequences, len(rows[0])
    losses = []
    for b in range(num_sequences):
        seq = probs[b * length : (b + 1) * length]
        counts = [0] * num_experts
        for p in seq:
            for e in best(p, range(num_experts), k):
                counts[e] += 1
        cost = [c / (length * k / num_experts) for c in counts]
        losses.append(sum(cost[e] * sum(p[e] for p in seq) / length for e in range(num_experts)))
    return sum(losses) / num_sequences


def make_layer(num_experts, config):
    torch.manual_seed(5)
    return MoELayer(H, 32, num_experts, config, init_std=0.2, output_init_std=0.1)


@pytest.mark.parametrize("options", [{}, dict(router_score_function="softmax"), dict(router_score_function="sigmoid")])
def test_seq_aux_loss_is_the_mean_of_per_sequence_losses(options):
    """Through the layer: its router loss is coeff x the loss of each sequence of the [B, S] batch."""
    config = MoEConfig(topk=2, router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1, **options)
    layer = make_layer(8, config).eval()
    torch.manual_seed(6)
    x_BSH = torch.randn(3, 10, H)
    with torch.no_grad():
        loss = layer(x_BSH).router_loss
    logits = (x_BSH.reshape(-1, H).double() @ layer.router.weight.double().T).tolist()
    expected = naive_sequence_loss(logits, 2, 3, config.score_function)
    assert float(loss) == pytest.approx(0.1 * expected, rel=1e-5)
    assert float(loss) != pytest.approx(0.1 * naive_sequence_loss(logits, 2, 1, config.score_function), rel=1e-3)


def test_deepspeed_gating_with_seq_aux_loss_keeps_its_routes():
    config = MoEConfig(topk=2, sample_second_expert=False, router_load_balancing_type="seq_aux_loss")
    router = Router(H, 8, config).eval()
    with torch.no_grad():
        gating, logits = router(torch.randn(20, H), num_sequences=2)
    deepspeed = topk_gating(logits, 2, 1.0, 4)
    for ours, theirs in zip(gating[1:], deepspeed[1:]):
        assert torch.equal(ours, theirs)
    assert float(gating.l_aux) == pytest.approx(naive_sequence_loss(logits.double().tolist(), 2, 2), rel=1e-5)


def test_aux_loss_of_megatron_core_routing_is_its_switch_loss():
    router = Router(
        H, 8, MoEConfig(topk=2, router_score_function="softmax", router_group_topk=1, router_num_groups=4)
    ).eval()
    with torch.no_grad():
        gating, logits = router(torch.randn(30, H))
    # counted over the unbiased, ungrouped top-k, whatever the groups chose
    assert float(gating.l_aux) == pytest.approx(naive_switch_loss(logits.double().tolist(), 2), rel=1e-5)


@pytest.mark.parametrize("options", [{}, dict(router_score_function="sigmoid", topk=2)])
def test_no_balancing_loss(options):
    layer = make_layer(4, MoEConfig(**{"topk": 1, **options}, router_load_balancing_type="none", z_loss_coeff=0.0))
    x = torch.randn(2, 6, H)
    output = layer(x)
    out, loss = output.hidden_BSH, output.router_loss
    assert float(loss) == 0.0 and float(output.routing.l_aux) == 0.0
    (out.sum() + loss).backward()  # the router still learns through the gates
    assert layer.router.weight.grad.abs().sum() > 0


def test_router_entropy_statistic_uses_the_routers_probabilities():
    layer = make_layer(4, MoEConfig(topk=2, router_score_function="sigmoid"))
    x = torch.randn(2, 6, H)
    routing = layer(x).routing
    scores = torch.sigmoid(x.reshape(-1, H) @ layer.router.weight.T)
    p = scores / scores.sum(1, keepdim=True)
    torch.testing.assert_close(routing.entropy_sum, -(p * p.log()).sum())


# ---------------------------------------------------------------- expert bias: the update and training

BIASED = dict(topk=2, router_score_function="sigmoid", router_enable_expert_bias=True, router_bias_update_rate=0.01)


def test_expert_bias_is_a_saved_buffer_and_counts_training_forwards_only():
    router = Router(H, 4, MoEConfig(**BIASED))
    assert "expert_bias" in router.state_dict() and "local_tokens_per_expert" not in router.state_dict()
    assert "expert_bias" not in Router(H, 4, MoEConfig(topk=2)).state_dict()  # old checkpoints still load
    x = torch.randn(12, H)
    router(x)
    router(x)
    with torch.no_grad():
        router(x)  # activation recomputation aside, no-grad forwards are not training steps
    router.eval()(x)
    assert int(router.local_tokens_per_expert.sum()) == 2 * 12 * 2


def test_update_rule_moves_against_the_load_and_clears_the_counts():
    model = torch.nn.ModuleDict(
        {
            "a": Router(H, 4, MoEConfig(**BIASED)),
            "b": Router(H, 2, MoEConfig(**BIASED)),
            "plain": Router(H, 4, MoEConfig(topk=2)),
        }
    )
    model["a"].local_tokens_per_expert.copy_(torch.tensor([5, 1, 3, 3]))
    model["b"].local_tokens_per_expert.copy_(torch.tensor([0, 4]))
    update_expert_biases(model, None, step_taken=True)
    torch.testing.assert_close(model["a"].expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    torch.testing.assert_close(model["b"].expert_bias, torch.tensor([0.01, -0.01]))
    assert int(model["a"].local_tokens_per_expert.sum()) == 0 == int(model["b"].local_tokens_per_expert.sum())
    model["a"].local_tokens_per_expert.copy_(torch.tensor([9, 0, 0, 0]))
    update_expert_biases(model, None, step_taken=False)  # a skipped step: counts dropped, bias kept
    torch.testing.assert_close(model["a"].expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert int(model["a"].local_tokens_per_expert.sum()) == 0


MOE = {
    "num_experts": 4,
    "num_layers": 2,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "topk": 2,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_bias_update_rate": 0.01,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _biases(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: buffer.clone() for name, buffer in trainer.engine.module.named_buffers() if name.endswith("expert_bias")
    }


def test_expert_bias_moves_in_training_and_is_checkpointed(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    trainer = Trainer(tiny_config(corpus, train_iters=4, save=save, **MOE), SINGLE)
    trainer.train()
    ((name, bias),) = _biases(trainer).items()
    assert name == "layers.1.mlp.router.expert_bias"
    steps = bias / 0.01
    assert bias.abs().sum() > 0 and torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 4
    resumed = Trainer(tiny_config(corpus, train_iters=4, load=save, **MOE), SINGLE)
    assert resumed.iteration == 4
    torch.testing.assert_close(_biases(resumed)[name], bias, rtol=0, atol=0)


def test_skipped_fp16_steps_leave_the_bias_alone(corpus):
    overflowing = poisoned_forward(float("inf"), lambda engine: True)
    trainer = Trainer(tiny_config(corpus, train_iters=3, fp16=True, initial_loss_scale=256, **MOE), SINGLE, overflowing)
    with pytest.raises(TrainingStopped, match="all 3 iterations of this run skipped their step"):
        trainer.train()
    assert trainer.engine.skipped_steps == 3
    (bias,) = _biases(trainer).values()
    assert bias.abs().sum() == 0
    router = trainer.engine.module.layers[1].mlp.router
    assert int(router.local_tokens_per_expert.sum()) == 0


def _train_biased(corpus: str, ep_size: int, train_iters: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    config = tiny_config(
        corpus,
        dp_size=grid.dp_size,
        train_iters=train_iters,
        micro_batch_size=1,
        global_batch_size=4,
        moe_expert_parallel_size=ep_size,
        **MOE,
    )
    trainer = Trainer(config, grid)
    result = trainer.train()
    out = {"losses": torch.tensor(result.losses, dtype=torch.float64), **_biases(trainer)}
    for name, param in trainer.engine.module.named_parameters():
        if expert_ids(param) is None:
            out[name] = param.detach().clone()
    return out


def test_ep2_trains_exactly_like_ep1_with_the_expert_bias(corpus):
    ep1 = run_distributed(_train_biased, 2, corpus, 1, 5)
    ep2 = run_distributed(_train_biased, 2, corpus, 2, 5)
    bias = "layers.1.mlp.router.expert_bias"
    assert ep1[0][bias].abs().sum() > 0
    for rank in range(2):
        torch.testing.assert_close(ep1[rank][bias], ep1[0][bias], rtol=0, atol=0)  # every rank applies one update
        torch.testing.assert_close(ep2[rank]["losses"], ep1[rank]["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ep2[rank].items():
            torch.testing.assert_close(value, ep1[rank][name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- refusals and flags


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(router_score_function="tanh"), "unknown --moe-router-score-function 'tanh'"),
        (dict(router_load_balancing_type="sinkhorn"), "unknown --moe-router-load-balancing-type 'sinkhorn'"),
        (
            dict(topk=2, router_score_function="sigmoid", router_pre_softmax=True),
            "--moe-router-pre-softmax applies to softmax",
        ),
        (
            dict(topk=2, router_norm_topk_prob=False),
            "--disable-moe-router-norm-topk-prob applies to --moe-router-score-function sigmoid",
        ),
        (
            dict(topk=2, router_pre_softmax=True, router_enable_expert_bias=True),
            "--moe-router-enable-expert-bias needs sigmoid",
        ),
        (dict(topk=2, router_score_function="sigmoid", router_group_topk=1), "add --moe-router-num-groups"),
        (dict(topk=2, router_score_function="sigmoid", router_num_groups=2), "only with --moe-router-group-topk"),
        (
            dict(topk=4, router_score_function="sigmoid", router_num_groups=2, router_group_topk=3),
            "exceeds --moe-router-num-groups 2",
        ),
        (
            dict(topk=3, router_score_function="sigmoid", router_num_groups=4, router_group_topk=2),
            "--topk 3 is not a multiple",
        ),
        (dict(topk=1, router_score_function="softmax"), "add --moe-router-pre-softmax"),
        (dict(topk=1, router_pre_softmax=True, noisy_gate_policy="RSample"), "RSample is DeepSpeed's top-1 gate noise"),
    ],
)
def test_invalid_combinations_stop_with_one_sentence(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        MoEConfig(**options)


def test_expert_counts_the_groups_do_not_fit_are_refused():
    config = MoEConfig(topk=4, router_score_function="sigmoid", router_num_groups=4, router_group_topk=1)
    with pytest.raises(ConfigError, match="--moe-router-num-groups 4 does not divide a layer's 6 experts"):
        Router(H, 6, config)
    with pytest.raises(ConfigError, match="takes 4 experts from a group of 2; use fewer, larger groups"):
        Router(H, 8, config)
    Router(H, 16, config)


def test_the_megatron_core_drop_policy_applies_to_any_k():
    MoEConfig(topk=2, router_score_function="softmax", drop_policy="position")
    with pytest.raises(ConfigError, match="applies to --topk 3 or more"):
        MoEConfig(topk=2, drop_policy="position")


BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--data-path",
    "corpus",
    "--train-iters",
    "10",
    "--num-experts",
    "8",
]


def test_flags_parse_into_the_moe_config():
    moe = parse_args(
        BASE
        + [
            "--moe-router-topk",
            "4",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-topk-scaling-factor",
            "2.5",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "0.002",
            "--moe-router-num-groups",
            "4",
            "--moe-router-group-topk",
            "2",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--disable-moe-router-norm-topk-prob",
        ]
    ).model.moe
    assert (moe.topk, moe.router_score_function, moe.router_topk_scaling_factor) == (4, "sigmoid", 2.5)
    assert moe.router_enable_expert_bias and moe.router_bias_update_rate == 0.002
    assert (moe.router_num_groups, moe.router_group_topk) == (4, 2)
    assert moe.router_load_balancing_type == "seq_aux_loss" and not moe.router_norm_topk_prob
    assert moe.megatron_core_routing
    default = parse_args(BASE).model.moe
    assert not default.megatron_core_routing and default.router_load_balancing_type == "aux_loss"
    assert default.router_bias_update_rate == 1e-3 and default.router_norm_topk_prob
    pre = parse_args(BASE + ["--moe-router-pre-softmax"]).model.moe
    assert pre.megatron_core_routing and pre.score_function == "softmax"


def test_flags_check_the_groups_against_every_layers_expert_count():
    with pytest.raises(ConfigError, match="--moe-router-num-groups 3 does not divide a layer's 8 experts"):
        parse_args(
            BASE
            + [
                "--topk",
                "2",
                "--moe-router-score-function",
                "sigmoid",
                "--moe-router-num-groups",
                "3",
                "--moe-router-group-topk",
                "1",
            ]
        )
