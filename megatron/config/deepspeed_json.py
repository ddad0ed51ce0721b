"""Megatron-DeepSpeed's `--deepspeed --deepspeed_config ds.json`: the JSON and the flags become
one config. A value given both ways must agree; a JSON value fills in a flag left at its default.
"""

import argparse
import math
from collections.abc import Callable
from typing import Any

from megatron.errors import ConfigError
from megatron.config.runtime_schema import read_config_file, validate_runtime_config

# (path in the JSON, flag destination, JSON value -> flag value)
KEYS_TO_FLAGS: list[tuple[tuple[str, ...], str, Callable[[Any], Any]]] = [
    (("train_batch_size",), "global_batch_size", int),
    (("train_micro_batch_size_per_gpu",), "micro_batch_size", int),
    (("gradient_clipping",), "clip_grad", float),
    (("fp16", "enabled"), "fp16", bool),
    (("bf16", "enabled"), "bf16", bool),
    (("fp16", "loss_scale"), "loss_scale", lambda v: float(v) or None),  # 0 means dynamic
    (("fp16", "initial_scale_power"), "initial_loss_scale", lambda v: 2.0 ** int(v)),
    (("fp16", "loss_scale_window"), "loss_scale_window", int),
    (("fp16", "hysteresis"), "hysteresis", int),
    (("fp16", "min_loss_scale"), "min_loss_scale", float),
    (("optimizer", "params", "lr"), "lr", float),
    (("optimizer", "params", "weight_decay"), "weight_decay", float),
    (("optimizer", "params", "betas", 0), "adam_beta1", float),
    (("optimizer", "params", "betas", 1), "adam_beta2", float),
    (("optimizer", "params", "eps"), "adam_eps", float),
    (("zero_optimization", "stage"), "zero_stage", int),
]
# blocks that no Megatron flag sets: they reach the runtime config as the JSON gives them
PASSTHROUGH_KEYS = ("zero_optimization", "aio", "tensorboard", "steps_per_print", "wall_clock_breakdown")
# Megatron's own LR annealing flags, which a DeepSpeed "scheduler" block replaces
ANNEALING_FLAGS = ("lr_decay_style", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_tokens",
                   "lr_decay_iters", "lr_decay_samples", "lr_decay_tokens")


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags written on the command line (not left at their defaults)."""
    options = parser._option_string_actions
    return {options[token.split("=", 1)[0]].dest for token in argv if token.split("=", 1)[0] in options}


def _lookup(config: dict[str, Any], path: tuple[str | int, ...]) -> Any:
    value: Any = config
    for part in path:
        if isinstance(part, int):
            if not isinstance(value, (list, tuple)) or len(value) <= part:
                return None
            value = value[part]
        elif not isinstance(value, dict) or part not in value:
            return None
        else:
            value = value[part]
    return value


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def merge_deepspeed_config(args: argparse.Namespace, explicit: set[str]) -> argparse.Namespace:
    """Fill flags from the JSON; stop with both values named where a flag and the JSON disagree."""
    path = args.deepspeed_config
    config = read_config_file(path)
    validate_runtime_config(config, path)
    merged = vars(args).copy()
    for key_path, dest, convert in KEYS_TO_FLAGS:
        raw = _lookup(config, key_path)
        if raw is None:
            continue
        value = convert(raw)
        if dest in explicit and not _same(merged[dest], value):
            key = ".".join(str(part) for part in key_path)
            raise ConfigError(
                f"{_flag(dest)} {merged[dest]} and {key} {raw} in {path} disagree; give the value in one place"
            )
        merged[dest] = value
    scheduler = config.get("scheduler")
    if scheduler is not None:
        clashing = sorted(explicit & set(ANNEALING_FLAGS))
        if clashing:
            raise ConfigError(
                f"{path} names scheduler {scheduler.get('type')!r} and {_flag(clashing[0])} sets Megatron's LR "
                "annealing; use one of them"
            )
        merged["deepspeed_scheduler"] = scheduler
    merged["deepspeed_accumulation"] = config.get("gradient_accumulation_steps")
    merged["deepspeed_passthrough"] = {key: config[key] for key in PASSTHROUGH_KEYS if key in config}
    return argparse.Namespace(**merged)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b
