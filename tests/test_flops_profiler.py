"""The flops profiler against torch's FlopCounterMode, on dense, MoE (deliberately uneven routing,
with and without capacity drops) and PR-MoE GPT models; its per-module sums, parameter counts,
printing, DeepSpeed's return shapes, and a model left as it was."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from megatron.errors import ConfigError
from megatron.model import GPTConfig, GPTModel
from megatron.model.moe import MoEConfig
from megatron.model.moe.experts import padded_rows
from megatron.parallel import ParallelGrid, single_process_grid
from megatron.profiling.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from megatron.profiling.records import ModuleProfile
from megatron.runtime.config.schema import load_runtime_config
from megatron.runtime.engine import Engine, initialize

H, HEADS, VOCAB, B, S, E, K = 32, 4, 64, 2, 32, 4, 2
T = B * S


def tiny_model(**overrides: object) -> GPTModel:
    torch.manual_seed(0)
    values = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=S,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(GPTConfig(**{**values, **overrides})).eval()


def moe_model(mlp_type: str = "standard", drop_tokens: bool = False) -> GPTModel:
    """Two MoE layers whose every token's first choice is expert 0 and second one of the others:
    the norm before each MoE layer adds 1 to every feature and expert 0's router row is all 3s, so
    its logit is 3 H for every token (a normalised row sums to 0), far above the others' (the
    normalised row times small random rows)."""
    moe = MoEConfig(topk=K, drop_tokens=drop_tokens, use_residual=mlp_type == "residual")
    model = tiny_model(num_experts=(E,), expert_interval=1, mlp_type=mlp_type, moe=moe)
    with torch.no_grad():
        for block in model.layers:
            block.post_attention_layernorm.bias.fill_(1.0)
            block.mlp.router.weight.normal_(0.0, 0.5)
            block.mlp.router.weight[0] = 3.0
    return model


MODELS = {"dense": tiny_model, "moe": moe_model, "pr_moe": lambda: moe_model("residual")}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def reference_gemm_flops(model: nn.Module, ids: torch.Tensor) -> int:
    """FlopCounterMode's count, taught the two CPU kernels it has no formula for: attention's
    (torch's own formula) and oneDNN's linear, which the CPU experts run (M x N x K from x [M, K]
    and the weight [N, K])."""

    def onednn_linear(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]

    def cpu_attention(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q_shape, k_shape, v_shape)

    mapping = {
        torch.ops.mkldnn._linear_pointwise: onednn_linear,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention,
    }
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(ids)
    return counter.get_total_flops()


def profiled(model: nn.Module, ids: torch.Tensor, ignore_list: list[type[nn.Module]] | None = None) -> FlopsProfiler:
    with torch.no_grad():
        model(ids)  # the first forward probes the experts' fast paths, which would be counted
        profiler = FlopsProfiler(model)
        profiler.start_profile(ignore_list=ignore_list)
        model(ids)
    profiler.stop_profile()
    return profiler


def walk(root: ModuleProfile) -> list[ModuleProfile]:
    return [root] + [m for child in root.children for m in walk(child)]


def find(root: ModuleProfile, name: str) -> ModuleProfile:
    return next(module for module in walk(root) if module.name == name)


@pytest.mark.parametrize("kind", MODELS)
def test_gemm_flops_equal_flop_counter_modes(kind):
    model, ids = MODELS[kind](), tokens()
    profile = profiled(model, ids).module_profile()
    reference = reference_gemm_flops(model, ids)
    assert profile.cost.gemm_flops == pytest.approx(reference, rel=0.01)
    # the LM head (tied, run by GPTModel itself) and the query/key/value projection, by hand
    assert profile.self_cost.gemm_flops == 2 * T * H * VOCAB
    assert find(profile, "layers.0.self_attention.query_key_value").cost.gemm_flops == 2 * T * H * 3 * H


@pytest.mark.parametrize("drop_tokens", [False, True])
def test_experts_flops_follow_the_rows_each_expert_received(drop_tokens, tmp_path):
    model, ids = moe_model(drop_tokens=drop_tokens), tokens()
    profiler = profiled(model, ids)
    profile = profiler.module_profile()
    capacity = T * K // E  # capacity factor 1
    text_file = tmp_path / "profile.txt"
    profiler.print_model_profile(output_file=str(text_file))
    text = text_file.read_text()
    for layer in ("layers.0.mlp", "layers.1.mlp"):
        moe = find(profile, layer).moe
        routed, received = moe.routed_per_expert, moe.received_per_expert
        assert sum(routed) == T * K and routed[0] == T  # every token's first choice
        assert received == ([min(n, capacity) for n in routed] if drop_tokens else routed)
        assert f"routed choices per expert (before capacity drops): {routed} = {T * K}" in text
        assert f"rows per local expert: {received} = {sum(received)}" in text
        experts = find(profile, f"{layer}.experts")
        w1, w2 = model.layers[0].mlp.experts.w1, model.layers[0].mlp.experts.w2
        per_row = H * w1.shape[2] + w2.shape[1] * H
        assert moe.active_gemm_flops == [2 * n * per_row for n in received]
        # the CPU experts compute padded row blocks (experts.padded_rows), and nothing else
        assert experts.cost.gemm_flops == sum(2 * padded_rows(n) * per_row for n in received)
        beyond = number_to_string(experts.cost.gemm_flops - sum(moe.active_gemm_flops))
        assert f"GEMM FLOPs run beyond them: {beyond}" in text


def test_moe_phases_hold_the_dispatch_and_combine():
    profile = profiled(moe_model("residual"), tokens()).module_profile()
    layer = find(profile, "layers.0.mlp")
    dispatch, combine = layer.moe.dispatch, layer.moe.combine
    assert dispatch.cost.macs == combine.cost.macs == 0
    # the gate-weighted sum: a product and an add per routed row's element
    assert combine.cost.other_flops == 2 * T * K * H
    assert dispatch.duration_s > 0 and combine.duration_s > 0
    assert dispatch.cost.other_flops + combine.cost.other_flops <= layer.self_cost.other_flops
    assert dispatch.duration_s + combine.duration_s < layer.duration_s


@pytest.mark.parametrize("kind", ["dense", "pr_moe"])
def test_each_modules_flops_are_its_own_plus_its_childrens(kind):
    profile = profiled(MODELS[kind](), tokens()).module_profile()
    for module in walk(profile):
        for field in ("macs", "other_flops"):
            children = sum(getattr(child.cost, field) for child in module.children)
            assert getattr(module.cost, field) == getattr(module.self_cost, field) + children, module.name
    assert find(profile, "layers.1").cost.flops > 0


def test_ignored_modules_count_for_their_caller():
    model, ids = tiny_model(), tokens()
    whole = profiled(model, ids).module_profile()
    ignoring = profiled(model, ids, ignore_list=[nn.LayerNorm]).module_profile()
    assert ignoring.cost == whole.cost
    norm = find(ignoring, "layers.0.input_layernorm")
    assert norm.cost.flops == 0 and norm.calls == 0
    block, whole_block = find(ignoring, "layers.0"), find(whole, "layers.0")
    assert block.self_cost.other_flops == whole_block.self_cost.other_flops + 2 * T * H  # both norms


def test_params_count_each_tensor_once():
    model = tiny_model()  # the LM head is the word embedding
    profile = profiled(model, tokens()).module_profile()
    assert profile.params == sum(p.numel() for p in model.parameters())
    assert find(profile, "word_embeddings").params == VOCAB * H
    shared, tied = nn.Linear(3, 3), nn.Linear(3, 3)
    tied.weight = shared.weight
    net = nn.Sequential(shared, nn.ReLU(), shared, tied)  # one module twice, one weight in two modules
    profiler = FlopsProfiler(net)
    profiler.start_profile()
    net(torch.ones(2, 3))
    profiler.stop_profile()
    assert profiler.get_total_params() == 9 + 3 + 3
    assert find(profiler.module_profile(), "3").params == 12
    assert profiler.get_total_macs() == 3 * 2 * 3 * 3  # but each run counted


def hooks_and_attributes(model: nn.Module) -> list[tuple[str, ...]]:
    hook_dicts = [name for name in vars(nn.Module()) if "hooks" in name]
    return [tuple(sorted(vars(m))) + tuple(str(len(getattr(m, h))) for h in hook_dicts) for m in model.modules()]


def test_end_profile_leaves_the_model_as_it_was():
    model, ids = moe_model("residual"), tokens()
    before = hooks_and_attributes(model)
    with torch.no_grad():
        plain = model(ids)
        profiler = FlopsProfiler(model)
        profiler.start_profile()
        assert hooks_and_attributes(model) != before
        during = model(ids)
        profiler.end_profile()
        after = model(ids)
    assert hooks_and_attributes(model) == before
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch.equal(plain.logits_BSV, during.logits_BSV) and torch.equal(plain.logits_BSV, after.logits_BSV)
    assert torch.equal(plain.routing[1].tokens_per_expert_E, during.routing[1].tokens_per_expert_E)
    with pytest.raises(RuntimeError, match="holds no profile"):
        profiler.get_total_flops()


def test_a_forward_that_raises_leaves_no_counting_mode_behind():
    model = tiny_model()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with pytest.raises(IndexError):
        model(torch.full((1, 4), VOCAB))  # a token id past the vocabulary
    assert torch._C._len_torch_dispatch_stack() == 0
    with torch.no_grad():
        model(tokens())
    assert profiler.get_total_flops() > 0
    profiler.end_profile()


def test_inference_mode_counts_the_same_gemms():
    """Under inference_mode the forward reaches the counter as linear and scaled_dot_product_attention
    instead of their decompositions."""
    model, ids = moe_model(), tokens()
    expected = profiled(model, ids).get_total_macs()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.inference_mode():
        model(ids)
    profiler.stop_profile()
    assert profiler.get_total_macs() == expected


def test_print_model_profile_writes_the_file_and_nothing_else(tmp_path, capsys):
    model = moe_model("residual")
    grid = ParallelGrid(world_size=1, rank=0, dp_size=1, dp_rank=0, dp_group=None, device=torch.device("cpu"))
    profiler = FlopsProfiler(model, ds_engine=SimpleNamespace(parallel=grid, gradient_accumulation_steps=4))
    profiler.start_profile()
    with torch.no_grad():
        model(tokens())
    profiler.stop_profile()
    whole, shallow = tmp_path / "whole.txt", tmp_path / "shallow.txt"
    profiler.print_model_profile(profile_step=3, top_modules=2, output_file=str(whole))
    profiler.print_model_profile(module_depth=2, output_file=str(shallow))
    assert capsys.readouterr().out == ""
    text = whole.read_text()
    flops = number_to_string(profiler.get_total_flops())
    lines = text.splitlines()
    assert any(line.startswith("fwd FLOPs:") and line.endswith(f" {flops}") for line in lines)
    for expected in (
        "Flops profile at step 3",
        "world size:",
        "gradient accumulation steps:",
        "Top 2 modules",
        "(router) Router:",
        "[dispatch] sort, permutation, all-to-all:",
        "(experts) GroupedExperts:",
        "[combine] return all-to-all, gate-weighted sum:",
        "(residual_mlp) MLP:",
    ):
        assert expected in text, expected
    assert lines.index(next(x for x in lines if "[dispatch]" in x)) < lines.index(
        next(x for x in lines if "(experts)" in x)
    )
    shallow_text = shallow.read_text()
    assert "(0) TransformerBlock" in shallow_text and "(mlp) MoELayer" not in shallow_text
    profiler.print_model_profile()
    assert "Flops profile at step 1" in capsys.readouterr().out
    profiler.end_profile()


def test_get_model_profile_returns_deepspeeds_tuples(tmp_path):
    model, ids = tiny_model(), tokens()
    flops, macs, params = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    assert all(isinstance(n, int) for n in (flops, macs, params))
    assert params == sum(p.numel() for p in model.parameters()) and 2 * macs < flops
    # token ids drawn over the vocabulary: an embedding would refuse random floats
    strings = get_model_profile(model, input_shape=(B, S), output_file=str(tmp_path / "p.txt"))
    assert strings == (number_to_string(flops), macs_to_string(macs), params_to_string(params))
    assert "Flops profile at step 1" in (tmp_path / "p.txt").read_text()
    with pytest.raises(ValueError, match="needs the model's input"):
        get_model_profile(model)
    with pytest.raises(ValueError, match="has none"):
        get_model_profile(model, args=[ids], mode="generate")


def test_strings_are_deepspeeds():
    assert flops_to_string(8.19e13) == "81.90 TFLOPS"
    assert flops_to_string(1.5e9, units="M") == "1500.00 MFLOPS"
    assert macs_to_string(3.14e9) == "3.14 GMACs" and macs_to_string(12) == "12 MACs"
    assert params_to_string(336_230_000) == "336.23 M" and params_to_string(512) == "512"
    assert number_to_string(6279.86e9, precision=1) == "6.3 T"
    assert duration_to_string(0.07667) == "76.67 ms" and duration_to_string(2e-5) == "20.00 us"
    assert duration_to_string(3.0) == "3.00 s"


def trained_with(ds_profiler: dict, steps: int = 3, accumulation: int = 2) -> tuple[list[float], GPTModel, Engine]:
    """Losses of `steps` engine steps of an MoE GPT under the ds_config `flops_profiler` block given."""
    model = tiny_model(num_experts=(E,), moe=MoEConfig(topk=K)).train()
    config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "flops_profiler": ds_profiler,
    }
    engine = initialize(model, config, single_process_grid(torch.device("cpu")))
    tokens = torch.randint(0, VOCAB, (steps * accumulation, B, S), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(steps):
        for micro in range(accumulation):
            batch = tokens[step * accumulation + micro]
            out = engine(batch, labels_BS=batch.roll(-1, dims=1))
            loss = out.losses_BS.mean() + out.router_loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, model, engine


def test_the_ds_config_block_prints_the_profile_of_its_step_once_and_changes_no_loss(tmp_path):
    output = tmp_path / "profile.txt"
    block = {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 2, "output_file": str(output)}
    one_step, _, _ = trained_with(block, steps=1)
    assert not output.exists()  # step 0 is not profiled
    losses, model, engine = trained_with(block)
    text = output.read_text()
    assert text.count("Flops profile at step 1") == 1 and "[dispatch]" in text and "fwd MACs:" in text
    assert engine.profiled_step.done
    assert "samples/second:" in text and "iteration latency (profiling included):" in text
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed after the step
    assert all(not m._forward_hooks for m in model.modules())
    unprofiled, _, _ = trained_with({"enabled": False})
    assert losses == unprofiled and losses[:2] == one_step


def test_a_wrong_flops_profiler_key_or_value_is_refused_by_name():
    with pytest.raises(ConfigError, match="profile_stepp"):
        load_runtime_config({"train_batch_size": 2, "flops_profiler": {"enabled": True, "profile_stepp": 1}}, 1)
    with pytest.raises(ConfigError, match="module_depth"):
        load_runtime_config({"train_batch_size": 2, "flops_profiler": {"enabled": True, "module_depth": -2}}, 1)
