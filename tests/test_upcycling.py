"""--moe-use-upcycling: an MoE model started from a dense checkpoint computes what the dense model
computes (dropless), under any expert-parallel size, and a restarted upcycled run resumes its own
checkpoints."""

from dataclasses import replace

import pytest
import torch

from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoEConfig
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.placement import expert_ids
from megatron.training.loop import Trainer
from megatron.training.upcycling import check_upcycling, upcycle
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_config, write_corpus

DENSE = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    max_position_embeddings=16,
    ffn_hidden_size=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_method_std=0.1,
)
MODERN = dict(
    swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope", num_query_groups=2
)


def dropless(topk: int) -> MoEConfig:
    return MoEConfig(topk=topk, drop_tokens=False, use_rts=False, sample_second_expert=False)


def dense_and_upcycled(dense: GPTConfig, moe: GPTConfig, ep_group=None) -> tuple[GPTModel, GPTModel, str]:
    torch.manual_seed(0)
    dense_model = GPTModel(dense).eval()
    with torch.no_grad():  # biases and norms away from their zero/one init, so copying them is tested too
        for name, param in dense_model.named_parameters():
            if "bias" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    torch.manual_seed(1)
    moe_model = GPTModel(moe, ep_group=ep_group).eval()
    line = upcycle(moe_model, dense_model.state_dict().__getitem__, dense)
    return dense_model, moe_model, line


TOKENS = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))


SIGMOID = dict(router_score_function="sigmoid", router_enable_expert_bias=True, router_topk_scaling_factor=2.5)


@pytest.mark.parametrize(
    "extra, experts, ffn, topk, mlp_type, routing",
    [
        ({}, 4, 64, 2, "standard", {}),  # GELU experts with biases, each a whole copy
        (MODERN, 4, 32, 2, "standard", {}),  # SwiGLU without biases, 2 slices of the dense MLP per copy
        ({}, 8, 16, 4, "standard", {}),  # 4 slices, top-4 (DeepSpeed's top-k path)
        ({"swiglu": True}, 4, 64, 2, "residual", {}),  # PR-MoE: the residual MLP is the dense MLP
        ({}, 8, 32, 4, "standard", SIGMOID),  # normalised sigmoid gates that sum to the scaling factor
        (MODERN, 4, 64, 2, "standard", {"router_score_function": "softmax"}),  # Megatron-Core's softmax
    ],
)
def test_upcycled_model_computes_what_the_dense_model_computes(extra, experts, ffn, topk, mlp_type, routing):
    dense = replace(DENSE, **extra)
    moe = replace(
        dense,
        num_experts=(experts,),
        moe_ffn_hidden_size=ffn,
        mlp_type=mlp_type,
        moe=replace(dropless(topk), use_residual=mlp_type == "residual", **routing),
    )
    check_upcycling(moe, dense, "dense")
    dense_model, moe_model, line = dense_and_upcycled(dense, moe)
    with torch.no_grad():
        torch.testing.assert_close(moe_model(TOKENS).logits_BSV, dense_model(TOKENS).logits_BSV, rtol=1e-5, atol=1e-5)
        router = moe_model.layers[1].mlp.router.weight
        granularity = 64 // ffn
        assert torch.equal(router, router[::granularity].repeat_interleave(granularity, dim=0))
        assert len(router.unique(dim=0)) == experts // granularity  # copies differ, their own slices score alike
    assert f"second weights scaled by {granularity / routing.get('router_topk_scaling_factor', 1):g}" in line


def test_top1_keeps_the_router_probability_and_is_scaled_by_the_expert_count():
    """DeepSpeed's top-1 gate is the router probability (1/E for a zero router): Megatron-Core's
    factor E * g / k then gives back the dense output exactly."""
    moe = replace(DENSE, num_experts=(4,), moe=dropless(1))
    dense_model, moe_model, line = dense_and_upcycled(DENSE, moe)
    experts = moe_model.layers[1].mlp.experts
    dense_w2 = dense_model.layers[1].mlp.dense_4h_to_h.weight
    torch.testing.assert_close(experts.w2[3], dense_w2.t() * 4)
    with torch.no_grad():
        moe_model.layers[1].mlp.router.weight.zero_()
        torch.testing.assert_close(moe_model(TOKENS).logits_BSV, dense_model(TOKENS).logits_BSV, rtol=1e-5, atol=1e-5)
    assert "second weights scaled by 4" in line


def _upcycle_under_ep(ep_size: int) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    moe = replace(DENSE, **MODERN, num_experts=(4,), moe_ffn_hidden_size=32, moe=dropless(2))
    dense_model, moe_model, _ = dense_and_upcycled(replace(DENSE, **MODERN), moe, grid.ep_group)
    experts = moe_model.layers[1].mlp.experts
    with torch.no_grad():
        return {
            "moe": moe_model(TOKENS).logits_BSV,
            "dense": dense_model(TOKENS).logits_BSV,
            **{f"w1[{g}]": experts.w1[i].clone() for i, g in enumerate(expert_ids(experts.w1))},
        }


def test_upcycling_under_expert_parallelism_gives_each_rank_its_experts():
    single = _upcycle_under_ep(1)
    for rank, result in enumerate(run_distributed(_upcycle_under_ep, 2, 2)):
        torch.testing.assert_close(result["moe"], result["dense"], rtol=1e-5, atol=1e-5)
        assert {key for key in result if key.startswith("w1")} == {f"w1[{2 * rank}]", f"w1[{2 * rank + 1}]"}
        for key in ("w1[0]", "w1[1]", "w1[2]", "w1[3]"):
            if key in result:
                torch.testing.assert_close(result[key], single[key], rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": (1,)}, "the flags give none"),
        ({"hidden_size": 48, "num_experts": (4,)}, r"hidden_size 32 there, 48 here"),
        ({"num_experts": (4,), "moe_ffn_hidden_size": 24}, "--moe-ffn-hidden-size 24 does not divide"),
        ({"num_experts": (6,), "moe_ffn_hidden_size": 16}, "6 experts are not a multiple of the 4 slices"),
        (
            {"num_experts": (4,), "moe_ffn_hidden_size": 32, "moe": dropless(1)},
            "--moe-router-topk 1 does not choose whole",
        ),
        ({"num_experts": (4,), "moe_shared_expert_intermediate_size": 16}, "cannot start shared experts"),
    ],
)
def test_a_model_that_cannot_be_upcycled_is_refused_with_the_reason(change, message):
    with pytest.raises(ConfigError, match=message):
        check_upcycling(replace(DENSE, **change), DENSE, "dense")
    with pytest.raises(ConfigError, match="already has MoE layers"):
        check_upcycling(replace(DENSE, num_experts=(4,)), replace(DENSE, num_experts=(4,)), "dense")


def test_training_with_moe_use_upcycling_starts_at_the_dense_loss_and_resumes_its_own_checkpoints(tmp_path):
    corpus = write_corpus(tmp_path)
    common = dict(num_layers=2, hidden_dropout=0.0, attention_dropout=0.0, eval_iters=2, swiglu=True)
    dense_dir, moe_dir = str(tmp_path / "dense"), str(tmp_path / "moe")
    grid = single_process_grid(torch.device("cpu"))
    Trainer(tiny_config(corpus, train_iters=3, save=dense_dir, **common), grid).train()
    dense = Trainer(tiny_config(corpus, train_iters=3, load=dense_dir, **common), grid)
    moe_flags = dict(num_experts=4, topk=2, disable_moe_token_dropping=True, moe_use_upcycling=True, **common)
    upcycled = Trainer(tiny_config(corpus, train_iters=3, load=dense_dir, save=moe_dir, **moe_flags), grid)
    assert upcycled.iteration == 0 and upcycled.resume_from is None
    assert abs(upcycled.evaluate(upcycled.valid_data) - dense.evaluate(dense.valid_data)) < 1e-5
    upcycled.train()
    restarted = Trainer(tiny_config(corpus, train_iters=5, load=dense_dir, save=moe_dir, **moe_flags), grid)
    assert restarted.iteration == 3 and restarted.load_dir == moe_dir
    with pytest.raises(ConfigError, match="already has MoE layers"):
        Trainer(tiny_config(corpus, train_iters=5, load=moe_dir, save=str(tmp_path / "other"), **moe_flags), grid)
