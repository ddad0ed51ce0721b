import pytest

from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.errors import ConfigError
from megatron.training.run_length import run_length

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
]


def parse(extra: str):
    return parse_args(BASE + extra.split())


def test_training_length_in_iterations_samples_or_tokens():
    assert parse("--train-iters 10 --global-batch-size 8").training.train_iters == 10
    assert parse("--train-samples 81 --global-batch-size 8").training.train_iters == 11
    assert parse("--train-tokens 1280 --global-batch-size 8").training.train_iters == 10


@pytest.mark.parametrize(
    "extra, iterations, decay_tokens",
    [
        ("--train-tokens 1290", 11, 11 * 128),  # a partial last iteration counts, and the decay covers it
        ("--train-tokens 1280 --train-iters 6", 6, 6 * 128),  # Megatron-DeepSpeed: whichever stop comes first
        ("--train-tokens 640 --train-samples 200", 5, 5 * 128),
        ("--train-tokens 1280 --train-iters 6 --lr-decay-iters 4", 6, 4 * 128),
    ],
)
def test_train_tokens_is_a_stop_beside_iterations_or_samples(extra, iterations, decay_tokens):
    length = run_length(parse(extra + " --global-batch-size 8"))
    assert (length.train_iters, length.lr_decay_tokens) == (iterations, decay_tokens)


def test_a_training_length_is_required_and_iterations_and_samples_exclude_each_other():
    with pytest.raises(
        ConfigError, match="give the training length with one of --train-iters, --train-samples, --train-tokens"
    ):
        parse("")
    with pytest.raises(ConfigError, match="--train-iters and --train-samples were both given"):
        parse("--train-iters 4 --train-samples 8")


def test_lr_schedule_lengths_convert_to_tokens():
    config = parse("--train-iters 10 --global-batch-size 8 --lr-warmup-iters 2 --lr-decay-samples 40")
    assert config.training.lr_warmup_tokens == 2 * 8 * 16
    assert config.training.lr_decay_tokens == 40 * 16
    assert parse("--train-iters 10 --global-batch-size 8").training.lr_decay_tokens == 10 * 8 * 16


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--train-iters 10 --train-samples 5", "--train-iters and --train-samples were both given"),
        ("", "give the training length"),
        ("--train-iters 10 --bf16 --fp16", "choose one precision"),
        ("--train-iters 10 --max-position-embeddings 8", "exceeds --max-position-embeddings"),
        ("--train-iters 0", "--train-iters: .0. is not a positive integer"),
        ("--train-iters 10 --lr-warmup-iters 1 --lr-warmup-tokens 5", "use only one"),
        ("--train-iters 10 --lr-warmup-iters 10", r"the LR warmup \(320 tokens\) is not shorter than its decay"),
    ],
)
def test_contradictions_stop_with_a_clear_message(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse(extra)


def test_global_batch_must_divide_into_micro_batches_and_ranks():
    config = parse("--train-iters 10 --global-batch-size 6")
    with_data_parallel_size(config, 1)
    with pytest.raises(
        ConfigError, match="--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size 2"
    ):
        with_data_parallel_size(config, 2)


def test_global_batch_defaults_to_micro_batch_times_data_parallel_size():
    config = with_data_parallel_size(parse("--train-samples 64"), 4)
    assert config.training.global_batch_size == 8 and config.training.train_iters == 8


def test_unknown_flag_is_rejected():
    with pytest.raises(ConfigError, match="unknown flag --num-layer; did you mean --num-layers"):
        parse("--train-iters 10 --num-layer 3")


def test_missing_data_is_rejected():
    with pytest.raises(ConfigError, match="no training data"):
        parse_args([a for a in BASE if a not in ("--data-path", "corpus")] + ["--train-iters", "1"])


def test_moe_flags_build_the_layer_plan():
    config = parse("--train-iters 10 --num-layers 4 --num-experts 8 --topk 2 --mlp-type residual")
    assert config.model.experts_per_layer == [1, 8, 1, 8]
    assert config.model.moe.topk == 2 and config.model.moe.use_residual
    pyramid = parse("--train-iters 10 --num-layers 6 --num-experts 4 4 8")
    assert pyramid.model.experts_per_layer == [1, 4, 1, 4, 1, 8]
    assert parse("--train-iters 10 --num-experts 8 --topk 3").model.moe.drop_policy == "probs"
    assert (
        parse("--train-iters 10 --num-experts 8 --topk 3 --moe-token-drop-policy position").model.moe.drop_policy
        == "position"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--num-layers 4 --num-experts 4 4 8", "--num-experts has 3 values but 4 layers .* give one value or 2"),
        ("--num-experts 1 --mlp-type residual", "--mlp-type residual needs MoE layers"),
        ("--num-experts 4 --topk 2 --moe-noisy-gate-policy RSample", "RSample applies to top-1"),
        ("--num-experts 4 --topk 2 --moe-token-drop-policy position", "applies to --topk 3 or more"),
    ],
)
def test_moe_flag_errors(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse("--train-iters 10 " + extra)


def test_expert_parallel_size_must_divide_every_expert_count():
    config = parse(
        "--train-iters 10 --num-layers 4 --num-experts 4 6 --moe-expert-parallel-size 4 --global-batch-size 8"
    )
    with pytest.raises(ConfigError, match="6 experts cannot be split over --moe-expert-parallel-size 4"):
        with_data_parallel_size(config, 4)


def test_unknown_mlp_type_is_rejected():
    with pytest.raises(ConfigError, match="--mlp-type: invalid choice: 'pyramid'"):
        parse("--train-iters 10 --num-experts 4 --mlp-type pyramid")


def test_async_save_needs_a_save_folder():
    assert parse("--train-iters 4 --async-save --save ckpt").checkpoint.async_save
    with pytest.raises(
        ConfigError, match="--async-save writes the checkpoints of --save in the background; add --save"
    ):
        parse("--train-iters 4 --async-save")
