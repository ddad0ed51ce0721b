"""Learning-rate schedules. `AnnealingLR` is Megatron's: linear warmup from 0, then constant,
linear or cosine decay to min_lr. Steps are counted in whatever unit the caller chooses
(iterations, samples or tokens) through `increment`, as Megatron counts samples or tokens.

DeepSpeed's schedules live in `deepspeed_schedules.py`; `build_scheduler` here turns a config's
`"scheduler": {"type", "params"}` into one of them, checking names before anything is built.
"""

import difflib
import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from megatron.errors import ConfigError
from megatron.runtime.deepspeed_schedules import (
    LRRangeTest,
    OneCycle,
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

DECAY_STYLES = ("constant", "linear", "cosine")


class AnnealingLR:
    kind = "AnnealingLR"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
        increment: int = 1,
    ) -> None:
        if decay_style not in DECAY_STYLES:
            raise ConfigError(f"unknown --lr-decay-style {decay_style!r}; use one of {', '.join(DECAY_STYLES)}")
        if decay_style != "constant" and decay_steps <= warmup_steps:
            raise ConfigError(
                f"the LR decays over {decay_steps} steps but warms up over {warmup_steps}; "
                "make the decay length longer than the warmup"
            )
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr {min_lr} must be between 0 and --lr {max_lr}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.increment = increment
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> float:
        steps = self.num_steps
        if self.warmup_steps > 0 and steps <= self.warmup_steps:
            return self.max_lr * steps / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if steps > self.decay_steps:
            return self.min_lr
        ratio = (steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.num_steps += self.increment
        self._apply()

    def resume_at(self, steps_taken: int) -> None:
        """Continue a run that another kind of schedule drove for `steps_taken` optimizer steps."""
        self.num_steps = steps_taken * self.increment
        self._apply()

    @property
    def settings(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "decay_steps": self.decay_steps,
            "decay_style": self.decay_style,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "settings": self.settings, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()


SCHEDULES: dict[str, type[Schedule]] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}


def _nearest(name: str, choices: Sequence[str]) -> str:
    by_lower = {choice.lower(): choice for choice in choices}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.5)
    return f" (did you mean {by_lower[match[0]]!r}?)" if match else ""


def scheduler_parameters(type_name: str, params: dict[str, Any]) -> dict[str, inspect.Parameter]:
    """Check a config's `"scheduler"` names (type and parameters) without building it, so a typo
    stops the run before any work; returns the schedule's parameters."""
    if type_name not in SCHEDULES:
        raise ConfigError(
            f"unknown scheduler type {type_name!r}{_nearest(type_name, list(SCHEDULES))}; "
            f"use one of {', '.join(SCHEDULES)}"
        )
    signature = inspect.signature(SCHEDULES[type_name].__init__).parameters
    allowed = {name: parameter for name, parameter in signature.items() if name not in ("self", "optimizer")}
    unknown = [key for key in params if key not in allowed]
    if unknown:
        hints = "".join(_nearest(key, list(allowed)) for key in unknown)
        raise ConfigError(
            f"scheduler {type_name} has no parameter {', '.join(map(repr, unknown))}{hints}; "
            f"allowed: {', '.join(allowed)}"
        )
    missing = [
        name
        for name, parameter in allowed.items()
        if parameter.default is inspect.Parameter.empty and name not in params
    ]
    if missing:
        raise ConfigError(f"scheduler {type_name} needs {', '.join(missing)} in its params")
    return allowed


def build_scheduler(optimizer: torch.optim.Optimizer, type_name: str, params: dict[str, Any]) -> Schedule:
    """Build the schedule a config's `"scheduler": {"type", "params"}` names; bad input is a ConfigError."""
    allowed = scheduler_parameters(type_name, params)
    schedule = SCHEDULES[type_name](optimizer, **params)
    given = {
        **{name: parameter.default for name, parameter in allowed.items()},
        **params,
    }  # required ones are in params
    schedule.settings = {name: given[name] for name in allowed if name != "last_batch_iteration"}
    return schedule
