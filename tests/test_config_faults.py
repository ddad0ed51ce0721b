"""Config faults that used to pass config time and misbehave later, each injected and each stopped
with one sentence: a boolean where an integer belongs (`"stage": true` ran as stage 1), a number
or boolean in quotes (read as a contradiction), a TensorBoard folder that is a file (a
NotADirectoryError once training ran), damage to a parameter swap file (reported as optimizer
state), fp16 loss-scale flags outside the range their JSON keys accept, and settings that
contradict each other (refused as the config is read, so --dry-run reports them)."""

import json
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
import torch
from pydantic import BaseModel

from megatron.cli.pretrain_gpt import pretrain_from_flags
from megatron.cli.threads import ThreadChoice
from megatron.config.flags import parse_args, with_data_parallel_size
from megatron.errors import ConfigError
from megatron.runtime.config.schema import RuntimeConfig, validate_runtime_config
from megatron.runtime.swap.slots import SwapError
from tests.test_config_inputs import BASE
from tests.test_offload import BATCH, H, swapping_engine, train

FLAGS = BASE  # a tiny model; the data is never opened at config time


def flags(*extra: str) -> None:
    """Parse and check the flags as a run does before any work."""
    with_data_parallel_size(parse_args(FLAGS + list(extra)), 1).runtime_config(1)


def with_json(tmp_path: Path, config: dict[str, Any]) -> list[str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def kinds(annotation: Any) -> set[Any]:
    """The types a field's annotation admits (Literal members by their type)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return {kind for arg in get_args(annotation) for kind in kinds(arg)}
    if origin is Literal:
        return {type(member) for member in get_args(annotation)}
    return {annotation}


def integer_keys(section: type[BaseModel] = RuntimeConfig, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of the ds_config schema that takes an integer and not a boolean."""
    keys = []
    for name, field in section.model_fields.items():
        admitted = kinds(field.annotation)
        for kind in admitted:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                keys += integer_keys(kind, (*prefix, name))
        if int in admitted and bool not in admitted:
            keys.append((*prefix, name))
    return keys


INTEGER_KEYS = integer_keys()


def test_the_zero_stage_as_a_boolean_is_refused_and_so_is_every_integer_key():
    with pytest.raises(ConfigError) as caught:
        validate_runtime_config({"zero_optimization": {"stage": True}}, "ds.json")
    assert str(caught.value) == (
        "bad value true for 'zero_optimization.stage' in ds.json: a boolean is not a ZeRO stage; write 0, 1, 2 or 3"
    )
    assert ("zero_optimization", "stage") in INTEGER_KEYS and len(INTEGER_KEYS) > 20
    for key in INTEGER_KEYS:  # a boolean, or a float with a fraction, is never taken as an integer
        for value in (True, False, 2.5):
            with pytest.raises(ConfigError, match=re.escape(repr(".".join(key)))):
                validate_runtime_config(nested(key, value), "ds.json")
    # DeepSpeed's configs write counts like 5e8: a float with no fraction is that integer
    assert validate_runtime_config({"zero_optimization": {"stage": 2.0}}).zero_optimization.stage == 2


QUOTED = [
    (
        {"zero_optimization": {"stage": "2"}},
        "'zero_optimization.stage' is the string \"2\" in ds.json; write it without quotes: 2",
    ),
    ({"fp16": {"enabled": "true"}}, "'fp16.enabled' is the string \"true\" in ds.json; write it without quotes: true"),
    (
        {"bf16": {"enabled": "False"}},
        "'bf16.enabled' is the string \"False\" in ds.json; write it without quotes: false",
    ),
    (
        {"zero_optimization": {"reduce_bucket_size": "5e8"}},
        "'zero_optimization.reduce_bucket_size' is the string \"5e8\" in ds.json; write it without quotes: 5e8",
    ),
    (
        {"optimizer": {"params": {"betas": ["0.9", 0.95]}}},
        "'optimizer.params.betas.0' is the string \"0.9\" in ds.json; write it without quotes: 0.9",
    ),
    ({"disable_python_gc": "5"}, "'disable_python_gc' is the string \"5\" in ds.json; write it without quotes: 5"),
    # where the value without quotes is refused too, the sentence says what is accepted
    (
        {"zero_optimization": {"stage": "7"}},
        "bad value '7' for 'zero_optimization.stage' in ds.json: input should be 0, 1, 2 or 3",
    ),
    (
        {"gradient_allreduce_op": "2"},
        "bad value '2' for 'gradient_allreduce_op' in ds.json: input should be 'mean' or 'sum'",
    ),
    (
        {"aio": {"single_submit": "yes"}},
        "bad value 'yes' for 'aio.single_submit' in ds.json: input should be a valid boolean",
    ),
]


@pytest.mark.parametrize("config, sentence", QUOTED, ids=[str(i) for i in range(len(QUOTED))])
def test_a_number_or_boolean_in_quotes_says_to_remove_the_quotes(config, sentence):
    with pytest.raises(ConfigError) as caught:
        validate_runtime_config(config, "ds.json")
    assert str(caught.value) == sentence


def test_a_tensorboard_folder_that_is_a_file_stops_at_config_time(tmp_path):
    file = tmp_path / "tb"
    file.write_text("not a folder")
    with pytest.raises(ConfigError) as caught:
        parse_args(FLAGS + ["--tensorboard-dir", str(file)])
    assert str(caught.value) == (
        f"--tensorboard-dir {file} is a file, not a folder; point it at a folder, or at a path that does not exist yet"
    )
    with pytest.raises(ConfigError) as caught:
        parse_args(FLAGS + ["--tensorboard-dir", str(file / "run1")])
    assert str(caught.value) == (
        f"--tensorboard-dir {file / 'run1'} lies under {file}, which is a file, not a folder; point it at a folder, "
        "or at a path that does not exist yet"
    )
    argv = FLAGS + with_json(tmp_path, {"tensorboard": {"enabled": True, "output_path": str(file)}})
    with pytest.raises(ConfigError) as caught:
        parse_args(argv)
    assert str(caught.value) == (
        f"bad value for 'tensorboard' in {tmp_path / 'ds.json'}: {file} is a file, so the TensorBoard logs cannot go "
        f"to {file / 'DeepSpeedJobName'}; point output_path and job_name at a folder, or at a path that does not exist yet"
    )
    # a folder not made yet, and the block turned off, are fine
    parse_args(FLAGS + ["--tensorboard-dir", str(tmp_path / "new" / "tb")])
    parse_args(FLAGS + with_json(tmp_path, {"tensorboard": {"enabled": False, "output_path": str(file)}}))


def test_damage_to_a_parameter_swap_file_is_reported_as_parameters(tmp_path):
    engine = swapping_engine(tmp_path)  # stage 3, the moments and the whole fp32 master in swap files
    train(engine, 0, 1)
    path = engine.strategy.swapper.folder.path / "params0.swp"
    engine.backward(engine(torch.randn(BATCH, 3, H)).square().mean())
    data = bytearray(path.read_bytes())
    data[next(at for at in range(0, len(data), 4096) if any(data[at : at + 4096])) + 17] ^= 1 << 3
    path.write_bytes(data)  # one bit flips after the gathers, so the optimizer's read finds it
    with pytest.raises(SwapError, match=rf"damaged data for parameter partitions in {re.escape(str(path))}, bytes"):
        engine.step()
    path.unlink()  # the disk loses the file
    with pytest.raises(SwapError, match=rf"^swapping parameter partitions failed \(.*{re.escape(str(path))}"):
        engine.step()


LOSS_SCALE = "from 2**-24 (fp16's smallest positive number) to 2**127 (the largest power of two in fp32)"
BAD_LOSS_SCALES = [
    ("--min-loss-scale 1e-10", f"--min-loss-scale: '1e-10' is not a loss scale {LOSS_SCALE}"),
    ("--loss-scale 1e-30", f"--loss-scale: '1e-30' is not a loss scale {LOSS_SCALE}"),
    ("--loss-scale 1e39", f"--loss-scale: '1e39' is not a loss scale {LOSS_SCALE}"),
    ("--initial-loss-scale 1000", "--initial-loss-scale: '1000' is not a power of two from 1 to 2**127"),
    ("--initial-loss-scale 0.5", "--initial-loss-scale: '0.5' is not a power of two from 1 to 2**127"),
    ("--loss-scale-window 0", "--loss-scale-window: '0' is not a positive integer"),
    ("--hysteresis 0", "--hysteresis: '0' is not a positive integer"),
    (
        "--fp16 --initial-loss-scale 256 --min-loss-scale 1024",
        "--min-loss-scale 1024 is above --initial-loss-scale 256, so the dynamic fp16 loss scale would start below "
        "its minimum; lower --min-loss-scale or raise the other",
    ),
]
# (flag, its JSON key, the flag's value as the JSON writes it, values to try)
MIRRORED = [
    ("--min-loss-scale", "min_loss_scale", float, [1e-10, 2**-25, 2**-24, 1.0, 2.0**127, 2.0**128]),
    ("--loss-scale", "loss_scale", float, [1e-30, 2**-24, 1024.0, 2.0**127, 1e39]),
    ("--initial-loss-scale", "initial_scale_power", lambda v: v.bit_length() - 1, [1, 2, 2**16, 2**127, 2**128]),
    ("--loss-scale-window", "loss_scale_window", int, [0, 1, 1000]),
    ("--hysteresis", "hysteresis", int, [0, 1, 2]),
]


def accepted(check: Any, *args: Any) -> bool:
    try:
        check(*args)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("extra, sentence", BAD_LOSS_SCALES, ids=[extra for extra, _ in BAD_LOSS_SCALES])
def test_loss_scale_flags_out_of_range_stop_with_the_range(extra, sentence):
    with pytest.raises(ConfigError) as caught:
        flags(*extra.split())
    assert str(caught.value) == sentence
    # the JSON key says the same range
    with pytest.raises(ConfigError) as caught:
        validate_runtime_config({"fp16": {"enabled": True, "min_loss_scale": 1e-10}}, "ds.json")
    assert (
        str(caught.value) == f"bad value 1e-10 for 'fp16.min_loss_scale' in ds.json: a loss scale must be {LOSS_SCALE}"
    )


@pytest.mark.parametrize("flag, key, as_json, values", MIRRORED, ids=[flag for flag, *_ in MIRRORED])
def test_loss_scale_flags_accept_what_their_json_keys_accept(flag, key, as_json, values):
    for value in values:
        by_flag = accepted(flags, "--fp16", "--initial-loss-scale", str(2.0**127), flag, repr(value))
        fp16 = {"enabled": True, "initial_scale_power": 127, key: as_json(value)}
        assert by_flag == accepted(validate_runtime_config, {"fp16": fp16}), (flag, value)


# combinations the engine used to refuse only once the data was indexed and the model built, so
# that --dry-run passed them: each a ds_config (or flags) and the start of its sentence
COMBINATIONS = [
    ({"optimizer": {"type": "Lamb"}}, ["--zero-stage", "1"], "optimizer Lamb needs whole tensors"),  # JSON and flag
    ({"optimizer": {"params": {"bias_correction": False}}}, [], "optimizer.params.bias_correction false is"),
    ({"zero_optimization": {"stage": 2}}, ["--pipeline-model-parallel-size", "2"], "ZeRO stage 2 reduces gradients"),
]


@pytest.mark.parametrize("ds, extra, sentence", COMBINATIONS, ids=["lamb_zero", "bias_correction", "pp_tied_zero2"])
def test_a_contradiction_of_settings_is_what_dry_run_reports(tmp_path, capsys, monkeypatch, ds, extra, sentence):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the ranks torchrun would start
    extra = [*extra, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--dry-run"]
    argv = FLAGS + with_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, **ds}) + extra
    threads = ThreadChoice("1", "PASSIVE", chosen_here=False)
    with pytest.raises(ConfigError, match=f"^{re.escape(sentence)}"):
        pretrain_from_flags(argv, threads)
    assert "total parameters" not in capsys.readouterr().out
    # the same run otherwise: the dry run sizes it
    fixed = {"optimizer": {"type": "AdamW"}} if "optimizer" in ds else {"zero_optimization": {"stage": 1}}
    argv = FLAGS + with_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, **fixed}) + extra
    pretrain_from_flags(argv, threads)
    assert "total parameters" in capsys.readouterr().out
