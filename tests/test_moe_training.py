"""MoE in the GPT model: training, expert-load reporting, EP=N equal to EP=1, checkpoints that
load under another expert-parallel size."""

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.checkpoint.tensors import ShardedReader
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.placement import expert_ids
from megatron.training.loop import Trainer
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_config, write_corpus

MOE = {"num_experts": 4, "num_layers": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_moe_model_trains_and_reports_expert_load(corpus, tmp_path, capsys):
    config = tiny_config(
        corpus,
        train_iters=40,
        eval_interval=40,
        eval_at_start=True,
        lr=1e-2,
        min_lr=1e-3,
        log_interval=10,
        tensorboard_dir=str(tmp_path / "tb"),
        topk=2,
        **MOE,
    )
    trainer = Trainer(config, single_process_grid(torch.device("cpu")))
    assert trainer.model_config.experts_per_layer == [1, 4]
    result = trainer.train()
    (_, first), (_, last) = result.validation
    assert last < first - 0.8, result.validation
    out = capsys.readouterr().out
    assert "moe loss:" in out
    assert " moe | layer 2: imbalance " in out and "dropped" in out and "entropy" in out
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"moe loss", "moe/layer2/imbalance", "moe/layer2/dropped-fraction", "moe/layer2/router-entropy"} <= set(
        events.Tags()["scalars"]
    )
    assert "moe/layer2/tokens-per-expert" in events.Tags()["histograms"]
    histogram = events.Histograms("moe/layer2/tokens-per-expert")[-1].histogram_value
    # 10 iterations x 4 samples x 16 tokens x top-2 choices per log interval
    assert histogram.num == 10 * 4 * 16 * 2 and len(histogram.bucket) == 4


def test_flops_count_active_parameters_only():
    dense = tiny_config("unused", num_layers=2).model
    from dataclasses import replace

    dense = replace(dense, vocab_size=128)
    moe8 = replace(dense, num_experts=(8,))
    moe64 = replace(dense, num_experts=(64,))
    router_difference = 3 * 2 * 32 * (64 - 8)
    assert moe64.flops_per_token(16) - moe8.flops_per_token(16) == router_difference
    assert moe8.flops_per_token(16) - dense.flops_per_token(16) == 3 * 2 * 32 * 8  # top-1: one expert = one MLP


def _train(
    corpus: str, ep_size: int, save: str | None, load: str | None, train_iters: int, overrides: dict
) -> dict[str, torch.Tensor]:
    grid = build_parallel_grid(torch.device("cpu"), ep_size=ep_size)
    config = tiny_config(
        corpus,
        dp_size=grid.dp_size,
        train_iters=train_iters,
        micro_batch_size=1,
        global_batch_size=4,
        moe_expert_parallel_size=ep_size,
        save=save,
        load=load,
        **{**MOE, **overrides},
    )
    trainer = Trainer(config, grid)
    start = trainer.iteration
    result = trainer.train()
    out = {"losses": torch.tensor(result.losses, dtype=torch.float64), "start": torch.tensor(start)}
    for name, param in trainer.engine.module.named_parameters():
        ids = expert_ids(param)
        if ids is None:
            out[name] = param.detach().clone()
        else:
            out.update({f"{name}[{g}]": param[i].detach().clone() for i, g in enumerate(ids)})
    return out


def test_ep2_trains_exactly_like_ep1_from_scratch(corpus):
    ep1, ep2 = (
        run_distributed(_train, 2, corpus, 1, None, None, 5, {}),
        run_distributed(_train, 2, corpus, 2, None, None, 5, {}),
    )
    for rank in range(2):
        torch.testing.assert_close(ep2[rank]["losses"], ep1[rank]["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ep2[rank].items():  # dense weights, and this rank's experts by global id
            torch.testing.assert_close(value, ep1[rank][name], rtol=1e-4, atol=1e-5, msg=name)


def test_ep2_equals_ep1_with_fine_grained_shared_and_swiglu_experts(corpus):
    modern = {
        "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 24,
        "moe_shared_expert_gate": True,
        "normalization": "RMSNorm",
        "group_query_attention": True,
        "num_query_groups": 2,
        "position_embedding_type": "rope",
        "swiglu": True,
        "disable_bias_linear": True,
    }
    ep1 = run_distributed(_train, 2, corpus, 1, None, None, 4, modern)
    ep2 = run_distributed(_train, 2, corpus, 2, None, None, 4, modern)
    assert "layers.1.mlp.shared_expert.gate.weight" in ep1[0] and "layers.1.mlp.experts.b1[0]" not in ep1[0]
    for rank in range(2):
        torch.testing.assert_close(ep2[rank]["losses"], ep1[rank]["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ep2[rank].items():
            torch.testing.assert_close(value, ep1[rank][name], rtol=1e-4, atol=1e-5, msg=name)


def _saved_experts(folder: Path) -> ShardedReader:
    return ShardedReader(folder, "model")


def test_checkpoint_saved_with_ep2_loads_with_ep1_and_ep4(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(_train, 2, corpus, 2, save, None, 3, {})
    reader = _saved_experts(Path(save) / "iter_0000003")
    assert {key for key in reader.file_of if "experts.w1" in key} == {f"layers.1.mlp.experts.w1[{g}]" for g in range(4)}
    single = _train(corpus, 1, None, save, 4, {})
    assert int(single["start"]) == 3 and len(single["losses"]) == 1
    four = run_distributed(_train, 4, corpus, 4, None, save, 3, {})  # loads and stops at once: weights as saved
    for rank, result in enumerate(four):
        assert int(result["start"]) == 3
        key = f"layers.1.mlp.experts.w1[{rank}]"
        torch.testing.assert_close(result[key], reader.get(key))
        assert not any(f"experts.w1[{g}]" in k for g in range(4) if g != rank for k in result)


def test_residual_pyramid_model_trains_saves_and_reloads_under_another_ep_size(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    pyramid = {"num_layers": 4, "num_experts": [2, 4], "mlp_type": "residual"}
    first = run_distributed(_train, 2, corpus, 2, save, None, 4, pyramid)
    assert (
        "layers.3.mlp.coefficient.weight" in first[0] and "layers.3.mlp.residual_mlp.dense_h_to_4h.weight" in first[0]
    )
    assert torch.isfinite(first[0]["losses"]).all()
    resumed = _train(corpus, 1, None, save, 6, pyramid)
    assert int(resumed["start"]) == 4 and len(resumed["losses"]) == 2
    reader = _saved_experts(Path(save) / "iter_0000004")
    assert {k for k in reader.file_of if k.startswith("layers.1.mlp.experts.w2[")} == {
        f"layers.1.mlp.experts.w2[{g}]" for g in range(2)
    }
