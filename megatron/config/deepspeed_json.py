"""Megatron-DeepSpeed's `--deepspeed --deepspeed_config ds.json`: the JSON and the flags become
one config through one two-way table. A value given both ways must agree; a JSON value fills in a
flag left at its default (so `--lr` and `--micro-batch-size` may come from the JSON alone); the
rest of the JSON (optimizer type and parameters, the scheduler, ZeRO, aio, ...) reaches the
runtime as written, with the flags' values laid over it.
"""

import argparse
import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron.errors import ConfigError
from megatron.runtime.config.config_file import read_config_file
from megatron.runtime.config.schema import validate_runtime_config

JsonPath = tuple[str | int, ...]


@dataclass(frozen=True)
class FlagKey:
    """One value that a flag and a JSON key both set, and how it reads in each."""

    path: JsonPath
    dest: str  # the flag's argparse destination
    to_flag: Callable[[Any], Any] = lambda value: value
    to_json: Callable[[Any], Any] = lambda value: value

    @property
    def key(self) -> str:
        return ".".join(str(part) for part in self.path)

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


FLAG_KEYS: tuple[FlagKey, ...] = (
    FlagKey(("train_batch_size",), "global_batch_size"),
    FlagKey(("train_micro_batch_size_per_gpu",), "micro_batch_size"),
    FlagKey(("gradient_clipping",), "clip_grad"),
    FlagKey(("fp16", "enabled"), "fp16"),
    FlagKey(("bf16", "enabled"), "bf16"),
    # the JSON's 0 means a dynamic scale, as no --loss-scale does
    FlagKey(("fp16", "loss_scale"), "loss_scale", lambda v: v or None, lambda v: v or 0.0),
    FlagKey(("fp16", "initial_scale_power"), "initial_loss_scale", lambda v: 2.0**v, lambda v: round(math.log2(v))),
    FlagKey(("fp16", "loss_scale_window"), "loss_scale_window"),
    FlagKey(("fp16", "hysteresis"), "hysteresis"),
    FlagKey(("fp16", "min_loss_scale"), "min_loss_scale"),
    FlagKey(("optimizer", "params", "lr"), "lr"),
    FlagKey(("optimizer", "params", "weight_decay"), "weight_decay"),
    FlagKey(("optimizer", "params", "betas", 0), "adam_beta1"),
    FlagKey(("optimizer", "params", "betas", 1), "adam_beta2"),
    FlagKey(("optimizer", "params", "eps"), "adam_eps"),
    FlagKey(("zero_optimization", "stage"), "zero_stage"),
)
# Megatron's own LR annealing flags, which a DeepSpeed "scheduler" block replaces
ANNEALING_FLAGS = (
    "lr_decay_style",
    "min_lr",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_tokens",
    "lr_decay_iters",
    "lr_decay_samples",
    "lr_decay_tokens",
)


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags written on the command line (not left at their defaults)."""
    options = parser._option_string_actions
    return {options[token.split("=", 1)[0]].dest for token in argv if token.split("=", 1)[0] in options}


def _lookup(config: dict[str, Any], path: JsonPath) -> Any:
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


def _assign(config: dict[str, Any], path: JsonPath, value: Any) -> None:
    """Set `path` in nested dicts, creating them; a list index fills a two-item list (betas)."""
    node: Any = config
    for part, following in itertools.pairwise(path):
        if not isinstance(node.get(part) if isinstance(node, dict) else None, (dict, list)):
            node[part] = [None, None] if isinstance(following, int) else {}
        node = node[part]
    node[path[-1]] = value


def merge_deepspeed_config(args: argparse.Namespace, explicit: set[str]) -> argparse.Namespace:
    """Fill flags from the JSON; stop with both values named where a flag and the JSON disagree."""
    path = args.deepspeed_config
    config = read_config_file(path)
    validate_runtime_config(config, path)
    merged = vars(args).copy()
    for key in FLAG_KEYS:
        raw = _lookup(config, key.path)
        if raw is None:
            continue
        value = key.to_flag(raw)
        if key.dest in explicit and not _same(merged[key.dest], value):
            raise ConfigError(
                f"{key.flag} {merged[key.dest]} and {key.key} {raw} in {path} disagree; give the value in one place"
            )
        merged[key.dest] = value
    scheduler = config.get("scheduler")
    clashing = sorted(explicit & set(ANNEALING_FLAGS))
    if scheduler is not None and clashing:
        raise ConfigError(
            f"{path} names scheduler {scheduler.get('type')!r} and --{clashing[0].replace('_', '-')} sets Megatron's LR "
            "annealing; use one of them"
        )
    merged["deepspeed_json"] = config
    return argparse.Namespace(**merged)


def runtime_dict(flags: dict[str, Any], deepspeed_json: dict[str, Any] | None) -> dict[str, Any]:
    """The runtime config: the JSON as written (if any) with every flag-set value laid over it."""
    config = copy.deepcopy(deepspeed_json or {})
    for key in FLAG_KEYS:
        if flags.get(key.dest) is not None:
            _assign(config, key.path, key.to_json(flags[key.dest]))
    # the trainer's Megatron log lines already report progress: the engine's own line only on request
    config.setdefault("steps_per_print", 0)
    return config


def flag_for(loc: tuple[str | int, ...]) -> FlagKey | None:
    """The flag behind a runtime-config location, for errors that should name the flag."""
    return next((key for key in FLAG_KEYS if key.path == loc), None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b
