"""`--deepspeed --deepspeed_config ds.json`: JSON and flags become one config, contradictions stop."""

import json

import pytest
import torch

from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.errors import ConfigError
from megatron.parallel import single_process_grid
from megatron.runtime.deepspeed_schedules import WarmupLR
from megatron.training.loop import Trainer
from tests.training_fixtures import tiny_flags, write_corpus

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
    "3e-4",
    "--train-iters",
    "10",
    "--data-path",
    "corpus",
]


def ds_args(tmp_path, config: dict, extra: str = "") -> list[str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return BASE + ["--deepspeed", "--deepspeed_config", str(path)] + extra.split()


def test_json_fills_the_flags_left_at_their_defaults(tmp_path):
    config = parse_args(
        ds_args(
            tmp_path,
            {
                "train_batch_size": 8,
                "gradient_clipping": 0.5,
                "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            },
        )
    )
    r = config.runtime_config(2)
    assert (config.training.global_batch_size, r.gradient_clipping, r.precision) == (8, 0.5, "bf16")
    assert (r.optimizer.params.betas[1], r.optimizer.params.weight_decay) == (0.95, 0.1)
    runtime = with_data_parallel_size(config, 2).runtime_config(2)
    assert runtime.gradient_accumulation_steps == 2 and runtime.gradient_clipping == 0.5


@pytest.mark.parametrize(
    "ds, extra, message",
    [
        ({"gradient_clipping": 0.5}, "--clip-grad 1.0", "--clip-grad 1.0 and gradient_clipping 0.5 in .* disagree"),
        ({"optimizer": {"params": {"lr": 1e-3}}}, "", "--lr 0.0003 and optimizer.params.lr 0.001 in .* disagree"),
        ({"fp16": {"enabled": True}}, "--bf16", "--bf16 and --fp16 were both given"),
        (
            {"scheduler": {"type": "WarmupLR"}},
            "--lr-decay-style cosine",
            "names scheduler 'WarmupLR' and --lr-decay-style",
        ),
        ({"gradient_cliping": 1.0}, "", "unknown key 'gradient_cliping' .* did you mean 'gradient_clipping'"),
    ],
)
def test_contradictions_name_both_values(tmp_path, ds, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(ds_args(tmp_path, ds, extra))


def test_accumulation_and_zero_stage_checks(tmp_path):
    accumulation = parse_args(ds_args(tmp_path, {"train_batch_size": 8, "gradient_accumulation_steps": 3}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 3 in .* disagrees .* = 4"):
        with_data_parallel_size(accumulation, 1)
    with pytest.raises(ConfigError, match="should be 0, 1, 2 or 3"):
        parse_args(ds_args(tmp_path, {"zero_optimization": {"stage": 4}}))
    with pytest.raises(ConfigError, match="--zero-stage: invalid choice: 4"):
        parse_args(BASE + ["--zero-stage", "4"])
    # the JSON's other ZeRO keys reach the runtime config; DeepSpeed writes sizes like 5e8
    zero = {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": False, "stage3_param_persistence_threshold": 0}
    runtime = with_data_parallel_size(parse_args(ds_args(tmp_path, {"zero_optimization": zero})), 1).runtime_config(1)
    assert runtime.zero_optimization.stage == 3 and runtime.zero_optimization.reduce_bucket_size == 500_000_000
    assert not runtime.zero_optimization.overlaps_communication
    assert runtime.zero_optimization.stage3_param_persistence_threshold == 0
    # so do the blocks no flag sets; without them the engine's own progress line stays off
    blocks = {
        "aio": {"block_size": 262144},
        "tensorboard": {"enabled": True, "output_path": "tb"},
        "steps_per_print": 5,
    }
    runtime = with_data_parallel_size(parse_args(ds_args(tmp_path, blocks)), 1).runtime_config(1)
    assert (runtime.aio.block_size, runtime.tensorboard.output_path, runtime.steps_per_print) == (262144, "tb", 5)
    assert with_data_parallel_size(parse_args(BASE), 1).runtime_config(1).steps_per_print == 0


def test_config_file_needs_the_deepspeed_flag(tmp_path):
    args = [a for a in ds_args(tmp_path, {}) if a != "--deepspeed"]
    with pytest.raises(ConfigError, match="add --deepspeed"):
        parse_args(args)


def test_deepspeed_scheduler_replaces_megatron_annealing(tmp_path):
    corpus = write_corpus(tmp_path)
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "scheduler": {
                    "type": "WarmupLR",
                    "params": {
                        "warmup_min_lr": 0.0,
                        "warmup_max_lr": 1e-3,
                        "warmup_num_steps": 4,
                        "warmup_type": "linear",
                    },
                }
            }
        )
    )
    flags = [f for f in tiny_flags(corpus, train_iters=3, lr=1e-3)]
    for flag in ("--lr-warmup-iters", "--lr-decay-style", "--min-lr"):  # the fixture's annealing flags
        index = flags.index(flag)
        del flags[index : index + 2]
    config = with_data_parallel_size(parse_args(flags + ["--deepspeed", "--deepspeed_config", str(ds)]), 1)
    trainer = Trainer(config, single_process_grid(torch.device("cpu")))
    assert isinstance(trainer.engine.lr_scheduler, WarmupLR)
    trainer.train()
    assert trainer.engine.get_lr()[0] == pytest.approx(1e-3 * 2 / 4)  # 3 steps done: t = 2
