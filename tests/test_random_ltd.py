"""Random-LTD (ds_config data_efficiency.data_routing.random_ltd): the kept length at chosen steps
equals DeepSpeed's fixed_linear RandomLTDScheduler written out from its documentation; a chosen
layer changes only the positions it keeps, and those as the layer run on the kept tokens alone
would; with the whole sequence kept a run equals the plain model's; evaluation sees every token; a
resumed run draws the same tokens; TP=2 with sequence parallelism and MoE layers among the chosen
ones equals one process; and what the run cannot take is refused by name."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megatron.checkpoint.layout import LATEST_FILE
from megatron.config.flags import parse_args
from megatron.errors import ConfigError
from megatron.model import GPTModel
from megatron.model.random_ltd import RandomLTD
from megatron.parallel import build_parallel_grid, single_process_grid
from megatron.runtime.config.data_efficiency import RandomLTDConfig
from megatron.training.loop import Trainer
from megatron.training.random_ltd_schedule import RandomLTDSchedule
from tests.dist_utils import run_distributed
from tests.training_fixtures import tiny_flags, write_corpus

SINGLE = single_process_grid(torch.device("cpu"))


def block(min_value: int = 4, max_value: int = 16, layers: tuple[int, ...] = (1,), **extra: object) -> dict:
    ltd = {
        "enabled": True,
        "total_layer_num": 2,
        "random_ltd_layer_num": len(layers),
        "random_ltd_layer_id": list(layers),
        "model_mask_name": "attention_mask",
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
            "min_value": min_value,
            "max_value": max_value,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": 6, "seq_per_step": 4},
        },
        **extra,
    }
    return {"enabled": True, "seed": 1234, "data_routing": {"enabled": True, "random_ltd": ltd}}


def deepspeed_lengths(schedule: dict, steps: int) -> list[int]:
    """DeepSpeed's RandomLTDScheduler as documented: the current length starts at min_value; after
    each step t (the engine's global_steps), while below max_value, it becomes floor(t / require_steps
    x (max - min) + min) less its remainder by seq_per_step, at most max. Iteration i uses the
    length current before its step."""
    lo, hi, c = schedule["min_value"], schedule["max_value"], schedule["schedule_config"]
    current, lengths = lo, []
    for step in range(1, steps + 1):
        lengths.append(current)
        if current < hi:
            value = math.floor(step / c["require_steps"] * (hi - lo) + lo)
            current = min(value - value % c["seq_per_step"], hi)
    return lengths


@pytest.mark.parametrize("min_value", [4, 6])
def test_the_kept_length_follows_deepspeeds_fixed_linear_schedule(min_value):
    ltd = block(min_value)["data_routing"]["random_ltd"]
    schedule = RandomLTDSchedule(RandomLTDConfig(**ltd), RandomLTD(frozenset({1}), 0))
    got = [schedule.kept_length(i) for i in range(1, 11)]
    assert got == deepspeed_lengths(ltd["random_ltd_schedule"], 10)
    # written out: 4 + 12 t / 6 less its remainder by 4; from 6: 6 first, then 6 + 10 t / 6 rounded down to 4s
    assert got == {4: [4, 4, 8, 8, 12, 12, 16, 16, 16, 16], 6: [6, 4, 8, 8, 12, 12, 16, 16, 16, 16]}[min_value]


def tiny_model() -> GPTModel:
    config = parse_args(tiny_flags("unused", hidden_dropout=0.0, attention_dropout=0.0)).model
    torch.manual_seed(0)
    return GPTModel(config.__class__(**{**config.__dict__, "vocab_size": 64}))


def test_a_chosen_layer_changes_only_its_kept_positions_as_the_layer_alone_would():
    model = tiny_model().train()
    model.random_ltd = RandomLTD(frozenset({1}), seed=7)
    model.random_ltd.begin_iteration(3, kept=6)
    seen: dict[str, torch.Tensor] = {}
    model.layers[0].register_forward_hook(lambda m, i, out: seen.__setitem__("before", out.hidden_BSH.detach()))
    model.final_layernorm.register_forward_pre_hook(lambda m, args: seen.__setitem__("after", args[0].detach()))
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    model(tokens)
    before, after = seen["before"], seen["after"]
    changed = (after != before).any(-1)  # [B, S]: the positions layer 1 saw
    assert changed.sum(1).tolist() == [6, 6, 6]
    positions = torch.arange(16).expand(3, -1)
    for b in range(3):
        kept = changed[b].nonzero().squeeze(1)
        alone = model.layers[1](before[b : b + 1, kept], positions[b : b + 1, kept]).hidden_BSH
        torch.testing.assert_close(after[b, kept], alone[0])
    model.random_ltd.begin_iteration(4, kept=6)  # another iteration draws other tokens
    model(tokens)
    assert not torch.equal((seen["after"] != seen["before"]).any(-1), changed)
    model.eval()  # evaluation sees every token
    plain = tiny_model().eval()
    torch.testing.assert_close(model(tokens).logits_BSV, plain(tokens).logits_BSV, rtol=0, atol=0)


def _flags(tmp_path, corpus: str, data_efficiency: dict | None, **overrides: object) -> list[str]:
    shape = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "train_iters": 6, "eval_interval": 6}
    flags = tiny_flags(corpus, **{**shape, **overrides})
    if data_efficiency is None:
        return flags
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"data_efficiency": data_efficiency}))
    return flags + ["--random-ltd", "--deepspeed", "--deepspeed_config", str(ds)]


def test_with_the_whole_sequence_kept_a_run_equals_the_plain_model(tmp_path):
    corpus = write_corpus(tmp_path)
    plain = Trainer(parse_args(_flags(tmp_path, corpus, None)), SINGLE).train()
    whole = Trainer(parse_args(_flags(tmp_path, corpus, block(16, 16, layers=(0, 1)))), SINGLE).train()
    assert whole.losses == plain.losses and whole.validation == plain.validation
    dropping = Trainer(parse_args(_flags(tmp_path, corpus, block(4, 16, layers=(0, 1)))), SINGLE).train()
    assert dropping.losses[0] != plain.losses[0]  # a share kept: another run


def test_tokens_count_each_layers_kept_share_as_megatron_deepspeed_does(tmp_path):
    """Megatron-DeepSpeed's actual_seq_length: (length x (L - n) + kept x n) // L for n random-LTD
    layers of L, once the kept length is below the sequence's; --train-tokens stops on that count."""
    corpus = write_corpus(tmp_path)
    kept = deepspeed_lengths(block()["data_routing"]["random_ltd"]["random_ltd_schedule"], 20)
    counted = [4 * ((16 * 1 + k * 1) // 2 if k < 16 else 16) for k in kept]  # 1 of the 2 layers drops tokens
    trainer = Trainer(parse_args(_flags(tmp_path, corpus, block())), SINGLE)
    trainer.train()
    assert trainer.consumed_tokens == sum(counted[:6]) and trainer.engine.lr_scheduler.num_steps == sum(counted[:6])
    budget = sum(counted[:9])
    by_tokens = Trainer(parse_args(_flags(tmp_path, corpus, block(), train_iters=None, train_tokens=budget)), SINGLE)
    by_tokens.train()
    assert by_tokens.iteration == 9 and by_tokens.consumed_tokens == budget


def test_a_resumed_run_draws_the_same_tokens(tmp_path):
    corpus = write_corpus(tmp_path)
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = Trainer(parse_args(_flags(tmp_path, corpus, block(), save=str(full_dir), save_interval=3)), SINGLE)
    result = full.train()
    resumed_dir.mkdir()
    shutil.copytree(full_dir / "iter_0000003", resumed_dir / "iter_0000003")
    (resumed_dir / LATEST_FILE).write_text("3\n")
    resumed = Trainer(parse_args(_flags(tmp_path, corpus, block(), load=str(resumed_dir))), SINGLE)
    assert resumed.train().losses == result.losses[3:]


MOE_TP = {
    "num_experts": 4,
    "topk": 2,
    "disable_moe_token_dropping": True,
    "disable_moe_top2_2nd_expert_sampling": True,
    "make_vocab_size_divisible_by": 32,
}


def _losses(tmp: str, corpus: str, tp: int) -> dict[str, torch.Tensor]:
    layout = {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1}
    flags = _flags(Path(tmp) / f"tp{tp}", corpus, block(4, 16, layers=(0, 1)), **MOE_TP, **layout)
    grid = build_parallel_grid(torch.device("cpu"), tp_size=tp)
    return {"losses": torch.tensor(Trainer(parse_args(flags), grid).train().losses)}


def test_tp2_with_sequence_parallelism_and_moe_layers_equals_one_process(tmp_path):
    corpus = write_corpus(tmp_path)
    for tp in (1, 2):
        (tmp_path / f"tp{tp}").mkdir()
    single = _losses(str(tmp_path), corpus, 1)["losses"]
    for rank in run_distributed(_losses, 2, str(tmp_path), corpus, 2):
        torch.testing.assert_close(rank["losses"], single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "data_efficiency, message",
    [
        (block(layers=(2,)), "random_ltd_layer_id 2 is not a layer of this 2-layer model"),
        (block(max_value=32), "random_ltd_schedule.max_value 32 is above --seq-length 16"),
        (block(total_layer_num=4), "random_ltd.total_layer_num 4 is not --num-layers 2"),
        ({}, "--random-ltd needs the ds_config data_efficiency.data_routing.random_ltd block"),
    ],
)
def test_what_the_run_cannot_take_is_refused_by_name(tmp_path, data_efficiency, message):
    corpus = write_corpus(tmp_path)
    with pytest.raises(ConfigError, match=message):
        Trainer(parse_args(_flags(tmp_path, corpus, data_efficiency)), SINGLE)
