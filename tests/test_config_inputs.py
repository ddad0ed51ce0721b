"""Tables of bad inputs: every DeepSpeed-style config value and every flag is checked before any
work, and each problem is one sentence that names the input (and the nearest valid key or flag)."""

import json
import os
import subprocess
import sys

import pytest

from megatron.config.flags import build_parser, parse_args, with_data_parallel_size
from megatron.errors import ConfigError

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
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_json(tmp_path, config: dict | str, argv: list[str] = BASE) -> list[str]:
    path = tmp_path / "ds.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return argv + ["--deepspeed", "--deepspeed_config", str(path)]


def runtime(tmp_path, config: dict | str, argv: list[str] = BASE):
    return with_data_parallel_size(parse_args(with_json(tmp_path, config, argv)), 1).runtime_config(1)


BAD_CONFIGS = [
    ({"fp16": {"enabled": "false"}}, r"'fp16.enabled' is the string \"false\" in .*; write it without quotes: false"),
    ({"bf16": {"enabled": 1}}, r"'bf16.enabled' .* valid boolean"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, r"'fp16.hysteresis' .* greater than or equal to 1"),
    ('{"fp16": {"enabled": true, "loss_scale": Infinity}}', r"'fp16.loss_scale' .* finite number"),
    ('{"fp16": {"enabled": true, "loss_scale": NaN}}', r"'fp16.loss_scale' .* finite number"),
    (
        {"fp16": {"enabled": True, "loss_scale": -1}},
        r"bad value -1 for 'fp16.loss_scale' .* greater than or equal to 0",
    ),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, r"'fp16.loss_scale_window' .* greater than or equal to 1"),
    (
        {"fp16": {"enabled": True, "initial_scale_power": 5000}},
        r"'fp16.initial_scale_power' .* less than or equal to 127",
    ),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, r"'fp16.min_loss_scale' .* a loss scale must be from 2\*\*-24"),
    ({"fp16": {"enabled": True, "loss_scal": 8}}, r"unknown key 'fp16.loss_scal' .* did you mean 'loss_scale'"),
    ({"gradient_clipping": -1}, r"bad value -1 for 'gradient_clipping' .* greater than or equal to 0"),
    ('{"gradient_clipping": NaN}', r"'gradient_clipping' .* finite number"),
    ({"optimizer": {"params": {"lr": "abc"}}}, r"bad value 'abc' for 'optimizer.params.lr' .* valid number"),
    ({"optimizer": {"params": {"betas": [1.5, 0.9]}}}, r"'optimizer.params.betas.0' .* less than 1"),
    ({"optimizer": {"params": {"betas": [0.9]}}}, r"missing key 'optimizer.params.betas.1'"),
    ({"scheduler": {"params": {}}}, r"missing key 'scheduler.type' .*; add it"),
    ({"optimizer": {"params": {"eps": -1}}}, r"bad value -1 for 'optimizer.params.eps' .* greater than 0"),
    ({"optimizer": {"params": {"weight_decy": 0.1}}}, r"unknown key 'optimizer.params.weight_decy' .* 'weight_decay'"),
    ({"optimizer": {"type": "Adam", "params": {"max_coeff": 5}}}, r"max_coeff is not a parameter of Adam"),
    (
        {"optimizer": {"type": "Adagrad"}},
        r"'optimizer.type' .* 'Adam', 'AdamW', 'Lamb', 'OneBitAdam', 'ZeroOneAdam' or 'OneBitLamb'",
    ),
    ({"train_batch_size": "8"}, r"'train_batch_size' is the string \"8\" in .*; write it without quotes: 8"),
    ({"train_batch_size": True}, r"'train_batch_size' .* valid integer"),
    ({"train_batch_size": 0}, r"'train_batch_size' .* greater than or equal to 1"),
    ({"gradient_accumulation_steps": 2.5}, r"'gradient_accumulation_steps' .* valid integer"),
    ({"steps_per_print": -1}, r"'steps_per_print' .* greater than or equal to 0"),
    ({"zero_optimization": {"stage": "1"}}, r"'zero_optimization.stage'"),
    (
        {"zero_optimization": {"stage": 1, "overlap_com": True}},
        r"unknown key 'zero_optimization.overlap_com' .* 'overlap_comm'",
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_sise": 8}}},
        r"unknown key 'zero_optimization.offload_param.buffer_sise' .* 'buffer_size'",
    ),
    (
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_pth": "/x"}}},
        r"unknown key 'zero_optimization.offload_optimizer.nvme_pth' .* 'nvme_path'",
    ),
    ({"aio": {"queue_depth": 0}}, r"'aio.queue_depth' .* greater than or equal to 1"),
    ({"aio": {"single_submit": "yes"}}, r"'aio.single_submit' .* valid boolean"),
    ({"scheduler": {"tpye": "WarmupLR"}}, r"unknown key 'scheduler.tpye' .* did you mean 'type'"),
    ({"scheduler": {"type": "WarmupLr"}}, r"unknown scheduler type 'WarmupLr' \(did you mean 'WarmupLR'\?\)"),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
        r"scheduler WarmupLR has no parameter 'warmup_num_step' \(did you mean 'warmup_num_steps'\?\)",
    ),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"scheduler WarmupDecayLR needs total_num_steps"),
    ({"tensorboard": {"enabled": True, "output_pth": "tb"}}, r"unknown key 'tensorboard.output_pth' .* 'output_path'"),
    ('{"fp16": {"enabled": }}', r"cannot read the runtime config .*ds.json: expected a value at line 1 column 22"),
    ("[1, 2]", r"must hold a JSON object"),
]


@pytest.mark.parametrize("config, message", BAD_CONFIGS, ids=[str(i) for i in range(len(BAD_CONFIGS))])
def test_bad_deepspeed_configs_stop_with_one_sentence(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message) as caught:
        runtime(tmp_path, config)
    assert "\n" not in str(caught.value)


def test_good_values_in_deepspeed_spellings_are_accepted(tmp_path):
    config = runtime(
        tmp_path,
        {
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "consecutive_hysteresis": True},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},  # DeepSpeed writes counts as floats
            "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "weight_decay": 0, "adam_w_mode": False}},
            "gradient_clipping": 1,  # an integer where a float is meant
        },
    )
    assert config.zero_optimization.reduce_bucket_size == 500_000_000 and config.gradient_clipping == 1.0
    # the JSON's own keys that no flag sets reach the runtime: the optimizer type and parameters, fp16's others
    assert config.optimizer.type == "Adam" and config.optimizer.params.given()["adam_w_mode"] is False
    assert config.fp16.consecutive_hysteresis and config.fp16.initial_scale_power == 12


def test_json_fills_the_flags_it_sets_so_they_are_not_required(tmp_path):
    argv = " ".join(BASE).replace("--micro-batch-size 2 ", "").replace("--lr 3e-4 ", "").split()
    config = parse_args(
        with_json(tmp_path, {"train_micro_batch_size_per_gpu": 4, "optimizer": {"params": {"lr": 2e-4}}}, argv)
    )
    assert config.training.micro_batch_size == 4 and config.runtime_config(1).optimizer.params.lr == 2e-4
    with pytest.raises(ConfigError, match="--lr is required; give it, or optimizer.params.lr in --deepspeed_config"):
        parse_args(argv + ["--micro-batch-size", "2"])
    with pytest.raises(ConfigError, match="--micro-batch-size is required"):
        parse_args(argv + ["--lr", "1e-3"])


BAD_FLAGS = [
    ("--hidden-szie 64", "unknown flag --hidden-szie; did you mean --hidden-size?"),
    ("--moe-expert-paralel-size 2", "unknown flag --moe-expert-paralel-size; did you mean --moe-expert-parallel-size?"),
    ("--completely-unknown", "unknown flag --completely-unknown; pretrain_gpt.py --help lists every flag"),
    ("--hidden-size abc", "--hidden-size: 'abc' is not a positive integer"),
    ("--hidden-size 0", "--hidden-size: '0' is not a positive integer"),
    ("--hidden-dropout 1.5", r"--hidden-dropout: '1.5' is not a probability in \[0, 1\)"),
    ("--lr nan", "--lr: 'nan' is not a finite number"),
    ("--lr -0.001", "--lr: '-0.001' is not a positive number"),
    ("--adam-beta1 1", r"--adam-beta1: '1' is not a probability in \[0, 1\)"),
    ("--adam-eps 0", "--adam-eps: '0' is not a positive number"),
    ("--clip-grad -1", "--clip-grad: '-1' is not zero or a positive number"),
    ("--weight-decay inf", "--weight-decay: 'inf' is not a finite number"),
    ("--num-experts 4 0", "--num-experts: '0' is not a positive integer"),
    ("--topk 0", "--topk/--moe-router-topk: '0' is not a positive integer"),
    ("--moe-train-capacity-factor -1", "--moe-train-capacity-factor: '-1' is not a positive number"),
    ("--moe-min-capacity -1", "--moe-min-capacity: '-1' is not zero or a positive integer"),
    ("--hysteresis 0", "--hysteresis: '0' is not a positive integer"),
    ("--zero-stage 4", r"--zero-stage: invalid choice: 4 \(choose from 0, 1, 2, 3\)"),
    ("--lr-decay-style cosin", "--lr-decay-style: invalid choice: 'cosin'"),
    ("--seq-length", "--seq-length: expected one argument"),
    ("--initial-loss-scale 1e300 --fp16", r"--initial-loss-scale: '1e300' is not a power of two from 1 to 2\*\*127"),
]


@pytest.mark.parametrize("extra, message", BAD_FLAGS, ids=[flag.split()[0] for flag, _ in BAD_FLAGS])
def test_bad_flags_stop_with_one_sentence_naming_the_flag(extra, message):
    argv = [a for a in BASE if a != "--seq-length" and a != "16"] + ["--seq-length", "16"] + extra.split()
    with pytest.raises(ConfigError, match=message) as caught:
        with_data_parallel_size(parse_args(argv), 1)
    assert "\n" not in str(caught.value)


def test_megatron_override_scheduler_flag_is_accepted():
    parse_args(BASE + ["--override-opt_param-scheduler"])
    parse_args(BASE + ["--override-opt-param-scheduler"])


def test_help_shows_every_default():
    text = " ".join(build_parser().format_help().split())
    for expected in (
        "--weight-decay WEIGHT_DECAY (default: 0.01)",
        "--split SPLIT (default: 969,30,1)",
        "--topk TOPK, --moe-router-topk TOPK experts per token (default: 1)",
        "(default: learned_absolute)",
        "--min-lr MIN_LR (default: 0.0)",
    ):
        assert expected in text


def test_a_bad_flag_under_torchrun_is_one_line_from_rank_0_only(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "pretrain_gpt.py",
        *BASE,
        "--hidden-szie",
        "64",
    ]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    ours = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0
    assert ours == ["error: unknown flag --hidden-szie; did you mean --hidden-size?"]
    assert "usage:" not in result.stderr + result.stdout
